"""Packing examples into rows of ``seq_len`` tokens on the fly, three ways.

* ``"crossing"`` — pre-training text: ``doc₀ EOS doc₁ EOS …`` cut into rows, attention
  crossing documents within a row (GPT-2/GPT-3, Megatron-LM's default, as
  :class:`~slapo_fn.data.TokenData`); rows have ``attention_mask`` (all ones) and
  ``labels`` equal to ``input_ids``.
* ``"apart"`` — examples that must not see each other (chat fine-tuning, or a mixture that
  holds chat): whole examples are placed in a row while they fit, the rest of the row is
  padding; ``position_ids`` restart at 0 at each example, which Hugging Face's LLaMA-family
  models (transformers' ``find_packed_sequence_indices``) turn into a block-diagonal
  causal mask when no ``attention_mask`` is given and no cache is made — the
  "padding-free" packing of ``DataCollatorWithFlattening``. The first token of each
  example, and padding, have label -100: nothing before them in the row may predict them.
* ``"padded"`` — one example per row, padded, with a 2-D ``attention_mask``: for model
  families whose attention does not read packed ``position_ids`` (see
  :func:`slapo_fn.data.attention.packing_for`).

Text longer than a row continues in the next rows; a chat example longer than a row is cut
at ``seq_len`` (as TRL's ``max_length``): a conversation split across rows would train its
second part without its prompt. A :class:`Packer` holds the examples not yet emitted; its
:meth:`~Packer.state_dict` is what a checkpoint saves so that a resumed run emits the
same rows.

Example:
    >>> import numpy as np
    >>> p = Packer(seq_len=4, mode="apart", eos_id=0)
    >>> p.add(np.array([5, 6, 0]), np.array([5, 6, 0]))
    >>> p.add(np.array([7, 0]), np.array([7, 0]))
    >>> row = p.row()
    >>> row["input_ids"].tolist(), row["position_ids"].tolist(), row["labels"].tolist()
    ([5, 6, 0, 0], [0, 1, 2, 0], [-100, 6, 0, -100])
"""

from __future__ import annotations

from collections import deque
from typing import Literal

import numpy as np
import torch

__all__ = ["IGNORE", "MODES", "Mode", "Packer"]

Mode = Literal["crossing", "apart", "padded"]
MODES: tuple[Mode, ...] = ("crossing", "apart", "padded")
IGNORE = -100


class Packer:
    """Examples in (token ids and labels), rows of ``seq_len`` out, in ``mode``."""

    def __init__(self, seq_len: int, mode: Mode, eos_id: int, *, cut: bool = False) -> None:
        """``cut``: an example longer than a row is cut at ``seq_len`` (chat), rather than
        continued in the next rows (text)."""
        self.seq_len, self.mode, self.eos_id, self.cut = seq_len, mode, eos_id, cut
        self._pending: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._tokens = 0

    @property
    def ready(self) -> bool:
        """Whether a whole row can be emitted without more examples (an ``"apart"`` row
        needs to see the example that no longer fits, or to be exactly full)."""
        return bool(self._pending) if self.mode == "padded" else self._tokens >= self.seq_len

    def add(self, ids: np.ndarray, labels: np.ndarray) -> None:
        """One example (int64 ids and labels, -100 where no loss)."""
        if self.cut:
            ids, labels = ids[: self.seq_len], labels[: self.seq_len]
        if self.mode == "crossing" or len(ids) <= self.seq_len:
            pieces = [(ids, labels)]
        else:  # a long text, continued row after row
            pieces = [(ids[i: i + self.seq_len], labels[i: i + self.seq_len]) for i in range(0, len(ids), self.seq_len)]
        for piece_ids, piece_labels in pieces:
            if len(piece_ids):
                self._pending.append((piece_ids, piece_labels))
                self._tokens += len(piece_ids)

    def row(self) -> dict[str, torch.Tensor]:
        """The next row (1-D tensors); call when :attr:`ready`."""
        if self.mode == "crossing":
            return self._crossing_row()
        taken: list[tuple[np.ndarray, np.ndarray]] = []
        used = 0
        while self._pending and used + len(self._pending[0][0]) <= self.seq_len \
                and (self.mode == "apart" or not taken):
            piece = self._pending.popleft()
            taken.append(piece)
            used += len(piece[0])
        self._tokens -= used
        pad = self.seq_len - used
        ids = np.concatenate([p[0] for p in taken] + [np.full(pad, self.eos_id, dtype=np.int64)])
        labels = np.concatenate([_first_ignored(p[1]) for p in taken] + [np.full(pad, IGNORE, dtype=np.int64)])
        out = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if self.mode == "apart":
            out["position_ids"] = torch.from_numpy(np.concatenate([np.arange(len(p[0])) for p in taken]
                                                                  + [np.arange(pad)]))
        else:
            out["attention_mask"] = torch.from_numpy((np.arange(self.seq_len) < used).astype(np.int64))
        return out

    def _crossing_row(self) -> dict[str, torch.Tensor]:
        parts_ids, parts_labels, need = [], [], self.seq_len
        while need:
            ids, labels = self._pending[0]
            if len(ids) <= need:
                self._pending.popleft()
            else:
                self._pending[0] = (ids[need:], labels[need:])
                ids, labels = ids[:need], labels[:need]
            parts_ids.append(ids)
            parts_labels.append(labels)
            need -= len(ids)
        self._tokens -= self.seq_len
        ids_t = torch.from_numpy(np.concatenate(parts_ids))
        return {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t),
                "labels": torch.from_numpy(np.concatenate(parts_labels))}

    # ----------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The examples not yet emitted, as tensors (what ``torch.load(weights_only=True)`` reads)."""
        pieces = list(self._pending)
        return {"ids": torch.from_numpy(np.concatenate([p[0] for p in pieces] or [np.empty(0, np.int64)])),
                "labels": torch.from_numpy(np.concatenate([p[1] for p in pieces] or [np.empty(0, np.int64)])),
                "lengths": torch.tensor([len(p[0]) for p in pieces], dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        ids, labels = state["ids"].numpy(), state["labels"].numpy()
        ends = np.cumsum(state["lengths"].numpy())
        self._pending = deque((ids[s:e], labels[s:e]) for s, e in zip(np.concatenate([[0], ends[:-1]]), ends))
        self._tokens = int(ends[-1]) if len(ends) else 0


def _first_ignored(labels: np.ndarray) -> np.ndarray:
    """``labels`` with its first position -100: the tokens before it in the row are another example's."""
    out = labels.copy()
    out[:1] = IGNORE
    return out
