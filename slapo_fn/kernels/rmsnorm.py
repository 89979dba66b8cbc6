"""RMSNorm on PyTorch's fused ``F.rms_norm`` kernel, a drop-in for Hugging Face's RMSNorms."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``y = x / rms(x) * weight`` computed by ``torch.nn.functional.rms_norm``.

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

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    @classmethod
    def from_hf(cls, old: nn.Module, path: str = "") -> RMSNorm:
        eps = getattr(old, "variance_epsilon", getattr(old, "eps", None))
        weight = getattr(old, "weight", None)
        if not isinstance(weight, nn.Parameter) or eps is None:
            raise TypeError(f"{path or type(old).__name__}: not an RMSNorm with a weight and an epsilon")
        return cls(weight, float(eps))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), None, self.eps)
        return self.weight * normed.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
