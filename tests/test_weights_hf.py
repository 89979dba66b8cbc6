"""Hugging Face weight folders in and out of any layout (``sf.load_hf``, ``sf.save_hf``):

* a tiny LLaMA and a tiny GPT-2 (packed ``c_attn``), each saved with ``save_pretrained``,
  built on meta with ``init="empty"`` and loaded at tp2, dp2×tp2 (FSDP2), pp2 and pp2×tp2:
  the first loss equals Hugging Face's own on the same batch;
* exported from each layout, ``from_pretrained`` gives the Hugging Face logits;
* bad folders (missing, unexpected, shape-mismatched keys) are one typed error listing
  them all, the model untouched;
* a rank's peak memory while loading stays below ``from_pretrained`` + ``build``;
* ``build_pipeline(init="full")`` gives every stage the single-device weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist import mesh
from models import tiny_gpt2, tiny_llama, token_ids
from torch import nn

import slapo_fn as sf

BATCH, SEQ = 4, 8
TIMEOUT = 120


def llama() -> nn.Module:
    return tiny_llama(layers=2, tie_word_embeddings=True)


def gpt2() -> nn.Module:
    return tiny_gpt2(layers=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


MAKERS = {"llama": llama, "gpt2": gpt2}


def pretrained(family: str, folder: Path) -> nn.Module:
    """A "pretrained" model: seeded weights moved off their initial values (so a
    re-initialisation cannot pass for a load), saved with ``save_pretrained``."""
    model = MAKERS[family]()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    model.save_pretrained(str(folder))
    return model.eval()


def on_meta(family: str) -> nn.Module:
    with torch.device("meta"):
        return MAKERS[family]()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return token_ids(BATCH, SEQ, seed=1), token_ids(BATCH, SEQ, seed=2)


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    full = logits.full_tensor() if isinstance(logits, torch.distributed.tensor.DTensor) else logits
    return F.cross_entropy(full.flatten(0, 1).float(), target.flatten())


def hf_loss(model: nn.Module) -> float:
    ids, target = batch()
    with torch.no_grad():
        return float(ce(model(ids).logits, target))


def hf_logits(folder: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(token_ids(BATCH, SEQ, seed=1)).logits


def schedule(family: str, layout: str, world: int) -> sf.Schedule:
    """``layout``: tp (tp=world), fsdp (dp2×tp2), pp (pp=world), pptp (pp2×tp2), 3d
    (dp2×pp2×tp2, FSDP2 over tensor-parallel pipeline stages)."""
    model = on_meta(family)
    recipe = sf.recipes.for_model(model)
    if layout == "tp":
        return recipe(sf.create_schedule(model, mesh=mesh((world,), ("tp",))), tp=world)
    if layout == "fsdp":
        return recipe(sf.create_schedule(model, mesh=mesh((2, 2), ("dp", "tp"))), tp=2, dp_mode="fsdp")
    if layout == "pp":
        return recipe(sf.create_schedule(model, mesh=mesh((world,), ("pp",))), stages=world)
    if layout == "3d":
        return recipe(sf.create_schedule(model, mesh=mesh((2, 2, 2), ("dp", "pp", "tp"))), tp=2, stages=2,
                      dp_mode="fsdp")
    return recipe(sf.create_schedule(model, mesh=mesh((2, 2), ("pp", "tp"))), tp=2, stages=2)


# -- ranks ------------------------------------------------------------------------------------
def _load_and_export(rank: int, world: int, family: str, layout: str, folder: str, out: str) -> dict[str, Any]:
    sch = schedule(family, layout, world)
    ids, target = batch()
    if layout in ("pp", "pptp", "3d"):
        pipe = sf.build_pipeline(sch, microbatches=2, schedule="gpipe", loss_fn=ce, init="empty")
        sf.load_hf(pipe, folder)
        for m in pipe.modules.values():
            m.eval()
        loss = float(pipe.step(ids, target=target))
        sf.save_hf(pipe, out)
    else:
        model = sf.build(sch, init="empty")
        sf.load_hf(model, folder)
        model.eval()
        loss = float(ce(model(ids).logits, target))
        sf.save_hf(model, out)
    return {"loss": loss}


def _pipeline_full_init(rank: int, world: int, family: str) -> dict[str, float]:
    model = on_meta(family)
    single = sf.build(sf.create_schedule(model), init="full", seed=5)
    want = dict(single.named_parameters(remove_duplicate=False))
    sch = sf.recipes.for_model(model)(sf.create_schedule(model, mesh=mesh((world,), ("pp",))), stages=world)
    pipe = sf.build_pipeline(sch, microbatches=2, schedule="gpipe", loss_fn=ce, init="full", seed=5)
    return {n: float((p.detach() - want[n]).abs().max()) for m in pipe.modules.values()
            for n, p in m.named_parameters(remove_duplicate=False)}


# -- multi-process: loss equals Hugging Face's, export round-trips -------------------------------
def _check_layout(pool: Any, family: str, layout: str, tmp_path: Path) -> None:
    folder, out = tmp_path / "hf", tmp_path / "out"
    reference = pretrained(family, folder)
    want = hf_loss(reference)
    results = pool.run(_load_and_export, family, layout, str(folder), str(out), timeout=TIMEOUT)
    for r in results:
        assert abs(r["loss"] - want) < 1e-5, (results, want)
    with torch.no_grad():
        reference_logits = reference(token_ids(BATCH, SEQ, seed=1)).logits
    torch.testing.assert_close(hf_logits(str(out)), reference_logits, rtol=0, atol=1e-6)


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_two_ranks_load_equals_hugging_face_and_exports(dist2: Any, family: str, layout: str, tmp_path: Path) -> None:
    _check_layout(dist2, family, layout, tmp_path)


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "layout"), [("llama", "fsdp"), ("gpt2", "fsdp"), ("gpt2", "pptp")])
def test_four_ranks_load_equals_hugging_face_and_exports(dist_pool: Any, family: str, layout: str,
                                                         tmp_path: Path) -> None:
    """FSDP2 over tensor parallelism (``_StridedShard`` over dp, and over the packed
    ``c_attn`` of GPT-2), and a pipeline of tensor-parallel stages.

    The pipeline case runs on a fresh pool: late in the full suite, on the session's
    4-rank pool after ~900 other tests, it hung in CI (all ranks, 120 s) though it passes
    in 16 s on a fresh pool; not yet understood (see the closing note)."""
    if layout == "pptp":
        dist_pool(4).close()  # the fixture starts a fresh pool for the next call
    _check_layout(dist_pool(4), family, layout, tmp_path)


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pipeline_full_init_equals_single_device(dist2: Any, family: str) -> None:
    results = dist2.run(_pipeline_full_init, family, timeout=TIMEOUT)
    seen = {n for r in results for n in r}
    assert {"lm_head.weight", "model.layers.1.mlp.up_proj.weight", "transformer.h.1.attn.c_attn.weight"} & seen
    assert all(v == 0.0 for r in results for v in r.values()), results


# -- single process ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_single_process_load_and_export(family: str, tmp_path: Path) -> None:
    reference = pretrained(family, tmp_path / "hf")
    model = sf.load_hf(sf.build(sf.create_schedule(on_meta(family)), init="empty"), tmp_path / "hf")
    model.eval()
    assert abs(hf_loss(model) - hf_loss(reference)) < 1e-6
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head is embed  # the tie is kept
    sf.save_hf(model, tmp_path / "out")
    assert "lm_head.weight" not in json.dumps(_keys(tmp_path / "out"))  # saved once, as save_pretrained does
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(str(tmp_path / "out")), reference(batch()[0]).logits, rtol=0, atol=0)


def _keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def test_rotary_buffer_recomputed_and_sharded_index(tmp_path: Path) -> None:
    """A folder of several files (``model.safetensors.index.json``) loads; the rotary
    ``inv_freq`` (in no file) is recomputed, not left as uninitialised memory."""
    reference = pretrained("llama", tmp_path / "one")
    reference.save_pretrained(str(tmp_path / "many"), max_shard_size="20KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").is_file()
    model = sf.build(sf.create_schedule(on_meta("llama")), init="empty")
    model.model.rotary_emb.inv_freq.fill_(float("nan"))
    sf.load_hf(model, tmp_path / "many")
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert abs(hf_loss(model.eval()) - hf_loss(reference)) < 1e-6


def test_dtype_as_stored_or_as_asked(tmp_path: Path) -> None:
    model16 = llama().to(torch.bfloat16)
    model16.save_pretrained(str(tmp_path / "bf16"))
    stored = sf.load_hf(sf.build(sf.create_schedule(on_meta("llama")), init="empty"), tmp_path / "bf16")
    assert stored.lm_head.weight.dtype == torch.bfloat16
    assert stored.model.rotary_emb.inv_freq.dtype == torch.float32  # as Hugging Face keeps it
    assert torch.equal(stored.model.layers[0].mlp.up_proj.weight, model16.model.layers[0].mlp.up_proj.weight)
    asked = sf.load_hf(sf.build(sf.create_schedule(on_meta("llama")), init="empty"), tmp_path / "bf16",
                       dtype=torch.float32)
    assert asked.lm_head.weight.dtype == torch.float32
    assert torch.equal(asked.lm_head.weight, model16.lm_head.weight.float())


def test_bad_folder_is_one_error_listing_everything(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    pretrained("llama", tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    del tensors["model.norm.weight"]
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    model = sf.build(sf.create_schedule(on_meta("llama")), init="empty")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.25)
    with pytest.raises(sf.WeightsMismatchError, match=r"4 problems") as info:
        sf.load_hf(model, tmp_path / "hf")
    err = info.value
    assert isinstance(err, sf.ScheduleError)
    assert set(err.missing) == {"model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    assert err.unexpected == ("model.layers.9.extra.weight",)
    assert err.mismatched == {"model.layers.1.mlp.down_proj.weight": ((3, 3), (64, 128))}
    assert "not in the weight files" in str(err) and "has shape [3, 3]" in str(err)
    assert all(bool((p == 0.25).all()) for p in model.parameters())  # nothing was read into the model


def test_not_a_folder_and_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(sf.ScheduleError, match="holds no \\*.safetensors file"):
        sf.load_hf(nn.Linear(2, 2), tmp_path)
    with pytest.raises(sf.ScheduleTypeError, match="expected a built model"):
        sf.load_hf("model", tmp_path)
    with pytest.raises(sf.ScheduleError, match="has no Hugging Face config"):
        sf.save_hf(nn.Linear(2, 2), tmp_path / "out")


# -- memory ----------------------------------------------------------------------------------------
_MEMORY = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import slapo_fn as sf
    from transformers import LlamaConfig, LlamaForCausalLM
    from torch.distributed.device_mesh import init_device_mesh
    how, folder = sys.argv[1], sys.argv[2]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)  # rank 0 of tp=2, no data moves
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    cfg = LlamaConfig.from_pretrained(folder)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    recipe = sf.recipes.for_model(meta)
    def status(key):  # kB, from the kernel's own accounting of this process
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to now: earlier peaks (imports) must not hide the load's
    start = status("VmRSS")
    if how == "load_hf":
        model = sf.load_hf(sf.build(recipe(sf.create_schedule(meta, mesh=mesh), tp=2), init="empty"), folder)
    else:
        full = LlamaForCausalLM.from_pretrained(folder)
        model = sf.build(recipe(sf.create_schedule(full, mesh=mesh), tp=2))
    peak = status("VmHWM")
    print(json.dumps({"peak_kib": peak - start}))
    """
)


