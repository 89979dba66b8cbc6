"""Boundary contracts: which layout each sharded module needs and produces, and the
collectives that reconcile neighbours — as a plan (for ``explain`` and ``strict``) and
as forwards installed on build's private copy.

Contracts, per role (over the role's mesh axis):

=========== ============================= =====================================
role        input                         output
=========== ============================= =====================================
column      Replicate (enter: all-reduce  Shard(d): kept local when a row-
            of the input gradient, once   parallel sibling follows (Megatron
            per distinct input tensor)    pair), else all-gathered
row         Shard(d) (split locally if    Partial → all-reduce (bias added once)
            it arrives replicated)
vocab       Replicate ids                 Partial → all-reduce
embed_dim   Replicate ids                 Shard(-1) → all-gathered
channels    Shard(d), between a column    Shard(d): each channel from its own
            and its row
param       any                           the module runs on gathered parameters
=========== ============================= =====================================

``d`` is the role's feature dimension (:attr:`.roles.Role.dim`): ``-1`` for a linear
layer, ``1`` for the channels of a convolution or a norm over them (``N, C, ...``).

Inside a :func:`~slapo_fn.sequence_parallel` chain the residual stream is
``Shard(seq)``: column inputs are all-gathered (reduce-scatter backward), row and vocab
outputs reduce-scattered. Activations are plain local tensors throughout.

This module builds the plan (:func:`plan`): each module's contract and the boundaries
with their collectives (the gradients' included). One reason to change: a role's contract or
what a boundary costs. What it builds on, lowest first (each imports only those before
it; ``pyproject.toml`` states the order): the values (:mod:`.planned`), the lookups over
the traced model (:mod:`.lookups`), chains (:mod:`.chains`), the layouts stated and
carried (:mod:`.arriving`), Megatron pairs (:mod:`.pairs`) and heads (:mod:`.heads`), the
checks of chains and of statements (:mod:`.chain_checks`, :mod:`.statements`) and the
verdicts (:mod:`.checks`).

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

import functools
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..rewrites._common import within
from ..schedule import Schedule
from ..tree import caller_path, get_module, join, walk
from .arriving import (
    _arrives_feature_split,
    _arriving,
    _features_by_axis,
    _input_reaches_column,
    _moving,
    _output_before_syncs,
    _partner_gathered,
    _split_outputs,
)
from .chains import (
    _chain_entries,
    _enters_chain_whole,
    _gathering_parents,
    _in_chain,
    _inside_any,
    _merged_tokens,
    _shared_gathers,
    _whole_in_chains,
    _whole_syncs,
)
from .checks import _unproven
from .experts import EXPERTS, Experts
from .flow import INPUT, OUTPUT, SIDE, pointwise
from .layout import Layout, shard_axes
from .local import LOCAL
from .lookups import _caller, _flows_memo, _origin, _read_by, _run_order, _through
from .pairs import _elided_gathers, _gathered_through_elementwise, _partners
from .planned import Boundary, ModulePlan, Plan, _d
from .rng import RNG, RngSpec
from .roles import Role, left_apart
from .sequence import SEQ, SeqSpec
from .shard import LAYOUT, ROLE, mesh_dims
from .sync import SYNC, SyncSpec, collective_of

__all__ = ["param_dims", "plan"]


def plan(sch: Schedule) -> Plan:
    """The boundary plan of ``sch``: per-module contracts and the boundaries with their
    collectives (what ``explain`` prints and ``build(strict=True)`` checks)."""
    with _flows_memo():
        return _plan(sch)


def _without_gathers(sch: Schedule, paths: frozenset[str]) -> Schedule:
    """``sch`` without the ``fwd_post`` syncs of ``paths``."""
    notes = sch.annotations
    for path in paths:
        kept = tuple(s for s in notes.get(path, SYNC, ()) if s.mode != "fwd_post")
        notes = notes.set(path, SYNC, kept) if kept else notes.unset(path, SYNC)
    return sch.evolve(annotations=notes) if paths else sch


def _plan(sch: Schedule) -> Plan:
    partners = _partners(sch)
    # a gather stated where only rows read the value, to split it again, is left out: what is
    # planned and checked after this is the schedule without it
    sch = _without_gathers(sch, _elided_gathers(sch, partners))
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
            if within(root, path):
                spec, role = seqs[root], roles.get(path)
                if path in merged and role is not None and role.mesh_axis == spec.mesh_axis:
                    # handed the batch and the tokens merged: gathered and scattered along that dimension
                    return replace(spec, seq_axis=merged[path])
                return spec
        return None

    modules: dict[str, ModulePlan] = {}
    bounds: list[Boundary] = []
    fused: set[str] = set()  # the entry groups a leader has entered
    know = _features_by_axis(sch, partners)  # what the data flow brings, per mesh axis
    exit_columns = _exit_columns(sch, seq_roots)
    entered_at = {q: path for path, columns in exit_columns.items() for q in columns}

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
                                     functools.partial(_output_before_syncs, sch, know, path), partnered,
                                     functools.partial(_arriving, sch, know, path),
                                     role is None and pointwise(get_module(sch.module, path)))
        out_sync = next((s for s in spec_syncs if s.mode == "fwd_post"), None)
        group = ""
        split_input = pads = False
        entered = False
        if role is not None:
            ax = role.mesh_axis
            if role.enters:
                in_seq = seq is not None and seq.mesh_axis == ax
                pre = _moving(spec_syncs, "fwd_pre")
                # (a chain's exit entering for it, its caller need not)
                entered = seq is None and pre is None and path not in entered_at and _entered_by_caller(sch, path, ax)
                # a column that a sync hands a converted tensor enters the region with it alone; one
                # whose caller enters for it shares that caller's entry (with its siblings) alone
                group = f"{ax} " + (f"own {path}" if pre is not None else f"by {caller!r}" if entered
                                    else _entry_key(sch, path))
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
                elif path in entered_at:
                    pass  # the chain's exit gathers the sequence for it (reduce-scatter backward)
                else:
                    bounds.append(Boundary(path, "input", "R", "R", ax, (), ("all_reduce",) if leader else ()))
                if not isinstance(get_module(sch.module, path), nn.Embedding) and _arrives_feature_split(
                        sch, path, ax, pre, know):
                    # split by a sync on it or before it: the column gathers its input back
                    bounds.append(Boundary(path, "input", f"S({role.dim})", "R", ax, ("all_gather",), (), False))
                out = f"S({role.dim})" if role.packed == 1 else f"S({role.dim})×{role.packed}"
                if out_sync is not None:
                    fwd, bwd = collective_of(Shard(role.dim), out_sync.layout)
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
                    bounds.append(Boundary(path, "input", "R", f"S({role.dim})", ax, (), ("all_gather",), True))
                elif (pre is None and (not partnered or _partner_gathered(sch, partners[path], ax))
                      and not _arrives_feature_split(sch, path, ax, None, know, stated)):
                    # replicated input (or its columns' outputs gathered by syncs): split locally. A
                    # sync from Replicate() to itself states it; as one from a layout to itself, it
                    # is not believed over the data flow (a column's kept split reaching it)
                    told = isinstance(stated, SyncSpec) and isinstance(stated.layout, Replicate)
                    pads = partnered and _gathered_through_elementwise(sch, path, partners[path], ax)
                    # rows handed one whole value split it once: their gradients summed, one gather
                    group = f"{ax} split " + ("padded " if pads else "") + _entry_key(sch, path)
                    leader = group not in fused
                    fused.add(group)
                    bounds.append(Boundary(path, "input", "R", f"S({role.dim})", ax, (),
                                           () if pads or not leader else ("all_gather",), told))
                else:
                    split_input = True
                # a fwd_pre sync to Shard(-1) is the input boundary itself (added with the syncs below)
                bounds.append(_reduce_boundary(path, ax, seq, out_sync))
            elif (role.reads_ids and role.sums):
                bounds.append(_reduce_boundary(path, ax, seq, out_sync))
            elif role.keeps:
                pass  # this rank's channels in and out: no boundary of its own (checks.py: fed split)
            elif (role.reads_ids and role.splits_output):
                if out_sync is not None:
                    fwd, bwd = collective_of(Shard(-1), out_sync.layout)
                    bounds.append(Boundary(path, "output", "S(-1)", _d(out_sync.layout), ax, fwd, bwd, True, "output"))
                elif not partnered:  # paired with a row like a column: its features stay split for it
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
                # read by columns alone, the gather is their entry: their partial input gradients,
                # summed by autograd, are reduce-scattered back (as where a chain gathers into them)
                bwd = ("reduce_scatter",) if path in exit_columns else ()
                bounds.append(
                    Boundary(
                        path, "output", f"S({spec.seq_axis})", "R", spec.mesh_axis, ("all_gather",), bwd, True, "output"
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
        ) or (role is not None and not role.own_forward and bool(_reduced_params(sch, ModulePlan(path, role))))
        modules[path] = ModulePlan(path, role, seq, partnered, entry, exit_, spec_syncs, rngs.get(path), local,
                                   partners=partners.get(path, ()), entry_group=group,
                                   split_input=role is not None and role.splits_input and split_input,
                                   pads_split=role is not None and role.splits_input and pads,
                                   shared_gather=shares, side_input=on_side, entered=entered,
                                   exit_columns=exit_columns.get(path, ()) if exit_ is not None else (),
                                   entered_at=entered_at.get(path, ""))
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
    syncs, sequence-parallel chains and ``tp_local`` modules use (usually just ``"tp"``); they are
    replicated implicitly over the others, as FSDP2's 2-D composition expects (it
    concatenates its dp mesh with the parameters' mesh). All the mesh's axes where none is used."""
    assert sch.mesh is not None
    used = {n for lay in sch.annotations.of_kind(LAYOUT).values() for n in shard_axes(lay)}
    used |= {r.mesh_axis for r in sch.annotations.of_kind(ROLE).values()}
    used |= {q.mesh_axis for q in sch.annotations.of_kind(SEQ).values()}
    used |= {q.mesh_axis for q in sch.annotations.of_kind(LOCAL).values()}
    used |= {s.mesh_axis for specs in sch.annotations.of_kind(SYNC).values() for s in specs}
    dims = mesh_dims(sch.mesh)
    return tuple(d for d in dims if d in used) or dims


