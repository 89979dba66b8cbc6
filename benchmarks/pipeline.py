"""Pipeline schedules on 4 gloo ranks (pp4): step time and bubble fraction.

A tiny LLaMA (hidden 128, 8 decoder layers, so that interleaved schedules get two stages
per rank) is cut by ``sf.cut_pipeline_stage`` into 4 stages (``gpipe``, ``1f1b``) or 8
(``interleaved``, ``zero-bubble`` = InterleavedZeroBubble, ``zbv`` = ZBVZeroBubble) and
trained with ``sf.build_pipeline`` on 4 CPU processes (gloo, one thread each; the worker
pool of ``tests/dist.py``). Per schedule: the median step time over ``--steps`` steps
after warm-up, and the bubble fraction ``1 - busy / step`` averaged over ranks, where a
rank's *busy* time is the wall time spent inside its stages' compute actions
(``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``) — time
waiting for peers or in communication is the bubble. Prints one JSON line.

On a machine with fewer free cores than ranks, ranks also wait for a CPU and the
measured bubble includes that wait. So the benchmark also reports ``ideal_bubble``: the
schedule's own action order (``pipeline_order`` of the torch schedule) replayed with the
*CPU* time each compute action took (``time.thread_time``: time descheduled is not
counted), respecting the dependencies F(s-1)→F(s), F(s)→B(s), B(s+1)→B(s), I→W and each
rank's order, with free communication — the bubble the schedule has by construction
for these measured stage costs.

    .venv/bin/python benchmarks/pipeline.py [--steps 5] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SCHEDULES = {"gpipe": 4, "1f1b": 4, "interleaved": 8, "zero-bubble": 8, "zbv": 8}
LAYERS, HIDDEN, BATCH, SEQ, VOCAB = 8, 128, 16, 64, 256


def _model() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return LlamaForCausalLM(cfg)


def _run(rank: int, world: int, schedule: str, stages: int, microbatches: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from dist import mesh

    import slapo_fn as sf

    def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    per = LAYERS // stages
    cuts = ",".join(str(per * (i + 1) - 1) for i in range(stages - 1))
    sch = sf.cut_pipeline_stage(sf.create_schedule(_model(), mesh=mesh((world,), ("pp",))), f"model.layers.[{cuts}]")
    pipe = sf.build_pipeline(sch, microbatches=microbatches, schedule=schedule, loss_fn=ce)  # type: ignore[arg-type]
    busy = [0.0]
    executed: list[tuple[str, int, int]] = []
    cpu: dict[tuple[str, int], list[float]] = {}

    def timed(fn: Any, kind: str, index: int) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start
                full = kwargs.get("full_backward", True)
                key = kind if kind != "B" or full else "I"
                cpu.setdefault((key, index), []).append(time.thread_time() - start_cpu)
                executed.append((key, index, int(args[0])))

        return wrapper

    for stage in pipe.pipeline_stages:  # the pipeline's private stage objects (build's copies)
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
            setattr(stage, name, timed(getattr(stage, name), kind, stage.stage_index))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    times, bubbles, losses = [], [], []
    for step in range(steps + 2):
        dist.barrier(group=pipe.group)
        busy[0] = 0.0
        executed.clear()
        start = time.perf_counter()
        loss = pipe.step(ids, target=target)
        elapsed = time.perf_counter() - start
        for p in pipe.parameters():
            p.grad = None
        if step >= 2:  # warm-up: shape inference, first-touch allocations
            times.append(elapsed)
            bubbles.append(1.0 - busy[0] / elapsed)
            losses.append(loss.item())
    costs = {f"{k}{s}": statistics.median(v) for (k, s), v in cpu.items()}
    return {"times": times, "bubbles": bubbles, "loss": losses[0], "costs": costs, "order": list(executed)}


def ideal_bubble(order: dict[int, list[tuple[str, int, int]]], costs: dict[str, float], stages: int) -> float:
    """Replay each rank's compute actions in the order it executed them, with their CPU
    costs and free communication; ``1 - busy / (ranks × makespan)``."""
    compute = {r: [a for a in acts if a[0] in ("F", "B", "I", "W")] for r, acts in order.items()}
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(compute, 0.0)
    position = dict.fromkeys(compute, 0)

    def ready(kind: str, s: int, mb: int) -> float | None:
        need = []
        if kind == "F" and s > 0:
            need.append(("F", s - 1, mb))
        if kind in ("B", "I"):
            need.append(("F", s, mb))
            if s < stages - 1:
                need.append(("B" if ("B", s + 1, mb) in done else "I", s + 1, mb))
        if kind == "W":
            need.append(("I", s, mb))
        if any(n not in done for n in need):
            return None
        return max((done[n] for n in need), default=0.0)

    progress = True
    while progress:
        progress = False
        for r, acts in compute.items():
            while position[r] < len(acts):
                kind, s, mb = acts[position[r]]
                at = ready(kind, s, mb)
                if at is None:
                    break
                finish = max(clock[r], at) + costs.get(f"{kind}{s}", costs.get(f"B{s}", 0.0))
                done[(kind, s, mb)] = clock[r] = finish
                position[r] += 1
                progress = True
    if any(position[r] < len(acts) for r, acts in compute.items()):
        raise RuntimeError(f"the schedule replay stalled (unexpected action order): {position} {compute}")
    makespan = max(clock.values())
    busy = sum(costs.get(f"{k}{s}", 0.0) for acts in compute.values() for k, s, _ in acts)
    return 1.0 - busy / (len(compute) * makespan)


def _merge(dicts: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        out.update(d)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    from dist import WorkerPool

    results: dict[str, Any] = {}
    with WorkerPool(4) as pool:
        for schedule, stages in SCHEDULES.items():
            per_rank = pool.run(_run, schedule, stages, args.microbatches, args.steps, timeout=300)
            step_times = [statistics.median(r["times"]) for r in per_rank]
            results[schedule] = {
                "stages": stages,
                "step_s": round(max(step_times), 4),
                "bubble": round(statistics.mean(statistics.median(r["bubbles"]) for r in per_rank), 3),
                "bubble_per_rank": [round(statistics.median(r["bubbles"]), 3) for r in per_rank],
                "ideal_bubble": round(ideal_bubble({i: r["order"] for i, r in enumerate(per_rank)},
                                                   _merge(r["costs"] for r in per_rank), stages), 3),
                "loss": round(per_rank[0]["loss"], 6),
            }
    print(json.dumps({"benchmark": "pipeline", "ranks": 4, "layers": LAYERS, "hidden": HIDDEN, "batch": BATCH,
                      "seq": SEQ, "microbatches": args.microbatches, "steps": args.steps, "cpu_cores": os.cpu_count(),
                      "schedules": results}))


if __name__ == "__main__":
    main()
