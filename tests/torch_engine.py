"""PyTorch's own tensor-parallel engine, run on the same weights as a slapo_fn schedule.

Differential tests write a plan once and run it twice: as slapo_fn calls, and through
``parallelize_module`` with PyTorch's parallel styles, activations kept as DTensors
(``use_local_output=False``) so that DTensor's sharding propagation computes whatever code
sits between the styled modules. This module is the PyTorch side (worker-side: it runs on
every rank of a ``tests/dist.py`` pool):

* :func:`role_style` — the style of one sharded layer: ``ColwiseParallel`` /
  ``RowwiseParallel`` for ``nn.Linear`` and ``nn.Embedding`` (a vocabulary-parallel
  embedding is ``RowwiseParallel(input_layouts=Replicate())``, an embedding split by
  features ``ColwiseParallel``), :class:`Conv1DParallel` for Hugging Face's ``Conv1D``;
* :func:`record_calls` — how each module is called (which argument is its first tensor,
  how many outputs it returns), so that :func:`input_style` / :func:`output_style` can
  write ``PrepareModuleInput`` / ``PrepareModuleOutput`` for that argument alone;
* :func:`parallelize` — a copy of the model with the styles applied in order, ties kept
  (a tie whose one side was sharded takes the sharded parameter on both sides, as
  PyTorch's own weight-tying test does), every other parameter a replicated DTensor;
* :func:`run_torch` — one forward and backward under ``implicit_replication()`` and the
  math attention kernel, with the collectives of the forward (the outputs made whole
  included), of the backward, and of making every gradient take its parameter's
  placements (what an optimizer step would do: one all-reduce per ``Partial`` gradient).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement
from torch.nn.attention import SDPBackend, sdpa_kernel
from tp_checks import CountCollectives, counts

from slapo_fn.hf import is_conv1d

__all__ = [
    "KINDS",
    "Call",
    "Conv1DParallel",
    "Kind",
    "TorchRun",
    "input_style",
    "output_style",
    "parallelize",
    "record_calls",
    "role_style",
    "run_torch",
    "sequence_style",
]


class Conv1DParallel(ParallelStyle):
    """Hugging Face's ``Conv1D`` (``addmm(bias, x, weight)``, the weight stored (in, out)) as
    a column (weight ``Shard(1)``, bias ``Shard(0)``: output ``Shard(-1)``) or a row (weight
    ``Shard(0)``, bias replicated: output ``Partial``), with the keyword layouts and input and
    output handling of PyTorch's ``ColwiseParallel`` / ``RowwiseParallel``."""

    def __init__(
        self,
        *,
        column: bool,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
    ) -> None:
        super().__init__()
        self.column = column
        self.desired_input_layouts: tuple[Placement, ...] = (Replicate(),) if column else (Shard(-1),)
        self.input_layouts = (input_layouts,) if input_layouts is not None else self.desired_input_layouts
        self.output_layouts = (output_layouts or (Shard(-1) if column else Replicate()),)

    def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
        weight, bias = (Shard(1), Shard(0)) if self.column else (Shard(0), Replicate())
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = weight if pname == "weight" else bias
            dt = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
            module.register_parameter(pname, nn.Parameter(dt.redistribute(mesh, [placement]),
                                                          requires_grad=param.requires_grad))

    def _input(self, module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, self.input_layouts, run_check=False)
        if self.input_layouts != self.desired_input_layouts:
            x = x.redistribute(placements=self.desired_input_layouts)
        return (x, *inputs[1:])

    def _output(self, module: nn.Module, output: Any, mesh: Any) -> Any:
        if tuple(output.placements) != self.output_layouts:
            output = output.redistribute(placements=self.output_layouts)
        return output

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition,
                                 lambda m, i, mesh: self._input(m, i, mesh),
                                 lambda m, o, mesh: self._output(m, o, mesh))


@dataclass(frozen=True)
class Kind:
    """How a random plan shards a layer, as a value: ``splits_output`` (a Linear's or
    Conv1D's column, an embedding split by features: each rank makes its own output
    features) or not (a row, an embedding split by vocabulary: each rank makes a partial
    sum), of an ``embedding`` or not. Plans name their kinds (:data:`KINDS`), so that they
    stay plain data a rank is sent."""

    splits_output: bool
    embedding: bool


#: Each kind by the name a plan gives it, Linear/Conv1D kinds first, then the embeddings'.
KINDS: dict[str, Kind] = {"col": Kind(True, False), "row": Kind(False, False), "vocab": Kind(False, True),
                          "dim": Kind(True, True)}


def role_style(
    module: nn.Module,
    role: str,
    *,
    input_layout: Placement | None = None,
    output_layout: Placement | None = None,
) -> ParallelStyle:
    """PyTorch's style for ``module`` sharded as the kind named ``role`` (:data:`KINDS`),
    activations kept as DTensors."""
    kind = KINDS[role]
    kw: dict[str, Any] = {}
    if input_layout is not None:
        kw["input_layouts"] = input_layout
    if output_layout is not None:
        kw["output_layouts"] = output_layout
    if is_conv1d(module):
        return Conv1DParallel(column=kind.splits_output, **kw)
    if isinstance(module, nn.Embedding) and not kind.splits_output:
        # by vocabulary: ids arrive whole (RowwiseParallel's default input is Shard(-1), for a row's)
        return RowwiseParallel(**{"input_layouts": Replicate(), **kw}, use_local_output=False)
    return (ColwiseParallel if kind.splits_output else RowwiseParallel)(**kw, use_local_output=False)


