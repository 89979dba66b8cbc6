"""explain's tensor-parallel section: layouts, per-rank parameter bytes, per-boundary
collectives with bytes — predicted without devices, checked against the real run
(CommDebugMode counts and the sizes of the functional collectives actually issued) on
2 gloo ranks; and build(strict=True) refusing implicit resharding."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from models import MLP, megatron_llama, tiny_llama, token_ids
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode
from tp_checks import counts

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh

_SHORT = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


class Recorder(TorchDispatchMode):
    """Records (op, bytes of the full tensor) of every functional collective issued:
    the all-reduced tensor, the all-gathered result, the reduce-scattered input."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = func._overloadpacket.__name__.rstrip("_")
        if func.namespace == "_c10d_functional" and name in _SHORT:
            t = args[0]
            size = t.numel() * t.element_size() * (int(args[1]) if name == "all_gather_into_tensor" else 1)
            self.ops.append((_SHORT[name], size))
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- fake process group


def test_llama_7b_shaped_meta_model_at_tp8_without_devices() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(use_cache=False)  # LLaMA-7B: hidden 4096, 32 layers, 32 heads, MLP 11008, vocab 32000
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    sch = megatron_llama(sf.create_schedule(model, mesh=fake_mesh(8)))
    sch = sf.shard(sf.shard(sch, "model.embed_tokens", axis=0), "lm_head", axis=0)
    batch, seq = 1, 2048
    e = sf.explain(sch, torch.empty(batch, seq, dtype=torch.long, device="meta"))
    tp = e.tensor_parallel
    assert tp is not None and tp.shapes_note == ""

    # exact per-rank parameter bytes, counted by hand (f32): every sharded matrix is 1/8
    h, i, v, layers = 4096, 11008, 32000, 32
    per_layer = (4 * h * h + 3 * h * i) // 8 + 2 * h  # q/k/v/o + gate/up/down sharded; two norms replicated
    exact = 4 * (v * h // 8 + layers * per_layer + h + v * h // 8)
    assert abs(tp.rank_bytes - exact) <= 0.01 * exact
    assert tp.rank_bytes == exact
    assert tp.total_bytes == 4 * sum(p.numel() for p in model.parameters()) == e.total_bytes
    assert tp.module_bytes["model.layers.3.mlp.down_proj"] == 4 * h * i // 8
    assert tp.module_bytes["model.layers.3.input_layernorm"] == 4 * h
    layouts = {p.path: p.layout for p in tp.params}
    assert layouts["model.layers.0.self_attn.q_proj.weight"] == "f32[4096@tp, 4096]"
    assert layouts["model.layers.0.mlp.down_proj.weight"] == "f32[4096, 11008@tp]"
    assert layouts["model.norm.weight"] == "f32[4096]"

    # collectives: 2 all-reduces forward and 2 backward per layer; embedding (vocab) 1 forward;
    # the LM head enters (1 backward) and all-gathers its logits (implicit)
    assert tp.counts() == {
        "forward": {"all_reduce": 2 * layers + 1, "all_gather": 1},
        "backward": {"all_reduce": 2 * layers + 1},
    }
    hidden = 4 * batch * seq * h
    by_site = {(c.path, c.direction): c for c in tp.collectives}
    o = by_site[("model.layers.7.self_attn.o_proj", "forward")]
    assert (o.op, o.side, o.src, o.dst, o.bytes, o.origin) == ("all_reduce", "output", "P", "R", hidden, "shard")
    q = by_site[("model.layers.7.self_attn.q_proj", "backward")]
    assert (q.op, q.side, q.bytes, q.asked) == ("all_reduce", "input", hidden, True)
    assert ("model.layers.7.self_attn.k_proj", "backward") not in by_site  # fused with q's entry
    head = by_site[("lm_head", "forward")]
    assert (head.op, head.src, head.dst, head.bytes, head.origin) == (
        "all_gather",
        "S(-1)",
        "R",
        4 * seq * v,
        "implicit",
    )
    assert [c.path for c in tp.implicit] == ["lm_head"]
    assert tp.bytes("forward") == (2 * layers + 1) * hidden + 4 * seq * v

    text = str(e)
    assert "parameter bytes per rank: 3.1 GiB (of 25.1 GiB unsharded)" in text
    assert "model.layers.*.mlp.down_proj output P→R@tp  fwd all_reduce  32.0 MiB  [shard]  ×32" in text
    assert "lm_head output S(-1)→R@tp  fwd all_gather  250.0 MiB  [implicit]" in text
    assert "· weight: f32[4096, 11008@tp]" in text


def test_without_example_inputs_counts_are_known_and_bytes_are_not() -> None:
    sch = sf.create_schedule(MLP(8, 16), mesh=fake_mesh(2))
    tp = sf.explain(sf.shard(sf.shard(sch, "fc1", axis=0), "fc2", axis=1)).tensor_parallel
    assert tp is not None
    assert tp.counts() == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
    assert [c.bytes for c in tp.collectives] == [None, None] and tp.bytes() is None
    assert "no example inputs" in tp.shapes_note and "? B" in str(tp)
    assert sf.explain(sf.create_schedule(MLP())).tensor_parallel is None  # no mesh, no section


def test_sync_origin_and_bytes_of_a_stated_boundary() -> None:
    sch = sf.create_schedule(MLP(8, 16), mesh=fake_mesh(2))
    sch = sf.sync(sf.shard(sch, "fc1", axis=0), "fc1", "fwd_post", Replicate())
    tp = sf.explain(sch, torch.empty(3, 5, 8, device="meta", requires_grad=True)).tensor_parallel
    assert tp is not None
    assert [(c.path, c.side, c.direction, c.op, c.bytes, c.origin) for c in tp.collectives] == [
        ("fc1", "input", "backward", "all_reduce", 3 * 5 * 8 * 4, "shard"),
        ("fc1", "output", "forward", "all_gather", 3 * 5 * 16 * 4, "sync"),
    ]
    # a raw input that needs no gradient: the column's entry costs nothing backward
    frozen = sf.explain(sch, torch.empty(3, 5, 8, device="meta")).tensor_parallel
    assert frozen is not None and frozen.counts() == {"forward": {"all_gather": 1}, "backward": {}}


# ----------------------------------------------------------------------------- build(strict=True)


def test_strict_build_names_every_implicit_boundary_and_sync_makes_it_pass() -> None:
    # a column and a row Linear under different parents with a norm over the features between
    # them (no Megatron pair: through an activation alone they would pair across parents)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16)), nn.LayerNorm(16), nn.Sequential(nn.Linear(16, 8)),
                          nn.LayerNorm(8))
    base = sf.shard(sf.shard(sf.create_schedule(model, mesh=fake_mesh(2)), "0.0", axis=0), "2.0", axis=1)
    sch = sf.shard(base, "3.weight", axis=0)  # a parameter sharded by path: gathered to run
    sf.build(sch)  # lenient by default
    with pytest.raises(sf.LayoutError, match=r"build\(strict=True\): 3 problems") as info:
        sf.build(sch, strict=True)
    assert info.value.paths == ("0.0", "2.0", "3")
    text = str(info.value)
    assert "'0.0': output needs implicit resharding S(-1)→R over 'tp' (forward: all_gather" in text
    assert "sf.sync(sch, '0.0', 'fwd_post', Replicate())" in text
    assert "'2.0': input needs implicit resharding R→S(-1) over 'tp' (forward: -, backward: all_gather)" in text
    assert "sf.sync(sch, '2.0', 'fwd_pre', Shard(-1))" in text
    assert "'3': param weight needs implicit resharding" in text and "shard '3' as a whole" in text

    stated = sf.sync(sf.sync(sch, "0.0", "fwd_post", Replicate()), "2.0", "fwd_pre", Shard(-1))
    with pytest.raises(sf.LayoutError) as info:
        sf.build(stated, strict=True)
    assert info.value.paths == ("3",)  # the two stated boundaries pass
    stated = sf.sync(sf.sync(base, "0.0", "fwd_post", Replicate()), "2.0", "fwd_pre", Shard(-1))
    built = sf.build(stated, strict=True)
    assert isinstance(built[0][0].weight, DTensor)
    tp = sf.explain(stated).tensor_parallel
    assert tp is not None and tp.implicit == ()
    # the stated row input is one split (all-gather backward), not two
    assert tp.counts() == {
        "forward": {"all_gather": 1, "all_reduce": 1},
        "backward": {"all_reduce": 1, "all_gather": 1},
    }
    # stating the row's input as replicated keeps the local split, now asked for
    replicated = sf.explain(sf.sync(base, "2.0", "fwd_pre", Replicate())).tensor_parallel
    assert replicated is not None
    assert [(c.path, c.origin) for c in replicated.collectives if c.side == "input"][1:] == [("2.0", "sync")]


