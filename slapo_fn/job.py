"""What the options of ``slapo-fn train``, ``verify`` and ``explain`` build, and the check
of the schedule before any rank starts.

A job's options (the parsed flags, an ``argparse.Namespace``) name a model, its recipe's
knobs and a mesh (``--dp/--tp/--pp``), and for ``train`` its data and checkpoints. Every
rank turns them into the same values here, and so does the launcher before it starts
any:

* :func:`schedule_for`: the model (a preset or a Hugging Face config or folder) scheduled
  by its family's recipe for the knobs, or by its own ``base_model_tp_plan``;
* :func:`run_data`: the synthetic task, byte windows of a text file, or ``--data``
  tokenized and packed (:class:`Positioned`, which the training loop checkpoints);
* :func:`check_schedule`: what the launcher refuses once, after the inputs
  (:mod:`slapo_fn.inputs`) and before spawning: an unknown pipeline schedule, a model
  without a recipe or a plan for the knobs, and whatever the schedule itself refuses,
  built on the meta device over a fake process group of the job's size, as every rank
  would build it.
"""

from __future__ import annotations

import argparse
import difflib
import os
from typing import Any, Literal

from . import hf, recipes
from .data import Arithmetic, ByteText, Codec, TokenData, open_data, stdlib_corpus
from .data.attention import packing_for
from .data.order import PositionalRows
from .dtensor.testing import fake_mesh, fake_world
from .errors import CommandLineError, Problem
from .inputs import codec, config, data_problems, packed
from .kernels.gpu import async_tp_problem, float8_problem
from .options import axes, eval_fraction, is_stdlib, stdlib_bytes, world
from .pipelines import SCHEDULES, schedule_problem, split_stages
from .presets import build_model
from .recipes import HSDP_AXES
from .schedule import Schedule, create_schedule
from .train import TokenBatches

__all__ = ["Positioned", "check_schedule", "checkpointed", "data_axes", "dp_mode", "knobs", "mesh_axes", "run_data",
           "schedule_for", "stages"]

Options = argparse.Namespace


# -- the schedule ---------------------------------------------------------------------------
def mesh_axes(options: Options) -> list[tuple[str, int]]:
    """The job's mesh axes (:func:`slapo_fn.options.axes`): with ``--dp-mode hsdp``, the
    replicas of ``--dp-shard`` ranks apart (``dp_replicate``, ``dp``)."""
    mode = getattr(options, "dp_mode", None)
    return axes(dp=options.dp, tp=options.tp, pp=options.pp, dp_shard=options.dp_shard if mode == "hsdp" else None,
                data_parallel=mode is not None, cp=getattr(options, "cp", 1))


def data_axes(options: Options) -> str | tuple[str, str]:
    """The mesh axes a step's batch is split over: ``dp``, or both HSDP axes."""
    return HSDP_AXES if getattr(options, "dp_mode", None) == "hsdp" else "dp"



def stages(options: Options) -> int:
    """Pipeline stages for ``--pp`` ranks: one per rank, or as many per rank as
    ``--schedule`` places (``zbv``: two, in a V)."""
    kind = SCHEDULES.get(options.schedule)
    per_rank = kind.per_rank if kind is not None and kind.per_rank is not None else 1
    return 1 if options.pp == 1 else options.pp * per_rank


def knobs(options: Options) -> recipes.Knobs:
    """The recipe's knobs the options set."""
    return recipes.Knobs(tp=options.tp, sequence_parallel=options.sp, checkpoint=options.checkpoint,
                         stages=stages(options), dp_mode=dp_mode(options),
                         kernels=options.kernels, compile=options.compile, cp=getattr(options, "cp", 1),
                         # train's loop hands each cp rank its chunks; verify and explain pass the global batch
                         cp_inputs_split=options.command == "train",
                         float8=bool(getattr(options, "float8", False)),
                         async_tp=bool(getattr(options, "async_tp", False)))


