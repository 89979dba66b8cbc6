"""Fixtures for every test and doctest (tests/ and the package's doctests).

Single-process tests and doctests start a ``fake`` process group for DTensor placement
logic (``slapo_fn.dtensor.testing.fake_mesh``). Left running, it would make the next test
believe it runs distributed (DCP then plans a 2-rank save with no peer), so it is torn
down after each test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _no_fake_process_group_left() -> Iterator[None]:
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()
