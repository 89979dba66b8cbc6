"""Does the step-time estimate rank configurations as real runs do? (issue 16, item 3)

``tune`` runs every configuration of a grid as a real ``slapo-fn train`` subprocess on
this machine; before any runs, it estimated each one's tokens/s with the same estimate
``slapo-fn explain --hardware cpu`` prints (:func:`slapo_fn.tune.cost.estimate`: FLOPs
6N + 12·L·H·Q·T per token plus recomputation, the CPU profile's peak × efficiency and
per-module-call overhead, ring-formula communication, pipeline bubble). Reported: the
Spearman rank correlation between estimated and measured tokens/s over the trials that
ran (target ≥ 0.8 over ≥ 8 configurations) and each pair. Prints one JSON line.

The machine is shared and its load drifts over minutes, so the trials run in a random
order (not the tuner's fastest-predicted-first order, which would turn a drift into a
spurious correlation), ``--repeats`` times, and each configuration keeps its fastest
(least disturbed) measured step over all passes.

Default grid: llama-small (hidden 256, 4 layers), one process, seq 128, checkpoint ∈
{none, 0.5, all} × batch ∈ {1, 2, 4, 8}: 12 configurations, 6 measured steps each after
2 warm-up steps. ``--world-size 2`` searches dp × tp over 2 gloo ranks instead.

    .venv/bin/python benchmarks/explain_ranking.py [--world-size 1] [--model llama-small]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from slapo_fn.tune import Random, Trial, space_for, tune


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank.

    >>> ranks([10.0, 30.0, 20.0, 20.0])
    [1.0, 4.0, 2.5, 2.5]
    """
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks.

    >>> round(spearman([1, 2, 3, 4], [10, 20, 30, 40]), 6), round(spearman([1, 2, 3], [3, 2, 1]), 6)
    (1.0, -1.0)
    """
    ra, rb = ranks(a), ranks(b)
    n = len(ra)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="passes over the grid, each in its own random order")
    args = parser.parse_args()
    fixed = {"seq": args.seq, "steps": args.steps, "warmup": 2}
    if args.world_size == 1:
        space = space_for(args.model, 1, checkpoint=[None, 0.5, 1.0], batch=[1, 2, 4, 8], fixed=fixed)
    else:
        space = space_for(args.model, args.world_size, sp=[False], checkpoint=[None, 1.0], batch=[2, 8],
                          fixed=fixed)
    began = time.monotonic()
    best: dict[str, Trial] = {}
    for seed in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            result = tune(space, strategy=Random(seed=seed), trial_timeout=300, folder=Path(folder))
        for t in result.trials:
            if not t.ok or not t.step_tokens_per_s:
                continue
            # the least disturbed step: other processes on a shared machine only ever slow one down
            t = dataclasses.replace(t, tokens_per_s=max(t.step_tokens_per_s))
            key = str(t.config)
            if key not in best or (t.tokens_per_s or 0.0) > (best[key].tokens_per_s or 0.0):
                best[key] = t
    ran = [t for t in best.values() if t.estimate_tokens_per_s]
    ran.sort(key=lambda t: -(t.estimate_tokens_per_s or 0.0))
    predicted = [t.estimate_tokens_per_s or 0.0 for t in ran]
    measured = [t.tokens_per_s or 0.0 for t in ran]
    print(json.dumps({
        "benchmark": "explain_ranking", "model": args.model, "world_size": args.world_size, "seq": args.seq,
        "configurations": len(space.valid()), "ran": len(ran), "repeats": args.repeats,
        "spearman": round(spearman(predicted, measured), 3) if len(ran) > 1 else None, "target": 0.8,
        "pairs": [{"config": str(t.config), "estimated_tokens_per_s": round(p, 1), "measured_tokens_per_s": round(m, 1)}
                  for t, p, m in zip(ran, predicted, measured, strict=True)],
        "wall_s": round(time.monotonic() - began, 1),
    }))


if __name__ == "__main__":
    main()