def _restated(sch: Schedule, path: str, specs: tuple[SyncSpec, ...]) -> tuple[SyncSpec, ...]:
    """``specs`` with each ``bwd_post`` sync from ``Partial()`` that restates what a column's
    entry already does made a sync from ``Replicate()`` (which moves nothing): Slapo's
    schedules write an all-reduce of the input gradient on every column (or the module
    holding them), which slapo_fn's columns issue themselves; summed again, the gradient
    would be the axis size times too large."""
    return tuple(replace(s, src=Replicate()) if s.mode == "bwd_post" and isinstance(s.src, Partial)
                 and _input_reaches_column(sch, path, s.mesh_axis) else s for s in specs)


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
    it, else the features the data flow makes there (``inner(axis)``,
    :func:`.arriving._output_before_syncs`), for an input the features the data flow
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


def _entered_by_caller(sch: Schedule, path: str, axis: str) -> bool:
    """Whether the column ``path``'s caller can enter the region for it: it is called on the
    caller's first argument, which reaches nothing in the caller's code but columns over
    ``axis`` that no ``fwd_pre`` sync converts and no chain gathers (:attr:`.planned.ModulePlan.entered`)."""
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
        if (name == OUTPUT or role is None or not role.enters or role.mesh_axis != axis or _in_chain(sch, q, axis)
                or any(s.mode == "fwd_pre" for s in syncs.get(q, ()))):
            return False
    return True