def _peak_kib(how: str, folder: Path) -> int:
    out = subprocess.run([sys.executable, "-c", _MEMORY, how, str(folder)], capture_output=True, text=True,
                         timeout=TIMEOUT, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_kib"])


@pytest.mark.timeout(240)
def test_peak_memory_while_loading_is_below_from_pretrained_plus_build(tmp_path: Path) -> None:
    """Rank 0 of tp=2 (a fake process group: loading moves no data between ranks), each
    way in a fresh process, a LLaMA of ~84 MB: the peak RSS growth while loading into
    shards is below that of ``from_pretrained`` + ``build``: measured 78 MB to 171–192 MB
    (0.41–0.46×). Holding the files' memory maps over the whole load, as load_hf once did,
    gave 134 MB (0.70–0.78×, and over 0.8× once in CI); the bound catches that."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    ours, theirs = _peak_kib("load_hf", tmp_path), _peak_kib("from_pretrained", tmp_path)
    assert ours < 0.65 * theirs, (ours, theirs)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eight_ranks_3d_load_equals_hugging_face_and_exports(dist_pool: Any, family: str, tmp_path: Path) -> None:
    """dp2×pp2×tp2: each rank reads its stage's tensor-parallel slices, FSDP2-sharded again
    over dp (GPT-2's packed ``c_attn`` included); every data-parallel replica gets the same
    batch here, so each one's loss is Hugging Face's, and the export round-trips."""
    _check_layout(dist_pool(8), family, "3d", tmp_path)
