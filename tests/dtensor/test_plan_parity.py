"""The plans of ``test_plan.py`` hold on gloo ranks: for each small case, the collectives
counted in one forward and one backward (``CommDebugMode``) equal ``plan(sch).counts()``,
and the loss, the input gradient and every parameter gradient equal the unsharded model's.

The loss weights each output feature differently (``sum(out * arange)``): a loss such as
``out.pow(2).mean()`` cannot tell a permuted or misplaced feature shard from the right one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import PreNormLayer as Layer
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from tp_checks import parity

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def weighted(out: Any, _: sf.Schedule) -> torch.Tensor:
    out = out if isinstance(out, torch.Tensor) else out.logits
    return (out.float() * torch.arange(1, out.shape[-1] + 1, dtype=torch.float32)).sum()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


class Attention(nn.Module):
    """Three sibling columns reading one input, and a row."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x) * self.k(x) + self.v(x))






def megatron(col: str | list[str], row: str | list[str], **kw: Any) -> Callable[[sf.Schedule], sf.Schedule]:
    return lambda s: sf.shard(sf.shard(s, col, axis=0, **kw), row, axis=1, **kw)


def hidden() -> torch.Tensor:
    return torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))


def ids() -> torch.Tensor:
    return torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))


Case = tuple[Callable[[], nn.Module], Callable[[sf.Schedule], sf.Schedule], Callable[[], torch.Tensor]]

CASES: dict[str, Case] = {
    "megatron-pair": (mlp, megatron("0", "2"), hidden),
    "lone-column": (mlp, lambda s: sf.shard(s, "0", axis=0), hidden),
    "lone-row": (mlp, lambda s: sf.shard(s, "2", axis=1), hidden),
    "row-then-column": (
        lambda: nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)),
        lambda s: sf.shard(sf.shard(s, "0", axis=1), "1", axis=0),
        hidden,
    ),
    "qkv-columns": (lambda: nn.Sequential(Attention()), megatron(["0.q", "0.k", "0.v"], "0.o"), hidden),
    "vocab-embedding": (
        lambda: nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8)),
        lambda s: sf.shard(s, "0", axis=0),
        ids,
    ),
    "embed-dim-embedding": (
        lambda: nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8)),
        lambda s: sf.shard(s, "0", axis=1),
        ids,
    ),
    "embed-dim-then-row": (
        lambda: nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8)),
        lambda s: sf.shard(sf.shard(s, "0", axis=1), "1", axis=1),
        ids,
    ),
    "packed-column": (
        lambda: nn.Sequential(nn.Linear(8, 24)),
        lambda s: sf.shard(s, "0", axis=0, packed=3),
        hidden,
    ),
    "packed-parameter": (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)),
        lambda s: sf.shard(s, "1.weight", axis=0, packed=2),
        hidden,
    ),
    "sp-layers": (
        lambda: nn.Sequential(Layer(), Layer(), nn.LayerNorm(8)),
        lambda s: sf.sequence_parallel(megatron("*.mlp.fc1", "*.mlp.fc2")(s), ["0", "1", "2"]),
        hidden,
    ),
    "sp-flat-chain": (
        lambda: nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)),
        lambda s: sf.sequence_parallel(megatron("1", "2")(s), ["0", "1", "2"]),
        hidden,
    ),
    "sp-vocab-first": (
        lambda: nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8)),
        lambda s: sf.sequence_parallel(sf.shard(s, "0", axis=0), ["0", "1"]),
        ids,
    ),
    "column-sync-replicated": (mlp, lambda s: sf.sync(sf.shard(s, "0", axis=0), "0", "fwd_post", Replicate()), hidden),
    "row-sync-pre-shard": (mlp, lambda s: sf.sync(sf.shard(s, "2", axis=1), "2", "fwd_pre", Shard(-1)), hidden),
    "row-sync-pre-replicated": (mlp, lambda s: sf.sync(sf.shard(s, "2", axis=1), "2", "fwd_pre", Replicate()), hidden),
    "row-reduce-scatter-then-gather": (
        lambda: nn.Sequential(mlp(), nn.LayerNorm(8)),
        lambda s: sf.sync(
            sf.sync(megatron("0.0", "0.2")(s), "0.2", "fwd_post", Shard(1)), "1", "fwd_pre", Replicate(), src=Shard(1)
        ),
        hidden,
    ),
    "bwd-post-replicated": (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
        lambda s: sf.sync(s, "1", "bwd_post", Replicate(), src=Replicate()),
        hidden,
    ),
    "column-chain-equal-widths": (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
        lambda s: sf.shard(s, ["0", "1"], axis=0),
        hidden,
    ),
    "row-fed-by-row": (
        lambda: nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 8)),
        lambda s: sf.shard(sf.shard(s, "0", axis=0), ["1", "2"], axis=1),
        hidden,
    ),
}


def _run(rank: int, world: int, name: str, shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, Any]:
    model, rewrite, inputs = CASES[name]
    torch.manual_seed(0)
    r = parity(model(), rewrite, (inputs(),), shape=shape, names=names, loss=weighted)
    return {"counted": {"forward": r["fwd"], "backward": r["bwd"]}, "predicted": r["predicted"]}


@pytest.mark.parametrize("name", list(CASES))
def test_plan_holds(dist2: Any, name: str) -> None:
    for r in dist2.run(_run, name, (2,), ("tp",), timeout=60):  # parity() compared loss and gradients
        assert r["counted"] == r["predicted"], name


def test_plan_holds_on_a_2d_mesh(dist4: Any) -> None:
    for name in ("megatron-pair", "sp-layers"):
        for r in dist4.run(_run, name, (2, 2), ("dp", "tp"), timeout=60):
            assert r["counted"] == r["predicted"], name
