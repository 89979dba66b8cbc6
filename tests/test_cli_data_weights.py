"""``slapo-fn`` with real weights and real data (issue 13, the command-line part):
``--model`` a Hugging Face folder (weights read into the shards), ``--data`` tokenized
and packed (``--tokenizer``, the folder's tokenizer, ``stdlib``), eval losses, resume at
the data position, ``export`` and ``--export-to``, and ``make demo``.

Every run is a real subprocess with a time bound; the numbers are checked against
Hugging Face's own model on the same batch (``TokenData``'s, computed here).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from slapo_fn import build, create_schedule, load
from slapo_fn.data import TokenData, stdlib_corpus, train_bpe
from slapo_fn.hf import recompute_buffers
from slapo_fn.options import EVAL_FRACTION
from slapo_fn.presets import build_model

CLI = [sys.executable, "-m", "slapo_fn.cli"]
ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH = 32, 4


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def losses(stdout: str, kind: str = "loss") -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(rf"^step (\d+) {kind} ([\d.]+)", stdout, re.M)}


def refusal(result: subprocess.CompletedProcess[str]) -> str:
    """The one message of a refused command: exit 2, no traceback, said once."""
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    text = "\n".join(lines[next(i for i, line in enumerate(lines) if line.startswith("slapo-fn")):])
    assert sum(line.startswith("slapo-fn") for line in text.splitlines()) == 1, text
    return text


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny LLaMA saved with ``save_pretrained`` and a BPE tokenizer; the same config
    without weights; corpora as a text file and as JSONL."""
    tmp = tmp_path_factory.mktemp("hf")
    docs = [d for d in stdlib_corpus(max_bytes=60_000)]
    tok = train_bpe(docs, vocab_size=300, save_to=tmp / "model")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp / "model")
    config.save_pretrained(tmp / "config-only")
    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp / "vocab128")
    text = "\n".join(docs)[:20_000]
    (tmp / "corpus.txt").write_text(text)
    with (tmp / "corpus.jsonl").open("w") as f:
        for line in text.splitlines():
            f.write(json.dumps({"text": line}) + "\n")
    (tmp / "empty").mkdir()
    return {name: tmp / name for name in ("model", "config-only", "vocab128", "corpus.txt", "corpus.jsonl", "empty")}


def _hf_loss(folder: Path, corpus: Path) -> float:
    """Hugging Face's own loss on the first global batch that ``slapo-fn train`` sees (its
    default held-out split, with --eval-every or without)."""
    batch = TokenData.from_source(corpus, folder, seq_len=SEQ, seed=0, eval_fraction=EVAL_FRACTION).batch(0, BATCH)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        return float(model(**batch).loss)


