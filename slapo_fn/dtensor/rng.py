"""``fork_rng``: random ops of a module draw from a per-TP-rank stream.

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> sch = sf.fork_rng(sf.create_schedule(nn.Sequential(nn.Dropout(0.1)), mesh=fake_mesh(2)), "0")
    >>> sch["0"].annotations["rng"]
    RngSpec(mesh_axis='tp')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from ..combinators import primitive
from ..errors import LayoutError
from ..kernels.dropout import dropout_keep_scale
from ..schedule import Key, Schedule
from ..select import Selection
from .shard import _problem_mesh

__all__ = ["RNG", "RngSpec", "fork_rng", "forked"]

RNG: Key[RngSpec] = Key("rng")


@dataclass(frozen=True)
class RngSpec:
    mesh_axis: str

    def __str__(self) -> str:
        return f"rng@{self.mesh_axis}"


@primitive
def fork_rng(sch: Schedule, where: Selection, *, mesh_axis: str = "tp") -> Schedule:
    """Random ops inside the selected modules run with a per-``mesh_axis``-rank stream.

    Each call draws one key from the default generator as a tensor (the same on every
    rank, so one ``torch.manual_seed`` reproduces everything; never read on the host for
    dropout) and mixes in the rank's coordinate on ``mesh_axis``: dropout masks differ
    across TP ranks (on sharded activations) and are identical across the other mesh
    axes. The default CPU generator advances by that one draw and the CUDA generator not
    at all, so the code after the module sees the same stream on every rank; DTensor
    activations on CUDA keep PyTorch's own offset-based RNG tracker (see :func:`forked`).
    Returns a new schedule; the input is unchanged.

    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 8))
    >>> sch = sf.fork_rng(sf.create_schedule(model, mesh=fake_mesh(2)), "1")
    >>> print(sch["1"].annotations["rng"])
    rng@tp
    """
    paths = where.modules(sch.module)
    problems = [p for p in (_problem_mesh(sch, path, mesh_axis) for path in paths) if p is not None]
    if problems:
        raise LayoutError("fork_rng", problems)
    for path in paths:
        sch = sch.annotate_path(path, RNG, RngSpec(mesh_axis))
    return sch


def forked(forward: Callable[..., Any], coordinate: int) -> Callable[..., Any]:
    """``forward`` with its random ops drawing a stream of this rank's ``coordinate``.

    Each call draws one 62-bit key from the default CPU generator — a tensor, never read
    on the host — so every rank advances that generator alike and touches no other
    (the CUDA generator is left as it was found): code after the region draws the same
    numbers on every rank, and one ``torch.manual_seed`` reproduces everything. Inside,
    under :class:`_Forked`:

    * dropout on a plain tensor (``nn.Dropout``, ``F.dropout``, any device) keeps the
      elements of a counter-based hash mask (:func:`~slapo_fn.kernels.dropout.dropout_keep_scale`)
      of the key mixed with the coordinate and the call's index in the region: tensor
      arithmetic only, so ``torch.compile`` traces the region in one graph;
    * dropout on a DTensor is DTensor's own (on CUDA, PyTorch's offset-based RNG
      tracker draws each shard's part of the whole tensor's stream); off CUDA, where
      DTensor has no tracker, the hash mask, mixed with the coordinate where the
      DTensor is sharded and the same on every rank where it is replicated;
    * any other random op (``torch.rand``, SDPA with ``dropout_p``, ...) runs under a
      fork of its device's generator seeded from the key, mixed likewise: its key is
      read on the host there (one graph break under ``torch.compile``), and the
      generator is restored after it.
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        key = torch.randint(0, 2**62, (), dtype=torch.int64)
        with _Forked(key, coordinate):
            return forward(*args, **kwargs)

    return run


_M62 = 2**62 - 1
_DROPOUTS = frozenset({F.dropout})
_RANDOM = frozenset({
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like, torch.bernoulli,
    torch.normal, torch.poisson, torch.multinomial, torch.randperm, torch.dropout, torch.alpha_dropout,
    torch.feature_dropout, torch.feature_alpha_dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d,
    F.dropout2d, F.dropout3d, F.rrelu, F.gumbel_softmax, torch.Tensor.bernoulli, torch.Tensor.bernoulli_,
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.exponential_, torch.Tensor.geometric_,
    torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.Tensor.random_, torch.Tensor.multinomial,
})


def _splitmix(*words: int) -> int:
    """A 62-bit mix of small integers (SplitMix64's finaliser), as a graph constant."""
    z = 0
    for w in words:
        z = (z + 0x9E3779B97F4A7C15 + w) & (2**64 - 1)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        z ^= z >> 31
    return z & _M62


class _Forked(TorchFunctionMode):
    """The random ops of one run of a forked region (see :func:`forked`): ``key`` is
    the run's draw, ``coordinate`` this rank's; the ``n``-th random op of the run
    uses ``key ^ splitmix(coordinate, n)``."""

    def __init__(self, key: torch.Tensor, coordinate: int) -> None:
        super().__init__()
        self.key, self.coordinate, self.calls = key, coordinate, 0

    def _next(self, per_rank: bool) -> torch.Tensor:
        self.calls += 1
        return self.key ^ _splitmix(self.coordinate if per_rank else 0, self.calls)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return self._dropout(*args, **kwargs)
        if func in _RANDOM or (func is F.scaled_dot_product_attention and _sdpa_dropout(*args, **kwargs)):
            return self._on_a_forked_generator(func, args, kwargs)
        return func(*args, **kwargs)

    def _dropout(self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        cuda_dtensor = isinstance(x, DTensor) and x.device.type == "cuda"
        if cuda_dtensor or not training or p in (0.0, 1.0) or not 0.0 < p < 1.0 or not x.is_floating_point():
            return F.dropout(x, p, training, inplace)  # PyTorch's RNG tracker, or nothing to draw (or a bad p)
        factor: torch.Tensor
        if isinstance(x, DTensor):  # sharded: this rank's own mask; replicated: the same on every rank
            local = x.to_local()
            key = self._next(any(pl.is_shard() for pl in x.placements))
            scale = dropout_keep_scale(local.numel(), p, key, dtype=local.dtype, device=local.device)
            factor = DTensor.from_local(scale.view(local.shape), x.device_mesh, x.placements, run_check=False,
                                        shape=x.shape, stride=x.stride())
        else:
            factor = dropout_keep_scale(x.numel(), p, self._next(True), dtype=x.dtype, device=x.device).view(x.shape)
        return x.mul_(factor) if inplace else x * factor

    def _on_a_forked_generator(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        devices = {t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        device = kwargs.get("device")
        if device is not None:
            devices.add(torch.device(device))
        cuda = sorted({d.index if d.index is not None else torch.cuda.current_device()
                       for d in devices if d.type == "cuda"})
        seed = int(self._next(True))  # a CPU tensor read on the host: no device sync
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            return func(*args, **kwargs)


def _sdpa_dropout(*args: Any, dropout_p: float = 0.0, **kwargs: Any) -> bool:
    return (args[4] if len(args) > 4 else dropout_p) > 0.0