def test_strict_build_accepts_megatron_and_sequence_parallel() -> None:
    sch = megatron_llama(sf.create_schedule(tiny_llama(2).model, mesh=fake_mesh(2)), "layers.*")
    sf.build(sch, strict=True)
    sf.build(sf.sequence_parallel(sch, ["layers.*", "norm"]), strict=True)


# ----------------------------------------------------------------------------- against the real run


def _measure(model: nn.Module, rewrite: Any, inputs: tuple[Any, ...], loss: Any) -> dict[str, Any]:
    from dist import mesh

    sch = rewrite(sf.create_schedule(model, mesh=mesh((2,), ("tp",))))
    tp = sf.explain(sch, *inputs).tensor_parallel
    assert tp is not None
    built, ref = sf.build(sch), sf.build(sf.create_schedule(model))
    built.eval()
    ref.eval()
    loss(ref(*inputs)).backward()
    fwd_rec, bwd_rec = Recorder(), Recorder()
    with CommDebugMode() as fwd, fwd_rec:
        value = loss(built(*inputs))
    with CommDebugMode() as bwd, bwd_rec:
        value.backward()
    torch.testing.assert_close(value, loss(ref(*inputs)))
    grads = dict(ref.named_parameters())
    for name, p in built.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(g, grads[name].grad, atol=1e-5, rtol=1e-4)
    predicted = {
        d: Counter((c.op, c.bytes) for c in tp.collectives if c.direction == d) for d in ("forward", "backward")
    }
    return {
        "explain": tp.counts(),
        "comm_debug": {"forward": counts(fwd), "backward": counts(bwd)},
        "bytes_predicted": predicted,
        "bytes_issued": {"forward": Counter(fwd_rec.ops), "backward": Counter(bwd_rec.ops)},
        "paths": sorted({c.path for c in tp.collectives}),
    }


