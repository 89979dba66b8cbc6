"""Drop-in replacement modules and functions, used through :func:`slapo_fn.replace`.

* attention — :class:`Attention` (``Attention.from_hf`` picks :class:`RotaryAttention`,
  :class:`FusedQKVAttention`, :class:`EncoderSelfAttention`, :class:`PostNormAttention` or
  :class:`WindowedCausalAttention`), on flash-attn or SDPA;
* :class:`FusedMLP` — bias+GeLU MLPs (GPT-2, Linear-GELU-Linear);
* :class:`RMSNorm` / :class:`CompiledRMSNorm` — fused RMSNorm;
* :func:`counter_dropout` / :class:`CounterDropout` — dropout with counter-based hash
  masks, which compiled CPU kernels fuse cheaply (``sf.fuse`` uses it);
* :func:`linear_cross_entropy`, :class:`ChunkedLMHeadLoss`, :func:`causal_lm_loss` — an LM
  head's loss without materialising the logits; :class:`LossFootprint` declares what a loss
  holds at its peak (:data:`CHUNKED_LOSS`, :data:`FULL_LOGITS_LOSS`) for explain.
* :mod:`.float8` — torchao's float8 training linears (``float8=True`` on a recipe), and
  :mod:`.gpu` — what this process's GPU runs of float8 and async tensor parallelism.

Every ``Kernel.from_hf(old, path)`` is a factory for ``sf.replace(sch, where, Kernel.from_hf)``
and raises :class:`KernelError` for a module it cannot replace.
"""

from ._common import KernelError
from .attention import (
    Attention,
    EncoderSelfAttention,
    FusedQKVAttention,
    PostNormAttention,
    RotaryAttention,
    WindowedCausalAttention,
    attention,
    flash_attn_available,
)
from .cross_entropy import (
    CHUNKED_LOSS,
    FULL_LOGITS_LOSS,
    ChunkedLMHeadLoss,
    LossFootprint,
    causal_lm_loss,
    default_chunk_size,
    linear_cross_entropy,
)
from .dropout import CounterDropout, counter_dropout
from .mlp import FusedMLP, fused_mlp
from .rmsnorm import CompiledRMSNorm, RMSNorm, rms_norm

__all__ = [
    "CHUNKED_LOSS",
    "FULL_LOGITS_LOSS",
    "Attention",
    "ChunkedLMHeadLoss",
    "CompiledRMSNorm",
    "CounterDropout",
    "EncoderSelfAttention",
    "FusedMLP",
    "FusedQKVAttention",
    "KernelError",
    "LossFootprint",
    "PostNormAttention",
    "RMSNorm",
    "RotaryAttention",
    "WindowedCausalAttention",
    "attention",
    "causal_lm_loss",
    "counter_dropout",
    "default_chunk_size",
    "flash_attn_available",
    "fused_mlp",
    "linear_cross_entropy",
    "rms_norm",
]
