"""Ring against all-gather attention under context parallelism, at a long sequence on one device.

A one-layer LLaMA-shaped model (``--heads`` 32 over ``--kv-heads`` 8, ``--head-dim`` 128,
bf16) is built twice with ``sf.context_parallel`` over a ``cp`` mesh axis of this one
process: ``impl="allgather"`` (the Llama 3 scheme: K/V all-gathered, each of the rank's two
load-balanced chunks attending to the keys up to its end through SDPA with the mask of its
global positions) and ``impl="ring"`` (PyTorch's ring attention: its flash kernels, causal,
the chunks merged by log-sum-exp). Both attend the same random query, key and value of
``--seq`` 32768 tokens; the figures are the median milliseconds of forward + backward of
the attention alone (``--steps`` timed after a warm-up), their ratio, the peak CUDA memory
of each, and the largest difference of their outputs and input gradients.

With one device the ``cp`` axis has one rank: the collectives are no-ops and what is
compared is the attention kernels each scheme runs (masked SDPA on two chunks against the
ring's causal flash steps). PyTorch's ring attention is CUDA's: without CUDA the ring
variant reports itself ``skipped`` with the reason, and ``--smoke`` (tiny sizes, float32)
checks the script on CPU. Prints one JSON line.

Run: ``python benchmarks/context_parallel_ring.py [--seq 32768] [--smoke]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import slapo_fn as sf


def _model(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden = args.heads * args.head_dim
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=1,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        use_cache=False, max_position_embeddings=args.seq))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(attn: nn.Module, qkv: list[torch.Tensor], args: argparse.Namespace, device: torch.device) \
        -> dict[str, Any]:
    """Median ms of forward + backward of ``attn``'s attention on ``qkv``, its peak memory,
    its output and the gradients of ``qkv`` (of the last step)."""
    grad = torch.randn(args.batch, args.seq, args.heads, args.head_dim, device=device, dtype=qkv[0].dtype,
                       generator=torch.Generator(device).manual_seed(1))
    times: list[float] = []
    out = torch.empty(0)
    for step in range(args.steps + 1):
        for t in qkv:
            t.grad = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        out = attn._attend(*qkv, None, None)
        out.backward(grad)
        _sync(device)
        if step:  # the first is the warm-up
            times.append((time.perf_counter() - start) * 1e3)
    figures: dict[str, Any] = {"status": "ok", "ms": round(statistics.median(times), 3)}
    if device.type == "cuda":
        figures["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    figures["_out"] = [out.detach().float(), *(t.grad.detach().float() for t in qkv if t.grad is not None)]
    return figures


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("cp",))
        dtype = torch.float32 if args.smoke else torch.bfloat16
        gen = torch.Generator(device).manual_seed(0)
        shapes = [(args.batch, h, args.seq, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
        qkv = [torch.randn(*s, device=device, dtype=dtype, generator=gen).requires_grad_() for s in shapes]
        result: dict[str, Any] = {"benchmark": "context_parallel_ring", "device": torch.cuda.get_device_name(device)
                                  if cuda else "cpu", "seq": args.seq, "heads": args.heads, "kv_heads": args.kv_heads,
                                  "head_dim": args.head_dim, "dtype": str(dtype).removeprefix("torch."), "cp": 1}
        for impl in ("allgather", "ring"):
            try:
                sch = sf.context_parallel(sf.create_schedule(_model(args), mesh=mesh), impl=impl)
            except sf.LayoutError as e:  # the ring off CUDA: refused by the schedule, with the reason
                result[impl] = {"status": "skipped", "reason": e.problems[0].reason}
                continue
            built = sf.build(sch, device=device).to(dtype)
            result[impl] = _time(built.model.layers[0].self_attn, qkv, args, device)
        ring, gathered = result["ring"], result["allgather"]
        if ring["status"] == "ok":
            result["ring_speedup"] = round(gathered["ms"] / ring["ms"], 3)
            pairs = list(zip(ring["_out"], gathered["_out"], strict=True))
            result["max_diff"] = max(float((a - b).abs().max()) for a, b in pairs)
            # relative to each tensor's largest magnitude: bf16 rounds to 2^-8 of it
            result["max_rel_diff"] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in pairs)
        for impl in ("allgather", "ring"):
            result[impl].pop("_out", None)
        return result
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=None, help="tokens (default 32768; --smoke: 64)")
    parser.add_argument("--heads", type=int, default=None, help="query heads (default 32; --smoke: 4)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default 8; --smoke: 2)")
    parser.add_argument("--head-dim", type=int, default=None, help="(default 128; --smoke: 16)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up (default 5; "
                        "--smoke: 1)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes in float32: checks the script (CPU)")
    args = parser.parse_args()
    for name, full, tiny in (("seq", 32768, 64), ("heads", 32, 4), ("kv_heads", 8, 2), ("head_dim", 128, 16),
                             ("steps", 5, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.smoke else full)
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