def dp_mode(options: Options) -> Literal["fsdp", "ddp", "hsdp"] | None:
    """The data-parallel mode of the recipe: ``--dp-mode`` where given (with ``--dp 1``
    too: the data-parallel job of one), FSDP2 where ``--dp > 1``."""
    mode: Literal["fsdp", "ddp", "hsdp"] | None = getattr(options, "dp_mode", None)
    return mode if mode is not None else "fsdp" if options.dp > 1 else None


def schedule_for(options: Options, mesh: Any, *, meta: bool, say: bool = True) -> Schedule:
    """The model of ``--model`` on ``mesh``, scheduled by its family's recipe for the
    knobs (a family without one: by the model's own ``base_model_tp_plan``, said once on
    rank 0 unless ``say`` is false)."""
    model = build_model(options.model, meta=meta)
    plan = fallback_plan(model, options)
    if plan is None:
        return recipes.for_model(model)(create_schedule(model, mesh=mesh), knobs(options))
    sch = recipes.from_model_plan(model)(create_schedule(model, mesh=mesh), knobs(options))
    if say and os.environ.get("RANK", "0") == "0":
        print(f"slapo-fn: no recipe for model_type {hf.model_type(model)!r}: scheduled by the model's own "
              f"base_model_tp_plan ({len(plan)} entries), not a recipe", flush=True)
    return sch


def fallback_plan(model: Any, options: Options) -> dict[str, str] | None:
    """``None`` where the family of ``model`` (a model or its config) has a recipe; else the
    model's own ``base_model_tp_plan``, checked against the knobs. A model with neither, or
    knobs its plan cannot serve, is bad input: a ValueError (a ScheduleError) saying why."""
    kind = hf.model_type(model)
    if any(kind in r.model_types for r in recipes.RECIPES.values()):
        return None
    plan = recipes.tp_plan_of(model)
    if not plan:
        known = sorted(t for r in recipes.RECIPES.values() for t in r.model_types)
        raise ValueError(f"model_type {kind!r} has neither a recipe ({', '.join(known)}) nor a base_model_tp_plan: "
                         "write a recipe for it (slapo_fn.recipes) or add a base_model_tp_plan to its config.json")
    if options.sp and len(recipes.plan_stacks(plan)) != 1:
        raise ValueError(f"--sp needs one stack of repeated layers; the base_model_tp_plan of model_type {kind!r} "
                         "names none or several")
    if options.tp > 1:
        recipes.check_tp_plan(plan)
    return plan


# -- the data -------------------------------------------------------------------------------
def token_data(options: Options, tokens: Codec) -> Any:
    """``--data`` tokenized with ``tokens`` and packed into rows of ``--seq`` tokens: in
    memory, mapped from a prepared folder, streamed, or a mixture (:mod:`slapo_fn.data`)."""
    fraction = eval_fraction(options.eval_fraction)
    if is_stdlib(options.data):
        return TokenData.from_texts(stdlib_corpus(max_bytes=stdlib_bytes(options.data)), tokens,
                                    seq_len=options.seq, seed=options.seed, eval_fraction=fraction)
    return open_data(options.data, tokens, seq_len=options.seq, seed=options.seed, eval_fraction=fraction,
                     stream=options.stream, text_field=options.text_field, data_format=options.data_format,
                     chat_packing=lambda: packing_for(config(options.model, options.command)))


def checkpointed(data: Any, batch_size: int) -> Any:
    """Data as :func:`slapo_fn.train.train` checkpoints it: positional rows through
    :class:`Positioned`; streams and mixtures save their own position."""
    return Positioned(data, batch_size) if isinstance(data, PositionalRows) else data


