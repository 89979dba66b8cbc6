"""The ``slapo-fn`` command on a family without a recipe: the model's own Hugging Face
``base_model_tp_plan`` schedules it (GPT-NeoX, Gemma2, Phi-3, OLMo2), with sequence parallelism too,
checked by ``verify`` on 2 gloo ranks; a family with neither a recipe nor a plan is refused in one line, before any
process starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

CLI = [sys.executable, "-m", "slapo_fn.cli"]
ROOT = Path(__file__).resolve().parents[1]
NOTE = "not a recipe"

TINY: dict[str, dict[str, Any]] = {
    # a fused per-head [q|k|v] projection, biases, parallel residual
    "gpt_neox": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                 "vocab_size": 128, "max_position_embeddings": 64},
    # grouped-query attention, soft-capping, tied embeddings, four norms per layer
    "gemma2": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64},
    # neither a recipe nor a base_model_tp_plan
    "stablelm": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64},
    # a plan of gathered columns and rows that split their whole input (colwise_gather_output,
    # rowwise_split_input) over a packed [q|k|v] projection
    "phi3": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
             "vocab_size": 128, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1,
             "eos_token_id": 2},
    # q/k RMSNorms over the whole projection: the plan gathers q/k/v for them, and o splits its
    # whole input; under SP the attention gathers the sequence first and o reduce-scatters it back
    "olmo2": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64},
}


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def tiny(folder: Path, model_type: str, **extra: Any) -> str:
    """A folder holding the ``config.json`` of a tiny ``model_type`` (no hub)."""
    AutoConfig.for_model(model_type, **TINY[model_type], **extra).save_pretrained(folder)
    return str(folder)


def own_lines(stderr: str) -> list[str]:
    """The command's own lines of stderr (not the warnings of the libraries it loads)."""
    return [line for line in stderr.splitlines() if line.startswith("slapo-fn")]


@pytest.mark.parametrize("model_type", ["gpt_neox", "gemma2", "phi3"])
def test_explain_uses_the_models_own_plan_with_the_other_knobs(tmp_path: Path, model_type: str) -> None:
    result = run("explain", "--model", tiny(tmp_path, model_type), "--dp", "2", "--tp", "2", "--checkpoint", "1.0")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert f"no recipe for model_type {model_type!r}" in out and "base_model_tp_plan" in out and NOTE in out
    layers, column, row = {
        "gpt_neox": ("gpt_neox.layers", "attention.query_key_value", "attention.dense"),
        "gemma2": ("model.layers", "self_attn.q_proj", "self_attn.o_proj"),
        "phi3": ("model.layers", "self_attn.qkv_proj", "self_attn.o_proj"),
    }[model_type]
    assert f"{layers}.[0,1].{column}: tp=column@tp" in out  # the layers named
    assert f"{layers}.[0,1].{row}: tp=row@tp" in out
    assert f"{row} output P→R@tp  fwd all_reduce" in out
    assert f"checkpoint.at(['{layers}.0', '{layers}.1'])" in out  # the plan's layers take the other knobs
    assert "data_parallel.at(mode='fsdp')" in out


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model_type", "sp"), [
    *(pytest.param(m, sp, id=f"{'sp' if sp else 'tp'}-{m}") for m in ("gpt_neox", "gemma2", "phi3")
      for sp in ([], ["--sp"])),
    pytest.param("olmo2", ["--sp"], id="sp-olmo2"),
])
def test_verify_of_the_models_own_plan_passes_on_two_ranks(tmp_path: Path, model_type: str, sp: list[str]) -> None:
    result = run("verify", "--model", tiny(tmp_path, model_type), "--tp", "2", *sp)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    assert result.stdout.count(NOTE) == 1  # said once, by the first rank
    column = {"gpt_neox": "gpt_neox.layers.0.attention.query_key_value", "gemma2": "model.layers.0.self_attn.v_proj",
              "phi3": "model.layers.0.self_attn.qkv_proj", "olmo2": "model.layers.0.self_attn.q_proj"}
    assert column[model_type] in result.stdout and "OK: verified" in result.stdout


def test_explain_runs_the_plans_layers_and_final_norm_on_sequence_shards(tmp_path: Path) -> None:
    """With --sp, the plan's repeated layers and the final norm its base_model_pp_plan names
    after them form the chain: all-gathers and reduce-scatters in place of all-reduces."""
    result = run("explain", "--model", tiny(tmp_path, "gemma2"), "--tp", "2", "--sp")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "model.layers.[0,1]: sequence_parallel=seq@tp(axis 1)" in out
    assert "model.norm: sequence_parallel=seq@tp(axis 1)" in out
    assert "o_proj output P→S(1)@tp  fwd reduce_scatter" in out and "fwd all_reduce" not in out


@pytest.mark.parametrize("command", [["explain"], ["verify", "--tp", "2"]], ids=["explain", "verify-tp2"])
def test_neither_recipe_nor_plan_is_one_clear_line(tmp_path: Path, command: list[str]) -> None:
    result = run(*command, "--model", tiny(tmp_path, "stablelm"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = own_lines(result.stderr)
    assert len(lines) == 1, result.stderr  # refused before any process started: no rank repeats it
    assert "model_type 'stablelm' has neither a recipe" in lines[0]
    assert "write a recipe" in lines[0] and "add a base_model_tp_plan to its config.json" in lines[0]


def test_a_plan_added_to_config_json_is_used(tmp_path: Path) -> None:
    plan = {"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    folder = tiny(tmp_path, "stablelm")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "base_model_tp_plan": plan}))
    result = run("explain", "--model", folder, "--tp", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "base_model_tp_plan (3 entries)" in result.stdout
    assert "model.layers.[0,1].mlp.down_proj: tp=row@tp" in result.stdout


@pytest.mark.parametrize(("model_type", "plan", "extra", "expected"), [
    ("stablelm", {"layers.*.mlp.up_proj": "packed_rowwise"}, [], "style 'packed_rowwise' has no slapo_fn equivalent"),
    ("stablelm", {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise", "blocks.*.fc": "colwise"},
     ["--sp"], "--sp needs one stack of repeated layers"),
], ids=["unsupported-style", "sequence-parallel-over-two-stacks"])
def test_what_a_plan_cannot_do_is_refused_without_a_traceback(tmp_path: Path, model_type: str,
                                                               plan: dict[str, str] | None, extra: list[str],
                                                               expected: str) -> None:
    folder = tiny(tmp_path, model_type)
    if plan is not None:
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "base_model_tp_plan": plan}))
    result = run("verify", "--model", folder, "--tp", "2", *extra)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert expected in result.stderr
