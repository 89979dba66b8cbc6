"""What a user's own code does between a column kept split and its row partner, at tp=2.

A Megatron pair keeps the column's output as this rank's features, so the parent's code
between the two runs on a share of them. That is right for code acting on each feature
alone (activations, gates, scaling) and for code taking the features apart into heads;
it would be silently wrong for anything over the features: a norm, a mean, a softmax, a
max, a flip, a concatenation of two columns. The plan cannot prove such code right on
local shards, so the model runs on DTensor activations (PyTorch's sharding propagation
gathers what the op needs), equal, and the plan's reason names the op; the reason's fix
(the column's output gathered) runs equal on local shards. Head views whose fixed sizes
count the whole output's heads (``unflatten(-1, (self.h, -1))``) go the same way unless
build makes the count local (``num_heads`` beside ``head_dim``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist import mesh
from torch import nn
from torch.distributed.tensor import Replicate
from tp_checks import parity

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

D = 16


class Pair(nn.Module):
    """``out(code(fc(x)))``: ``code`` is the parent's own code between the pair."""

    def __init__(self, code: Callable[[torch.Tensor], torch.Tensor], width: int = 2 * D) -> None:
        super().__init__()
        self.code = code
        self.fc = nn.Linear(D, width)
        self.out = nn.Linear(width, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.code(self.fc(x)))


class Beside(Pair):
    """``out(fc(x)) + code(fc(x))``: the column's output read by the parent beside its row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.out(h) + self.code(h)


class Concat(nn.Module):
    """Two columns concatenated along the features: locally [a_r | b_r], not [a | b]'s share."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.out = nn.Linear(2 * D if dim == -1 else D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.a(x), self.b(x)], dim=self.dim))


