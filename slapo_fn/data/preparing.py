"""Tokenize once: :func:`prepare` turns a corpus into a memory-mapped token file.

The corpus (a file or a folder of ``.jsonl``/``.ndjson``/``.json``, ``.parquet`` or text
files) is cut into tasks of about ``chunk_bytes`` (line-aligned byte ranges of JSON-lines
files, row groups of parquet files, whole text files), which worker processes read, parse
and encode with the tokenizer's own batch encoder, one task at a time. The parent writes
their token ids to ``tokens.bin`` and the documents' ends to ``documents.bin`` in corpus
order, and hashes the source files meanwhile; at most two tasks per worker are in flight,
so memory stays bounded whatever the corpus's size (Megatron-LM's
``preprocess_data.py`` does the same with a pool of encoders). A progress bar (tqdm) shows
bytes per second. The manifest is written last (:mod:`slapo_fn.data.manifest`).

Example:
    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "c.jsonl").write_text('{"text": "hello"}\\n{"text": "world"}\\n')
    >>> manifest = prepare(folder / "c.jsonl", None, folder / "prepared", workers=0, progress=False)
    >>> manifest.tokens, manifest.documents, manifest.tokenizer.name
    (12, 2, 'bytes')
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from tqdm import tqdm

from ..errors import Problem, ScheduleError
from .codec import Codec
from .encoder import Encoder
from .manifest import DOCUMENTS, MANIFEST, TOKENIZER, TOKENS, Manifest, SourceFile, TokenizerInfo
from .problems import MAX_LISTED, check_int, error, raise_all
from .sources import read_file, text_of, walk

if TYPE_CHECKING:
    import tokenizers
    from transformers import PreTrainedTokenizerBase

__all__ = ["CHUNK_BYTES", "prepare"]

CHUNK_BYTES = 4 << 20
"""Bytes of the corpus per task: what one worker holds as text at a time."""

_LINES = (".jsonl", ".ndjson")
#: How workers start: forked where the platform forks safely (Linux), so that a script that
#: calls prepare() needs no ``if __name__ == "__main__":`` guard; workers never touch torch,
#: so a parent that has run torch's thread pools does not matter to them. Spawned elsewhere.
_START = "fork" if sys.platform.startswith("linux") else "spawn"
_PARQUET = ".parquet"
_NOT_JSON = "one JSON object per line, e.g. {\"text\": \"...\"}"


@dataclass(frozen=True)
class _Task:
    path: str
    kind: Literal["lines", "file", "parquet"]
    start: int  # a byte offset ("lines") or a row group ("parquet")
    stop: int
    size: int  # the bytes of the corpus it covers, for the progress bar


@dataclass(frozen=True)
class _Piece:
    ids: np.ndarray
    lengths: np.ndarray
    problems: tuple[Problem, ...] = ()


def prepare(source: str | Path,
            tokenizer: PreTrainedTokenizerBase | tokenizers.Tokenizer | Codec | str | Path | None,
            out: str | Path, *, workers: int | None = None, text_field: str = "text",
            chunk_bytes: int = CHUNK_BYTES, progress: bool = True) -> Manifest:
    """Tokenize ``source`` once into folder ``out`` (see :mod:`slapo_fn.data.manifest`)
    with ``tokenizer`` (anything :meth:`Codec.of <slapo_fn.data.Codec.of>` takes;
    ``None``: bytes), and return its manifest.

    ``workers`` processes encode (default: one per CPU this process may use; 0: in this
    process). Documents are each row's ``text_field`` (JSON lines, parquet) or a whole
    text file; empty ones are left out. ``out`` must not exist or be empty.

    Raises :class:`~slapo_fn.errors.ScheduleError` — before any work for a missing source,
    a first row without ``text_field``, chat rows, a non-empty ``out`` or a tokenizer
    without a ``tokenizers`` backend; at the first bad row met otherwise, leaving no
    partial output behind.
    """
    codec = Codec.of(tokenizer)
    out = Path(out)
    count = workers if workers is not None else len(os.sched_getaffinity(0))
    problems = check_int("workers", count, 0, "workers=0 (this process) or more")
    problems += check_int("chunk_bytes", chunk_bytes, 1 << 10, f"chunk_bytes={CHUNK_BYTES}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        problems.append(Problem(str(out), "exists and is not an empty folder",
                                "a new folder (or remove this one: a prepared folder is written whole)"))
    if codec.encoder is None:
        problems.append(Problem("tokenizer", f"{codec.name} is a slow tokenizer (no `tokenizers` backend), which "
                                "worker processes cannot share", "a fast tokenizer (a folder with tokenizer.json)"))
    raise_all(problems)
    assert codec.encoder is not None  # refused above
    files = _files(Path(source))
    tasks = _plan(files, chunk_bytes, text_field)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / TOKENS, out / DOCUMENTS, out / TOKENIZER]
    try:
        with ThreadPoolExecutor(1) as hasher:  # hashing reads the files again, beside the workers
            hashes = hasher.submit(lambda: [_sha256(f) for f in files])
            tokens, documents = _write(tasks, codec.encoder, text_field, count, out, progress, str(source))
            sources = tuple(SourceFile(str(f.resolve()), f.stat().st_size, h) for f, h in zip(files, hashes.result()))
        _save_tokenizer(codec, out / TOKENIZER)
        manifest = Manifest(TokenizerInfo(codec.name, codec.fingerprint, codec.vocab, codec.eos_id),
                            codec.encoder.dtype.name, tokens, documents, sources, text_field)
        (out / MANIFEST).write_text(manifest.to_json())
        return manifest
    except BaseException:
        for path in written:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- planning (the parent)


def _files(source: Path) -> list[Path]:
    if not source.exists():
        raise error(source, "no such file or folder",
                    "a .jsonl/.parquet/text file, or a folder of them (hidden files are skipped)")
    files = [source] if source.is_file() else [f for f in walk(source) if f.stat().st_size]
    if not files:
        raise error(source, "holds no file with anything in it", "point at a corpus")
    return files


def _plan(files: Sequence[Path], chunk_bytes: int, text_field: str) -> list[_Task]:
    """The tasks, in corpus order; each JSON-lines file's first row and each parquet
    file's schema are checked first, so that a wrong field is refused before any work."""
    tasks: list[_Task] = []
    problems: list[Problem] = []
    for file in files:
        size = file.stat().st_size
        suffix = file.suffix.lower()
        if suffix == _PARQUET:
            groups, problem = _parquet_groups(file, text_field)
            problems += [problem] if problem else []
            tasks += [_Task(str(file), "parquet", g, g + 1, size // max(groups, 1)) for g in range(groups)]
        elif suffix in _LINES or (suffix == ".json" and _first_char(file) != b"["):
            problem = _first_row_problem(file, text_field)
            problems += [problem] if problem else []
            tasks += [_Task(str(file), "lines", start, min(start + chunk_bytes, size), min(chunk_bytes, size - start))
                      for start in range(0, size, chunk_bytes)]
        else:
            tasks.append(_Task(str(file), "file", 0, size, size))
    raise_all(problems)
    return tasks


def _first_char(file: Path) -> bytes:
    with open(file, "rb") as f:
        return f.read(4096).lstrip()[:1]


def _first_row_problem(file: Path, text_field: str) -> Problem | None:
    with open(file, "rb") as f:
        line = next((raw for raw in f if raw.strip()), b"")
    where = f"{file}:1"
    try:
        row = json.loads(line)
    except ValueError as e:
        return Problem(where, f"is not JSON ({e})", _NOT_JSON)
    if isinstance(row, dict) and "messages" in row and text_field not in row:
        return Problem(str(file), "holds chat rows ('messages'): prepare tokenizes text rows",
                       f"stream chat files (slapo-fn train --data {file}), or rows with a {text_field!r} string")
    found = text_of(row, where, text_field)
    return found if isinstance(found, Problem) else None


def _parquet_groups(file: Path, text_field: str) -> tuple[int, Problem | None]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(file)
    names = meta.schema_arrow.names
    if text_field not in names:
        return 0, Problem(str(file), f"has no {text_field!r} column (columns: {', '.join(names)})",
                          f"a parquet file with a {text_field!r} string column, or text_field=NAME")
    return meta.num_row_groups, None


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- writing (the parent)


def _write(tasks: Sequence[_Task], encoder: Encoder, text_field: str, workers: int, out: Path, progress: bool,
           name: str) -> tuple[int, int]:
    """Every task's tokens to ``tokens.bin`` and its documents' ends to ``documents.bin``,
    in task order; returns the token and document counts."""
    tokens = documents = 0
    bar = tqdm(total=sum(t.size for t in tasks), unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"prepare {name}", disable=not progress, file=sys.stderr, smoothing=0.05)
    with bar, open(out / TOKENS, "wb") as ids_file, open(out / DOCUMENTS, "wb") as ends_file:
        for task, piece in _pieces(tasks, encoder, text_field, workers):
            if piece.problems:
                raise ScheduleError("data", list(piece.problems))
            piece.ids.tofile(ids_file)
            (tokens + np.cumsum(piece.lengths)).tofile(ends_file)
            tokens += len(piece.ids)
            documents += len(piece.lengths)
            bar.update(task.size)
    if not documents:
        raise error(name, "holds no text (no document with at least one character)", "point at a corpus")
    return tokens, documents


def _pieces(tasks: Sequence[_Task], encoder: Encoder, text_field: str, workers: int) \
        -> Iterator[tuple[_Task, _Piece]]:
    """Each task with its encoded piece, in order; with workers, two tasks per worker in flight."""
    if workers == 0:
        yield from ((t, _encode(t, encoder, text_field)) for t in tasks)
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(_START),
                               initializer=_start_worker, initargs=(encoder, text_field))
    try:
        pending = iter(tasks)
        window: deque[tuple[_Task, Future[_Piece]]] = deque(
            (t, pool.submit(_work, t)) for t in islice(pending, 2 * workers))
        while window:
            task, future = window.popleft()
            piece = future.result()
            for nxt in islice(pending, 1):
                window.append((nxt, pool.submit(_work, nxt)))
            yield task, piece
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _save_tokenizer(codec: Codec, folder: Path) -> None:
    """The tokenizer's files, for a run that names no tokenizer; none for bytes."""
    tok = codec.tokenizer
    if tok is None:
        return
    if not hasattr(tok, "save_pretrained"):  # a tokenizers.Tokenizer: saved as transformers loads it
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tok.id_to_token(codec.eos_id))
    tok.save_pretrained(str(folder))


