"""slapo_fn.data.prepare and PreparedData: tokenize once, map, read each rank's own rows.

Corpora are generated into tmp_path (a tokenizer is trained on them in a second); worker
processes are used once, the rest runs in-process (workers=0) to stay fast.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slapo_fn.data import Codec, PreparedData, TokenData, prepare, read_documents, train_bpe
from slapo_fn.data.manifest import DOCUMENTS, MANIFEST, TOKENS, Manifest
from slapo_fn.data.order import shuffled
from slapo_fn.data.preparing import _read_lines, _Task
from slapo_fn.errors import ScheduleError


def _corpus(folder: Path, files: int = 3, rows: int = 40) -> list[str]:
    """JSON-lines files of numbered documents of varied length; returns the documents in order."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for f in range(files):
        with open(folder / f"part{f}.jsonl", "w") as out:
            for i in range(rows):
                doc = f"document {f}-{i}: " + "the quick brown fox ü " * (1 + (i * 7 + f) % 23)
                out.write(json.dumps({"text": doc, "id": i}) + "\n")
                docs.append(doc)
    return docs


def _expected(docs: list[str], codec: Codec) -> list[int]:
    return [t for ids in codec.encode_batch(docs) for t in (*ids, codec.eos_id)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    train_bpe(_corpus(folder / "corpus"), vocab_size=400, save_to=folder / "tok")
    return folder / "tok"


# --------------------------------------------------------------------------- prepare


def test_prepare_in_worker_processes_writes_the_tokens_the_documents_and_a_manifest(
        tmp_path: Path, tokenizer: Path) -> None:
    docs = _corpus(tmp_path / "c")
    codec = Codec.of(tokenizer)
    manifest = prepare(tmp_path / "c", tokenizer, tmp_path / "p", workers=2, chunk_bytes=1 << 10, progress=False)
    want = _expected(docs, codec)
    ids = np.fromfile(tmp_path / "p" / TOKENS, dtype=np.uint16)
    assert ids.tolist() == want
    ends = np.fromfile(tmp_path / "p" / DOCUMENTS, dtype=np.int64)
    assert ends.tolist() == np.cumsum([len(ids) + 1 for ids in codec.encode_batch(docs)]).tolist()
    assert (manifest.tokens, manifest.documents, manifest.dtype) == (len(want), len(docs), "uint16")
    assert manifest.tokenizer.fingerprint == codec.fingerprint and manifest.tokenizer.vocab == codec.vocab
    files = sorted((tmp_path / "c").iterdir())
    assert [(Path(s.path).name, s.bytes, s.sha256) for s in manifest.sources] == [
        (f.name, f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest()) for f in files]
    assert Manifest.read(tmp_path / "p") == manifest
    assert Codec.of(tmp_path / "p" / "tokenizer").fingerprint == codec.fingerprint  # saved beside the tokens


def test_prepare_reads_parquet_and_text_files_and_skips_empty_documents(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "c").mkdir()
    pq.write_table(pa.table({"text": ["alpha", "", None, "beta"]}), tmp_path / "c" / "a.parquet", row_group_size=2)
    (tmp_path / "c" / "b.txt").write_text("gamma")
    prepare(tmp_path / "c", None, tmp_path / "p", workers=0, progress=False)
    assert np.fromfile(tmp_path / "p" / TOKENS, dtype=np.uint16).tolist() == _expected(
        ["alpha", "beta", "gamma"], Codec.byte_level())


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=30), chunk=st.integers(1, 64),
       trailing=st.booleans())
def test_line_aligned_chunks_read_every_row_once(tmp_path_factory: pytest.TempPathFactory, lengths: list[int],
                                                 chunk: int, trailing: bool) -> None:
    file = tmp_path_factory.mktemp("lines") / "c.jsonl"
    rows = [json.dumps({"text": "x" * n + str(i)}) for i, n in enumerate(lengths)]
    file.write_text("\n".join(rows) + ("\n" if trailing else ""))
    size = file.stat().st_size
    got = [t for start in range(0, size, chunk)
           for t in _read_lines(_Task(str(file), "lines", start, min(start + chunk, size), chunk), "text")[0]]
    assert got == [json.loads(r)["text"] for r in rows]


def test_prepare_refuses_before_any_work(tmp_path: Path) -> None:
    _corpus(tmp_path / "c", files=1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ScheduleError, match="exists and is not an empty folder"):
        prepare(tmp_path / "c", None, tmp_path / "full", workers=0, progress=False)
    with pytest.raises(ScheduleError, match="has no 'body' field"):
        prepare(tmp_path / "c", None, tmp_path / "p", workers=0, progress=False, text_field="body")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ScheduleError, match="holds chat rows"):
        prepare(tmp_path / "chat.jsonl", None, tmp_path / "p", workers=0, progress=False)
    with pytest.raises(ScheduleError, match="no such file or folder"):
        prepare(tmp_path / "missing", None, tmp_path / "p", workers=0, progress=False)
    assert not (tmp_path / "p").exists() or not any((tmp_path / "p").iterdir())


