"""How a parent's code treats one child's output along its features, read from the
parent's traced graph (:mod:`.flow`) for the layout checks of :mod:`.plan`.

A column kept split hands its parent this rank's share of the features. Code acting on
each feature alone is right on that share, and so is code taking the features apart into
heads or blocks (which the head and packing checks read). Anything over the features (a
norm, a softmax, a flip, a concatenation along them) is silently wrong on it. The walk
here follows the output through the parent's code and finds which it is.

Which dimension holds the features is followed along the way (:class:`At`): a transpose
moves them, an index or a reduction over the batch drops a dimension in front of them. A
dimension given as a positive number (``softmax(1)``) is the features or not depending on
the value's rank, which the trace does not hold; it is read with the child's output taken
as ``(batch, sequence, features)`` (:data:`ASSUMED_RANK`), and the walk says so
(:attr:`Walk.ranked`), so that the runtime can refuse an output of another rank instead
of trusting the reading.

Example:
    >>> import torch.fx as fx, torch.nn as nn
    >>> class Pair(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc, self.out = nn.Linear(4, 8), nn.Linear(8, 4)
    ...     def forward(self, x):
    ...         return self.out(self.fc(x).softmax(1)), self.out(self.fc(x).transpose(1, 2).softmax(1))
    >>> g = fx.symbolic_trace(Pair()).graph
    >>> first, second = [n for n in g.nodes if n.target == "fc"]
    >>> along_features(first, lambda _: False)
    Walk(apart=None, mixes=None, ranked='softmax(dim=1)', inner=None)
    >>> along_features(second, lambda _: False).mixes
    'softmax(dim=1)'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import torch.fx as fx

from .view_shapes import SizeOf, op_name, shape_given, view_shape, whole_shape

__all__ = ["ASSUMED_RANK", "Apart", "ApartKind", "At", "SizeOf", "Tokens", "Walk", "along_features", "along_tokens",
           "elementwise_op", "head_operands", "metadata", "nodes_in", "op_name", "sizes_only", "view_shape",
           "viewed_by_width"]

#: The rank a traced value is taken to have where nothing in the trace says: a parent's
#: arguments and its children's outputs are hidden states ``(batch, sequence, features)``.
ASSUMED_RANK = 3


class ApartKind(Enum):
    """How a parent's code takes a child's output apart along its features (:class:`Apart`)."""

    #: split into blocks ([Q|K|V], [gate|up]): ``split``, ``chunk``, ``x[..., :n]`` at once
    BLOCKS = "blocks"
    #: sliced at positions fixed by the full widths (Phi-3's ``qkv[..., :q]``, ``qkv[..., q:q + k]``)
    SLICES = "slices"
    #: viewed into heads: a view whose sizes after the leading ones (batch, sequence) split
    #: the features into more dimensions, however the shape is spelled (:func:`view_shape`)
    HEADS = "heads"


@dataclass(frozen=True)
class Apart:
    """How a parent's code first takes a child's output apart along its features:
    ``kind`` :attr:`ApartKind.BLOCKS` (split into ``count`` blocks; ``None`` where the
    trace does not say how many), :attr:`ApartKind.SLICES` (``count`` slices at fixed
    positions) or :attr:`ApartKind.HEADS` (viewed with the features as ``dims``: ``(-1,
    64)`` for ``view(B, S, -1, 64)``, ``(4, 3, 16)`` for BLOOM's per-head [q|k|v]; ``None``
    for a size the trace computes). Blocks split by sizes keep them in ``dims`` (``(32,)``
    for ``split(self.n_embd)``, ``(64, 16, 16)`` for ``split([q, k, v])``)."""

    kind: ApartKind
    count: int | None = None
    dims: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class At:
    """Where the features are in one value of the parent's code: ``feat``, their
    dimension counted from the end; ``rank``, the value's number of dimensions (``None``
    where the code does not say); ``assumed``, that rank is the child's output taken as
    :data:`ASSUMED_RANK`, not one the code fixed (a ``permute``, a ``view`` by sizes);
    ``items``, the value is a tuple of such tensors (``max(dim)``'s values and indices,
    a ``chunk`` along the sequence), ``None`` where it may be one (a module's output:
    Hugging Face attention returns ``(hidden_states, weights)``); ``merged``, in the walk
    along the tokens only: the value is the batch and the tokens merged into its first
    dimension (OPT's ``x.reshape(-1, x.size(-1))``), with the value merged and where its
    tokens were (the view back by that value's shape restores them)."""

    rank: int | None = ASSUMED_RANK
    feat: int = -1
    assumed: bool = True
    items: bool | None = False
    merged: tuple[fx.Node, At] | None = None


@dataclass(frozen=True)
class Walk:
    """What :func:`along_features` found: how the code takes the features apart (``None``
    where it does not), the first op that mixes them as short text (``None`` where none
    does), the first op whose reading took the output's rank as
    :data:`ASSUMED_RANK` (``None`` where no reading did), and where the output is split
    into blocks, how the code then takes a block apart (``inner``: nanoGPT's ``k.view(B,
    T, n_head, C // n_head)`` after ``split(n_embd)``)."""

    apart: Apart | None = None
    mixes: str | None = None
    ranked: str | None = None
    inner: Apart | None = None


#: Ops that act on each feature alone (elementwise, casts, copies): a rank's share of the
#: features goes through them as the whole would, in the same dimensions.
_ELEMENTWISE = frozenset({
    "add", "sub", "subtract", "mul", "multiply", "truediv", "div", "divide", "true_divide", "floordiv", "neg", "pos",
    "pow", "float_power", "mod", "remainder", "abs", "exp", "exp2", "expm1", "log", "log1p", "log2", "sigmoid",
    "tanh", "relu", "gelu", "silu", "mish", "elu", "selu", "celu", "leaky_relu", "softplus", "softsign",
    "hardswish", "hardsigmoid", "hardtanh", "relu6", "logsigmoid", "dropout", "sqrt", "rsqrt", "square",
    "reciprocal", "sin", "cos", "erf", "sign", "clamp", "clip", "where", "masked_fill", "maximum", "minimum",
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "invert", "iadd", "isub", "imul", "itruediv", "lerp",
    "addcmul", "addcdiv", "nan_to_num", "float", "half", "bfloat16", "double", "to", "type", "type_as",
    "contiguous", "clone", "detach", "add_", "sub_", "mul_", "div_", "clamp_", "masked_fill_", "neg_", "pow_",
    "sigmoid_", "tanh_", "relu_", "exp_", "sqrt_", "rsqrt_",
})
#: Ops over a dimension (``dim``: its keyword, its position among the arguments after the
#: tensor, its default): over the features they mix them; over batch or sequence they do not.
_OVER_DIM = {
    **{op: (0, None) for op in ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "var",
                                 "std", "logsumexp", "all", "any", "median", "nansum", "nanmean", "count_nonzero",
                                 "mode", "cummax", "cummin")},
    "softmax": (0, None), "log_softmax": (0, None), "cumsum": (0, None), "cumprod": (0, None),
    "norm": (1, None), "topk": (1, -1), "kthvalue": (1, -1), "sort": (0, -1), "argsort": (0, -1), "cat": (0, 0),
    "concat": (0, 0), "concatenate": (0, 0), "stack": (0, 0), "normalize": (1, 1), "unsqueeze": (0, None),
    "flip": (0, None), "roll": (1, None),
}
#: Ops of :data:`_OVER_DIM` that drop the dimensions they reduce unless told to keep them,
#: with ``keepdim``'s position among the arguments after the tensor.
_REDUCING = {
    **{op: 1 for op in ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "logsumexp", "all",
                        "any", "median", "nansum", "nanmean", "mode")},
    "norm": 2, "var": 2, "std": 2, "count_nonzero": -1,
}
#: Ops of :data:`_OVER_DIM` whose result is a tuple (values, indices) of the same layout.
_PAIRS = frozenset({"max", "min", "median", "mode", "topk", "kthvalue", "sort", "cummax", "cummin"})
_SPLITS = frozenset({"split", "chunk", "tensor_split", "split_with_sizes"})
#: Products over the last two dimensions, batched over the ones in front of them.
_BATCHED = frozenset({"matmul", "bmm", "baddbmm", "scaled_dot_product_attention"})
_MOVES = frozenset({"transpose", "swapaxes", "swapdims", "movedim", "moveaxis"})

