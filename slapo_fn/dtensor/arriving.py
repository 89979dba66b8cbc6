"""The layouts that reach a module's input and leave its output over one mesh axis: those
syncs state (:func:`_split_by_sync`, :func:`_stated_output`, a column's output kept split
or gathered) and those the data flow carries from the model's input
(:class:`_Features`).

One reason to change: how a layout is stated by a sync or carried along the data flow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..rewrites._common import INSTALLED, within
from ..schedule import Schedule
from ..tree import get_module, join, split
from .chains import _chain_exits, _in_chain
from .experts import EXPERTS
from .flow import INPUT, OUTPUT, SIDE, pointwise
from .local import LOCAL
from .lookups import _caller, _flow_of, _flows_memo, _model_output, _through
from .planned import ModulePlan, _gathers_output, _last_dim
from .roles import Role
from .sequence import SEQ
from .shard import ROLE
from .sync import SYNC, SyncSpec

__all__ = ["stated_model_output"]


def _moving(specs: tuple[SyncSpec, ...], mode: str) -> SyncSpec | None:
    """The last sync of ``mode`` that moves a layout: stacked syncs run in order, so the
    module sees what the last leaves (a sync from a layout to itself moves nothing: the
    module sees what arrives)."""
    return next((s for s in reversed(specs) if s.mode == mode and s.src != s.layout), None)


def _arrives_feature_split(sch: Schedule, path: str, axis: str, pre: SyncSpec | None,
                           know: Callable[[str], _Features], stated: SyncSpec | None = None) -> bool:
    """Whether ``path``'s input arrives split on its features over ``axis``: a ``fwd_pre``
    sync moves it to ``Shard(-1)``, or, with none, the data flow brings this rank's
    features (:class:`_Features` of the axis, from ``know``). Where the flow cannot
    tell (columns in another parent: BERT's attention output), every sibling feeding it
    states its output so (:func:`_fed_split`), or a sync from ``Shard(-1)`` to itself
    (``stated``) says it arrives so."""
    if pre is not None:
        return pre.mesh_axis == axis and _last_dim(pre.layout)
    known = know(axis).arriving(path)
    if known is not None:
        return _last_dim(known)
    return _fed_split(sch, path, axis) or (stated is not None and stated.mesh_axis == axis and _last_dim(stated.src)
                                           and _last_dim(stated.layout))


def _partner_gathered(sch: Schedule, columns: tuple[str, ...], axis: str) -> bool:
    """Whether a ``fwd_post`` sync moves a paired column's output off its ``Shard(-1)``
    (to ``Replicate()`` or a sequence shard): the row then takes a whole-width input and
    splits it itself, a backward all-gather."""
    syncs = sch.annotations.of_kind(SYNC)
    return any(_gathers_output(syncs.get(c, ()), axis) for c in columns)


def _kept_columns(sch: Schedule, paired: Iterable[str]) -> frozenset[str]:
    """The columns among ``paired`` (those with rows to hand their output to) whose output
    stays this rank's features (``Shard(-1)``) for those rows: no ``fwd_post`` sync of
    theirs moves it off the split over the column's mesh axis. Before the plan is made;
    after, :attr:`.planned.ModulePlan.keeps_features` says the same of each module."""
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    return frozenset(q for q in paired if (r := roles.get(q)) is not None and r.enters
                     and not _partner_gathered(sch, (q,), r.mesh_axis))


def _input_reaches_column(sch: Schedule, path: str, axis: str, depth: int = 0) -> bool:
    """Whether ``path`` is a column over ``axis``, or its own code hands its input to one
    (through its children, as far as their data flow is known): that column's entry then
    all-reduces the input's gradient."""
    role = sch.annotations.get(path, ROLE)
    if role is not None and role.enters and role.mesh_axis == axis:
        return True
    fl = _flow_of(sch, path) if depth < 8 else None
    if fl is None:
        return False
    return any(c not in (OUTPUT, SIDE, INPUT) and _input_reaches_column(sch, join(path, c), axis, depth + 1)
               for c in fl.consumers(INPUT, _through(sch, path)))


def _arriving_at(know: Callable[[str], _Features], path: str, axis: str) -> Placement | None:
    """The features the data flow brings to ``path``'s input over ``axis`` (``None``: unknown)."""
    return know(axis).arriving(path)


def _arriving(sch: Schedule, know: Callable[[str], _Features], path: str, axis: str) -> Placement | None:
    """The layout ``path``'s input arrives in over ``axis``: the features the data flow
    brings (:func:`_arriving_at`), else the layout the one module feeding it states for its
    output (:func:`_stated_input`); ``None`` where neither is known."""
    return _arriving_at(know, path, axis) or _stated_input(sch, path, axis)


def _stated_input(sch: Schedule, path: str, axis: str) -> Placement | None:
    """The layout over ``axis`` that the ``fwd_post`` syncs of the one module feeding
    ``path``'s input in its caller's traced code state for that module's output (or that
    its own children state, :func:`_stated_output`): a GELU after a Linear whose output a
    sync splits along the sequence arrives split so. ``None`` where another value, or more
    than one module, feeds it, or none states a layout."""
    found = _caller(sch, path)
    if found is None:
        return None
    here, name, fl = found
    feeders = fl.hidden_feeders(name)
    if len(feeders) != 1 or feeders & {INPUT, SIDE}:
        return None
    return _stated_by(sch, join(here, next(iter(feeders))), axis)


def _stated_output(sch: Schedule, path: str, axis: str) -> Placement | None:
    """The layout over ``axis`` that the last ``fwd_post`` sync of the child that alone
    makes ``path``'s output states (looking down through such children, and through
    pointwise ones after it), by the data flow; ``None`` where none states one."""
    fl = _flow_of(sch, path)
    if fl is None:
        return None
    reach = fl.reaching_output(_through(sch, path))
    if len(reach) != 1 or reach & {INPUT, SIDE}:
        return None
    return _stated_by(sch, join(path, next(iter(reach))), axis)


def _output_before_syncs(sch: Schedule, know: Callable[[str], _Features], path: str, axis: str) -> Placement | None:
    """The layout over ``axis`` of ``path``'s output before its ``fwd_post`` syncs, where the
    plan knows it: what a sync states on the child that alone makes it
    (:func:`_stated_output`), else, for a module with no role, what the data flow makes
    (:meth:`_Features.made`: columns kept split up to a caller that gathers, their ``Shard(-1)``)."""
    stated = _stated_output(sch, path, axis)
    if stated is not None or sch.annotations.get(path, ROLE) is not None:
        return stated
    return know(axis).made(path, own_syncs=False)


def _stated_by(sch: Schedule, module: str, axis: str) -> Placement | None:
    """The layout over ``axis`` that ``module``'s last ``fwd_post`` sync states for its
    output, else the one its children state (:func:`_stated_output`)."""
    stated = [s.layout for s in sch.annotations.of_kind(SYNC).get(module, ()) if s.mode == "fwd_post"
              and s.mesh_axis == axis and s.src != s.layout]
    return stated[-1] if stated else _stated_output(sch, module, axis)


def _fed_split(sch: Schedule, path: str, axis: str) -> bool:
    """Whether everything that reaches row ``path`` comes from siblings whose syncs leave
    their output ``Shard(-1)`` over ``axis`` (:func:`_split_by_sync`): the row then takes
    its input split as it is (the sync's boundary carries the collective), with no split
    of its own."""
    found = _caller(sch, path)
    if found is None:
        return False
    parent, name, fl = found
    fed = fl.feeders(name, _through(sch, parent))
    return bool(fed) and all(q not in (INPUT, OUTPUT, SIDE) and _split_by_sync(sch, join(parent, q), axis)
                             for q in fed)


def _split_by_sync(sch: Schedule, path: str, axis: str) -> bool:
    """Whether the syncs of ``path`` leave its output ``Shard(-1)`` over ``axis``: the last
    ``fwd_post`` sync that moves a layout states it (a sync from a layout to itself moves
    nothing; a later one may gather it back). Where none moves its output, a pointwise
    module (an activation) whose ``fwd_pre`` sync splits its input by features hands on
    this rank's features as they are (a row after ``sync(act, 'fwd_pre', Shard(-1))``
    takes them so; code after it must act on each feature alone)."""
    syncs = sch.annotations.of_kind(SYNC).get(path, ())
    if any(s.mode == "fwd_post" and s.src != s.layout for s in syncs):
        moving = [s for s in syncs if s.mode == "fwd_post" and s.mesh_axis == axis and s.src != s.layout]
        return bool(moving) and _last_dim(moving[-1].layout)
    pre = _moving(syncs, "fwd_pre")
    return (pre is not None and pre.mesh_axis == axis and _last_dim(pre.layout)
            and pointwise(get_module(sch.module, path)))


def _split_outputs(sch: Schedule, modules: Mapping[str, ModulePlan]) -> dict[str, str]:
    """The modules whose output reaches their parent's code as this rank's features, with
    the mesh axis: columns kept split for their rows, and outputs a sync splits."""
    out = {path: mp.role.mesh_axis for path, mp in modules.items()
           if path and mp.role is not None and mp.keeps_features}
    for path, specs in sch.annotations.of_kind(SYNC).items():
        for sp in specs:
            if path and path not in out and _split_by_sync(sch, path, sp.mesh_axis):
                out[path] = sp.mesh_axis
    return out


def stated_model_output(sch: Schedule) -> dict[str, Placement]:
    """Per mesh axis, the layout syncs state for the model's result: a ``fwd_post`` sync on
    the root, or on a module whose output is the result and nothing else's (vocab-parallel
    logits kept split), or a ``fwd_pre`` sync on an elementwise module there (its output
    keeps its input's layout); the outermost one stated wins. Axes not named are whole."""
    with _flows_memo():
        syncs: dict[str, tuple[SyncSpec, ...]] = sch.annotations.of_kind(SYNC)
        paths = sorted((q for q in syncs if not q or _model_output(sch, q)), key=lambda q: -len(split(q)))
        out: dict[str, Placement] = {}
        for q in paths:
            through = bool(q) and pointwise(get_module(sch.module, q))
            for mode in ("fwd_pre", "fwd_post"):
                for spec in syncs[q]:
                    if spec.mode == mode and (mode == "fwd_post" or through):
                        out[spec.mesh_axis] = spec.layout
        return out


class _Features:
    """What the plan knows of activations' features over one mesh axis: ``Replicate()``
    (every rank holds them whole) or ``Shard(-1)`` (this rank's), by the data flow from
    the model's input; ``None`` where it cannot know (a flow fx cannot trace, a token
    shard or a partial sum, a chain, the user's own code: installed, ``tp_local``,
    experts). Roles give their outputs (a column kept for its rows ``Shard(-1)``, gathered
    otherwise; rows and embeddings reduce or gather), a sync the layout it moves to, a
    parent what reaches its result, a leaf module what reaches it."""

    def __init__(self, sch: Schedule, axis: str, partners: Mapping[str, tuple[str, ...]]) -> None:
        self.sch, self.axis = sch, axis
        self.roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
        self.syncs: dict[str, tuple[SyncSpec, ...]] = sch.annotations.of_kind(SYNC)
        self.own = set(sch.annotations.of_kind(LOCAL)) | set(sch.annotations.of_kind(INSTALLED)) | set(
            sch.annotations.of_kind(EXPERTS))
        self.kept = _kept_columns(sch, (q for q, ps in partners.items() if ps))
        self.exit = _chain_exits(sch).get(axis)  # the chain's gather
        self.moving = set(self.syncs) | set(sch.annotations.of_kind(SEQ)) | self.own  # all but roles
        self.annotated = set(self.roles) | self.moving
        self.memo: dict[tuple[str, str], Placement | None] = {}
        self.throughs: dict[str, Callable[[str], bool]] = {}

    def _through(self, parent: str) -> Callable[[str], bool]:
        if parent not in self.throughs:
            self.throughs[parent] = _through(self.sch, parent)
        return self.throughs[parent]

    def _cached(self, kind: str, path: str, compute: Callable[[], Placement | None]) -> Placement | None:
        key = (kind, path)
        if key not in self.memo:
            self.memo[key] = None  # a cycle knows nothing
            self.memo[key] = compute()
        return self.memo[key]

    def _moved(self, path: str, mode: str) -> tuple[bool, Placement | None]:
        role = self.roles.get(path)
        specs = [s for s in self.syncs.get(path, ()) if s.mode == mode and s.mesh_axis == self.axis
                 and (s.src != s.layout or (role is not None and mode == "fwd_post"))]
        if not specs:
            return False, None
        layout = specs[-1].layout
        return True, layout if isinstance(layout, Replicate) or _last_dim(layout) else None

    def arriving(self, path: str) -> Placement | None:
        """What reaches ``path``'s input, before its own ``fwd_pre`` syncs."""
        return self._cached("in", path, lambda: self._arriving(path))

    def _arriving(self, path: str, first: bool = False) -> Placement | None:
        if _in_chain(self.sch, path, self.axis) or path in self.own:
            return None
        if not path:
            return Replicate()
        found = _caller(self.sch, path)
        if found is None:
            return None
        parent, name, fl = found
        fed = fl.hidden_feeders(name, self._through(parent)) if first else fl.feeders(name, self._through(parent))
        return self._combine(parent, fed)

    def inside(self, path: str, first: bool = False) -> Placement | None:
        """What ``path``'s own code receives, after its ``fwd_pre`` syncs (``first``: in its
        first argument alone, what the flow of its own code calls :data:`.flow.INPUT`;
        BERT's output block takes the intermediate's output first, the residual beside it)."""
        moved, layout = self._moved(path, "fwd_pre")
        if moved:
            return layout
        if first:
            return self._cached("first", path, lambda: self._arriving(path, first=True))
        return self.arriving(path)

    def made(self, path: str, own_syncs: bool = True) -> Placement | None:
        """``path``'s output, after its ``fwd_post`` syncs (``own_syncs``) or before them."""
        if own_syncs:
            moved, layout = self._moved(path, "fwd_post")
            if moved:
                return layout
        return self._cached("out", path, lambda: self._made(path))

    def _made(self, path: str) -> Placement | None:
        if path in self.own:
            return None
        role = self.roles.get(path)
        column = role is not None and role.enters and role.mesh_axis == self.axis
        if _in_chain(self.sch, path, self.axis) and not column:  # a column gathers the sequence itself
            # the chain's exit gathers the last member's output; anything else in it is a shard
            return Replicate() if path == self.exit else None
        if role is not None and not role.own_forward:
            if role.mesh_axis != self.axis or (self.inside(path) is None and not isinstance(
                    get_module(self.sch.module, path), nn.Embedding)):
                return None  # fed a token shard, or what the flow cannot tell: its output is that too
            return Shard(-1) if role.enters and path in self.kept else Replicate()
        module = get_module(self.sch.module, path)
        if not module._modules:
            # whole in, whole out; this rank's features stay so only through pointwise code (a
            # norm or a sum over them makes something else)
            got = self.inside(path)
            return got if isinstance(got, Replicate) or pointwise(module) else None
        fl = _flow_of(self.sch, path)
        if fl is None:
            # untraceable, but whole in and nothing inside it handing on anything but whole values,
            # it computes on what arrives as the model does: whole out (BERT's embeddings, one sharded
            # by features; Mixtral's routed experts). Roles without syncs gather or reduce their
            # outputs, but for a column kept split for its rows
            inner = [q for q in self.annotated if within(path, q)]
            whole = all(q != path and q in self.roles and q not in self.moving and q not in self.kept for q in inner)
            return Replicate() if whole and isinstance(self.inside(path), Replicate) else None
        return self._combine(path, fl.reaching_output(self._through(path)))

    def _combine(self, parent: str, fed: frozenset[str]) -> Placement | None:
        if not fed and parent not in self.roles:
            return Replicate()  # made in the parent's code from sizes alone (positions from arange)
        fed = fed - {SIDE}
        if not fed:
            return None
        got = {self.inside(parent, first=True) if q == INPUT else self.made(join(parent, q)) for q in fed}
        return got.pop() if len(got) == 1 else None


def _features_by_axis(sch: Schedule, partners: Mapping[str, tuple[str, ...]]) -> Callable[[str], _Features]:
    """:class:`_Features` of each mesh axis of ``sch``, made on its first use: one per axis
    for the plan or check under way, so each axis's lookups are memoised once."""
    features: dict[str, _Features] = {}

    def know(axis: str) -> _Features:
        if axis not in features:
            features[axis] = _Features(sch, axis, partners)
        return features[axis]

    return know
