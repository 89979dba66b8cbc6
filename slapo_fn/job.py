"""What the options of ``slapo-fn train``, ``verify`` and ``explain`` build, and the checks
that refuse them before any rank starts.

A job's options (the parsed flags, an ``argparse.Namespace``) name a model, its recipe's
knobs and a mesh (``--dp/--tp/--pp``), and for ``train`` its data and checkpoints. Every
rank turns them into the same values here, and so does the launcher before it starts
any:

* :func:`schedule_for`: the model (a preset or a Hugging Face config or folder) scheduled
  by its family's recipe for the knobs, or by its own ``base_model_tp_plan``;
* :func:`run_data`: the synthetic task, byte windows of a text file, or ``--data``
  tokenized and packed (:class:`Positioned`, which the training loop checkpoints);
* :func:`check_inputs`: everything the launcher refuses once, before spawning: an unknown
  pipeline schedule, a model config that is no causal LM, ``--seq`` past its positions,
  a tokenizer that does not fit the vocabulary, nothing to resume, and whatever the
  schedule itself refuses, built on the meta device over a fake process group of the
  job's size, as every rank would build it.
"""

from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path
from typing import Any

from . import hf, recipes
from .data import Arithmetic, ByteText, Codec, TokenData, stdlib_corpus
from .dtensor.testing import fake_mesh, fake_world
from .errors import CommandLineError, Problem, ScheduleError
from .options import axes, eval_fraction, is_stdlib, stdlib_bytes
from .pipelines import SCHEDULES, split_stages
from .presets import build_model, config_for, tokenizer_of
from .schedule import Schedule, create_schedule
from .state import latest, loadable, step_of
from .train import TokenBatches

__all__ = [
    "Positioned",
    "check_inputs",
    "codec",
    "config",
    "data_problems",
    "knobs",
    "packed",
    "resume_problems",
    "run_data",
    "schedule_for",
    "stages",
    "world",
]

Options = argparse.Namespace


# -- the schedule ---------------------------------------------------------------------------
def world(options: Options) -> int:
    """Ranks of the job: ``dp * tp * pp``."""
    return int(options.dp * options.tp * options.pp)


def stages(options: Options) -> int:
    """Pipeline stages for ``--pp`` ranks: one per rank, or as many per rank as
    ``--schedule`` places (``zbv``: two, in a V)."""
    kind = SCHEDULES.get(options.schedule)
    per_rank = kind.per_rank if kind is not None and kind.per_rank is not None else 1
    return 1 if options.pp == 1 else options.pp * per_rank


def knobs(options: Options) -> recipes.Knobs:
    """The recipe's knobs the options set."""
    return recipes.Knobs(tp=options.tp, sequence_parallel=options.sp, checkpoint=options.checkpoint,
                         stages=stages(options), dp_mode=options.dp_mode if options.dp > 1 else None,
                         kernels=options.kernels, compile=options.compile)


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
def tokenizer_source(options: Options) -> str | None:
    """What tokenizes ``--data``: ``--tokenizer`` (a folder, or ``"bytes"``), else the
    ``--model`` folder's own tokenizer, else ``None``."""
    if options.tokenizer is not None:
        return str(options.tokenizer)
    found = tokenizer_of(options.model)
    return None if found is None else str(found)


def packed(options: Options) -> bool:
    """Whether ``--data`` is tokenized and packed (:class:`slapo_fn.data.TokenData`: masks,
    a held-out split, resumable) rather than read as random byte windows (the behaviour of
    earlier versions, kept for a plain text file when no tokenizer is given)."""
    if options.data is None:
        return False
    if tokenizer_source(options) is not None or is_stdlib(options.data):
        return True
    path = Path(options.data)
    return not path.is_file() or path.suffix.lower() in (".jsonl", ".json")


def codec(options: Options) -> Codec:
    """The tokenizer of ``--data`` as a :class:`slapo_fn.data.Codec`."""
    source = tokenizer_source(options)
    return Codec.byte_level() if source in (None, "bytes") else Codec.of(Path(source))


