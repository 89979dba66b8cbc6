"""The data flow among a module's children, traced by need: which children's outputs
reach each child's input in the parent's ``forward`` (not the order the children were
registered in), for the layout planner (:mod:`.plan`).

A parent is traced with ``torch.fx``, its children as leaves (their code is not run),
on a shallow copy (an attribute its forward sets stays off the model). Where plain fx
fails, a tracer whose values answer ``.shape`` with one size per dimension traces code
that unpacks shapes into arguments (Hugging Face attention's ``view(*input_shape, -1,
head_dim)``) and takes branches on sizes alone the way a sequence of several tokens
does; a parent's optional tensor argument (``position_embeddings``) is traced where the
forward needs it. The parent's first argument is the hidden states (:data:`INPUT`), the
others side values (:data:`SIDE`). A parent that neither traces (control flow on tensor
values, ``nn.MultiheadAttention``'s functional call) has no flow: :func:`flow` returns
``None`` and the planner falls back to module order and its refusals. The flow also
says how the parent takes each child's output apart (:class:`Apart`: split into blocks,
viewed into heads), which packing and head counts are checked against.

Example:
    >>> import torch.nn as nn, torch.nn.functional as F
    >>> class Gated(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.gate, self.down = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
    ...     def forward(self, x):
    ...         return self.down(F.silu(self.gate(x)) * self.up(x))
    >>> fl = flow(Gated())
    >>> sorted(fl.feeders("down")), sorted(fl.feeders("up")), sorted(fl.consumers("gate"))
    (['gate', 'up'], ['<input>'], ['down'])
"""

from __future__ import annotations

import copy
import functools
import inspect
import operator
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..hf import is_conv1d, linear_features
from ..tree import uncalled
from .features import ASSUMED_RANK as _ASSUMED_RANK
from .features import (
    Apart,
    ApartKind,
    At,
    Meets,
    SizeOf,
    Tokens,
    Walk,
    along_features,
    along_tokens,
    elementwise_op,
    head_operands,
    view_shape,
    viewed_by_width,
)
from .features import metadata as _metadata
from .features import nodes_in as _nodes_in
from .features import op_name as _op_name
from .features import sizes_only as _sizes_only
from .operands import combiners, operand_of, read_of_a_child
from .roles import CHANNEL_NORMS, channels_rank
from .taken import returned, taken
from .traced_einops import einops_on_traced_values

__all__ = ["INPUT", "OUTPUT", "SIDE", "Apart", "ApartKind", "Flow", "flow", "own_layer", "pointwise"]

#: What reaches a child from the parent's first argument (the hidden states), and where the
#: parent's result goes.
INPUT, OUTPUT = "<input>", "<output>"
#: What reaches a child from the parent's other arguments: masks, rotary ``cos``/``sin``,
#: ALiBi biases, encoder states; values that are not the activation the layouts split.
SIDE = "<side>"
_INNER = "inner"