_METADATA_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "get_device", "element_size"})
_METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"})


def metadata(node: fx.Node) -> bool:
    """Whether ``node`` reads a tensor's metadata (its shape, dtype, device), not its values."""
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    return (node.op == "call_function" and node.target is getattr and len(node.args) > 1
            and node.args[1] in _METADATA_ATTRS)


def elementwise_op(node: fx.Node) -> bool:
    """Whether ``node`` is a function or method acting on each element alone (``add``,
    ``relu``, ``to``): its result has its tensor arguments' dimensions, broadcast."""
    return node.op in ("call_function", "call_method") and op_name(node) in _ELEMENTWISE


def sizes_only(node: fx.Node) -> bool:
    """Whether ``node`` is computed from tensors' sizes alone, not their values."""
    if metadata(node):
        return True
    inputs = node.all_input_nodes
    return node.op == "call_function" and bool(inputs) and all(sizes_only(a) for a in inputs)


def nodes_in(arg: Any) -> list[fx.Node]:
    """The graph nodes in an argument (a node, or nodes in tuples, lists and dicts)."""
    found: list[fx.Node] = []

    def keep(n: fx.Node) -> fx.Node:
        found.append(n)
        return n

    fx.node.map_arg(arg, keep)
    return found


def along_features(node: fx.Node, elementwise: Callable[[fx.Node], bool], start: At = At()) -> Walk:
    """Follow a child's output (``node``) through the parent's code that keeps each
    feature whole (and the children ``elementwise`` accepts: activations), to where the
    code takes the features apart (there or after such ops, as Bart's ``q_proj(x) *
    scaling`` viewed into heads) and to the first op that mixes them, if one comes before
    they are taken apart or handed to a module."""
    return _walk(node, elementwise, start, through=None)


@dataclass(frozen=True)
class Tokens:
    """What :func:`along_tokens` found: the first op of the code over the sequence (as
    text; ``None`` where none is), and the children the activation reaches, each with
    where its sequence is then (counted from the end) and whether the batch and the
    tokens are merged into that dimension (:attr:`At.merged`)."""

    mixes: str | None
    reached: tuple[tuple[str, int, bool], ...]


def along_tokens(node: fx.Node, elementwise: Callable[[fx.Node], bool], seq_axis: int,
                 child: Callable[[fx.Node], str | None], tensor: Callable[[str], bool]) -> Tokens:
    """Follow an activation split along its sequence (``node``: a parent's argument, its
    sequence at ``seq_axis`` of :data:`ASSUMED_RANK`) through the parent's code, through
    its children too (``child`` names the child a node calls; each is taken to keep the
    layout, as norms, projections and sequence-parallel attention do; ``tensor`` says
    which return one tensor, not maybe a tuple), to the first op
    over the sequence: a reduction, softmax or cumulative op along it, a flip, a split or an
    index of it, or a child handed the sequence as its last dimension (a ``Linear`` after a
    transpose mixes tokens)."""
    reached: dict[str, tuple[int, bool]] = {}
    start = At(feat=seq_axis - ASSUMED_RANK)
    walked = _walk(node, elementwise, start, through=lambda use, at: _reach(use, at, child, tensor, reached))
    return Tokens(walked.mixes, tuple((name, *where) for name, where in reached.items()))


@dataclass(frozen=True)
class Meets:
    """Where an argument of a parent meets the heads of its code (:func:`head_operands`):
    at dimension ``dim``, counted from the end; ``merged``, that dimension is the batch and
    the heads merged, the heads inner (BLOOM's ALiBi bias of ``(batch * heads, 1, keys)``,
    added to the scores of ``q.reshape(batch * heads, -1, head_dim)``)."""

    dim: int
    merged: bool = False