def token_data(options: Options, tokens: Codec) -> TokenData:
    """``--data`` tokenized with ``tokens`` and packed into rows of ``--seq`` tokens."""
    fraction = eval_fraction(options.eval_fraction, options.eval_every)
    if is_stdlib(options.data):
        return TokenData.from_texts(stdlib_corpus(max_bytes=stdlib_bytes(options.data)), tokens,
                                    seq_len=options.seq, seed=options.seed, eval_fraction=fraction)
    return TokenData.from_source(Path(options.data), tokens, seq_len=options.seq, seed=options.seed,
                                 eval_fraction=fraction)


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


def run_data(options: Options, model: Any) -> tuple[Positioned | TokenBatches, Codec | None]:
    """The data a rank trains ``model`` on, and the tokenizer that made it (``None`` for
    the synthetic task and byte windows); symbols outside the model's vocabulary are a
    :class:`CommandLineError` (:func:`data_problems`)."""
    vocab = hf.vocab_size(model)
    if packed(options):
        tokens = codec(options)
        if tokens.vocab > vocab:
            raise CommandLineError(options.command, data_problems(options, model.config))
        return Positioned(token_data(options, tokens), options.batch), tokens
    source = ByteText.from_file(options.data, options.seed) if options.data else Arithmetic(vocab, options.seed)
    if source.vocab > vocab:
        raise CommandLineError(options.command, data_problems(options, model.config))
    return TokenBatches(source, options.seq), None


# -- the checks before any rank starts --------------------------------------------------------
def check_inputs(options: Options) -> Any:
    """Refuse, before any process starts, what the arguments alone do not show: an
    unknown pipeline schedule, a model config that cannot be read or is no causal LM, a
    recipe the knobs do not fit, data or a checkpoint that does not fit the run — and, for
    a job on several processes, anything the schedule itself refuses (heads that do not
    split over ``--tp``, too few microbatches for the stages), found by building it on
    the meta device over a fake process group, as every rank would. Returns the model's
    config."""
    if options.schedule not in SCHEDULES:
        close = difflib.get_close_matches(options.schedule, list(SCHEDULES), n=1)
        raise CommandLineError(options.command, [Problem(
            "--schedule", f"unknown pipeline schedule {options.schedule!r}"
                          + (f"; did you mean {close[0]!r}?" if close else ""),
            f"one of {', '.join(SCHEDULES)}")])
    model_config = config(options.model, options.command)
    fallback_plan(model_config, options)
    _check_sequence_length(model_config, options)
    if options.command == "train":
        problems = _eval_problems(options) or data_problems(options, model_config) + resume_problems(options)
        if problems:
            raise CommandLineError(options.command, problems)
    if world(options) > 1 and options.command != "explain":  # explain builds the schedule in its process anyway
        _check_schedule(options)
    return model_config


def config(model: str, command: str) -> Any:
    """The Hugging Face config of ``--model`` (a preset or a config.json), or a
    :class:`CommandLineError` naming the file: not JSON, no or an unknown ``model_type``
    (with close matches, not the list of every type), no causal LM for it."""
    try:
        return config_for(model, causal=True)
    except ScheduleError as e:
        raise CommandLineError(command, e.problems) from None


def default_seq(config: Any) -> int:
    """``explain``'s sequence length when ``--seq`` is left out: 2048, or the model's
    positions where fewer."""
    return min(2048, hf.position_limit(config))


def _check_sequence_length(config: Any, options: Options) -> None:
    """``--seq`` against the positions ``config``'s model covers: a longer one is refused
    before any work (the model's position table would fail on it, deep inside a rank)."""
    limit = hf.position_limit(config)
    seq = getattr(options, "seq", None)
    if seq is not None and seq > limit:
        raise CommandLineError(options.command, [Problem(
            "--seq", f"{seq} is longer than the {limit} positions {options.model!r} covers (its config's "
                     "max_position_embeddings or n_positions)", f"--seq {limit}")])


