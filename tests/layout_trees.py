"""The module trees and plans of the layout property test (``test_layout_properties.py``),
as plain data: a :class:`Case` (a tree of :class:`Block` values and a plan of ops), the
modules it builds (:func:`make_model`) and the plan as ``sf`` calls (:func:`apply_plan`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import slapo_fn as sf

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