def head_operands(node: fx.Node, elementwise: Callable[[fx.Node], bool]) -> dict[str, Meets]:
    """The parent's arguments that its code combines, element by element, with the heads
    a child's output (``node``) is viewed into, each with where it meets them
    (:class:`Meets`). MPT adds its ALiBi bias, built for every head by the model and
    handed to each attention, to the scores ``q @ k.transpose(-1, -2)``: on this rank's
    heads the bias must be this rank's share of it too. Followed from each view into heads
    (after a split into blocks too) through moves, elementwise ops, batched products
    (``baddbmm`` adds its first operand), views that keep the dimensions or merge the
    batch with the heads, to a view merging the heads back; an operand is traced back to
    an argument through slices, casts and a view taking the heads out of the batch
    (Falcon's ``alibi.view(batch, num_heads, 1, -1)``)."""
    found: dict[str, Meets] = {}
    todo: list[tuple[fx.Node, At, bool, bool]] = [(node, At(), False, False)]
    seen: set[fx.Node] = set()
    while todo:
        value, at, heads, merged = todo.pop()
        if value in seen:
            continue
        seen.add(value)
        users = [u for u in value.users if not metadata(u)]
        for use in users:
            if use.op == "call_module":
                if elementwise(use) and not heads:
                    todo.append((use, at, heads, merged))
                continue
            if use.op not in ("call_function", "call_method"):
                continue
            name = op_name(use)
            if heads and at.rank is not None:
                added = _added_operands(use, name, value)
                for arg in added:
                    if (source := _argument_of(arg)) is not None:
                        found.setdefault(str(source.target), Meets(at.feat, merged))
                    elif (through := _viewed_argument(arg, at, merged)) is not None:
                        found.setdefault(str(through.target), Meets(-(at.rank - 1), merged=True))
                if name == "scaled_dot_product_attention":
                    continue
                if (then := _heads_view(use, at, merged) or _heads_index(use, at, merged)) is not None:
                    todo.append((use, then[0], True, then[1]))
                    continue
                if merged and name in ("view", "reshape", "flatten", "unflatten"):
                    continue  # the batch and heads regrouped another way: not followed
            step = _step(use, value, at, alone=len(users) == 1)
            if isinstance(step.then, Apart):
                if step.then.kind is ApartKind.BLOCKS and name in _SPLITS and not heads:
                    todo.append((use, replace(at, items=True), False, False))
                elif step.then.kind is ApartKind.HEADS and not heads and at.rank is not None and step.then.dims:
                    # the features become len(dims) dimensions, the heads first of them
                    width = len(step.then.dims)
                    todo.append((use, At(at.rank - 1 + width, -width, assumed=False), True, False))
            elif isinstance(step.then, At) and (not heads or step.then.rank is not None):
                todo.append((use, step.then, heads, merged))
    return found


def _added_operands(use: fx.Node, name: str, value: fx.Node) -> list[fx.Node]:
    """The operands ``use`` adds, element by element, to the heads in ``value``: the
    others of an elementwise op or of attention (its mask), the first of ``baddbmm``."""
    if name in _ELEMENTWISE or name == "scaled_dot_product_attention":
        return [a for a in nodes_in((use.args, use.kwargs)) if a is not value]
    if name == "baddbmm":
        first = use.args[0] if use.args else use.kwargs.get("input")
        return [first] if isinstance(first, fx.Node) and first is not value else []
    return []


def _heads_view(use: fx.Node, at: At, merged: bool) -> tuple[At, bool] | None:
    """A view in the walk over the heads that :func:`_step` does not follow: one keeping
    every dimension, the heads' given by their count (Falcon's ``reshape(batch, num_heads,
    q_len, head_dim)``), or one merging the batch in front of the heads into one
    dimension (BLOOM's ``reshape(batch * num_heads, -1, head_dim)``): the new place of the
    heads and whether they are merged; ``None`` for any other op."""
    if op_name(use) not in ("view", "reshape") or at.rank is None:
        return None
    shape = shape_given(use, at.rank)
    pos = at.rank + at.feat
    sized = [isinstance(d, int | SizeOf) or (isinstance(d, fx.Node) and sizes_only(d)) for d in shape]
    if not shape or not all(sized):
        return None
    if merged:
        # the batch taken out again in front of the heads: view(batch, num_heads, q_len, -1)
        unmerged = pos == 0 and len(shape) == at.rank + 1 and isinstance(shape[1], int) and shape[1] > 0
        return (At(len(shape), 1 - len(shape), assumed=False), False) if unmerged else None
    if len(shape) == at.rank and isinstance(shape[pos], int) and shape[pos] > 0:
        return at, merged
    if pos == 1 and len(shape) == at.rank - 1 and isinstance(shape[0], fx.Node) \
            and op_name(shape[0]) == "mul":
        return At(len(shape), -len(shape), assumed=False), True
    return None


def _heads_index(use: fx.Node, at: At, merged: bool) -> tuple[At, bool] | None:
    """An index in the walk over the heads that keeps them whole and takes single items
    of other dimensions (Falcon's and BLOOM's ``fused[..., 0, :]``, q of each head's [q|k|v]):
    the new place of the heads; ``None`` for any other op."""
    if op_name(use) != "getitem" or at.rank is None or len(use.args) < 2:
        return None
    index = use.args[1]
    parts = list(index) if isinstance(index, tuple) else [index]
    if not all(p is None or p is Ellipsis or isinstance(p, slice) or (isinstance(p, int) and not isinstance(p, bool))
               for p in parts) or parts.count(Ellipsis) > 1:
        return None
    taking = [p for p in parts if p is not None and p is not Ellipsis]
    if len(taking) > at.rank:
        return None
    if Ellipsis in parts:
        i = parts.index(Ellipsis)
        parts[i:i + 1] = [slice(None)] * (at.rank - len(taking))
    parts += [slice(None)] * (at.rank - len([p for p in parts if p is not None]))
    kept, where, dim = 0, None, 0
    for p in parts:
        if p is None:
            kept += 1
            continue
        if dim == at.rank + at.feat:
            if p != slice(None):
                return None
            where = kept
        if not isinstance(p, int):
            kept += 1
        dim += 1
    return (At(kept, where - kept, assumed=False), merged) if where is not None else None


def _viewed_argument(arg: fx.Node, at: At, merged: bool) -> fx.Node | None:
    """The argument viewed into ``arg`` with the heads taken out of the batch in front of
    them (Falcon's ``alibi.view(batch, num_heads, 1, -1)`` of a ``(batch * heads, 1,
    keys)`` bias), where ``arg`` meets heads at ``at`` as its second dimension; ``None``
    for any other way to it. That argument meets the heads merged, at its first dimension."""
    if merged or at.rank is None or at.rank + at.feat != 1 or op_name(arg) not in ("view", "reshape"):
        return None
    if arg.op not in ("call_function", "call_method") or not isinstance(arg.args[0], fx.Node):
        return None
    return _argument_of(arg.args[0]) if len(shape_given(arg)) == at.rank else None


