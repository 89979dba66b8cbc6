"""The tensor-parallel build phase: the forwards that :func:`~slapo_fn.dtensor.plan.plan`
describes, installed on build's private copy of the model.

Parameters become DTensors (every one: its layout, or ``Replicate``); sharded modules
run on local tensors through the autograd-aware collectives of :mod:`.collectives`;
every other module sees local values of its parameters for the length of its forward.
Nothing here decides a layout: that is the plan's (``explain`` and ``build(strict=True)``
read the same one).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.nn.utils.stateless import _reparametrize_module

from ..errors import LayoutError, Problem
from ..hf import EXPERT_COUNT_ATTRS as _EXPERT_COUNTS
from ..hf import QUERY_HEAD_ATTRS
from ..rewrites._common import contains, within
from ..rewrites.checkpoint import CHECKPOINT
from ..schedule import Key, Schedule, path_exists
from ..tree import caller_path, get_module, join, relative, split, tensor_at, uncalled
from . import collectives as C
from .checks import implicit, refusals
from .data_parallel import DATA_PARALLEL
from .experts import EXPERTS, experts_forward
from .features import ASSUMED_RANK, Meets
from .heads import heads_made_local
from .layout import Layout
from .local import LOCAL
from .lookups import _flow_of, _in_width, _out_features, _parent, per_head_operands
from .on_dtensors import install_on_dtensors
from .plan import _local_axis, _sharded_output, param_dims, plan
from .planned import ModulePlan, Plan
from .region import (
    Activations,
    BiasShare,
    map_first_output,
    map_input,
    output_slot,
    reduce_partial_grads,
    same_tensor,
)
from .regions import regions_of
from .rng import RNG, forked
from .roles import Role, reading, whole_params
from .sequence import SEQ
from .shard import LAYOUT, ROLE, mesh_dims
from .sync import SYNC, SyncSpec

__all__ = ["apply_tensor_parallel"]


#: How many recent entries a forward pass remembers (siblings read their input in a row).
_RECENT = 4


class _Runtime:
    """Per-build state: the mesh, and the entries of the forward pass under way, which
    make sibling column modules reading the same input tensor enter the TP region once
    (one backward collective)."""

    def __init__(self, sch: Schedule, grads_after_backward: bool = False) -> None:
        assert sch.mesh is not None
        self.mesh = sch.mesh
        self.dims = mesh_dims(sch.mesh)
        # Parameters live on the sub-mesh of the axes the schedule shards over (plan.param_dims)
        self.param_dims = param_dims(sch)
        self.param_mesh = self.mesh if self.param_dims == self.dims else self.mesh[self.param_dims]
        # Plan.grads_after_backward: the gradients of replicated parameters used on activation
        # shards stay Partial until one callback at the end of backward (reduce_partial_grads)
        self.after = grads_after_backward
        self.entries: list[tuple[torch.Tensor, tuple[Any, ...], torch.Tensor]] | None = None
        self.traced = False  # whether the pass under way was opened while a compiler traced

    def axis(self, name: str) -> C.Axis:
        return (self.mesh, self.dims.index(name))

    def size(self, name: str) -> int:
        return int(self.mesh.size(self.dims.index(name)))

    def reduced_grads(self, name: str, ps: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The local values of one module's replicated parameters used on this rank's shard
        of the activations (sequence positions, heads): their
        local gradients are partial sums over ``name``, all-reduced so that each parameter's
        gradient is ``Replicate`` like the parameter (an optimizer step or a norm then needs
        no collective). With :attr:`.plan.Plan.grads_after_backward`, the gradients are
        ``Partial`` through backward and one callback reduces them all at its end
        (:func:`.region.reduce_partial_grads`); else (and inside ``torch.func``
        transforms) in this module's backward, in one
        collective per dtype. Nothing here holds state of the pass: compiled, identical
        blocks trace alike."""
        if _in_transform():
            return C.enter_all([_constant(p, local=True) for p in ps], self.axis(name))
        dts = [p for p in ps if isinstance(p, DTensor)]
        assert len(dts) == len(ps)
        if not self.after:
            return C.enter_all([p.to_local(grad_placements=p.placements) for p in dts], self.axis(name))
        i = self.param_dims.index(name)
        return tuple(p.to_local(grad_placements=[Partial() if j == i else pl for j, pl in enumerate(p.placements)])
                     for p in dts)

    def scoped(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` run as one pass: the entries it makes are shared by the modules it
        calls and forgotten when it returns (the outermost scoped call owns them; the root
        and every parent of column modules are scoped, so a checkpointed layer's
        recomputation, which runs outside the root's pass, has its own)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            compiling = torch.compiler.is_compiling()
            if self.entries is not None and self.traced == compiling:
                return forward(*args, **kwargs)
            # a module compiled on its own (a block, torchtitan's way) inside an eager pass opens
            # a pass of its own: its graph never holds the eager pass's tensors, which dynamo
            # would return as outputs aliasing each other (refused beside DTensor parameters)
            outer = self.entries, self.traced
            self.entries, self.traced = [], compiling
            try:
                return forward(*args, **kwargs)
            finally:
                self.entries, self.traced = outer

        return run

    def enter(self, x: torch.Tensor, name: str, seq: int | None, group: str, sliced: bool = False) -> torch.Tensor:
        """Enter the TP region once per input tensor within a pass: columns of one entry
        ``group`` (:attr:`.plan.ModulePlan.entry_group`: siblings the plan knows are called
        on one value) handed the same tensor share one entry, so autograd sums their input
        gradients before a single collective. A group is one value wherever the columns
        sit (:func:`.plan._entry_key`): the cross-attention k/v of every decoder block read
        the encoder's output, and enter once for all of them. Tensors are matched by
        identity or as whole aliases of one base (module backward hooks hand each module
        its own alias), never by storage address, so ``torch.func`` transforms and
        ``torch.compile`` see plain code; every rank runs the same module code, so every
        rank hits or misses alike. Anything else enters again: one more collective, the
        same numbers. The pass remembers its last :data:`_RECENT` entries, the one hit
        last counting as new (a decoder block's entry on the encoder's output is hit by
        the next block's). ``sliced``: a
        gather along ``seq`` whose gradient is whole on every rank (this rank's slice of it
        comes back), where more than columns read what it gathers (:func:`.chains._shared_gathers`)."""
        axis = self.axis(name)
        return self._once(x, ("enter", name, seq, group, sliced), lambda: (
            C.enter(x, axis) if seq is None else C.gather(x, seq, axis) if sliced else C.gather_rs(x, seq, axis)))

    def split(self, x: torch.Tensor, dim: int, name: str, padded: bool, group: str) -> torch.Tensor:
        """This rank's features of a whole ``x`` along ``dim`` (a row's input), once per
        input tensor within a pass, as :meth:`enter` is: rows of one ``group`` handed the
        same whole tensor (two rows on one attention's hidden states) share the split, so
        autograd sums their input gradients before the one gather back. ``padded``: the
        gradient is put back among zeros (:func:`.collectives.split_padded`), with no gather."""
        axis = self.axis(name)
        return self._once(x, ("split", name, dim % x.dim(), padded, group),
                          lambda: (C.split_padded if padded else C.split)(x, dim, axis))

    def _once(self, x: torch.Tensor, key: tuple[Any, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, or what it made for ``x`` under ``key`` (its kind first) earlier in
        the pass (one opened alike, eagerly or while a compiler traces: see :meth:`scoped`)."""
        entries = self.entries if self.traced == torch.compiler.is_compiling() else None
        if entries is not None:
            for i, (prev, prev_key, made) in enumerate(entries):
                if prev_key == key and same_tensor(prev, x):
                    entries.append(entries.pop(i))
                    return made
        made = make()
        if entries is not None:
            entries.append((x, key, made))
            # the last few of each kind: a row's splits never push out the columns' entries
            kind = [i for i, (_, k, _) in enumerate(entries) if k[0] == key[0]]
            for i in reversed(kind[:-_RECENT]):
                del entries[i]
        return made


def _in_transform() -> bool:
    """Whether a ``torch.func`` transform is under way (never asked while a compiler
    traces: it cannot read functorch's state, and ``torch.func`` runs eagerly here)."""
    return not torch.compiler.is_compiling() and bool(torch._C._are_functorch_transforms_active())


class _ToLocal(torch.autograd.Function):
    """``DTensor.to_local`` that ``torch.func`` transforms accept (DTensor's own is an
    autograd Function without ``setup_context``): forward this rank's shard, backward the
    local gradient as a DTensor of the parameter's layout (built directly, no Function)."""

    @staticmethod
    def forward(p: DTensor) -> torch.Tensor:  # type: ignore[override]
        return p._local_tensor.view_as(p._local_tensor)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.spec = _underlying(inputs[0])._spec  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:  # type: ignore[override]
        spec = ctx.spec
        meta = TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, grad.dtype)
        out_spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
        # the local gradient itself, not functorch's wrapper of it, whose storage ends with the
        # transform (first-order gradients: a torch.func.grad over these is not supported)
        return DTensor(_underlying(grad).contiguous(), out_spec, requires_grad=False)


def _underlying(t: torch.Tensor) -> torch.Tensor:
    """The tensor under ``torch.func``'s wrappers (a DTensor parameter is wrapped, not a DTensor)."""
    while not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _constant(p: torch.Tensor, *, local: bool) -> torch.Tensor:
    """A parameter's value inside a ``torch.func`` transform: this rank's shard (``local``)
    or the full tensor, differentiable (``torch.func.grad`` over the parameters), read
    without DTensor's ``to_local``/``redistribute``, autograd Functions without
    ``setup_context`` that transforms refuse."""
    inner = _underlying(p)
    assert isinstance(inner, DTensor)
    t = _ToLocal.apply(p)
    if local:
        return t
    for mesh_dim in reversed(range(inner.device_mesh.ndim)):
        placement = inner.placements[mesh_dim]
        if isinstance(placement, _StridedShard):
            raise NotImplementedError(
                "a packed (_StridedShard) parameter of a module run on gathered parameters cannot be "
                "gathered inside a torch.func transform; shard it with packed=1 or call the model outside it"
            )
        if isinstance(placement, Shard):
            t = C.gather(t, placement.dim, (inner.device_mesh, mesh_dim))
    return t


def _is_dtensor(p: torch.Tensor | None) -> bool:
    return isinstance(p, DTensor) or (p is not None and _in_transform() and isinstance(_underlying(p), DTensor))


def _local(p: torch.Tensor | None) -> torch.Tensor | None:
    if not _is_dtensor(p):
        return p
    assert p is not None
    return _constant(p, local=True) if _in_transform() else p.to_local()  # type: ignore[attr-defined]


def _role_forward(rt: _Runtime, m: nn.Module, mp: ModulePlan, member: bool) -> Callable[..., Any]:
    """A sharded module's forward on local tensors, read off its role's transfer:

    * what it takes: whole features (a column) enter the region (the all-reduce of their
      gradient; gathered first where they arrive split), unless its caller entered for it
      (:attr:`ModulePlan.entered`) or a chain's parent gathered the sequence for it
      (``member``: the module is itself a chain member and gathers its own input); this
      rank's features (a row) are split from a whole input, which a row the plan takes to
      be fed them (:attr:`ModulePlan.split_input`) refuses instead; token ids pass;
    * what it gives: this rank's features stay so for the rows they pair with, else are
      gathered (a packed column's chunks put back in order) or moved to what a
      ``fwd_post`` sync states; a partial sum is reduced (scattered along the sequence in
      a chain, or moved to a stated layout), its bias added once after the sum.
    """
    role = mp.role
    assert role is not None
    ax = role.mesh_axis
    axis, size, rank = rt.axis(ax), rt.size(ax), rt.mesh.get_local_rank(rt.dims.index(ax))
    seq = mp.seq.seq_axis if mp.seq is not None and mp.seq.mesh_axis == ax else None
    full_in = _in_width(m)
    out_sync = next((s for s in mp.syncs if s.mode == "fwd_post"), None)
    group = mp.entry_group or _parent(mp.path)  # columns of one group handed one tensor enter once
    scatter = None if seq is None else _sequence_split(
        mp.path, seq, functools.partial(C.reduce_scatter, dim=seq, axis=axis))

    def whole_in(x: torch.Tensor) -> torch.Tensor:
        d = role.feature_dim(x.dim())
        if full_in is not None and x.shape[d] != full_in:  # arrived sharded (a column chain)
            x = C.gather(x, d, axis)
        if seq is None:  # outside a chain: it enters, unless its caller entered for it
            return x if mp.entered or mp.entered_at else rt.enter(x, ax, None, group)
        if member:
            return rt.enter(x, ax, seq, group)
        if mp.shared_gather or mp.side_input:
            # its parent gathered the input for more than its columns (its gradient sliced back),
            # or this is the parent's other input (not gathered): the column enters itself
            return rt.enter(x, ax, None, group)
        return x  # its parent gathered the sequence for it

    def split_in(x: torch.Tensor) -> torch.Tensor:
        d = role.feature_dim(x.dim())
        if full_in is not None and size > 1 and x.shape[d] == full_in:  # arrived replicated
            if mp.split_input:
                raise LayoutError("tensor parallel forward", [_whole_input_problem(mp, full_in, size)])
            x = rt.split(x, d, ax, mp.pads_split, mp.entry_group or f"own {mp.path}")
        return x

    def reduce(y: torch.Tensor) -> torch.Tensor:
        if out_sync is not None:
            return C.redistribute(y, Partial(), out_sync.layout, axis)
        return C.reduce(y, axis) if scatter is None else scatter(y)

    def summed(y: torch.Tensor) -> torch.Tensor:
        b = _local(role.bias_after(m))
        if b is not None and _sharded_output(seq, out_sync):
            # each rank adds its share before the reduce-scatter, which adds the bias once; its
            # gradient is then the whole one on every rank (see BiasShare): no collective
            return reduce(role.add_bias(y, BiasShare.apply(b, size)))
        y = reduce(y)
        return y if b is None else role.add_bias(y, b)

    def features(y: torch.Tensor, ids: bool) -> torch.Tensor:
        if role.keeps:  # this rank's features in, the same out: between a column and its row
            return y
        d = role.feature_dim(y.dim())
        kept_local = out_sync is None and mp.partnered
        if role.packed > 1 and not kept_local and not _is_last_dim_shard(out_sync, y.dim()):
            # this rank's output is [Q_r|K_r|V_r]: gathered, the chunks are put back in order
            full = C.unpack(C.gather(y, d, axis), role.packed, size)
            return full if out_sync is None else C.redistribute(full, Replicate(), out_sync.layout, axis)
        if out_sync is not None:
            return C.redistribute(y, Shard(d), out_sync.layout, axis)
        return y if kept_local else C.gather(y, d, axis)

    # the parameters its local forward reads whole (a LoRA's A in a column): their local
    # gradients are partial sums, reduced as a sequence-parallel norm's are
    whole = whole_params(m, role) if mp.local_params else ()

    def local_of() -> Callable[[torch.Tensor | None], torch.Tensor | None]:
        if not whole:
            return _local
        ps = [m._parameters[n] for n in whole]  # the module's, or torch.func.functional_call's
        return reading(list(zip(ps, rt.reduced_grads(ax, ps), strict=True)), _local)  # type: ignore[arg-type]

    def forward(x: torch.Tensor) -> torch.Tensor:
        takes = role.takes(x.dim())
        if takes is not None:
            x = split_in(x) if isinstance(takes, Shard) else whole_in(x)
        y = role.local_forward(m, x, rank, local_of())
        return summed(y) if isinstance(role.gives(y.dim()), Partial) else features(y, takes is None)

    return forward


def _is_last_dim_shard(sync: SyncSpec | None, ndim: int) -> bool:
    return sync is not None and isinstance(sync.layout, Shard) and sync.layout.dim % ndim == ndim - 1


def _whole_input_problem(mp: ModulePlan, full_in: int, size: int) -> Problem:
    """Why a row that the plan takes to be fed this rank's features refuses all of them."""
    if mp.partners and not any(s.mode == "fwd_pre" for s in mp.syncs):
        return Problem(
            mp.path,
            f"takes this rank's {full_in // size} of the {full_in} features its column-parallel partners "
            f"({', '.join(map(repr, mp.partners))}) keep split, but all {full_in} arrived: the code between "
            "them broadcast this rank's heads against values made for all heads (a position bias such as "
            "ALiBi, built by the model for every head) — the numbers would be wrong",
            "gather the columns' outputs (sf.sync(sch, '<column>', 'fwd_post', Replicate())), keep the "
            "attention's projections unsharded, or replace it (sf.replace) by one written for this rank's heads",
        )
    return Problem(
        mp.path,
        f"was planned to take this rank's {full_in // size} of its {full_in} input features (as a fwd_pre sync's "
        f"src=Shard(-1) states, or as its partners make them), but all {full_in} arrived: explain's counts and "
        "what the sync converts would not be what runs",
        f"state what arrives: sf.sync(sch, {mp.path!r}, 'fwd_pre', Shard(-1), src=Replicate()), or drop the sync",
    )


def _generic(rt: _Runtime, m: nn.Module, mp: ModulePlan, forward: Callable[..., Any]) -> Callable[..., Any]:
    names = [n for n, p in m._parameters.items() if isinstance(p, DTensor)]
    ax = _local_axis(mp)
    # callables at its boundaries are the module's tensor-parallel code (Slapo's embedding
    # masking around its rows' shard): its own forward runs on this rank's shards
    own_code = any(s.fn is not None for s in mp.syncs)

    def run(*args: Any, **kwargs: Any) -> Any:
        params: dict[str, torch.Tensor] = {}
        reduced: dict[str, torch.Tensor] = {}
        for n in names:
            p = getattr(m, n)  # the module's, or torch.func.functional_call's tensor in its place
            inner = _underlying(p)
            assert isinstance(inner, DTensor)
            if any(isinstance(pl, Shard | _StridedShard) for pl in inner.placements) and not own_code:
                params[n] = (
                    _constant(p, local=False)
                    if _in_transform()
                    else p.redistribute(placements=[Replicate()] * len(p.placements)).to_local()
                )
            elif mp.local_params:
                reduced[n] = p
            else:
                params[n] = _local(p)  # type: ignore[assignment]
        if reduced:  # the module's replicated parameters, their gradients reduced together
            params.update(zip(reduced, rt.reduced_grads(ax, list(reduced.values())), strict=True))
        with _local_padding_row(m, own_code), _reparametrize_module(m, params):
            return forward(*args, **kwargs)

    return run


@contextlib.contextmanager
def _local_padding_row(m: nn.Module, own_code: bool) -> Iterator[None]:
    """An embedding that runs its own forward on this rank's rows (its weight split by
    vocabulary, callables around it) has its padding row (whose gradient ``nn.Embedding``
    zeroes) as this rank's local index, or none where another rank holds it: the global
    index would zero the gradient of another token's row here."""
    pad = m.padding_idx if isinstance(m, nn.Embedding) and own_code else None
    inner = None if pad is None else _underlying(m._parameters["weight"])  # type: ignore[arg-type]
    if pad is None or not isinstance(inner, DTensor) or not any(
            isinstance(pl, Shard) and pl.dim == 0 for pl in inner.placements):
        yield
        return
    assert isinstance(m, nn.Embedding)
    shape, offset = compute_local_shape_and_global_offset(inner.shape, inner.device_mesh, inner.placements)
    local = pad - offset[0]
    m.padding_idx = local if 0 <= local < shape[0] else None
    try:
        yield
    finally:
        m.padding_idx = pad


def _distribute(model: nn.Module, sch: Schedule, rt: _Runtime) -> None:
    """Every parameter becomes a DTensor on the parameter mesh: its layout where it has
    one, ``Replicate`` elsewhere, so optimizers (foreach, fused) and ``clip_grad_norm_``
    see one kind of tensor. Each rank keeps its own chunk (no communication: every rank
    holds the full value); a tied parameter stays one tensor, with the layout any of its
    paths has (a tie sharded on one side: the model then runs on DTensor activations)."""
    memo: dict[int, nn.Parameter] = {}
    # the paths with a layout first: a tie takes the layout of whichever path has one
    targets: dict[str, Layout | None] = dict(sch.annotations.of_kind(LAYOUT))
    for n, _ in model.named_parameters(remove_duplicate=False):
        targets.setdefault(n, None)
    replicate = [Replicate()] * len(rt.param_dims)
    for path, lay in targets.items():
        tokens = split(path)
        owner = get_module(model, ".".join(tokens[:-1]))
        if tokens[-1] in owner._buffers:  # a running statistic split with its channels
            _distribute_buffer(owner, tokens[-1], lay, rt)
            continue
        p = owner._parameters[tokens[-1]]
        if p is None or isinstance(p, DTensor):
            continue
        if id(p) not in memo:
            placements = replicate if lay is None else [lay.placements[rt.dims.index(d)] for d in rt.param_dims]
            dt = distribute_tensor(p.detach(), rt.param_mesh, placements, src_data_rank=None)
            new = nn.Parameter(dt, requires_grad=p.requires_grad)
            new.__dict__.update({k: v for k, v in p.__dict__.items() if k != "grad"})
            memo[id(p)] = new
        owner._parameters[tokens[-1]] = memo[id(p)]


def _distribute_buffer(owner: nn.Module, name: str, lay: Layout | None, rt: _Runtime) -> None:
    """A buffer with a layout (a BatchNorm's running statistics, split with its channels)
    becomes a DTensor of it, so that a checkpoint saves each rank's shard and loads it back
    into any layout; the module's forward updates this rank's shard in place."""
    b = owner._buffers[name]
    if b is None or isinstance(b, DTensor) or lay is None:
        return
    placements = [lay.placements[rt.dims.index(d)] for d in rt.param_dims]
    owner._buffers[name] = distribute_tensor(b, rt.param_mesh, placements, src_data_rank=None)


def _adjust_packed_parent(model: nn.Module, path: str, role: Role, rt: _Runtime) -> None:
    """A packed column module's parent that splits its output by a full-size attribute
    (GPT-2 attention's ``split_size``) gets the local size on build's copy."""
    out = _out_features(get_module(model, path)) or 0
    parent = get_module(model, _parent(path))
    chunk = out // role.packed
    if getattr(parent, "split_size", None) == chunk:
        object.__setattr__(parent, "split_size", chunk // rt.size(role.mesh_axis))


def _adjust_head_counts(model: nn.Module, sch: Schedule, path: str, role: Role, rt: _Runtime,
                        adjusted: set[tuple[int, str]]) -> None:
    """The parent (attention) of a column module whose output stays sharded runs on this
    rank's heads: each of its head counts and widths :func:`.plan.heads_made_local` names
    becomes this rank's share on build's copy."""
    parent = get_module(model, _parent(path))
    for attr in heads_made_local(sch, path, role.packed):
        key = (id(parent), attr)
        if key not in adjusted:
            object.__setattr__(parent, attr, vars(parent)[attr] // rt.size(role.mesh_axis))
            adjusted.add(key)


_KEYS: tuple[Key[Any], ...] = (ROLE, SEQ, SYNC, RNG, LOCAL, EXPERTS)


def refused(sch: Schedule) -> list[Problem]:
    """What :func:`slapo_fn.build` of ``sch`` refuses for its layouts (pure, no process
    group): a pipeline checks every stage's on every rank, so that all refuse together."""
    if not any(sch.annotations.of_kind(k) for k in _KEYS):
        return []
    return refusals(sch, plan(sch))


def apply_tensor_parallel(model: nn.Module, sch: Schedule, strict: bool = False) -> None:
    """The ``tensor_parallel`` build phase (on build's private copy ``model``)."""
    if not any(sch.annotations.of_kind(k) for k in _KEYS):
        return
    p = plan(sch)
    problems = refusals(sch, p)
    if problems:
        raise LayoutError("build", problems)
    if strict:
        problems = implicit(p)
        if problems:
            raise LayoutError("build(strict=True)", problems)
    rt = _Runtime(sch, p.grads_after_backward)
    _distribute(model, sch, rt)
    regions = regions_of(sch, p)
    # the parameters whose gradients are put in their placements: every region's, and where they
    # wait for the end of backward, those of the modules on local shards that leave them partial
    # sums; one callback then reduces them all together
    placed: list[torch.Tensor] = []
    for root in regions:  # what the plan cannot prove runs on DTensors there (the whole model: "")
        placed += install_on_dtensors(model, sch, p, Activations(rt.param_mesh, rt.param_dims),
                                      lambda ax: rt.mesh.get_local_rank(rt.dims.index(ax)),
                                      functools.partial(_experts_on_dtensors, rt), root)
    if "" in regions:
        reduce_partial_grads(placed, after_backward=p.grads_after_backward)
        return
    # the rest on local shards, as planned
    p = replace(p, modules={q: mp for q, mp in p.modules.items()
                            if not any(within(r, q) for r in regions)})
    seq_roots = set(sch.annotations.of_kind(SEQ))
    # a column whose caller is strictly inside a chain member (attention, MLP) has its input
    # gathered by that caller, so that model code reshaping it sees the whole sequence; any
    # other (a member itself, or called by one beside the residual stream, as nanoGPT's block
    # calls its MLP's layers in a ModuleDict) gathers its own
    gathers_own = {q for q in p.modules if not any(contains(r, caller_path(model, q)) for r in seq_roots)}
    adjusted: set[tuple[int, str]] = set()
    for path, mp in p.modules.items():
        m = get_module(model, path)
        forward: Callable[..., Any] = m.forward
        if mp.experts is not None:
            ep, etp = mp.experts.mesh_axis, mp.experts.tensor_axis
            axes = (rt.axis(ep) if ep else None, rt.axis(etp) if etp else None)
            forward = experts_forward(m, mp.experts, axes, forward, _local_value)
            if ep is not None:
                _adjust_expert_count(m, mp.experts.num_experts, mp.experts.local_experts(rt.size(ep)))
        elif mp.role is not None and not mp.role.own_forward:
            forward = _role_forward(rt, m, mp, path in gathers_own)
            if mp.keeps_features:  # not where the output is gathered: the parent then sees all of it
                if mp.role.packed > 1:
                    _adjust_packed_parent(model, path, mp.role, rt)
                _adjust_head_counts(model, sch, path, mp.role, rt, adjusted)
        elif (mp.role is not None and mp.role.own_forward) or mp.local_params:
            forward = _generic(rt, m, mp, forward)
        forward = _wrap_boundaries(rt, mp, forward, ids=isinstance(m, nn.Embedding), module=m)
        if mp.read_as_3d:
            forward = _read_as_3d(mp, forward)
        if mp.rng is not None:
            forward = forked(forward, rt.mesh.get_local_rank(rt.dims.index(mp.rng.mesh_axis)))
        m.forward = _settling(forward)  # type: ignore[method-assign]
    _localise_replicated(model, sch, p, set(regions))
    if p.grads_after_backward:
        placed += [param for mp in p.modules.values() if mp.local_params
                   for param in get_module(model, mp.path).parameters(recurse=False)]
    reduce_partial_grads(placed, after_backward=p.grads_after_backward)
    # sequence parallel: a column group's parent (attention, MLP) all-gathers its input along the
    # sequence, so that model code reading the input's shape (HF attention's view) sees the full length
    for parent, (ax, seq_axis, shared) in _sp_parents(model, p, gathers_own).items():
        pm = get_module(model, parent)
        pm.forward = _gathering(pm.forward, rt.axis(ax), seq_axis, shared)  # type: ignore[method-assign]
    # a parent that runs on this rank's heads and fails on their shapes (a head count it takes
    # from its config, a fused projection it splits by full sizes) says so as a LayoutError
    heads_of = {caller_path(model, mp.path): mp.role.mesh_axis for mp in p.modules.values()
                if mp.keeps_features and mp.role is not None}
    for parent in sorted({caller_path(model, mp.path) for mp in p.modules.values()
                          if mp.enters and mp.partnered}):
        pm = get_module(model, parent)
        operands = per_head_operands(sch, parent) if parent in heads_of else {}
        counts = _head_counts(get_module(sch.module, parent), pm, rt.size(heads_of[parent])) if operands else None
        if operands and counts is not None:
            pm.forward = _per_head(rt, parent, pm, operands, heads_of[parent], *counts)  # type: ignore[method-assign]
        pm.forward = _explained(parent, pm.forward)  # type: ignore[method-assign]
    # a parent adding its children's operands to their outputs itself (a decomposed Linear's
    # bias) adds this rank's share of each: the one its child's output holds
    for parent, names in sorted(_operand_reads(sch, model, p).items()):
        pm = get_module(model, parent)
        pm.forward = _reading_local(pm, names, pm.forward)  # type: ignore[method-assign]
    # a caller whose first argument reaches its columns alone enters the region for them, once
    entering = {caller_path(model, mp.path): mp.role.mesh_axis for mp in p.modules.values()
                if mp.entered and mp.role is not None}
    for path, ax in sorted(entering.items()):
        pm = get_module(model, path)
        pm.forward = _entering(pm.forward, rt.axis(ax))  # type: ignore[method-assign]
    # columns entering one by one share an entry per input tensor within one pass of the root,
    # or of their parent (see _Runtime.scoped), and rows splitting a whole input share the split
    matched = {caller_path(model, mp.path) for mp in p.modules.values()
               if (mp.enters and not (mp.entered or mp.entered_at))
               or (mp.role is not None and mp.role.splits_input and not mp.split_input)}
    for path in sorted(matched | ({""} if matched else set())):
        pm = get_module(model, path)
        pm.forward = rt.scoped(pm.forward)  # type: ignore[method-assign]


def _operand_reads(sch: Schedule, model: nn.Module, p: Plan) -> dict[str, tuple[str, ...]]:
    """Per parent of a module planned on local shards, the parameters of its planned
    children its code adds to their outputs itself (:attr:`.flow.Flow.operands`), by their
    paths relative to it."""
    found: dict[str, set[str]] = {}
    for path in p.modules:
        parent = caller_path(model, path) if path else None
        fl = _flow_of(sch, parent) if parent is not None else None
        child = relative(parent, path) if parent is not None else path
        if fl is not None and child in fl.operands:
            found.setdefault(parent or "", set()).update(join(child, n) for n in fl.operands[child])
    return {parent: tuple(sorted(names)) for parent, names in found.items()}


def _reading_local(module: nn.Module, names: Sequence[str], forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` of ``module`` with its children's parameters ``names`` read as this
    rank's shards (plain tensors whose gradients flow back to the parameters')."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with _reparametrize_module(module, {n: _local(tensor_at(module, n)) for n in names}):  # type: ignore[misc]
            return forward(*args, **kwargs)

    return run


