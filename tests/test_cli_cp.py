"""``--cp N``: context parallelism from the command line (mesh axis ``cp``), checked before
any rank starts, explained, and trained as one process trains."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from slapo_fn.cli import main

CLI = [sys.executable, "-m", "slapo_fn.cli"]
ROOT = Path(__file__).resolve().parents[1]


def _losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+) loss ([\d.]+)", stdout, re.M)}


def test_cp_flags_that_cannot_hold_are_refused_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--model", "llama-tiny", "--cp", "2", "--dp", "2", "--dp-mode", "ddp", "--seq", "62",
                 "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "'--dp-mode': --cp 2 does not compose with --dp-mode yet" in err and "fix: --dp-mode fsdp" in err
    assert "'--seq': 62 tokens do not split into 4 equal chunks (2 x --cp)" in err and "fix: --seq 60" in err
    assert main(["train", "--model", "llama-tiny", "--cp", "0"]) == 2
    assert "'--cp': must be at least 1" in capsys.readouterr().err


def test_explain_shows_the_cp_collectives_and_a_mesh_with_a_cp_axis(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--model", "llama-tiny", "--cp", "2", "--tp", "2", "--seq", "64", "--batch", "2",
                 "--hardware", "none"]) == 0
    out = capsys.readouterr().out
    assert "mesh (cp=2, tp=2)" in out, out
    assert re.search(r"cp: all_gather ×4 \(32\.0 KiB\), reduce_scatter ×4 \(32\.0 KiB\)", out), out


@pytest.mark.parametrize(("command", "split"), [("train", True), ("explain", False), ("verify", False)])
def test_train_hands_each_cp_rank_its_chunks_and_the_other_commands_the_global_batch(command: str,
                                                                                       split: bool) -> None:
    """``train``'s loop cuts each batch for its rank (the model is built with
    ``inputs_split=True``: it never sees the global batch); ``explain`` and ``verify`` call
    the model with the global batch, which it cuts itself."""
    from slapo_fn import job
    from slapo_fn.cli import _parse
    from slapo_fn.dtensor.context import CP
    from slapo_fn.dtensor.testing import fake_mesh

    options = _parse([command, "--model", "llama-tiny", "--cp", "2"])
    sch = job.schedule_for(options, fake_mesh(2, names=("cp",)), meta=True)
    specs = set(sch.annotations.of_kind(CP).values())
    assert len(specs) == 1 and next(iter(specs)).inputs_split is split, specs


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cp2_cp2_tp2_fsdp_over_cp2_and_pp2_cp2_train_as_one_process_does() -> None:
    """Through the loop's collation: each cp rank's model takes its chunks of each batch."""
    common = ["train", "--model", "llama-tiny", "--steps", "3", "--seq", "64", "--batch", "2", "--log-every", "1",
              "--no-progress"]
    runs = [subprocess.run([*CLI, *common, *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
            for extra in ([], ["--cp", "2"], ["--cp", "2", "--tp", "2"], ["--cp", "2", "--dp-mode", "fsdp"],
                          ["--cp", "2", "--pp", "2", "--microbatches", "2"])]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    expected = _losses(runs[0].stdout)
    assert sorted(expected) == [1, 2, 3]
    for r in runs[1:]:
        got = _losses(r.stdout)
        assert sorted(got) == [1, 2, 3] and all(got[s] == pytest.approx(expected[s], rel=1e-5) for s in got), \
            (expected, got)
