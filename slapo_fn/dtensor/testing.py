"""A fake process group for single-process use: doctests, ``explain``, unit tests.

``fake_mesh(4)`` starts (once) a ``fake`` process group
(``torch.testing._internal.distributed.fake_pg``) of the mesh's size in this process and
returns a ``DeviceMesh`` on it: DTensor placement logic and ``CommDebugMode`` work,
collectives move no data.

>>> fake_mesh(2).shape
(2,)
"""

from __future__ import annotations

import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["fake_mesh"]


def fake_mesh(*shape: int, names: tuple[str, ...] | None = None) -> DeviceMesh:
    """A mesh of ``shape`` (names default to ``("tp",)`` for 1-D, ``("dp", "tp")`` for
    2-D) on a fake process group of ``prod(shape)`` ranks, this process being rank 0.

    A fake group of another size is replaced. Raises ``RuntimeError`` if a real process
    group of another size is already running.
    """
    if names is None:
        names = ("tp",) if len(shape) == 1 else ("dp", "tp") if len(shape) == 2 else tuple(f"d{i}" for i in shape)
    world = math.prod(shape)
    if dist.is_initialized() and dist.get_world_size() != world and dist.get_backend() == "fake":
        dist.destroy_process_group()
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    if dist.get_world_size() != world:
        raise RuntimeError(f"a process group of {dist.get_world_size()} ranks is running; this mesh needs {world}")
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
