"""Per-rank memory of a schedule: parameters, gradients and optimizer state on each rank.

Computed from shapes alone (meta-device models, no process group): each parameter
counts its tensor-parallel shard (its ``layout``), divided over the data-parallel shard
axis by FSDP/HSDP (dim 0, padded up as FSDP2 pads it; rank 0's share is reported), and
only in the pipeline stage(s) that hold it. Gradients are as large as the parameters;
the optimizer keeps ``states`` tensors per parameter (AdamW: 2) in the parameter's dtype,
as ``torch.optim.AdamW`` and :func:`slapo_fn.optim.adamw` make them (``zeros_like`` of
the parameter: a pure-bf16 model's states are bf16; ``train --dtype bf16`` keeps float32
parameters, so float32 states), or in ``state_dtype`` where the optimizer keeps them so. With example
inputs, :func:`activation_memory` adds each stage's peak of activations, and the
table's ``total`` is the one per-rank figure: state plus activations.

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> print(per_rank_memory(sf.create_schedule(nn.Linear(1024, 1024))))
    per-rank memory (rank 0 of each stage; optimizer: 2 states per parameter, in its dtype):
      stage  parameters  params   grads    optimizer  total
      -      1,049,600   4.0 MiB  4.0 MiB  8.0 MiB    16.0 MiB
      total = params (this rank's TP and FSDP shard) + grads + optimizer; activations not included (no example inputs)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from .dtensor.context import CP
from .dtensor.data_parallel import DATA_PARALLEL
from .dtensor.explain import ActivationShapes
from .dtensor.sequence import SEQ
from .dtensor.shard import LAYOUT, ROLE
from .kernels import FULL_LOGITS_LOSS, LossFootprint
from .pipelines.cut import PIPELINE_CUT, pp_size
from .pipelines.runner import SCHEDULES, stage_ranks
from .pipelines.split import Stage, split_stages
from .render import format_bytes, format_dtype
from .rewrites.checkpoint import CHECKPOINT
from .rewrites.compile import COMPILE
from .schedule import Schedule
from .tree import parent_path

__all__ = ["ActivationRow", "ActivationTable", "MemoryRow", "MemoryTable", "activation_memory", "per_rank_memory",
           "profiled_peak_bytes"]


@dataclass(frozen=True)
class MemoryRow:
    """One pipeline stage's (or the whole model's) memory on one rank.

    ``activation_bytes`` is the predicted peak of activations (``None`` when unknown:
    no example inputs); ``total_bytes`` adds it to parameters, gradients and optimizer
    states — the one figure to compare with a device's memory."""

    stage: int | None
    parameters: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int | None = None
    #: Microbatches whose activations this stage holds at once (1 without a pipeline).
    in_flight: int = 1

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer states."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + (self.activation_bytes or 0)


@dataclass(frozen=True)
class MemoryTable:
    rows: tuple[MemoryRow, ...]
    states: int
    #: The dtype of the optimizer's states (``None``: each parameter's own).
    state_dtype: torch.dtype | None = None
    #: What the activation column assumes (batch per microbatch, checkpointing, SP, …).
    activation_note: str = ""

    @property
    def max_total_bytes(self) -> int:
        return max((r.total_bytes for r in self.rows), default=0)

    def __str__(self) -> str:
        acts = any(r.activation_bytes is not None for r in self.rows)
        header = ["stage", "parameters", "params", "grads", "optimizer"] + (["activations"] if acts else []) + ["total"]
        table = [[("-" if r.stage is None else str(r.stage)), f"{r.parameters:,}",
                  *map(format_bytes, (r.param_bytes, r.grad_bytes, r.optimizer_bytes)),
                  *([format_bytes(r.activation_bytes or 0)] if acts else []), format_bytes(r.total_bytes)]
                 for r in self.rows]
        widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
        kept = "in its dtype" if self.state_dtype is None else f"in {format_dtype(self.state_dtype)}"
        lines = [f"per-rank memory (rank 0 of each stage; optimizer: {self.states} states per parameter, {kept}):"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *table]]
        if acts:
            lines.append("  total = params (this rank's TP and FSDP shard) + grads (as large) + optimizer "
                         "+ activations (peak of saved tensors, " + self.activation_note + ")")
        else:
            lines.append("  total = params (this rank's TP and FSDP shard) + grads + optimizer; activations "
                         f"not included ({self.activation_note or 'no example inputs'})")
        return "\n".join(lines)


