"""Grouped-query attention with a padding mask: K/V repeated in memory against SDPA's own GQA.

One LLaMA-like attention call (``--heads`` query heads sharing ``--kv-heads`` K/V heads,
a causal + left-padding boolean mask, training: forward and backward) two ways:

* ``repeat`` — K and V expanded and copied to the query's heads, then SDPA (what
  ``slapo_fn.kernels.attention`` did with a mask before issue 41);
* ``gqa`` — ``slapo_fn.kernels.attention``, which hands SDPA the K/V heads as they are
  (``enable_gqa=True``) where a fused kernel of the device takes them with a mask.

Per way: the bytes the call's ATen ops allocate (new storages only, views excluded;
forward + backward), the peak allocated on CUDA (``torch.cuda.max_memory_allocated``)
when it runs there, and the median time (ms). Prints one JSON line.
Run: ``python benchmarks/attention_gqa.py [--seq N] [--device cuda] [--dtype bfloat16]``.
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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from slapo_fn.kernels.attention import _repeat_kv, attention


class _Allocated(TorchDispatchMode):
    """Sums the bytes of every new storage an ATen op returns (a view returns none)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        fresh = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        self.bytes += sum(n for ptr, n in fresh.items() if ptr not in given)
        return out


def _inputs(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    dtype, dev = getattr(torch, args.dtype), torch.device(args.device)
    b, h, kv, s, d = args.batch, args.heads, args.kv_heads, args.seq, args.head_dim
    q = torch.randn(b, h, s, d, generator=g).to(dev, dtype).requires_grad_()
    k = torch.randn(b, kv, s, d, generator=g).to(dev, dtype).requires_grad_()
    v = torch.randn(b, kv, s, d, generator=g).to(dev, dtype).requires_grad_()
    pad = torch.ones(b, s, dtype=torch.long, device=dev)
    pad[0, : s // 4] = 0  # the first sequence left-padded by a quarter
    return q, k, v, pad


def _repeat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    s, groups = q.shape[2], q.shape[1] // k.shape[1]
    mask = pad.bool()[:, None, None, :] & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, _repeat_kv(k, groups), _repeat_kv(v, groups), attn_mask=mask)


def _gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    return attention(q, k, v, pad, is_causal=True).transpose(1, 2)


def _measure(fn: Callable[..., torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
    q, k, v, pad = _inputs(args)
    cuda = q.is_cuda
    with _Allocated() as seen:
        fn(q, k, v, pad).float().square().mean().backward()
    peak = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(q, k, v, pad).float().square().mean().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        fn(q, k, v, pad).float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return {"allocated_mib": round(seen.bytes / 2**20, 2),
            "cuda_peak_mib": None if peak is None else round(peak / 2**20, 2),
            "median_ms": round(statistics.median(times), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    q, k, v, pad = _inputs(args)
    with torch.no_grad():
        gap = (_repeat(q, k, v, pad) - _gqa(q, k, v, pad)).abs()[pad.bool()[:, None, :, None].expand_as(q)].max()
    result = {"benchmark": "attention_gqa", "torch": torch.__version__, "device": args.device, "dtype": args.dtype,
              "shape": {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "seq": args.seq,
                        "head_dim": args.head_dim},
              "max_abs_diff": float(gap), "repeat": _measure(_repeat, args), "gqa": _measure(_gqa, args)}
    result["allocated_saved_mib"] = round(result["repeat"]["allocated_mib"] - result["gqa"]["allocated_mib"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