def _local_value(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (a plain tensor is its own)."""
    value = _local(p)
    assert value is not None
    return value


def _adjust_expert_count(m: nn.Module, total: int, local: int) -> None:
    """An experts module run on this rank's experts sizes its routing tables by its expert
    count (Hugging Face's grouped forward bins pairs per expert): on build's copy the count
    becomes the local one, as a head count does for attention."""
    for attr in _EXPERT_COUNTS:
        if vars(m).get(attr) == total:
            object.__setattr__(m, attr, local)


def _localise_replicated(model: nn.Module, sch: Schedule, p: Plan, apart: set[str]) -> None:
    """Modules the plan does not give a forward of their own compute on local tensors:
    each module on the way to a planned one (attention, MLP, a decoder layer, the root)
    swaps in, for the length of its forward, the local values of its own replicated
    parameters and of every parameter in its subtrees that hold nothing planned (norms,
    embeddings, rotary tables, a child whose weight it reads directly, as
    ``nn.MultiheadAttention`` reads ``out_proj.weight``). Their gradients are
    ``Replicate``: every rank computes the same ones on replicated activations.

    An FSDP block sets its own parameters in its pre-forward hook, and a checkpointed
    module is recomputed outside its ancestors' forwards, so each of them localises its
    own subtree instead of its parent doing so. The
    DTensor regions ``apart`` (:mod:`.regions`) read their parameters as DTensors: left out."""
    spec = sch.annotations.get("", DATA_PARALLEL)
    # a checkpointed module is recomputed in backward, outside its ancestors' forwards: it
    # swaps its own subtree's values in, as an FSDP block does, so its recomputation sees them
    # (inside a region, parameters are read as DTensors: nothing to swap)
    blocks = (set(spec.blocks) if spec is not None else set()) | {
        q for q in sch.annotations.of_kind(CHECKPOINT) if not any(within(r, q) for r in apart)}
    planned = set(p.modules) | apart
    on_the_way = {join(*split(q)[:i]) for q in planned for i in range(len(split(q)) + 1)}

    def subtree(path: str, module: nn.Module, prefix: str) -> list[str]:
        names = [join(prefix, n) for n, t in module._parameters.items() if t is not None]
        for name, child in module._modules.items():
            cp = join(path, name)
            if child is not None and cp not in blocks and cp not in apart:
                names += subtree(cp, child, join(prefix, name))
        return names

    def beside(path: str, module: nn.Module, prefix: str) -> list[str]:
        # the subtrees below ``module`` that hold nothing planned; a container on the way is
        # never called (the loop of the module holding it calls its items), so its items'
        # subtrees are localised by that module
        names: list[str] = []
        for name, child in module._modules.items():
            cp = join(path, name)
            if child is None or cp in blocks or cp in apart:
                continue
            if cp not in on_the_way:
                names += subtree(cp, child, join(prefix, name))
            elif uncalled(child):
                names += beside(cp, child, join(prefix, name))
        return names

    def install(path: str, names: list[str]) -> None:
        if names:
            m = get_module(model, path)
            m.forward = _replicated(m, tuple(names), m.forward)  # type: ignore[method-assign]

    for path in sorted(on_the_way, key=lambda q: len(split(q))):
        m = get_module(model, path)
        mp = p.modules.get(path)
        # a role's forward (or _generic's) reads its module's own parameters itself
        own = mp is None or not (
            mp.local_params
            or mp.experts is not None
            or mp.role is not None
        )
        if uncalled(m) or path in apart:
            continue
        names = [n for n, t in m._parameters.items() if t is not None] if own else []
        install(path, names + beside(path, m, ""))
    for path in sorted(blocks - on_the_way):
        if path_exists(model, path):  # a pipeline stage holds only its own blocks
            install(path, subtree(path, get_module(model, path), ""))


def _replicated(m: nn.Module, names: tuple[str, ...], forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        # getattr, not get_parameter: under torch.func.functional_call they are plain tensors
        local = {n: _local(tensor_at(m, n)) for n in names}
        with _reparametrize_module(m, local):  # type: ignore[arg-type]
            return forward(*args, **kwargs)

    return run


def _read_as_3d(mp: ModulePlan, forward: Callable[..., Any]) -> Callable[..., Any]:
    """An output handed to its parent as this rank's features, whose parent's code the
    plan read with it taken as (batch, sequence, features) (:attr:`ModulePlan.read_as_3d`):
    an output of another rank is refused, since the reading would be wrong for it (a
    ``softmax(1)`` over a 2-D ``(batch, features)`` output is over this rank's features)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        slot = output_slot(out)
        first = out if slot == -1 else None if slot is None else out[slot]
        if isinstance(first, torch.Tensor) and first.dim() != ASSUMED_RANK:
            raise LayoutError("tensor parallel forward", [Problem(
                mp.path,
                f"hands its parent this rank's share of its output features, and slapo_fn read the parent's code "
                f"({mp.read_as_3d}) with that output taken as (batch, sequence, features); it has "
                f"{first.dim()} dimensions, so the reading may be wrong (a dimension taken for the sequence may be "
                "the features)",
                f"gather its output, sf.sync(sch, {mp.path!r}, 'fwd_post', Replicate()) (its row partner then splits "
                "the whole input), or leave it unsharded",
            )])
        return out

    return run


def _head_counts(original: nn.Module, local: nn.Module, size: int) -> tuple[int, int] | None:
    """An attention's whole and local head counts: the first query-head count among its
    attributes, as the model has it and as build made it this rank's; ``None`` where it
    has none, or build did not make it local."""
    for attr in QUERY_HEAD_ATTRS:
        whole, mine = vars(original).get(attr), vars(local).get(attr)
        if isinstance(whole, int) and isinstance(mine, int):
            return (whole, mine) if whole == mine * size and size > 1 else None
    return None


def _per_head(rt: _Runtime, path: str, module: nn.Module, operands: Mapping[str, Meets], ax: str, whole: int,
              local: int) -> Callable[..., Any]:
    """``module``'s forward, running on this rank's ``local`` of its ``whole`` heads, with each
    argument its code adds to the heads (:func:`.plan.per_head_operands`: MPT's ALiBi bias,
    built by the model for every head) cut to this rank's heads along the dimension that
    meets them; where that dimension is the batch and the heads merged (BLOOM's), the batch
    is its first argument's (the hidden states). One of size 1 there broadcasts over the
    heads (a mask), and one already of ``local`` heads is this rank's: both pass as they
    are. A learned one (it requires a gradient) is refused: its gradient would have to be
    gathered over the heads."""
    forward = module.forward
    names = [q.name for q in list(inspect.signature(type(module).forward).parameters.values())[1:]
             if q.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    rank = rt.mesh.get_local_rank(rt.dims.index(ax))

    def cut(name: str, meets: Meets, x: Any, batch: int | None) -> Any:
        dim = meets.dim
        if not isinstance(x, torch.Tensor) or x.dim() < -dim:
            return x
        # merged, the batch and heads are its first dimension; one more dimension holds them apart
        # (Falcon's (batch, heads, 1, keys) bias, which its attention views as BLOOM's is merged)
        merged = meets.merged and x.dim() == -dim
        per = 1 if not merged else batch
        size = x.shape[dim]
        if per is not None and size in (1, per, per * local):
            return x
        if per is None or size != per * whole or x.requires_grad:
            with_batch = f" merged with the batch of {per}" if merged and per is not None else ""
            why = ("is learned (it requires a gradient), which would have to be gathered over the heads"
                   if per is not None and size == per * whole else
                   "comes with no hidden states to read the batch from" if per is None else
                   f"has {size} there, neither 1, this rank's {local} nor all {whole} heads{with_batch}")
            raise LayoutError("tensor parallel forward", [Problem(
                path,
                f"runs on this rank's {local} of its {whole} heads and adds its argument {name!r} to them; that "
                f"argument, of shape {tuple(x.shape)}, meets the heads at dimension {dim} and {why}",
                "keep this module's projections unsharded, or gather their outputs: "
                "sf.sync(sch, '<column>', 'fwd_post', Replicate())",
            )])
        if not merged:
            return x.narrow(dim, rank * local, local)
        d = x.dim() + dim
        return x.unflatten(d, (per, whole)).narrow(d + 1, rank * local, local).flatten(d, d + 1)

    def run(*args: Any, **kwargs: Any) -> Any:
        given = list(args)
        first = given[0] if given else kwargs.get(names[0]) if names else None
        batch = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else None
        for name, meets in operands.items():
            if name in kwargs:
                kwargs[name] = cut(name, meets, kwargs[name], batch)
            elif name in names and names.index(name) < len(given):
                given[names.index(name)] = cut(name, meets, given[names.index(name)], batch)
        return forward(*given, **kwargs)

    return run


_SHAPE_ERRORS = ("shape '", "must match the size of tensor", "invalid for input of size", "size mismatch")


def _explained(path: str, forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except RuntimeError as e:
            if not any(text in str(e) for text in _SHAPE_ERRORS):
                raise
            raise LayoutError("tensor parallel forward", [Problem(
                path,
                "runs on this rank's share of its column-parallel outputs (heads) and failed on their shapes "
                f"({str(e).splitlines()[0]}): it reshapes or splits them by sizes slapo_fn could not adjust (a "
                "head count read from its config, a fused projection in another order, a mask built for the "
                "whole sequence while sequence parallelism gathered only part of it)",
                "keep this module's projections unsharded (or out of sequence_parallel), replace it by a module "
                "whose local head counts are attributes (sf.replace), or gather the columns' outputs: "
                "sf.sync(sch, '<column>', 'fwd_post', Replicate())",
            )]) from e

    return run


def _sp_parents(model: nn.Module, p: Plan, members: set[str]) -> dict[str, tuple[str, int, bool]]:
    """The gathering parents: each with its mesh axis, the sequence's dimension, and
    whether more than its columns read what it gathers (:attr:`.plan.ModulePlan.shared_gather`)."""
    out: dict[str, tuple[str, int, bool]] = {}
    for mp in p.modules.values():
        role, seq = mp.role, mp.seq
        if mp.path in members:
            continue  # a chain member gathers its own input
        if role is not None and mp.enters and seq is not None and seq.mesh_axis == role.mesh_axis:
            out.setdefault(caller_path(model, mp.path), (role.mesh_axis, seq.seq_axis, mp.shared_gather))
    return out


def _gathering(forward: Callable[..., Any], axis: C.Axis, seq_axis: int, shared: bool) -> Callable[..., Any]:
    """The parent of columns inside a chain member gathers its first tensor input (the
    hidden states) along the sequence, once per call (a reduce-scatter of its gradient;
    ``shared``: it gathers for more than its columns, so its gradient, whole on every rank,
    is sliced back, see :attr:`.plan.ModulePlan.shared_gather`). A column called on its
    other input (a cross-attention's encoder states) enters the region itself
    (:attr:`.plan.ModulePlan.side_input`)."""
    gather = C.gather if shared else C.gather_rs

    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = map_input(args, kwargs, lambda x: C.settled(gather(x, dim=seq_axis, axis=axis)))
        return forward(*args, **kwargs)

    return run


def _settling(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` handing its result on with no collective pending (:func:`.collectives.settled`)."""
    return lambda *args, **kwargs: C.settled(forward(*args, **kwargs))


def _entering(forward: Callable[..., Any], axis: C.Axis) -> Callable[..., Any]:
    """``forward`` entering the tensor-parallel region with its first tensor argument
    (identity forward; all-reduce of its gradient backward): its columns share it."""

    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = map_input(args, kwargs, functools.partial(C.enter, axis=axis))
        return forward(*args, **kwargs)

    return run


def _sequence_split(path: str, seq_axis: int, split: Callable[[torch.Tensor], torch.Tensor]
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``split`` (along ``seq_axis``), refusing a tensor whose ``seq_axis`` is its last
    dimension: on a 2-D ``(batch, features)`` activation that is the features, and the
    chain would run norms and the parent's code on a share of them."""

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 0 and seq_axis % x.dim() == x.dim() - 1:
            raise LayoutError("tensor parallel forward", [Problem(
                path,
                f"sequence_parallel splits dimension {seq_axis} of its {x.dim()}-D activation "
                f"{tuple(x.shape)}, its last: that holds the features, not a sequence",
                "give sequence_parallel the dimension of the sequence (seq_axis=), or leave a model whose "
                "activations have no sequence out of sequence_parallel",
            )])
        return split(x)

    return run


def _wrap_boundaries(rt: _Runtime, mp: ModulePlan, forward: Callable[..., Any], ids: bool = False,
                     module: nn.Module | None = None) -> Callable[..., Any]:
    """``forward`` with ``mp``'s syncs and sequence_parallel entry and exit around it
    (``ids``: the module takes token ids, whose last dimension is the sequence). A sync
    with a callable runs it on ``module`` as PyTorch runs a module hook, in place of the
    collective (its stated layouts were checked by the plan)."""
    pre = [s for s in mp.syncs if s.mode == "fwd_pre"]
    bwd = [s for s in mp.syncs if s.mode == "bwd_post"]
    post = mp.posts
    if not (pre or bwd or post or mp.entry or mp.exit):
        return forward

    def convert(src: Placement, dst: Placement, mesh_axis: str) -> Callable[[torch.Tensor], torch.Tensor]:
        return functools.partial(C.redistribute, src=src, dst=dst, axis=rt.axis(mesh_axis))

    def run(*args: Any, **kwargs: Any) -> Any:
        if mp.entry is not None:
            e = mp.entry
            split = convert(Replicate(), Shard(e.seq_axis), e.mesh_axis)
            args, kwargs = map_input(args, kwargs, split if ids else _sequence_split(mp.path, e.seq_axis, split))
        called = args  # what a fwd_post callable reads: the module's inputs as its caller handed them
        for s in pre:
            if s.fn is not None:
                args = _pre_hooked(s.fn(module, args), args)
                continue
            args, kwargs = map_input(args, kwargs, convert(s.src or Replicate(), s.layout, s.mesh_axis))
        for s in bwd:  # sync validated these: Partial → Replicate (all-reduce) or nothing to do
            if isinstance(s.src, Partial):
                args, kwargs = map_input(args, kwargs, functools.partial(C.enter, axis=rt.axis(s.mesh_axis)))
        out = forward(*args, **kwargs)
        if (post or mp.exit is not None) and output_slot(out) is None:
            what = "a fwd_post sync" if post else "the sequence_parallel chain's exit"
            raise LayoutError("tensor parallel forward", [Problem(
                mp.path or "<root>",
                f"returned {type(out).__name__}, with no tensor for {what} to convert (a tensor, a tuple's first "
                "tensor, or a mapping's first tensor field other than loss)",
                "sync a module that returns its activation as a tensor (a child of this one), or drop the sync",
            )])
        for s in post:  # the plan filled in each sync's src (plan._resolved_syncs)
            if s.fn is not None:
                hooked = s.fn(module, called, out)
                out = out if hooked is None else hooked
                continue
            out = map_first_output(out, convert(s.src or Replicate(), s.layout, s.mesh_axis))
        if mp.exit is not None and not post:
            x = mp.exit
            # read by columns alone: the gather is their entry (reduce-scatter of their gradients)
            gather = (functools.partial(C.gather_rs, dim=x.seq_axis, axis=rt.axis(x.mesh_axis)) if mp.exit_columns
                      else convert(Shard(x.seq_axis), Replicate(), x.mesh_axis))
            out = map_first_output(out, gather)
        return out

    return run


def _pre_hooked(result: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The positional arguments after a forward-pre callable returned ``result``, as
    PyTorch reads a forward-pre hook's: ``None`` keeps them, a tuple replaces them, any
    other value is the first and only one."""
    if result is None:
        return args
    return result if isinstance(result, tuple) else (result,)


def _experts_on_dtensors(rt: _Runtime, acts: Activations, m: nn.Module, mp: ModulePlan,
                         forward: Callable[..., Any]) -> Callable[..., Any]:
    """An experts module inside a region: its local forward (:func:`.experts.experts_forward`)
    on whole (replicated) inputs, its whole output a replicated DTensor."""
    assert mp.experts is not None
    ep, etp = mp.experts.mesh_axis, mp.experts.tensor_axis
    axes = (rt.axis(ep) if ep else None, rt.axis(etp) if etp else None)
    local = experts_forward(m, mp.experts, axes, forward, _local_value)
    if ep is not None:
        _adjust_expert_count(m, mp.experts.num_experts, mp.experts.local_experts(rt.size(ep)))

    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = acts.locals_of((args, kwargs))
        return acts.to_dtensor(local(*args, **kwargs))

    return run
