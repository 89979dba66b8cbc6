"""The ``slapo-fn`` command: ``train``, ``prepare``, ``export``, ``explain``, ``verify``, ``tune``.

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

This module only turns arguments into calls. Each command is a :class:`Command` of
:data:`COMMANDS`: its flags and the function that runs it. Bad input gets one answer,
before any work starts: the arguments are checked here first (sizes, an even split of
the batch, files), then :func:`slapo_fn.job.check_inputs` checks the model's config, the
data, the checkpoint to resume and — for a job on several processes — the whole
schedule, built on the meta device over a fake process group. Each refusal is a
:class:`~slapo_fn.errors.CommandLineError` (or another typed ``ValueError``/``KeyError``
of slapo_fn) printed once, in a few lines, without a traceback, with exit code 2.

A job on several processes is started by :func:`slapo_fn.launch.run`, which re-runs this
command in each rank (:func:`slapo_fn.processes.in_worker`); a rank runs
:mod:`slapo_fn.worker`. Whatever way the run ends no worker is left running, and a
failure is said once (see :mod:`slapo_fn.launch`).

torch and the rest of the package are imported inside the commands, on use: ``--help``
and bad arguments are answered before torch loads.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CommandLineError, Problem, ScheduleError
from .options import EVAL_FRACTION, FAULTS, Split, is_stdlib, parse_faults, parse_size, stdlib_bytes, world
from .processes import RUN_DIR_ENV, in_worker, record_error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["COMMANDS", "Command", "CommandLineError", "main"]

#: Learning-rate decays of ``--decay`` (``slapo_fn.train.DECAYS``, named here without importing torch).
DECAYS = ("cosine", "linear", "constant")
#: AdamW implementations of ``--optimizer-impl`` (``slapo_fn.train.adamw``'s ``impl``).
OPTIMIZER_IMPLS = ("auto", "foreach", "fused", "for-loop")
#: The most lines a refusal takes; a longer one is cut, saying how many lines are left out.
MAX_MESSAGE_LINES = 10


# -- arguments --------------------------------------------------------------------------
def _parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-tiny",
                   help="a preset (see slapo_fn.presets), a config.json path, or a Hugging Face folder (its "
                        "weights, model.safetensors or a sharded index, are loaded where present)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (mesh axis 'dp')")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (mesh axis 'tp')")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages, one per rank (mesh axis 'pp')")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel degree (mesh axis 'cp'): each sequence split over --cp ranks, keys and "
                        "values all-gathered in attention")
    p.add_argument("--dp-mode", choices=("fsdp", "ddp", "hsdp"), default=None,
                   help="data parallelism over --dp: FSDP2 (parameters sharded over the --dp ranks; the default "
                        "with --dp > 1), DDP (replicated), or HSDP (sharded over --dp-shard ranks, replicated over "
                        "--dp / --dp-shard); given with --dp 1, one rank runs the data-parallel job of one (a "
                        "process group and a one-rank mesh)")
    p.add_argument("--dp-shard", type=int, default=None, metavar="N",
                   help="with --dp-mode hsdp: the ranks each replica shards the parameters over (a divisor of --dp)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    p.add_argument("--checkpoint", type=float, default=None, metavar="RATIO",
                   help="activation checkpointing of the first RATIO of the layers (1.0 = all)")
    p.add_argument("--kernels", action="store_true", help="the family's fused kernels")
    p.add_argument("--compile", action="store_true", help="torch.compile every layer")
    p.add_argument("--float8", action="store_true",
                   help="the layers' linears in float8 (torchao's Float8Linear, as torchtitan): needs torchao and a "
                        "CUDA GPU of compute capability 8.9+ (Ada, Hopper), refused before any rank starts elsewhere")
    p.add_argument("--async-tp", action="store_true",
                   help="async tensor parallelism (inductor's micro-pipelined all-gather/reduce-scatter matmuls, as "
                        "torchtitan): with --tp > 1, --sp and --compile, on CUDA GPUs")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches (default: 2 x pp)")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, interleaved, zero-bubble, zbv")


# -- the commands -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Command:
    """A command of ``slapo-fn``: its name and one-line help, the function that adds its
    flags to its parser, and the function that runs it on the parsed flags and the
    command line (``argv``, which a launch hands to every rank); it returns the exit code."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Sequence[str]], int]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``slapo-fn`` parser and its commands' parsers, by name."""
    parser = argparse.ArgumentParser(prog="slapo-fn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.arguments(sub.add_parser(command.name, help=command.help, description=command.help,
                                         formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    return parser, dict(sub.choices)


def _train_args(train: argparse.ArgumentParser) -> None:
    train.add_argument("--config", default=None, metavar="FILE.toml",
                       help="a TOML file whose keys are these flags' names (e.g. lr = 3e-4, grad-accum = 2; in "
                            "[sections] or not); flags given on the command line override it")
    _parallel_args(train)
    train.add_argument("--steps", type=int, default=40, help="the step to train up to (a resumed run's total)")
    train.add_argument("--batch", type=int, default=8, help="global batch (sequences per optimizer step, over "
                                                            "data-parallel ranks and --grad-accum micro-steps)")
    train.add_argument("--seq", type=int, default=64, help="sequence length")
    train.add_argument("--seed", type=int, default=0,
                       help="random initialisation, dropout and the order of --data's rows")
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
    loop.add_argument("--nonfinite", choices=("stop", "skip"), default="stop",
                      help="a step whose loss, grad norm or learning rate is not finite: stop the run before its "
                           "update, or skip the step")
    loop.add_argument("--max-skipped", type=int, default=10, metavar="N",
                      help="with --nonfinite skip: stop after more than N skipped steps")
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
    data.add_argument("--tokenizer", default=None, metavar="FOLDER|bytes",
                      help="a tokenizer folder (AutoTokenizer), or 'bytes' (UTF-8 bytes + EOS: 257 symbols); "
                           "default: the --model folder's tokenizer if it has one")
    data.add_argument("--eval-fraction", type=float, default=EVAL_FRACTION, metavar="F",
                      help="the share of --data's rows held out for --eval-every, the same with --eval-every or "
                           "without (the rows a run trains on do not depend on whether it evaluates)")
    data.add_argument("--text-field", default="text", metavar="NAME",
                      help="the field of JSON rows (and the column of parquet files and saved datasets) that holds "
                           "the text")
    train.add_argument("--export-to", default=None, metavar="FOLDER",
                       help="at the end, write the trained model (and the tokenizer) as a Hugging Face folder")
    train.add_argument("--checkpoint-dir", default=None,
                       help="where distributed checkpoints go (one run at a time: the run holds a lock on it)")
    train.add_argument("--save-every", type=int, default=0, help="save every N steps (and at the end)")
    train.add_argument("--keep", type=int, default=2, metavar="N",
                       help="checkpoints to keep (the newest; when the disk is short, older ones go first)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint that verifies (its files against their digests)")
    train.add_argument("--log-every", type=int, default=5, metavar="N", help="a loss line every N steps")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--run-dir", default=None,
                       help="where worker PIDs and each rank's output (rank-N.log) go (default: a temporary folder, "
                            "kept when the job fails)")
    train.add_argument("--collective-timeout", type=float, default=300.0, metavar="S",
                       help="a collective waiting longer for a rank fails the job, naming the rank that did not "
                            "arrive")
    train.add_argument("--metrics", default=None, help="write per-step figures as JSON lines to this file "
                       "(with the peak memory of the most loaded rank)")
    train.add_argument("--fault", default=None, metavar="KIND:STEP",
                       help="inject failures (tests of failure handling), several separated by commas: 'exit:3' "
                            "the last rank exits non-zero after step 3, 'hang:3' it stops answering, 'nan:3' the "
                            "learning rate turns NaN from step 3, 'full-disk:3' saves after step 3 find no room")
    train.add_argument("--wandb", default=None, metavar="PROJECT",
                       help="log each step to a Weights & Biases run of PROJECT, written under --wandb-dir; needs "
                            "the wandb package (pip install 'slapo_fn[wandb]')")
    train.add_argument("--wandb-dir", default=".", metavar="DIR", help="where --wandb writes its runs")
    train.add_argument("--wandb-mode", choices=("offline", "online"), default="offline",
                       help="offline: no network, upload later with `wandb sync`; online: stream to the service")
    debug = train.add_argument_group("debugging")
    debug.add_argument("--profile-every", type=int, default=0, metavar="N",
                       help="a torch.profiler trace of every Nth step, one file per rank "
                            "(--profile-dir/rank-R-step-S.json, opens in Perfetto or chrome://tracing); 0: none")
    debug.add_argument("--memory-snapshot", action="store_true",
                       help="record the CUDA allocator's history and dump its snapshot per rank at the end, or on "
                            "running out of memory, into --profile-dir (open it at pytorch.org/memory_viz); "
                            "CUDA only")
    debug.add_argument("--profile-dir", default="profile-traces", metavar="DIR",
                       help="where --profile-every and --memory-snapshot write")
    train.add_argument("--hardware", default="auto", metavar="NAME|FILE.toml",
                       help="hardware profile of the MFU in the logs: auto (the GPU's by its name, or cpu), h100, "
                            "h200, a100, cpu, or a TOML file")
    train.add_argument("--tensorboard", default=None, metavar="DIR",
                       help="TensorBoard scalars (loss, lr, grad norm, tokens/s, peak memory) in DIR; needs the "
                            "tensorboard package (pip install 'slapo_fn[tensorboard]')")
    nodes = train.add_argument_group("several nodes", "run the same command on every node, each with its "
                                                      "--node-rank; torchrun's static rendezvous at node 0")
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes of the job (dp*tp*pp ranks split evenly)")
    nodes.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0 .. --nnodes - 1")
    nodes.add_argument("--master-addr", default=None, metavar="HOST", help="address of node 0 (with --nnodes > 1)")
    nodes.add_argument("--master-port", type=int, default=29500, metavar="PORT", help="a free port on node 0")


