"""``context_parallel``: the sequence over a ``cp`` axis, K/V all-gathered (Llama 3).

Every rank takes the global batch; the loss must be the single process's on every rank
and every parameter gradient equal to the single process's after ``backward()``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from dist import mesh
from models import VOCAB, tiny_gpt2, token_ids
from torch import nn
from torch.distributed.tensor import DTensor
from tp_checks import CountCollectives, full

import slapo_fn as sf

ATOL = 2e-5


def tiny_decoder(family: str, layers: int = 2, **overrides: object) -> nn.Module:
    """A tiny LLaMA / Qwen2 / Mistral causal LM (random weights, GQA: 4 heads over 2)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    torch.manual_seed(0)
    options: dict[str, object] = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "use_cache": False,
                                  "num_hidden_layers": layers}
    return model_cls(config_cls(**{**options, **overrides}))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _parity(rank: int, world: int, family: str, shape: tuple[int, ...], names: tuple[str, ...], seq: int,
            load_balance: bool = True, overrides: dict[str, object] | None = None,
            then: Callable[[sf.Schedule], sf.Schedule] | None = None) -> dict[str, Any]:
    model = tiny_decoder(family, **(overrides or {}))
    ids = token_ids(batch=2, seq=seq, seed=1)
    ref = model(ids, labels=ids)
    ref.loss.backward()
    expected = _grads(model)
    model.zero_grad()
    sch = sf.create_schedule(model, mesh=mesh(shape, names))
    sch = sf.context_parallel(sch, load_balance=load_balance)
    if then is not None:
        sch = then(sch)
    built = sf.build(sch)
    with CountCollectives() as seen:
        out = built(ids, labels=ids)
        forward = dict(seen.seen)
        out.loss.backward()
    got = _grads(built)
    worst = max((got[n] - g).abs().max().item() for n, g in expected.items())
    sharded = sum(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in built.parameters())
    return {"loss": abs(out.loss.item() - ref.loss.item()), "grad": worst, "names": sorted(got) == sorted(expected),
            "forward": forward, "all": dict(seen.seen), "sharded": sharded,
            "untouched": all(p.grad is None for p in model.parameters())}


def _check(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["loss"] < ATOL and r["grad"] < ATOL and r["names"] and r["untouched"], r


@pytest.mark.timeout(150)
def test_llama_cp2_loss_and_every_gradient_equal_the_single_process(dist2) -> None:
    """Load-balanced chunks (0, 3) and (1, 2) of 128 tokens; GQA; 2 layers. Per layer the
    forward all-gathers K and V (2), the backward reduce-scatters their gradients (2) and
    all-gathers nothing; the loss is all-reduced once and each parameter's gradient once."""
    results = dist2.run(_parity, "llama", (2,), ("cp",), 128, timeout=120)
    _check(results)
    layers, params = 2, len(list(tiny_decoder("llama").parameters()))
    for r in results:
        assert r["forward"] == {"all_gather": 2 * layers, "all_reduce": 1}, r
        assert r["all"] == {"all_gather": 2 * layers, "reduce_scatter": 2 * layers, "all_reduce": 1 + params}, r


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "overrides", "load_balance"), [
    ("qwen2", {}, True),
    ("qwen2", {}, False),
    # a window shorter than the sequence: the mask of the global positions holds it
    ("mistral", {"sliding_window": 48}, True),
    ("llama", {"num_key_value_heads": 4}, True),
])
def test_cp4_loss_and_every_gradient_equal_the_single_process(dist4, family: str, overrides: dict[str, object],
                                                              load_balance: bool) -> None:
    results = dist4.run(_parity, family, (4,), ("cp",), 128, load_balance, overrides, timeout=240)
    _check(results)
    for r in results:
        assert r["forward"] == {"all_gather": 4, "all_reduce": 1}, r


# -- refusals and purity: one process, a fake mesh (nothing is communicated) ----------------


def _cp_mesh(size: int = 2) -> Any:
    from slapo_fn.dtensor.testing import fake_mesh

    return fake_mesh(size, names=("cp",))


def _cp_schedule(model: nn.Module, where: str | None = None, **options: Any) -> sf.Schedule:
    return sf.context_parallel(sf.create_schedule(model, mesh=_cp_mesh()), where, **options)


