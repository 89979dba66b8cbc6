"""The ``slapo-fn`` command: ``train``, ``export``, ``explain``, ``verify``, ``tune``.

* ``slapo-fn train --model llama-small --dp 2 --tp 2 --steps 40`` builds the model from a
  named config (or a local Hugging Face ``config.json``), schedules it with its family's
  recipe for the requested ``--dp/--tp/--pp`` (a family without one: with the model's own
  ``base_model_tp_plan``, ``slapo_fn.recipes.from_model_plan``), starts the local processes itself through
  ``torchrun`` (gloo on CPU, NCCL on GPUs), trains on a synthetic task or ``--data``
  (a text file, folder, JSONL, a saved ``datasets`` dataset or ``stdlib``, tokenized with
  ``--tokenizer`` or the model folder's tokenizer and packed; a plain text file with no
  tokenizer: byte windows, as before) with a progress bar; a Hugging Face folder's
  weights are read into each rank's shards (``sf.load_hf``); writes distributed checkpoints
  (``--checkpoint-dir``, ``--save-every``) and resumes from them (``--resume``). The
  loop is :func:`slapo_fn.train.train` (``--lr/--warmup/--decay``, ``--weight-decay``,
  ``--grad-clip``, ``--grad-accum``, ``--dtype``, ``--metrics``, ``--tensorboard``);
  ``--config run.toml`` gives any flag's value, flags override it; ``--nnodes
  --node-rank --master-addr --master-port`` make this machine one node of several.
* ``slapo-fn prepare --data SRC --tokenizer T --out DIR`` tokenizes a corpus once, in
  parallel worker processes, into a memory-mapped token folder that ``train --data DIR``
  maps (:func:`slapo_fn.data.prepare`).
* ``slapo-fn export CKPT OUT --model ...`` writes a checkpoint as a Hugging Face folder
  (one process, ``sf.load`` then ``sf.save_hf``); ``train --export-to OUT`` does it at the end.
* ``slapo-fn explain --model llama-7b --tp 8 --pp 4 --dp 4`` prints the schedule, its
  layouts, collectives, stages and per-rank memory without starting a job (meta device,
  a fake process group).
* ``slapo-fn verify --model llama-tiny --tp 2`` checks the recipe against the unscheduled
  model (forward and every gradient) on the requested ranks and prints a per-module report.
* ``slapo-fn tune --model llama-tiny --world-size 2 --tp 1,2 --checkpoint none,all --batch 2,4``
  searches the recipe's knobs (constraints, then a memory estimate, then short ``train``
  trials) and prints the ``train`` command of the fastest config (slapo_fn.tune).

Bad input gets one answer, before any work starts: the arguments are checked first
(sizes, an even split of the batch, files), then the model's config, the checkpoint to
resume and — for a job on several processes — the whole schedule, built on the meta
device over a fake process group. Each refusal is a :class:`CommandLineError` (or
another typed ``ValueError``/``KeyError`` of slapo_fn) printed once, in a few lines,
without a traceback, with exit code 2.

A multi-process run is started by :func:`slapo_fn.launch.launch`: torchrun's agent in a
session of its own, its workers writing their PIDs under ``--run-dir``. Whatever way the
run ends (success, a failed or killed rank, Ctrl-C, SIGTERM, SIGHUP) no worker is left
running; a rank that refuses its input leaves its message for the launcher, which says it
once, and a failed rank is one line, not torchrun's ``ChildFailedError``.

Imports of torch and of the rest of the package are made inside the commands, on use.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import math
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from .errors import Problem, ScheduleError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["CommandLineError", "main"]

PG_TIMEOUT_S = 60
#: Learning-rate decays of ``--decay`` (``slapo_fn.train.DECAYS``, named here without importing torch).
DECAYS = ("cosine", "linear", "constant")
#: AdamW implementations of ``--optimizer-impl`` (``slapo_fn.train.adamw``'s ``impl``).
OPTIMIZER_IMPLS = ("auto", "foreach", "fused", "for-loop")
#: The most lines a refusal takes; a longer one is cut, saying how many lines are left out.
MAX_MESSAGE_LINES = 10


class CommandLineError(ScheduleError):
    """Arguments, files or a model config that ``slapo-fn`` refuses before any work
    starts. Each problem's ``path`` is the flag (``"--steps"``) or the file at fault; all
    problems found are reported at once. A ``ValueError``, like every bad-input error of
    slapo_fn.

    >>> print(CommandLineError("train", [Problem("--steps", "must be at least 1, got 0", "--steps 40")]))
    slapo-fn train: '--steps': must be at least 1, got 0
          fix: --steps 40
    """

    def __init__(self, command: str, problems: Sequence[Problem]) -> None:
        super().__init__(f"slapo-fn {command}", problems)


# -- arguments --------------------------------------------------------------------------
def _parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-tiny",
                   help="a preset (see slapo_fn.presets), a config.json path, or a Hugging Face folder (its "
                        "weights, model.safetensors or a sharded index, are loaded where present)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (mesh axis 'dp')")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (mesh axis 'tp')")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages, one per rank (mesh axis 'pp')")
    p.add_argument("--dp-mode", choices=("fsdp", "ddp"), default=None,
                   help="data parallelism over --dp: FSDP2 (the default when --dp > 1) or DDP; given with --dp 1, "
                        "one rank runs the data-parallel job of one (a process group and a one-rank mesh)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    p.add_argument("--checkpoint", type=float, default=None, metavar="RATIO",
                   help="activation checkpointing of the first RATIO of the layers (1.0 = all)")
    p.add_argument("--kernels", action="store_true", help="the family's fused kernels")
    p.add_argument("--compile", action="store_true", help="torch.compile every layer")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches (default: 2 x pp)")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, interleaved, zero-bubble, zbv")


def _parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``slapo-fn`` parser and its commands' parsers, by name."""
    parser = argparse.ArgumentParser(prog="slapo-fn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model with a recipe on local processes (or several nodes)")
    train.add_argument("--config", default=None, metavar="FILE.toml",
                       help="a TOML file whose keys are these flags' names (e.g. lr = 3e-4, grad-accum = 2; in "
                            "[sections] or not); flags given on the command line override it")
    _parallel_args(train)
    train.add_argument("--steps", type=int, default=40, help="the step to train up to (a resumed run's total)")
    train.add_argument("--batch", type=int, default=8, help="global batch (sequences per optimizer step, over "
                                                            "data-parallel ranks and --grad-accum micro-steps)")
    train.add_argument("--seq", type=int, default=64, help="sequence length")
    train.add_argument("--seed", type=int, default=0)
    loop = train.add_argument_group("optimization")
    loop.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    loop.add_argument("--warmup", type=int, default=0, help="steps of linear warmup to --lr")
    loop.add_argument("--decay", choices=DECAYS, default="constant",
                      help="after warmup, from --lr to --min-lr by the last step")
    loop.add_argument("--min-lr", type=float, default=0.0, help="the learning rate the decay ends at")
    loop.add_argument("--weight-decay", type=float, default=0.01,
                      help="AdamW weight decay of matrices (not of biases and norm scales)")
    loop.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default="auto",
                      help="AdamW's kernels: auto (torch's choice: foreach on GPUs), foreach, fused or for-loop")
    loop.add_argument("--grad-clip", type=float, default=None, metavar="NORM",
                      help="clip gradients to this global norm (across TP, FSDP and pipeline stages)")
    loop.add_argument("--grad-accum", type=int, default=1, metavar="K",
                      help="micro-steps per optimizer step (FSDP2 reduces gradients on the last one)")
    loop.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                      help="compute dtype: bf16 is FSDP2 mixed precision with --dp > 1, autocast otherwise; "
                           "weights, optimizer and gradient reductions stay float32")
    loop.add_argument("--eval-every", type=int, default=0, metavar="N",
                      help="an eval loss every N steps, where the data has a held-out split (0: never)")
    loop.add_argument("--eval-batches", type=int, default=None, metavar="N", help="at most N eval batches")
    data = train.add_argument_group("data", "with a tokenizer (--tokenizer, or the --model folder's own), --data is "
                                            "tokenized and packed into --seq tokens per row, with attention masks "
                                            "and a held-out split; without one, a plain text file is read as in "
                                            "earlier versions (random byte windows, 256 symbols)")
    data.add_argument("--data", default=None,
                      help="a text file, a folder of text files, JSONL with a 'text' field (or chat 'messages'), "
                           "parquet, a `datasets` dataset saved on disk, a folder of `slapo-fn prepare`, or 'stdlib' "
                           "(the Python standard library's sources, 2 MB; 'stdlib:8MiB' or 'stdlib:all' for more); "
                           "a mixture: 'a.jsonl:0.7,b/:0.3'; sources over 256 MiB, parquet and mixtures are "
                           "streamed; default: a synthetic task")
    data.add_argument("--stream", action="store_true",
                      help="stream --data (datasets' iterable mode, packed on the fly) whatever its size")
    data.add_argument("--data-format", choices=("auto", "text", "chat"), default="auto",
                      help="rows of text (--text-field) or chat 'messages' (rendered with the tokenizer's chat "
                           "template, loss on assistant turns); auto: as the first row says")
    data.add_argument("--text-field", default="text", help="the field of JSON rows and parquet columns to read")
    data.add_argument("--tokenizer", default=None, metavar="FOLDER|bytes",
                      help="a tokenizer folder (AutoTokenizer), or 'bytes' (UTF-8 bytes + EOS: 257 symbols); "
                           "default: the --model folder's tokenizer if it has one")
    data.add_argument("--eval-fraction", type=float, default=None, metavar="F",
                      help="the share of --data's rows held out for --eval-every (default: 0.05 with --eval-every, "
                           "else 0)")
    train.add_argument("--export-to", default=None, metavar="FOLDER",
                       help="at the end, write the trained model (and the tokenizer) as a Hugging Face folder")
    train.add_argument("--checkpoint-dir", default=None, help="where distributed checkpoints go")
    train.add_argument("--save-every", type=int, default=0, help="save every N steps (and at the end)")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    train.add_argument("--log-every", type=int, default=5)
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--run-dir", default=None, help="where worker PIDs are written (default: a temp dir)")
    train.add_argument("--metrics", default=None, help="write per-step figures as JSON lines to this file "
                       "(with the peak memory of the most loaded rank)")
    train.add_argument("--fault", default=None, metavar="KIND:STEP",
                       help="inject a failure on the last rank at STEP: 'exit:3' exits non-zero, 'hang:3' stops "
                            "answering (tests the launcher's and the tuner's failure handling)")
    train.add_argument("--tensorboard", default=None, metavar="DIR",
                       help="TensorBoard scalars (loss, lr, grad norm, tokens/s, peak memory) in DIR; needs the "
                            "tensorboard package (pip install 'slapo_fn[tensorboard]')")
    nodes = train.add_argument_group("several nodes", "run the same command on every node, each with its "
                                                      "--node-rank; torchrun's static rendezvous at node 0")
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes of the job (dp*tp*pp ranks split evenly)")
    nodes.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0 .. --nnodes - 1")
    nodes.add_argument("--master-addr", default=None, metavar="HOST", help="address of node 0 (with --nnodes > 1)")
    nodes.add_argument("--master-port", type=int, default=29500, metavar="PORT", help="a free port on node 0")

    explain = sub.add_parser("explain", help="explain the schedule of a model and parallel config (no job)")
    _parallel_args(explain)
    explain.add_argument("--tree", action="store_true", help="print the whole (folded) module tree too")
    explain.add_argument("--json", action="store_true", help="print everything as one JSON object (for scripts)")
    explain.add_argument("--batch", type=int, default=8, help="global batch, for the bytes of each collective")
    explain.add_argument("--seq", type=int, default=None, help="sequence length, for the bytes of each collective "
                         "(default: 2048, or the model's positions where fewer)")
    explain.add_argument("--hardware", default="h100", metavar="NAME|FILE.toml",
                         help="hardware profile of the step-time estimate: h100, h200, a100, cpu, or a TOML file "
                              "(see slapo_fn/hardware/h100.toml); 'none' for no estimate")

    verify = sub.add_parser("verify", help="check a recipe against the unscheduled model")
    _parallel_args(verify)
    verify.add_argument("--seq", type=int, default=16)
    verify.add_argument("--batch", type=int, default=2)
    verify.add_argument("--rtol", type=float, default=None,
                        help="relative to each tensor's largest value (default: by dtype, 1e-5 for float32)")
    verify.add_argument("--atol", type=float, default=None, help="absolute (default: by dtype, 1e-5 for float32)")
    verify.add_argument("--run-dir", default=None)
    _tune_args(sub.add_parser("tune", help="search the recipe's knobs for the fastest config that fits"))

    _prepare_args(sub.add_parser("prepare", help="tokenize a corpus once into a memory-mapped folder that "
                                                 "train --data reads (no job)"))

    export = sub.add_parser("export", help="write a training checkpoint as a Hugging Face folder (no job)")
    export.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="a --checkpoint-dir of slapo-fn train")
    export.add_argument("out", metavar="OUT_FOLDER", help="the Hugging Face folder to write")
    export.add_argument("--model", required=True,
                        help="the model the checkpoint was trained as (a preset, config.json or folder)")
    export.add_argument("--tokenizer", default=None, metavar="FOLDER",
                        help="tokenizer files to write beside the weights (default: the --model folder's, if any)")
    return parser, dict(sub.choices)


