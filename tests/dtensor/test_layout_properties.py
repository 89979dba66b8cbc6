"""A differential property test of the layout engine, on 2 gloo ranks.

The promise (DESIGN.md, "Layouts and automatic resharding"): *any* combination of
``sf.shard``, ``sf.sync`` and ``sf.sequence_parallel`` either raises ``sf.LayoutError``
before it runs (at schedule time or in ``sf.build``) or gives a model equal to the
single-process one — the forward output, the input gradient, every parameter gradient
and the parameters after one ``torch.optim.AdamW(foreach=True)`` step — and, for the
cases that run, ``plan(sch).counts()`` equals the collectives counted in one forward and
one backward.

Hypothesis draws random small module trees (chains of Linears, residual blocks, LLaMA's
gated MLP, attention that reshapes by heads, a tied embedding and head, LayerNorms, a
module that reads a child's weight functionally) and random plans over them. Each case is
plain data (:class:`Case`): the test process draws a batch and ships it to the ranks,
which rebuild the model with a fixed seed and apply the plan (:func:`_run_cases`). A
failing case prints its tree, its plan as ``sf`` calls, a ``Case(...)`` repr that
:func:`check_case` takes, and what diverged.

* CI (profile ``gate``, derandomised): ``BATCHES`` × ``BATCH`` cases (at least 300 run), a
  fixed set, about 25 s on 2 cores after the pool is up.
* More: ``SLAPO_PROPERTY_EXAMPLES=200 HYPOTHESIS_PROFILE=explore pytest -k right_or_refused``
  (examples of ``BATCH`` cases each, new ones every run).
* ``SLAPO_PROPERTY_KNOWN=1`` keeps the known defects in the generation (it then fails: to
  see them, or to check that one is fixed).

Known defects of the library are excluded from the generation by :data:`KNOWN_DEFECTS`
(one named predicate per failure class) and pinned by one strict xfail each
(``test_known_defect``): once a defect is fixed, its xfail passes (XPASS fails the run) —
then delete its entry and the generation covers it again. None is open today: every class
found so far is closed, its minimal example kept in :data:`CLOSED`.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from tp_checks import CountCollectives, _fake_counts

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

#: Cases per pool call, and pool calls (Hypothesis examples): the CI set runs >= MIN_CASES
#: cases (a few examples stop short when the draws run out of Hypothesis's data budget).
BATCH = 12
DEFAULT_BATCHES = 40
BATCHES = int(os.environ.get("SLAPO_PROPERTY_EXAMPLES", DEFAULT_BATCHES))
MIN_CASES = 300
VOCAB, BATCH_SIZE, SEQ = 16, 2, 4

# ----------------------------------------------------------------------------- case description


@dataclass(frozen=True)
class Block:
    """One top-level block of the tree (see :func:`make_blocks` for what each kind builds)."""

    kind: str  # mlp | gated | attn | layer | branches | functional | chain | norm | bert | fused
    hidden: int = 0  # mlp / gated / layer: hidden width
    act: str = "gelu"
    bias: bool = True
    heads: int = 0  # attn / layer
    style: str = ""  # attn / layer: hf | hf-seq | infer | fixed | fixed-scaled | untraced; branches: add | mul;
    # mlp: _MLP_CODE; fused: grouped | grouped-infer
    norm: bool = False  # a LayerNorm child applied first
    residual: bool = False  # x + f(x)
    widths: tuple[int, ...] = ()  # chain: the widths between its Linears
    flat: bool = False  # chain: spliced into the root instead of an nn.Sequential
    extra: bool = False  # functional: a Linear after the functional one; layer: gated MLP

    def __repr__(self) -> str:  # the fields that differ from the defaults
        fields = [f"{k}={v!r}" for k, v in vars(self).items() if k != "kind" and v != getattr(Block, k)]
        return f"Block({', '.join([repr(self.kind), *fields])})"


@dataclass(frozen=True)
class Case:
    dim: int
    ids: bool  # token ids in (an Embedding first) or hidden states (B, S, dim)
    head: str  # "" | tied | untied (a Linear dim -> VOCAB last; tied shares the embedding's weight)
    blocks: tuple[Block, ...]
    plan: tuple[tuple[Any, ...], ...] = field(default=())
    looped: bool = False  # the blocks in an nn.ModuleList the root's loop calls (paths layers.i)
    reordered: bool = False  # the blocks registered last first, called first first (paths b.i)


# Ops of a plan, as plain tuples:
#   ("shard", path, axis, packed)              sf.shard(sch, path, axis=axis, packed=packed)
#   ("sync", path, mode, layout, src)           sf.sync(sch, path, mode, <layout>, src=<src>)
#   ("sp", (path, ...), input_layout)            sf.sequence_parallel(sch, [paths], input_layout=...)
# Placements as text: "R", "P", "S(1)", "S(-1)"; src None means the default.


def placement(text: str | None) -> Any:
    if text is None:
        return None
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    return Shard(int(text[2:-1]))


def _ptext(text: str | None) -> str:
    if text is None:
        return "None"
    return {"R": "Replicate()", "P": "Partial()"}.get(text, f"Shard({text[2:-1]})")


def op_source(op: tuple[Any, ...]) -> str:
    if op[0] == "shard":
        packed = f", packed={op[3]}" if op[3] != 1 else ""
        return f"sch = sf.shard(sch, {op[1]!r}, axis={op[2]}{packed})"
    if op[0] == "sync":
        src = f", src={_ptext(op[4])}" if op[4] is not None else ""
        return f"sch = sf.sync(sch, {op[1]!r}, {op[2]!r}, {_ptext(op[3])}{src})"
    given = f", input_layout={_ptext(op[2])}" if len(op) > 2 and op[2] is not None else ""
    return f"sch = sf.sequence_parallel(sch, {list(op[1])!r}{given})"


def describe(case: Case) -> str:
    """The tree (module paths), the plan as ``sf`` calls, and the ``Case`` repr."""
    model = make_model(case, device="meta")
    given = f"token ids (2, 4) < {VOCAB}" if case.ids else f"hidden states (2, 4, {case.dim})"
    lines = [f"input: {given}" + (", head tied to the embedding" if case.head == "tied" else ""), "tree:"]
    for path, m in model.named_modules():
        depth = path.count(".") + 1 if path else 0
        text = m.extra_repr()
        lines.append(f"  {'  ' * depth}{path or '<root>'}: {type(m).__name__}({text})")
    lines.append("plan:")
    lines += [f"  {op_source(op)}" for op in case.plan] or ["  (none)"]
    lines.append(f"repro (a test with the dist_pool fixture): check_case({case!r}, lambda: dist_pool(2))")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the modules


def _act(name: str) -> nn.Module:
    return nn.GELU() if name == "gelu" else nn.ReLU()


class Mlp(nn.Module):
    FLOW: ClassVar[dict[str, tuple[str, ...]]] = {"fc2": ("fc1",)}

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.residual = b.residual
        if b.norm:
            self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, b.hidden, bias=b.bias)
        self.act = _act(b.act)
        if b.style == "mid-norm":  # NormFormer's FFN norm; OLMo2's q/k norms over the whole projection
            self.mid = nn.LayerNorm(b.hidden)
        self.fc2 = nn.Linear(b.hidden, d, bias=b.bias)

        self.style = b.style

    def extra_repr(self) -> str:
        flat = self.style.startswith("flat")
        text = f"fc2({_MLP_CODE[self.style][0]})" + (" + x" if self.residual else "")
        return f"{text}, x = x.reshape(-1, x.size(-1)), viewed back by its shape" if flat else text

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.style.startswith("flat")  # OPT's MLP: on the batch and the tokens merged
        x0 = x.reshape(-1, x.size(-1)) if flat else x
        h = self.norm(x0) if "norm" in self._modules else x0
        h = self.act(self.fc1(h))
        y = self.fc2(_MLP_CODE[self.style][1](self.mid(h) if "mid" in self._modules else h))
        y = x0 + y if self.residual else y
        return y.view(x.shape) if flat else y


#: Mlp's own code between fc1 and fc2, by style: on each feature alone, over the sequence, or
#: over the features (right only on all of them)
_MLP_CODE: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    "": ("act(fc1(x))", lambda h: h),
    "scaled": ("act(fc1(x)) * 0.5 + 0.1", lambda h: h * 0.5 + 0.1),
    "seq-softmax": ("act(fc1(x)).softmax(1)", lambda h: h.softmax(1)),
    "normed": ("h / h.norm(dim=-1), h = act(fc1(x))", lambda h: h / (h.norm(dim=-1, keepdim=True) + 1.0)),
    "seq-max": ("h - h.amax(1), h = act(fc1(x))", lambda h: h - h.amax(1, keepdim=True)),
    "moved": ("act(fc1(x)).mT.softmax(1).mT", lambda h: h.mT.softmax(1).mT),  # over the features
    "flat": ("act(fc1(x))", lambda h: h),
    "flat-rows": ("act(fc1(x)).softmax(0)", lambda h: h.softmax(0)),  # over every token
    "mid-norm": ("mid(act(fc1(x))), mid a LayerNorm", lambda h: h),  # a child over the features
}


class Gated(nn.Module):
    """LLaMA's MLP: ``down(act(gate(x)) * up(x))``."""

    FLOW: ClassVar[dict[str, tuple[str, ...]]] = {"down": ("gate", "up")}
    SHARED = ("gate", "up")  # Linears that read one input

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.residual = b.residual
        if b.norm:
            self.norm = nn.LayerNorm(d)
        self.gate = nn.Linear(d, b.hidden, bias=b.bias)
        self.up = nn.Linear(d, b.hidden, bias=b.bias)
        self.down = nn.Linear(b.hidden, d, bias=b.bias)
        self.act = _act(b.act)

    def extra_repr(self) -> str:
        return "down(act(gate(x)) * up(x))" + (" + x" if self.residual else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) if "norm" in self._modules else x
        y = self.down(self.act(self.gate(h)) * self.up(h))
        return x + y if self.residual else y


