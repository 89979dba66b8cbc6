"""The order of rows: which rows global batch ``step`` holds, and each data-parallel rank's share.

:class:`PositionalRows` is what :class:`~slapo_fn.data.TokenData` and
:class:`~slapo_fn.data.PreparedData` share: ``n_train`` training rows (then the held-out
ones), visited in a fresh order per epoch; global batch ``step`` is positions ``step·B …
step·B + B - 1`` of that endless sequence (``B`` the *global* batch size), and data-parallel
rank ``r`` of ``n`` takes the ``r``-th of ``n`` equal slices, so the ranks' rows are
disjoint, together cover each epoch once, and the global batch does not depend on ``n``.
Nothing is consumed: a batch is a pure function of the step, and resuming is asking for
the next step (:meth:`~PositionalRows.state` / :meth:`~PositionalRows.resume` check that a
checkpoint's data is this data).

:func:`shuffled` is an epoch's order as a function, not a table: a keyed Feistel
permutation of ``[0, n)`` (cycle-walking on the next power of four), so that a corpus of a
billion rows is reordered every epoch with nothing held in memory and nothing computed
before step 1 — Megatron-LM builds and caches an index file for this; a permutation that
is computed where it is read needs neither.

Example:
    >>> import numpy as np
    >>> order = shuffled(np.arange(10), 10, seed=0, epoch=0)
    >>> sorted(order.tolist()) == list(range(10)), order.tolist() != list(range(10))
    (True, True)
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import Problem
from .problems import check_int, raise_all

if TYPE_CHECKING:
    from .packed import Batch

__all__ = ["PositionalRows", "shuffled"]

_ROUNDS = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _keys(seed: int, epoch: int) -> list[np.uint64]:
    digest = hashlib.sha256(f"slapo_fn.data.order/{seed}/{epoch}".encode()).digest()
    return [np.uint64(int.from_bytes(digest[4 * i: 4 * i + 8], "little")) for i in range(_ROUNDS)]


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """SplitMix64's finalizer of ``x + key``: every output bit depends on every input bit."""
    z = x + key + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))  # type: ignore[no-any-return]


