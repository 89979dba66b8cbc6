"""``expert_parallel``: a mixture-of-experts block's experts spread over a mesh axis, with
tokens dispatched to their experts' ranks by all-to-all.

The rewrite records two things and validates eagerly: each fused expert parameter
(Hugging Face 5.x keeps them 3-D, e.g. ``experts.gate_up_proj`` of shape [E, 2I, H]) gets
a :class:`~slapo_fn.dtensor.layout.Layout` ``Shard(0)`` over the mesh axis, and the
experts module gets the role :class:`Experts`. The ``tensor_parallel`` build phase
installs :func:`experts_forward` on build's private copy; the model's router (and so its
auxiliary load-balancing loss) and the experts' own math are untouched: only *where*
each (token, expert) pair is computed changes.

How a step runs over ``ep`` ranks (activations are replicated over the axis, as
everywhere in slapo_fn):

1. the T tokens are cut into ``ep`` contiguous slices (padded to equal size); this rank
   keeps its slice (backward: one all-gather of the token and routing-weight gradients);
2. the ranks exchange their pair counts per expert (a small all-gather); its (token,
   expert) pairs, sorted by expert, go to the experts' ranks with one
   ``all_to_all_single`` of variable split sizes (backward: the reverse all-to-all);
3. each rank runs the model's own experts forward on what it received, with its local
   E/ep experts;
4. the results come back with the reverse all-to-all, are weighted by the router's
   weights and summed per token as the model does; an all-gather makes the output
   replicated again (backward: this rank's slice of the gradient, no communication).

Nothing is dropped unless ``capacity_factor`` is given: then each expert takes at most
``ceil(capacity_factor * T * top_k / E)`` pairs, the first ones in token order, and a
dropped pair contributes zero (as in Switch Transformer).

Example:
    >>> import slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> cfg = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
    >>> sch = sf.create_schedule(MixtralForCausalLM(cfg), mesh=fake_mesh(2, names=("ep",)))
    >>> sch = sf.expert_parallel(sch, "model.layers.*.mlp", mesh_axis="ep")
    >>> print(sch.annotations.get("model.layers.0.mlp.experts", EXPERTS))
    experts@ep(4)
    >>> print(sch.annotations.get("model.layers.0.mlp.experts.gate_up_proj", LAYOUT))
    (ep=S(0))
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.nn.utils.stateless import _reparametrize_module

from ..combinators import primitive
from ..errors import LayoutError, Problem, ScheduleTypeError
from ..hf import EXPERTS_PER_TOKEN_ATTRS, config_of, config_value, experts_transposed, gate_up_packing
from ..schedule import Key, Schedule
from ..select import Selection
from ..tree import get_module, join
from .collectives import Axis, _all_gather, _all_reduce, gather, reduce, wait
from .layout import Layout, describe, packed_shard
from .shard import LAYOUT, ROLE, _layout, _problem_mesh, mesh_dims

__all__ = [
    "EXPERTS",
    "ExpertCosts",
    "Experts",
    "expert_costs",
    "expert_parallel",
    "expert_tensor_parallel",
    "experts_forward",
    "find_experts",
]

EXPERTS: Key[Experts] = Key("experts")



@dataclass(frozen=True)
class Experts:
    """The role of an experts module: its ``num_experts`` experts (the leading dimension of
    each of ``params``) split evenly over the ranks of ``mesh_axis`` (expert parallelism:
    tokens reach them by all-to-all; ``None``: every rank holds every expert), and each
    expert's matrices split over ``tensor_axis`` (Megatron-style inside each expert: the
    intermediate dimension, output partial sums all-reduced; ``None``: whole).
    ``capacity_factor`` (``None``: exact) caps the pairs each expert takes per step."""

    mesh_axis: str | None
    num_experts: int
    params: tuple[str, ...]
    capacity_factor: float | None = None
    tensor_axis: str | None = None

    def __str__(self) -> str:
        cap = "" if self.capacity_factor is None else f", capacity {self.capacity_factor:g}"
        axes = "×".join(a for a in (self.mesh_axis, self.tensor_axis) if a)
        return f"experts@{axes}({self.num_experts}{cap})"

    def local_experts(self, size: int) -> int:
        """How many experts each of ``size`` ranks of ``mesh_axis`` holds."""
        return self.num_experts // size if self.mesh_axis is not None else self.num_experts

    def capacity(self, tokens: int, top_k: int) -> int | None:
        """The most (token, expert) pairs one expert takes for ``tokens`` tokens (``None``: no cap).

        >>> Experts("ep", 4, ("w",), capacity_factor=1.0).capacity(16, 2)
        8
        """
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * top_k / self.num_experts)


# ----------------------------------------------------------------------------- finding experts


def _expert_count(module: nn.Module) -> int | None:
    """``E`` if every direct parameter of ``module`` has leading dimension ``E`` and one is
    3-D (a fused stack of per-expert matrices), else ``None``."""
    params = [p for p in module._parameters.values() if p is not None]
    if not params or not any(p.dim() == 3 for p in params):
        return None
    sizes = {p.shape[0] for p in params if p.dim() >= 1}
    return int(next(iter(sizes))) if len(sizes) == 1 and all(p.dim() >= 2 for p in params) else None


def _takes_routing(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes (hidden_states, top_k_index, top_k_weights)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def find_experts(block: nn.Module, path: str = "") -> tuple[str, int] | None:
    """``(path of the experts module, number of experts)`` of a mixture-of-experts block
    (the block itself when it is the experts module), or ``None``: a child whose
    parameters are fused 3-D expert stacks and whose forward takes the routing
    (hidden_states, top_k_index, top_k_weights), as in Hugging Face 5.x Mixtral,
    Qwen2/3-MoE, DeepSeek-V3 and gpt-oss.

    >>> from torch import nn
    >>> find_experts(nn.Linear(2, 2)) is None
    True
    """
    own = _expert_count(block)
    if own is not None and _takes_routing(block):
        return path, own
    for name, child in block._modules.items():
        if child is None:
            continue
        count = _expert_count(child)
        if count is not None and _takes_routing(child):
            return join(path, name), count
    return None


# ----------------------------------------------------------------------------- the rewrite


def _check_arguments(what: str, mesh_axis: object, capacity_factor: object = None) -> None:
    typed = []
    if not isinstance(mesh_axis, str):
        typed.append(Problem("mesh_axis", f"expected a mesh-axis name, got {type(mesh_axis).__name__}",
                             "mesh_axis='ep'" if what == "expert_parallel" else "mesh_axis='tp'"))
    if capacity_factor is not None and (isinstance(capacity_factor, bool)
                                        or not isinstance(capacity_factor, int | float)):
        typed.append(Problem("capacity_factor", f"expected a number or None, got {type(capacity_factor).__name__}",
                             "capacity_factor=None (exact, nothing dropped) or e.g. 1.25"))
    if typed:
        raise ScheduleTypeError(what, typed)
    if capacity_factor is not None and not (isinstance(capacity_factor, int | float) and capacity_factor > 0):
        raise LayoutError(what, [Problem(
            "capacity_factor", f"is {capacity_factor}; it scales the pairs each expert takes and must be positive",
            "capacity_factor=None (exact), or a positive factor such as 1.25")])


def _not_moe(path: str, module: nn.Module) -> Problem:
    kind = type(module).__name__
    return Problem(
        path,
        f"a {kind} is not a mixture-of-experts block: no child holds fused 3-D expert parameters "
        "([num_experts, ...]) with a forward taking (hidden_states, top_k_index, top_k_weights)",
        "select the MoE blocks only, e.g. 'model.layers.*.mlp'; on models with dense layers in between "
        "(a config's mlp_only_layers) list the sparse ones",
    )


def _with(layout: Layout | None, sch: Schedule, mesh_axis: str, placement: Placement) -> Layout | None:
    """``layout`` (replicated if ``None``) with ``placement`` over ``mesh_axis``; ``None`` if
    it already places the tensor otherwise over that axis."""
    base = layout if layout is not None else _layout(sch, Replicate(), mesh_axis)
    i = base.mesh_dims.index(mesh_axis)
    if not isinstance(base.placements[i], Replicate) and base.placements[i] != placement:
        return None
    return Layout((*base.placements[:i], placement, *base.placements[i + 1 :]), base.mesh_dims, base.mesh_shape)


_Placer = Callable[[str, nn.Module, int, int], "dict[str, Placement] | list[Problem]"]


def _spread(
    sch: Schedule,
    where: Selection,
    what: str,
    mesh_axis: str,
    role: Callable[[Experts | None, int, tuple[str, ...]], Experts],
    placer: _Placer,
) -> Schedule:
    """Validate and record one of the two expert layouts (see :func:`expert_parallel` and
    :func:`expert_tensor_parallel`): ``role`` makes the experts module's new role from its
    previous one, ``placer`` each parameter's placement over ``mesh_axis`` (or problems)."""
    paths = where.paths(sch.module)
    problems = [p for p in (_problem_mesh(sch, path, mesh_axis) for path in paths[:1]) if p is not None]
    if problems:
        raise LayoutError(what, problems)
    assert sch.mesh is not None
    size = int(sch.mesh.size(mesh_dims(sch.mesh).index(mesh_axis)))
    found: list[tuple[str, Experts, dict[str, Layout]]] = []
    for path in paths:
        try:
            module = get_module(sch.module, path)
        except KeyError:
            problems.append(Problem(path, "is a parameter, not a mixture-of-experts block",
                                    "select the block holding the router and the experts, e.g. 'model.layers.*.mlp'"))
            continue
        hit = find_experts(module, path)
        if hit is None:
            problems.append(_not_moe(path, module))
            continue
        experts_path, count = hit
        experts = get_module(sch.module, experts_path)
        if sch.annotations.get(experts_path, ROLE) is not None:
            problems.append(Problem(experts_path, f"is already sharded as {sch.annotations.get(experts_path, ROLE)} "
                                                  "(sf.shard of its parameters)",
                                    f"give expert parameters one layout: {what} alone, or sf.shard alone"))
            continue
        placements = placer(experts_path, experts, count, size)
        if isinstance(placements, list):
            problems += placements
            continue
        layouts: dict[str, Layout] = {}
        for name, placement in placements.items():
            existing = sch.annotations.get(join(experts_path, name), LAYOUT)
            merged = _with(existing, sch, mesh_axis, placement)
            if merged is None:
                problems.append(Problem(
                    join(experts_path, name),
                    f"already has the layout {existing}; {what} places it as {describe(placement)} over "
                    f"{mesh_axis!r}",
                    f"give expert parameters one layout: {what} alone, or sf.shard alone",
                ))
            else:
                layouts[name] = merged
        previous = sch.annotations.get(experts_path, EXPERTS)
        try:
            spec = role(previous, count, tuple(placements))
        except ValueError as e:
            problems.append(Problem(experts_path, str(e), f"apply {what} once per block"))
            continue
        found.append((experts_path, spec, layouts))
    if problems:
        raise LayoutError(what, problems)
    for experts_path, spec, layouts in found:
        sch = sch.annotate_path(experts_path, EXPERTS, spec)
        for name, lay in layouts.items():
            sch = sch.annotate_path(join(experts_path, name), LAYOUT, lay)
    return sch