class Attention(nn.Module):
    """q/k/v/o and softmax attention, reshaping by heads. ``style``: ``hf`` reads
    ``self.num_heads``/``self.head_dim`` (Hugging Face's names); ``hf-seq`` views as
    ``(B, -1, self.num_heads, self.head_dim)`` (OPT's: the sequence inferred); ``infer`` views as
    ``(B, S, -1, self.hd)``; ``fixed`` views as ``(B, S, self.nh, self.hd)`` (names no list
    holds: the trace tells that ``nh`` sizes the heads and nothing else); ``fixed-scaled`` as
    ``fixed``, and scales q by ``self.nh`` too (so ``nh`` may not become this rank's);
    ``untraced`` as ``fixed``, behind a branch on a tensor's values (it always takes the
    same way) that fx cannot trace."""

    FLOW: ClassVar[dict[str, tuple[str, ...]]] = {"o": ("q", "k", "v")}
    SHARED = ("q", "k", "v")

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.residual, self.style = b.residual, b.style
        if b.norm:
            self.norm = nn.LayerNorm(d)
        hd = d // b.heads
        if b.style in ("hf", "hf-seq"):
            self.num_heads, self.head_dim = b.heads, hd
        else:
            self.nh, self.hd = b.heads, hd
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=b.bias) for _ in range(4))

    def extra_repr(self) -> str:
        view = {"hf": "(B, S, self.num_heads, self.head_dim)", "hf-seq": "(B, -1, self.num_heads, self.head_dim)",
                "infer": "(B, S, -1, self.hd)"}
        heads = getattr(self, "num_heads", getattr(self, "nh", 0))
        return f"{heads} heads, view{view.get(self.style, '(B, S, self.nh, self.hd)')}" + (
            ", untraceable" if self.style == "untraced" else "") + (
            ", q * (1 + 1 / self.nh)" if self.style == "fixed-scaled" else "") + (", + x" if self.residual else "")

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        bsz, s = t.shape[:2]
        if self.style == "hf":
            t = t.view(bsz, s, self.num_heads, self.head_dim)
        elif self.style == "hf-seq":
            t = t.view(bsz, -1, self.num_heads, self.head_dim)
        elif self.style == "infer":
            t = t.view(bsz, s, -1, self.hd)
        else:
            t = t.view(bsz, s, self.nh, self.hd)
        return t.transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) if "norm" in self._modules else x
        if self.style == "untraced" and not bool(torch.isfinite(h).all()):  # fx cannot trace a value's branch
            h = h.nan_to_num()
        q, k, v = self._split(self.q(h)), self._split(self.k(h)), self._split(self.v(h))
        if self.style == "fixed-scaled":
            q = q * (1.0 + 1.0 / self.nh)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        y = self.o((att @ v).transpose(1, 2).reshape(*h.shape[:2], -1))
        return x + y if self.residual else y


class Fused(nn.Module):
    """BLOOM's and Falcon's attention: one ``qkv`` Linear whose rows hold each head's q, k
    and v side by side, viewed ``(B, S, self.num_heads, 3, self.head_dim)`` (style
    ``grouped``) or ``(B, S, -1, 3, self.head_dim)`` (``grouped-infer``), then ``o``. It adds
    ``bias``, one per head built by its caller (:class:`Alibi`), to the scores: of
    ``(B * heads, 1, S)`` through ``baddbmm`` on the batch and heads merged (BLOOM's,
    ``self.merged``), or of ``(B, heads, 1, S)`` viewed by the head count (Falcon's)."""

    FLOW: ClassVar[dict[str, tuple[str, ...]]] = {"o": ("qkv",)}

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.residual, self.style, self.merged = b.residual, b.style, b.act == "gelu"
        if b.norm:
            self.norm = nn.LayerNorm(d)
        self.num_heads, self.head_dim = b.heads, d // b.heads
        self.qkv = nn.Linear(d, 3 * d, bias=b.bias)
        self.o = nn.Linear(d, d, bias=b.bias)

    def extra_repr(self) -> str:
        heads = "-1" if self.style == "grouped-infer" else "self.num_heads"
        return (f"{self.num_heads} heads, qkv(x).view(B, S, {heads}, 3, self.head_dim), + bias "
                f"{'(B * heads, 1, S) by baddbmm' if self.merged else '(B, heads, 1, S)'}"
                + (", + x" if self.residual else ""))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x) if "norm" in self._modules else x
        bsz, s = h.shape[:2]
        fused = self.qkv(h).view(bsz, s, -1 if self.style == "grouped-infer" else self.num_heads, 3, self.head_dim)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
        scale = 1 / math.sqrt(self.head_dim)
        if bias is None:
            scores = q @ k.transpose(-1, -2) * scale
        elif self.merged:
            merged = bsz * self.num_heads
            scores = bias.baddbmm(q.reshape(merged, s, self.head_dim), k.reshape(merged, s, self.head_dim).mT,
                                  alpha=scale).view(bsz, self.num_heads, s, s)
        else:
            scores = q @ k.transpose(-1, -2) * scale + bias.view(bsz, self.num_heads, 1, -1)
        y = self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(bsz, s, -1))
        return x + y if self.residual else y


class Alibi(nn.Module):
    """BLOOM's model around its attention: a bias built for every head (``self.num_heads``,
    which build leaves whole: it is not the attention's), handed to ``attn``."""

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.num_heads = b.heads
        self.attn = Fused(d, replace(b, residual=False, norm=False))

    def extra_repr(self) -> str:
        return "x + attn(x, bias), bias = slopes[head] * arange(S), one per head"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, s = x.shape[:2]
        slopes = 0.5 ** torch.arange(1, self.num_heads + 1, dtype=x.dtype)
        bias = (slopes[:, None] * torch.arange(s, dtype=x.dtype)).expand(bsz, self.num_heads, s)
        bias = bias.reshape(bsz * self.num_heads, 1, s) if self.attn.merged else bias.reshape(
            bsz, self.num_heads, 1, s)
        return x + self.attn(x, bias)


class Layer(nn.Module):
    """A pre-norm decoder layer: ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``; with relu, a
    LayerNorm over the MLP's hidden features between its Linears (NormFormer's)."""

    def extra_repr(self) -> str:
        return "x + attn(ln1(x)), then + mlp(ln2(x))"

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, replace(b, norm=False, residual=False))
        self.ln2 = nn.LayerNorm(d)
        mlp = replace(b, norm=False, residual=False, style="mid-norm" if b.act == "relu" else "")
        self.mlp = Gated(d, mlp) if b.extra else Mlp(d, mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Branches(nn.Module):
    """Two parallel Linears combined elementwise (``a(x) + b(x)`` or ``a(x) * b(x)``)."""

    SHARED = ("a", "b")

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.residual, self.style = b.residual, b.style
        if b.norm:
            self.norm = nn.LayerNorm(d)
        self.a = nn.Linear(d, d, bias=b.bias)
        self.b = nn.Linear(d, d, bias=b.bias)

    def extra_repr(self) -> str:
        return f"a(x) {'+' if self.style == 'add' else '*'} b(x)" + (" + x" if self.residual else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) if "norm" in self._modules else x
        y = self.a(h) + self.b(h) if self.style == "add" else self.a(h) * self.b(h)
        return x + y if self.residual else y


class Functional(nn.Module):
    """Calls its child's parameters functionally: ``F.linear(x, self.proj.weight, self.proj.bias)``
    (then, with ``extra``, a Linear ``out`` called as a module)."""

    FLOW: ClassVar[dict[str, tuple[str, ...]]] = {"out": ("proj",)}

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.residual = b.residual
        self.proj = nn.Linear(d, d, bias=b.bias)
        self.act = _act(b.act)
        if b.extra:
            self.out = nn.Linear(d, d, bias=b.bias)

    def extra_repr(self) -> str:
        out = "out(...)" if "out" in self._modules else "..."
        return out.replace("...", "act(F.linear(x, self.proj.weight, self.proj.bias))") + (
            " + x" if self.residual else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(F.linear(x, self.proj.weight, self.proj.bias))
        if "out" in self._modules:
            y = self.out(y)
        return x + y if self.residual else y


class CrossSelf(nn.Module):
    """BERT's ``attention.self``: q/k/v and softmax attention, heads merged back (its
    output projection is in a sibling, :class:`CrossOut`)."""

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.num_heads, self.head_dim = b.heads, d // b.heads
        self.q, self.k, self.v = (nn.Linear(d, d, bias=b.bias) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, s = x.shape[:2]
        q, k, v = (t.view(bsz, s, self.num_heads, self.head_dim).transpose(1, 2) for t in (self.q(x), self.k(x),
                                                                                             self.v(x)))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)
        return (att @ v).transpose(1, 2).reshape(bsz, s, -1)


class CrossOut(nn.Module):
    """BERT's ``attention.output`` / ``output``: ``norm(dense(x) + residual)``."""

    def __init__(self, d_in: int, d: int, b: Block) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d, bias=b.bias)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(self.dense(x) + residual)


class CrossAttention(nn.Module):
    """BERT's ``attention``: ``output(self(x), x)``."""

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.self_, self.output = CrossSelf(d, b), CrossOut(d, d, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self_(x), x)


class CrossInter(nn.Module):
    """BERT's ``intermediate``: ``act(dense(x))``."""

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.dense, self.act = nn.Linear(d, b.hidden, bias=b.bias), _act(b.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class Bert(nn.Module):
    """A BERT layer: columns and their rows in sibling modules (q/k/v in
    ``attention.self_``, their row in ``attention.output``; ``inter.dense`` and ``out.dense``)."""

    def __init__(self, d: int, b: Block) -> None:
        super().__init__()
        self.attention, self.inter, self.out = CrossAttention(d, b), CrossInter(d, b), CrossOut(b.hidden, d, b)

    def extra_repr(self) -> str:
        return "a = attention.output(attention.self_(x), x); out(inter(a), a)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention(x)
        return self.out(self.inter(a), a)


class Residual(nn.Module):
    """``x + body(x)`` around an ``nn.Sequential`` body (a chain block made residual)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def extra_repr(self) -> str:
        return "x + body(x)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def _chain(d: int, b: Block) -> list[nn.Module]:
    widths = (d, *b.widths, d)
    mods: list[nn.Module] = []
    for i in range(len(widths) - 1):
        if i:
            mods.append(_act(b.act))
        mods.append(nn.Linear(widths[i], widths[i + 1], bias=b.bias))
    return mods


def make_blocks(d: int, b: Block) -> list[nn.Module]:
    """The top-level module(s) a block adds to the root ``nn.Sequential``."""
    if b.kind == "chain":
        mods = _chain(d, b)
        if b.flat:
            return mods
        seq = nn.Sequential(*mods)
        return [Residual(seq) if b.residual else seq]
    if b.kind == "norm":
        return [nn.LayerNorm(d)]
    cls: dict[str, Callable[[int, Block], nn.Module]] = {
        "mlp": Mlp, "gated": Gated, "attn": Attention, "layer": Layer, "branches": Branches, "functional": Functional,
        "bert": Bert,
    }
    if b.kind == "fused":
        return [Alibi(d, b) if b.extra else Fused(d, b)]
    return [cls[b.kind](d, b)]


class Looped(nn.Module):
    """A root that holds its blocks in an ``nn.ModuleList`` and calls them in a loop, as
    Hugging Face models and PyTorch's test ``Transformer`` hold their layers (the list is
    never called itself): paths ``layers.0``, ``layers.1``, ..."""

    def __init__(self, mods: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Reordered(nn.Module):
    """A root that registers its blocks in the reverse of the order its forward calls them,
    as OPT's decoder registers its final norm before its layers: paths ``b0``, ``b1``, ...
    in the order they run, module order ``b<n-1>`` first."""

    def __init__(self, mods: list[nn.Module]) -> None:
        super().__init__()
        self.count = len(mods)
        for i in reversed(range(len(mods))):
            self.add_module(f"b{i}", mods[i])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.count):
            x = getattr(self, f"b{i}")(x)
        return x

    def called(self) -> list[nn.Module]:
        return [getattr(self, n) for n in called_names(self)]


def called_names(parent: nn.Module) -> list[str]:
    """The names of ``parent``'s children in the order it calls them (module order, but for
    a :class:`Reordered` root)."""
    return [f"b{i}" for i in range(parent.count)] if isinstance(parent, Reordered) else list(parent._modules)


def top(model: nn.Module) -> tuple[str, Any]:
    """The path prefix of the top-level blocks and the module holding them in order."""
    if isinstance(model, Reordered):
        return "b", model.called()
    return ("layers.", model.layers) if isinstance(model, Looped) else ("", model)


def make_model(case: Case, device: str = "cpu") -> nn.Module:
    with torch.device(device):
        mods: list[nn.Module] = []
        if case.ids:
            mods.append(nn.Embedding(VOCAB, case.dim))
        for b in case.blocks:
            mods += make_blocks(case.dim, b)
        if case.head:
            head = nn.Linear(case.dim, VOCAB, bias=False)
            if case.head == "tied":
                head.weight = mods[0].weight  # type: ignore[assignment]
            mods.append(head)
        if case.reordered:
            return Reordered(mods)
        return Looped(mods) if case.looped else nn.Sequential(*mods)


def make_input(case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    if case.ids:
        return torch.randint(0, VOCAB, (BATCH_SIZE, SEQ), generator=g)
    return torch.randn(BATCH_SIZE, SEQ, case.dim, generator=g)


def apply_plan(sch: sf.Schedule, ops: tuple[tuple[Any, ...], ...]) -> sf.Schedule:
    for op in ops:
        if op[0] == "shard":
            sch = sf.shard(sch, op[1], axis=op[2], packed=op[3])
        elif op[0] == "sync":
            sch = sf.sync(sch, op[1], op[2], placement(op[3]), src=placement(op[4]))
        else:
            given = {"input_layout": placement(op[2])} if len(op) > 2 and op[2] is not None else {}
            sch = sf.sequence_parallel(sch, list(op[1]), **given)
    return sch


# ----------------------------------------------------------------------------- what a case means
#
# The data flow of the trees above, known from the module classes (not from the library):
# which Linear siblings feed a Linear through elementwise ops only (``FLOW``, and
# consecutive Linears of an ``nn.Sequential``), and which modules' outputs are the model's.


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _name(path: str) -> str:
    return path.rpartition(".")[2]


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def producers(model: nn.Module, path: str) -> tuple[str, ...]:
    """The sibling Linears whose outputs are the input of Linear ``path`` (through
    activations and elementwise products only)."""
    parent = model.get_submodule(_parent(path))
    flow: dict[str, tuple[str, ...]] = getattr(parent, "FLOW", {})
    if isinstance(parent, nn.Sequential | nn.ModuleList | Reordered):
        names = called_names(parent)
        i = names.index(_name(path)) - 1
        while i >= 0 and isinstance(parent._modules[names[i]], nn.GELU | nn.ReLU):
            i -= 1
        if i >= 0 and isinstance(parent._modules[names[i]], nn.Linear):
            return (_join(_parent(path), names[i]),)
        return ()
    return tuple(_join(_parent(path), n) for n in flow.get(_name(path), ()))


def output_paths(model: nn.Module) -> list[str]:
    """The modules whose output is the model's output, outermost first."""
    out, path, m = [""], "", model
    while True:
        last: str | None = None
        if isinstance(m, nn.Sequential | nn.ModuleList) and m._modules:
            last = list(m._modules)[-1]
        elif isinstance(m, Looped):
            last = "layers"
        elif isinstance(m, Reordered):
            last = f"b{m.count - 1}"
        elif isinstance(m, Bert):
            last = "out"
        elif isinstance(m, CrossOut):
            last = "norm"  # norm(dense(x) + residual): the norm's output is the block's
        elif isinstance(m, Mlp | Gated | Attention | Functional | Fused) and not m.residual:
            last = {Mlp: "fc2", Gated: "down", Attention: "o", Fused: "o"}.get(
                type(m), "out" if "out" in m._modules else "act")
        if last is None:
            return out
        path, m = _join(path, last), m._modules[last]
        out.append(path)


