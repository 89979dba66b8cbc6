"""fork_rng (per-TP-rank dropout streams on a 2-D mesh) and sync at fwd_pre / fwd_post /
bwd_post: every derived collective counted with CommDebugMode, numbers equal to the
unsharded model."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from tp_checks import parity

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(150)]


# ----------------------------------------------------------------------------- fork_rng


def _dropout_masks(rank: int, world: int) -> dict[str, Any]:
    from dist import mesh

    m = mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8))
    x = torch.randn(4, 8)
    base = sf.shard(sf.shard(sf.create_schedule(model, mesh=m), "0", axis=0), "2", axis=1)
    out: dict[str, Any] = {"dp": m.get_local_rank("dp"), "tp": m.get_local_rank("tp")}
    for name, sch in (("forked", sf.fork_rng(base, "1")), ("plain", base)):
        built = sf.build(sch).train()
        seen: list[torch.Tensor] = []
        built[1].register_forward_hook(lambda mod, args, y, seen=seen: seen.append(y.detach() != 0))
        runs = []
        for _ in range(2):  # the same seed twice: the same masks
            torch.manual_seed(1234)
            y = built(x)
            runs.append((seen[-1], y.detach(), torch.rand(3)))  # torch.rand: the stream after the step
        mask, y, after = runs[0]
        # the unsharded model with the full mask (every tp rank's features, in order)
        masks: list[Any] = [None] * world
        dist.all_gather_object(masks, (out["dp"], out["tp"], mask))
        full = torch.cat([mk for d, _, mk in sorted(masks, key=lambda t: t[1]) if d == out["dp"]], dim=-1)
        with torch.no_grad():
            expected = model[2](model[0](x) * full / 0.5)
        out[name] = {
            "mask": mask,
            "reproducible": torch.equal(runs[1][0], mask) and torch.equal(runs[1][1], y),
            "after": after,
            "matches_unsharded": torch.allclose(y, expected, atol=1e-6),
        }
    return out


def test_fork_rng_per_tp_rank_masks_identical_across_dp_reproducible(dist4) -> None:
    results = dist4.run(_dropout_masks, timeout=90)
    by_coord = {(r["dp"], r["tp"]): r for r in results}
    for r in results:
        for name in ("forked", "plain"):
            assert r[name]["reproducible"] and r[name]["matches_unsharded"], (name, r["dp"], r["tp"])
    for tp in (0, 1):  # identical across dp
        assert torch.equal(by_coord[(0, tp)]["forked"]["mask"], by_coord[(1, tp)]["forked"]["mask"])
    for dp in (0, 1):  # different across tp
        assert not torch.equal(by_coord[(dp, 0)]["forked"]["mask"], by_coord[(dp, 1)]["forked"]["mask"])
        # without fork_rng every rank draws the same mask (the stream fork_rng is there to split)
        assert torch.equal(by_coord[(dp, 0)]["plain"]["mask"], by_coord[(dp, 1)]["plain"]["mask"])
    first = results[0]["forked"]["after"]
    assert all(torch.equal(r["forked"]["after"], first) for r in results)  # the default stream stays in step


# ----------------------------------------------------------------------------- sync


class Sum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True)


class LocalSum(nn.Module):
    """What a user writes for TP by hand (Slapo style): sums this rank's features only —
    a partial sum; its input gradient is partial too (zero outside this rank's features)."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.rank, self.size = rank, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.chunk(self.size, -1)[self.rank].sum(-1, keepdim=True)


def _syncs(rank: int, world: int) -> dict[str, dict[str, Any]]:
    from dist import mesh

    m = mesh((world,), ("tp",))
    tp = m.get_local_rank("tp")
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))

    def lin(*dims: int) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(dims)))

    def case(model: nn.Module, rewrite: Any) -> dict[str, Any]:
        return parity(model, rewrite, (x,), shape=(world,))

    return {
        # fwd_pre R→S(-1): split (all-gather of the gradient); fwd_post P→R: all-reduce
        "pre_post": case(
            nn.Sequential(lin(8, 16), Sum()),
            lambda s: sf.sync(sf.sync(s, "1", "fwd_pre", Shard(-1)), "1", "fwd_post", Replicate(), src=Partial()),
        ),
        # bwd_post P→R: all-reduce of a hand-written partial module's input gradient
        "bwd_post": case(
            nn.Sequential(lin(8, 16), Sum()),
            lambda s: sf.sync(
                sf.sync(sf.replace(s, "1", LocalSum(tp, world)), "1", "fwd_post", Replicate(), src=Partial()),
                "1",
                "bwd_post",
                Replicate(),
                src=Partial(),
            ),
        ),
        # a column Linear's output stated replicated: all-gather (its entry: all-reduce backward)
        "column_post": case(
            nn.Sequential(lin(8, 16), nn.GELU()),
            lambda s: sf.sync(sf.shard(s, "0.0", axis=0), "0.0", "fwd_post", Replicate()),
        ),
        # a row Linear's output reduce-scattered along the sequence, gathered again before a norm
        "row_rs": case(
            nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), nn.LayerNorm(8)),
            lambda s: sf.sync(
                sf.sync(sf.shard(sf.shard(s, "0.0", axis=0), "0.2", axis=1), "0.2", "fwd_post", Shard(1)),
                "1",
                "fwd_pre",
                Replicate(),
                src=Shard(1),
            ),
        ),
        # a lone row Linear's input stated sharded: one split (all-gather backward), not two
        "row_pre": case(
            nn.Sequential(lin(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 8))),
            lambda s: sf.sync(sf.shard(s, "2.0", axis=1), "2.0", "fwd_pre", Shard(-1)),
        ),
    }


EXPECTED = {
    "pre_post": ({"all_reduce": 1}, {"all_gather": 1}),
    "bwd_post": ({"all_reduce": 1}, {"all_reduce": 1}),
    "column_post": ({"all_gather": 1}, {"all_reduce": 1}),
    # backward: the entry's all-reduce (the row's bias, added before the reduce-scatter, needs none)
    "row_rs": ({"reduce_scatter": 1, "all_gather": 1}, {"all_gather": 1, "all_reduce": 1}),
    "row_pre": ({"all_reduce": 1}, {"all_gather": 1}),
}


def test_sync_modes_derive_each_collective_and_keep_the_numbers(dist2) -> None:
    for result in dist2.run(_syncs, timeout=90):  # parity() compared loss, input and every gradient
        for name, (fwd, bwd) in EXPECTED.items():
            r = result[name]
            assert (r["fwd"], r["bwd"]) == (fwd, bwd), name
            assert r["predicted"] == {"forward": fwd, "backward": bwd}, name
