"""The ``context_parallel`` build phases: what :func:`~slapo_fn.dtensor.context.context_parallel`
annotated, installed on build's private copy of the model.

* :func:`apply_context_parallel` (before tensor parallelism): each selected attention
  module becomes a :class:`ContextParallelAttention` (the same projections, the same
  FQNs), and the root's forward cuts the rank's chunks from the global batch, shifts the
  labels globally and returns the global loss;
* :func:`sum_gradients_over_cp` (after tensor parallelism, whose parameters are the
  ones the optimizer sees): every parameter's gradient is summed over the ``cp`` axis in
  backward, as data parallelism sums it — unless FSDP2 shards the parameters over
  ``dp × cp`` (:func:`~slapo_fn.dtensor.data_parallel.shard_axes`) and reduces them so.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import LayoutError, Problem
from ..kernels import RotaryAttention
from ..kernels.attention import attention
from ..schedule import Schedule
from ..tree import get_module, parent_path, split
from . import collectives as C
from .context import CP, IGNORE_INDEX, CPSpec, chunk_count, chunks, key_positions, positions, shifted, split_batch, take
from .context_ring import ring_attention
from .data_parallel import DATA_PARALLEL
from .sequence import SEQ
from .shard import mesh_dims

__all__ = ["ContextParallelAttention", "ContextSplit", "apply_context_parallel", "context_split", "pipeline_loss",
           "pipeline_problems", "shifted", "sum_gradients_over_cp"]

#: The attribute of a built model's root that holds its :class:`ContextSplit`.
_SPLIT = "_slapo_fn_context_split"


@dataclass(frozen=True)
class ContextSplit:
    """How a built model splits its sequences over ``cp``: what a training loop that
    computes the loss from the model's logits (this rank's tokens) needs."""

    axis: C.Axis
    load_balance: bool
    #: The model takes this rank's chunks (``inputs_split=True``): :meth:`collate` cuts them.
    inputs_split: bool = False

    @property
    def rank_and_size(self) -> tuple[int, int]:
        mesh, dim = self.axis
        return mesh.get_local_rank(dim), mesh.size(dim)

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of ``x`` along the sequence (dim 1)."""
        rank, size = self.rank_and_size
        return take(x, 1, rank, size, self.load_balance)

    def collate(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this rank's model takes of a global ``batch``: this rank's chunks
        (:func:`~slapo_fn.dtensor.context.split_batch`: ``labels`` become ``shift_labels``)
        where the model was built with ``inputs_split=True``, else the batch itself."""
        if not self.inputs_split:
            return dict(batch)
        rank, size = self.rank_and_size
        return split_batch(batch, rank, size, self.load_balance)

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """This rank's next-token targets: ``labels`` (the global batch) shifted globally
        (position t predicts t + 1; the last predicts nothing), then cut."""
        return self.cut(shifted(labels))

    def total(self, value: float) -> float:
        """The sum of ``value`` over the ``cp`` ranks (a loss sum of each rank's tokens)."""
        return float(C._all_reduce(torch.tensor([value], dtype=torch.float64), self.axis)[0])


def context_split(model: nn.Module) -> ContextSplit | None:
    """The :class:`ContextSplit` of a model ``sf.build`` made from a context-parallel schedule, else ``None``."""
    found = model.__dict__.get(_SPLIT)
    return found if isinstance(found, ContextSplit) else None


class ContextParallelAttention(RotaryAttention):
    """:class:`~slapo_fn.kernels.RotaryAttention` on this rank's chunks of the sequence:
    its queries stay local, keys and values are all-gathered over the ``cp`` axis (one
    all-gather each forward, one reduce-scatter each backward) and put in global order;
    each of the rank's chunks attends to the keys up to its own end, with the causal
    (and sliding-window) mask of its global positions. The mask the model built for the
    local tokens is not used.
    """

    axis: C.Axis
    load_balance: bool
    impl: str

    @classmethod
    def of(cls, kernel: RotaryAttention, axis: C.Axis, load_balance: bool, impl: str = "allgather") \
            -> ContextParallelAttention:
        """The context-parallel form of ``kernel`` (its own child modules, in its mode)."""
        new = cls(kernel.q_proj, kernel.k_proj, kernel.v_proj, kernel.o_proj, head_dim=kernel.head_dim,
                  scaling=kernel.scaling, dropout_p=kernel.dropout_p, layer_idx=kernel.layer_idx,
                  q_norm=kernel._modules.get("q_norm"), k_norm=kernel._modules.get("k_norm"),
                  sliding_window=kernel.sliding_window, backend=kernel.backend)
        new.axis, new.load_balance, new.impl = axis, load_balance, impl
        return new.train(kernel.training)

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if self.impl == "ring":  # PyTorch's ring attention (CUDA; checked at schedule time)
            return ring_attention(query, key, value, self.axis, self.scaling)
        mesh, dim = self.axis
        size, rank = mesh.size(dim), mesh.get_local_rank(dim)
        key, value = C.gather_rs(key, 2, self.axis), C.gather_rs(value, 2, self.axis)
        seq = key.shape[2]
        # the keys in global order: each of this rank's chunks then attends to the keys up to its
        # own end only (half the work of masking every key, on average)
        order = torch.argsort(key_positions(size, seq, self.load_balance, key.device))
        key, value = key.index_select(2, order), value.index_select(2, order)
        n = seq // chunk_count(size, self.load_balance)
        outs = []
        for i, c in enumerate(chunks(rank, size, self.load_balance)):
            end = (c + 1) * n
            q_pos = torch.arange(c * n, end, device=query.device)[:, None]
            k_pos = torch.arange(end, device=query.device)[None, :]
            allowed = k_pos <= q_pos
            if sliding_window is not None:
                allowed = allowed & (k_pos > q_pos - sliding_window)
            outs.append(attention(query[:, :, i * n:(i + 1) * n], key[:, :, :end], value[:, :, :end],
                                  allowed[None, None], is_causal=True, scale=self.scaling,
                                  dropout_p=self.dropout_p if self.training else 0.0, backend=self.backend))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def extra_repr(self) -> str:
        balance = "load-balanced" if self.load_balance else "contiguous"
        return f"{super().extra_repr()}, context_parallel={self.impl}, {balance}"


def _axis(sch: Schedule, spec: CPSpec) -> C.Axis:
    assert sch.mesh is not None
    return (sch.mesh, mesh_dims(sch.mesh).index(spec.mesh_axis))


def _spec(sch: Schedule) -> CPSpec | None:
    specs = set(sch.annotations.of_kind(CP).values())
    return next(iter(specs)) if specs else None


def apply_context_parallel(model: nn.Module, sch: Schedule) -> None:
    """The ``context_parallel`` build phase (on build's private copy ``model``)."""
    spec = _spec(sch)
    if spec is None:
        return
    refused = [Problem("", "context_parallel does not compose with sequence_parallel yet (both split the sequence)",
                       "drop sf.sequence_parallel, or context_parallel")] if sch.annotations.of_kind(SEQ) else []
    dp = sch.annotations.get("", DATA_PARALLEL)
    if dp is not None and dp.mode != "fsdp":
        refused.append(Problem("", f"context_parallel composes with data_parallel mode 'fsdp' (FSDP2 over dp x cp, "
                                   f"torchtitan's dp_shard_cp), not {dp.mode!r}", 'data_parallel(mode="fsdp")'))
    if refused:
        raise LayoutError("build", refused)
    axis = _axis(sch, spec)
    for path in sch.annotations.of_kind(CP):
        old = get_module(model, path)
        kernel = old if isinstance(old, RotaryAttention) else RotaryAttention.from_hf(old, path)
        assert isinstance(kernel, RotaryAttention)  # from_hf on a subclass builds that subclass
        split_kernel = ContextParallelAttention.of(kernel, axis, spec.load_balance, spec.impl)
        setattr(get_module(model, parent_path(path)), split(path)[-1], split_kernel)
    model.forward = _splitting(model.forward, axis, spec)  # type: ignore[method-assign]
    model.__dict__[_SPLIT] = ContextSplit(axis, spec.load_balance, spec.inputs_split)


def sum_gradients_over_cp(model: nn.Module, sch: Schedule) -> None:
    """Sum every parameter's gradient over the ``cp`` axis as backward computes it (before
    it is accumulated into ``.grad``: accumulation over micro-batches stays right)."""
    spec = _spec(sch)
    if spec is None or sch.annotations.get("", DATA_PARALLEL) is not None:  # FSDP2 reduces over dp x cp itself
        return
    axis = _axis(sch, spec)
    seen: set[int] = set()
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            p.register_hook(functools.partial(_summed, axis=axis))


def _summed(grad: torch.Tensor, axis: C.Axis) -> torch.Tensor:
    if isinstance(grad, DTensor):  # a tensor-parallel parameter: its local values, over the other axis
        local = C._all_reduce(grad.to_local(), axis)
        return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape,
                                  stride=grad.stride())
    return C._all_reduce(grad, axis)


def pipeline_loss(sch: Schedule, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) \
        -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A pipeline's ``loss_fn`` on a context-parallel schedule's last stage: ``loss_fn``
    (a mean over the targets of this rank's chunks that are not ``-100``; the targets
    arrive shifted, ``shift_labels`` of :meth:`ContextSplit.collate`) weighted by this
    rank's share of the microbatch's counted tokens, as a value the mean over the global
    tokens on every ``cp`` rank with this rank's own gradient (the stages' gradients are
    summed over ``cp`` in backward). ``loss_fn`` itself without context parallelism."""
    spec = _spec(sch)
    if spec is None:
        return loss_fn
    axis = _axis(sch, spec)

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        count = (target != IGNORE_INDEX).sum()
        total = C._all_reduce(count, axis)
        return _global_loss(loss_fn(output, target) * (count / total.clamp(min=1)), axis)

    return loss


def pipeline_problems(sch: Schedule) -> list[Problem]:
    """Why the stages of a context-parallel schedule cannot run as a pipeline: a stage
    after the first takes the hidden states of this rank's chunks, so every stage must
    take split inputs (``inputs_split=True``: the loader cuts ``input_ids``,
    ``position_ids`` and the shifted targets)."""
    spec = _spec(sch)
    if spec is None or spec.inputs_split:
        return []
    path = next(iter(sch.annotations.of_kind(CP)))
    return [Problem(path, "is context-parallel on the global batch: in a pipeline, the stages after the first take "
                          "the hidden states of this rank's chunks, which cannot be cut again",
                    "sf.context_parallel(..., inputs_split=True) and hand each rank its chunks "
                    "(ContextSplit.collate; the targets are its shift_labels)")]


def _refuse(reason: str, fix: str) -> LayoutError:
    return LayoutError("context_parallel", [Problem("", reason, fix)])


def _global_loss(loss: torch.Tensor, axis: C.Axis) -> torch.Tensor:
    """The sum of the ranks' losses (each the sum over its tokens divided by the global
    count) as a value, with this rank's own gradient: every rank's backward then adds its
    tokens' share, and the gradients' sum over ``cp`` is the global loss's gradient."""
    total = C._all_reduce(loss.detach(), axis)
    return loss + (total - loss.detach())


