"""The collectives of a model that runs on DTensor activations, counted on fake tensors.

Where the plan runs the model on DTensor activations (:attr:`.plan.Plan.on_dtensors`),
its collectives are the ones PyTorch's sharding propagation chooses op by op, so nothing
short of that propagation predicts them. :func:`dtensor_collectives` runs it: the
schedule is built on a private copy whose tensors are fake (``FakeTensorMode``: shapes
and dtypes, no data), one forward and one backward run on example inputs, and every
functional collective DTensor issues is recorded with the bytes of the whole tensor it
operates on. Under a fake process group nothing moves; under a real one, the fake
tensors' collectives move nothing either (they are dispatched to their meta kernels).

A model whose code reads values (a router's expert counts) cannot run on fake tensors;
the counts are then unknown, and :func:`dtensor_collectives` says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..schedule import Schedule
from ..tree import private_copy
from .runtime import apply_tensor_parallel

__all__ = ["Recorded", "dtensor_collectives"]


@dataclass(frozen=True)
class Recorded:
    """One collective of the fake run: its op (``all_reduce``, ``all_gather``,
    ``reduce_scatter``, ``all_to_all``), the direction it ran in, and the bytes of the
    whole tensor it operates on."""

    direction: str
    op: str
    bytes: int
    mesh_axis: str


class _Record(TorchDispatchMode):
    def __init__(self, direction: str, into: list[Recorded], axes: Mapping[str, str]) -> None:
        super().__init__()
        self.direction, self.into, self.axes = direction, into, axes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # an op on DTensors goes back to DTensor, which re-dispatches its local ops and the
        # collectives of its redistributions here; run with this mode off, they go uncounted
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name != "wait_tensor" and not name.startswith("_"):
            op = name.replace("_into_tensor", "").replace("_tensor", "").replace("_single", "")
            # the whole tensor: an all-gather's result, the input of the others
            whole = out if op == "all_gather" else args[0]
            size = whole.numel() * whole.element_size() if isinstance(whole, torch.Tensor) else 0
            group = next((a for a in args if isinstance(a, str) and a in self.axes), "")
            self.into.append(Recorded(self.direction, op, int(size), self.axes.get(group, "?")))
        return out


def _loss(out: Any) -> torch.Tensor | None:
    """A scalar reaching every floating-point output (the backward the fake run measures)."""
    leaves = [t for t in pytree.tree_leaves(out.to_tuple() if hasattr(out, "to_tuple") else out)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    return sum((t.float().sum() for t in leaves), torch.zeros(())) if leaves else None  # type: ignore[return-value]


def dtensor_collectives(sch: Schedule, inputs: tuple[Any, ...],
                        kwargs: Mapping[str, Any] | None = None) -> tuple[tuple[Recorded, ...] | None, str]:
    """The collectives one forward and one backward of the built ``sch`` issue on
    ``inputs`` (shapes and dtypes: real, meta or fake tensors), counted on fake tensors;
    ``(None, why)`` where the model cannot run on them."""
    recorded: list[Recorded] = []
    assert sch.mesh is not None
    names = sch.mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(sch.mesh.ndim))
    axes = {str(sch.mesh.get_group(i).group_name): name for i, name in enumerate(names)}
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            model = private_copy(sch.module, copy_data=True)
            apply_tensor_parallel(model, sch)
            args, kw = pytree.tree_map(
                lambda t: fake.from_tensor(t) if isinstance(t, torch.Tensor) and not t.is_meta
                else torch.empty(t.shape, dtype=t.dtype, requires_grad=t.requires_grad)
                if isinstance(t, torch.Tensor) else t, (tuple(inputs), dict(kwargs or {})))
            with _Record("forward", recorded, axes):
                out = model(*args, **kw)
            loss = _loss(out)
            if loss is not None:
                with _Record("backward", recorded, axes):
                    loss.backward()
    except Exception as e:  # a model whose code reads values cannot run on fake tensors
        first = str(e).splitlines()[0] if str(e) else ""
        return None, f"the fake run on DTensor activations failed: {type(e).__name__}: {first}"
    return tuple(recorded), ""
