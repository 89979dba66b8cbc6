"""Roles: how a sharded module computes, as small frozen values in the shape of PyTorch's
``ParallelStyle``.

A role owns, over its mesh axis, what its module takes (the layout its input must have,
and the layout of the local gradient of that input), what it gives (its output's layout
before any resharding), and its local forward: the module's computation on the local
shards of its input and parameters, with no collective (a ``Linear``'s own forward, a
subclass's too: float8, LoRA, quantized). The planner, the runtime on
local shards and the DTensor regions ask a role these questions; none of them branches
on which role it is.

============  ===============  ======================  ===============================
role          takes (input)    its input's local grad  gives (output)
============  ===============  ======================  ===============================
``Column``    ``Replicate``    ``Partial``             ``Shard(d)`` (features)
``Row``       ``Shard(d)``     ``Shard(d)``            ``Partial`` (bias added after)
``Channels``  ``Shard(d)``     ``Shard(d)``            ``Shard(d)`` (each channel alone)
``VocabEmbed``  token ids      —                       ``Partial`` (rows outside: 0)
``EmbedDim``  token ids        —                       ``Shard(-1)``
``Gathered``  as it comes      as it comes             as it computes (parameters gathered)
============  ===============  ======================  ===============================

``d`` is the role's :attr:`Role.dim`, the activation dimension its features are on: the
last for a linear layer (``-1``), the channels for a convolution or a norm over channels
(``1``, of ``N, C, ...``).

Example:
    >>> import torch, torch.nn as nn
    >>> role = Column("tp")
    >>> print(role)
    column@tp
    >>> role.takes(3), role.input_grad(3), role.gives(3)
    (Replicate(), Partial(sum), Shard(dim=2))
    >>> lin = nn.Linear(4, 6)
    >>> role.local_forward(lin, torch.ones(2, 4), rank=0).shape  # its own weight here: 6 features
    torch.Size([2, 6])
    >>> Row("tp", dim=1).takes(4)  # a convolution's input channels (N, C, H, W)
    Shard(dim=1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.nn.utils.stateless import _reparametrize_module

from ..tree import adds_bias

__all__ = ["Channels", "Column", "EmbedDim", "Gathered", "Role", "Row", "VocabEmbed", "left_apart",
           "local_value", "reading", "run_own_forward", "whole_params"]


def local_value(p: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a parameter (a plain tensor is its own)."""
    return p.to_local() if isinstance(p, DTensor) else p


#: How a local forward reads a parameter's shard (inside ``torch.func`` transforms the
#: runtime reads it without DTensor's own ``to_local``).
Local = Callable[[torch.Tensor | None], torch.Tensor | None]


def whole_params(module: nn.Module, role: Role) -> tuple[str, ...]:
    """The DTensor parameters ``role``'s local forward reads whole on every rank (a LoRA's
    ``A`` in a column, its ``B`` in a row), but a bias added after the sum: their local
    gradients are partial sums over the axis, to be all-reduced. A bias the module's forward
    leaves to its caller (:func:`~slapo_fn.tree.adds_bias`) it does not read at all."""
    apart = left_apart(module, role)
    return tuple(n for n, p in module._parameters.items() if isinstance(p, DTensor)
                 and not any(p is q for q in apart) and all(isinstance(pl, Replicate) for pl in p.placements))


def left_apart(module: nn.Module, role: Role | None) -> tuple[torch.Tensor, ...]:
    """The parameters of ``module`` its local forward under ``role`` does not combine with
    this rank's activations: a bias ``role`` adds after the sum, and one the module's own
    forward leaves to its caller (:func:`~slapo_fn.tree.adds_bias`). Their gradients are whole on every
    rank, never partial sums."""
    after = role.bias_after(module) if role is not None else None
    unread = None if adds_bias(module) else module._parameters.get("bias")
    return tuple(p for p in (after, unread) if p is not None)


def reading(values: Sequence[tuple[torch.Tensor, torch.Tensor]], local: Local) -> Local:
    """``local``, but for each parameter of ``values`` (matched by identity) its given value."""

    def read(p: torch.Tensor | None) -> torch.Tensor | None:
        for q, v in values:
            if q is p:
                return v
        return local(p)

    return read


