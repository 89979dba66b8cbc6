"""slapo_fn.data.StreamData: datasets' iterable mode, split between ranks, packed on the fly,
resumed bit for bit from the checkpointed position without replaying the stream.

Corpora are generated into tmp_path; bytes are the tokenizer (no training needed).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from slapo_fn.data import Codec, TokenData
from slapo_fn.data.packing import Packer
from slapo_fn.data.stream import StreamData, StreamSource
from slapo_fn.errors import ScheduleError

BYTES = Codec.byte_level()


def _corpus(folder: Path, files: int, rows: int = 30) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for f in range(files):
        with open(folder / f"part{f}.jsonl", "w") as out:
            for i in range(rows):
                doc = f"<{f}-{i}>" + "abc" * ((i * 5 + f) % 17)
                out.write(json.dumps({"text": doc}) + "\n")
                docs.append(doc)
    return docs


def _counting(codec: Codec, seen: list[str]) -> Codec:
    """``codec`` that records the texts it encodes."""
    def encode_batch(texts: Sequence[str]) -> list[list[int]]:
        seen.extend(texts)
        return codec.encode_batch(texts)
    return Codec(codec.name, codec.vocab, codec.eos_id, encode_batch, codec.decode, codec.tokenizer, codec.encoder)


def _batches(data: StreamData, steps: range, batch: int, rank: int = 0, size: int = 1) -> list[dict[str, torch.Tensor]]:
    return [data.batch(s, batch, dp_rank=rank, dp_size=size) for s in steps]


def test_a_streamed_corpus_packs_into_the_rows_tokendata_packs(tmp_path: Path) -> None:
    _corpus(tmp_path / "c", files=2)
    memory = TokenData.from_source(tmp_path / "c", seq_len=16)
    stream = StreamData(StreamSource(tmp_path / "c"), BYTES, seq_len=16)
    rows = stream.rows(memory.n_train - 1)  # the last one is TokenData's padded remainder
    assert torch.equal(rows["input_ids"], memory.rows[: memory.n_train - 1].long())
    assert torch.equal(rows["labels"], rows["input_ids"]) and bool(rows["attention_mask"].all())


@pytest.mark.parametrize("files", [3, 4])  # 3 over 2 ranks: every other row; 4: whole files per rank
def test_a_resumed_stream_continues_bit_for_bit_across_epochs(
        tmp_path: Path, files: int) -> None:
    _corpus(tmp_path / "c", files=files, rows=90 // files)
    for rank in range(2):
        whole = _batches(StreamData(StreamSource(tmp_path / "c"), BYTES, seq_len=24), range(40), 4, rank, 2)
        # 40 steps: several epochs of this rank's rows
        for cut in (1, 20, 35):
            first = StreamData(StreamSource(tmp_path / "c"), BYTES, seq_len=24)
            _batches(first, range(cut), 4, rank, 2)
            saved = first.state_dict()
            saved = torch.load(_saved(tmp_path, saved), weights_only=True)  # as a checkpoint stores it
            assert saved["epoch"] == (cut == 35), saved["epoch"]  # the last cut is in the second epoch
            again = StreamData(StreamSource(tmp_path / "c"), BYTES, seq_len=24)
            again.load_state_dict(saved)
            rest = _batches(again, range(cut, 40), 4, rank, 2)
            for a, b in zip(rest, whole[cut:]):
                assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resumed_stream_reads_on_from_its_position_not_from_the_start(tmp_path: Path) -> None:
    _corpus(tmp_path / "c", files=2, rows=400)  # more rows than one read
    first = StreamData(StreamSource(tmp_path / "c"), BYTES, seq_len=64)
    read: list[str] = []
    first.codec = _counting(BYTES, read)
    while len(read) <= 300:  # past the first read
        first.rows(1)
    saved, done = first.state_dict(), len(read)
    again: list[str] = []
    resumed = StreamData(StreamSource(tmp_path / "c"), _counting(BYTES, again), seq_len=64)
    resumed.load_state_dict(saved)
    rows = resumed.rows(300)  # more than the examples read and not yet emitted
    assert again[0] == _corpus_docs(tmp_path / "c")[done]  # the document after the last one read
    assert torch.equal(rows["input_ids"], first.rows(300)["input_ids"])


def _corpus_docs(folder: Path) -> list[str]:
    return [json.loads(line)["text"] for f in sorted(folder.iterdir()) for line in f.read_text().splitlines()]


def _saved(tmp_path: Path, state: object) -> Path:
    file = tmp_path / "state.pt"
    torch.save(state, file)
    return file


@pytest.mark.parametrize(("files", "ranks"), [(3, 2), (4, 2), (3, 3), (1, 2)])
def test_streamed_ranks_are_disjoint_and_cover_each_epoch_once(tmp_path: Path, files: int, ranks: int) -> None:
    docs = _corpus(tmp_path / "c", files=files, rows=12)
    seen: list[str] = []
    for rank in range(ranks):
        data = StreamData(StreamSource(tmp_path / "c"), BYTES, seq_len=8)
        ids = torch.cat([data.rows(4, dp_rank=rank, dp_size=ranks)["input_ids"].flatten() for _ in range(60)])
        mine = bytes(i if i < 256 else 0 for i in ids.tolist()).decode().split("\0")  # EOS -> NUL
        first_epoch = mine[: mine.index(mine[0], 1)]  # up to the first document read again
        assert len(first_epoch) == len(set(first_epoch))
        seen += first_epoch
    assert sorted(seen) == sorted(docs)  # disjoint, and together the whole corpus


def test_parquet_saved_datasets_and_dataset_objects_stream(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"doc {i} " + "x" * i for i in range(40)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=7)
    table = datasets.Dataset.from_dict({"text": docs})
    table.save_to_disk(str(tmp_path / "saved"))
    want = np.concatenate([[*d.encode(), 256] for d in docs])[: 10 * 32].reshape(10, 32)
    for source in (StreamSource(tmp_path / "c.parquet"), StreamSource(tmp_path / "saved"),
                   StreamSource(dataset=table), StreamSource(dataset=table.to_iterable_dataset())):
        rows = StreamData(source, BYTES, seq_len=32).rows(10)["input_ids"]
        assert rows.tolist() == want.tolist(), source


def test_a_stream_is_refused_with_no_rows_a_wrong_field_or_mixed_files(tmp_path: Path) -> None:
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "a.parquet").write_bytes(b"")
    with pytest.raises(ScheduleError, match="holds no file with anything in it"):
        StreamData(StreamSource(tmp_path / "e"), BYTES, seq_len=8)
    import datasets

    with pytest.raises(ScheduleError, match="has no rows"):
        StreamData(StreamSource(dataset=datasets.Dataset.from_dict({"text": []})), BYTES, seq_len=8)
    _corpus(tmp_path / "c", files=1)
    with pytest.raises(ScheduleError, match="first row has no 'body' string"):
        StreamData(StreamSource(tmp_path / "c", text_field="body"), BYTES, seq_len=8)
    with pytest.raises(ScheduleError, match="is read as chat, and its first row has no 'messages'"):
        StreamData(StreamSource(tmp_path / "c", format="chat"), BYTES, seq_len=8)
    (tmp_path / "c" / "notes.txt").write_text("a text file")
    with pytest.raises(ScheduleError, match="mixes json and text files"):
        StreamData(StreamSource(tmp_path / "c"), BYTES, seq_len=8)


def test_a_stream_is_read_in_order_and_resumes_only_its_own_state(tmp_path: Path) -> None:
    _corpus(tmp_path / "c", files=1)
    data = StreamData(StreamSource(tmp_path / "c"), BYTES, seq_len=8)
    data.batch(0, 2)
    with pytest.raises(ScheduleError, match="a stream is read in order: step 5 asked where step 1 is next"):
        data.batch(5, 2)
    other = StreamData(StreamSource(tmp_path / "c"), BYTES, seq_len=16)
    with pytest.raises(ScheduleError, match="resume with the corpus, tokenizer"):
        other.load_state_dict(data.state_dict())
    wrong = StreamData(StreamSource(tmp_path / "c"), BYTES, seq_len=8)
    wrong.load_state_dict(data.state_dict())
    with pytest.raises(ScheduleError, match="resume with the saved run's --dp"):
        wrong.batch(1, 4, dp_rank=0, dp_size=2)


def test_packing_apart_keeps_examples_whole_and_marks_their_starts() -> None:
    packer = Packer(seq_len=6, mode="apart", eos_id=0)
    for n in (3, 2, 4, 9):
        ids = np.arange(1, n + 1, dtype=np.int64)
        packer.add(ids, ids)
    rows = []
    while packer.ready:
        rows.append(packer.row())
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 1, 2, 0], [1, 2, 3, 4, 0, 0],
                                                       [1, 2, 3, 4, 5, 6]]
    assert rows[0]["position_ids"].tolist() == [0, 1, 2, 0, 1, 0]
    assert rows[0]["labels"].tolist() == [-100, 2, 3, -100, 2, -100]
    state = packer.state_dict()
    again = Packer(seq_len=6, mode="apart", eos_id=0)
    again.load_state_dict(state)
    assert again.state_dict()["ids"].tolist() == [7, 8, 9]  # the long text's rest, waiting for more