# --------------------------------------------------------------------------- encoding (the workers)

#: The encoder and text field of this worker process, set once by the pool's initializer
#: (sent once per worker, not with each task: a tokenizer's JSON is megabytes).
_WORKER: dict[str, Any] = {}


def _start_worker(encoder: Encoder, text_field: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _WORKER.update(encoder=encoder, text_field=text_field)


def _work(task: _Task) -> _Piece:
    return _encode(task, _WORKER["encoder"], _WORKER["text_field"])


def _encode(task: _Task, encoder: Encoder, text_field: str) -> _Piece:
    texts, problems = _read(task, text_field)
    if problems:
        return _Piece(np.empty(0, encoder.dtype), np.empty(0, np.int64), tuple(problems))
    ids, lengths = encoder.encode_documents([t for t in texts if t])
    return _Piece(ids, lengths)


def _read(task: _Task, text_field: str) -> tuple[list[str], list[Problem]]:
    """The task's documents, or the problems of its rows (up to :data:`MAX_LISTED` + 1)."""
    if task.kind == "file":
        try:
            return read_file(Path(task.path), text_field), []
        except ScheduleError as e:
            return [], list(e.problems)
    if task.kind == "parquet":
        import pyarrow.parquet as pq

        column = pq.ParquetFile(task.path).read_row_groups(range(task.start, task.stop), columns=[text_field])
        values = column.column(0).to_pylist()
        bad = [i for i, v in enumerate(values) if v is not None and not isinstance(v, str)]
        return [v for v in values if v], [Problem(f"{task.path} (row group {task.start}, row {i})",
                                                  f"its {text_field!r} is not a string", "a string column")
                                          for i in bad[: MAX_LISTED + 1]]
    return _read_lines(task, text_field)


def _read_lines(task: _Task, text_field: str) -> tuple[list[str], list[Problem]]:
    """The rows of the JSON lines that *start* in ``[start, stop)``: a line that crosses
    ``stop`` is this task's, one that crosses ``start`` the previous task's."""
    with open(task.path, "rb") as f:
        begin = task.start
        if begin:
            f.seek(begin - 1)
            f.readline()  # up to the first line that starts at or after `start`
            begin = f.tell()
        if begin >= task.stop:
            return [], []
        data = f.read(task.stop - begin)
        if not data.endswith(b"\n"):
            data += f.readline()
    texts: list[str] = []
    problems: list[Problem] = []
    offset = begin
    for line in data.split(b"\n"):
        if line.strip() and len(problems) <= MAX_LISTED:
            where = f"{task.path} (the line at byte {offset})"
            try:
                found = text_of(json.loads(line), where, text_field)
            except ValueError as e:  # not JSON, or not UTF-8
                found = Problem(where, f"is not JSON ({e})", _NOT_JSON)
            if isinstance(found, Problem):
                problems.append(found)
            else:
                texts.append(found)
        offset += len(line) + 1
    return texts, problems
