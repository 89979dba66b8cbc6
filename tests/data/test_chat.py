"""Chat fine-tuning data: the tokenizer's own chat template, loss on assistant turns only,
and packing that keeps examples apart (position ids where the family reads them, else one
example per row) — checked against the model itself.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from slapo_fn.data import Codec, StreamData, StreamSource, open_data, train_bpe
from slapo_fn.data.attention import packing_for
from slapo_fn.data.chat import render_chat
from slapo_fn.errors import ScheduleError

#: ChatML, as Qwen2's tokenizers have it (with a generation prompt).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
     {"role": "assistant", "content": "Six, of course."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "Say hello in French."}, {"role": "assistant", "content": "Bonjour !"}],
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    texts = [json.dumps(c) for c in CONVERSATIONS] * 20
    tok = train_bpe(texts, vocab_size=320)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(tmp_path_factory.mktemp("tok") / "tok")
    return tok


def test_only_assistant_turns_and_their_end_of_turn_are_trained_on(tokenizer: PreTrainedTokenizerBase) -> None:
    ids, labels = render_chat(tokenizer, CONVERSATIONS[0])
    assert ids.tolist() == tokenizer(tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False),
                                     add_special_tokens=False)["input_ids"]
    trained = tokenizer.decode(ids[labels != -100])
    assert trained == "4<|im_end|>\nSix, of course.<|im_end|>\n"
    assert np.array_equal(labels[labels != -100], ids[labels != -100])
    assert "What is" in tokenizer.decode(ids[labels == -100]) and "<|im_start|>assistant" in tokenizer.decode(
        ids[labels == -100])


@pytest.mark.parametrize(("messages", "match"), [
    ("hello", "not a list of turns"),
    ([{"role": "user"}, {"content": "x"}], "turn 1 of a row's messages"),
    ([{"role": "user", "content": "only a question"}], "no assistant turn"),
])
def test_malformed_chat_rows_are_refused(tokenizer: PreTrainedTokenizerBase, messages: object, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        render_chat(tokenizer, messages, "chat.jsonl")


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{{ messages | length }}" + CHATML  # the turn count first: prefixes change
    with pytest.raises(ScheduleError, match="does not render the conversation up to turn"):
        render_chat(tok, CONVERSATIONS[1])


def _llama(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def test_chat_rows_packed_apart_give_each_example_its_own_logits(tmp_path: Path,
                                                                 tokenizer: PreTrainedTokenizerBase) -> None:
    with open(tmp_path / "chat.jsonl", "w") as f:
        for c in CONVERSATIONS * 4:
            f.write(json.dumps({"messages": c}) + "\n")
    codec = Codec.of(tokenizer)
    data = StreamData(StreamSource(tmp_path / "chat.jsonl"), codec, seq_len=96)
    assert data.format == "chat" and data.mode == "apart"
    rows = data.rows(3)
    assert "attention_mask" not in rows  # a mask would turn the packed reading off
    model = _llama(len(tokenizer))
    with torch.no_grad():
        packed = model(rows["input_ids"], position_ids=rows["position_ids"], use_cache=False).logits
    starts = (rows["position_ids"] == 0).nonzero().tolist()
    checked = 0
    for (r, s), nxt in zip(starts, [*starts[1:], [None, None]]):
        end = nxt[1] if nxt[0] == r else 96
        ids = rows["input_ids"][r, s:end]
        if rows["labels"][r, s:end].eq(-100).all():
            continue  # padding
        with torch.no_grad():
            alone = model(ids[None], use_cache=False).logits[0]
        assert torch.allclose(packed[r, s:end], alone, atol=1e-5)
        checked += 1
    assert checked >= 4
    assert rows["labels"][rows["position_ids"] == 0].eq(-100).all()  # no example predicts the next one's start


def test_families_whose_attention_ignores_packed_positions_get_one_example_per_row(
        tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    assert packing_for(LlamaConfig(vocab_size=100)) == "apart"
    assert packing_for(AutoConfig.for_model("opt", vocab_size=100)) == "padded"
    with open(tmp_path / "chat.jsonl", "w") as f:
        for c in CONVERSATIONS:
            f.write(json.dumps({"messages": c}) + "\n")
    data = open_data(str(tmp_path / "chat.jsonl"), Codec.of(tokenizer), seq_len=96, chat_packing="padded")
    rows = data.batch(0, 3)
    assert "position_ids" not in rows
    for r in range(3):  # one conversation per row, then padding masked out
        real = int(rows["attention_mask"][r].sum())
        assert rows["attention_mask"][r, :real].all() and not rows["attention_mask"][r, real:].any()
        assert tokenizer.decode(rows["input_ids"][r, :real]).count("<|im_start|>user") >= 1


def test_a_mixture_of_chat_and_text_keeps_chat_examples_apart(tmp_path: Path,
                                                             tokenizer: PreTrainedTokenizerBase) -> None:
    with open(tmp_path / "chat.jsonl", "w") as f:
        for c in CONVERSATIONS * 5:
            f.write(json.dumps({"messages": c}) + "\n")
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": f"plain text {i} " * 9}) + "\n"
                                                 for i in range(30)))
    mix = open_data(f"{tmp_path}/chat.jsonl:0.5,{tmp_path}/text.jsonl:0.5", Codec.of(tokenizer), seq_len=64)
    rows = mix.batch(0, 8)
    assert set(rows) == {"input_ids", "labels", "position_ids"}
    text_rows = [r for r in range(8) if mix.choices(0, 8)[r] == 1]
    for r in text_rows:  # a text row: one sequence, trained on every token
        assert rows["position_ids"][r].tolist() == list(range(64))
        assert torch.equal(rows["labels"][r], rows["input_ids"][r])