@dataclass(frozen=True)
class Flow:
    """Where data goes among one parent's children.

    ``feeds[child]`` holds the children (or :data:`INPUT`, :data:`SIDE`) whose outputs
    reach ``child``'s arguments, through any ops of the parent's code between; ``output``
    what reaches the parent's result (the first element where it returns a tuple, as
    Hugging Face modules return ``(hidden_states, attn_weights)``); ``reads`` the children
    whose parameters or buffers the parent's own code reads (``F.linear(x,
    self.proj.weight)``). Children called in no path of the traced forward are absent
    from ``feeds``.
    """

    feeds: Mapping[str, frozenset[str]]
    output: frozenset[str]
    reads: frozenset[str] = frozenset()
    first: Mapping[str, str] = field(default_factory=dict)  # the value each child is first called on (a node)
    apart: Mapping[str, Apart] = field(default_factory=dict)  # how the parent takes each output apart
    leaves: tuple[frozenset[str], ...] = ()  # what reaches each tensor the parent returns (a ModelOutput's fields)
    hidden: Mapping[str, frozenset[str]] = field(default_factory=dict)  # what reaches each child's first argument
    # the parameters of each child's forward that the parent hands a value (not a constant): what
    # the child is traced with (a decoder layer's encoder states call its cross-attention)
    given: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # for each child, the first op of the parent's code that mixes its output's features (a
    # reduction, a softmax or a matmul over them, a flip, a concatenation along them) before
    # the code takes them apart or hands them to a module, as text: ``"norm(dim=-1)"``
    mixes: Mapping[str, str] = field(default_factory=dict)
    # whether the parent's own code multiplies two activations (q @ k.transpose(-2, -1), an
    # einsum, scaled_dot_product_attention): an output position then reads other positions
    attends: bool = False
    # for each child, the first op of the parent's code whose reading took the child's output as
    # (batch, sequence, features) (:data:`.features.ASSUMED_RANK`): ``"softmax(dim=1)"`` is over the
    # sequence only at that rank, so the runtime checks the rank where the output is a share of features
    ranked: Mapping[str, str] = field(default_factory=dict)
    # the parent's first argument split along its sequence, followed through its code and
    # children (:func:`.features.along_tokens`), for a sequence at dimension 1 (batch first)
    # and 0 (sequence first, as nn.Transformer's default): what a sequence-parallel chain checks
    tokens: Mapping[int, Tokens] = field(default_factory=dict)
    # for each child whose output the code splits into blocks, how it then takes a block
    # apart (:attr:`.features.Walk.inner`): the head check of packed columns reads it
    inner: Mapping[str, Apart] = field(default_factory=dict)
    # the parent's own plain attributes its traced forward read (``self.num_heads``): a head
    # count it never reads sizes none of its views
    attrs: frozenset[str] = frozenset()
    # the parent's arguments its code combines, element by element, with the heads its children's
    # outputs are viewed into (MPT's ALiBi bias, built for every head), each with where it meets
    # the heads (:func:`.features.head_operands`)
    per_head: Mapping[str, Meets] = field(default_factory=dict)
    # for each child whose output the parent's code views into heads by a constant count, the
    # parent's own attributes that give that count and nothing else (:func:`_counted_by`)
    counts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # for each child whose output the parent's code views (after any ops) by the width of its
    # hidden states, read off them (timm's ``B, N, C = x.shape``, then ``reshape(B, N, C)``): a
    # width build cannot make this rank's share of a column's features
    by_width: Mapping[str, str] = field(default_factory=dict)
    # the children the forward calls, in the order of its code's first call to each (OPT's decoder
    # registers its final norm before its layers and calls it after them)
    order: tuple[str, ...] = ()
    # the parent's result as named fields (a ``ModelOutput``, a dict): what reaches each field
    fields: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # for each child whose output reaches the parent's result, the fields read off it on the way
    # (``outputs.past_key_values``), with ``""`` for the output read otherwise (whole, by position)
    returned: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # for each child called once, the parameters of its forward handed a traced value, each with
    # the node of that value (``{"key_value_states": "a2"}``): one value handed down unchanged
    # through several modules is one tensor (:func:`.lookups._origin`)
    args: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # the parameters of the parent's forward its placeholders ``a0``..``a3`` stand for, in order
    params: tuple[str, ...] = ()
    # for each child, its parameters the parent's code reads only to combine them, element by
    # element, with that child's output (the bias ``decompose`` adds after a Linear's matmul):
    # operands on the output's features, not reads that bypass the child (:attr:`reads`)
    operands: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # the children that combine, element by element, one activation with such operands alone
    # (``fuse``'s ``gelu(x + bias)``): a layout passes through them as through an activation
    combines: frozenset[str] = frozenset()
    # for each child whose output the parent's code only takes apart by position, the positions
    # it reads, each ``None`` (read) or the position of the parent's result it is handed on as
    # (:func:`.taken.taken`); a position absent is read by nothing
    taken: Mapping[str, Mapping[int, int | None]] = field(default_factory=dict)

    def same_input(self, a: str, b: str) -> bool:
        """Whether children ``a`` and ``b`` are called on the very same tensor (q/k/v on the
        normed hidden states), not merely on values of equal shape."""
        return a in self.first and self.first.get(a) == self.first.get(b)

    def called(self, child: str) -> bool:
        return child in self.feeds

    def feeders(self, child: str, through: Callable[[str], bool] = lambda _: False) -> frozenset[str]:
        """What reaches ``child``, looking through the children ``through`` accepts
        (pointwise modules: an activation, a dropout)."""
        return _close(self.feeds.get(child, frozenset()), self.feeds, through)

    def hidden_feeders(self, child: str, through: Callable[[str], bool] = lambda _: False) -> frozenset[str]:
        """What reaches ``child``'s first argument (the hidden states, not a mask or the
        rotary ``cos``/``sin`` passed beside them), looking through the children ``through``
        accepts."""
        return _close(self.hidden.get(child, frozenset()), self.feeds, through)

    def reaching_output(self, through: Callable[[str], bool] = lambda _: False) -> frozenset[str]:
        """What reaches the parent's result, looking through the children ``through`` accepts."""
        return _close(self.output, self.feeds, through)

    def returned_with(self, child: str, through: Callable[[str], bool] = lambda _: False) -> frozenset[str]:
        """What reaches the tensors of the parent's result that ``child``'s output reaches
        (itself included): the values it is combined with in one returned tensor, not the
        ones returned beside it (a ``ModelOutput``'s other fields)."""
        out: set[str] = set()
        for leaf in self.leaves:
            closed = _close(leaf, self.feeds, through)
            if child in closed:
                out |= closed
        return frozenset(out)

    def consumers(self, child: str, through: Callable[[str], bool] = lambda _: False) -> frozenset[str]:
        """The children (and :data:`OUTPUT`) ``child``'s output reaches, looking through
        the children ``through`` accepts."""
        out: set[str] = set()
        todo, seen = [child], {child}
        while todo:
            here = todo.pop()
            users = [q for q, src in self.feeds.items() if here in src]
            if here in self.output:
                users.append(OUTPUT)
            for q in users:
                if q != OUTPUT and through(q):
                    if q not in seen:
                        seen.add(q)
                        todo.append(q)
                else:
                    out.add(q)
        return frozenset(out)


def _close(
    sources: Iterable[str], feeds: Mapping[str, frozenset[str]], through: Callable[[str], bool]
) -> frozenset[str]:
    out: set[str] = set()
    todo, seen = list(sources), set()
    while todo:
        q = todo.pop()
        if q in seen:
            continue
        seen.add(q)
        if q not in (INPUT, OUTPUT, SIDE) and through(q):
            todo += feeds.get(q, frozenset())
        else:
            out.add(q)
    return frozenset(out)


_NOT_POINTWISE = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.GLU, nn.MultiheadAttention)


def pointwise(module: nn.Module) -> bool:
    """Whether ``module`` works element by element with no parameters (an activation, a
    dropout, ``Identity``): a layout passes through it unchanged."""
    if any(True for _ in module.parameters()) or isinstance(module, _NOT_POINTWISE):
        return False
    if isinstance(module, nn.Identity | nn.modules.dropout._DropoutNd):
        return True
    kind = type(module)
    if kind.__module__ in ("torch.nn.modules.activation", "transformers.activations"):
        return True
    return not module._modules and not module._buffers and _elementwise_code(module)


#: Whether a module's own code is elementwise (:func:`_elementwise_code`), by its class, forward
#: and plain attributes. Bounded: cleared when it grows past :data:`_SHAPES_MAX`.
_ELEMENTWISE_CODE: dict[tuple[Any, ...], bool] = {}