def test_context_parallel_is_pure_and_annotates_each_attention() -> None:
    from fingerprint import fingerprint, same

    model = tiny_decoder("llama")
    before = fingerprint(model)
    sch = sf.create_schedule(model, mesh=_cp_mesh())
    cp = sf.context_parallel(sch)
    assert same(before, fingerprint(model)) and not sch.annotations
    assert sorted(cp.annotations) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    built = sf.build(cp)
    assert type(built.model.layers[0].self_attn).__name__ == "ContextParallelAttention"
    assert list(built.state_dict()) == list(model.state_dict())
    assert same(before, fingerprint(model))


def test_attention_that_makes_its_own_positions_is_refused_by_path() -> None:
    """GPT-2 adds learned positions before its blocks and its attention takes none; BLOOM's
    attention adds ALiBi biases of the positions it sees: both would use the chunk's."""
    from transformers import BloomConfig, BloomForCausalLM

    from slapo_fn.errors import LayoutError

    with pytest.raises(LayoutError) as e:
        _cp_schedule(tiny_gpt2(), "transformer.h.*.attn")
    assert e.value.paths[:2] == ("transformer.h.0.attn", "transformer.h.1.attn")
    assert "does not receive its positions" in str(e.value) and "fix:" in str(e.value)
    bloom = BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4))
    with pytest.raises(LayoutError, match="ALiBi") as e:
        _cp_schedule(bloom, "transformer.h.*.self_attention")
    assert e.value.paths[0] == "transformer.h.0.self_attention"


@pytest.mark.parametrize(("options", "says"), [
    ({"mesh_axis": "sp"}, "mesh axis 'sp' is not in the mesh"),
    # PyTorch's CPU SDPA has no ring strategy: the ring is CUDA's
    ({"impl": "ring"}, r"(?s)impl='ring' runs PyTorch's ring attention.*cpu SDPA has no ring strategy.*"
                       r"fix: impl=\"allgather\""),
    ({"impl": "ring", "load_balance": False}, "load_balance=False is not its layout"),
    ({"impl": "rings"}, "unknown impl 'rings'"),
])
def test_bad_options_are_refused_at_schedule_time(options: dict[str, Any], says: str) -> None:
    from slapo_fn.errors import LayoutError

    with pytest.raises(LayoutError, match=says):
        _cp_schedule(tiny_decoder("llama", layers=1), **options)
    with pytest.raises(LayoutError, match="not one of the modules this kernel replaces"):  # a layer, not attention
        _cp_schedule(tiny_decoder("llama", layers=1), "model.layers.*")


def test_ring_on_cuda_takes_plain_causal_attention_and_refuses_windows_and_dropout() -> None:
    """What PyTorch's ring attention cannot run, named by path on a CUDA mesh (the device is
    read off the mesh: this machine needs no GPU to check it)."""
    from slapo_fn.dtensor.context_ring import ring_problems
    from slapo_fn.kernels import RotaryAttention

    def kernel(family: str, **overrides: object) -> RotaryAttention:
        attn = tiny_decoder(family, layers=1, **overrides).model.layers[0].self_attn
        return RotaryAttention.from_hf(attn, "model.layers.0.self_attn")

    assert ring_problems("a", kernel("llama"), "cuda", load_balance=True) == []
    reasons = [p.reason for p in ring_problems("a", kernel("mistral", sliding_window=48, attention_dropout=0.1),
                                               "cuda", load_balance=True)]
    assert len(reasons) == 2 and "sliding window of 48" in reasons[0] and "dropout 0.1" in reasons[1], reasons


def test_a_second_call_with_other_options_is_refused() -> None:
    from slapo_fn.errors import LayoutError

    sch = _cp_schedule(tiny_decoder("llama"), "model.layers.0.self_attn")
    with pytest.raises(LayoutError, match="already splits the sequence"):
        sf.context_parallel(sch, "model.layers.1.self_attn", load_balance=False)
    assert sorted(sf.context_parallel(sch, "model.layers.1.self_attn").annotations) == [
        "model.layers.0.self_attn", "model.layers.1.self_attn"]