class Heads(nn.Module):
    """Attention written with ``unflatten`` and ``einsum``; ``view`` sizes the head split."""

    def __init__(self, view: str) -> None:
        super().__init__()
        self.view = view
        if view == "num_heads":  # the names build makes this rank's
            self.num_heads, self.head_dim = 4, D // 4
        else:
            self.h, self.width = 4, D
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def split(self, t: torch.Tensor) -> torch.Tensor:
        if self.view in ("h", "h-scaled", "h-width"):
            return t.unflatten(-1, (self.h, -1))  # a count of the whole output's heads, of no known name
        if self.view == "num_heads":
            return t.unflatten(-1, (self.num_heads, -1))
        return t.unflatten(-1, (-1, D // 4))  # -1 heads of a fixed size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        if self.view == "h-scaled":  # h read for more than sizes: build may not make it this rank's
            q = q / self.h
        a = torch.einsum("bshd,bthd->bhst", q, k).softmax(-1)
        y = torch.einsum("bhst,bthd->bshd", a, v)
        if self.view == "h-width":  # merged back by a width of its own, which build makes this rank's too
            return self.o(y.reshape(*y.shape[:2], self.width))
        return self.o(y.flatten(-2))


def _pair(column: str = "fc", row: str = "out") -> Callable[[sf.Schedule], sf.Schedule]:
    return lambda s: sf.shard(sf.shard(s, column, axis=0), row, axis=1)


def _heads(s: sf.Schedule) -> sf.Schedule:
    s = sf.shard(s, ["q", "k", "v"], axis=0)
    return sf.shard(s, "o", axis=1)


def _concat(s: sf.Schedule) -> sf.Schedule:
    return sf.shard(sf.shard(s, ["a", "b"], axis=0), "out", axis=1)


#: name -> (model, plan, the op a refusal names or None where the plan runs equal)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[sf.Schedule], sf.Schedule], str | None]] = {
    "norm": (lambda: Pair(lambda h: h / h.norm(dim=-1, keepdim=True)), _pair(), "norm(dim=-1)"),
    "mean": (lambda: Pair(lambda h: h - h.mean(-1, keepdim=True)), _pair(), "mean(dim=-1)"),
    "softmax": (lambda: Pair(lambda h: h.softmax(-1)), _pair(), "softmax(dim=-1)"),
    "max": (lambda: Pair(lambda h: h * (h > h.max(-1, keepdim=True).values * 0.5)), _pair(), "max(dim=-1)"),
    "flip": (lambda: Pair(lambda h: h.flip(-1)), _pair(), "flip(dim=-1)"),
    "layer_norm": (lambda: Pair(lambda h: F.layer_norm(h, h.shape[-1:])), _pair(), "layer_norm(...)"),
    "concat-features": (lambda: Concat(-1), _concat, "cat(dim=-1)"),
    "heads-counted-whole": (lambda: Heads("h-scaled"), _heads, "the sizes in front of the -1"),

    # over each feature alone, or over the sequence: equal
    "gelu-and-scale": (lambda: Pair(lambda h: F.gelu(h) * 0.5 + 1.0), _pair(), None),
    "softmax-over-sequence": (lambda: Pair(lambda h: h.softmax(1)), _pair(), None),
    "concat-sequence": (lambda: Concat(1), _concat, None),
    "heads-minus-one-first": (lambda: Heads("-1"), _heads, None),
    "heads-in-num_heads": (lambda: Heads("num_heads"), _heads, None),
    # a count in self.h, read for the split's sizes alone (the trace, again with h doubled, says so)
    "heads-in-an-attribute-of-its-own": (lambda: Heads("h"), _heads, None),
    "heads-and-width-in-attributes-of-their-own": (lambda: Heads("h-width"), _heads, None),
    "last-token": (lambda: Pair(lambda h: h[:, -1]), _pair(), None),
    # the column's output read by the parent beside its row as well: no pair, gathered whole
    "slice-beside-the-row": (lambda: Beside(lambda h: h[..., :D]), _pair(), None),
    "sum-beside-the-row": (lambda: Beside(lambda h: h.sum(-1, keepdim=True)), _pair(), None),
    # a slice of the features before the row: this rank's share does not hold the same ones
    "slices-before-the-row": (lambda: Pair(lambda h: torch.cat([h[..., :D], h[..., D:]], -1)), _pair(),
                              "slices at fixed feature positions"),
    "slice-after-a-scale": (lambda: Pair(lambda h: F.pad((h + 1.0)[..., :D], (0, D))), _pair(),
                            "splits its output into blocks"),
    "slice-beside-a-sum": (lambda: Pair(lambda h: F.pad(h[..., :D], (0, D)) + h), _pair(), "x[..., :16]"),

    # the features followed where the code moves them: refused where an op then mixes them
    "transposed-then-softmax": (lambda: Pair(lambda h: h.transpose(1, 2).softmax(1).transpose(1, 2)), _pair(),
                                "softmax(dim=1)"),
    "unsqueezed-then-summed": (lambda: Pair(lambda h: h * h.unsqueeze(-1).sum(-2)), _pair(), "sum(dim=-2)"),
    "item-then-softmax": (lambda: Pair(lambda h: h[0].softmax(1)), _pair(), "softmax(dim=1)"),
    "flattened-tokens-into-heads": (lambda: Pair(lambda h: h.reshape(-1, 4, h.shape[-1] // 4).softmax(-1)
                                               .reshape(h.shape)), _pair(), "reshape(-1, 4, ...)"),
    "view-counting-heads-whole": (lambda: Pair(lambda h: h.view(*h.shape[:2], 4, -1).softmax(-1).flatten(2)),
                                    _pair(), "the sizes in front of the -1"),
    "view-counting-heads-by-a-computed-size": (
        lambda: Pair(lambda h: h.view(*h.shape[:2], 4, h.size(-1) // 4).softmax(-1).flatten(2)), _pair(),
        "counts 4 heads of the whole output"),
    # ... and equal where none does
    "transposed-softmax-over-sequence": (lambda: Pair(lambda h: h.transpose(1, 2).softmax(-1).transpose(1, 2)),
                                         _pair(), None),
    "max-over-sequence": (lambda: Pair(lambda h: h - h.max(1, keepdim=True).values), _pair(), None),
    "chunks-of-the-sequence": (lambda: Pair(lambda h: torch.cat(h.chunk(2, dim=1)[::-1], 1)), _pair(), None),
    "tokens-flattened": (lambda: Pair(lambda h: h.reshape(-1, h.shape[-1]).softmax(0).view(h.shape)), _pair(),
                         None),
    # a 2-D (batch, features) output: dim 1 is the features, not the sequence the plan reads it
    # as, which only the running model shows: refused at the first forward
    "softmax-over-dim-1-of-2d": (lambda: Pair(lambda h: h.softmax(1)), _pair(), "forward: softmax(dim=1)"),
    "mean-over-dim-1-of-2d": (lambda: Pair(lambda h: h - h.mean(1, keepdim=True)), _pair(), "forward: mean(dim=1)"),
    "gelu-of-2d": (lambda: Pair(F.gelu), _pair(), None),
}
#: the cases run on a (batch, features) input; the others on (batch, sequence, features)
FLAT = {"softmax-over-dim-1-of-2d", "mean-over-dim-1-of-2d", "gelu-of-2d"}


def _loss(out: Any, _: sf.Schedule) -> torch.Tensor:
    return (out * torch.linspace(0.5, 1.5, out.shape[-1])).pow(2).mean()  # type: ignore[no-any-return]


def _gathered(name: str) -> Callable[[sf.Schedule], sf.Schedule]:
    """The refusal's fix: the columns' outputs gathered (the row splits its whole input)."""
    _, plan, _ = CASES[name]
    columns = ["a", "b"] if name.startswith("concat") else ["q", "k", "v"] if name.startswith("heads") else ["fc"]
    return lambda s: sf.sync(plan(s), columns, "fwd_post", Replicate())


def _outcome(rank: int, world: int, name: str, fixed: bool) -> str:
    torch.manual_seed(0)
    make, plan, _ = CASES[name]
    x = torch.randn(*((4,) if name in FLAT else (2, 6)), D, generator=torch.Generator().manual_seed(3))
    rewrite = _gathered(name) if fixed else plan
    try:
        r = parity(make(), rewrite, (x,), shape=(world,), loss=_loss, tracker=False)
    except sf.LayoutError as e:
        return f"refused: {e}"
    if r["on_dtensors"]:
        why = sf.dtensor.plan(rewrite(sf.create_schedule(make(), mesh=mesh((world,), ("tp",))))).on_dtensors
        return "equal on DTensors: " + " | ".join(str(p) for p in why)
    return "equal"


@pytest.mark.parametrize("name", list(CASES))
def test_code_between_a_pair_is_equal_or_refused_naming_the_op(dist2: Any, name: str) -> None:
    got = dist2.run(_outcome, name, False, timeout=120)
    assert got[0] == got[1]
    op = CASES[name][2]
    if op is None:
        assert got[0] == "equal"
    elif op.startswith("forward: "):
        assert got[0].startswith("refused: tensor parallel forward:"), got[0]
        assert op.removeprefix("forward: ") in got[0] and "(batch, sequence, features)" in got[0], got[0]
    else:
        assert got[0].startswith("equal on DTensors: "), got[0]  # decided at build, before running
        assert op in got[0], got[0]


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[2] is not None])
def test_the_reasons_fix_runs_equal_on_local_shards(dist2: Any, name: str) -> None:
    assert dist2.run(_outcome, name, True, timeout=120) == ["equal", "equal"]