def _eval_problems(options: Options) -> list[Problem]:
    """``--eval-every`` needs data with a held-out split."""
    if not options.eval_every:
        return []
    if options.data is None or not packed(options):
        what = "the synthetic task" if options.data is None else \
            f"{options.data}, read as byte windows (no tokenizer given),"
        return [Problem("--eval-every", f"{what} has no held-out split",
                        "--data FILE with --tokenizer FOLDER (or --tokenizer bytes), or leave out --eval-every")]
    if options.eval_fraction == 0:
        return [Problem("--eval-every", "--eval-fraction 0 holds out no rows to evaluate on",
                        "--eval-fraction 0.05 (or leave it out: 0.05 with --eval-every)")]
    return []


def data_problems(options: Options, config: Any) -> list[Problem]:
    """``--data``'s symbols against the model's vocabulary: the tokenizer's (loaded here,
    not the data), or 256 for byte windows."""
    vocab = hf.config_value(config, "vocab_size", default=None)
    if options.data is None or vocab is None:
        return []
    if not packed(options):
        symbols = ByteText(b"").vocab  # byte-level text: one token per byte value
        if symbols <= vocab:
            return []
        return [Problem("--data", f"{options.data} is read as bytes ({symbols} symbols); the model's vocabulary has "
                                  f"only {vocab}",
                        "a model with vocab_size >= 256, a --tokenizer FOLDER whose vocabulary fits, or no --data "
                        "(the synthetic task fits any vocabulary)")]
    try:
        tokens = codec(options)
    except ScheduleError as e:
        first = e.problems[0] if e.problems else Problem("", str(e), "")
        return [Problem("--tokenizer" if options.tokenizer is not None else "--model", f"{first.path}: {first.reason}",
                        "a folder with tokenizer files (tokenizer.json, tokenizer_config.json), or --tokenizer bytes")]
    if tokens.vocab <= vocab:
        return []
    where = "--tokenizer" if options.tokenizer is not None else "--model"
    return [Problem(where, f"the tokenizer {tokens.name} has {tokens.vocab} tokens; the model's vocabulary has only "
                           f"{vocab} (token ids would fall outside the embedding)",
                    "a tokenizer with at most vocab_size tokens, or a model whose config.json has vocab_size >= "
                    f"{tokens.vocab}")]


def resume_problems(options: Options) -> list[Problem]:
    """With ``--resume``: a checkpoint to resume from, before step ``--steps``."""
    if not options.resume:
        return []
    found = loadable(options.checkpoint_dir) or latest(options.checkpoint_dir)  # load falls back past a broken one
    if found is None or not found.is_dir():
        what = "no checkpoint to resume from (no LATEST file, no .metadata)" if found is None else \
            f"its LATEST names {found.name}, which is missing"
        return [Problem("--checkpoint-dir", f"{options.checkpoint_dir}: {what}",
                        "drop --resume to start at step 0, or pass the --checkpoint-dir of an earlier run")]
    step = step_of(found)
    if step < options.steps:
        return []
    return [Problem("--steps", f"the checkpoint in {options.checkpoint_dir} is at step {step}, and --steps "
                               f"{options.steps} is the step to train up to: nothing is left to train",
                    f"--steps {step + 1} or more (the total, not the steps to add), or drop --resume")]


def _check_schedule(options: Options) -> None:
    """Build the schedule every rank will build, on the meta device over a fake process
    group of the job's size: what it refuses is refused here, once. A pipeline also
    needs a microbatch per stage."""
    mesh_axes = axes(dp=options.dp, tp=options.tp, pp=options.pp)
    with fake_world(world(options)):
        mesh = fake_mesh(*(s for _, s in mesh_axes), names=tuple(n for n, _ in mesh_axes))
        sch = schedule_for(options, mesh, meta=True, say=False)
    if options.command == "train" and options.pp > 1:
        count, micro = len(split_stages(sch)), options.microbatches or 2 * options.pp
        if micro < count:
            raise CommandLineError(options.command, [Problem(
                "--microbatches", f"{micro} microbatches for {count} pipeline stages (--schedule "
                                  f"{options.schedule}): every stage needs at least one",
                f"--microbatches {count} or more")])
