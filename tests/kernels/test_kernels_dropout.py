"""counter_dropout: the hash, its statistics, its edges, and compiled forward/backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slapo_fn.kernels import CounterDropout, counter_dropout
from slapo_fn.kernels.dropout import _lowbias32, dropout_keep_scale

CPU = torch.device("cpu")


def lowbias32_reference(x: int) -> int:
    """Wellons' lowbias32 with Python integers (wrapping multiplies)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_is_lowbias32_in_int64_without_overflow() -> None:
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, *torch.randint(0, 2**32, (200,)).tolist()]
    got = _lowbias32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [lowbias32_reference(v) for v in values]
    assert lowbias32_reference(1) != lowbias32_reference(2)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_scale(p: float) -> None:
    n = 1 << 20
    m = dropout_keep_scale(n, p, torch.tensor(12345), dtype=torch.float32, device=CPU)
    zero, scale = torch.unique(m).tolist()
    assert zero == 0.0 and scale == pytest.approx(1 / (1 - p))
    kept = float((m > 0).double().mean())
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(kept - (1 - p)) < 5 * sigma


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


def test_masks_are_uncorrelated_across_neighbours_and_keys() -> None:
    n = 1 << 20
    keep = [(dropout_keep_scale(n, 0.5, torch.tensor(k), dtype=torch.float32, device=CPU) > 0) for k in (1, 2, 2**40)]
    bound = 5 / n**0.5
    assert abs(correlation(keep[0][:-1], keep[0][1:])) < bound  # neighbouring elements
    assert abs(correlation(keep[0][:-1024], keep[0][1024:])) < bound  # a row apart
    assert abs(correlation(keep[0], keep[1])) < bound  # keys differing in one bit
    assert abs(correlation(keep[0], keep[2])) < bound  # keys differing in the high half
    # a key change is not a shift of the stream (as idx + key would be)
    assert not any(torch.equal(keep[0][s:s + 4096], keep[1][:4096]) for s in range(1, 64))


def test_reproducible_under_manual_seed_and_fresh_each_call() -> None:
    x = torch.ones(4096)
    torch.manual_seed(3)
    a, b = counter_dropout(x, 0.3), counter_dropout(x, 0.3)
    torch.manual_seed(3)
    assert torch.equal(counter_dropout(x, 0.3), a)
    assert not torch.equal(a, b)


def test_edges_match_f_dropout() -> None:
    x = torch.randn(64, 8)
    assert counter_dropout(x, 0.5, training=False) is x
    assert counter_dropout(x, 0.0) is x
    assert torch.equal(counter_dropout(x, 1.0), torch.zeros_like(x))
    y = x.clone()
    out = counter_dropout(y, 0.5, inplace=True)
    assert out is y and set(torch.unique(out / x).tolist()) <= {0.0, 2.0}
    with pytest.raises(ValueError, match="between 0 and 1"):
        counter_dropout(x, 1.5)
    with pytest.raises(ValueError):
        F.dropout(x, 1.5)


def test_gradient_is_the_forward_mask() -> None:
    x = torch.randn(32, 16, requires_grad=True)
    y = counter_dropout(x, 0.25)
    y.backward(torch.ones_like(y))
    assert x.grad is not None
    assert torch.equal(x.grad, (y != 0).float() / 0.75)


def test_module_follows_train_and_eval() -> None:
    d = CounterDropout(0.5)
    assert isinstance(d, nn.Dropout) and d.p == 0.5
    x = torch.ones(1000)
    assert (d(x) == 0).any()
    assert torch.equal(d.eval()(x), x)


@pytest.mark.slow
def test_compiled_backward_recomputes_the_forward_mask() -> None:
    compiled = torch.compile(lambda x, b: counter_dropout(x + b, 0.5))
    x = torch.randn(256, 64, requires_grad=True)
    b = torch.zeros(64, requires_grad=True)
    y = compiled(x, b)
    y.backward(torch.ones_like(y))
    assert x.grad is not None and b.grad is not None
    mask = (y != 0).float() * 2.0
    assert torch.equal(x.grad, mask)
    assert torch.allclose(b.grad, mask.sum(0))
    assert abs(float((y != 0).float().mean()) - 0.5) < 0.02