def _dp_shards(sch: Schedule) -> int:
    spec = sch.annotations.get("", DATA_PARALLEL)
    if spec is None or spec.mode == "ddp" or sch.mesh is None:
        return 1
    names = tuple(sch.mesh.mesh_dim_names or ())
    shard_axis = spec.mesh_axes[-1]  # fsdp: its one axis; hsdp: (replicate, shard)
    return int(sch.mesh.size(names.index(shard_axis)))


def _row(sch: Schedule, stage: int | None, states: int, state_dtype: torch.dtype | None) -> MemoryRow:
    dp = _dp_shards(sch)
    seen: set[int] = set()
    count = nbytes = state_bytes = 0
    for name, p in sch.module.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        layout = sch.annotations.get(name, LAYOUT)
        shape = list(layout.local_shape(tuple(p.shape)) if layout is not None else p.shape)
        if dp > 1 and shape:
            shape[0] = math.ceil(shape[0] / dp)
        numel = math.prod(shape)
        count += numel
        nbytes += numel * p.element_size()
        state_bytes += numel * (p.element_size() if state_dtype is None else _itemsize(state_dtype))
    return MemoryRow(stage, count, nbytes, nbytes, states * state_bytes)


def per_rank_memory(sch: Schedule, *, states: int = 2, state_dtype: torch.dtype | None = None,
                    activations: ActivationTable | None = None) -> MemoryTable:
    """The per-rank memory of ``sch`` (one row per pipeline stage, or one row), with the
    activation peaks of ``activations`` (:func:`activation_memory`) where given. The
    optimizer keeps ``states`` tensors per parameter, each in the parameter's dtype
    (``torch.optim.AdamW``'s and :func:`slapo_fn.optim.adamw`'s moments: ``zeros_like``
    the parameter), or in ``state_dtype`` for an optimizer that keeps them in another
    (float32 states of bf16 parameters).

    >>> import torch, torch.nn as nn, slapo_fn as sf
    >>> sch = sf.create_schedule(nn.Linear(1024, 1024).to(torch.bfloat16))
    >>> per_rank_memory(sch).rows[0].optimizer_bytes == 2 * 2 * 1_049_600  # two bf16 moments
    True
    >>> per_rank_memory(sch, state_dtype=torch.float32).rows[0].optimizer_bytes == 2 * 4 * 1_049_600
    True
    """
    if sch.annotations.of_kind(PIPELINE_CUT):
        rows = tuple(_row(s.schedule, s.index, states, state_dtype) for s in split_stages(sch))
    else:
        rows = (_row(sch, None, states, state_dtype),)
    if activations is None:
        return MemoryTable(rows, states, state_dtype)
    by_stage = {a.stage: a for a in activations.rows}
    rows = tuple(dataclasses.replace(r, activation_bytes=by_stage[r.stage].peak_bytes,
                                     in_flight=by_stage[r.stage].in_flight) if r.stage in by_stage else r
                 for r in rows)
    return MemoryTable(rows, states, state_dtype, activations.note)


def profiled_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated above the starting point while ``fn()`` runs (freed
    temporaries included), measured — not estimated — from the allocations and frees
    the PyTorch profiler records (``profile_memory=True``), summed in time order; works
    on CPU, with DTensors and collectives too. Relies on the profiler's event tree
    (``kineto_results.experimental_event_tree()``, a private API).

    >>> import torch
    >>> profiled_peak_bytes(lambda: torch.ones(1024, 1024).sum()) >= 4 * 2**20
    True
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    changes: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            changes.append((node.start_time_ns, node.typed[1].alloc_size))
        stack.extend(node.children)
    current = peak = 0
    for _, size in sorted(changes):
        current += size
        peak = max(peak, current)
    return peak


# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class ActivationRow:
    """Activations of one stage (or of the whole model) on one rank, in bytes.

    ``saved_bytes`` is what autograd holds when the last forward in flight ends:
    ``in_flight`` microbatches' saved tensors (a checkpointed module keeps only its
    input), the stage's received inputs and sent outputs. ``peak_bytes`` adds the
    larger of the two backward transients: what the loss holds at its peak (its
    :class:`~slapo_fn.kernels.LossFootprint`), or one checkpointed module recomputed
    while the checkpointed inputs are held."""

    stage: int | None
    in_flight: int
    saved_bytes: int
    loss_bytes: int
    recompute_peak_bytes: int
    #: Context parallelism: the gradients of one attention's all-gathered keys and values
    #: (full length, before their reduce-scatter), beside everything saved in its backward.
    gathered_grad_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        return max(self.saved_bytes + max(self.loss_bytes, self.gathered_grad_bytes), self.recompute_peak_bytes)


