"""Dropout whose mask is a counter-based hash, for fused CPU kernels.

Inductor fuses dropout into the surrounding elementwise kernel, but on CPU it draws
each element's random number by building a Philox engine for that element (about
12 ns an element here, slower than eager ``bernoulli_``), and it stores the mask as
``bool``, which its CPU code generation writes slowly. :func:`counter_dropout` draws one
64-bit key per call from PyTorch's default generator and derives each element's keep
bit from a hash of (key, element index): a few integer multiplies, shifts and xors
that inductor vectorises, and nothing to save for backward but the key (the mask is
recomputed there). This is the counter-based scheme GPU kernels use (Philox is one);
the hash is Wellons' ``lowbias32`` (a bijection on 32 bits with low avalanche bias),
applied twice with the two 32-bit halves of the key, so that masks drawn with
different keys are not shifts or xor-permutations of one another.

The masks are as random as dropout needs (keep rate ``1 - p`` to within ``2**-32``,
no measurable correlation between neighbouring elements or successive calls) but are
a different stream from eager ``F.dropout``: like inductor's own fused dropout, a run
is reproducible under ``torch.manual_seed`` but does not repeat eager's masks. Off
CPU it is ``F.dropout`` (inductor's Philox is vectorised on GPUs).

:func:`slapo_fn.fuse` uses it for dropout inside regions it compiles with inductor
(unless ``options={"fallback_random": True}`` asks for eager's exact masks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CounterDropout", "counter_dropout", "dropout_keep_scale"]

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` held in int64, without overflowing
    int64: the constant is split in 16-bit halves."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep_scale(numel: int, p: float, key: torch.Tensor, *, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    """The flat dropout multiplier for ``numel`` elements: ``1 / (1 - p)`` where an
    element is kept, else 0, from a 62-bit integer ``key`` (a 0-d int64 tensor).

    Element ``i`` is kept when ``lowbias32(lowbias32(i ^ k0) ^ k1) >= p * 2**32``, with
    ``k0``/``k1`` the key's low and high 32 bits. The comparison is done in integer
    arithmetic (a sign bit, not a ``bool`` tensor), which compiled CPU code stores fast.

    Example:
        >>> import torch
        >>> m = dropout_keep_scale(100_000, 0.25, torch.tensor(7), dtype=torch.float32, device=torch.device("cpu"))
        >>> torch.unique(m).tolist() == [0.0, torch.tensor(4 / 3).item()]
        True
        >>> abs(float((m > 0).float().mean()) - 0.75) < 0.01
        True
    """
    index = torch.arange(numel, dtype=torch.int64, device=device)
    h = _lowbias32((index ^ (key & _M32)) & _M32 ^ (index >> 32))
    h = _lowbias32(h ^ ((key >> 32) & _M32))
    keep = ((h - int(p * 2**32)) >> 63) + 1  # 1 where h >= threshold, else 0
    return keep.to(dtype) * (1.0 / (1.0 - p))


def counter_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout`` with a counter-based hash mask on CPU (see the module docstring);
    ``F.dropout`` itself elsewhere. Same signature and scaling (kept elements are
    multiplied by ``1 / (1 - p)``).

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> x = torch.ones(10_000, requires_grad=True)
        >>> y = counter_dropout(x, 0.5)
        >>> sorted(set(y.tolist()))
        [0.0, 2.0]
        >>> y.sum().backward()
        >>> torch.equal(x.grad, y.detach())
        True
        >>> torch.equal(counter_dropout(x, 0.5, training=False), x)
        True
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if x.device.type != "cpu" or not x.is_floating_point():
        return F.dropout(x, p, training, inplace)
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x.mul_(0.0) if inplace else torch.zeros_like(x)
    key = torch.randint(0, 2**62, (), dtype=torch.int64, device=x.device)
    scale = dropout_keep_scale(x.numel(), p, key, dtype=x.dtype, device=x.device).view(x.shape)
    return x.mul_(scale) if inplace else x * scale


class CounterDropout(nn.Dropout):
    """``nn.Dropout`` drawing its masks with :func:`counter_dropout`; honours
    ``train()``/``eval()`` like ``nn.Dropout``.

    Example:
        >>> import torch
        >>> d = CounterDropout(0.1).eval()
        >>> x = torch.randn(4, 8)
        >>> torch.equal(d(x), x)
        True
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # nn.Dropout names it input
        return counter_dropout(x, self.p, self.training, self.inplace)