@primitive
def expert_parallel(
    sch: Schedule,
    where: Selection,
    *,
    mesh_axis: str = "ep",
    capacity_factor: float | None = None,
) -> Schedule:
    """Spread the experts of the selected mixture-of-experts blocks over ``mesh_axis``:
    with E experts over ``ep`` ranks each rank holds E/ep (the fused expert parameters
    become DTensors ``Shard(0)``), and each (token, expert) pair is computed on its
    expert's rank, reached by an all-to-all after routing and returned by another.

    The router, its top-k and its auxiliary losses are the model's own; the result equals
    the unsharded model's (forward, every gradient), unless ``capacity_factor`` caps the
    pairs per expert (then the pairs over the cap, latest tokens first, contribute zero).
    Composes with :func:`expert_tensor_parallel` (each expert's matrices split over
    another axis), with ``shard`` elsewhere in the model (``mesh_axis="tp"`` reuses the
    tensor-parallel ranks), with ``data_parallel`` over another axis (FSDP2 then shards
    each rank's experts over ``dp`` too) and with pipeline stages. As for tensor
    parallelism, the ranks of ``mesh_axis`` see the same tokens: give each data-parallel
    replica its own batch over a ``dp`` axis, not over ``ep``.

    Validates at once: the mesh axis exists, each selected module is (or holds) an experts
    module, E divides by the axis size, no other layout was given to the expert
    parameters. Returns a new schedule; the input is unchanged.

    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> sch = sf.create_schedule(nn.Sequential(nn.Linear(4, 4)), mesh=fake_mesh(2, names=("ep",)))
    >>> sf.expert_parallel(sch, "0")
    Traceback (most recent call last):
    ...
    slapo_fn.errors.LayoutError: expert_parallel: '0': a Linear is not a mixture-of-experts block: no child holds \
fused 3-D expert parameters ([num_experts, ...]) with a forward taking (hidden_states, top_k_index, top_k_weights)
          fix: select the MoE blocks only, e.g. 'model.layers.*.mlp'; on models with dense layers in between (a \
config's mlp_only_layers) list the sparse ones
    """
    _check_arguments("expert_parallel", mesh_axis, capacity_factor)
    cap = None if capacity_factor is None else float(capacity_factor)

    def placer(path: str, experts: nn.Module, count: int, size: int) -> dict[str, Placement] | list[Problem]:
        if count % size:
            return [Problem(
                path,
                f"{count} experts are not divisible by the size {size} of mesh axis {mesh_axis!r}",
                f"use a mesh axis whose size divides {count} (e.g. {math.gcd(count, size)}), or leave it unsharded",
            )]
        return {n: Shard(0) for n, p in experts._parameters.items() if p is not None}

    def role(previous: Experts | None, count: int, names: tuple[str, ...]) -> Experts:
        spec = Experts(mesh_axis, count, names, cap, previous.tensor_axis if previous else None)
        if previous is not None and previous.mesh_axis is not None and previous != spec:
            raise ValueError(f"already spread as {previous}; now asked for {spec}")
        return spec

    return _spread(sch, where, "expert_parallel", mesh_axis, role, placer)


