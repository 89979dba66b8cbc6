"""The ``slapo-fn`` command: train (2 and 4 ranks, resume, failures), explain, verify."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slapo_fn.cli import main
from slapo_fn.presets import PRESETS
from slapo_fn.processes import alive, descendants

CLI = [sys.executable, "-m", "slapo_fn.cli"]
ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+) loss ([\d.]+)", stdout, re.M)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", [pytest.param(["--dp", "2"], id="dp2", marks=pytest.mark.slow),
                                      pytest.param(["--dp", "2", "--tp", "2"], id="dp2xtp2")])
def test_train_on_several_ranks_lowers_the_loss(parallel: list[str]) -> None:
    result = run("train", "--model", "llama-tiny", *parallel, "--steps", "12", "--lr", "1e-2", "--log-every", "1",
                 "--no-progress", "--seq", "32")
    assert result.returncode == 0, result.stderr[-3000:]
    seen = losses(result.stdout)
    assert sorted(seen) == list(range(1, 13))
    assert seen[12] < seen[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_continues_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    common = ["train", "--model", "llama-tiny", "--tp", "2", "--lr", "1e-2", "--log-every", "1", "--no-progress",
              "--seq", "32"]
    whole = run(*common, "--steps", "8")
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run(*common, "--steps", "4", "--checkpoint-dir", str(tmp_path), "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000004"
    resumed = run(*common, "--steps", "8", "--checkpoint-dir", str(tmp_path), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stdout
    expected, got = losses(whole.stdout), losses(resumed.stdout)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-6)


def _wait_for(predicate: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError("timed out waiting")


def _start_long_run(run_dir: Path, metrics: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, "train", "--model", "llama-tiny", "--dp", "2", "--steps", "100000",
                             "--no-progress", "--seq", "16", "--run-dir", str(run_dir), "--metrics", str(metrics)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _pids(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in run_dir.glob("pid-*")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["kill-a-rank", pytest.param("ctrl-c", marks=pytest.mark.slow),
                                 pytest.param("kill-the-agent", marks=pytest.mark.slow)])
def test_a_killed_rank_or_ctrl_c_exits_non_zero_and_leaves_no_process(tmp_path: Path, how: str) -> None:
    run_dir, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    proc = _start_long_run(run_dir, metrics)
    try:
        _wait_for(lambda: len(_pids(run_dir)) == 2 and metrics.exists() and metrics.read_text().count("\n") >= 2, 120)
        pids = _pids(run_dir)
        started = time.monotonic()
        if how == "kill-a-rank":
            os.kill(pids[1], signal.SIGKILL)
        elif how == "kill-the-agent":
            agent = next(p for p in descendants(proc.pid) if p not in pids and "slapo_fn.launch" in
                         Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"))
            os.kill(agent, signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
        assert code != 0
        assert time.monotonic() - started < 90  # within the process-group timeout, not a hang
        _wait_for(lambda: not any(alive(p) for p in pids), 10)
        err = proc.stderr.read() if proc.stderr else ""
        said = {"kill-a-rank": f"(pid {pids[1]}) was killed by SIGKILL", "ctrl-c": "stopped by SIGINT",
                "kill-the-agent": "the torchrun agent (pid"}[how]
        assert said in err, err[-3000:]  # one line, not torchrun's ChildFailedError report
        assert "every worker is stopped" in err and "done:" not in (proc.stdout.read() if proc.stdout else "")
        assert "ChildFailedError" not in err and "SignalException" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))


def test_explain_7b_lists_per_rank_memory_within_one_percent(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--model", "llama-7b", "--tp", "8", "--pp", "4", "--dp", "4"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^  (\d)\s+([\d,]+)\s", out.split("per-rank memory")[1], re.M)
    stated = {int(s): int(n.replace(",", "")) for s, n in rows}
    cfg = PRESETS["llama-7b"]
    h, ff, vocab, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    tp, dp, per_stage = 8, 4, layers // 4
    kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]

    def fsdp(rows: int, cols: int = 1) -> int:  # FSDP2 shards dim 0, padded up
        return math.ceil(rows / dp) * cols

    layer = (fsdp(h // tp, h) + 2 * fsdp(kv // tp, h) + fsdp(h, h // tp)  # q, k, v (column), o (row)
             + 2 * fsdp(ff // tp, h) + fsdp(h, ff // tp) + 2 * fsdp(h))  # gate, up, down, two norms
    exact = {0: fsdp(vocab, h) + per_stage * layer, 1: per_stage * layer, 2: per_stage * layer,
             3: per_stage * layer + fsdp(h) + fsdp(vocab, h)}
    for stage, count in exact.items():
        assert abs(stated[stage] - count) <= 0.01 * count, (stage, stated[stage], count)
    assert "dp4 x pp4 x tp8 (128 ranks)" in out
    # the default batch is the smallest that train takes: one sequence per microbatch
    assert "assumed: global batch 32 × seq 2048 (8 sequences per data-parallel rank, 8 microbatches, 1f1b)" in out
    assert "model.layers.*.mlp.down_proj output P→R@tp  fwd all_reduce" in out


@pytest.mark.timeout(240)
def test_verify_prints_a_per_module_report() -> None:
    result = run("verify", "--model", "llama-tiny", "--tp", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model.layers.0.self_attn.q_proj" in result.stdout and "OK: verified" in result.stdout


def test_unknown_model_is_a_clear_error() -> None:
    result = run("explain", "--model", "llama-70q")
    assert result.returncode != 0
    assert "'llama-70q': unknown model: neither a preset nor a config.json" in result.stderr
    assert "close matches: 'llama-7b'" in result.stderr and "fix: use a preset (" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 2


def test_peak_memory_of_a_worker_is_its_own_not_its_launchers() -> None:
    # a launcher holding 1 GiB resident starts a small worker: on Linux ru_maxrss would
    # carry the launcher's peak across exec; the worker must report what it reports when
    # started by a small launcher
    def worker_peak(held_floats: int) -> int:
        launcher = (
            "import subprocess, sys, torch\n"
            f"held = torch.ones({held_floats})\n"  # touched, so resident
            "code = 'from slapo_fn.train import peak_memory; print(peak_memory(None))'\n"
            "print(subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout)\n"
            "print(float(held.sum()))\n"
        )
        out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=120,
                             check=True)
        return int(out.stdout.split()[0])

    small, big = worker_peak(1), worker_peak(2**28)
    assert small > 0 and big < small + 100 * 2**20, (small, big)
