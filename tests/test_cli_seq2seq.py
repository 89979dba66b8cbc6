"""``slapo-fn train``, ``verify`` and ``explain`` on encoder-decoders (T5, Bart): the decoder
reads the labels shifted right (:class:`slapo_fn.train.Seq2Seq`), as Hugging Face's models
do when given labels. Through the command line, as real processes where ranks start."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slapo_fn.cli import main
from slapo_fn.presets import build_model
from slapo_fn.train import Seq2Seq

CLI = [sys.executable, "-m", "slapo_fn.cli"]
ROOT = Path(__file__).resolve().parents[1]
T5 = ["--model", "t5-tiny", "--seq", "16", "--batch", "4", "--steps", "3", "--no-progress", "--log-every", "1"]


def run(*args: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def losses(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step \d+ loss ([\d.]+)", stdout, re.M)]


def test_the_decoder_reads_the_labels_shifted_right_as_the_model_does_given_labels() -> None:
    model = build_model("bart-tiny")
    labels = torch.tensor([[5, 6, 7, -100]])
    objective = Seq2Seq.of(model)
    assert objective is not None and Seq2Seq.of(build_model("llama-tiny")) is None
    ours = objective.inputs({"input_ids": labels.clamp(min=0), "labels": labels})["decoder_input_ids"]
    model.eval()
    with torch.no_grad():  # Bart given labels makes its decoder inputs itself: the same logits
        theirs = model(labels.clamp(min=0), labels=labels).logits
        mine = model(labels.clamp(min=0), decoder_input_ids=ours).logits
        loss = model(labels.clamp(min=0), labels=labels).loss
    torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(objective.loss(mine, labels), loss)


@pytest.mark.timeout(300)
def test_t5_trains_at_dp2_through_the_command_line_as_one_process_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *T5]) == 0
    reference = losses(capsys.readouterr().out)
    done = run("train", *T5, "--dp", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    got = losses(done.stdout)
    assert len(got) == 3 and all(math.isfinite(x) for x in got)
    assert got[-1] < got[0]
    assert got == pytest.approx(reference, rel=1e-4)


@pytest.mark.slow  # two ranks started by the command (about 30 s on a loaded machine)
@pytest.mark.timeout(300)
def test_t5_trains_at_tp2_through_the_command_line_as_one_process_does(capsys: pytest.CaptureFixture[str]) -> None:
    """T5's heads over two ranks train as one process does, to the printed digits. Built
    from meta with its attention at std 1 (before build initialised parents as Hugging
    Face does) the model was so ill conditioned that fp32 rounding moved the loss by 1e-3
    by step 3: the tensor-parallel run then looked wrong without being so."""
    assert main(["train", *T5]) == 0
    reference = losses(capsys.readouterr().out)
    done = run("train", *T5, "--tp", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert losses(done.stdout) == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow  # two ranks started by the command (about 30 s on a loaded machine); the recipe at tp=2 is
@pytest.mark.timeout(200)  # checked in the default suite by tests/recipes/test_bart_recipe.py
def test_verify_at_tp2_finds_bart_equal_to_the_unscheduled_model() -> None:
    done = run("verify", "--model", "bart-tiny", "--tp", "2", "--seq", "8", "--batch", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "OK: verified 2 outputs" in done.stdout
    assert "model.decoder.layers.1.encoder_attn.q_proj" in done.stdout  # the cross-attention is sharded too


def test_explain_shows_an_encoder_decoder_cut_through_both_stacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--model", "t5-tiny", "--pp", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "encoder.block.1: pipeline_cut=stage cut after" in out and "pipeline stages (2):" in out
    assert "decoder.block.[0,1].layer.1.EncDecAttention.q: tp=column@tp" in out


def test_a_zero_bubble_schedule_is_refused_before_any_rank_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *T5, "--pp", "2", "--schedule", "zbv"]) != 0
    captured = capsys.readouterr()
    said = (captured.out + captured.err).strip().splitlines()
    assert said[0].startswith("slapo-fn train: '--schedule': schedule 'zbv' splits the backward in two"), said
    assert len(said) == 2 and "fix: use 'gpipe' or '1f1b'" in said[1]
    assert "step 1" not in captured.out
