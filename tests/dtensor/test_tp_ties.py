"""Tied parameters under tensor parallelism: one tensor, one layout, or a LayoutError."""

from __future__ import annotations

import re

import pytest
import torch
from dist import mesh
from torch import nn
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids))))


def test_a_tie_sharded_two_ways_is_refused_naming_both_paths() -> None:
    sch = sf.create_schedule(TiedLM(), mesh=fake_mesh(2))
    sch = sf.shard(sch, "embed", axis=0)  # vocab rows
    with pytest.raises(sf.LayoutError, match=r"(?s)'head.weight'.*same parameter as 'embed.weight'.*S\(0\).*alike"):
        sf.shard(sch, "head", axis=1)  # row-parallel would need S(1) of the same tensor
    # the other order, and a parameter path with a layout, are refused alike
    row_head = sf.shard(sf.create_schedule(TiedLM(), mesh=fake_mesh(2)), "head", axis=1)
    with pytest.raises(sf.LayoutError, match=r"'embed.weight'.*same parameter as 'head.weight'"):
        sf.shard(row_head, "embed", axis=0)
    with pytest.raises(sf.LayoutError, match="tied"):
        sf.shard(row_head, "embed.weight", layout=("tp", None))


def test_a_tie_sharded_on_one_side_only_runs_on_dtensors_and_names_the_local_way() -> None:
    """The head reads the embedding's rows sharded: the plan cannot keep its output on local
    shards, so the model runs on DTensor activations (PyTorch's engine computes it too);
    the plan's reason names the tie and the fix that keeps it local."""
    sch = sf.shard(sf.create_schedule(TiedLM(), mesh=fake_mesh(2)), "embed", axis=0)
    before = sch.module.embed.weight
    why = "\n".join(str(p) for p in sf.dtensor.plan(sch).on_dtensors)
    assert re.search(r"(?s)'head.weight'.*tie would come apart.*sf.shard\(sch, \['embed', 'head'\]", why), why
    sf.build(sch)
    assert sch.module.embed.weight is before and sch.module.head.weight is before


def _one_side(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    return parity(TiedLM(), lambda s: sf.shard(s, "embed", axis=0), (torch.randint(0, 16, (2, 5)),), shape=(world,),
                  tracker=False)


_ONE_SIDE: list[list[dict]] = []


def _one_side_results(pool) -> list[dict]:
    if not _ONE_SIDE:
        _ONE_SIDE.append(pool.run(_one_side, timeout=60))
    return _ONE_SIDE[0]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_tie_sharded_on_one_side_only_matches_the_reference(dist2) -> None:
    for r in _one_side_results(dist2):
        assert r["on_dtensors"] and r["grads"] == 3


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_explain_counts_a_tie_sharded_on_one_side_only(dist2) -> None:
    for r in _one_side_results(dist2):
        assert r["predicted"] == {"forward": r["fwd"], "backward": r["bwd"]}


def _consistent(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 16, (2, 5))
    result = parity(model, lambda s: sf.shard(s, ["embed", "head"], axis=0), (ids,), shape=(world,))
    built = sf.build(sf.shard(sf.create_schedule(model, mesh=mesh((world,), ("tp",))), ["embed", "head"], axis=0))
    result["one_tensor"] = built.head.weight is built.embed.weight
    return result


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_consistent_tie_stays_one_tensor_and_matches_the_reference(dist2) -> None:
    for r in dist2.run(_consistent, timeout=60):
        assert r["one_tensor"]
        assert r["grads"] == 3  # the tied weight (once), body weight and bias
        assert r["fwd"] == r["predicted"]["forward"] and r["bwd"] == r["predicted"]["backward"]