@pytest.mark.timeout(200)
def test_train_at_tp2_from_a_folder_starts_at_hugging_faces_loss(files: dict[str, Path]) -> None:
    result = run("train", "--model", str(files["model"]), "--data", str(files["corpus.txt"]), "--tp", "2",
                 "--steps", "2", "--batch", str(BATCH), "--seq", str(SEQ), "--log-every", "1", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"loaded weights from {files['model']}" in result.stdout
    assert "random" not in result.stdout
    assert losses(result.stdout)[1] == pytest.approx(_hf_loss(files["model"], files["corpus.txt"]), abs=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fine_tune_at_pp2_x_tp2_from_a_folder_starts_at_hugging_faces_loss(files: dict[str, Path]) -> None:
    result = run("train", "--model", str(files["model"]), "--data", str(files["corpus.txt"]), "--pp", "2",
                 "--tp", "2", "--steps", "1", "--batch", str(BATCH), "--seq", str(SEQ), "--microbatches", "2",
                 "--log-every", "1", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"loaded weights from {files['model']}" in result.stdout
    # a pipeline's loss is the mean of its microbatch means: equal-sized full rows here
    assert losses(result.stdout)[1] == pytest.approx(_hf_loss(files["model"], files["corpus.txt"]), abs=1e-4)


@pytest.mark.timeout(120)
def test_a_folder_without_weights_says_it_trains_from_random_ones(files: dict[str, Path]) -> None:
    result = run("train", "--model", str(files["config-only"]), "--steps", "1", "--batch", "2", "--seq", "16",
                 "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stdout.splitlines() if "random" in line]
    assert len(said) == 1 and "no weights" in said[0] and str(files["config-only"]) in said[0]
    assert "loaded weights" not in result.stdout


@pytest.mark.timeout(120)
def test_jsonl_with_eval_every_prints_eval_losses(files: dict[str, Path]) -> None:
    result = run("train", "--model", str(files["model"]), "--data", str(files["corpus.jsonl"]), "--steps", "4",
                 "--eval-every", "2", "--eval-fraction", "0.2", "--eval-batches", "2", "--batch", str(BATCH),
                 "--seq", str(SEQ), "--log-every", "1", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    evals = losses(result.stdout, "eval_loss")
    assert sorted(evals) == [2, 4]
    assert all(0 < v < 10 for v in evals.values())
    assert "eval sequences" in result.stdout  # the data line: train + eval rows


@pytest.mark.timeout(200)
def test_resume_continues_at_the_data_position(files: dict[str, Path], tmp_path: Path) -> None:
    common = ["train", "--model", str(files["model"]), "--data", str(files["corpus.txt"]), "--batch", str(BATCH),
              "--seq", str(SEQ), "--log-every", "1", "--no-progress", "--lr", "1e-2"]
    whole = run(*common, "--steps", "4")
    first = run(*common, "--steps", "2", "--checkpoint-dir", str(tmp_path))
    resumed = run(*common, "--steps", "4", "--checkpoint-dir", str(tmp_path), "--resume")
    for r in (whole, first, resumed):
        assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout
    expected, got = losses(whole.stdout), losses(resumed.stdout)
    assert sorted(got) == [3, 4]
    assert all(got[s] == expected[s] for s in got), (expected, got)
    other = run(*common[:-2], "--seq", str(SEQ // 2), "--steps", "6", "--checkpoint-dir", str(tmp_path), "--resume")
    said = refusal(other)  # the option that differs, with both values, before any rank starts
    assert f"saved by a run with other data: --seq {SEQ} (this run: {SEQ // 2})" in said, said


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_and_export_to_give_the_trained_models_logits(files: dict[str, Path], tmp_path: Path) -> None:
    ckpt, direct, exported = tmp_path / "ckpt", tmp_path / "direct", tmp_path / "exported"
    trained = run("train", "--model", str(files["model"]), "--data", str(files["corpus.txt"]), "--tp", "2",
                  "--steps", "3", "--batch", str(BATCH), "--seq", str(SEQ), "--lr", "1e-2", "--no-progress",
                  "--checkpoint-dir", str(ckpt), "--export-to", str(direct))
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = run("export", str(ckpt), str(exported), "--model", str(files["model"]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"exported step 3 of {ckpt}" in result.stdout
    # the reference: a single-process build loaded from the checkpoint
    reference = build(create_schedule(build_model(str(files["model"]), meta=True)), init="empty")
    assert load(reference, None, ckpt) == 3
    recompute_buffers(reference)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
        original = AutoModelForCausalLM.from_pretrained(files["model"])(ids).logits
        for folder in (exported, direct):
            assert (folder / "tokenizer.json").is_file()
            got = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.allclose(original, want, atol=1e-3)  # it did train


@pytest.mark.parametrize(("case", "expected"), [
    (["train", "--data", "{corpus.txt}", "--tokenizer", "{missing}"], ["'--tokenizer'", "no such folder"]),
    (["train", "--data", "{corpus.txt}", "--tokenizer", "{empty}"], ["'--tokenizer'", "holds no tokenizer"]),
    (["train", "--model", "{vocab128}", "--data", "stdlib", "--tokenizer", "{model}"],
     ["'--tokenizer'", "tokens; the model's vocabulary has only 128"]),
    (["train", "--model", "{config-only}", "--data", "{corpus.txt}", "--eval-every", "2"],
     ["'--eval-every'", "no held-out split", "--tokenizer"]),
    (["train", "--data", "stdlib:lots"], ["'--data'", "stdlib:lots"]),
    (["export", "{empty}", "{missing}", "--model", "{model}"], ["'CHECKPOINT_DIR'", "no checkpoint here"]),
], ids=["tokenizer-missing", "tokenizer-empty-folder", "vocab-exceeds-model", "eval-without-split",
        "stdlib-size", "export-empty-dir"])
@pytest.mark.timeout(120)
def test_bad_input_gets_one_typed_message(files: dict[str, Path], case: list[str], expected: list[str]) -> None:
    named = {**{k: str(v) for k, v in files.items()}, "missing": str(files["empty"] / "no-such")}
    text = refusal(run(*[named[a[1:-1]] if a.startswith("{") else a for a in case]))
    for part in expected:
        assert part in text, text


@pytest.mark.timeout(120)
def test_lifecycle_setup_writes_a_tokenizer_and_a_config_folder(tmp_path: Path) -> None:
    folder = tmp_path / "base"
    result = subprocess.run([sys.executable, "examples/lifecycle_setup.py", str(folder), "--vocab", "300",
                             "--corpus-bytes", "50000"], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 300
    assert (folder / "tokenizer.json").is_file() and not (folder / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_make_demo_runs_the_lifecycle(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = subprocess.run(["make", "-o", ".venv/.installed", "demo", f"DEMO={out}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    text = result.stdout
    assert "no weights" in text and f"loaded weights from {out}/hf" in text and "eval_loss" in text
    ended = float(re.search(r"pre-training \(dp2 x tp2\) ended at: step 50 loss ([\d.]+)", text).group(1))
    began = float(re.search(r"fine-tuning \(pp2 x tp2\) began at:  step 1 loss ([\d.]+)", text).group(1))
    first = float(re.search(r"^step 1 loss ([\d.]+)", text, re.M).group(1))  # pre-training's, from random weights
    assert abs(began - ended) < 0.5 < first - began
    assert (out / "hf" / "model.safetensors").is_file()
    assert "llama-7b" in text and "128 ranks" in text
