"""What a training step did, and where it is written: :class:`StepRecord` and the loggers
:func:`slapo_fn.train.train` hands each record to on rank 0.

* :class:`ConsoleLog`: a progress bar and a loss line every few steps; ``done:`` only
  when the run reached its last step;
* :class:`JsonlLog`: one JSON line per step (``--metrics``), always valid JSON: a value
  that is not finite is ``null``;
* :class:`TensorBoardLog`: scalars for TensorBoard (the ``tensorboard`` extra);
* :class:`WandbLog`: a Weights & Biases run (the ``wandb`` extra), offline unless asked:
  written under a local folder, no network; ``wandb sync`` uploads it later.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import IO, Any, Literal

from tqdm import tqdm

from .errors import Problem, ScheduleError

__all__ = ["ConsoleLog", "JsonlLog", "StepRecord", "TensorBoardLog", "WandbLog"]


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step did. ``step`` counts steps done (1 after the first);
    ``loss`` is the mean over the global batch's target tokens (all data-parallel ranks
    and micro-steps); ``grad_norm`` the global norm before clipping; ``tokens`` the
    input tokens of the global batch; ``seconds`` the step's own time (forward, backward,
    update), ``tokens_per_s`` the global batch's tokens over it; ``first`` marks the
    first step of a run (compilation, allocation); ``eval_seconds`` and ``save_seconds``
    time its evaluation and checkpoint apart; ``tflops`` and ``mfu`` are one rank's
    achieved FLOP/s and its share of the hardware's peak; ``peak_mem_bytes`` the most
    loaded rank's peak memory and ``peak_mem_by_rank`` every rank's; ``eval_loss`` the
    held-out loss where evaluated."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    seconds: float
    tokens_per_s: float
    peak_mem_bytes: int | None = None
    train_mem_bytes: int | None = None
    mem_kind: str | None = None
    eval_loss: float | None = None
    skipped: bool = False
    first: bool = False
    eval_seconds: float | None = None
    save_seconds: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_mem_by_rank: tuple[int, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready fields: those that are ``None`` (not measured) and
        ``skipped=False`` left out, a value that is not finite as ``None`` (JSON's
        ``null``: JSON has no NaN).

        >>> StepRecord(6, float("nan"), 1e4, float("inf"), 64, 0.1, 640.0, skipped=True).as_dict()
        {'step': 6, 'loss': None, 'lr': 10000.0, 'grad_norm': None, 'tokens': 64, 'seconds': 0.1, \
'tokens_per_s': 640.0, 'skipped': True}
        """
        return {k: None if isinstance(v, float) and not math.isfinite(v) else list(v) if isinstance(v, tuple) else v
                for k, v in asdict(self).items() if v is not None and not (k in ("skipped", "first") and not v)}