def _splitting(forward: Callable[..., Any], axis: C.Axis, spec: CPSpec) -> Callable[..., Any]:
    """The root's forward, on this rank's chunks of the global batch."""
    signature = inspect.signature(forward)
    var_kw = next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    takes = set(signature.parameters)
    mesh, dim = axis
    size, rank = mesh.size(dim), mesh.get_local_rank(dim)
    n = chunk_count(size, spec.load_balance)

    def cut(x: torch.Tensor) -> torch.Tensor:
        return x if spec.inputs_split else take(x, 1, rank, size, spec.load_balance)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        named = dict(bound.arguments)
        if var_kw is not None:
            named.update(named.pop(var_kw, None) or {})
        tokens = next((named[k] for k in ("input_ids", "inputs_embeds") if named.get(k) is not None), None)
        if tokens is None:
            raise _refuse("the model was called without input_ids or inputs_embeds", "pass the token ids")
        seq = tokens.shape[1] * (size if spec.inputs_split else 1) if tokens.dim() >= 2 else 0
        if seq == 0 or seq % n:
            given = f"{tokens.shape[1]} tokens per rank ({seq} in all)" if spec.inputs_split else f"{seq} tokens"
            raise _refuse(f"the sequence of {given} cannot be cut into {n} equal chunks over cp={size}",
                          f"pad or pack the sequences to a multiple of {n} tokens")
        mask = named.pop("attention_mask", None)
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise _refuse("a padding attention_mask cannot be split over cp (its keys live on other ranks)",
                          "pack the sequences without padding (labels -100 where no loss is wanted)")
        for k in ("input_ids", "inputs_embeds"):
            if named.get(k) is not None:
                named[k] = cut(named[k])
        given_positions = named.get("position_ids")
        if given_positions is not None:
            named["position_ids"] = cut(given_positions)
        else:
            here = positions(rank, size, seq, spec.load_balance, tokens.device)
            named["position_ids"] = here[None].expand(tokens.shape[0], -1)
        if "use_cache" in takes:
            named["use_cache"] = False
        counted = _labels(named, cut, spec, axis)
        out = forward(**named)
        loss = getattr(out, "loss", None) if counted else None
        if isinstance(loss, torch.Tensor):
            out["loss"] = _global_loss(loss, axis)
        return out

    return run


def _labels(named: dict[str, Any], cut: Callable[[torch.Tensor], torch.Tensor], spec: CPSpec, axis: C.Axis) -> bool:
    """Shift the labels globally, cut them and count the global tokens that carry a loss
    (``num_items_in_batch``: each rank's loss is then its sum over the global count).
    Whether there are labels."""
    labels, targets = named.get("labels"), named.get("shift_labels")
    if labels is None and targets is None:
        return False
    if targets is None:
        assert labels is not None
        if spec.inputs_split:
            raise _refuse("labels arrive cut into chunks: their shift crosses chunk boundaries",
                          "pass shift_labels= shifted before the cut (slapo_fn.dtensor.context.take of "
                          "labels[:, 1:] padded with -100)")
        targets = shifted(labels)
    if named.get("num_items_in_batch") is None:
        count = (targets != IGNORE_INDEX).sum()
        named["num_items_in_batch"] = C._all_reduce(count, axis) if spec.inputs_split else count
    named["shift_labels"] = cut(targets)
    named["labels"] = named["shift_labels"] if labels is None else cut(labels)
    return True
