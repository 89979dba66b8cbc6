"""The gradients of replicated parameters that run on sequence shards (a sequence-parallel
chain's norms), all-reduced together at the end of backward (2 gloo ranks).

Through backward they are ``Partial`` (what they are); one callback at its end reduces
them all in one collective and makes them ``Replicate``. These check the ways that can go
wrong: gradients accumulated over two backwards, ``torch.autograd.grad`` (which fills no
``.grad``), activation checkpointing (the norms recomputed), and a mesh with an axis the
parameters do not live on (each norm then reduces its own, for FSDP's hooks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from dist import mesh
from torch import nn
from torch.distributed.tensor import DTensor
from tp_checks import CountCollectives, full

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

NORMS = ("0.weight", "0.bias", "2.weight", "2.bias")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(8), nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), nn.LayerNorm(8))


def _schedule(model: nn.Module, m: Any, checkpointed: bool = False) -> sf.Schedule:
    sch = sf.shard(sf.shard(sf.create_schedule(model, mesh=m), "1.0", axis=0), "1.2", axis=1)
    sch = sf.sequence_parallel(sch, ["0", "1", "2"])
    return sf.checkpoint(sch, "1") if checkpointed else sch


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) * torch.linspace(0.5, 1.5, 8)).pow(2).mean()


def _inputs(n: int) -> list[torch.Tensor]:
    return [torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _compare(built: nn.Module, ref: nn.Module) -> float:
    grads = dict(ref.named_parameters())
    worst = 0.0
    for name, p in built.named_parameters():
        assert p.grad is not None and grads[name].grad is not None, name
        worst = max(worst, float((full(p.grad) - grads[name].grad).abs().max()))
    return worst


def _accumulated(rank: int, world: int) -> dict[str, Any]:
    """Two backwards without zero_grad: the second adds its Partial gradient to the first's
    Replicate one (DTensor reduces it on the spot); the sum equals the reference's."""
    model = _model()
    built = sf.build(_schedule(model, mesh((world,), ("tp",))))
    ref = sf.build(sf.create_schedule(model))
    counts = []
    for x in _inputs(2):
        _loss(ref, x).backward()
        loss = _loss(built, x)
        with CountCollectives() as mode:
            loss.backward()
        counts.append(dict(mode.seen))
    params = dict(built.named_parameters())
    return {"worst": _compare(built, ref), "counts": counts,
            "placements": {n: tuple(map(str, params[n].grad.placements)) for n in NORMS}}


def test_gradients_accumulated_over_two_backwards_equal_the_reference(dist2) -> None:
    for r in dist2.run(_accumulated, timeout=120):
        assert r["worst"] < 1e-5, r
        assert set(r["placements"].values()) == {("R",)}, r
        # the first backward: the four norm gradients in one all-reduce at its end
        assert r["counts"][0] == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}, r["counts"]


def _pending(rank: int, world: int) -> int:
    """Unwaited collectives left in the process group's registry by one backward whose
    gradients nobody reads (an all-reduce left pending there keeps its buffer for good)."""
    import gc

    from torch._C._distributed_c10d import _get_work_registry_size

    built = sf.build(_schedule(_model(), mesh((world,), ("tp",))))
    gc.collect()
    before = _get_work_registry_size()
    _loss(built, _inputs(1)[0]).backward()
    del built
    gc.collect()
    return _get_work_registry_size() - before


def test_the_reduction_at_the_end_of_backward_leaves_no_collective_pending(dist2) -> None:
    assert dist2.run(_pending, timeout=120) == [0, 0]


def _autograd_grad(rank: int, world: int) -> dict[str, Any]:
    """``torch.autograd.grad`` fills no ``.grad``: the norms' gradients it returns are the
    Partial DTensors they are (their sum over ranks is the gradient), never local values
    taken for whole ones; ``.grad`` stays empty."""
    model = _model()
    built = sf.build(_schedule(model, mesh((world,), ("tp",))))
    ref = sf.build(sf.create_schedule(model))
    (x,) = _inputs(1)
    params = dict(built.named_parameters())
    want = dict(zip(NORMS, torch.autograd.grad(_loss(ref, x), [dict(ref.named_parameters())[n] for n in NORMS]),
                    strict=True))
    got = dict(zip(NORMS, torch.autograd.grad(_loss(built, x), [params[n] for n in NORMS]), strict=True))
    return {"worst": max(float((full(got[n]) - want[n]).abs().max()) for n in NORMS),
            "placements": {n: tuple(map(str, g.placements)) for n, g in got.items() if isinstance(g, DTensor)},
            "grads": [n for n in NORMS if params[n].grad is not None]}


