"""What a user states, checked against the data flow: a sync's ``src=`` the flow
contradicts or nothing makes (:func:`_sources`), ``src=Partial()`` on a built-in module,
a sharded module's output syncs, ``tp_local`` on a module that sees the whole input,
and syncs to ``Shard(-1)`` whose features go on to code that needs them whole
(:func:`_feature_syncs`).

One reason to change: the rule for a stated layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..errors import Problem
from ..rewrites._common import INSTALLED, contains, within
from ..schedule import Schedule
from ..tree import get_module, join, relative
from .arriving import (
    _features_by_axis,
    _input_reaches_column,
    _partner_gathered,
    _split_by_sync,
    _stated_output,
)
from .chains import _chain_entries, _chain_exits, _enters_chain_whole, _in_chain
from .experts import EXPERTS
from .flow import INPUT, OUTPUT, SIDE, pointwise
from .local import LOCAL, LocalSpec
from .lookups import (
    _ancestors,
    _caller,
    _flow_of,
    _has_params,
    _model_output,
    _parent,
    _reach,
    _result_of_caller,
    _through,
)
from .pairs import _partners
from .planned import Plan, _code, _last_dim
from .roles import Role
from .sequence import SEQ, SeqSpec
from .shard import ROLE
from .sync import SYNC, SyncSpec

__all__: list[str] = []


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
        inner = relative(parent, row)
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
                    or sch.annotations.of_kind(INSTALLED) or _callable_code(sch))
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
                    within(r, path) or (contains(path, r) and not holds_exit)
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
    installed by ``sf.replace``, a ``tp_local`` one, experts, one run on its parameters'
    shards between callables (:func:`_callable_code`)."""
    return any(within(path, q) for key in (INSTALLED, LOCAL, EXPERTS)
               for q in sch.annotations.of_kind(key)) or any(within(path, q)
                                                             for q in _callable_code(sch))


def _callable_code(sch: Schedule) -> frozenset[str]:
    """The modules whose tensor-parallel code is the user's callables: sharded by their
    parameters (no Megatron role of their own), with a callable sync at a boundary, they
    run their own forward on this rank's shards (Slapo's vocabulary-split embedding between
    its masking hooks)."""
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    return frozenset(q for q, specs in sch.annotations.of_kind(SYNC).items()
                     if any(s.fn is not None for s in specs) and (role := roles.get(q)) is not None
                     and role.own_forward)


def _stacked_role_outputs(sch: Schedule) -> list[Problem]:
    """A sharded module with several ``fwd_post`` syncs: its output boundary converts its
    role's own output to the first's layout, and each later one converts on from there
    (:attr:`.planned.ModulePlan.posts`). The local-shard path plans one conversion per
    output, so the model runs on DTensor activations, which move through each in turn."""
    syncs: dict[str, tuple[SyncSpec, ...]] = sch.annotations.of_kind(SYNC)
    return [Problem(path, f"is {role.name}-parallel with {n} fwd_post syncs, converted one after another",
                    f"keep one fwd_post sync on {path!r}, to the layout its output should have, for the "
                    "local-shard path")
            for path, role in sch.annotations.of_kind(ROLE).items() if not role.own_forward
            and (n := sum(s.mode == "fwd_post" for s in syncs.get(path, ()))) > 1]


def _unseen_tp_locals(sch: Schedule) -> list[Problem]:
    """``tp_local`` on a module whose input the data flow cannot tell, outside a
    sequence-parallel chain: its caller's code fx cannot trace (BERT's embeddings
    LayerNorm, inside ``BertEmbeddings``), or what reaches it is unknown (a token split
    stated upstream, whose region hands its result on whole). The statement cannot be
    checked: where the whole activation reaches the module, summing its gradients over
    the ranks would multiply them. On DTensor activations the gradients are what the
    data flow makes them, whatever the statement."""
    problems = []
    for path, spec, found in _reaching_tp_locals(sch):
        if found is False:
            problems.append(Problem(
                path, "is declared tp_local, but its caller's code cannot be traced, so what reaches it is unknown",
                f"trace its caller, or drop tp_local for {path!r} where the whole activation reaches it"))
        elif found is None and not _in_chain(sch, path, spec.mesh_axis):
            problems.append(Problem(
                path, f"is declared tp_local, but the data flow cannot tell what reaches it over {spec.mesh_axis!r}",
                f"drop tp_local for {path!r} where the whole activation reaches it (it is for modules after a "
                "column kept split, such as per-head norms, or inside a sequence_parallel chain)"))
    return problems