def stated_output(case: Case, model: nn.Module) -> str | None:
    """The layout that ``fwd_post`` syncs state for the model's output, or ``None`` for
    Replicate: a sharded output is then compared all-gathered. Innermost module first; a
    sharded module's output takes its first such sync (from its own layout), any other
    module's each in turn (one from ``src`` to the same layout converts nothing). An
    activation passes on the layout its own ``fwd_pre`` syncs leave."""
    roles = {op[1] for op in case.plan if op[0] == "shard"}
    chain = next((op[1] for op in case.plan if op[0] == "sp"), ())
    layout = "R"
    for path in reversed(output_paths(model)):
        if isinstance(model.get_submodule(path), nn.GELU | nn.ReLU):
            for op in case.plan:
                if op[0] == "sync" and op[1] == path and op[2] == "fwd_pre" and op[4] != op[3]:
                    layout = op[3]
        posts = [op for op in case.plan if op[0] == "sync" and op[1] == path and op[2] == "fwd_post"]
        if chain and path == chain[-1]:
            # the chain's exit gathers the last member's output, unless a sync on it takes its place
            layout = "S(1)" if posts else "R"
        for op in posts[:1] if path in roles else posts:
            if path in roles or op[4] != op[3]:
                layout = op[3]
    return None if layout == "R" else layout


@dataclass(frozen=True)
class Facts:
    """A case's plan as the test reads it: roles by path, the sequence-parallel run, syncs."""

    model: nn.Module
    roles: dict[str, tuple[str, int]]  # path -> (column | row | vocab | embed_dim, packed)
    sp: tuple[str, ...]
    sp_input: str | None
    syncs: tuple[tuple[Any, ...], ...]
    ops: tuple[tuple[Any, ...], ...]

    @staticmethod
    def of(case: Case) -> Facts:
        model = make_model(case, device="meta")
        roles: dict[str, tuple[str, int]] = {}
        sp: tuple[str, ...] = ()
        sp_input = None
        for op in case.plan:
            if op[0] == "shard":
                m = model.get_submodule(op[1])
                if isinstance(m, nn.Embedding):
                    roles[op[1]] = ("vocab" if op[2] == 0 else "embed_dim", op[3])
                else:
                    roles[op[1]] = ("column" if op[2] == 0 else "row", op[3])
            elif op[0] == "sp":
                sp, sp_input = op[1], (op[2] if len(op) > 2 else None)
        return Facts(model, roles, sp, sp_input, tuple(op for op in case.plan if op[0] == "sync"), case.plan)

    def kind(self, path: str) -> str | None:
        return self.roles.get(path, (None, 1))[0]

    def in_sp(self, path: str) -> bool:
        return any(path == p or path.startswith(p + ".") for p in self.sp)

    def siblings(self, path: str) -> list[str]:
        parent = self.model.get_submodule(_parent(path))
        return [_join(_parent(path), n) for n in called_names(parent)]

    def columns(self) -> list[str]:
        return [p for p, (k, _) in self.roles.items() if k == "column"]

    def rows(self) -> list[str]:
        return [p for p, (k, _) in self.roles.items() if k == "row"]

    def partnered(self, column: str) -> bool:
        """The library's rule: a column keeps its output sharded when a row sibling follows."""
        sib = self.siblings(column)
        return any(self.kind(s) == "row" for s in sib[sib.index(column) + 1 :])


# ----------------------------------------------------------------------------- strategies

ACTS = st.sampled_from(["gelu", "relu"])
WIDTHS = st.sampled_from([8, 16])


@st.composite
def blocks(draw: Any, d: int) -> Block:
    kind = draw(st.sampled_from(["mlp", "gated", "attn", "layer", "branches", "functional", "chain", "norm",
                                 "bert", "fused"]))
    bias, act = draw(st.booleans()), draw(ACTS)
    norm, residual = draw(st.booleans()), draw(st.booleans())
    if kind == "mlp":
        return Block(kind, hidden=draw(WIDTHS), act=act, bias=bias, norm=norm, residual=residual,
                     style=draw(st.sampled_from(["", "", "scaled", "seq-softmax", "normed", "seq-max", "moved",
                                                  "flat", "flat-rows", "mid-norm"])))
    if kind == "gated":
        return Block(kind, hidden=draw(WIDTHS), act=act, bias=bias, norm=norm, residual=residual)
    if kind in ("attn", "layer"):
        heads = draw(st.sampled_from([1, 2, 4]))
        style = draw(st.sampled_from(["hf", "hf-seq", "infer", "fixed", "fixed-scaled", "untraced"]))
        if kind == "layer":
            return Block(kind, hidden=draw(WIDTHS), act=act, bias=bias, heads=heads, style=style,
                         extra=draw(st.booleans()))
        return Block(kind, bias=bias, heads=heads, style=style, norm=norm, residual=residual)
    if kind == "fused":  # act: gelu for BLOOM's merged bias, relu for Falcon's; extra: with a bias
        return Block(kind, bias=bias, act=act, heads=draw(st.sampled_from([1, 2, 4])), norm=norm, residual=residual,
                     style=draw(st.sampled_from(["grouped", "grouped-infer"])), extra=draw(st.booleans()))
    if kind == "branches":
        return Block(kind, bias=bias, style=draw(st.sampled_from(["add", "mul"])), norm=norm, residual=residual)
    if kind == "bert":
        return Block(kind, hidden=draw(WIDTHS), act=act, bias=bias, heads=draw(st.sampled_from([1, 2, 4])))
    if kind == "functional":
        return Block(kind, act=act, bias=bias, residual=residual, extra=draw(st.booleans()))
    if kind == "chain":
        widths = tuple(draw(st.lists(WIDTHS, max_size=2)))
        flat = draw(st.booleans())
        return Block(kind, act=act, bias=bias, widths=widths, flat=flat, residual=residual and not flat)
    return Block(kind)