def shuffled(positions: np.ndarray, n: int, *, seed: int, epoch: int) -> np.ndarray:
    """Where ``positions`` (ints in ``[0, n)``) go in epoch ``epoch``'s order of ``n`` rows:
    a permutation of ``[0, n)`` that is a pure function of ``(n, seed, epoch)``, computed
    for the positions asked only (int64, the shape of ``positions``)."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)  # a domain of 4**half >= n
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = _keys(seed, epoch)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & mask)
        return (left << shift) | right  # type: ignore[no-any-return]

    out = encrypt(np.asarray(positions, dtype=np.uint64))
    outside = out >= np.uint64(n)
    while outside.any():  # cycle-walk: the permutation of the larger domain, followed back into [0, n)
        out[outside] = encrypt(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


class PositionalRows(ABC):
    """Rows addressed by position: ``n_train`` training rows, then ``n_eval`` held out.

    Subclasses give :meth:`_order` (an epoch's order), :meth:`_rows` (the batch of given
    row indices), the sizes and a :attr:`fingerprint`; the batches, the eval batches and
    resuming are here, the same for every kind.
    """

    n_train: int
    seed: int

    @property
    @abstractmethod
    def seq_len(self) -> int: ...

    @property
    @abstractmethod
    def n_eval(self) -> int: ...

    @property
    @abstractmethod
    def fingerprint(self) -> str: ...

    @abstractmethod
    def _order(self, epoch: int, within: torch.Tensor) -> torch.Tensor:
        """The training rows at positions ``within`` of epoch ``epoch``'s order."""

    @abstractmethod
    def _rows(self, index: torch.Tensor) -> Batch:
        """The rows ``index`` (corpus order, held-out rows after the training ones) as a batch."""

    def steps_per_epoch(self, batch_size: int) -> int:
        """Full global batches in one pass over the training rows (batches run on across epochs)."""
        return self.n_train // batch_size

    def rows_at(self, positions: torch.Tensor) -> Batch:
        """The rows at ``positions`` of the endless sequence of epochs (position ``p`` is
        row ``p mod n_train`` of epoch ``p // n_train``'s order)."""
        epochs, within = positions // self.n_train, positions % self.n_train
        index = torch.empty_like(positions)
        for epoch in epochs.unique().tolist():
            chosen = epochs == epoch
            index[chosen] = self._order(int(epoch), within[chosen])
        return self._rows(index)

    def batch(self, step: int, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """Data-parallel rank ``dp_rank``'s ``batch_size // dp_size`` rows of global batch ``step``.

        ``batch_size`` is the global batch (all ranks together). A pure function of its
        arguments and the seed: call it with the step number, also after a resume.
        """
        problems = check_int("step", step, 0, "the 0-based step number")
        problems += self._check_dp(batch_size, dp_rank, dp_size)
        raise_all(problems)
        local = batch_size // dp_size
        start = step * batch_size + dp_rank * local
        return self.rows_at(torch.arange(start, start + local))

    def eval_batches(self, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> Iterator[Batch]:
        """The held-out rows in corpus order, ``n_eval // batch_size`` global batches (a
        remainder smaller than one batch is left out), rank ``dp_rank``'s share of each.

        Every rank gets the same number of batches, so a loop can all-reduce after each.
        """
        problems = self._check_dp(batch_size, dp_rank, dp_size)
        if not problems and self.n_eval < batch_size:
            problems.append(Problem("eval_fraction", f"holds out {self.n_eval} row(s), fewer than one batch of "
                                    f"{batch_size}", "a larger eval_fraction, or a smaller eval batch"))
        raise_all(problems)
        local = batch_size // dp_size
        for b in range(self.n_eval // batch_size):
            start = self.n_train + b * batch_size + dp_rank * local
            yield self._rows(torch.arange(start, start + local))

    def _check_dp(self, batch_size: int, dp_rank: int, dp_size: int) -> list[Problem]:
        problems = check_int("batch_size", batch_size, 1, "the global batch size, in rows")
        problems += check_int("dp_size", dp_size, 1, "the number of data-parallel ranks")
        if not problems and batch_size % dp_size:
            fit = dp_size * max(1, batch_size // dp_size)
            problems.append(Problem("batch_size", f"{batch_size} rows do not split evenly over {dp_size} "
                                    "data-parallel ranks", f"a multiple of {dp_size}, e.g. {fit}"))
        if not problems and not (isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
            problems.append(Problem("dp_rank", f"{dp_rank!r} is not a rank of {dp_size}", f"0 to {dp_size - 1}"))
        return problems

    # ----------------------------------------------------------------- resume

    def state(self, step: int, batch_size: int) -> dict[str, int | str]:
        """What a checkpoint saved after ``step`` steps stores about the data.

        ``position`` counts the global rows consumed; the rest identifies the data, so
        that :meth:`resume` can refuse a checkpoint of other data.
        """
        raise_all(check_int("step", step, 0, "the number of steps done") +
                  check_int("batch_size", batch_size, 1, "the global batch size, in rows"))
        position = step * batch_size
        return {"position": position, "epoch": position // self.n_train, "seed": self.seed,
                "seq_len": self.seq_len, "fingerprint": self.fingerprint}

    def resume(self, state: Mapping[str, object], batch_size: int) -> int:
        """The step to continue at after ``state`` (from :meth:`state`); the next batch
        is ``batch(step, batch_size, …)``, the one the uninterrupted run would have seen.

        Raises :class:`~slapo_fn.errors.ScheduleError` listing what differs if ``state``
        was saved with another corpus, tokenizer, ``seq_len`` or seed, or at a position
        ``batch_size`` does not divide.
        """
        problems = []
        for key, mine in (("fingerprint", self.fingerprint), ("seq_len", self.seq_len), ("seed", self.seed)):
            if state.get(key) != mine:
                problems.append(Problem(f"state.{key}", f"the checkpoint's data has {key} "
                                        f"{state.get(key)!r}, this data {mine!r}",
                                        "resume with the corpus, tokenizer, seq_len, seed and eval_fraction "
                                        "of the saved run"))
        saved = state.get("position")
        position = saved if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 0 else -1
        problems += check_int("batch_size", batch_size, 1, "the saved run's global batch size")
        if position < 0:
            problems.append(Problem("state.position", f"{saved!r} is not a row count",
                                    "a state returned by state()"))
        elif not problems and position % batch_size:
            problems.append(Problem("batch_size", f"{batch_size} does not divide the {position} rows consumed",
                                    "resume with the saved run's global batch size"))
        raise_all(problems)
        return position // batch_size