@pytest.mark.parametrize(("seq", "kwargs", "options", "says"), [
    (6, {}, {}, "cannot be cut into 4 equal chunks over cp=2"),
    (8, {"attention_mask": torch.tensor([[0] * 2 + [1] * 6] * 2)}, {}, "a padding attention_mask"),
    (4, {"labels": token_ids(2, 4)}, {"inputs_split": True}, "labels arrive cut into chunks"),
    (3, {}, {"inputs_split": True}, "3 tokens per rank"),
])
def test_inputs_that_cannot_be_split_are_refused_before_model_code_runs(seq: int, kwargs: dict[str, Any],
                                                                        options: dict[str, Any], says: str) -> None:
    from slapo_fn.errors import LayoutError

    built = sf.build(_cp_schedule(tiny_decoder("llama", layers=1), **options))
    ran: list[str] = []
    built.model.embed_tokens.register_forward_pre_hook(lambda *_: ran.append("embed"))
    with pytest.raises(LayoutError, match=says):
        built(token_ids(2, seq), **kwargs)
    assert not ran


def _megatron(sch: sf.Schedule) -> sf.Schedule:
    from models import megatron_llama

    return megatron_llama(sch)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp2_tp2_loss_and_every_gradient_equal_the_single_process(dist4) -> None:
    """Mesh ("cp", "tp"): heads over tp (Megatron attention and MLP), tokens over cp. K/V
    are all-gathered over cp on each rank's heads."""
    results = dist4.run(_parity, "llama", (2, 2), ("cp", "tp"), 128, True, None, _megatron, timeout=240)
    _check(results)
    for r in results:
        # 2 layers x (q, k, v, gate, up, o, down): 14 parameters split over tp
        assert r["sharded"] == 14 and r["forward"]["all_gather"] == 4, r


def _checkpointed(sch: sf.Schedule) -> sf.Schedule:
    return sf.checkpoint(sch, "model.layers.*")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_cp2_with_activation_checkpointing_recomputes_the_all_gathers(dist2) -> None:
    """Checkpointed layers recompute their forward in backward, all-gathers included: per
    layer 2 all-gathers forward, 2 all-gathers and 2 reduce-scatters backward."""
    results = dist2.run(_parity, "llama", (2,), ("cp",), 128, True, None, _checkpointed, timeout=150)
    _check(results)
    for r in results:
        assert r["forward"]["all_gather"] == 4 and r["all"]["all_gather"] == 8 and r["all"]["reduce_scatter"] == 4, r


def test_explain_lists_the_cp_collectives_with_bytes_and_divides_activations() -> None:
    """Per attention: K and V all-gathered forward (the gathered tensor's bytes: batch x seq x
    kv heads x head dim, fp32), their gradients reduce-scattered backward; the loss and each
    parameter's gradient all-reduced; activations per rank halved at cp2."""
    model = tiny_decoder("llama")
    ids = token_ids(2, 64)
    plain = sf.explain(sf.create_schedule(model, mesh=_cp_mesh()), ids, kwargs={"labels": ids})
    ex = sf.explain(_cp_schedule(model), ids, kwargs={"labels": ids})
    gathered = 2 * 64 * 2 * 16 * 4  # batch, seq, kv heads, head dim, fp32
    params = len({id(p) for p in model.parameters()})
    assert ex.by_axis()["cp"] == {"all_gather": {"count": 4, "bytes": 4 * gathered},
                                  "reduce_scatter": {"count": 4, "bytes": 4 * gathered},
                                  "all_reduce": {"count": 1 + params,
                                                 "bytes": 4 + sum(p.numel() * 4 for p in model.parameters())}}
    before, after = plain.memory.rows[0].activation_bytes, ex.memory.rows[0].activation_bytes
    assert before is not None and after is not None
    # each rank's tokens: half of every activation, but each attention holds the keys and values
    # it gathered at full length (2 x gathered bytes), where the rank's share (half) was counted
    assert after == pytest.approx(before / 2 + 2 * 2 * gathered * (1 - 1 / 2), abs=4), (before, after)