def _megatron(model: nn.Module) -> list[tuple[Any, ...]]:
    """The standard pattern per module: Megatron pairs (columns then a row), vocab
    embedding + column head, a lone column."""
    ops: list[tuple[Any, ...]] = []
    for path, m in model.named_modules():
        if isinstance(m, Mlp):
            ops += [("shard", f"{path}.fc1", 0, 1), ("shard", f"{path}.fc2", 1, 1)]
        elif isinstance(m, Gated):
            ops += [("shard", f"{path}.{n}", 0, 1) for n in ("gate", "up")] + [("shard", f"{path}.down", 1, 1)]
        elif isinstance(m, Attention):
            ops += [("shard", f"{path}.{n}", 0, 1) for n in "qkv"] + [("shard", f"{path}.o", 1, 1)]
        elif isinstance(m, Fused):
            ops += [("shard", f"{path}.qkv", 0, 1), ("shard", f"{path}.o", 1, 1)]
        elif isinstance(m, Bert):
            ops += [("shard", f"{path}.attention.self_.{n}", 0, 1) for n in "qkv"]
            ops += [("shard", f"{path}.attention.output.dense", 1, 1), ("shard", f"{path}.inter.dense", 0, 1),
                    ("shard", f"{path}.out.dense", 1, 1)]
        elif isinstance(m, Branches):
            ops += [("shard", f"{path}.a", 0, 1), ("shard", f"{path}.b", 0, 1)]
        elif isinstance(m, Functional) and "out" in m._modules:
            ops += [("shard", f"{path}.out", 1, 1)]
        elif isinstance(m, nn.Sequential) and path:
            lin = [f"{path}.{n}" for n, c in m.named_children() if isinstance(c, nn.Linear)]
            ops += [("shard", p, i % 2, 1) for i, p in enumerate(lin)]
        elif isinstance(m, nn.Embedding) or (path == _top_path(model, -1) and isinstance(m, nn.Linear)):
            ops.append(("shard", path, 0, 1))  # vocab embedding, column head
    return ops


def _top_path(model: nn.Module, i: int) -> str:
    prefix, items = top(model)
    return f"{prefix}{i % len(items)}"


SRCS = st.sampled_from([None, None, "R", "S(1)", "S(-1)", "P"])  # None: the plan fills it in


@st.composite
def plans(draw: Any, model: nn.Module) -> tuple[tuple[Any, ...], ...]:
    """A random plan over ``model``: shards of its Linears/Embeddings (axis 0 or 1, some
    packed), syncs with random placements, a sequence-parallel run of top-level modules."""
    shardable = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)]
    ops: list[tuple[Any, ...]] = []
    if draw(st.booleans()):  # start from the standard pattern, perturbed
        for op in _megatron(model):
            r = draw(st.integers(0, 9))
            if r == 0:
                continue  # dropped
            if r == 1:
                op = (*op[:2], 1 - op[2], 1)  # flipped axis
            ops.append(op)
    else:
        for path, _ in shardable:
            if draw(st.integers(0, 9)) < 4:
                ops.append(("shard", path, draw(st.sampled_from([0, 1])), 1))
    # packed=2 on a column whose out features allow it
    for i, op in enumerate(ops):
        m = model.get_submodule(op[1])
        if isinstance(m, nn.Linear) and op[2] == 0 and m.out_features % 4 == 0 and draw(st.integers(0, 9)) == 0:
            ops[i] = (*op[:3], 2)
    paths = [p for p, _ in model.named_modules()]
    for _ in range(draw(st.integers(0, 2))):
        mode = draw(st.sampled_from(["fwd_pre", "fwd_post", "fwd_post", "bwd_post"]))
        if mode == "bwd_post":
            layout, src = "R", draw(st.sampled_from(["P", "R"]))
        else:
            layout, src = draw(st.sampled_from(["R", "S(1)", "S(-1)"])), draw(SRCS)
        ops.append(("sync", draw(st.sampled_from(paths)), mode, layout, src))
    prefix, items = top(model)
    if draw(st.integers(0, 9)) < 3:
        start = draw(st.integers(0, len(items) - 1))
        end = draw(st.integers(start + 1, len(items)))
        given = "S(1)" if draw(st.integers(0, 4)) == 0 else None
        if given and start and draw(st.booleans()):  # the module before states its output split
            ops.append(("sync", f"{prefix}{start - 1}", "fwd_post", "S(1)", None))
        members = tuple(f"{prefix}{i}" for i in range(start, end))
        ops.append(("sp", members, given))
        sharded = {op[1] for op in ops if op[0] == "shard"}
        inner = [p for p in paths if any(p.startswith(f"{m}.") for m in members) and p not in sharded]
        if inner and draw(st.integers(0, 4)) == 0:  # one module inside runs on the whole sequence
            path = draw(st.sampled_from(inner))
            ops.append(("sync", path, "fwd_pre", "R", draw(st.sampled_from([None, "S(1)"]))))
            ops.append(("sync", path, "fwd_post", "S(1)", draw(st.sampled_from([None, "R"]))))
    if not ops:  # every case states something (a build without annotations is the plain model)
        if shardable:
            ops.append(("shard", draw(st.sampled_from(shardable))[0], draw(st.sampled_from([0, 1])), 1))
        else:
            ops.append(("sp", (f"{prefix}0",), None))
    if len(ops) > 1 and draw(st.booleans()):
        ops = list(draw(st.permutations(ops)))
    return tuple(ops)


@st.composite
def cases(draw: Any) -> Case:
    d = draw(WIDTHS)
    ids = draw(st.booleans())
    head = draw(st.sampled_from(["", "tied", "untied"])) if ids else ""
    body = tuple(draw(st.lists(blocks(d), min_size=1, max_size=4)))
    root = draw(st.integers(0, 3))
    case = Case(d, ids, head, body, looped=root == 0, reordered=root == 1)
    return replace(case, plan=draw(plans(make_model(case, device="meta"))))


# ----------------------------------------------------------------------------- known defects
#
# The open failure classes found by this test (explore profile, tens of thousands of
# cases), one predicate each over a case's Facts: the generation draws a matching case
# again, and test_known_defect pins the class's minimal example as a strict xfail. The
# predicates say which plans fall in the class from the tree's data flow and the plan's
# ops, not from the library's own plan. See KNOWN_DEFECTS for each class's symptom.

class Defect(NamedTuple):
    """An open failure class: which cases it takes (``predicate``), what goes wrong and
    where (``reason``), and its smallest example (``minimal``, a strict xfail)."""

    predicate: Callable[[Facts], bool]
    reason: str
    minimal: Case


def _c(blocks: list[Block], *plan: tuple[Any, ...], dim: int = 8, ids: bool = False) -> Case:
    return Case(dim, ids, "", tuple(blocks), plan)


_MLP = Block("mlp", hidden=8, bias=False)
_GATED = Block("gated", hidden=8, bias=False)
_ATTN = Block("attn", heads=2, style="hf", bias=False)
_ADD = Block("branches", style="add", bias=False)
_NORM = Block("norm")
_MEGATRON_ATTN = (("shard", "0.q", 0, 1), ("shard", "0.k", 0, 1), ("shard", "0.v", 0, 1), ("shard", "0.o", 1, 1))

#: The open failure classes of the layout engine, excluded from the generation while open.
KNOWN_DEFECTS: dict[str, Defect] = {
    # none open: the last ones (stated srcs the plan did not check, gathers and splits inside
    # chains, a sharded module's output overridden, plan counts of gathered pairs) are closed,
    # and 9600 cases drawn with every class open (SLAPO_PROPERTY_KNOWN=1) kept the promise
}


def known_defects(case: Case) -> list[str]:
    facts = Facts.of(case)
    return [name for name, defect in KNOWN_DEFECTS.items() if defect.predicate(facts)]


def known_defect(case: Case) -> str | None:
    if os.environ.get("SLAPO_PROPERTY_KNOWN"):
        return None
    return next(iter(known_defects(case)), None)


# ----------------------------------------------------------------------------- the ranks


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def _diff(name: str, got: torch.Tensor | None, want: torch.Tensor | None) -> str | None:
    """``None`` if equal up to a tolerance relative to the reference's scale, else why."""
    if want is None or got is None:
        return None if got is None and want is None else f"{name}: gradient is {got} (reference: {want})"
    if tuple(got.shape) != tuple(want.shape):
        return f"{name}: shape {tuple(got.shape)} (reference {tuple(want.shape)})"
    err = (got.detach().float() - want.detach().float()).abs().max().item()
    scale = max(1.0, want.detach().abs().max().item())
    if not err <= 1e-4 * scale:  # also NaN
        return f"{name}: max abs diff {err:.3g} (reference max abs {scale:.3g})"
    return None


def _optim(params: Any) -> torch.optim.Optimizer:
    # eps large enough that gradients equal up to rounding give updates equal up to rounding
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3, foreach=True)


def _run_one(case: Case, mesh: Any) -> dict[str, Any]:
    from slapo_fn.dtensor.boundary import plan

    torch.manual_seed(1234)
    model = make_model(case)
    x = make_input(case)
    stage = "schedule"
    try:
        sch = apply_plan(sf.create_schedule(model, mesh=mesh), case.plan)
        stage = "build"
        built = sf.build(sch)
        # on DTensor activations the collectives are DTensor's: explain counts them on a fake run
        # (None where the model cannot run on fake tensors: explain then says they are unknown)
        given = x.clone().requires_grad_(True) if x.is_floating_point() else x  # as the run below
        on_dtensors = bool(plan(sch).on_dtensors)
        predicted = _fake_counts(sch, (given,)) if on_dtensors else plan(sch).counts()
    except sf.LayoutError as e:
        return {"status": "refused", "stage": stage, "why": str(e).splitlines()[0]}
    except Exception as e:  # any other error breaks the promise
        return {"status": "error", "stage": stage, "why": _raw(e)}
    # the reference: the original model (build copied it), on a copy of the input
    xr = x.clone().requires_grad_(True) if x.is_floating_point() else x
    facts = Facts.of(case)
    # a chain fed by the model's input and told that it arrives split (input_layout=Shard(1)):
    # the caller's promise, kept here by handing each rank its part of the sequence
    rank, world = mesh.get_local_rank(), mesh.size()
    # (a fwd_pre sync on the root that moves it states the model's input instead: whole unless its
    # src says split; one from a layout to itself moves nothing and states nothing)
    root_pre = [op for op in case.plan if op[0] == "sync" and op[1] == "" and op[2] == "fwd_pre"
                and op[3] != (op[4] or "R")]
    arrives_split = (root_pre[0][4] == "S(1)" if root_pre else
                     facts.sp_input is not None and facts.sp[0] == _top_path(facts.model, 0))
    xb = x.chunk(world, dim=1)[rank].clone() if arrives_split else x.clone()
    if x.is_floating_point():
        xb.requires_grad_(True)
    out_ref = model(xr)
    w = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(5))
    (out_ref * w).sum().backward()
    try:
        stage = "forward"
        with CountCollectives() as fwd:
            out = built(xb)
        stated = stated_output(case, model)
        if stated is not None and isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
            # the plan states the model's output sharded (vocab-parallel logits): compare it gathered
            dim = placement(stated).dim % out.dim()
            out = DTensor.from_local(out, mesh, [Shard(dim)]).full_tensor()
        if isinstance(out, DTensor) or tuple(out.shape) != tuple(out_ref.shape):
            return {"status": "mismatch", "stage": stage,
                    "why": _diff("output", _full(out), out_ref) or f"output is a {type(out).__name__}"}
        loss = (out * w).sum()
        stage = "backward"
        with CountCollectives() as bwd:
            loss.backward()
        stage = "compare"
        problems = [_diff("output", out, out_ref)]
        if x.is_floating_point():
            want = xr.grad.chunk(world, dim=1)[rank] if arrives_split and xr.grad is not None else xr.grad
            problems.append(_diff("input grad", xb.grad, want))
        ref_params = dict(model.named_parameters())
        built_params = dict(built.named_parameters())
        if sorted(ref_params) != sorted(built_params):
            problems.append(f"parameter names {sorted(built_params)} (reference {sorted(ref_params)})")
        for name, p in built_params.items():
            if not isinstance(p, DTensor):
                problems.append(f"{name}: not a DTensor ({type(p).__name__})")
            problems.append(_diff(f"grad {name}", _full(p.grad), ref_params[name].grad))
        stage = "optimizer step"
        _optim(built.parameters()).step()
        _optim(model.parameters()).step()
        stage = "compare"
        for name, p in built_params.items():
            problems.append(_diff(f"param {name} after AdamW", _full(p.detach()), ref_params[name].detach()))
    except Exception as e:
        return {"status": "error", "stage": stage, "why": _raw(e)}
    found = [p for p in problems if p is not None]
    if found:
        return {"status": "mismatch", "stage": "compare", "why": "; ".join(found[:4])}
    counted = {"forward": dict(fwd.seen), "backward": dict(bwd.seen)}
    if predicted is not None and counted != predicted:
        # on DTensor activations the prediction is explain's fake run, which misses what DTensor
        # redistributes inside an op (OPEN_STATUSES)
        return {"status": "fake-counts" if on_dtensors else "counts", "stage": "plan",
                "why": f"counted {counted}, plan predicted {predicted}"}
    return {"status": "equal"}