@dataclass(frozen=True)
class ActivationTable:
    rows: tuple[ActivationRow, ...]
    #: What the figures assume, as text.
    note: str


def _factors(sch: Schedule) -> Callable[[str], float]:
    """``path -> share of a tensor saved there that one rank holds`` under tensor and
    sequence parallelism: a row-parallel module saves its sharded input (1/t), a column
    its gathered input (1); the code of a parent of sharded modules and of their
    siblings (attention, the MLP's gate product) runs on local heads or features (1/t);
    elsewhere (norms, residual stream, loss) a tensor is replicated (1), or split along
    the sequence where sequence parallelism covers the module (1/t). Context parallelism
    over ``c`` ranks runs every module on ``1/c`` of the tokens (the keys and values its
    attention gathers to full length are added by :func:`_gathered_kv`)."""
    roles = sch.annotations.of_kind(ROLE)
    seqs = sch.annotations.of_kind(SEQ)
    size = _axis_sizes(sch)
    cps = {spec.mesh_axis for spec in sch.annotations.of_kind(CP).values()}
    tokens = 1 / math.prod(size.get(axis, 1) for axis in cps)
    sharded_parents: dict[str, int] = {}
    for path, role in roles.items():
        parent = parent_path(path)
        if role.enters or role.splits_input:  # splits an activation's features
            sharded_parents[parent] = size.get(role.mesh_axis, 1)
    cache: dict[str, float] = {}

    def factor(path: str) -> float:
        if path in cache:
            return cache[path]
        role = roles.get(path)
        parent = parent_path(path)
        if role is not None:
            out = 1 / size.get(role.mesh_axis, 1) if role.splits_input else 1.0
        elif path in sharded_parents:
            out = 1 / sharded_parents[path]
        elif path and parent in sharded_parents:
            out = 1 / sharded_parents[parent]
        else:
            out = 1.0
            for p, spec in seqs.items():
                if path == p or path.startswith(p + "."):
                    out = 1 / size.get(spec.mesh_axis, 1)
                    break
        cache[path] = out = out * tokens
        return out

    return factor


def _gathered_kv(sch: Schedule, shapes: ActivationShapes) -> dict[str, float]:
    """``attention path -> bytes of its keys and values at full length`` (one rank's
    heads, the whole sequence) for each context-parallel attention: what its all-gather
    makes and its kernel saves for backward, where the fake run of the unsharded model
    saw them at the length of the rank's tokens only; the gradients of as much exist in
    its backward before their reduce-scatter. From the attention's input (batch, seq)
    and its ``k_proj``'s output features (K and V alike)."""
    cps = sch.annotations.of_kind(CP)
    if not cps:
        return {}
    size = _axis_sizes(sch)
    factor = _factors(sch)
    out = {}
    for path, spec in cps.items():
        entry = shapes.inputs.get(path)
        k_proj = getattr(sch[path].module, "k_proj", None)
        features = getattr(k_proj, "out_features", None)
        if entry is None or not isinstance(features, int):
            continue
        shape, dtype = entry
        tokens = math.prod(shape[:-1])
        element = torch.empty((), dtype=dtype, device="meta").element_size()
        out[path] = 2 * tokens * features * element * factor(path) * size.get(spec.mesh_axis, 1)
    return out


def _axis_sizes(sch: Schedule) -> dict[str, int]:
    if sch.mesh is None:
        return {}
    names = tuple(sch.mesh.mesh_dim_names or ())
    return {n: int(s) for n, s in zip(names, tuple(sch.mesh.shape), strict=True)}


def _under(path: str, roots: tuple[str, ...]) -> str | None:
    for r in roots:
        if path == r or path.startswith(r + ".") or not r:
            return r
    return None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _loss_bytes(shapes: ActivationShapes, loss: LossFootprint, factor: Callable[[str], float], micro: int) -> int:
    """What ``loss`` holds on one rank for one microbatch's logits: the output of the last
    module that ran (its share ``factor`` on the rank), whose weight is ``vocab x hidden``
    (its output's and input's last axes)."""
    if not shapes.order:
        return 0
    last = shapes.order[-1]
    out, inp = shapes.outputs.get(last), shapes.inputs.get(last)
    if out is None:
        return 0
    share = factor(last)
    head = out[0][-1] * inp[0][-1] if inp is not None and out[0] and inp[0] else 0
    return loss.nbytes(logits=math.ceil(math.prod(out[0]) * share / micro), head=math.ceil(head * share))


