"""Training on a prepared folder: :class:`PreparedData` maps ``tokens.bin`` and reads rows.

Opening reads the manifest and maps the token file; nothing is read or computed ahead, so
a run starts in the same time on a terabyte as on a megabyte. The flat stream
``doc₀ EOS doc₁ EOS …`` is cut into rows of ``seq_len`` tokens (a last partial row is
left out, as Megatron-LM does); the last ``ceil(eval_fraction · rows)`` rows are held out.
Training rows are visited in a fresh order per epoch (:func:`~slapo_fn.data.order.shuffled`,
computed for the rows asked only) and split between data-parallel ranks as
:class:`~slapo_fn.data.order.PositionalRows` says: each rank reads its own rows, and
nothing else, from the map. Attention crosses documents within a row, as in
:class:`~slapo_fn.data.TokenData`.

Example:
    >>> import tempfile, pathlib
    >>> from slapo_fn.data import prepare
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "c.jsonl").write_text('{"text": "hello"}\\n{"text": "world"}\\n')
    >>> _ = prepare(folder / "c.jsonl", None, folder / "p", workers=0, progress=False)
    >>> data = PreparedData.open(folder / "p", seq_len=4)
    >>> data
    PreparedData(3 train + 0 eval sequences of 4 tokens, vocab 257, seed 0, bytes)
    >>> data.batch(0, batch_size=3)["input_ids"].shape
    torch.Size([3, 4])
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import Problem
from .codec import Codec
from .manifest import TOKENIZER, TOKENS, Manifest
from .order import PositionalRows, shuffled
from .packed import Batch, check_options
from .problems import error, raise_all

if TYPE_CHECKING:
    import tokenizers
    from transformers import PreTrainedTokenizerBase

__all__ = ["PreparedData"]


@dataclass(frozen=True, eq=False)
class PreparedData(PositionalRows):
    """A prepared folder (:func:`~slapo_fn.data.prepare`) as rows of ``seq_len`` tokens:
    sharded, shuffled per epoch, resumable. Build it with :meth:`open`."""

    folder: Path
    manifest: Manifest = field(repr=False)
    tokens: np.ndarray = field(repr=False)
    """The memory-mapped token file."""
    length: int
    """Tokens per row (``seq_len``)."""
    n_train: int
    n_rows: int
    seed: int = 0

    def __repr__(self) -> str:
        return (f"PreparedData({self.n_train} train + {self.n_eval} eval sequences of {self.seq_len} tokens, "
                f"vocab {self.vocab}, seed {self.seed}, {self.manifest.tokenizer.name})")

    @classmethod
    def open(cls, folder: str | Path, *, seq_len: int, seed: int = 0, eval_fraction: float = 0.0,
             tokenizer: PreTrainedTokenizerBase | tokenizers.Tokenizer | Codec | str | Path | None = None
             ) -> PreparedData:
        """Map prepared ``folder`` for rows of ``seq_len`` tokens.

        ``tokenizer``, where given (anything :meth:`Codec.of <slapo_fn.data.Codec.of>`
        takes), must be the one the folder was prepared with: another one's ids would mean
        other words to the model. A :class:`~slapo_fn.errors.ScheduleError` says so, as it
        does for a folder that is not prepared, is incomplete, or has too few tokens.
        """
        check_options(seq_len, seed, eval_fraction)
        folder = Path(folder)
        manifest = Manifest.read(folder)
        if tokenizer is not None:
            raise_all(tokenizer_problems(manifest, Codec.of(tokenizer), folder))
        n_rows = manifest.tokens // seq_len
        n_eval = math.ceil(eval_fraction * n_rows)
        if n_rows - n_eval < 1:
            raise error(folder, f"holds {manifest.tokens} tokens: {n_rows} row(s) of {seq_len}, too few to hold "
                                f"out {eval_fraction:.0%} and still train",
                        "a larger corpus, a shorter seq_len, or a smaller eval_fraction")
        tokens = np.memmap(folder / TOKENS, dtype=np.dtype(manifest.dtype), mode="r", shape=(manifest.tokens,))
        return cls(folder, manifest, tokens, seq_len, n_rows - n_eval, n_rows, seed)

    # ----------------------------------------------------------------- sizes

    @property
    def seq_len(self) -> int:
        return self.length

    @property
    def n_eval(self) -> int:
        return self.n_rows - self.n_train

    @property
    def vocab(self) -> int:
        return self.manifest.tokenizer.vocab

    @property
    def eos_id(self) -> int:
        return self.manifest.tokenizer.eos_id

    @functools.cached_property
    def codec(self) -> Codec:
        """The tokenizer the folder was prepared with (its saved files; bytes if none)."""
        saved = self.folder / TOKENIZER
        return Codec.of(saved) if saved.is_dir() else Codec.byte_level()

    @property
    def fingerprint(self) -> str:
        """The manifest's fingerprint and the split: what a checkpoint's data state names."""
        text = f"{self.manifest.fingerprint}/{self.n_train}/{self.n_rows}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # ----------------------------------------------------------------- rows

    def _order(self, epoch: int, within: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(shuffled(within.numpy(), self.n_train, seed=self.seed, epoch=epoch))

    def _rows(self, index: torch.Tensor) -> Batch:
        starts = index.numpy() * self.length
        rows = np.stack([self.tokens[s: s + self.length] for s in starts.tolist()]).astype(np.int64)
        input_ids = torch.from_numpy(rows)
        return Batch(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids.clone())


def tokenizer_problems(manifest: Manifest, codec: Codec, folder: Path) -> list[Problem]:
    """``[]`` if ``codec`` is the tokenizer ``folder`` was prepared with, else the problem."""
    mine = manifest.tokenizer
    if codec.fingerprint == mine.fingerprint:
        return []
    return [Problem(str(folder), f"was prepared with tokenizer {mine.name} (fingerprint {mine.fingerprint}, "
                                 f"{mine.vocab} tokens); this run's is {codec.name} (fingerprint {codec.fingerprint}, "
                                 f"{codec.vocab} tokens)",
                    "train with the tokenizer it was prepared with (or no --tokenizer: the folder's own), or "
                    "prepare the corpus again with this one")]
