"""Issue 39, item 4: a ``decompose``d and ``fuse``d bias+GeLU on a column-sharded Linear,
in either order of the rewrites (Slapo's ``fuse_bias_gelu`` then ``shard_mlp``, or the
other way), at tp=2 on gloo.

``decompose`` keeps a Linear called for its matmul (the parent adds its bias after the
call); the parent's read of that bias is an operand of the column's output, handed as this
rank's share, and the fused ``gelu(x + bias)`` passes the column's layout on to its row:
the layer runs on local shards at the unfused layer's collectives (one all-reduce each
way), with ``sf.dtensor.plan(sch).on_dtensors`` empty. Decomposing the row too, its bias
is added once by the parent after the all-reduce.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh

D = 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))  # type: ignore[no-any-return]


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias)


def _megatron(sch: sf.Schedule) -> sf.Schedule:
    return sf.shard(sf.shard(sch, "fc_in", axis=0), "fc_out", axis=1)


def _fused(sch: sf.Schedule, where: str = "fc_in") -> sf.Schedule:
    sch = sf.decompose(sf.trace(sch, ""), where)
    (match,) = sf.find(sch, "", bias_gelu)
    return sf.fuse(sch, "", match, compiler=None)


ORDERS = {"unfused": _megatron, "fuse-then-shard": lambda s: _megatron(_fused(s)),
          "shard-then-fuse": lambda s: _fused(_megatron(s)),
          "both-decomposed": lambda s: _fused(_megatron(s), "")}  # the row's bias added by the parent


def _run(rank: int, world: int, order: str) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(3))
    r = parity(MLP(), ORDERS[order], (x,), shape=(world,), predict=False)
    return {k: r[k] for k in ("fwd", "bwd", "grads", "on_dtensors")}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_fused_bias_gelu_on_a_column_runs_equal_either_order_at_the_unfused_counts(dist2: Any) -> None:
    for order in ORDERS:  # parity checks the output, the input's gradient and every parameter's
        got = dist2.run(_run, order, timeout=100)
        assert got[0]["grads"] == 4 and not got[0]["on_dtensors"], order  # on local shards, every order
        # DTensor's propagation finds the same collectives as the local plan of the unfused layer
        assert (got[0]["fwd"], got[0]["bwd"]) == ({"all_reduce": 1}, {"all_reduce": 1}), (order, got[0])


@pytest.mark.parametrize("order", ["fuse-then-shard", "shard-then-fuse", "both-decomposed"])
def test_a_fused_bias_gelu_on_a_column_runs_on_local_shards_at_the_unfused_counts(order: str) -> None:
    unfused = sf.dtensor.plan(ORDERS["unfused"](sf.create_schedule(MLP(), mesh=fake_mesh(2))))
    p = sf.dtensor.plan(ORDERS[order](sf.create_schedule(MLP(), mesh=fake_mesh(2))))
    assert p.on_dtensors == (), [f"{q.path}: {q.reason}" for q in p.on_dtensors]
    assert p.counts() == unfused.counts() == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


def test_a_lone_column_whose_bias_its_parent_adds_is_not_proven_on_local_shards() -> None:
    # its output is gathered, whole, while the bias the parent adds is split: DTensors decide
    p = sf.dtensor.plan(sf.shard(_fused(sf.create_schedule(MLP(), mesh=fake_mesh(2))), "fc_in", axis=0))
    assert [(q.path, q.reason.split(",")[0]) for q in p.on_dtensors] == [
        ("<root>", "adds 'fc_in.bias' to the output of 'fc_in' itself")]


class ReadsItsColumn(MLP):
    """A traced parent computing its column's linear itself (what ``decompose`` makes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(F.linear(x, self.fc_in.weight, self.fc_in.bias)))  # type: ignore[no-any-return]


def test_a_parent_reading_its_columns_parameters_is_told_so_not_that_fx_cannot_trace_it() -> None:
    # fx traces it: the one reason is the read (before, also "fx cannot trace its forward")
    p = sf.dtensor.plan(_megatron(sf.create_schedule(ReadsItsColumn(), mesh=fake_mesh(2))))
    assert [(q.path, q.reason.split(",")[0]) for q in p.on_dtensors] == [
        ("<root>", "reads the parameters of its child 'fc_in' itself instead of calling it")]
