"""Mixture-of-experts weight folders in and out (``sf.load_hf``, ``sf.save_hf``).

transformers keeps experts as fused 3-D parameters (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]) but ``save_pretrained`` writes, and Hub checkpoints
hold, one 2-D tensor per expert (Mixtral: ``block_sparse_moe.experts.N.w1/w2/w3``;
Qwen2-MoE / Qwen3-MoE: ``mlp.experts.N.gate_proj/up_proj/down_proj``). Checked here:

* a tiny Mixtral, Qwen2-MoE and Qwen3-MoE saved with ``save_pretrained`` load in one
  process with exactly ``from_pretrained``'s logits, and ``save_hf`` writes the keys
  ``save_pretrained`` writes (``from_pretrained`` gives the same logits again);
* at ep2 (2 gloo ranks) and on 4 ranks at tp2 attention × ep2 (also with the experts split
  over tp), FSDP2 dp2 × ep2 and pp2 × ep2: the loss equals Hugging Face's on the same
  batch, and ``save_hf`` round-trips;
* a rank at ep2 reads exactly the elements of its shards: its own experts' tensors, no other;
* dtype as stored or asked; a folder missing an expert is one typed error with nothing
  loaded; a conversion that cannot be read slice by slice, and a model type transformers
  has no conversion for, are typed errors saying so.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist import mesh
from torch import nn
from torch.distributed.tensor import DTensor

import slapo_fn as sf

VOCAB, BATCH, SEQ = 128, 2, 8
TIMEOUT = 150


def _config(family: str) -> Any:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, num_experts_per_tok=2, use_cache=False,
                                  tie_word_embeddings=False)
    if family == "mixtral":
        return MixtralConfig(intermediate_size=128, num_local_experts=4, **common)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                              num_experts=4, **common)
    return Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, head_dim=16, num_experts=4, **common)


def make(family: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(family))


def on_meta(family: str) -> nn.Module:
    with torch.device("meta"):
        return make(family)


def pretrained(family: str, folder: Path) -> nn.Module:
    """Seeded weights moved off their initial values (a re-initialisation cannot pass for
    a load), saved with ``save_pretrained`` (per-expert keys)."""
    model = make(family)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(folder))
    return model.eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g1), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g2)


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return F.cross_entropy(full.flatten(0, 1).float(), target.flatten())


def hf_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return model(batch()[0]).logits


def file_keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


# -- schedules ------------------------------------------------------------------------------------
def _attention_tp(sch: sf.Schedule) -> sf.Schedule:
    return sf.foreach(
        "model.layers.*.self_attn",
        sf.shard.at(["q_proj", "k_proj", "v_proj"], axis=0) >> sf.shard.at("o_proj", axis=1),
    )(sch)


def schedule(family: str, layout: str) -> sf.Schedule:
    """``ep2``: experts over a ("ep",) mesh; ``tp_ep``: attention over tp, experts over ep
    of an (ep, tp) mesh; ``tp_ep_etp``: each expert also split over tp; ``dp_ep``: experts
    over ep and FSDP2 over dp of a (dp, ep) mesh; ``etp2``: attention and each expert
    split over a ("tp",) mesh; ``pp_ep``: two pipeline stages of a
    (pp, ep) mesh, experts over ep in each."""
    model = on_meta(family)
    if layout == "ep2":
        return sf.expert_parallel(sf.create_schedule(model, mesh=mesh((2,), ("ep",))), "model.layers.*.mlp")
    if layout == "etp2":
        sch = sf.create_schedule(model, mesh=mesh((2,), ("tp",)))
        return sf.expert_tensor_parallel(_attention_tp(sch), "model.layers.*.mlp")
    if layout == "dp_ep":
        sch = sf.create_schedule(model, mesh=mesh((2, 2), ("dp", "ep")))
        return sf.data_parallel(sf.expert_parallel(sch, "model.layers.*.mlp"))
    if layout == "pp_ep":
        sch = sf.create_schedule(model, mesh=mesh((2, 2), ("pp", "ep")))
        return sf.cut_pipeline_stage(sf.expert_parallel(sch, "model.layers.*.mlp"), "model.layers.0")
    sch = sf.create_schedule(model, mesh=mesh((2, 2), ("ep", "tp")))
    sch = sf.expert_parallel(_attention_tp(sch), "model.layers.*.mlp", mesh_axis="ep")
    if layout == "tp_ep_etp":
        sch = sf.expert_tensor_parallel(sch, "model.layers.*.mlp", mesh_axis="tp")
    return sch


# -- ranks ----------------------------------------------------------------------------------------
def _load_and_export(rank: int, world: int, family: str, layout: str, folder: str, out: str) -> dict[str, Any]:
    ids, target = batch()
    if layout == "pp_ep":
        pipe = sf.build_pipeline(schedule(family, layout), microbatches=2, schedule="gpipe", loss_fn=ce,
                                 init="empty")
        sf.load_hf(pipe, folder)
        for m in pipe.modules.values():
            m.eval()
        step = pipe.step(ids, target=target)
        loss = None if step is None else float(step)  # the last stage's
        params = dict(pipe.named_parameters())
        sf.save_hf(pipe, out)
    else:
        model = sf.build(schedule(family, layout), init="empty")
        sf.load_hf(model, folder)
        model.eval()
        with torch.no_grad():
            loss = float(ce(model(ids).logits, target))
        params = dict(model.named_parameters())
        sf.save_hf(model, out)
    experts = next(p for n, p in params.items() if n.endswith("experts.gate_up_proj"))
    return {"loss": loss, "local_experts": tuple(experts.to_local().shape)}


class _SliceSpy:
    def __init__(self, key: str, inner: Any, log: list[tuple[str, int]]) -> None:
        self.key, self.inner, self.log = key, inner, log

    def __getitem__(self, index: Any) -> torch.Tensor:
        data = self.inner[index]
        self.log.append((self.key, data.numel()))
        return data

    def get_shape(self) -> Any:
        return self.inner.get_shape()

    def get_dtype(self) -> Any:
        return self.inner.get_dtype()


class _HandleSpy:
    """A ``safe_open`` handle that logs every element read: ``(key, elements)``."""

    def __init__(self, inner: Any, log: list[tuple[str, int]]) -> None:
        self.inner, self.log = inner, log

    def __enter__(self) -> _HandleSpy:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)

    def keys(self) -> Any:
        return self.inner.keys()

    def get_slice(self, key: str) -> _SliceSpy:
        return _SliceSpy(key, self.inner.get_slice(key), self.log)

    def get_tensor(self, key: str) -> torch.Tensor:
        data = self.inner.get_tensor(key)
        self.log.append((key, data.numel()))
        return data


def _reads(rank: int, world: int, family: str, layout: str, folder: str) -> dict[str, Any]:
    """Load in ``layout`` with ``safe_open`` spied on: what this rank read, and how many
    elements its local shards hold."""
    import slapo_fn.weights as weights

    model = sf.build(schedule(family, layout), init="empty")
    log: list[tuple[str, int]] = []
    real = weights.safe_open
    weights.safe_open = lambda *a, **k: _HandleSpy(real(*a, **k), log)  # type: ignore[assignment]
    try:
        sf.load_hf(model, folder)
    finally:
        weights.safe_open = real  # type: ignore[assignment]
    local = {id(t): (t.to_local() if isinstance(t, DTensor) else t).numel() for t in model.state_dict().values()}
    return {"read": log, "local_elements": sum(local.values())}


# -- single process -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_single_process_load_equals_from_pretrained_and_saves_its_keys(family: str, tmp_path: Path) -> None:
    reference = pretrained(family, tmp_path / "hf")
    assert any(".experts.3." in k for k in file_keys(tmp_path / "hf"))  # per-expert keys in the files
    model = sf.load_hf(sf.build(sf.create_schedule(on_meta(family)), init="empty"), tmp_path / "hf").eval()
    for name, p in reference.named_parameters():  # the fused [gate; up] order is transformers' own
        assert torch.equal(model.get_parameter(name), p), name
    want = hf_logits(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(model(batch()[0]).logits, want, rtol=0, atol=0)
    sf.save_hf(model, tmp_path / "out")
    assert file_keys(tmp_path / "out") == file_keys(tmp_path / "hf")  # what save_pretrained writes
    torch.testing.assert_close(hf_logits(tmp_path / "out"), want, rtol=0, atol=0)


def test_dtype_as_stored_or_as_asked(tmp_path: Path) -> None:
    reference = make("mixtral").to(torch.bfloat16)
    reference.save_pretrained(str(tmp_path))
    stored = sf.load_hf(sf.build(sf.create_schedule(on_meta("mixtral")), init="empty"), tmp_path)
    experts = stored.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(experts.gate_up_proj, reference.model.layers[1].mlp.experts.gate_up_proj)
    asked = sf.load_hf(sf.build(sf.create_schedule(on_meta("mixtral")), init="empty"), tmp_path, dtype=torch.float32)
    assert asked.model.layers[1].mlp.experts.down_proj.dtype == torch.float32
    assert torch.equal(asked.model.layers[1].mlp.experts.down_proj,
                       reference.model.layers[1].mlp.experts.down_proj.float())


def test_missing_expert_is_one_error_and_nothing_is_loaded(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    pretrained("mixtral", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.block_sparse_moe.experts.3.w1.weight"]
    del tensors["model.layers.1.block_sparse_moe.experts.2.w2.weight"]
    tensors["model.layers.1.block_sparse_moe.experts.0.w9.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = sf.build(sf.create_schedule(on_meta("mixtral")), init="empty")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.25)
    with pytest.raises(sf.WeightsMismatchError, match=r"3 problems") as info:
        sf.load_hf(model, tmp_path)
    err = info.value
    assert err.unexpected == ("model.layers.1.block_sparse_moe.experts.0.w9.weight",)
    assert err.mismatched == {"model.layers.0.mlp.experts.gate_up_proj": (None, (4, 256, 64)),
                              "model.layers.1.mlp.experts.down_proj": ((3, 64, 128), (4, 64, 128))}
    assert "whose shapes do not fit together" in str(err) and "7 per-expert tensors" in str(err)
    assert all(bool((p == 0.25).all()) for p in model.parameters())


def test_conversion_that_cannot_be_sliced_is_a_typed_error(tmp_path: Path) -> None:
    """A model whose transformers conversion has an operation other than stacking and
    concatenating (here a ``Transpose`` registered for a class of this test only) is
    refused before anything is read, naming the key and the operation."""
    from transformers import MixtralForCausalLM
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    class TransposedExpertsMixtral(MixtralForCausalLM):
        pass

    register_checkpoint_conversion_mapping("TransposedExpertsMixtral", [
        WeightConverter("experts.*.w2.weight", "experts.down_proj",  # a pattern of its own: matched first
                        operations=[MergeModulelist(dim=0), Transpose(dim0=1, dim1=2)]),
    ], overwrite=True)
    pretrained("mixtral", tmp_path)
    with torch.device("meta"):
        meta = TransposedExpertsMixtral(_config("mixtral"))
    model = sf.build(sf.create_schedule(meta), init="empty")
    with pytest.raises(sf.WeightsMismatchError, match=r"cannot be read slice by slice: transformers makes it with "
                                                      r"Transpose") as info:
        sf.load_hf(model, tmp_path)
    assert "model.layers.0.mlp.experts.down_proj" in info.value.missing


def test_model_type_without_conversion_mapping_is_one_error_saying_so(tmp_path: Path) -> None:
    """Per-expert files for a model type transformers has no conversion mapping for (a
    Mixtral under another ``model_type``): the fused parameters are missing, the
    per-expert keys unexpected, and the message says why."""
    pretrained("mixtral", tmp_path)
    config = _config("mixtral")
    config.model_type = "tiny_unmapped_moe"
    with torch.device("meta"):
        meta = type(make("mixtral"))(config)
    model = sf.build(sf.create_schedule(meta), init="empty")
    with pytest.raises(sf.WeightsMismatchError, match="no checkpoint conversion mapping for model type "
                                                      "'tiny_unmapped_moe'") as info:
        sf.load_hf(model, tmp_path)
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"} <= set(
        info.value.missing)
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in info.value.unexpected


# -- multi-process ------------------------------------------------------------------------------
def _check_layout(pool: Any, family: str, layout: str, tmp_path: Path, local: tuple[int, ...]) -> None:
    """Every rank's loss is Hugging Face's; each holds ``local`` (the shape of its
    ``gate_up_proj`` shard); the export loads in ``from_pretrained`` with the same logits."""
    folder, out = tmp_path / "hf", tmp_path / "out"
    reference = pretrained(family, folder)
    ids, target = batch()
    with torch.no_grad():
        want_logits = reference(ids).logits
    want = float(ce(want_logits, target))
    results = pool.run(_load_and_export, family, layout, str(folder), str(out), timeout=TIMEOUT)
    assert any(r["loss"] is not None for r in results)
    for r in results:
        assert r["loss"] is None or abs(r["loss"] - want) < 1e-5, (results, want)
        assert r["local_experts"] == local, results  # the experts really are spread (and split)
    assert file_keys(out) == file_keys(folder)
    torch.testing.assert_close(hf_logits(out), want_logits, rtol=0, atol=1e-6)


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_ep2_load_equals_hugging_face_and_exports(dist2: Any, family: str, tmp_path: Path) -> None:
    width = 2 * _config(family).moe_intermediate_size if family != "mixtral" else 256
    _check_layout(dist2, family, "ep2", tmp_path, local=(2, width, 64))


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["ep2", "etp2"])
def test_a_rank_reads_only_its_experts_and_slices(dist2: Any, layout: str, tmp_path: Path) -> None:
    """Every element a rank reads is one of its shards' (no more, none twice). At ep2 it
    opens only its own experts' tensors (rank r: experts 2r and 2r+1 of 4); at etp2 every
    expert's, and of each matrix only its half (its rows of w1 and of w3, its columns of w2)."""
    pretrained("mixtral", tmp_path)
    results = dist2.run(_reads, "mixtral", layout, str(tmp_path), timeout=TIMEOUT)
    for rank, r in enumerate(results):
        read = r["read"]
        assert sum(n for _, n in read) == r["local_elements"], (rank, r["local_elements"])
        experts = Counter(int(k.split(".experts.")[1].split(".")[0]) for k, _ in read if ".experts." in k)
        assert set(experts) == ({2 * rank, 2 * rank + 1} if layout == "ep2" else {0, 1, 2, 3}), (rank, experts)
        assert all(n == 2 * 3 for n in experts.values())  # 2 layers × w1, w2, w3, each once
        if layout == "etp2":  # each expert matrix: half of its 64 × 128 elements
            assert {n for k, n in read if ".experts." in k} == {64 * 128 // 2}, read


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["tp_ep", "tp_ep_etp", "dp_ep", "pp_ep"])
def test_four_ranks_ep_layouts_load_equals_hugging_face_and_exports(dist_pool: Any, layout: str,
                                                                    tmp_path: Path) -> None:
    """Attention over tp, experts over ep; with ``tp_ep_etp`` each expert's matrices are also
    split over tp (the fused [gate; up] chunk by chunk: each rank reads its slice of w1 and
    of w3); with ``dp_ep`` FSDP2 shards each rank's experts again over dp (every dp rank
    gets the same batch here, so each one's loss is Hugging Face's); with ``pp_ep`` each of
    two pipeline stages holds one layer, its experts over ep."""
    local = {"tp_ep": (2, 256, 64), "tp_ep_etp": (2, 128, 64), "dp_ep": (1, 256, 64), "pp_ep": (2, 256, 64)}[layout]
    _check_layout(dist_pool(4), "mixtral", layout, tmp_path, local=local)