#: Ops an operand goes through on its way from an argument and keeps its dimensions.
_KEEPING = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous", "clone",
                      "detach"})


def _argument_of(node: fx.Node) -> fx.Node | None:
    """The placeholder ``node`` is, or comes from through slices and casts; else ``None``."""
    while node.op != "placeholder":
        if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        name = op_name(node)
        if name == "getitem":
            index = node.args[1]
            parts = index if isinstance(index, tuple) else (index,)
            if not all(isinstance(p, slice) or p is Ellipsis for p in parts):
                return None
        elif name not in _KEEPING:
            return None
        node = node.args[0]
    return node


def _reach(use: fx.Node, at: At, child: Callable[[fx.Node], str | None], tensor: Callable[[str], bool],
           reached: dict[str, tuple[int, bool]]) -> At | str:
    """A child handed the tracked value: the layout of its output, or what mixes."""
    name = child(use)
    if name is None:
        return replace(at, items=None)
    if at.feat == -1:
        return f"{name}(...) over the sequence"
    reached.setdefault(name, (at.feat, at.merged is not None))
    return replace(at, items=False if tensor(name) else None)


def _walk(node: fx.Node, elementwise: Callable[[fx.Node], bool], start: At,
          through: Callable[[fx.Node, At], At | str] | None) -> Walk:
    """The walk of :func:`along_features` and :func:`along_tokens` (``through``: children
    are walked through, and say what mixes the tracked dimension; an op taking it apart
    then mixes it too)."""
    apart: Apart | None = None
    inner: Apart | None = None
    ranked: str | None = None
    # each value with where its tracked dimension is, and whether it is a block of the output
    todo: list[tuple[fx.Node, At, bool]] = [(node, start, False)]
    seen: set[fx.Node] = set()
    split_last: set[fx.Node] = set()  # values followed with the tracked dimension last
    while todo:
        value, at, block = todo.pop()
        if value in seen:
            continue
        seen.add(value)
        if at.feat == -1 and not at.items and at.merged is None:
            split_last.add(value)
        users = [u for u in value.users if not metadata(u) and not (through is not None and _shape_of(u, value))]
        if through is not None and not at.items and (read := _length_read(value, at)) is not None:
            return Walk(apart, read, ranked, inner)
        if not at.items and at.feat == -1 and len(users) > 1 and all(_fixed_slice(u) for u in users):
            # x[..., :a], x[..., a:b], x[..., b:]: positions fixed by the full widths (Phi-3's qkv)
            if through is not None:
                return Walk(apart, _text(users[0]), ranked, inner)
            apart = apart or Apart(ApartKind.SLICES, len(users))
            continue
        for use in users:
            if use.op == "call_module" and elementwise(use):
                todo.append((use, at, block))
                continue
            if use.op == "output":
                if at.merged is not None:  # handed on with each rank's rows where the tokens were
                    return Walk(apart, "the batch and the tokens merged into one dimension, returned so", ranked,
                                inner)
                continue
            if use.op == "call_module":
                if through is not None:
                    then = through(use, at)
                    if isinstance(then, str):
                        return Walk(apart, then, ranked, inner)
                    todo.append((use, then, block))
                continue
            if value in split_last and _viewed_as(use, value, split_last):
                # view(h.shape), h a value followed before with the dimension last, as this one: alike
                todo.append((use, replace(at, rank=None, assumed=False), block))
                continue
            merging = _merging(use, value, at) if through is not None else None
            step = merging or _step(use, value, at, alone=len(users) == 1)
            if step.ranked and ranked is None:
                ranked = _text(use)
            if isinstance(step.then, Apart):
                if through is not None:
                    return Walk(apart, _text(use), ranked, inner)
                if block:
                    inner = inner or step.then
                    continue
                apart = apart or step.then
                if step.then.kind is ApartKind.BLOCKS and op_name(use) in _SPLITS:
                    # each block holds this rank's share of its features: followed on
                    todo.append((use, replace(at, items=True), True))
            elif isinstance(step.then, At):
                todo.append((use, step.then, block))
            else:
                return Walk(apart, step.then, ranked, inner)
    return Walk(apart, None, ranked, inner)


#: Ops that may take a value's own sizes: views of a tensor by its local shape.
_SHAPED = frozenset({"view", "reshape", "expand", "unflatten", "new_empty", "new_zeros", "new_ones"})


def _shape_of(use: fx.Node, value: fx.Node) -> bool:
    """Whether ``use`` reads only ``value``'s shape: ``y.view_as(value)``,
    ``y.reshape_as(value)``, ``y.expand_as(value)``, ``value`` not being ``y``."""
    return (use.op == "call_method" and use.target in ("view_as", "reshape_as", "expand_as")
            and use.args[0] is not value and value in use.args[1:])


#: What the walk along the tokens follows while the batch and the tokens are merged (besides
#: children): ops on each row alone, over its features (``rows @ w``, as :func:`_step` reads it).
_PER_ROW = frozenset({"linear", "layer_norm", "rms_norm", "matmul"})


def _merging(use: fx.Node, value: fx.Node, at: At) -> _Step | None:
    """The walk along the tokens through the batch and the tokens merged into one
    dimension in front of the features (OPT's decoder layer, ``x.reshape(-1,
    x.size(-1))`` around its MLP, and ``.view(shape)`` back): each row is then a token,
    and on this rank's rows code acting on each row alone is right, as the whole would
    be. Merged, the walk follows only such code, and the view back to the merged value's
    own shape; anything else is what mixes. An op over one dimension (``cumsum(-1)``) is
    left to :func:`_step`, which finds whether that is the rows'. ``None``: ``use`` is no
    such step (the walk reads it as any other op)."""
    if use.op not in ("call_function", "call_method"):
        return None
    name = op_name(use)
    if at.merged is None:
        if at.items or at.rank is None or not -at.rank <= at.feat < -1 or use.args[0] is not value:
            return None
        if name in ("view", "reshape"):
            shape = shape_given(use, at.rank)
            if len(shape) == 2 and _own_last_size(shape[-1], value, at.rank):
                return _Step(At(2, -2, assumed=False, merged=(value, at)))
        if name == "flatten":
            # every dimension but the last, whatever the rank (flatten(0, -2)), or by the rank
            # where the code fixed it (not where it is assumed)
            start, end = _dim_arg(use, 0, "start_dim", 0), _dim_arg(use, 1, "end_dim", -1)
            if start == 0 and (end == -2 or (not at.assumed and end == at.rank - 2)):
                return _Step(At(2, -2, assumed=False, merged=(value, at)))
        return None
    if name in ("view", "reshape", "view_as", "reshape_as") and use.args[0] is value:
        back = _viewed_back(use, at.merged[0])
        return _Step(at.merged[1] if back else _text(use))
    if name in _ELEMENTWISE or (name in _PER_ROW and use.args[0] is value):
        return None
    if name in _OVER_DIM and name not in _JOINING and use.args[0] is value:
        return None  # over one dimension (a softmax, a cumsum): _step reads whether it is the rows'
    return _Step(_text(use))