def _explain_args(explain: argparse.ArgumentParser) -> None:
    _parallel_args(explain)
    explain.add_argument("--tree", action="store_true", help="print the whole (folded) module tree too")
    explain.add_argument("--json", action="store_true", help="print everything as one JSON object (for scripts)")
    explain.add_argument("--batch", type=int, default=None,
                         help="global batch, for the bytes of each collective (default: 8, or the smallest batch "
                              "above that splits over --dp and the pipeline's microbatches)")
    explain.add_argument("--seq", type=int, default=None, help="sequence length, for the bytes of each collective "
                         "(default: 2048, or the model's positions where fewer)")
    explain.add_argument("--hardware", default="h100", metavar="NAME|FILE.toml",
                         help="hardware profile of the step-time estimate: h100, h200, a100, cpu, or a TOML file "
                              "(see slapo_fn/hardware/h100.toml); 'none' for no estimate")
    explain.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                         help="compute dtype of the estimate, as train's --dtype (default: the config's dtype where "
                              "it is bf16, else fp32)")


def _verify_args(verify: argparse.ArgumentParser) -> None:
    _parallel_args(verify)
    verify.add_argument("--seq", type=int, default=16, help="sequence length of the random batch compared")
    verify.add_argument("--batch", type=int, default=2, help="sequences of the random batch compared")
    verify.add_argument("--rtol", type=float, default=None,
                        help="relative to each tensor's largest value (default: by dtype, 1e-5 for float32)")
    verify.add_argument("--atol", type=float, default=None, help="absolute (default: by dtype, 1e-5 for float32)")
    verify.add_argument("--run-dir", default=None,
                        help="where worker PIDs and each rank's output go (default: a temporary folder)")
    verify.add_argument("--collective-timeout", type=float, default=300.0, metavar="S",
                        help="a collective waiting longer for a rank fails the job")