@primitive
def expert_tensor_parallel(sch: Schedule, where: Selection, *, mesh_axis: str = "tp") -> Schedule:
    """Split each expert's matrices of the selected mixture-of-experts blocks over
    ``mesh_axis``, Megatron-style (Hugging Face's ``moe_tp_experts`` with its
    ``packed_colwise`` gate/up and ``rowwise`` down projections): the intermediate
    dimension is sharded (the fused [gate; up] projection chunk by chunk), every rank runs
    every pair on its slice, and the partial outputs are all-reduced (the inputs' and the
    routing weights' gradients likewise in backward).

    Composes with :func:`expert_parallel` over another axis (each rank then holds E/ep
    experts, each split over ``mesh_axis``). Only 3-D expert matrices are supported (no
    per-expert biases). Returns a new schedule; the input is unchanged.

    >>> import slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> cfg = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
    >>> sch = sf.create_schedule(MixtralForCausalLM(cfg), mesh=fake_mesh(2, names=("tp",)))
    >>> sch = sf.expert_tensor_parallel(sch, "model.layers.*.mlp")
    >>> print(sch.annotations.get("model.layers.0.mlp.experts", EXPERTS))
    experts@tp(4)
    >>> [str(sch.annotations.get(f"model.layers.0.mlp.experts.{n}", LAYOUT)) for n in ("gate_up_proj", "down_proj")]
    ['(tp=S(1)×2)', '(tp=S(2))']
    """
    _check_arguments("expert_tensor_parallel", mesh_axis)

    def placer(path: str, experts: nn.Module, count: int, size: int) -> dict[str, Placement] | list[Problem]:
        params = {n: p for n, p in experts._parameters.items() if p is not None}
        flat = [n for n, p in params.items() if p.dim() != 3]
        if flat:
            return [Problem(join(path, n), f"is a {params[n].dim()}-D expert parameter (a bias); tensor parallelism "
                                           "inside experts splits 3-D expert matrices only",
                            "use expert_parallel alone for this model") for n in flat]
        hidden = _hidden_size(list(params.values()))
        transposed = experts_transposed(experts)
        order = list(params)
        inner: dict[str, int] = {}
        for name, p in params.items():
            dims = [d for d in (1, 2) if p.shape[d] != hidden]
            if len(dims) != 1 and transposed is not None and len(order) == 2:
                # by the module's own convention: the first projection's output and the last one's
                # input are the intermediate dimension ([E, out, in], or [E, in, out] transposed)
                out_dim, in_dim = (2, 1) if transposed else (1, 2)
                dims = [out_dim if name == order[0] else in_dim]
            if len(dims) != 1:
                return [Problem(join(path, name), f"of shape {tuple(p.shape)}: cannot tell its intermediate "
                                                  f"dimension from the model dimension {hidden}",
                                "shard its parameters by hand with sf.shard")]
            inner[name] = dims[0]
        smallest = min(int(params[n].shape[d]) for n, d in inner.items())
        out: dict[str, Placement] = {}
        problems = []
        for name, d in inner.items():
            packed = int(params[name].shape[d]) // smallest if gate_up_packing(experts) > 1 else 1
            if smallest % size:
                problems.append(Problem(join(path, name), f"intermediate size {smallest} is not divisible by the "
                                                          f"size {size} of mesh axis {mesh_axis!r}",
                                        f"use a mesh axis whose size divides {smallest}"))
            out[name] = packed_shard(d, packed)
        return problems or out

    def role(previous: Experts | None, count: int, names: tuple[str, ...]) -> Experts:
        if previous is None:
            return Experts(None, count, names, None, mesh_axis)
        if previous.tensor_axis not in (None, mesh_axis):
            raise ValueError(f"already split as {previous}; now asked for tensor parallelism over {mesh_axis!r}")
        return Experts(previous.mesh_axis, count, names, previous.capacity_factor, mesh_axis)

    return _spread(sch, where, "expert_tensor_parallel", mesh_axis, role, placer)


