"""The functional loop's overhead: one training step of a LLaMA at tp=2 (2 gloo ranks),
the functional form and the module form side by side in the same run, from the same
initial weights.

(a) module: ``loss.backward()``, ``sf.clip_grad_norm_``, ``torch.optim.AdamW(foreach=True)``
    ``step`` and ``zero_grad``;
(b) functional: ``sf.func.value_and_grad``, ``sf.func.clip_by_global_norm``,
    ``sf.optim.adamw`` ``update(..., donate=True)``.

The optimizer alone is timed too, on the same gradients: ``torch.optim.AdamW(foreach=True)``
``step()`` against ``update(grads, state, params, donate=True)`` and against
``donate=False`` (new tensors every step, what a JAX-style update without donation
costs). Variants are timed interleaved (one of each per repeat, ranks synchronised by a
barrier), so load from other processes hits all alike; the median per variant is the
slowest rank's.

Prints one JSON line::

    .venv/bin/python benchmarks/functional_step.py [--repeats 20] [--layers 4] [--hidden 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _run(rank: int, world: int, layers: int, hidden: int, batch: int, seq: int, repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from dist import mesh
    from models import megatron_llama
    from transformers import LlamaConfig, LlamaForCausalLM

    import slapo_fn as sf

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=8, num_key_value_heads=4, use_cache=False)
        return LlamaForCausalLM(cfg)

    def build() -> torch.nn.Module:
        return sf.build(megatron_llama(sf.create_schedule(make(), mesh=mesh((world,), ("tp",)))))

    ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(1))
    lr, wd, max_norm = 1e-4, 0.1, 1.0

    def ce(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())

    module = build()
    opt = torch.optim.AdamW(list(module.parameters()), lr=lr, weight_decay=wd, foreach=True)

    functional_model = build()
    apply_fn, params, _ = sf.func.functional(functional_model)
    init, update = sf.optim.adamw(lr, weight_decay=wd, foreach=True)
    state = init(params)
    value_and_grad = sf.func.value_and_grad(lambda ps: ce(apply_fn(ps, ids).logits))

    def module_step() -> float:
        loss = ce(module(ids).logits)
        loss.backward()
        sf.clip_grad_norm_(module, max_norm)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    def functional_step() -> float:
        nonlocal params, state
        loss, grads = value_and_grad(params)
        grads, _ = sf.func.clip_by_global_norm(grads, max_norm)
        params, state = update(grads, state, params)
        return float(loss)

    # the optimizer alone, on fixed gradients: torch's step vs the pure update
    opt_model = build()
    ce(opt_model(ids).logits).backward()
    torch_opt = torch.optim.AdamW(list(opt_model.parameters()), lr=lr, weight_decay=wd, foreach=True)
    _, opt_params, _ = sf.func.functional(build())
    fixed_grads = {k: p.grad for k, p in opt_model.named_parameters()}
    opt_state = init(opt_params)

    def torch_update() -> float:
        torch_opt.step()
        return 0.0

    def donated_update() -> float:
        update(fixed_grads, opt_state, opt_params, donate=True)
        return 0.0

    def copied_update() -> float:
        update(fixed_grads, opt_state, opt_params, donate=False)
        return 0.0

    variants = {"module_step": module_step, "functional_step": functional_step, "torch_adamw_step": torch_update,
                "adamw_update_donate": donated_update, "adamw_update_copy": copied_update}
    losses: dict[str, list[float]] = {k: [] for k in ("module_step", "functional_step")}
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            value = fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
            if name in losses:
                losses[name].append(value)
    return {"median_s": {k: statistics.median(v) for k, v in times.items()}, "losses": losses,
            "params": sum(p.numel() for p in make().parameters())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=540.0)
    args = parser.parse_args(argv)

    from dist import WorkerPool

    world = 2
    with WorkerPool(world) as pool:
        results = pool.run(_run, args.layers, args.hidden, args.batch, args.seq, args.repeats, timeout=args.timeout)
    median = {k: max(r["median_s"][k] for r in results) for k in results[0]["median_s"]}
    r0 = results[0]
    loss_gap = max(abs(a - b) for a, b in zip(r0["losses"]["module_step"], r0["losses"]["functional_step"],
                                               strict=True))
    report: dict[str, Any] = {
        "benchmark": "functional_step",
        "model": f"llama layers={args.layers} hidden={args.hidden} heads=8 kv_heads=4 params={r0['params']}",
        "world": world,
        "backend": "gloo",
        "layout": "tp=2 (Megatron q/k/v/gate/up column, o/down row)",
        "batch": args.batch,
        "seq": args.seq,
        "repeats": args.repeats,
        "median_s": {k: round(v, 5) for k, v in median.items()},
        "functional_vs_module_step": round(median["functional_step"] / median["module_step"], 3),
        "target_functional_vs_module_step": 1.05,
        "donated_update_vs_torch_adamw_step": round(median["adamw_update_donate"] / median["torch_adamw_step"], 3),
        "target_donated_update_vs_torch_adamw_step": 1.0,
        "copied_update_vs_donated_update": round(median["adamw_update_copy"] / median["adamw_update_donate"], 3),
        "max_loss_gap_functional_vs_module": loss_gap,
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