def _prepare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, metavar="SRC",
                   help="a .jsonl/.parquet/text file or a folder of them (JSON rows' --text-field is a document)")
    p.add_argument("--tokenizer", required=True, metavar="FOLDER|bytes",
                   help="a tokenizer folder (AutoTokenizer, with tokenizer.json), or 'bytes'")
    p.add_argument("--out", required=True, metavar="FOLDER", help="a new (or empty) folder for the tokens")
    p.add_argument("--workers", type=int, default=None, help="encoding processes (default: one per CPU)")
    p.add_argument("--text-field", default="text", help="the field of JSON rows and parquet columns to read")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-tiny", help="a preset (see slapo_fn.presets) or a config.json path")
    p.add_argument("--world-size", type=int, default=1, help="ranks of every trial (dp*tp*pp)")
    knobs = p.add_argument_group("knobs", "comma-separated values to search; a knob left out takes its "
                                          "defaults from the model's recipe (slapo_fn.tune.space_for)")
    for name, example in (("dp", "1,2"), ("tp", "1,2"), ("pp", "1,2"), ("sp", "false,true"),
                          ("checkpoint", "none,0.5,all"), ("microbatches", "2,4"), ("batch", "4,8"),
                          ("dp-mode", "fsdp,ddp"), ("kernels", "false,true"), ("compile", "false,true"),
                          ("schedule", "1f1b,gpipe")):
        knobs.add_argument(f"--{name}", default=None, metavar="V,V", help=f"e.g. {example}")
    p.add_argument("--seq", type=int, default=64, help="sequence length of every trial")
    p.add_argument("--steps", type=int, default=4, help="measured steps per trial (after --warmup)")
    p.add_argument("--warmup", type=int, default=2, help="steps per trial before measuring")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--strategy", choices=("auto", "grid", "random", "tpe"), default="auto",
                   help="auto: grid for spaces of at most --grid-max candidates, else TPE (optuna) or random")
    p.add_argument("--grid-max", type=int, default=16)
    p.add_argument("--trials", type=int, default=None, help="at most this many trials")
    p.add_argument("--patience", type=int, default=None, help="stop when the best has not improved for N trials")
    p.add_argument("--time-budget", type=float, default=None, metavar="S", help="start no trial after S seconds")
    p.add_argument("--trial-timeout", type=float, default=300.0, metavar="S", help="a trial running longer fails")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="per-rank memory for the training state, e.g. 80GiB or 300MiB: configs estimated above it "
                        "are pruned without running")
    p.add_argument("--out", default="tune-out", help="folder for trials.json, throughput.png and each trial's log")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--fault", action="append", default=[], metavar="KNOB=V[,KNOB=V]@KIND:STEP",
                   help="inject a fault (see train --fault) into the trials matching these knob values (tests)")