# ----------------------------------------------------------------------------- collectives


@torch.no_grad()
def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], axis: Axis) -> torch.Tensor:
    return wait(funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, axis))


# Every Function has ``setup_context`` and saves plain Python values (see collectives.py).


class _AllToAll(torch.autograd.Function):
    """Rows to ranks: ``in_splits[d]`` rows go to rank ``d``, ``out_splits[s]`` arrive from
    rank ``s``; backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(  # type: ignore[override]
        x: torch.Tensor, out_splits: tuple[int, ...], in_splits: tuple[int, ...], axis: Axis
    ) -> torch.Tensor:
        return _all_to_all(x, list(out_splits), list(in_splits), axis)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.out_splits, ctx.in_splits, ctx.axis = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return _all_to_all(grad, list(ctx.in_splits), list(ctx.out_splits), ctx.axis), None, None, None


def _as_bytes(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.contiguous().view(rows, -1).view(torch.uint8)


class _SplitTokens(torch.autograd.Function):
    """This rank's slice of rows of the tokens and of their routing weights (both padded
    to ``size * rows``); backward all-gathers both gradients in one collective (as bytes,
    so that tokens in bf16 and weights in fp32 travel together exactly)."""

    @staticmethod
    def forward(  # type: ignore[override]
        x: torch.Tensor, w: torch.Tensor, rows: int, axis: Axis
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mesh, dim = axis
        lo = mesh.get_local_rank(dim) * rows
        return x[lo : lo + rows], w[lo : lo + rows]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, w, ctx.rows, ctx.axis = inputs
        ctx.shapes = (tuple(x.shape), tuple(w.shape))
        ctx.dtypes = (x.dtype, w.dtype)
        ctx.device = x.device

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, gx: torch.Tensor | None, gw: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        (sx, sw), (dx, dw), rows = ctx.shapes, ctx.dtypes, ctx.rows
        gx = torch.zeros((rows, *sx[1:]), dtype=dx, device=ctx.device) if gx is None else gx
        gw = torch.zeros((rows, *sw[1:]), dtype=dw, device=ctx.device) if gw is None else gw
        bx, bw = _as_bytes(gx, rows), _as_bytes(gw, rows)
        full = _all_gather(torch.cat([bx, bw], dim=1), 0, ctx.axis)
        n = full.shape[0]
        fx = full[:, : bx.shape[1]].contiguous().view(dx).view(n, *sx[1:])
        fw = full[:, bx.shape[1] :].contiguous().view(dw).view(n, *sw[1:])
        return fx, fw, None, None


class _EnterBoth(torch.autograd.Function):
    """Tokens and their routing weights entering a tensor-parallel region: identity
    forward; backward all-reduces both gradients (each rank's slice of the experts gives a
    partial one), in one collective when they share a dtype."""

    @staticmethod
    def forward(  # type: ignore[override]
        x: torch.Tensor, w: torch.Tensor, axis: Axis
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x.view_as(x), w.view_as(w)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, w, ctx.axis = inputs
        ctx.shapes = (tuple(x.shape), tuple(w.shape))
        ctx.dtypes = (x.dtype, w.dtype)
        ctx.device = x.device

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, gx: torch.Tensor | None, gw: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        (sx, sw), (dx, dw) = ctx.shapes, ctx.dtypes
        gx = torch.zeros(sx, dtype=dx, device=ctx.device) if gx is None else gx
        gw = torch.zeros(sw, dtype=dw, device=ctx.device) if gw is None else gw
        if dx != dw:
            return _all_reduce(gx, ctx.axis), _all_reduce(gw, ctx.axis), None
        both = _all_reduce(torch.cat([gx.reshape(-1), gw.reshape(-1)]), ctx.axis)
        return both[: gx.numel()].view(sx), both[gx.numel() :].view(sw), None


# ----------------------------------------------------------------------------- routing tables


@dataclass(frozen=True)
class _Routes:
    """Where this rank's (token, expert) pairs go and what it receives."""

    order: torch.Tensor  # positions (token * top_k + k) of this rank's kept pairs, by expert
    send: tuple[int, ...]  # pairs to each rank
    recv: tuple[int, ...]  # pairs from each rank
    local_ids: torch.Tensor  # local expert of each received pair


