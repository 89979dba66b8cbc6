"""The Schedule value: a module tree plus annotations plus the history of rewrites.

A :class:`Schedule` is frozen. Primitives return new schedules; structural rewrites
copy only the modules on the path they change (see :mod:`slapo_fn.tree`), annotation
rewrites copy nothing of the tree at all.

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    >>> sch = sf.create_schedule(model)
    >>> sch2 = sf.checkpoint(sch, "0")
    >>> sch2.module is sch.module, len(sch.history), len(sch2.history)
    (True, 0, 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import torch
from torch import nn

from .errors import Problem, ScheduleTypeError, SelectorError
from .render import render_tree
from .select import select
from .tree import child_names, get_module, split, walk

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .combinators import Rewrite

__all__ = ["Annotations", "Key", "Schedule", "View", "create_schedule"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
D = TypeVar("D")


@dataclass(frozen=True)
class Key(Generic[T_co]):
    """The typed name of one kind of annotation, declared once, next to the rewrite that
    writes it (``LAYOUT: Key[Layout] = Key("layout")`` in :mod:`slapo_fn.dtensor.shard`).

    Readers import the key instead of spelling its name, so a rename or a wrong value
    type is a type error, not a silent ``None``. Your own primitives declare their own:

    >>> import torch.nn as nn, slapo_fn as sf
    >>> FROZEN: sf.Key[bool] = sf.Key("frozen")
    >>> sch = sf.create_schedule(nn.Linear(2, 2)).annotate_path("weight", FROZEN, True)
    >>> sch.annotations.get("weight", FROZEN), sch.annotations.of_kind(FROZEN)
    (True, {'weight': True})
    """

    name: str

    def __repr__(self) -> str:
        return f"Key({self.name!r})"


_NOT_A_KEY = (
    "annotations are read and written by typed keys, not strings: got {got!r}. "
    "Import the key from the rewrite that writes it (from slapo_fn.rewrites.checkpoint import CHECKPOINT; "
    "sch.annotations.of_kind(CHECKPOINT)) or declare your own (FROZEN = sf.Key[bool]('frozen'))"
)


def _name(key: Key[Any]) -> str:
    if not isinstance(key, Key):
        raise TypeError(_NOT_A_KEY.format(got=key))
    return key.name


class Annotations(Mapping[str, Mapping[str, Any]]):
    """An immutable map ``path -> {kind name -> value}``, read and written by typed
    :class:`Key` values.

    ``set``/``drop`` return new maps; the values stored should themselves be immutable
    (frozen dataclasses, tuples, ``MappingProxyType``). As a mapping it is keyed by path
    (``sch.annotations["layers.0"]["checkpoint"]``), for display and inspection.
    """

    __slots__ = ("_data", "_kinds")

    def __init__(self, data: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self._data: dict[str, MappingProxyType[str, Any]] = {
            path: MappingProxyType(dict(kinds)) for path, kinds in (data or {}).items() if kinds
        }
        #: ``{kind name: {path: value}}``, built on the first ``of_kind`` (the map never changes)
        self._kinds: dict[str, dict[str, Any]] | None = None

    def __getitem__(self, path: str) -> Mapping[str, Any]:
        return self._data[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    @overload  # type: ignore[override]
    def get(self, path: str, key: Key[T], /) -> T | None: ...
    @overload
    def get(self, path: str, key: Key[T], default: D, /) -> T | D: ...
    @overload
    def get(self, path: str, /) -> Mapping[str, Any] | None: ...
    @overload
    def get(self, path: str, default: Mapping[str, Any], /) -> Mapping[str, Any]: ...

    def get(self, path: str, *args: Any) -> Any:
        """``get(path, key[, default])``: the ``key`` annotation of ``path`` (typed by the
        key); ``get(path[, default])``: every annotation of ``path``, as a mapping does."""
        if args and isinstance(args[0], Key):
            kinds = self._data.get(path)
            default = args[1] if len(args) > 1 else None
            return default if kinds is None else kinds.get(args[0].name, default)
        return self._data.get(path, *args)

    def of_kind(self, key: Key[T]) -> dict[str, T]:
        """``{path: value}`` of every ``key`` annotation, in insertion order (a new dict:
        the plan reads a few kinds thousands of times, so they are indexed once per map)."""
        name = _name(key)
        if self._kinds is None:
            index: dict[str, dict[str, Any]] = {}
            for path, kinds in self._data.items():
                for kind, value in kinds.items():
                    index.setdefault(kind, {})[path] = value
            self._kinds = index
        return dict(self._kinds.get(name, {}))

    def set(self, path: str, key: Key[T], value: T) -> Annotations:
        new = Annotations.__new__(Annotations)
        new._kinds = None
        new._data = dict(self._data)
        new._data[path] = MappingProxyType({**self._data.get(path, {}), _name(key): value})
        return new

    def unset(self, path: str, key: Key[Any]) -> Annotations:
        """The same map without the ``key`` annotation of ``path``."""
        new = Annotations.__new__(Annotations)
        new._kinds = None
        new._data = dict(self._data)
        kinds = {k: v for k, v in self._data.get(path, {}).items() if k != _name(key)}
        if kinds:
            new._data[path] = MappingProxyType(kinds)
        else:
            new._data.pop(path, None)
        return new

    def without(self, key: Key[Any]) -> Annotations:
        """The same map with every ``key`` annotation removed."""
        return Annotations({p: {k: v for k, v in kinds.items() if k != key.name} for p, kinds in self._data.items()})

    def drop(self, paths: AbstractSet[str]) -> Annotations:
        new = Annotations.__new__(Annotations)
        new._kinds = None
        new._data = {p: k for p, k in self._data.items() if p not in paths}
        return new

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Annotations) and {p: dict(k) for p, k in self._data.items()} == {
            p: dict(k) for p, k in other._data.items()
        }

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Annotations({ {p: dict(k) for p, k in self._data.items()} })"


def _exists(root: nn.Module, path: str) -> bool:
    tokens = split(path)
    module = root
    for i, token in enumerate(tokens):
        child = module._modules.get(token)
        if child is None:
            return i == len(tokens) - 1 and module._parameters.get(token) is not None
        module = child
    return True


@dataclass(frozen=True)
class View:
    """A read-only view of one path of a schedule (``sch["layers.0.attn"]``).

    ``module`` is the schedule's own module object: inspect it or call it, but do not
    mutate it (use a rewrite instead).
    """

    path: str
    module: nn.Module
    annotations: Mapping[str, Any]

    @property
    def type(self) -> type:
        return type(self.module)

    @property
    def children(self) -> tuple[str, ...]:
        return tuple(child_names(self.module))

    @property
    def parameters(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """This module's own parameters: ``{name: (shape, dtype)}``."""
        return MappingProxyType(
            {n: (tuple(p.shape), p.dtype) for n, p in self.module._parameters.items() if p is not None}
        )

    def __str__(self) -> str:
        return render_tree(self.module, self.path, _annotations_below(self.path, self.annotations))