class ConsoleLog:
    """A tqdm progress bar on ``bar_to`` (stderr; none with ``progress=False``) and a
    line ``step N loss L tokens/s R lr X grad_norm G`` every ``every`` steps, on the
    first, the last and a skipped one. :meth:`finish` (a run that reached its last step)
    prints ``done: loss a -> b over steps i..j``; :meth:`close` alone prints nothing more,
    so a failed run never ends on ``done:``."""

    def __init__(self, *, every: int, start: int, total: int, progress: bool = True,
                 out: IO[str] | None = None, bar_to: IO[str] | None = None) -> None:
        self.every, self.start, self.total = every, start, total
        self.out = out if out is not None else sys.stdout
        self.bar = tqdm(total=total, initial=start, desc="train", unit="step",
                        file=bar_to if bar_to is not None else sys.stderr) if progress else None
        self.first: float | None = None
        self.last: float | None = None
        self.steps: list[float] = []  # the steps' own seconds, the first step apart
        self.firsts: list[float] = []
        self.eval_s = self.save_s = 0.0

    def __call__(self, r: StepRecord) -> None:
        self.last = r.loss
        self.first = r.loss if self.first is None else self.first
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{r.loss:.4f}", tok_s=f"{r.tokens_per_s:,.0f}")
            self.bar.update(1)
        if not r.skipped:
            (self.firsts if r.first else self.steps).append(r.seconds)
            self.eval_s += r.eval_seconds or 0.0
            self.save_s += r.save_seconds or 0.0
        if r.step % self.every == 0 or r.step == self.start + 1 or r.step == self.total or r.skipped:
            rate = f" TFLOP/s {r.tflops:.3g}" if r.tflops is not None else ""
            rate += f" MFU {100 * r.mfu:.1f}%" if r.mfu is not None else ""
            mem = f" peak_mem {r.peak_mem_bytes / 2**30:.2f} GiB" if r.peak_mem_bytes is not None else ""
            print(f"step {r.step} loss {r.loss:.6f} tokens/s {r.tokens_per_s:.0f} lr {r.lr:.3e} "
                  f"grad_norm {r.grad_norm:.4g}" + rate + mem + (" skipped" if r.skipped else ""), file=self.out,
                  flush=True)
        if r.eval_loss is not None:
            print(f"step {r.step} eval_loss {r.eval_loss:.6f}", file=self.out, flush=True)

    def finish(self) -> None:
        """Close the bar and say how the loss went: the run reached its last step."""
        self.close()
        if self.first is not None and self.last is not None:
            times = f"; step {sum(self.steps) / len(self.steps):.3f} s" if self.steps else ""
            apart = [f"first step {sum(self.firsts):.2f} s"] if self.firsts else []
            apart += [f"{what} {seconds:.2f} s" for what, seconds in (("eval", self.eval_s), ("saves", self.save_s))
                      if seconds]
            print(f"done: loss {self.first:.4f} -> {self.last:.4f} over steps {self.start + 1}..{self.total}{times}"
                  + (f" ({', '.join(apart)} apart)" if apart else ""), file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class JsonlLog:
    """Each record as a JSON line appended to ``path`` (``slapo-fn train --metrics``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.file = open(path, "a")  # noqa: SIM115 (closed by close())

    def __call__(self, r: StepRecord) -> None:
        self.file.write(json.dumps(r.as_dict(), allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardLog:
    """Scalars for TensorBoard under ``directory``: ``train/loss``, ``train/lr``,
    ``train/grad_norm``, ``train/tokens_per_s``, ``train/peak_mem_bytes`` and
    ``eval/loss``. Needs the ``tensorboard`` package (``pip install 'slapo_fn[tensorboard]'``);
    without it, a :class:`~slapo_fn.ScheduleError` saying so."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # the tensorboard extra
        except ImportError as e:
            raise ScheduleError("tensorboard", [Problem(str(directory), f"TensorBoard logging needs the tensorboard "
                                                                     f"package ({e})",
                                                     "pip install 'slapo_fn[tensorboard]' (or: pip install "
                                                     "tensorboard), or leave out --tensorboard")]) from None
        self.writer = SummaryWriter(log_dir=str(directory))

    def __call__(self, r: StepRecord) -> None:
        scalars = {"train/loss": r.loss, "train/lr": r.lr, "train/grad_norm": r.grad_norm,
                   "train/tokens_per_s": r.tokens_per_s, "train/peak_mem_bytes": r.peak_mem_bytes,
                   "train/step_s": r.seconds, "train/tflops": r.tflops, "train/mfu": r.mfu, "eval/loss": r.eval_loss}
        for tag, value in scalars.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, r.step)

    def close(self) -> None:
        self.writer.close()


class WandbLog:
    """Each record as a step of a Weights & Biases run of ``project``: every figure of
    :meth:`StepRecord.as_dict` that is a number (non-finite ones left out), with
    ``config`` (the run's options). ``mode="offline"`` (the default) needs no network or
    account: the run is written under ``directory`` (``wandb/offline-run-…``) and
    ``wandb sync`` uploads it later. Needs the ``wandb`` package (``pip install
    'slapo_fn[wandb]'``); without it, a :class:`~slapo_fn.ScheduleError` saying so."""

    def __init__(self, project: str, directory: str | os.PathLike[str] = ".", *,
                 config: Mapping[str, Any] | None = None, mode: Literal["offline", "online"] = "offline") -> None:
        try:
            import wandb  # the wandb extra
        except ImportError as e:
            raise ScheduleError("wandb", [Problem(project, f"Weights & Biases logging needs the wandb package ({e})",
                                                  "pip install 'slapo_fn[wandb]' (or: pip install wandb), or leave "
                                                  "out --wandb")]) from None
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=project, dir=str(directory), mode=mode, config=dict(config or {}),
                              settings=wandb.Settings(silent=True))

    def __call__(self, r: StepRecord) -> None:
        figures = {k: v for k, v in r.as_dict().items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"}
        self.run.log(figures, step=r.step)

    def close(self) -> None:
        self.run.finish()
