"""Partition specs: a tensor's layout by mesh-axis name, JAX's ``PartitionSpec``.

``P("dp", "tp")`` says: tensor dimension 0 is split over the mesh axis ``dp``, dimension
1 over ``tp``; ``None`` leaves a dimension whole; a tuple ``("dp", "tp")`` splits one
dimension over both axes (``dp`` major, as the mesh orders them). A dimension packed as
``k`` fused chunks, each split separately (``sf.shard(..., packed=3)`` on GPT-2's
``c_attn``), reads :class:`Packed` ``("tp", 3)``. Mesh axes a spec does not name hold
the tensor replicated. Trailing ``None`` entries do not matter: ``P("tp") == P("tp", None)``.

A spec lowers to DTensor placements on a named mesh (:func:`placements_of`, which checks
it against the tensor and the mesh) and back (:func:`spec_of`). A ``Partial`` placement
(a sum not yet reduced) has no spec; asking for one is a :class:`LayoutError`.

Example:
    >>> from torch.distributed.tensor import Replicate, Shard
    >>> P("tp", None) == P("tp")
    True
    >>> spec_of((Replicate(), Shard(0)), ("dp", "tp"), ndim=2)
    P('tp', None)
    >>> spec_of((Shard(1), Shard(1)), ("dp", "tp"), ndim=2)
    P(None, ('dp', 'tp'))
    >>> spec_of(placements_of(P(("tp", "dp")), ("dp", "tp"), (2, 4)), ("dp", "tp"), ndim=1, mesh_shape=(2, 4))
    P(('tp', 'dp'))
    >>> P(None, Packed("tp", 3))
    P(None, Packed('tp', 3))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..errors import LayoutError, Problem

__all__ = ["Entry", "P", "Packed", "placements_of", "spec_of"]


@dataclass(frozen=True)
class Packed:
    """A dimension of ``chunks`` fused blocks ([Q|K|V]), each split over ``mesh_axis``."""

    mesh_axis: str
    chunks: int

    def __repr__(self) -> str:
        return f"Packed({self.mesh_axis!r}, {self.chunks})"


Entry: TypeAlias = str | tuple[str, ...] | Packed | None


def _entry(e: object) -> Entry:
    if e is None or isinstance(e, str | Packed):
        return e
    if isinstance(e, tuple | list) and all(isinstance(x, str) for x in e):
        names = tuple(e)
        return None if not names else names[0] if len(names) == 1 else names
    raise TypeError(
        f"a PartitionSpec entry is a mesh-axis name, a tuple of names, Packed(name, k) or None, not {e!r}; "
        'e.g. sf.P("dp", None) or sf.P(("dp", "tp"))'
    )


class P(tuple):  # a tuple with value semantics, like jax.sharding.PartitionSpec
    """A PartitionSpec: one entry per tensor dimension (see the module docstring).

    A one-name tuple is the name (``P(("tp",)) == P("tp")``); trailing ``None`` entries
    are ignored by ``==`` and ``hash``.
    """

    def __new__(cls, *entries: object) -> P:
        return super().__new__(cls, tuple(_entry(e) for e in entries))

    def __getnewargs__(self) -> tuple[Entry, ...]:  # pickle and copy rebuild it from its entries
        return tuple(self)

    def _key(self) -> tuple[Entry, ...]:
        items = list(self)
        while items and items[-1] is None:
            items.pop()
        return tuple(items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, P):
            return self._key() == other._key()
        if isinstance(other, tuple):
            return self._key() == P(*other)._key()
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def axes(self, dim: int) -> tuple[str, ...]:
        """The mesh axes that split tensor dimension ``dim`` (major first)."""
        e = self[dim] if dim < len(self) else None
        return () if e is None else (e,) if isinstance(e, str) else (e.mesh_axis,) if isinstance(e, Packed) else e


def spec_of(placements: Sequence[Placement], mesh_dims: Sequence[str], *, ndim: int,
            mesh_shape: Sequence[int] | None = None, path: str = "") -> P:
    """The spec of a tensor with ``placements`` on a mesh named ``mesh_dims``.

    A dimension split over several mesh axes lists them major first: in mesh order for
    plain ``Shard``s, and with an FSDP2-style ``_StridedShard`` (FSDP2 over a TP shard:
    ``(_StridedShard(0, sf=tp), Shard(0))`` on ``("dp", "tp")``) the TP axis first,
    ``("tp", "dp")`` (that needs ``mesh_shape``). Raises :class:`LayoutError` for a
    ``Partial`` placement (no spec says "unreduced") and for layouts no spec describes.
    """
    if len(mesh_dims) != len(placements):
        raise LayoutError("specs", [Problem(path, "the mesh has no dimension names, so no spec can name its axes",
                                            'init_device_mesh(..., mesh_dim_names=("dp", "tp"))')])
    per_dim: list[list[int]] = [[] for _ in range(ndim)]
    for i, (name, p) in enumerate(zip(mesh_dims, placements, strict=True)):
        if isinstance(p, Partial):
            raise LayoutError(
                "specs",
                [Problem(path, f"is Partial over mesh axis {name!r} (a sum not yet reduced), which no spec describes",
                         "reduce it first: sf.func.constrain(x, sf.P(...)), or redistribute it to Replicate()")],
            )
        if isinstance(p, Shard | _StridedShard):
            per_dim[p.dim % ndim].append(i)
    entries: list[Entry] = []
    for d, dims in enumerate(per_dim):
        strided = [i for i in dims if isinstance(placements[i], _StridedShard)]
        if not strided:
            names = [mesh_dims[i] for i in dims]
            entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
            continue
        if len(dims) == 1:
            entries.append(Packed(mesh_dims[dims[0]], int(placements[dims[0]].split_factor)))  # type: ignore[attr-defined]
            continue
        if len(dims) == 2 and strided == dims[:1] and mesh_shape is not None \
                and int(placements[dims[0]].split_factor) == mesh_shape[dims[1]]:  # type: ignore[attr-defined]
            entries.append((mesh_dims[dims[1]], mesh_dims[dims[0]]))  # FSDP2 over a TP shard: TP major
            continue
        raise LayoutError("specs", [Problem(path, f"dimension {d} has the layout {tuple(placements)}, which no spec "
                                                  "describes (a packed dimension split over several mesh axes)",
                                            "split a packed dimension over one mesh axis")])
    return P(*entries)


def placements_of(
    spec: Sequence[Entry],
    mesh_dims: Sequence[str],
    mesh_shape: Sequence[int],
    *,
    shape: Sequence[int] | None = None,
    path: str = "",
) -> tuple[Placement, ...]:
    """DTensor placements for ``spec`` on a mesh, one per mesh dimension.

    With ``shape`` the spec is checked against the tensor: no more entries than
    dimensions, and each split dimension divisible by the product of its axes' sizes.
    Every problem is reported at once as a :class:`LayoutError` naming ``path``.
    """
    spec = spec if isinstance(spec, P) else P(*spec)
    dims = list(mesh_dims)
    problems: list[Problem] = []
    placements: list[Placement] = [Replicate() for _ in dims]
    used: dict[str, int] = {}
    if shape is not None and len(spec) > len(shape):
        problems.append(Problem(path, f"spec {spec!r} has {len(spec)} entries for a tensor of {len(shape)} "
                                      f"dimensions {tuple(shape)}", f"give at most {len(shape)} entries"))
    for d, e in enumerate(spec):
        names = spec.axes(d)
        for name in names:
            if name not in dims:
                problems.append(Problem(path, f"spec {spec!r} names mesh axis {name!r}, which the mesh lacks "
                                              f"(mesh axes: {tuple(dims)})", f"use one of {tuple(dims)}, or None"))
            elif name in used:
                problems.append(Problem(path, f"spec {spec!r} uses mesh axis {name!r} twice", "name each axis once"))
            else:
                used[name] = d
        known = [n for n in names if n in dims]
        reverse = len(known) == 2 and dims.index(known[0]) > dims.index(known[1])  # FSDP2 over TP: TP major
        if not reverse and [dims.index(n) for n in known] != sorted(dims.index(n) for n in known):
            problems.append(Problem(path, f"spec {spec!r} splits dimension {d} over {names}, which DTensor cannot "
                                          "lay out (axes out of mesh order, more than two)",
                                    f"write the axes in mesh order: {tuple(sorted(known, key=dims.index))}"))
        if reverse and isinstance(e, Packed):
            problems.append(Problem(path, f"spec {spec!r}: a packed dimension over two mesh axes", "one axis"))
        if shape is not None and d < len(shape) and known:
            parts = 1
            for n in known:
                parts *= mesh_shape[dims.index(n)]
            if isinstance(e, Packed):
                parts *= e.chunks
            if shape[d] % parts:
                problems.append(Problem(path, f"dimension {d} of size {shape[d]} does not split into {parts} even "
                                              f"parts over {known}" + (f" × {e.chunks} chunks" if isinstance(e, Packed)
                                                                       else ""),
                                        "pad the dimension, or split another one"))
        for n in known:
            placements[dims.index(n)] = _StridedShard(d, split_factor=e.chunks) if isinstance(e, Packed) else Shard(d)
        if reverse:  # the minor axis comes first in the mesh: it splits each of the major axis's parts
            placements[dims.index(known[1])] = _StridedShard(d, split_factor=mesh_shape[dims.index(known[0])])
    if problems:
        raise LayoutError("spec", problems)
    return tuple(placements)
