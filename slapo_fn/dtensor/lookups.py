"""The planner's lookups over the traced parents of a schedule's model: a parent's data
flow (:func:`_flow_of`), the module whose traced ``forward`` calls a path
(:func:`_caller`), which children a layout passes through (:func:`_through`), the order
the modules run in (:func:`_run_order`) and where an output goes (:func:`_downstream`,
:func:`_reach`). Within one :func:`~.plan.plan` or :func:`~.checks.refusals` call each is
found once (:func:`_flows_memo`, a context variable: no state outlives the call).

One reason to change: how the planner reads the traced model (:mod:`.flow`), never a
layout rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType

from torch import nn

from ..hf import linear_features
from ..rewrites._common import INSTALLED, contains, within
from ..schedule import Schedule
from ..tree import caller_path, child_names, get_module, join, parent_path, split, uncalled
from .features import Meets
from .flow import OUTPUT, Flow, flow, pointwise
from .local import LOCAL
from .roles import CONVOLUTIONS
from .sequence import SEQ, SeqSpec
from .shard import ROLE
from .sync import SYNC

__all__ = ["per_head_operands", "read_positions"]


_parent = parent_path


def _siblings(root: nn.Module, path: str) -> list[str]:
    """``path`` and the other children of its parent, in order (the root is alone)."""
    if not path:
        return [path]
    parent = _parent(path)
    return [join(parent, n) for n in child_names(get_module(root, parent))]


def _in_features(module: nn.Module) -> int | None:
    return None if (f := linear_features(module)) is None else f[0]


def _in_width(module: nn.Module) -> int | None:
    """The width of what a layer takes along its features: a linear layer's input features,
    a convolution's input channels."""
    return _in_features(module) if not isinstance(module, CONVOLUTIONS) else module.in_channels


def per_head_operands(sch: Schedule, parent: str) -> Mapping[str, Meets]:
    """The arguments of the module at ``parent`` that its code adds to its heads (a
    per-head bias), each with where it meets them (:attr:`.flow.Flow.per_head`);
    empty where it adds none or cannot be traced."""
    fl = _flow_of(sch, parent)
    return {} if fl is None else fl.per_head


def _flow_of(sch: Schedule, parent: str) -> Flow | None:
    """The data flow among the children of the module at ``parent``, traced with the values
    the module that calls it hands it (cached by :func:`.flow.flow`; within one
    :func:`.plan.plan` or :func:`.checks.refusals`, looked up once per path)."""
    memo = _LOOKUPS.get()
    key = (id(sch.module), parent)
    if memo is not None and key in memo.flows:
        return memo.flows[key]
    found = _caller(sch, parent) if parent else None
    got = flow(get_module(sch.module, parent), found[2].given.get(found[1], frozenset()) if found else frozenset())
    if memo is not None:
        memo.flows[key] = got
    return got


@dataclass
class _Lookups:
    """The flows (:func:`_flow_of`) and callers (:func:`_caller`) found by the :func:`.plan.plan`
    or :func:`.checks.refusals` call under way, keyed by the model's id and a path: each path's
    caller is found from its ancestors' flows, so a lookup repeats theirs."""

    flows: dict[tuple[int, str], Flow | None] = field(default_factory=dict)
    callers: dict[tuple[int, str], tuple[str, str, Flow] | None] = field(default_factory=dict)
    #: :func:`.chains._whole_in_chains` of the schedule it was found for (read by the plan and several refusals)
    whole: tuple[Schedule, dict[str, SeqSpec]] | None = None
    #: :func:`_run_order` of the schedule it was found for
    order: tuple[Schedule, Mapping[str, int]] | None = None


#: The lookups of the call under way; ``None`` outside one.
_LOOKUPS: ContextVar[_Lookups | None] = ContextVar("slapo_fn_plan_lookups", default=None)


@contextlib.contextmanager
def _flows_memo() -> Iterator[None]:
    """Memoise :func:`_flow_of` and :func:`_caller` for the call under way (the schedule
    is not changed during it)."""
    if _LOOKUPS.get() is not None:
        yield
        return
    token = _LOOKUPS.set(_Lookups())
    try:
        yield
    finally:
        _LOOKUPS.reset(token)