def test_explain_counts_the_gradients_of_the_gathered_keys_and_values_in_backward() -> None:
    """A loss transient smaller than one attention's gathered K/V gradients (a tiny vocabulary):
    the peak is what is saved plus those gradients, at full length."""
    from slapo_fn.dtensor.explain import activation_shapes
    from slapo_fn.memory import activation_memory

    model = tiny_decoder("llama", vocab_size=8)
    ids = token_ids(2, 64) % 8
    sch = _cp_schedule(model)
    row = activation_memory(sch, activation_shapes(sch.module, (ids,), {"labels": ids})).rows[0]
    gathered = 2 * 2 * 64 * 2 * 16 * 4  # K and V: batch, seq, kv heads, head dim, fp32
    assert row.gathered_grad_bytes == gathered > row.loss_bytes, row
    assert row.peak_bytes == row.saved_bytes + gathered, row


def _shape_into(seen: list[tuple[int, ...]], _: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    seen.append(tuple(args[0].shape))


def _split_inputs(rank: int, world: int) -> dict[str, Any]:
    """``inputs_split=True``: the loader's collation (``ContextSplit.collate``) hands each
    rank its chunks, the labels shifted before the cut and the global positions; the built
    model (which sees only them) gives the single process's loss and gradients, and so does
    the training loop's loss on its logits, as on the model that cuts its own chunks."""
    from slapo_fn.dtensor.context_runtime import context_split
    from slapo_fn.train import _inputs, _loss_sum, _targets

    model = tiny_decoder("llama")
    ids = token_ids(batch=2, seq=64, seed=2)
    labels = ids.clone()
    labels[1, 20:40] = -100  # tokens without a loss, across a chunk boundary of both ranks
    ref = model(ids, labels=labels)
    ref.loss.backward()
    expected = _grads(model)
    model.zero_grad()
    results: dict[str, Any] = {"untouched": True}
    for split in (False, True):
        built = sf.build(sf.context_parallel(sf.create_schedule(model, mesh=mesh((world,), ("cp",))),
                                             inputs_split=split))
        seen: list[tuple[int, ...]] = []
        built.model.embed_tokens.register_forward_pre_hook(functools.partial(_shape_into, seen))
        cut = context_split(built)
        assert cut is not None
        batch = cut.collate({"input_ids": ids, "labels": labels})
        out = built(**batch)  # the model's own loss (of shift_labels where the batch was cut)
        out.loss.backward()
        got = _grads(built)
        built.zero_grad()
        # the training loop's: its token sum over the global count, summed over cp
        inputs, kwargs = _inputs(batch)
        total = _loss_sum(built, built(inputs, **kwargs), batch)
        count = cut.total(_targets(batch)) if split else _targets(batch)
        (total / count).backward()
        loop = _grads(built)
        results[f"split={split}"] = {"loss": abs(out.loss.item() - ref.loss.item()),
                                     "loop": abs(cut.total(float(total)) / count - ref.loss.item()),
                                     "grad": max((got[n] - g).abs().max().item() for n, g in expected.items()),
                                     "loop_grad": max((loop[n] - g).abs().max().item() for n, g in expected.items()),
                                     "embedded": seen, "keys": sorted(batch)}
    return results


def test_inputs_split_by_the_loader_give_the_single_process_loss_and_gradients(dist2) -> None:
    for r in dist2.run(_split_inputs, timeout=100):
        for split in (False, True):
            got = r[f"split={split}"]
            assert all(got[k] < ATOL for k in ("loss", "loop", "grad", "loop_grad")), got
        assert r["split=True"]["embedded"] == [(2, 32)] * 2, r  # the model never sees the global batch
        assert r["split=True"]["keys"] == ["input_ids", "position_ids", "shift_labels"], r
        assert r["split=False"]["keys"] == ["input_ids", "labels"], r


def _fsdp_parity(rank: int, world: int, shape: tuple[int, int], seq: int) -> dict[str, Any]:
    """FSDP2 over dp x cp (torchtitan's dp_shard_cp): each dp rank takes its rows of the
    batch, each cp rank its tokens; the loss of each dp group is its rows' mean, the
    gradients (reduce-scattered over dp x cp: summed over cp, averaged over dp) those of
    the single process on the whole batch; every parameter is sharded over all ranks."""
    from torch.distributed.fsdp import FSDPModule

    model = tiny_decoder("llama")
    ids = token_ids(batch=2, seq=seq, seed=3)
    ref = model(ids, labels=ids)
    ref.loss.backward()
    expected = _grads(model)
    model.zero_grad()
    dp = shape[0]
    mine = ids.chunk(dp)[rank // shape[1]]
    row = model(mine, labels=mine).loss.item()
    sch = sf.context_parallel(sf.create_schedule(model, mesh=mesh(shape, ("dp", "cp"))))
    built = sf.build(sf.data_parallel(sch))
    out = built(mine, labels=mine)
    out.loss.backward()
    got = _grads(built)
    local = [p.to_local().numel() for p in built.parameters()]
    worst = max((got[n] - g).abs().max().item() for n, g in expected.items())
    return {"loss": abs(out.loss.item() - row), "grad": worst,
            "names": sorted(got) == sorted(expected), "untouched": True,
            "sharded": sum(local) * world >= sum(p.numel() for p in model.parameters()) > sum(local) * (world - 1),
            "fsdp": isinstance(built, FSDPModule)}


def test_fsdp_over_cp_equals_the_single_process(dist2) -> None:
    """dp1 x cp2: FSDP2 shards the parameters over the cp ranks and sums their gradients."""
    for r in dist2.run(_fsdp_parity, (1, 2), 64, timeout=100):
        _check([r])
        assert r["sharded"] and r["fsdp"], r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_over_dp2_cp2_equals_the_single_process(dist4) -> None:
    for r in dist4.run(_fsdp_parity, (2, 2), 64, timeout=240):
        _check([r])
        assert r["sharded"] and r["fsdp"], r


def _pipeline_parity(rank: int, world: int) -> dict[str, Any]:
    """pp2 x cp2: two stages of one layer each, each stage's attention over the cp ranks
    of its pp rank; each rank is handed its chunks (ids, global positions, targets shifted
    before the cut) and the microbatch loss is the global token mean: the loss and the
    stage's gradients equal the single process's (the mean of its microbatch means)."""
    from slapo_fn.dtensor.context import split_batch
    from slapo_fn.train import next_token_loss

    model = tiny_decoder("llama")
    ids = token_ids(batch=4, seq=64, seed=4)
    labels = ids.clone()
    labels[0, 10:40] = -100  # the first microbatch: fewer counted tokens, unevenly over the chunks
    ref = torch.stack([model(i, labels=t).loss for i, t in zip(ids.chunk(2), labels.chunk(2), strict=True)]).mean()
    ref.backward()
    expected = _grads(model)
    model.zero_grad()
    sch = sf.context_parallel(sf.create_schedule(model, mesh=mesh((2, 2), ("pp", "cp"))), inputs_split=True)
    pipe = sf.build_pipeline(sf.cut_pipeline_stage(sch, "model.layers.0"), microbatches=2, schedule="gpipe",
                             loss_fn=next_token_loss)
    mine = split_batch({"input_ids": ids, "labels": labels}, rank % 2, 2, True)
    loss = pipe.step(mine["input_ids"], target=mine["shift_labels"], position_ids=mine["position_ids"])
    got = {n: full(p.grad) for n, p in pipe.named_parameters() if p.grad is not None}
    return {"loss": abs(loss.item() - ref.item()), "grad": max((got[n] - expected[n]).abs().max().item() for n in got),
            "names": bool(got) and set(got) <= set(expected), "untouched": True, "params": sorted(got)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pp2_cp2_pipeline_stages_equal_the_single_process(dist4) -> None:
    results = dist4.run(_pipeline_parity, timeout=240)
    _check(results)
    stages = [set(r["params"]) for r in results]
    assert stages[0] == stages[1] and stages[2] == stages[3] and not stages[0] & stages[2], stages
    assert stages[0] | stages[2] == set(_grads_names()), stages


def _grads_names() -> list[str]:
    return [n for n, _ in tiny_decoder("llama").named_parameters()]


def test_layouts_it_does_not_compose_with_yet_are_refused_at_build() -> None:
    from slapo_fn.dtensor.testing import fake_mesh
    from slapo_fn.errors import LayoutError, ScheduleError

    sch = sf.context_parallel(sf.create_schedule(tiny_decoder("llama"), mesh=fake_mesh(2, 2, names=("pp", "cp"))))
    with pytest.raises(LayoutError, match="composes with data_parallel mode 'fsdp'.*not 'ddp'"):
        sf.build(sf.data_parallel(sch, mode="ddp", mesh_axis="pp"))
    with pytest.raises(LayoutError, match="does not compose with sequence_parallel yet"):
        sf.build(sf.sequence_parallel(sch, ["model.layers.*"], mesh_axis="pp"))
    with pytest.raises(ScheduleError, match="(?s)is context-parallel on the global batch.*inputs_split=True") as e:
        sf.build_pipeline(sf.cut_pipeline_stage(sch, "model.layers.0"), microbatches=2, loss_fn=lambda o, t: o)
    assert e.value.paths[-1] == "model.layers.0.self_attn"


class _Rows:
    """A few fixed batches with held-out ones: what :func:`slapo_fn.train.train` reads."""

    vocab = VOCAB

    def batch(self, step: int, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> dict[str, torch.Tensor]:
        ids = token_ids(batch_size, 32, seed=10 + step)
        labels = ids.clone()
        labels[0, :5] = -100  # tokens without a loss count in neither the sum nor the mean
        return {"input_ids": ids, "labels": labels}

    def eval_batches(self, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> Any:
        return iter([{"input_ids": token_ids(batch_size, 32, seed=99), "labels": token_ids(batch_size, 32, seed=99)}])


def _train_loop(rank: int, world: int) -> list[tuple[float, float | None, float]]:
    """The training loop (its own loss on logits, AdamW, clipping, an eval) on the cp2 model
    against the single process: the same losses, eval losses and grad norms (relative differences)."""
    from slapo_fn.train import adamw, train

    runs = []
    for cp, split in ((False, False), (True, False), (True, True)):  # one process; the model cuts; the loop cuts
        model = tiny_decoder("llama")
        if cp:
            model = sf.build(sf.context_parallel(sf.create_schedule(model, mesh=mesh((world,), ("cp",))),
                                                 inputs_split=split))
        records = train(model, adamw(model, lr=1e-2), _Rows(), steps=3, batch_size=2, grad_clip=1.0, eval_every=3,
                        mesh=mesh((world,), ("cp",)) if cp else None)
        runs.append([(r.loss, r.eval_loss, r.grad_norm, r.tokens) for r in records])
    return [tuple(abs(a - b) / abs(a) for a, b in zip(x, y, strict=True) if a is not None and b is not None)
            for run in runs[1:] for x, y in zip(runs[0], run, strict=True)]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_training_loop_on_cp2_trains_as_one_process_does(dist2) -> None:
    """The model cutting its own chunks, and the loop's collation cutting them (inputs_split):
    the same losses, eval losses, grad norms and token counts as one process."""
    for rank in dist2.run(_train_loop, timeout=150):
        assert len(rank) == 6 and len(rank[2]) == len(rank[5]) == 4, rank  # the last step has an eval loss
        # relative: AdamW's first steps magnify float32 rounding of the gradients (1e-5 of the norm)
        assert all(d < 1e-4 for step in rank for d in step), rank


def _functional(rank: int, world: int) -> dict[str, Any]:
    model = tiny_decoder("llama")
    ids = token_ids(batch=2, seq=64, seed=1)
    ref = model(ids, labels=ids)
    ref.loss.backward()
    expected = _grads(model)
    sch = sf.context_parallel(sf.create_schedule(model, mesh=mesh((world,), ("cp",))))
    apply_fn, params, _ = sf.func.functional(sf.build(sch))
    loss, grads = sf.func.value_and_grad(lambda p: apply_fn(p, ids, labels=ids).loss)(params)
    got = {n: full(g) for n, g in grads.items() if g is not None}
    worst = max((got[n] - g).abs().max().item() for n, g in expected.items())
    return {"loss": abs(loss.item() - ref.loss.item()), "grad": worst, "names": sorted(got) == sorted(expected),
            "untouched": True}


@pytest.mark.timeout(150)
def test_the_functional_loop_on_cp2_gives_the_single_process_loss_and_gradients(dist2) -> None:
    # sf.func's value_and_grad takes gradients with torch.autograd.grad, not backward(): the
    # sum over cp must not rely on hooks that only accumulation runs
    _check(dist2.run(_functional, timeout=150))
