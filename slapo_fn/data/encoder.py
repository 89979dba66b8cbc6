"""A tokenizer that crosses process boundaries: what :func:`~slapo_fn.data.prepare`'s
worker processes encode with, and what says whether two tokenizers are the same.

An :class:`Encoder` is a value: bytes (UTF-8, EOS 256), or the JSON of a ``tokenizers``
tokenizer (what a fast ``transformers`` tokenizer runs underneath), with its EOS id and
vocabulary size. It pickles as that JSON and loads once per process; it imports neither
torch nor transformers, so workers start in a fraction of a second.

Example:
    >>> enc = Encoder.byte_level()
    >>> ids, lengths = enc.encode_documents(["hi", "é"])
    >>> ids.tolist(), lengths.tolist(), ids.dtype.name
    ([104, 105, 256, 195, 169, 256], [3, 3], 'uint16')
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import tokenizers

__all__ = ["Encoder", "token_dtype"]

_SUB_BATCH_CHARS = 1 << 20  # texts encoded at a time: bounds the library's per-token objects


def token_dtype(vocab: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids below ``vocab`` (uint16 up to 65,536 tokens)."""
    return np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)


@functools.lru_cache(maxsize=2)
def _loaded(json: str) -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json)


@dataclass(frozen=True)
class Encoder:
    """Bytes (``json is None``) or a ``tokenizers`` tokenizer, as a picklable value."""

    json: str | None = field(repr=False)
    eos_id: int
    vocab: int

    @staticmethod
    def byte_level() -> Encoder:
        return Encoder(None, 256, 257)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of what encodes: equal for tokenizers that give the same ids and EOS."""
        digest = hashlib.sha256(b"bytes" if self.json is None else self.json.encode())
        digest.update(f"/{self.eos_id}/{self.vocab}".encode())
        return digest.hexdigest()[:16]

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids, without special tokens."""
        if self.json is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in _loaded(self.json).encode_batch_fast(list(texts), add_special_tokens=False)]

    def encode_documents(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``doc₀ EOS doc₁ EOS …`` as one array of :attr:`dtype`, and each document's
        length with its EOS (int64); a few MB of text at a time, so that the tokenizer's
        per-token objects stay small."""
        pieces: list[np.ndarray] = []
        lengths: list[int] = []
        start = 0
        while start < len(texts):
            stop, chars = start, 0
            while stop < len(texts) and (stop == start or chars < _SUB_BATCH_CHARS):
                chars += len(texts[stop])
                stop += 1
            for ids in self._encode_arrays(texts[start:stop]):
                pieces += [ids, np.array([self.eos_id], dtype=self.dtype)]
                lengths.append(len(ids) + 1)
            start = stop
        flat = np.concatenate(pieces) if pieces else np.empty(0, dtype=self.dtype)
        return flat, np.asarray(lengths, dtype=np.int64)

    def _encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        if self.json is None:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(self.dtype) for t in texts]
        return [np.asarray(ids, dtype=self.dtype) for ids in self.encode(texts)]
