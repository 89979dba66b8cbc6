"""Per-rank memory of a schedule: parameters, gradients and optimizer state on each rank.

Computed from shapes alone (meta-device models, no process group): each parameter
counts its tensor-parallel shard (its ``layout``), divided over the data-parallel shard
axis by FSDP/HSDP (dim 0, padded up as FSDP2 pads it; rank 0's share is reported), and
only in the pipeline stage(s) that hold it. Gradients are as large as the parameters;
the optimizer keeps ``states`` fp32 tensors per parameter (AdamW: 2).

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> print(per_rank_memory(sf.create_schedule(nn.Linear(1024, 1024))))
    per-rank memory (rank 0 of each stage; optimizer: 2 fp32 states per parameter):
      stage  parameters  params   grads    optimizer  total
      -      1,049,600   4.0 MiB  4.0 MiB  8.0 MiB    16.0 MiB
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action

from .dtensor.data_parallel import DATA_PARALLEL
from .dtensor.shard import LAYOUT
from .pipelines.cut import PIPELINE_CUT
from .pipelines.split import split_stages
from .render import format_bytes
from .schedule import Schedule

__all__ = ["MemoryRow", "MemoryTable", "per_rank_memory", "profiled_peak_bytes"]


@dataclass(frozen=True)
class MemoryRow:
    stage: int | None
    parameters: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class MemoryTable:
    rows: tuple[MemoryRow, ...]
    states: int

    @property
    def max_total_bytes(self) -> int:
        return max((r.total_bytes for r in self.rows), default=0)

    def __str__(self) -> str:
        header = ["stage", "parameters", "params", "grads", "optimizer", "total"]
        table = [[("-" if r.stage is None else str(r.stage)), f"{r.parameters:,}",
                  *map(format_bytes, (r.param_bytes, r.grad_bytes, r.optimizer_bytes, r.total_bytes))]
                 for r in self.rows]
        widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
        lines = [f"per-rank memory (rank 0 of each stage; optimizer: {self.states} fp32 states per parameter):"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *table]]
        return "\n".join(lines)


def _dp_shards(sch: Schedule) -> int:
    spec = sch.annotations.get("", DATA_PARALLEL)
    if spec is None or spec.mode == "ddp" or sch.mesh is None:
        return 1
    names = tuple(sch.mesh.mesh_dim_names or ())
    shard_axis = spec.mesh_axes[-1]  # fsdp: its one axis; hsdp: (replicate, shard)
    return int(sch.mesh.size(names.index(shard_axis)))


def _row(sch: Schedule, stage: int | None, states: int) -> MemoryRow:
    dp = _dp_shards(sch)
    seen: set[int] = set()
    count = nbytes = 0
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
    fp32 = torch.finfo(torch.float32).bits // 8
    return MemoryRow(stage, count, nbytes, nbytes, states * count * fp32)


def per_rank_memory(sch: Schedule, *, states: int = 2) -> MemoryTable:
    """The per-rank memory of ``sch`` (one row per pipeline stage, or one row)."""
    if sch.annotations.of_kind(PIPELINE_CUT):
        return MemoryTable(tuple(_row(s.schedule, s.index, states) for s in split_stages(sch)), states)
    return MemoryTable((_row(sch, None, states),), states)


def profiled_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated above the starting point while ``fn()`` runs (freed
    temporaries included), measured — not estimated — from the PyTorch profiler's memory
    timeline; works on CPU. Relies on the profiler's private ``_memory_profile()``.

    >>> import torch
    >>> profiled_peak_bytes(lambda: torch.ones(1024, 1024).sum()) >= 4 * 2**20
    True
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    current = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            current += size
        elif action == Action.DESTROY:
            current -= size
        peak = max(peak, current)
    return peak
