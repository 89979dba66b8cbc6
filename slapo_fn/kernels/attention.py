"""Attention kernels: drop-ins for Hugging Face attention modules on flash-attn or SDPA.

:func:`attention` is the shared core: it takes queries, keys and values in the layout
Hugging Face attention functions receive (``(batch, heads, seq, head_dim)``), and the
attention mask the *model* built for its attention implementation, and returns what a
Hugging Face attention function returns (``(batch, seq, heads, head_dim)``). It calls
``flash_attn_func`` when flash-attn is installed, the tensors are on CUDA in fp16/bf16
and no explicit mask is needed (pure causal or full attention); everything else runs on
``torch.nn.functional.scaled_dot_product_attention``.

The modules (:class:`RotaryAttention` for LLaMA/Mistral/Qwen2/Qwen3, :class:`FusedQKVAttention`
for GPT-2, :class:`EncoderSelfAttention` for BERT/RoBERTa, :class:`PostNormAttention` for
ALBERT, :class:`WindowedCausalAttention` for GPT-Neo) take over the projections of
the Hugging Face module — the same ``Parameter`` objects under the same names — so state
dicts load unchanged, and they accept the same call (arguments and masks) as the module
they replace. They are replaced as modules, not registered with
``transformers.AttentionInterface``: the model keeps building its masks exactly as it
does for its configured implementation (``sdpa``/``eager`` give a 4-D boolean or additive
mask, or ``None`` for pure causal; ``flash_attention_2`` a 2-D padding mask), and the
kernel honours each form, so padding is never dropped.

One difference from ``eager`` remains, by design: with left padding a padded query may
have no key to attend to. Eager's additive mask gives that row a uniform softmax (the
outputs match) and a q/k gradient that is a rounding artefact (``s + finfo.min`` is
``finfo.min``); SDPA's gradient there differs. Such positions carry no loss in training
(their labels are ignored), and every gradient then matches.

Example:
    >>> import torch, slapo_fn as sf
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                   num_attention_heads=4, num_key_value_heads=2)
    >>> sch = sf.create_schedule(LlamaForCausalLM(cfg))
    >>> sch = sf.replace(sch, "model.layers.*.self_attn", Attention.from_hf)
    >>> ids, pad = torch.randint(0, 64, (2, 6)), torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    >>> report = sf.verify(sch, ids, kwargs={"attention_mask": pad})
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import torch
from torch import nn
from torch.backends import cuda
from torch.nn import functional as F

from ._common import expect_type, fail, require_attrs

__all__ = [
    "Attention",
    "Backend",
    "EncoderSelfAttention",
    "FusedQKVAttention",
    "PostNormAttention",
    "RotaryAttention",
    "WindowedCausalAttention",
    "attention",
    "flash_attn_available",
]

Backend: TypeAlias = Literal["auto", "flash", "sdpa"]
_BACKENDS = ("auto", "flash", "sdpa")

ROTARY_MODULES = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
FUSED_QKV_MODULES = ("GPT2Attention",)
ENCODER_MODULES = ("BertSelfAttention", "RobertaSelfAttention")
POST_NORM_MODULES = ("AlbertAttention",)
WINDOWED_MODULES = ("GPTNeoSelfAttention",)


@functools.cache
def flash_attn_available() -> bool:
    """Whether the ``flash_attn`` package can be imported (it is CUDA-only).

    >>> isinstance(flash_attn_available(), bool)
    True
    """
    return importlib.util.find_spec("flash_attn") is not None


def _flash_fn() -> Callable[..., torch.Tensor]:
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]

    fn: Callable[..., torch.Tensor] = flash_attn_func
    return fn


def _check_backend(backend: str, path: str = "") -> None:
    if backend not in _BACKENDS:
        raise fail(
            "attention",
            path,
            f"backend must be one of {', '.join(map(repr, _BACKENDS))}, got {backend!r}",
            'Attention.from_hf(old, path, backend="auto")',
        )


def _causal(q_len: int, kv_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``(q_len, kv_len)`` boolean mask, True where a query may attend: causal aligned on
    the last key (queries are the last ``q_len`` positions), optionally within a window."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    kv_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = kv_pos <= q_pos
    if window is not None:
        allowed = allowed & (kv_pos > q_pos - window)
    return allowed


@torch.compiler.assume_constant_result
def _gqa_takes_masks(device: torch.device, dtype: torch.dtype, head_dim: int, mask_dtype: torch.dtype,
                     dropout: bool) -> bool:
    """Whether SDPA runs grouped-query attention with an explicit mask on a fused kernel of
    ``device`` (K/V read in place, never repeated). Without one, SDPA's math fallback
    repeats K/V itself, and repeating them here instead keeps the fused kernel the
    repeated form can use — so K/V are repeated only where that is what SDPA would do.

    The CPU flash kernel takes GQA with a mask (checked on PyTorch 2.13); on CUDA the answer
    depends on the build, the card and the dtype, and PyTorch's own dispatch checks
    (``torch.backends.cuda.can_use_*_attention``) give it for a small probe of this
    dtype and head size; other devices keep the repeat. A constant under
    ``torch.compile`` (it depends on the call's static properties only).

    >>> _gqa_takes_masks(torch.device("cpu"), torch.float32, 64, torch.bool, False)
    True
    """
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    return _cuda_gqa_takes_masks(device, dtype, head_dim, mask_dtype, dropout)


@functools.cache
def _cuda_gqa_takes_masks(device: torch.device, dtype: torch.dtype, head_dim: int, mask_dtype: torch.dtype,
                          dropout: bool) -> bool:
    seq = 128
    q = torch.zeros(1, 2, seq, head_dim, device=device, dtype=dtype)
    kv = torch.zeros(1, 1, seq, head_dim, device=device, dtype=dtype)
    mask = torch.zeros(1, 1, seq, seq, device=device, dtype=mask_dtype)
    params = cuda.SDPAParams(q, kv, kv, mask, 0.1 if dropout else 0.0, False, True)
    return any(can(params, False) for can in (cuda.can_use_flash_attention, cuda.can_use_efficient_attention,
                                               cuda.can_use_cudnn_attention))


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    is_causal: bool,
    scale: float | None = None,
    dropout_p: float = 0.0,
    sliding_window: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Scaled dot-product attention as a Hugging Face attention function computes it.

    ``query`` is ``(batch, heads, q_len, head_dim)``; ``key``/``value`` are
    ``(batch, kv_heads, kv_len, head_dim)`` with ``kv_heads`` dividing ``heads`` (GQA).
    ``attention_mask`` is what a Hugging Face model hands its attention modules:

    * ``None`` — no padding: causal (when ``is_causal`` and ``q_len > 1``) or full;
    * a 4-D boolean mask (True = attend) or a 4-D additive float mask — used as given
      (it already holds the causal, padding and sliding-window pattern);
    * a 2-D ``(batch, kv_len)`` padding mask (1 = token, 0 = padding), as models
      configured for ``flash_attention_2`` give — combined here with the causal pattern
      and ``sliding_window``.

    Returns ``(batch, q_len, heads, head_dim)``, contiguous. ``backend="auto"`` uses
    flash-attn when it is installed, the inputs are CUDA fp16/bf16 and no explicit mask
    is needed, else SDPA; ``"flash"`` insists on flash-attn (:class:`KernelError` when it
    cannot be used), ``"sdpa"`` never uses it.

    Example:
        >>> q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
        >>> out = attention(q, k, k, is_causal=True)
        >>> tuple(out.shape)
        (1, 5, 4, 8)
    """
    _check_backend(backend)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise fail(
            "attention",
            "",
            f"query, key and value must be 4-D (batch, heads, seq, head_dim), got {query.dim()}-D, "
            f"{key.dim()}-D and {value.dim()}-D",
            "q.view(batch, seq, heads, head_dim).transpose(1, 2)",
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads == 0 or heads % kv_heads or value.shape[1] != kv_heads:
        raise fail(
            "attention",
            "",
            f"query has {heads} heads, key {kv_heads} and value {value.shape[1]}: key and value must have "
            "the same number of heads, dividing the query's",
            "pass (batch, heads, seq, head_dim) tensors with num_attention_heads % num_key_value_heads == 0",
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = heads // kv_heads
    mask = attention_mask
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise fail(
            "attention",
            "",
            f"the attention mask is a {type(mask).__name__}; this kernel takes None, a 2-D padding mask or a "
            "4-D boolean/additive mask",
            'load the model with attn_implementation="sdpa" (or "eager") before replacing its attention',
        )
    if mask is not None and mask.dim() == 2:
        if tuple(mask.shape) != (query.shape[0], kv_len):
            raise fail(
                "attention",
                "",
                f"a 2-D padding mask must be (batch, kv_len) = {(query.shape[0], kv_len)}, got {tuple(mask.shape)}",
                "pass the tokenizer's attention_mask",
            )
        allowed = mask.bool()[:, None, None, :]
        if is_causal:
            allowed = allowed & _causal(q_len, kv_len, sliding_window, query.device)
        mask = allowed
    elif mask is not None and mask.dim() != 4:
        raise fail(
            "attention",
            "",
            f"the attention mask must be 2-D (batch, kv_len) or 4-D (batch, 1, q_len, kv_len), got {mask.dim()}-D",
            "pass the mask the Hugging Face model builds, or None",
        )
    causal = mask is None and is_causal and q_len > 1
    if causal and sliding_window is not None and kv_len > sliding_window:
        mask, causal = _causal(q_len, kv_len, sliding_window, query.device), False
    if causal and kv_len > q_len:  # as Hugging Face's SDPA path: an empty static cache's prefill
        key, value = key[:, :, :q_len], value[:, :, :q_len]

    use_flash = (
        mask is None
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] <= 256
        and flash_attn_available()
    )
    if backend == "flash" and not use_flash:
        raise fail(
            "attention",
            "",
            "flash-attn cannot run this call (it needs the flash_attn package, CUDA fp16/bf16 tensors, "
            "head_dim <= 256 and no explicit mask)"
            + ("" if flash_attn_available() else "; flash_attn is not installed"),
            'use backend="auto" to fall back to scaled_dot_product_attention',
        )
    if use_flash and backend != "sdpa":
        return _flash_fn()(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            dropout_p=dropout_p,
            softmax_scale=scale,
            causal=causal,
        ).contiguous()

    extra: dict[str, Any] = {}
    if groups > 1:
        if mask is None or _gqa_takes_masks(query.device, query.dtype, query.shape[-1], mask.dtype, dropout_p > 0):
            extra["enable_gqa"] = True
        else:
            key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale, **extra
    )
    return out.transpose(1, 2).contiguous()


# torch.fx records a call to attention() as one node and does not trace into it (its
# checks branch on masks and devices): a module built on it (the kernels below) traces,
# and the layout planner reads which projections feed which from that trace
torch.fx.wrap("attention")


class Attention(nn.Module):
    """Base of the attention kernels; ``Attention.from_hf(old, path)`` picks the right one.

    Subclasses keep the Hugging Face module's projections as children under their
    original names and return ``(output, None)`` like a Hugging Face SDPA attention.

    Example:
        >>> from transformers import GPT2Config
        >>> from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
        >>> hf = GPT2Attention(GPT2Config(n_embd=32, n_head=4), layer_idx=0)
        >>> kernel = Attention.from_hf(hf, "h.0.attn")
        >>> type(kernel).__name__, kernel.c_attn is hf.c_attn
        ('FusedQKVAttention', True)
    """

    backend: Backend
    is_causal: bool
    scaling: float
    dropout_p: float

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return attention(
            query,
            key,
            value,
            attention_mask,
            is_causal=self.is_causal,
            scale=self.scaling,
            dropout_p=self.dropout_p if self.training else 0.0,
            sliding_window=sliding_window,
            backend=self.backend,
        )

    @classmethod
    def from_hf(cls, old: nn.Module, path: str = "", *, backend: Backend = "auto") -> Attention:
        """The kernel for the Hugging Face attention module ``old`` (at ``path``).

        On :class:`Attention` itself this dispatches on the module's class; on a subclass
        it builds that subclass (and raises :class:`KernelError` for other modules). The
        kernel starts in the mode (train/eval) of ``old``.
        """
        name = type(old).__name__
        kinds: tuple[tuple[tuple[str, ...], type[Attention]], ...] = (
            (ROTARY_MODULES, RotaryAttention),
            (FUSED_QKV_MODULES, FusedQKVAttention),
            (ENCODER_MODULES, EncoderSelfAttention),
            (POST_NORM_MODULES, PostNormAttention),
            (WINDOWED_MODULES, WindowedCausalAttention),
        )
        for names, kernel in kinds:
            if name in names and (cls is Attention or cls is kernel):
                return kernel._build(old, path, backend).train(old.training)
        supported = [n for names, kernel in kinds if cls in (Attention, kernel) for n in names]
        expect_type(
            cls.__name__,
            old,
            path,
            supported,
            "select the attention modules themselves, e.g. 'model.layers.*.self_attn' or 'transformer.h.*.attn'",
        )
        raise AssertionError("unreachable")  # pragma: no cover

    @classmethod
    def _build(cls, old: nn.Module, path: str, backend: Backend) -> Attention:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, causal={self.is_causal}, scaling={self.scaling:.4g}"


def _get(module: nn.Module, name: str) -> Any:
    """An attribute of a Hugging Face module (children, numbers), untyped."""
    return getattr(module, name)


def _kv_cache(cache: Any, past_key_values: Any) -> Any:
    """The key/value cache a layer hands its attention: ``cache=`` since transformers 5.24,
    ``past_key_values=`` before (the old name is still accepted there, as by the modules replaced)."""
    return cache if cache is not None else past_key_values


def _heads(hidden_states: torch.Tensor, head_dim: int, *projections: nn.Module) -> list[torch.Tensor]:
    """Each projection of ``hidden_states`` split into heads of ``head_dim``: ``(batch, heads,
    seq, head_dim)`` (as many heads as the projection yields: this rank's, under tensor
    parallelism)."""
    shape = (*hidden_states.shape[:-1], -1, head_dim)
    return [proj(hidden_states).view(shape).transpose(1, 2) for proj in projections]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of ``(batch, heads, seq, head_dim)`` queries and keys with
    ``(batch, seq, head_dim)`` ``cos``/``sin`` — Hugging Face's ``apply_rotary_pos_emb``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class RotaryAttention(Attention):
    """Drop-in for LLaMA-family attention (``LlamaAttention``, ``MistralAttention``,
    ``Qwen2Attention``, ``Qwen3Attention``): GQA, RoPE, optional q/k norms (Qwen3) and a
    sliding window (Mistral, Qwen2/3 sliding layers).

    Keeps ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (and ``q_norm``/``k_norm``) of the
    replaced module. ``forward(hidden_states, position_embeddings, attention_mask,
    cache, **kwargs) -> (output, None)``, as the decoder layer calls it (``cache`` was
    ``past_key_values`` before transformers 5.24: either name is taken).

    Example:
        >>> from transformers import LlamaConfig
        >>> from transformers.models.llama.modeling_llama import LlamaAttention
        >>> cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        ...                   attn_implementation="sdpa")
        >>> hf = LlamaAttention(cfg, layer_idx=0).eval()
        >>> kernel = RotaryAttention.from_hf(hf, "layers.0.self_attn")
        >>> x, cos, sin = torch.randn(2, 5, 32), torch.ones(2, 5, 8), torch.zeros(2, 5, 8)
        >>> torch.allclose(kernel(x, (cos, sin))[0], hf(x, (cos, sin))[0], atol=1e-6)
        True
    """

    def __init__(
        self,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        o_proj: nn.Module,
        *,
        head_dim: int,
        scaling: float,
        dropout_p: float = 0.0,
        layer_idx: int | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        sliding_window: int | None = None,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        _check_backend(backend)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        if q_norm is not None:
            self.q_norm = q_norm
        if k_norm is not None:
            self.k_norm = k_norm
        self.head_dim = head_dim
        self.scaling = scaling
        self.dropout_p = dropout_p
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_causal = True
        self.backend = backend

    @classmethod
    def _build(cls, old: nn.Module, path: str, backend: Backend) -> RotaryAttention:
        require_attrs(cls.__name__, old, path, ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))
        if getattr(old, "is_causal", True) is not True:
            raise fail(cls.__name__, path, "this attention is not causal", "replace decoder self-attention only")
        # the window its forward uses: its own where it keeps one (Qwen2's, None on its full
        # layers), else its config's, which the forwards that keep none read (Mistral's, Mixtral's)
        holder = old if hasattr(old, "sliding_window") else getattr(old, "config", None)
        window: int | None = getattr(holder, "sliding_window", None)
        return cls(
            _get(old, "q_proj"),
            _get(old, "k_proj"),
            _get(old, "v_proj"),
            _get(old, "o_proj"),
            head_dim=int(_get(old, "head_dim")),
            scaling=float(_get(old, "scaling")),
            dropout_p=float(getattr(old, "attention_dropout", 0.0)),
            layer_idx=getattr(old, "layer_idx", None),
            q_norm=getattr(old, "q_norm", None),
            k_norm=getattr(old, "k_norm", None),
            sliding_window=window,
            backend=backend,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if position_embeddings is None:
            raise fail(
                type(self).__name__,
                "",
                "position_embeddings (cos, sin) are required",
                "call it as the decoder layer does: attn(hidden_states, position_embeddings=(cos, sin), ...)",
            )
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if "q_norm" in self._modules:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        if (kv := _kv_cache(cache, past_key_values)) is not None:
            k, v = kv.update(k, v, self.layer_idx)
        out = self._attend(q, k, v, attention_mask, self.sliding_window)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


class FusedQKVAttention(Attention):
    """Drop-in for GPT-2 self-attention (``GPT2Attention``): the packed ``c_attn`` Conv1D
    ([Q|K|V] along its output), ``c_proj``, ``attn_dropout`` and ``resid_dropout`` are
    kept; the scaling (incl. ``scale_attn_by_inverse_layer_idx``) is the module's.

    Cross-attention (``add_cross_attention``) is refused. ``reorder_and_upcast_attn`` only
    changes how the eager path rounds in half precision; this kernel's softmax follows SDPA.

    Example:
        >>> from transformers import GPT2Config
        >>> from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
        >>> hf = GPT2Attention(GPT2Config(n_embd=32, n_head=4, attn_implementation="sdpa"), layer_idx=0).eval()
        >>> x = torch.randn(2, 5, 32)
        >>> torch.allclose(FusedQKVAttention.from_hf(hf)(x)[0], hf(x)[0], atol=1e-6)
        True
    """

    def __init__(
        self,
        c_attn: nn.Module,
        c_proj: nn.Module,
        attn_dropout: nn.Dropout,
        resid_dropout: nn.Module,
        *,
        num_heads: int,
        scaling: float,
        layer_idx: int | None = None,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        _check_backend(backend)
        self.c_attn, self.c_proj = c_attn, c_proj
        self.attn_dropout, self.resid_dropout = attn_dropout, resid_dropout
        self.num_heads = num_heads
        # reshape by the head size, not the head count: under tensor parallelism this rank's
        # c_attn yields its own heads only, and (..., -1, head_dim) finds how many
        proj_weight = c_proj.weight
        assert isinstance(proj_weight, torch.Tensor)
        self.head_dim = int(proj_weight.shape[0]) // num_heads  # Conv1D weight: (in, out)
        self.scaling = scaling
        self.layer_idx = layer_idx
        self.is_causal = True
        self.backend = backend

    @property
    def dropout_p(self) -> float:  # type: ignore[override]
        return float(self.attn_dropout.p)

    @classmethod
    def _build(cls, old: nn.Module, path: str, backend: Backend) -> FusedQKVAttention:
        require_attrs(cls.__name__, old, path, ("c_attn", "c_proj", "attn_dropout", "resid_dropout", "num_heads"))
        if getattr(old, "is_cross_attention", False):
            raise fail(
                cls.__name__, path, "this is a cross-attention", "replace the self-attention modules ('h.*.attn') only"
            )
        return cls(
            _get(old, "c_attn"),
            _get(old, "c_proj"),
            _get(old, "attn_dropout"),
            _get(old, "resid_dropout"),
            num_heads=int(_get(old, "num_heads")),
            scaling=float(_get(old, "scaling")),
            layer_idx=getattr(old, "layer_idx", None),
            backend=backend,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        past_key_values: Any = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if encoder_hidden_states is not None:
            raise fail(
                type(self).__name__,
                "",
                "called with encoder_hidden_states: this kernel is self-attention only",
                "do not replace attention modules that are used as cross-attention",
            )
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = self.c_attn(hidden_states).chunk(3, dim=-1)  # unpacked as such: torch.fx traces it
        q, k, v = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
        if (kv := _kv_cache(cache, past_key_values)) is not None:
            k, v = kv.update(k, v, self.layer_idx)
        out = self._attend(q, k, v, attention_mask)
        return self.resid_dropout(self.c_proj(out.reshape(*hidden_states.shape[:-1], -1))), None


class EncoderSelfAttention(Attention):
    """Drop-in for BERT/RoBERTa self-attention (``BertSelfAttention``,
    ``RobertaSelfAttention``): ``query``, ``key``, ``value`` and ``dropout`` are kept;
    causal only where the module is (``is_decoder`` configs).

    Example:
        >>> from transformers import BertConfig
        >>> from transformers.models.bert.modeling_bert import BertSelfAttention
        >>> hf = BertSelfAttention(BertConfig(hidden_size=32, num_attention_heads=4)).eval()
        >>> x = torch.randn(2, 5, 32)
        >>> torch.allclose(EncoderSelfAttention.from_hf(hf)(x)[0], hf(x)[0], atol=1e-6)
        True
    """

    def __init__(
        self,
        query: nn.Module,
        key: nn.Module,
        value: nn.Module,
        dropout: nn.Dropout,
        *,
        head_dim: int,
        scaling: float,
        is_causal: bool = False,
        layer_idx: int | None = None,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        _check_backend(backend)
        self.query, self.key, self.value, self.dropout = query, key, value, dropout
        self.head_dim = head_dim
        self.scaling = scaling
        self.is_causal = is_causal
        self.layer_idx = layer_idx
        self.backend = backend

    @property
    def dropout_p(self) -> float:  # type: ignore[override]
        return float(self.dropout.p)

    @classmethod
    def _build(cls, old: nn.Module, path: str, backend: Backend) -> EncoderSelfAttention:
        require_attrs(cls.__name__, old, path, ("query", "key", "value", "dropout", "attention_head_size", "scaling"))
        return cls(
            _get(old, "query"),
            _get(old, "key"),
            _get(old, "value"),
            _get(old, "dropout"),
            head_dim=int(_get(old, "attention_head_size")),
            scaling=float(_get(old, "scaling")),
            is_causal=bool(getattr(old, "is_causal", False)),
            layer_idx=getattr(old, "layer_idx", None),
            backend=backend,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        q, k, v = _heads(hidden_states, self.head_dim, self.query, self.key, self.value)
        if (kv := _kv_cache(cache, past_key_values)) is not None:
            kv = getattr(kv, "self_attention_cache", kv)
            k, v = kv.update(k, v, self.layer_idx)
        out = self._attend(q, k, v, attention_mask)
        return out.reshape(*hidden_states.shape[:-1], -1), None


class PostNormAttention(Attention):
    """Drop-in for an encoder attention block that holds its own output projection,
    residual and norm (``AlbertAttention``): ``LayerNorm(x + dropout(dense(attend(q, k, v))))``.
    ``query``, ``key``, ``value``, ``dense``, ``LayerNorm``, ``attention_dropout`` and
    ``output_dropout`` are kept. Under tensor parallelism ``dense`` is the row-parallel
    partner of the column-parallel projections, inside this one module.

    Example:
        >>> from transformers import AlbertConfig
        >>> from transformers.models.albert.modeling_albert import AlbertAttention
        >>> hf = AlbertAttention(AlbertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64)).eval()
        >>> x = torch.randn(2, 5, 32)
        >>> torch.allclose(PostNormAttention.from_hf(hf)(x)[0], hf(x)[0], atol=1e-6)
        True
    """

    def __init__(
        self,
        query: nn.Module,
        key: nn.Module,
        value: nn.Module,
        dense: nn.Module,
        norm: nn.Module,
        attention_dropout: nn.Dropout,
        output_dropout: nn.Module,
        *,
        head_dim: int,
        scaling: float,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        _check_backend(backend)
        self.query, self.key, self.value, self.dense = query, key, value, dense
        self.LayerNorm = norm  # the Hugging Face names, so that state dicts load unchanged
        self.attention_dropout, self.output_dropout = attention_dropout, output_dropout
        self.head_dim = head_dim
        self.scaling = scaling
        self.is_causal = False
        self.backend = backend

    @property
    def dropout_p(self) -> float:  # type: ignore[override]
        return float(self.attention_dropout.p)

    @classmethod
    def _build(cls, old: nn.Module, path: str, backend: Backend) -> PostNormAttention:
        names = ("query", "key", "value", "dense", "LayerNorm", "attention_dropout", "output_dropout")
        require_attrs(cls.__name__, old, path, (*names, "attention_head_size", "scaling"))
        if getattr(old, "is_causal", False):
            raise fail(cls.__name__, path, "this attention is causal", "replace encoder attention only")
        return cls(
            *(_get(old, n) for n in names),
            head_dim=int(_get(old, "attention_head_size")),
            scaling=float(_get(old, "scaling")),
            backend=backend,
        )

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, None]:
        q, k, v = _heads(hidden_states, self.head_dim, self.query, self.key, self.value)
        out = self._attend(q, k, v, attention_mask).reshape(*hidden_states.shape[:-1], -1)
        return self.LayerNorm(hidden_states + self.output_dropout(self.dense(out))), None


def _windowed(mask: torch.Tensor, q_len: int, kv_len: int, window: int | None) -> torch.Tensor:
    """A model's 4-D mask (boolean or additive) narrowed to causal attention within ``window``
    keys: what an attention applying its own causal/local pattern on top of that mask sees."""
    allowed = _causal(q_len, kv_len, window, mask.device)
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, torch.finfo(mask.dtype).min)


class WindowedCausalAttention(Attention):
    """Drop-in for GPT-Neo self-attention (``GPTNeoSelfAttention``): causal, over every
    earlier key (``"global"`` layers) or the last ``window_size`` (``"local"`` layers), and
    unscaled (GPT-Neo does not divide scores by √head_dim). ``q_proj``, ``k_proj``,
    ``v_proj``, ``out_proj``, ``attn_dropout`` and ``resid_dropout`` are kept. Scores are
    computed in the inputs' dtype (GPT-Neo's eager path upcasts them to float32).

    Example:
        >>> from transformers import GPTNeoConfig
        >>> from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention
        >>> cfg = GPTNeoConfig(hidden_size=32, num_heads=4, num_layers=1, attention_types=[[["local"], 1]],
        ...                    window_size=3)
        >>> hf = GPTNeoSelfAttention(cfg, "local", layer_id=0).eval()
        >>> x = torch.randn(2, 6, 32)
        >>> torch.allclose(WindowedCausalAttention.from_hf(hf)(x)[0], hf(x)[0], atol=1e-6)
        True
    """

    def __init__(
        self,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        out_proj: nn.Module,
        attn_dropout: nn.Dropout,
        resid_dropout: nn.Module,
        *,
        head_dim: int,
        sliding_window: int | None = None,
        layer_idx: int | None = None,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        _check_backend(backend)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = q_proj, k_proj, v_proj, out_proj
        self.attn_dropout, self.resid_dropout = attn_dropout, resid_dropout
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.layer_idx = layer_idx
        self.scaling = 1.0
        self.is_causal = True
        self.backend = backend

    @property
    def dropout_p(self) -> float:  # type: ignore[override]
        return float(self.attn_dropout.p)

    @classmethod
    def _build(cls, old: nn.Module, path: str, backend: Backend) -> WindowedCausalAttention:
        names = ("q_proj", "k_proj", "v_proj", "out_proj", "attn_dropout", "resid_dropout")
        require_attrs(cls.__name__, old, path, (*names, "head_dim", "attention_type", "config"))
        kind = _get(old, "attention_type")
        if kind not in ("global", "local"):
            raise fail(cls.__name__, path, f"attention_type {kind!r} is neither 'global' nor 'local'",
                       "replace GPT-Neo self-attention of a supported config")
        return cls(
            *(_get(old, n) for n in names),
            head_dim=int(_get(old, "head_dim")),
            sliding_window=int(_get(old, "config").window_size) if kind == "local" else None,
            layer_idx=getattr(old, "layer_id", None),
            backend=backend,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        layer_past: Any = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        q, k, v = _heads(hidden_states, self.head_dim, self.q_proj, self.k_proj, self.v_proj)
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        mask = attention_mask
        if mask is not None and mask.dim() == 4:  # the model's mask, and this layer's own causal/local pattern
            mask = _windowed(mask, q.shape[2], k.shape[2], self.sliding_window)
        out = self._attend(q, k, v, mask, self.sliding_window)
        return self.resid_dropout(self.out_proj(out.reshape(*hidden_states.shape[:-1], -1))), None