def _elementwise_code(module: nn.Module, operands: bool = False) -> bool:
    """Whether fx traces ``module``'s forward, on one tensor, into ops that each act on
    every element alone (BLOOM's ``BloomGelu``, an ``autograd.Function`` whose forward is
    ``x * 0.5 * (1 + tanh(...))``); with ``operands``, on several tensors it combines so
    (``fuse``'s ``gelu(x + bias)``). A module of any other code, or one fx cannot trace,
    is not taken for elementwise."""
    key = (type(module), type(module).forward, operands,
           tuple((k, v) for k, v in vars(module).items() if isinstance(v, _PLAIN)))
    if key in _ELEMENTWISE_CODE:
        return _ELEMENTWISE_CODE[key]
    params = _positional(module)
    found = False
    required = len([p for p in params or () if p.default is inspect.Parameter.empty])
    if params and (required == 1 or (operands and required > 1)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = fx.Tracer().trace(_recording(module, set()))  # a copy: what it sets stays off
        except Exception:  # any failure of symbolic tracing: not known to be elementwise
            graph = None
        if graph is not None:
            inputs = [n for n in graph.nodes if n.op == "placeholder"]
            ops = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
            found = bool(inputs) and all(elementwise_op(n) for n in ops) and (operands or all(
                not n.users for n in inputs[1:]))
    if len(_ELEMENTWISE_CODE) > _SHAPES_MAX:
        _ELEMENTWISE_CODE.clear()
    _ELEMENTWISE_CODE[key] = found
    return found


def own_layer(module: nn.Module, bases: tuple[type[nn.Module], ...]) -> bool:
    """Whether ``module`` is one of PyTorch's layers ``bases`` running that layer's own
    forward (a subclass with a forward of its own may compute anything)."""
    return any(isinstance(module, base) and type(module).forward is base.forward for base in bases)


class _Caller(nn.Module):
    """Calls ``inner`` with its first ``n`` positional arguments (fx cannot trace a root
    taking ``*args``/``**kwargs``, as Hugging Face decoder layers do) and the keywords of
    :data:`_FIXED` its ``forward`` takes beyond them."""

    def __init__(self, inner: nn.Module, n: int, fixed: Mapping[str, Any]) -> None:
        super().__init__()
        self.inner = inner
        self.n = n
        self.fixed = dict(fixed)

    def forward(self, a0: Any, a1: Any = None, a2: Any = None, a3: Any = None) -> Any:
        return self.inner(*(a0, a1, a2, a3)[: self.n], **self.fixed)


#: Arguments traced at a fixed value: no cache (a Hugging Face model's ``use_cache``
#: defaults to its config's, and a ``DynamicCache`` is no value fx can trace).
_FIXED: Mapping[str, Any] = MappingProxyType({"use_cache": False})


class _Leaves(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name.startswith(_INNER + ".")


#: The rank tried next where unpacking a shape fails at :data:`_ASSUMED_RANK`: a model's
#: root takes token ids ``(batch, sequence)`` (``_bsz, seq_len = tokens.size()``).
_TOKENS_RANK = 2


class _Shapes(_Leaves):
    """A tracer whose values answer ``.shape`` and ``.size()`` with a tuple of one
    ``size(i)`` node per dimension, so code that unpacks a shape into arguments
    (``x.view(*x.shape[:-1], -1, d)``, which plain fx cannot trace) traces. The number of
    dimensions is read from the trace (a view's arguments, a module keeps its input's) or
    taken as ``rank`` (:data:`_ASSUMED_RANK`); a wrong guess changes the arity of a traced
    view, never which values reach which child, which is all :func:`flow` reads. An
    unpacking that needs another arity fails the trace, which is then tried at
    :data:`_TOKENS_RANK` (:class:`_TokenShapes`)."""

    rank = _ASSUMED_RANK

    def __init__(self) -> None:
        # torch's factories called on traced sizes (OPT's ``torch.ones(batch, seq)`` mask, T5's
        # ``torch.zeros((1, heads, q, k))`` position bias) are recorded as calls, as fx records
        # math's: fx looks for the ids it wraps in the modules of ``_autowrap_search``, and
        # patches them back when the trace ends
        super().__init__(autowrap_functions=_FACTORIES)
        self._autowrap_search = [*self._autowrap_search, torch]

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ShapedProxy(node, self)

    answers: tuple[bool, ...] = ()
    taken: list[bool]

    def to_bool(self, obj: fx.Proxy) -> bool:
        """A branch on sizes alone (``q_len > 1``) takes the way a sequence of more than
        one token does, unless ``answers`` says otherwise for it (:func:`_traced`); a
        branch on tensor values still fails the trace."""
        if _sizes_only(obj.node):
            i = len(self.taken)
            self.taken.append(self.answers[i] if i < len(self.answers) else True)
            return self.taken[-1]
        return super().to_bool(obj)


#: torch's factories of new tensors from sizes, which fx cannot call on traced sizes.
_FACTORIES = (torch.ones, torch.zeros, torch.full, torch.empty, torch.arange, torch.randn, torch.rand)


class _TokenShapes(_Shapes):
    rank = _TOKENS_RANK


class _BufferShapes(_Shapes):
    """A tracer of shapes whose buffers are traced values too, tried last: code that
    slices a buffer by traced sizes (GPT-Neo's causal mask, ``self.bias[:, :, k - q:k,
    :k]``) fails on a real tensor. A buffer reaches no child's features (its node has no
    sources), so the flow is the same; it is not the first try because code that reads a
    buffer's values (``if self.flag.item()``) traces only where the buffer is real."""

    proxy_buffer_attributes = True


class _ShapedProxy(fx.Proxy):
    def __getattr__(self, k: str) -> Any:
        if k == "shape":
            return self._sizes()
        if k == "dtype":  # a dtype carries no data: code reading it (torch.finfo(x.dtype).min) traces
            return torch.get_default_dtype()
        if k == "size":
            def size(*dim: Any) -> Any:
                if dim:
                    return self.tracer.create_proxy("call_method", "size", (self, *dim), {})
                return self._sizes()
            return size
        return super().__getattr__(k)

    def _sizes(self) -> tuple[fx.Proxy, ...]:
        rank = _rank(self.node, getattr(self.tracer, "rank", _ASSUMED_RANK))
        return tuple(self.tracer.create_proxy("call_method", "size", (self, i), {}) for i in range(rank))


#: Layers whose output has their input's number of dimensions (over the last alone).
_SAME_RANK = (nn.Linear, nn.LayerNorm, nn.RMSNorm)


def _known_rank(parent: nn.Module, prefix: str, node: fx.Node, depth: int = 0) -> int | None:
    """The number of dimensions of a traced value where the code fixes it: a view by sizes
    (OPT's ``x.reshape(-1, x.size(-1))``), then layers over the last dimension and
    elementwise code; ``None`` where it is not known (a parent's argument, any other op)."""
    if depth > 32:
        return None
    if node.op == "call_method" and _op_name(node) in ("view", "reshape"):
        shape = view_shape(node, lambda t: _known_rank(parent, prefix, t, depth + 1))
        known = shape and all(isinstance(d, int | SizeOf) or (isinstance(d, fx.Node) and _sizes_only(d))
                              for d in shape)
        return len(shape) if known and not (len(shape) == 1 and isinstance(shape[0], fx.Node)) else None
    first = next(iter(node.all_input_nodes), None)
    if first is None:
        return None
    if node.op == "call_module" and str(node.target).startswith(prefix):
        child = parent.get_submodule(str(node.target)[len(prefix):])
        same = pointwise(child) or is_conv1d(child) or own_layer(child, _SAME_RANK)
        return _known_rank(parent, prefix, first, depth + 1) if same else None
    if elementwise_op(node):
        tensors = [a for a in node.all_input_nodes if not _sizes_only(a)]
        ranks = [_known_rank(parent, prefix, a, depth + 1) for a in tensors]
        return max(ranks) if ranks and all(r is not None for r in ranks) else None  # type: ignore[type-var]
    return None


def _rank(node: fx.Node, assumed: int, depth: int = 0) -> int:
    """The number of dimensions of a traced value, as far as the trace shows it, else ``assumed``."""
    first = next(iter(node.all_input_nodes), None)
    if node.op == "call_method" and node.target in ("view", "reshape", "expand", "repeat") and len(node.args) > 1:
        return len(view_shape(node, lambda t: _rank(t, assumed, depth + 1)))
    if first is None or depth > 32:
        return assumed
    inner = _rank(first, assumed, depth + 1)
    if node.op == "call_method" and node.target == "unsqueeze":
        return inner + 1
    # Falcon's fused_qkv[..., 0, :]: each integer index drops a dimension, each None adds one (one
    # integer alone may pick an item of a tuple, q of split()'s (q, k, v): not read)
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2 \
            and isinstance(index := node.args[1], tuple) \
            and all(i is None or i is Ellipsis or isinstance(i, int | slice | list) for i in index):
        return inner - sum(isinstance(i, int) for i in index) + sum(i is None for i in index)
    if node.op == "call_method" and node.target == "flatten" and inner > 0:
        given = (*node.args[1:3], *(0, -1)[len(node.args[1:3]):])  # flatten(start_dim=0, end_dim=-1)
        start, end = node.kwargs.get("start_dim", given[0]), node.kwargs.get("end_dim", given[1])
        if isinstance(start, int) and isinstance(end, int):
            return inner - ((end % inner) - (start % inner))
    return inner


def _positional(module: nn.Module) -> list[inspect.Parameter] | None:
    """``module.forward``'s positional parameters, or ``None`` where they cannot be read."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in params if p.kind in kinds]


def _keywords(module: nn.Module) -> set[str]:
    """The names ``module.forward`` takes by keyword."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in kinds}


def _arguments(params: list[inspect.Parameter], given: frozenset[str] = frozenset()) -> list[tuple[Any, ...]] | None:
    """The ways to call a parent for tracing, tried in turn, each the value of its first
    four positional arguments (:data:`_TRACED_ARG` for a traced value, else the default):
    first, where its caller hands it values for optional ones (``given``: the encoder
    states that make a decoder layer call its cross-attention), those traced too; then its
    required arguments traced; then also one optional argument typed as tensors (Hugging
    Face attention declares ``position_embeddings`` optional, though it unpacks it), never
    a cache. Other optional arguments keep their defaults (a mask of ``None``: what the
    parent computes from its children is traced, not its masking)."""
    required = [p for p in params if p.default is inspect.Parameter.empty]
    if len(required) > 4:
        return None
    base = tuple(_TRACED_ARG if p.default is inspect.Parameter.empty else _FIXED.get(p.name, p.default)
                 for p in params[:4])
    if not required:
        base = (_TRACED_ARG, *base[1:]) if base else (_TRACED_ARG,)
    handed = tuple(_TRACED_ARG if p.name in given and "mask" not in p.name else v
                   for p, v in zip(params[:4], base, strict=False))
    out = [handed] if handed != base else []
    out.append(base)
    for i, p in enumerate(params[:4]):
        hint = str(p.annotation)
        if (p.default is None and "Tensor" in hint and "Cache" not in hint and "mask" not in p.name):
            out.append(tuple(_TRACED_ARG if j == i else v for j, v in enumerate(base)))
    return out


#: Marks an argument :func:`flow` traces (the others are passed as constants).
_TRACED_ARG = object()


#: Traced flows by parent module (weakly: a module no schedule holds any more drops out),
#: with what they were traced from: its children and its plain attributes (a changed one
#: traces again).
_TRACED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], Flow | None]] = weakref.WeakKeyDictionary()
#: Traced flows by what they can depend on: the parent's class, forward and children's names
#: and classes, then the attributes its forward read and their values (plain ones by value,
#: others by identity, held here so that an identity stays theirs). The 126 attention
#: modules of a LLaMA-405B, alike but for ``layer_idx``, which their forward does not read
#: without a cache, trace once. Bounded: cleared when it grows past :data:`_SHAPES_MAX`.
_BY_SHAPE: dict[tuple[Any, ...], list[tuple[tuple[tuple[str, Any], ...], Flow | None]]] = {}
_SHAPES_MAX = 1024
_PLAIN = (int, float, str, bool, type(None))
_MISSING = object()


