"""Facts of sequence-parallel chains: their members, first and last in run order
(:func:`_chain_ends`), the modules inside a member that run on the whole sequence
(:func:`_whole_in_chains`), the parents that gather the sequence for their columns
(:func:`_gathering_parents`), and what a member's own code does over the tokens
(:func:`_over_sequence`).

One reason to change: what a :func:`~slapo_fn.sequence_parallel` chain is. The checks
on chains are in :mod:`.chain_checks`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import replace

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..hf import is_conv1d, mixes_tokens
from ..rewrites._common import contains, within
from ..schedule import Schedule
from ..tree import caller_path, get_module, join, relative
from .features import ASSUMED_RANK
from .flow import INPUT, flow, own_layer, pointwise
from .lookups import _LOOKUPS, _caller, _flow_of, _flows_memo, _run_order, _through
from .roles import Role
from .sequence import SEQ, SeqSpec
from .shard import ROLE
from .sync import SYNC, SyncSpec

__all__ = ["chain_entries_given_split"]


def _told_split(sch: Schedule, path: str) -> bool:
    """Whether the chain at ``path`` was told that its input arrives split (``input_layout``)."""
    chain = sch.annotations.get(path, SEQ)
    return chain is not None and chain.sharded_input


#: Layers whose forward mixes the positions of their input's other dimensions: a token shard
#: gives them a share of what they compute over.
_OVER_POSITIONS = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.GroupNorm,
                   nn.modules.instancenorm._InstanceNorm, nn.RNNBase)


def _member_over_sequence(sch: Schedule, member: str, spec: SeqSpec, merged: dict[str, int],
                          entered: set[str] | None = None) -> tuple[str, str] | None:
    """:func:`_over_sequence` of a sequence-parallel chain member (``merged`` as there)."""
    if spec.seq_axis not in (0, 1):
        return None
    columns = {q for q, r in sch.annotations.of_kind(ROLE).items() if r.enters
               and r.mesh_axis == spec.mesh_axis and (within(member, q))}
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
    by :func:`.chain_checks._attention_on_sequence_shards`), or a leaf :func:`_leaf_over_sequence`
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


def chain_entries_given_split(sch: Schedule) -> dict[str, SeqSpec]:
    """The first members of the sequence-parallel chains told that their input arrives split
    (``input_layout=Shard(d)``), with their chain's spec."""
    seqs: dict[str, SeqSpec] = sch.annotations.of_kind(SEQ)
    with _flows_memo():
        return {first: seqs[first] for first in _chain_entries(sch).values() if seqs[first].sharded_input}


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
            columns_of.setdefault(parent, set()).add(relative(parent, q))
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


def _whole_in_chains(sch: Schedule) -> dict[str, SeqSpec]:
    """:func:`_modules_run_whole`, found once per :func:`.plan.plan` or :func:`.checks.refusals` call."""
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


def passive_member(sch: Schedule, path: str) -> bool:
    """Whether ``path`` is a sequence-parallel chain member that moves no layout: neither
    its chain's first nor its last (the entry and exit move the sequence at the ends
    only), with no role and no sync of its own, and pointwise (an activation, a dropout).
    It computes on whatever layout reaches it, as it would outside the chain: between a
    column and its row, on this rank's features (PyTorch's SP MLP test puts ``net1``,
    ``relu`` and ``net2`` in one chain)."""
    if path not in sch.annotations.of_kind(SEQ) or path in sch.annotations.of_kind(ROLE):
        return False
    if path in sch.annotations.of_kind(SYNC) or any(path in pair for pair in _chain_ends(sch).values()):
        return False
    return pointwise(get_module(sch.module, path))


def _in_chain(sch: Schedule, path: str, axis: str) -> bool:
    """Whether ``path`` is in (or is) a sequence-parallel chain over ``axis``."""
    return any(s.mesh_axis == axis and (within(r, path))
               for r, s in sch.annotations.of_kind(SEQ).items())