def sequence_style() -> ParallelStyle:
    """A norm run on sequence shards (PyTorch's ``SequenceParallel``, output kept a DTensor)."""
    return SequenceParallel(use_local_output=False)


@dataclass(frozen=True)
class Call:
    """How a module was called the first time: its positional arguments (count), the first
    tensor among them (an index) or among its keyword arguments (a name), and its output:
    a tensor (``1``), a tuple (its length) or anything else (``None``)."""

    args: int
    first: int | str | None
    outputs: int | None


def record_calls(model: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Call]:
    """:class:`Call` per module path, from one forward of ``model`` (not changed)."""
    seen: dict[str, Call] = {}
    handles = []
    for path, module in model.named_modules():
        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, path: str = path) -> None:
            if path in seen:
                return
            first: int | str | None = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
            if first is None:
                first = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
            outputs = 1 if isinstance(out, torch.Tensor) else len(out) if type(out) is tuple else None
            seen[path] = Call(len(args), first, outputs)

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def input_style(call: Call, src: Placement, dst: Placement) -> ParallelStyle:
    """``PrepareModuleInput`` of the module's first tensor argument from ``src`` to ``dst``
    (a DTensor argument is redistributed to ``dst`` whenever the two differ)."""
    if isinstance(call.first, str):
        return PrepareModuleInput(input_kwarg_layouts={call.first: src}, desired_input_kwarg_layouts={call.first: dst},
                                  use_local_output=False)
    at = call.first or 0
    src_all = tuple(src if i == at else None for i in range(max(call.args, 1)))
    dst_all = tuple(dst if i == at else None for i in range(max(call.args, 1)))
    return PrepareModuleInput(input_layouts=src_all, desired_input_layouts=dst_all, use_local_output=False)


def output_style(call: Call, src: Placement, dst: Placement) -> ParallelStyle:
    """``PrepareModuleOutput`` of the module's first output from ``src`` to ``dst``; a module
    whose output is neither a tensor nor a tuple gets one of length 1, which PyTorch refuses
    as it runs (it takes outputs as tensors or tuples)."""
    n = call.outputs or 1
    return PrepareModuleOutput(output_layouts=(src,) + (None,) * (n - 1),
                               desired_output_layouts=(dst,) + (None,) * (n - 1), use_local_output=False)


def _ties(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, parameter name) holding one parameter, in module order."""
    groups: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                groups.setdefault(id(p), []).append((module, name))
    return list(groups.values())


def parallelize(model: nn.Module, mesh: Any, styles: Sequence[tuple[str, ParallelStyle]]) -> nn.Module:
    """A copy of ``model`` with each ``(path, style)`` applied in order by ``parallelize_module``;
    then each tie takes the first DTensor among its sides (or one replicated DTensor), and
    every other parameter becomes a replicated DTensor (all ranks hold the same weights)."""
    pt = copy.deepcopy(model)
    ties = _ties(pt)
    for path, style in styles:
        parallelize_module(pt.get_submodule(path), mesh, style)
    for group in ties:
        current = [getattr(m, n) for m, n in group]
        chosen = next((p for p in current if isinstance(p, DTensor)), None)
        if chosen is None:
            p = current[0]
            chosen = nn.Parameter(DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False),
                                  requires_grad=p.requires_grad)
        for m, n in group:
            m.register_parameter(n, chosen)
    return pt


@dataclass(frozen=True)
class TorchRun:
    """One forward and backward of a parallelized model: the loss, the whole outputs, every
    parameter's whole gradient by name, and the collectives by phase."""

    loss: torch.Tensor
    outputs: tuple[torch.Tensor, ...]
    grads: dict[str, torch.Tensor | None]
    fwd: dict[str, int]
    bwd: dict[str, int]
    grad_sync: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.fwd.values()) + sum(self.bwd.values()) + sum(self.grad_sync.values())


def _whole(t: Any) -> Any:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_torch(
    pt: nn.Module,
    inputs: tuple[Any, ...],
    fields: Callable[[Any], tuple[Any, ...]],
    loss: Callable[[tuple[torch.Tensor, ...]], torch.Tensor],
) -> TorchRun:
    """Forward (``fields`` picks the output tensors, made whole with ``full_tensor()``,
    which counts), ``loss`` on them, backward, and each gradient redistributed to its
    parameter's placements, each phase's collectives counted (``CountCollectives``)."""
    with implicit_replication(), sdpa_kernel(SDPBackend.MATH):
        with CountCollectives() as fwd:
            out = pt(*inputs)
            whole = tuple(_whole(t) for t in fields(out))
            value = loss(whole)
        with CountCollectives() as bwd:
            value.backward()
        synced: dict[str, Any] = {}
        with CountCollectives() as sync:
            for name, p in pt.named_parameters():
                g = p.grad
                if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
                    g = g.redistribute(p.device_mesh, p.placements)
                synced[name] = g
        grads = {n: None if g is None else _whole(g).detach() for n, g in synced.items()}  # to compare: not counted
    return TorchRun(loss=value.detach(), outputs=tuple(t.detach() for t in whole), grads=grads,
                    fwd=counts(fwd), bwd=counts(bwd), grad_sync=counts(sync))