#: Ops of :data:`_OVER_DIM` that add a dimension or join tensors: on merged rows, not followed.
_JOINING = frozenset({"cat", "concat", "concatenate", "stack", "unsqueeze"})


def _viewed_back(use: fx.Node, merged: fx.Node) -> bool:
    """Whether ``use`` views a value back to the shape of ``merged`` (``.view(x.shape)``,
    ``.view(x.size())``, ``.view_as(x)``, or ``x``'s sizes one by one, in order)."""
    if op_name(use) in ("view_as", "reshape_as"):
        return len(use.args) > 1 and use.args[1] is merged
    shape = shape_given(use)
    if len(shape) == 1 and (whole := whole_shape(shape[0])) is not None:
        return whole is merged
    n = len(shape)
    return n > 1 and all(_size_of(d, merged) in (i, i - n) for i, d in enumerate(shape))


def _viewed_as(use: fx.Node, value: fx.Node, alike: set[fx.Node]) -> bool:
    """Whether ``use`` views ``value`` to the whole shape of one of ``alike``
    (``value.view(h.shape)``)."""
    if op_name(use) not in ("view", "reshape") or use.op not in ("call_function", "call_method") or not use.args:
        return False
    shape = shape_given(use) if use.args[0] is value else ()
    return len(shape) == 1 and whole_shape(shape[0]) in alike


def viewed_by_width(node: fx.Node, value: fx.Node) -> bool:
    """Whether ``node`` views a tensor with a size that is ``value``'s last (its width
    when ``value`` is the parent's hidden states, as read there: ``B, N, C = x.shape``
    then ``y.reshape(B, N, C)``; ``x.size(-1)``)."""
    if node.op not in ("call_function", "call_method") or op_name(node) not in ("view", "reshape") \
            or not node.args or node.args[0] is value:
        return False
    return any(_size_of(d, value) in (-1, ASSUMED_RANK - 1) for d in shape_given(node))


def _size_of(d: Any, value: fx.Node) -> int | None:
    """Which of ``value``'s sizes ``d`` reads (``value.size(i)``, ``value.shape[i]``,
    ``value.size()[i]``), as given; ``None`` where it reads none of them."""
    if isinstance(d, SizeOf):
        return d.dim if d.of is value else None
    if not isinstance(d, fx.Node):
        return None
    if d.op == "call_method" and op_name(d) == "size" and len(d.args) > 1 and d.args[0] is value:
        return d.args[1] if isinstance(d.args[1], int) else None
    if d.op == "call_function" and op_name(d) == "getitem" and len(d.args) > 1 and whole_shape(d.args[0]) is value:
        return d.args[1] if isinstance(d.args[1], int) else None
    return None


def _length_read(value: fx.Node, at: At) -> str | None:
    """Where code reads the length of ``value``'s tracked dimension (``x.size(1)``,
    ``x.shape[1]``) for anything but a view by its own shape: positions built from this
    rank's share of the sequence (``torch.arange(x.size(1))``, ``self.pos[: x.size(1)]``),
    as text; else ``None``."""
    lengths: list[fx.Node] = []
    for use in value.users:
        if use.op == "call_method" and use.target == "size" and len(use.args) > 1:
            if _pos(use.args[1], at)[0] == at.feat:
                lengths.append(use)
        elif (metadata(use) and use.op == "call_function" and use.args[1] == "shape") or (
                use.op == "call_method" and use.target == "size" and len(use.args) == 1):
            lengths += _sizes_at(use, at)
    todo, seen = list(lengths), set(lengths)
    while todo:
        size = todo.pop()
        for use in size.users:
            if use in seen:
                continue
            if use.op == "call_function" and getattr(use.target, "__module__", "") in ("_operator", "math") \
                    and op_name(use) != "getitem":
                seen.add(use)
                todo.append(use)  # arithmetic on sizes
            elif op_name(use) not in _SHAPED:
                return f"{_text(use)} to the length of its share of the sequence"
    return None


def _sizes_at(shape: fx.Node, at: At, offset: int = 0, stop: int | None = None, depth: int = 0) -> list[fx.Node]:
    """The items of ``shape`` (a tensor's shape, or its dimensions ``offset`` to ``stop``)
    that read the length of the dimension at ``at``: ``x.shape[1]``, and through slices of
    the shape (``bsz, s = x.shape[:2]``)."""
    found: list[fx.Node] = []
    for u in shape.users:
        if op_name(u) != "getitem" or len(u.args) < 2:
            continue
        index = u.args[1]
        if isinstance(index, int) and not isinstance(index, bool):
            dim = offset + index if index >= 0 else index if stop is None else stop + index
            if _pos(dim, at)[0] == at.feat:
                found.append(u)
        elif isinstance(index, slice) and index.step in (None, 1) and depth < 8 and all(
                b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 0)
                for b in (index.start, index.stop)):
            end = offset + index.stop if index.stop is not None else stop
            found += _sizes_at(u, at, offset + (index.start or 0), end if stop is None or end is None
                               else min(end, stop), depth + 1)
    return found


@dataclass(frozen=True)
class _Step:
    """One op's verdict: ``then`` is the value's new :class:`At` (the walk goes on), an
    :class:`Apart` (taken apart: the walk stops there), or the text of an op
    that mixes the features; ``ranked``: the verdict read a dimension by the assumed rank."""

    then: At | Apart | str
    ranked: bool = False


