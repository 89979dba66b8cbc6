"""fork_rng's streams in one process: per-rank dropout without a host read (one graph
under torch.compile), the caller's CPU and CUDA generators as they were (``build`` and
``verify`` too), other random ops on a forked generator, DTensor activations by placement."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import slapo_fn as sf
from slapo_fn.dtensor.rng import forked
from slapo_fn.dtensor.testing import fake_mesh


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.GELU(), nn.Linear(32, 8), nn.Dropout(0.25))


def _run(fn: Any, x: torch.Tensor, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(x)`` after ``torch.manual_seed(seed)``, and the CPU generator's state after it."""
    torch.manual_seed(seed)
    return fn(x), torch.get_rng_state()


def test_forked_dropout_differs_across_ranks_and_leaves_one_stream_after() -> None:
    block, x = _block().train(), torch.randn(4, 8)
    (y0, after0), (y1, after1) = (_run(forked(block, c), x) for c in (0, 1))
    again, _ = _run(forked(block, 1), x)
    assert not torch.equal(y0 != 0, y1 != 0) and torch.equal(y1, again)  # per rank, reproducible
    torch.manual_seed(7)
    torch.randint(0, 2**62, (), dtype=torch.int64)  # the region's one draw, the same on every rank
    assert torch.equal(after0, after1) and torch.equal(after0, torch.get_rng_state())
    keep = (block[1](torch.ones(200_000)) != 0).float().mean()  # an unforked reference of the rate
    masked = forked(nn.Dropout(0.5), 0)(torch.ones(200_000))
    assert abs((masked != 0).float().mean() - keep) < 0.01 and set(masked.unique().tolist()) == {0.0, 2.0}
    out, _ = _run(forked(block.eval(), 0), x)
    assert torch.equal(out, block(x))  # eval: no dropout


def test_a_forked_block_is_one_graph_and_compiles_to_the_same_masks() -> None:
    block, x = _block().train(), torch.randn(4, 8)
    explained = torch._dynamo.explain(forked(block, 1))(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(forked(block, 1), backend="eager", fullgraph=True)
    (want, state), (got, state_compiled) = _run(forked(block, 1), x), _run(compiled, x)
    assert torch.equal(want, got) and torch.equal(state, state_compiled)


def test_other_random_ops_run_on_a_forked_generator_and_restore_it() -> None:
    def noisy(x: torch.Tensor) -> torch.Tensor:  # SDPA's own dropout among them
        attended = torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.5)
        return attended + torch.rand(x.shape) + torch.randn_like(x)

    x = torch.ones(1, 2, 8, 4)
    (y0, after0), (y1, after1) = (_run(forked(noisy, c), x) for c in (0, 1))
    assert not torch.equal(y0, y1) and torch.equal(_run(forked(noisy, 0), x)[0], y0)
    assert torch.equal(after0, after1)


class _FakeCuda:
    """One CUDA device's generator as ``torch.random.fork_rng`` reads and restores it."""

    def __init__(self) -> None:
        self.state, self.restored = torch.arange(16, dtype=torch.uint8), []

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.state.clone()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        self.restored.append(state.clone())


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCuda:
    cuda = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", cuda.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", cuda.set_rng_state)
    return cuda


@pytest.mark.parametrize("init", ["full", "reset"])
def test_build_and_verify_leave_the_cpu_and_cuda_generators_as_found(fake_cuda: _FakeCuda, init: str) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    plain, x = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)).train(), torch.randn(2, 4)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    built = sf.build(sf.create_schedule(model), init=init, seed=11)
    assert torch.equal(before, torch.get_rng_state())
    assert len(fake_cuda.restored) == 1 and torch.equal(fake_cuda.restored[0], fake_cuda.state)
    sf.verify(sf.create_schedule(plain), x)
    assert torch.equal(before, torch.get_rng_state()) and len(fake_cuda.restored) > 1
    assert all(torch.equal(s, fake_cuda.state) for s in fake_cuda.restored)
    assert isinstance(built, nn.Module)


def test_dtensor_dropout_per_rank_where_sharded_and_alike_where_replicated() -> None:
    mesh = fake_mesh(2)
    x = torch.ones(4, 64)
    for placement, alike in ((Shard(1), False), (Replicate(), True)):
        masks = []
        for c in (0, 1):
            torch.manual_seed(5)
            d = DTensor.from_local(x, mesh, [placement], run_check=False)
            out = forked(nn.Dropout(0.5), c)(d)
            assert isinstance(out, DTensor) and tuple(out.placements) == (placement,)
            masks.append(out.to_local() != 0)
        assert torch.equal(masks[0], masks[1]) == alike, placement
