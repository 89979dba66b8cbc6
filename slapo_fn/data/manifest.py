"""The folder :func:`~slapo_fn.data.prepare` writes, and its manifest.

A prepared folder holds::

    tokens.bin       every document's token ids then its EOS, one after another (uint16, or
                     uint32 for vocabularies over 65,536), memory-mapped by training
    documents.bin    where each document ends in tokens.bin (int64, one per document): the
                     document index, as Megatron-LM's .idx
    manifest.json    format, tokenizer (name, fingerprint, vocabulary, EOS), dtype, token and
                     document counts, and the source files with their sizes and SHA-256
    tokenizer/       the tokenizer's own files (none for bytes), for runs that name none

The manifest is written last: a folder without one is a preparation that did not finish.

Example:
    >>> m = Manifest(TokenizerInfo("bytes", "ab12", 257, 256), "uint16", tokens=10, documents=2,
    ...              sources=(SourceFile("a.jsonl", 40, "00ff"),), text_field="text")
    >>> Manifest.from_json(m.to_json()) == m
    True
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import Problem, ScheduleError
from .problems import error

__all__ = ["DOCUMENTS", "FORMAT", "MANIFEST", "TOKENIZER", "TOKENS", "Manifest", "SourceFile", "TokenizerInfo",
           "is_prepared"]

FORMAT = "slapo_fn.prepared/1"
MANIFEST = "manifest.json"
TOKENS = "tokens.bin"
DOCUMENTS = "documents.bin"
TOKENIZER = "tokenizer"


@dataclass(frozen=True)
class TokenizerInfo:
    name: str
    fingerprint: str
    vocab: int
    eos_id: int


@dataclass(frozen=True)
class SourceFile:
    path: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a prepared folder holds and what it was made from."""

    tokenizer: TokenizerInfo
    dtype: str
    tokens: int
    documents: int
    sources: tuple[SourceFile, ...]
    text_field: str
    format: str = FORMAT

    @property
    def fingerprint(self) -> str:
        """A hash of the tokenizer, the sources and the counts: what a checkpoint's data state names."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> Manifest:
        raw: dict[str, Any] = json.loads(text)
        return Manifest(TokenizerInfo(**raw["tokenizer"]), raw["dtype"], raw["tokens"], raw["documents"],
                        tuple(SourceFile(**s) for s in raw["sources"]), raw["text_field"], raw["format"])

    @staticmethod
    def read(folder: Path) -> Manifest:
        """The manifest of prepared ``folder``, checked against its files: a
        :class:`~slapo_fn.errors.ScheduleError` for no manifest, another format, or a
        token file or document index shorter or longer than the manifest says."""
        file = folder / MANIFEST
        if not file.is_file():
            raise error(folder, f"is not a prepared folder (no {MANIFEST}; a preparation that did not finish "
                                "leaves none)", "slapo-fn prepare --data SRC --tokenizer T --out FOLDER")
        try:
            manifest = Manifest.from_json(file.read_text())
        except (ValueError, KeyError, TypeError) as e:
            raise error(file, f"cannot be read ({type(e).__name__}: {e})",
                        "prepare the corpus again into an empty folder") from None
        problems = []
        if manifest.format != FORMAT:
            problems.append(Problem(str(file), f"is format {manifest.format!r}, this version reads {FORMAT!r}",
                                    "prepare the corpus again with this version"))
        itemsize = {"uint16": 2, "uint32": 4}.get(manifest.dtype, 0)
        for name, want in ((TOKENS, manifest.tokens * itemsize), (DOCUMENTS, manifest.documents * 8)):
            have = (folder / name).stat().st_size if (folder / name).is_file() else -1
            if have != want:
                problems.append(Problem(str(folder / name), "is missing" if have < 0 else
                                        f"holds {have} bytes where the manifest needs {want}",
                                        "prepare the corpus again into an empty folder"))
        if problems:
            raise ScheduleError("data", problems)
        return manifest


def is_prepared(path: Path) -> bool:
    """Whether ``path`` is a folder :func:`~slapo_fn.data.prepare` wrote (it has a manifest)."""
    return (path / MANIFEST).is_file()