def test_torch_autograd_grad_returns_the_partial_gradients_they_are(dist2) -> None:
    for r in dist2.run(_autograd_grad, timeout=120):
        assert r["worst"] < 1e-5, r
        assert set(r["placements"].values()) == {("P(sum)",)}, r
        assert r["grads"] == [], r


def _checkpointed(rank: int, world: int, reentrant: bool) -> dict[str, Any]:
    """The chain's middle checkpointed: recomputation runs outside the root's pass."""
    model = _model()
    if reentrant:
        built = sf.build(_schedule(model, mesh((world,), ("tp",))))

        def run(x: torch.Tensor) -> torch.Tensor:
            h = built[0](x)
            h = torch.utils.checkpoint.checkpoint(built[1], h, use_reentrant=True)
            return built[2](h)

        forward: Callable[[torch.Tensor], torch.Tensor] = run
    else:
        built = sf.build(_schedule(model, mesh((world,), ("tp",)), checkpointed=True))
        forward = built
    ref = sf.build(sf.create_schedule(model))
    (x,) = _inputs(1)
    _loss(ref, x).backward()
    (forward(x) * torch.linspace(0.5, 1.5, 8)).pow(2).mean().backward()
    params = dict(built.named_parameters())
    return {"worst": _compare(built, ref),
            "placements": {n: tuple(map(str, params[n].grad.placements)) for n in NORMS}}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_members_keep_the_gradients(dist2, reentrant: bool) -> None:
    for r in dist2.run(_checkpointed, reentrant, timeout=120):
        assert r["worst"] < 1e-5, r
        assert set(r["placements"].values()) == {("R",)}, r


def _dp_tp(rank: int, world: int) -> dict[str, Any]:
    """On a (dp, tp) mesh whose dp axis no parameter uses, each norm reduces its own
    gradients in its backward (FSDP2's hooks read them there)."""
    model = _model()
    built = sf.build(_schedule(model, mesh((1, world), ("dp", "tp"))))
    ref = sf.build(sf.create_schedule(model))
    (x,) = _inputs(1)
    _loss(ref, x).backward()
    loss = _loss(built, x)
    with CountCollectives() as mode:
        loss.backward()
    return {"worst": _compare(built, ref), "counts": dict(mode.seen)}


def test_on_a_mesh_with_a_free_axis_each_norm_reduces_its_own(dist2) -> None:
    for r in dist2.run(_dp_tp, timeout=120):
        assert r["worst"] < 1e-5, r
        assert r["counts"] == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}, r["counts"]


def _compiled(rank: int, world: int) -> dict[str, Any]:
    """A compiled sequence-parallel model: the same gradients, step after step, and no
    recompilation after the first step."""
    import torch._dynamo

    torch._dynamo.reset()
    model = _model()
    built = sf.build(sf.compile(_schedule(model, mesh((world,), ("tp",))), "", backend="eager"))
    ref = sf.build(sf.create_schedule(model))
    graphs, worst = [], 0.0
    for x in _inputs(3):
        _loss(ref, x).backward()
        _loss(built, x).backward()
        worst = max(worst, _compare(built, ref))
        for m in (built, ref):
            m.zero_grad()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return {"worst": worst, "graphs": graphs}


def test_a_compiled_sequence_parallel_model_keeps_the_gradients_and_its_graphs(dist2) -> None:
    for r in dist2.run(_compiled, timeout=200):
        assert r["worst"] < 1e-5, r
        assert r["graphs"][0] >= 1 and r["graphs"][1:] == [r["graphs"][0]] * 2, r
