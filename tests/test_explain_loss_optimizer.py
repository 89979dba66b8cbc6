"""explain's optimizer states and loss against what a CPU run holds: AdamW's moments in
the parameters' dtype (counted against ``torch.optim.AdamW``'s own state), and the peak
of a step whose loss is torch's float32 cross-entropy over the full logits or the
chunked LM-head loss (each declaring its :class:`~slapo_fn.kernels.LossFootprint`),
within 15% of the peak the profiler measures."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import slapo_fn as sf
from slapo_fn.dtensor.explain import activation_shapes
from slapo_fn.kernels import CHUNKED_LOSS, FULL_LOGITS_LOSS, ChunkedLMHeadLoss, LossFootprint, causal_lm_loss
from slapo_fn.memory import activation_memory, profiled_peak_bytes

VOCAB = 4096


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False))


def ids(batch: int = 2, seq: int = 64) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adamw_states_are_counted_in_the_params_dtype(dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(dtype)
    numel = sum(p.numel() for p in model.parameters())
    memory = sf.explain(sf.create_schedule(model)).memory
    assert memory is not None
    size = 2 if dtype == torch.bfloat16 else 4
    assert memory.rows[0].optimizer_bytes == 2 * size * numel
    assert "2 states per parameter, in its dtype" in str(memory)
    # what torch's AdamW really keeps after a step (the step counters aside)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32, dtype=dtype)).sum().backward()
    opt.step()
    kept = sum(t.nbytes for s in opt.state.values() for k, t in s.items() if k != "step")
    assert kept == memory.rows[0].optimizer_bytes
    # and slapo_fn's functional AdamW the same
    state = sf.optim.adamw()[0](dict(model.named_parameters()))
    assert sum(t.nbytes for k in ("exp_avg", "exp_avg_sq") for t in state[k].values()) == kept
    # an optimizer that keeps float32 states of bf16 parameters says so
    fp32 = sf.explain(sf.create_schedule(model), state_dtype=torch.float32).memory
    assert fp32 is not None and fp32.rows[0].optimizer_bytes == 2 * 4 * numel and "in f32" in str(fp32)


def test_a_chunked_loss_counts_no_full_logits() -> None:
    model, x = llama(), ids()
    sch = sf.create_schedule(model)
    shapes = activation_shapes(model, (x,), {})

    def peak(loss: LossFootprint) -> int:
        return activation_memory(sch, shapes, loss=loss).rows[0].peak_bytes

    logits, head = x.numel() * VOCAB, VOCAB * 64
    assert peak(FULL_LOGITS_LOSS) - peak(CHUNKED_LOSS) \
        == FULL_LOGITS_LOSS.nbytes(logits=logits, head=head) - CHUNKED_LOSS.nbytes(logits=logits, head=head)
    # nothing as large as the logits: one chunk of 16 tokens and the head's gradient
    small = LossFootprint(chunk=3, chunk_elements=16 * VOCAB, head_grad=True)
    assert peak(CHUNKED_LOSS) - peak(small) == 3 * 4 * (logits - 16 * VOCAB)
    assert "a chunk of 65,536 logits" in activation_memory(sch, shapes, loss=small).note


def _measured(step: Callable[[], torch.Tensor]) -> int:
    """The least of three measured peaks of ``step().backward()``, gradients allocated by a
    first step (the peak holds activations, the loss and temporaries)."""
    step().backward()
    return min(profiled_peak_bytes(lambda: step().backward()) for _ in range(3))


@pytest.mark.timeout(120)
def test_the_predicted_peak_follows_the_loss_the_run_computes() -> None:
    model, x = llama(), ids()
    sch = sf.create_schedule(model)
    built = sf.build(sch)
    head = ChunkedLMHeadLoss.from_hf(built.get_output_embeddings(), chunk_size=16)
    plain = _measured(lambda: built(x, labels=x).loss)
    chunked = _measured(lambda: causal_lm_loss(built, x, chunk_size=16))
    runs = {  # (the fake run's keywords, the loss, the measured peak)
        "hf labels": ({"labels": x}, FULL_LOGITS_LOSS, plain),
        "hf, fake run without labels": ({}, FULL_LOGITS_LOSS, plain),
        "chunked": ({}, head.footprint, chunked),
    }
    without = activation_shapes(model, (x,), {})
    with_labels = activation_shapes(model, (x,), {"labels": x})
    out = {}
    for name, (kwargs, loss, measured) in runs.items():
        table = activation_memory(sch, with_labels if kwargs else without, loss=loss)
        out[name] = (table.rows[0].peak_bytes, measured)
    for name, (predicted, measured) in out.items():
        assert abs(predicted - measured) <= 0.15 * measured, (name, out)
    assert out["chunked"][1] < 0.5 * out["hf labels"][1], out


def test_compiled_modules_are_counted_as_eager_and_the_note_says_so() -> None:
    model, x = llama(), ids()
    eager = sf.explain(sf.create_schedule(model), x).memory
    compiled = sf.explain(sf.compile(sf.create_schedule(model), "model.layers.*"), x).memory
    assert eager is not None and compiled is not None
    assert compiled.rows[0].activation_bytes == eager.rows[0].activation_bytes
    assert "2 compiled modules counted as eager" in str(compiled) and "compiled" not in str(eager)
