"""``fork_rng``: random ops of a module draw from a per-TP-rank stream.

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> sch = sf.fork_rng(sf.create_schedule(nn.Sequential(nn.Dropout(0.1)), mesh=fake_mesh(2)), "0")
    >>> sch["0"].annotations["rng"]
    RngSpec(mesh_axis='tp')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..combinators import primitive
from ..errors import LayoutError
from ..schedule import Key, Schedule
from ..select import Selection
from .shard import _problem_mesh

__all__ = ["RNG", "RngSpec", "fork_rng", "forked"]

RNG: Key[RngSpec] = Key("rng")
_STRIDE = 1_000_003


@dataclass(frozen=True)
class RngSpec:
    mesh_axis: str

    def __str__(self) -> str:
        return f"rng@{self.mesh_axis}"


@primitive
def fork_rng(sch: Schedule, where: Selection, *, mesh_axis: str = "tp") -> Schedule:
    """Random ops inside the selected modules run with a per-``mesh_axis``-rank stream.

    Each call draws one seed from the default generator (the same on every rank, so one
    ``torch.manual_seed`` reproduces everything) and runs the module under
    ``seed + coordinate × 1_000_003``: dropout masks differ across TP ranks (on sharded
    activations) and are identical across the other mesh axes. The default generator
    advances by one draw, so the code after the module sees the same stream everywhere.
    Returns a new schedule; the input is unchanged.

    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 8))
    >>> sch = sf.fork_rng(sf.create_schedule(model, mesh=fake_mesh(2)), "1")
    >>> print(sch["1"].annotations["rng"])
    rng@tp
    """
    paths = where.modules(sch.module)
    problems = [p for p in (_problem_mesh(sch, path, mesh_axis) for path in paths) if p is not None]
    if problems:
        raise LayoutError("fork_rng", problems)
    for path in paths:
        sch = sch.annotate_path(path, RNG, RngSpec(mesh_axis))
    return sch


def forked(forward: Callable[..., Any], coordinate: int) -> Callable[..., Any]:
    """``forward`` run under a seed drawn from the default generator plus ``coordinate``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + coordinate * _STRIDE)
            return forward(*args, **kwargs)

    return run