def _pos(d: Any, at: At) -> tuple[int | None, bool]:
    """Dimension ``d`` counted from the end of a value at ``at`` (``None`` where the rank
    needed is not known), and whether that took the assumed rank."""
    if isinstance(d, bool) or not isinstance(d, int):
        return None, False
    if d < 0:
        return d, False
    if at.rank is None or d >= at.rank:
        return None, False
    return d - at.rank, at.assumed


def _step(use: fx.Node, value: fx.Node, at: At, alone: bool) -> _Step:
    """What ``use`` does to the tracked dimension of ``value``, one of its arguments, at
    ``at`` (``alone``: the argument's only use)."""
    if use.op not in ("call_function", "call_method"):
        return _Step(use.op)
    name = op_name(use)
    if at.items is None:  # a module's output, maybe a tuple: an int index then picks an item
        if name == "getitem" and len(use.args) > 1 and isinstance(use.args[1], int):
            return _Step(replace(at, items=False))
        at = replace(at, items=False)
    if at.items:
        return _item(use, name, at)
    if name in _ELEMENTWISE:
        return _Step(at)
    if name == "getattr" and len(use.args) > 1:
        return _attribute(use.args[1], at)
    if name == "getitem" and len(use.args) > 1:
        return _index(use, at, alone)
    if name == "squeeze":
        # drops dimensions of size one, if any: never the features (wider than one) nor, where
        # they are last, any dimension after them
        return _Step(replace(at, rank=None, assumed=False) if at.feat == -1 else _text(use))
    if name == "expand":
        sizes = shape_given(use, at.rank)
        return _Step(replace(at, rank=len(sizes), assumed=False) if sizes else _text(use))
    if name == "expand_as":
        return _Step(replace(at, rank=None, assumed=False))
    if name in _SPLITS or name == "unbind":
        return _split(use, name, at, alone)
    if name in ("view", "reshape", "unflatten"):
        return _view(use, name, at)
    if name == "flatten":
        return _flatten(use, at)
    if name == "permute":
        return _permute(use, at)
    if name in _MOVES:
        return _move(use, name, at)
    if name in _OVER_DIM:
        return _over_dim(use, name, at)
    if name == "matmul" and at.feat == -2 and use.args[0] is value:
        return _Step(at)  # the rows of x @ w: each alone (a functional linear layer's tokens)
    if name == "linear" and at.feat <= -2 and use.args[0] is value:
        return _Step(at)  # F.linear(x, w, b) acts over the last dimension only
    if name in ("layer_norm", "rms_norm") and use.args[0] is value and at.feat < 0:
        # over the last len(normalized_shape) dimensions (a LayerNorm subclass's own forward)
        shape = _dim_arg(use, 0, "normalized_shape", None)  # sizes, or sizes read off a tensor: (x.shape[-1],)
        if isinstance(shape, int | tuple | list):
            return _Step(at if at.feat < -(1 if isinstance(shape, int) else len(shape)) else _text(use))
    if name in _BATCHED and at.feat <= -3:
        # the features moved to a batch dimension of a product (T5's per-head bias, (heads, q,
        # k), added to the scores in scaled_dot_product_attention): each head's alone
        return _Step(at)
    return _Step(_text(use))


def _item(use: fx.Node, name: str, at: At) -> _Step:
    """An op on a tuple of tensors (``max(dim)``'s result, chunks along the sequence): an
    item of it or its ``.values`` keeps the layout; any other use is not followed."""
    if name == "getitem" and len(use.args) > 1 and isinstance(use.args[1], int):
        return _Step(replace(at, items=False))
    if name == "getitem":
        return _Step(at)
    if name == "getattr" and len(use.args) > 1 and use.args[1] in ("values", "indices"):
        return _Step(replace(at, items=False))
    if name in ("cat", "concat", "concatenate", "stack"):  # the tensors put back together
        return _over_dim(use, name, replace(at, items=False))
    return _Step(_text(use))


def _attribute(attr: Any, at: At) -> _Step:
    if attr in ("mT", "mH"):  # the last two dimensions swapped
        return _Step(replace(at, feat={-1: -2, -2: -1}.get(at.feat, at.feat)))
    if attr in ("T", "H"):  # all dimensions reversed
        if at.rank is None:
            return _Step(f".{attr}")
        return _Step(replace(at, feat=-(at.rank + at.feat) - 1), ranked=at.assumed)
    return _Step(at)  # a field of a returned ModelOutput (.last_hidden_state)


def _index(use: fx.Node, at: At, alone: bool) -> _Step:
    """``x[index]``: an index of other dimensions keeps the features whole (dropping the
    dimensions it takes single items of); one that picks features at positions of the
    whole width (``x[..., :a]``) cuts this rank's share at the wrong ones."""
    index = use.args[1]
    parts = index if isinstance(index, tuple) else (index,)
    if all(p == slice(None) or p is Ellipsis for p in parts):
        return _Step(at)
    ellipsis = Ellipsis in parts
    before = parts[: parts.index(Ellipsis)] if ellipsis else parts
    after = parts[parts.index(Ellipsis) + 1 :] if ellipsis else ()
    if None in after or (at.feat != -1 and None in before):
        return _Step(_text(use))  # a new dimension that may come after the features
    # each taken position, counted from the end where the rank (or the Ellipsis) says
    placed: list[tuple[int | None, Any]] = [(-len(after) + j, p) for j, p in enumerate(after)]
    taken = [p for p in before if p is not None]
    ranked = False
    if any(p != slice(None) for p in taken):
        if at.rank is None:
            if not (ellipsis and at.feat >= -len(after)):
                return _Step(_text(use))
        else:
            ranked = at.assumed and not (ellipsis and at.feat >= -len(after))
            placed += [(i - at.rank, p) for i, p in enumerate(taken)]
    here = next((p for pos, p in placed if pos == at.feat), slice(None))
    if here != slice(None):
        if at.feat == -1 and after and alone:
            return _Step(Apart(ApartKind.BLOCKS))  # x[..., :n] at once: the packing check reads it
        return _Step(_text(use))
    if any(pos is not None and pos > at.feat and (p is None or not isinstance(p, slice)) for pos, p in placed):
        return _Step(_text(use))  # items taken after the features: they would move
    if any(isinstance(p, fx.Node) and not sizes_only(p) for p in parts) or at.rank is None:
        return _Step(replace(at, rank=None, assumed=False), ranked)  # indexed by tensors
    dropped = sum(1 for p in parts if isinstance(p, int | fx.Node) and not isinstance(p, bool))
    added = sum(1 for p in parts if p is None)
    return _Step(replace(at, rank=at.rank - dropped + added), ranked)


