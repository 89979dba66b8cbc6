"""Chunked linear + cross-entropy: an LM head and its loss without the full logits.

A causal LM's head turns ``tokens x hidden`` states into ``tokens x vocab`` logits — for
GPT-2 (50 257 words) at 4 x 1024 tokens that is 823 MB in float32, and autograd keeps
it (and its log-softmax) until backward. :func:`linear_cross_entropy` walks the tokens in
chunks: per chunk it computes the logits, the loss and — when a gradient will be needed
— the gradients with respect to the hidden states, the weight and the bias right away,
then drops the chunk's logits. Backward only scales those gradients by the incoming
one. Peak extra memory is one chunk of logits plus a weight-sized gradient buffer; no
``tokens x vocab`` tensor is ever saved. The arithmetic is the same as
``F.cross_entropy(F.linear(h, weight, bias).float(), target)`` (three matmuls per
chunk, as forward + backward of the plain head). The weight-sized gradient buffer is
held from the head's forward to its backward, so the kernel saves memory once a step
has more tokens than about the hidden size (the plain head keeps 2-3 ``tokens x vocab``
tensors); for a handful of tokens the plain head is leaner.

Under autocast the three matmuls run in the autocast dtype, as the plain head's
``F.linear`` would (the weight is cast once, not per chunk); the log-softmax, the loss and
the weight gradient accumulated across chunks stay in float32.

For a Hugging Face causal LM, :func:`causal_lm_loss` runs the base model, shifts the
labels as Hugging Face does and applies this loss with the model's own ``lm_head``
parameters; :class:`ChunkedLMHeadLoss` is the same as a module holding those parameters.

What a loss holds at its peak is declared as a :class:`LossFootprint`, which explain's
memory table reads (``sf.explain(..., loss=...)``): :data:`FULL_LOGITS_LOSS` for torch's
cross-entropy over float32 logits (Hugging Face's loss, ``slapo-fn train``'s),
:data:`CHUNKED_LOSS` (and :attr:`ChunkedLMHeadLoss.footprint`) for this one.

Example:
    >>> import torch, torch.nn.functional as F
    >>> h, w = torch.randn(6, 4, requires_grad=True), torch.randn(10, 4)
    >>> y = torch.tensor([1, 2, -100, 3, 4, 5])
    >>> torch.allclose(linear_cross_entropy(h, w, y, chunk_size=4), F.cross_entropy(h @ w.T, y))
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from ._common import fail

__all__ = ["CHUNKED_LOSS", "FULL_LOGITS_LOSS", "ChunkedLMHeadLoss", "LossFootprint", "causal_lm_loss",
           "default_chunk_size", "linear_cross_entropy"]

Reduction = Literal["mean", "sum"]

#: Logits elements per chunk when no ``chunk_size`` is given (64 MiB of float32). Fewer,
#: larger chunks run faster on CPU (each chunk re-reads the weight and its gradient
#: buffer); smaller ones lower the peak. A chunk's logits and log-probabilities coexist.
CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class LossFootprint:
    """What a language model's loss holds at once at the peak of its backward, beside the
    activations the model saved, in float32 tensors: ``logits`` copies of the full
    ``tokens x vocab`` logits, ``chunk`` copies of one chunk of ``chunk_elements`` of
    them, and (``head_grad``) a gradient buffer as large as the LM head's weight.

    >>> FULL_LOGITS_LOSS.nbytes(logits=1000, head=50)
    12000
    >>> LossFootprint(chunk=3, chunk_elements=100, head_grad=True).nbytes(logits=1000, head=50)
    1400
    """

    logits: int = 0
    chunk: int = 0
    chunk_elements: int = 0
    head_grad: bool = False

    def nbytes(self, *, logits: int, head: int) -> int:
        """Bytes held for full logits of ``logits`` elements and a head weight of ``head``."""
        fp32 = torch.finfo(torch.float32).bits // 8
        return fp32 * (self.logits * logits + self.chunk * min(self.chunk_elements, logits)
                       + (head if self.head_grad else 0))

    def describe(self) -> str:
        """What it holds, as explain's note says it."""
        parts = [f"{self.logits} float32 copies of the logits"] if self.logits else []
        if self.chunk:
            parts.append(f"{self.chunk} float32 copies of a chunk of {self.chunk_elements:,} logits")
        if self.head_grad:
            parts.append("a float32 gradient of the LM head's weight")
        return " and ".join(parts) or "nothing"


#: torch's cross-entropy over float32 logits (``F.cross_entropy(logits.float(), ...)``:
#: Hugging Face's ``ForCausalLMLoss``, ``slapo_fn.train``'s loss): at LogSoftmax's backward
#: the log-probabilities it saved, their gradient and the logits' gradient exist at once.
FULL_LOGITS_LOSS = LossFootprint(logits=3)


def default_chunk_size(vocab: int) -> int:
    """Tokens per chunk so that one chunk of float32 logits holds about 2**24 values.

    >>> default_chunk_size(50257)
    333
    """
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


