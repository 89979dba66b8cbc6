"""Bad input to the ``slapo-fn`` command gets one clear answer, and a job never outlives
its launcher (issue 15, the command-line part).

Every case runs the command as a real subprocess with a time bound and checks: exit
code 2, nothing on stdout, no traceback, one message (said once, not once per rank) of at
most ~10 lines that names the flag or file at fault. Every case is refused before any
process starts, so each costs one interpreter start (torch and transformers imports).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from slapo_fn.checkpoint_dir import write_manifest
from slapo_fn.cli import MAX_MESSAGE_LINES, CommandLineError, _say
from slapo_fn.errors import Problem
from slapo_fn.launch import describe, launch, root_cause
from slapo_fn.processes import alive

CLI = [sys.executable, "-m", "slapo_fn.cli"]
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


def run(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def message(stderr: str) -> list[str]:
    """The command's own message: stderr from its first ``slapo-fn`` line on (before it
    come only the warnings of the libraries it loads)."""
    lines = stderr.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("slapo-fn")), len(lines))
    return lines[first:]


# -- the files the cases need ------------------------------------------------------------------
def _files(tmp: Path) -> dict[str, str]:
    """``{name: path}`` of the inputs that the cases refer to as ``{name}``."""
    (tmp / "broken.json").write_text('{"model_type": "llama", "hidden_size": 64,\n')
    (tmp / "typo.json").write_text(json.dumps({"model_type": "lama", "hidden_size": 64}))
    AutoConfig.for_model("vit", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64).save_pretrained(tmp / "vit")
    AutoConfig.for_model("llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp / "vocab128")
    AutoConfig.for_model("llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16).save_pretrained(tmp / "short")
    AutoConfig.for_model("llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp / "vocab320")
    (tmp / "text.txt").write_text("some text to train on\n" * 10)
    # data the ranks would refuse, found on a sample before they start: a row without its
    # text field in a JSONL file, and a Latin-1 file among UTF-8 ones
    (tmp / "rows.jsonl").write_text('{"text": "one"}\n' * 40 + '{"txt": "two"}\n' + '{"text": "three"}\n' * 40)
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "a.txt").write_text("plain text\n" * 20)
    (tmp / "corpus" / "b.txt").write_bytes("caf\u00e9 na\u00efve\n".encode("latin-1") * 20)
    # a checkpoint folder as slapo_fn.save leaves it: LATEST names the newest step, whose
    # manifest lists its files; the refusal comes before anything is loaded, so no data
    # files are needed
    (tmp / "ckpt" / "step-00000004").mkdir(parents=True)
    write_manifest(tmp / "ckpt" / "step-00000004", {}, step=4)
    (tmp / "ckpt" / "LATEST").write_text("step-00000004\n")
    (tmp / "empty").mkdir()
    return {"broken": str(tmp / "broken.json"), "typo": str(tmp / "typo.json"), "vit": str(tmp / "vit"),
            "vocab128": str(tmp / "vocab128"), "short": str(tmp / "short"), "text": str(tmp / "text.txt"),
            "ckpt": str(tmp / "ckpt"), "vocab320": str(tmp / "vocab320"), "rows": str(tmp / "rows.jsonl"),
            "corpus": str(tmp / "corpus"),
            "empty": str(tmp / "empty"), "missing": str(tmp / "no-such-file.txt")}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _files(tmp_path_factory.mktemp("inputs"))


# What the message must say, case by case (``{name}``: a file of ``_files``). One case per
# kind of bad input runs by default; the other cases of a kind are `slow` (each costs one
# interpreter start, ~5 s, mostly imports).
SLOW = pytest.mark.slow
CASES = [
    pytest.param(["train", "--steps", "0"], ["'--steps'", "at least 1, got 0"], id="steps-0"),
    pytest.param(["train", "--steps", "-5"], ["'--steps'", "got -5"], id="steps-negative", marks=SLOW),
    pytest.param(["train", "--dp", "0", "--tp", "-2"], ["2 problems", "'--dp'", "got 0", "'--tp'", "got -2"],
                 id="sizes-all-at-once"),
    pytest.param(["train", "--dp", "2", "--batch", "3"], ["'--batch'", "--dp 2", "--batch 4"], id="uneven-batch"),
    pytest.param(["train", "--pp", "2", "--microbatches", "0"], ["'--microbatches'", "got 0"], id="microbatches-0"),
    pytest.param(["train", "--pp", "2", "--microbatches", "3"],
                 ["'--microbatches'", "do not split into 3 microbatches"], id="microbatches-do-not-split"),
    pytest.param(["train", "--pp", "2", "--batch", "2", "--microbatches", "1"],
                 ["'--microbatches'", "1 microbatches for 2 pipeline stages"], id="microbatches-below-stages",
                 marks=SLOW),
    pytest.param(["train", "--log-every", "0"], ["'--log-every'"], id="log-every-0", marks=SLOW),
    pytest.param(["train", "--save-every", "2"], ["'--save-every'", "needs --checkpoint-dir"],
                 id="save-every-without-dir", marks=SLOW),
    pytest.param(["train", "--fault", "boom"], ["'--fault'", "KIND:STEP"], id="fault", marks=SLOW),
    pytest.param(["explain", "--batch", "0"], ["'--batch'", "got 0"], id="explain-batch-0"),
    # explain refuses what train refuses: one check of the split (slapo_fn.options.Split)
    pytest.param(["explain", "--model", "llama-7b", "--tp", "8", "--pp", "4", "--dp", "4", "--batch", "8"],
                 ["'--batch'", "2 sequences per data-parallel rank and micro-step (--batch 8 / --dp 4) do not split "
                  "into 8 microbatches (the default: 2 x --pp)", "fix: --batch 32"], id="explain-uneven-microbatches"),
    pytest.param(["explain", "--seq", "0"], ["'--seq'", "got 0"], id="explain-seq-0"),
    pytest.param(["train", "--resume", "--steps", "2", "--checkpoint-dir", "{ckpt}"],
                 ["'--steps'", "at step 4", "nothing is left to train", "--steps 5"], id="resume-past-the-end"),
    pytest.param(["train", "--resume"], ["'--resume'", "--checkpoint-dir"], id="resume-without-dir", marks=SLOW),
    pytest.param(["train", "--resume", "--checkpoint-dir", "{empty}"],
                 ["'--checkpoint-dir'", "{empty}", "no checkpoint"], id="resume-from-nothing", marks=SLOW),
    pytest.param(["train", "--data", "{missing}"], ["'--data'", "{missing}", "no such file"], id="data-missing"),
    pytest.param(["train", "--model", "{vocab320}", "--data", "{rows}", "--tokenizer", "bytes", "--dp", "2"],
                 ["'{rows}:41'", "has no 'text' field (fields: txt)", "text_field='txt'"], id="data-row-without-text"),
    pytest.param(["train", "--model", "{vocab320}", "--data", "{corpus}", "--tokenizer", "bytes"],
                 ["b.txt'", "is not UTF-8 text"], id="data-not-utf8", marks=SLOW),
    pytest.param(["train", "--model", "{vocab128}", "--data", "{text}"],
                 ["'--data'", "{text}", "256 symbols", "only 128"], id="data-beyond-vocab", marks=SLOW),
    pytest.param(["train", "--tp", "2", "--float8"], ["'--float8'", "drop --float8"], id="float8-without-sm89",
                 marks=[SLOW, pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU may run float8")]),
    pytest.param(["train", "--tp", "2", "--sp", "--async-tp"], ["'--async-tp'", "needs --tp > 1, --sp and --compile",
                                                                 "add --compile"], id="async-tp-without-compile"),
    pytest.param(["explain", "--model", "{broken}"], ["{broken}", "not valid JSON", "line 2"], id="config-not-json"),
    pytest.param(["explain", "--model", "{typo}"], ["{typo}", "unknown model_type 'lama'", "close matches: 'llama'"],
                 id="config-unknown-type"),
    pytest.param(["explain", "--model", "{vit}"], ["config.json", "'vit'", "has no language model"],
                 id="config-not-causal-lm"),
    pytest.param(["train", "--tp", "3"], ["num_attention_heads=4", "tp=3"], id="heads-over-tp"),
    pytest.param(["train", "--pp", "2", "--schedule", "bogus"], ["'--schedule'", "'bogus'", "1f1b"],
                 id="schedule-unknown"),
    pytest.param(["verify", "--pp", "2"], ["'--pp'", "does not run pipelines"], id="verify-pipeline"),
    pytest.param(["verify", "--model", "{short}", "--seq", "32"],
                 ["'--seq'", "32 is longer than the 16 positions", "--seq 16"], id="seq-beyond-positions"),
    pytest.param(["verify", "--rtol", "-1"], ["'--rtol'", "got -1"], id="verify-tolerance", marks=SLOW),
    # a sequence --sp cannot split over the ranks: said before any rank starts, not by the first forward
    pytest.param(["verify", "--tp", "2", "--sp", "--seq", "17"], ["'--seq'", "--tp 2", "--seq 18 or 16", "drop --sp"],
                 id="seq-over-tp-with-sp"),
    pytest.param(["train", "--tp", "2", "--sp", "--seq", "1"], ["'--seq'", "--seq 2 (a multiple"],
                 id="seq-below-tp-with-sp", marks=SLOW),
]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize(("args", "expected"), CASES)
def test_bad_input_is_refused_once_in_a_few_lines(files: dict[str, str], args: list[str],
                                                  expected: list[str]) -> None:
    result = run(*(a.format(**files) for a in args))
    said = message(result.stderr)
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    assert result.stdout == "", result.stdout[-2000:]  # refused before any work: no rank printed anything
    assert said and len(said) <= MAX_MESSAGE_LINES, result.stderr
    assert sum(line.startswith("slapo-fn") for line in said) == 1, result.stderr  # said once
    text = "\n".join(said)
    assert len(text) < 1000, text  # no list of every model type or class on one line
    for needle in expected:
        assert needle.format(**files) in text, (needle, text)
    assert "ChildFailedError" not in result.stderr


# -- in one process: the message's shape, the agent's line ----------------------------------------------------
def test_a_long_refusal_is_cut_to_the_line_limit() -> None:
    error = CommandLineError("train", [Problem(f"--flag{i}", "bad", "fix it") for i in range(12)])
    text = _say("train", error)
    lines = text.splitlines()
    assert len(lines) == MAX_MESSAGE_LINES
    assert lines[0] == "slapo-fn train: 12 problems" and lines[-1].endswith("more lines")
    assert _say("explain", ValueError("plain")) == "slapo-fn explain: plain"


@pytest.mark.parametrize(("exitcode", "line", "code"), [
    (-9, "rank 1 (pid 42) was killed by SIGKILL", 137),
    (3, "rank 1 (pid 42) exited with code 3", 3),
])
def test_the_agent_says_how_a_rank_failed_in_one_line(exitcode: int, line: str, code: int) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    assert describe(1, ProcessFailure(local_rank=1, pid=42, exitcode=exitcode, error_file="")) == (line, code)


def test_the_rank_that_failed_first_is_the_one_reported() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failure(rank: int, exitcode: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="")

    # seen in one poll (the same second, listed by rank): the killed rank, not the one that lost its peer
    assert root_cause({0: failure(0, 1), 1: failure(1, -9), 2: failure(2, -15)})[0] == 1
    # a rank that exited non-zero, not the ranks the agent stopped with SIGTERM
    assert root_cause({0: failure(0, -15), 1: failure(1, 2)})[0] == 1
    earlier, later = failure(0, -15), failure(1, -9)
    later.timestamp = earlier.timestamp + 1
    assert root_cause({0: earlier, 1: later})[0] == 0  # otherwise the earliest
    # both exited non-zero in one poll: the rank that recorded a lost peer is the consequence
    assert root_cause({0: failure(0, 1), 1: failure(1, 3)}, lost={0})[0] == 1
    assert root_cause({0: failure(0, 1), 1: failure(1, 3)})[0] == 0


# -- jobs on several processes ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_refusal_found_only_in_the_workers_is_said_once_without_torchruns_report(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # launch() skips the command's own checks, as a job whose input only its ranks can
    # judge: both ranks refuse the same recipe knob
    outcome = launch(["train", "--dp", "2", "--checkpoint", "1.5", "--steps", "1", "--no-progress"], 2, tmp_path)
    err = capfd.readouterr().err
    assert outcome.code == 2 and outcome.stopped_by is None
    assert len(outcome.errors) == 1 and "checkpoint ratio 1.5" in outcome.errors[0]
    assert outcome.failure == ""  # the refusal says why (errors); no rank crashed to be named
    assert "ChildFailedError" not in err and "Traceback" not in err and "checkpoint ratio" not in err, err
    # the first rank to refuse ends the job (torchrun stops the other, which may not have said it yet)
    assert {p.name for p in tmp_path.glob("error-*")} & {"error-0", "error-1"}


def _processes_with(marker: str) -> dict[int, str]:
    """Running processes whose command line holds ``marker`` (``ww``: whole lines)."""
    out = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True, timeout=30).stdout
    found = {}
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if marker in args and int(pid) != os.getpid():
            found[int(pid)] = args
    return found


def _wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, id="SIGTERM"),
                                 pytest.param(signal.SIGHUP, id="SIGHUP", marks=pytest.mark.slow)])
def test_a_signal_to_the_launcher_stops_every_worker(tmp_path: Path, sig: signal.Signals) -> None:
    run_dir, metrics = tmp_path / f"run-{sig.name}-{os.getpid()}", tmp_path / "metrics.jsonl"
    marker = str(run_dir)  # in the command line of the launcher, the agent and every worker
    proc = subprocess.Popen([*CLI, "train", "--dp", "2", "--steps", "100000", "--no-progress", "--seq", "16",
                             "--log-every", "1000000", "--run-dir", marker, "--metrics", str(metrics)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 150), \
            proc.stderr.read() if proc.poll() is not None and proc.stderr else "no training step"
        workers = [int(p.read_text()) for p in run_dir.glob("pid-*")]
        job = _processes_with(marker)
        assert len(workers) == 2 and set(workers) <= set(job) and len(job) == 4  # launcher, agent, 2 workers
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig
        assert _wait_for(lambda: not _processes_with(marker), 10), _processes_with(marker)  # none 10 s later
        assert not any(alive(p) for p in workers)
        assert f"stopped by {sig.name}; every worker is stopped" in err
        assert "Traceback" not in err and "SignalException" not in err, err
        assert len(message(err)) == 1, err
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_explain_assumes_no_longer_a_sequence_than_the_model_covers(files: dict[str, str]) -> None:
    """``explain``'s default sequence (2048) is cut to the model's positions: a model of 16
    positions is explained at 16, and its fake run (the collectives' bytes) does not fail."""
    result = run("explain", "--model", files["short"], "--tp", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "× seq 16 " in result.stdout, result.stdout[-2000:]
    assert "fake run failed" not in result.stdout, result.stdout[-3000:]