def flow(parent: nn.Module, given: frozenset[str] = frozenset(), *, leaf: bool = False) -> Flow | None:
    """The data flow among ``parent``'s children, or ``None`` where fx cannot trace its
    forward (the planner then reads module order). ``given``: the parameters of its
    ``forward`` its caller hands values (:attr:`Flow.given`), traced as such. ``leaf``:
    trace a module without children too (its own code: what :attr:`Flow.tokens` reads);
    else there is no flow to speak of (``None``). Traced once per module and ``given``,
    and once for modules alike in what their forward reads."""
    key = (
        type(parent).forward,
        given,
        leaf,
        _children(parent, id),
        tuple((k, v) for k, v in vars(parent).items() if isinstance(v, _PLAIN)),
    )
    known = _TRACED.get(parent)
    if known is not None and known[0] == key:
        return known[1]
    shape = (type(parent), type(parent).forward, given, leaf, _children(parent, type))
    own = vars(parent)
    alike = [f for reads, f in _BY_SHAPE.get(shape, ())
             if all(_same(own.get(name, _MISSING), value) for name, value in reads)]
    if alike:
        found = alike[0]
    else:
        found, read = _trace(parent, given, leaf)
        if len(_BY_SHAPE) > _SHAPES_MAX:
            _BY_SHAPE.clear()
        _BY_SHAPE.setdefault(shape, []).append((tuple((n, own.get(n, _MISSING)) for n in sorted(read)), found))
    _TRACED[parent] = (key, found)
    return found