def _raw(e: BaseException) -> str:
    """The exception and the innermost frame of the library that raised it."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "slapo_fn" in f.filename.replace(os.sep, "/")]
    where = f" (at {frames[-1].filename.split('slapo_fn')[-1].lstrip('/')}:{frames[-1].lineno} " \
            f"in {frames[-1].name})" if frames else ""
    text = " ".join(str(e).split())[:300]
    return f"{type(e).__name__}: {text}{where}"


#: Statuses after which both ranks are known to have run the same collectives.
_IN_STEP = ("equal", "refused", "counts", "fake-counts")

#: Outcomes of an open defect outside the layout engine, kept apart from the promise (counted,
#: and pinned by a strict xfail): "fake-counts", explain's count of a plan run on DTensor
#: activations (``slapo_fn/dtensor/dryrun.py``'s fake run) short of what runs, because its
#: dispatch mode sees an op on DTensors before DTensor does and so never the collectives
#: DTensor issues inside it (CommDebugMode hands such ops back with NotImplemented).
OPEN_STATUSES = ("fake-counts",)
FAKE_COUNTS_MINIMAL = Case(16, False, "", (Block("mlp", hidden=8, act="relu", style="normed"),
                                           Block("functional", act="relu", bias=False, residual=True, extra=True)),
                           (("sync", "1.out", "fwd_post", "S(1)", None), ("shard", "0.fc1", 0, 1),
                            ("shard", "0.fc2", 0, 1)))


def _run_cases(rank: int, world: int, batch: list[Case]) -> list[dict[str, Any]]:
    """Run ``batch`` on this rank; stop after a case that raised or diverged, since the
    ranks may then be out of step (:func:`run_cases` resubmits the rest)."""
    from dist import mesh

    m = mesh((world,), ("tp",))
    out = []
    for case in batch:
        out.append(_run_one(case, m))
        if out[-1]["status"] not in _IN_STEP:
            break
    return out


def run_cases(pool_of: Callable[[], Any], cases: list[Case]) -> list[list[dict[str, Any]]]:
    """Per case, the results of every rank. ``pool_of()`` gives a live pool: one whose
    ranks fell out of step (a case failed differently on different ranks, e.g. one rank
    raised while the other waited in a collective) is killed and the next call starts a
    fresh one."""
    results: list[list[dict[str, Any]]] = []
    todo = list(cases)
    while todo:
        pool = pool_of()
        try:
            per_rank = pool.run(_run_cases, todo, timeout=300)
        except AssertionError as e:  # DistTimeout / RankError: the pool is gone or unusable
            pool.kill()
            error = {"status": "error", "stage": "pool", "why": " ".join(str(e).split())[:600]}
            results.append([error] * pool.world_size)
            todo = todo[1:]
            continue
        n = min(len(r) for r in per_rank)
        results += [[r[i] for r in per_rank] for i in range(n)]
        last = results[-1]
        if any(len(r) != n for r in per_rank) or len({(x["status"], x.get("why")) for x in last}) > 1:
            pool.kill()
        todo = todo[n:]
    return results


def verdict(case: Case, results: list[dict[str, Any]], open_statuses: tuple[str, ...] = OPEN_STATUSES) -> str | None:
    """``None`` if the case kept the promise on every rank (an outcome of ``open_statuses``
    aside), else a message to reproduce it."""
    bad = [(r, res) for r, res in enumerate(results) if res["status"] not in ("equal", "refused", *open_statuses)]
    statuses = {res["status"] for res in results}
    if not bad and len(statuses) == 1:
        return None
    what = "\n".join(f"  rank {r}: {res['status']} at {res.get('stage')}: {res.get('why', '')}"
                     for r, res in enumerate(results))
    return f"the promise does not hold:\n{what}\n{describe(case)}"


def check_case(case: Case, pool_of: Callable[[], Any]) -> tuple[str, str]:
    """Run one case; (status, why) of rank 0, raising AssertionError if it broke the promise."""
    per_rank = run_cases(pool_of, [case])[0]
    message = verdict(case, per_rank)
    assert message is None, message
    return per_rank[0]["status"], per_rank[0].get("why", "")


def _settings(n: int) -> Callable[[Any], Any]:
    # no shrinking: a failing batch reports each failing case whole (its repro), and
    # shrinking a batch would cost a pool call per step
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


def test_layouts_are_right_or_refused(dist_pool: Any) -> None:
    """BATCHES Hypothesis examples, each a batch of BATCH cases run in one call of the
    session's 2-rank pool (``dist_pool(2)`` is the pool ``dist2`` gives; taken per call, so
    that a pool killed after its ranks fell out of step is started afresh). Cases of an open
    failure class (KNOWN_DEFECTS) are drawn again; the counts of each outcome are printed."""
    stats: dict[str, int] = {}
    t0 = time.monotonic()

    @_settings(BATCHES)
    @given(st.data())
    def batch(data: st.DataObject) -> None:
        todo: list[Case] = []
        for _ in range(BATCH * 8):  # excluded cases are drawn again, a bounded number of times
            if len(todo) == BATCH:
                break
            case = data.draw(cases())
            name = known_defect(case)
            if name is not None:
                stats[f"skipped ({name})"] = stats.get(f"skipped ({name})", 0) + 1
                continue
            todo.append(case)
        results = run_cases(lambda: dist_pool(2), todo)
        failures = []
        for case, per_rank in zip(todo, results, strict=True):
            status = per_rank[0]["status"]
            stats[status] = stats.get(status, 0) + 1
            stats["cases"] = stats.get("cases", 0) + 1
            message = verdict(case, per_rank)
            if message is not None:
                failures.append(message)
        assert not failures, f"{len(failures)} of {len(todo)} cases broke the promise:\n" + "\n\n".join(failures)

    batch()
    print(f"\nlayout properties: {stats.get('cases', 0)} cases in {time.monotonic() - t0:.1f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(stats.items()) if k != "cases"))
    assert stats.get("cases", 0) >= (MIN_CASES if BATCHES >= DEFAULT_BATCHES else BATCHES * BATCH // 2), stats
    # most random plans are refused (a chain with no column to gather it, a tie split one way); about a
    # fifth run, give or take 9 of 480 (the draws change with the strategies' code): a sixth must
    assert stats.get("equal", 0) >= stats["cases"] // 6, f"too few cases ran to the end: {stats}"


#: Minimal examples of classes closed since (and cases the explore profile found): each must
#: now equal the single-process model or be refused before running.
CLOSED: dict[str, Case] = {
    # paired by module order in an untraceable parent; now traced (shapes unpacked into arguments)
    "sibling-order": _c([_ATTN], ("shard", "0.q", 0, 1), ("shard", "0.k", 0, 1), ("shard", "0.v", 1, 1),
                        ("shard", "0.o", 1, 1)),
    "equal-in-columns": _c([_ATTN], ("shard", "0.q", 0, 1), ("shard", "0.o", 0, 1)),
    # a head count in an attribute of no known name (self.nh): refused from the traced view, until
    # the trace told that nh sizes the heads and nothing else (traced again with nh doubled); equal
    "head-attr": _c([Block("attn", heads=2, style="fixed", bias=False)], *_MEGATRON_ATTN),
    # nh read for a scale too: not made this rank's (the scale would change); refused at build
    "head-attr-read-for-more-than-sizes": _c([Block("attn", heads=2, style="fixed-scaled", bias=False)],
                                             *_MEGATRON_ATTN),
    # the plan fills in every sync's src, the runtime reads it
    "sp-sync-default-src": _c([_NORM, _NORM], ("sp", ("0", "1"), None), ("sync", "1", "fwd_post", "R", None)),
    "sp-sync-default-src-pre": _c([_MLP, _MLP], ("sp", ("0", "1"), None), ("sync", "1.fc1", "fwd_pre", "R", None)),
    "stacked-syncs": _c([_NORM], ("sync", "0", "fwd_post", "S(1)", None), ("sync", "0", "fwd_post", "R", None)),
    "stacked-syncs-nested": _c([_MLP], ("sync", "0.fc2", "fwd_post", "S(1)", None),
                               ("sync", "0", "fwd_post", "R", None)),
    "stacked-feature-syncs": _c([_NORM], ("sync", "0", "fwd_pre", "S(-1)", None),
                                ("sync", "0", "fwd_pre", "S(-1)", None)),
    "pair-pre-sync-default-src": _c([Block("chain", widths=(8,), bias=False)], ("shard", "0.0", 0, 1),
                                    ("shard", "0.2", 1, 1), ("sync", "0.2", "fwd_pre", "S(-1)", None)),
    # input_layout=Shard(1) on a chain that the module before it hands the whole sequence
    "sp-input-unchecked-in-model": _c([_MLP, _MLP], ("shard", "1.fc1", 0, 1), ("shard", "1.fc2", 1, 1),
                                      ("sp", ("1",), "S(1)")),
    # found by the explore profile
    "no-op-sync-hid-a-token-shard": _c([Block("mlp", hidden=16, act="relu", bias=False)],
                                       ("sync", "0.act", "fwd_post", "S(-1)", "S(-1)"),
                                       ("sync", "0.fc1", "fwd_post", "S(1)", None), dim=16),
    "gate-split-by-a-sync-beside-an-up-column": _c([Block("gated", hidden=8, act="relu", residual=True)],
                                                   ("shard", "0.up", 0, 1), ("shard", "0.down", 1, 1),
                                                   ("sync", "0.gate", "fwd_post", "S(-1)", "R"), dim=16),
    "split-output-under-a-root-sync": _c([Block("functional", bias=False)], ("sync", "", "fwd_post", "R", None),
                                         ("sync", "0.act", "fwd_pre", "S(-1)", "R"), dim=16),
    "split-gate-meets-a-row-up": _c([Block("gated", hidden=16, bias=False)], ("shard", "0.up", 1, 1),
                                    ("shard", "0.down", 1, 1), ("sync", "0.gate", "fwd_post", "S(-1)", None), dim=16),
    "partial-src-on-a-torch-linear": _c([_MLP], ("sync", "0.fc1", "fwd_post", "R", "P")),
    "column-kept-split-meets-a-row": _c([Block("branches", bias=False, style="mul")], ("shard", "0.a", 0, 1),
                                        ("shard", "0.b", 1, 1), ("sync", "0.a", "fwd_post", "S(-1)", "R"), dim=16),
    "root-src-contradicts-a-child-sync": _c([Block("chain", widths=(16,))], ("sync", "0.2", "fwd_post", "S(-1)", None),
                                            ("sync", "", "fwd_post", "S(-1)", "R")),
    # plan counts: a row splitting an input that syncs gathered (or left whole), a column gathering one
    "pair-gathered-counts": _c([_MLP], ("shard", "0.fc1", 0, 1), ("shard", "0.fc2", 1, 1),
                               ("sync", "0.fc1", "fwd_post", "R", None)),
    "pair-pre-sync-gathered-counts": _c([_MLP], ("shard", "0.fc1", 0, 1), ("shard", "0.fc2", 1, 1),
                                        ("sync", "0.fc2", "fwd_pre", "R", "S(-1)")),
    "feature-pre-sync-counts": _c([_ADD], ("shard", "0.b", 1, 1), ("sync", "0.b", "fwd_pre", "S(-1)", "S(-1)")),
    "column-pre-split-counts": _c([_MLP], ("shard", "0.fc1", 0, 1), ("sync", "0.fc1", "fwd_pre", "S(-1)", None)),
    "row-pre-src-contradicts-its-input": _c([_ADD], ("shard", "0.b", 1, 1), ("sync", "0.b", "fwd_pre", "R", "S(-1)")),
    # a fwd_post sync overriding a sharded module's output where its consumer expects the role's own
    "role-output-sync": _c([_ADD], ("shard", "0.a", 1, 1), ("sync", "0.a", "fwd_post", "S(-1)", None)),
    "one-of-a-pair-gathered": _c([_ATTN], *_MEGATRON_ATTN, ("sync", "0.q", "fwd_post", "R", None)),
    "column-pre-split-enters-alone": _c([Block("attn", heads=2, style="fixed", bias=False)],
                                        ("shard", "0.q", 0, 1), ("shard", "0.v", 0, 1),
                                        ("sync", "0.q", "fwd_pre", "S(-1)", "R")),
    # input_layout=Shard(1) on a chain fed by the model's input: each rank is handed its part
    "sp-input-from-the-model": _c([_MLP], ("shard", "0.fc1", 0, 1), ("shard", "0.fc2", 1, 1), ("sp", ("0",), "S(1)")),
    # a gather inside a chain for one module alone
    "sp-inner-replicate": _c([_GATED], ("shard", "0.gate", 0, 1), ("shard", "0.up", 0, 1), ("shard", "0.down", 1, 1),
                             ("sync", "0.gate", "fwd_pre", "R", "S(1)"), ("sp", ("0",), None)),
    "row-split-by-a-src-it-ignores": _c([Block("gated", hidden=8, bias=False, residual=True)],
                                        ("shard", "0.down", 1, 1), ("sync", "0.down", "fwd_post", "S(-1)", "S(-1)")),
    "split-then-gathered-by-stacked-syncs": Case(8, True, "untied", (Block("branches", bias=False, style="mul",
                                                                      residual=True),),
                                                 (("shard", "2", 1, 1), ("shard", "1.a", 1, 1), ("shard", "0", 0, 1),
                                                  ("sync", "1", "fwd_post", "S(-1)", "R"),
                                                  ("sync", "1", "fwd_post", "R", None))),
    "partial-src-nothing-makes": _c([_MLP], ("sync", "0", "fwd_post", "R", "P")),
    "feature-src-nothing-makes": _c([_MLP, _MLP], ("sync", "1", "fwd_pre", "R", "S(-1)")),
    "token-src-nothing-makes": _c([_NORM], ("sync", "", "fwd_post", "R", "S(1)")),
    # src= checked against the data flow (arriving._Features) and the schedule (statements._unsourced)
    "src-unchecked": _c([_MLP, _MLP], ("shard", "0.fc1", 0, 1), ("sync", "1", "fwd_post", "R", "S(-1)")),
    "bwd-partial-nothing-makes": _c([Block("mlp", hidden=16, residual=True), Block("chain", act="relu")],
                                    ("sync", "", "bwd_post", "R", "P")),
    "chain-member-pre-src": _c([_NORM], ("sync", "0", "fwd_pre", "S(1)", "R"), ("sp", ("0",), None)),
    "pair-in-a-chain-pre-src": _c([_GATED], ("shard", "0.gate", 0, 1), ("shard", "0.up", 0, 1),
                                  ("shard", "0.down", 1, 1), ("sync", "0.down", "fwd_pre", "S(-1)", "P"),
                                  ("sp", ("0",), None)),
    "after-a-chain-exit-src": _c([_NORM, _NORM, _MLP], ("shard", "2.fc1", 0, 1), ("shard", "2.fc2", 1, 1),
                                 ("sync", "2", "fwd_post", "S(-1)", "S(1)"), ("sp", ("0", "1"), None)),
    # found with every class open (SLAPO_PROPERTY_KNOWN=1)
    "row-fed-split-by-a-pointwise-pre-sync": Case(16, True, "tied", (
        Block("gated", hidden=16, act="relu", norm=True),
        Block("functional", act="relu", bias=False, residual=True, extra=True)), (
        ("shard", "0", 0, 1), ("shard", "1.gate", 0, 2), ("shard", "1.down", 1, 1), ("shard", "2.out", 1, 1),
        ("shard", "3", 0, 1), ("sync", "2.act", "fwd_pre", "S(-1)", None), ("sync", "3", "fwd_post", "R", None))),
    "token-split-inside-a-chain": _c([Block("gated", hidden=8, act="relu")], ("shard", "0.gate", 0, 1),
                                     ("sp", ("0",), None), ("shard", "0.up", 0, 1),
                                     ("sync", "0.down", "fwd_pre", "S(-1)", "S(-1)"),
                                     ("sync", "0.up", "fwd_pre", "S(1)", None), ("shard", "0.down", 1, 1)),
    "column-kept-split-into-a-plain-linear": Case(16, True, "untied", (Block("chain", residual=True),), (
        ("shard", "1.body.0", 0, 1), ("sync", "1.body.0", "fwd_post", "S(-1)", None),
        ("sync", "1.body", "bwd_post", "R", "R"), ("shard", "2", 0, 1), ("shard", "0", 0, 1))),
    "synced-gate-beside-a-column-in-a-chain-member": _c(
        [Block("gated", hidden=8, act="relu", bias=False, norm=True, residual=True)],
        ("sync", "0.norm", "bwd_post", "R", "R"), ("shard", "0.up", 0, 1),
        ("sync", "0.gate", "fwd_post", "S(-1)", None), ("shard", "0.down", 1, 1), ("sp", ("0",), None)),
    "column-output-token-split-in-a-chain": _c([Block("mlp", hidden=8, norm=True)], ("shard", "0.fc1", 0, 1),
                                               ("shard", "0.fc2", 1, 1), ("sync", "0.fc1", "fwd_post", "S(1)", None),
                                               ("sp", ("0",), None), dim=16),
    "column-member-pre-split": _c([Block("chain", act="relu", widths=(8, 8), flat=True)], ("shard", "4", 0, 1),
                                  ("sync", "4", "fwd_pre", "S(-1)", None), ("sp", ("4",), None), dim=16),
    "unpaired-column-kept-split-into-a-head-view": _c([Block("attn", heads=2, style="hf")], ("shard", "0.k", 0, 1),
                                                      ("sync", "0.k", "fwd_post", "S(-1)", None)),
    "split-sync-into-a-head-view": _c([Block("attn", heads=1, style="infer", bias=False)],
                                      ("shard", "0.q", 0, 1), ("shard", "0.o", 1, 1),
                                      ("sync", "0.q", "fwd_post", "S(-1)", "S(1)"), dim=16),
    # a second fwd_pre sync from Shard(-1) after one to Replicate(): it gathered a whole input again
    "stacked-pre-syncs-from-another-layout": _c([Block("gated", hidden=8, bias=False)], ("shard", "0.up", 0, 1),
                                                ("shard", "0.down", 0, 1), ("sync", "", "fwd_pre", "R", None),
                                                ("sync", "", "fwd_pre", "R", "S(-1)")),
    # a token split before a pointwise module whose output is the model's: returned split, unstated
    "token-split-into-the-result": _c([Block("functional")], ("sync", "0.act", "fwd_pre", "S(1)", "R")),
    # a column kept split by a sync, the last of a residual's body: x + body(x) met the split a level up
    "column-kept-split-out-of-a-residual-body": _c([Block("chain", residual=True)], ("shard", "0.body.0", 0, 1),
                                                   ("sync", "0.body.0", "fwd_post", "S(-1)", None), dim=16),
    # a sync from Replicate() to itself on a chain's last member took the place of the exit's gather
    "same-layout-sync-at-a-chain-exit": _c([Block("chain", widths=(8,), flat=True)], ("shard", "2", 0, 1),
                                           ("sync", "0", "fwd_post", "R", "R"), ("sp", ("0",), None)),
    # columns held in the root's ModuleList: entries keyed by the value they read (the root's flow),
    # not by their widths, which counted one backward all-reduce for two
    "columns-in-a-module-list": replace(_c([Block("chain", act="relu", bias=False, widths=(16, 16), flat=True)],
                                           ("shard", "layers.0", 0, 1), ("shard", "layers.4", 0, 1), dim=16),
                                        looped=True),
    # a Megatron pair held directly in the root's ModuleList: paired by the root's flow
    "pair-in-a-module-list": replace(_c([Block("chain", act="relu", bias=False, widths=(16, 16), flat=True)],
                                        ("shard", "layers.0", 0, 1), ("shard", "layers.2", 1, 1),
                                        ("shard", "layers.4", 0, 1), dim=16), looped=True),
    # a row's fwd_pre sync to Shard(-1) without src, after a sync that split the features: from Replicate()
    # it split them again ((8x2) for (8x4)); its src is now what the flow brings
    "pre-sync-after-a-split": _c([Block("chain", bias=False, widths=(8, 8))], ("shard", "0.0", 0, 1),
                                 ("shard", "0.2", 1, 1), ("shard", "0.4", 1, 1),
                                 ("sync", "0.4", "fwd_pre", "S(-1)", None), ("sync", "0.3", "fwd_post", "S(-1)", None)),
    # a token split "gathered back" by a fwd_pre sync without src=, which takes its input as Replicate()
    "token-split-gathered-without-src": _c([_NORM, Block("functional", bias=False, extra=True)],
                                           ("shard", "1.out", 1, 1), ("sync", "1.act", "fwd_post", "S(1)", None),
                                           ("sync", "1.out", "fwd_pre", "R", None)),
    # a column kept split into a block that holds a row but takes its input into a norm first
    "column-kept-split-into-a-norm-before-a-row": _c(
        [_ATTN, Block("layer", hidden=8, bias=False, heads=4, style="fixed", extra=True)],
        ("shard", "0.o", 0, 1), ("sync", "0.o", "fwd_post", "S(-1)", None), ("shard", "1.attn.o", 1, 1), dim=16),
    # src=Partial() on a column's input inside a chain: reduce-scattered a whole value (wrong numbers)
    "partial-src-inside-a-chain": _c([Block("mlp", hidden=8, act="relu", bias=False)], ("shard", "0.fc1", 0, 1),
                                     ("shard", "0.fc2", 1, 1), ("sync", "0.fc1", "fwd_pre", "S(-1)", "P"),
                                     ("sp", ("0",), None), dim=16),
    # a token split handed on by a pointwise module with a (backward) sync of its own reached a lone
    # column and the model's result unrefused: half the sequence
    "token-split-through-a-synced-activation": _c(
        [Block("chain", bias=False, widths=(16, 8), flat=True)], ("shard", "2", 0, 1), ("shard", "4", 0, 1),
        ("sync", "3", "bwd_post", "R", "R"), ("sync", "2", "fwd_post", "S(1)", None)),
    # the chain's exit gathers the last member's output where a row inside it states Shard(1): the test
    # took the model's result as split
    "row-in-the-last-member-states-a-token-shard": _c(
        [Block("mlp", hidden=16)], ("shard", "0.fc1", 0, 1), ("shard", "0.fc2", 1, 1),
        ("sync", "0.fc2", "fwd_post", "S(1)", None), ("sp", ("0",), None), dim=16),
    # a row's output reduce-scattered over the features, added to its whole sibling in the parent's code
    # (a raw shape error): the check looked only at the rows beyond the parent
    "row-split-by-features-beside-a-whole-branch": _c(
        [Block("branches", style="add", bias=False), Block("chain", widths=(16,), flat=True)],
        ("shard", "0.a", 1, 1), ("shard", "0.b", 1, 1), ("sync", "0.a", "fwd_post", "S(-1)", "P"),
        ("shard", "1", 1, 1)),
    # a fwd_pre sync on a column inside a chain member: it split and gathered its input apart from the
    # entry its parent made for its columns (wrong numbers)
    "column-sync-inside-a-chain-member": _c(
        [Block("gated", hidden=8, bias=False, residual=True)], ("shard", "0.gate", 0, 1), ("shard", "0.up", 0, 1),
        ("shard", "0.down", 1, 1), ("sync", "0.up", "fwd_pre", "S(-1)", "R"), ("sp", ("0",), None), dim=16),
    # q/k/v and o paired by module order in an attention fx cannot trace, viewed by a head count of a
    # name slapo_fn does not know: this rank's features taken for whole heads (wrong numbers); refused
    "untraced-attention-pair": _c([Block("attn", heads=2, style="untraced", bias=False)], *_MEGATRON_ATTN),
    # the same with the columns gathered: the code sees whole heads, the row splits its input
    "untraced-attention-pair-gathered": _c(
        [Block("attn", heads=2, style="untraced", bias=False)], *_MEGATRON_ATTN,
        *(("sync", f"0.{c}", "fwd_post", "R", None) for c in "qkv")),
    # in an attention fx cannot trace, columns v and o of one input width were counted as one entry
    # (one backward all-reduce) though o reads the attention's output: the plan predicted one too few
    "untraced-columns-of-one-width-enter-apart": _c(
        [Block("attn", heads=2, style="untraced", bias=False)], ("shard", "0.v", 0, 2), ("shard", "0.o", 0, 1)),
    # a column's output kept split by a fwd_post sync, taken by the code of an attention fx cannot trace
    # (its residual add: a raw shape error); the flow being unknown, it was trusted
    "column-kept-split-into-untraced-code": _c(
        [Block("attn", heads=4, style="untraced", residual=True)], ("shard", "0.o", 0, 1),
        ("sync", "0.o", "fwd_post", "S(-1)", None), ("shard", "0.q", 0, 1)),
    # a row first in a chain after an activation whose fwd_pre sync splits the features: the row takes
    # them as they arrive, but the plan counted a split of its own (one backward all-gather too many)
    "row-in-a-chain-after-a-split-activation": _c(
        [Block("chain", bias=False, widths=(16,), flat=True)], ("shard", "0", 0, 2), ("shard", "2", 1, 1),
        ("sync", "1", "fwd_pre", "S(-1)", None), ("sp", ("2",), None), dim=16),
    # a root sync from S(1) over a model whose chain (the head alone) ends inside it: the chain's exit
    # gathers the sequence, so the root sync gathered it twice (twice the sequence length)
    "token-src-on-a-module-holding-the-chain-exit": Case(
        8, True, "untied", (Block("mlp", hidden=16, norm=True, residual=True),),
        (("shard", "layers.0", 0, 1), ("shard", "layers.1.fc1", 0, 2), ("shard", "layers.2", 0, 1),
         ("sync", "", "fwd_post", "R", "S(1)"), ("sp", ("layers.2",), None)), looped=True),
    # wrong numbers (OPT's view): q/k/v gathered by syncs before a row o, but build made the head
    # count this rank's as for kept columns, so view(B, -1, self.num_heads, ...) on the whole output
    # doubled the sequence
    "gathered-pair-keeps-its-head-count": _c(
        [Block("attn", heads=2, style="hf-seq", bias=False)], *_MEGATRON_ATTN,
        *(("sync", f"0.{c}", "fwd_post", "R", None) for c in "qkv")),
    # a stated Shard(-1) src believed because a sync elsewhere split features: one from a layout to
    # itself on the root, or one splitting the model's result, splits nothing any module reads
    "src-believed-for-a-root-sync-to-itself": _c(
        [Block("attn", heads=4, style="untraced", norm=True, bias=False)], ("shard", "0.k", 0, 1),
        ("sync", "", "fwd_post", "S(-1)", "S(-1)"), ("sync", "0", "fwd_post", "R", "S(-1)")),
    # wrong numbers: a row's fwd_pre src=Partial() in an attention fx cannot trace was left to the
    # data flow (which cannot tell there), so the sync summed the ranks' whole copies of its input
    "row-input-stated-partial-in-untraced-code": _c(
        [Block("attn", heads=4, style="untraced", norm=True, bias=False)], ("shard", "0.k", 1, 1),
        ("sync", "0.k", "fwd_pre", "R", "P")),
    # explain counts: stacked fwd_pre syncs (to Shard(-1), then to Replicate()) leave the module the
    # last one's layout; the plan read the first (a row's own split, a column's gather miscounted)
    "stacked-pre-syncs-row": _c([Block("mlp", hidden=8, act="relu")], ("shard", "0.fc1", 1, 1),
                                ("sync", "0.fc1", "fwd_pre", "S(-1)", None), ("sync", "0.fc1", "fwd_pre", "R", None)),
    "stacked-pre-syncs-column": _c(
        [Block("mlp", hidden=8, act="relu")], ("shard", "0.fc1", 0, 1),
        ("sync", "0.fc1", "fwd_pre", "S(-1)", None), ("sync", "0.fc1", "fwd_pre", "R", None)),
    "src-believed-for-a-split-of-the-result": _c(
        [Block("attn", heads=4, style="untraced", norm=True, bias=False)], ("shard", "0.k", 0, 1),
        ("sync", "", "fwd_post", "S(-1)", None), ("sync", "0", "fwd_post", "R", "S(-1)")),
    # raw shape error: an activation's fwd_post sync without src= was taken to convert from
    # Replicate(), though its own fwd_pre sync had split what it passes on (nothing gathered)
    "pointwise-post-sync-after-its-own-split": _c(
        [Block("gated", hidden=16, act="relu")], ("shard", "0.gate", 0, 1), ("shard", "0.up", 0, 1),
        ("shard", "0.down", 1, 1), ("sync", "0.act", "fwd_pre", "S(-1)", None),
        ("sync", "0.act", "fwd_post", "R", None)),
    # raw shape error: a token shard made inside code fx cannot trace met the whole sequence
    # there (a residual add); nothing after it gathered it back or took it
    "token-shard-into-untraced-code": _c([Block("attn", bias=False, heads=2, style="untraced", residual=True)],
                                         ("sync", "0.o", "fwd_post", "S(1)", None), dim=16),
    # wrong numbers: a norm over the features between a Megatron pair, after an activation module
    # (the walk from fc1 stopped at the module call instead of looking through it)
    "feature-norm-after-an-activation": _c([Block("mlp", hidden=16, style="normed")], ("shard", "0.fc1", 0, 1),
                                           ("shard", "0.fc2", 1, 1)),
    # explain counts: a row's fwd_pre sync from Replicate() to itself was believed over the data
    # flow, which brings the column's kept split (its fwd_post sync to Shard(-1)): a local split
    # counted that never ran
    "row-self-sync-over-a-kept-split": _c(
        [Block("mlp", hidden=16, bias=False)], ("shard", "0.fc1", 0, 1), ("shard", "0.fc2", 1, 1),
        ("sync", "0.fc1", "fwd_post", "S(-1)", None), ("sync", "0.fc2", "fwd_pre", "R", "R"), dim=16),
    # wrong numbers: an activation's fwd_pre sync split its input by features, so its output was
    # this rank's features too, and the norm over them after it ran on that share
    "feature-norm-after-an-activation-split-on-entry": _c(
        [Block("mlp", hidden=16, style="normed")], ("shard", "0.fc2", 1, 1),
        ("sync", "0.act", "fwd_pre", "S(-1)", "R")),
    # refused at the first forward: code over dimension 0 of a column's output was read with
    # the output taken as 3-D, though the code's own reshape(-1, d) made it 2-D
    "rows-of-a-2d-activation-kept-split": _c(
        [Block("mlp", hidden=8, style="flat-rows", residual=True)], ("shard", "0.fc1", 0, 1), ("shard", "0.fc2", 1, 1)),
    "rows-of-a-2d-activation-split-on-entry": _c(
        [Block("mlp", hidden=8, style="flat-rows", residual=True)], ("shard", "0.fc2", 1, 1),
        ("sync", "0.act", "fwd_pre", "S(-1)", None)),
    # explain counted a split (and its backward all-gather) at BERT's output row: what reached its
    # parent's first argument was read together with the residual beside it
    "row-across-parents-after-a-sync-keeping-the-split": _c(
        [Block("bert", hidden=8, bias=False, heads=2)], ("sync", "0.inter.dense", "fwd_post", "S(-1)", None),
        ("shard", "0.out.dense", 1, 1), ("shard", "0.inter.dense", 0, 1), dim=16),
    # BERT's attention.self_ with only v sharded, under SP: it gathers the sequence for q and k
    # too, and the reduce-scatter of the gradient came back summed their whole gradients over the
    # ranks (and q's and k's weights had theirs all-reduced again): wrong gradients, silently.
    # Found by the explore profile; the gather now slices the gradient back and v enters itself
    "gather-shared-with-unsharded-q-k": _c(
        [Block("bert", hidden=8, act="relu", heads=2)], ("shard", "0.attention.self_.v", 0, 1),
        ("shard", "0.attention.output.dense", 1, 1), ("shard", "0.inter.dense", 0, 1), ("shard", "0.out.dense", 1, 1),
        ("sp", ("0",), None)),
    # OPT's view back by the input's shape (y.view(x.shape)) of an output a sync kept split by
    # features: a raw shape error inside the model's code at the first forward; refused at build
    "split-output-viewed-by-another-shape": _c(
        [Block("mlp", hidden=8, bias=False, style="flat-rows")], ("shard", "0.fc1", 0, 1),
        ("sync", "0.fc2", "fwd_post", "S(-1)", None)),
    # q run on the whole sequence inside attention that nothing gathers for: q's rows came
    # back to this rank's tokens, and attention ran over them alone (wrong numbers); the first
    # draw of modules run whole found it, before any build refused it
    "whole-q-inside-ungathered-attention": _c(
        [Block("attn", bias=False, heads=1, style="hf")], ("sp", ("0",), None), ("sync", "0.q", "fwd_pre", "R", None),
        ("sync", "0.q", "fwd_post", "S(1)", None)),
    # a module run whole after a column, which hands on the whole sequence: gathered again, it
    # would see it twice; refused at build
    "whole-after-a-column": _c(
        [Block("mlp", hidden=8, residual=True)], ("shard", "0.fc1", 0, 1), ("shard", "0.fc2", 1, 1),
        ("sp", ("0",), None), ("sync", "0.act", "fwd_pre", "R", "S(1)"), ("sync", "0.act", "fwd_post", "S(1)", "R")),
    # before the column: equal
    "whole-before-a-column": _c(
        [Block("mlp", hidden=8, residual=True, norm=True)], ("shard", "0.fc1", 0, 1), ("shard", "0.fc2", 1, 1),
        ("sp", ("0",), None), ("sync", "0.norm", "fwd_pre", "R", None), ("sync", "0.norm", "fwd_post", "S(1)", None)),
    # wrong numbers (half the sequence out): a GELU's fwd_post Shard(1) sync after a Linear whose
    # own sync already split its output took its input for Replicate() and split it again; the
    # layout a lone feeder's sync states is now what arrives
    # a pointwise module's fwd_post sync stated before its fwd_pre one: its default src read the
    # input's layout before that sync was resolved, so it gathered nothing (a raw shape error)
    "post-sync-stated-before-the-pre-sync": _c([Block("gated", hidden=16)], ("sync", "0.act", "fwd_post", "R", None),
                                              ("sync", "0.act", "fwd_pre", "S(-1)", None)),
    # the test's own reading: BERT's output block ends in its norm, whose fwd_post sync states the
    # model's output split by features (the explore compared it whole)
    "output-split-by-the-last-norm-s-sync": _c([Block("bert", hidden=8, heads=4)],
                                              ("sync", "0.out.norm", "fwd_post", "S(-1)", "R"),
                                              ("shard", "0.out.dense", 0, 1), dim=16),
    "split-again-after-a-feeder-s-split": Case(
        8, True, "", (Block("chain", widths=(16,), flat=True),),
        (("sync", "1", "fwd_post", "S(1)", None), ("sync", "2", "fwd_post", "S(1)", None), ("sp", ("3",), "S(1)"))),
    # BLOOM's and Falcon's fused q|k|v per head, with a bias for every head handed in by the block
    # that holds the attention: refused at build before (head counts of no column's features), equal
    "grouped-heads-bias-merged-with-the-batch": _c(
        [_NORM, Block("fused", bias=False, heads=2, style="grouped", act="gelu", extra=True)],
        ("shard", "1.attn.qkv", 0, 1), ("shard", "1.attn.o", 1, 1)),
    "grouped-heads-bias-viewed-by-heads": _c(
        [_NORM, Block("fused", bias=False, heads=4, style="grouped-infer", act="relu", extra=True)],
        ("shard", "1.attn.qkv", 0, 1), ("shard", "1.attn.o", 1, 1)),
    # raw shape error: that block, a chain member, built its bias from this rank's tokens
    # (bsz, s = x.shape[:2]; arange(s)): a block holding attention was taken for attention, its own
    # code not read; refused at build
    "grouped-heads-bias-built-from-a-token-shard": _c(
        [_NORM, Block("fused", bias=False, heads=2, style="grouped", act="gelu", extra=True)],
        ("shard", "1.attn.qkv", 0, 1), ("shard", "1.attn.o", 1, 1), ("sp", ("1",), None)),
}


@pytest.mark.parametrize("name", list(CLOSED))
def test_closed_class_holds(dist_pool: Any, name: str) -> None:
    check_case(CLOSED[name], lambda: dist_pool(2))


def test_a_chain_runs_in_the_order_its_parent_calls_it_not_module_order(dist_pool: Any) -> None:
    """A root that registers its blocks last first (OPT's decoder registers its final norm
    before its layers): a chain over the MLP and the norm called after it, then a column
    head, runs equal. Ordered by registration, the norm looked like the chain's first member
    and the head like a module run between two members: refused, naming the head."""
    case = replace(Case(8, True, "untied", (Block("mlp", hidden=16), Block("norm")), plan=(
        ("shard", "b1.fc1", 0, 1), ("shard", "b1.fc2", 1, 1), ("sp", ("b1", "b2"), None), ("shard", "b3", 0, 1))),
        reordered=True)
    assert [n for n, _ in make_model(case, "meta").named_children()] == ["b3", "b2", "b1", "b0"]
    assert check_case(case, lambda: dist_pool(2)) == ("equal", "")


def test_a_norm_between_a_column_and_its_row_runs_whole_where_its_parent_gathers_the_sequence(
        dist_pool: Any) -> None:
    """A LayerNorm over an MLP's hidden features (NormFormer's; OLMo2's q/k norms over the
    whole projection) keeps the column from its row, so the column gathers its features.
    Inside a chain member, the MLP (the member's child) gathers the sequence for the column,
    the norm runs on the whole sequence, and the row splits its whole input and reduce-
    scatters the sequence back: equal. Where the MLP is the member itself, its children run
    on the sequence shard, so the norm's gradient would be summed again on local shards:
    the model runs on DTensor activations, equal."""
    layer = Block("layer", hidden=16, heads=2, act="relu")
    attn = (*(("shard", f"0.attn.{n}", 0, 1) for n in "qkv"), ("shard", "0.attn.o", 1, 1))
    mlp = (("shard", "0.mlp.fc1", 0, 1), ("shard", "0.mlp.fc2", 1, 1))
    assert check_case(_c([layer, Block("norm")], *attn, *mlp, ("sp", ("0", "1"), None)),
                      lambda: dist_pool(2)) == ("equal", "")
    alone = Block("mlp", hidden=16, style="mid-norm")
    status, why = check_case(_c([alone, Block("norm")], ("shard", "0.fc1", 0, 1), ("shard", "0.fc2", 1, 1),
                                ("sp", ("0", "1"), None)), lambda: dist_pool(2))
    assert status == "equal", why


_BERT = Block("bert", hidden=16, bias=True, heads=2)
_BERT_PLAN = (("shard", "0.attention.self_.q", 0, 1), ("shard", "0.attention.self_.k", 0, 1),
              ("shard", "0.attention.self_.v", 0, 1), ("shard", "0.attention.output.dense", 1, 1),
              ("shard", "0.inter.dense", 0, 1), ("shard", "0.out.dense", 1, 1))


@pytest.mark.parametrize("sp", [(), ("0",), ("0", "1")], ids=["tp", "sp", "sp-two-layers"])
def test_bert_layout_runs_equal_with_and_without_sequence_parallelism(dist_pool: Any, sp: tuple[str, ...]) -> None:
    """Columns and rows in sibling modules (BERT's layout) pair across their parents: with
    sequence parallelism too, equal to the single-process model, not refused."""
    blocks = [_BERT, _BERT] if len(sp) == 2 else [_BERT]
    plan = _BERT_PLAN + tuple((op[0], op[1].replace("0.", "1.", 1), *op[2:]) for op in _BERT_PLAN if len(sp) == 2)
    status, why = check_case(_c(blocks, *plan, *((("sp", sp, None),) if sp else ())), lambda: dist_pool(2))
    assert status == "equal", why


@pytest.mark.parametrize("style", ["flat", "flat-rows"])
def test_an_mlp_on_the_batch_and_tokens_merged_runs_equal(dist_pool: Any, style: str) -> None:
    """OPT's MLP (``x.reshape(-1, x.size(-1))``, viewed back by ``x``'s shape) in a
    sequence-parallel chain: each row is a token, so the Megatron plan runs equal on local
    shards; code over the rows (a softmax over every token) runs on DTensor activations."""
    mlp = Block("mlp", hidden=16, bias=True, norm=True, residual=True, style=style)
    plan = (("shard", "0.fc1", 0, 1), ("shard", "0.fc2", 1, 1), ("shard", "1.fc1", 0, 1), ("shard", "1.fc2", 1, 1),
            ("sp", ("0", "1"), None))
    status, why = check_case(_c([mlp, mlp], *plan), lambda: dist_pool(2))
    assert status == "equal", why


def test_each_minimal_example_is_in_its_own_class_only() -> None:
    """The exclusions are exact enough that each minimal example matches one class."""
    for name, defect in KNOWN_DEFECTS.items():
        assert known_defects(defect.minimal) == [name], (name, known_defects(defect.minimal))


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=d.reason))
     for n, d in KNOWN_DEFECTS.items()],
)
def test_known_defect(dist_pool: Any, name: str) -> None:
    """The minimal example of each open failure class still breaks the promise (strict
    xfail). When it passes (XPASS fails the run), the defect is fixed: delete its
    KNOWN_DEFECTS entry, and the generation covers that class again."""
    check_case(KNOWN_DEFECTS[name].minimal, lambda: dist_pool(2))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="explain's fake run on DTensor activations misses "
                   "the collectives DTensor issues inside an op: predicted forward {all_gather: 2}, counted "
                   "{all_reduce: 2, all_gather: 3} (OPEN_STATUSES)")
def test_explain_counts_what_a_plan_on_dtensors_runs(dist_pool: Any) -> None:
    per_rank = run_cases(lambda: dist_pool(2), [FAKE_COUNTS_MINIMAL])[0]
    assert verdict(FAKE_COUNTS_MINIMAL, per_rank, open_statuses=()) is None, per_rank[0]