def _annotations_below(path: str, kinds: Mapping[str, Any]) -> Annotations:
    return Annotations({path: kinds}) if kinds else Annotations()


@dataclass(frozen=True, eq=False, repr=False)
class Schedule:
    """An immutable schedule: ``module`` (the tree as rewritten so far), the ``mesh``,
    per-path ``annotations`` and the ``history`` of rewrites applied.

    ``original`` is the model given to :func:`create_schedule`, the default reference of
    :func:`slapo_fn.verify`. Nothing reachable from a schedule is ever mutated by
    slapo_fn.
    """

    module: nn.Module
    mesh: DeviceMesh | None = None
    annotations: Annotations = field(default_factory=Annotations)
    history: tuple[Rewrite, ...] = ()
    original: nn.Module | None = None

    def evolve(self, **changes: Any) -> Schedule:
        """A new schedule with some fields replaced (for primitives' implementations)."""
        return dataclasses.replace(self, **changes)

    def with_module(self, module: nn.Module, *, replaced: tuple[str, ...] = ()) -> Schedule:
        """A new schedule over a rewritten tree; annotations at or below ``replaced`` paths
        that no longer resolve in the new tree are dropped."""
        stale = {
            p
            for p in self.annotations
            if any(p == r or p.startswith(r + ".") or not r for r in replaced) and not _exists(module, p)
        }
        return self.evolve(module=module, annotations=self.annotations.drop(stale))

    def annotate_path(self, path: str, key: Key[T], value: T) -> Schedule:
        """A new schedule with the ``key`` annotation of ``path`` set to ``value``."""
        return self.evolve(annotations=self.annotations.set(path, key, value))

    def __getitem__(self, path: str) -> View:
        found = select(path).modules(self.module)  # SelectorError with close matches if none
        if found != (path,):
            raise SelectorError(path, reason=f"a view needs one exact module path; this selects {len(found)}",
                                fix=f"index with one of them, e.g. sch[{found[0]!r}]")
        return View(path, get_module(self.module, path), self.annotations.get(path, MappingProxyType({})))

    def paths(self) -> Iterator[str]:
        """Every module path of the tree, in pre-order."""
        return (p for p, _ in walk(self.module))

    def __repr__(self) -> str:
        mesh = "None" if self.mesh is None else f"{tuple(self.mesh.mesh_dim_names or ())}{tuple(self.mesh.shape)}"
        return (
            f"Schedule({type(self.module).__name__}, {len(self.history)} rewrites, "
            f"{len(self.annotations)} annotated paths, mesh={mesh})"
        )

    def __str__(self) -> str:
        return render_tree(self.module, "", self.annotations)


def create_schedule(model: nn.Module, *, mesh: DeviceMesh | None = None) -> Schedule:
    """Start a schedule for ``model`` (which is not copied and never mutated).

    Works on real and meta-device models; ``mesh`` is the ``DeviceMesh`` that layout
    rewrites name axes of (``"dp"``, ``"pp"``, ``"tp"``…).

    >>> import torch.nn as nn, slapo_fn as sf
    >>> sf.create_schedule(nn.Linear(2, 2))
    Schedule(Linear, 0 rewrites, 0 annotated paths, mesh=None)
    """
    if not isinstance(model, nn.Module):
        raise ScheduleTypeError(
            "create_schedule",
            [Problem("", f"expected an nn.Module, got {type(model).__name__}", "pass the model itself")],
        )
    if mesh is not None and not hasattr(mesh, "mesh_dim_names"):
        raise ScheduleTypeError(
            "create_schedule",
            [
                Problem(
                    "",
                    f"mesh must be a DeviceMesh, got {type(mesh).__name__}",
                    'mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))',
                )
            ],
        )
    return Schedule(module=model, mesh=mesh, original=model)


def path_exists(root: nn.Module, path: str) -> bool:
    """Whether ``path`` names a module or a parameter under ``root``."""
    return _exists(root, path)
