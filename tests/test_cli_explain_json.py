"""``slapo-fn explain --json``: everything explain prints, as one JSON object (a real
subprocess, as scripts and the tuner would call it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(200)
def test_explain_json_holds_what_the_text_says() -> None:
    common = [sys.executable, "-m", "slapo_fn.cli", "explain", "--model", "llama-7b", "--tp", "8", "--pp", "4",
              "--dp", "4", "--batch", "32", "--seq", "1024"]
    text = subprocess.run(common, cwd=ROOT, capture_output=True, text=True, timeout=190)
    data = subprocess.run([*common, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=190)
    assert text.returncode == 0 and data.returncode == 0, data.stderr[-2000:]
    d = json.loads(data.stdout)
    assert d["mesh"] == {"dp": 4, "pp": 4, "tp": 8} and d["ranks"] == 128 and (d["batch"], d["seq"]) == (32, 1024)
    assert d["total_parameters"] == 6_738_415_616
    assert d["assumed"] == "input 0: i64 (8, 1024)"  # one data-parallel rank's share of the batch
    collectives = d["tensor_parallel"]["collectives"]
    assert f"collectives per step ({len(collectives)}:" in text.stdout
    assert {c["mesh_axis"] for c in collectives} == {"tp"}
    assert [row["stage"] for row in d["memory"]["rows"]] == [0, 1, 2, 3]
    cuts = [r["path"] for r in d["rows"] if any(a.startswith("pipeline_cut") for a in r["annotations"])]
    assert cuts == ["model.layers.7", "model.layers.15", "model.layers.23"]
    assert "model.layers.[7,15,23]: pipeline_cut" in text.stdout