def _caller(sch: Schedule, path: str) -> tuple[str, str, Flow] | None:
    """The module whose traced ``forward`` calls ``path``, ``path``'s name in it and its
    flow: the parent, or an ancestor past containers with no ``forward`` of their own (an
    ``nn.ModuleList`` of decoder layers, whose items the model's loop calls as
    ``layers.0``, ``layers.1``) or past modules that do not call it (OPT's root calls
    ``self.model.decoder``, not ``self.model``). ``None`` where no traced ancestor calls it."""
    if not path:
        return None
    memo = _LOOKUPS.get()
    key = (id(sch.module), path)
    if memo is not None and key in memo.callers:
        return memo.callers[key]
    found = _find_caller(sch, path)
    if memo is not None:
        memo.callers[key] = found
    return found


def _find_caller(sch: Schedule, path: str) -> tuple[str, str, Flow] | None:
    parts = split(path)
    for depth in range(len(parts) - 1, -1, -1):
        here, name = join(*parts[:depth]), join(*parts[depth:])
        fl = _flow_of(sch, here)
        if fl is not None and fl.called(name):
            return here, name, fl
        if fl is None and not uncalled(get_module(sch.module, here)):
            return None  # an untraced module between: what calls the path is unknown
    return None


def _through(sch: Schedule, parent: str) -> Callable[[str], bool]:
    """Which children of ``parent`` a layout passes through unchanged: pointwise modules
    (activations, dropouts) with no layout of their own (a sync from a layout to the
    same one moves nothing), modules declared to run on this rank's shard
    (:func:`~slapo_fn.dtensor.tp_local`: Qwen3's per-head q/k norms), and modules whose
    role keeps this rank's features (:attr:`.roles.Role.keeps`: a BatchNorm split by channels)."""
    moving = {q for q, specs in sch.annotations.of_kind(SYNC).items()
              if any(s.mode == "bwd_post" or s.src is None or s.src != s.layout for s in specs)}
    roles = sch.annotations.of_kind(ROLE)
    keeps = {q for q, r in roles.items() if r.keeps}  # a norm over channels split with them
    annotated = (set(roles) - keeps) | set(sch.annotations.of_kind(SEQ)) | moving
    # tp_local: runs on this rank's shard as it is (per-head norms), as a role that keeps it does
    local = set(sch.annotations.of_kind(LOCAL)) | keeps
    pm = get_module(sch.module, parent)
    fl = _flow_of(sch, parent)
    combines = fl.combines if fl is not None else frozenset()
    return lambda q: join(parent, q) not in annotated and (join(parent, q) in local or q in combines
                                                           or pointwise(get_module(pm, q)))


def _out_features(module: nn.Module) -> int | None:
    return None if (f := linear_features(module)) is None else f[1]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _later_modules(root: nn.Module, path: str) -> Iterator[str]:
    """The modules that run after ``path`` in module order: its later siblings, then its
    parent's later siblings, and so on up to the root's children."""
    tokens = split(path)
    for depth in range(len(tokens), 0, -1):
        here = ".".join(tokens[:depth])
        siblings = _siblings(root, here)
        yield from siblings[siblings.index(here) + 1 :]


def _result_of_caller(sch: Schedule, path: str) -> str | None:
    """The module whose result ``path``'s output reaches (through pointwise code) in its
    forward, or ``None`` (it goes elsewhere first, or the flow is unknown, or it is the root)."""
    found = _caller(sch, path)
    if found is None:
        return None
    parent, name, fl = found
    return parent if parent and OUTPUT in fl.consumers(name, _through(sch, parent)) else None


def _ancestors(path: str) -> list[str]:
    """The modules that hold ``path``, innermost first, the root (``""``) last."""
    tokens = split(path)
    return [".".join(tokens[:i]) for i in range(len(tokens) - 1, -1, -1)]