def _children(parent: nn.Module, key: Callable[[nn.Module | None], Any]) -> tuple[tuple[str, Any, Any], ...]:
    """The names of ``parent``'s children with ``key`` of each (its identity for a module's
    own flow, its class for modules alike), and inside a container it calls the items of
    (an ``nn.ModuleList`` of layers) theirs: the flow names each item it calls, so two
    models alike but for their number of layers, or a list appended to, have different flows."""
    return tuple((k, key(m), _children(m, key) if m is not None and uncalled(m) else None)
                 for k, m in parent._modules.items())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, _PLAIN) and isinstance(b, _PLAIN):
        return type(a) is type(b) and a == b
    return a is b


def _recording(parent: nn.Module, read: set[str]) -> nn.Module:
    """A shallow copy of ``parent`` that notes the names of the instance attributes its
    forward reads. What the traced forward sets lands on the copy: its containers too
    (``_buffers``, ``_parameters``, ``_modules``, any dict, list or set) are copies, so
    GPT-J's ``self.embed_positions = self.embed_positions.to(...)``, a buffer, leaves the
    model's own buffer as it was (a shared ``_buffers`` got the traced value, and the
    model's next forward failed)."""
    shell = copy.copy(parent)
    for name, value in vars(parent).items():
        if isinstance(value, dict | list | set):
            shell.__dict__[name] = copy.copy(value)
    own = set(vars(parent))
    base = type(parent)

    def __getattribute__(self: nn.Module, name: str) -> Any:
        if name in own and not name.startswith("_"):
            read.add(name)
        return base.__getattribute__(self, name)

    kind = type(base.__name__, (base,), {"__getattribute__": __getattribute__})
    shell.__class__ = kind
    return shell


