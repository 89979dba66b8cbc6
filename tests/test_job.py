"""What a run's options build and what the launcher checks before spawning (slapo_fn.job,
slapo_fn.inputs), in this process: the held-out split, --text-field, a refused --resume,
--help."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import slapo_fn as sf
from slapo_fn import inputs, job
from slapo_fn.cli import _parsers
from slapo_fn.errors import CommandLineError


def options(**given: object) -> argparse.Namespace:
    """``slapo-fn train``'s defaults, with ``given`` instead."""
    parsed = _parsers()[1]["train"].parse_args([])
    parsed.command = "train"
    for key, value in given.items():
        setattr(parsed, key, value)
    return parsed


def test_the_held_out_split_is_the_same_with_eval_every_or_without(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"body": f"document {i} " * 20}) + "\n" for i in range(60)))
    plain = options(data=str(corpus), tokenizer="bytes", text_field="body", seq=16)
    evaluating = options(data=str(corpus), tokenizer="bytes", text_field="body", seq=16, eval_every=5)
    rows = [job.token_data(o, inputs.codec(o)) for o in (plain, evaluating)]
    assert rows[0].n_train == rows[1].n_train < rows[0].rows.shape[0]  # 5% held out either way
    assert torch.equal(rows[0].rows, rows[1].rows)
    assert inputs.sample_problems(plain, inputs.codec(plain)) == []
    wrong = options(data=str(corpus), tokenizer="bytes", seq=16)  # --text-field text: the rows have 'body'
    problems = inputs.sample_problems(wrong, inputs.codec(wrong))
    assert problems and problems[0].path == f"{corpus}:1" and "has no 'text' field (fields: body)" in problems[0].reason


def test_a_refused_resume_names_the_options_that_differ_with_both_values(tmp_path: Path) -> None:
    saved = options(seq=64, seed=0, batch=8)
    sf.save(nn.Linear(2, 2), None, tmp_path, step=4, meta={"options": inputs.resumed_options(saved)})
    again = options(seq=32, seed=1, batch=8, resume=True, checkpoint_dir=str(tmp_path), steps=10)
    [problem] = inputs.resume_problems(again)
    assert problem.path == "--resume"
    assert problem.reason == (f"the checkpoint at step 4 in {tmp_path} was saved by a run with other data: --seq 64 "
                              "(this run: 32); --seed 0 (this run: 1)")
    assert problem.fix.startswith("resume with the saved run's --seq, --seed")
    assert inputs.resume_problems(options(seq=64, seed=0, batch=8, resume=True, checkpoint_dir=str(tmp_path),
                                          steps=10)) == []


@pytest.mark.parametrize("command", ["train", "explain", "verify", "tune", "export"])
def test_help_has_text_and_the_default_of_every_flag(command: str) -> None:
    parser = _parsers()[1][command]
    text = parser.format_help()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"
        if action.option_strings and action.default is not None and action.default is not False:
            shown = f"(default: {action.default})"
            assert shown in " ".join(text.split()), f"{command} {action.option_strings[0]}: {shown} not shown"


def test_explain_hsdp_replicates_over_one_axis_and_shards_over_the_other(capsys: pytest.CaptureFixture[str]) -> None:
    from slapo_fn.cli import main

    assert main(["explain", "--model", "llama-tiny", "--dp", "4", "--dp-mode", "hsdp", "--dp-shard", "2", "--seq",
                 "32", "--hardware", "none", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mesh"] == {"dp_replicate": 2, "dp": 2}
    assert set(d["by_axis"]["dp"]) == {"all_gather", "reduce_scatter"} and set(d["by_axis"]["dp_replicate"]) == {
        "all_reduce"}
    assert main(["explain", "--dp", "4", "--dp-mode", "hsdp"]) == 2
    assert "'--dp-shard': --dp-mode hsdp shards over --dp-shard ranks" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU may run them")
def test_float8_and_async_tp_are_refused_before_any_rank_starts_where_no_gpu_runs_them() -> None:
    """The launcher's check (``check_schedule``), before the model is read: one problem
    per flag, each naming it (the command line says them once, exit code 2)."""
    options = argparse.Namespace(command="train", schedule="1f1b", float8=True, async_tp=True)
    with pytest.raises(CommandLineError) as e:
        job.check_schedule(options, None)
    assert e.value.paths == ("--float8", "--async-tp"), e.value
    assert all(p.fix.startswith("drop --") for p in e.value.problems), e.value
