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