def test_a_bad_row_met_late_stops_prepare_and_leaves_no_partial_output(tmp_path: Path) -> None:
    _corpus(tmp_path / "c", files=2)
    with open(tmp_path / "c" / "part1.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(ScheduleError, match=r"part1.jsonl \(the line at byte \d+\)': is not JSON"):
        prepare(tmp_path / "c", None, tmp_path / "p", workers=0, chunk_bytes=1 << 10, progress=False)
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == []


# --------------------------------------------------------------------------- PreparedData


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_each_epoch_order_is_a_permutation_that_changes_with_the_epoch(n: int) -> None:
    orders = [shuffled(np.arange(n), n, seed=3, epoch=e) for e in range(3)]
    assert all(sorted(o.tolist()) == list(range(n)) for o in orders)
    if n >= 64:
        assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[0], np.arange(n))
    part = shuffled(np.arange(n)[n // 2:], n, seed=3, epoch=0)  # computed for the positions asked only
    assert np.array_equal(part, orders[0][n // 2:])


def test_training_on_a_prepared_folder_reads_the_rows_of_the_token_file(tmp_path: Path) -> None:
    docs = _corpus(tmp_path / "c")
    prepare(tmp_path / "c", None, tmp_path / "p", workers=0, progress=False)
    data = PreparedData.open(tmp_path / "p", seq_len=16, seed=1, eval_fraction=0.1)
    stream = _expected(docs, Codec.byte_level())
    rows = len(stream) // 16
    assert (data.n_train, data.n_eval) == (rows - math.ceil(0.1 * rows), math.ceil(0.1 * rows))
    batch = data.batch(0, batch_size=4)
    for row in batch["input_ids"].tolist():
        start = next(i for i in range(0, rows * 16, 16) if stream[i: i + 16] == row)
        assert start // 16 < data.n_train
    assert torch.equal(batch["labels"], batch["input_ids"]) and bool(batch["attention_mask"].all())
    held = [b["input_ids"] for b in data.eval_batches(batch_size=2)]
    assert torch.cat(held).flatten().tolist() == stream[data.n_train * 16: (data.n_train + 2 * len(held)) * 16]


def test_prepared_data_parallel_ranks_are_disjoint_and_cover_each_epoch_once(tmp_path: Path) -> None:
    # one document of distinct ids: each row is told apart by its first token
    (tmp_path / "c.txt").write_text("".join(chr(0x100 + i) for i in range(600)))  # 2 UTF-8 bytes each
    prepare(tmp_path / "c.txt", None, tmp_path / "p", workers=0, progress=False)
    data = PreparedData.open(tmp_path / "p", seq_len=10, seed=5)
    assert data.n_train == 120  # 1201 tokens with the EOS
    first = {}
    for row in range(data.n_train):
        first[tuple(np.asarray(data.tokens[row * 10: row * 10 + 10]).tolist())] = row
    for dp in (1, 2, 4):
        for epoch in range(2):
            seen: list[int] = []
            for step in range(epoch * 10, epoch * 10 + 10):  # global batch 12: 10 steps an epoch
                for rank in range(dp):
                    rows = data.batch(step, 12, dp_rank=rank, dp_size=dp)["input_ids"].tolist()
                    seen += [first[tuple(r)] for r in rows]
            assert sorted(seen) == list(range(120)), (dp, epoch)


def test_a_prepared_folder_refuses_another_tokenizer_and_resumes_only_its_own_state(
        tmp_path: Path, tokenizer: Path) -> None:
    _corpus(tmp_path / "c", files=1)
    prepare(tmp_path / "c", tokenizer, tmp_path / "p", workers=0, progress=False)
    with pytest.raises(ScheduleError, match="was prepared with tokenizer .* this run's is bytes"):
        PreparedData.open(tmp_path / "p", seq_len=8, tokenizer=Codec.byte_level())
    data = PreparedData.open(tmp_path / "p", seq_len=8, tokenizer=tokenizer)
    assert data.codec.fingerprint == Codec.of(tokenizer).fingerprint
    state = data.state(step=4, batch_size=2)
    assert data.resume(state, batch_size=2) == 4
    other = PreparedData.open(tmp_path / "p", seq_len=8, seed=1)
    with pytest.raises(ScheduleError, match="seed"):
        other.resume(state, batch_size=2)
    (tmp_path / "p" / MANIFEST).unlink()
    with pytest.raises(ScheduleError, match="is not a prepared folder"):
        PreparedData.open(tmp_path / "p", seq_len=8)


def test_prepared_and_in_memory_data_pack_the_same_stream(tmp_path: Path) -> None:
    docs = _corpus(tmp_path / "c", files=2)
    prepare(tmp_path / "c", None, tmp_path / "p", workers=0, progress=False)
    memory = TokenData.from_source(tmp_path / "c", seq_len=32)
    prepared = PreparedData.open(tmp_path / "p", seq_len=32)
    full = prepared.n_rows
    assert read_documents(tmp_path / "c") == docs
    assert torch.equal(memory.rows[:full].long(), torch.from_numpy(
        np.asarray(prepared.tokens[: full * 32], dtype=np.int64)).view(full, 32))


def test_prepares_workers_import_neither_torch_nor_transformers() -> None:
    import subprocess
    import sys

    code = "import sys, slapo_fn.data.preparing; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_prepare_shows_its_progress_in_bytes_per_second(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _corpus(tmp_path / "c", files=1)
    prepare(tmp_path / "c", None, tmp_path / "p", workers=0)
    bar = capsys.readouterr().err
    assert "prepare" in bar and "100%" in bar and "B/s" in bar
