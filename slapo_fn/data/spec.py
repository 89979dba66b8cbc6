"""What ``--data`` names, read without reading any data: one source or a weighted mixture.

``--data`` is a source, or comma-separated sources each with ``:WEIGHT``
(``"a.jsonl:0.7,b/:0.3"``, the same string as ``data = "..."`` in a TOML config). A
source is ``stdlib[:SIZE]``, a prepared folder (:func:`~slapo_fn.data.prepare`), or a
file or folder of JSON lines, parquet or text files, or a folder saved by ``datasets``.
Which path reads it (:func:`kind`):

* ``"memory"`` — ``stdlib``, and files under :data:`STREAM_BYTES` in all (JSON lines,
  text, a saved dataset): :class:`~slapo_fn.data.TokenData`, as before;
* ``"prepared"`` — a prepared folder: :class:`~slapo_fn.data.PreparedData`;
* ``"stream"`` — anything else, parquet, chat rows, anything asked to stream
  (``--stream``), and every source of a mixture that is not prepared:
  :class:`~slapo_fn.data.StreamData`.

Example:
    >>> spec = parse("a.jsonl:0.7,b/:0.3")
    >>> [(s.name, s.weight) for s in spec.sources], spec.mixture
    ([('a.jsonl', 0.7), ('b/', 0.3)], True)
    >>> parse("stdlib:8MiB").sources[0].weight is None
    True
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import Problem, ScheduleError
from .manifest import is_prepared
from .sources import JSON_SUFFIXES, walk

__all__ = ["STDLIB", "STREAM_BYTES", "DataSpec", "Kind", "Source", "kind", "parse"]

STDLIB = "stdlib"
STREAM_BYTES = 256 << 20
"""Sources of more bytes than this stream rather than load into every rank's memory."""

Kind = Literal["memory", "prepared", "stream"]
_FIX = "--data 'a.jsonl:0.7,b/:0.3' (positive weights, which need not add up to 1)"


@dataclass(frozen=True)
class Source:
    name: str
    weight: float | None = None

    @property
    def stdlib(self) -> bool:
        return self.name.partition(":")[0] == STDLIB

    @property
    def path(self) -> Path:
        return Path(self.name)


@dataclass(frozen=True)
class DataSpec:
    sources: tuple[Source, ...]

    @property
    def mixture(self) -> bool:
        """Several sources, or a weight given: sampled by :class:`~slapo_fn.data.Mixture`."""
        return len(self.sources) > 1 or self.sources[0].weight is not None

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(1.0 if s.weight is None else s.weight for s in self.sources)


def parse(text: str) -> DataSpec:
    """The sources of ``text``; a :class:`~slapo_fn.errors.ScheduleError` for an empty
    source or a weight that is not a positive number. ``NAME:X`` is a weight where ``X``
    reads as a number, else part of the name (``stdlib:8MiB``)."""
    sources, problems = [], []
    for item in (part.strip() for part in text.split(",")):
        name, _, weight = item.rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            sources.append(Source(item))
            continue
        if not name:
            problems.append(Problem("--data", f"{item!r} names no source before its weight", _FIX))
        elif not (math.isfinite(value) and value > 0):
            problems.append(Problem("--data", f"{name}: a mixture weight must be a positive number, got {weight}",
                                    _FIX))
        sources.append(Source(name, value))
    problems += [Problem("--data", f"{text!r} has an empty source", _FIX) for s in sources if not s.name][:1]
    if problems:
        raise ScheduleError("data", problems)
    return DataSpec(tuple(sources))


def kind(spec: DataSpec, source: Source, *, stream: bool = False, data_format: str = "auto") -> Kind:
    """Which path reads ``source`` of ``spec`` (see the module docstring); chat rows
    (``data_format`` ``"chat"``, or ``"auto"`` and a first JSON row with ``messages``)
    stream, whatever their size."""
    if not source.stdlib and is_prepared(source.path):
        return "prepared"
    if stream or spec.mixture or data_format == "chat":
        return "stream"
    if source.stdlib:
        return "memory"
    files = [source.path] if source.path.is_file() else list(walk(source.path))
    if any(f.suffix.lower() == ".parquet" for f in files) or (data_format == "auto" and _chat_rows(files)):
        return "stream"
    return "stream" if sum(f.stat().st_size for f in files) > STREAM_BYTES else "memory"


def _chat_rows(files: list[Path]) -> bool:
    """Whether the first JSON file's first row is a chat example (has ``messages``)."""
    first = next((f for f in files if f.suffix.lower() in JSON_SUFFIXES), None)
    if first is None:
        return False
    with open(first, "rb") as f:
        line = next((raw for raw in f if raw.strip()), b"")
    try:
        row = json.loads(line)
    except ValueError:
        return False
    return isinstance(row, dict) and "messages" in row