@torch.no_grad()
def _routes(mine: torch.Tensor, spec: Experts, axis: Axis, capacity: int | None) -> _Routes:
    """``mine``: this rank's [rows, top_k] expert ids (padding rows hold ``E``). The ranks
    exchange their pair counts per expert (one small all-gather): split sizes then agree
    even where the ranks' copies of the routing do not (a pipeline stage infers shapes
    from uninitialised inputs), and each rank learns which of its experts each received
    pair is for. With a ``capacity``, pairs are kept in token order: rank by rank, then
    in this rank's order, so every rank drops what the others expect it to."""
    mesh, dim = axis
    size, rank = int(mesh.size(dim)), int(mesh.get_local_rank(dim))
    e = spec.num_experts
    flat = mine.reshape(-1).long()
    onehot = F.one_hot(flat, e + 1)[:, :e]
    counts = _all_gather(onehot.sum(0)[None], 0, axis)  # [source rank, expert]
    if capacity is not None:
        before = counts.cumsum(0) - counts  # pairs of the ranks before, per expert
        seen = (onehot.cumsum(0) * onehot).sum(1) + before[rank].gather(0, flat.clamp(max=e - 1))
        flat = flat.masked_fill((flat < e) & (seen > capacity), e)
        counts = torch.minimum(counts, (capacity - before).clamp(min=0))
    local = spec.local_experts(size)
    to_ranks = counts.view(size, size, local).sum(-1)  # [source, destination]
    order = torch.argsort(flat, stable=True)
    order = order[: int((flat < e).sum())]
    received = counts[:, rank * local : (rank + 1) * local].reshape(-1)
    local_ids = torch.arange(local, device=mine.device).repeat(size).repeat_interleave(received)
    return _Routes(order, tuple(to_ranks[rank].tolist()), tuple(to_ranks[:, rank].tolist()), local_ids)