def _users(sch: Schedule, path: str) -> list[str] | None:
    """The modules ``path``'s output reaches (through pointwise ones), by the data flow, up
    the tree while it leaves its parent; ``None`` where a parent's flow is unknown."""
    return _reach(sch, path)[0]


@dataclass(frozen=True)
class _Level:
    """One parent on the way of a module's output: what it reaches there (``users``, with
    :data:`.flow.OUTPUT` where it leaves the parent), by the parent's ``flow``."""

    parent: str
    name: str
    flow: Flow
    through: Callable[[str], bool]
    users: frozenset[str]


def read_positions(sch: Schedule, path: str) -> frozenset[int] | None:
    """The positions of ``path``'s tuple output that some code reads, by its caller's traced
    code (:attr:`.flow.Flow.taken`) and, for a position only handed on as the caller's own,
    by the caller's caller; ``None`` where any may be read (the caller is not traced, or reads
    the output otherwise than by constant positions). The model's own output is the user's:
    all of it is read."""
    found = _caller(sch, path)
    if found is None:
        return None
    here, name, fl = found
    positions = fl.taken.get(name)
    if positions is None:
        return None
    above = read_positions(sch, here) if here and any(j is not None for j in positions.values()) else None
    return frozenset(i for i, j in positions.items() if j is None or above is None or j in above)


def _downstream(sch: Schedule, path: str) -> tuple[list[_Level], str | None]:
    """Where ``path``'s output goes by the data flow: one level per parent while it leaves
    the parent (up to the root), and the path from which module order must go on — ``None``
    if it stays inside a parent whose flow is known, ``""`` past the root, else the first
    module whose parent's flow is unknown."""
    levels: list[_Level] = []
    start = path
    while start:
        found = _caller(sch, start)  # past a ModuleList, to the module whose loop calls its items
        if found is None:
            return levels, start
        parent, name, fl = found
        through = _through(sch, parent)
        users = fl.consumers(name, through)
        levels.append(_Level(parent, name, fl, through, users))
        if OUTPUT not in users:
            return levels, None
        start = parent
    return levels, start


def _read_by(sch: Schedule, path: str) -> frozenset[str] | None:
    """The modules that read ``path``'s output (through pointwise ones), up the tree while
    it leaves its parent, as :func:`_downstream` finds them, but following a parent's
    result by its named fields (a ``ModelOutput``): a model's ``last_hidden_state`` read
    by its caller's LM head reaches the caller's result only if a field holding it does.
    ``None`` where some of it may reach the model's result, or a flow is unknown."""
    users: set[str] = set()
    start, fields = path, None  # the fields of start's result that hold it (None: not known)
    while start:
        found = _caller(sch, start)
        if found is None:
            return None
        parent, name, fl = found
        through = _through(sch, parent)
        users |= {join(parent, q) for q in fl.consumers(name, through) - {OUTPUT}}
        carriers, todo = {name}, [name]  # it, and the pointwise children it passes through
        while todo:
            here = todo.pop()
            for q in [q for q, src in fl.feeds.items() if here in src and through(q) and q not in carriers]:
                carriers.add(q)
                todo.append(q)
        if not (carriers & fl.output or any(carriers & leaf for leaf in fl.leaves)):
            return frozenset(users)  # in no tensor of the parent's result (a tuple's second included)
        # through a pointwise child it reaches the result by no field of its own
        alone = carriers == {name}
        returned = fl.returned.get(name, frozenset({""}))
        if alone and fields is not None and "" not in returned and not returned & fields:
            return frozenset(users)  # only other fields of its output reach the result
        held = frozenset(k for k, src in fl.fields.items() if name in src)
        start, fields = parent, (held if fl.fields and alone else None)
    return None


