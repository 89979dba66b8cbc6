"""Chunked linear + cross-entropy: equal to ``F.cross_entropy(F.linear(h, W, b), y)`` in
loss and gradients (ignore_index, mean/sum, bias, chunk sizes, dtypes), equal to a Hugging
Face causal LM's own loss, never saves a tokens x vocab tensor, lower peak memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import slapo_fn as sf
from slapo_fn.kernels import ChunkedLMHeadLoss, KernelError, causal_lm_loss, linear_cross_entropy
from slapo_fn.memory import profiled_peak_bytes
from tests.models import tiny_gpt2, tiny_llama, token_ids


def _data(n: int, d: int, v: int, dtype: torch.dtype = torch.float64, ignored: int = 0, seed: int = 0,
          bias: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.randperm(n, generator=g)[:ignored]] = -100
    return h, w, b, y


def _grads(loss: torch.Tensor, *inputs: torch.Tensor | None) -> list[torch.Tensor]:
    present = [t for t in inputs if t is not None]
    return list(torch.autograd.grad(loss, present))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), v=st.integers(2, 30), chunk=st.integers(1, 45), ignored=st.integers(0, 10),
       bias=st.booleans(), reduction=st.sampled_from(["mean", "sum"]))
def test_equals_plain_cross_entropy_in_float64(n: int, v: int, chunk: int, ignored: int, bias: bool,
                                               reduction: str) -> None:
    h, w, b, y = _data(n, 6, v, ignored=min(ignored, n - 1), bias=bias)
    want = F.cross_entropy(F.linear(h, w, b), y, reduction=reduction)
    got = linear_cross_entropy(h, w, y, b, reduction=reduction, chunk_size=chunk)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want)
    for g_got, g_want in zip(_grads(got, h, w, b), _grads(want, h, w, b), strict=True):
        torch.testing.assert_close(g_got, g_want)


def test_float32_and_batched_shapes_and_upstream_gradient() -> None:
    h, w, b, y = _data(24, 16, 50, dtype=torch.float32, ignored=5, bias=True)
    h3, y3 = h.view(2, 12, 16), y.view(2, 12)
    want = F.cross_entropy(F.linear(h3, w, b).flatten(0, 1), y3.flatten())
    got = linear_cross_entropy(h3, w, y3, b, chunk_size=7)
    torch.testing.assert_close(got, want)
    for g_got, g_want in zip(_grads(3.0 * got, h, w, b), _grads(3.0 * want, h, w, b), strict=True):
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)


def test_bfloat16_hidden_upcasts_logits_like_hf() -> None:
    h, w, _, y = _data(16, 8, 20, dtype=torch.bfloat16)
    want = F.cross_entropy(F.linear(h, w).float(), y)
    got = linear_cross_entropy(h, w, y, chunk_size=5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    for g_got, g_want in zip(_grads(got, h, w), _grads(want, h, w), strict=True):
        assert g_got.dtype == torch.bfloat16
        torch.testing.assert_close(g_got, g_want, rtol=2e-2, atol=2e-2)


def test_under_autocast_the_matmuls_run_in_bfloat16_like_the_plain_head() -> None:
    h, w, b, y = _data(64, 32, 300, dtype=torch.float32, ignored=4, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(h, w, b).float(), y)
        got = linear_cross_entropy(h, w, y, b, chunk_size=17)
    exact = F.cross_entropy(F.linear(h, w, b), y)
    assert got.dtype == torch.float32
    # bfloat16 logits, as the autocast plain head: near it, and measurably off the float32 loss
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    assert float((got - exact).abs()) > 1e-6
    for g_got, g_want in zip(_grads(got, h, w, b), _grads(want, h, w, b), strict=True):
        assert g_got.dtype == torch.float32
        torch.testing.assert_close(g_got, g_want, rtol=3e-2, atol=3e-3)
    from torch.utils._python_dispatch import TorchDispatchMode

    aten, gemms = torch.ops.aten, []

    class Gemms(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.overloadpacket in (aten.mm, aten.addmm, aten.addmm_):
                gemms.append((func.overloadpacket.__name__, args[-1].dtype))
            return func(*args, **(kwargs or {}))

    with Gemms(), torch.autocast("cpu", dtype=torch.bfloat16):
        linear_cross_entropy(h, w, y, b, chunk_size=17).backward()
    assert len(gemms) == 3 * 4 and {dtype for _, dtype in gemms} == {torch.bfloat16}


def test_all_ignored_is_nan_like_pytorch_and_no_grad_path() -> None:
    h, w, _, y = _data(4, 3, 5)
    y[:] = -100
    assert torch.isnan(linear_cross_entropy(h, w, y)) and torch.isnan(F.cross_entropy(h @ w.T, y))
    h, w, _, y = _data(9, 3, 5)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y, chunk_size=2), F.cross_entropy(h @ w.T, y))


def test_second_backward_through_the_same_graph_is_refused() -> None:
    """Backward scales the saved gradients in place; a retained graph cannot reuse them."""
    h, w, _, y = _data(6, 3, 5)
    loss = linear_cross_entropy(h, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_no_tokens_by_vocab_tensor_is_saved_for_backward() -> None:
    n, d, v = 64, 8, 500
    h, w, _, y = _data(n, d, v, dtype=torch.float32)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = linear_cross_entropy(h, w, y, chunk_size=16)
    assert saved and max(torch.Size(s).numel() for s in saved) <= max(n, v) * d
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(F.linear(h, w), y)
    assert any(torch.Size(s).numel() >= n * v for s in saved)  # the plain head keeps its logits
    loss.backward()


def test_peak_memory_is_lower_than_the_plain_head() -> None:
    n, d, v = 256, 32, 4000  # logits: 4 MB in float32
    h, w, _, y = _data(n, d, v, dtype=torch.float32)
    plain = profiled_peak_bytes(lambda: F.cross_entropy(F.linear(h, w), y).backward())
    chunked = profiled_peak_bytes(lambda: linear_cross_entropy(h, w, y, chunk_size=32).backward())
    logits_bytes = n * v * 4
    assert plain >= 2 * logits_bytes  # logits and their log-softmax (and its gradient) coexist
    assert chunked < logits_bytes  # not even one full copy of the logits at any time
    assert chunked < plain / 4


# -- Hugging Face causal LMs -----------------------------------------------------------------
@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2-tied"])
def test_causal_lm_loss_equals_the_models_loss_and_gradients(make: object) -> None:
    model = make().eval()  # type: ignore[operator]  # GPT-2 has dropout
    ids = token_ids(batch=3, seq=9)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    want = model(ids, attention_mask=mask, labels=labels).loss
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    got = causal_lm_loss(model, ids, labels, attention_mask=mask, chunk_size=5)
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, want)
    for (name, _), a, b in zip(model.named_parameters(), got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    summed = causal_lm_loss(model, ids, labels, attention_mask=mask, num_items_in_batch=7)
    torch.testing.assert_close(summed, model(ids, attention_mask=mask, labels=labels, num_items_in_batch=7).loss)


def test_causal_lm_loss_on_a_scheduled_model() -> None:
    model = tiny_llama()
    built = sf.build(sf.checkpoint(sf.create_schedule(model), "model.layers.*"))
    ids = token_ids()
    torch.testing.assert_close(causal_lm_loss(built, ids), model(ids, labels=ids).loss)


def test_lm_head_loss_module_keeps_the_head_parameters() -> None:
    head = nn.Linear(8, 30)
    loss_fn = ChunkedLMHeadLoss.from_hf(head, "lm_head", chunk_size=4)
    assert loss_fn.weight is head.weight and loss_fn.bias is head.bias
    h, y = torch.randn(2, 5, 8), torch.randint(0, 30, (2, 5))
    torch.testing.assert_close(loss_fn(h, y), F.cross_entropy(head(h).flatten(0, 1), y.flatten()))
    torch.testing.assert_close(loss_fn(h, y, reduction="sum"),
                               F.cross_entropy(head(h).flatten(0, 1), y.flatten(), reduction="sum"))


def test_errors() -> None:
    h, w, _, y = _data(6, 4, 10)
    with pytest.raises(KernelError, match="hidden has 4 features but weight expects 3"):
        linear_cross_entropy(h, w[:, :3], y)
    with pytest.raises(KernelError, match=r"target shape \(5,\) must equal"):
        linear_cross_entropy(h, w, y[:5])
    with pytest.raises(KernelError, match="integer class ids"):
        linear_cross_entropy(h, w, y.double())
    with pytest.raises(KernelError, match="reduction must be"):
        linear_cross_entropy(h, w, y, reduction="none")  # type: ignore[arg-type]
    with pytest.raises(KernelError, match="chunk_size must be a positive int"):
        linear_cross_entropy(h, w, y, chunk_size=0)
    with pytest.raises(KernelError, match=r"bias must be \(10,\)"):
        linear_cross_entropy(h, w, y, torch.zeros(3))
    with pytest.raises(KernelError, match="lm_head: an LM head must be an nn.Linear"):
        ChunkedLMHeadLoss.from_hf(nn.Embedding(3, 3), "lm_head")
    with pytest.raises(KernelError, match="not a Hugging Face causal LM"):
        causal_lm_loss(nn.Linear(3, 3), token_ids())
