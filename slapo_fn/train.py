"""The training loop as a plain function: :func:`train`.

``train(model_or_pipeline, optimizer, data, steps=..., batch_size=...)`` runs the steps a
user of PyTorch distributed training expects, on any model ``sf.build`` or
``sf.build_pipeline`` made (tensor, sequence, pipeline and data parallel, FSDP2):

* the learning rate of each step from an :class:`LRSchedule` (linear warmup, then a
  cosine, linear or constant decay to ``min_lr``);
* gradient accumulation over ``grad_accum`` micro-steps, FSDP2's gradient
  reduce-scatter only on the last one (``set_requires_gradient_sync``); the loss is the
  mean over every target token of the step's global batch, so accumulation gives the
  full batch's gradients;
* gradient clipping by the global norm, right across TP and FSDP meshes and pipeline
  stages (:func:`slapo_fn.clip_grad_norm_`); the norm is logged either way;
* ``autocast`` (bf16) where the model has no FSDP2 mixed precision; parameters, the
  optimizer and reductions stay float32 (see :func:`precision`);
* an eval loss every ``eval_every`` steps from ``data.eval_batches`` when the data has it;
* a guard before the optimizer update: a loss, global grad norm or learning rate that
  is not finite stops the run (:class:`NonFiniteError`: no update, no checkpoint), or
  with ``nonfinite="skip"`` skips the step, up to ``max_skipped`` of them;
* checkpoints every ``Checkpointing.every`` steps and at the end, with the RNG state of
  each rank verified with them, and :func:`resume`, which falls back to the newest
  checkpoint that verifies; a save without room (or failing part-way) is skipped with
  one line, except the last;
* per-step :class:`StepRecord` values to loggers (:mod:`slapo_fn.loggers`):
  :class:`ConsoleLog` (progress bar and loss lines), :class:`JsonlLog` (``--metrics``),
  :class:`TensorBoardLog`.

``data`` is any object with ``batch(step, batch_size, dp_rank=, dp_size=)`` returning this
data-parallel rank's share of step ``step``'s global batch of ``batch_size`` sequences:
a dict with ``input_ids`` and ``labels`` (Hugging Face's convention: ``labels`` line up
with ``input_ids`` and the loss shifts them; ``-100`` is ignored) and optionally
``attention_mask`` or other keyword inputs of the model. A pure function of ``step``
makes a resumed run see the batches of an uninterrupted one. :class:`TokenBatches`
adapts the synthetic task and byte-level text of :mod:`slapo_fn.data`.

Example:
    >>> import torch, slapo_fn as sf
    >>> from slapo_fn.data import Arithmetic
    >>> from slapo_fn.presets import build_model
    >>> model = sf.build(sf.create_schedule(build_model("llama-tiny")), init="full")
    >>> opt = adamw(model, lr=1e-2)
    >>> records = train(model, opt, TokenBatches(Arithmetic(vocab=64), seq_len=16), steps=3, batch_size=4)
    >>> [r.step for r in records], records[-1].loss < records[0].loss
    ([1, 2, 3], True)
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .checkpoint_dir import RANK_STATE, free_bytes, step_name
from .data import Arithmetic, ByteText
from .dtensor.context_runtime import context_split
from .dtensor.data_parallel import DATA_PARALLEL, DataParallelSpec
from .errors import Problem, ScheduleError
from .func import clip_grad_norm_, global_norm
from .hf import config_of, config_value, is_encoder_decoder
from .loggers import ConsoleLog, JsonlLog, StepRecord, TensorBoardLog
from .options import Split
from .pipelines import Pipeline
from .schedule import Schedule
from .state import CheckpointFallback, CheckpointSpaceError, CheckpointWriteError, load, rank_state, save

__all__ = [
    "ADAMW_IMPLS",
    "IGNORE_INDEX",
    "Batches",
    "Checkpointing",
    "ConsoleLog",
    "JsonlLog",
    "LRSchedule",
    "NonFiniteError",
    "Seq2Seq",
    "StepRecord",
    "TensorBoardLog",
    "TokenBatches",
    "TrainError",
    "adamw",
    "causal_lm_loss",
    "next_token_loss",
    "parse_dtype",
    "peak_memory",
    "precision",
    "resume",
    "train",
]

#: Label value that no loss counts (padding, document boundaries), as in Hugging Face.
IGNORE_INDEX = -100
#: What :func:`train` does with a step whose loss, grad norm or learning rate is not finite.
NONFINITE = ("stop", "skip")

Model: TypeAlias = "nn.Module | Pipeline"
Logger: TypeAlias = "Callable[[StepRecord], None]"
Decay = Literal["cosine", "linear", "constant"]
DECAYS: tuple[str, ...] = ("cosine", "linear", "constant")
DTYPES: Mapping[str, torch.dtype] = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                                     "bfloat16": torch.bfloat16}


class TrainError(ScheduleError):
    """Arguments of :func:`train` (or its helpers) that cannot work, all reported at once,
    each naming the argument, why, and a fix. A ``ValueError``."""


class NonFiniteError(FloatingPointError):
    """:func:`train` stopped before an optimizer update whose loss, global grad norm or
    learning rate was not finite (or after more than ``max_skipped`` skipped steps): the
    model and optimizer are those of the step before, and nothing was saved. ``step`` is
    the step that was not taken; the message is one line with the values."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