def _export_args(export: argparse.ArgumentParser) -> None:
    export.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="a --checkpoint-dir of slapo-fn train")
    export.add_argument("out", metavar="OUT_FOLDER", help="the Hugging Face folder to write")
    export.add_argument("--model", required=True,
                        help="the model the checkpoint was trained as (a preset, config.json or folder)")
    export.add_argument("--tokenizer", default=None, metavar="FOLDER",
                        help="tokenizer files to write beside the weights (default: the --model folder's, if any)")


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
    p.add_argument("--lr", type=float, default=None, help="every trial's --lr (default: train's)")
    p.add_argument("--seed", type=int, default=None, help="every trial's --seed, and the search's (default: 0)")
    p.add_argument("--strategy", choices=("auto", "grid", "random", "tpe"), default="auto",
                   help="auto: grid for spaces of at most --grid-max candidates, else TPE (optuna) or random")
    p.add_argument("--grid-max", type=int, default=16, metavar="N",
                   help="the most candidates --strategy auto searches by grid")
    p.add_argument("--trials", type=int, default=None, help="at most this many trials")
    p.add_argument("--patience", type=int, default=None, help="stop when the best has not improved for N trials")
    p.add_argument("--time-budget", type=float, default=None, metavar="S", help="start no trial after S seconds")
    p.add_argument("--trial-timeout", type=float, default=300.0, metavar="S", help="a trial running longer fails")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="per-rank memory for the training state, e.g. 80GiB or 300MiB: configs estimated above it "
                        "are pruned without running")
    p.add_argument("--out", default="tune-out", help="folder for trials.json, throughput.png and each trial's log")
    p.add_argument("--no-plot", action="store_true", help="no throughput.png")
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
    at_least("--cp", 1, "context-parallel ranks", "--cp 1 (no context parallelism) or more")
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
        at_least("--keep", 1, "checkpoints kept", "--keep 2")
        at_least("--max-skipped", 0, "non-finite steps skipped before the run stops", "--max-skipped 10")
        at_least("--profile-every", 0, "steps between profiler traces; 0: none", "--profile-every 10")
        at_least("--nnodes", 1, "nodes of the job", "--nnodes 1 (this machine only)")
        at_least("--node-rank", 0, "this node's rank", "--node-rank 0 on the first node, 1 on the next, ...")
        problems += _loop_problems(args)
    if args.command in ("train", "verify"):
        at_least("--collective-timeout", 1, "seconds a collective waits", "--collective-timeout 300")
    if args.command == "verify":
        at_least("--rtol", 0, "relative tolerance", "--rtol 1e-4")
        at_least("--atol", 0, "absolute tolerance", "--atol 1e-5")
        if args.pp > 1:
            problems.append(Problem("--pp", "verify compares tensor- and data-parallel schedules with the "
                                            "unscheduled model; it does not run pipelines",
                                    "drop --pp (pipelines are verified by their tests); use --tp/--dp"))
    if problems:  # the checks below divide by these sizes
        return problems
    problems += _context_problems(args)
    if getattr(args, "dp_mode", None) == "hsdp" and not (args.dp_shard and 1 < args.dp_shard < args.dp
                                                         and args.dp % args.dp_shard == 0):
        problems.append(Problem("--dp-shard", f"--dp-mode hsdp shards over --dp-shard ranks and replicates over the "
                                              f"rest of --dp {args.dp}: --dp-shard must divide it, above 1 and below "
                                              f"it, got {args.dp_shard}",
                                f"--dp-shard {next((d for d in range(2, args.dp) if args.dp % d == 0), 2)} (with "
                                "--dp 4 or more), or --dp-mode fsdp"))
    if args.command in ("train", "explain", "verify"):  # verify runs one batch whole on every rank
        whole = args.command == "verify"
        problems += Split(batch=args.batch, dp=1 if whole else args.dp, grad_accum=args.grad_accum if train else 1,
                          pp=1 if whole else args.pp, microbatches=args.microbatches, seq=args.seq, tp=args.tp,
                          sp=args.sp).problems()
    if getattr(args, "async_tp", False) and not (args.tp > 1 and args.sp and args.compile):
        missing = [f for f, on in (("--tp 2", args.tp > 1), ("--sp", args.sp), ("--compile", args.compile)) if not on]
        problems.append(Problem("--async-tp", "fuses the all-gathers and reduce-scatters of sequence parallelism "
                                              "with their matmuls in compiled layers: it needs --tp > 1, --sp and "
                                              "--compile", f"add {' '.join(missing)}, or drop --async-tp"))
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
    if args.wandb is not None and importlib.util.find_spec("wandb") is None:
        problems.append(Problem("--wandb", "needs the wandb package, which is not installed",
                                "pip install 'slapo_fn[wandb]' (or: pip install wandb), or leave out --wandb"))
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
        parse_faults(args.fault)
    except ValueError:
        problems.append(Problem("--fault", f"{args.fault!r} is not KIND:STEP (KIND {', '.join(FAULTS)}; STEP a "
                                           "step number)", "--fault exit:3 or --fault hang:3"))
    return problems



