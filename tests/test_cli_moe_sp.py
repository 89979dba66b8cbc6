"""``slapo-fn`` on a mixture-of-experts model with ``--sp``: the Mixtral recipe runs the
decoder layers on sequence shards and each experts' block on the whole sequence (its input
all-gathered, its output split back), so that the router reads every token. ``explain``
shows those two boundaries; ``verify`` checks the numbers on 2 gloo ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

CLI = [sys.executable, "-m", "slapo_fn.cli"]
ROOT = Path(__file__).resolve().parents[1]


def _mixtral(folder: Path) -> str:
    AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         vocab_size=128, max_position_embeddings=64).save_pretrained(folder)
    return str(folder)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_explain_gathers_the_tokens_for_the_experts_block(tmp_path: Path) -> None:
    result = _run("explain", "--model", _mixtral(tmp_path), "--tp", "2", "--sp", "--seq", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "model.layers.[0,1]: sequence_parallel=seq@tp(axis 1)" in out
    assert "model.layers.[0,1].mlp: sync=fwd_pre S(1)→R@tp (all_gather), fwd_post R→S(1)@tp (local)" in out
    assert "model.layers.*.mlp input S(1)→R@tp  fwd all_gather" in out
    assert "model.layers.*.mlp output R→S(1)@tp  bwd all_gather" in out
    # the attention's row scatters its output along the sequence: no all-reduce but the experts'
    assert "o_proj output P→S(1)@tp  fwd reduce_scatter" in out


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_verify_mixtral_with_sequence_parallelism_on_two_ranks(tmp_path: Path) -> None:
    result = _run("verify", "--model", _mixtral(tmp_path), "--tp", "2", "--sp", "--seq", "16")
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    assert "OK: verified" in result.stdout and "21 gradients" in result.stdout