def _origin(sch: Schedule, path: str) -> tuple[str, str] | None:
    """Where the tensor ``path`` is called on is made: the module whose traced code makes it
    and its node there, following it out of each caller that merely hands on an argument
    of its own other than its first (:attr:`.flow.Flow.args`): every decoder layer's
    cross-attention k/v read the one tensor the model makes of the encoder's output. Not
    out of a module whose first argument it is, nor out of one with syncs or in a
    sequence-parallel chain: build's forwards convert those modules' inputs (an entry into
    the region, a gather, a stated layout), so what their children read is another
    tensor. ``None`` where its caller's flow is unknown."""
    found = _caller(sch, path)
    if found is None or found[1] not in found[2].first:
        return None
    here, _, fl = found
    node = fl.first[found[1]]
    converting = set(sch.annotations.of_kind(SYNC)) | set(sch.annotations.of_kind(SEQ))
    while here:
        params = fl.params
        index = int(node[1:]) if node[:1] == "a" and node[1:].isdigit() else -1
        held = here in converting or any(contains(r, here) for r in sch.annotations.of_kind(SEQ))
        up = _caller(sch, here) if 0 < index < len(params) and not held else None
        handed = None if up is None else up[2].args.get(up[1], {}).get(params[index])
        if up is None or handed is None:
            break
        here, fl, node = up[0], up[2], handed
    return here, node


def _installed(sch: Schedule, path: str) -> bool:
    """Whether ``path`` is, or is inside, a module installed by ``sf.replace``: code written
    for this rank's share (slapo_fn's attention kernels take their head counts from the
    recipe), trusted with what it is handed."""
    return any(within(a, path) for a in sch.annotations.of_kind(INSTALLED))


def _reach(sch: Schedule, path: str) -> tuple[list[str] | None, str | None]:
    """Where ``path``'s output goes, from one walk of :func:`_downstream`: the modules it
    reaches (through pointwise ones, up the tree while it leaves its parent; ``None`` where
    a parent's flow is unknown), and the module fx cannot trace whose code takes it (past
    containers without a ``forward`` of their own; ``None`` where the flow is known all the
    way, or that module is :func:`_installed`)."""
    levels, start = _downstream(sch, path)
    if not start:
        return [join(lv.parent, q) for lv in levels for q in sorted(lv.users - {OUTPUT})], None
    around = caller_path(sch.module, start)
    return None, None if _installed(sch, around) else around


def _model_output(sch: Schedule, path: str) -> bool:
    """Whether ``path``'s output is the model's result and nothing else reads it."""
    users = _users(sch, path)
    if users != []:
        return False
    here = path
    while here:  # at every level it reaches the result of the module calling it alone
        found = _caller(sch, here)
        if found is None or found[2].reaching_output(_through(sch, found[0])) != {found[1]}:
            return False
        here = found[0]
    return True


def _run_order(sch: Schedule) -> Mapping[str, int]:
    """Each module path's place in the order the model runs them, pre-order: the children of
    a parent whose forward fx traces come in the order its code first calls them, in the
    places module order gives the called ones (OPT's decoder registers ``final_layer_norm``
    before ``layers`` and calls it after them); elsewhere module order. The order of two
    paths is their common ancestor's, so only the ancestors of sequence-parallel members,
    whose chains the order decides (first, last, what runs between), are traced for it.
    Found once per :func:`.plan.plan` or :func:`.checks.refusals` call."""
    memo = _LOOKUPS.get()
    if memo is not None and memo.order is not None and memo.order[0] is sch:
        return memo.order[1]
    traced = {a for q in sch.annotations.of_kind(SEQ) for a in _ancestors(q)}
    paths: list[str] = []

    def visit(path: str, module: nn.Module) -> None:
        paths.append(path)
        names = [n for n, c in module._modules.items() if c is not None]
        fl = _flow_of(sch, path) if path in traced and len(names) > 1 and not uncalled(module) else None
        if fl is not None:
            first: dict[str, int] = {}
            for i, called in enumerate(fl.order):
                first.setdefault(split(called)[0], i)
            ordered = iter(sorted((n for n in names if n in first), key=first.__getitem__))
            names = [next(ordered) if n in first else n for n in names]
        for n in names:
            visit(join(path, n), module._modules[n])  # type: ignore[arg-type]

    visit("", sch.module)
    found = MappingProxyType({q: i for i, q in enumerate(paths)})
    if memo is not None:
        memo.order = (sch, found)
    return found