def _trace(parent: nn.Module, given: frozenset[str] = frozenset(), leaf: bool = False) -> tuple[Flow | None, set[str]]:
    """The flow of ``parent`` and the names of the attributes its forward read."""
    read: set[str] = set()
    params = _positional(parent)
    calls = _arguments(params, given) if params is not None and (parent._modules or leaf) else None
    if not calls or params is None:
        return None, read
    shell = _recording(parent, read)
    graph = None
    named = {p.name for p in params[:4]}
    fixed = {k: v for k, v in _FIXED.items() if k in _keywords(parent) and k not in named}
    for tracer, call in [(t, c) for t in (_Leaves, _Shapes, _TokenShapes, _BufferShapes) for c in calls]:
        # plain fx first; shapes unpacked into arguments next; buffers traced last
        graph = _traced(tracer, shell, call, fixed)
        if graph is not None:
            break
    if graph is None:
        return None, read
    prefix = _INNER + "."
    sources: dict[fx.Node, frozenset[str]] = {}
    feeds: dict[str, frozenset[str]] = {}
    reads: set[str] = set()
    first: dict[str, str] = {}
    hidden: dict[str, frozenset[str]] = {}
    apart: dict[str, Apart] = {}
    mixes: dict[str, str] = {}
    ranked: dict[str, str] = {}
    inner: dict[str, Apart] = {}
    handed: dict[str, frozenset[str]] = {}
    output: frozenset[str] = frozenset()
    leaves: tuple[frozenset[str], ...] = ()
    fields: dict[str, frozenset[str]] = {}
    args: dict[str, Mapping[str, str]] = {}
    feeds_seen: set[str] = set()
    per_head: dict[str, Meets] = {}
    operands: dict[str, set[str]] = {}
    attends = False
    # a pointwise child called more than once (T5's one dropout after the embedding and after the
    # final norm) is traced as the code it is: one name for both calls would feed the first
    # layer from the final norm, a cycle
    called = [str(n.target)[len(prefix):] for n in graph.nodes
              if n.op == "call_module" and str(n.target).startswith(prefix)]
    reused = {n for n in set(called) if called.count(n) > 1 and pointwise(parent.get_submodule(n))}
    one = {n: _one_tensor(parent.get_submodule(n)) for n in set(called)}
    for node in graph.nodes:
        upstream: frozenset[str] = frozenset().union(*(sources.get(a, frozenset()) for a in node.all_input_nodes))
        if node.op == "call_module" and str(node.target)[len(prefix):] in reused:
            sources[node] = upstream
        elif node.op == "placeholder":
            sources[node] = frozenset({INPUT if node.target == "a0" else SIDE})
        elif node.op == "get_attr":
            target = str(node.target)
            used = any(not _metadata(user) for user in node.users)  # self.wo.weight.dtype is no read
            if target.startswith(prefix) and used:
                name, _, attr = target[len(prefix) :].rpartition(".")
                if name in _child_paths(parent) and operand_of(node, prefix + name,
                                                                 functools.partial(_pointwise_call, parent, prefix)):
                    operands.setdefault(name, set()).add(attr)
                elif name in _child_paths(parent):
                    reads.add(name)
            sources[node] = frozenset()
        elif node.op == "call_module" and str(node.target).startswith(prefix):
            name = str(node.target)[len(prefix) :]
            feeds[name] = feeds.get(name, frozenset()) | upstream
            arg = next(iter([*node.args, *node.kwargs.values()]), None)
            if isinstance(arg, fx.Node):
                hidden[name] = hidden.get(name, frozenset()) | sources.get(arg, frozenset())
            if name not in first and isinstance(arg, fx.Node):
                first[name] = arg.name
            handed[name] = handed.get(name, frozenset()) | _handed(parent.get_submodule(name), node)
            args[name] = _argument_nodes(parent.get_submodule(name), node) if name not in feeds_seen else {}
            feeds_seen.add(name)
            sources[node] = frozenset({name})
            if name not in apart:
                walked = _features_of(parent, prefix, node, one[name])
                if walked.apart is not None:
                    apart[name] = walked.apart
                if walked.inner is not None:
                    inner[name] = walked.inner
                if walked.mixes is not None:
                    mixes[name] = walked.mixes
                elif walked.ranked is not None:
                    ranked[name] = walked.ranked
                if name in apart or name in inner:
                    for target, meets in head_operands(node, functools.partial(_pointwise_call, parent,
                                                                             prefix)).items():
                        index = int(target[1:]) if target[1:].isdigit() else -1  # a0..a3: its parameters
                        if 0 <= index < len(params):
                            per_head.setdefault(params[index].name, meets)
        elif node.op == "output":
            # (hidden states, attention weights, cache): the first is the result; older Hugging Face
            # modules return (attention_output,) + self_outputs[1:], a tuple concatenated
            result = _concatenated(node.args[0])
            main = result[0] if isinstance(result, tuple | list) and result else result
            output = frozenset().union(*(sources.get(a, frozenset()) for a in _nodes_in(main)))
            if isinstance(result, Mapping):
                fields = {str(k): frozenset().union(*(sources.get(a, frozenset()) for a in _nodes_in(v)))
                          for k, v in result.items()}
            leaves = tuple(sources.get(a, frozenset()) for a in _nodes_in(result))
        elif _metadata(node):
            sources[node] = frozenset()  # a shape or dtype carries no data: x.size() to view by
        else:
            sources[node] = upstream
            attends = attends or _products_of_activations(node)
    counts = _counted_by(parent, read, apart, graph, one, sources,
                         lambda shell: _traced(tracer, shell, call, fixed))
    # views by the width of the parent's hidden states (timm's B, N, C = x.shape; reshape(B, N, C)),
    # of values computed from children's outputs
    hidden_in = next((n for n in graph.nodes if n.op == "placeholder" and n.target == "a0"), None)
    by_width: dict[str, str] = {}
    for node in graph.nodes:
        if hidden_in is not None and viewed_by_width(node, hidden_in):
            for name in sorted(sources.get(node.args[0], frozenset()) - {INPUT, SIDE}):  # type: ignore[arg-type]
                by_width.setdefault(name, f"{_op_name(node)}(..., {params[0].name}'s width)")
    combining = combiners(graph, prefix, lambda n: _pointwise_call(parent, prefix, n) and not pointwise(
        parent.get_submodule(str(n.target)[len(prefix):])))
    found = Flow(MappingProxyType(feeds), output, frozenset(reads), MappingProxyType(first), MappingProxyType(apart),
                 leaves, MappingProxyType(hidden), MappingProxyType(handed), MappingProxyType(mixes), attends,
                 MappingProxyType(ranked), _tokens(graph, parent, prefix, one), MappingProxyType(inner),
                 frozenset(read), MappingProxyType(per_head), MappingProxyType(counts), MappingProxyType(by_width),
                 tuple(dict.fromkeys(called)), MappingProxyType(fields), returned(graph, prefix),
                 MappingProxyType({n: MappingProxyType(dict(a)) for n, a in args.items()}),
                 tuple(p.name for p in params[:4]),
                 MappingProxyType({n: frozenset(a) for n, a in operands.items() if n not in reads}),
                 frozenset(combining), taken(graph, prefix))
    return found, read


def _argument_nodes(child: nn.Module, node: fx.Node) -> dict[str, str]:
    """The parameters of ``child``'s forward that the call ``node`` hands a traced value,
    each with that value's node (:attr:`Flow.args`)."""
    params = _positional(child) or []
    out = {params[i].name: a.name for i, a in enumerate(node.args[: len(params)]) if isinstance(a, fx.Node)}
    out.update({k: v.name for k, v in node.kwargs.items() if isinstance(v, fx.Node)})
    return out


def _features_of(parent: nn.Module, prefix: str, node: fx.Node, one: bool) -> Walk:
    """The walk along the features of the output of the child ``node`` calls
    (:func:`.features.along_features`); ``one``: the child returns one tensor."""
    rank = _known_rank(parent, prefix, node)
    start = At() if rank is None else At(rank, assumed=False)
    channels = _channels_rank(parent, prefix, node)
    if channels is not None:  # N, C, *spatial: the features are the channels, not the last dimension
        start = At(channels, feat=1 - channels, assumed=False)
    return along_features(node, functools.partial(_pointwise_call, parent, prefix),
                          start if one else replace(start, items=None))


