"""A fake process group for single-process use: doctests, ``explain``, unit tests.

``fake_mesh(4)`` starts a ``fake`` process group
(``torch.testing._internal.distributed.fake_pg``) of the mesh's size in this process and
returns a ``DeviceMesh`` on it: DTensor placement logic and ``CommDebugMode`` work,
collectives move no data. ``fake_world(n)`` does the same for the duration of a block
and puts back whatever group was there before.

>>> fake_mesh(2).shape
(2,)
>>> fake_mesh(2, 2, 2).mesh_dim_names
('dp', 'pp', 'tp')
>>> with fake_world(8):
...     fake_mesh(2, 4).mesh_dim_names
('dp', 'tp')
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = ["DEFAULT_NAMES", "fake_mesh", "fake_world"]

#: Mesh-axis names by number of mesh dimensions, outermost first.
DEFAULT_NAMES: dict[int, tuple[str, ...]] = {1: ("tp",), 2: ("dp", "tp"), 3: ("dp", "pp", "tp")}


def _fake_size() -> int | None:
    """The world size of a running fake default group; ``None`` if none runs. Raises
    ``RuntimeError`` if a real one runs (a fake one must never replace it)."""
    if not dist.is_initialized():
        return None
    if dist.get_backend() != "fake":
        raise RuntimeError(
            f"a real {dist.get_backend()} process group of {dist.get_world_size()} ranks is running; "
            "fake meshes are for single-process use"
        )
    return dist.get_world_size()


def _start(world: int) -> None:
    if _fake_size() not in (None, world):
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def fake_mesh(*shape: int, names: tuple[str, ...] | None = None) -> DeviceMesh:
    """A mesh of ``shape`` on a fake process group of ``prod(shape)`` ranks, this process
    being rank 0. Names default to :data:`DEFAULT_NAMES` (``tp``; ``dp, tp``; ``dp, pp,
    tp``); a mesh of more dimensions needs ``names``.

    A running fake group of another size is replaced (use :func:`fake_world` to have it
    put back). A real process group of the same size is used as it is; of another size,
    it is a ``RuntimeError``.
    """
    if names is None:
        if len(shape) not in DEFAULT_NAMES:
            raise ValueError(f"a {len(shape)}-D mesh needs names=(...), one per dimension")
        names = DEFAULT_NAMES[len(shape)]
    world = math.prod(shape)
    if dist.is_initialized() and dist.get_backend() != "fake":
        if dist.get_world_size() != world:
            raise RuntimeError(f"a process group of {dist.get_world_size()} ranks is running; this mesh needs {world}")
    else:
        _start(world)
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake default process group of ``world_size`` ranks for the duration of the block.

    Afterwards the process is as before: no group, or the fake group of the size that
    ran before. A fake group of the same size is used as it is. Raises ``RuntimeError``
    if a real process group is running.
    """
    before = _fake_size()
    if before == world_size:
        yield
        return
    _start(world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if before is not None:
            _start(before)