def _nbytes(entry: tuple[tuple[int, ...], torch.dtype] | None) -> int:
    if entry is None:
        return 0
    shape, dtype = entry
    return math.prod(shape) * _itemsize(dtype)


def _loss_saves(shapes: ActivationShapes) -> int:
    """How many of the last saved tensors the root's own code saved after its last module
    ran: the loss of a Hugging Face model called with ``labels`` (its float32
    log-probabilities), which the loss's footprint stands for."""
    count = 0
    for path, _ in reversed(shapes.saved):
        if path:
            break
        count += 1
    return count


def activation_memory(
    sch: Schedule, shapes: ActivationShapes, *, microbatches: int = 1, pipeline_schedule: str = "1f1b",
    loss: LossFootprint = FULL_LOGITS_LOSS,
) -> ActivationTable:
    """Predicted peak activation bytes per stage on one rank, from the saved tensors of
    one fake forward of the unsharded model (``shapes``, :func:`~slapo_fn.dtensor.explain.
    activation_shapes`, run on one data-parallel rank's batch) and the schedule:

    * each saved tensor scaled by its share on one rank (:func:`_factors`: TP, SP);
    * fully checkpointed modules keep only their first input; in backward one of them
      is recomputed at a time, beside the gradients of its output and input and one as
      large as its largest saved tensor. A selective policy (``policy=``) keeps what it
      saves, which the fake run does not tell apart: its modules are counted as not
      checkpointed, an upper bound ("will it fit" errs on the safe side);
    * a pipeline runs ``microbatches`` of ``batch / microbatches``; stage ``i`` on
      ``pp`` rank ``r`` holds ``min(pp - r, microbatches)`` of them under 1F1B (and
      the interleaved and zero-bubble schedules, approximated so), all of them under
      GPipe; stages also hold what they received and sent;
    * the loss: the last module's output is the logits (the LM head's); what the loss
      holds at the peak of its backward is ``loss``'s declaration (a
      :class:`~slapo_fn.kernels.LossFootprint`: torch's float32 cross-entropy holds three
      float32 copies of the logits, the chunked loss one chunk of them and a gradient of
      the head), in place of what the root's code saved after its last module (the loss
      of a model called with labels, :func:`_loss_saves`);
    * a ``param_dtype`` of FSDP mixed precision scales float activations;
    * a module compiled with ``sf.compile`` is counted as it runs eager, and the note says
      so: Inductor's min-cut partitioner recomputes cheap elementwise ops in backward
      instead of saving their outputs, so its saves are fewer (an upper bound: on CPU a
      compiled LLaMA layer saved 0.68 of what the eager one did), by how much depends on
      the graph and on the attention kernel, which the fake run does not see.

    >>> import torch, torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.explain import activation_shapes
    >>> model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    >>> x = torch.empty(64, 256, requires_grad=True, device="meta")
    >>> table = activation_memory(sf.create_schedule(model), activation_shapes(model, (x,), {}))
    >>> table.rows[0].saved_bytes // 1024  # the inputs of both Linears and of the GELU, 64 KiB each
    192
    """
    factor = _factors(sch)
    compiled = len(sch.annotations.of_kind(COMPILE))
    every_ckpt = sch.annotations.of_kind(CHECKPOINT)
    ckpts = tuple(sorted(p for p, spec in every_ckpt.items() if spec.context_fn() is None))  # full ones
    selective = len(every_ckpt) - len(ckpts)
    stages = split_stages(sch) if sch.annotations.of_kind(PIPELINE_CUT) else ()
    layer_stage: dict[str, int] = {}
    for each in stages:
        for layer_path in each.layer_paths:
            layer_stage[layer_path] = each.index
    layer_roots = tuple(layer_stage)
    micro = max(1, microbatches if stages else 1)
    scale = 1.0
    spec = sch.annotations.get("", DATA_PARALLEL)
    if spec is not None and spec.param_dtype is not None:
        model_dtype = next((p.dtype for p in sch.module.parameters() if p.is_floating_point()), torch.float32)
        scale = torch.empty((), dtype=spec.param_dtype, device="meta").element_size() / \
            torch.empty((), dtype=model_dtype, device="meta").element_size()

    n_stages = len(stages) or 1
    kept = [0.0] * n_stages  # per microbatch, forward end
    ckpt_kept = [0.0] * n_stages
    pre = [0.0] * n_stages
    recompute: dict[str, float] = {}
    largest: dict[str, float] = {}
    seen_layer = False
    gathered = _gathered_kv(sch, shapes)
    cp = {path: _axis_sizes(sch).get(spec.mesh_axis, 1) for path, spec in sch.annotations.of_kind(CP).items()}
    grad_peak = [0.0] * n_stages
    # a context-parallel attention holds its gathered keys and values, not the rank's share of them
    extra = [(path, kv * (1 - 1 / cp[path]) / factor(path)) for path, kv in gathered.items()]
    model_saves = shapes.saved[:len(shapes.saved) - _loss_saves(shapes)]
    for path, nbytes in (*model_saves, *extra):
        size = nbytes * factor(path) * scale / micro
        layer = _under(path, layer_roots) if layer_roots else None
        if layer is not None:
            seen_layer = True
            idx = layer_stage[layer]
        elif stages:
            idx = stages[-1].index if seen_layer else stages[0].index
        else:
            idx = 0
        if path in gathered:
            grad_peak[idx] = max(grad_peak[idx], gathered[path] * scale / micro)
        c = _under(path, ckpts) if ckpts else None
        if c is not None:
            seen_layer = True
            recompute[c] = recompute.get(c, 0.0) + size
            largest[c] = max(largest.get(c, 0.0), size)
            continue
        kept[idx] += size
        if not seen_layer:
            pre[idx] += size
    ckpt_stage: dict[str, int] = {}
    for c in ckpts:
        layer = _under(c, layer_roots) if layer_roots else None
        idx = layer_stage[layer] if layer is not None else (stages[0].index if stages else 0)
        ckpt_stage[c] = idx
        held = _nbytes(shapes.inputs.get(c)) * factor(c) * scale / micro
        kept[idx] += held
        ckpt_kept[idx] += held
        # backward through the recomputed module: the gradients of its output and input,
        # and one gradient as large as its largest saved tensor, live beside its tensors
        # (unsplit: under sequence parallelism the gradients inside are gathered ones, and
        # a column's gathered input gradient waits for its reduce-scatter beside them)
        full = _nbytes(shapes.inputs.get(c)) * scale / micro
        grads = (3 if factor(c) < 1 else 2) * full
        recompute[c] = recompute.get(c, 0.0) + grads + largest.get(c, 0.0)
    logits = _loss_bytes(shapes, loss, factor, micro)

    pp = pp_size(sch) or n_stages
    kind = SCHEDULES.get(pipeline_schedule)
    ranks = stage_ranks(n_stages, pp, kind.style if kind is not None else "loop") if stages else (0,)
    rows = []
    for i in range(n_stages):
        st: Stage | None = stages[i] if stages else None
        in_flight = 1
        io = 0.0
        if st is not None:
            in_flight = micro if pipeline_schedule == "gpipe" else min(pp - ranks[i], micro)
            first = st.layer_paths[0]
            last_layer = st.layer_paths[-1]
            io += 0 if st.pre else _nbytes(shapes.inputs.get(first)) * factor(first) * scale / micro
            io += 0 if st.post else _nbytes(shapes.outputs.get(last_layer)) * factor(last_layer) * scale / micro
        saved = in_flight * (kept[i] + io)
        at_loss = logits if (st is None or st.post) else 0.0
        mine = [recompute[c] for c in ckpts if ckpt_stage[c] == i and c in recompute]
        again = (pre[i] + ckpt_kept[i] + io + (in_flight - 1) * (kept[i] + io) + max(mine)) if mine else 0.0
        rows.append(ActivationRow(st.index if st is not None else None, in_flight, math.ceil(saved),
                                  math.ceil(at_loss), math.ceil(again + grad_peak[i] if again else 0.0),
                                  math.ceil(grad_peak[i])))
    per_mb = "" if not stages else f", {micro} microbatches ({pipeline_schedule}) of 1/{micro} of it"
    mp = "" if scale == 1.0 else f", activations in {spec.param_dtype}"  # type: ignore[union-attr]
    note = (f"for the example inputs{per_mb}{mp}; checkpointed modules keep their input"
            + (", one recomputed at a time" if ckpts else "")
            + (f"; {selective} selectively checkpointed modules counted as not checkpointed (an upper bound)"
               if selective else "")
            + (f"; {compiled} compiled modules counted as eager (Inductor recomputes some of what eager saves: "
               "an upper bound)" if compiled else "")
            + f"; the loss holds {loss.describe()}"
            + ("; each context-parallel attention's all-gathered keys and values (and their gradients in its "
               "backward) at full length" if gathered else ""))
    return ActivationTable(tuple(rows), note)
