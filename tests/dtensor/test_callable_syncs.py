"""Callable syncs, as Slapo's schedules write them (``sync_op_or_fn=<fn>``), at tp=2 on gloo.

``sf.sync(sch, path, mode, layout, src=..., fn=callable)`` runs the user's callable at the
boundary as PyTorch runs a module hook; the user states the layout it takes (``src``) and
gives (``layout``), and the plan trusts the statement only where the data flow agrees.
Two of Slapo's hooks, translated (slapo/model_schedule/gpt2.py and bert.py): an
embedding's rows split by vocabulary between a masking pre-hook and a post-hook that zeros
the rows outside this rank's and all-reduces; and ``broadcast_input``, rank 0's inputs
broadcast to the tensor-parallel group before the model runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import mesh
from slapo_schedules import embedding_hooks
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from tp_checks import parity, single_process

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

VOCAB, D = 32, 16


class Tiny(nn.Module):
    """An embedding, then a Megatron MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.fc, self.proj = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        return h + self.proj(torch.relu(self.fc(h)))  # type: ignore[no-any-return]


class Mixed(Tiny):
    """A softmax over the features between the pair: the plan cannot prove it on local shards."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        return h + self.proj(self.fc(h).softmax(-1))  # type: ignore[no-any-return]


def _megatron_mlp(sch: sf.Schedule) -> sf.Schedule:
    return sf.shard(sf.shard(sch, "fc", axis=0), "proj", axis=1)


def _slapo_embedding(sch: sf.Schedule) -> sf.Schedule:
    """The weight's rows split by its path, as Slapo's ``shard("weight", axis=0)``, and the
    hooks around the module, stated: the ids arrive whole and go in as this rank's local
    ids (whole on every rank: ``Replicate``), the output leaves partial and is reduced."""
    pre, post = embedding_hooks(sch, VOCAB)
    sch = sf.shard(_megatron_mlp(sch), "wte.weight", axis=0)
    sch = sf.sync(sch, "wte", "fwd_pre", Replicate(), src=Replicate(), fn=pre)
    return sf.sync(sch, "wte", "fwd_post", Replicate(), src=Partial(), fn=post)


def _broadcast_input(sch: sf.Schedule) -> sf.Schedule:
    """Slapo's ``broadcast_input``: the tensor-parallel group's first rank's inputs on every rank."""
    m = sch.mesh
    assert m is not None
    group = m.get_group(0)
    first = dist.get_global_rank(group, 0)

    def broadcast(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        for a in args:
            if isinstance(a, torch.Tensor):
                dist.broadcast(a, src=first, group=group)
        return args

    return sf.sync(_megatron_mlp(sch), "", "fwd_pre", Replicate(), src=Replicate(), fn=broadcast)


def _loss(out: Any, _: sf.Schedule) -> torch.Tensor:
    return (out * torch.linspace(0.5, 1.5, out.shape[-1])).pow(2).mean()  # type: ignore[no-any-return]


def _run(rank: int, world: int, which: str, skew: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    rewrite = {"embedding": _slapo_embedding, "broadcast": _broadcast_input}[which]
    model = Tiny()
    reference = single_process(model, (ids,), _loss)
    if skew:  # each rank handed other ids: the broadcast makes them rank 0's (the reference's)
        ids = (ids + rank) % VOCAB
    r = parity(model, rewrite, (ids,), shape=(world,), loss=_loss, reference=reference)
    return {"on_dtensors": r["on_dtensors"], "fwd": r["fwd"], "bwd": r["bwd"], "grads": r["grads"],
            "placements": r["placements"]}


def test_slapos_embedding_masking_hooks_run_equal_on_this_ranks_rows(dist2: Any) -> None:
    got = dist2.run(_run, "embedding", False, timeout=120)
    assert got[0]["on_dtensors"] is False
    assert got[0]["grads"] == 5
    assert got[0]["placements"]["wte.weight"] == ("S(0)",)  # never gathered: each rank its rows
    # the MLP's all-reduce each way, and the hook's c10d all-reduce (in place) forward alone
    assert got[0]["fwd"] == {"all_reduce": 1, "allreduce_": 1} and got[0]["bwd"] == {"all_reduce": 1}


def test_broadcast_input_runs_equal_with_each_rank_handed_other_inputs(dist2: Any) -> None:
    got = dist2.run(_run, "broadcast", True, timeout=120)
    assert got[0]["on_dtensors"] is False and got[0]["grads"] == 5
    assert got[0]["fwd"] == {"broadcast_": 1, "all_reduce": 1} and got[0]["bwd"] == {"all_reduce": 1}


def _refused(rank: int, world: int, what: str) -> str:
    sch = sf.create_schedule(Tiny(), mesh=mesh((world,), ("tp",)))
    if what == "pre-src":  # the ids arrive whole, not split
        sch = sf.sync(sch, "wte", "fwd_pre", Replicate(), src=Shard(-1), fn=lambda m, a: a)
    elif what == "root-src":  # the model's inputs arrive whole on every rank
        sch = sf.sync(sch, "", "fwd_pre", Replicate(), src=Partial(), fn=lambda m, a: a)
    elif what == "post-src":  # a column gives its features split, not partial
        sch = sf.sync(sf.shard(sch, "fc", axis=0), "fc", "fwd_post", Replicate(), src=Partial(),
                      fn=lambda m, a, o: o)
    elif what == "post-src-unsharded":  # an unsharded module between callables: every rank the whole output
        sch = sf.sync(sch, "wte", "fwd_pre", Replicate(), src=Replicate(), fn=lambda m, a: a)
        sch = sf.sync(sch, "wte", "fwd_post", Replicate(), src=Partial(), fn=lambda m, a, o: o)
    elif what == "on-dtensors":  # a callable is code on local tensors: never skipped on DTensors
        sch = _broadcast_input(sf.create_schedule(Mixed(), mesh=mesh((world,), ("tp",))))
    try:
        sf.build(sch)
    except sf.LayoutError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize("what", ["pre-src", "root-src", "post-src", "post-src-unsharded", "on-dtensors"])
def test_a_callable_stated_to_take_what_the_flow_contradicts_is_refused(dist2: Any, what: str) -> None:
    got = dist2.run(_refused, what, timeout=120)
    assert got[0] == got[1]
    assert got[0].startswith("build"), got[0]
    assert ("DTensor activations" if what == "on-dtensors" else "src=") in got[0], got[0]


def test_sync_refuses_a_callable_without_src_or_on_a_gradient() -> None:
    from slapo_fn.dtensor.testing import fake_mesh

    sch = sf.create_schedule(Tiny(), mesh=fake_mesh(2))
    with pytest.raises(sf.LayoutError, match="needs src="):
        sf.sync(sch, "wte", "fwd_post", Replicate(), fn=lambda m, a, o: o)
    with pytest.raises(sf.LayoutError, match="forward pass"):
        sf.sync(sch, "wte", "bwd_post", Replicate(), src=Partial(), fn=lambda m, a, o: o)
    with pytest.raises(sf.LayoutError, match="not callable"):
        sf.sync(sch, "wte", "fwd_post", Replicate(), src=Partial(), fn=3)  # type: ignore[arg-type]
    spec = sf.sync(sch, "wte", "fwd_post", Replicate(), src=Partial(), fn=print)["wte"].annotations["sync"][0]
    assert str(spec) == "fwd_post P→R@tp (by print)"
