"""Expert parallelism: one training step of a small Mixtral on 2 gloo ranks, side by side
in the same run, from the same initial weights:

(a) ``expert_parallel``: ``sf.expert_parallel(sch, "model.layers.*.mlp", mesh_axis="ep")``
    — each rank holds E/2 experts and computes only the (token, expert) pairs routed to
    them, reached by all-to-all;
(b) ``all_gathered``: the experts' fused parameters sharded parameter by parameter with
    ``sf.shard(..., axis=0)`` (the only option before expert parallelism): each rank stores
    E/2 experts but all-gathers them for every use and computes every pair;
(c) ``expert_parallel_loop``: (a) with the model's per-expert loop (Hugging Face's
    ``experts_implementation="eager"``) instead of its grouped matmul (``"grouped_mm"``,
    the default, which calls ``torch._grouped_mm`` on CPU where it applies), to measure the
    grouped computation.

A step is forward (loss with the router's auxiliary loss), backward, an AdamW update and
``zero_grad``. Variants are timed interleaved (one step of each per repeat, ranks
synchronised by barriers), so load from other processes hits all alike; the per-variant
median of the slower rank is reported. Also reported per rank: the expert FLOPs of a step
(from the routing of that step: 6·H·I per pair forward, twice that backward), the expert
parameter bytes it stores, and the peak expert bytes of a step (stored shards plus the
full expert tensors a step all-gathers and keeps for backward, measured with saved-tensor
hooks); the collectives and all-to-all bytes per step (a dispatch mode);
and :func:`slapo_fn.dtensor.experts.expert_costs`'s prediction.

Prints one JSON line::

    .venv/bin/python benchmarks/moe.py [--repeats 10] [--layers 2] [--hidden 512] [--experts 8]
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


def _config(layers: int, hidden: int, experts: int, implementation: str) -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=experts,
        num_experts_per_tok=2,
        use_cache=False,
        experts_implementation=implementation,
    )


def _run(rank: int, world: int, layers: int, hidden: int, experts: int, batch: int, seq: int,
         repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from dist import mesh
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import MixtralForCausalLM

    import slapo_fn as sf
    from slapo_fn.dtensor.experts import expert_costs

    m = mesh((world,), ("ep",))
    torch.manual_seed(0)
    model = MixtralForCausalLM(_config(layers, hidden, experts, "grouped_mm"))
    looped = MixtralForCausalLM(_config(layers, hidden, experts, "eager"))
    looped.load_state_dict(model.state_dict())
    ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(1))
    moe = "model.layers.*.mlp"

    ep = sf.expert_parallel(sf.create_schedule(model, mesh=m), moe, mesh_axis="ep")
    gathered = sf.shard(sf.create_schedule(model, mesh=m),
                        [f"{moe}.experts.gate_up_proj", f"{moe}.experts.down_proj"], axis=0, mesh_axis="ep")
    models: dict[str, nn.Module] = {
        "expert_parallel": sf.build(ep),
        "all_gathered": sf.build(gathered),
        "expert_parallel_loop": sf.build(sf.expert_parallel(sf.create_schedule(looped, mesh=m), moe)),
    }
    optims = {k: torch.optim.AdamW(v.parameters(), lr=1e-4) for k, v in models.items()}
    for v in models.values():
        v.train()

    def loss_of(name: str) -> torch.Tensor:
        return models[name](ids, labels=ids, output_router_logits=True).loss  # type: ignore[no-any-return]

    def step(name: str) -> float:
        loss = loss_of(name)
        loss.backward()
        optims[name].step()
        optims[name].zero_grad(set_to_none=True)
        return float(loss.detach())

    class Sent(TorchDispatchMode):
        """Functional collectives by name, and the bytes handed to all-to-alls (as
        ``CommDebugMode`` counts them, without its module tracker)."""

        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0
            self.counts: dict[str, int] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            op = func.__name__.split(".")[0]
            if func.namespace == "_c10d_functional" and op != "wait_tensor" and not op.startswith("_"):
                self.counts[op] = self.counts.get(op, 0) + 1
                if op == "all_to_all_single":  # (input, output splits, input splits, group): rows that leave
                    x, in_splits = args[0], args[2]
                    row = x[0].numel() * x.element_size() if x.shape[0] else 0
                    self.bytes += (x.shape[0] - in_splits[rank]) * row
            return func(*args, **(kwargs or {}))

    full_bytes = {p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n}

    def measured(name: str) -> dict[str, Any]:
        """Collectives, all-to-all bytes sent, and full expert tensors saved for backward."""
        saved: dict[int, int] = {}
        own = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
               for p in models[name].parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, DTensor):
                return t
            storage = t.untyped_storage()
            if storage.nbytes() in full_bytes and storage.data_ptr() not in own:  # a gathered expert tensor
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        sent = Sent()
        with sent, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_of(name).backward()
        models[name].zero_grad(set_to_none=True)
        return {"collectives": sent.counts, "all_to_all_bytes_sent": sent.bytes,
                "gathered_expert_bytes": sum(saved.values())}

    # the routing of this step (the unsharded model): pairs per expert, per layer
    with torch.no_grad():
        router_logits = model(ids, output_router_logits=True).router_logits
    per_expert = sum(torch.bincount(torch.topk(g.softmax(-1), 2, dim=-1).indices.reshape(-1), minlength=experts)
                     for g in router_logits)
    local = experts // world
    pairs_here = int(per_expert[rank * local : (rank + 1) * local].sum())
    pairs_all = int(per_expert.sum())
    flops_per_pair = 3 * 6 * hidden * (hidden * 2)  # forward 6·H·I, backward twice that
    stored = {k: sum(p.to_local().numel() * p.element_size() for n, p in v.named_parameters()
                     if ".experts." in n and isinstance(p, DTensor)) for k, v in models.items()}
    info = {k: measured(k) for k in models}
    first = {k: step(k) for k in models}  # also a warm-up step
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(repeats):
        for name in models:
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    costs = expert_costs(ep, tokens=batch * seq, top_k=2)
    return {
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "first_loss": first,
        "expert_flops": {"expert_parallel": pairs_here * flops_per_pair, "expert_parallel_loop": pairs_here *
                         flops_per_pair, "all_gathered": pairs_all * flops_per_pair},
        "stored_expert_bytes": stored,
        "peak_expert_bytes": {k: stored[k] + info[k]["gathered_expert_bytes"] for k in models},
        "measured": info,
        "predicted": {"param_bytes": costs.param_bytes, "all_to_all_bytes": costs.all_to_all_bytes,
                      "all_to_all_count": costs.all_to_all_count},
        "grouped_mm_on_cpu": bool(hasattr(torch, "_grouped_mm")),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=540.0)
    args = parser.parse_args(argv)

    from dist import WorkerPool

    world = 2
    with WorkerPool(world) as pool:
        results = pool.run(_run, args.layers, args.hidden, args.experts, args.batch, args.seq, args.repeats,
                           timeout=args.timeout)
    # a step ends when the slowest rank is done
    median = {k: max(r["median_s"][k] for r in results) for k in results[0]["median_s"]}
    base = median["all_gathered"]
    r0 = results[0]

    def per_rank(key: str) -> dict[str, list[int]]:
        return {k: [r[key][k] for r in results] for k in r0[key]}

    peak = per_rank("peak_expert_bytes")
    report: dict[str, Any] = {
        "benchmark": "moe",
        "model": f"mixtral layers={args.layers} hidden={args.hidden} intermediate={args.hidden * 2} "
                 f"experts={args.experts} top_k=2",
        "world": world,
        "backend": "gloo",
        "batch": args.batch,
        "seq": args.seq,
        "repeats": args.repeats,
        "step_median_s": {k: round(v, 5) for k, v in median.items()},
        "ratio_vs_all_gathered": {k: round(v / base, 3) for k, v in median.items()},
        "grouped_vs_loop": round(median["expert_parallel"] / median["expert_parallel_loop"], 3),
        "target_step_ratio": 0.8,
        "expert_flops_per_rank": per_rank("expert_flops"),
        "stored_expert_bytes_per_rank": per_rank("stored_expert_bytes"),
        "peak_expert_bytes_per_rank": peak,
        "peak_expert_memory_ratio": round(max(peak["expert_parallel"]) / max(peak["all_gathered"]), 3),
        "target_memory_ratio": 0.55,
        "collectives_per_step": {k: v["collectives"] for k, v in r0["measured"].items()},
        "all_to_all_bytes_off_rank_per_rank": [r["measured"]["expert_parallel"]["all_to_all_bytes_sent"]
                                               for r in results],
        "explain_predicted_per_rank": r0["predicted"],
        "first_step_loss": r0["first_loss"],
        "grouped_mm_available": r0["grouped_mm_on_cpu"],
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