def _cases(rank: int, world: int) -> dict[str, dict[str, Any]]:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, requires_grad=True)  # as if a trainable layer came before
    llama = tiny_llama(2)
    return {
        "mlp": _measure(
            MLP(8, 16), lambda s: sf.shard(sf.shard(s, "fc1", axis=0), "fc2", axis=1), (x,), lambda y: y.pow(2).mean()
        ),
        "llama": _measure(
            llama, megatron_llama, (token_ids(),), lambda y: y.logits.pow(2).mean()
        ),
        "sp": _measure(
            llama.model,
            lambda s: sf.sequence_parallel(megatron_llama(s, "layers.*"), ["layers.*", "norm"]),
            (token_ids(seq=8),),
            lambda y: y.last_hidden_state.pow(2).mean(),
        ),
    }


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_explain_equals_what_the_real_run_issues_on_two_ranks(dist2) -> None:
    for result in dist2.run(_cases, timeout=120):
        for name, r in result.items():
            assert r["explain"] == r["comm_debug"], (name, r)
            assert r["bytes_predicted"] == r["bytes_issued"], name
        assert result["mlp"]["explain"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
        assert result["llama"]["explain"] == {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}
        assert result["sp"]["explain"] == {
            "forward": {"all_gather": 5, "reduce_scatter": 4},
            "backward": {"all_gather": 5, "reduce_scatter": 4, "all_reduce": 1},  # + the norms' weight gradients
        }
        assert "layers.1.mlp.down_proj" in result["sp"]["paths"] and "norm" in result["sp"]["paths"]
