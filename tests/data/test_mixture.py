"""Mixtures (rows drawn by weight from the seed and the step) and resuming mid-stream and
mid-mixture through slapo_fn.train: the losses equal the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from slapo_fn.data import Codec, Cursor, Mixture, PreparedData, StreamData, StreamSource, open_data, prepare
from slapo_fn.data.loading import data_problems
from slapo_fn.errors import ScheduleError
from slapo_fn.train import Checkpointing, resume, train

BYTES = Codec.byte_level()


def _jsonl(file: Path, letter: str, rows: int = 60) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("".join(json.dumps({"text": f"{letter}{i} " + letter * (i % 13)}) + "\n" for i in range(rows)))


@pytest.fixture
def corpora(tmp_path: Path) -> Path:
    _jsonl(tmp_path / "a.jsonl", "a")
    _jsonl(tmp_path / "b" / "part0.jsonl", "b")
    _jsonl(tmp_path / "b" / "part1.jsonl", "B")
    _jsonl(tmp_path / "c.jsonl", "c")
    prepare(tmp_path / "c.jsonl", None, tmp_path / "c-prepared", workers=0, progress=False)
    return tmp_path


def test_rows_are_drawn_by_weight_from_the_seed_and_the_step_alone(corpora: Path) -> None:
    spec = f"{corpora}/a.jsonl:0.7,{corpora}/b:0.2,{corpora}/c-prepared:0.1"
    mix = open_data(spec, BYTES, seq_len=8, seed=3)
    assert isinstance(mix, Mixture) and isinstance(mix.sources[2], Cursor)
    drawn = np.concatenate([mix.choices(step, 64) for step in range(100)])
    assert np.abs(np.bincount(drawn, minlength=3) / len(drawn) - [0.7, 0.2, 0.1]).max() < 0.02
    again = open_data(spec, BYTES, seq_len=8, seed=3)
    assert np.array_equal(again.choices(57, 64), mix.choices(57, 64))  # type: ignore[union-attr]
    assert not np.array_equal(open_data(spec, BYTES, seq_len=8, seed=4).choices(57, 64),  # type: ignore[union-attr]
                              mix.choices(57, 64))
    rows = mix.batch(0, 16)["input_ids"]
    first = [chr(r[0]) if r[0] < 256 else "" for r in rows.tolist()]
    # each row comes from the source drawn for it (row starts are that source's letters or digits)
    letters = {0: "a0123456789 ", 1: "bB0123456789 ", 2: "c0123456789 "}
    assert all(ch == "" or ch in letters[k] for ch, k in zip(first, mix.choices(0, 16)))


def test_a_mixtures_ranks_draw_disjoint_rows(tmp_path: Path) -> None:
    # every character distinct across both sources: a row's bytes say which row it is
    chars = iter(chr(0x4E00 + i) for i in range(4000))
    (tmp_path / "p.txt").write_text("".join(next(chars) for _ in range(800)))
    prepare(tmp_path / "p.txt", None, tmp_path / "p", workers=0, progress=False)
    (tmp_path / "s").mkdir()
    for part in range(2):
        (tmp_path / "s" / f"{part}.jsonl").write_text("".join(
            json.dumps({"text": "".join(next(chars) for _ in range(30))}) + "\n" for _ in range(20)))
    seen: list[set[tuple[int, ...]]] = []
    for rank in range(2):
        mix = open_data(f"{tmp_path}/p:1,{tmp_path}/s:1", BYTES, seq_len=12, seed=0)
        rows = [tuple(r) for step in range(20) for r in mix.batch(step, 8, dp_rank=rank, dp_size=2)["input_ids"]
                .tolist()]
        assert len(rows) == len(set(rows))  # less than an epoch of either source per rank
        seen.append(set(rows))
    assert not seen[0] & seen[1]


def test_mixture_weights_and_sources_are_refused_before_any_rank(corpora: Path) -> None:
    problems = data_problems(f"{corpora}/a.jsonl:0,{corpora}/b:-2", BYTES)
    assert [p.reason.split(": ", 1)[1] for p in problems] == ["a mixture weight must be a positive number, got 0",
                                                              "a mixture weight must be a positive number, got -2"]
    (corpora / "empty.jsonl").write_text("\n")
    empty = data_problems(f"{corpora}/a.jsonl:1,{corpora}/empty.jsonl:1", BYTES)
    assert len(empty) == 1 and "has no rows" in empty[0].reason
    assert "stdlib is a demo corpus" in data_problems(f"stdlib:1,{corpora}/a.jsonl:1", BYTES)[0].reason
    with pytest.raises(ScheduleError, match="positive"):
        Mixture([Cursor(PreparedData.open(corpora / "c-prepared", seq_len=8))], [0.0])


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False))


def _losses(make_data, tmp: Path, steps: int, save_at: int | None = None, resume_from: Path | None = None) \
        -> list[float]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = make_data()
    start = resume(model, optimizer, resume_from, data=data) if resume_from is not None else 0
    checkpoint = Checkpointing(tmp, every=save_at) if save_at is not None else None
    records = train(model, optimizer, data, steps=steps, batch_size=4, start_step=start, checkpoint=checkpoint)
    return [r.loss for r in records]


@pytest.mark.parametrize("what", ["stream", "mixture"])
def test_resuming_mid_stream_and_mid_mixture_gives_the_uninterrupted_losses_bit_for_bit(
        corpora: Path, tmp_path: Path, what: str) -> None:
    def make_data() -> StreamData | Mixture:
        if what == "stream":
            return StreamData(StreamSource(corpora / "b"), BYTES, seq_len=24)
        return open_data(f"{corpora}/a.jsonl:0.5,{corpora}/b:0.3,{corpora}/c-prepared:0.2", BYTES, seq_len=24,
                         seed=1)  # type: ignore[return-value]

    whole = _losses(make_data, tmp_path / "unused", steps=8)
    first = _losses(make_data, tmp_path / "ckpt", steps=5, save_at=5)
    rest = _losses(make_data, tmp_path / "unused", steps=8, resume_from=tmp_path / "ckpt")
    assert first == whole[:5]
    assert rest == whole[5:]  # exactly: ==, not approx
