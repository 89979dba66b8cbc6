"""The checks the plan runs and their two verdicts: :func:`refusals`, the statements the
layouts contradict (``build`` raises them), and :func:`unproven`, what the plan cannot
prove right on local shards (the build runs it on DTensor activations); with
:func:`implicit` (the boundaries ``build(strict=True)`` refuses) and the checks of the
module tree itself (a tie sharded on one side, a child's parameters read by its parent,
a planned module never called).

One reason to change: which checks run, and for which verdict. The rules themselves are
in :mod:`.pairs`, :mod:`.heads`, :mod:`.chain_checks` and :mod:`.statements`.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate

from ..errors import Problem
from ..rewrites._common import contains
from ..schedule import Schedule
from ..tree import get_module, join, split, uncalled, walk
from .chain_checks import (
    _attention_on_sequence_shards,
    _chain_gaps,
    _chains_inside_pairs,
    _code_over_the_sequence,
    _gathers_inside_chains,
    _lone_columns_in_chains,
    _split_input_into_reducers,
    _stray_token_shards,
    _ungathered_chain_members,
    _unsplit_chain_inputs,
)
from .heads import _features_mixed, _heads_against_flow, _packed_outputs_read_whole, _packing_against_flow
from .lookups import _flow_of, _flows_memo, _parent
from .pairs import _channels_off_pairs, _half_gathered_pairs, _unsharded_twins, _untraced_pairs
from .planned import Boundary, Plan, _named
from .shard import LAYOUT, ROLE, tied_paths
from .statements import (
    _feature_syncs,
    _partial_sources,
    _role_output_syncs,
    _sources,
    _stacked_role_outputs,
    _unseen_tp_locals,
    _whole_tp_locals,
)

__all__ = ["implicit", "refusals", "unproven"]


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
        problems += _operands_off_features(sch, p, parent, fl.operands if fl is not None else {})
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


def _operands_off_features(sch: Schedule, p: Plan, parent: str, operands: Mapping[str, frozenset[str]]
                           ) -> list[Problem]:
    """The operands of a child's output (:attr:`.flow.Flow.operands`: the bias ``decompose``
    adds after a Linear's matmul) whose layout is not that output's: the parent combines
    this rank's share of each with the child's local output, so an output kept as this
    rank's features (a column paired with its rows) needs the operand split alike along
    its one dimension (packed alike: a fused [Q|K|V]'s bias holds this rank's share of
    each chunk, as its output does), and a whole output a whole operand."""
    layouts = sch.annotations.of_kind(LAYOUT)
    problems = []
    for child, names in sorted(operands.items()):
        path = join(parent, child)
        mp = p.modules.get(path)
        axis = mp.role.mesh_axis if mp is not None and mp.keeps_features and mp.role is not None else None
        packed = mp.role.packed if mp is not None and mp.role is not None else 1
        # a sharded layer's own whole parameters (a LoRA column's A) leave its split operands alone
        if mp is not None and (mp.seq is not None or (mp.local_params and mp.role is None)):
            problems.append(Problem(
                parent or "<root>",
                f"adds parameters of {path!r} to its output itself, on sequence shards or a tp_local module's "
                "activations, where their gradients would be partial sums no one reduces",
                f"leave {path!r} out of sequence_parallel chains and tp_local, or do not decompose it",
            ))
            continue
        for name in sorted(names):
            layout, value = layouts.get(join(path, name)), get_module(sch.module, path)._parameters.get(name)
            whole = layout is None or layout.is_replicated
            split = (layout is not None and value is not None and value.dim() == 1
                     and layout.axes_of(0, 1) == ((axis, packed),)
                     and all(isinstance(q, Replicate) for d, q in zip(layout.mesh_dims, layout.placements,
                                                                      strict=True) if d != axis))
            if (whole and axis is None) or (axis is not None and split):
                continue
            problems.append(Problem(
                parent or "<root>",
                f"adds {join(path, name)!r} to the output of {path!r} itself, and that output is "
                + (f"this rank's features over {axis!r} while the operand is laid out {layout}" if axis is not None
                   else f"whole while the operand is split ({layout})"),
                f"shard {path!r} as a whole (sf.shard(sch, {path!r}, axis=0)) with its row, or leave it unsharded",
            ))
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
    propagation computes it (:attr:`.planned.Plan.on_dtensors`)."""
    return list(p.on_dtensors)


def _contradictions(sch: Schedule, p: Plan) -> list[Problem]:
    return (_unsplit_chain_inputs(sch) + _partial_sources(sch) + _sources(sch) + _role_output_syncs(sch)
            + _bypassed(sch, p) + _whole_tp_locals(sch) + _channels_off_pairs(sch, p))