def _channels_rank(parent: nn.Module, prefix: str, node: fx.Node, depth: int = 0) -> int | None:
    """The rank of the output of the child ``node`` calls where its features are channels
    (:func:`.roles.channels_rank`), else ``None``. A norm over channels of no fixed rank
    (GroupNorm, BatchNorm1d) has its input's: a convolution's output, through pointwise
    modules and elementwise code."""
    if depth > 32 or node.op != "call_module" or not str(node.target).startswith(prefix):
        return None
    child = parent.get_submodule(str(node.target)[len(prefix):])
    rank = channels_rank(child)
    if rank is not None or not isinstance(child, CHANNEL_NORMS):
        return rank
    x = next(iter(node.all_input_nodes), None)
    while x is not None and (elementwise_op(x) or (x.op == "call_module" and str(x.target).startswith(prefix)
                                                    and pointwise(parent.get_submodule(str(x.target)[len(prefix):])))):
        x = next(iter(x.all_input_nodes), None)
    return None if x is None else _channels_rank(parent, prefix, x, depth + 1)


def _counted_by(parent: nn.Module, read: set[str], apart: Mapping[str, Apart], graph: fx.Graph,
                one: Mapping[str, bool], sources: Mapping[fx.Node, frozenset[str]],
                retrace: Callable[[nn.Module], fx.Graph | None]) -> dict[str, tuple[str, ...]]:
    """For each child whose output the parent's code views into heads by a constant count
    (``view(B, S, self.nh, self.hd)``), the parent's own integer attributes that give that
    count and nothing else: traced again with one of them doubled (``retrace``), the
    child's count doubles, and the code is as it was but for the sizes of views of values
    computed from such children (and the arithmetic on sizes feeding them). Then, beside
    them, the attributes holding those heads' whole width (``reshape(B, S, self.dim)``
    merging them back), found the same way. Build may make each this rank's share,
    whatever its name; one read for anything else (a loop over the heads, a scale, a range
    of slopes, a view of the input) is not, and a view by it stays refused."""
    wanted = {name: how.dims[0] for name, how in apart.items()
              if how.kind is ApartKind.HEADS and len(how.dims) >= 2 and isinstance(how.dims[0], int)
              and how.dims[0] > 0}
    own = vars(parent)
    prefix = _INNER + "."

    seen: dict[str, tuple[fx.Graph, frozenset[str]] | None] = {}

    def doubled(attr: str) -> tuple[fx.Graph, frozenset[str]] | None:
        """The trace with ``attr`` doubled, and the children whose values the views it
        resized hold; ``None`` where it changed more than sizes."""
        if attr not in seen:
            seen[attr] = _doubled(attr)
        return seen[attr]

    def _doubled(attr: str) -> tuple[fx.Graph, frozenset[str]] | None:
        shell = _recording(parent, set())
        shell.__dict__[attr] = 2 * own[attr]
        other = retrace(shell)
        resized = _resized(graph, other) if other is not None else None
        if other is None or resized is None:
            return None
        return other, frozenset().union(*(sources.get(n.args[0], frozenset()) for n in resized  # type: ignore[arg-type]
                                          if n.args and isinstance(n.args[0], fx.Node)))

    found: dict[str, list[str]] = {}
    for attr in sorted(read):
        value = own.get(attr)
        if type(value) is not int or value not in wanted.values() or (got := doubled(attr)) is None:
            continue
        other, holders = got
        calls = {str(n.target)[len(prefix):]: n for n in other.nodes
                 if n.op == "call_module" and str(n.target).startswith(prefix)}
        counted = {name for name, count in wanted.items() if count == value and name in calls
                   and _features_of(parent, prefix, calls[name], one[name]).apart
                   == replace(apart[name], dims=(2 * count, *apart[name].dims[1:]))}
        if counted and holders <= counted:
            for name in sorted(counted):
                found.setdefault(name, []).append(attr)
    counts = {name: tuple(attrs) for name, attrs in found.items()}
    widths: dict[str, tuple[str, ...]] = {}
    for name, attrs in counts.items():
        child = parent.get_submodule(name)
        width = None if (features := linear_features(child)) is None else features[1]
        heads = {q for q, a in counts.items() if a == attrs}  # the children counted alike
        widths[name] = tuple(attr for attr in sorted(read - set(attrs))
                             if isinstance(width, int) and type(own.get(attr)) is int and own[attr] == width
                             and (got := doubled(attr)) is not None and got[1] and got[1] <= heads)
    return {name: (*attrs, *widths[name]) for name, attrs in counts.items()}


#: Ops whose integer arguments are sizes: a view by sizes, or a tensor made to a shape.
_SIZED = frozenset({"view", "reshape", "expand", "unflatten", "new_zeros", "new_ones", "new_empty", "new_full"})


def _resized(a: fx.Graph, b: fx.Graph) -> list[fx.Node] | None:
    """Where two traces of one forward are the same code but for integer sizes (of views,
    :data:`_SIZED`, and of arithmetic on sizes alone: ``bsz * self.nh``), the views of
    ``a`` whose sizes differ; ``None`` where they differ in anything else."""
    left, right = list(a.nodes), list(b.nodes)
    if len(left) != len(right):
        return None
    index = {n: i for i, n in enumerate(left)} | {n: i for i, n in enumerate(right)}

    def plain(arg: Any, sized: bool) -> Any:
        if isinstance(arg, fx.Node):
            return ("node", index[arg])
        if isinstance(arg, tuple | list):
            return tuple(plain(x, sized) for x in arg)
        if isinstance(arg, dict):
            return tuple(sorted((k, plain(v, sized)) for k, v in arg.items()))
        if sized and isinstance(arg, int) and not isinstance(arg, bool):
            return "size"
        return ("tensor", tuple(arg.shape)) if isinstance(arg, torch.Tensor) else arg

    changed: set[fx.Node] = set()
    for x, y in zip(left, right, strict=True):
        if x.op != y.op or x.target != y.target:
            return None
        sized = (x.op in ("call_method", "call_function") and _op_name(x) in _SIZED) or _sizes_only(x)
        if plain((x.args, x.kwargs), sized) != plain((y.args, y.kwargs), sized):
            return None
        if sized and plain((x.args, x.kwargs), False) != plain((y.args, y.kwargs), False):
            changed.add(x)
        elif sized and any(n in changed for n in x.all_input_nodes if _sizes_only(n)):
            changed.add(x)  # sizes computed from a changed size
    return [n for n in changed if n.op in ("call_method", "call_function") and _op_name(n) in _SIZED]