@dataclass(frozen=True)
class Role:
    """How a sharded module computes over ``mesh_axis`` (``packed``: the number of fused
    chunks each sharded separately, GPT-2's [Q|K|V] is 3; ``dim``: the activation
    dimension its features are on, ``-1`` for a linear layer, ``1`` for the channels of a
    convolution's ``N, C, ...``)."""

    mesh_axis: str
    packed: int = 1
    dim: int = -1
    #: How ``print(sch)`` names it (``column@tp``).
    name: ClassVar[str] = ""
    #: Whether the module's own forward runs, on its parameters gathered (``Gathered``),
    #: instead of :meth:`local_forward`.
    own_forward: ClassVar[bool] = False

    # What the planner asks of a role, answered from its transfer (no caller names a role):

    def feature_dim(self, ndim: int) -> int:
        """:attr:`dim` as a dimension of an activation with ``ndim`` dimensions."""
        return self.dim % ndim

    @property
    def keeps(self) -> bool:
        """Takes this rank's features and gives them back, each computed alone (a norm over
        channels, a depthwise convolution): runs between a column and its row as an
        activation does."""
        return not self.own_forward and isinstance(self.takes(3), Shard) and isinstance(self.gives(3), Shard)

    @property
    def enters(self) -> bool:
        """Takes whole activations and splits its output's features (a column): entering
        the tensor-parallel region, its input's gradient is all-reduced."""
        return not self.own_forward and isinstance(self.takes(3), Replicate)

    @property
    def splits_input(self) -> bool:
        """Takes this rank's features of an activation and sums over them (a row)."""
        return not self.own_forward and isinstance(self.takes(3), Shard) and not self.keeps

    @property
    def sums(self) -> bool:
        """Gives a partial sum, reduced after it (a row, a vocabulary embedding)."""
        return not self.own_forward and isinstance(self.gives(3), Partial)

    @property
    def splits_output(self) -> bool:
        """Gives this rank's features (a column, packed or not; an embedding split by its
        dimension)."""
        return not self.own_forward and isinstance(self.gives(3), Shard | _StridedShard) and not self.keeps

    @property
    def reads_ids(self) -> bool:
        """Takes token ids (an embedding), with no gradient of its input."""
        return not self.own_forward and self.takes(3) is None

    def __str__(self) -> str:
        return (f"{self.name}@{self.mesh_axis}" + (f"×{self.packed}" if self.packed > 1 else "")
                + (f"[dim {self.dim}]" if self.dim != -1 else ""))

    def takes(self, ndim: int) -> Placement | None:
        """The layout its input must have over :attr:`mesh_axis`; ``None`` for token ids
        (whole on every rank, with no gradient)."""
        return Replicate()

    def input_grad(self, ndim: int) -> Placement:
        """The layout of the gradient :meth:`local_forward` makes for its local input."""
        return Replicate()

    def gives(self, ndim: int) -> Placement:
        """The layout of what :meth:`local_forward` returns."""
        return Replicate()

    def local_forward(self, module: nn.Module, x: torch.Tensor, rank: int, local: Local = local_value
                      ) -> torch.Tensor:
        """The module's computation on this rank's shards (``rank`` on :attr:`mesh_axis`),
        with no collective; ``local`` reads a parameter's shard."""
        raise NotImplementedError(f"{self} runs its module's own forward")

    def bias_after(self, module: nn.Module) -> torch.Tensor | None:
        """A bias :meth:`local_forward` leaves out, to be added once to the summed output."""
        return None

    def add_bias(self, y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``y`` plus the per-feature ``b`` of :meth:`bias_after`, along :attr:`dim`."""
        return y + b.reshape(*b.shape, *(1,) * (y.dim() - 1 - self.feature_dim(y.dim())))


def _linear(module: nn.Module, x: torch.Tensor, bias: bool, local: Local) -> torch.Tensor:
    """A linear layer's computation on this rank's shards; ``bias=False`` leaves the bias
    out (a row adds it once, after the sum). A ``Linear`` runs its own forward (a subclass's
    too: float8, LoRA, quantized) on the local values of its parameters; see
    :func:`run_own_forward`. A bias the module leaves to its caller (:func:`~slapo_fn.tree.adds_bias`) is
    never added here."""
    bias = bias and adds_bias(module)
    if isinstance(module, nn.Linear):
        if type(module).forward is nn.Linear.forward:  # F.linear itself: no swap needed
            return F.linear(x, local(module.weight), local(module.bias) if bias else None)  # type: ignore[arg-type]
        values = {n: None if p is None or (n == "bias" and not bias) else local(p)
                  for n, p in module._parameters.items()}
        return run_own_forward(module, values, x)
    w = local(module.weight)  # type: ignore[arg-type]
    b = local(module.bias) if bias else None  # type: ignore[arg-type]
    assert w is not None
    if isinstance(module, CONVOLUTIONS):  # a column or a row over channels: its groups are whole
        return _conv(module, x, w, b, module.groups)
    # Hugging Face's Conv1D stores its weight (in, out), and its forward reshapes to its full
    # output width (``nf``): the product is written here
    flat = x.reshape(-1, x.shape[-1])
    y = torch.addmm(b, flat, w) if b is not None else flat @ w
    return y.view(*x.shape[:-1], w.shape[1])


def run_own_forward(module: nn.Module, values: dict[str, torch.Tensor | None], *args: Any) -> Any:
    """The forward of ``module``'s class run on ``values`` in place of its parameters (this
    rank's shards; ``None`` for a bias left out), as ``torch.func.functional_call`` does,
    but calling the class's forward, not the instance's (which build replaces by the
    sharded one)."""
    with _reparametrize_module(module, values):  # type: ignore[arg-type]
        return type(module).forward(module, *args)


#: The convolutions :func:`~slapo_fn.dtensor.shard` lays out over their channels.
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: The norms over channels it lays out so (their statistics per channel or per group).
CHANNEL_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.GroupNorm)

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def channels_rank(module: nn.Module) -> int | None:
    """The number of dimensions of ``module``'s (batched) output where its features are
    channels, dim 1 of ``N, C, *spatial``: a convolution's, a BatchNorm2d's (4); ``None``
    for any other module, and for a norm that takes several ranks (BatchNorm1d, GroupNorm)."""
    if isinstance(module, CONVOLUTIONS):
        return len(module.kernel_size) + 2
    fixed = {nn.BatchNorm2d: 4, nn.BatchNorm3d: 5, nn.InstanceNorm2d: 4, nn.InstanceNorm3d: 5}
    return next((rank for kind, rank in fixed.items() if isinstance(module, kind)), None)


def _conv(module: nn.Module, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, groups: int) -> torch.Tensor:
    """``module``'s convolution with weight ``w``, bias ``b`` and ``groups`` (this rank's)."""
    assert isinstance(module, CONVOLUTIONS)
    conv = _CONV[len(module.kernel_size)]
    if module.padding_mode != "zeros":
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        return conv(x, w, b, module.stride, 0, module.dilation, groups)  # type: ignore[operator]
    return conv(x, w, b, module.stride, module.padding, module.dilation, groups)  # type: ignore[operator]


def _local_groups(groups: int, channels: int, x: torch.Tensor) -> int:
    """This rank's share of ``groups`` over ``channels``, read off its input's channels."""
    return groups * x.shape[1] // channels


@dataclass(frozen=True)
class Column(Role):
    """Output features split (a ``Linear``'s weight rows, a ``Conv1D``'s columns; the bias
    split alike): whole input in, this rank's features out; the local input gradient is a
    partial sum. Packed, its local features are this rank's share of each fused chunk."""

    name: ClassVar[str] = "column"

    def takes(self, ndim: int) -> Placement:
        return Replicate()

    def input_grad(self, ndim: int) -> Placement:
        return Partial()

    def gives(self, ndim: int) -> Placement:
        d = self.feature_dim(ndim)
        return Shard(d) if self.packed == 1 else _StridedShard(d, split_factor=self.packed)

    def local_forward(self, module: nn.Module, x: torch.Tensor, rank: int, local: Local = local_value
                      ) -> torch.Tensor:
        return _linear(module, x, True, local)


