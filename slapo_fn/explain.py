"""``explain``: what a schedule will build — the tree, annotations, parameter counts and bytes.

Runs on meta-device models and needs no process group. ``print(sch)`` shows the same
tree; repeated identical siblings (the decoder layers of a transformer) are folded into
one entry (``layers.[0-79] ×80``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .dtensor.data_parallel import DATA_PARALLEL
from .dtensor.explain import (
    ActivationShapes,
    Collective,
    TensorParallelExplanation,
    activation_shapes,
    context_parallel_collectives,
    data_parallel_collectives,
    explain_tensor_parallel,
    loss_collectives,
)
from .errors import Problem, ScheduleError
from .hardware import HardwareProfile, StepTime, estimate_step, load_profile
from .hf import CONFIG_HEAD_COUNT_ATTRS, HIDDEN_SIZE_ATTRS, LAYER_COUNT_ATTRS, config_of, config_value
from .kernels import FULL_LOGITS_LOSS, LossFootprint
from .memory import MemoryTable, activation_memory, per_rank_memory
from .pipelines.cut import PIPELINE_CUT, pp_size
from .pipelines.explain import pipeline_collectives, stage_table
from .pipelines.runner import stage_ranks
from .pipelines.split import split_stages
from .render import format_bytes, format_dtype, format_param, render_tree
from .rewrites.checkpoint import CHECKPOINT
from .schedule import Schedule
from .tree import walk
from .verify import check_inputs

__all__ = ["Explanation", "ModuleRow", "compute_dtype", "explain", "format_bytes", "format_dtype", "format_param",
           "model_flops", "rank_collectives", "render_tree", "step_time"]

@dataclass(frozen=True)
class ModuleRow:
    path: str
    type: str
    parameters: int
    bytes: int
    annotations: tuple[str, ...]


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found; ``str()`` renders it."""

    tree: str
    rows: tuple[ModuleRow, ...]
    total_parameters: int
    total_bytes: int
    history: tuple[str, ...]
    #: The pipeline stage table (:func:`slapo_fn.pipelines.stage_table`), "" without cuts.
    stages: str = ""
    #: Layouts, per-rank parameter bytes and per-boundary collectives
    #: (:func:`slapo_fn.dtensor.explain.explain_tensor_parallel`); ``None`` without a mesh.
    tensor_parallel: TensorParallelExplanation | None = None
    #: Parameters, gradients and optimizer state per rank (:func:`slapo_fn.memory.per_rank_memory`).
    memory: MemoryTable | None = None
    #: The example inputs the activation and collective sizes are computed for, as text
    #: (``input 0: int64 (4, 2048)``); "" without inputs.
    assumed: str = ""
    #: Every collective of one step on one rank (with a pipeline: a rank at ``pp`` rank
    #: ``pp_rank`` of :func:`explain`, 0 by default): tensor and sequence parallel (of its
    #: stages' modules, per microbatch), a vocab-parallel loss, FSDP2 / DDP / HSDP of its
    #: stages, pipeline transfers of that rank.
    collectives: tuple[Collective, ...] = ()
    #: The step-time estimate (:func:`slapo_fn.hardware.estimate_step`), with a hardware profile.
    time: StepTime | None = None

    def by_axis(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{mesh axis: {op: {"count": n, "bytes": b}}}`` over :attr:`collectives`
        (bytes of unknown size count as 0).

        >>> import torch.nn as nn, slapo_fn as sf
        >>> sf.explain(sf.create_schedule(nn.Linear(2, 3))).by_axis()
        {}
        """
        out: dict[str, dict[str, dict[str, int]]] = {}
        for c in self.collectives:
            entry = out.setdefault(c.mesh_axis, {}).setdefault(c.op, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += c.bytes or 0
        return out

    def as_dict(self) -> dict[str, Any]:
        """Everything ``str()`` prints, as plain JSON-able data (``json.dumps`` it):
        rows, annotations, the tensor-parallel layouts and collectives, the memory table,
        the stage table and the history.

        >>> import json, torch.nn as nn, slapo_fn as sf
        >>> d = sf.explain(sf.create_schedule(nn.Linear(2, 3))).as_dict()
        >>> d["total_parameters"], json.loads(json.dumps(d))["rows"][0]["type"]
        (9, 'Linear')
        """
        return _plain(self)

    def __str__(self) -> str:
        annotated = [(r.path or "<root>", ", ".join(r.annotations)) for r in self.rows if r.annotations]
        out = [self.tree, "", f"parameters: {self.total_parameters:,} ({format_bytes(self.total_bytes)})"]
        if self.assumed:
            out.append(f"sizes below are for the inputs given: {self.assumed}")
        if annotated:
            out.append("annotations:")
            out += [f"  {path}: {text}{_times(n)}" for (path, text), n in _fold_numbered(annotated)]
        if self.tensor_parallel is not None:
            out.append(str(self.tensor_parallel))
        if self.stages:
            out.append(self.stages)
        if self.collectives:
            out.append("collectives of one step on one rank, by mesh axis (bytes: the full tensor of each):")
            for axis, ops in self.by_axis().items():
                text = ", ".join(f"{op} ×{v['count']} ({format_bytes(v['bytes'])})" for op, v in ops.items())
                out.append(f"  {axis}: {text}")
        if self.memory is not None and (self.tensor_parallel is not None or self.stages
                                        or any(r.activation_bytes is not None for r in self.memory.rows)):
            out.append(str(self.memory))
        if self.time is not None:
            out.append(str(self.time))
        if self.history:
            folded = _fold_numbered([(h, "") for h in self.history])
            note = ", repeated ones folded" if len(folded) < len(self.history) else ""
            out.append(f"rewrites ({len(self.history)}{note}):")
            out += [f"  {i}. {h}{_times(n)}" for i, ((h, _), n) in enumerate(folded, 1)]
        return "\n".join(out)


_NUMBER = re.compile(r"(?<=\.)\d+(?=[.']|$)")


def _times(n: int) -> str:
    return f"  ×{n}" if n > 1 else ""


def _indices(numbers: list[int]) -> str:
    """``[0-31]``, ``[7,15,23]`` or ``[0-3,8]``: the numbers as a selector token."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return "[" + ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs) + "]"


def _fold_numbered(items: list[tuple[str, str]]) -> list[tuple[tuple[str, str], int]]:
    """Group entries equal up to the layer numbers in their paths, in order of first
    appearance, with their counts; a group's path names the layers it holds where one
    number varies (``layers.[7,15,23]``, ``layers.[0-31]``), else ``layers.*``; single
    entries keep their numbers.

    >>> _fold_numbered([("m.layers.7", "cut"), ("m.layers.15", "cut"), ("m.layers.23", "cut")])
    [(('m.layers.[7,15,23]', 'cut'), 3)]
    """
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for key, text in items:
        groups.setdefault((_NUMBER.sub("*", key), text), []).append((key, text))
    out: list[tuple[tuple[str, str], int]] = []
    for (pattern, text), members in groups.items():
        if len(members) == 1:
            out.append((members[0], 1))
            continue
        numbers = [_NUMBER.findall(key) for key, _ in members]
        varying = [i for i in range(len(numbers[0])) if len({tuple(n)[i] for n in numbers}) > 1]
        if len(varying) == 1 and pattern.count("*") == len(numbers[0]):
            parts = pattern.split("*")
            fixed = numbers[0]
            pieces = [parts[0]]
            for i in range(len(fixed)):
                token = _indices([int(n[i]) for n in numbers]) if i == varying[0] else fixed[i]
                pieces += [token, parts[i + 1]]
            pattern = "".join(pieces)
        out.append(((pattern, text), len(members)))
    return out


def explain(
    sch: Schedule,
    *inputs: Any,
    kwargs: Mapping[str, Any] | None = None,
    microbatches: int = 1,
    pipeline_schedule: str = "1f1b",
    hardware: HardwareProfile | str | None = None,
    expert_imbalance: float = 1.0,
    dtype: torch.dtype | None = None,
    pp_rank: int = 0,
    loss: LossFootprint = FULL_LOGITS_LOSS,
    state_dtype: torch.dtype | None = None,
) -> Explanation:
    """Explain ``sch``: the folded tree, parameter counts and bytes per module (tied
    parameters counted once), annotations and the rewrite history; with a mesh, the
    tensor-parallel section (``.tensor_parallel``: layouts, per-rank parameter bytes,
    the collectives of one step per module boundary). Optional example ``inputs`` /
    ``kwargs`` (meta tensors suffice: only shapes matter) give those collectives their bytes;
    they are checked against the model's forward first (:func:`slapo_fn.verify.check_inputs`:
    float token ids for a language model, misspelt keywords, …). With them, the memory
    table adds activations (:func:`slapo_fn.memory.activation_memory`; a pipeline runs
    ``microbatches`` of them with ``pipeline_schedule``). With a ``hardware`` profile
    (:func:`slapo_fn.hardware.load_profile`: "h100", "cpu", … or a TOML path) and inputs,
    ``.time`` estimates the step (:func:`step_time`). ``expert_imbalance`` (≥ 1) scales
    the all-to-all bytes of expert-parallel blocks, sized for even routing, by the busiest
    rank's excess. ``dtype``: the compute dtype the estimate assumes (``torch.bfloat16``:
    mixed precision); default: FSDP2's ``param_dtype``, else the parameters' dtype.
    ``.collectives`` (and the estimate) are those of a rank at ``pp`` rank ``pp_rank``:
    with a pipeline, its stages' own collectives, once per microbatch
    (:func:`rank_collectives`). ``loss``: what the run's loss holds at its peak
    (:data:`slapo_fn.kernels.FULL_LOGITS_LOSS`, torch's cross-entropy over float32 logits,
    as ``slapo-fn train`` and Hugging Face compute it; :data:`slapo_fn.kernels.CHUNKED_LOSS`
    for :func:`slapo_fn.kernels.causal_lm_loss`). ``state_dtype``: the dtype the optimizer
    keeps its states in (default: each parameter's, as ``torch.optim.AdamW`` does).

    >>> import torch.nn as nn, slapo_fn as sf
    >>> sch = sf.checkpoint(sf.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))), "0")
    >>> sf.explain(sch).total_parameters
    40
    """
    if isinstance(expert_imbalance, bool) or not (isinstance(expert_imbalance, int | float)
                                                  and expert_imbalance >= 1):
        raise ScheduleError("explain", [Problem("expert_imbalance", f"must be a number >= 1, got {expert_imbalance!r}",
                                                "1.0 for even routing, e.g. 1.5 for a busiest rank 50% over")])
    shapes: ActivationShapes | None = None
    note = ""
    if inputs or kwargs:
        check_inputs(sch.module, inputs, kwargs or {}, "explain")
        try:
            shapes = activation_shapes(sch.module, inputs, dict(kwargs or {}))
        except Exception as e:  # explain never fails for a model it cannot run fake
            note = f"the fake run failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    seen: set[int] = set()
    rows = []
    total = total_bytes = 0
    for path, m in walk(sch.module):
        count = nbytes = 0
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                count += p.numel()
                nbytes += p.numel() * p.element_size()
        total += count
        total_bytes += nbytes
        notes = tuple(
            f"{k}={v}" if not isinstance(v, tuple) else f"{k}={', '.join(map(str, v))}"
            for k, v in sch.annotations.get(path, {}).items()
        )
        rows.append(ModuleRow(path, type(m).__name__, count, nbytes, notes))
    tp = _tensor_parallel(sch, inputs, kwargs, shapes, note, expert_imbalance)
    memory = _memory(sch, shapes, microbatches, pipeline_schedule, loss, state_dtype)
    if note:
        memory = dataclasses.replace(memory, activation_note=note)
    collectives = rank_collectives(sch, tp.collectives if tp is not None else (), shapes, microbatches, pp_rank)
    profile = load_profile(hardware) if isinstance(hardware, str) else hardware
    time = None
    if profile is not None and inputs:
        time = step_time(sch, inputs, collectives, profile, microbatches=microbatches,
                         pipeline_schedule=pipeline_schedule, calls=len(shapes.order) if shapes is not None else 0,
                         dtype=dtype)
    return Explanation(
        tree=render_tree(sch.module, "", sch.annotations),
        rows=tuple(rows),
        total_parameters=total,
        total_bytes=total_bytes,
        history=tuple(repr(h) for h in sch.history),
        stages=_stages(sch),
        tensor_parallel=tp,
        memory=memory,
        assumed=_assumed(inputs, kwargs),
        collectives=collectives,
        time=time,
    )


def rank_collectives(sch: Schedule, tensor_parallel: tuple[Collective, ...], shapes: ActivationShapes | None,
                     microbatches: int = 1, pp_rank: int = 0) -> tuple[Collective, ...]:
    """Every collective one step issues on a rank at ``pp`` rank ``pp_rank``, in a real
    run's counts. Without pipeline cuts: ``tensor_parallel`` (the plan's boundaries,
    :func:`slapo_fn.dtensor.explain.explain_tensor_parallel`), the loss's, data
    parallelism's. With them, the rank runs only its stages
    (:func:`slapo_fn.pipelines.runner.stage_ranks`), each microbatch apart: the tensor-
    and sequence-parallel collectives of the stages' own modules (the vocab-parallel loss
    on the last stage's rank) once per microbatch, each of a microbatch's bytes; FSDP2 of
    each stage as a pipeline runs it; and the rank's point-to-point transfers."""
    if not sch.annotations.of_kind(PIPELINE_CUT):
        return tensor_parallel + context_parallel_collectives(sch, shapes) + loss_collectives(sch, shapes) \
            + data_parallel_collectives(sch) + pipeline_collectives(sch, shapes, microbatches)
    stages = split_stages(sch)
    micro = max(1, microbatches)
    ranks = stage_ranks(len(stages), pp_size(sch) or len(stages))
    mine = [st for st in stages if ranks[st.index] == pp_rank]
    held = {path for st in mine for path, _ in st.schedule.module.named_modules() if path}
    if stages[-1] in mine:
        held.add("")  # the root's own boundaries: the model's output, on the last stage

    def each(c: Collective) -> tuple[Collective, ...]:
        share = dataclasses.replace(c, bytes=None if c.bytes is None else c.bytes // micro)
        return (share,) * micro

    per_micro = tensor_parallel + context_parallel_collectives(sch, shapes) \
        + (loss_collectives(sch, shapes) if stages[-1] in mine else ())
    out = [x for c in per_micro if c.path in held for x in each(c)]
    for st in mine:
        out += data_parallel_collectives(st.schedule, microbatches=micro)
    return tuple(out) + pipeline_collectives(sch, shapes, micro, pp_rank)


def _plain(value: Any) -> Any:
    """``value`` as JSON data: dataclasses and mappings as dicts, sequences and sets as
    lists, numbers, strings, booleans and None as they are, anything else as its text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(_plain(v) for v in value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _assumed(inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> str:
    """``input 0: int64 (4, 2048); attention_mask=: int64 (4, 2048)``."""
    named = [(f"input {i}", x) for i, x in enumerate(inputs)] + [(f"{k}=", v) for k, v in (kwargs or {}).items()]
    return "; ".join(f"{name}: {format_dtype(x.dtype)} {tuple(x.shape)}" for name, x in named
                     if isinstance(x, torch.Tensor))


def _tensor_parallel(
    sch: Schedule, inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None, shapes: ActivationShapes | None,
    note: str, expert_imbalance: float = 1.0,
) -> TensorParallelExplanation | None:
    if sch.mesh is None:
        return None
    return explain_tensor_parallel(sch, *inputs, kwargs=kwargs, shapes=shapes, failed=note,
                                   expert_imbalance=expert_imbalance)


def _memory(sch: Schedule, shapes: ActivationShapes | None, microbatches: int, kind: str,
            loss: LossFootprint = FULL_LOGITS_LOSS, state_dtype: torch.dtype | None = None) -> MemoryTable:
    if shapes is None:
        return per_rank_memory(sch, state_dtype=state_dtype)
    acts = activation_memory(sch, shapes, microbatches=microbatches, pipeline_schedule=kind, loss=loss)
    return per_rank_memory(sch, state_dtype=state_dtype, activations=acts)


def _stages(sch: Schedule) -> str:
    return str(stage_table(sch))


def model_flops(sch: Schedule, tokens: int, seq: int) -> tuple[float, float]:
    """(FLOPs of one training step over ``tokens`` tokens of sequences of ``seq``, the
    FLOPs checkpointing adds), for the whole model on all ranks: ``6N + 12·L·H·Q·T`` per
    token (N the parameters of every module but embeddings — a tied LM head counts —
    L layers, H heads, Q head size, T = ``seq``; the attention term needs a Hugging
    Face config); recomputation adds a checkpointed module's forward again
    (``2N' + 4·L'·H·Q·T`` per token for the checkpointed part).

    >>> import torch.nn as nn, slapo_fn as sf
    >>> model_flops(sf.create_schedule(nn.Linear(10, 10, bias=False)), tokens=3, seq=3)
    (1800.0, 0.0)
    """
    seen: set[int] = set()
    counted: dict[str, int] = {}
    for path, m in walk(sch.module):
        own = 0
        for p in m._parameters.values():
            if p is None or id(p) in seen or isinstance(m, torch.nn.Embedding):
                continue
            seen.add(id(p))
            own += p.numel()
        counted[path] = own
    n = sum(counted.values())
    config = config_of(sch.module)
    attention = 0.0
    layers = 0
    if config is not None:
        try:
            layers = int(config_value(config, *LAYER_COUNT_ATTRS))
            heads = int(config_value(config, *CONFIG_HEAD_COUNT_ATTRS))
            hidden = int(config_value(config, *HIDDEN_SIZE_ATTRS))
            head = config_value(config, "head_dim", default=None)
            q = int(head) if isinstance(head, int) and head > 0 else hidden // heads
            attention = 12.0 * layers * heads * q * seq
        except (KeyError, AttributeError, ValueError, TypeError):
            attention, layers = 0.0, 0
    ckpts = tuple(sch.annotations.of_kind(CHECKPOINT))
    n_ckpt = sum(v for path, v in counted.items() if any(path == c or path.startswith(c + ".") for c in ckpts))
    share = min(1.0, len(ckpts) / layers) if layers else 0.0
    total = (6.0 * n + attention) * tokens
    recompute = (2.0 * n_ckpt + attention / 3 * share) * tokens
    return total, recompute


def step_time(
    sch: Schedule,
    inputs: tuple[Any, ...],
    collectives: tuple[Collective, ...],
    profile: HardwareProfile,
    *,
    microbatches: int = 1,
    pipeline_schedule: str = "1f1b",
    calls: int = 0,
    dtype: torch.dtype | None = None,
) -> StepTime:
    """Estimate one step of ``sch`` on one rank (:func:`slapo_fn.hardware.estimate_step`):
    ``inputs[0]`` is one data-parallel rank's batch (``(batch, seq)``), its FLOPs
    (:func:`model_flops`) split over the tensor- and pipeline-parallel ranks, the
    collectives of :func:`explain` (TP/SP and pipeline transfers exposed, FSDP/DDP
    overlapped; under a pipeline, :func:`rank_collectives` lists TP ones once per
    microbatch, of the rank's stages only). ``calls`` is the
    number of modules one forward calls (all stages): each costs the profile's
    per-call overhead forward and twice backward, per microbatch, on one stage's share,
    and again forward when checkpointed. ``dtype``: the compute dtype (:func:`compute_dtype`
    when ``None``)."""
    first = inputs[0]
    shape = tuple(first.shape) if isinstance(first, torch.Tensor) else (1, 1)
    batch, seq = (int(shape[0]), int(shape[1])) if len(shape) > 1 else (1, int(shape[0]))
    sizes: dict[str, int] = {}
    if sch.mesh is not None:
        names = tuple(sch.mesh.mesh_dim_names or ())
        sizes = {n: int(v) for n, v in zip(names, tuple(sch.mesh.shape), strict=True)}
    spec = sch.annotations.get("", DATA_PARALLEL)
    shard_ranks = math.prod(v for n, v in sizes.items() if n not in (spec.mesh_axes if spec is not None else ("dp",)))
    flops, recompute = model_flops(sch, batch * seq, seq)
    stages = len(split_stages(sch)) if sch.annotations.of_kind(PIPELINE_CUT) else 1
    pp = sizes.get("pp", 1)
    micro = microbatches if stages > 1 else 1
    critical: list[tuple[str, int, str, int, int]] = []
    hidden: list[tuple[str, int, str, int, int]] = []
    first_boundary = next((c.path for c in collectives if c.origin == "pipeline"), None)
    for c in collectives:  # each entry is one collective (a pipeline's: one per microbatch)
        size = sizes.get(c.mesh_axis, 1)
        if c.origin == "pipeline":
            if c.path == first_boundary:
                critical.append((c.mesh_axis, 2, c.op, c.bytes or 0, 1))
        elif c.origin == "data_parallel":
            hidden.append((c.mesh_axis, size, c.op, c.bytes or 0, 1))
        else:
            critical.append((c.mesh_axis, size, c.op, c.bytes or 0, 1))
    ckpts = tuple(sch.annotations.of_kind(CHECKPOINT))
    again = sum(1 for path, _ in walk(sch.module) if any(path == c or path.startswith(c + ".") for c in ckpts))
    per_rank_calls = (3 * calls + again) * micro // max(1, pp)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype or compute_dtype(sch), "fp32")
    return estimate_step(profile, flops=flops / shard_ranks, recompute_flops=recompute / shard_ranks, dtype=name,
                         comm=critical, axis_sizes=sizes, overlapped=hidden, stages=stages if stages > 1 else 1,
                         microbatches=micro, stages_per_rank=max(1, stages // max(1, pp)),
                         tokens=batch * seq / shard_ranks, calls=per_rank_calls)


def compute_dtype(sch: Schedule) -> torch.dtype:
    """The dtype ``sch`` computes in: FSDP2's ``param_dtype`` where its data parallelism
    casts, else its parameters' dtype.

    >>> import torch.nn as nn, slapo_fn as sf
    >>> compute_dtype(sf.create_schedule(nn.Linear(2, 2)))
    torch.float32
    """
    spec = sch.annotations.get("", DATA_PARALLEL)
    param = next((p.dtype for p in sch.module.parameters()), torch.float32)
    return spec.param_dtype if spec is not None and spec.param_dtype is not None else param
