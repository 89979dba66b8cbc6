"""Mixtures: several sources sampled by weight, row by row, deterministically from the seed
and the step.

Row ``j`` of global batch ``step`` comes from source ``k`` with probability ``wₖ / Σw``,
drawn from a generator seeded by ``(seed, step)`` alone: every rank draws the same global
choices and takes its own slice of them, so the choices of a step do not depend on the
steps before it, and a resumed run draws what the uninterrupted one did. A weight is a
share of *rows*, so of tokens, as in Megatron-LM's blended datasets (a weight per document
would favour the source with longer documents). Each source then gives this rank as many
of its own next rows as were drawn for it: a stream its next packed rows
(:class:`~slapo_fn.data.StreamData`), a prepared folder the rows of its epoch order at
this rank's positions (:class:`Cursor`), so the ranks' rows stay disjoint. The checkpoint
holds each source's position.

Rows of every source take the keys of the mixture's: a text row (``attention_mask`` of
ones) mixed with chat rows packed apart takes ``position_ids`` 0, 1, … instead, which is
the same attention.

Example:
    >>> from slapo_fn.data import TokenData
    >>> a = TokenData.from_texts(["a" * 400], seq_len=4)
    >>> b = TokenData.from_texts(["b" * 400], seq_len=4)
    >>> mix = Mixture([Cursor(a), Cursor(b)], [0.75, 0.25], seed=0)
    >>> drawn = mix.choices(step=1, batch_size=8)  # a pure function of (seed, step)
    >>> drawn.tolist()
    [0, 0, 0, 1, 0, 0, 0, 1]
    >>> _ = mix.batch(0, batch_size=8)
    >>> rows = mix.batch(1, batch_size=8)["input_ids"]
    >>> [chr(r[0]) for r in rows.tolist()] == ["ab"[k] for k in drawn]
    True
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import Problem, ScheduleError
from .order import PositionalRows
from .problems import check_int, in_order_problems, raise_all

__all__ = ["Cursor", "Mixture", "RowSource"]


class RowSource(Protocol):
    """What a mixture draws rows from: this rank's next rows, and where it is."""

    @property
    def vocab(self) -> int: ...

    def rows(self, count: int, *, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Cursor:
    """Positional rows (:class:`~slapo_fn.data.PreparedData`, :class:`~slapo_fn.data.TokenData`)
    read in turn by each rank: its ``i``-th row is position ``i·dp_size + dp_rank`` of the
    endless sequence of epochs, so ranks are disjoint and together cover each epoch once."""

    def __init__(self, data: PositionalRows) -> None:
        self.data, self.taken = data, 0

    @property
    def vocab(self) -> int:
        return int(getattr(self.data, "vocab"))  # noqa: B009 (every positional kind has one)

    def __repr__(self) -> str:
        return f"Cursor({self.data!r})"

    def rows(self, count: int, *, dp_rank: int = 0, dp_size: int = 1) -> dict[str, torch.Tensor]:
        positions = (torch.arange(self.taken, self.taken + count) * dp_size + dp_rank)
        self.taken += count
        return {k: v for k, v in self.data.rows_at(positions).items() if isinstance(v, torch.Tensor)}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "cursor", "fingerprint": self.data.fingerprint, "taken": self.taken}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "cursor" or state.get("fingerprint") != self.data.fingerprint:
            raise ScheduleError("data", [Problem("state.fingerprint", f"the checkpoint's source is "
                                                 f"{state.get('fingerprint')!r}, this one {self.data.fingerprint!r}",
                                                 "resume with the sources of the saved run")])
        self.taken = int(state["taken"])


class Mixture:
    """``sources`` sampled row by row with ``weights`` (positive; they need not add up to 1)."""

    def __init__(self, sources: Sequence[RowSource], weights: Sequence[float], *, seed: int = 0,
                 names: Sequence[str] | None = None) -> None:
        problems = check_int("seed", seed, 0, "a non-negative int seed")
        if len(sources) != len(weights) or not sources:
            problems.append(Problem("weights", f"{len(weights)} weight(s) for {len(sources)} source(s)",
                                    "one positive weight per source"))
        problems += [Problem("weights", f"weight {w!r} of source {i} is not a positive number",
                             "positive weights, e.g. [0.7, 0.3]")
                     for i, w in enumerate(weights) if not (isinstance(w, int | float) and w > 0)]
        raise_all(problems)
        self.sources, self.seed = list(sources), seed
        self.names = list(names) if names is not None else [repr(s) for s in sources]
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self._step: int | None = None

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {w:.3g}" for n, w in zip(self.names, self.weights))
        return f"Mixture({parts}; seed {self.seed})"

    @property
    def vocab(self) -> int:
        return max(s.vocab for s in self.sources)

    def choices(self, step: int, batch_size: int) -> np.ndarray:
        """The source of each row of global batch ``step``: a pure function of ``(seed, step)``."""
        digest = hashlib.sha256(f"slapo_fn.data.mixture/{self.seed}/{step}".encode()).digest()
        rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))
        return rng.choice(len(self.sources), size=batch_size, p=self.weights)

    def batch(self, step: int, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> dict[str, torch.Tensor]:
        """This rank's ``batch_size // dp_size`` rows of global batch ``step``, in the drawn order."""
        raise_all(in_order_problems("a mixture of streams", step, self._step, batch_size, dp_size))
        local = batch_size // dp_size
        mine = self.choices(step, batch_size)[dp_rank * local: (dp_rank + 1) * local]
        drawn = {k: self.sources[k].rows(int(np.sum(mine == k)), dp_rank=dp_rank, dp_size=dp_size)
                 for k in np.unique(mine).tolist()}
        keys = set().union(*drawn.values())
        apart = "position_ids" in keys
        for rows in drawn.values():
            if apart and "position_ids" not in rows:  # a row that crosses documents: one sequence
                count, length = rows["input_ids"].shape
                rows["position_ids"] = torch.arange(length).expand(count, length).clone()
                rows.pop("attention_mask", None)
        taken = dict.fromkeys(drawn, 0)
        out: dict[str, list[torch.Tensor]] = {}
        for k in mine.tolist():
            for key, value in drawn[k].items():
                out.setdefault(key, []).append(value[taken[k]])
            taken[k] += 1
        self._step = step + 1
        return {key: torch.stack(values) for key, values in out.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixture", "seed": self.seed, "weights": self.weights.tolist(), "step": self._step,
                "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("weights")
        if state.get("kind") != "mixture" or state.get("seed") != self.seed or saved is None \
                or not np.allclose(saved, self.weights) or len(state["sources"]) != len(self.sources):
            raise ScheduleError("data", [Problem("state", f"the checkpoint's data is a {state.get('kind')} with seed "
                                                 f"{state.get('seed')} and weights {saved}, this one a mixture with "
                                                 f"seed {self.seed} and weights {self.weights.tolist()}",
                                                 "resume with the saved run's --data and --seed")])
        for source, saved_source in zip(self.sources, state["sources"]):
            source.load_state_dict(saved_source)
        self._step = state["step"]
