"""Layouts: DTensor placements on a named mesh, readable by mesh-axis name.

A :class:`Layout` is a frozen value: one placement per mesh dimension (``Shard``,
``Replicate`` or a packed ``_StridedShard``), the mesh's dimension names and shape. It
renders the way JAX users read shardings — ``f32[4096@tp, 1024]`` — and converts from
a PartitionSpec-style tuple of mesh-axis names (``("tp", None)``).

Example:
    >>> import torch
    >>> from torch.distributed.tensor import Replicate, Shard
    >>> lay = Layout((Replicate(), Shard(0)), ("dp", "tp"), (2, 4))
    >>> lay.format((4096, 1024), torch.float32)
    'f32[4096@tp, 1024]'
    >>> lay.local_shape((4096, 1024))
    (1024, 1024)
    >>> from_spec(("tp", None), ("dp", "tp"), (2, 4)) == lay
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..render import format_dtype

__all__ = ["Layout", "describe", "from_spec", "packed_shard", "shard_axes"]

def packed_shard(axis: int, packed: int) -> Placement:
    """The placement sharding each of ``packed`` fused chunks along ``axis`` separately
    (``Shard(axis)`` when ``packed == 1``)."""
    return Shard(axis) if packed == 1 else _StridedShard(axis, split_factor=packed)


def describe(placement: Placement) -> str:
    """``S(0)``, ``R``, ``P`` or ``S(1)×3`` (packed)."""
    if isinstance(placement, _StridedShard):
        return f"S({placement.dim})×{placement.split_factor}"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Partial):
        return "P"
    return "R"


@dataclass(frozen=True)
class Layout:
    """Placements of one tensor over a named mesh (one placement per mesh dimension)."""

    placements: tuple[Placement, ...]
    mesh_dims: tuple[str, ...]
    mesh_shape: tuple[int, ...]

    def axes_of(self, dim: int, ndim: int) -> tuple[tuple[str, int], ...]:
        """The (mesh axis, packed factor) pairs that shard tensor dimension ``dim``."""
        out = []
        for name, p in zip(self.mesh_dims, self.placements, strict=True):
            if isinstance(p, Shard | _StridedShard) and p.dim % ndim == dim % ndim:
                out.append((name, int(p.split_factor) if isinstance(p, _StridedShard) else 1))
        return tuple(out)

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """This rank's shard shape (dimensions divide evenly: :func:`shard` checks it)."""
        local = list(shape)
        for size, p in zip(self.mesh_shape, self.placements, strict=True):
            if isinstance(p, Shard | _StridedShard):
                local[p.dim % len(local)] //= size
        return tuple(local)

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def format(self, shape: Sequence[int], dtype: torch.dtype) -> str:
        """``f32[4096@tp, 1024]``; a packed dimension reads ``3072@tp×3``."""
        name = format_dtype(dtype)
        dims = []
        for d, size in enumerate(shape):
            axes = self.axes_of(d, len(shape))
            text = str(size) + "".join(f"@{a}" + (f"×{k}" if k > 1 else "") for a, k in axes)
            dims.append(text)
        return f"{name}[{', '.join(dims)}]"

    def __str__(self) -> str:
        return "(" + ", ".join(f"{n}={describe(p)}" for n, p in zip(self.mesh_dims, self.placements, strict=True)) + ")"


def shard_axes(layout: Layout) -> tuple[str, ...]:
    """Mesh axes along which ``layout`` shards something."""
    pairs = zip(layout.mesh_dims, layout.placements, strict=True)
    return tuple(n for n, p in pairs if isinstance(p, Shard | _StridedShard))


def from_spec(
    spec: Sequence[str | tuple[str, ...] | None], mesh_dims: Sequence[str], mesh_shape: Sequence[int]
) -> Layout:
    """A layout from a PartitionSpec-style tuple: entry ``d`` names the mesh axis (or
    axes) that tensor dimension ``d`` is sharded over, ``None`` for none.

    Raises ``KeyError`` naming a mesh axis that the mesh lacks and ``ValueError`` for a
    mesh axis used twice.
    """
    placements: list[Placement] = [Replicate() for _ in mesh_dims]
    used: set[str] = set()
    for dim, entry in enumerate(spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for name in names:
            if name not in mesh_dims:
                raise KeyError(name)
            if name in used:
                raise ValueError(f"mesh axis {name!r} appears twice in {tuple(spec)!r}")
            used.add(name)
            placements[list(mesh_dims).index(name)] = Shard(dim)
    return Layout(tuple(placements), tuple(mesh_dims), tuple(mesh_shape))
