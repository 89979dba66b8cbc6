"""``data_parallel``: FSDP2, DDP and HSDP over mesh axes, applied last by ``build``.

The engine is PyTorch's own: ``fully_shard`` (FSDP2) per block and on the root for
``"fsdp"``; FSDP2 over a 2-D (replicate, shard) mesh for ``"hsdp"``; and the FSDP2-based
composable ``replicate`` for ``"ddp"`` (it keeps FQNs, and composes with tensor-parallel
DTensor parameters). ``build`` applies it after tensor parallelism, checkpointing and
compilation, on its private copy, so parameter names stay those of the original model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..combinators import primitive
from ..errors import LayoutError, Problem, ScheduleError
from ..rewrites._common import contains
from ..schedule import Key, Schedule, path_exists
from ..select import Selection
from ..tree import get_module, walk
from .context import CP
from .shard import _problem_mesh, mesh_dims

__all__ = ["DATA_PARALLEL", "DataParallelSpec", "apply_data_parallel", "data_parallel", "find_blocks", "shard_axes"]

DATA_PARALLEL: Key[DataParallelSpec] = Key("data_parallel")
Mode = Literal["fsdp", "ddp", "hsdp"]
_MODES = ("fsdp", "ddp", "hsdp")


@dataclass(frozen=True)
class DataParallelSpec:
    """How the model is data-parallel: ``mode`` over ``mesh_axes``, FSDP units ``blocks``."""

    mode: str
    mesh_axes: tuple[str, ...]
    blocks: tuple[str, ...]
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True

    def __str__(self) -> str:
        extra = f", param_dtype={self.param_dtype}" if self.param_dtype else ""
        return f"{self.mode}@{'×'.join(self.mesh_axes)}({len(self.blocks)} blocks{extra})"


def find_blocks(root: nn.Module) -> tuple[str, ...]:
    """The repeated blocks of a model: children of every ``ModuleList`` whose children
    are of one type and hold parameters (``model.layers.*``, ``transformer.h.*``,
    ``encoder.block.*`` and ``decoder.block.*``…).

    >>> import torch.nn as nn
    >>> find_blocks(nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])))
    ('0.0', '0.1')
    """
    blocks: list[str] = []
    for path, module in walk(root):
        if isinstance(module, nn.ModuleList) and len(module) > 1 and not any(path.startswith(b + ".") for b in blocks):
            kids = [c for c in module._modules.values() if c is not None]
            if len({type(c) for c in kids}) == 1 and any(True for _ in kids[0].parameters()):
                blocks += [f"{path}.{name}" if path else name for name in module._modules]
    return tuple(blocks)


def _axes(mesh_axis: str | tuple[str, ...]) -> tuple[str, ...]:
    return (mesh_axis,) if isinstance(mesh_axis, str) else tuple(mesh_axis)


@primitive
def data_parallel(
    sch: Schedule,
    where: Selection | None = None,
    *,
    mode: Mode = "fsdp",
    mesh_axis: str | tuple[str, ...] = "dp",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> Schedule:
    """Train the model data-parallel over ``mesh_axis`` of the schedule's mesh.

    ``mode="fsdp"``: FSDP2 ``fully_shard`` on each block (``where``; default: the repeated
    blocks found by :func:`find_blocks`) and on the root; ``"hsdp"``: the same over two
    mesh axes, ``mesh_axis=("dp_replicate", "dp_shard")``; ``"ddp"``: replicated
    parameters, gradients all-reduced (FSDP2-based ``replicate``). ``param_dtype`` /
    ``reduce_dtype`` set FSDP2 mixed precision. Applied by ``build`` after tensor
    parallelism, checkpointing and compilation; FQNs are unchanged. Returns a new
    schedule; the input is unchanged.

    Example:
        >>> import torch.nn as nn, slapo_fn as sf
        >>> from slapo_fn.dtensor.testing import fake_mesh
        >>> model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
        >>> sch = sf.data_parallel(sf.create_schedule(model, mesh=fake_mesh(2, names=("dp",))))
        >>> print(sch[""].annotations["data_parallel"])
        fsdp@dp(2 blocks)
    """
    axes = _axes(mesh_axis)
    problems = []
    if mode not in _MODES:
        problems.append(Problem("", f"unknown data-parallel mode {mode!r}", f"use one of {', '.join(_MODES)}"))
    elif (mode == "hsdp") != (len(axes) == 2) or len(axes) not in (1, 2):
        problems.append(
            Problem(
                "",
                f"mode {mode!r} takes {'two mesh axes' if mode == 'hsdp' else 'one mesh axis'}, got {axes}",
                'hsdp: mesh_axis=("dp_replicate", "dp_shard"); fsdp/ddp: mesh_axis="dp"',
            )
        )
    # one "no mesh" problem however many axes were named
    problems += dict.fromkeys(p for p in (_problem_mesh(sch, "", a) for a in axes) if p is not None)
    if problems:
        raise LayoutError("data_parallel", problems)
    existing = sch.annotations.get("", DATA_PARALLEL)
    if existing is not None:
        again = Problem("", f"already data-parallel: {existing}", "apply data_parallel once per schedule")
        raise ScheduleError("data_parallel", [again])
    blocks = find_blocks(sch.module) if where is None else where.modules(sch.module)
    nested = [b for b in blocks if any(contains(o, b) for o in blocks)]
    if nested or "" in blocks:
        raise ScheduleError(
            "data_parallel",
            [
                Problem(
                    b or "",
                    "FSDP units cannot nest (the root is always one)",
                    "select the blocks, e.g. 'model.layers.*'",
                )
                for b in (nested or [""])
            ],
        )
    spec = DataParallelSpec(mode, axes, tuple(blocks), param_dtype, reduce_dtype, reshard_after_forward)
    return sch.annotate_path("", DATA_PARALLEL, spec)


def shard_axes(sch: Schedule) -> tuple[str, ...]:
    """The mesh axes FSDP2 shards parameters over: the data-parallel axes, and where the
    schedule is context-parallel, its ``cp`` axis too (torchtitan's ``dp_shard_cp``: the
    ``cp`` ranks hold different tokens, so their gradients are reduced as data
    parallelism's are), in mesh order. Empty without ``data_parallel``."""
    spec: DataParallelSpec | None = sch.annotations.get("", DATA_PARALLEL)
    if spec is None or sch.mesh is None:
        return ()
    return tuple(n for n in mesh_dims(sch.mesh) if n in (*spec.mesh_axes, *_cp_axes(sch)))


def _fsdp_mesh(sch: Schedule, spec: DataParallelSpec) -> tuple[DeviceMesh, int]:
    """The mesh FSDP2 shards over (:func:`shard_axes`, flattened into one dimension where
    they are several) and the data-parallel degree its gradients are averaged over (the
    ``cp`` ranks' gradients are summed: each holds its tokens' share of the loss)."""
    assert sch.mesh is not None
    axes = shard_axes(sch)
    mesh = sch.mesh[axes[0]] if len(axes) == 1 else sch.mesh[axes]._flatten("_".join(axes))
    return mesh, math.prod(sch.mesh[a].size() for a in spec.mesh_axes if a not in _cp_axes(sch))


def _cp_axes(sch: Schedule) -> set[str]:
    return {s.mesh_axis for s in sch.annotations.of_kind(CP).values()}


def apply_data_parallel(model: nn.Module, sch: Schedule) -> None:
    """Wrap ``model`` (build's private copy) as the schedule says; a no-op without it."""
    spec: DataParallelSpec | None = sch.annotations.get("", DATA_PARALLEL)
    if spec is None:
        return
    assert sch.mesh is not None
    mp = MixedPrecisionPolicy(param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype)
    if spec.mode == "fsdp" and _cp_axes(sch):
        mesh, dp = _fsdp_mesh(sch, spec)
        _shard(model, spec, mesh, mp)
        for m in model.modules():  # sum over cp, average over dp
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(float(dp))
                if mesh.device_type == "cpu":  # gloo has no PREMUL_SUM: a sum, then the division
                    m.set_force_sum_reduction_for_comms(True)
        return
    mesh = sch.mesh[spec.mesh_axes[0]] if len(spec.mesh_axes) == 1 else sch.mesh[spec.mesh_axes]
    if spec.mode == "ddp":
        replicate(model, mesh=mesh, mp_policy=mp)
        return
    _shard(model, spec, mesh, mp)


def _shard(model: nn.Module, spec: DataParallelSpec, mesh: DeviceMesh, mp: MixedPrecisionPolicy) -> None:
    """``fully_shard`` each block of ``spec`` that ``model`` holds, then the root."""
    for path in spec.blocks:
        if not path_exists(model, path):  # a pipeline stage holds only its own blocks
            continue
        block = get_module(model, path)
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=spec.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=spec.reshard_after_forward)