def _tokens(graph: fx.Graph, parent: nn.Module, prefix: str, one: Mapping[str, bool]) -> Mapping[int, Tokens]:
    """:attr:`Flow.tokens`: the parent's first argument followed along its sequence;
    ``one``: which called children return one tensor (:func:`_one_tensor`)."""
    first = next((n for n in graph.nodes if n.op == "placeholder" and n.target == "a0"), None)
    if first is None:
        return MappingProxyType({})

    def child(node: fx.Node) -> str | None:
        target = str(node.target)
        return target[len(prefix):] if node.op == "call_module" and target.startswith(prefix) else None

    return MappingProxyType({
        seq_axis: along_tokens(first, functools.partial(_pointwise_call, parent, prefix), seq_axis, child,
                               one.__getitem__)
        for seq_axis in (0, 1)})


def _concatenated(result: Any) -> Any:
    """``result`` with a traced tuple concatenation ``(a, b) + rest`` as the tuple
    ``(a, b, rest)``: its first items are the literal's."""
    if (isinstance(result, fx.Node) and result.op == "call_function" and _op_name(result) == "add"
            and len(result.args) == 2 and isinstance(result.args[0], tuple) and result.args[0]):
        return (*result.args[0], _concatenated(result.args[1]))
    return result


def _one_tensor(module: nn.Module) -> bool:
    """Whether ``module`` returns one tensor (a layer, a norm, an activation), not maybe
    a tuple as Hugging Face attention does."""
    return (isinstance(module, nn.Linear | nn.LayerNorm | nn.RMSNorm | nn.Embedding)
            or is_conv1d(module) or pointwise(module))


def _handed(child: nn.Module, node: fx.Node) -> frozenset[str]:
    """The parameters of ``child``'s forward that call ``node`` hands a traced value."""
    params = _positional(child) or []
    names = {params[i].name for i, a in enumerate(node.args[: len(params)]) if _nodes_in(a)}
    return frozenset(names | {k for k, v in node.kwargs.items() if _nodes_in(v)})


#: How many ways through a parent's branches on sizes one tracer tries.
_BRANCH_TRIES = 8


def _traced(
    tracer: type[_Leaves], shell: nn.Module, call: tuple[Any, ...], fixed: Mapping[str, Any]
) -> fx.Graph | None:
    """``shell``'s graph traced with ``tracer`` on ``call``'s arguments, or ``None``. A
    tracer of shapes answers branches on sizes alone ``True`` first; where the trace then
    fails (``if seq_len > self.max_seq_len: raise``), the last ``True`` is turned
    ``False`` and the trace tried again, depth first."""
    einops_on_traced_values()  # a parent written with einops traces into its reshapes
    concrete = {f"a{i}": v for i, v in enumerate(call) if v is not _TRACED_ARG}
    concrete.update({f"a{i}": None for i in range(len(call), 4)})
    answers: tuple[bool, ...] = ()
    for _ in range(_BRANCH_TRIES):
        t = tracer()
        if isinstance(t, _Shapes):
            t.answers, t.taken = answers, []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return t.trace(_Caller(shell, len(call), fixed), concrete_args=concrete)
        except Exception:  # any failure of symbolic tracing: another way, else no graph
            taken = t.taken if isinstance(t, _Shapes) else []
            if True not in taken:
                return None
            last = len(taken) - 1 - taken[::-1].index(True)
            answers = (*taken[:last], False)
    return None


_PRODUCTS = frozenset({"matmul", "bmm", "baddbmm", "einsum", "scaled_dot_product_attention"})


def _products_of_activations(node: fx.Node) -> bool:
    """Whether ``node`` multiplies two activations (``q @ k.transpose(-2, -1)``): two of its
    tensor operands computed by the code, not read from parameters (``x @ self.w`` is a
    linear layer)."""
    if node.op not in ("call_function", "call_method") or _op_name(node) not in _PRODUCTS:
        return False
    return sum(1 for a in _nodes_in(node.args) if a.op != "get_attr") >= 2


def _pointwise_call(parent: nn.Module, prefix: str, node: fx.Node) -> bool:
    """Whether ``node`` calls a pointwise child of ``parent`` (an activation, a dropout),
    or a child whose code combines, element by element, one activation with parameters
    of its siblings alone (``fuse``'s ``gelu(x + bias)`` handed a Linear's bias; its own
    children pointwise, as GPT-2's ``act(x + bias)`` calling its ``NewGELUActivation``)."""
    target = str(node.target)
    if not target.startswith(prefix):
        return False
    child = parent.get_submodule(target[len(prefix):])
    if pointwise(child):
        return True
    values = [a for a in _nodes_in((node.args, node.kwargs)) if not read_of_a_child(a, prefix, _child_paths(parent))]
    return (len(values) == 1 and not any(True for _ in child.parameters()) and all(map(pointwise, child.children()))
            and not child._buffers and _elementwise_code(child, operands=True))


def _child_paths(parent: nn.Module) -> set[str]:
    return {name for name, _ in parent.named_modules() if name}
