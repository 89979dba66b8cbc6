"""Attention kernels: outputs and gradients equal the Hugging Face modules they replace —
causal, padded (left and right), GQA, sliding window, RoPE, KV cache — and every error."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import slapo_fn as sf
from slapo_fn.kernels import (
    Attention,
    EncoderSelfAttention,
    FusedQKVAttention,
    KernelError,
    RotaryAttention,
    attention,
    flash_attn_available,
)

VOCAB = 96
SEQ = 10


def _decoder(family: str, impl: str, **overrides: Any) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation=impl)
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[family]
    return model_cls(config_cls(**common)).eval()


def _gpt2(impl: str, **overrides: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    overrides["attn_implementation"] = impl
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4, n_positions=32, use_cache=False,
                     **overrides)
    return GPT2LMHeadModel(cfg).eval()


def _bert(impl: str) -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    options: dict[str, Any] = {"attn_implementation": impl}
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=32, **options)
    return BertModel(cfg).eval()


def _ids(batch: int = 3, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _mask(kind: str, batch: int = 3, seq: int = SEQ) -> torch.Tensor | None:
    """None, or a padding mask: "left" pads the start of rows 0 and 2, "right" their end."""
    if kind == "none":
        return None
    mask = torch.ones(batch, seq, dtype=torch.long)
    if kind == "left":
        mask[0, :4] = 0
        mask[2, :1] = 0
    else:
        mask[0, -4:] = 0
        mask[2, -1:] = 0
    return mask


ATTN_PATHS = {
    "llama": "model.layers.*.self_attn",
    "mistral": "model.layers.*.self_attn",
    "qwen2": "model.layers.*.self_attn",
    "qwen3": "model.layers.*.self_attn",
    "gpt2": "transformer.h.*.attn",
    "bert": "encoder.layer.*.attention.self",
}


def _model(family: str, impl: str) -> nn.Module:
    if family == "gpt2":
        return _gpt2(impl)
    if family == "bert":
        return _bert(impl)
    return _decoder(family, impl)


def _verify(model: nn.Module, family: str, mask: torch.Tensor | None, *, train: bool = False,
            factory: Callable[..., nn.Module] = Attention.from_hf) -> sf.VerifyReport:
    sch = sf.replace(sf.create_schedule(model), ATTN_PATHS[family], factory)
    kwargs = {} if mask is None else {"attention_mask": mask}
    return sf.verify(sch, _ids(), kwargs=kwargs, train=train, rtol=1e-5, atol=1e-5)


# -- parity on whole models --------------------------------------------------------------
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gpt2", "bert"])
def test_kernel_matches_hf_outputs_and_gradients(family: str, padding: str) -> None:
    report = _verify(_model(family, "sdpa"), family, _mask(padding))
    assert len(report.gradients) == len(list(_model(family, "sdpa").parameters()))


@pytest.mark.parametrize("padding", ["none", "right"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_kernel_matches_hf_eager_masks(family: str, padding: str) -> None:
    """With ``attn_implementation="eager"`` the model builds additive float masks."""
    assert _verify(_model(family, "eager"), family, _mask(padding)).gradients


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_eager_left_padding_matches_where_a_query_sees_a_token(family: str) -> None:
    """Left padding + causal leaves padded queries with no key to attend to. Eager's
    additive mask gives them a uniform softmax (outputs match) whose q/k "gradient" is a
    rounding artefact (``s + finfo.min == finfo.min``); SDPA's differs. Every output
    matches, and every gradient does once such rows carry no cotangent (their labels are
    ignored in a real loss)."""
    model = _model(family, "eager")
    built = sf.build(sf.replace(sf.create_schedule(model), ATTN_PATHS[family], Attention.from_hf))
    ids, mask = _ids(), _mask("left")
    assert mask is not None
    live = mask.bool() if family != "bert" else torch.ones_like(mask, dtype=torch.bool)
    grads = []
    for m in (model, built):
        out = m(ids, attention_mask=mask)
        out = out.logits if hasattr(out, "logits") else out.last_hidden_state
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)) * live[..., None]
        (out * cot).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        m.zero_grad()
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-5, msg=name)


def test_padding_is_honoured_not_ignored() -> None:
    """Guard against a kernel that drops the mask: padded and unpadded inputs must give
    different outputs on the kept tokens of a left-padded row, exactly as HF's do."""
    model = _decoder("llama", "sdpa")
    built = sf.build(sf.replace(sf.create_schedule(model), ATTN_PATHS["llama"], Attention.from_hf))
    ids, mask = _ids(), _mask("left")
    with torch.no_grad():
        padded = built(ids, attention_mask=mask).logits
        unpadded = built(ids).logits
        reference = model(ids, attention_mask=mask).logits
    assert not torch.allclose(padded[0, 4:], unpadded[0, 4:], atol=1e-4)
    torch.testing.assert_close(padded, reference, rtol=1e-5, atol=1e-5)


