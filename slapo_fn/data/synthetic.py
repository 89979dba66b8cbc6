"""Synthetic and byte-level data, each a pure function of ``(seed, step)``.

* :class:`Arithmetic` — sequences ``start, start+k, start+2k, … (mod vocab)``: a model
  learns to continue them within a few dozen steps, so the loss visibly falls.
* :class:`ByteText` — random windows of a text file, one token per byte (vocab 256).

Example:
    >>> batch = Arithmetic(vocab=32).batch(step=0, size=2, length=5)
    >>> batch.shape
    torch.Size([2, 5])
    >>> bool(((batch[:, 1] - batch[:, 0]) % 32 == (batch[:, 2] - batch[:, 1]) % 32).all())
    True
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Arithmetic", "ByteText", "Dataset"]


@dataclass(frozen=True)
class Arithmetic:
    vocab: int
    seed: int = 0
    max_step: int = 8

    def batch(self, step: int, size: int, length: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab, (size, 1), generator=gen)
        stride = torch.randint(1, self.max_step, (size, 1), generator=gen)
        return (start + stride * torch.arange(length)) % self.vocab


@dataclass(frozen=True)
class ByteText:
    data: bytes
    seed: int = 0

    @staticmethod
    def from_file(path: str | Path, seed: int = 0) -> ByteText:
        data = Path(path).read_bytes()
        if len(data) < 2:
            raise ValueError(f"{path}: a text file of at least 2 bytes is needed, got {len(data)}")
        return ByteText(data, seed)

    @property
    def vocab(self) -> int:
        return 256

    @functools.cached_property
    def _tokens(self) -> torch.Tensor:
        """The file's bytes as a uint8 tensor, made once (``batch`` runs every step)."""
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8)

    def batch(self, step: int, size: int, length: int) -> torch.Tensor:
        tokens = self._tokens
        if tokens.numel() <= length:
            tokens = tokens.repeat(length // tokens.numel() + 2)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, tokens.numel() - length, (size,), generator=gen)
        return torch.stack([tokens[s : s + length] for s in starts.tolist()]).long()


Dataset = Arithmetic | ByteText