def _exit_columns(sch: Schedule, seq_roots: list[str]) -> dict[str, tuple[str, ...]]:
    """For each sequence-parallel chain whose last member (its exit, in run order) has an
    output read by nothing but columns over the chain's axis (by the data flow, up the
    tree: an LM head after the final norm), those columns: the exit's all-gather is their
    entry into the region, as where a chain's parent gathers for its columns, and autograd
    sums their partial input gradients before one reduce-scatter (Megatron's
    sequence-parallel entry; the all-reduce of each column's and the slice the exit's own
    gather takes back would cost more). Columns that a sync converts, or that sit in a
    chain themselves, enter as they would anyway, and keep the exit as it is."""
    seqs: dict[str, SeqSpec] = sch.annotations.of_kind(SEQ)
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    syncs: dict[str, tuple[SyncSpec, ...]] = sch.annotations.of_kind(SYNC)
    out: dict[str, tuple[str, ...]] = {}
    for axis in dict.fromkeys(seqs[r].mesh_axis for r in seq_roots):
        last = [r for r in seq_roots if seqs[r].mesh_axis == axis][-1]
        own = roles.get(last)
        if syncs.get(last) or (own is not None and own.mesh_axis == axis):
            continue
        readers = _read_by(sch, last)
        if not readers or not all((r := roles.get(q)) is not None and r.enters and r.splits_output
                                  and r.mesh_axis == axis and not syncs.get(q) and not _in_chain(sch, q, axis)
                                  for q in readers):
            continue
        out[last] = tuple(sorted(readers))
    return out


