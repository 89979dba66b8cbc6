"""Training throughput and MFU on one GPU: a ~1B LLaMA, Hugging Face eager vs the recipe, bf16.

Both run the same model (the ``llama-1b`` preset: hidden 2048, 22 layers, 32 heads, GQA
4 kv-heads, vocab 32000) from the same weights, in bf16 with fp32 AdamW states, on the
same batches; the recipe adds its fused kernels and ``torch.compile`` of every decoder
layer. Prints one JSON line: tokens/s (median of the timed steps), MFU, peak memory and
the ratio.

FLOP convention (per token, forward + backward): ``6 N + 12 L H Q T`` — ``N`` the
parameters outside the embeddings, ``L`` layers, ``H`` heads, ``Q`` head dim, ``T`` the
sequence length (attention scores and values); MFU = tokens/s × that / peak bf16 FLOP/s
(``--peak-tflops``; default from the device name: H100/H200 989, A100 312).

    python benchmarks/gpu_throughput.py [--batch 8 --seq 2048 --steps 20]
    python benchmarks/gpu_throughput.py --smoke     # the script's logic on CPU, a tiny model
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import slapo_fn as sf
from slapo_fn.presets import build_model

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}


def flops_per_token(model: nn.Module, seq: int) -> float:
    cfg = model.config  # type: ignore[union-attr]
    embeddings = sum(p.numel() for n, p in model.named_parameters() if "embed" in n or "lm_head" in n)
    n = sum(p.numel() for p in model.parameters()) - embeddings
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq


def run(model: nn.Module, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    vocab = int(model.config.vocab_size)  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(0)
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        logits = model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_s = args.batch * args.seq / step_s
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"step_s": round(step_s, 4), "tokens_per_s": round(tokens_s, 1), "peak_memory_gib": round(peak / 2**30, 2),
            "last_loss": round(loss.item(), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU in fp32: checks the script only")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.batch, args.seq, args.steps, args.warmup, args.no_compile = "llama-tiny", 2, 32, 2, 1, True
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_throughput.py needs a CUDA device (or --smoke to check the script on CPU)")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)

    torch.manual_seed(0)
    base = build_model(args.model).to(dtype)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    per_token = flops_per_token(base, args.seq)
    results = {}
    eager = build_model(args.model).to(dtype)
    eager.load_state_dict(state)
    results["hf_eager"] = run(eager.to(device), args, device)
    del eager
    if device.type == "cuda":
        torch.cuda.empty_cache()
    recipe = sf.recipes.for_model(base)
    sch = recipe(sf.create_schedule(base), kernels=True, compile=not args.no_compile)
    built = sf.build(sch, device=device)
    results["recipe"] = run(built, args, device)
    for r in results.values():
        r["mfu"] = round(r["tokens_per_s"] * per_token / (peak * 1e12), 4) if peak else None
    print(json.dumps({
        "benchmark": "gpu_throughput", "device": name, "model": args.model, "dtype": str(dtype), "batch": args.batch,
        "seq": args.seq, "flops_per_token": per_token, "flop_convention": "6N + 12*L*H*Q*T (N: non-embedding)",
        "peak_tflops": peak, **results,
        "speedup": round(results["recipe"]["tokens_per_s"] / results["hf_eager"]["tokens_per_s"], 3),
    }))


if __name__ == "__main__":
    main()
