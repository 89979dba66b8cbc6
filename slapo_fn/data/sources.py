"""Documents from files, folders, JSONL, saved ``datasets`` datasets, lists of strings,
and the Python standard library's own sources: what :class:`~slapo_fn.data.TokenData`
reads into memory (small corpora; large ones are prepared or streamed)."""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import Problem, ScheduleError
from .problems import a as _a
from .problems import error as _error
from .problems import raise_all as _raise_all

if TYPE_CHECKING:
    import datasets

__all__ = ["JSON_SUFFIXES", "is_saved_dataset", "read_documents", "read_file", "stdlib_corpus", "text_of", "walk"]

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
"""Suffixes of files read as JSON rows."""
_SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})


def read_documents(source: str | Path | Sequence[str] | datasets.Dataset | datasets.DatasetDict, *,
                   text_field: str = "text") -> list[str]:
    """The documents of ``source``, in a fixed order; empty documents are left out.

    * a text file: one document (read as UTF-8);
    * a ``.jsonl``/``.ndjson``/``.json`` file: one document per row's ``text_field``
      (``.json`` may also hold one JSON list of rows);
    * a folder saved by ``datasets``' ``save_to_disk``: its rows' ``text_field`` (of a
      ``DatasetDict``, the ``"train"`` split), read with ``datasets.load_from_disk``;
    * any other folder: every file under it, by sorted relative path (hidden files and
      ``__pycache__`` skipped), each read as above by its suffix;
    * a ``datasets.Dataset``/``DatasetDict`` object: as a saved one;
    * a list or tuple of strings: the documents themselves.

    Raises :class:`~slapo_fn.errors.ScheduleError` naming the path, the reason and a fix
    for a missing path, a file that is not UTF-8, a row without ``text_field`` and a
    source without any text.

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "b.jsonl").write_text('{"text": "second"}\\n{"text": "third"}\\n')
        >>> _ = (folder / "a.txt").write_text("first")
        >>> read_documents(folder)
        ['first', 'second', 'third']
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise _error(path, "no such file or folder",
                         "the path of a text file, a folder of them, a JSONL file with a 'text' field, or a "
                         "dataset saved with datasets' save_to_disk")
        docs = _read_folder(path, text_field) if path.is_dir() else read_file(path, text_field)
        where: object = path
    elif isinstance(source, (list, tuple)):
        bad = [Problem(f"<documents>[{i}]", f"is {_a(type(d).__name__)}, not a string", "pass strings only")
               for i, d in enumerate(source) if not isinstance(d, str)]
        _raise_all(bad)
        docs, where = list(source), "<documents>"
    elif hasattr(source, "column_names"):  # a datasets.Dataset or DatasetDict object
        docs, where = _read_dataset(source, "<dataset>", text_field), "<dataset>"
    else:
        raise ScheduleError("data", [Problem("<source>", f"{_a(type(source).__name__)} is not a data source",
                                             "a path (str or Path), a list of strings, or a datasets.Dataset")])
    docs = [d for d in docs if d]
    if not docs:
        raise _error(where, "holds no text (no document with at least one character)",
                     "point at a corpus with text in it, or use slapo_fn.data.stdlib_corpus() for a demo")
    return docs


def read_file(path: Path, text_field: str) -> list[str]:
    """The documents of one file: its ``text_field`` rows if JSON (``.jsonl``, ``.ndjson``,
    ``.json``), else its whole text, one document."""
    text = _read_text(path)
    if path.suffix.lower() in JSON_SUFFIXES:
        return _json_rows(path, text, text_field)
    return [text]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _error(path, f"is not UTF-8 text ({e.reason} at byte {e.start})",
                     "convert it to UTF-8, or move it out of the corpus") from None
    except OSError as e:
        raise _error(path, f"cannot be read ({e.strerror})", "make it readable") from None


def _json_rows(path: Path, text: str, text_field: str) -> list[str]:
    rows: list[tuple[str, Any]] = []  # (where, the row, or a Problem if the line is not JSON)
    whole: Any = None
    if path.suffix.lower() == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # not one JSON value: read it as JSON lines
    if isinstance(whole, list):
        rows = [(f"{path}[{i}]", row) for i, row in enumerate(whole)]
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((f"{path}:{number}", json.loads(line)))
                except json.JSONDecodeError as e:
                    rows.append((f"{path}:{number}", Problem(f"{path}:{number}", f"is not JSON ({e.msg})",
                                                             "one JSON object per line, e.g. {\"text\": \"...\"}")))
    docs = []
    problems: list[Problem] = []
    for where, row in rows:
        value = row if isinstance(row, Problem) else text_of(row, where, text_field)
        if isinstance(value, Problem):
            problems.append(value)
        else:
            docs.append(value)
    _raise_all(problems)
    return docs


def text_of(row: Any, where: str, text_field: str) -> str | Problem:
    """Row ``row``'s (a JSON value's) document, its ``text_field`` string, or the problem
    at ``where`` (not an object, no such field, not a string), with the fix."""
    value = row.get(text_field) if isinstance(row, dict) else None
    if isinstance(value, str):
        return value
    if not isinstance(row, dict):
        reason = f"is {_a(type(row).__name__)} (JSON), not an object with a {text_field!r} field"
    elif text_field not in row:
        reason = f"has no {text_field!r} field (fields: {', '.join(map(str, row)) or 'none'})"
    else:
        reason = f"its {text_field!r} is {_a(type(value).__name__)}, not a string"
    fields = [k for k, v in row.items() if isinstance(v, str)] if isinstance(row, dict) else []
    fix = f'give each row a "{text_field}" string'
    if fields and text_field not in row:
        fix += f", or read another field: text_field={fields[0]!r}"
    return Problem(where, reason, fix)


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``datasets``' ``save_to_disk``."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def _read_folder(path: Path, text_field: str) -> list[str]:
    if is_saved_dataset(path):
        try:
            import datasets
        except ImportError:
            raise _error(path, "is a dataset saved by the `datasets` library, which is not installed",
                         "pip install 'slapo_fn[hf]' (or pip install datasets)") from None
        return _read_dataset(datasets.load_from_disk(str(path)), path, text_field)
    docs: list[str] = []
    for file in walk(path):
        docs += read_file(file, text_field)
    return docs


def walk(root: Path, suffix: str | None = None) -> Iterator[Path]:
    """Files under ``root`` in sorted order, files of a folder before its subfolders."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIPPED_DIRS)
        for name in sorted(files):
            if not name.startswith(".") and (suffix is None or name.endswith(suffix)):
                yield Path(folder, name)