def _reaching_tp_locals(sch: Schedule) -> list[tuple[str, LocalSpec, Placement | Literal[False] | None]]:
    """Per ``tp_local`` module, what the data flow brings to it over its mesh axis
    (:class:`.arriving._Features`: ``Replicate()``, ``Shard(-1)``, or ``None`` where it
    cannot tell), or ``False`` where its caller's code cannot be traced. What columns kept
    split for their rows alone feed is this rank's features whatever reached the columns
    (a per-head norm inside a kernel the flow does not follow)."""
    locals_: dict[str, LocalSpec] = sch.annotations.of_kind(LOCAL)
    if not locals_:
        return []
    know = _features_by_axis(sch, _partners(sch))
    out: list[tuple[str, LocalSpec, Placement | Literal[False] | None]] = []
    for path, spec in locals_.items():
        found = _caller(sch, path)
        if found is None:
            out.append((path, spec, False))
            continue
        f = know(spec.mesh_axis)
        parent, name, fl = found
        fed = fl.feeders(name, f._through(parent))
        got = f._combine(parent, fed)
        if got is None and fed and all(join(parent, q) in f.kept and f.roles[join(parent, q)].mesh_axis
                                       == spec.mesh_axis for q in fed):
            got = Shard(-1)
        out.append((path, spec, got))
    return out


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
        own: Placement = Partial() if role.sums else Shard(role.dim)
        if posts and posts[0].src is not None and posts[0].src != own:
            problems.append(Problem(
                path, f"is {role.name}-parallel, so its output is {_code(own)}, but its fwd_post sync states "
                f"src={_code(posts[0].src)}",
                f"drop src= (or state src={_code(own)})",
            ))
    return problems


def _contradicted_sources(sch: Schedule, partners: Mapping[str, tuple[str, ...]]) -> list[Problem]:
    """A sync's stated ``src`` that contradicts what the plan knows is there: for a
    ``fwd_pre`` sync, the features that reach the module (:class:`.arriving._Features`; a paired
    row's columns' where fx cannot trace the parent); for a ``fwd_post`` sync, the
    layout an earlier sync on the same output moved it to, the one a sync states on the
    child that alone makes the output (``_stated_output``), else the features the
    module makes by the data flow. The runtime converts from what is stated, so the
    activation would be split twice or gathered wrongly (a root sync from Replicate()
    over a child's Shard(-1): (2, 4, 4) for (2, 4, 8)). Refused, naming the module."""
    problems = []
    roles: dict[str, Role] = sch.annotations.of_kind(ROLE)
    know = _features_by_axis(sch, partners)
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
                    and not any(within(q, path) or contains(path, q) or _parent(q) == _parent(path)
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


def _whole_tp_locals(sch: Schedule) -> list[Problem]:
    """``tp_local`` states that a module runs on this rank's shard, so its replicated
    parameters' gradients are partial sums, reduced over the mesh axis. Where the data flow
    shows the whole activation reaching it (a norm before the columns, the model's final
    norm), each rank's gradient is already the whole one, and the reduction would multiply
    it by the axis size: refused, naming the module."""
    return [Problem(
        path,
        f"is declared tp_local (to run on this rank's shard over {spec.mesh_axis!r}), but by the data flow "
        "the whole activation reaches it: every rank's gradient of its parameters is already the whole "
        "one, and reducing it over the ranks would multiply it",
        f"drop tp_local for {path!r} (it is for modules after a column kept split, such as per-head norms)",
    ) for path, spec, found in _reaching_tp_locals(sch) if isinstance(found, Replicate)]


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
    by module order alone is :func:`.pairs._untraced_pairs`'s), a lone one or a feature-split
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