def _dim_arg(use: fx.Node, position: int, keyword: str, default: Any) -> Any:
    rest = use.args[1:]
    return use.kwargs.get(keyword, rest[position] if len(rest) > position else default)


def _split(use: fx.Node, name: str, at: At, alone: bool) -> _Step:
    """A split along the features is taken apart into blocks (the packing check reads how
    many, where the whole output is split at once); along another dimension it gives a
    tuple of tensors with the features where they were."""
    d = _dim_arg(use, 0, "dim", 0) if name == "unbind" else _dim_arg(use, 1, "dim", 0)
    pos, ranked = _pos(d, at)
    if pos is None:
        return _Step(_text(use))
    if pos != at.feat:  # along the batch or sequence: a tuple of tensors of the same layout
        rank = at.rank if name != "unbind" or at.rank is None else at.rank - 1
        return _Step(At(rank, at.feat, at.assumed, items=True), ranked)
    if name == "unbind" or at.feat != -1:
        return _Step(_text(use))
    parts = use.args[1] if len(use.args) > 1 else use.kwargs.get("split_size_or_sections", use.kwargs.get("chunks"))
    if not alone:
        return _Step(Apart(ApartKind.BLOCKS, parts if isinstance(parts, int) and name == "chunk" else None), ranked)
    if name == "chunk" and isinstance(parts, int):
        return _Step(Apart(ApartKind.BLOCKS, parts), ranked)
    if isinstance(parts, tuple | list):  # split([q, k, v]): sizes of the whole width
        sizes = tuple(d if isinstance(d, int) else None for d in parts)
        return _Step(Apart(ApartKind.BLOCKS, len(parts), sizes), ranked)
    # split(size): as many blocks as the width holds, each of that size
    return _Step(Apart(ApartKind.BLOCKS, dims=(parts,) if isinstance(parts, int) else ()), ranked)


def _view(use: fx.Node, name: str, at: At) -> _Step:
    """A view of the features into heads (a size after the batch and sequence sizes:
    ``view(B, S, -1, 64)``, ``unflatten(-1, (h, d))``) is taken apart for the head check;
    a view of the batch and sequence (``reshape(-1, x.shape[-1])``) keeps the features
    whole and last; any other view regroups them."""
    if name == "unflatten":
        d = _dim_arg(use, 0, "dim", None)
        sizes = _dim_arg(use, 1, "sizes", ())
        pos, ranked = _pos(d, at)
        if pos is None or not isinstance(sizes, tuple | list):
            return _Step(_text(use))
        if pos == at.feat == -1:
            return _Step(Apart(ApartKind.HEADS, dims=tuple(s if isinstance(s, int) else None for s in sizes)), ranked)
        if pos < at.feat:  # the batch or sequence unflattened
            rank = None if at.rank is None else at.rank + len(sizes) - 1
            return _Step(replace(at, rank=rank), ranked)
        return _Step(_text(use))
    shape = shape_given(use, at.rank)
    if not shape:
        return _Step(_text(use))
    if len(shape) == 1 and (whole := whole_shape(shape[0])) is not None:
        # view(y.shape): to another tensor's shape, whose last size is the whole width where y
        # is not split alike (OPT's layer views its MLP's output back by its input's shape)
        return _Step(at if whole is use.args[0] else _text(use))  # its own: nothing moves
    last = shape[-1]
    whole = last == -1 or _size_read(last)
    if at.feat < -1 and _own_last_size(last, use.args[0], at.rank):
        # x.view(-1, x.shape[-1]): the dimensions in front of the last merged, the tracked one
        # with them (the batch and the tokens flattened, as a mixture-of-experts block does);
        # where it goes then is not followed (a view back by sizes would seem to keep it), as
        # flatten's merge of it with the dimensions in front is not
        return _Step(_text(use))
    if at.feat != -1:
        # the features (heads, moved back in front of the head size) merged with every
        # dimension after them, features first: this rank's share of the merged features
        if at.rank is not None and len(shape) == at.rank + at.feat + 1 and whole:
            return _Step(At(len(shape), -1, assumed=False), at.assumed)
        kept = None if at.rank is None else at.rank + at.feat  # the tracked dimension, from the start
        if kept is not None and len(shape) > kept and all(_size_read(d) for d in shape[: kept + 1]):
            # every dimension up to the tracked one kept by its size (view(B, S, heads, d) of tokens)
            return _Step(replace(at, rank=len(shape), feat=kept - len(shape)), at.assumed)
        if at.rank is not None and len(shape) == at.rank and shape[at.feat] == -1 and all(
                _size_read(d) for i, d in enumerate(shape) if i != at.rank + at.feat):
            return _Step(at, at.assumed)  # every other dimension kept by its size: the same dimensions
        return _Step(_text(use))
    if _size_read(last):  # x.shape[-1]: the features kept whole and last
        return _Step(At(len(shape), -1, assumed=False))
    if at.rank is not None and len(shape) > at.rank:
        lead = at.rank - 1  # the sizes after the batch and sequence are the features'
        dims = tuple(d if isinstance(d, int) else None for d in shape[lead:])
        return _Step(Apart(ApartKind.HEADS, dims=dims), at.assumed)
    if last == -1 and at.rank is not None and len(shape) == at.rank:
        return _Step(at, at.assumed)  # the same dimensions
    return _Step(_text(use))


def _own_last_size(d: Any, value: Any, rank: int | None) -> bool:
    """Whether a view's size ``d`` is ``value``'s own last size: ``value.size(-1)``,
    ``value.shape[-1]`` (or its index ``rank - 1``)."""
    return isinstance(value, fx.Node) and _size_of(d, value) in ((-1,) if rank is None else (-1, rank - 1))


def _size_read(d: Any) -> bool:
    """Whether a view's size ``d`` is one size read off a tensor (``x.size(-1)``,
    ``x.shape[-1]``), not a constant or a size computed from others (``x.shape[-1] // 4``)."""
    if isinstance(d, SizeOf):
        return True
    if not isinstance(d, fx.Node):
        return False
    if metadata(d):
        return True
    return (d.op == "call_function" and op_name(d) == "getitem" and isinstance(d.args[0], fx.Node)
            and metadata(d.args[0]))