# -- a TOML config file: defaults for the flags, which override it ---------------------------------
def _parse(argv: Sequence[str]) -> argparse.Namespace:
    """The arguments of ``argv``; with ``--config FILE`` its values are the flags'
    defaults, so that a flag given overrides the file (as torchtitan's configs)."""
    parser, commands = _parsers()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    command = commands[args.command]
    command.set_defaults(**_config_values(Path(args.config), command, args.command))
    return parser.parse_args(argv)


def _config_values(file: Path, parser: argparse.ArgumentParser, command: str) -> dict[str, Any]:
    """The flag values of TOML ``file`` for ``parser``: keys are flag names (``grad-accum``
    or ``grad_accum``), at the top or in ``[sections]`` (any names: ``[optimizer]``,
    ``[parallel]``, ...); each value of the flag's type. Every unknown key and wrong value
    is reported at once, naming the file and key."""
    def refuse(problems: list[Problem]) -> CommandLineError:
        return CommandLineError(command, problems)

    fix = 'a TOML file of flag names and values, e.g. lr = 3e-4 and grad-accum = 2, or [optimizer] lr = 3e-4'
    try:
        table = tomllib.loads(file.read_text())
    except OSError as e:
        raise refuse([Problem("--config", f"{file}: cannot be read ({e.strerror or e})", fix)]) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise refuse([Problem(str(file), f"not valid TOML: {e}", fix)]) from None
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    flat: list[tuple[str, Any]] = []
    for key, value in table.items():
        if isinstance(value, dict):  # a [section], also one named like a flag ([data] data = "...")
            flat += [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            flat.append((key, value))
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for where, value in flat:
        name = where.rsplit(".", 1)[-1]
        dest = name.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            close = difflib.get_close_matches(dest, list(actions), n=3)
            problems.append(Problem(f"{file}: {where}", f"not a flag of slapo-fn {command}"
                                    + (f"; close matches: {', '.join(c.replace('_', '-') for c in close)}"
                                       if close else ""),
                                    f"slapo-fn {command} --help lists the flags"))
            continue
        checked = _config_value(action, value)
        if isinstance(checked, Problem):
            problems.append(Problem(f"{file}: {where}", checked.reason, checked.fix))
        elif dest in values:
            problems.append(Problem(f"{file}: {where}", "is set twice (sections are only for reading)",
                                    "set each flag once"))
        else:
            values[dest] = checked
    if problems:
        raise refuse(problems)
    return values


def _config_value(action: argparse.Action, value: Any) -> Any:
    """``value`` as the flag of ``action`` takes it, or a :class:`Problem` saying why not."""
    flag = action.option_strings[-1]
    if isinstance(action, argparse._StoreTrueAction):
        kind, ok = "true or false", isinstance(value, bool)
    elif action.type is int:
        kind, ok = "an integer", isinstance(value, int) and not isinstance(value, bool)
    elif action.type is float:
        kind, ok = "a number", isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        kind, ok = "a string", isinstance(value, str)
    if not ok:
        return Problem("", f"must be {kind} (as {flag}), got {value!r}", f"{flag.lstrip('-')} = "
                       + ("true" if kind.startswith("true") else "2" if kind == "an integer" else
                          "0.5" if kind == "a number" else '"..."'))
    if action.choices is not None and value not in action.choices:
        return Problem("", f"{value!r} is not one of {', '.join(map(str, action.choices))}",
                       f"{flag.lstrip('-')} = {next(iter(action.choices))!r}")
    return value


# -- checking the input, before any work starts ---------------------------------------------
def _argument_problems(args: argparse.Namespace) -> list[Problem]:
    """Every problem of the arguments themselves (no torch, no model): sizes out of
    range, a batch that does not split evenly, flags that need another one."""
    problems: list[Problem] = []
    train = args.command == "train"

    def at_least(flag: str, low: int | float, what: str, fix: str) -> None:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
        if value is not None and not value >= low:  # `not >=`: NaN is refused too
            problems.append(Problem(flag, f"must be at least {low}, got {value} ({what})", fix))

    at_least("--dp", 1, "data-parallel ranks", "--dp 1 (no data parallelism) or more")
    at_least("--tp", 1, "tensor-parallel ranks", "--tp 1 (no tensor parallelism) or more")
    at_least("--pp", 1, "pipeline stages", "--pp 1 (no pipeline) or more")
    at_least("--microbatches", 1, "microbatches per pipeline step",
             "leave --microbatches out for the default, 2 x --pp")
    at_least("--batch", 1, "sequences per step", "--batch 8")
    at_least("--seq", 1, "tokens per sequence", "--seq 64")
    if train:
        at_least("--steps", 1, "the step to train up to, resumed runs included", "--steps 40")
        at_least("--log-every", 1, "steps between loss lines", "--log-every 5")
        at_least("--save-every", 0, "steps between checkpoints; 0: only at the end", "--save-every 0")
        at_least("--warmup", 0, "steps of learning-rate warmup", "--warmup 0 (none) or more")
        at_least("--grad-accum", 1, "micro-steps per optimizer step", "--grad-accum 1 (no accumulation)")
        at_least("--eval-every", 0, "steps between eval losses; 0: never", "--eval-every 0")
        at_least("--eval-batches", 1, "eval batches per evaluation", "leave out --eval-batches for all of them")
        at_least("--nnodes", 1, "nodes of the job", "--nnodes 1 (this machine only)")
        at_least("--node-rank", 0, "this node's rank", "--node-rank 0 on the first node, 1 on the next, ...")
        problems += _loop_problems(args)
    if args.command == "verify":
        at_least("--rtol", 0, "relative tolerance", "--rtol 1e-4")
        at_least("--atol", 0, "absolute tolerance", "--atol 1e-5")
        if args.pp > 1:
            problems.append(Problem("--pp", "verify compares tensor- and data-parallel schedules with the "
                                            "unscheduled model; it does not run pipelines",
                                    "drop --pp (pipelines are verified by their tests); use --tp/--dp"))
    if problems:  # the checks below divide by these sizes
        return problems
    accum = args.grad_accum if train else 1
    if args.command in ("train", "explain") and args.batch % (args.dp * accum):
        even = math.ceil(args.batch / (args.dp * accum)) * args.dp * accum
        over = f"--dp {args.dp} data-parallel ranks" + (f" x --grad-accum {accum} micro-steps" if accum > 1 else "")
        problems.append(Problem("--batch", f"a global batch of {args.batch} sequences does not split evenly "
                                           f"over {over}",
                                f"--batch {even} (a multiple of --dp{' x --grad-accum' if accum > 1 else ''})"))
    elif train and args.pp > 1:
        local, micro = args.batch // (args.dp * accum), args.microbatches or 2 * args.pp
        if local % micro:
            divisors = [str(d) for d in range(args.pp, local + 1) if local % d == 0]  # at least one per stage
            default = "" if args.microbatches else " (the default: 2 x --pp)"
            per = f"--batch {args.batch} / --dp {args.dp}" + (f" / --grad-accum {accum}" if accum > 1 else "")
            problems.append(Problem("--microbatches" if args.microbatches else "--batch",
                                    f"{local} sequences per data-parallel rank and micro-step ({per}) do not "
                                    f"split into {micro} microbatches{default}",
                                    f"--batch {micro * args.dp * accum * math.ceil(local / micro)}"
                                    + (f", or --microbatches among {', '.join(divisors)}" if divisors else "")))
    if (args.command in ("train", "verify", "explain") and args.sp is True and args.tp > 1 and args.seq is not None
            and args.seq % args.tp):
        down = args.seq - args.seq % args.tp
        up = down + args.tp
        problems.append(Problem("--seq", f"{args.seq} tokens per sequence do not split evenly over the --tp "
                                         f"{args.tp} ranks that --sp splits each sequence over",
                                f"--seq {up}" + (f" or {down}" if down else "")
                                + " (a multiple of --tp), or drop --sp"))
    if train and args.nnodes > 1 and _world(args) % args.nnodes:
        problems.append(Problem("--nnodes", f"{_world(args)} ranks (--dp {args.dp} x --tp {args.tp} x --pp "
                                            f"{args.pp}) do not split evenly over {args.nnodes} nodes",
                                "--nnodes among the divisors of dp*tp*pp"))
    if train:
        problems += _train_argument_problems(args)
    return problems


def _loop_problems(args: argparse.Namespace) -> list[Problem]:
    """The training loop's numbers: learning rates, weight decay, clipping, the nodes."""
    problems = []
    if not (math.isfinite(args.lr) and args.lr > 0):
        problems.append(Problem("--lr", f"must be a positive number, got {args.lr}", "--lr 3e-3"))
    elif not (math.isfinite(args.min_lr) and 0 <= args.min_lr <= args.lr):
        problems.append(Problem("--min-lr", f"must be in [0, --lr {args.lr}], got {args.min_lr}",
                                "--min-lr 0 (or a tenth of --lr)"))
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        problems.append(Problem("--weight-decay", f"must be a number >= 0, got {args.weight_decay}",
                                "--weight-decay 0.1 (or 0: none)"))
    if args.grad_clip is not None and not (math.isfinite(args.grad_clip) and args.grad_clip > 0):
        problems.append(Problem("--grad-clip", f"must be a positive norm, got {args.grad_clip}",
                                "--grad-clip 1.0, or leave it out (no clipping)"))
    if args.nnodes >= 1 and not 0 <= args.node_rank < args.nnodes:
        problems.append(Problem("--node-rank", f"must be in 0 .. {args.nnodes - 1} for --nnodes {args.nnodes}, "
                                               f"got {args.node_rank}", "--node-rank 0 on node 0, 1 on the next, ..."))
    if args.nnodes > 1 and not args.master_addr:
        problems.append(Problem("--master-addr", f"--nnodes {args.nnodes} needs the address of node 0, where "
                                                 "the ranks meet", "--master-addr HOST (the same on every node)"))
    if not 1 <= args.master_port <= 65535:
        problems.append(Problem("--master-port", f"must be a TCP port (1 .. 65535), got {args.master_port}",
                                "--master-port 29500"))
    return problems


def _train_argument_problems(args: argparse.Namespace) -> list[Problem]:
    problems = _data_argument_problems(args)
    if args.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        problems.append(Problem("--tensorboard", "needs the tensorboard package, which is not installed",
                                "pip install 'slapo_fn[tensorboard]' (or: pip install tensorboard), or leave out "
                                "--tensorboard"))
    if args.metrics is not None and not Path(args.metrics).absolute().parent.is_dir():
        problems.append(Problem("--metrics", f"{args.metrics}: its folder does not exist",
                                "--metrics FILE in an existing folder (the file is created or appended to)"))
    if args.resume and not args.checkpoint_dir:
        problems.append(Problem("--resume", "needs --checkpoint-dir (where the checkpoints are)",
                                "--resume --checkpoint-dir DIR"))
    if args.save_every and not args.checkpoint_dir:
        problems.append(Problem("--save-every", "needs --checkpoint-dir (where to save)",
                                f"--save-every {args.save_every} --checkpoint-dir DIR"))
    if args.export_to is not None and Path(args.export_to).exists() and not Path(args.export_to).is_dir():
        problems.append(Problem("--export-to", f"{args.export_to}: is a file, not a folder",
                                "--export-to FOLDER (created if missing)"))
    try:
        _fault(args.fault)
    except ValueError:
        problems.append(Problem("--fault", f"{args.fault!r} is not KIND:STEP (KIND exit or hang, STEP a step number)",
                                "--fault exit:3 or --fault hang:3"))
    return problems


STDLIB = "stdlib"
#: Bytes of the standard library's sources that ``--data stdlib`` reads (``stdlib:SIZE``: another amount).
STDLIB_BYTES = 2_000_000
#: The held-out share of ``--data`` with ``--eval-every`` and no ``--eval-fraction``.
EVAL_FRACTION = 0.05
_DATA_FIX = ("a text file, a folder of them, a .jsonl file with a 'text' field, a `datasets` dataset saved with "
             "save_to_disk, or stdlib")


def _stdlib_bytes(data: str) -> int | None:
    """The byte cap of ``--data stdlib[:SIZE]`` (``None``: all of it); ``ValueError`` for a bad SIZE."""
    _, _, size = data.partition(":")
    if not size:
        return STDLIB_BYTES
    return None if size == "all" else _size(size)


def _tokenizer_source(args: argparse.Namespace) -> str | None:
    """What tokenizes ``--data``: ``--tokenizer`` (a folder, or ``"bytes"``), else the
    ``--model`` folder's own tokenizer, else ``None``."""
    from .presets import tokenizer_of

    if args.tokenizer is not None:
        return str(args.tokenizer)
    found = tokenizer_of(args.model)
    return None if found is None else str(found)


def _packed(args: argparse.Namespace) -> bool:
    """Whether ``--data`` is tokenized and packed (:class:`slapo_fn.data.TokenData`: masks,
    a held-out split, resumable) rather than read as random byte windows (the behaviour of
    earlier versions, kept for a plain text file when no tokenizer is given)."""
    if args.data is None:
        return False
    if _tokenizer_source(args) is not None or args.data.partition(":")[0] == STDLIB or args.stream:
        return True
    path = Path(args.data)
    return not path.is_file() or path.suffix.lower() in (".jsonl", ".json")


def _data_argument_problems(args: argparse.Namespace) -> list[Problem]:
    """``--data``, ``--tokenizer`` and the eval flags, without reading any data."""
    problems = []
    if args.data is not None and args.data.partition(":")[0] == STDLIB:
        try:
            _stdlib_bytes(args.data)
        except ValueError:
            problems.append(Problem("--data", f"{args.data!r}: the size after 'stdlib:' is not a size",
                                    "--data stdlib, --data stdlib:8MiB or --data stdlib:all"))
    elif args.data is not None and (mixed := _mixture_problems(args.data)) is not None:
        problems += mixed
    elif args.data is not None:
        path, why = Path(args.data), ""
        if not path.exists():
            why = "no such file or folder"
        elif not os.access(path, os.R_OK):
            why = "not readable"
        elif path.is_file() and path.stat().st_size < 2:
            why = f"a file of at least 2 bytes is needed, got {path.stat().st_size}"
        elif not path.is_file() and not path.is_dir():
            why = "neither a file nor a folder"
        if why:
            problems.append(Problem("--data", f"{args.data}: {why}", f"{_DATA_FIX}; or no --data for the "
                                                                     "synthetic task"))
    if args.tokenizer is not None:
        if args.data is None:
            problems.append(Problem("--tokenizer", "tokenizes --data, and there is none (the synthetic task is "
                                                   "token ids already)", "--data FILE --tokenizer FOLDER, or "
                                                                         "leave out --tokenizer"))
        elif args.tokenizer != "bytes" and not Path(args.tokenizer).is_dir():
            problems.append(Problem("--tokenizer", f"{args.tokenizer}: no such folder (nothing is downloaded)",
                                    "a folder with tokenizer files (tokenizer.json, tokenizer_config.json), or "
                                    "--tokenizer bytes"))
    fraction = args.eval_fraction
    if fraction is not None and not (math.isfinite(fraction) and 0 <= fraction < 1):
        problems.append(Problem("--eval-fraction", f"must be in [0, 1), got {fraction}", "--eval-fraction 0.05"))
    elif fraction is not None and args.data is None:
        problems.append(Problem("--eval-fraction", "holds out rows of --data, and there is none",
                                "--data FILE --eval-fraction 0.05, or leave out --eval-fraction"))
    if args.eval_every and not problems:
        if args.data is None or not _packed(args):
            what = "the synthetic task" if args.data is None else \
                f"{args.data}, read as byte windows (no tokenizer given),"
            problems.append(Problem("--eval-every", f"{what} has no held-out split",
                                    "--data FILE with --tokenizer FOLDER (or --tokenizer bytes), or leave out "
                                    "--eval-every"))
        elif fraction == 0:
            problems.append(Problem("--eval-every", "--eval-fraction 0 holds out no rows to evaluate on",
                                    "--eval-fraction 0.05 (or leave it out: 0.05 with --eval-every)"))
    return problems


def _mixture_problems(data: str) -> list[Problem] | None:
    """``None`` where ``--data`` is one source without a weight; else the problems of its
    weights and sources (without reading them)."""
    from .data.spec import parse

    try:
        spec = parse(data)
    except ScheduleError as e:
        return list(e.problems)
    if not spec.mixture:
        return None
    return [Problem("--data", f"{s.name}: no such file or folder", _DATA_FIX)
            for s in spec.sources if not s.stdlib and not s.path.exists()]


def _eval_fraction(args: argparse.Namespace) -> float:
    if args.eval_fraction is not None:
        return float(args.eval_fraction)
    return EVAL_FRACTION if args.eval_every else 0.0


def _check_inputs(args: argparse.Namespace) -> None:
    """Refuse, before any process starts, what the arguments alone do not show: an
    unknown pipeline schedule, a model config that cannot be read or is no causal LM, a
    recipe the knobs do not fit, data or a checkpoint that does not fit the run — and, for
    a job on several processes, anything the schedule itself refuses (heads that do not
    split over ``--tp``, too few microbatches for the stages), found by building it on
    the meta device over a fake process group, as every rank would."""
    from .pipelines import SCHEDULES

    if args.schedule not in SCHEDULES:
        close = difflib.get_close_matches(args.schedule, list(SCHEDULES), n=1)
        raise CommandLineError(args.command, [Problem(
            "--schedule", f"unknown pipeline schedule {args.schedule!r}" + (f"; did you mean {close[0]!r}?" if close
                                                                           else ""),
            f"one of {', '.join(SCHEDULES)}")])
    config = _config(args.model, args.command)
    _fallback_plan(config, args)
    _sequence_length(config, args)
    if args.command == "train":
        problems = _data_problems(args, config) + _resume_problems(args)
        if problems:
            raise CommandLineError(args.command, problems)
    if _axes(args) and args.command != "explain":  # explain builds the schedule in this process anyway
        _check_schedule(args)


def _sequence_length(config: Any, args: argparse.Namespace) -> None:
    """``--seq`` against the positions ``config``'s model covers: ``explain``'s default is
    2048 or that many, whichever is fewer; a longer one given is refused before any work
    (the model's position table would fail on it, deep inside a rank)."""
    from .hf import position_limit

    if not hasattr(args, "seq"):
        return
    limit = position_limit(config)
    if args.seq is None:
        args.seq = min(2048, limit)
    elif args.seq > limit:
        raise CommandLineError(args.command, [Problem(
            "--seq", f"{args.seq} is longer than the {limit} positions {args.model!r} covers (its config's "
                     "max_position_embeddings or n_positions)", f"--seq {limit}")])


def _config(model: str, command: str) -> Any:
    """The Hugging Face config of ``--model`` (a preset or a config.json), or a
    :class:`CommandLineError` naming the file: not JSON, no or an unknown ``model_type``
    (with close matches, not the list of every type), no causal LM for it."""
    from .presets import config_for

    try:
        return config_for(model, causal=True)
    except ScheduleError as e:
        raise CommandLineError(command, e.problems) from None


def _data_problems(args: argparse.Namespace, config: Any) -> list[Problem]:
    """``--data``'s symbols against the model's vocabulary: the tokenizer's (loaded here,
    not the data), or 256 for byte windows."""
    from . import hf
    from .data import ByteText

    vocab = hf.config_value(config, "vocab_size", default=None)
    if args.data is None or vocab is None:
        return []
    if not _packed(args):
        symbols = ByteText(b"").vocab  # byte-level text: one token per byte value
        if symbols <= vocab:
            return []
        return [Problem("--data", f"{args.data} is read as bytes ({symbols} symbols); the model's vocabulary has "
                                  f"only {vocab}",
                        "a model with vocab_size >= 256, a --tokenizer FOLDER whose vocabulary fits, or no --data "
                        "(the synthetic task fits any vocabulary)")]
    try:
        codec = _codec(args)
    except ScheduleError as e:
        first = e.problems[0] if e.problems else Problem("", str(e), "")
        return [Problem("--tokenizer" if args.tokenizer is not None else "--model", f"{first.path}: {first.reason}",
                        "a folder with tokenizer files (tokenizer.json, tokenizer_config.json), or --tokenizer bytes")]
    if codec.vocab <= vocab:
        return _source_problems(args, codec)
    where = "--tokenizer" if args.tokenizer is not None else "--model"
    return [Problem(where, f"the tokenizer {codec.name} has {codec.vocab} tokens; the model's vocabulary has only "
                           f"{vocab} (token ids would fall outside the embedding)",
                    "a tokenizer with at most vocab_size tokens, or a model whose config.json has vocab_size >= "
                    f"{codec.vocab}")]


def _source_problems(args: argparse.Namespace, codec: Any) -> list[Problem]:
    """What ``--data``'s sources hold, read as little as it takes (a prepared folder's
    manifest, a stream's first row): :func:`slapo_fn.data.data_problems`."""
    from .data import data_problems

    if args.data.partition(":")[0] == STDLIB:
        return []
    return data_problems(args.data, codec, stream=args.stream, text_field=args.text_field,
                         data_format=args.data_format, eval_every=bool(args.eval_every))


def _codec(args: argparse.Namespace) -> Any:
    """The tokenizer of ``--data`` as a :class:`slapo_fn.data.Codec`."""
    from .data import Codec
    from .data.manifest import TOKENIZER, is_prepared

    source = _tokenizer_source(args)
    if source is None and args.data is not None and is_prepared(Path(args.data)) \
            and (Path(args.data) / TOKENIZER).is_dir():
        source = str(Path(args.data) / TOKENIZER)  # the folder's own tokenizer
    return Codec.byte_level() if source in (None, "bytes") else Codec.of(Path(source))


def _token_data(args: argparse.Namespace, codec: Any) -> Any:
    """``--data`` tokenized with ``codec`` and packed into rows of ``--seq`` tokens: in
    memory, mapped from a prepared folder, streamed, or a mixture (:mod:`slapo_fn.data`)."""
    from .data import TokenData, open_data, stdlib_corpus
    from .data.attention import packing_for

    if args.data.partition(":")[0] == STDLIB:
        return TokenData.from_texts(stdlib_corpus(max_bytes=_stdlib_bytes(args.data)), codec, seq_len=args.seq,
                                    seed=args.seed, eval_fraction=_eval_fraction(args))
    return open_data(args.data, codec, seq_len=args.seq, seed=args.seed, eval_fraction=_eval_fraction(args),
                     stream=args.stream, text_field=args.text_field, data_format=args.data_format,
                     chat_packing=lambda: packing_for(_config(args.model, args.command)))


def _checkpointed(data: Any, batch_size: int) -> Any:
    """Data as :func:`slapo_fn.train.train` checkpoints it: positional rows through
    :class:`_Positioned`; streams and mixtures save their own position."""
    from .data.order import PositionalRows

    return _Positioned(data, batch_size) if isinstance(data, PositionalRows) else data


class _Positioned:
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


def _resume_problems(args: argparse.Namespace) -> list[Problem]:
    """With ``--resume``: a checkpoint to resume from, before step ``--steps``."""
    from .state import latest, loadable

    if not args.resume:
        return []
    found = loadable(args.checkpoint_dir) or latest(args.checkpoint_dir)  # load falls back past a broken one
    if found is None or not found.is_dir():
        what = "no checkpoint to resume from (no LATEST file, no .metadata)" if found is None else \
            f"its LATEST names {found.name}, which is missing"
        return [Problem("--checkpoint-dir", f"{args.checkpoint_dir}: {what}",
                        "drop --resume to start at step 0, or pass the --checkpoint-dir of an earlier run")]
    step = _checkpoint_step(found)
    if step < args.steps:
        return []
    return [Problem("--steps", f"the checkpoint in {args.checkpoint_dir} is at step {step}, and --steps "
                               f"{args.steps} is the step to train up to: nothing is left to train",
                    f"--steps {step + 1} or more (the total, not the steps to add), or drop --resume")]


def _checkpoint_step(checkpoint: Path) -> int:
    """The step of a checkpoint folder (``step-00000012``: 12; another name: 0, as
    ``slapo_fn.load`` counts it)."""
    kind, _, number = checkpoint.name.partition("-")
    return int(number) if kind == "step" and number.isdigit() else 0


def _check_schedule(args: argparse.Namespace) -> None:
    """Build the schedule every rank will build, on the meta device over a fake process
    group of the job's size: what it refuses is refused here, once. A pipeline also
    needs a microbatch per stage."""
    from .dtensor.testing import fake_mesh, fake_world
    from .pipelines import split_stages

    axes = _axes(args)
    with fake_world(_world(args)):
        mesh = fake_mesh(*(s for _, s in axes), names=tuple(n for n, _ in axes))
        sch = _schedule(args, mesh, meta=True, say=False)
    if args.command == "train" and args.pp > 1:
        stages, micro = len(split_stages(sch)), args.microbatches or 2 * args.pp
        if micro < stages:
            raise CommandLineError(args.command, [Problem(
                "--microbatches", f"{micro} microbatches for {stages} pipeline stages (--schedule {args.schedule}): "
                                  "every stage needs at least one", f"--microbatches {stages} or more")])


def _say(command: str, error: BaseException) -> str:
    """The refusal as printed: ``slapo-fn COMMAND: …``, at most :data:`MAX_MESSAGE_LINES`."""
    text = str(error) if isinstance(error, CommandLineError) else f"slapo-fn {command}: {error}"
    lines = text.rstrip().splitlines()
    if len(lines) > MAX_MESSAGE_LINES:
        lines = [*lines[: MAX_MESSAGE_LINES - 1], f"  … and {len(lines) - MAX_MESSAGE_LINES + 1} more lines"]
    return "\n".join(lines)


def _refuse(command: str, error: BaseException) -> None:
    """Say why the input is refused, once: in the launcher or a single process, on
    stderr; in a worker of a launch, to the run folder, for the launcher to say (every
    rank refuses the same input); in a worker started otherwise, on rank 0."""
    from .launch import RUN_DIR_ENV
    from .processes import record_error

    text = _say(command, error)
    rank = os.environ.get("RANK", "0")
    run_dir = os.environ.get(RUN_DIR_ENV) if _in_worker() else None
    if run_dir and rank.isdigit():
        record_error(Path(run_dir), int(rank), text)
    elif not _in_worker() or rank == "0":
        print(text, file=sys.stderr, flush=True)


# -- launching ----------------------------------------------------------------------------
def _world(args: argparse.Namespace) -> int:
    return int(args.dp * args.tp * args.pp)


def _in_worker() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("SLAPO_FN_WORKER") == "1"


def _launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run this command on ``dp*tp*pp`` local processes; say how it ended if it failed,
    once: the ranks' refusal, the first failed rank, or the signal that stopped it."""
    from .launch import Nodes, launch

    count = getattr(args, "nnodes", 1)
    nodes = Nodes(count, args.node_rank, args.master_addr or "127.0.0.1", args.master_port) if count > 1 else None
    outcome = launch(argv, _world(args) // count, getattr(args, "run_dir", None), nodes=nodes)
    if outcome.stopped_by is not None:
        print(f"slapo-fn {args.command}: stopped by {outcome.stopped_by.name}; every worker is stopped",
              file=sys.stderr, flush=True)
    elif outcome.errors:
        print("\n".join(outcome.errors), file=sys.stderr, flush=True)
        return 2
    elif outcome.code and outcome.failure:
        print(f"slapo-fn {args.command}: {outcome.failure}; the other ranks were stopped", file=sys.stderr,
              flush=True)
    return outcome.code


# -- inside a worker ------------------------------------------------------------------------
def _setup(args: argparse.Namespace) -> tuple[Any, Any]:
    """Process group (if several ranks), device and mesh for this worker."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .launch import RUN_DIR_ENV

    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        Path(run_dir, f"pid-{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world != _world(args):
        raise CommandLineError(args.command, [Problem(
            "--dp/--tp/--pp", f"{world} processes started for dp*tp*pp = {_world(args)} ranks",
            f"start {_world(args)} processes, or let slapo-fn start them (run it without torchrun)")])
    if not _axes(args):  # one process, no data-parallel job of one: no process group
        return device, None
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    axes = _axes(args)
    mesh = init_device_mesh(device.type, tuple(s for _, s in axes), mesh_dim_names=tuple(n for n, _ in axes))
    return device, mesh


def _axes(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The mesh axes of ``--dp/--pp/--tp`` larger than one, in mesh order; ``dp`` of one
    too where ``--dp-mode`` asks for data parallelism over it (FSDP2 over one rank)."""
    return [(n, s) for n, s in (("dp", args.dp), ("pp", args.pp), ("tp", args.tp))
            if s > 1 or (n == "dp" and getattr(args, "dp_mode", None) is not None)]


def _teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _knobs(args: argparse.Namespace) -> Any:
    from .recipes import Knobs

    return Knobs(tp=args.tp, sequence_parallel=args.sp, checkpoint=args.checkpoint, stages=_stages(args),
                 dp_mode=_dp_mode(args), kernels=args.kernels, compile=args.compile)


def _dp_mode(args: argparse.Namespace) -> Literal["fsdp", "ddp"] | None:
    """The data-parallel mode of the recipe: ``--dp-mode`` where given, FSDP2 where ``--dp > 1``."""
    mode: Literal["fsdp", "ddp"] | None = args.dp_mode
    return mode if mode is not None else "fsdp" if args.dp > 1 else None


def _stages(args: argparse.Namespace) -> int:
    """Pipeline stages for ``--pp`` ranks: one per rank, or as many per rank as
    ``--schedule`` places (``zbv``: two, in a V)."""
    from .pipelines import SCHEDULES

    kind = SCHEDULES.get(args.schedule)
    per_rank = kind.per_rank if kind is not None and kind.per_rank is not None else 1
    return 1 if args.pp == 1 else args.pp * per_rank


def _schedule(args: argparse.Namespace, mesh: Any, *, meta: bool, say: bool = True) -> Any:
    from . import create_schedule, recipes
    from .hf import model_type
    from .presets import build_model

    model = build_model(args.model, meta=meta)
    plan = _fallback_plan(model, args)
    if plan is None:
        return recipes.for_model(model)(create_schedule(model, mesh=mesh), _knobs(args))
    sch = recipes.from_model_plan(model)(create_schedule(model, mesh=mesh), _knobs(args))
    if say and os.environ.get("RANK", "0") == "0":
        print(f"slapo-fn: no recipe for model_type {model_type(model)!r}: scheduled by the model's own "
              f"base_model_tp_plan ({len(plan)} entries), not a recipe", flush=True)
    return sch


def _fallback_plan(model: Any, args: argparse.Namespace) -> dict[str, str] | None:
    """``None`` where the family of ``model`` (a model or its config) has a recipe; else the
    model's own ``base_model_tp_plan``, checked against the knobs. A model with neither, or
    knobs its plan cannot serve, is bad input: a ValueError (a ScheduleError) saying why."""
    from . import recipes
    from .hf import model_type

    kind = model_type(model)
    if any(kind in r.model_types for r in recipes.RECIPES.values()):
        return None
    plan = recipes.tp_plan_of(model)
    if not plan:
        known = sorted(t for r in recipes.RECIPES.values() for t in r.model_types)
        raise ValueError(f"model_type {kind!r} has neither a recipe ({', '.join(known)}) nor a base_model_tp_plan: "
                         "write a recipe for it (slapo_fn.recipes) or add a base_model_tp_plan to its config.json")
    if args.sp and len(recipes.plan_stacks(plan)) != 1:
        raise ValueError(f"--sp needs one stack of repeated layers; the base_model_tp_plan of model_type {kind!r} "
                         "names none or several")
    if args.tp > 1:
        recipes.check_tp_plan(plan)
    return plan


def _train(args: argparse.Namespace) -> int:
    """One worker of ``slapo-fn train``: the schedule, the model, the data, then
    :func:`slapo_fn.train.train`."""
    import torch

    from . import build, build_pipeline, hf
    from . import train as t
    from .data import Arithmetic, ByteText
    from .data.loading import packs_apart
    from .presets import tokenizer_of, weights_of
    from .weights import load_hf, save_hf

    fault = _fault(args.fault)
    device, mesh = _setup(args)
    rank = int(os.environ.get("RANK", "0"))
    sch = _schedule(args, mesh, meta=True)
    vocab = hf.vocab_size(sch.module)
    data: Any
    codec = None
    if _packed(args):
        codec = _codec(args)
        if codec.vocab > vocab:
            raise CommandLineError(args.command, _data_problems(args, sch.module.config))
        data = _checkpointed(_token_data(args, codec), args.batch)
        if rank == 0:
            print(f"data: {getattr(data, 'data', data)}", flush=True)
    else:
        source = ByteText.from_file(args.data, args.seed) if args.data else Arithmetic(vocab, args.seed)
        if source.vocab > vocab:
            raise CommandLineError(args.command, _data_problems(args, sch.module.config))
        data = t.TokenBatches(source, args.seq)
    sch, autocast = t.precision(sch, args.dtype)
    weights = weights_of(args.model)
    init: Literal["empty", "full"] = "empty" if weights is not None and not args.resume else "full"  # a resumed
    # run loads its checkpoint instead
    if args.pp > 1:
        micro = args.microbatches or 2 * args.pp
        model: Any = build_pipeline(sch, microbatches=micro, schedule=args.schedule, loss_fn=t.causal_lm_loss,
                                    init=init, seed=args.seed, device=device)
    else:
        model = build(sch, init=init, seed=args.seed, device=device)
    if packs_apart(data) and isinstance(model, torch.nn.Module):  # examples apart by position ids: no
        # cache, which would turn the reading of packed position ids off
        hf.train_without_cache(model)
    if init == "empty":
        load_hf(model, Path(args.model))
        if rank == 0:
            print(f"loaded weights from {args.model}", flush=True)
    elif not args.resume and rank == 0:
        _say_random_init(args)
    optimizer = t.adamw(model, lr=args.lr, weight_decay=args.weight_decay, impl=args.optimizer_impl)
    torch.manual_seed(args.seed)  # dropout and other random ops of the steps, the same on every rank
    start = 0
    if args.resume:
        start = t.resume(model, optimizer, args.checkpoint_dir, data=data, say=_say_line)
        if start >= args.steps:  # checked before the launch; here for a job started by torchrun itself
            raise CommandLineError(args.command, _resume_problems(args))
        if isinstance(data, _Positioned) and data.resumed_at not in (None, start):
            raise CommandLineError(args.command, [Problem(
                "--batch", f"the checkpoint at step {start} has consumed {data.resumed_at} batches of --batch "
                           f"{args.batch}", "resume with the saved run's --batch")])
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    loggers: list[Any] = []
    if rank == 0:
        loggers.append(t.ConsoleLog(every=args.log_every, start=start, total=args.steps,
                                    progress=not args.no_progress))
        if args.metrics:
            loggers.append(t.JsonlLog(args.metrics))
        if args.tensorboard:
            loggers.append(t.TensorBoardLog(args.tensorboard))

    def inject(step: int) -> None:
        if fault is not None and step == fault[1] and rank == int(os.environ.get("WORLD_SIZE", "1")) - 1:
            _inject(fault[0])

    try:
        t.train(model, optimizer, data, steps=args.steps, batch_size=args.batch, mesh=mesh, start_step=start,
                lr_schedule=t.LRSchedule(args.lr, warmup=args.warmup, decay=args.decay, min_lr=args.min_lr,
                                         total=args.steps),
                grad_clip=args.grad_clip, grad_accum=args.grad_accum, autocast=autocast,
                eval_every=args.eval_every, eval_batches=args.eval_batches,
                checkpoint=t.Checkpointing(args.checkpoint_dir, every=args.save_every) if args.checkpoint_dir
                else None,
                log=loggers, memory=bool(args.metrics or args.tensorboard), on_step=inject)
    finally:
        for logger in loggers:
            logger.close()
    if args.export_to:
        tokenizer = codec.tokenizer if codec is not None and codec.tokenizer is not None else tokenizer_of(args.model)
        save_hf(model, args.export_to, tokenizer=tokenizer)
        if rank == 0:
            print(f"exported to {args.export_to}", flush=True)
    _teardown()
    return 0


def _say_random_init(args: argparse.Namespace) -> None:
    """One line where a Hugging Face folder has a config but no weights: it trains from random ones."""
    from .presets import WEIGHT_FILES

    if Path(args.model, "config.json").is_file() and args.model not in _preset_names():
        print(f"slapo-fn {args.command}: {args.model} has config.json but no weights ({' or '.join(WEIGHT_FILES)}): "
              f"training from random initialization (seed {args.seed})", flush=True)


def _preset_names() -> Sequence[str]:
    from .presets import PRESETS

    return list(PRESETS)


def _say_line(text: str) -> None:
    print(f"slapo-fn train: {text}", flush=True)


def _peak_memory(device: Any) -> int:
    """This process's peak memory in bytes (:func:`slapo_fn.train.peak_memory`)."""
    from .train import peak_memory

    return peak_memory(device)


def _fault(spec: str | None) -> tuple[str, int] | None:
    if spec is None:
        return None
    kind, _, step = spec.partition(":")
    if kind not in ("exit", "hang") or not step.isdigit():
        raise ValueError(f"--fault {spec!r}: use exit:STEP or hang:STEP")
    return kind, int(step)


def _inject(kind: str) -> None:
    print(f"slapo-fn: injected fault {kind!r} on rank {os.environ.get('RANK', '0')}", file=sys.stderr, flush=True)
    if kind == "exit":
        os._exit(3)
    while True:  # hang: the others wait on the next collective until they time out or are killed
        time.sleep(3600)


def _verify(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from . import hf, verify
    from .presets import weights_of
    from .verify import VerificationError

    _device, mesh = _setup(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)  # the model's random initialisation
    sch = _schedule(args, mesh, meta=False)  # a Hugging Face folder's weights where it has some
    if rank == 0 and weights_of(args.model) is not None:
        print(f"loaded weights from {args.model}", flush=True)
    vocab = hf.vocab_size(sch.module)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    code = 0
    try:
        report = verify(sch, ids, rtol=args.rtol, atol=args.atol)
    except VerificationError as e:
        if rank == 0:
            print(f"FAILED: {e}", flush=True)
        code = 1
    else:
        if rank == 0:
            print(_report(report), flush=True)
    _teardown()
    return code


def _report(report: Any) -> str:
    """Per-module table of a verify report: parameters checked and the largest gradient
    difference of each module, then the outputs."""
    modules: dict[str, list[float]] = {}
    for name, diff in report.gradients.items():
        modules.setdefault(name.rsplit(".", 1)[0], []).append(diff)
    width = max((len(m) for m in modules), default=6)
    lines = [f"{'module'.ljust(width)}  params  max |grad diff|"]
    lines += [f"{m.ljust(width)}  {len(d):6d}  {max(d):.3g}" for m, d in modules.items()]
    lines += [f"output {name}: max |diff| {diff:.3g}" for name, diff in report.outputs.items()]
    lines.append(f"OK: {report}")
    return "\n".join(lines)


def _explain(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from .dtensor.testing import fake_mesh
    from .explain import explain

    world = _world(args)
    mesh = None
    started = False
    if _axes(args):
        axes = _axes(args)
        started = not dist.is_initialized()
        mesh = fake_mesh(*(s for _, s in axes), names=tuple(n for n, _ in axes))
    try:
        sch = _schedule(args, mesh, meta=True)
        shape = (args.batch // args.dp, args.seq)  # one data-parallel rank's batch: the bytes of its collectives
        micro = (args.microbatches or 2 * args.pp) if args.pp > 1 else 1
        hardware = None if args.hardware == "none" else args.hardware
        info = explain(sch, torch.zeros(shape, dtype=torch.long, device="meta"), microbatches=micro,
                       pipeline_schedule=args.schedule, hardware=hardware)
        axes_text = " x ".join(f"{n}{s}" for n, s in _axes(args))
        if args.json:
            import json

            print(json.dumps({"model": args.model, "mesh": dict(_axes(args)), "ranks": world,
                              "batch": args.batch, "seq": args.seq, "microbatches": micro,
                              "knobs": str(_knobs(args)), **info.as_dict(), "by_axis": info.by_axis()}))
            return 0
        print(f"{args.model}: {info.total_parameters:,} parameters; {axes_text or 'one process'} "
              f"({world} ranks); recipe knobs: {_knobs(args)}")
        print(f"assumed: global batch {args.batch} × seq {args.seq} ({shape[0]} sequences per data-parallel rank"
              + (f", {micro} microbatches, {args.schedule}" if args.pp > 1 else "") + ")")
        text = str(info)
        if not args.tree:
            text = text.split("\n\n", 1)[-1]  # everything after the tree
        print(text)
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _export_problems(args: argparse.Namespace) -> list[Problem]:
    """A checkpoint to read, a folder to write, tokenizer files if asked for."""
    from .state import latest, loadable

    problems = []
    where = Path(args.checkpoint_dir)
    if not where.is_dir():
        problems.append(Problem("CHECKPOINT_DIR", f"{where}: no such folder",
                                "the --checkpoint-dir of a slapo-fn train run"))
    elif (loadable(where) or latest(where)) is None:
        problems.append(Problem("CHECKPOINT_DIR", f"{where}: no checkpoint here (no LATEST file, no .metadata)",
                                "the --checkpoint-dir of a slapo-fn train run that saved (--checkpoint-dir DIR)"))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        problems.append(Problem("OUT_FOLDER", f"{out}: is a file, not a folder", "a folder (created if missing)"))
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        problems.append(Problem("--tokenizer", f"{args.tokenizer}: no such folder",
                                "a folder with tokenizer files, or leave out --tokenizer"))
    return problems


def _export(args: argparse.Namespace) -> int:
    """``slapo-fn export``: the newest loadable checkpoint under CHECKPOINT_DIR, whatever
    layout wrote it, loaded into one process's unsharded model (``sf.load``, no
    optimizer; DCP reshards) and written with ``sf.save_hf``."""
    problems = _export_problems(args)
    if problems:
        raise CommandLineError(args.command, problems)
    _config(args.model, args.command)
    from . import build, create_schedule, load
    from .hf import recompute_buffers
    from .presets import build_model, tokenizer_of
    from .weights import save_hf

    model = build(create_schedule(build_model(args.model, meta=True)), init="empty")
    step = load(model, None, args.checkpoint_dir)
    recompute_buffers(model)  # rotary inv_freq and other buffers a checkpoint does not hold
    tokenizer = args.tokenizer if args.tokenizer is not None else tokenizer_of(args.model)
    folder = save_hf(model, args.out, tokenizer=tokenizer)
    print(f"exported step {step} of {args.checkpoint_dir} to {folder}"
          + (f" (with the tokenizer of {tokenizer})" if tokenizer is not None else " (no tokenizer)"), flush=True)
    return 0


def _prepare(args: argparse.Namespace) -> int:
    """``slapo-fn prepare``: :func:`slapo_fn.data.prepare` in this process and its workers."""
    from .data import prepare

    began = time.perf_counter()
    tokenizer = None if args.tokenizer == "bytes" else Path(args.tokenizer)
    manifest = prepare(args.data, tokenizer, args.out, workers=args.workers, text_field=args.text_field,
                       progress=not args.no_progress)
    size = sum(s.bytes for s in manifest.sources)
    seconds = time.perf_counter() - began
    print(f"slapo-fn prepare: {args.out}: {manifest.tokens:,} tokens, {manifest.documents:,} documents from "
          f"{len(manifest.sources)} file(s), {size / 2**20:,.1f} MiB in {seconds:.1f} s "
          f"({size / 2**20 / max(seconds, 1e-9):,.1f} MiB/s), tokenizer {manifest.tokenizer.name}; "
          f"train on it with --data {args.out}", flush=True)
    return 0


def _size(text: str) -> int:
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "tb": 10**12}
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number):].lower()
    try:
        return int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise ValueError(f"size {text!r}: use e.g. 512MiB, 80GiB or a number of bytes") from None


def _knob_values(name: str, text: str) -> list[Any]:
    def one(v: str) -> Any:
        v = v.strip().lower()
        if name == "checkpoint":
            return None if v in ("none", "off", "0") else 1.0 if v == "all" else float(v)
        if name in ("sp", "kernels", "compile"):
            if v not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"--{name} {text!r}: use true/false")
            return v in ("true", "1", "yes")
        if name in ("dp_mode", "schedule"):
            return v
        if not v.isdigit():
            raise ValueError(f"--{name.replace('_', '-')} {text!r}: use integers, e.g. 1,2")
        return int(v)

    return [one(v) for v in text.split(",") if v.strip()]


def _tune(args: argparse.Namespace) -> int:
    from rich.console import Console

    from . import tune as t
    from .tune.report import plot, row, table, write_json

    names = ("dp", "tp", "pp", "sp", "checkpoint", "microbatches", "batch", "dp_mode", "kernels", "compile",
             "schedule")
    knobs = {n: _knob_values(n, getattr(args, n)) for n in names if getattr(args, n) is not None}
    fixed: dict[str, Any] = {"seq": args.seq, "steps": args.steps, "warmup": args.warmup}
    fixed.update({k: getattr(args, k) for k in ("lr", "seed") if getattr(args, k) is not None})
    space = t.space_for(args.model, args.world_size, fixed=fixed, **knobs)
    points = space.valid()
    name = args.strategy
    if name == "auto":
        name = "grid" if len(points) <= args.grid_max else "auto"
    strategy = t.strategy(name, seed=args.seed or 0)
    faults = {}
    for spec in args.fault:
        match, _, fault = spec.partition("@")
        wanted = dict(kv.split("=", 1) for kv in match.split(",") if kv)
        for c in points:
            if all(_show_value(c.get(k.replace("-", "_"))) == _show_value(_knob_values(k.replace("-", "_"), v)[0])
                   for k, v in wanted.items()):
                faults[c] = fault
    budget = _size(args.memory_budget) if args.memory_budget else None
    out = Path(args.out)
    console = Console(stderr=False, highlight=False)
    console.print(f"slapo-fn tune: {args.model} on {args.world_size} rank(s); {space.size} points, {len(points)} "
                  f"valid; strategy {strategy.name}; memory budget "
                  f"{'none' if budget is None else f'{budget / 2**20:,.0f} MiB'}; results in {out}")

    varying = [k.name for k in space.knobs if len(k.values()) > 1]

    def progress(trial: Any, done: int, total: int) -> None:
        console.print(row(trial, done, total, varying), soft_wrap=True)

    result = t.tune(space, strategy=strategy, memory_budget=budget, max_trials=args.trials, patience=args.patience,
                    time_budget=args.time_budget, trial_timeout=args.trial_timeout, folder=out / "trials",
                    faults=faults, on_trial=progress)
    write_json(result, out / "trials.json")
    console.print(table(result))
    if not args.no_plot:
        try:
            console.print(f"plot: {plot(result, out / 'throughput.png')}")
        except ImportError:
            console.print("plot: skipped (matplotlib is not installed: pip install 'slapo_fn[tune]')")
    console.print(f"tuner overhead {result.overhead_s:.1f} s of {result.elapsed_s:.1f} s; "
                  f"trials: {out / 'trials.json'}")
    if result.best is None:
        console.print("no trial succeeded")
        return 1
    console.print(f"best: {result.best.tokens_per_s:,.0f} tokens/s with {result.best.config}")
    console.print(f"reproduce: {result.best_command}", soft_wrap=True)
    return 0


def _show_value(value: Any) -> str:
    return "none" if value is None else str(value).lower()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``slapo-fn`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(argv)
    except CommandLineError as e:  # a --config file that does not fit
        _refuse(argv[0] if argv else "", e)
        return 2
    try:
        if args.command == "tune":
            return _tune(args)
        if args.command == "export":
            return _export(args)
        if args.command == "prepare":
            return _prepare(args)
        problems = _argument_problems(args)
        if problems:
            raise CommandLineError(args.command, problems)
        if not _in_worker():
            _check_inputs(args)  # bad input is refused here, once, before any process starts
        if args.command == "explain":
            return _explain(args)
        if _axes(args) and not _in_worker():  # several ranks, or a data-parallel job of one
            return _launch(args, argv)
        if args.command == "train":
            return _train(args)
        return _verify(args)
    except (ValueError, KeyError) as e:  # bad input (typed slapo_fn errors included): the message, no traceback
        _refuse(args.command, e)
        return 2


def _worker_exit(code: int) -> None:
    """Leave a torchrun worker once its work is done and its process group torn down,
    skipping interpreter shutdown: there, C++ destructors of the collective backend's
    threads race and now and then abort the process ("terminate called without an active
    exception"), turning a finished job into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if _in_worker():
        _worker_exit(code)
    raise SystemExit(code)