def test_kernel_in_training_mode_matches() -> None:
    report = _verify(_decoder("llama", "sdpa"), "llama", _mask("left"), train=True)
    assert report.gradients


@pytest.mark.parametrize(("family", "overrides"), [
    ("mistral", {}),  # keeps no window of its own: its forward reads the config's, and so does the kernel
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 0}),  # keeps its own
    ("qwen2", {"use_sliding_window": False}),  # its own is None (full attention) though the config has one
])
def test_sliding_window_mask_from_the_model(family: str, overrides: dict[str, Any]) -> None:
    model = _decoder(family, "sdpa", sliding_window=4, **overrides)
    _verify(model, family, None)
    _verify(model, family, _mask("left"))


def test_gpt2_layer_scaling_and_sdpa_backend() -> None:
    model = _gpt2("sdpa", scale_attn_by_inverse_layer_idx=True)
    _verify(model, "gpt2", _mask("right"), factory=functools.partial(FusedQKVAttention.from_hf, backend="sdpa"))


def test_parameters_are_the_same_objects_and_state_dict_keys_unchanged() -> None:
    for family in ("llama", "qwen3", "gpt2", "bert"):
        model = _model(family, "sdpa")
        sch = sf.replace(sf.create_schedule(model), ATTN_PATHS[family], Attention.from_hf)
        built = sf.build(sch, copy=False)
        assert list(built.state_dict()) == list(model.state_dict())
        original = dict(model.named_parameters())
        assert all(p is original[n] for n, p in sch.module.named_parameters())


def test_from_hf_dispatches_and_keeps_mode() -> None:
    llama, gpt2, bert = _decoder("qwen3", "sdpa"), _gpt2("sdpa"), _bert("sdpa")
    kernel = Attention.from_hf(llama.get_submodule("model.layers.0.self_attn"))
    assert isinstance(kernel, RotaryAttention)
    assert kernel.q_norm is llama.get_submodule("model.layers.0.self_attn.q_norm")
    assert not kernel.training
    assert isinstance(Attention.from_hf(gpt2.get_submodule("transformer.h.0.attn")), FusedQKVAttention)
    bert_kernel = EncoderSelfAttention.from_hf(bert.get_submodule("encoder.layer.0.attention.self"))
    assert isinstance(bert_kernel, EncoderSelfAttention)
    assert Attention.from_hf(gpt2.get_submodule("transformer.h.0.attn").train()).training


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kv_cache_decoding_matches(family: str) -> None:
    model = _model(family, "sdpa")
    built = sf.build(sf.replace(sf.create_schedule(model), ATTN_PATHS[family], Attention.from_hf), copy=False)
    ids = _ids(batch=2)
    with torch.no_grad():
        outs = []
        for m in (model, built):
            first = m(ids[:, :6], use_cache=True)
            step = m(ids[:, 6:], past_key_values=first.past_key_values, use_cache=True)
            outs.append(torch.cat([first.logits, step.logits], dim=1))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_the_kernel_takes_the_kv_cache_by_either_name(name: str) -> None:
    """Decoder layers hand attention its cache as ``cache=`` since transformers 5.24
    (``past_key_values=`` before): either name is updated, none is dropped into kwargs."""
    from transformers import DynamicCache

    model = _model("llama", "sdpa").eval()
    kernel = Attention.from_hf(model.get_submodule("model.layers.0.self_attn"))
    hidden = torch.randn(2, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    rope = model.model.rotary_emb(hidden, torch.arange(6)[None])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        kernel(hidden, rope, None, **{name: cache})
    assert cache.get_seq_length() == 6


# -- the functional core -----------------------------------------------------------------
def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _qkv(batch: int = 2, heads: int = 4, kv_heads: int = 2, q_len: int = 6,
         kv_len: int = 6) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, q_len, 8, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, kv_len, 8, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, kv_len, 8, generator=g, dtype=torch.float64)
    return q, k, v


