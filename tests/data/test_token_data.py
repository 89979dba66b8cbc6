"""slapo_fn.data: sources, tokenizers, packing, order, sharding, resume, held-out split, errors.

Fast (seconds), offline: the corpora are written to tmp_path, the tokenizer is trained on the fly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slapo_fn.data import (
    EOS_TOKEN,
    IGNORE_INDEX,
    Arithmetic,
    Batch,
    ByteText,
    Codec,
    TokenData,
    read_documents,
    stdlib_corpus,
    train_bpe,
)
from slapo_fn.errors import ScheduleError

# --------------------------------------------------------------------------- helpers


def _numbered(rows: int, seq_len: int, **options: object) -> TokenData:
    """One document of distinct ids 1..: every packed row has its own content, so rows can be
    told apart by their tokens (id 0 is EOS)."""
    tokens = rows * seq_len - 1  # + EOS = exactly `rows` full rows
    return TokenData.from_token_ids([list(range(1, tokens + 1))], eos_id=0, vocab=tokens + 1, seq_len=seq_len,
                                    **options)  # type: ignore[arg-type]


def _row_ids(batch: Batch, seq_len: int) -> list[int]:
    """The packed row of each batch row of :func:`_numbered` data (its first token says which)."""
    ids = batch["input_ids"]
    return [int(first) // seq_len for first in ids[:, 0]]


def _stream(data: TokenData) -> list[int]:
    """All real (unpadded) tokens of all rows, in corpus order."""
    mask = torch.arange(data.seq_len) < data.lengths[:, None]
    return data.rows[mask].tolist()


def _equal(a: Batch, b: Batch) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("input_ids", "attention_mask", "labels"))  # type: ignore[literal-required]


# --------------------------------------------------------------------------- sources


def test_a_text_file_is_one_document_of_utf8_bytes_then_eos(tmp_path: Path) -> None:
    file = tmp_path / "corpus.txt"
    file.write_text("héllo\nworld\n", encoding="utf-8")
    data = TokenData.from_source(file, seq_len=4)
    assert (data.vocab, data.eos_id, data.codec.name) == (257, 256, "bytes")
    assert _stream(data) == [*"héllo\nworld\n".encode(), 256]
    assert data.codec.decode(_stream(data)) == "héllo\nworld\n"


def test_a_folder_reads_every_file_by_sorted_path_skipping_hidden_files_and_caches(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.md").write_text("first")
    (tmp_path / "sub" / "c.jsonl").write_text('{"text": "third"}\n\n{"text": "fourth", "id": 4}\n')
    (tmp_path / ".hidden.txt").write_text("hidden")
    (tmp_path / ".git" / "HEAD").write_text("git")
    (tmp_path / "__pycache__" / "x.txt").write_text("cache")
    (tmp_path / "empty.txt").write_text("")
    assert read_documents(tmp_path) == ["first", "second", "third", "fourth"]
    data = TokenData.from_source(tmp_path, seq_len=8)
    assert _stream(data) == [t for doc in ("first", "second", "third", "fourth") for t in (*doc.encode(), 256)]


def test_jsonl_takes_each_rows_text_field_and_json_may_hold_a_list(tmp_path: Path) -> None:
    rows = [{"text": "alpha", "id": 1}, {"text": "beta"}, {"body": "gamma", "text": "delta"}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "b.json").write_text(json.dumps([{"body": "x"}, {"body": "y"}]))
    assert read_documents(tmp_path / "a.jsonl") == ["alpha", "beta", "delta"]
    assert read_documents(tmp_path / "b.json", text_field="body") == ["x", "y"]
    data = TokenData.from_source(tmp_path / "a.jsonl", seq_len=4)
    assert data.codec.decode(_stream(data)) == "alpha" + "beta" + "delta"  # EOS (256) decodes to nothing


def test_a_dataset_saved_on_disk_and_a_dataset_object(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the `hf` extra (datasets) is not installed")
    rows = datasets.Dataset.from_dict({"text": ["one", "", "two"], "n": [1, 2, 3]})
    rows.save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({"train": rows, "test": datasets.Dataset.from_dict({"text": ["held"]})}).save_to_disk(
        str(tmp_path / "dict"))
    assert read_documents(tmp_path / "plain") == ["one", "two"]
    assert read_documents(tmp_path / "dict") == ["one", "two"]  # a DatasetDict gives its "train" split
    assert read_documents(rows) == ["one", "two"]
    data = TokenData.from_source(tmp_path / "plain", seq_len=4)
    assert _stream(data) == [*b"one", 256, *b"two", 256]
    with pytest.raises(ScheduleError, match=r"has no 'body' column \(columns: text, n\)") as e:
        read_documents(tmp_path / "plain", text_field="body")
    assert "text_field='text'" in e.value.problems[0].fix
    datasets.DatasetDict({"validation": rows}).save_to_disk(str(tmp_path / "notrain"))
    with pytest.raises(ScheduleError, match=r"without a 'train' split \(splits: validation\)"):
        read_documents(tmp_path / "notrain")


# --------------------------------------------------------------------------- packing


documents = st.lists(st.lists(st.integers(1, 9), max_size=12), min_size=1, max_size=8).filter(
    lambda docs: sum(len(d) for d in docs) > 0)


@settings(max_examples=60, deadline=None)
@given(docs=documents, seq_len=st.integers(2, 9))
def test_packing_concatenates_documents_with_eos_into_rows_with_masks_and_labels(
        docs: list[list[int]], seq_len: int) -> None:
    data = TokenData.from_token_ids(docs, eos_id=0, vocab=10, seq_len=seq_len)
    stream = [t for d in docs if d for t in (*d, 0)]
    full, rest = divmod(len(stream), seq_len)
    assert data.rows.shape == (full + (rest >= 2), seq_len)
    assert _stream(data) == stream[: data.rows.shape[0] * seq_len]  # a last row of 1 token predicts nothing: left out
    batch = data.batch(0, batch_size=data.n_train)
    order = _permutation_of(data, batch)
    mask = torch.arange(seq_len) < data.lengths[order, None]
    assert torch.equal(batch["attention_mask"], mask.long())
    assert torch.equal(batch["input_ids"], data.rows[order].long())
    assert torch.equal(batch["labels"], batch["input_ids"].masked_fill(~mask, IGNORE_INDEX))
    assert bool((batch["input_ids"][~mask] == 0).all())  # padding is EOS, never attended, never a label
    assert (data.lengths[:-1] == seq_len).all()  # only the last row may be short


def _permutation_of(data: TokenData, batch: Batch) -> list[int]:
    """Which packed row each batch row is (rows are matched by content; ties take the first free one)."""
    free = list(range(data.rows.shape[0]))
    order = []
    for row in batch["input_ids"]:
        i = next(i for i in free if torch.equal(data.rows[i].long(), row))
        free.remove(i)
        order.append(i)
    return order


def test_packed_rows_have_seq_len_tokens_and_the_last_partial_row_is_padded_and_masked() -> None:
    data = TokenData.from_token_ids([[1, 2, 3], [4, 5]], eos_id=9, vocab=10, seq_len=4)
    assert data.rows.tolist() == [[1, 2, 3, 9], [4, 5, 9, 9]]
    last = data._rows(torch.tensor([1]))
    assert last["attention_mask"].tolist() == [[1, 1, 1, 0]]
    assert last["labels"].tolist() == [[4, 5, 9, IGNORE_INDEX]]  # the EOS that ends a document is a label


def test_a_hugging_face_causal_lm_takes_a_batch_and_its_loss_ignores_padding() -> None:
    from tests.models import tiny_llama

    model = tiny_llama(layers=1).eval()
    data = TokenData.from_token_ids([list(range(1, 12))], eos_id=0, vocab=128, seq_len=8)  # rows: 8 + 4 tokens
    batch = data._rows(torch.tensor([0, 1]))
    with torch.no_grad():
        out = model(**batch)
        logits = out.logits[:, :-1].flatten(0, 1)
        expected = torch.nn.functional.cross_entropy(logits, batch["labels"][:, 1:].flatten())
        short = model(input_ids=batch["input_ids"][1:, :4])  # the padded row alone, without its padding
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.logits[1, :4], short.logits[0])  # padding changes no real position


# --------------------------------------------------------------------------- order, sharding, resume


def test_the_same_seed_gives_the_same_batches_and_another_seed_another_order() -> None:
    a, b, c = (_numbered(32, 4, seed=s) for s in (3, 3, 4))
    for step in range(10):
        assert _equal(a.batch(step, 8), b.batch(step, 8))
    assert any(not _equal(a.batch(step, 8), c.batch(step, 8)) for step in range(4))


def test_an_epoch_visits_every_training_row_once_then_the_next_epoch_reshuffles() -> None:
    data = _numbered(24, 4, seed=1)
    seen = [_row_ids(data.batch(step, 6), 4) for step in range(8)]  # 2 epochs of 4 steps
    first, second = [r for rows in seen[:4] for r in rows], [r for rows in seen[4:] for r in rows]
    assert sorted(first) == sorted(second) == list(range(24))
    assert first != second
    assert data.steps_per_epoch(6) == 4


@settings(max_examples=40, deadline=None)
@given(step=st.integers(0, 50), dp_size=st.sampled_from([1, 2, 4]), per_rank=st.integers(1, 3),
       seed=st.integers(0, 5))
def test_data_parallel_ranks_take_disjoint_slices_of_the_same_global_batch(
        step: int, dp_size: int, per_rank: int, seed: int) -> None:
    data = _numbered(48, 3, seed=seed)  # every batch size here divides 48: no batch straddles two epochs
    batch_size = dp_size * per_rank
    shards = [data.batch(step, batch_size, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    whole = data.batch(step, batch_size)  # the global batch does not depend on the number of ranks
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(torch.cat([s[key] for s in shards]), whole[key])
    rows = [_row_ids(s, 3) for s in shards]
    assert all(len(r) == per_rank for r in rows)
    flat = [r for shard in rows for r in shard]
    assert len(set(flat)) == len(flat)


@pytest.mark.parametrize(("stop", "batch_size"), [(3, 4), (5, 4), (7, 6)], ids=["mid-epoch", "epoch-edge", "later"])
def test_a_resumed_run_sees_exactly_the_batches_of_the_uninterrupted_run(stop: int, batch_size: int) -> None:
    uninterrupted = _numbered(20, 5, seed=7)
    expected = [uninterrupted.batch(s, batch_size, dp_rank=r, dp_size=2) for s in range(12) for r in range(2)]
    saved = json.loads(json.dumps(uninterrupted.state(stop, batch_size)))  # as a checkpoint stores it
    assert saved["position"] == stop * batch_size and saved["epoch"] == stop * batch_size // 20
    restarted = _numbered(20, 5, seed=7)  # a new process builds the data again
    start = restarted.resume(saved, batch_size)
    assert start == stop
    resumed = [restarted.batch(s, batch_size, dp_rank=r, dp_size=2) for s in range(start, 12) for r in range(2)]
    assert all(_equal(a, b) for a, b in zip(resumed, expected[2 * stop:], strict=True))


def test_resume_refuses_the_state_of_other_data_another_seed_or_a_batch_size_that_does_not_divide() -> None:
    data = _numbered(20, 5, seed=7)
    saved = data.state(3, 4)
    with pytest.raises(ScheduleError, match=r"'state.seed': the checkpoint's data has seed 7, this data 8"):
        _numbered(20, 5, seed=8).resume(saved, 4)
    other = r"(?s)2 problems.*'state.fingerprint'.*'state.seq_len': the checkpoint's data has seq_len 5, this data 4"
    with pytest.raises(ScheduleError, match=other):
        _numbered(25, 4, seed=7).resume(saved, 4)
    with pytest.raises(ScheduleError, match=r"'batch_size': 5 does not divide the 12 rows consumed"):
        data.resume(saved, 5)
    with pytest.raises(ScheduleError, match=r"'state.position': None is not a row count"):
        data.resume({k: v for k, v in saved.items() if k != "position"}, 4)


# --------------------------------------------------------------------------- held-out split


def test_the_eval_split_is_the_last_rows_disjoint_from_training_and_independent_of_the_seed() -> None:
    data = _numbered(40, 4, seed=2, eval_fraction=0.1)
    assert (data.n_train, data.n_eval) == (36, 4)
    trained = {r for step in range(2 * data.steps_per_epoch(6)) for r in _row_ids(data.batch(step, 6), 4)}
    assert trained == set(range(36))
    shards = [list(data.eval_batches(4, dp_rank=r, dp_size=2)) for r in range(2)]
    assert [len(s) for s in shards] == [1, 1]
    assert _row_ids(shards[0][0], 4) + _row_ids(shards[1][0], 4) == [36, 37, 38, 39]
    other = _numbered(40, 4, seed=9, eval_fraction=0.1)
    assert _equal(next(other.eval_batches(4)), next(data.eval_batches(4)))
    assert len(list(data.eval_batches(3))) == 1  # a remainder smaller than a batch is left out


def test_a_short_last_row_lands_in_the_eval_split_and_training_rows_are_full() -> None:
    data = TokenData.from_source(["x" * 30], seq_len=8, eval_fraction=0.2)  # 31 tokens: 3 full rows + 7
    assert (data.n_train, data.n_eval) == (3, 1)
    assert bool((data.batch(0, 3)["attention_mask"] == 1).all())
    assert next(data.eval_batches(1))["labels"][0, -1].item() == IGNORE_INDEX


# --------------------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return stdlib_corpus(max_bytes=300_000)


def test_the_stdlib_corpus_is_python_source_in_a_fixed_order_within_the_byte_cap(corpus: list[str]) -> None:
    assert corpus == stdlib_corpus(max_bytes=300_000)
    assert 299_000 < sum(len(d.encode()) for d in corpus) <= 300_000  # whole lines up to the cap
    assert len(corpus) > 5 and all("def " in d or "import " in d or "=" in d for d in corpus)
    small = stdlib_corpus(max_bytes=50_000)  # a prefix of the larger corpus, its last file cut at a line end
    assert small[:-1] == corpus[: len(small) - 1]
    assert corpus[len(small) - 1].startswith(small[-1]) and small[-1].endswith("\n")


def test_a_bpe_tokenizer_trained_on_the_stdlib_round_trips_through_a_saved_folder(
        corpus: list[str], tmp_path: Path) -> None:
    tok = train_bpe(corpus, vocab_size=512, save_to=tmp_path / "tok")
    assert train_bpe(corpus, vocab_size=512).get_vocab() == tok.get_vocab()  # the same texts, the same tokenizer
    data = TokenData.from_source(corpus, tmp_path / "tok", seq_len=64, eval_fraction=0.05)  # AutoTokenizer
    assert (data.vocab, data.eos_id) == (512, tok.convert_tokens_to_ids(EOS_TOKEN))
    assert data.codec.decode(_stream(data)) == "".join(doc + EOS_TOKEN for doc in corpus)
    for doc in corpus[:5]:
        assert data.codec.decode(data.codec.encode(doc)) == doc
    assert len(_stream(data)) < sum(len(d.encode()) for d in corpus) / 1.8  # merges compress the text
    raw = TokenData.from_source(corpus[:3], tok.backend_tokenizer, seq_len=64)  # a tokenizers.Tokenizer
    assert (raw.vocab, raw.eos_id) == (512, data.eos_id)
    assert torch.equal(raw.rows[:5], data.rows[:5])


def test_the_byte_level_fallback_and_the_older_byte_and_arithmetic_data_keep_their_interface(
        tmp_path: Path) -> None:
    codec = Codec.of(None)
    assert (codec.vocab, codec.eos_id, codec.encode("é"), codec.decode([195, 169, 256])) == (257, 256, [195, 169], "é")
    file = tmp_path / "t.txt"
    file.write_bytes(b"abcdefghij")
    text = ByteText.from_file(file, seed=1)
    assert text.vocab == 256 and text.batch(2, 3, 5).shape == (3, 5)
    assert torch.equal(text.batch(2, 3, 5), ByteText.from_file(file, seed=1).batch(2, 3, 5))
    assert Arithmetic(32, seed=1).batch(0, 2, 6).shape == (2, 6)


# --------------------------------------------------------------------------- errors


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _lines(path: Path, *lines: str) -> Path:
    return _write(path, "\n".join(lines) + "\n")


@pytest.mark.parametrize(("make", "kwargs", "match", "fix"), [
    pytest.param(lambda p: p / "missing.txt", {}, r"missing\.txt': no such file or folder", "JSONL",
                 id="missing-file"),
    pytest.param(lambda p: _write(p / "e.txt", ""), {}, r"e\.txt': holds no text", "stdlib_corpus",
                 id="empty-file"),
    pytest.param(lambda p: p, {}, r"holds no text", "stdlib_corpus", id="empty-folder"),
    pytest.param(lambda p: [], {}, r"'<documents>': holds no text", "stdlib_corpus", id="empty-list"),
    pytest.param(lambda p: _lines(p / "a.jsonl", '{"text": "ok"}', '{"body": "b", "n": 1}'), {},
                 r"a\.jsonl:2': has no 'text' field \(fields: body, n\)", "text_field='body'", id="jsonl-no-text"),
    pytest.param(lambda p: _lines(p / "a.jsonl", '{"text": 3}', "[1]", "{oops"), {},
                 r"(?s)3 problems.*a\.jsonl:1': its 'text' is an int"
                 r".*a\.jsonl:2': is a list \(JSON\).*a\.jsonl:3': is not JSON",
                 'give each row a "text" string', id="jsonl-bad-rows"),
    pytest.param(lambda p: _lines(p / "a.txt", "x"), {"seq_len": 0}, r"'seq_len': must be at least 2, got 0",
                 "seq_len=2 or more", id="seq-len-0"),
    pytest.param(lambda p: _lines(p / "a.txt", "x"), {"eval_fraction": 1.0},
                 r"'eval_fraction': must be a number in \[0, 1\), got 1\.0", "last 5%", id="eval-fraction-1"),
    pytest.param(lambda p: _lines(p / "a.txt", "abc"), {"eval_fraction": 0.5}, r"too few to hold out 50%",
                 "a larger corpus", id="too-small-to-split"),
    pytest.param(lambda p: p / "tokenizer-folder-missing", {"tokenizer": "no/such/folder"},
                 r"'no/such/folder': no such tokenizer folder \(nothing is downloaded\)", "train_bpe",
                 id="missing-tokenizer"),
], )
def test_bad_sources_and_options_raise_one_typed_error_naming_path_reason_and_fix(
        tmp_path: Path, make: object, kwargs: dict[str, object], match: str, fix: str) -> None:
    source = make(tmp_path)  # type: ignore[operator]
    options: dict[str, object] = {"seq_len": 4, **kwargs}
    with pytest.raises(ScheduleError, match=match) as e:
        TokenData.from_source(source, **options)  # type: ignore[arg-type]
    assert isinstance(e.value, ValueError)
    assert fix in e.value.problems[0].fix


def test_non_utf8_files_bad_batches_and_bad_bpe_sizes_are_typed_errors(tmp_path: Path) -> None:
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ScheduleError, match=r"bin\.dat': is not UTF-8 text \(invalid start byte at byte 0\)"):
        read_documents(tmp_path)
    data = _numbered(10, 4, eval_fraction=0.2)
    with pytest.raises(ScheduleError, match=r"'batch_size': 6 rows do not split evenly over 4") as e:
        data.batch(0, 6, dp_rank=0, dp_size=4)
    assert e.value.problems[0].fix == "a multiple of 4, e.g. 4"
    with pytest.raises(ScheduleError, match=r"'dp_rank': 2 is not a rank of 2"):
        data.batch(0, 4, dp_rank=2, dp_size=2)
    with pytest.raises(ScheduleError, match=r"'step': must be at least 0, got -1"):
        data.batch(-1, 4)
    with pytest.raises(ScheduleError, match=r"'eval_fraction': holds out 2 row\(s\), fewer than one batch of 4"):
        next(data.eval_batches(4))
    with pytest.raises(ScheduleError, match=r"'vocab_size': 100 leaves no room for merges"):
        train_bpe(["text"], vocab_size=100)
    with pytest.raises(ScheduleError, match=r"'<source>': an int is not a data source"):
        read_documents(3)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"'tokenizer': an object is not a tokenizer"):
        Codec.of(object())  # type: ignore[arg-type]