#: :func:`linear_cross_entropy` at its default chunk size: one chunk's logits (in the compute
#: dtype, in float32, their log-probabilities: at most three float32 copies) and the float32
#: gradient of the head's weight; the gradient of the hidden states it saves instead of them
#: is as large as the head's input, which the plain head saves.
CHUNKED_LOSS = LossFootprint(chunk=3, chunk_elements=CHUNK_ELEMENTS, head_grad=True)


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss and, in the same pass over the chunks, the gradients of its inputs: forward
    returns them as extra non-differentiable outputs that ``setup_context`` saves (the form
    ``torch.func`` needs); ``wants`` says which of hidden, weight, bias need one."""

    @staticmethod
    def forward(  # type: ignore[override]
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        ignore_index: int,
        reduction: Reduction,
        chunk_size: int,
        wants: tuple[bool, bool, bool],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        device = hidden.device.type
        compute = torch.promote_types(hidden.dtype, weight.dtype)
        if torch.is_autocast_enabled(device):  # matmuls in the autocast dtype, as F.linear would run
            compute = torch.get_autocast_dtype(device)
        acc = torch.promote_types(compute, torch.float32)
        valid = target != ignore_index
        denominator = valid.sum().to(acc) if reduction == "mean" else torch.ones((), dtype=acc, device=hidden.device)
        want_h, want_w, want_b = wants
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        grad_b = (
            torch.zeros(bias.shape, dtype=acc, device=bias.device) if want_b and bias is not None else None
        )
        total = torch.zeros((), dtype=acc, device=hidden.device)
        w = weight.to(compute)  # cast once for every chunk (autocast would cast per call)
        b = None if bias is None else bias.to(compute)
        with torch.autocast(device, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                h = hidden[start : start + chunk_size].to(compute)
                keep = valid[start : start + chunk_size]
                t = target[start : start + chunk_size].masked_fill(~keep, 0)
                logp = torch.log_softmax(F.linear(h, w, b).to(acc), dim=-1)
                total -= torch.where(keep, logp.gather(1, t[:, None]).squeeze(1), 0.0).sum()
                if not (want_h or want_w or want_b):
                    continue
                grad = logp.exp_()  # softmax, in place of the log-probabilities
                grad[torch.arange(grad.shape[0], device=grad.device), t] -= 1.0
                grad.mul_((keep.to(grad.dtype) / denominator)[:, None])
                if grad_b is not None:
                    grad_b += grad.sum(0)
                g = grad.to(compute)
                if grad_h is not None:
                    grad_h[start : start + chunk_size] = torch.mm(g, w)
                if grad_w is not None:
                    if compute == acc:
                        grad_w.addmm_(g.t(), h)
                    else:  # a low-precision product, accumulated in float32 across chunks
                        grad_w += torch.mm(g.t(), h)
        return total / denominator, grad_h, grad_w, grad_b

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        hidden, weight, bias = inputs[:3]
        _, grad_h, grad_w, grad_b = output
        ctx.grad_dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(*(g for g in (grad_h, grad_w, grad_b) if g is not None))
        ctx.save_for_backward(grad_h, grad_w, grad_b)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        # Scaled in place: the buffers were made for this call and are not needed again,
        # so backward allocates nothing weight-sized beyond them (a dtype cast aside).
        grads = []
        for g, dtype in zip(ctx.saved_tensors, ctx.grad_dtypes, strict=True):
            grads.append(None if g is None else g.mul_(grad_out.to(g.dtype)).to(dtype))
        return (*grads, None, None, None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)``, chunked over
    tokens so the ``tokens x vocab`` logits never exist at once.

    ``hidden`` is ``(..., hidden)``, ``weight`` ``(vocab, hidden)`` (an ``nn.Linear`` /
    ``lm_head`` weight), ``target`` integer class ids of shape ``hidden.shape[:-1]``;
    targets equal to ``ignore_index`` count neither in the loss nor in the mean.
    ``reduction`` is ``"mean"`` (over non-ignored tokens; NaN if there are none, as in
    PyTorch) or ``"sum"``. ``chunk_size`` tokens are processed at a time (default
    :func:`default_chunk_size`). Differentiable once in ``hidden``, ``weight`` and ``bias``
    (a second backward through a retained graph raises).

    >>> h, w, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64), torch.arange(5)
    >>> torch.allclose(linear_cross_entropy(h, w, y, reduction="sum", chunk_size=2),
    ...                F.cross_entropy(h @ w.T, y, reduction="sum"))
    True
    """
    problems: list[str] = []
    if weight.dim() != 2:
        problems.append(f"weight must be 2-D (vocab, hidden), got shape {tuple(weight.shape)}")
    elif hidden.shape[-1] != weight.shape[1]:
        problems.append(f"hidden has {hidden.shape[-1]} features but weight expects {weight.shape[1]}")
    if bias is not None and weight.dim() == 2 and tuple(bias.shape) != (weight.shape[0],):
        problems.append(f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        problems.append(f"target shape {tuple(target.shape)} must equal hidden's without its last axis, "
                        f"{tuple(hidden.shape[:-1])}")
    if target.is_floating_point() or target.is_complex():
        problems.append(f"target must hold integer class ids, got {target.dtype}")
    if reduction not in ("mean", "sum"):
        problems.append(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        problems.append(f"chunk_size must be a positive int, got {chunk_size!r}")
    if problems:
        raise fail("linear_cross_entropy", "", "; ".join(problems),
                   "linear_cross_entropy(hidden[B, T, H], lm_head.weight[V, H], labels[B, T])")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = target.reshape(-1)
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    grad_on = torch.is_grad_enabled()
    wants = tuple(grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias))
    loss: torch.Tensor = _LinearCrossEntropy.apply(
        flat_h, weight, bias, flat_t, ignore_index, reduction, chunk, wants
    )[0]
    return loss


class ChunkedLMHeadLoss(nn.Module):
    """An LM head and its cross-entropy in one: ``forward(hidden_states, labels)`` returns
    :func:`linear_cross_entropy` of the head's weight (and bias).

    :meth:`from_hf` takes the ``lm_head`` (an ``nn.Linear``) of a model — its parameters,
    the same objects, so tying with the embedding is kept.

    Example:
        >>> head = nn.Linear(4, 10, bias=False)
        >>> loss_fn = ChunkedLMHeadLoss.from_hf(head, chunk_size=2)
        >>> h, y = torch.randn(2, 3, 4), torch.randint(0, 10, (2, 3))
        >>> torch.allclose(loss_fn(h, y), F.cross_entropy(head(h).flatten(0, 1), y.flatten()))
        True
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None = None,
        *,
        ignore_index: int = -100,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size

    @classmethod
    def from_hf(
        cls, old: nn.Module, path: str = "", *, ignore_index: int = -100, chunk_size: int | None = None
    ) -> ChunkedLMHeadLoss:
        if not isinstance(old, nn.Linear):
            raise fail(
                cls.__name__,
                path,
                f"an LM head must be an nn.Linear, got {type(old).__name__}",
                "ChunkedLMHeadLoss.from_hf(model.get_output_embeddings())",
            )
        bias = old.bias if isinstance(old.bias, nn.Parameter) else None
        weight = old.weight
        assert isinstance(weight, nn.Parameter)
        return cls(weight, bias, ignore_index=ignore_index, chunk_size=chunk_size)

    def forward(
        self, hidden_states: torch.Tensor, labels: torch.Tensor, *, reduction: Reduction = "mean"
    ) -> torch.Tensor:
        return linear_cross_entropy(
            hidden_states,
            self.weight,
            labels,
            self.bias,
            ignore_index=self.ignore_index,
            reduction=reduction,
            chunk_size=self.chunk_size,
        )

    @property
    def footprint(self) -> LossFootprint:
        """What this loss holds at its peak (:data:`CHUNKED_LOSS` at its chunk size)."""
        if self.chunk_size is None:
            return CHUNKED_LOSS
        return LossFootprint(chunk=CHUNKED_LOSS.chunk, chunk_elements=self.chunk_size * self.weight.shape[0],
                             head_grad=True)

    def extra_repr(self) -> str:
        return f"vocab={self.weight.shape[0]}, hidden={self.weight.shape[1]}, chunk_size={self.chunk_size}"


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The loss ``model(input_ids, labels=labels).loss`` of a Hugging Face causal LM, computed
    without its logits: the base model (``model.base_model``) gives the hidden states, the
    labels are shifted as Hugging Face shifts them (position t predicts t+1, the last
    position is ignored), and :func:`linear_cross_entropy` applies the model's output
    embedding (``model.get_output_embeddings()``). ``labels`` defaults to ``input_ids``;
    with ``num_items_in_batch`` the summed loss is divided by it (gradient accumulation),
    as Hugging Face does. Models that rescale logits (soft-capping, ``logit_scale``) are
    refused. ``model`` may be a built schedule (``sf.build(sch)``).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                   num_attention_heads=4, num_key_value_heads=2)
        >>> model, ids = LlamaForCausalLM(cfg), torch.randint(0, 64, (2, 6))
        >>> torch.allclose(causal_lm_loss(model, ids, chunk_size=4), model(ids, labels=ids).loss)
        True
    """
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise fail("causal_lm_loss", "", f"this model rescales its logits ({attr}); the chunked loss does not",
                       "compute the loss from model(...).logits for this model")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    base = getattr(model, "base_model", None)
    if not isinstance(head, nn.Linear) or not isinstance(base, nn.Module) or base is model:
        raise fail(
            "causal_lm_loss",
            "",
            f"{type(model).__name__} is not a Hugging Face causal LM with a base model and a Linear LM head",
            "pass e.g. a LlamaForCausalLM or GPT2LMHeadModel",
        )
    hidden = base(input_ids, attention_mask=attention_mask, **kwargs)
    hidden = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
    labels = input_ids if labels is None else labels
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction: Reduction = "mean" if num_items_in_batch is None else "sum"
    loss = linear_cross_entropy(
        hidden, head.weight, shifted.to(hidden.device), head.bias,
        ignore_index=ignore_index, reduction=reduction, chunk_size=chunk_size,
    )
    return loss if num_items_in_batch is None else loss / num_items_in_batch
