"""Training throughput and MFU on one GPU: a ~1B LLaMA, Hugging Face eager vs the recipe, bf16.

Every variant runs the same model (the ``llama-1b`` preset: hidden 2048, 22 layers, 32
heads, GQA with 4 kv-heads, vocab 32000) from the same weights (built on the device from
seed 0), in pure bf16 (weights, gradients and AdamW states; fused AdamW on a GPU), on the
same random batches:

* ``hf_eager`` — the Hugging Face model as built (its default SDPA attention), its own
  loss ``model(input_ids, labels=input_ids).loss`` (float32 logits);
* ``recipe`` — the family's recipe with its kernels (``recipes.for_model(...)(kernels=True)``:
  the attention kernel on SDPA, fused RMSNorm), the loss by the chunked LM head +
  cross-entropy (:func:`slapo_fn.kernels.causal_lm_loss`, no logits held);
* ``recipe_compile`` — the same plus ``torch.compile`` of every decoder layer (the recipe's
  ``compile=True``); its first step, compilation included, is ``first_step_s``.

The levers GPU users train with, each one change against ``recipe_compile`` (run at its
batch, so ``gain_vs`` is the lever's own gain):

* ``recipe_compile_float8`` — the layers' linears as torchao's float8 training linears
  (the recipe's ``float8=True``, torchtitan's conversion); where the GPU is older than
  sm_89 or torchao is missing, the recipe refuses (``HardwareError``) and the variant's
  entry says so instead of figures;
* ``recipe_compile_foreach`` — AdamW's multi-tensor ``foreach`` step instead of the fused
  kernel, the baseline that shows what ``fused=True`` (every other variant's) gains.

Async tensor parallelism needs ``tp > 1``, two GPUs or more: not a variant of this
one-process script.

``--batch auto`` finds the largest batch that fits: one full step (forward, backward,
optimizer) at batch 1, 2, 4, … up to ``--max-batch``, then bisection between the last that
fit and the first that ran out of memory, within ``--search-budget-s`` and
``--search-probes`` steps; the model is then rebuilt from the seed, so the timed steps start
from the same weights as every other variant. A timed run that still runs out of memory
halves the batch once.

FLOP convention (per token, forward + backward): ``6 N + 12 L H Q T`` — ``N`` the
parameters outside the embeddings, ``L`` layers, ``H`` heads, ``Q`` head dim, ``T`` the
sequence length (attention scores and values); MFU = tokens/s × that / peak dense bf16
FLOP/s of the device's hardware profile (``slapo_fn/hardware``: H100 SXM and H200 SXM both
989 TFLOP/s, A100 312), or ``--peak-tflops``.

``--profile-out FILE``: where the variant is short of the goal (MFU < ``--goal-mfu`` or,
given ``--eager-tokens-per-s``, a speedup below ``--goal-speedup``), one more step runs under
``torch.profiler`` and its kernel table (by self device time) goes to FILE; the JSON names
the top kernels.

Prints one JSON line: per variant tokens/s (median of the timed steps), step time, MFU, peak
memory (``torch.cuda.max_memory_allocated`` over the run), first and last loss.

    python benchmarks/gpu_throughput.py [--variants hf_eager,recipe,recipe_compile] [--batch auto]
    python benchmarks/gpu_throughput.py --variants recipe_compile,recipe_compile_float8,recipe_compile_foreach
    python benchmarks/gpu_throughput.py --variants recipe --batch 8 --profile-out prof.txt
    python benchmarks/gpu_throughput.py --smoke     # the script's logic on CPU: a tiny model in fp32
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import slapo_fn as sf
from slapo_fn.hardware import load_profile
from slapo_fn.kernels import causal_lm_loss
from slapo_fn.presets import build_model

VARIANTS = ("hf_eager", "recipe", "recipe_compile", "recipe_compile_float8", "recipe_compile_foreach")
#: Each lever's variant and the variant it changes one thing of.
LEVERS = {"recipe_compile_float8": "recipe_compile", "recipe_compile_foreach": "recipe_compile"}
#: Hardware profiles (slapo_fn/hardware) by a word of the device's name.
PROFILES = {"H100": "h100", "H200": "h200", "A100": "a100"}
Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def flops_per_token(model: nn.Module, seq: int) -> float:
    """``6 N + 12 L H Q T``: ``N`` the parameters outside the embeddings and the LM head."""
    cfg = model.config  # type: ignore[union-attr]
    embeddings = sum(p.numel() for n, p in model.named_parameters() if "embed" in n or "lm_head" in n)
    n = sum(p.numel() for p in model.parameters()) - embeddings
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq


def peak_flops(device: torch.device, dtype: torch.dtype, override: float | None) -> tuple[float, str]:
    """Peak dense FLOP/s of ``device`` in ``dtype`` and where the figure comes from."""
    if override:
        return override * 1e12, "--peak-tflops"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    profile = "cpu" if device.type == "cpu" else next((p for k, p in PROFILES.items() if k in name), None)
    if profile is None:
        return 0.0, f"no hardware profile for {name!r} (give --peak-tflops)"
    hw = load_profile(profile)
    kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    return hw.peak(kind), f"slapo_fn/hardware/{profile}.toml: {hw.name}, dense {kind}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def make(variant: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
         ) -> tuple[nn.Module, torch.optim.Optimizer, Loss]:
    """The model of ``variant`` from seed 0, its optimizer and its loss."""
    torch.manual_seed(0)
    with torch.device(device):
        base = build_model(args.model).to(dtype)
    if variant == "hf_eager":
        model: nn.Module = base

        def loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            return m(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]
    else:
        recipe = sf.recipes.for_model(base)
        sch = recipe(sf.create_schedule(base), kernels=True, compile=variant.startswith("recipe_compile"),
                     float8=variant.endswith("_float8"))
        model = sf.build(sch, device=device)
        del base, sch

        def loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            return causal_lm_loss(m, ids)
    _free(device)
    foreach = variant.endswith("_foreach")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" and not foreach,
                                  foreach=foreach or None)
    return model, optimizer, loss


def _batches(vocab: int, batch: int, seq: int, device: torch.device) -> Callable[[int], torch.Tensor]:
    def ids(step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(step)
        return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    return ids


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Loss, ids: torch.Tensor) -> float:
    loss = loss_fn(model, ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _fits(run: tuple[nn.Module, torch.optim.Optimizer, Loss], ids: torch.Tensor, device: torch.device) -> bool:
    """Whether one full step on ``ids`` fits in the device's memory."""
    model, optimizer, loss_fn = run
    try:
        _step(model, optimizer, loss_fn, ids)
        _sync(device)
        return True
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        if not _out_of_memory(e):
            raise
        optimizer.zero_grad(set_to_none=True)
        return False


