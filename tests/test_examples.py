"""The examples run, as a user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_verifies_and_the_loss_falls() -> None:
    result = subprocess.run([sys.executable, "examples/demo.py", "--steps", "12"], cwd=ROOT, capture_output=True,
                            text=True, timeout=230)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verified 1 outputs" in result.stdout
    assert "the original model was not touched: True" in result.stdout


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_tutorial_runs_on_four_ranks_and_every_step_verifies() -> None:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                             "examples/tutorial.py"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-4000:]
    for step in ("0. nothing scheduled", "2. shard: Megatron", "3. sequence parallel", "4. checkpoint",
                 "5. cut_pipeline_stage"):
        line = next(line for line in result.stdout.splitlines() if line.startswith(step))
        assert "verified 1 outputs" in line
    assert "pipeline step: loss" in result.stdout
    assert "was never modified: True" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_throughput_benchmark_logic_in_smoke_mode() -> None:
    import json

    result = subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--smoke"], cwd=ROOT,
                            capture_output=True, text=True, timeout=230)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for variant in ("recipe", "recipe_compile"):  # same weights, same batches; the chunked loss rounds otherwise
        assert abs(figures[variant]["last_loss"] - figures["hf_eager"]["last_loss"]) < 1e-3
        assert figures[variant]["speedup_vs_hf_eager"] > 0
    assert figures["flops_per_token"] > 0


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_functional_loop_example_gives_the_module_loops_losses_at_dp2_tp2() -> None:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                             "examples/functional_loop.py", "--steps", "10"], cwd=ROOT, capture_output=True,
                            text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(rows) == 10
    for row in rows:
        assert abs(float(row[3]) - float(row[5])) <= 1e-5, row
    assert float(rows[-1][3]) < float(rows[0][3])  # it trains