@dataclass(frozen=True)
class Row(Role):
    """Input features split (the weight's columns; the bias whole, added once after the
    sum): this rank's features in, a partial sum out."""

    name: ClassVar[str] = "row"

    def takes(self, ndim: int) -> Placement:
        return Shard(self.feature_dim(ndim))

    def input_grad(self, ndim: int) -> Placement:
        return Shard(self.feature_dim(ndim))

    def gives(self, ndim: int) -> Placement:
        return Partial()

    def local_forward(self, module: nn.Module, x: torch.Tensor, rank: int, local: Local = local_value
                      ) -> torch.Tensor:
        return _linear(module, x, False, local)

    def bias_after(self, module: nn.Module) -> torch.Tensor | None:
        return module._parameters.get("bias") if adds_bias(module) else None


@dataclass(frozen=True)
class Channels(Role):
    """Every per-channel tensor split alike (a BatchNorm's weight, bias and running
    statistics; a GroupNorm's; a grouped or depthwise convolution's output channels, whole
    groups each): this rank's channels in, the same channels out, each computed from its
    own alone. Between a column and its row it runs on the shard as an activation does."""

    name: ClassVar[str] = "channels"

    def takes(self, ndim: int) -> Placement:
        return Shard(self.feature_dim(ndim))

    def input_grad(self, ndim: int) -> Placement:
        return Shard(self.feature_dim(ndim))

    def gives(self, ndim: int) -> Placement:
        return Shard(self.feature_dim(ndim))

    def local_forward(self, module: nn.Module, x: torch.Tensor, rank: int, local: Local = local_value
                      ) -> torch.Tensor:
        if isinstance(module, CONVOLUTIONS):  # whole groups: this rank's groups of its channels
            w = local(module.weight)  # type: ignore[arg-type]
            assert w is not None
            return _conv(module, x, w, local(module.bias), _local_groups(module.groups, module.in_channels, x))
        if isinstance(module, nn.GroupNorm):
            groups = _local_groups(module.num_groups, module.num_channels, x)
            return F.group_norm(x, groups, local(module.weight), local(module.bias), module.eps)
        # a norm with per-channel statistics: its own forward on this rank's parameters and
        # statistics (the running ones updated in place, in this rank's shard)
        tensors = {n: local(t) for n, t in (*module.named_parameters(recurse=False),
                                            *module.named_buffers(recurse=False))}
        with _reparametrize_module(module, tensors):  # type: ignore[arg-type]
            return type(module).forward(module, x)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class VocabEmbed(Role):
    """An embedding's rows (the vocabulary) split: each rank looks up the ids in its rows
    and gives zeros for the others, a partial sum over the ranks."""

    name: ClassVar[str] = "vocab"

    def takes(self, ndim: int) -> None:
        return None

    def gives(self, ndim: int) -> Placement:
        return Partial()

    def local_forward(self, module: nn.Module, x: torch.Tensor, rank: int, local: Local = local_value
                      ) -> torch.Tensor:
        w = local(module.weight)  # type: ignore[arg-type]
        assert w is not None and isinstance(module, nn.Embedding)
        rows = w.shape[0]
        lo = rank * rows
        outside = (x < lo) | (x >= lo + rows)
        pad = module.padding_idx
        local_pad = pad - lo if isinstance(pad, int) and lo <= pad < lo + rows else None
        return F.embedding((x - lo).masked_fill(outside, 0), w, local_pad).masked_fill(outside.unsqueeze(-1), 0.0)


@dataclass(frozen=True)
class EmbedDim(Role):
    """An embedding's columns (the embedding dimension) split: this rank's features of
    every id."""

    name: ClassVar[str] = "embed_dim"

    def takes(self, ndim: int) -> None:
        return None

    def gives(self, ndim: int) -> Placement:
        return Shard(self.feature_dim(ndim))

    def local_forward(self, module: nn.Module, x: torch.Tensor, rank: int, local: Local = local_value
                      ) -> torch.Tensor:
        w = local(module.weight)  # type: ignore[arg-type]
        assert w is not None and isinstance(module, nn.Embedding)
        return F.embedding(x, w, module.padding_idx, module.max_norm, module.norm_type, module.scale_grad_by_freq,
                           module.sparse)


@dataclass(frozen=True)
class Gathered(Role):
    """Any other sharding of a module's parameters: the module's own forward runs on them
    gathered (one all-gather per use), on whatever it is handed."""

    name: ClassVar[str] = "param"
    own_forward: ClassVar[bool] = True