# -- the learning rate ------------------------------------------------------------------------
@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of each step: ``warmup`` steps rising linearly to ``lr`` (step
    ``s < warmup`` gets ``lr * (s + 1) / warmup``), then ``decay`` from ``lr`` to
    ``min_lr`` over the remaining steps up to ``total``: ``"cosine"`` (half a cosine),
    ``"linear"``, or ``"constant"`` (``lr`` throughout). Steps count from 0.

    >>> s = LRSchedule(1.0, warmup=2, decay="linear", min_lr=0.0, total=6)
    >>> [round(s(i), 3) for i in range(6)]
    [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    """

    lr: float
    warmup: int = 0
    decay: Decay = "constant"
    min_lr: float = 0.0
    total: int = 1

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(Problem("lr", f"must be a positive number, got {self.lr}", "lr=3e-4"))
        if not self.warmup >= 0:
            problems.append(Problem("warmup", f"must be at least 0 steps, got {self.warmup}", "warmup=0"))
        if self.decay not in DECAYS:
            problems.append(Problem("decay", f"unknown decay {self.decay!r}", f"one of {', '.join(DECAYS)}"))
        if not (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            problems.append(Problem("min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}", "min_lr=0.0"))
        if not self.total >= 1:
            problems.append(Problem("total", f"must be at least 1 step, got {self.total}", "total=steps"))
        if problems:
            raise TrainError("LRSchedule", problems)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.decay == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.decay == "linear":
            return self.lr + (self.min_lr - self.lr) * progress
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


# -- data -------------------------------------------------------------------------------------
@runtime_checkable
class Batches(Protocol):
    """What :func:`train` reads: ``batch(step, batch_size, dp_rank=, dp_size=)``, this
    data-parallel rank's share of step ``step``'s global batch of ``batch_size``
    sequences (:class:`slapo_fn.data.TokenData`, :class:`TokenBatches`), a dict of tensors (``input_ids``, ``labels``,
    optionally ``attention_mask`` and other keyword inputs of the model). Data with eval
    batches also has ``eval_batches(batch_size=, dp_rank=, dp_size=)``: an iterable of
    such dicts."""

    def batch(self, step: int, batch_size: int, *, dp_rank: int, dp_size: int) -> Mapping[str, torch.Tensor]: ...


@dataclass(frozen=True)
class TokenBatches:
    """:class:`~slapo_fn.data.Arithmetic` or :class:`~slapo_fn.data.ByteText` as
    :class:`Batches`: sequences of ``seq_len`` tokens, ``labels`` equal to
    ``input_ids`` (the loss shifts them), every rank drawing the same global batch and
    keeping its rows. No eval split.

    >>> b = TokenBatches(Arithmetic(vocab=32), seq_len=5).batch(0, 4, dp_rank=1, dp_size=2)
    >>> b["input_ids"].shape, bool((b["labels"] == b["input_ids"]).all())
    (torch.Size([2, 5]), True)
    """

    source: Arithmetic | ByteText
    seq_len: int

    @property
    def vocab(self) -> int:
        return int(self.source.vocab)

    def batch(self, step: int, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> dict[str, torch.Tensor]:
        if batch_size % dp_size:
            raise TrainError("TokenBatches.batch", [Problem(
                "batch_size", f"{batch_size} sequences do not split evenly over {dp_size} data-parallel ranks",
                f"a multiple of {dp_size}")])
        ids = self.source.batch(step, batch_size, self.seq_len).chunk(dp_size)[dp_rank].contiguous()
        return {"input_ids": ids, "labels": ids.clone()}


# -- loss -------------------------------------------------------------------------------------
def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, reduction: Literal["mean", "sum"] = "mean") \
        -> torch.Tensor:
    """Next-token cross entropy in float32: ``logits[:, t]`` predicts ``labels[:, t + 1]``
    (Hugging Face's convention), labels ``-100`` ignored; the mean over counted tokens or
    their sum. Also a pipeline's ``loss_fn``.

    >>> logits = torch.zeros(1, 3, 4)
    >>> round(causal_lm_loss(logits, torch.tensor([[0, 1, 2]])).item(), 4) == round(math.log(4), 4)
    True
    """
    return next_token_loss(logits[:, :-1], labels[:, 1:], reduction=reduction)


def next_token_loss(logits: torch.Tensor, shift_labels: torch.Tensor, *,
                    reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
    """Cross entropy in float32 of ``logits[:, t]`` against ``shift_labels[:, t]``: targets
    already shifted (a context-parallel rank's chunks of them; ``-100`` ignored). The
    pipeline's ``loss_fn`` under context parallelism.

    >>> logits = torch.zeros(1, 3, 4)
    >>> round(next_token_loss(logits, torch.tensor([[1, 2, -100]])).item(), 4) == round(math.log(4), 4)
    True
    """
    return F.cross_entropy(logits.float().flatten(0, 1), shift_labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


#: The keys of a batch that are the loss's, not the model's inputs.
_TARGETS = ("labels", "shift_labels")


@dataclass(frozen=True)
class Seq2Seq:
    """The objective of an encoder-decoder, as Hugging Face's models train when given
    ``labels``: the encoder reads ``input_ids``; the decoder reads ``labels`` shifted right
    by one (``decoder_start`` first, ``-100`` read as ``pad``), and ``logits[:, t]``
    predicts ``labels[:, t]`` (no shift in the loss). On language-model data, whose labels
    are the input tokens, the model learns to reproduce its input.

    >>> s = Seq2Seq(decoder_start=0, pad=1)
    >>> s.inputs({"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[5, 6, -100]])})["decoder_input_ids"]
    tensor([[0, 5, 6]])
    >>> round(s.loss(torch.zeros(1, 3, 4), torch.tensor([[0, 1, -100]])).item(), 4) == round(math.log(4), 4)
    True
    """

    decoder_start: int
    pad: int

    @classmethod
    def of(cls, model: nn.Module) -> Seq2Seq | None:
        """The objective of ``model`` where it is a Hugging Face encoder-decoder (its config's
        ``decoder_start_token_id`` and ``pad_token_id``); ``None`` for a causal LM."""
        if not is_encoder_decoder(model):
            return None
        config = config_of(model)
        start = config_value(config, "decoder_start_token_id", default=None)
        pad = config_value(config, "pad_token_id", default=None)
        start = pad if start is None else start
        return cls(int(start or 0), int(pad if pad is not None else start or 0))

    def inputs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` with ``decoder_input_ids`` (its labels shifted right) where it has none."""
        if "decoder_input_ids" in batch:
            return dict(batch)
        labels = batch["labels"]
        shifted = torch.cat([torch.full_like(labels[:, :1], self.decoder_start), labels[:, :-1]], dim=1)
        return {**batch, "decoder_input_ids": shifted.masked_fill(shifted == IGNORE_INDEX, self.pad)}

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, *,
             reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
        """Cross entropy in float32 of ``logits[:, t]`` against ``labels[:, t]``, ``-100``
        ignored; the mean over counted tokens or their sum. Also a pipeline's ``loss_fn``."""
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction=reduction)


def _loss_sum(model: nn.Module, out: Any, part: Mapping[str, torch.Tensor],
              seq2seq: Seq2Seq | None = None) -> torch.Tensor:
    """The summed loss of ``model``'s output ``out`` for the batch ``part``'s targets: an
    encoder-decoder's (``seq2seq``) on its labels unshifted; else the next-token loss on
    its ``shift_labels`` where a context-parallel model's loader cut the batch (already
    shifted globally and cut to this rank's chunks), or on its ``labels`` — on this rank's
    tokens where the model is context-parallel (its logits are this rank's chunks; the
    targets are shifted globally, then cut). Over the ``cp`` ranks the sums add up to the
    whole batch's."""
    logits = _logits(out)
    if seq2seq is not None:
        return seq2seq.loss(logits, part["labels"], reduction="sum")
    split = context_split(model)
    if "shift_labels" in part:
        targets = part["shift_labels"]
    elif split is None:
        return causal_lm_loss(logits, part["labels"], reduction="sum")
    else:
        targets = split.targets(part["labels"])
    return next_token_loss(logits, targets, reduction="sum")


def _targets(part: Mapping[str, torch.Tensor], seq2seq: Seq2Seq | None = None) -> int:
    """How many tokens of the batch ``part`` the loss counts (of this rank's chunks where
    a loader cut it for context parallelism; all but the first of each row, which no token
    predicts, for a causal LM; all for an encoder-decoder)."""
    if "shift_labels" in part:
        return int((part["shift_labels"] != IGNORE_INDEX).sum())
    labels = part["labels"]
    return int(((labels if seq2seq is not None else labels[:, 1:]) != IGNORE_INDEX).sum())


def _target(part: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A pipeline's target of the batch ``part``: its ``shift_labels`` where a loader cut
    it for context parallelism (:func:`next_token_loss`), else its ``labels``."""
    return part["shift_labels"] if "shift_labels" in part else part["labels"]


def _collated(model: Model, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``model`` takes of a global batch: this rank's chunks where it is
    context-parallel with ``inputs_split`` (:meth:`ContextSplit.collate`), else all of it."""
    stage = next(iter(model.modules.values()), None) if isinstance(model, Pipeline) else model
    split = context_split(stage) if stage is not None else None
    return split.collate(batch) if split is not None else dict(batch)


def _inputs(part: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The token ids of a batch and its other keyword inputs of the model (not the targets)."""
    return part["input_ids"], {k: v for k, v in part.items() if k not in ("input_ids", *_TARGETS)}


# -- optimizer and precision -------------------------------------------------------------------
#: AdamW's implementations (``adamw(impl=...)``): the keyword arguments of ``torch.optim.AdamW`` each stands for.
ADAMW_IMPLS: Mapping[str, Mapping[str, bool]] = MappingProxyType({
    "auto": MappingProxyType({}),  # torch's choice: foreach where every parameter is on a GPU, else the for-loop
    "foreach": MappingProxyType({"foreach": True}),
    "fused": MappingProxyType({"fused": True}),
    "for-loop": MappingProxyType({"foreach": False}),
})


def adamw(model: Model, *, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
          eps: float = 1e-8, impl: str = "auto") -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``model``'s parameters, weight decay on the matrices
    only (parameters of two or more dimensions: weights of linear layers and embeddings;
    not biases or norm scales), as GPT-style training does. ``impl`` picks its kernels
    (:data:`ADAMW_IMPLS`): ``"auto"`` (torch's default), ``"foreach"``, ``"fused"`` or
    ``"for-loop"``.

    >>> opt = adamw(nn.Linear(2, 2), lr=1e-3, weight_decay=0.1, impl="fused")
    >>> [(len(g["params"]), g["weight_decay"], g["fused"]) for g in opt.param_groups]
    [(1, 0.1, True), (1, 0.0, True)]
    """
    problems = []
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        problems.append(Problem("weight_decay", f"must be a number >= 0, got {weight_decay}",
                                "weight_decay=0.1 (or 0.0: none)"))
    if impl not in ADAMW_IMPLS:
        problems.append(Problem("impl", f"unknown AdamW implementation {impl!r}", f"one of {', '.join(ADAMW_IMPLS)}"))
    if problems:
        raise TrainError("adamw", problems)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": g, "weight_decay": wd} for g, wd in ((decay, weight_decay), (rest, 0.0)) if g]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **ADAMW_IMPLS[impl])


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``"fp32"``/``"float32"`` (or a dtype) as a dtype.

    >>> parse_dtype("bf16")
    torch.bfloat16
    """
    if isinstance(name, torch.dtype) and name in DTYPES.values():
        return name
    if isinstance(name, str) and name.lower() in DTYPES:
        return DTYPES[name.lower()]
    raise TrainError("dtype", [Problem(str(name), "is not a training dtype", "bf16 or fp32")])


def precision(sch: Schedule, dtype: str | torch.dtype) -> tuple[Schedule, torch.dtype | None]:
    """Mixed precision for training ``sch`` in ``dtype``: a schedule whose FSDP2 data
    parallelism (``sf.data_parallel``, ``fsdp``/``hsdp``/``ddp`` modes) computes in
    ``dtype`` (``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)``), and
    the dtype :func:`train` should ``autocast`` to — ``None`` where FSDP2 casts, or for
    float32. Either way parameters and optimizer state stay float32. Returns a new
    schedule; the input is unchanged.

    >>> from slapo_fn import create_schedule
    >>> sch, cast = precision(create_schedule(nn.Linear(2, 2)), "bf16")
    >>> cast
    torch.bfloat16
    """
    dtype = parse_dtype(dtype)
    if dtype == torch.float32:
        return sch, None
    spec: DataParallelSpec | None = sch.annotations.get("", DATA_PARALLEL)
    if spec is None:
        return sch, dtype
    mixed = replace(spec, param_dtype=dtype, reduce_dtype=torch.float32)
    return sch.annotate_path("", DATA_PARALLEL, mixed), None


# -- checkpoints ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpointing:
    """Where and how often :func:`train` saves: every ``every`` steps (0: only at the
    end) and after the last step, into ``directory`` (``sf.save``), keeping the newest
    ``keep`` (two by default, so that a corrupted newest one has one to fall back to).
    ``free_space(directory)`` gives the free bytes a save checks first
    (:func:`slapo_fn.checkpoint_dir.free_bytes`); ``meta`` is kept in each checkpoint's
    manifest (the command line keeps the options a resume must match)."""

    directory: str | os.PathLike[str]
    every: int = 0
    keep: int = 2
    free_space: Callable[[Path], int] = free_bytes
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if not self.every >= 0:
            problems.append(Problem("every", f"must be at least 0, got {self.every}", "every=0 (only at the end)"))
        if not self.keep >= 1:
            problems.append(Problem("keep", f"must be at least 1, got {self.keep}", "keep=2"))
        if problems:
            raise TrainError("Checkpointing", problems)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _save(model: Model, optimizer: torch.optim.Optimizer, data: object, checkpointing: Checkpointing,
          step: int, say: Callable[[str], None], *, last: bool) -> Path | None:
    """``sf.save`` with every rank's training state (RNG, data position) in the
    checkpoint. A save without room, or failing part-way, is one line and ``None``; on
    the ``last`` step it is the error (the run must not look finished and saved)."""
    state: dict[str, Any] = {"step": step, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if callable(getattr(data, "state_dict", None)):
        state["data"] = data.state_dict()  # type: ignore[attr-defined]
    try:
        return save(model, optimizer, checkpointing.directory, step=step, keep=checkpointing.keep, rank_state=state,
                    free_space=checkpointing.free_space, meta=checkpointing.meta)
    except (CheckpointSpaceError, CheckpointWriteError) as e:
        if last:
            raise
        say(f"step {step} {e.strerror}")
        return None


def resume(model: Model, optimizer: torch.optim.Optimizer, directory: str | os.PathLike[str], *,
           data: object = None, say: Callable[[str], None] | None = None) -> int:
    """Load the newest loadable checkpoint under ``directory`` into ``model`` and
    ``optimizer`` (every rank calls it) and restore this rank's RNG state and the data's
    position saved with it; returns its step, the ``start_step`` of :func:`train`.

    A corrupted or partial newest checkpoint is skipped for the newest loadable one;
    ``say`` (on rank 0) gets one line saying so, and one if the checkpoint has no
    training state (written by ``sf.save`` alone: the RNG then continues from here).
    Another model's checkpoint is a :class:`~slapo_fn.ScheduleError` naming the first
    mismatching keys."""
    tell = say if say is not None and _rank() == 0 else (lambda _: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointFallback)
        step = load(model, optimizer, directory)
    for w in caught:
        if issubclass(w.category, CheckpointFallback) and say is not None:
            tell(f"resume: {w.message}")
        else:  # without `say`, the fallback stays a warning: never silent
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    folder = Path(directory) / step_name(step)
    if not folder.is_dir():
        folder = Path(directory)
    state = rank_state(folder, _rank())
    if state is None:
        tell(f"resume: {folder} has no training state ({RANK_STATE.format(rank='N')}): model and optimizer "
             "restored, the random number generators continue from here")
        return step
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "data" in state and callable(getattr(data, "load_state_dict", None)):
        data.load_state_dict(state["data"])  # type: ignore[attr-defined]
    return step


# -- memory -----------------------------------------------------------------------------------
def peak_memory(device: torch.device | None) -> int:
    """This process's peak memory in bytes: ``torch.cuda.max_memory_allocated`` on a GPU,
    else the peak resident set size since this process started (``VmHWM`` of
    ``/proc/self/status``; ``getrusage``'s ``ru_maxrss`` where there is no ``/proc`` — on
    Linux it carries the launching process's peak across ``exec``, so a worker started by
    a big parent, like a test runner, would report the parent's)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _step_memory(device: torch.device, base: int) -> dict[str, Any]:
    """Every rank's peak memory so far (``peak_mem_by_rank``), the most loaded one's
    (``peak_mem_bytes``) and its growth since training started (``train_mem_bytes``: on
    CPU the peak RSS less ``base``; on a GPU the same as the peak): one all-gather."""
    peak = peak_memory(device)
    grown = peak - (0 if device.type == "cuda" else base)
    peaks, growths = [peak], [grown]
    if dist.is_initialized():
        both = torch.tensor([peak, grown], dtype=torch.float64, device=device)
        every = torch.empty(dist.get_world_size() * 2, dtype=torch.float64, device=device)
        dist.all_gather_into_tensor(every, both)
        values = [int(v) for v in every.tolist()]
        peaks, growths = values[0::2], values[1::2]
    return {"peak_mem_bytes": max(peaks), "train_mem_bytes": max(growths), "mem_kind": device.type,
            "peak_mem_by_rank": tuple(peaks)}


# -- the loop ---------------------------------------------------------------------------------
def _modules(model: Model) -> list[nn.Module]:
    return list(model.modules.values()) if isinstance(model, Pipeline) else [model]


def _device(model: Model) -> torch.device:
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        return torch.device(local.device)
    return torch.device("cpu")


def _dp(mesh: DeviceMesh | None, axis: str | tuple[str, ...]) -> tuple[int, int, dist.ProcessGroup | None]:
    """This rank's data-parallel rank, the data-parallel size and group, over one mesh
    axis or several (HSDP's replicas and shards: flattened into one, every rank calling)."""
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    wanted = (axis,) if isinstance(axis, str) else tuple(axis)
    if mesh is None or not all(a in names for a in wanted):
        return 0, 1, None
    data = mesh[wanted[0]] if len(wanted) == 1 else mesh[wanted]._flatten("_".join(wanted))
    if data.size() == 1:
        return 0, 1, None
    return data.get_local_rank(), data.size(), data.get_group()


@contextlib.contextmanager
def _gradient_sync(modules: Sequence[nn.Module], enabled: bool) -> Iterator[None]:
    """FSDP2 / ``replicate`` reduce gradients only when ``enabled`` (the last micro-step)."""
    roots = [m for m in modules if callable(getattr(m, "set_requires_gradient_sync", None))]
    for m in roots:
        m.set_requires_gradient_sync(enabled)  # type: ignore[operator]
    try:
        yield
    finally:
        for m in roots:
            m.set_requires_gradient_sync(True)  # type: ignore[operator]


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _split(batch: Mapping[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    chunks = {k: v.chunk(parts) for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(parts)]


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0] if isinstance(output, tuple) else output


def _all_sum(values: list[float], group: dist.ProcessGroup | None, device: torch.device) -> list[float]:
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return [float(v) for v in t.tolist()]


def _check(model: Model, optimizer: object, data: object, steps: int, batch_size: int, grad_accum: int,
           dp_size: int, start_step: int, grad_clip: float | None, eval_every: int, nonfinite: str,
           max_skipped: int) -> None:
    problems = []
    if not isinstance(model, nn.Module | Pipeline):
        problems.append(Problem("model", f"expected a built model or pipeline, got {type(model).__name__}",
                                "pass sf.build(sch) or sf.build_pipeline(sch, ...)"))
    if not isinstance(optimizer, torch.optim.Optimizer):
        problems.append(Problem("optimizer", f"expected a torch.optim optimizer, got {type(optimizer).__name__}",
                                "adamw(model, lr=3e-4)"))
    if not callable(getattr(data, "batch", None)):
        problems.append(Problem("data", f"{type(data).__name__} has no batch(step, batch_size, dp_rank=, dp_size=)",
                                "wrap it: TokenBatches(Arithmetic(vocab), seq_len)"))
    if not steps >= 1:
        problems.append(Problem("steps", f"must be at least 1, got {steps}", "steps=40"))
    if not 0 <= start_step < max(steps, 1):
        problems.append(Problem("start_step", f"must be in [0, steps={steps}), got {start_step}",
                                "the step resume() returned, below steps"))
    if not grad_accum >= 1:
        problems.append(Problem("grad_accum", f"must be at least 1, got {grad_accum}", "grad_accum=1"))
    elif not batch_size >= 1:
        problems.append(Problem("batch_size", f"must be at least 1, got {batch_size}", "batch_size=8"))
    else:  # the command line's own check (slapo_fn.options.Split), in the names of this function's arguments
        pp, micro = (len(set(model.placement)), model.microbatches) if isinstance(model, Pipeline) else (1, None)
        problems += Split(batch=batch_size, dp=dp_size, grad_accum=grad_accum, pp=pp,
                          microbatches=micro).problems(_SPLIT_NAMES)
    if grad_clip is not None and not (math.isfinite(grad_clip) and grad_clip > 0):
        problems.append(Problem("grad_clip", f"must be a positive number, got {grad_clip}", "grad_clip=1.0"))
    if not eval_every >= 0:
        problems.append(Problem("eval_every", f"must be at least 0, got {eval_every}", "eval_every=0 (never)"))
    elif eval_every and not callable(getattr(data, "eval_batches", None)):
        problems.append(Problem("eval_every", f"{type(data).__name__} has no eval_batches(batch_size=, dp_rank=, "
                                              "dp_size=)", "data with a held-out split, or eval_every=0"))
    if nonfinite not in NONFINITE:
        problems.append(Problem("nonfinite", f"must be one of {', '.join(NONFINITE)}, got {nonfinite!r}",
                                'nonfinite="stop"'))
    if not max_skipped >= 0:
        problems.append(Problem("max_skipped", f"must be at least 0, got {max_skipped}", "max_skipped=10"))
    if problems:
        raise TrainError("train", problems)


#: How :func:`train`'s refusals of an uneven split name its sizes.
_SPLIT_NAMES = {"batch": "batch_size", "dp": "dp", "grad_accum": "grad_accum", "pp": "pp",
                "microbatches": "microbatches", "seq": "seq", "tp": "tp", "sp": "sp"}


def train(
    model: Model,
    optimizer: torch.optim.Optimizer,
    data: Batches,
    *,
    steps: int,
    batch_size: int,
    lr_schedule: Callable[[int], float] | None = None,
    grad_clip: float | None = None,
    grad_accum: int = 1,
    autocast: torch.dtype | None = None,
    mesh: DeviceMesh | None = None,
    dp_axis: str | tuple[str, ...] = "dp",
    start_step: int = 0,
    eval_every: int = 0,
    eval_batches: int | None = None,
    checkpoint: Checkpointing | None = None,
    log: Iterable[Logger] = (),
    memory: bool = False,
    on_step: Callable[[int], None] | None = None,
    nonfinite: Literal["stop", "skip"] = "stop",
    max_skipped: int = 10,
    say: Callable[[str], None] | None = None,
    flops: float | None = None,
    peak_flops: float | None = None,
    seq2seq: Seq2Seq | None = None,
) -> list[StepRecord]:
    """Train ``model`` (``sf.build``) or a pipeline (``sf.build_pipeline``) from step
    ``start_step`` up to step ``steps``; every rank calls it. Returns the records of the
    steps run (the same on every rank).

    * ``batch_size``: sequences per optimizer step, over all data-parallel ranks
      (``mesh``'s ``dp_axis``) and ``grad_accum`` micro-steps; ``data.batch`` gives each
      rank its share, cut into ``grad_accum`` micro-batches. FSDP2 reduces gradients on
      the last micro-step only. The loss of a step is the mean over its target tokens
      (for a pipeline: the mean of its microbatch means).
    * ``lr_schedule(step)`` sets every parameter group's ``lr`` before step ``step``
      (0-based; :class:`LRSchedule`); ``None`` leaves the optimizer's.
    * ``grad_clip``: scale the gradients to this global norm at most
      (:func:`slapo_fn.clip_grad_norm_`: right across meshes and stages).
    * ``autocast``: run forward and loss under ``torch.autocast`` to this dtype (see
      :func:`precision`; not needed where FSDP2 mixed precision casts).
    * ``eval_every``: every so many steps, the mean loss over ``data.eval_batches(...)``
      (at most ``eval_batches`` of them), in eval mode without gradients.
    * ``checkpoint``: save as :class:`Checkpointing` says; resume with :func:`resume`.
    * ``log``: callables given each :class:`StepRecord` on global rank 0.
    * ``memory``: measure every step's peak memory over ranks (a collective).
    * ``on_step(step)``: called on every rank after each optimizer step (tests inject
      faults so).
    * ``nonfinite``: before each optimizer update the loss, the global grad norm and the
      learning rate are checked (every rank sees the same values: no collective). One
      that is not finite stops the run with ``"stop"`` (:class:`NonFiniteError`, before
      the update and any save), or with ``"skip"`` drops the step's gradients and goes
      on, the record marked ``skipped``; more than ``max_skipped`` skipped steps stop it.
    * ``say``: one-line notices on rank 0 (a skipped step, a save skipped for lack of
      room); default: :func:`warnings.warn`.
    * ``flops``: the FLOPs of one step on one rank (:func:`slapo_fn.explain.model_flops`
      over the ranks), ``peak_flops`` one rank's peak FLOP/s (a hardware profile's, at
      the compute dtype): each record then has the rank's TFLOP/s and MFU.
    * ``seq2seq``: the objective of an encoder-decoder (:class:`Seq2Seq`): every batch gets
      its ``decoder_input_ids`` from its labels and the loss is not shifted (a pipeline's
      ``loss_fn`` should be :meth:`Seq2Seq.loss`); ``None``: a causal LM's.

    A record's ``seconds`` is the step's own time — forward, backward and the optimizer
    update — with its evaluation and its checkpoint save timed apart (``eval_seconds``,
    ``save_seconds``); the first step of the call (``first``: compilation, allocation)
    is marked, so that summaries can leave it out.
    """
    mesh = mesh if mesh is not None else _mesh_of(model)
    dp_rank, dp_size, dp_group = _dp(mesh, dp_axis)
    _check(model, optimizer, data, steps, batch_size, grad_accum, dp_size, start_step, grad_clip, eval_every,
           nonfinite, max_skipped)
    loggers = list(log) if _rank() == 0 else []
    tell = (say if say is not None else _warn) if _rank() == 0 else (lambda _: None)
    saved, skipped, first = (start_step or None), 0, True
    modules = _modules(model)
    device = _device(model)
    pipeline = model if isinstance(model, Pipeline) else None
    base_memory = peak_memory(None) if memory and device.type != "cuda" else 0
    for m in modules:
        m.train()
    records: list[StepRecord] = []
    for step in range(start_step, steps):
        began = time.perf_counter()
        lr = lr_schedule(step) if lr_schedule is not None else float(optimizer.param_groups[0]["lr"])
        if lr_schedule is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        batch = {k: v.to(device) for k, v in data.batch(step, batch_size, dp_rank=dp_rank, dp_size=dp_size).items()}
        tokens = int(batch["input_ids"].numel()) * dp_size
        if seq2seq is not None:
            batch = seq2seq.inputs(batch)
        micro = _split(_collated(model, batch), grad_accum)
        if pipeline is not None:
            loss_sum, count = _pipeline_step(pipeline, micro, autocast, device)
        else:
            loss_sum, count = _module_step(model, micro, autocast, device, dp_size, dp_group,  # type: ignore[arg-type]
                                           seq2seq)
        loss_sum, count = _all_sum([loss_sum, count], dp_group, device)
        if grad_clip is not None:  # the global norm, across meshes and stages, before clipping
            norm = clip_grad_norm_(model, grad_clip)
        else:
            norm = global_norm({k: p.grad for k, p in model.named_parameters() if p.grad is not None},
                               pipeline=pipeline)
        loss = loss_sum / max(count, 1.0)
        finite = all(math.isfinite(v) for v in (loss, float(norm), lr))
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - began  # the step's own time: eval and saves are timed apart
        if not finite:
            skipped += 1
            record = StepRecord(step=step + 1, loss=loss, lr=lr, grad_norm=float(norm), tokens=tokens,
                                seconds=seconds, tokens_per_s=0.0, skipped=True, first=first)
            records.append(record)
            for logger in loggers:
                logger(record)
            values = f"loss {loss:.6g}, grad_norm {float(norm):.6g}, lr {lr:.6g}"
            if nonfinite == "stop" or skipped > max_skipped:
                why = "is not finite" if nonfinite == "stop" else f"is not finite, the {skipped}th skipped step " \
                    f"(more than max_skipped={max_skipped})"
                raise NonFiniteError(f"step {step + 1}: {values} {why}: stopped before the optimizer update, "
                                     "nothing saved" + (f"; the newest checkpoint is step {saved}" if saved else ""),
                                     step=step + 1)
            tell(f"step {step + 1} skipped: {values} is not finite ({skipped} of at most {max_skipped} skipped)")
        if on_step is not None:
            on_step(step + 1)
        eval_loss = eval_seconds = save_seconds = None
        if eval_every and (step + 1) % eval_every == 0:
            began = time.perf_counter()
            eval_loss = _evaluate(model, data, batch_size, dp_rank, dp_size, dp_group, autocast, device,
                                  eval_batches, seq2seq)
            eval_seconds = time.perf_counter() - began
        mem = _step_memory(device, base_memory) if memory else {}
        try:
            if checkpoint is not None and ((checkpoint.every and (step + 1) % checkpoint.every == 0)
                                           or step + 1 == steps):
                began = time.perf_counter()
                if _save(model, optimizer, data, checkpoint, step + 1, tell, last=step + 1 == steps) is not None:
                    saved = step + 1
                save_seconds = time.perf_counter() - began
        finally:  # the step's record even where its save fails
            if finite:
                achieved = flops / seconds if flops is not None else None
                record = StepRecord(step=step + 1, loss=loss, lr=lr, grad_norm=float(norm), tokens=tokens,
                                    seconds=seconds, tokens_per_s=tokens / seconds, eval_loss=eval_loss,
                                    first=first, eval_seconds=eval_seconds, save_seconds=save_seconds,
                                    tflops=None if achieved is None else achieved / 1e12,
                                    mfu=None if achieved is None or not peak_flops else achieved / peak_flops, **mem)
                records.append(record)
                for logger in loggers:
                    logger(record)
        first = False
    return records


def _warn(text: str) -> None:
    warnings.warn(text, stacklevel=3)


def _mesh_of(model: Model) -> DeviceMesh | None:
    """The mesh of the model's first DTensor parameter's root mesh, if any."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            root = getattr(mesh, "_get_root_mesh", None)  # FSDP2 shards over a sub-mesh: the whole one
            return root() if callable(root) else mesh  # type: ignore[no-any-return]
    return None


def _module_step(model: nn.Module, micro: list[dict[str, torch.Tensor]], autocast: torch.dtype | None,
                 device: torch.device, dp_size: int, dp_group: dist.ProcessGroup | None,
                 seq2seq: Seq2Seq | None = None) -> tuple[float, float]:
    """Forward and backward of every micro-batch; returns this rank's loss sum and count
    of target tokens. Each micro-batch's loss is its token sum over the step's global
    count, times ``dp_size`` (data parallelism averages over ranks): the gradients are
    those of the global batch's token mean."""
    split = context_split(model)
    local = float(sum(_targets(m, seq2seq) for m in micro))
    if split is not None and split.inputs_split:  # each cp rank counted its own chunks
        local = split.total(local)
    count = _all_sum([local], dp_group, device)[0]
    total = 0.0
    for i, part in enumerate(micro):
        ids, kwargs = _inputs(part)
        with _gradient_sync([model], i == len(micro) - 1):  # around the backward, where FSDP2 reduces
            with _autocast(device, autocast):
                loss_sum = _loss_sum(model, model(ids, **kwargs), part, seq2seq)
            (loss_sum * (dp_size / max(count, 1.0))).backward()
        total += float(loss_sum.detach())
    return (total if split is None else split.total(total)), local


def _pipeline_step(pipe: Pipeline, micro: list[dict[str, torch.Tensor]], autocast: torch.dtype | None,
                   device: torch.device) -> tuple[float, float]:
    """``pipe.step`` per micro-batch (the schedule syncs FSDP2 and tied weights itself);
    the gradients of each are summed aside and averaged, so that micro-steps add up as
    one step over their union. Returns the sum of the micro-steps' mean losses and their
    number (the mean loss of the step, as a sum and a count)."""
    kept: dict[nn.Parameter, torch.Tensor] = {}
    total = 0.0
    for part in micro:
        if len(micro) > 1:
            for p in pipe.parameters():
                if p.grad is not None:
                    kept[p] = kept[p] + p.grad if p in kept else p.grad
                    p.grad = None
        ids, kwargs = _inputs(part)
        with _autocast(device, autocast):
            total += float(pipe.step(ids, target=_target(part), **kwargs))
    if len(micro) > 1:
        with torch.no_grad():
            for p in pipe.parameters():
                if p.grad is not None and p in kept:
                    p.grad += kept[p]
                elif p in kept:
                    p.grad = kept[p]
                if p.grad is not None:
                    p.grad /= len(micro)
    return total, float(len(micro))


@torch.no_grad()
def _evaluate(model: Model, data: object, batch_size: int, dp_rank: int, dp_size: int,
              dp_group: dist.ProcessGroup | None, autocast: torch.dtype | None, device: torch.device,
              limit: int | None, seq2seq: Seq2Seq | None = None) -> float:
    """The token-mean loss over the data's eval batches (a pipeline: the mean of its
    microbatch means), over every data-parallel rank; modules in eval mode meanwhile."""
    modules = _modules(model)
    for m in modules:
        m.eval()
    total, count = 0.0, 0.0
    try:
        batches = data.eval_batches(batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size)  # type: ignore[attr-defined]
        for i, batch in enumerate(batches):
            if limit is not None and i >= limit:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            if seq2seq is not None:
                batch = seq2seq.inputs(batch)
            with _autocast(device, autocast):
                if isinstance(model, Pipeline):
                    batch = _collated(model, batch)
                    ids, kwargs = _inputs(batch)
                    total += _pipeline_eval(model, ids, _target(batch), kwargs)
                    count += 1
                else:
                    split = context_split(model)
                    batch = _collated(model, batch)
                    ids, kwargs = _inputs(batch)
                    part, counted = (float(_loss_sum(model, model(ids, **kwargs), batch, seq2seq)),
                                     float(_targets(batch, seq2seq)))
                    total += part if split is None else split.total(part)
                    count += split.total(counted) if split is not None and split.inputs_split else counted
    finally:
        for m in modules:
            m.train()
    total, count = _all_sum([total, count], dp_group, device)
    return total / max(count, 1.0)


def _pipeline_eval(pipe: Pipeline, ids: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, torch.Tensor]) \
        -> float:
    """The mean microbatch loss of a forward-only pass of the pipeline, on every rank."""
    losses: list[torch.Tensor] = []
    pipe.runner.eval(ids, target=labels, losses=losses, **kwargs)
    last = pipe.placement[-1]
    mine = dist.get_rank(pipe.group)
    loss = torch.stack([x.detach().float() for x in losses]).mean() if mine == last else torch.zeros(())
    dist.broadcast(loss, group=pipe.group, group_src=last)
    return float(loss)