def test_two_d_padding_mask_with_causal_and_window() -> None:
    q, k, v = _qkv()
    pad = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    for window in (None, 3):
        allowed = (j <= i) & pad.bool()[:, None, None, :]
        if window is not None:
            allowed = allowed & (j > i - window)
        got = attention(q, k, v, pad, is_causal=True, sliding_window=window)
        want = _reference(q, k, v, allowed)
        keep = pad.bool()  # rows of fully masked queries are undefined in the reference
        torch.testing.assert_close(got[keep], want[keep])


def test_no_mask_causal_with_window_and_full() -> None:
    q, k, v = _qkv()
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    torch.testing.assert_close(attention(q, k, v, is_causal=True, sliding_window=2),
                               _reference(q, k, v, (j <= i) & (j > i - 2)))
    full = torch.ones(6, 6, dtype=torch.bool)
    torch.testing.assert_close(attention(q, k, v, is_causal=False), _reference(q, k, v, full))
    # one query token attends to everything (decoding), causal or not
    q1 = q[:, :, -1:]
    torch.testing.assert_close(attention(q1, k, v, is_causal=True), _reference(q1, k, v, full[:1]))


def test_four_d_boolean_and_additive_masks_agree() -> None:
    q, k, v = _qkv()
    allowed = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[..., 0] = True
    additive = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    want = _reference(q, k, v, allowed)
    torch.testing.assert_close(attention(q, k, v, allowed, is_causal=True), want)
    torch.testing.assert_close(attention(q, k, v, additive, is_causal=True), want)


