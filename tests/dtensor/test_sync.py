"""``sync``: stated conversions, stacked on one boundary."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())


def _two_posts(sch: sf.Schedule) -> sf.Schedule:
    sch = sf.shard(sf.shard(sch, "0", axis=0), "2", axis=1)
    return sf.sync(sf.sync(sch, "2", "fwd_post", Shard(-1)), "2", "fwd_post", Replicate())


def test_a_row_with_two_output_syncs_runs_them_in_turn_on_dtensors() -> None:
    """A row's output stated ``Shard(-1)`` and then ``Replicate()``: nothing contradicts it
    (PyTorch's engine applies both). The local-shard path converts a role's output once,
    so the model runs on DTensor activations, naming why; a first sync whose ``src=``
    is not the row's ``Partial()`` is still refused."""
    why = sf.dtensor.plan(_two_posts(sf.create_schedule(_mlp(), mesh=fake_mesh(2)))).on_dtensors
    assert [(p.path, "2 fwd_post syncs, converted one after another" in p.reason) for p in why] == [("2", True)]
    sch = sf.shard(sf.shard(sf.create_schedule(_mlp(), mesh=fake_mesh(2)), "0", axis=0), "2", axis=1)
    with pytest.raises(sf.LayoutError, match=r"so its output is Partial\(\), but its fwd_post sync states src=Shard"):
        sf.build(sf.sync(sch, "2", "fwd_post", Replicate(), src=Shard(-1)), init="empty")


def _run_two_posts(rank: int, world: int) -> dict[str, object]:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    r = parity(_mlp(), _two_posts, (x,), shape=(world,), tracker=False, predict=False)
    return {"on_dtensors": r["on_dtensors"], "fwd": r["fwd"]}


@pytest.mark.timeout(90)
def test_a_row_with_two_output_syncs_is_equal_to_the_single_process(dist2) -> None:
    """Forward and every gradient equal (parity); the row's partial sum is reduce-scattered
    by features, then gathered: one of each, as stated."""
    for r in dist2.run(_run_two_posts, timeout=60):
        assert r == {"on_dtensors": True, "fwd": {"reduce_scatter": 1, "all_gather": 1}}, r
