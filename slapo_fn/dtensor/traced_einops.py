"""einops on the values :mod:`.flow` traces: a user's attention written with
``rearrange(x, "b s (h d) -> b s h d", h=self.heads)`` traces into the ``reshape`` and
``permute`` calls einops makes of it, with the sizes einops computes from the traced
shape, so the planner reads the split into heads off those calls as it reads any other
spelling of it (:func:`.features.view_shape`).

einops picks a backend by the type of the value it is given (its own extension point:
the subclasses of ``einops._backends.AbstractBackend``); the one here takes fx's traced
values and calls on them what einops' torch backend calls on tensors. It is defined
once, the first time a parent is traced in a process that has imported einops (a model
written without it never imports it), and answers only for traced values, so einops on
tensors is untouched.

One reason to change: how einops meets traced values.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch.fx as fx

__all__ = ["einops_on_traced_values"]


def einops_on_traced_values() -> None:
    """Make einops run on fx's traced values, where the process has imported einops."""
    if "einops" in sys.modules:
        _backend()


@functools.cache
def _backend() -> type:
    from einops._backends import TorchBackend

    class TracedBackend(TorchBackend):  # type: ignore[misc]
        """einops' torch backend, for fx's traced values (a :class:`torch.fx.Proxy`)."""

        framework_name = "torch.fx"  # einops loads a backend whose framework is imported

        def is_appropriate_type(self, tensor: Any) -> bool:
            return isinstance(tensor, fx.Proxy)

        def shape(self, x: Any) -> list[Any]:
            # the traced sizes (one per dimension where the tracer answers .shape so) as a
            # list: einops caches recipes by hashable shapes, and a traced size is no value
            # to cache by; a tracer that answers .shape with one value fails here, and the
            # trace is tried with the next tracer
            return list(x.shape)

    return TracedBackend
