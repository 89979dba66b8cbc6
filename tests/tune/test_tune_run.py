"""slapo_fn.tune with real trials on this CPU: ``slapo-fn tune`` over a small space (a trial
that crashes, one that hangs), the best config rerun, and memory pruning against real runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from slapo_fn.processes import alive
from slapo_fn.tune import Config, estimate, run_trial, space_for, tune

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "slapo_fn.cli"]


def _losses(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_cli_tune_records_every_trial_survives_a_crash_and_a_hang_and_the_best_reproduces(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run([*CLI, "tune", "--model", "llama-tiny", "--world-size", "2", "--tp", "1,2", "--sp", "false",
                             "--checkpoint", "none,all", "--batch", "2,4", "--seq", "32", "--steps", "2", "--warmup",
                             "1", "--trial-timeout", "50", "--out", str(out),
                             "--fault", "tp=2,checkpoint=all,batch=2@exit:2",
                             "--fault", "tp=1,checkpoint=none,batch=2@hang:2"],
                            cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "trials.json").read_text())
    trials = report["trials"]
    assert len(trials) == 8 and report["summary"]["ran"] == 8
    by = {(t["config"]["tp"], t["config"]["checkpoint"], t["config"]["batch"]): t for t in trials}
    assert by[(2, 1.0, 2)]["status"] == "crash" and "injected fault 'exit'" in by[(2, 1.0, 2)]["reason"]
    assert by[(1, None, 2)]["status"] == "timeout"
    ok = [t for t in trials if t["status"] == "ok"]
    assert len(ok) == 6 and all(t["tokens_per_s"] > 0 and t["peak_mem_bytes"] > 0 for t in ok)
    for run_dir in (out / "trials").glob("trial-*/run"):  # no process of any trial is left
        pids = [int(p.read_text()) for p in run_dir.glob("pid-*")]
        assert pids and not any(alive(p) for p in pids), run_dir
    if importlib.util.find_spec("matplotlib") is not None:  # the optional `tune` extra
        assert (out / "throughput.png").stat().st_size > 0
    else:
        assert "plot: skipped" in result.stdout
    best = report["best"]
    assert best["tokens_per_s"] == max(t["tokens_per_s"] for t in ok)
    command = report["best_command"]
    assert f"reproduce: {command}" in " ".join(result.stdout.split())
    # the printed command reruns the best config: same losses step for step
    rerun_metrics = tmp_path / "rerun.jsonl"
    args = command.split()[2:]
    rerun = subprocess.run([*CLI, "train", *args, "--no-progress", "--metrics", str(rerun_metrics)], cwd=ROOT,
                           capture_output=True, text=True, timeout=200)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    trial_metrics = Path(best["command"][best["command"].index("--metrics") + 1])
    assert _losses(rerun_metrics) == pytest.approx(_losses(trial_metrics), rel=1e-6)


CONFIG = {"model_type": "llama", "use_cache": False, "tie_word_embeddings": False, "vocab_size": 4096,
          "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 8}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_memory_pruning_rejects_a_config_a_real_run_does_not_fit_and_keeps_one_that_does(tmp_path: Path) -> None:
    model = tmp_path / "config.json"
    model.write_text(json.dumps(CONFIG))
    budget = 300 * 2**20
    fixed = {"seq": 128, "steps": 1, "warmup": 1}
    space = space_for(str(model), 1, checkpoint=[None], batch=[1, 16], fixed=fixed)
    result = tune(space, memory_budget=budget, trial_timeout=150, folder=tmp_path / "trials")
    status = {t.config.num("batch"): t for t in result.trials}
    assert status[16].status == "pruned" and status[1].status == "ok", result.trials
    kept = status[1]
    assert kept.estimate_bytes is not None and kept.train_mem_bytes is not None
    assert kept.train_mem_bytes <= budget  # the kept config really fits
    # the pruned one, run anyway, really does not fit
    big = Config.of({**status[16].config.as_dict()})
    assert estimate(big, str(model), world_size=1, seq=128).total_bytes > budget
    real = run_trial(big, {"model": str(model), **fixed}, tmp_path / "big", timeout=150)
    assert real.ok and real.train_mem_bytes is not None and real.train_mem_bytes > budget, real
