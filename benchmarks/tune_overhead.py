"""The auto-tuner's own overhead, and how many trials each strategy needs to reach the best
config, compared with exhaustive search. Prints one JSON line.

* ``simulated``: llama-small on 8 ranks, tp ∈ {1,2,4} × pp ∈ {1,2} × checkpoint ∈ {none,
  0.5, all} × batch ∈ {8,16,32} (dp follows from the world size). The objective is a
  simulated throughput (no process is started), an analytical step-time model: compute ∝
  tokens per rank × (1 + recompute share of checkpointing), a tensor-parallel all-reduce
  term ∝ (tp−1)/tp × tokens, a pipeline bubble (pp−1)/microbatches, a data-parallel
  gradient term, plus 3 % seeded noise. Trials-to-best is the 1-based index of the first
  trial that measured the best value; exhaustive grid search must run every point to know
  it has the best. Random and TPE are averaged over 10 seeds. The tuner's overhead here is
  all of its time (estimates for every point, strategy, bookkeeping).
* ``real``: ``tune`` of llama-tiny on one process, checkpoint ∈ {none, all} × batch ∈ {2, 4}
  (4 trials of 3 steps after 1 warm-up step, seq 64), real ``slapo-fn train`` subprocesses:
  total time, time in trials, overhead.

Run: ``.venv/bin/python benchmarks/tune_overhead.py`` (``--no-real`` skips the real run).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from slapo_fn.tune import TPE, Config, Grid, Random, Trial, space_for, tune


def simulated_speed(config: Config) -> float:
    """Tokens/s of the analytical model in the module docstring (deterministic per config)."""
    dp, tp, pp, batch = config.num("dp"), config.num("tp"), config.num("pp"), config.num("batch")
    ratio = float(config.get("checkpoint") or 0.0)  # type: ignore[arg-type]
    tokens = batch * 512
    per_rank = tokens / dp / tp / pp
    compute = per_rank * (1 + 0.33 * ratio)
    tp_comm = 0.45 * (tp - 1) / tp * tokens / dp / pp
    micro = 2 * pp
    bubble = (pp - 1) / micro * compute
    dp_comm = 2000.0 * (dp - 1) / dp
    noise = random.Random(str(config)).uniform(0.97, 1.03)
    memory_penalty = 1.6 if ratio == 0 and per_rank > 2048 else 1.0  # activations spill: slower
    return tokens / ((compute * memory_penalty + tp_comm + bubble + dp_comm) / 1e4) * noise


def run_simulated() -> dict[str, object]:
    space = space_for("llama-small", 8, tp=[1, 2, 4], pp=[1, 2], sp=[False], checkpoint=[None, 0.5, 1.0],
                      batch=[8, 16, 32])
    points = space.valid()

    def fake(config: Config, folder: Path) -> Trial:
        return Trial(config, "ok", tokens_per_s=simulated_speed(config))

    best = max(simulated_speed(c) for c in points)
    grid = tune(space, strategy=Grid(), run=fake)
    out: dict[str, object] = {"space_points": space.size, "valid_points": len(points),
                              "exhaustive": {"trials": len(grid.trials), "trials_to_best": grid.trials_to_best,
                                             "overhead_s": round(grid.overhead_s, 3)}}
    for name, make in (("random", Random), ("tpe", TPE)):
        reach, overhead = [], []
        for seed in range(10):
            result = tune(space, strategy=make(seed=seed), run=fake)  # type: ignore[operator]
            assert result.best is not None and result.best.tokens_per_s == best
            reach.append(result.trials_to_best or 0)
            overhead.append(result.overhead_s)
        out[name] = {"trials_to_best_mean": statistics.mean(reach), "trials_to_best_max": max(reach),
                     "overhead_s_mean": round(statistics.mean(overhead), 3)}
    patient = [tune(space, strategy=TPE(seed=s), patience=8, run=fake) for s in range(10)]
    out["tpe_patience8"] = {"trials_mean": statistics.mean(len(r.trials) for r in patient),
                            "found_best": sum(r.best is not None and r.best.tokens_per_s == best for r in patient),
                            "of": len(patient)}
    return out


def run_real() -> dict[str, object]:
    space = space_for("llama-tiny", 1, checkpoint=[None, 1.0], batch=[2, 4],
                      fixed={"seq": 64, "steps": 3, "warmup": 1})
    with tempfile.TemporaryDirectory() as folder:
        began = time.monotonic()
        result = tune(space, strategy=Grid(), trial_timeout=180, folder=Path(folder))
        wall = time.monotonic() - began
    return {"trials": len(result.trials), "ok": sum(t.ok for t in result.trials), "elapsed_s": round(wall, 2),
            "trial_s": round(result.trial_s, 2), "overhead_s": round(result.overhead_s, 3),
            "overhead_share": round(result.overhead_s / result.elapsed_s, 4),
            "best_tokens_per_s": None if result.best is None else round(result.best.tokens_per_s or 0.0, 1)}


def main() -> None:
    began = time.monotonic()
    figures: dict[str, object] = {"benchmark": "tune_overhead", "simulated": run_simulated()}
    if "--no-real" not in sys.argv:
        figures["real"] = run_real()
    figures["wall_s"] = round(time.monotonic() - began, 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
