"""``seeded``: a block run with every generator seeded, and every generator restored after.

``torch.manual_seed`` seeds the CPU generator and each CUDA device's; ``torch.random.fork_rng``
restores only the devices it is given. Code that seeds for its own purposes (``build``'s
initialisation, ``verify``'s runs) forks them all here, so the caller's CPU and CUDA
streams are as it left them.

Example:
    >>> import torch
    >>> before = torch.get_rng_state()
    >>> with seeded(0):
    ...     _ = torch.rand(3)
    >>> torch.equal(before, torch.get_rng_state())
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["seeded"]


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Run the block with the CPU and every CUDA generator seeded from ``seed`` (left as
    they are for ``None``), and restore them all to their states before it after."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        yield