class Positioned:
    """:class:`slapo_fn.data.TokenData` as :func:`slapo_fn.train.train` checkpoints data:
    ``state_dict()`` is the data's :meth:`~slapo_fn.data.TokenData.state` after the last
    batch given, ``load_state_dict`` checks a checkpoint's data is this data (corpus,
    tokenizer, ``--seq``, seed; else a :class:`~slapo_fn.ScheduleError`) and keeps the
    step it continues at in ``resumed_at``. Batches are a pure function of the step, so
    resuming at that step restores the position."""

    def __init__(self, data: Any, batch_size: int) -> None:
        self.data, self.batch_size = data, batch_size
        self.next_step = 0
        self.resumed_at: int | None = None

    @property
    def vocab(self) -> int:
        return int(self.data.vocab)

    def batch(self, step: int, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> Any:
        self.next_step = step + 1
        return self.data.batch(step, batch_size, dp_rank=dp_rank, dp_size=dp_size)

    def eval_batches(self, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> Any:
        return self.data.eval_batches(batch_size, dp_rank=dp_rank, dp_size=dp_size)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.data.state(self.next_step, self.batch_size))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resumed_at = self.next_step = int(self.data.resume(state, self.batch_size))


def run_data(options: Options, model: Any) -> tuple[Any, Codec | None]:
    """The data a rank trains ``model`` on, and the tokenizer that made it (``None`` for
    the synthetic task and byte windows); symbols outside the model's vocabulary are a
    :class:`CommandLineError` (:func:`data_problems`)."""
    vocab = hf.vocab_size(model)
    if packed(options):
        tokens = codec(options)
        if tokens.vocab > vocab:
            raise CommandLineError(options.command, data_problems(options, model.config))
        return checkpointed(token_data(options, tokens), options.batch), tokens
    source = ByteText.from_file(options.data, options.seed) if options.data else Arithmetic(vocab, options.seed)
    if source.vocab > vocab:
        raise CommandLineError(options.command, data_problems(options, model.config))
    return TokenBatches(source, options.seq), None


# -- the checks before any rank starts --------------------------------------------------------
def check_schedule(options: Options, config: Any) -> None:
    """Refuse, before any rank starts, a schedule the ranks would refuse: an unknown
    pipeline schedule, a model (``config``) with neither a recipe nor a plan for the
    knobs, ``--float8`` or ``--async-tp`` where this machine cannot run them, and — for a job of several
    ranks (``explain`` builds its schedule itself) — whatever building it refuses (heads
    that do not split over ``--tp``, a microbatch short per stage), built on the meta
    device over a fake process group of the job's size, as every rank would."""
    if options.schedule not in SCHEDULES:
        close = difflib.get_close_matches(options.schedule, list(SCHEDULES), n=1)
        raise CommandLineError(options.command, [Problem(
            "--schedule", f"unknown pipeline schedule {options.schedule!r}"
                          + (f"; did you mean {close[0]!r}?" if close else ""),
            f"one of {', '.join(SCHEDULES)}")])
    hardware = [p for flag, check in (("float8", float8_problem), ("async_tp", async_tp_problem))
                if getattr(options, flag, False) and (p := check("--" + flag.replace("_", "-"))) is not None]
    if hardware:
        raise CommandLineError(options.command, hardware)
    fallback_plan(config, options)
    count = world(dp=options.dp, tp=options.tp, pp=options.pp, cp=getattr(options, "cp", 1))
    if not mesh_axes(options) or options.command == "explain":
        return
    named = mesh_axes(options)
    with fake_world(count):
        mesh = fake_mesh(*(s for _, s in named), names=tuple(n for n, _ in named))
        sch = schedule_for(options, mesh, meta=True, say=False)
    if options.command == "train" and options.pp > 1:
        stages = split_stages(sch)
        count, micro = len(stages), options.microbatches or 2 * options.pp
        unsupported = schedule_problem(stages, options.schedule)
        if unsupported is not None:
            raise CommandLineError(options.command, [Problem("--schedule", unsupported.reason, unsupported.fix)])
        if micro < count:
            raise CommandLineError(options.command, [Problem(
                "--microbatches", f"{micro} microbatches for {count} pipeline stages (--schedule "
                                  f"{options.schedule}): every stage needs at least one",
                f"--microbatches {count} or more")])
