"""``slapo-fn prepare`` and ``train --data`` at scale (issue 44, the command-line part):
a corpus tokenized once and trained on from its map, streams, mixtures and chat files,
and what the parent refuses before any rank starts.

Every run is a real subprocess with a time bound; corpora and the tokenizer are generated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_cli_data_weights import losses, refusal, run
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from slapo_fn.data import PreparedData, stdlib_corpus, train_bpe

SEQ, BATCH = 32, 4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny LLaMA with a BPE tokenizer, another tokenizer, and a JSON-lines corpus."""
    tmp = tmp_path_factory.mktemp("scale")
    docs = stdlib_corpus(max_bytes=80_000)
    tok = train_bpe(docs, vocab_size=300, save_to=tmp / "model")
    train_bpe(docs[::-1], vocab_size=280, save_to=tmp / "other-tok")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp / "model")
    (tmp / "corpus").mkdir()
    for part in range(2):
        with (tmp / "corpus" / f"part{part}.jsonl").open("w") as f:
            for doc in docs[part::2]:
                f.write(json.dumps({"text": doc}) + "\n")
    return {name: tmp / name for name in ("model", "other-tok", "corpus")}


@pytest.mark.timeout(200)
def test_prepare_once_then_train_on_the_map_at_hugging_faces_loss(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "prepared"
    made = run("prepare", "--data", str(files["corpus"]), "--tokenizer", str(files["model"]), "--out", str(out),
               "--workers", "2", "--no-progress")
    assert made.returncode == 0, made.stderr[-3000:]
    assert f"train on it with --data {out}" in made.stdout
    result = run("train", "--model", str(files["model"]), "--data", str(out), "--steps", "2",
                 "--batch", str(BATCH), "--seq", str(SEQ), "--log-every", "1", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: PreparedData(" in result.stdout
    batch = PreparedData.open(out, seq_len=SEQ).batch(0, BATCH)
    with torch.no_grad():
        want = float(AutoModelForCausalLM.from_pretrained(files["model"])(**batch).loss)
    assert losses(result.stdout)[1] == pytest.approx(want, abs=1e-4)
    other = refusal(run("train", "--model", str(files["model"]), "--data", str(out), "--tokenizer",
                        str(files["other-tok"]), "--steps", "1", "--no-progress"))
    assert "was prepared with tokenizer" in other and "this run's is" in other


@pytest.mark.timeout(200)
def test_bad_data_is_refused_by_the_parent_in_one_message_before_any_rank_starts(files: dict[str, Path],
                                                                                 tmp_path: Path) -> None:
    corpus, model = files["corpus"], str(files["model"])
    weight = refusal(run("train", "--model", model, "--data", f"{corpus}/part0.jsonl:0.7,{corpus}/part1.jsonl:0",
                         "--dp", "2", "--steps", "1", "--no-progress"))
    assert "a mixture weight must be a positive number, got 0" in weight
    (tmp_path / "empty.jsonl").write_text("\n\n")
    both = refusal(run("train", "--model", model, "--data", f"{tmp_path / 'empty.jsonl'}:1,{corpus}:1",
                       "--data-format", "chat", "--dp", "2", "--steps", "1", "--no-progress"))
    assert "2 problems" in both and "has no rows: nothing to stream" in both  # every problem, in one message
    assert "is read as chat, and its first row has no 'messages' list" in both


def test_a_mixture_is_the_same_string_in_a_toml_config(tmp_path: Path) -> None:
    from slapo_fn.cli import _parse
    from slapo_fn.data.spec import parse

    (tmp_path / "run.toml").write_text('[data]\ndata = "web.jsonl:0.7,code/:0.3"\nstream = true\n')
    args = _parse(["train", "--config", str(tmp_path / "run.toml")])
    assert [(s.name, s.weight) for s in parse(args.data).sources] == [("web.jsonl", 0.7), ("code/", 0.3)]
    assert args.stream


@pytest.mark.timeout(200)
def test_fine_tune_on_chat_rows_packed_apart_at_hugging_faces_loss(tmp_path: Path) -> None:
    from slapo_fn.data import Codec, StreamData, StreamSource

    turns = [[{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": f"{2 * i}."}]
             for i in range(40)]
    tok = train_bpe([json.dumps(t) for t in turns], vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(tmp_path / "model")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=True)  # the run turns it off
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    with (tmp_path / "chat.jsonl").open("w") as f:
        f.writelines(json.dumps({"messages": t}) + "\n" for t in turns)
    result = run("train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "chat.jsonl"), "--steps", "1",
                 "--batch", str(BATCH), "--seq", "64", "--log-every", "1", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "chat packed apart" in result.stdout
    rows = StreamData(StreamSource(tmp_path / "chat.jsonl"), Codec.of(tmp_path / "model"), seq_len=64).rows(BATCH)
    with torch.no_grad():
        want = float(AutoModelForCausalLM.from_pretrained(tmp_path / "model")(**rows, use_cache=False).loss)
    assert losses(result.stdout)[1] == pytest.approx(want, abs=1e-4)
