"""Boundary contracts: which layout each sharded module needs and produces, and the
collectives that reconcile neighbours — as a plan (for ``explain`` and ``strict``) and
as forwards installed on build's private copy.

Contracts, per role (over the role's mesh axis):

=========== ============================= =====================================
role        input                         output
=========== ============================= =====================================
column      Replicate (enter: all-reduce  Shard(-1): kept local when a row-
            of the input gradient, once   parallel sibling follows (Megatron
            per distinct input tensor)    pair), else all-gathered
row         Shard(-1) (split locally if   Partial → all-reduce (bias added once)
            it arrives replicated)
vocab       Replicate ids                 Partial → all-reduce
embed_dim   Replicate ids                 Shard(-1) → all-gathered
param       any                           the module runs on gathered parameters
=========== ============================= =====================================

Inside a :func:`~slapo_fn.sequence_parallel` chain the residual stream is
``Shard(seq)``: column inputs are all-gathered (reduce-scatter backward), row and vocab
outputs reduce-scattered. Activations are plain local tensors throughout.

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> sch = sf.create_schedule(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), mesh=fake_mesh(2))
    >>> sch = sf.shard(sf.shard(sch, "0", axis=0), "2", axis=1)
    >>> for b in plan(sch).boundaries: print(b)
    0 input: R→R@tp  fwd: -  bwd: all_reduce
    2 output: P→R@tp  fwd: all_reduce  bwd: -
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..errors import Problem
from ..hf import (
    HEAD_COUNT_ATTRS,
    HEAD_DIM_ATTRS,
    HEAD_WIDTH_ATTRS,
    head_dim_of,
    is_conv1d,
    linear_features,
    mixes_tokens,
)
from ..rewrites._common import INSTALLED, contains
from ..schedule import Schedule
from ..tree import caller_path, child_names, get_module, join, parent_path, split, uncalled, walk
from .experts import EXPERTS, Experts
from .features import ASSUMED_RANK, Apart, Meets
from .flow import INPUT, OUTPUT, SIDE, Flow, flow, own_layer, pointwise
from .layout import Layout, shard_axes
from .local import LOCAL
from .rng import RNG, RngSpec
from .roles import Column, Role, Row
from .sequence import SEQ, SeqSpec
from .shard import LAYOUT, ROLE, mesh_dims, tied_paths
from .sync import SYNC, SyncSpec, collective_of

__all__ = ["Boundary", "ModulePlan", "Plan", "implicit", "plan", "refusals", "unproven"]


@dataclass(frozen=True)
class Boundary:
    """One module boundary where layouts meet: ``src``→``dst`` over ``mesh_axis``, the
    collectives it costs in one forward and one backward, and whether the user asked
    for it (``explicit``: stated by ``shard``'s own contract or by ``sync``)."""

    path: str
    side: str
    src: str
    dst: str
    mesh_axis: str
    forward: tuple[str, ...] = ()
    backward: tuple[str, ...] = ()
    explicit: bool = True
    tensor: str = "input"  # which tensor's full size the collective moves: input, output, param:<name>[,<name>...]

    def __str__(self) -> str:
        flag = "" if self.explicit else "  (implicit)"
        return (
            f"{self.path or '<root>'} {self.side}: {self.src}→{self.dst}@{self.mesh_axis}  "
            f"fwd: {', '.join(self.forward) or '-'}  bwd: {', '.join(self.backward) or '-'}{flag}"
        )


@dataclass(frozen=True)
class ModulePlan:
    """What the tensor-parallel build phase installs on one module."""

    path: str
    role: Role | None = None
    seq: SeqSpec | None = None
    partnered: bool = False
    entry: SeqSpec | None = None
    exit: SeqSpec | None = None
    syncs: tuple[SyncSpec, ...] = ()
    rng: RngSpec | None = None
    local_params: bool = False  # SP region / tp_local: replicated params with Partial gradients
    local_axis: str = ""  # tp_local: the mesh axis of those Partial gradients
    experts: Experts | None = None  # expert_parallel: this experts module runs its pairs by all-to-all
    partners: tuple[str, ...] = ()  # a column kept local: the rows it feeds; a row: the columns feeding it
    entry_group: str = ""  # a column: columns of one group handed one tensor enter the region once
    #: a row: the plan takes its input as this rank's features (from its partners, a sync, or as
    #: stated), so it counts no split of its own; a whole-width input then contradicts the plan
    split_input: bool = False
    #: an output that reaches its parent's code as this rank's features, where that code was
    #: read with the output taken as (batch, sequence, features): the first such op, as text.
    #: The runtime refuses an output of another rank (a 2-D ``(batch, features)``), for which
    #: the reading (``softmax(1)`` over the sequence) would be wrong.
    read_as_3d: str = ""
    #: a column inside a sequence-parallel chain whose parent gathers the sequence for more
    #: than its columns (:func:`_shared_gathers`): the gather's gradient is this rank's slice of
    #: a whole one, and the column enters the region itself (an all-reduce of its gradient)
    shared_gather: bool = False
    #: a column inside a sequence-parallel chain, under a parent that gathers the sequence,
    #: whose input is the parent's other argument (a cross-attention's k/v on the encoder
    #: states, whole on every rank), not the gathered one: it enters the region itself (an
    #: all-reduce of its input gradient)
    side_input: bool = False
    #: a column whose caller enters the tensor-parallel region for it: the caller's first
    #: argument reaches its columns over the axis alone (q/k/v on an attention's hidden
    #: states), so the caller's forward enters it once (one all-reduce of its gradient, as
    #: autograd sums the columns' partial ones first), decided here, not matched at run time
    entered: bool = False

    @property
    def enters(self) -> bool:
        """Whether its role takes whole activations and splits its output's features (a
        column): it enters the tensor-parallel region, whose gradient is all-reduced."""
        return self.role is not None and not self.role.own_forward and isinstance(self.role.takes(3), Replicate)

    @property
    def posts(self) -> tuple[SyncSpec, ...]:
        """The ``fwd_post`` syncs converted after the module's forward, in the order stated:
        all of them, but for a sharded module's first, which its own output boundary
        converts (from its role's output: a row's ``Partial()``, a column's ``Shard(-1)``);
        each later one converts from the layout the one before it made."""
        posts = tuple(s for s in self.syncs if s.mode == "fwd_post")
        return posts[1:] if self.role is not None and not self.role.own_forward else posts

    @property
    def keeps_features(self) -> bool:
        """A column paired with rows whose output stays this rank's features for them: no
        ``fwd_post`` sync of its own gathers it (:func:`_gathers_output`). Its parent's code
        then runs on this rank's heads, and build makes the parent's head counts local."""
        role = self.role
        return (self.partnered and role is not None and role.enters
                and not _gathers_output(self.syncs, role.mesh_axis))


def _gathers_output(specs: Iterable[SyncSpec], axis: str) -> bool:
    """Whether a ``fwd_post`` sync among ``specs`` moves an output split by features over
    ``axis`` off that split (to ``Replicate()`` or a sequence shard)."""
    return any(s.mode == "fwd_post" and s.mesh_axis == axis and not _last_dim(s.layout) for s in specs)


@dataclass(frozen=True)
class Plan:
    modules: Mapping[str, ModulePlan]
    boundaries: tuple[Boundary, ...] = field(default=())
    #: the replicated parameters that run on activation shards (sequence-parallel norms,
    #: ``tp_local`` modules) keep ``Partial`` gradients through backward, and one callback
    #: at its end all-reduces them together, one collective per mesh axis and dtype (as
    #: Megatron-LM reduces its sequence-parallel norms' gradients after backward). Where the
    #: mesh has axes the parameters do not live on (FSDP's ``dp``, ``pp``), whose own hooks
    #: read the gradients during backward, each module's are reduced where they are made.
    grads_after_backward: bool = False
    #: Why the plan cannot prove the model right on local shards (:func:`unproven`): where
    #: any, the build runs the model on DTensor activations (:mod:`.region`), whose
    #: collectives are DTensor's own (:mod:`.dryrun` counts them on example inputs), not
    #: :attr:`boundaries`.
    on_dtensors: tuple[Problem, ...] = ()

    def counts(self) -> dict[str, dict[str, int]]:
        """``{"forward": {op: n}, "backward": {op: n}}`` for one step (each module called once)."""
        out: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
        for b in self.boundaries:
            for op in b.forward:
                out["forward"][op] = out["forward"].get(op, 0) + 1
            for op in b.backward:
                out["backward"][op] = out["backward"].get(op, 0) + 1
        return out


def _named(path: str) -> str:
    """A module's path as a message names it: quoted, or "the root"."""
    return repr(path) if path else "the root"


_parent = parent_path


def _siblings(root: nn.Module, path: str) -> list[str]:
    """``path`` and the other children of its parent, in order (the root is alone)."""
    if not path:
        return [path]
    parent = _parent(path)
    return [join(parent, n) for n in child_names(get_module(root, parent))]


def _in_features(module: nn.Module) -> int | None:
    return None if (f := linear_features(module)) is None else f[0]


def plan(sch: Schedule) -> Plan:
    """The boundary plan of ``sch``: per-module contracts and the boundaries with their
    collectives (what ``explain`` prints and ``build(strict=True)`` checks)."""
    with _flows_memo():
        return _plan(sch)


def _plan(sch: Schedule) -> Plan:
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    seqs: dict[str, SeqSpec] = sch.annotations.of_kind(SEQ)
    syncs: dict[str, tuple[SyncSpec, ...]] = sch.annotations.of_kind(SYNC)
    rngs: dict[str, RngSpec] = sch.annotations.of_kind(RNG)
    order = _run_order(sch)
    seq_roots = sorted(seqs, key=lambda p: order.get(p, 0))
    entries = _chain_entries(sch)

    merged = _merged_tokens(sch) if seqs else {}
    whole = _whole_in_chains(sch)
    shared = _shared_gathers(sch) if seqs else frozenset()
    gathering: set[str] = set()  # the shared gathering parents whose gather is counted
    gatherers = set(_gathering_parents(sch)) if seqs else set()

    def region(path: str) -> SeqSpec | None:
        if _inside_any(whole, path):
            return None  # runs on the whole sequence (its syncs gather and split it)
        for root in seq_roots:
            if root == path or contains(root, path):
                spec, role = seqs[root], roles.get(path)
                if path in merged and role is not None and role.mesh_axis == spec.mesh_axis:
                    # handed the batch and the tokens merged: gathered and scattered along that dimension
                    return replace(spec, seq_axis=merged[path])
                return spec
        return None

    modules: dict[str, ModulePlan] = {}
    bounds: list[Boundary] = []
    fused: set[str] = set()  # the entry groups a leader has entered
    partners = _partners(sch)
    features: dict[str, _Features] = {}  # what the data flow brings, per mesh axis

    def know(axis: str) -> _Features:
        if axis not in features:
            features[axis] = _Features(sch, axis, partners)
        return features[axis]

    for path in sorted(set(roles) | set(seqs) | set(syncs) | set(rngs), key=lambda p: order.get(p, 0)):
        role = roles.get(path)
        seq = region(path)
        partnered = bool(partners.get(path))
        caller = caller_path(sch.module, path)
        shares = role is not None and role.enters and path not in seqs and caller in shared
        on_side = (role is not None and role.enters and path not in seqs and caller in gatherers
                   and _reads_side(sch, path))
        spec_syncs = _resolved_syncs(path, _restated(sch, path, _whole_syncs(syncs.get(path, ()), whole.get(path))),
                                     roles.get(path),
                                     seqs, entries,
                                     functools.partial(_stated_output, sch, path), partnered,
                                     functools.partial(_arriving, sch, know, path),
                                     role is None and pointwise(get_module(sch.module, path)))
        out_sync = next((s for s in spec_syncs if s.mode == "fwd_post"), None)
        group = ""
        split_input = False
        entered = False
        if role is not None:
            ax = role.mesh_axis
            if role.enters:
                in_seq = seq is not None and seq.mesh_axis == ax
                pre = _moving(spec_syncs, "fwd_pre")
                # a column that a sync hands a converted tensor enters the region with it alone
                group = f"{_parent(path)} {ax} " + (_entry_key(sch, path) if pre is None else f"own {path}")
                entered = seq is None and pre is None and _entered_by_caller(sch, path, ax)
                leader = group not in fused
                fused.add(group)
                if in_seq and on_side:
                    # called on the parent's other input (encoder states), which its parent does not
                    # gather: whole on every rank, it enters the region as outside a chain
                    bounds.append(Boundary(path, "input", "R", "R", ax, (), ("all_reduce",) if leader else ()))
                elif in_seq and shares:
                    # its parent gathers the sequence once for all that reads it (slicing the whole
                    # gradient back), and each group of columns enters with an all-reduce of its own
                    assert seq is not None
                    first = caller not in gathering
                    gathering.add(caller)
                    bounds.append(Boundary(path, "input", f"S({seq.seq_axis})", "R", ax,
                                           ("all_gather",) if first else (), ()))
                    bounds.append(Boundary(path, "input", "R", "R", ax, (), ("all_reduce",) if leader else ()))
                elif in_seq:
                    assert seq is not None
                    bounds.append(
                        Boundary(
                            path,
                            "input",
                            f"S({seq.seq_axis})",
                            "R",
                            ax,
                            ("all_gather",) if leader else (),
                            ("reduce_scatter",) if leader else (),
                        )
                    )
                else:
                    bounds.append(Boundary(path, "input", "R", "R", ax, (), ("all_reduce",) if leader else ()))
                if not isinstance(get_module(sch.module, path), nn.Embedding) and _arrives_feature_split(
                        sch, path, ax, pre, know):
                    # split by a sync on it or before it: the column gathers its input back
                    bounds.append(Boundary(path, "input", "S(-1)", "R", ax, ("all_gather",), (), False))
                out = "S(-1)" if role.packed == 1 else f"S(-1)×{role.packed}"
                if out_sync is not None:
                    fwd, bwd = collective_of(Shard(-1), out_sync.layout)
                    bounds.append(Boundary(path, "output", out, _d(out_sync.layout), ax, fwd, bwd, True, "output"))
                elif not partnered:
                    bounds.append(Boundary(path, "output", out, "R", ax, ("all_gather",), (), False, "output"))
            elif role.splits_input:
                # the layout the last fwd_pre sync leaves is what the row takes (stacked syncs)
                stated = next((s for s in reversed(spec_syncs) if s.mode == "fwd_pre"), None)
                pre = _moving(spec_syncs, "fwd_pre")
                split_input = False
                if pre is not None and isinstance(pre.layout, Replicate):
                    # gathered by its own sync (from the columns' split): the module splits it
                    # locally (all-gather of the gradient)
                    bounds.append(Boundary(path, "input", "R", "S(-1)", ax, (), ("all_gather",), True))
                elif (pre is None and (not partnered or _partner_gathered(sch, partners[path], ax))
                      and not _arrives_feature_split(sch, path, ax, None, know, stated)):
                    # replicated input (or its columns' outputs gathered by syncs): split locally. A
                    # sync from Replicate() to itself states it; as one from a layout to itself, it
                    # is not believed over the data flow (a column's kept split reaching it)
                    told = isinstance(stated, SyncSpec) and isinstance(stated.layout, Replicate)
                    bounds.append(Boundary(path, "input", "R", "S(-1)", ax, (), ("all_gather",), told))
                else:
                    split_input = True
                # a fwd_pre sync to Shard(-1) is the input boundary itself (added with the syncs below)
                bounds.append(_reduce_boundary(path, ax, seq, out_sync))
            elif (role.reads_ids and role.sums):
                bounds.append(_reduce_boundary(path, ax, seq, out_sync))
            elif (role.reads_ids and role.splits_output):
                if out_sync is not None:
                    fwd, bwd = collective_of(Shard(-1), out_sync.layout)
                    bounds.append(Boundary(path, "output", "S(-1)", _d(out_sync.layout), ax, fwd, bwd, True, "output"))
                else:
                    bounds.append(Boundary(path, "output", "S(-1)", "R", ax, ("all_gather",), (), False, "output"))
            else:
                module = get_module(sch.module, path)
                for name in module._parameters:
                    lay = sch.annotations.get(join(path, name), LAYOUT)
                    if isinstance(lay, Layout) and not lay.is_replicated:
                        n = sum(isinstance(p, Shard | _StridedShard) for p in lay.placements)
                        bounds.append(
                            Boundary(
                                path,
                                f"param {name}",
                                str(lay),
                                "R",
                                ax,
                                ("all_gather",) * n,
                                (),
                                False,
                                f"param:{name}",
                            )
                        )
        entry = exit_ = None
        if path in seqs:
            spec = seqs[path]
            same = [r for r in seq_roots if seqs[r].mesh_axis == spec.mesh_axis]
            own = role if role is not None and role.mesh_axis == spec.mesh_axis else None
            # a vocab embedding or a row layer first in the chain enters it by reduce-scattering its
            # partial output along the sequence; a column last leaves it by all-gathering its input
            if path == same[0] and not (own is not None and own.sums) and not spec.sharded_input:
                entry = spec
                # the chain's entry and exit are what sequence_parallel states: explicit; token ids
                # (an embedding first) have no gradient to gather back
                ids = isinstance(get_module(sch.module, path), nn.Embedding)
                bounds.append(
                    Boundary(path, "input", "R", f"S({spec.seq_axis})", spec.mesh_axis, (),
                             () if ids else ("all_gather",), True)
                )
            if path == same[-1] and out_sync is None and not (own is not None and own.enters):
                exit_ = spec
                bounds.append(
                    Boundary(
                        path, "output", f"S({spec.seq_axis})", "R", spec.mesh_axis, ("all_gather",), (), True, "output"
                    )
                )
        for s in spec_syncs:
            if role is not None and s.mode == "fwd_post" and not role.own_forward:
                continue  # folded into the role's output boundary above
            src = s.src or Replicate()  # resolved above, but for bwd_post
            fwd, bwd = collective_of(src, s.layout)
            if s.mode == "bwd_post":
                fwd, bwd = (), fwd
            side = {"fwd_pre": "input", "fwd_post": "output", "bwd_post": "input grad"}[s.mode]
            bounds.append(
                Boundary(
                    path,
                    side,
                    _d(src),
                    _d(s.layout),
                    s.mesh_axis,
                    fwd,
                    bwd,
                    True,
                    "output" if s.mode == "fwd_post" else "input",
                )
            )
        local = (
            seq is not None
            and role is None
            and any(
                p is not None and join(path, n) not in sch.annotations.of_kind(LAYOUT)
                for n, p in get_module(sch.module, path)._parameters.items()
            )
        )
        modules[path] = ModulePlan(path, role, seq, partnered, entry, exit_, spec_syncs, rngs.get(path), local,
                                   partners=partners.get(path, ()), entry_group=group,
                                   split_input=role is not None and role.splits_input and split_input,
                                   shared_gather=shares, side_input=on_side, entered=entered)
    # modules with parameters inside a sequence-parallel chain (norms): replicated, Partial gradients;
    # not inside a parent that gathers the sequence (an unsharded q beside sharded k and v): they
    # run on all of it, so their gradients are whole, unless declared to run on this rank's heads
    declared = sch.annotations.of_kind(LOCAL)
    for root in seq_roots:
        for path, module in walk(get_module(sch.module, root), root):
            if path in modules or path in roles or _inside_any(whole, path):
                continue
            if path not in declared and _inside_any(gatherers, path, strictly=True):
                continue
            if any(p is not None for p in module._parameters.values()):
                modules[path] = ModulePlan(path, seq=seqs[root], local_params=True)
    # modules declared to run on this rank's shard (tp_local): replicated, Partial gradients
    for path, local_spec in sch.annotations.of_kind(LOCAL).items():
        if path not in modules:
            modules[path] = ModulePlan(path, local_params=True, local_axis=local_spec.mesh_axis)
    for path, experts in sch.annotations.of_kind(EXPERTS).items():
        modules[path] = ModulePlan(path, experts=experts)
        bounds += _expert_boundaries(path, experts)
    after = sch.mesh is not None and param_dims(sch) == mesh_dims(sch.mesh)
    if after:
        bounds += _grads_after_backward(sch, [mp for mp in modules.values() if mp.local_params])
    else:
        for mp in modules.values():
            if mp.local_params:
                bounds += _param_grad_boundaries(sch, mp)
    for path in _split_outputs(sch, modules):
        found = _caller(sch, path)
        if path in modules and found is not None and (op := found[2].ranked.get(found[1])) is not None:
            modules[path] = replace(modules[path], read_as_3d=op)
    return Plan(modules, tuple(bounds), after, tuple(_unproven(sch, Plan(modules, tuple(bounds), after))))


def param_dims(sch: Schedule) -> tuple[str, ...]:
    """The mesh axes the parameters of ``sch``'s model live on: those its layouts, roles,
    sequence-parallel chains and ``tp_local`` modules use (usually just ``"tp"``); they are
    replicated implicitly over the others, as FSDP2's 2-D composition expects (it
    concatenates its dp mesh with the parameters' mesh). All the mesh's axes where none is used."""
    assert sch.mesh is not None
    used = {n for lay in sch.annotations.of_kind(LAYOUT).values() for n in shard_axes(lay)}
    used |= {r.mesh_axis for r in sch.annotations.of_kind(ROLE).values()}
    used |= {q.mesh_axis for q in sch.annotations.of_kind(SEQ).values()}
    used |= {q.mesh_axis for q in sch.annotations.of_kind(LOCAL).values()}
    dims = mesh_dims(sch.mesh)
    return tuple(d for d in dims if d in used) or dims


def _moving(specs: tuple[SyncSpec, ...], mode: str) -> SyncSpec | None:
    """The last sync of ``mode`` that moves a layout: stacked syncs run in order, so the
    module sees what the last leaves (a sync from a layout to itself moves nothing: the
    module sees what arrives)."""
    return next((s for s in reversed(specs) if s.mode == mode and s.src != s.layout), None)


def _last_dim(p: Placement | None) -> bool:
    return isinstance(p, Shard) and p.dim == -1


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
    after, :attr:`ModulePlan.keeps_features` says the same of each module."""
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    return frozenset(q for q in paired if (r := roles.get(q)) is not None and r.enters
                     and not _partner_gathered(sch, (q,), r.mesh_axis))


def _restated(sch: Schedule, path: str, specs: tuple[SyncSpec, ...]) -> tuple[SyncSpec, ...]:
    """``specs`` with each ``bwd_post`` sync from ``Partial()`` that restates what a column's
    entry already does made a sync from ``Replicate()`` (which moves nothing): Slapo's
    schedules write an all-reduce of the input gradient on every column (or the module
    holding them), which slapo_fn's columns issue themselves; summed again, the gradient
    would be the axis size times too large."""
    return tuple(replace(s, src=Replicate()) if s.mode == "bwd_post" and isinstance(s.src, Partial)
                 and _input_reaches_column(sch, path, s.mesh_axis) else s for s in specs)


def _input_reaches_column(sch: Schedule, path: str, axis: str, depth: int = 0) -> bool:
    """Whether ``path`` is a column over ``axis``, or its own code hands its input to one
    (through its children, as far as their data flow is known): that column's entry then
    all-reduces the input's gradient."""
    role = sch.annotations.get(path, ROLE)
    if isinstance(role, Column) and role.mesh_axis == axis:
        return True
    fl = _flow_of(sch, path) if depth < 8 else None
    if fl is None:
        return False
    return any(c not in (OUTPUT, SIDE, INPUT) and _input_reaches_column(sch, join(path, c), axis, depth + 1)
               for c in fl.consumers(INPUT, _through(sch, path)))


def _resolved_syncs(path: str, specs: tuple[SyncSpec, ...], role: Role | None, seqs: Mapping[str, SeqSpec],
                    entries: Mapping[str, str], inner: Callable[[str], Placement | None],
                    partnered: bool = False,
                    arriving: Callable[[str], Placement | None] = lambda _: None,
                    passes: bool = False) -> tuple[SyncSpec, ...]:
    """``path``'s syncs with the layout each converts from (``src``) filled in where the
    user left it out, for the boundaries and the runtime alike: the layout the previous
    sync on the same boundary moved to (one stating a layout to itself is not believed),
    else what the plan has there: the chain's sequence
    shard on a chain member (after its entry; a row or vocab embedding first in a chain
    takes its input whole), the columns' ``Shard(-1)`` at the input of a row in a
    Megatron pair, for an output the layout a sync states on the child that alone makes
    it (``inner(axis)``, :func:`_stated_output`), for an input the features the data flow
    brings (``arriving(axis)``: a sync before it split them), else ``Replicate()``. A
    module that ``passes`` its input's layout on (pointwise) has, at its output, the layout
    its ``fwd_pre`` syncs left, else what arrives (whichever order the syncs were stated
    in: the input's run first). ``bwd_post`` syncs keep theirs."""
    seq = seqs.get(path)
    whole_in = _enters_chain_whole(path, role, seqs, entries)
    out: dict[int, SyncSpec] = {}
    last: dict[tuple[str, str], Placement] = {}
    for i in sorted(range(len(specs)), key=lambda i: specs[i].mode != "fwd_pre"):
        s = specs[i]
        key = (s.mode, s.mesh_axis)
        src = s.src
        if src is None and s.mode != "bwd_post":
            if key in last:
                src = last[key]
            elif (s.mode == "fwd_pre" and partnered and role is not None and role.splits_input
                  and role.mesh_axis == s.mesh_axis):
                src = Shard(-1)
            elif seq is not None and seq.mesh_axis == s.mesh_axis and not (s.mode == "fwd_pre" and whole_in):
                src = Shard(seq.seq_axis)
            elif s.mode == "fwd_post" and passes:
                src = last.get(("fwd_pre", s.mesh_axis)) or arriving(s.mesh_axis) or Replicate()
            else:
                src = (inner(s.mesh_axis) if s.mode == "fwd_post" else arriving(s.mesh_axis)) or Replicate()
        if s.mode != "bwd_post" and src != s.layout:  # a sync from a layout to itself moves nothing, asserts nothing
            last[key] = s.layout
        out[i] = s if src is s.src else replace(s, src=src)
    return tuple(out[i] for i in range(len(specs)))


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


def _stated_by(sch: Schedule, module: str, axis: str) -> Placement | None:
    """The layout over ``axis`` that ``module``'s last ``fwd_post`` sync states for its
    output, else the one its children state (:func:`_stated_output`)."""
    stated = [s.layout for s in sch.annotations.of_kind(SYNC).get(module, ()) if s.mode == "fwd_post"
              and s.mesh_axis == axis and s.src != s.layout]
    return stated[-1] if stated else _stated_output(sch, module, axis)


def per_head_operands(sch: Schedule, parent: str) -> Mapping[str, Meets]:
    """The arguments of the module at ``parent`` that its code adds to its heads (a
    per-head bias), each with where it meets them (:attr:`.flow.Flow.per_head`);
    empty where it adds none or cannot be traced."""
    fl = _flow_of(sch, parent)
    return {} if fl is None else fl.per_head


def _flow_of(sch: Schedule, parent: str) -> Flow | None:
    """The data flow among the children of the module at ``parent``, traced with the values
    the module that calls it hands it (cached by :func:`.flow.flow`; within one
    :func:`plan` or :func:`refusals`, looked up once per path)."""
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
    """The flows (:func:`_flow_of`) and callers (:func:`_caller`) found by the :func:`plan`
    or :func:`refusals` call under way, keyed by the model's id and a path: each path's
    caller is found from its ancestors' flows, so a lookup repeats theirs."""

    flows: dict[tuple[int, str], Flow | None] = field(default_factory=dict)
    callers: dict[tuple[int, str], tuple[str, str, Flow] | None] = field(default_factory=dict)
    #: :func:`_whole_in_chains` of the schedule it was found for (read by the plan and several refusals)
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


def _entered_by_caller(sch: Schedule, path: str, axis: str) -> bool:
    """Whether the column ``path``'s caller can enter the region for it: it is called on the
    caller's first argument, which reaches nothing in the caller's code but columns over
    ``axis`` that no ``fwd_pre`` sync converts and no chain gathers (:attr:`ModulePlan.entered`)."""
    found = _caller(sch, path)
    if found is None or found[2].first.get(found[1]) != "a0" or _in_chain(sch, found[0], axis):
        return False
    caller, _, fl = found
    users = fl.consumers(INPUT)
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    syncs: dict[str, tuple[SyncSpec, ...]] = sch.annotations.of_kind(SYNC)
    for name in users:
        q = join(caller, name) if name != OUTPUT else ""
        role = roles.get(q)
        if (name == OUTPUT or not isinstance(role, Column) or role.mesh_axis != axis or _in_chain(sch, q, axis)
                or any(s.mode == "fwd_pre" for s in syncs.get(q, ()))):
            return False
    return True


def _entry_key(sch: Schedule, path: str) -> str:
    """Columns of one parent with equal keys read one input tensor and enter the tensor-
    parallel region once (one backward all-reduce for all): the value they are called on
    where the parent's data flow is known, else the column's own (fx cannot trace the
    parent, so which columns read one tensor is unknown; equal input widths are no proof:
    an attention's ``v`` and ``o``). The runtime shares an entry only within one key
    (:attr:`ModulePlan.entry_group`), so it makes what the plan counts."""
    found = _caller(sch, path)
    if found is not None and found[1] in found[2].first:
        return "value " + found[2].first[found[1]]
    return f"own {path}"


def _reads_side(sch: Schedule, path: str) -> bool:
    """Whether all that reaches ``path``'s input in its caller's code comes from the
    caller's other arguments (:data:`.flow.SIDE`: a cross-attention's encoder states), none
    of it from its first (the hidden states)."""
    found = _caller(sch, path)
    if found is None:
        return False
    caller, name, fl = found
    sources = fl.feeders(name, _through(sch, caller))
    return bool(sources) and sources <= {SIDE}


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


def _partners(sch: Schedule) -> dict[str, tuple[str, ...]]:
    """Megatron pairs: for each column that keeps its output sharded, the rows it feeds;
    for each such row, the columns that feed it (siblings, over one mesh axis).

    Where the parent's data flow is known (:func:`.flow.flow`), a column is kept local
    only if everything its output reaches (through activations and dropouts) is a row
    whose input comes from such columns alone: a row that also takes an unsharded
    module's output, a row's reduced output or the parent's input (LLaMA's MLP with
    ``gate_proj`` unsharded, a residual inside the block) takes a gathered input and
    splits it itself. The parent's other arguments (rotary ``cos``/``sin``, masks) do not
    count: they broadcast over the heads. Where the flow is not known (a parent fx cannot
    trace), module order decides: a column is paired with the rows after it among its
    siblings (and :func:`_untraced_pairs` refuses such a pair, unless a column gathers)."""
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    out: dict[str, tuple[str, ...]] = {}
    for (parent, axis), paths in _pair_groups(sch).items():
        if _by_module_order(sch, parent, paths):
            out.update(_partners_in_module_order(sch, paths, roles))
            continue
        fl = _flow_of(sch, parent)
        assert fl is not None
        names = {(p[len(parent) + 1:] if parent else p): p for p in paths}
        through = _through(sch, parent)
        cols = {n for n, p in names.items() if roles[p].enters}
        rows = {n for n, p in names.items() if roles[p].splits_input}
        keep = {c for c in cols if (users := fl.consumers(c, through)) and users <= rows}
        # side values (rotary cos/sin, masks) broadcast over the heads: they do not mix in; nor
        # does a sibling whose fwd_post sync states its output Shard(-1) (split like a column's),
        # unless the parent is a chain member: its columns gather the sequence themselves, the
        # sibling keeps the chain's shard
        member = (spec := sch.annotations.get(parent, SEQ)) is not None and spec.mesh_axis == axis
        split_synced = set() if member else {n for n in fl.feeds if _split_by_sync(sch, join(parent, n), axis)}
        fed = {r: fl.feeders(r, through) - {SIDE} - split_synced for r in rows}
        while True:
            mixed = {c for c in keep if any(not fed.get(r, frozenset()) <= keep for r in fl.consumers(c, through))}
            if not mixed:
                break
            keep -= mixed
        for c in sorted(keep):
            out[names[c]] = tuple(sorted(names[r] for r in fl.consumers(c, through)))
        for r in sorted(rows):
            fed_r = fed[r]
            if fed_r and fed_r <= keep:
                out[names[r]] = tuple(sorted(names[c] for c in fed_r))
    out.update(_partners_across(sch, roles, out))
    return out


def _partners_across(sch: Schedule, roles: Mapping[str, Role], paired: Mapping[str, tuple[str, ...]]
                     ) -> dict[str, tuple[str, ...]]:
    """Megatron pairs across parents, as BERT lays them out: ``attention.self`` calls q/k/v
    and returns what its code makes of them alone, and its caller hands that result only to
    the first argument of siblings (``attention.output``) whose first argument reaches a row
    alone. The columns keep their outputs split (``attention.self``'s code then runs on this
    rank's heads, checked as any parent's between a pair) and the row takes them so.
    Outside sequence-parallel chains (:func:`_sequence_pairs_across` reads them inside)."""
    seqs = sch.annotations.of_kind(SEQ)
    syncs = sch.annotations.of_kind(SYNC)
    by_caller: dict[tuple[str, str], list[str]] = {}
    for path, role in roles.items():
        if isinstance(role, Column) and path not in paired and not syncs.get(path) and not _in_chain(
                sch, path, role.mesh_axis):
            found = _caller(sch, path)
            if found is not None:
                by_caller.setdefault((found[0], role.mesh_axis), []).append(path)
    out: dict[str, tuple[str, ...]] = {}
    for (caller, axis), columns in by_caller.items():
        fl, up = _flow_of(sch, caller), _caller(sch, caller)
        if fl is None or up is None or caller in seqs or syncs.get(caller):
            continue
        through = _through(sch, caller)
        names = {q[len(caller) + 1:] if caller else q: q for q in columns}
        if not all(fl.consumers(n, through) == {OUTPUT} for n in names) or (
                fl.reaching_output(through) - {SIDE} != set(names)):
            continue
        outer, name, ofl = up
        othrough = _through(sch, outer)
        rows = []
        for user in ofl.consumers(name, othrough):
            receiver = join(outer, user)
            rfl = _flow_of(sch, receiver) if user != OUTPUT else None
            if rfl is None or ofl.hidden_feeders(user, othrough) != {name} or syncs.get(receiver):
                break
            rthrough = _through(sch, receiver)
            taken = rfl.consumers(INPUT, rthrough)
            row = join(receiver, next(iter(taken))) if len(taken) == 1 and OUTPUT not in taken else ""
            found_role = roles.get(row)
            if (not isinstance(found_role, Row) or found_role.mesh_axis != axis or syncs.get(row)
                    or rfl.hidden_feeders(next(iter(taken)), rthrough) != {INPUT}):
                break
            rows.append(row)
        else:
            if rows:
                for q in columns:
                    out[q] = tuple(sorted(rows))
                for r in rows:
                    out[r] = tuple(sorted(columns))
    return out


def _pair_groups(sch: Schedule) -> dict[tuple[str, str], list[str]]:
    """The columns and rows that may pair, grouped by the module whose ``forward`` calls
    them (:func:`_caller`, else their parent) and their mesh axis: groups holding both."""
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    groups: dict[tuple[str, str], list[str]] = {}
    for path, role in roles.items():
        if path and (role.enters or role.splits_input):
            found = _caller(sch, path)
            groups.setdefault((found[0] if found is not None else _parent(path), role.mesh_axis), []).append(path)
    return {g: paths for g, paths in groups.items()
            if any(roles[q].enters for q in paths) and any(roles[q].splits_input for q in paths)}


def _by_module_order(sch: Schedule, parent: str, paths: list[str]) -> bool:
    """Whether the columns and rows ``paths`` that ``parent`` calls pair by module order:
    fx cannot trace its ``forward``, or the trace does not call them all."""
    fl = _flow_of(sch, parent)
    return fl is None or not all(fl.called(q[len(parent) + 1:] if parent else q) for q in paths)


def _untraced_pairs(sch: Schedule, p: Plan) -> list[Problem]:
    """A column kept split for a row that only module order pairs it with: fx cannot
    trace the parent's ``forward`` (a branch on a tensor's values), so what its code does
    with this rank's features between them is unknown. A view by a head count slapo_fn
    does not know (``view(B, S, self.nh, -1)``) would take them for whole heads, silently
    wrong. Refused, naming the parent and its columns, with what to declare: gather the
    columns' outputs (the row then splits its whole input; right whatever the code), or
    make the forward traceable. A module installed by ``sf.replace`` is code written for
    this rank's share (slapo_fn's attention kernels take their head counts from the
    recipe): trusted, as :func:`_unsourced` trusts it."""
    kept = frozenset(q for q, mp in p.modules.items() if mp.keeps_features)
    order = _run_order(sch)
    problems = []
    for (parent, axis), paths in _pair_groups(sch).items():
        if _installed(sch, parent) or not _by_module_order(sch, parent, paths):
            continue  # installed: code written for this rank's share (the kernels take head counts from the recipe)
        columns = sorted((q for q in paths if q in kept), key=lambda q: order.get(q, 0))
        if not columns:
            continue
        listed = ", ".join(map(repr, columns))
        problems.append(Problem(
            parent or "<root>",
            f"holds {listed}, kept split by features over {axis!r} for the rows after them, but fx cannot trace its "
            "forward (a branch on a tensor's values, or a child called from code it cannot follow): slapo_fn cannot "
            "tell what that code does with this rank's features (a view by heads would take them for whole heads)",
            "gather the columns' outputs, " + ", ".join(f"sf.sync(sch, {q!r}, 'fwd_post', Replicate())"
                                                          for q in columns)
            + " (the rows then split their whole input), make its forward traceable by torch.fx, or replace it "
            "(sf.replace) by a module written for this rank's share of the heads",
        ))
    return problems


def _through(sch: Schedule, parent: str) -> Callable[[str], bool]:
    """Which children of ``parent`` a layout passes through unchanged: pointwise modules
    (activations, dropouts) with no layout of their own (a sync from a layout to the
    same one moves nothing), and modules declared to run on
    this rank's shard (:func:`~slapo_fn.dtensor.tp_local`: Qwen3's per-head q/k norms)."""
    moving = {q for q, specs in sch.annotations.of_kind(SYNC).items()
              if any(s.mode == "bwd_post" or s.src is None or s.src != s.layout for s in specs)}
    annotated = set(sch.annotations.of_kind(ROLE)) | set(sch.annotations.of_kind(SEQ)) | moving
    local = set(sch.annotations.of_kind(LOCAL))  # tp_local: runs on this rank's shard as it is (per-head norms)
    pm = get_module(sch.module, parent)
    return lambda q: join(parent, q) not in annotated and (join(parent, q) in local or pointwise(get_module(pm, q)))


def _partners_in_module_order(sch: Schedule, paths: list[str], roles: Mapping[str, Role]) -> dict[str, tuple[str, ...]]:
    order = {n: i for i, n in enumerate(_siblings(sch.module, paths[0]))}
    ranked = sorted(paths, key=lambda p: order.get(p, 0))
    out: dict[str, tuple[str, ...]] = {}
    for i, p in enumerate(ranked):
        if roles[p].enters:
            later = tuple(q for q in ranked[i + 1 :] if roles[q].splits_input)
            if later:
                out[p] = later
        else:
            earlier = tuple(q for q in ranked[:i] if roles[q].enters)
            if earlier:
                out[p] = earlier
    return out


def _expert_boundaries(path: str, spec: Experts) -> list[Boundary]:
    """An experts module with expert parallelism (see :mod:`.experts`): its tokens are split
    over the axis (their and the routing weights' gradients all-gathered in one backward
    collective), the ranks' pair counts per expert all-gathered (a few integers), its
    pairs dispatched and combined by all-to-all (and back in backward),
    its output all-gathered; ``E`` is the layout of pairs grouped on their experts' ranks.
    With tensor parallelism inside the experts, the tokens (and weights) enter the
    tensor-parallel region (one all-reduce of their gradients) and the per-token outputs,
    partial sums, are all-reduced."""
    bounds = []
    ep, tp = spec.mesh_axis, spec.tensor_axis
    if ep is not None:
        bounds += [
            Boundary(path, "input", "R", "S(0)", ep, (), ("all_gather",), True, "input"),
            Boundary(path, "counts", "S(0)", "R", ep, ("all_gather",), (), True, "counts"),
            Boundary(path, "dispatch", "S(0)", "E", ep, ("all_to_all",), ("all_to_all",), True, "dispatch"),
            Boundary(path, "combine", "E", "S(0)", ep, ("all_to_all",), ("all_to_all",), True, "combine"),
        ]
    if tp is not None:
        bounds += [
            Boundary(path, "input", "R", "R", tp, (), ("all_reduce",), True, "input"),
            Boundary(path, "output", "P", "R", tp, ("all_reduce",), (), True, "output"),
        ]
    if ep is not None:
        bounds.append(Boundary(path, "output", "S(0)", "R", ep, ("all_gather",), (), True, "output"))
    return bounds


def _sharded_output(seq: int | SeqSpec | None, out_sync: SyncSpec | None) -> bool:
    """Whether a row module's output leaves it sharded (sequence parallel, or a stated
    ``Shard`` output): a reduce-scatter, before which its bias is added in shares."""
    return seq is not None or (out_sync is not None and isinstance(out_sync.layout, Shard))


def _grads_after_backward(sch: Schedule, mps: list[ModulePlan]) -> list[Boundary]:
    """The one all-reduce per mesh axis and dtype, at the end of backward, of the gradients
    of every module's replicated parameters that run on activation shards
    (:attr:`Plan.grads_after_backward`)."""
    groups: dict[str, list[tuple[str, torch.dtype]]] = {}
    for mp in mps:
        ax = _local_axis(mp)
        groups.setdefault(ax, []).extend((join(mp.path, n), p.dtype) for n, p in _reduced_params(sch, mp).items())
    return [Boundary("", f"param grads after backward ({len(ps)} params)", "P", "R", ax, (),
                     ("all_reduce",) * len({d for _, d in ps}), True, "param:" + ",".join(n for n, _ in ps))
            for ax, ps in groups.items() if ps]


def _local_axis(mp: ModulePlan) -> str:
    """The mesh axis a module's replicated parameters get ``Partial`` gradients over."""
    return mp.role.mesh_axis if mp.role is not None else (mp.seq.mesh_axis if mp.seq is not None else mp.local_axis)


def _reduced_params(sch: Schedule, mp: ModulePlan) -> dict[str, nn.Parameter]:
    """A module's own replicated parameters (no layout, or a replicated one)."""
    layouts = sch.annotations.of_kind(LAYOUT)
    module = get_module(sch.module, mp.path)
    return {n: p for n, p in module._parameters.items()
            if p is not None and not (join(mp.path, n) in layouts and not layouts[join(mp.path, n)].is_replicated)}


def _param_grad_boundaries(sch: Schedule, mp: ModulePlan) -> list[Boundary]:
    """The backward all-reduce of a module's replicated parameters that run on activation
    shards (see ``_Runtime.reduced_grads``): one for all of them, flattened together (one
    per dtype where they differ)."""
    ax = _local_axis(mp)
    reduced = _reduced_params(sch, mp)
    if not reduced:
        return []
    dtypes = len({p.dtype for p in reduced.values()})
    return [Boundary(mp.path, f"param grads {', '.join(reduced)}", "P", "R", ax, (), ("all_reduce",) * dtypes,
                     True, "param:" + ",".join(reduced))]


def _d(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    return "P" if isinstance(p, Partial) else "R"


def _reduce_boundary(path: str, ax: str, seq: SeqSpec | None, out_sync: SyncSpec | None) -> Boundary:
    if out_sync is not None:
        fwd, bwd = collective_of(Partial(), out_sync.layout)
        return Boundary(path, "output", "P", _d(out_sync.layout), ax, fwd, bwd, True, "output")
    if seq is not None and seq.mesh_axis == ax:
        return Boundary(
            path, "output", "P", f"S({seq.seq_axis})", ax, ("reduce_scatter",), ("all_gather",), True, "output"
        )
    return Boundary(path, "output", "P", "R", ax, ("all_reduce",), (), True, "output")


def _fix(b: Boundary) -> str:
    if b.tensor.startswith("param:"):
        return (
            f"shard {b.path!r} as a whole (axis=0 or 1 on a Linear/Embedding/Conv1D) so that it computes on "
            "its shard, or leave the parameter unsharded"
        )
    if b.side == "output":
        stated = f"sf.sync(sch, {b.path!r}, 'fwd_post', Replicate())"
    else:
        stated = f"sf.sync(sch, {b.path!r}, 'fwd_pre', Shard(-1))"
    return f"state it with {stated}, or shard the neighbouring module so that the layouts agree (a Megatron pair)"


def implicit(p: Plan) -> list[Problem]:
    """Problems for every implicit boundary that moves data (for ``build(strict=True)``)."""
    return [
        Problem(
            b.path,
            f"{b.side} needs implicit resharding {b.src}→{b.dst} over {b.mesh_axis!r} "
            f"(forward: {', '.join(b.forward) or '-'}, backward: {', '.join(b.backward) or '-'})",
            _fix(b),
        )
        for b in p.boundaries
        if not b.explicit and (b.forward or b.backward)
    ]


def _out_features(module: nn.Module) -> int | None:
    return None if (f := linear_features(module)) is None else f[1]


def _unsharded_twins(sch: Schedule, p: Plan) -> list[Problem]:
    """A column kept sharded for its row partner (Megatron's pair) whose parent also holds
    an unsharded twin — a linear layer of the same shape, which reads the same input in
    every model seen (LLaMA's gate/up, q/k/v) — would meet that twin's full output inside
    the parent's forward: refused, naming both, instead of a shape error or a wrong sum."""
    roles = sch.annotations.of_kind(ROLE)
    problems = []
    for path, mp in p.modules.items():
        if mp.role is None or not mp.role.enters or not mp.partnered or mp.role.packed > 1:
            continue
        if _caller(sch, path) is not None:
            continue  # the data flow paired it: nothing unsharded meets its output (see _partners)
        module = get_module(sch.module, path)
        shape = (_in_features(module), _out_features(module))
        for twin in _siblings(sch.module, path):
            other = get_module(sch.module, twin)
            if twin != path and twin not in roles and (_in_features(other), _out_features(other)) == shape:
                problems.append(Problem(
                    twin,
                    f"is not sharded, while its twin {path!r} (same shape, same parent) keeps its output sharded "
                    f"for the row-parallel layer after it; their outputs would meet in {_parent(path) or '<root>'!r}",
                    f"shard it like {path!r} (sf.shard(sch, {twin!r}, axis=0)), or leave {path!r} and its row "
                    "partner unsharded",
                ))
    return problems


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _stray_token_shards(sch: Schedule) -> list[Problem]:
    """A ``sync`` that shards an activation along a token dimension (``Shard(d)``, ``d`` not
    the last) outside a sequence-parallel chain (or on the output of its last member, which
    then leaves the chain split) hands a module with parameters a part of the tokens: its
    parameters' gradients would be partial sums taken for whole ones.
    Refused, naming the module, unless a ``fwd_pre`` sync gathers the activation back
    before any such module (feature shards, ``Shard(-1)``, are the roles' business)."""
    syncs = sch.annotations.of_kind(SYNC)
    order = _run_order(sch)

    in_chain = functools.partial(_in_chain, sch)

    def gathers_back(path: str, axis: str, mode: str = "fwd_pre") -> bool:
        # from a stated layout: without src= the plan takes the value as Replicate(), which moves nothing
        return any(s.mode == mode and s.mesh_axis == axis and isinstance(s.layout, Replicate)
                   and s.src is not None and s.src != s.layout for s in syncs.get(path, ()))

    exits = _chain_exits(sch)

    def last_member(path: str, axis: str) -> bool:  # a chain's last member: the stream leaves the chain
        return exits.get(axis) == path

    problems = []
    for path, specs in syncs.items():
        for s in specs:
            token = isinstance(s.layout, Shard) and s.layout.dim >= 0 and s.mode in ("fwd_pre", "fwd_post")
            leaving = s.mode == "fwd_post" and last_member(path, s.mesh_axis)
            if not token or (in_chain(path, s.mesh_axis) and not leaving):
                continue
            what = f"{s.mode} sync of {path or '<root>'!r} to {_d(s.layout)} over {s.mesh_axis!r}"
            if s.mode == "fwd_pre":
                if _has_params(get_module(sch.module, path)):
                    problems.append(Problem(path, f"receives a token shard from the {what}, outside a "
                                            "sequence_parallel chain: its parameters' gradients would be partial",
                                            f"run it in a chain, sf.sequence_parallel(sch, {path!r}), instead"))
                    continue
                if not pointwise(get_module(sch.module, path)):
                    problems.append(Problem(path, f"receives a token shard from the {what}, outside a "
                                            "sequence_parallel chain: slapo_fn cannot tell that it works token by "
                                            "token", f"run it in a chain, sf.sequence_parallel(sch, {path!r}), "
                                            "or sync the output of the module before it instead"))
                    continue
            found = _token_consumer(sch, path, s.mesh_axis, in_chain, gathers_back)
            if found is None and s.mode == "fwd_pre" and _downstream(sch, path)[1] == "":
                # through pointwise code to the model's result, which nothing states split
                problems.append(Problem(
                    path, f"the {what} leaves the model's result split along the tokens, which no fwd_post sync "
                          "states: each rank would return a part of the sequence",
                    f"drop the sync, or state the result's layout with a fwd_post sync in its place "
                    f"(sf.sync(sch, {path!r}, 'fwd_post', {_d(s.layout)}))",
                ))
            if found is not None:
                q, why = found
                fix = (f"gather it back first, sf.sync(sch, {q!r}, 'fwd_pre', Replicate(), src={_d(s.layout)}), "
                       "or make the modules a chain with sf.sequence_parallel instead of the sync")
                if why is _UNTRACED_TAKER:
                    fix = ("drop the sync, or make the modules a chain with sf.sequence_parallel (it gathers the "
                           "tokens back where the chain ends)")
                problems.append(Problem(
                    q or "<root>", f"receives a token shard from the {what}, outside a sequence_parallel chain: "
                    f"{why}", fix))
    return sorted(set(problems), key=lambda pr: order.get(pr.path, 0))


def _token_consumer(
    sch: Schedule,
    path: str,
    axis: str,
    in_chain: Callable[[str, str], bool],
    gathers_back: Callable[[str, str, str], bool],
) -> tuple[str, str] | None:
    """The first module that would take ``path``'s token-sharded output wrongly, with why,
    or ``None`` (a ``fwd_pre`` sync gathers it back first, or nothing that could take it
    follows): by the data flow of its parent (and of theirs, as long as it is known), then
    by module order — the later siblings, then the ancestors'. ``gathers_back(q, axis,
    mode)`` tells whether a sync of ``q`` in ``mode`` gathers the shard back."""
    levels, start = _downstream(sch, path)
    for lv in levels:
        for user in sorted(lv.users - {OUTPUT}):
            q = join(lv.parent, user)
            if gathers_back(q, axis, "fwd_pre"):
                continue
            if in_chain(q, axis):
                if _told_split(sch, q):
                    continue
                return q, _SPLIT_TWICE
            if lv.flow.feeders(user, lv.through) - {lv.name}:
                return q, f"it takes the shard together with whole-sequence values in {_named(lv.parent)}'s forward"
            if _has_params(get_module(sch.module, q)):
                return q, "its parameters' gradients would be partial sums taken for whole ones"
            if not pointwise(get_module(sch.module, q)):
                return q, "slapo_fn cannot tell that it works token by token"
            # a pointwise module with a sync of its own (not looked through) hands the shard on,
            # unless its fwd_post sync gathers it back
            if gathers_back(q, axis, "fwd_post"):
                continue
            if (deeper := _token_consumer(sch, q, axis, in_chain, gathers_back)) is not None:
                return deeper
        if OUTPUT in lv.users and lv.flow.reaching_output(lv.through) - {lv.name}:
            return lv.parent, "its forward combines the shard with whole-sequence values"
    if start is None:
        return None
    for q in _later_modules(sch.module, start):
        if gathers_back(q, axis, "fwd_pre"):
            return None
        if in_chain(q, axis):
            return None if _told_split(sch, q) else (q, _SPLIT_TWICE)
        if _has_params(get_module(sch.module, q)):
            return q, "its parameters' gradients would be partial sums taken for whole ones"
    if start:  # code fx cannot trace takes the shard, and nothing after it gathers it back
        around = caller_path(sch.module, start)
        if not _installed(sch, around):
            return around, _UNTRACED_TAKER
    return None


_UNTRACED_TAKER = ("its forward, which fx cannot trace, takes the shard: slapo_fn cannot tell that it does not "
                   "combine it with whole-sequence values (a residual add)")


_SPLIT_TWICE = ("a sequence_parallel chain splits its input itself: it would be split twice (state "
                "sf.sequence_parallel(..., input_layout=Shard(1)) if the split is meant)")


def _told_split(sch: Schedule, path: str) -> bool:
    """Whether the chain at ``path`` was told that its input arrives split (``input_layout``)."""
    chain = sch.annotations.get(path, SEQ)
    return chain is not None and chain.sharded_input


def _later_modules(root: nn.Module, path: str) -> Iterator[str]:
    """The modules that run after ``path`` in module order: its later siblings, then its
    parent's later siblings, and so on up to the root's children."""
    tokens = split(path)
    for depth in range(len(tokens), 0, -1):
        here = ".".join(tokens[:depth])
        siblings = _siblings(root, here)
        yield from siblings[siblings.index(here) + 1 :]


def _half_sharded_ties(sch: Schedule) -> list[Problem]:
    """A tied parameter sharded at one of its paths and not at another would come apart in
    the build (two tensors where the model has one): refused, naming both paths."""
    layouts = sch.annotations.of_kind(LAYOUT)
    problems = []
    for path, group in tied_paths(sch.module).items():
        sharded = next((q for q in group if q in layouts), None)
        if sharded is not None and path not in layouts:
            problems.append(Problem(
                path,
                f"is the same parameter as {sharded!r} (tied), which is sharded as {layouts[sharded]}; "
                "this path is not, so the tie would come apart",
                f"shard both alike, e.g. sf.shard(sch, [{_parent(sharded)!r}, {_parent(path)!r}], axis=0), "
                "or untie them first",
            ))
    return problems


def _unsplit_chain_inputs(sch: Schedule) -> list[Problem]:
    """A chain told that its input arrives split along the sequence (``input_layout``)
    must get it so: from the model's own input (the caller splits its batch), or from
    modules whose ``fwd_post`` sync states that shard (PyTorch's ``RowwiseParallel(
    output_layouts=Shard(1))`` on the embedding). Anything else hands it the whole
    sequence, which the chain would run on and its exit gather again (twice the
    length): refused, naming what feeds it. Read from the data flow, level by level up
    the tree, and from module order where a parent's flow is unknown."""
    seqs = sch.annotations.of_kind(SEQ)
    order = _run_order(sch)
    syncs = sch.annotations.of_kind(SYNC)
    problems = []
    firsts: dict[str, str] = {}
    for q in sorted(seqs, key=lambda q: order.get(q, 0)):
        firsts.setdefault(seqs[q].mesh_axis, q)
    for axis, first in sorted(firsts.items()):
        spec = seqs[first]
        if not spec.sharded_input:
            continue

        def splits(q: str, spec: SeqSpec = spec) -> bool:
            stated = [o.layout for o in syncs.get(q, ()) if o.mode == "fwd_post" and o.mesh_axis == spec.mesh_axis]
            if not stated:
                found = _stated_output(sch, q, spec.mesh_axis)
                stated = [found] if found is not None else []
            return bool(stated) and isinstance(stated[-1], Shard) and stated[-1].dim % 3 == spec.seq_axis % 3

        here, whole = first, []
        while here:
            found = _caller(sch, here)
            parent = found[0] if found is not None else _parent(here)
            if found is not None:
                _, name, fl = found
                fed = fl.feeders(name, _through(sch, parent))
                whole = [join(parent, q) for q in sorted(fed - {INPUT, SIDE}) if not splits(join(parent, q))]
                if whole or fed - {INPUT}:
                    break
            else:
                sib = _siblings(sch.module, here)
                before = sib[: sib.index(here)]
                if before:
                    whole = [] if splits(before[-1]) else [before[-1]]
                    break
            here = parent
        if whole:
            problems.append(Problem(
                first,
                f"is first in a sequence_parallel chain over {axis!r} stated to receive its input split along "
                f"the sequence (input_layout), but {', '.join(repr(q) for q in whole)} hands it the whole sequence",
                f"sync that output to the shard (sf.sync(sch, {whole[0]!r}, 'fwd_post', Shard(1))), or drop "
                "input_layout=",
            ))
    return problems


def _gathers_inside_chains(sch: Schedule, p: Plan) -> list[Problem]:
    """A sync that moves an activation inside a sequence-parallel chain (on a member or a
    module in one) to ``Replicate()`` gathers the sequence for that module alone (unless
    it is the last member's output, the chain's exit): what it feeds in the chain takes
    sequence shards (a raw shape error where a branch meets the others, or a column
    gathering it twice), and its parameters' gradients, summed over the ranks as a
    chain's are, would count every token twice. One to a token shard (``Shard(d)``, ``d``
    not the last) splits again what the chain split, or what a column gathered whole for
    attention, so that branches meet at different lengths. A sync that moves nothing
    (its ``src`` is its layout), a column's own gather and a row's own reduce-scatter to
    the chain's shard are layouts of the chain; the rest are refused, naming the module."""
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    seqs: dict[str, SeqSpec] = sch.annotations.of_kind(SEQ)
    order = _run_order(sch)
    whole = _whole_in_chains(sch)
    problems = []
    for path, mp in p.modules.items():
        if _inside_any(whole, path):
            continue  # runs on the whole sequence: its own syncs gather it and split it back
        for s in mp.syncs:
            role = roles.get(path)
            member = (spec := seqs.get(path)) is not None and spec.mesh_axis == s.mesh_axis
            if (s.mode == "fwd_pre" and s.src != s.layout and role is not None and role.enters
                    and role.mesh_axis == s.mesh_axis and (member or (
                        _last_dim(s.layout) and _in_chain(sch, path, s.mesh_axis)))):
                # a column inside a member (a gated MLP's up) reads what its parent gathered and entered
                # for all its columns: a split and gather of its own left it out of that entry (wrong numbers)
                where = "a member of" if member else "inside"
                problems.append(Problem(
                    path,
                    f"is a column {where} the sequence_parallel chain over {s.mesh_axis!r}: the chain's sequence "
                    f"shard is gathered for it, but its fwd_pre sync moves its input to {_code(s.layout)} first",
                    f"drop the fwd_pre sync on {path!r} (or put the block that holds it in the chain instead)",
                ))
                break
            token = isinstance(s.layout, Shard) and not _last_dim(s.layout)
            if s.mode not in ("fwd_pre", "fwd_post") or not (isinstance(s.layout, Replicate) or token):
                continue
            members = sorted((r for r, spec in seqs.items() if spec.mesh_axis == s.mesh_axis),
                             key=lambda r: order.get(r, 0))
            chain = next((seqs[r] for r in members if r == path or contains(r, path)), None)
            if chain is None:
                continue
            exit_ = s.mode == "fwd_post" and path == members[-1] and not token
            if s.mode == "fwd_post" and role is not None and not role.own_forward:
                natural = (role.splits_output and not token) or (
                    role.sums and isinstance(s.layout, Shard) and s.layout.dim == chain.seq_axis)
                if natural or exit_:
                    continue
            elif s.src == s.layout or exit_:
                continue  # moves nothing; the chain's exit
            what = ("splits the sequence again inside the chain, which splits and gathers it" if token else
                    "gathers the sequence for this module alone, while what it feeds in the chain takes sequence "
                    "shards")
            pair = ""
            if path not in seqs and role is None:  # a module inside a member may run on the whole sequence
                other = (f"'fwd_post', Shard({chain.seq_axis}), src=Replicate()" if s.mode == "fwd_pre"
                         else f"'fwd_pre', Replicate(), src=Shard({chain.seq_axis})")
                pair = f"; or, to run it on the whole sequence, pair it with sf.sync(sch, {path!r}, {other})"
            problems.append(Problem(
                path,
                f"has a {s.mode} sync to {_code(s.layout)} over {s.mesh_axis!r} inside the sequence_parallel chain: "
                f"it {what}",
                f"end the chain before {path!r} (leave it out of sf.sequence_parallel), or drop the sync (the chain "
                f"gathers at its last member){pair}",
            ))
            break
    return problems


def _ungathered_chain_members(sch: Schedule) -> list[Problem]:
    """A member of a sequence-parallel chain that holds modules, none of them a column over
    the chain's mesh axis, has nothing that gathers the sequence for it (a column's parent
    does): attention or any other code in it that mixes tokens would see only this rank's
    tokens — a shape error inside model code (LLaMA's rotary embedding) or a silently wrong
    attention. Refused, naming the member. Leaf members (norms, dropout) work token by token."""
    roles = sch.annotations.of_kind(ROLE)
    problems = []
    for path, spec in sch.annotations.of_kind(SEQ).items():
        module = get_module(sch.module, path)
        if not any(True for _ in module.children()):
            continue
        if any(r.mesh_axis == spec.mesh_axis and r.splits_output and (q == path or contains(path, q))
               for q, r in roles.items()):
            continue
        linear = next((join(path, q) for q, m in walk(module) if q and linear_features(m) is not None),
                      None)
        example = f"sf.shard(sch, {linear!r}, axis=...)" if linear else "sf.shard"
        problems.append(Problem(
            path,
            f"runs on sequence shards over {spec.mesh_axis!r} (sequence_parallel), but no column-parallel layer "
            f"inside it is sharded over {spec.mesh_axis!r}, so nothing gathers the sequence for it: attention or "
            "other code in it that mixes tokens would see only this rank's tokens",
            f"shard its linear layers over {spec.mesh_axis!r} first ({example}, or a recipe with tp=...), or leave "
            "it out of sequence_parallel",
        ))
    return problems


def _chain_gaps(sch: Schedule) -> list[Problem]:
    """A sequence-parallel chain hands each member's sequence shard on to the next member.
    A module with parameters that runs between two members (in module order, as a decoder
    stack runs) but is not in the chain would take that shard for the whole sequence: a
    shape error inside model code, or partial gradients. Refused, naming it, unless a
    ``fwd_pre`` sync gathers the sequence back for it."""
    seqs = sch.annotations.of_kind(SEQ)
    order = _run_order(sch)
    problems = []
    for axis in sorted({s.mesh_axis for s in seqs.values()}):
        members = sorted((q for q, s in seqs.items() if s.mesh_axis == axis), key=lambda q: order.get(q, 0))
        for member in members[:-1]:
            found = _next_outside_chain(sch, member, members, axis)
            if found is None:
                continue
            within = " (it holds members of the chain, but is not one)" if any(
                contains(found, r) for r in members) else ""
            problems.append(Problem(
                found,
                f"runs after {member!r}, a member of the sequence_parallel chain over {axis!r} that is not its "
                f"last, but is not in the chain{within}: it would take that member's sequence shard for the "
                "whole sequence",
                "make the chain's members follow one another (each one's output feeding the next), e.g. whole "
                "decoder layers and the final norm, sf.sequence_parallel(sch, ['model.layers.*', 'model.norm']) "
                f"with their linear layers sharded; or add {found!r} to the chain",
            ))
    return problems


def _next_outside_chain(sch: Schedule, member: str, members: list[str], axis: str) -> str | None:
    """The first module with parameters after ``member`` (its later siblings, then its
    ancestors') before the chain goes on, or ``None`` (the next member comes first, or a
    ``fwd_pre`` sync gathers the sequence back)."""
    syncs = sch.annotations.of_kind(SYNC)

    def gathers(q: str) -> bool:
        return any(s.mode == "fwd_pre" and s.mesh_axis == axis and isinstance(s.layout, Replicate)
                   for s in syncs.get(q, ()))

    levels, start = _downstream(sch, member)  # where the data flow is known, what the output reaches runs next
    for lv in levels:
        for q in sorted(lv.users - {OUTPUT}):
            path = join(lv.parent, q)
            if any(r == path or contains(r, path) for r in members) or gathers(path):
                # the next member; a module outside the chain whose output the parent's code adds to
                # its hidden states (a position embedding) would meet this member's shard there
                joined = sorted(lv.flow.hidden_feeders(q, lv.through) - {lv.name, INPUT, SIDE, OUTPUT})
                for j in joined:
                    there = join(lv.parent, j)
                    if not any(r == there or contains(r, there) for r in members) and _has_params(
                            get_module(sch.module, there)):
                        return there
                continue
            module = get_module(sch.module, path)
            if _has_params(module) or mixes_tokens(module) or not pointwise(module):
                return path
    if start is None:
        return None
    for q in _later_modules(sch.module, start):
        if any(r == q or contains(r, q) for r in members):
            return None
        if gathers(q):
            return None
        if _has_params(get_module(sch.module, q)):
            return q
    return None


def head_count_attrs(parent: nn.Module, out: int, packed: int) -> tuple[str, ...]:
    """The attributes of ``parent`` (attention) that count the heads of a column of
    ``out`` output features and ``packed`` blocks: the ones build's copy makes this
    rank's count when the column's output stays sharded (OPT's ``view(bsz, -1,
    self.num_heads, head_dim)``), as Megatron's per-partition head count does. Only a
    count that, times a head size attribute, equals the block's width (so q/k/v of GQA
    each have their own); none where the parent holds no head size."""
    own, head_dim = vars(parent), head_dim_of(parent)
    if head_dim is None:
        return ()
    return tuple(a for a in HEAD_COUNT_ATTRS if type(own.get(a)) is int and own[a] * head_dim * packed == out)


def grouped_head_count_attrs(parent: nn.Module, out: int, how: Apart | None) -> tuple[str, ...]:
    """The head counts of an attention whose fused column of ``out`` features (not packed)
    its forward views into groups of heads, ``how`` (:attr:`.flow.Flow.apart`): ``(g, k,
    head_dim)``, g a head count (Falcon's and BLOOM's ``view(B, S, num_heads, 3,
    head_dim)``: each head's q, k and v side by side), or ``(-1, k, head_dim)`` (Falcon's
    new decoder architecture: each kv head's queries, then its key and value). A rank's
    contiguous rows are then whole groups, and it holds the same share of every count that
    the groups divide (``num_heads`` and ``num_kv_heads``): build makes each this rank's.
    None where a size inside a group is a head count too: ``(3, num_heads, head_dim)`` is
    three blocks of heads (timm's, ``packed=3``), and one number cannot tell the two apart.

    Example:
        >>> import torch.nn as nn
        >>> att = nn.Module()
        >>> att.num_heads, att.num_kv_heads, att.head_dim = 8, 2, 16
        >>> grouped_head_count_attrs(att, (8 + 2 * 2) * 16, Apart("heads", dims=(-1, 6, 16)))
        ('num_heads', 'num_kv_heads')
        >>> grouped_head_count_attrs(att, 3 * 8 * 16, Apart("heads", dims=(3, 8, 16))) # blocks of heads
        ()
    """
    own, head_dim = vars(parent), head_dim_of(parent)
    dims = how.dims if how is not None and how.kind == "heads" else ()
    if head_dim is None or len(dims) < 3 or dims[-1] != head_dim or any(d is None or d <= 0 for d in dims[1:]):
        return ()
    counts = {a: v for a in HEAD_COUNT_ATTRS if type(v := own.get(a)) is int and v > 0}
    inside = 1
    for d in dims[1:]:
        inside *= d  # type: ignore[operator]
    groups = out // inside
    if out % inside or dims[0] not in (-1, groups) or groups not in counts.values():
        return ()
    if dims[0] != -1 and any(d in counts.values() for d in dims[1:-1]):
        return ()
    return tuple(a for a, v in counts.items() if v % groups == 0)


def head_width_attrs(parent: nn.Module, out: int, packed: int) -> tuple[str, ...]:
    """The attributes of ``parent`` (attention whose head counts :func:`head_count_attrs`
    finds) that hold the width of all the heads of a block of a column of ``out`` output
    features in ``packed`` blocks (XGLM's ``embed_dim``, read to merge the heads back):
    build's copy makes them this rank's width with the counts."""
    if not head_count_attrs(parent, out, packed):
        return ()
    own = vars(parent)
    return tuple(a for a in HEAD_WIDTH_ATTRS if type(own.get(a)) is int and own[a] * packed == out)


def heads_made_local(sch: Schedule, path: str, packed: int) -> tuple[str, ...]:
    """The attributes of the module calling column ``path`` (attention, its output kept
    split for its row) that build's copy makes this rank's: the head counts of the column's
    own features (:func:`head_count_attrs`) with the widths beside them
    (:func:`head_width_attrs`), else those of the groups of heads its traced forward views
    the output into (:func:`grouped_head_count_attrs`), else, whatever their names, those
    that give the count of heads it views the output into and nothing else
    (:attr:`.flow.Flow.counts`: ``view(B, S, self.nh, self.hd)``)."""
    parent = get_module(sch.module, _parent(path))
    out = _out_features(get_module(sch.module, path))
    if out is None:
        return ()
    if counts := head_count_attrs(parent, out, packed):
        return (*counts, *head_width_attrs(parent, out, packed))
    found = _caller(sch, path)
    if packed != 1 or found is None or found[0] != _parent(path):
        return ()
    how = found[2].apart.get(found[1])
    if grouped := grouped_head_count_attrs(parent, out, how):
        return grouped
    return found[2].counts.get(found[1], ()) if how is not None and _views_all(how, out) else ()


def _views_all(how: Apart, out: int) -> bool:
    """Whether the view ``how`` sizes all of ``out`` features by its constants (``(4,
    16)`` of 64), or the head size from the features (``(4, None)``: ``x.size(-1) // 4``;
    ``(4, -1)``)."""
    dims = how.dims
    if not dims or -1 in dims[:-1] or None in dims[:-1]:
        return False
    if dims[-1] in (None, -1):
        return True
    per = 1
    for d in dims:
        per *= d  # type: ignore[operator]
    return per == out


def _unadjusted_head_counts(parent: nn.Module, out: int, packed: int, how: Apart | None = None) -> tuple[str, ...]:
    """The head counts of an attention-like ``parent`` (a head size attribute beside them)
    when none of them counts its column's ``out`` features in ``packed`` blocks, so
    :func:`head_count_attrs` finds none for build to make this rank's, nor, from its
    traced view ``how``, :func:`grouped_head_count_attrs`: Falcon's multi-query
    ``num_heads`` beside a fused ``query_key_value`` of ``num_heads + 2`` heads, whose
    ``reshape(batch, self.num_heads, ...)`` would meet this rank's share."""
    own = vars(parent)
    if not any(isinstance(own.get(a), int) for a in HEAD_DIM_ATTRS):
        return ()
    counts = tuple(a for a in HEAD_COUNT_ATTRS if type(own.get(a)) is int)
    if not counts or head_count_attrs(parent, out, packed) or (packed == 1 and grouped_head_count_attrs(
            parent, out, how)):
        return ()
    return counts


def _axis_size(sch: Schedule, axis: str) -> int:
    dims = mesh_dims(sch.mesh) if sch.mesh is not None else ()
    return int(sch.mesh.size(dims.index(axis))) if sch.mesh is not None and axis in dims else 1


def _split_made_local(parent: nn.Module, sizes: tuple[int | None, ...], out: int | None, packed: int) -> bool:
    """Whether a split of a packed column's output by ``sizes`` is one build gives this
    rank's block size: one size, the parent's ``split_size``, the width of a block."""
    return (out is not None and len(sizes) == 1 and sizes[0] == out // packed
            and vars(parent).get("split_size") == sizes[0])


def _blocks_of_heads(parent: nn.Module, dims: tuple[int | None, ...], out: int | None, packed: int) -> bool:
    """Whether a view of a packed column's output as ``dims`` is its ``packed`` blocks
    first, each viewed into heads build gives this rank's count of (timm's ``reshape(B,
    N, 3, self.num_heads, self.head_dim)``): ``(packed, -1, d)``, or ``(packed, h, d)``
    with ``h`` a head count of one block (:func:`head_count_attrs`)."""
    if out is None or len(dims) != 3 or dims[0] != packed or not isinstance(dims[2], int) or dims[2] <= 0:
        return False
    return dims[1] == -1 or any(vars(parent).get(a) == dims[1] for a in head_count_attrs(parent, out, packed))


def _made_local(parent: nn.Module, made: tuple[str, ...], leading: tuple[int | None, ...]) -> bool:
    """Whether ``leading``, the sizes a view puts in front of its ``-1`` (or of a head size
    it computes), is one head count build makes this rank's (one of the attributes ``made``)."""
    own = vars(parent)
    return len(leading) == 1 and any(own.get(a) == leading[0] for a in made)


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


def _features_mixed(sch: Schedule, p: Plan) -> list[Problem]:
    """Code between a column kept split and its row must act on each feature alone (or
    take the features apart into heads or blocks, which the head and packing checks
    read): a reduction, softmax or matmul over the features, a flip, a concatenation
    along them would run over this rank's share as if it were all of them, a silently
    wrong number. Read from the traced data flow (:attr:`.flow.Flow.mixes`); refused,
    naming the op and the parent."""
    problems = []
    for path in sorted(_split_outputs(sch, p.modules)):
        found = _caller(sch, path)
        if found is None or (op := found[2].mixes.get(found[1])) is None:
            continue
        where = _named(found[0])
        problems.append(Problem(
            path,
            f"{where}'s forward applies {op} to its output before taking it apart into heads or blocks or handing "
            "it to a module, and slapo_fn does not know that op to act on each feature alone: over the features (a "
            "norm, a softmax, a matmul, a flip, a concatenation) it would see only this rank's share of them",
            f"gather its output, sf.sync(sch, {path!r}, 'fwd_post', Replicate()) (its row partner then splits the "
            "whole input), or leave it unsharded",
        ))
    return problems


def _heads_against_flow(sch: Schedule, p: Plan) -> list[Problem]:
    """A column kept sharded (or a module whose ``fwd_post`` sync splits its output by
    features) into code that views its output into heads must leave each rank whole
    heads, and sizes the view can be given this rank's share of: a ``-1`` (Hugging
    Face's ``view(*shape[:-1], -1, head_dim)``) or a head count build makes local
    (:func:`heads_made_local`: of the column's features, of groups of heads, or any
    attribute the trace shows sizes the heads and nothing else). Constants, and attributes
    read for more than sizes, would meet this rank's share of the features: refused
    before running, naming the parent, with the two ways to write it. Read from the traced
    data flow (:func:`.flow.flow`); a parent whose head count attributes count none of the
    column's features (:func:`_unadjusted_head_counts`) is refused too: untraced, for any
    such count; traced, for those its forward reads (CodeGen since transformers 5.24 views
    by ``-1`` and its block width, never ``num_attention_heads``)."""
    problems = []
    split_out = {path: axis for path, axis in _split_outputs(sch, p.modules).items()
                 if (mp := p.modules.get(path)) is None or mp.role is None or mp.role.packed == 1}
    for path, axis in sorted(split_out.items()):
        parent = _parent(path)
        found = _caller(sch, path)
        how = found[2].apart.get(found[1]) if found is not None else None
        out = _out_features(get_module(sch.module, path))
        planned = p.modules.get(path)
        packed = planned.role.packed if planned is not None and planned.role is not None else 1
        traced = how if found is not None and found[0] == parent else None
        counts = _unadjusted_head_counts(get_module(sch.module, parent), out, packed, traced) if out else ()
        if found is not None and found[0] == parent:  # traced: only the counts its forward reads
            counts = tuple(c for c in counts if c in found[2].attrs)
        if counts:
            where = _named(parent)
            problems.append(Problem(
                path,
                f"{where} counts heads in {', '.join(counts)}, which do not count this output's {out} features "
                "(nor its packed blocks): slapo_fn cannot make them this rank's, so its code sizing heads by them "
                "would meet this rank's share of the features",
                f"keep {path!r}'s output whole (leave it and its row partner unsharded, or sf.sync(sch, {path!r}, "
                "'fwd_post', Replicate())), or replace the attention by one whose head counts are its columns' "
                "(sf.replace)",
            ))
            continue
        if how is not None and out is not None and (problem := _head_view_problem(
                sch, path, parent, how, out, _axis_size(sch, axis))) is not None:
            problems.append(problem)
    for path in sorted(_split_outputs(sch, p.modules)):
        # timm's B, N, C = x.shape; ...; (attn @ v).transpose(1, 2).reshape(B, N, C): the heads
        # merged back by the whole width, where this rank holds its share of them
        found = _caller(sch, path)
        if found is not None and (op := found[2].by_width.get(found[1])) is not None:
            problems.append(Problem(
                path,
                f"{_named(found[0])}'s forward views a value computed from its output by the width of its "
                f"input, {op}: that width is all of the features, of which this rank holds its share",
                "view it by -1 there (reshape(B, N, -1)), or gather its output: "
                f"sf.sync(sch, {path!r}, 'fwd_post', Replicate())",
            ))
    for path, axis in sorted(_split_outputs(sch, p.modules).items()):
        # a packed column's blocks, each viewed into heads after the parent splits them apart
        # (nanoGPT's q, k, v = c_attn(x).split(n_embd); k.view(B, T, n_head, C // n_head))
        mp = p.modules.get(path)
        found = _caller(sch, path)
        out = _out_features(get_module(sch.module, path))
        if mp is None or mp.role is None or mp.role.packed == 1 or found is None or out is None:
            continue
        inner = found[2].inner.get(found[1])
        if inner is not None and (problem := _head_view_problem(
                sch, path, _parent(path), inner, out // mp.role.packed, _axis_size(sch, axis), "block")):
            problems.append(problem)
    return problems


_HEAD_VIEW_FIX = ("view it with -1 heads (view(B, S, -1, head_dim)), or by a head count its forward reads from an "
                  "attribute for sizes alone (self.num_heads, or any name: build makes it this rank's)")


def _head_view_problem(sch: Schedule, path: str, parent: str, how: Apart, out: int, size: int,
                       part: str = "output") -> Problem | None:
    """Why the view ``how`` of ``out`` features (of the whole output, or of each ``part``
    it is split into), held split over ``size`` ranks, would make heads of the wrong size,
    or ``None``."""
    if how.kind != "heads" or not how.dims:
        return None
    what = "" if part == "output" else f"each {part} of "
    local, where = out // size, _named(parent)
    module = get_module(sch.module, parent)
    made = heads_made_local(sch, path, 1) if part == "output" else head_count_attrs(module, out, 1)
    count = how.dims[0]
    if part == "output" and isinstance(count, int) and count > 0 and count % size and any(
            vars(module).get(a) == count for a in made):
        return Problem(
            path,
            f"{where}'s forward views its output into {count} heads (or groups of heads), which {size} ranks "
            "cannot hold whole",
            f"use a mesh axis whose size divides {count}, or leave it unsharded",
        )
    if how.dims[-1] is None and -1 not in how.dims:
        # view(B, S, 4, x.size(-1) // 4): a fixed count, the head size computed from this rank's share
        fixed = tuple(d for d in how.dims[:-1] if d is not None)
        if not fixed or _made_local(module, made, fixed):
            return None
        shape = "(" + ", ".join("?" if d is None else str(d) for d in how.dims) + ")"
        return Problem(
            path,
            f"{where}'s forward views {what}its output's features as {shape}: it counts "
            f"{' x '.join(map(str, fixed))} heads of the whole {part}, which slapo_fn does not know to make "
            f"this rank's, so this rank's {local} features would make that many heads of the wrong size (the "
            "numbers silently wrong)",
            _HEAD_VIEW_FIX,
        )
    if None in how.dims:
        return None
    known = [d for d in how.dims if d is not None and d > 0]
    per = 1
    for d in known:
        per *= d
    shape = "(" + ", ".join(str(d) for d in how.dims) + ")"
    if -1 in how.dims and local % per:
        return Problem(
            path,
            f"{where}'s forward views {what}its output's features as {shape}; this rank's {local} of its {out} "
            "features do not fill that view",
            f"use a mesh axis whose size divides its {out // per} heads, or leave it unsharded",
        )
    if -1 in how.dims and how.dims.index(-1) > 0 and not _made_local(module, made, how.dims[: how.dims.index(-1)]):
        return Problem(
            path,
            f"{where}'s forward views {what}its output's features as {shape}: the sizes in front of the -1 count "
            f"the whole {part}'s heads, so this rank's {local} features would make that many heads of the wrong "
            "size (the numbers silently wrong)",
            _HEAD_VIEW_FIX,
        )
    if -1 not in how.dims and per == out and not made:
        return Problem(
            path,
            f"{where}'s forward views {what}its output's features as {shape}, sizes slapo_fn cannot make this "
            f"rank's (constants, or attributes its forward reads for more than sizes; it holds {local} of the {out} "
            "features)",
            _HEAD_VIEW_FIX,
        )
    return None


def _packing_against_flow(sch: Schedule, p: Plan) -> list[Problem]:
    """A column kept sharded into its parent's code must hold what that code takes apart:
    ``packed=k`` where the parent splits the output into k blocks along the features
    (GPT-2's ``c_attn`` into [Q|K|V], Phi-3's ``gate_up_proj`` into [gate|up]); no
    packing where it views the output into heads first (GPT-NeoX's, Falcon's and BLOOM's
    ``query_key_value``: [q_h|k_h|v_h] head by head), where a rank's contiguous rows are
    whole heads. Either mistake trains on the wrong features, silently where the widths
    happen to fit; refused, naming the parent's code. A column whose output a sync gathers
    whole hands the parent all of it (:attr:`ModulePlan.keeps_features`). Read from the
    traced data flow (:func:`.flow.flow`)."""
    problems = []
    for path, mp in p.modules.items():
        role = mp.role
        if not path or role is None or not mp.keeps_features:
            continue
        found = _caller(sch, path)
        how = found[2].apart.get(found[1]) if found is not None else None
        if how is None:
            continue
        kind, count = how.kind, how.count
        where = _named(_parent(path))
        if kind == "slices":
            problems.append(Problem(
                path,
                f"{where}'s forward takes its output apart in {count} slices at fixed feature positions "
                "(x[..., :a], x[..., a:b]: sizes of the whole output), but each rank holds only its share of the "
                "features, so the slices would cut the wrong ones",
                f"leave {path!r} unsharded (its row partner then splits its input itself), or replace "
                f"{where} (sf.replace) with a module that projects q, k and v separately",
            ))
        elif kind == "heads" and role.packed > 1 and _blocks_of_heads(
                get_module(sch.module, _parent(path)), how.dims, _out_features(get_module(sch.module, path)),
                role.packed):
            pass  # timm's reshape(B, N, 3, num_heads, head_dim): blocks first, each of this rank's heads
        elif kind == "heads" and role.packed > 1:
            problems.append(Problem(
                path,
                f"is packed={role.packed}, but {where}'s forward views its output into heads before it splits it, "
                "so its features are grouped head by head ([q_h|k_h|v_h] for each head h), not in "
                f"{role.packed} blocks",
                "shard it without packed= (a rank's contiguous rows are then whole heads)",
            ))
        elif kind == "blocks" and role.packed > 1 and how.dims and not _split_made_local(
                get_module(sch.module, _parent(path)), how.dims, _out_features(get_module(sch.module, path)),
                role.packed):
            sizes = ", ".join(str(d) for d in how.dims)
            problems.append(Problem(
                path,
                f"{where}'s forward splits its output by sizes of the whole output's blocks ({sizes}), which build "
                "does not make this rank's (only GPT-2's split_size), so this rank's share would be cut into the "
                "wrong blocks",
                f"gather its output, sf.sync(sch, {path!r}, 'fwd_post', Replicate()), or split it with "
                f"chunk({role.packed}, dim=-1) or by a split_size attribute",
            ))
        elif kind == "blocks" and role.packed == 1:
            blocks = f"{count} blocks" if count else "blocks"
            problems.append(Problem(
                path,
                f"{where}'s forward splits its output into {blocks} along the features (q/k/v, gate/up), but it is "
                "sharded as one contiguous slice: each rank would hold whole blocks or parts of the wrong ones",
                f"shard it with packed={count or 'k'} (k blocks, each split over the ranks)",
            ))
    return problems


def _packed_outputs_read_whole(sch: Schedule, p: Plan) -> list[Problem]:
    """A packed column (``packed=k``) keeps its local output as this rank's slice of each
    of its k blocks side by side, ``[A_r|B_r]``: right for a parent that splits the blocks
    itself (GPT-2's [Q|K|V] by heads, a fused gate/up multiplied), wrong for anything that
    reads it as one contiguous slice — a row partner whose input features are the column's
    output features, sharded with another packing, or a ``fwd_post`` sync stating it a
    ``Shard(-1)``. Refused, naming both."""
    problems = []
    for path, mp in p.modules.items():
        role = mp.role
        if role is None or not role.enters or role.packed == 1:
            continue
        width = _out_features(get_module(sch.module, path))
        if mp.partnered:
            for q in mp.partners:
                other = p.modules.get(q)
                if other is None or other.role is None or not other.role.splits_input:
                    continue
                if other.role.mesh_axis != role.mesh_axis or other.role.packed == role.packed:
                    continue
                if width is not None and _in_features(get_module(sch.module, q)) == width:
                    problems.append(Problem(
                        q,
                        f"is row-parallel after {path!r}, packed={role.packed}, whose local output is this rank's "
                        f"slice of each of its {role.packed} blocks side by side; this row takes the column's "
                        f"{width} features as one contiguous shard (packed={other.role.packed})",
                        f"shard it with the column's packing, sf.shard(sch, {q!r}, axis=1, packed={role.packed}), "
                        f"or shard {path!r} without packed=",
                    ))
        for sync in mp.syncs:
            if sync.mode == "fwd_post" and isinstance(sync.layout, Shard) and sync.layout.dim == -1:
                problems.append(Problem(
                    path,
                    f"is packed={role.packed}: its local output is this rank's slice of each block side by side, "
                    "not the Shard(-1) the fwd_post sync states",
                    f"state Replicate() (the blocks are gathered and put back in order), or shard {path!r} "
                    "without packed=",
                ))
    return problems


def _chains_inside_pairs(sch: Schedule, p: Plan) -> list[Problem]:
    """A sequence-parallel chain member between a column and the row it is paired with
    (siblings, in module order) would take the column's feature shard for a whole
    activation: split it along the sequence and gather it again, mixing the ranks'
    features — silently wrong. Refused, naming the member and the pair."""
    seqs = sch.annotations.of_kind(SEQ)
    problems = []
    for path, mp in p.modules.items():
        if mp.role is None or not mp.role.enters or not mp.partnered:
            continue
        siblings = _siblings(sch.module, path)
        later = siblings[siblings.index(path) + 1 :]
        row = next((q for q in later if q in mp.partners), None)
        if row is None:
            continue
        for member in later[: later.index(row)]:
            spec = seqs.get(member)
            if spec is not None and spec.mesh_axis == mp.role.mesh_axis:
                problems.append(Problem(
                    member,
                    f"is in a sequence_parallel chain but runs between the column {path!r} and its row partner "
                    f"{row!r}: it would take the column's feature shard for a whole activation",
                    f"leave {member!r} out of the chain (the pair needs no sequence parallelism inside), or put "
                    f"the whole block that holds the pair in the chain",
                ))
    return problems


def _attention_on_sequence_shards(sch: Schedule) -> list[Problem]:
    """Attention inside a sequence-parallel chain sees only this rank's tokens unless its
    column-parallel q/k/v gather the sequence for it: without one (q/k/v not sharded over
    the chain's axis) each rank attends over its own tokens — silently wrong; as a chain
    member itself (not inside a decoder layer) it reshapes by its input's sequence-shard
    shape. Attention is known by its class or head attributes (:func:`.hf.mixes_tokens`),
    or by its traced code multiplying two activations (:attr:`.flow.Flow.attends`: a
    user's own ``Head`` with ``q @ k.transpose(-2, -1)``). Refused, naming the module."""
    roles = sch.annotations.of_kind(ROLE)
    whole = _whole_in_chains(sch)
    problems = []
    for member, spec in sch.annotations.of_kind(SEQ).items():
        if not any(r.mesh_axis == spec.mesh_axis and r.enters and (q == member or contains(member, q))
                   for q, r in roles.items()):
            continue  # nothing in it gathers the sequence: _ungathered_chain_members names the member
        for path, module in walk(get_module(sch.module, member), member):
            if _inside_any(whole, path):
                continue  # runs on the whole sequence
            if not (mixes_tokens(module) or ((fl := _flow_of(sch, path)) is not None and fl.attends)):
                continue
            gathered = any(r.mesh_axis == spec.mesh_axis and r.enters and contains(path, q)
                           for q, r in roles.items())
            if path == member and gathered and _attention(module):
                problems.append(Problem(
                    path,
                    f"is attention and itself a member of the sequence_parallel chain over {spec.mesh_axis!r}: "
                    "its projections gather the sequence, but it reshapes by its input's sequence-shard shape",
                    "put the block that holds it in the chain instead (a decoder layer), with its projections "
                    "sharded",
                ))
            elif not gathered and path != member:  # a member without any column: _ungathered_chain_members
                problems.append(Problem(
                    path,
                    f"is attention inside the sequence_parallel chain over {spec.mesh_axis!r} with no "
                    f"column-parallel projection sharded over {spec.mesh_axis!r}: each rank would attend over "
                    "its own tokens only",
                    f"shard its q/k/v projections over {spec.mesh_axis!r} (axis=0) and its output projection "
                    "(axis=1), or leave its block out of sequence_parallel",
                ))
    return problems


#: Layers whose forward mixes the positions of their input's other dimensions: a token shard
#: gives them a share of what they compute over.
_OVER_POSITIONS = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.GroupNorm,
                   nn.modules.instancenorm._InstanceNorm, nn.RNNBase)


def _code_over_the_sequence(sch: Schedule) -> list[Problem]:
    """A sequence-parallel chain member runs its own code on this rank's tokens (only a
    parent of column-parallel projections gathers them): code over the sequence there
    (``softmax(1)``, ``cumsum(1)``, ``mean(1)``, a flip, a token index, a ``Linear`` on
    the transposed activation as MLP-Mixer's token MLP, a convolution) sees only those
    tokens, a silently wrong number. Read from each member's traced code and its
    children's, following the sequence's dimension (:attr:`.flow.Flow.tokens`);
    attention is :func:`_attention_on_sequence_shards`'s. Refused, naming the op."""
    problems = []
    whole = _whole_in_chains(sch)
    for member, spec in sorted(sch.annotations.of_kind(SEQ).items()):
        entered: set[str] = set()
        found = _member_over_sequence(sch, member, spec, {}, entered)
        problems += [] if found is not None else [Problem(
            q,
            f"is to run on the whole sequence (its syncs gather its input along dimension {spec.seq_axis} and split "
            f"its output back), but slapo_fn cannot tell that its input is this rank's share of the sequence in the "
            f"chain over {spec.mesh_axis!r}: in the code of {_named(member)} it comes after a column-parallel layer "
            "or a module that gathers the tokens (the whole sequence, which the sync would gather twice), from "
            "elsewhere, or through code slapo_fn does not follow",
            "sync a module that takes the chain's activation before any column-parallel layer, or drop these syncs",
        ) for q in sorted(w for w in whole if contains(member, w) and w not in entered)]
        if found is not None:
            where, op = found
            run_whole = (f", or run {where!r} on the whole sequence: sf.sync(sch, {where!r}, 'fwd_pre', "
                         f"Replicate(), src=Shard({spec.seq_axis})) and sf.sync(sch, {where!r}, 'fwd_post', "
                         f"Shard({spec.seq_axis}), src=Replicate())" if where != member else "")
            problems.append(Problem(
                where,
                f"runs on this rank's tokens in the sequence_parallel chain over {spec.mesh_axis!r} (as part of "
                f"{_named(member)}), and its forward applies {op}, which would see only those tokens",
                f"leave {member!r} out of sequence_parallel, or move that code into a module whose projections "
                f"are column-parallel (its input is then gathered along the sequence){run_whole}",
            ))
    return problems


def _member_over_sequence(sch: Schedule, member: str, spec: SeqSpec, merged: dict[str, int],
                          entered: set[str] | None = None) -> tuple[str, str] | None:
    """:func:`_over_sequence` of a sequence-parallel chain member (``merged`` as there)."""
    if spec.seq_axis not in (0, 1):
        return None
    columns = {q for q, r in sch.annotations.of_kind(ROLE).items() if r.enters
               and r.mesh_axis == spec.mesh_axis and (q == member or contains(member, q))}
    # as the runtime does: a column called by the member's own code gathers its own input, one
    # deeper has its caller (attention) gather it
    callers = {caller_path(sch.module, q) for q in columns}
    whole = {q for q in _whole_in_chains(sch) if contains(member, q)}
    rows = {q for q, r in sch.annotations.of_kind(ROLE).items() if r.sums
            and r.mesh_axis == spec.mesh_axis and contains(member, q)}
    return _over_sequence(sch, member, spec.seq_axis, columns,
                          {c for c in callers if c != member and contains(member, c)}, merged,
                          (whole, set() if entered is None else entered, rows))


def _merged_tokens(sch: Schedule) -> dict[str, int]:
    """The layers inside sequence-parallel chains handed the batch and the tokens merged
    into one dimension (OPT's MLP on ``x.reshape(-1, x.size(-1))``), each with where that
    dimension is, counted from the end: a column there gathers the tokens, and a row
    scatters them, along it rather than along the chain's ``seq_axis``."""
    merged: dict[str, int] = {}
    for member, spec in sorted(sch.annotations.of_kind(SEQ).items()):
        _member_over_sequence(sch, member, spec, merged)
    return merged


def _over_sequence(sch: Schedule, path: str, seq_axis: int, columns: set[str], gathered: set[str],
                   merged: dict[str, int], whole: tuple[set[str], set[str], set[str]] = (set(), set(), set())
                   ) -> tuple[str, str] | None:
    """The first module under ``path`` (itself included) whose code runs on a token shard
    and acts over the sequence, with the op; ``None`` where none does or it cannot be read.
    The layers handed the batch and the tokens merged (:attr:`.features.At.merged`) are
    noted in ``merged``, each with that dimension (counted from the end): only layers that
    act on each token alone may be, and a gathering parent may not (it gathers along
    ``seq_axis``). ``whole``: the modules run on the whole sequence (:func:`_whole_in_chains`),
    where to note those handed this rank's tokens at ``seq_axis`` (which their syncs gather:
    from the parent's input, a row's reduce-scatter (the rows given third) or a gathering
    parent holding such a row; not from a column, which hands on the whole sequence)."""
    module = get_module(sch.module, path)
    if _tokens_alone(sch, path, columns, gathered):
        return None  # its input is gathered whole, it is attention (_attention_on_sequence_shards), or known
    if isinstance(module, _OVER_POSITIONS):
        return path, type(module).__name__
    if not module._modules:
        return _leaf_over_sequence(sch, path, module, seq_axis)
    fl = _flow_of(sch, path)
    if fl is None:
        return path, _UNREAD.format(type(module).__name__)
    tokens = fl.tokens.get(seq_axis)
    if tokens is None or fl.attends:
        return None
    if tokens.mixes is not None:
        return path, tokens.mixes
    for name, at, flat in tokens.reached:
        child = join(path, name)
        if child in whole[0]:
            found = None
            # what hands it this rank's tokens: the parent's input, a row's reduce-scatter, or a
            # gathering parent (attention) whose own row scatters its output
            stops = columns | gathered | whole[2]
            scattered = whole[2] | {g for g in gathered if any(contains(g, r) for r in whole[2])}
            origins = fl.hidden_feeders(name, functools.partial(_not_in, stops, path))
            if flat or at != seq_axis - ASSUMED_RANK:
                where = "merged with the batch" if flat else f"moved to dimension {at}"
                found = path, f"{name}(...) on the tokens {where}, which its syncs would gather along {seq_axis}"
            elif all(q == INPUT or join(path, q) in scattered for q in origins):
                whole[1].add(child)
        elif flat:
            found = None
            if child in gathered or not _tokens_alone(sch, child, columns, gathered):
                found = path, f"{name}(...) on the batch and the tokens merged into one dimension"
            merged.setdefault(child, at)
        elif at == seq_axis - ASSUMED_RANK:  # the child is handed tokens where its own code reads them
            found = _over_sequence(sch, child, seq_axis, columns, gathered, merged, whole)
        elif _tokens_alone(sch, child, columns, gathered):
            found = None
        else:  # its code was read with the tokens elsewhere: what it does over them is unknown
            found = path, f"{name}(...) on the tokens moved to dimension {at}"
        if found is not None:
            return found
    return None


def _not_in(paths: set[str], parent: str, name: str) -> bool:
    """Whether ``parent``'s child ``name`` is not one of ``paths``."""
    return join(parent, name) not in paths


def _tokens_alone(sch: Schedule, path: str, columns: set[str], gathered: set[str]) -> bool:
    """Whether the module at ``path`` acts on each token alone wherever its input holds
    them: a column or a gathering parent (its input is gathered whole), attention (judged
    by :func:`_attention_on_sequence_shards`), or a leaf :func:`_leaf_over_sequence`
    knows without reading its code."""
    module = get_module(sch.module, path)
    if path in columns or path in gathered or _attention(module):
        return True
    return not module._modules and (pointwise(module) or is_conv1d(module) or own_layer(module, _PER_TOKEN))


def _attention(module: nn.Module) -> bool:
    """Whether ``module`` is attention (:func:`.hf.mixes_tokens`) holding none: a block
    holding attention, with a head count of its own (MPT's, BLOOM's), runs its own code on
    the tokens, which is read as any other's."""
    return mixes_tokens(module) and not any(mixes_tokens(c) for c in module.modules() if c is not module)


_UNREAD = "{}'s forward (fx cannot trace it, so what it does over the tokens is unknown)"
#: Layers that act on each token alone (over its features), as PyTorch writes them.
_PER_TOKEN = (nn.Linear, nn.Bilinear, nn.LayerNorm, nn.RMSNorm, nn.Embedding, nn.Identity)


def _leaf_over_sequence(sch: Schedule, path: str, module: nn.Module, seq_axis: int) -> tuple[str, str] | None:
    """:func:`_over_sequence` of a module without children: PyTorch's per-token layers
    (their own forward, not a subclass's), activations and dropouts act on each token;
    any other's own code is traced and walked (a user's ``fft`` over the tokens, FNet's),
    and one fx cannot trace is refused: what it does over the tokens is unknown (the
    layers known without reading are :func:`_tokens_alone`'s, checked before)."""
    kind = type(module)
    found = _caller(sch, path)
    fl = flow(module, found[2].given.get(found[1], frozenset()) if found else frozenset(), leaf=True)
    tokens = fl.tokens.get(seq_axis) if fl is not None else None
    if fl is None or tokens is None:
        return path, _UNREAD.format(kind.__name__)
    return None if tokens.mixes is None else (path, tokens.mixes)


def _lone_columns_in_chains(sch: Schedule, p: Plan) -> list[Problem]:
    """A column over a chain's mesh axis inside a sequence-parallel chain gathers the
    sequence for itself; only a row reading its output (its partner) scatters it back.
    Without one, its output — the whole sequence — would go on where the chain carries
    this rank's part: refused, naming it. The chain's last member may be such a column
    (PyTorch's LM head after the final norm): the chain ends there. Likewise a row (or
    vocab embedding) that no column feeds, other than the chain's first member (which
    enters the chain by its reduce-scatter), would scatter the sequence shard again."""
    seqs = sch.annotations.of_kind(SEQ)
    order = _run_order(sch)
    across = _sequence_pairs_across(sch, p)
    problems = []
    for path, mp in p.modules.items():
        role, seq = mp.role, mp.seq
        if role is None or seq is None or seq.mesh_axis != role.mesh_axis or mp.partnered or path in across:
            continue
        if _whole_in_parent(sch, p, path):
            continue
        members = sorted((q for q, s in seqs.items() if s.mesh_axis == seq.mesh_axis), key=lambda q: order.get(q, 0))
        if (role.reads_ids and role.splits_output):
            problems.append(Problem(
                path,
                f"is an embedding sharded by features (axis=1) inside the sequence_parallel chain over "
                f"{seq.mesh_axis!r}: slapo_fn does not split its token ids and gather its features in one step "
                "(its numbers came out wrong)",
                "shard it by vocabulary (axis=0), which enters the chain by a reduce-scatter, or leave it out of "
                "the chain",
            ))
            continue
        if role.sums and path != members[0]:
            problems.append(Problem(
                path,
                f"is {role.name}-parallel inside the sequence_parallel chain over {seq.mesh_axis!r}, but no "
                "column-parallel layer feeds it: it takes the chain's sequence shard and would reduce-scatter "
                "the sequence a second time",
                "shard the layer before it as its column partner (axis=0), or leave it unsharded, or make it the "
                "chain's first member",
            ))
            continue
        if not role.enters or path == members[-1]:
            continue
        norms = _norms_between(sch, path)
        problems.append(Problem(
            path,
            f"is column-parallel inside the sequence_parallel chain over {seq.mesh_axis!r}, but no row-parallel "
            "layer reads its output alone: it gathers the whole sequence, which would go on where the chain "
            "carries this rank's part" + (f" (its output goes through {', '.join(map(repr, norms))} first)"
                                          if norms else ""),
            (f"if {', '.join(map(repr, norms))} {'acts' if len(norms) == 1 else 'act'} on each head alone "
             f"(per-head q/k norms), declare it: sf.tp_local(sch, {norms!r}); else " if norms else "")
            + "shard the layer that reads its output as its row partner (axis=1), or leave it unsharded, or out "
            "of the chain",
        ))
    return problems


def _whole_in_parent(sch: Schedule, p: Plan, path: str) -> bool:
    """Whether a lone column or row inside a sequence-parallel chain sits in a stretch of its
    parent's code that runs on the whole sequence: each column there gathers the sequence
    and then its features (no row reads its output alone: OLMo2's q/k/v, whose full-width
    q/k norms come between), the children between hold no layout and compute on whole
    values, and each row takes such a whole input, splits it and reduce-scatters the
    sequence back (PyTorch's colwise with output ``Replicate()``, rowwise with input
    ``Replicate()``). A column qualifies when all its output reaches ends in such rows; a
    row when all that reaches it starts at such columns (or side values: rotary ``cos``/
    ``sin``) and its output reaches only the parent's result. Not where a norm narrower than
    a column's output (one per head, Gemma 3's) comes between: declared ``tp_local``, it
    lets the column pair with its row, and the refusal says so. Only in a parent strictly
    inside a member (attention inside a decoder layer), which gathers the sequence for its
    columns and runs its other children whole (:func:`_gathering_parents`); a member's own
    children run on its sequence shard."""
    found = _caller(sch, path)
    mp = p.modules[path]
    if found is None or mp.role is None:
        return False
    caller, name, fl = found
    if caller not in _gathering_parents(sch):
        return False
    axis = mp.role.mesh_axis
    laid = {*sch.annotations.of_kind(ROLE), *sch.annotations.of_kind(SEQ), *sch.annotations.of_kind(SYNC)}

    def whole(q: str) -> bool:  # runs on whole values as it is: nothing laid out at or under it
        full = join(caller, q)
        return not any(a == full or contains(full, a) for a in laid)

    def lone(q: str, row: bool) -> bool:  # no syncs, but a column's gather of its output (colwise_gather_output)
        m = p.modules.get(join(caller, q))
        if (m is None or m.role is None or (m.role.splits_input if row else m.role.enters) is False
                or m.role.mesh_axis != axis or m.partnered or m.seq is None or m.seq.mesh_axis != axis):
            return False
        if row:
            return not m.syncs
        return all(s.mode == "fwd_post" and s.mesh_axis == axis and isinstance(s.layout, Replicate)
                   for s in m.syncs) and not per_head(q)

    def per_head(column: str) -> bool:
        # a norm whose weight is narrower than the column's output acts on its heads (Gemma 3's
        # q/k norms): declared tp_local it pairs the column with its row; refused so as to say so
        width = _out_features(get_module(sch.module, join(caller, column))) or 0
        return any(0 < max((t.numel() for t in get_module(sch.module, norm).parameters()), default=0) < width
                   for norm in _norms_between(sch, join(caller, column)))

    def row(q: str) -> bool:
        sources = fl.feeders(q, whole)
        return (lone(q, True) and any(lone(s, False) for s in sources)
                and all(s == SIDE or lone(s, False) for s in sources) and fl.consumers(q, whole) <= {OUTPUT})

    if mp.role.splits_input:
        return row(name)
    users = fl.consumers(name, whole)
    return mp.role.enters and lone(name, False) and bool(users) and all(
        u != OUTPUT and row(u) for u in users)


def _norms_between(sch: Schedule, column: str) -> list[str]:
    """The norms (modules with parameters, no children, a class named ``...Norm``) that the
    column's output reaches in its caller's code: per-head q/k norms that keep it from its
    row unless declared ``tp_local``."""
    found = _caller(sch, column)
    if found is None:
        return []
    caller, name, fl = found
    out = []
    for user in sorted(fl.consumers(name, _through(sch, caller)) - {OUTPUT}):
        module = get_module(sch.module, join(caller, user))
        if not module._modules and "Norm" in type(module).__name__ and any(True for _ in module.parameters()):
            out.append(join(caller, user))
    return out


def _sequence_pairs_across(sch: Schedule, p: Plan) -> frozenset[str]:
    """Columns and rows of a sequence-parallel chain that pair across parents, as BERT's
    do: ``attention.self`` calls q/k/v and hands its result (the whole sequence) to
    ``attention.output``, whose row reduce-scatters the sequence (split by features or
    not, as the other checks and syncs settle). The column's caller is inside a member, so it gathers
    the sequence at its input and all its code runs on the whole sequence (whether fx can
    trace it or not: DeBERTa's cannot). Accepted where the data flow shows nothing else
    on the way out: the caller's result reaches only the first argument of siblings that
    hand their own first argument only to such a row, so the whole sequence runs from the
    gather to the row's reduce-scatter alone."""
    seqs = sch.annotations.of_kind(SEQ)
    out: set[str] = set()
    for path, mp in p.modules.items():
        role, seq = mp.role, mp.seq
        if (role is None or not role.enters or seq is None or seq.mesh_axis != role.mesh_axis
                or mp.partnered or path in seqs):
            continue
        rows = _rows_across(sch, p, path, role.mesh_axis, seqs)
        if rows:
            out |= {path, *rows}
    return frozenset(out)


def _rows_across(sch: Schedule, p: Plan, column: str, axis: str, seqs: Mapping[str, SeqSpec]) -> frozenset[str]:
    """The rows of :func:`_sequence_pairs_across` that ``column`` feeds, or none."""
    caller = caller_path(sch.module, column)  # as the runtime finds the parent that gathers
    if not any(contains(m, caller) for m in seqs):
        return frozenset()
    up = _caller(sch, caller)
    if up is None or not (up[0] in seqs or any(contains(m, up[0]) for m in seqs)):
        return frozenset()
    outer, inner_name, ofl = up
    through = _through(sch, outer)
    users = ofl.consumers(inner_name, through)
    rows: set[str] = set()
    for user in users:
        if user == OUTPUT or ofl.hidden_feeders(user, through) != {inner_name}:
            return frozenset()
        receiver = join(outer, user)
        rfl = _flow_of(sch, receiver)
        if rfl is None:
            return frozenset()
        rthrough = _through(sch, receiver)
        taken = rfl.consumers(INPUT, rthrough)
        if len(taken) != 1 or OUTPUT in taken or rfl.hidden_feeders(next(iter(taken)), rthrough) != {INPUT}:
            return frozenset()
        row = join(receiver, next(iter(taken)))
        mp = p.modules.get(row)
        if mp is None or mp.role is None or not mp.role.splits_input or mp.role.mesh_axis != axis or mp.seq is None:
            return frozenset()
        rows.add(row)
    return frozenset(rows)


def _split_input_into_reducers(sch: Schedule, p: Plan) -> list[Problem]:
    """A row- or vocab-parallel module first in a chain enters it by reduce-scattering its
    own partial output along the sequence; told that its input arrives split already
    (``input_layout=Shard(...)``), it would split the sequence a second time. Refused,
    naming it."""
    order = _run_order(sch)
    problems = []
    for path, spec in sch.annotations.of_kind(SEQ).items():
        if not spec.sharded_input:
            continue
        same = [q for q, s in sch.annotations.of_kind(SEQ).items() if s.mesh_axis == spec.mesh_axis]
        mp = p.modules.get(path)
        role = mp.role if mp is not None else None
        if path != min(same, key=lambda q: order.get(q, 0)) or role is None or role.mesh_axis != spec.mesh_axis:
            continue
        if role.sums:
            problems.append(Problem(
                path,
                f"is {role.name}-parallel and first in a sequence_parallel chain stated to receive its input split "
                f"(input_layout=Shard({spec.seq_axis})): it enters the chain by reduce-scattering its own partial "
                "output, which would split the sequence twice",
                "leave input_layout out (its reduce-scatter splits the sequence), or start the chain at a module "
                "that takes the split input",
            ))
    return problems


def _functional_reads(sch: Schedule, p: Plan) -> list[Problem]:
    """A parent that reads a child's parameters itself (``F.linear(x, self.proj.weight)``,
    ``nn.MultiheadAttention``'s ``out_proj``) instead of calling the child bypasses the
    child's installed forward: a layout planned for that child (sharded, synced, run on
    sequence shards) would meet the parent's plain math — a raw "mixed torch.Tensor and
    DTensor" error or wrong numbers. Refused, naming the parent and the child."""
    planned = set(p.modules) | set(sch.annotations.of_kind(ROLE))
    problems = []
    for parent in sorted({_parent(q) for q in planned if q}):
        pm = get_module(sch.module, parent)
        fl = _flow_of(sch, parent)
        reads = set(fl.reads) if fl is not None else set()
        if isinstance(pm, nn.MultiheadAttention):
            reads.add("out_proj")  # F.multi_head_attention_forward(..., self.out_proj.weight, ...)
        for child in sorted(reads):
            path = join(parent, child)
            if path in planned:
                problems.append(Problem(
                    parent or "<root>",
                    f"reads the parameters of its child {path!r} itself instead of calling it, so the layout "
                    f"planned for {path!r} (sharded, synced or on sequence shards) would not apply",
                    f"leave {path!r} unsharded and out of syncs and sequence_parallel chains, or replace "
                    f"{parent or '<root>'!r} (sf.replace) with a module that calls {child!r}",
                ))
    return problems


def _feature_syncs(sch: Schedule, p: Plan) -> list[Problem]:
    """A ``sync`` to ``Shard(-1)`` (this rank's features) hands a module a part of what it
    needs whole, unless that module is row-parallel (which takes its input split) or a
    column (which gathers it back): refused for a ``fwd_pre`` sync into a module with
    parameters (or into a parameterless one that is neither pointwise nor states its own
    output by a ``fwd_post`` sync, as a hand-written module on local features does), and
    for a ``fwd_post`` sync (or a pointwise module handed split features) whose output
    reaches anything but rows, unless it is the model's output."""
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    kept = frozenset(q for q, mp in p.modules.items() if mp.keeps_features)
    problems = []

    def meets_whole(path: str, what: str, rows: list[str] | None, axis: str, verb: str) -> bool:
        here, mixed = path, _whole_beside_split(sch, path, rows, axis, kept)
        while not mixed and rows is None and (up := _result_of_caller(sch, here)) is not None:
            # the split output is its caller's result too (x + body(x) around a Sequential body)
            here, mixed = up, _whole_beside_split(sch, up, None, axis, kept, hidden_only=True)
        if mixed:
            where = found[0] if (found := _caller(sch, here)) is not None else _parent(here)
            problems.append(Problem(
                path, f"{what} {verb} by features, but in {where or '<root>'!r}'s forward "
                      f"it meets the whole output of {', '.join(repr(q) for q in mixed)}",
                "shard those as columns (axis=0) too, or state Replicate() instead",
            ))
        return bool(mixed)

    for path, specs in sch.annotations.of_kind(SYNC).items():
        for s in specs:
            feature = isinstance(s.layout, Shard) and s.layout.dim == -1
            already = isinstance(s.src, Shard) and s.src.dim == -1
            role = roles.get(path)
            # a sharded module's fwd_post sync converts from the role's own output, whatever src says
            if s.mode not in ("fwd_pre", "fwd_post") or not feature or (
                    already and (role is None or s.mode == "fwd_pre")):
                continue
            what = f"the {s.mode} sync of {path or '<root>'!r} to Shard(-1) over {s.mesh_axis!r}"
            module = get_module(sch.module, path)
            if s.mode == "fwd_pre":
                if role is not None and (role.enters or role.splits_input):
                    continue
                states_output = any(o.mode == "fwd_post" for o in specs)
                if role is not None or _has_params(module) or not (pointwise(module) or states_output):
                    problems.append(Problem(
                        path, f"takes its whole input, but {what} hands it this rank's features only",
                        "shard it as a row (axis=1) so that it takes split features, or drop the sync",
                    ))
                    continue
                if states_output:
                    continue  # a hand-written module on this rank's features, whose output the user states
            elif role is not None and role.enters:
                if meets_whole(path, what, None, s.mesh_axis, "keeps its output split"):
                    continue
                users, taker = _reach(sch, path)
                if taker is not None:
                    problems.append(Problem(
                        path, f"{what} keeps its output split by features, but fx cannot trace the forward of "
                              f"{taker or '<root>'!r}, which takes it: slapo_fn cannot tell that its code takes "
                              "this rank's features",
                        "state Replicate() instead (or drop the sync), or make that forward traceable by torch.fx",
                    ))
                    continue
                # kept split for rows: its own, or ones inside the modules it reaches (BERT's attention
                # output); where it is the result (vocab-parallel logits) or an installed module takes it, trusted
                reached = users or []
                rows = [q for q, r in roles.items() if r.splits_input and r.mesh_axis == s.mesh_axis]
                bad = [q for q in reached if not _takes_split(sch, q, set(rows))]
                if bad:
                    problems.append(Problem(
                        path, f"{what} keeps its output split by features, but it goes on to "
                              f"{', '.join(map(repr, bad))}, which need it whole",
                        "state Replicate() instead (or drop the sync), or shard the modules that read it as rows "
                        "(axis=1)",
                    ))
                continue
            if _model_output(sch, path):
                stated = [q for q in _ancestors(path) for o in sch.annotations.of_kind(SYNC).get(q, ())
                          if o.mode == "fwd_post" and o.mesh_axis == s.mesh_axis and o.src is None]
                if stated:
                    problems.append(Problem(
                        stated[0] or "<root>",
                        f"has a fwd_post sync without src=, which takes its output as Replicate(), but {what} "
                        "leaves it split by features",
                        "state the split: sf.sync(..., src=Shard(-1))",
                    ))
                continue  # the model's sharded result
            users, taker = _reach(sch, path)
            if users is None and role is not None and taker is None:
                continue  # a sharded module's stated output taken by a module installed by sf.replace
            if users is None:
                named = "modules whose data flow slapo_fn cannot trace"
            elif not users:
                named = "the model's result, combined with other values"
            else:
                bad = [q for q in users
                       if (r := roles.get(q)) is None or not r.splits_input or r.mesh_axis != s.mesh_axis]
                named = ", ".join(repr(q) for q in bad)
                # every consumer in its parent, the parent's result included (a(x) + b(x) with b whole)
                if not named and meets_whole(path, what, None, s.mesh_axis, "splits its output"):
                    continue
            if named:
                problems.append(Problem(
                    path, f"{what} splits its output by features, but it goes on to {named}, which need it whole",
                    "state Replicate() instead, or shard the modules that read it as rows (axis=1)",
                ))
    return problems


def _half_gathered_pairs(sch: Schedule, p: Plan) -> list[Problem]:
    """A row whose paired columns' outputs a ``fwd_post`` sync moves off ``Shard(-1)`` for
    some and not others: the row would take whole-width values and this rank's features
    together (q gathered while k and v stay split: a raw shape error in the attention).
    Refused, naming the row and both groups."""
    problems = []
    for path, mp in p.modules.items():
        if mp.role is None or not mp.role.splits_input or not mp.partners:
            continue
        ax = mp.role.mesh_axis
        gathered = [c for c in mp.partners if _partner_gathered(sch, (c,), ax)]
        kept = [c for c in mp.partners if c not in gathered]
        if gathered and kept:
            problems.append(Problem(
                path,
                f"takes the outputs of {', '.join(map(repr, gathered))}, which a fwd_post sync gathers, together "
                f"with those of {', '.join(map(repr, kept))}, kept split by features for it",
                f"sync {', '.join(map(repr, kept))} alike, or drop the sync on {', '.join(map(repr, gathered))}",
            ))
    return problems


def _whole_beside_split(sch: Schedule, path: str, rows: list[str] | None, axis: str, kept: frozenset[str],
                        hidden_only: bool = False) -> list[str]:
    """The siblings whose whole (unsplit) output reaches one of ``rows`` (``None``: any of
    ``path``'s consumers in its parent, the parent's result included) together with
    ``path``'s output split by features: the two meet in the parent's code (``act(gate)
    * up``) at different widths. Columns kept sharded (``kept``: their paths) and outputs
    a sync splits too are split alike. ``hidden_only``: what reaches a consumer's first
    argument only (BERT's ``self.output(attention, hidden_states)`` adds its residual
    inside, after its row)."""
    found = _caller(sch, path)
    if found is None:
        return []
    parent, name, fl = found
    through = _through(sch, parent)
    if rows is None:
        users = fl.consumers(name, through)
        rows = [OUTPUT if u == OUTPUT else join(parent, u) for u in users]
    # in a chain member, columns gather the sequence themselves and a synced sibling keeps the
    # chain's shard: the two are not split alike
    member = (spec := sch.annotations.get(parent, SEQ)) is not None and spec.mesh_axis == axis

    def alike(q: str) -> bool:
        if not (q in kept or _split_by_sync(sch, q, axis)):
            return False
        return not member or (q in kept) == (path in kept)

    out: set[str] = set()
    for row in rows:
        inner = row[len(parent) + 1:] if parent else row
        if row != OUTPUT and not (contains(parent, row) and fl.called(inner)):
            continue
        # at the result: what it is returned with in one tensor (not beside it in a ModelOutput)
        if row == OUTPUT:
            fed = fl.returned_with(name, through)
        else:
            fed = fl.hidden_feeders(inner, through) if hidden_only else fl.feeders(inner, through)
        for q in fed - {SIDE, name}:
            if q == INPUT or not alike(join(parent, q)):
                out.add("<input>" if q == INPUT else join(parent, q))
    return sorted(out)


def _takes_split(sch: Schedule, path: str, rows: set[str], depth: int = 0) -> bool:
    """Whether module ``path`` takes its input split by features: a row, or a module whose
    code hands its input (through pointwise children) to such modules only (BERT's
    ``self.output``: its ``dense`` row first, the residual added after); a module holding
    rows whose flow is unknown is trusted. A norm or a plain Linear first needs it whole."""
    if path in rows:
        return True
    if not any(contains(path, r) for r in rows) or depth > 8:
        return False
    fl = _flow_of(sch, path)
    if fl is None:
        return True
    users = fl.consumers(INPUT, _through(sch, path))
    return bool(users) and OUTPUT not in users and all(_takes_split(sch, join(path, u), rows, depth + 1)
                                                        for u in users)


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


def _installed(sch: Schedule, path: str) -> bool:
    """Whether ``path`` is, or is inside, a module installed by ``sf.replace``: code written
    for this rank's share (slapo_fn's attention kernels take their head counts from the
    recipe), trusted with what it is handed."""
    return any(a == path or contains(a, path) for a in sch.annotations.of_kind(INSTALLED))


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


def chain_entries_given_split(sch: Schedule) -> dict[str, SeqSpec]:
    """The first members of the sequence-parallel chains told that their input arrives split
    (``input_layout=Shard(d)``), with their chain's spec."""
    seqs: dict[str, SeqSpec] = sch.annotations.of_kind(SEQ)
    with _flows_memo():
        return {first: seqs[first] for first in _chain_entries(sch).values() if seqs[first].sharded_input}


def _partial_sources(sch: Schedule) -> list[Problem]:
    """A ``fwd_post`` sync's ``src=Partial()`` says that each rank holds a share of the
    output to be summed, as a row-parallel module's local result is. A built-in
    ``torch.nn`` module without a layout (not sharded, not ``tp_local``) fed by nothing
    stated partial computes the whole output on every rank: the sync would all-reduce
    a replicated value (the output doubled at tp=2) or, on token ids, index out of
    range on one rank while the other waits. A container (``nn.Sequential``) returns its
    children's result, which rows have already summed. Refused, naming the module; a
    hand-written module may legitimately return partial sums, so only ``torch.nn``'s own
    are checked."""
    roles = sch.annotations.of_kind(ROLE)
    local = sch.annotations.of_kind(LOCAL)
    syncs = sch.annotations.of_kind(SYNC)
    stated_partial = {q for q, specs in syncs.items() for o in specs if isinstance(o.layout, Partial)}
    problems = []
    for path, specs in syncs.items():
        if not path or path in roles or path in local:
            continue
        module = get_module(sch.module, path)
        if not type(module).__module__.startswith("torch.nn.modules") or stated_partial - {path}:
            continue
        for o in specs:
            if o.mode == "fwd_post" and isinstance(o.src, Partial):
                problems.append(Problem(
                    path,
                    f"is {type(module).__name__} with no layout: every rank computes its whole output, but a "
                    f"fwd_post sync states it src=Partial() (a share of a sum), so the sync would sum the ranks' "
                    "copies",
                    "drop src= (the output is Replicate()), or shard the module as a row (axis=1), whose output "
                    "is the partial sum",
                ))
                break
    return problems


def _gathering_parents(sch: Schedule) -> dict[str, set[str]]:
    """The parents that gather the sequence inside sequence-parallel chains (the callers,
    strictly inside a member, of columns over the chain's mesh axis: attention, as the
    runtime installs them), each with the names of those columns under it."""
    roles = sch.annotations.of_kind(ROLE)
    seqs: dict[str, SeqSpec] = sch.annotations.of_kind(SEQ)
    whole = _whole_in_chains(sch)
    columns_of: dict[str, set[str]] = {}
    for q, r in roles.items():
        member = next((m for m, spec in seqs.items() if contains(m, q) and spec.mesh_axis == r.mesh_axis), None)
        if not r.enters or member is None or _inside_any(whole, q):
            continue
        parent = caller_path(sch.module, q)
        if contains(member, parent):  # not the member's own code: each such column gathers its own input
            columns_of.setdefault(parent, set()).add(q[len(parent) + 1:])
    return columns_of


def _shared_gathers(sch: Schedule) -> frozenset[str]:
    """The gathering parents of sequence-parallel chains (the callers, strictly inside a
    member, of columns over the chain's mesh axis: attention) whose gathered input reaches
    more than those columns: a q left unsharded beside sharded k and v, or code of the
    parent's own. The gradient that comes back to the gather then holds whole parts (the
    unsharded modules', the same on every rank) beside the columns' partial sums, and a
    reduce-scatter of it would count the whole parts once per rank. Such a parent gathers
    with the gradient sliced instead, and its columns each enter with an all-reduce. Where
    the parent's code cannot be traced, it is taken as shared (right, at that cost)."""
    shared = set()
    for parent, columns in _gathering_parents(sch).items():
        fl = _flow_of(sch, parent)
        if fl is None or not fl.consumers(INPUT, _through(sch, parent)) <= columns:
            shared.add(parent)
    return frozenset(shared)


def _run_order(sch: Schedule) -> Mapping[str, int]:
    """Each module path's place in the order the model runs them, pre-order: the children of
    a parent whose forward fx traces come in the order its code first calls them, in the
    places module order gives the called ones (OPT's decoder registers ``final_layer_norm``
    before ``layers`` and calls it after them); elsewhere module order. The order of two
    paths is their common ancestor's, so only the ancestors of sequence-parallel members,
    whose chains the order decides (first, last, what runs between), are traced for it.
    Found once per :func:`plan` or :func:`refusals` call."""
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


def _whole_in_chains(sch: Schedule) -> dict[str, SeqSpec]:
    """:func:`_modules_run_whole`, found once per :func:`plan` or :func:`refusals` call."""
    memo = _LOOKUPS.get()
    if memo is None:
        return _modules_run_whole(sch)
    if memo.whole is None or memo.whole[0] is not sch:
        memo.whole = (sch, _modules_run_whole(sch))
    return memo.whole[1]


def _modules_run_whole(sch: Schedule) -> dict[str, SeqSpec]:
    """The modules inside a sequence-parallel chain's member that run on the whole
    sequence, each with its chain: a ``fwd_pre`` sync gathers its input (``Shard(s)`` to
    ``Replicate()``, ``s`` the chain's ``seq_axis``) and a ``fwd_post`` sync splits its
    output back (``Replicate()`` to ``Shard(s)``), as PyTorch's
    ``PrepareModuleInputOutput`` does around a mixture-of-experts block whose routing
    reads every token. The module then runs replicated: its parameters' gradients are
    whole on every rank (no partial sums to reduce), and code over the tokens in it sees
    all of them. Only a module with no role of its own, strictly inside a member, not
    inside another such module; the two syncs' ``src`` may be left out."""
    seqs: dict[str, SeqSpec] = sch.annotations.of_kind(SEQ)
    roles = sch.annotations.of_kind(ROLE)
    found: dict[str, SeqSpec] = {}
    for path, specs in sorted(sch.annotations.of_kind(SYNC).items()):
        member = next((r for r in seqs if contains(r, path)), None)
        if member is None or path in roles:
            continue
        spec = seqs[member]
        pre = [s for s in specs if s.mode == "fwd_pre" and s.mesh_axis == spec.mesh_axis]
        post = [s for s in specs if s.mode == "fwd_post" and s.mesh_axis == spec.mesh_axis]
        if (len(pre) == len(post) == 1 and isinstance(pre[0].layout, Replicate)
                and (pre[0].src is None or _on_tokens(pre[0].src, spec)) and _on_tokens(post[0].layout, spec)
                and (post[0].src is None or isinstance(post[0].src, Replicate))):
            found[path] = spec
    return {path: spec for path, spec in found.items() if not _inside_any(found, path, strictly=True)}


def _on_tokens(layout: Placement, spec: SeqSpec) -> bool:
    """Whether ``layout`` is the chain's sequence shard (``Shard(1)``, or ``Shard(-2)`` of a
    3-D activation)."""
    return isinstance(layout, Shard) and layout.dim in (spec.seq_axis, spec.seq_axis - ASSUMED_RANK)


def _whole_syncs(specs: tuple[SyncSpec, ...], spec: SeqSpec | None) -> tuple[SyncSpec, ...]:
    """The syncs of a module run whole (:func:`_whole_in_chains`) with their ``src`` filled
    in: the chain's shard at the input, whole at the output."""
    if spec is None:
        return specs
    fill = {"fwd_pre": Shard(spec.seq_axis), "fwd_post": Replicate()}
    return tuple(replace(s, src=fill[s.mode]) if s.src is None and s.mode in fill and s.mesh_axis == spec.mesh_axis
                 else s for s in specs)


def _inside_any(paths: Iterable[str], path: str, strictly: bool = False) -> bool:
    """Whether ``path`` is one of ``paths`` or inside one (``strictly``: inside only)."""
    return any((q == path and not strictly) or contains(q, path) for q in paths)


def _enters_chain_whole(path: str, role: Role | None, seqs: Mapping[str, SeqSpec], entries: Mapping[str, str]) -> bool:
    """Whether ``path`` is a row or vocab embedding over its chain's mesh axis and the
    chain's first member (``entries``, :func:`_chain_ends`): it takes its input whole and
    makes the chain's sequence shard itself (a reduce-scatter), where any other member
    takes that shard."""
    seq = seqs.get(path)
    if seq is None or role is None or not role.sums or role.mesh_axis != seq.mesh_axis:
        return False
    return entries.get(seq.mesh_axis) == path


def _chain_ends(sch: Schedule) -> dict[str, tuple[str, str]]:
    """Per mesh axis, the first and last members of its sequence-parallel chain in module
    order: the chain's entry shards the sequence at the first, its exit gathers the last
    one's output back to the whole sequence."""
    order = _run_order(sch)
    members: dict[str, list[str]] = {}
    for r, spec in sch.annotations.of_kind(SEQ).items():
        members.setdefault(spec.mesh_axis, []).append(r)
    return {axis: (min(rs, key=lambda r: order.get(r, 0)), max(rs, key=lambda r: order.get(r, 0)))
            for axis, rs in members.items()}


def _chain_entries(sch: Schedule) -> dict[str, str]:
    """Per mesh axis, the first member of its chain in module order (:func:`_chain_ends`)."""
    return {axis: first for axis, (first, _) in _chain_ends(sch).items()}


def _chain_exits(sch: Schedule) -> dict[str, str]:
    """Per mesh axis, the last member of its chain in module order (:func:`_chain_ends`)."""
    return {axis: last for axis, (_, last) in _chain_ends(sch).items()}


def _in_chain(sch: Schedule, path: str, axis: str) -> bool:
    """Whether ``path`` is in (or is) a sequence-parallel chain over ``axis``."""
    return any(s.mesh_axis == axis and (r == path or contains(r, path))
               for r, s in sch.annotations.of_kind(SEQ).items())


def _unsourced(sch: Schedule) -> list[Problem]:
    """A sync's stated ``src`` that nothing in the schedule could have made. Only the
    user's own code computes this rank's share of a value: modules installed by
    ``sf.replace``, ``tp_local`` ones, experts; with none of them, the model is the
    single-process one and a value is split or partial only where the schedule makes it
    so. ``Partial()`` then needs a sync stating a partial value, or this rank's features
    handed to a module's own code, which may sum them (:func:`_features_reach_code`;
    rows reduce their own outputs, and columns kept for their rows hand them to rows
    alone); this rank's features (``Shard(-1)``) the same (a module between a Megatron
    pair with a sync of its own breaks the pair: the column gathers); a token shard
    (``Shard(d)``, ``d`` not the last) a member of a sequence-parallel chain at, inside or
    within the module (the chain's exit gathers the shard back), or a sync to one. Otherwise every rank holds the
    whole activation, and the sync would sum the ranks' copies or gather them into a
    tensor ``world`` times too long: refused, naming the module. (A sharded module's
    ``fwd_post`` converts from its role's own output, and a sync from a layout to itself
    moves nothing; a ``torch.nn`` module stated partial is :func:`_partial_sources`'s.)"""
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    syncs: dict[str, tuple[SyncSpec, ...]] = sch.annotations.of_kind(SYNC)
    stated = [(q, s) for q, specs in syncs.items() for s in specs if s.mode != "bwd_post"]
    own_code = bool(sch.annotations.of_kind(LOCAL) or sch.annotations.of_kind(EXPERTS)
                    or sch.annotations.of_kind(INSTALLED))
    chains: dict[str, list[str]] = {}
    for r, spec in sch.annotations.of_kind(SEQ).items():
        chains.setdefault(spec.mesh_axis, []).append(r)
    exits = _chain_exits(sch)
    reach = _features_reach_code(sch)
    problems = []
    for path, specs in syncs.items():
        module = get_module(sch.module, path)
        for s in specs:
            src = s.src
            if src is None or src == s.layout:
                continue
            if s.mode == "bwd_post":
                # slapo_fn's own layouts hand back whole input gradients (a column's entry reduces them);
                # only the user's own code at or inside the module may hand back a partial one
                if isinstance(src, Partial) and not _own_code_at(sch, path) and not _input_reaches_column(
                        sch, path, s.mesh_axis):
                    problems.append(Problem(
                        path or "<root>",
                        f"has a bwd_post sync from Partial() over {s.mesh_axis!r}, but nothing in the schedule "
                        "makes its input gradient partial: every rank holds the whole gradient, so the sync would "
                        "sum the ranks' copies",
                        "drop the sync (or src=Partial()): a partial input gradient comes only from your own "
                        "tensor-parallel code (a module installed by sf.replace, or sf.tp_local)",
                    ))
                    break
                continue
            role = roles.get(path)
            if role is not None and (s.mode == "fwd_post" or (
                    role.splits_input and role.mesh_axis == s.mesh_axis and _last_dim(src))):
                continue  # the role's own output; a row's stated split input is _contradicted_sources's
            others = [o for q, o in stated if o is not s and o.mesh_axis == s.mesh_axis]
            if isinstance(src, Partial):
                if (s.mode == "fwd_post" and path and path not in sch.annotations.of_kind(LOCAL)
                        and type(module).__module__.startswith("torch.nn.modules")):
                    continue  # _partial_sources
                # a module handed this rank's features may sum them (a partial sum)
                possible = (own_code or reach(s)
                            or any(isinstance(o.layout, Partial) for o in others))
            elif _last_dim(src):
                possible = own_code or reach(s)
            elif isinstance(src, Shard):
                # a chain's sequence shard lives in its members; its exit gathers it back, so a module
                # holding the last member returns it whole
                last = exits.get(s.mesh_axis)
                holds_exit = last is not None and last != path and contains(path, last)
                possible = own_code or any(
                    isinstance(o.layout, Shard) and not _last_dim(o.layout) for o in others) or any(
                    r == path or contains(r, path) or (contains(path, r) and not holds_exit)
                    for r in chains.get(s.mesh_axis, ()))
            else:
                continue
            if not possible:
                problems.append(Problem(
                    path or "<root>",
                    f"has a {s.mode} sync from {_code(src)} over {s.mesh_axis!r}, but nothing in the schedule makes "
                    f"{_code(src)} there: every rank holds the whole activation, so the sync would "
                    + ("sum the ranks' copies" if isinstance(src, Partial) else "gather copies of it"),
                    "drop src= (the plan knows the layout: Replicate() here)",
                ))
                break
    return problems


def _own_code_at(sch: Schedule, path: str) -> bool:
    """Whether the user's own tensor-parallel code may run at or inside ``path``: a module
    installed by ``sf.replace``, a ``tp_local`` one, experts."""
    return any(q == path or contains(path, q) for key in (INSTALLED, LOCAL, EXPERTS)
               for q in sch.annotations.of_kind(key))


def _stacked_role_outputs(sch: Schedule) -> list[Problem]:
    """A sharded module with several ``fwd_post`` syncs: its output boundary converts its
    role's own output to the first's layout, and each later one converts on from there
    (:attr:`ModulePlan.posts`). The local-shard path plans one conversion per output, so
    the model runs on DTensor activations, which move through each in turn."""
    syncs: dict[str, tuple[SyncSpec, ...]] = sch.annotations.of_kind(SYNC)
    return [Problem(path, f"is {role.name}-parallel with {n} fwd_post syncs, converted one after another",
                    f"keep one fwd_post sync on {path!r}, to the layout its output should have, for the "
                    "local-shard path")
            for path, role in sch.annotations.of_kind(ROLE).items() if not role.own_forward
            and (n := sum(s.mode == "fwd_post" for s in syncs.get(path, ()))) > 1]


def _role_output_syncs(sch: Schedule) -> list[Problem]:
    """A sharded module's output boundary converts from its role's own output (a column's
    or a feature-split embedding's ``Shard(-1)``, a row's or vocabulary embedding's
    ``Partial()``): a first ``fwd_post`` sync whose ``src=`` names another layout states
    what is not so. Refused, naming the module."""
    problems = []
    syncs: dict[str, tuple[SyncSpec, ...]] = sch.annotations.of_kind(SYNC)
    for path, role in sch.annotations.of_kind(ROLE).items():
        if role.own_forward:
            continue
        posts = [s for s in syncs.get(path, ()) if s.mode == "fwd_post"]
        own: Placement = Shard(-1) if role.splits_output else Partial()
        if posts and posts[0].src is not None and posts[0].src != own:
            problems.append(Problem(
                path, f"is {role.name}-parallel, so its output is {_code(own)}, but its fwd_post sync states "
                f"src={_code(posts[0].src)}",
                f"drop src= (or state src={_code(own)})",
            ))
    return problems


def _code(p: Placement) -> str:
    """A placement as it is written: ``Shard(-1)``, ``Replicate()``, ``Partial()``."""
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    return "Partial()" if isinstance(p, Partial) else "Replicate()"


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
            inner = [q for q in self.annotated if q == path or contains(path, q)]
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


def _contradicted_sources(sch: Schedule, partners: Mapping[str, tuple[str, ...]]) -> list[Problem]:
    """A sync's stated ``src`` that contradicts what the plan knows is there: for a
    ``fwd_pre`` sync, the features that reach the module (:class:`_Features`; a paired
    row's columns' where fx cannot trace the parent); for a ``fwd_post`` sync, the
    layout an earlier sync on the same output moved it to, the one a sync states on the
    child that alone makes the output (``_stated_output``), else the features the
    module makes by the data flow. The runtime converts from what is stated, so the
    activation would be split twice or gathered wrongly (a root sync from Replicate()
    over a child's Shard(-1): (2, 4, 4) for (2, 4, 8)). Refused, naming the module."""
    problems = []
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    features: dict[str, _Features] = {}

    def know(axis: str) -> _Features:
        if axis not in features:
            features[axis] = _Features(sch, axis, partners)
        return features[axis]

    seqs: dict[str, SeqSpec] = sch.annotations.of_kind(SEQ)
    entries = _chain_entries(sch)

    def member(path: str, axis: str) -> SeqSpec | None:
        spec = seqs.get(path)
        return spec if spec is not None and spec.mesh_axis == axis else None

    for path, specs in sch.annotations.of_kind(SYNC).items():
        role = roles.get(path)
        pre = next((s for s in specs if s.mode == "fwd_pre" and s.src != s.layout), None)
        chained = member(path, pre.mesh_axis) if pre is not None else None
        if pre is not None and pre.src is not None and chained is not None:
            # a chain member takes its input as the chain's sequence shard (after the chain's entry)
            whole = _enters_chain_whole(path, role, seqs, entries)
            have_seq: Placement = Replicate() if whole else Shard(chained.seq_axis)
            if pre.src != have_seq:
                problems.append(Problem(
                    path,
                    f"has a fwd_pre sync from {_code(pre.src)}, but as a member of the sequence_parallel chain "
                    f"over {pre.mesh_axis!r} it takes its input {_code(have_seq)}",
                    f"drop src= (the plan knows the layout) or state src={_code(have_seq)}",
                ))
        elif pre is not None and pre.src is not None:
            inside_chain = _in_chain(sch, path, pre.mesh_axis)
            have: Placement | None = None if inside_chain else know(pre.mesh_axis).arriving(path)
            cols = partners.get(path, ()) if role is not None and role.splits_input else ()
            if have is None and cols:  # a pair in a chain member, or paired by module order (fx cannot trace)
                have = Replicate() if _partner_gathered(sch, cols, pre.mesh_axis) else Shard(-1)
            own = know(pre.mesh_axis).own  # the user's own code: installed, tp_local, experts
            if (have is None and inside_chain and isinstance(pre.src, Partial)
                    and not any(q == path or contains(q, path) or contains(path, q) or _parent(q) == _parent(path)
                                for q in own)):
                # in a chain activations are sequence shards or what columns gather; rows reduce-scatter
                # their partial sums themselves, and no user code here makes one
                problems.append(Problem(
                    path,
                    f"has a fwd_pre sync from Partial() inside a sequence_parallel chain over {pre.mesh_axis!r}, "
                    "where nothing hands it a partial sum (rows reduce-scatter theirs)",
                    "drop src= (the plan knows the layout)",
                ))
            if have is not None and pre.src != have:
                named = ", ".join(map(repr, cols))
                why = f"its columns {named} keep their outputs split, so" if cols and _last_dim(have) else (
                    "by the data flow")
                problems.append(Problem(
                    path,
                    f"has a fwd_pre sync from {_code(pre.src)}, but {why} its input arrives {_code(have)}",
                    f"drop src= (the plan knows the layout) or state src={_code(have)}",
                ))
        moved: dict[str, Placement] = {}  # stacked fwd_pre syncs: each converts from what the one before made
        for s in specs:
            if s.mode != "fwd_pre" or s.src == s.layout:
                continue  # one stating a layout to itself is not believed (it moves nothing)
            before = moved.get(s.mesh_axis)
            if before is not None and s.src is not None and s.src != before:
                problems.append(Problem(
                    path or "<root>",
                    f"has a fwd_pre sync from {_code(s.src)}, but the fwd_pre sync before it moves its input to "
                    f"{_code(before)}",
                    f"drop src= (the plan knows the layout) or state src={_code(before)}",
                ))
            moved[s.mesh_axis] = s.layout
        known: dict[str, tuple[Placement, str]] = {}
        for s in specs:
            if s.mode != "fwd_post":
                continue
            if s.mesh_axis not in known:
                inner = _stated_output(sch, path, s.mesh_axis) if path or sch.module._modules else None
                if inner is not None:
                    known[s.mesh_axis] = (inner, "a sync inside it")
                elif role is None and (spec := member(path, s.mesh_axis)) is not None:
                    gathered = isinstance(moved.get(s.mesh_axis), Replicate)  # its own fwd_pre sync made it whole
                    known[s.mesh_axis] = ((Replicate(), "its fwd_pre sync, which gathers its input,") if gathered
                                          else (Shard(spec.seq_axis), "the sequence_parallel chain it is a member of"))
                elif role is None and not _in_chain(sch, path, s.mesh_axis):
                    made = know(s.mesh_axis).made(path, own_syncs=False)
                    if made is not None:
                        known[s.mesh_axis] = (made, "by the data flow, what reaches it")
            # on a chain's last member a sync takes the place of the exit's gather, so one stating a
            # layout to itself is believed there (it keeps the sequence shard)
            moves = s.src != s.layout or know(s.mesh_axis).exit == path
            if s.src is not None and moves and s.mesh_axis in known and known[s.mesh_axis][0] != s.src:
                have, where = known[s.mesh_axis]
                problems.append(Problem(
                    path or "<root>",
                    f"has a fwd_post sync from {_code(s.src)}, but {where} leaves its output {_code(have)}",
                    f"drop src= (the plan knows the layout) or state src={_code(have)}",
                ))
                break
            if s.src is None or s.src != s.layout:
                known[s.mesh_axis] = (s.layout, "an earlier sync on it")
    return problems


def refusals(sch: Schedule, p: Plan) -> list[Problem]:
    """The statements of ``sch`` its layouts contradict (a ``src=`` nothing makes, a sync on
    a module never called, a chain told its input arrives split that a module hands whole),
    as problems naming the module and the fix: ``build`` raises them at once."""
    with _flows_memo():
        return _contradictions(sch, p)


def unproven(sch: Schedule, p: Plan) -> list[Problem]:
    """Where the plan cannot prove that code runs right on local shards (a split by a full
    size, a tie sharded on one side, a column in a chain that no row reads): the build then
    runs the model on DTensor activations (:mod:`.region`), and PyTorch's sharding
    propagation computes it (:attr:`Plan.on_dtensors`)."""
    return list(p.on_dtensors)


def _contradictions(sch: Schedule, p: Plan) -> list[Problem]:
    return (_unsplit_chain_inputs(sch) + _partial_sources(sch) + _sources(sch) + _role_output_syncs(sch)
            + _bypassed(sch, p) + _whole_tp_locals(sch))


def _whole_tp_locals(sch: Schedule) -> list[Problem]:
    """``tp_local`` states that a module runs on this rank's shard, so its replicated
    parameters' gradients are partial sums, reduced over the mesh axis. Where the data flow
    shows the whole activation reaching it (a norm before the columns, the model's final
    norm), each rank's gradient is already the whole one, and the reduction would multiply
    it by the axis size: refused, naming the module."""
    problems = []
    partners = _partners(sch)
    known: dict[str, _Features] = {}
    for path, spec in sch.annotations.of_kind(LOCAL).items():
        found = _caller(sch, path)
        if found is None:
            continue
        f = known.setdefault(spec.mesh_axis, _Features(sch, spec.mesh_axis, partners))
        parent, name, fl = found
        if isinstance(f._combine(parent, fl.feeders(name, f._through(parent))), Replicate):
            problems.append(Problem(
                path,
                f"is declared tp_local (to run on this rank's shard over {spec.mesh_axis!r}), but by the data flow "
                "the whole activation reaches it: every rank's gradient of its parameters is already the whole "
                "one, and reducing it over the ranks would multiply it",
                f"drop tp_local for {path!r} (it is for modules after a column kept split, such as per-head norms)",
            ))
    return problems


def _unproven(sch: Schedule, p: Plan) -> list[Problem]:
    return (_half_sharded_ties(sch) + _unsharded_twins(sch, p) + _stray_token_shards(sch)
            + _ungathered_chain_members(sch) + _chain_gaps(sch) + _packed_outputs_read_whole(sch, p)
            + _untraced_pairs(sch, p) + _chains_inside_pairs(sch, p) + _attention_on_sequence_shards(sch)
            + _code_over_the_sequence(sch)
            + _lone_columns_in_chains(sch, p) + _split_input_into_reducers(sch, p) + _functional_reads(sch, p)
            + _feature_syncs(sch, p) + _half_gathered_pairs(sch, p) + _gathers_inside_chains(sch, p)
            + _packing_against_flow(sch, p) + _heads_against_flow(sch, p) + _features_mixed(sch, p)
            + _unseen_tp_locals(sch) + _stacked_role_outputs(sch))


def _unseen_tp_locals(sch: Schedule) -> list[Problem]:
    """``tp_local`` on a module whose caller's code fx cannot trace (BERT's embeddings
    LayerNorm, inside ``BertEmbeddings``): the data flow cannot show that only this rank's
    shard reaches it, and where the whole activation does, summing its gradients over the
    ranks would multiply them. On DTensor activations the gradients are what the data
    flow makes them, whatever the statement."""
    return [Problem(path, "is declared tp_local, but its caller's code cannot be traced, so what reaches it is "
                          "unknown", f"trace its caller, or drop tp_local for {path!r} where the whole activation "
                                   "reaches it")
            for path in sch.annotations.of_kind(LOCAL) if _caller(sch, path) is None]


def _bypassed(sch: Schedule, p: Plan) -> list[Problem]:
    """A planned module whose parent never calls it, calling a module inside it directly
    instead (``OPTForCausalLM`` calls ``self.model.decoder``, never ``self.model``): what
    the plan installs on its forward (a sync, a chain's entry, its parameters' local
    values) would never run. Read from the parent's traced data flow; refused, naming the
    module called in its place."""
    problems = []
    for path, mp in p.modules.items():
        if not path:
            continue
        fl = _flow_of(sch, _parent(path))
        name = split(path)[-1]
        if fl is None or fl.called(name):
            continue
        inside = sorted(q for q in fl.feeds if q.startswith(name + "."))
        if not inside:
            continue
        what = ("its syncs" if mp.syncs else "its sequence_parallel boundary" if mp.entry or mp.exit
                else "its layout")
        parent = _parent(path)
        callee, where = join(parent, inside[0]), _named(parent)
        problems.append(Problem(
            path,
            f"is never called: {where}'s forward calls {callee!r} inside it directly, so {what} would never run",
            f"put it on {callee!r} (the module that is called), or on {where}",
        ))
    return problems


def _sources(sch: Schedule) -> list[Problem]:
    """Stated ``src``s the data flow contradicts, then those nothing makes (one problem per module)."""
    partners = _partners(sch)
    contradicted = _contradicted_sources(sch, partners)
    named = {p.path for p in contradicted}
    return contradicted + [p for p in _unsourced(sch) if p.path not in named]


def _features_reach_code(sch: Schedule) -> Callable[[SyncSpec], bool]:
    """For a sync ``besides``, whether this rank's features
    (``Shard(-1)``) over its mesh axis may reach a module's own code by anything but
    ``besides`` itself, which could sum them into a partial value or hand them on: a sync
    splitting them for a module without a role (Slapo's ``fwd_pre`` ``Shard(-1)`` in front
    of a hand-written sum) or a sharded module whose ``fwd_post`` sync keeps its output
    split. A column paired by the data flow hands its split to its rows alone (one paired
    by module order alone is :func:`_untraced_pairs`'s), a lone one or a feature-split
    embedding gathers its output, and a row or vocabulary embedding reduces its own: no
    partial value leaves them (OPT's decoder, which fx cannot trace, holds only such
    layers). A sync from a layout to itself splits nothing, nor does one splitting the
    model's result (a ``fwd_post`` on the root). The syncs are gathered once per mesh axis,
    so each check is a lookup."""
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    splitting: dict[str, list[SyncSpec]] = {}  # mesh axis -> the syncs handing split features to code
    for q, specs in sch.annotations.of_kind(SYNC).items():
        role = roles.get(q)
        for o in specs:
            if o.mode == "bwd_post" or not _last_dim(o.layout) or o.src == o.layout:
                continue  # a sync from a layout to itself moves nothing
            if o.mode == "fwd_post" and (not q or _model_output(sch, q)):
                continue  # a split of the model's result reaches no module's code
            own = role is not None and role.mesh_axis == o.mesh_axis and not role.own_forward
            if not own or o.mode == "fwd_post":  # a role's output kept split leaves it
                splitting.setdefault(o.mesh_axis, []).append(o)
    return lambda besides: any(o is not besides for o in splitting.get(besides.mesh_axis, ()))