def search_batch(variant: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
                 ) -> tuple[int, list[dict[str, Any]]]:
    """The largest batch (at most ``--max-batch``) for which one full step fits, and the probes."""
    run = make(variant, args, device, dtype)
    try:
        good, probes = _search(run, args, device)
    finally:
        del run
        _free(device)
    if not good:
        raise RuntimeError(f"{variant}: not even batch 1 fits (probes: {probes})")
    return good, probes


def _search(run: tuple[nn.Module, torch.optim.Optimizer, Loss], args: argparse.Namespace, device: torch.device
            ) -> tuple[int, list[dict[str, Any]]]:
    """Doubling from 1, then bisection, within ``--search-probes`` and ``--search-budget-s``."""
    vocab = int(run[0].config.vocab_size)  # type: ignore[union-attr]
    probes: list[dict[str, Any]] = []
    start = time.perf_counter()

    def fits(batch: int) -> bool:
        t = time.perf_counter()
        ok = _fits(run, _batches(vocab, batch, args.seq, device)(0), device)
        _free(device)
        probes.append({"batch": batch, "fits": ok, "s": round(time.perf_counter() - t, 2)})
        return ok

    def in_budget() -> bool:
        return len(probes) < args.search_probes and time.perf_counter() - start < args.search_budget_s

    good, bad, batch = 0, None, 1
    while batch <= args.max_batch and in_budget():
        if not fits(batch):
            bad = batch
            break
        good, batch = batch, batch * 2
    while bad is not None and bad - good > 1 and good and in_budget():
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good, probes


