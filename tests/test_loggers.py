"""Honest figures in the training logs (slapo_fn.loggers): a step's own time with its
evaluation, its save and the first step apart; a rank's TFLOP/s and MFU; every rank's
peak memory."""

from __future__ import annotations

import io
import json
from pathlib import Path

from test_train import ToyLM, data

from slapo_fn.data import TokenData
from slapo_fn.loggers import ConsoleLog, JsonlLog
from slapo_fn.train import Checkpointing, adamw, train


def test_eval_saves_and_the_first_step_are_timed_apart_and_flops_give_mfu(tmp_path: Path) -> None:
    model = ToyLM()
    rows = TokenData.from_token_ids([[i % 31 + 1 for i in range(400)]], eos_id=0, vocab=32, seq_len=12,
                                    eval_fraction=0.2)
    out = io.StringIO()
    console = ConsoleLog(every=1, start=0, total=4, progress=False, out=out)
    metrics = JsonlLog(tmp_path / "m.jsonl")
    records = train(model, adamw(model, lr=1e-2), rows, steps=4, batch_size=4, eval_every=2, memory=True,
                    checkpoint=Checkpointing(tmp_path / "ckpt", every=2), log=[console, metrics], flops=2e6,
                    peak_flops=1e9)
    console.finish()
    metrics.close()
    assert [r.first for r in records] == [True, False, False, False]
    assert [r.eval_seconds is not None for r in records] == [False, True, False, True]
    assert [r.save_seconds is not None for r in records] == [False, True, False, True]
    for r in records:
        assert r.tflops == 2e6 / r.seconds / 1e12 and r.mfu == 2e6 / r.seconds / 1e9
        assert r.tokens_per_s == r.tokens / r.seconds and r.peak_mem_by_rank == (r.peak_mem_bytes,)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1 loss ") and " TFLOP/s " in lines[0] and " MFU " in lines[0]
    mean = sum(r.seconds for r in records[1:]) / 3
    evals = sum(r.eval_seconds or 0.0 for r in records)
    saves = sum(r.save_seconds or 0.0 for r in records)
    assert lines[-1] == (f"done: loss {records[0].loss:.4f} -> {records[-1].loss:.4f} over steps 1..4; step "
                         f"{mean:.3f} s (first step {records[0].seconds:.2f} s, eval {evals:.2f} s, saves "
                         f"{saves:.2f} s apart)")
    row = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[1])
    assert "first" not in row  # only the first step says so
    assert {"eval_seconds", "save_seconds", "tflops", "mfu", "peak_mem_by_rank"} <= set(row)


def test_a_run_that_does_not_finish_never_says_done() -> None:
    out = io.StringIO()
    console = ConsoleLog(every=1, start=0, total=4, progress=False, out=out)
    model = ToyLM()
    train(model, adamw(model, lr=1e-2), data(), steps=2, batch_size=4, log=[console])
    console.close()  # what a failed run does
    assert "done:" not in out.getvalue() and out.getvalue().count("\n") == 2
