"""``slapo-fn train``'s loop flags, its TOML config, resume past a broken checkpoint, and a
job over two "nodes" on loopback. The loop itself is tested through ``train()`` in
tests/test_train.py; here, that the command line reaches it."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from slapo_fn.cli import DECAYS, main
from slapo_fn.train import DECAYS as TRAIN_DECAYS
from slapo_fn.train import LRSchedule

CLI = [sys.executable, "-m", "slapo_fn.cli"]
ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "llama-tiny", "--seq", "16", "--no-progress", "--log-every", "1"]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+) loss ([\d.]+)", stdout, re.M)}


def rates(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step \d+ loss .* lr ([\d.e+-]+)", stdout, re.M)]


def test_the_decays_of_the_command_are_the_loops() -> None:
    assert DECAYS == TRAIN_DECAYS


@pytest.mark.timeout(240)
def test_a_toml_config_sets_the_flags_and_the_command_line_overrides_it(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tensorboard")
    config = tmp_path / "run.toml"
    config.write_text('model = "llama-tiny"\n'
                      '[training]\nsteps = 4\nbatch = 4\nseq = 16\nlog-every = 1\nno_progress = true\n'
                      '[optimizer]\nlr = 0.05\nwarmup = 2\ndecay = "linear"\nmin-lr = 0.001\ngrad-clip = 1.0\n'
                      'grad-accum = 2\n')
    board, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    code = main(["train", "--config", str(config), "--lr", "0.02", "--tensorboard", str(board), "--metrics",
                 str(metrics)])
    out = capsys.readouterr().out
    assert code == 0, out
    schedule = LRSchedule(0.02, warmup=2, decay="linear", min_lr=0.001, total=4)  # --lr overrides lr = 0.05
    assert rates(out) == pytest.approx([schedule(i) for i in range(4)], rel=1e-3)
    assert sorted(losses(out)) == [1, 2, 3, 4]
    assert len(metrics.read_text().splitlines()) == 4
    assert list(board.glob("events.out.tfevents.*"))


@pytest.mark.parametrize(("toml", "expected"), [
    ('grad-acum = 2\nsteps = "ten"\n[optimizer]\ndecay = "step"\n',
     ["3 problems", "grad-acum': not a flag", "close matches: grad-accum", "steps': must be an integer",
      "optimizer.decay': 'step' is not one of cosine, linear, constant"]),
    ("lr = [1\n", ["not valid TOML"]),
])
def test_a_bad_config_is_one_message_naming_the_file_and_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              toml: str, expected: list[str]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert str(config) in err
    for text in expected:
        assert text in err, err


@pytest.mark.parametrize(("args", "expected"), [
    (["--grad-clip", "0"], ["'--grad-clip'", "positive norm"]),
    (["--lr", "0.1", "--min-lr", "1"], ["'--min-lr'", "[0, --lr 0.1]"]),
    (["--weight-decay", "-1"], ["'--weight-decay'", ">= 0"]),
    (["--warmup", "-1", "--grad-accum", "0"], ["2 problems", "'--warmup'", "'--grad-accum'"]),
    (["--dp", "2", "--grad-accum", "3", "--batch", "8"], ["'--batch'", "--grad-accum 3", "--batch 12"]),
    (["--eval-every", "5"], ["'--eval-every'", "no held-out split"]),
    (["--dp", "2", "--nnodes", "2"], ["'--master-addr'", "address of node 0"]),
    (["--dp", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], ["'--node-rank'", "0 .. 1"]),
    (["--dp", "2", "--nnodes", "3", "--master-addr", "h"], ["'--nnodes'", "do not split evenly over 3 nodes"]),
    (["--master-port", "70000"], ["'--master-port'", "1 .. 65535"]),
], ids=["clip", "min-lr", "weight-decay", "all-at-once", "accum-batch", "eval", "no-master", "node-rank",
        "nnodes", "port"])
def test_loop_and_node_flags_are_checked_before_any_work(capsys: pytest.CaptureFixture[str], args: list[str],
                                                        expected: list[str]) -> None:
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_past_a_truncated_checkpoint_continues_the_uninterrupted_losses(tmp_path: Path) -> None:
    common = ["train", *TINY, "--lr", "1e-2", "--warmup", "2", "--decay", "cosine", "--grad-clip", "0.5",
              "--grad-accum", "2", "--batch", "4"]
    whole = run(*common, "--steps", "6")
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run(*common, "--steps", "4", "--checkpoint-dir", str(tmp_path), "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    broken = next((tmp_path / "step-00000004").glob("*.distcp"))
    broken.write_bytes(broken.read_bytes()[:64])
    resumed = run(*common, "--steps", "6", "--checkpoint-dir", str(tmp_path), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = [line for line in resumed.stdout.splitlines() if "unusable" in line]
    assert len(said) == 1 and "is truncated" in said[0] and "loaded step-00000002" in said[0], resumed.stdout
    assert "resumed from step 2" in resumed.stdout
    expected, got = losses(whole.stdout), losses(resumed.stdout)
    assert sorted(got) == [3, 4, 5, 6]
    assert all(got[s] == expected[s] for s in got), (got, expected)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_two_nodes_on_loopback_train_as_one_node_does(tmp_path: Path) -> None:
    common = ["train", *TINY, "--dp", "2", "--tp", "2", "--steps", "3", "--lr", "1e-2"]
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    other = subprocess.Popen([*CLI, *common, *nodes, "--node-rank", "1", "--run-dir", str(tmp_path / "n1")],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = run(*common, *nodes, "--node-rank", "0", "--run-dir", str(tmp_path / "n0"), timeout=300)
        out, err = other.communicate(timeout=60)
    finally:
        if other.poll() is None:
            other.kill()
    assert first.returncode == 0, first.stderr[-3000:]
    assert other.returncode == 0, err[-3000:]
    assert "step 1 loss" not in out  # rank 0, on node 0, reports
    one = run(*common)
    assert one.returncode == 0, one.stderr[-3000:]
    assert losses(first.stdout) == pytest.approx(losses(one.stdout), rel=1e-6)
    assert sorted(losses(first.stdout)) == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hsdp_on_four_ranks_trains_as_one_process_does() -> None:
    common = ["train", "--model", "llama-tiny", "--steps", "4", "--seq", "16", "--log-every", "1", "--no-progress"]
    one = subprocess.run([*CLI, *common], cwd=ROOT, capture_output=True, text=True, timeout=240)
    hsdp = subprocess.run([*CLI, *common, "--dp", "4", "--dp-mode", "hsdp", "--dp-shard", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert one.returncode == 0 and hsdp.returncode == 0, hsdp.stderr[-3000:]
    expected, got = losses(one.stdout), losses(hsdp.stdout)
    assert sorted(got) == [1, 2, 3, 4]
    assert all(got[s] == pytest.approx(expected[s], rel=1e-5) for s in got), (expected, got)