_DATA_FIX = ("a text file, a folder of them, a .jsonl file with a 'text' field, a `datasets` dataset saved with "
             "save_to_disk, or stdlib")



def _data_argument_problems(args: argparse.Namespace) -> list[Problem]:
    """``--data``, ``--tokenizer`` and the eval flags, without reading any data."""
    problems = []
    if is_stdlib(args.data):
        try:
            stdlib_bytes(args.data)
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
    elif fraction != EVAL_FRACTION and args.data is None:
        problems.append(Problem("--eval-fraction", "holds out rows of --data, and there is none",
                                "--data FILE --eval-fraction 0.05, or leave out --eval-fraction"))
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
    text = _say(command, error)
    rank = os.environ.get("RANK", "0")
    run_dir = os.environ.get(RUN_DIR_ENV) if in_worker() else None
    if run_dir and rank.isdigit():
        record_error(Path(run_dir), int(rank), text)
    elif not in_worker() or rank == "0":
        print(text, file=sys.stderr, flush=True)




# -- running the commands -------------------------------------------------------------------------
def _world(args: argparse.Namespace) -> int:
    return world(dp=args.dp, tp=args.tp, pp=args.pp, cp=getattr(args, "cp", 1))


def _context_problems(args: argparse.Namespace) -> list[Problem]:
    """What ``--cp`` does not compose with yet, and a ``--seq`` it cannot split into ``2·cp`` chunks."""
    cp = getattr(args, "cp", 1)
    if cp == 1:
        return []
    problems = [Problem(flag, f"--cp {cp} does not compose with {flag} yet", fix)
                for flag, given, fix in (("--dp-mode", getattr(args, "dp_mode", None) in ("ddp", "hsdp"),
                                          "--dp-mode fsdp (FSDP2 over dp x cp)"),
                                         ("--sp", args.sp, "drop --sp, or --cp")) if given]
    if args.seq is not None and args.seq % (2 * cp):
        problems.append(Problem("--seq", f"{args.seq} tokens do not split into {2 * cp} equal chunks (2 x --cp)",
                                f"--seq {max(2 * cp, args.seq - args.seq % (2 * cp))}"))
    return problems


