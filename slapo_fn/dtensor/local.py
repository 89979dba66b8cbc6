"""``tp_local``: modules that run on this rank's shard of the activations.

A module placed after column-parallel projections — Qwen3's per-head ``q_norm`` /
``k_norm`` — sees only this rank's heads. Its parameters stay replicated, but each rank's
gradient is a partial sum (its heads only), so the true gradient is their sum over the
tensor-parallel axis, as Megatron does for QK-layernorm. ``tp_local`` states that: in the
build the parameters become replicated DTensors whose gradients are ``Partial`` over
``mesh_axis``, reduced when read (the optimizer step, ``full_tensor()``).

Which modules see sharded data is a fact of the model's data flow, so it is declared (a
recipe's data), not guessed: a norm *before* a column projection in the same parent sees
the full input and must not be marked.

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> sch = sf.create_schedule(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), mesh=fake_mesh(2))
    >>> print(sf.tp_local(sch, "1")["1"].annotations["tp_local"])
    local@tp
"""

from __future__ import annotations

from dataclasses import dataclass

from ..combinators import primitive
from ..errors import LayoutError, Problem
from ..schedule import Key, Schedule
from ..select import Selection
from .shard import LAYOUT, ROLE, _problem_mesh

__all__ = ["LOCAL", "LocalSpec", "tp_local"]

LOCAL: Key[LocalSpec] = Key("tp_local")


@dataclass(frozen=True)
class LocalSpec:
    mesh_axis: str

    def __str__(self) -> str:
        return f"local@{self.mesh_axis}"


@primitive
def tp_local(sch: Schedule, where: Selection, *, mesh_axis: str = "tp") -> Schedule:
    """Declare that the selected modules run on this rank's shard over ``mesh_axis``:
    their replicated parameters get partial-sum gradients, reduced over ``mesh_axis``.
    Returns a new schedule; the input is unchanged (example: the module docstring)."""
    paths = where.modules(sch.module)
    problems = [p for p in (_problem_mesh(sch, path, mesh_axis) for path in paths) if p is not None]
    layouts, roles = sch.annotations.of_kind(LAYOUT), sch.annotations.of_kind(ROLE)
    for path in paths:
        module = sch[path].module
        if path in roles or any(f"{path}.{n}" in layouts for n in module._parameters):
            problems.append(Problem(path, "is sharded itself", "tp_local is for replicated parameters: drop it"))
        elif not any(p is not None for p in module._parameters.values()):
            problems.append(Problem(path, "has no parameters of its own", "select the module that holds them"))
    if problems:
        raise LayoutError("tp_local", problems)
    for path in paths:
        sch = sch.annotate_path(path, LOCAL, LocalSpec(mesh_axis))
    return sch
