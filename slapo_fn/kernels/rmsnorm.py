"""RMSNorm drop-ins for Hugging Face's RMSNorms: on PyTorch's fused ``F.rms_norm`` kernel,
or (``compile=True`` / :class:`CompiledRMSNorm`) with the elementwise part compiled by
``torch.compile`` into one fused kernel forward and one backward."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ._common import fail

__all__ = ["CompiledRMSNorm", "RMSNorm", "rms_norm"]


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x²) + eps))`` as Hugging Face computes it: normalised in
    float32, cast back to the input dtype, then scaled — written as plain elementwise ops
    for ``torch.compile`` to fuse.

    >>> x, w = torch.randn(2, 8), torch.ones(8)
    >>> torch.allclose(rms_norm(x, w, 1e-6), F.rms_norm(x, (8,), w, 1e-6), atol=1e-6)
    True
    """
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden_states.dtype)


@functools.cache
def _compiled_rms_norm() -> Callable[..., torch.Tensor]:
    """``rms_norm`` compiled, made on first use: ``torch.compile`` imports dynamo and inductor
    (a second or more), which a process that never runs compiled kernels should not pay."""
    return torch.compile(rms_norm)  # type: ignore[return-value]


class RMSNorm(nn.Module):
    """``y = x / rms(x) * weight`` computed by ``torch.nn.functional.rms_norm``, or, with
    ``compile=True``, by :func:`rms_norm` compiled with ``torch.compile``.

    :meth:`from_hf` takes over the weight *parameter* of a Hugging Face RMSNorm
    (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm``…) — same object, so the state
    dict key and any tying are kept — and its epsilon. Like the Hugging Face modules, the
    normalisation runs in float32 and the result is cast back to the input dtype before
    the weight is applied.

    Example:
        >>> import torch
        >>> from transformers.models.llama.modeling_llama import LlamaRMSNorm
        >>> hf = LlamaRMSNorm(8)
        >>> x = torch.randn(2, 8)
        >>> torch.allclose(RMSNorm.from_hf(hf)(x), hf(x), atol=1e-6)
        True
    """

    compiled_by_default = False

    def __init__(self, weight: nn.Parameter, eps: float, *, compile: bool | None = None) -> None:  # noqa: A002
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.compiled = self.compiled_by_default if compile is None else compile

    @classmethod
    def from_hf(cls, old: nn.Module, path: str = "", *, compile: bool | None = None) -> RMSNorm:  # noqa: A002
        """The kernel for the Hugging Face RMSNorm ``old`` (``compile`` defaults to the
        class's: off for :class:`RMSNorm`, on for :class:`CompiledRMSNorm`)."""
        eps = getattr(old, "variance_epsilon", getattr(old, "eps", None))
        weight = getattr(old, "weight", None)
        if not isinstance(weight, nn.Parameter) or eps is None:
            raise fail(
                cls.__name__,
                path,
                f"not an RMSNorm with a weight and an epsilon (got {type(old).__name__})",
                "select the norms themselves, e.g. 'model.layers.*.{input,post_attention}_layernorm'",
            )
        return cls(weight, float(eps), compile=compile).train(old.training)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.compiled:
            return _compiled_rms_norm()(hidden_states, self.weight, self.eps)  # type: ignore[no-any-return]
        normed = F.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), None, self.eps)
        return self.weight * normed.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}" + (", compiled" if self.compiled else "")


class CompiledRMSNorm(RMSNorm):
    """:class:`RMSNorm` with ``compile=True`` by default: ``sf.replace(sch, where,
    CompiledRMSNorm.from_hf)``. The first call compiles (seconds); later calls reuse it.

    Example:
        >>> from transformers.models.llama.modeling_llama import LlamaRMSNorm
        >>> CompiledRMSNorm.from_hf(LlamaRMSNorm(8), "model.norm")
        CompiledRMSNorm((8,), eps=1e-06, compiled)
    """

    compiled_by_default = True
