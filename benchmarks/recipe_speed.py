"""Single-process training step of Hugging Face models, eager vs slapo_fn kernels (+ compile).

Models (random weights, from configs): GPT-2 (4 layers, hidden 512, 8 heads, vocab
50 257) and LLaMA (4 layers, hidden 512, 8 heads / 4 KV heads, intermediate 1408, vocab
32 000); batch 4 x seq 256, float32, CPU. One training step = forward + loss + backward.

Variants:

* ``eager`` — the Hugging Face model as loaded (its default ``sdpa`` attention),
  ``model(ids, labels=ids).loss``;
* ``kernels`` — the same weights scheduled with the slapo_fn kernels (``Attention``, and
  ``FusedMLP`` for GPT-2 / ``CompiledRMSNorm`` for LLaMA, the fastest RMSNorm in
  ``rmsnorm_variants_ms``) and the loss from
  :func:`slapo_fn.kernels.causal_lm_loss` (chunked LM head + cross-entropy, no logits);
* ``kernels+compile`` — plus ``sf.compile`` (inductor) of every decoder layer; its first
  step (compilation included) is reported separately as ``first_compiled_step_wall_s``
  (inductor's on-disk cache makes a repeated run's compile much shorter than a cold one).

Time: median over ``--repeat`` steps, the variants interleaved step by step, of the
process CPU time (``time.process_time``, all threads: the work done, robust to this
shared machine's other load descheduling us) and of the wall-clock time (``*_wall``,
reported, noisy here); ``speedup`` = eager / variant on CPU time.

``gemm_share``: the fraction of a step's CPU time spent in matrix multiplications
(profiler), which bounds what fusing the rest can gain.

Memory: peak bytes allocated during one step above what was live before it — the
PyTorch profiler's memory timeline (``profile_memory=True``: every CPU allocation and
free made through PyTorch's allocator, temporaries included; ``tracemalloc`` cannot see
them). Gradients are allocated before (an earlier step), so the figure is activations +
temporaries. Measured without and with full activation checkpointing (``sf.checkpoint``
on every decoder layer); ``reduction`` is 1 - variant / eager-without-checkpointing.

``--dtype bfloat16`` runs every variant's forward under CPU autocast (bfloat16 matmuls,
which this CPU's AVX-512 BF16 runs about twice as fast as float32): the like-for-like
mixed-precision comparison.

Prints one JSON line. ``python benchmarks/recipe_speed.py [--repeat N] [--quick]
[--dtype float32|bfloat16]``; ``--quick`` uses 2 layers, seq 64 (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import slapo_fn as sf
from slapo_fn.kernels import Attention, CompiledRMSNorm, FusedMLP, RMSNorm, causal_lm_loss, fused_mlp, rms_norm
from slapo_fn.memory import profiled_peak_bytes

Step = Callable[[], None]


def make_gpt2(layers: int, seq: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=512, n_layer=layers, n_head=8, n_positions=max(seq, 256), use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def make_llama(layers: int, seq: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max(seq, 256),
                      use_cache=False)
    return LlamaForCausalLM(cfg)


LAYERS = {"gpt2": "transformer.h.*", "llama": "model.layers.*"}


def kernel_schedule(model: nn.Module, family: str) -> sf.Schedule:
    sch = sf.create_schedule(model)
    if family == "gpt2":
        sch = sf.replace(sch, "transformer.h.*.attn", Attention.from_hf)
        return sf.replace(sch, "transformer.h.*.mlp", FusedMLP.from_hf)
    sch = sf.replace(sch, "model.layers.*.self_attn", Attention.from_hf)
    norms = ["model.layers.*.{input,post_attention}_layernorm", "model.norm"]
    return sf.replace(sch, norms, CompiledRMSNorm.from_hf)


def hf_step(model: nn.Module, ids: torch.Tensor, bf16: bool = False) -> Step:
    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(ids, labels=ids).loss
        loss.backward()

    return step


def kernel_step(model: nn.Module, ids: torch.Tensor, bf16: bool = False) -> Step:
    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = causal_lm_loss(model, ids)
        loss.backward()

    return step


GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmm_")


def gemm_share(step: Step) -> float:
    """Fraction of one step's self CPU time spent in matrix multiplications (profiler):
    the part of the step that no elementwise fusion can speed up."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in GEMMS) / total


def timed(step: Step) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    return time.process_time() - cpu, time.perf_counter() - wall