class _Outputs(TorchDispatchMode):
    """Records the shapes of every tensor an aten op returns, and the kernels' inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.kernel_inputs: list[list[tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if "scaled_dot_product" in str(func):
            self.kernel_inputs.append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
        return out


@pytest.mark.parametrize("form", ["none", "padding_2d", "bool_4d", "additive_4d"])
def test_gqa_reads_keys_and_values_in_place_with_every_mask(form: str) -> None:
    """SDPA's own GQA (``enable_gqa``) with causal and padding masks alike: forward and
    backward never build K/V repeated to the query's heads (a copy of heads/kv_heads × K)."""
    q, k, v = (t.float().requires_grad_() for t in _qkv(q_len=3, kv_len=6))
    pad = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    i, j = torch.arange(3, 6)[:, None], torch.arange(6)[None, :]
    allowed = (j <= i) & pad.bool()[:, None, None, :]
    mask = {"none": None, "padding_2d": pad, "bool_4d": allowed,
            "additive_4d": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)}[form]
    with _Outputs() as seen:
        out = attention(q, k, v, mask, is_causal=mask is not None)  # (None and causal drops the cache's tail)
        out.square().sum().backward()
    repeated = (2, 4, 6, 8)  # (batch, heads, kv_len, head_dim)
    assert repeated not in seen.shapes and not any(len(s) == 5 for s in seen.shapes), seen.shapes
    assert seen.kernel_inputs and all((2, 2, 6, 8) in shapes for shapes in seen.kernel_inputs)
    if mask is not None:
        keep = pad.bool()[:, 3:]
        want = _reference(q.detach().double(), k.detach().double(), v.detach().double(), allowed)
        torch.testing.assert_close(out.detach()[keep].double(), want[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (flash_attn_available() and torch.cuda.is_available()), reason="needs flash-attn and CUDA")
def test_flash_backend_matches_sdpa_on_cuda() -> None:  # pragma: no cover - no GPU in CI
    q, k, v = (t.to("cuda", torch.bfloat16) for t in _qkv())
    flash = attention(q, k, v, is_causal=True, backend="flash")
    sdpa = attention(q, k, v, is_causal=True, backend="sdpa")
    torch.testing.assert_close(flash, sdpa, rtol=2e-2, atol=2e-2)


# -- errors ------------------------------------------------------------------------------
def test_errors_name_the_module_and_the_fix() -> None:
    with pytest.raises(KernelError, match=r"layers\.0\.mlp: Linear is not one of the modules this kernel replaces"):
        Attention.from_hf(nn.Linear(2, 2), "layers.0.mlp")
    gpt2 = _gpt2("sdpa")
    with pytest.raises(KernelError, match="GPT2Attention is not one of .*LlamaAttention"):
        RotaryAttention.from_hf(gpt2.get_submodule("transformer.h.0.attn"), "h.0.attn")
    with pytest.raises(KernelError, match="backend must be one of"):
        Attention.from_hf(gpt2.get_submodule("transformer.h.0.attn"), backend="triton")  # type: ignore[arg-type]
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    cross = GPT2Attention(gpt2.config, is_cross_attention=True, layer_idx=0)
    with pytest.raises(KernelError, match="this is a cross-attention"):
        Attention.from_hf(cross, "h.0.crossattention")
    with pytest.raises(TypeError):  # KernelError is a TypeError too
        sf.replace(sf.create_schedule(gpt2), "transformer.h.*.mlp", Attention.from_hf)


def test_replace_leaves_input_unchanged_on_error() -> None:
    model = _gpt2("sdpa")
    sch = sf.create_schedule(model)
    with pytest.raises(KernelError):
        sf.replace(sch, "transformer.h.*.ln_1", Attention.from_hf)
    assert type(sch.module.get_submodule("transformer.h.0.attn")).__name__ == "GPT2Attention"


def test_bad_inputs_are_refused() -> None:
    q, k, v = _qkv()
    with pytest.raises(KernelError, match="must be 4-D"):
        attention(q[0], k, v, is_causal=True)
    with pytest.raises(KernelError, match="dividing the query's"):
        attention(q, k[:, :1].expand(2, 3, 6, 8), v[:, :1].expand(2, 3, 6, 8), is_causal=True)
    with pytest.raises(KernelError, match="2-D padding mask must be"):
        attention(q, k, v, torch.ones(2, 5), is_causal=True)
    with pytest.raises(KernelError, match="got 3-D"):
        attention(q, k, v, torch.ones(2, 6, 6, dtype=torch.bool), is_causal=True)
    with pytest.raises(KernelError, match="the attention mask is a dict"):
        attention(q, k, v, {"mask": 1}, is_causal=True)  # type: ignore[arg-type]
    if not flash_attn_available():
        with pytest.raises(KernelError, match="flash_attn is not installed"):
            attention(q, k, v, is_causal=True, backend="flash")
    gpt2 = _gpt2("sdpa")
    kernel = Attention.from_hf(gpt2.get_submodule("transformer.h.0.attn"))
    with pytest.raises(KernelError, match="self-attention only"):
        kernel(torch.randn(1, 3, 64), encoder_hidden_states=torch.randn(1, 3, 64))
    llama = Attention.from_hf(_decoder("llama", "sdpa").get_submodule("model.layers.0.self_attn"))
    with pytest.raises(KernelError, match="position_embeddings"):
        llama(torch.randn(1, 3, 64))
