"""A data-parallel job of one (``--dp 1 --dp-mode fsdp``: FSDP2 over a one-rank mesh, as the
GPU check trains) and AdamW's implementations (``--optimizer-impl``). The job itself runs in
tests/test_gpu_check.py (the script's train part)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from slapo_fn.cli import main
from slapo_fn.train import TrainError, adamw


def test_explain_of_a_data_parallel_job_of_one_shows_fsdp_over_its_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["explain", "--model", "llama-tiny", "--batch", "2", "--seq", "16", "--hardware", "none"]
    assert main([*small, "--dp", "1", "--dp-mode", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "dp1 (1 ranks)" in out and "data_parallel=fsdp@dp" in out
    assert "dp: all_gather" in out and "reduce_scatter" in out
    assert main(small) == 0  # --dp 1 alone stays one process with no data parallelism
    out = capsys.readouterr().out
    assert "one process" in out and "data_parallel" not in out


def test_a_metrics_file_in_a_missing_folder_is_refused_before_the_job(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere" / "m.jsonl"
    assert main(["train", "--steps", "1", "--metrics", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "'--metrics'" in err and "its folder does not exist" in err


def test_an_unknown_optimizer_impl_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--optimizer-impl", "apex"])
    assert exit_.value.code == 2 and "--optimizer-impl" in capsys.readouterr().err


@pytest.mark.parametrize(("impl", "expected"), [("auto", {"foreach": None, "fused": None}),
                                                ("foreach", {"foreach": True, "fused": None}),
                                                ("fused", {"foreach": None, "fused": True}),
                                                ("for-loop", {"foreach": False, "fused": None})])
def test_adamw_runs_the_kernels_asked_for(impl: str, expected: dict[str, bool | None]) -> None:
    group = adamw(nn.Linear(2, 2), lr=1e-3, impl=impl).param_groups[0]
    assert {k: group[k] for k in expected} == expected


def test_an_unknown_adamw_impl_names_the_known_ones() -> None:
    with pytest.raises(TrainError, match=r"(?s)unknown AdamW implementation .apex.*foreach, fused, for-loop"):
        adamw(nn.Linear(2, 2), lr=1e-3, impl="apex")
