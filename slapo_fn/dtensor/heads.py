"""Attention heads and the code between a column kept split and its row: the head counts
and widths build makes this rank's (:func:`heads_made_local`), and the checks of the
views, splits and ops that code applies to this rank's features (heads of the wrong
size, packed blocks cut wrongly, an op over all the features).

One reason to change: how the planner reads heads and packed blocks in a parent's code.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn
from torch.distributed.tensor import Shard

from ..errors import Problem
from ..hf import HEAD_COUNT_ATTRS, HEAD_DIM_ATTRS, HEAD_WIDTH_ATTRS, head_dim_of
from ..schedule import Schedule
from ..tree import get_module
from .arriving import _split_outputs
from .features import Apart, ApartKind
from .lookups import _caller, _in_features, _out_features, _parent
from .planned import Plan, _named
from .shard import mesh_dims

__all__ = ["grouped_head_count_attrs", "head_count_attrs", "head_width_attrs", "heads_made_local"]


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
        >>> grouped_head_count_attrs(att, (8 + 2 * 2) * 16, Apart(ApartKind.HEADS, dims=(-1, 6, 16)))
        ('num_heads', 'num_kv_heads')
        >>> grouped_head_count_attrs(att, 3 * 8 * 16, Apart(ApartKind.HEADS, dims=(3, 8, 16))) # blocks of heads
        ()
    """
    own, head_dim = vars(parent), head_dim_of(parent)
    dims = how.dims if how is not None and how.kind is ApartKind.HEADS else ()
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
    rank's block size: one size, the parent's ``split_size``, the width of a block, read by
    its forward (a traced parent's code holds the size it was traced with, not the
    attribute build changes)."""
    return (out is not None and len(sizes) == 1 and sizes[0] == out // packed
            and vars(parent).get("split_size") == sizes[0] and not isinstance(parent, fx.GraphModule))


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


def _features_mixed(sch: Schedule, p: Plan) -> list[Problem]:
    """Code between a column kept split and its row must act on each feature alone (or
    take the features apart into heads or blocks, which the head and packing checks
    read): a reduction, softmax or matmul over the features, a flip, a concatenation
    along them would run over this rank's share as if it were all of them, a silently
    wrong number. Read from the traced data flow (:attr:`.flow.Flow.mixes`); refused,
    naming the op and the parent. So must the code after a module that keeps this rank's
    features (:attr:`.roles.Role.keeps`: a BatchNorm split by channels after a column)."""
    problems = []
    kept = {q for q, mp in p.modules.items() if mp.role is not None and mp.role.keeps}
    for path in sorted(set(_split_outputs(sch, p.modules)) | kept):
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
    if how.kind is not ApartKind.HEADS or not how.dims:
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
    whole hands the parent all of it (:attr:`.planned.ModulePlan.keeps_features`). Read from the
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
        if kind is ApartKind.SLICES:
            problems.append(Problem(
                path,
                f"{where}'s forward takes its output apart in {count} slices at fixed feature positions "
                "(x[..., :a], x[..., a:b]: sizes of the whole output), but each rank holds only its share of the "
                "features, so the slices would cut the wrong ones",
                f"leave {path!r} unsharded (its row partner then splits its input itself), or replace "
                f"{where} (sf.replace) with a module that projects q, k and v separately",
            ))
        elif kind is ApartKind.HEADS and role.packed > 1 and _blocks_of_heads(
                get_module(sch.module, _parent(path)), how.dims, _out_features(get_module(sch.module, path)),
                role.packed):
            pass  # timm's reshape(B, N, 3, num_heads, head_dim): blocks first, each of this rank's heads
        elif kind is ApartKind.HEADS and role.packed > 1:
            problems.append(Problem(
                path,
                f"is packed={role.packed}, but {where}'s forward views its output into heads before it splits it, "
                "so its features are grouped head by head ([q_h|k_h|v_h] for each head h), not in "
                f"{role.packed} blocks",
                "shard it without packed= (a rank's contiguous rows are then whole heads)",
            ))
        elif kind is ApartKind.BLOCKS and role.packed > 1 and how.dims and not _split_made_local(
                get_module(sch.module, _parent(path)), how.dims, _out_features(get_module(sch.module, path)),
                role.packed):
            sizes = ", ".join(str(d) for d in how.dims)
            traced = isinstance(get_module(sch.module, _parent(path)), fx.GraphModule)
            problems.append(Problem(
                path,
                f"{where}'s forward splits its output by sizes of the whole output's blocks ({sizes}), which build "
                + ("does not make this rank's (a traced forward holds the sizes it was traced with)" if traced
                   else "does not make this rank's (only a split_size attribute)")
                + ", so this rank's share would be cut into the wrong blocks",
                f"gather its output, sf.sync(sch, {path!r}, 'fwd_post', Replicate()), or split it with "
                f"chunk({role.packed}, dim=-1) or by a split_size attribute",
            ))
        elif kind is ApartKind.BLOCKS and role.packed == 1:
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
