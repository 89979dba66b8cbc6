"""The checks of sequence-parallel chains and token shards: where the plan cannot prove a
chain right on local shards (a module between members, a column no row reads, code over
the sequence, attention on shards, a token shard outside a chain, a sync gathering
inside one), and the chain statement it refuses (an input stated split that arrives
whole, :func:`_unsplit_chain_inputs`).

One reason to change: a rule about chains. Their facts are in :mod:`.chains`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from torch.distributed.tensor import Replicate, Shard

from ..errors import Problem
from ..hf import linear_features, mixes_tokens
from ..rewrites._common import contains, within
from ..schedule import Schedule
from ..tree import caller_path, get_module, join, walk
from .arriving import _stated_output
from .chains import (
    _attention,
    _chain_exits,
    _gathering_parents,
    _in_chain,
    _inside_any,
    _member_over_sequence,
    _told_split,
    _whole_in_chains,
    passive_member,
)
from .flow import INPUT, OUTPUT, SIDE, pointwise
from .lookups import (
    _caller,
    _downstream,
    _flow_of,
    _has_params,
    _installed,
    _later_modules,
    _out_features,
    _parent,
    _run_order,
    _siblings,
    _through,
)
from .planned import Plan, _code, _d, _last_dim, _named
from .roles import Role
from .sequence import SEQ, SeqSpec
from .shard import ROLE
from .sync import SYNC

__all__: list[str] = []


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
            chain = next((seqs[r] for r in members if within(r, path)), None)
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
        if any(r.mesh_axis == spec.mesh_axis and r.splits_output and (within(path, q))
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
            if any(within(r, path) for r in members) or gathers(path):
                # the next member; a module outside the chain whose output the parent's code adds to
                # its hidden states (a position embedding) would meet this member's shard there
                joined = sorted(lv.flow.hidden_feeders(q, lv.through) - {lv.name, INPUT, SIDE, OUTPUT})
                for j in joined:
                    there = join(lv.parent, j)
                    if not any(within(r, there) for r in members) and _has_params(
                            get_module(sch.module, there)):
                        return there
                continue
            module = get_module(sch.module, path)
            if _has_params(module) or mixes_tokens(module) or not pointwise(module):
                return path
    if start is None:
        return None
    for q in _later_modules(sch.module, start):
        if any(within(r, q) for r in members):
            return None
        if gathers(q):
            return None
        if _has_params(get_module(sch.module, q)):
            return q
    return None


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
            if spec is not None and spec.mesh_axis == mp.role.mesh_axis and not passive_member(sch, member):
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
        if not any(r.mesh_axis == spec.mesh_axis and r.enters and (within(member, q))
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
        norms = _per_head_between(sch, path)
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
    columns and runs its other children whole (:func:`.chains._gathering_parents`); a member's own
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
        return not any(within(full, a) for a in laid)

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
        return bool(_per_head_between(sch, join(caller, column)))

    def row(q: str) -> bool:
        sources = fl.feeders(q, whole)
        return (lone(q, True) and any(lone(s, False) for s in sources)
                and all(s == SIDE or lone(s, False) for s in sources) and fl.consumers(q, whole) <= {OUTPUT})

    if mp.role.splits_input:
        return row(name)
    users = fl.consumers(name, whole)
    return mp.role.enters and lone(name, False) and bool(users) and all(
        u != OUTPUT and row(u) for u in users)


def _per_head_between(sch: Schedule, column: str) -> list[str]:
    """The modules the column's output reaches first in its caller's code that act on
    each head alone: no children, and parameters narrower than the column's output (the
    per-head q/k norms of Gemma 3). They keep the column from its row unless declared
    ``tp_local``. Read off the parameters' sizes, not the modules' kinds."""
    found = _caller(sch, column)
    if found is None:
        return []
    caller, name, fl = found
    width = _out_features(get_module(sch.module, column)) or 0
    out = []
    for user in sorted(fl.consumers(name, _through(sch, caller)) - {OUTPUT}):
        module = get_module(sch.module, join(caller, user))
        size = max((t.numel() for t in module.parameters()), default=0)
        if not module._modules and 0 < size < width:
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