def _checked(args: argparse.Namespace, *, inputs: bool = True) -> Any:
    """Refuse the arguments of a job's command once, before any work starts: their own
    problems, then (with ``inputs``, in the launcher, not in every rank again) what
    reading the model, data and checkpoints shows (:func:`slapo_fn.job.check_inputs`).
    Returns the model's config where it was read."""
    problems = _argument_problems(args)
    if problems:
        raise CommandLineError(args.command, problems)
    if in_worker() or not inputs:
        return None
    from .inputs import check_inputs

    config = check_inputs(args)  # the files first: fast, without the layout engine
    from .job import check_schedule

    check_schedule(args, config)
    return config


@contextlib.contextmanager
def _writer(args: argparse.Namespace) -> Iterator[None]:
    """Hold ``--checkpoint-dir``'s lock for the run (one writer per directory), in the
    launcher of node 0 (or the run's one process): a second run is refused, naming the
    holder; a dead holder's lock is taken over, and saves it left half-done are removed,
    each said in a line."""
    if args.checkpoint_dir is None or in_worker() or getattr(args, "node_rank", 0) != 0:
        yield
        return
    from .checkpoint_dir import partials
    from .lock import LockedError, acquire

    try:
        held = acquire(args.checkpoint_dir)
    except LockedError as e:
        raise CommandLineError(args.command, [Problem("--checkpoint-dir", f"{p.path}: {p.reason}", p.fix)
                                              for p in e.problems]) from None
    with held:
        if held.took_over is not None:
            print(f"slapo-fn {args.command}: took over the lock of {args.checkpoint_dir} from {held.took_over}, "
                  "which no longer runs", flush=True)
        left = partials(args.checkpoint_dir)
        for folder in left:
            shutil.rmtree(folder, ignore_errors=True)
        if left:
            print(f"slapo-fn {args.command}: removed what {len(left)} interrupted save(s) left in "
                  f"{args.checkpoint_dir}: {', '.join(f.name for f in left)}", flush=True)
        yield