def _flatten(use: fx.Node, at: At) -> _Step:
    start, ranked_a = _pos(_dim_arg(use, 0, "start_dim", 0), at)
    end, ranked_b = _pos(_dim_arg(use, 1, "end_dim", -1), at)
    if start is None or end is None:
        return _Step(_text(use))
    ranked = ranked_a or ranked_b
    if start == at.feat and end == -1:  # merged with the dimensions after them, features first
        return _Step(At(None if at.rank is None else at.rank + at.feat + 1, -1, at.assumed), ranked)
    if start <= at.feat <= end and start != end:
        return _Step(_text(use))  # the features merged with dimensions in front of them
    rank = None if at.rank is None else at.rank - (end - start)
    feat = at.feat + (end - start) if end < at.feat else at.feat
    return _Step(replace(at, rank=rank, feat=feat), ranked)


def _permute(use: fx.Node, at: At) -> _Step:
    given = use.kwargs.get("dims")
    dims = shape_given(use, at.rank) if not isinstance(given, tuple | list) else tuple(given)
    if not dims or not all(isinstance(d, int) for d in dims):
        return _Step(_text(use))
    rank = len(dims)  # a permutation names every dimension: the rank is the code's, not assumed
    at_known = At(rank, at.feat, assumed=False)
    order = [_pos(d, at_known)[0] for d in dims]
    if at.feat not in order:
        return _Step(_text(use))
    return _Step(At(rank, order.index(at.feat) - rank, assumed=False))


def _move(use: fx.Node, name: str, at: At) -> _Step:
    """``transpose(a, b)`` swaps two dimensions; ``movedim(src, dst)`` moves one."""
    if name in ("movedim", "moveaxis"):
        src_arg, dst_arg = _dim_arg(use, 0, "source", None), _dim_arg(use, 1, "destination", None)
    else:
        src_arg, dst_arg = _dim_arg(use, 0, "dim0", None), _dim_arg(use, 1, "dim1", None)
    (a, ranked_a), (b, ranked_b) = _pos(src_arg, at), _pos(dst_arg, at)
    if a is None or b is None:
        return _Step(_text(use))
    ranked = ranked_a or ranked_b
    if name in ("movedim", "moveaxis") and a != at.feat and not (a < at.feat and b < at.feat) and not (
            a > at.feat and b > at.feat):
        return _Step(_text(use))  # a dimension moved across the features
    feat = b if at.feat == a else a if at.feat == b and name not in ("movedim", "moveaxis") else at.feat
    return _Step(replace(at, feat=feat), ranked)


def _over_dim(use: fx.Node, name: str, at: At) -> _Step:
    """An op over dimensions: over the features it mixes them; over batch or sequence
    (each feature alone) it does not, and may drop the dimensions it reduces."""
    rest = list(use.args[1:])  # after the tensor (torch.cat's list of tensors)
    found = _dims_of(use, name)
    dims = list(found) if isinstance(found, tuple | list) else [found]
    text = _text(use)
    if name in ("unsqueeze", "stack"):  # a new dimension, at a position of the result
        d = dims[0]
        if isinstance(d, bool) or not isinstance(d, int):
            return _Step(text)
        if d < 0:
            feat = at.feat - 1 if d >= at.feat else at.feat
            return _Step(replace(at, rank=None if at.rank is None else at.rank + 1, feat=feat))
        if at.rank is None:
            return _Step(text)
        feat = at.feat - 1 if d > at.rank + at.feat else at.feat
        return _Step(replace(at, rank=at.rank + 1, feat=feat), at.assumed)
    positions = [_pos(d, at) for d in dims]
    if any(p is None or p == at.feat for p, _ in positions):
        return _Step(text)
    ranked = any(r for _, r in positions)
    if name in _PAIRS:
        return _Step(replace(at, items=True), ranked)
    if name not in _REDUCING:
        return _Step(at, ranked)
    keep_at = _REDUCING[name]
    keep = use.kwargs.get("keepdim", rest[keep_at] if 0 <= keep_at < len(rest) else False)
    if keep is True:
        return _Step(at, ranked)
    if keep is False and at.rank is not None:
        return _Step(replace(at, rank=at.rank - len(dims)), ranked)
    return _Step(replace(at, rank=None, assumed=False), ranked)


def _fixed_slice(node: fx.Node) -> bool:
    """Whether ``node`` is ``x[..., a:b]`` with constant bounds (the last dimension)."""
    if node.op != "call_function" or getattr(node.target, "__name__", "") != "getitem" or len(node.args) < 2:
        return False
    index = node.args[1]
    return (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)
            and all(b is None or isinstance(b, int) for b in (index[1].start, index[1].stop)))


def _text(node: fx.Node) -> str:
    """A short text of an op, as a refusal names it: ``softmax(dim=1)``, ``x[..., :16]``,
    ``view(-1, 4, ...)``."""
    name = op_name(node)
    if name == "getitem" and len(node.args) > 1:
        index = node.args[1]
        parts = index if isinstance(index, tuple) else (index,)
        return "x[" + ", ".join(_index_text(p) for p in parts) + "]"
    if name in _OVER_DIM:
        found = _dims_of(node, name)
        shown = found[0] if isinstance(found, tuple | list) and len(found) == 1 else found
        return f"{name}(dim={tuple(shown) if isinstance(shown, list) else shown})"
    if name in ("view", "reshape", "unflatten", "flatten", "permute", "transpose", "movedim", "expand"):
        args = [a if isinstance(a, int) else "..." for a in node.args[1:]]
        if len(node.args) == 2 and isinstance(node.args[1], tuple | list):
            args = [a if isinstance(a, int) else "..." for a in node.args[1]]
        return f"{name}({', '.join(map(str, args))})"
    return f"{name}(...)"


def _dims_of(node: fx.Node, name: str) -> Any:
    """The dimension (or dimensions) an :data:`_OVER_DIM` op ``name`` is over, as written."""
    position, default = _OVER_DIM[name]
    return node.kwargs.get("dims", _dim_arg(node, position, "dim", default))


def _index_text(index: Any) -> str:
    if index is Ellipsis:
        return "..."
    if isinstance(index, slice):
        text = ":".join("" if b is None else str(b) if isinstance(b, int) else "n" for b in (index.start, index.stop))
        return text
    if index is None:
        return "None"
    return str(index) if isinstance(index, int) else "i"