# ----------------------------------------------------------------------------- the forward


def experts_forward(
    module: nn.Module,
    spec: Experts,
    axes: tuple[Axis | None, Axis | None],
    forward: Callable[..., torch.Tensor],
    local: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """The forward of an experts module with the role ``spec`` (on build's copy):
    ``forward`` is the model's own experts forward, run on this rank's local expert
    parameters (``local`` gives a parameter's shard) for the pairs routed to them.
    ``axes``: the (expert-parallel, tensor-parallel) mesh axes, ``None`` where unused."""
    ep, tp = axes

    def compute(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        params = {n: local(getattr(module, n)) for n in spec.params}
        with _reparametrize_module(module, params):
            return forward(x, index, weights)

    def tensor_parallel(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        assert tp is not None
        x, w = _EnterBoth.apply(hidden_states, top_k_weights, tp)
        return reduce(compute(x, top_k_index, w), tp)

    if ep is None:
        return tensor_parallel
    mesh, dim = ep
    size = int(mesh.size(dim))
    rank = int(mesh.get_local_rank(dim))

    def run(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        tokens, top_k = x.shape[0], top_k_index.shape[-1]
        index = top_k_index.reshape(tokens, top_k)
        weights = top_k_weights.reshape(tokens, top_k)
        rows = -(-tokens // size)
        pad = rows * size - tokens
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
            weights = F.pad(weights, (0, 0, 0, pad))
            index = F.pad(index, (0, 0, 0, pad), value=spec.num_experts)
        routes = _routes(index[rank * rows : (rank + 1) * rows], spec, ep, spec.capacity(tokens, top_k))
        x_mine, w_mine = _SplitTokens.apply(x, weights, rows, ep)
        if tp is not None:  # each expert split over tp: every tp rank runs these pairs on its slice
            x_mine, w_mine = _EnterBoth.apply(x_mine, w_mine, tp)
        token = routes.order // top_k
        sent = _AllToAll.apply(x_mine[token], routes.recv, routes.send, ep)
        ones = torch.ones(sent.shape[0], 1, dtype=weights.dtype, device=sent.device)
        done = compute(sent, routes.local_ids[:, None], ones)
        back = _AllToAll.apply(done, routes.send, routes.recv, ep)
        pairs = w_mine.reshape(-1)[routes.order, None] * back
        mine = torch.zeros(rows * top_k, x.shape[-1], dtype=pairs.dtype, device=pairs.device)
        mine = mine.index_copy(0, routes.order, pairs)
        out = mine.view(rows, top_k, -1).sum(1).to(x.dtype)
        if tp is not None:
            out = reduce(out, tp)
        return gather(out, 0, ep)[:tokens].reshape(shape)

    return run


# ----------------------------------------------------------------------------- costs, for explain


def _hidden_size(stacks: Sequence[torch.Tensor]) -> int:
    """The model dimension of fused expert stacks: the matrix dimension all of them share
    ([E, 2I, H] and [E, H, I] share H), else the last one of the first."""
    common = set(stacks[0].shape[1:])
    for p in stacks[1:]:
        common &= set(p.shape[1:])
    return int(max(common)) if common else int(stacks[0].shape[-1])


@dataclass(frozen=True)
class ExpertCosts:
    """Per-rank expert memory and per-step all-to-all traffic of one expert-parallel schedule.

    ``param_bytes``: this rank's expert parameters (its E/ep experts of every block);
    ``all_to_all_bytes``: bytes this rank sends in one step's all-to-alls (dispatch and
    combine, forward and backward), from the expected tokens per expert times
    ``imbalance``; ``all_to_all_count``: their number; ``blocks``: the experts paths."""

    param_bytes: int
    all_to_all_bytes: int
    all_to_all_count: int
    all_gather_bytes: int
    blocks: tuple[str, ...]


def expert_costs(
    sch: Schedule,
    *,
    tokens: int,
    top_k: int | None = None,
    imbalance: float = 1.0,
    dtype: torch.dtype | None = None,
) -> ExpertCosts:
    """Per-rank expert memory and the all-to-all bytes per step of ``sch``'s expert-parallel
    blocks, for ``tokens`` tokens per step on each group of the ``ep`` axis (batch ×
    sequence of one data-parallel replica) routed to ``top_k`` experts each (default: the
    model config's ``num_experts_per_tok``). ``dtype``: the activations' (default: the
    expert parameters').

    Each rank owns T/ep tokens, i.e. T·k/ep pairs; evenly routed, (ep−1)/ep of them leave
    the rank. ``imbalance`` (≥ 1) scales that by the busiest rank's excess. Dispatch and
    combine each move that many rows of the hidden size forward and again backward.

    >>> import slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> cfg = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
    >>> sch = sf.create_schedule(MixtralForCausalLM(cfg), mesh=fake_mesh(2, names=("ep",)))
    >>> costs = expert_costs(sf.expert_parallel(sch, "model.layers.*.mlp"), tokens=64, top_k=2)
    >>> costs.param_bytes, costs.all_to_all_count, costs.all_to_all_bytes
    (24576, 8, 16384)
    """
    assert sch.mesh is not None, "expert_costs needs a schedule with a mesh"
    if top_k is None:
        top_k = int(config_value(config_of(sch.module), *EXPERTS_PER_TOKEN_ATTRS))
    dims = mesh_dims(sch.mesh)
    param_bytes = a2a_bytes = gather_bytes = count = 0
    blocks = []
    for path, spec in sorted(sch.annotations.of_kind(EXPERTS).items()):
        size = int(sch.mesh.size(dims.index(spec.mesh_axis)))
        module = get_module(sch.module, path)
        blocks.append(path)
        stacks = []
        for name in spec.params:
            p = module._parameters[name]
            assert p is not None
            lay = sch.annotations.get(join(path, name), LAYOUT)
            local = lay.local_shape(tuple(p.shape)) if isinstance(lay, Layout) else tuple(p.shape)
            param_bytes += math.prod(local) * p.element_size()
            if p.dim() == 3:
                stacks.append(p)
        hidden = _hidden_size(stacks)
        elem = (dtype or stacks[0].dtype).itemsize
        pairs = math.ceil(tokens / size) * top_k
        leaving = pairs * (size - 1) / size * imbalance
        a2a_bytes += 4 * math.ceil(leaving) * hidden * elem
        # the output forward, the token and routing-weight gradients backward, the pair counts
        gather_bytes += tokens * hidden * elem + tokens * (hidden * elem + top_k * 4) + size * spec.num_experts * 8
        count += 4
    return ExpertCosts(param_bytes, a2a_bytes, count, gather_bytes, tuple(blocks))