def _entry_key(sch: Schedule, path: str) -> str:
    """Columns with equal keys read one input tensor and enter the tensor-parallel region
    once (one backward all-reduce for all, of their partial input gradients summed by
    autograd, as Megatron's "f" at the tensor's fan-out): the value they are called on,
    where the data flow is known, followed out through the modules that hand it on
    unchanged (:func:`.lookups._origin`): q/k/v on one attention's hidden states, and the
    cross-attention k/v of every decoder layer on the encoder's output. Else the column's
    own (fx cannot trace the parent, so which columns read one tensor is unknown; equal
    input widths are no proof: an attention's ``v`` and ``o``). The runtime shares an entry
    only within one key (:attr:`.planned.ModulePlan.entry_group`), so it makes what the plan
    counts."""
    origin = _origin(sch, path)
    return f"own {path}" if origin is None else f"value {origin[1]} of {origin[0]!r}"


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
    (:attr:`.planned.Plan.grads_after_backward`)."""
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
    """A module's own replicated parameters (no layout, or a replicated one) but a bias its
    role adds after the sum: a sharded layer's are those its local forward reads whole
    (a LoRA's ``A`` in a column), whose local gradients are partial sums."""
    layouts = sch.annotations.of_kind(LAYOUT)
    module = get_module(sch.module, mp.path)
    apart = left_apart(module, mp.role)
    return {n: p for n, p in module._parameters.items()
            if p is not None and not any(p is q for q in apart)
            and not (join(mp.path, n) in layouts and not layouts[join(mp.path, n)].is_replicated)}


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


def _reduce_boundary(path: str, ax: str, seq: SeqSpec | None, out_sync: SyncSpec | None) -> Boundary:
    if out_sync is not None:
        fwd, bwd = collective_of(Partial(), out_sync.layout)
        return Boundary(path, "output", "P", _d(out_sync.layout), ax, fwd, bwd, True, "output")
    if seq is not None and seq.mesh_axis == ax:
        return Boundary(
            path, "output", "P", f"S({seq.seq_axis})", ax, ("reduce_scatter",), ("all_gather",), True, "output"
        )
    return Boundary(path, "output", "P", "R", ax, ("all_reduce",), (), True, "output")
