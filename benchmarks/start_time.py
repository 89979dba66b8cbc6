"""Where a real job's start goes: a small Qwen2 folder with its own tokenizer and weights,
and a 450-row JSONL, trained at ``--tp 2`` — and how fast bad input is refused.

Makes the folder (a BPE tokenizer trained on the standard library, a 4-layer Qwen2 with
random weights saved as safetensors) and the JSONL, then measures, as medians of
``--repeats``:

* ``import_*_s``: a fresh interpreter importing what each phase needs — the command
  line (``slapo_fn.cli``, no torch), the input checks (``slapo_fn.inputs``: torch, the
  data reader), the schedule check (``slapo_fn.job``: the layout engine), a rank
  (``slapo_fn.worker``);
* in this process: ``check_inputs_s`` (config, tokenizer, a sample of the data),
  ``check_schedule_s`` (the schedule on the meta device over a fake process group of 2),
  ``tokenize_s`` (the corpus tokenized and packed, as each rank does), ``build_s`` (a
  rank's model built and the folder's weights loaded, tp=1 here);
* ``first_step_s``: ``slapo-fn train ... --tp 2 --steps 20`` from its start to the line
  of step 1 (launcher, torchrun, two ranks), ``job_s`` to its end, and ``job_cpu_s``
  the CPU time of all its processes (what a loaded machine stretches the wall time of);
* ``refuse_row_s`` / ``refuse_field_s``: a JSONL row without its text and a
  ``--text-field`` no row has, from the start to the refusal (before any rank starts).

Targets (issue 43): first step under 15 s and refusals under 5 s, on 2 CPU cores.

    .venv/bin/python benchmarks/start_time.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from slapo_fn.build import build
from slapo_fn.data import stdlib_corpus, train_bpe
from slapo_fn.inputs import check_inputs, codec
from slapo_fn.job import check_schedule, schedule_for, token_data
from slapo_fn.weights import load_hf

CLI = [sys.executable, "-m", "slapo_fn.cli"]


def make_inputs(folder: Path) -> tuple[Path, Path]:
    model = folder / "qwen2-small"
    tokenizer = train_bpe(stdlib_corpus(max_bytes=300_000), vocab_size=512, save_to=model)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         use_cache=False, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    rows = folder / "rows.jsonl"
    docs = stdlib_corpus(max_bytes=450 * 600)[:450]
    rows.write_text("".join(json.dumps({"text": d[:600]}) + "\n" for d in docs))
    return model, rows


def seconds(argv: list[str], until: str | None = None) -> tuple[float, float, int, float]:
    """(seconds to the first stdout line holding ``until``, to the end, exit code, CPU
    seconds of the command and every process below it)."""
    cpu = _children_cpu()
    began = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if seen is None and until is not None and until in line:
            seen = time.perf_counter() - began
    code = proc.wait()
    end = time.perf_counter() - began
    return (seen if seen is not None else end), end, code, _children_cpu() - cpu


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def imported(module: str) -> float:
    return seconds([sys.executable, "-c", f"import {module}"])[1]


def options(model: Path, rows: Path, **given: object) -> Namespace:
    from slapo_fn.cli import _parsers

    parsed = _parsers()[1]["train"].parse_args(["--model", str(model), "--data", str(rows), "--tp", "2"])
    parsed.command = "train"
    for k, v in given.items():
        setattr(parsed, k, v)
    return parsed


def timed(fn: object, *args: object) -> float:
    began = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    out: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        out.setdefault(name, []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        model, rows = make_inputs(Path(tmp))
        bad = Path(tmp, "bad.jsonl")
        bad.write_text(rows.read_text() + '{"txt": "a row without its text"}\n')
        job = [*CLI, "train", "--model", str(model), "--data", str(rows), "--tp", "2", "--seq", "128", "--batch",
               "8", "--steps", "20", "--log-every", "1", "--no-progress"]
        for _ in range(args.repeats):
            for name, module in (("cli", "slapo_fn.cli"), ("inputs", "slapo_fn.inputs"), ("job", "slapo_fn.job"),
                                 ("worker", "slapo_fn.worker")):
                add(f"import_{name}_s", imported(module))
            o = options(model, rows, seq=128, batch=8)
            config = check_inputs(o)
            add("check_inputs_s", timed(check_inputs, o))
            add("check_schedule_s", timed(check_schedule, o, config))
            add("tokenize_s", timed(token_data, o, codec(o)))
            one = options(model, rows, seq=128, batch=8, tp=1)
            began = time.perf_counter()
            load_hf(build(schedule_for(one, None, meta=True, say=False), init="empty"), model)
            add("build_s", time.perf_counter() - began)
            first, whole, code, cpu = seconds(job, until="step 1 loss")
            assert code == 0, code
            add("first_step_s", first)
            add("job_s", whole)
            add("job_cpu_s", cpu)
            for name, argv in (("refuse_row_s", [*job[:5], str(bad), *job[6:]]),
                               ("refuse_field_s", [*job, "--text-field", "body"])):
                _, took, code, _ = seconds(argv)
                assert code == 2, (name, code)
                add(name, took)
    print(json.dumps({"benchmark": "start_time", "cores": len(os.sched_getaffinity(0)),
                      "load_average": round(os.getloadavg()[0], 1),
                      **{k: round(statistics.median(v), 2) for k, v in out.items()}}))


if __name__ == "__main__":
    main()