def _unproven(sch: Schedule, p: Plan) -> list[Problem]:
    return (_half_sharded_ties(sch) + _unsharded_twins(sch, p) + _stray_token_shards(sch)
            + _ungathered_chain_members(sch) + _chain_gaps(sch) + _packed_outputs_read_whole(sch, p)
            + _untraced_pairs(sch, p) + _chains_inside_pairs(sch, p) + _attention_on_sequence_shards(sch)
            + _code_over_the_sequence(sch)
            + _lone_columns_in_chains(sch, p) + _split_input_into_reducers(sch, p) + _functional_reads(sch, p)
            + _feature_syncs(sch, p) + _half_gathered_pairs(sch, p) + _gathers_inside_chains(sch, p)
            + _packing_against_flow(sch, p) + _heads_against_flow(sch, p) + _features_mixed(sch, p)
            + _unseen_tp_locals(sch) + _stacked_role_outputs(sch))


def _bypassed(sch: Schedule, p: Plan) -> list[Problem]:
    """A planned module the model's forward never calls: what the plan installs on its
    forward (a sync, a chain's entry, a ``tp_local`` or RNG statement, its parameters'
    local values) would never run. Two cases, read from the traced data flow: its parent
    calls a module inside it directly instead (``OPTForCausalLM`` calls
    ``self.model.decoder``, never ``self.model``), refused naming that module; or no
    traced forward calls it at all (T5's ``shared`` embedding, which the model reaches
    through ``encoder.embed_tokens`` and ``decoder.embed_tokens``, its parameters tied),
    refused where a statement acts at its call, naming the called modules that hold its
    parameters. Where a forward on the way cannot be traced, nothing is refused."""
    problems = []
    for path, mp in p.modules.items():
        if not path:
            continue
        # what acts where the module is called (a layout alone acts through its parameters)
        at_call = bool(mp.syncs or mp.entry or mp.exit or mp.local_axis or mp.rng)
        what = ("its syncs" if mp.syncs else "its sequence_parallel boundary" if mp.entry or mp.exit
                else "its tp_local statement" if mp.local_axis else "its RNG statement" if mp.rng
                else "its layout")
        fl = _flow_of(sch, _parent(path))
        name = split(path)[-1]
        inside = sorted(q for q in fl.feeds if q.startswith(name + ".")) if fl is not None and not fl.called(name) \
            else []
        if inside:
            parent = _parent(path)
            callee, where = join(parent, inside[0]), _named(parent)
            problems.append(Problem(
                path,
                f"is never called: {where}'s forward calls {callee!r} inside it directly, so {what} would never run",
                f"put it on {callee!r} (the module that is called), or on {where}",
            ))
        elif at_call and _runs(sch, path) is False:
            problems.append(_never_runs(sch, path, what))
    return problems


def _runs(sch: Schedule, path: str) -> bool | None:
    """Whether the module at ``path`` runs in the model's forward: ``True`` where a traced
    forward that runs calls it (its parent's, or an ancestor's past containers and past
    modules that never run: OPT's root calls ``model.decoder``, never ``model``), ``False``
    where none does though every forward above it is traced, ``None`` (unknown) where one
    cannot be traced."""
    if not path:
        return True
    parts = split(path)
    unknown = False
    for depth in range(len(parts) - 1, -1, -1):
        here, name = join(*parts[:depth]), join(*parts[depth:])
        fl = _flow_of(sch, here)
        if fl is None:
            unknown = unknown or not uncalled(get_module(sch.module, here))
        elif fl.called(name):
            runs = _runs(sch, here)
            if runs:
                return True
            unknown = unknown or runs is None
    return None if unknown else False


def _never_runs(sch: Schedule, path: str, what: str) -> Problem:
    """The problem of ``path``, which no forward calls, naming the called modules that hold
    it (the same module at another path) or its parameters (a tie)."""
    module = get_module(sch.module, path)
    ties = tied_paths(sch.module)
    same = {q for q, m in walk(sch.module) if m is module and q != path}
    tied = {_parent(other) for n, _ in module.named_parameters(prefix=path) for other in ties.get(n, ())
            if not any(contains(q, other) for q in (path, *same))}
    called = [(sorted(q for q in found if _runs(sch, q) is not False), how)
              for found, how in ((same, "is the same module as"), (tied, "shares its parameters (tied) with"))]
    names = [q for qs, _ in called for q in qs]
    reason = f"is never called in the model's forward, so {what} would never run"
    if not names:
        return Problem(path, reason, "drop it, or state it on a module the forward calls")
    said = "; ".join(f"it {how} {', '.join(map(repr, qs))}, which the forward calls" for qs, how in called if qs)
    return Problem(path, f"{reason}: {said}",
                   f"state it on {', '.join(map(repr, names))} (the called paths that should have it), or drop it")