def _read_dataset(dataset: Any, where: object, text_field: str) -> list[str]:
    if not hasattr(dataset, "features"):  # a DatasetDict: take its training split
        if "train" not in dataset:
            raise _error(where, f"is a DatasetDict without a 'train' split (splits: {', '.join(dataset)})",
                         "save the training split (dataset['name'].save_to_disk(...)), or name it 'train'")
        dataset = dataset["train"]
    if text_field not in dataset.column_names:
        strings = [c for c, f in dataset.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
        fix = f"a dataset with a {text_field!r} column"
        if strings:
            fix += f", or read another column: text_field={strings[0]!r}"
        raise _error(where, f"has no {text_field!r} column (columns: {', '.join(dataset.column_names)})", fix)
    return [t for t in dataset[text_field] if isinstance(t, str)]


def stdlib_corpus(max_bytes: int | None = 4_000_000) -> list[str]:
    """The Python standard library's own ``.py`` sources: real text that every machine has.

    Files come in a fixed order (sorted names, a folder's files before its subfolders;
    ``site-packages`` and ``__pycache__`` skipped; files that are not UTF-8 skipped), one
    document each, until ``max_bytes`` are read (``None``: all, tens of MB); the file that
    reaches the cap is cut after its last whole line that fits. The same Python version
    gives the same corpus.

    Example:
        >>> docs = stdlib_corpus(max_bytes=100_000)
        >>> 0 < sum(len(d.encode()) for d in docs) <= 100_000
        True
    """
    docs: list[str] = []
    total = 0
    for file in walk(Path(sysconfig.get_paths()["stdlib"]), ".py"):
        raw = file.read_bytes()
        full = max_bytes is not None and total + len(raw) >= max_bytes
        if max_bytes is not None and total + len(raw) > max_bytes:
            raw = raw[: raw.rfind(b"\n", 0, max_bytes - total) + 1]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text:
            docs.append(text)
        total += len(raw)
        if full:
            break
    return docs

