"""Megatron pairs: the columns that keep their output split for the rows it reaches, and
those rows (:func:`_partners`), within a parent by its data flow or module order, or
across sibling modules as BERT lays them out; and the checks of pairs the plan cannot
prove right on local shards (a pair only module order makes, an unsharded twin, columns
gathered for some of a row's inputs and not others).

One reason to change: how columns are paired with rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch.distributed.tensor import Replicate

from ..errors import Problem
from ..rewrites._common import contains
from ..schedule import Schedule
from ..tree import get_module, join, relative
from .arriving import _partner_gathered, _split_by_sync
from .chains import _in_chain, passive_member
from .flow import INPUT, OUTPUT, SIDE, Flow
from .lookups import (
    _caller,
    _flow_of,
    _in_features,
    _installed,
    _out_features,
    _parent,
    _run_order,
    _siblings,
    _through,
)
from .planned import Plan, _last_dim
from .roles import Role
from .sequence import SEQ
from .shard import ROLE
from .sync import SYNC, SyncSpec

__all__: list[str] = []


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
        names = {relative(parent, p): p for p in paths}
        through = _through_members(sch, parent)
        cols = {n for n, p in names.items() if roles[p].splits_output}
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


def _through_members(sch: Schedule, parent: str) -> Callable[[str], bool]:
    """:func:`_through`, and the chain members between that move no layout
    (:func:`.chains.passive_member`)."""
    base = _through(sch, parent)
    return lambda q: base(q) or passive_member(sch, join(parent, q))


def _partners_across(sch: Schedule, roles: Mapping[str, Role], paired: Mapping[str, tuple[str, ...]]
                     ) -> dict[str, tuple[str, ...]]:
    """Megatron pairs across parents, as BERT lays them out: ``attention.self`` calls q/k/v
    and returns what its code makes of them alone, and its caller hands that result only to
    the first argument of siblings (``attention.output``) whose first argument reaches a row
    alone. The columns keep their outputs split (``attention.self``'s code then runs on this
    rank's heads, checked as any parent's between a pair) and the row takes them so. A
    ``fwd_post`` sync on the caller that gathers its output (:func:`_leaves_pair`) is left
    out where those rows alone read it (:func:`_elided_gathers`: they would split it
    again); with no such rows, the columns stay split up to the caller's output, paired
    with the caller itself, and its sync gathers there once, not each column's output.
    Outside sequence-parallel chains (:func:`.chain_checks._sequence_pairs_across` reads them inside)."""
    seqs = sch.annotations.of_kind(SEQ)
    syncs = sch.annotations.of_kind(SYNC)
    by_caller: dict[tuple[str, str], list[str]] = {}
    for path, role in roles.items():
        # a column's fwd_pre syncs move its input alone (a split one it gathers back), not its
        # output; a gather of its own output is left out where the pair's rows alone read it
        if role.enters and role.splits_output and path not in paired and all(
                s.mode == "fwd_pre" or _gathers_whole(s, role.mesh_axis) for s in syncs.get(path, ())
        ) and not _in_chain(sch, path, role.mesh_axis):
            found = _caller(sch, path)
            if found is not None:
                by_caller.setdefault((found[0], role.mesh_axis), []).append(path)
    out: dict[str, tuple[str, ...]] = {}
    for (caller, axis), columns in by_caller.items():
        fl, up = _flow_of(sch, caller), _caller(sch, caller)
        specs = syncs.get(caller, ())
        if fl is None or up is None or caller in seqs or not _leaves_pair(specs, axis):
            continue
        through = _through(sch, caller)
        names = {q[len(caller) + 1:] if caller else q: q for q in columns}
        if not all(fl.consumers(n, through) == {OUTPUT} for n in names) or (
                fl.reaching_output(through) - {SIDE} != set(names)):
            continue
        rows = _rows_taking(sch, roles, up, axis)
        if rows:
            # a gather the caller's sync states is left out (:func:`_elided_gathers`): the rows
            # would split the whole value again, and nothing else reads it
            for q in columns:
                out[q] = rows
            for r in rows:
                out[r] = tuple(sorted(columns))
        elif any(s.mode == "fwd_post" for s in specs) and not any(
                s.mode == "fwd_post" for q in columns for s in syncs.get(q, ())):
            # the caller's own sync gathers its output: the columns stay split up to it (its code on
            # this rank's heads), one gather there, whatever takes the whole value after it
            for q in columns:
                out[q] = (caller,)
    return out


def _rows_taking(sch: Schedule, roles: Mapping[str, Role], up: tuple[str, str, Flow], axis: str) -> tuple[str, ...]:
    """The rows over ``axis`` that alone take the output of the module ``up`` names (its
    caller, its name there, the caller's flow): each module its caller hands that output
    to takes it as its first argument alone and hands it to one row alone (BERT's
    ``attention.output`` to its ``dense``), with no sync but ``fwd_post`` ones on the way
    or on the row (they move its output, not what it takes). ``()`` where anything else
    reads it."""
    syncs = sch.annotations.of_kind(SYNC)
    outer, name, ofl = up
    othrough = _through(sch, outer)
    rows = []
    for user in ofl.consumers(name, othrough):
        receiver = join(outer, user)
        rfl = _flow_of(sch, receiver) if user != OUTPUT else None
        if (rfl is None or ofl.hidden_feeders(user, othrough) != {name}
                or not all(_leaves_split(s, axis, False) for s in syncs.get(receiver, ()))):  # its input is the pair's
            return ()
        rthrough = _through(sch, receiver)
        taken = rfl.consumers(INPUT, rthrough)
        row = join(receiver, next(iter(taken))) if len(taken) == 1 and OUTPUT not in taken else ""
        found_role = roles.get(row)
        if (found_role is None or not (found_role.splits_input and found_role.sums)
                or found_role.mesh_axis != axis or not all(_leaves_split(s, axis, True) for s in syncs.get(row, ()))
                or rfl.hidden_feeders(next(iter(taken)), rthrough) != {INPUT}):
            return ()
        rows.append(row)
    return tuple(sorted(rows))


def _leaves_split(s: SyncSpec, axis: str, row: bool) -> bool:
    """Whether sync ``s`` on a module between a column and its row (or on the ``row``)
    leaves what the row takes as the column gave it, this rank's features: a ``fwd_post``
    sync moves the module's output, not its input, and a ``fwd_pre`` one that states the
    input split by features over ``axis``, from that split, states the pair's own layout, a
    move of nothing. (``src`` left out is the module's own layout there: the row's split,
    the whole input of a module between.)"""
    if s.mode == "fwd_post":
        return True
    return (s.mode == "fwd_pre" and s.fn is None and s.mesh_axis == axis and _last_dim(s.layout)
            and (s.src == s.layout or (row and s.src is None)))


def _elided_gathers(sch: Schedule, partners: Mapping[str, tuple[str, ...]]) -> frozenset[str]:
    """The modules whose ``fwd_post`` syncs gather what columns they call keep split for
    rows in other modules (a pair across parents, :func:`_partners_across`): only those
    rows read the whole value, and they split it again, so the plan leaves the gather out
    (each row takes the columns' split as it is, as PyTorch's output layouts leave a
    DTensor's placements where the stated one is already whole)."""
    roles: Mapping[str, Role] = sch.annotations.of_kind(ROLE)
    syncs = sch.annotations.of_kind(SYNC)
    out: set[str] = set()
    for path, rows in partners.items():
        role, found = roles.get(path), _caller(sch, path)
        if role is None or not role.enters or found is None or not all(
                (r := roles.get(q)) is not None and r.splits_input and not contains(found[0], q) for q in rows):
            continue
        # the caller's gather of what the columns make, and a column's gather of its own output
        out.update(q for q in (found[0], path) if any(s.mode == "fwd_post" for s in syncs.get(q, ())))
    return frozenset(out)


def _gathered_through_elementwise(sch: Schedule, row: str, columns: tuple[str, ...], axis: str) -> bool:
    """Whether row ``row`` takes the outputs of its ``columns`` (siblings, not packed) that
    their own ``fwd_post`` syncs gather whole over ``axis``, through nothing but elementwise
    code: pointwise modules, and parent code that neither mixes, views, takes apart nor
    reads by rank any of them (:class:`.flow.Flow`). The row's split of the whole value then
    needs no gather of its gradient: the columns' gathers keep this rank's share of it
    alone, and elementwise code makes that share from the row's share alone
    (:func:`.collectives.split_padded`), as PyTorch's DTensors keep it split backward."""
    found = _caller(sch, row)
    if found is None or not columns:
        return False
    parent, name, fl = found
    roles: Mapping[str, Role] = sch.annotations.of_kind(ROLE)
    syncs = sch.annotations.of_kind(SYNC)
    through = _through(sch, parent)
    for c in columns:
        role, found_c = roles.get(c), _caller(sch, c)
        posts = [s for s in syncs.get(c, ()) if s.mode == "fwd_post"]
        if (role is None or role.packed != 1 or found_c is None or found_c[0] != parent or len(posts) != 1
                or posts[0].mesh_axis != axis or not isinstance(posts[0].layout, Replicate)):
            return False
    names = {relative(parent, c) for c in columns}
    if fl.feeders(name, through) - {SIDE} != names:
        return False
    between = names | {q for q in fl.feeds if through(q) and name in fl.consumers(q, through)}
    return not any(q in table for q in between
                   for table in (fl.mixes, fl.apart, fl.counts, fl.by_width, fl.ranked, fl.inner))


def _gathers_whole(s: SyncSpec, axis: str) -> bool:
    """Whether ``s`` gathers a module's output whole over ``axis`` from where it is (no
    ``src=``, no callable), as PyTorch's output layouts do."""
    return (s.mode == "fwd_post" and s.mesh_axis == axis and s.src is None and s.fn is None
            and isinstance(s.layout, Replicate))


def _leaves_pair(specs: tuple[SyncSpec, ...], axis: str) -> bool:
    """Whether the syncs of a module that calls columns keep them split up to its output:
    ``fwd_pre`` syncs that state its input whole, as the columns take it anyway, and
    ``fwd_post`` syncs over ``axis`` without ``src=`` that gather its output whole (from
    the columns' split, once there, as PyTorch's output layouts do). Any other moves what
    the columns take or make (a ``bwd_post`` one states how the input gradient leaves,
    which the columns' backward makes)."""
    return all((s.mode == "fwd_pre" and isinstance(s.layout, Replicate)) or _gathers_whole(s, axis) for s in specs)


def _pair_groups(sch: Schedule) -> dict[tuple[str, str], list[str]]:
    """The columns and rows that may pair, grouped by the module whose ``forward`` calls
    them (:func:`.lookups._caller`, else their parent) and their mesh axis: groups holding both."""
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    groups: dict[tuple[str, str], list[str]] = {}
    for path, role in roles.items():
        if path and (role.splits_output or role.splits_input):
            found = _caller(sch, path)
            groups.setdefault((found[0] if found is not None else _parent(path), role.mesh_axis), []).append(path)
    return {g: paths for g, paths in groups.items()
            if any(roles[q].splits_output for q in paths) and any(roles[q].splits_input for q in paths)}


def _by_module_order(sch: Schedule, parent: str, paths: list[str]) -> bool:
    """Whether the columns and rows ``paths`` that ``parent`` calls pair by module order:
    fx cannot trace its ``forward``, or the trace does not call them all."""
    fl = _flow_of(sch, parent)
    return fl is None or not all(fl.called(relative(parent, q)) for q in paths)


def _untraced_pairs(sch: Schedule, p: Plan) -> list[Problem]:
    """A column kept split for a row that only module order pairs it with: fx cannot
    trace the parent's ``forward`` (a branch on a tensor's values), so what its code does
    with this rank's features between them is unknown. A view by a head count slapo_fn
    does not know (``view(B, S, self.nh, -1)``) would take them for whole heads, silently
    wrong. Refused, naming the parent and its columns, with what to declare: gather the
    columns' outputs (the row then splits its whole input; right whatever the code), or
    make the forward traceable. A module installed by ``sf.replace`` is code written for
    this rank's share (slapo_fn's attention kernels take their head counts from the
    recipe): trusted, as :func:`.statements._unsourced` trusts it."""
    kept = frozenset(q for q, mp in p.modules.items() if mp.keeps_features)
    order = _run_order(sch)
    problems = []
    for (parent, axis), paths in _pair_groups(sch).items():
        if _installed(sch, parent) or not _by_module_order(sch, parent, paths):
            continue  # installed: code written for this rank's share (the kernels take head counts from the recipe)
        fl = _flow_of(sch, parent)
        if fl is not None and any(relative(parent, q) in fl.reads for q in paths):
            continue  # traced, reading a column's parameters itself (a decomposed Linear): checks._functional_reads
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


def _channels_off_pairs(sch: Schedule, p: Plan) -> list[Problem]:
    """A module whose role keeps this rank's features (a BatchNorm or a depthwise
    convolution split by channels, :attr:`.roles.Role.keeps`) runs on them only between a
    column that keeps its output split and the row it feeds, as an activation between them
    does. Anywhere else its input would arrive whole (a shape error) or its output reach
    code that needs every channel: refused, naming the module and what it sits between."""
    problems = []
    syncs = sch.annotations.of_kind(SYNC)
    for path, role in sch.annotations.of_kind(ROLE).items():
        if not role.keeps:
            continue
        found = _caller(sch, path)
        if found is None:
            why = "slapo_fn cannot trace the forward that calls it, so it cannot tell what it sits between"
        else:
            parent, name, fl = found
            through = _through(sch, parent)
            feeders = fl.hidden_feeders(name, through) - {SIDE}
            users = fl.consumers(name, through)
            columns = {f for f in feeders if (m := p.modules.get(join(parent, f))) is not None and m.keeps_features
                       and m.role is not None and m.role.mesh_axis == role.mesh_axis}
            rows = {u for u in users if (m := p.modules.get(join(parent, u))) is not None and m.partnered
                    and m.role is not None and m.role.splits_input and m.role.mesh_axis == role.mesh_axis}
            if feeders and feeders == columns and users and users == rows:
                continue
            wrong = []
            if not feeders or feeders != columns:
                whole = ", ".join(sorted(repr(f) for f in feeders - columns)) or "the parent's code"
                wrong.append(f"its input comes whole from {whole}, not from a column kept split for its row")
            if not users or users != rows:
                need = ", ".join(sorted(repr(u) for u in users - rows)) or "nothing"
                wrong.append(f"its output reaches {need}, not only rows that take this rank's channels")
            why = "runs on this rank's channels, but " + " and ".join(wrong)
            synced = sorted(q for n in feeders | users if (q := join(parent, n)) in syncs)
            if synced:
                # a sync on a neighbour to a channel split (Shard(1)) is read as a gather: only
                # Shard(-1) is taken for a split of features yet
                problems.append(Problem(path, why, f"drop the syncs on {', '.join(map(repr, synced))}: a column "
                                                   "and its row keep the channels split between them without any"))
                continue
        problems.append(Problem(path, why, "shard it between a column (axis=0) and its row (axis=1), e.g. "
                                           "conv1 axis=0 -> bn1 axis=0 -> relu -> conv2 axis=1, or leave it unsharded"))
    return problems