def _on_ranks(args: argparse.Namespace, argv: Sequence[str], work: Callable[[argparse.Namespace], int]) -> int:
    """``work`` in this process, or on ``dp*tp*pp`` local processes started for it (this
    machine's share of them with ``--nnodes``), each of which runs ``work``."""
    if in_worker() or (_world(args) == 1 and getattr(args, "dp_mode", None) is None):
        return work(args)  # one process (a data-parallel job of one is launched: it needs a process group)
    from .launch import Nodes, run

    count = getattr(args, "nnodes", 1)
    nodes = Nodes(count, args.node_rank, args.master_addr or "127.0.0.1", args.master_port) if count > 1 else None
    return run(args.command, argv, _world(args) // count, getattr(args, "run_dir", None), nodes=nodes)


def _train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``slapo-fn train``: :func:`slapo_fn.worker.train` on every rank, the checkpoint
    directory locked for it."""
    _checked(args, inputs=False)
    with _writer(args):
        _checked(args)
        from . import worker

        return _on_ranks(args, argv, worker.train)


def _verify(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``slapo-fn verify``: :func:`slapo_fn.worker.verify` on every rank."""
    _checked(args)
    from . import worker

    return _on_ranks(args, argv, worker.verify)


def _explain(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``slapo-fn explain``: the schedule of the job the flags describe, built in this
    process on the meta device over a fake process group, explained."""
    if args.batch is None:  # the smallest batch of at least 8 that train would take
        args.batch = Split.default_batch(dp=max(args.dp, 1), pp=max(args.pp, 1), microbatches=args.microbatches)
    config = _checked(args)
    import torch
    import torch.distributed as dist

    from . import job
    from .dtensor.testing import fake_mesh
    from .explain import explain
    from .inputs import default_seq
    from .train import parse_dtype

    if args.seq is None:
        args.seq = default_seq(config)
    world = _world(args)
    mesh_axes = job.mesh_axes(args)
    mesh = None
    started = False
    if mesh_axes:
        started = not dist.is_initialized()
        mesh = fake_mesh(*(s for _, s in mesh_axes), names=tuple(n for n, _ in mesh_axes))
    try:
        sch = job.schedule_for(args, mesh, meta=True)
        shape = (args.batch // args.dp, args.seq)  # one data-parallel rank's batch: the bytes of its collectives
        micro = (args.microbatches or 2 * args.pp) if args.pp > 1 else 1
        hardware = None if args.hardware == "none" else args.hardware
        dtype, dtype_from = _explain_dtype(args, config)
        info = explain(sch, torch.zeros(shape, dtype=torch.long, device="meta"), microbatches=micro,
                       pipeline_schedule=args.schedule, hardware=hardware, dtype=parse_dtype(dtype))
        axes_text = " x ".join(f"{n}{s}" for n, s in mesh_axes)
        if args.json:
            import json

            print(json.dumps({"model": args.model, "mesh": dict(mesh_axes), "ranks": world,
                              "batch": args.batch, "seq": args.seq, "microbatches": micro, "dtype": dtype,
                              "hardware": args.hardware, "knobs": str(job.knobs(args)), **info.as_dict(),
                              "by_axis": info.by_axis()}))
            return 0
        print(f"{args.model}: {info.total_parameters:,} parameters; {axes_text or 'one process'} "
              f"({world} ranks); recipe knobs: {job.knobs(args)}")
        print(f"assumed: global batch {args.batch} × seq {args.seq} ({shape[0]} sequences per data-parallel rank"
              + (f", {micro} microbatches, {args.schedule}" if args.pp > 1 else "") + f"); compute dtype {dtype} "
              f"({dtype_from}); hardware {args.hardware}")
        text = str(info)
        if not args.tree:
            text = text.split("\n\n", 1)[-1]  # everything after the tree
        print(text)
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _explain_dtype(args: argparse.Namespace, config: Any) -> tuple[str, str]:
    """``explain``'s compute dtype and where it comes from: ``--dtype``, else the config's
    ``dtype`` (``torch_dtype``) where it is bf16, else fp32."""
    if args.dtype is not None:
        return args.dtype, "--dtype"
    named = str(getattr(config, "dtype", None) or "")  # transformers 5 reads an older torch_dtype into it
    if named.removeprefix("torch.") in ("bfloat16", "bf16"):
        return "bf16", "the config's dtype"
    return "fp32", "the default; --dtype bf16 for mixed precision"


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


def _export(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``slapo-fn export``: the newest loadable checkpoint under CHECKPOINT_DIR, whatever
    layout wrote it, loaded into one process's unsharded model (``sf.load``, no
    optimizer; DCP reshards) and written with ``sf.save_hf``."""
    problems = _export_problems(args)
    if problems:
        raise CommandLineError(args.command, problems)
    from . import build, create_schedule, load
    from .hf import recompute_buffers
    from .inputs import config
    from .presets import build_model, tokenizer_of
    from .weights import save_hf

    config(args.model, args.command)
    model = build(create_schedule(build_model(args.model, meta=True)), init="empty")
    step = load(model, None, args.checkpoint_dir)
    recompute_buffers(model)  # rotary inv_freq and other buffers a checkpoint does not hold
    tokenizer = args.tokenizer if args.tokenizer is not None else tokenizer_of(args.model)
    folder = save_hf(model, args.out, tokenizer=tokenizer)
    print(f"exported step {step} of {args.checkpoint_dir} to {folder}"
          + (f" (with the tokenizer of {tokenizer})" if tokenizer is not None else " (no tokenizer)"), flush=True)
    return 0


def _prepare(args: argparse.Namespace, argv: Sequence[str]) -> int:
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


def _tune(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from rich.console import Console

    from . import tune as t
    from .tune.report import plot, print_table, row, write_json

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
    budget = parse_size(args.memory_budget) if args.memory_budget else None
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
    print_table(console, result)
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




#: The commands of ``slapo-fn``, in the order ``--help`` lists them.
COMMANDS: tuple[Command, ...] = (
    Command("train", "train a model with a recipe on local processes (or several nodes)", _train_args, _train),
    Command("explain", "explain the schedule of a model and parallel config (no job)", _explain_args, _explain),
    Command("verify", "check a recipe against the unscheduled model", _verify_args, _verify),
    Command("tune", "search the recipe's knobs for the fastest config that fits", _tune_args, _tune),
    Command("prepare", "tokenize a corpus once into a memory-mapped folder that train --data reads (no job)",
            _prepare_args, _prepare),
    Command("export", "write a training checkpoint as a Hugging Face folder (no job)", _export_args, _export),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``slapo-fn`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(argv)
    except CommandLineError as e:  # a --config file that does not fit
        _refuse(argv[0] if argv else "", e)
        return 2
    command = next(c for c in COMMANDS if c.name == args.command)
    try:
        return command.run(args, argv)
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
    if in_worker():
        _worker_exit(code)
    raise SystemExit(code)