def bench_model(family: str, layers: int, batch: int, seq: int, repeat: int, bf16: bool = False) -> dict[str, Any]:
    model = (make_gpt2 if family == "gpt2" else make_llama)(layers, seq).train()
    vocab: int = getattr(model, "config").vocab_size  # noqa: B009
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    kernels = kernel_schedule(model, family)
    built = {
        "eager": sf.build(sf.create_schedule(model), copy=False),
        "kernels": sf.build(kernels, copy=False),
        "kernels+compile": sf.build(sf.compile(kernels, LAYERS[family]), copy=False),
    }
    steps = {
        "eager": hf_step(built["eager"], ids, bf16),
        "kernels": kernel_step(built["kernels"], ids, bf16),
        "kernels+compile": kernel_step(built["kernels+compile"], ids, bf16),
    }
    _, compile_wall = timed(steps["kernels+compile"])  # first call compiles every layer
    for step in steps.values():  # warm-up (allocates gradients, primes caches)
        step()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(repeat):
        for name, step in steps.items():
            times[name].append(timed(step))
    med = {name: statistics.median(c for c, _ in ts) for name, ts in times.items()}
    med_wall = {name: statistics.median(w for _, w in ts) for name, ts in times.items()}

    ckpt = {
        "eager+ckpt": sf.build(sf.checkpoint(sf.create_schedule(model), LAYERS[family]), copy=False),
        "kernels+ckpt": sf.build(sf.checkpoint(kernels, LAYERS[family]), copy=False),
    }
    mem_steps = {
        "eager": steps["eager"],
        "eager+ckpt": hf_step(ckpt["eager+ckpt"], ids, bf16),
        "kernels": steps["kernels"],
        "kernels+ckpt": kernel_step(ckpt["kernels+ckpt"], ids, bf16),
    }
    peaks = {}
    for name, step in mem_steps.items():
        step()  # gradients exist before the measured step
        peaks[name] = profiled_peak_bytes(step)
    base = peaks["eager"]
    shares = {name: round(gemm_share(steps[name]), 3) for name in ("eager", "kernels")}
    return {
        "config": {"layers": layers, "batch": batch, "seq": seq, "vocab": vocab,
                   "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)},
        "step_cpu_s": {name: round(t, 3) for name, t in med.items()},
        "speedup": {name: round(med["eager"] / t, 3) for name, t in med.items() if name != "eager"},
        "step_wall_s": {name: round(t, 3) for name, t in med_wall.items()},
        "speedup_wall": {name: round(med_wall["eager"] / t, 3) for name, t in med_wall.items() if name != "eager"},
        "first_compiled_step_wall_s": round(compile_wall, 1),
        "gemm_share": shares,
        "peak_MB": {name: round(b / 2**20, 1) for name, b in peaks.items()},
        "reduction": {name: round(1 - b / base, 3) for name, b in peaks.items() if name != "eager"},
    }


def mlp_variants(tokens: int, dim: int, repeat: int) -> dict[str, float]:
    """GPT-2 MLP fwd+bwd, CPU ms: HF (Conv1D addmm + gelu_new formula) vs FusedMLP's choice
    (addmm + native tanh GeLU) vs a bias-free matmul + inductor-fused bias+GeLU vs the
    whole MLP compiled."""
    from transformers.activations import NewGELUActivation

    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g, requires_grad=True)
    w1 = (torch.randn(dim, 4 * dim, generator=g) * 0.02).requires_grad_()
    w2 = (torch.randn(4 * dim, dim, generator=g) * 0.02).requires_grad_()
    b1, b2 = torch.zeros(4 * dim, requires_grad=True), torch.zeros(dim, requires_grad=True)
    act = NewGELUActivation()
    bias_gelu = torch.compile(lambda h, b: F.gelu(h + b, approximate="tanh"))
    whole = torch.compile(fused_mlp)
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "hf_gelu_new": lambda: torch.addmm(b2, act(torch.addmm(b1, x, w1)), w2),
        "addmm_native_gelu": lambda: fused_mlp(x, w1, b1, w2, b2, transposed=True),
        "mm_compiled_bias_gelu": lambda: torch.addmm(b2, bias_gelu(x @ w1, b1), w2),
        "compiled_whole": lambda: whole(x, w1, b1, w2, b2, transposed=True),
    }
    return _interleaved(variants, repeat)


def rmsnorm_variants(tokens: int, dim: int, repeat: int) -> dict[str, float]:
    """RMSNorm fwd+bwd, CPU ms: HF LlamaRMSNorm vs ``F.rms_norm`` vs the compiled elementwise."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(dim)
    fused, x = RMSNorm.from_hf(hf), torch.randn(tokens, dim, requires_grad=True)
    compiled = torch.compile(rms_norm)
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "hf": lambda: hf(x),
        "f_rms_norm": lambda: fused(x),
        "compiled": lambda: compiled(x, hf.weight, hf.variance_epsilon),
    }
    return _interleaved(variants, repeat)


def _interleaved(variants: dict[str, Callable[[], torch.Tensor]], repeat: int) -> dict[str, float]:
    """Median CPU milliseconds of fwd+bwd per variant, interleaved."""

    def run(fn: Callable[[], torch.Tensor]) -> float:
        start = time.process_time()
        fn().sum().backward()
        return time.process_time() - start

    for fn in variants.values():
        for _ in range(3):
            run(fn)
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(repeat):
        for name, fn in variants.items():
            times[name].append(run(fn))
    return {name: round(statistics.median(ts) * 1e3, 2) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 layers, seq 64: a smoke run")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16: every variant's forward under CPU autocast (bfloat16 matmuls)")
    args = parser.parse_args()
    layers, batch, seq = (2, 2, 64) if args.quick else (4, 4, 256)
    result: dict[str, Any] = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": args.dtype if args.dtype == "float32" else "bfloat16 autocast, every variant",
        "memory_method": "torch.profiler memory timeline (profile_memory=True), peak above step start",
    }
    result["mlp_variants_ms"] = mlp_variants(batch * seq, 512, args.repeat * 3)
    result["rmsnorm_variants_ms"] = rmsnorm_variants(batch * seq, 512, args.repeat * 3)
    for family in ("gpt2", "llama"):
        result[family] = bench_model(family, layers, batch, seq, args.repeat, bf16=args.dtype == "bfloat16")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