def measure(variant: str, batch: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
            ) -> dict[str, Any]:
    """Warm-up and timed steps of ``variant`` at ``batch``: step time, tokens/s, peak memory, losses."""
    model, optimizer, loss_fn = make(variant, args, device, dtype)
    ids = _batches(int(model.config.vocab_size), batch, args.seq, device)  # type: ignore[union-attr]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    first_step_s = 0.0
    for step in range(args.warmup + args.steps):
        batch_ids = ids(step)
        _sync(device)
        start = time.perf_counter()
        losses.append(_step(model, optimizer, loss_fn, batch_ids))  # float(): waits for the step
        _sync(device)
        took = time.perf_counter() - start
        if step == 0:
            first_step_s = took
        if step >= args.warmup:
            times.append(took)
    step_s = statistics.median(times)
    result: dict[str, Any] = {
        "batch": batch, "step_s": round(step_s, 4), "first_step_s": round(first_step_s, 2),
        "tokens_per_s": round(batch * args.seq / step_s, 1), "first_loss": round(losses[0], 4),
        "last_loss": round(losses[-1], 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "reserved_memory_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        if device.type == "cuda" else None,
    }
    result["_run"] = (model, optimizer, loss_fn, ids(args.warmup + args.steps))
    return result


def profile_step(run: tuple[Any, ...], device: torch.device, out: Path, rows: int = 30) -> list[dict[str, Any]]:
    """One more step under ``torch.profiler``: its kernel table (by self device time; CPU time
    on CPU) written to ``out``, and the top kernels with their share of the step."""
    from torch.profiler import ProfilerActivity, profile

    model, optimizer, loss_fn, ids = run
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _step(model, optimizer, loss_fn, ids)
        _sync(device)
    events = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out.write_text(events.table(sort_by=key, row_limit=rows) + "\n")
    total = sum(float(getattr(e, key)) for e in events) or 1.0
    top = sorted(events, key=lambda e: float(getattr(e, key)), reverse=True)[:10]
    return [{"name": e.key[:120], "self_ms": round(float(getattr(e, key)) / 1e3, 3),
             "share": round(float(getattr(e, key)) / total, 4), "calls": int(e.count)} for e in top]


def run_variant(variant: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                peak: float, per_token: float) -> dict[str, Any]:
    """``variant`` at the batch asked for (or found), its figures, and a profile where short of the goal."""
    probes: list[dict[str, Any]] = []
    batch = int(args.batch) if args.batch != "auto" else 0
    if not batch:
        batch, probes = search_batch(variant, args, device, dtype)
    try:
        result: dict[str, Any] | None = measure(variant, batch, args, device, dtype)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        if not _out_of_memory(e) or batch == 1:
            raise
        result = None  # retried below, once this exception (and the memory its frames hold) is gone
    if result is None:
        _free(device)
        result = measure(variant, batch // 2, args, device, dtype)
        result["note"] = f"batch {batch} ran out of memory in the timed steps; halved"
    run = result.pop("_run")
    if probes:
        result["batch_search"] = probes
    result["mfu"] = round(result["tokens_per_s"] * per_token / peak, 4) if peak else None
    speedup = result["tokens_per_s"] / args.eager_tokens_per_s if args.eager_tokens_per_s else None
    if speedup is not None:
        result["speedup_vs_hf_eager"] = round(speedup, 3)
    short = (result["mfu"] is not None and result["mfu"] < args.goal_mfu) or (
        speedup is not None and speedup < args.goal_speedup)
    if args.profile_out and variant != "hf_eager" and short:
        path = Path(args.profile_out)
        result["profile"] = {"table": path.name, "top": profile_step(run, device, path)}
    del run
    _free(device)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--batch", default="auto", help="sequences per step, or 'auto': the largest that fits")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--search-budget-s", type=float, default=40.0)
    parser.add_argument("--search-probes", type=int, default=9)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--eager-tokens-per-s", type=float, default=None,
                        help="Hugging Face eager's tokens/s, for the speedup and the profile's trigger")
    parser.add_argument("--goal-mfu", type=float, default=0.45)
    parser.add_argument("--goal-speedup", type=float, default=1.5)
    parser.add_argument("--profile-out", default=None, help="kernel table of one step where short of the goal")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU in fp32: checks the script only")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.seq, args.steps, args.warmup, args.max_batch = "llama-tiny", 32, 2, 1, 4
        args.search_probes = 3
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: use {', '.join(VARIANTS)}")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_throughput.py needs a CUDA device (or --smoke to check the script on CPU)")
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    peak, source = peak_flops(device, dtype, args.peak_tflops)
    per_token = flops_per_token(build_model(args.model, meta=True), args.seq)
    results = {}
    for variant in variants:
        try:
            results[variant] = run_variant(variant, args, device, dtype, peak, per_token)
        except sf.HardwareError as e:  # a lever this machine cannot run (float8 below sm_89): said, not measured
            results[variant] = {"status": "refused", "error": str(e).splitlines()[0]}
            continue
        base_variant = LEVERS.get(variant)
        if base_variant in results and "tokens_per_s" in results[base_variant]:
            results[variant]["gain_vs"] = {
                base_variant: round(results[variant]["tokens_per_s"] / results[base_variant]["tokens_per_s"], 3)}
        if variant == "hf_eager" and not args.eager_tokens_per_s:  # the later variants' speedup and profile trigger
            args.eager_tokens_per_s = results[variant]["tokens_per_s"]
    summary: dict[str, Any] = {
        "benchmark": "gpu_throughput", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "model": args.model, "dtype": str(dtype), "seq": args.seq,
        "flops_per_token": per_token, "flop_convention": "6N + 12*L*H*Q*T (N: without embeddings and LM head)",
        "peak_tflops": round(peak / 1e12, 3), "peak_source": source, **results,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
