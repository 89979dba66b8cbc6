"""One rank of ``slapo-fn train`` or ``verify``: its process group, mesh and device, the
model its options build (:mod:`slapo_fn.job`), then the work.

* :func:`train`: the schedule, the data, the model built or pipelined (a Hugging Face
  folder's weights read into this rank's shards, or a checkpoint resumed), the
  optimizer and loggers, then :func:`slapo_fn.train.train`; at the end the model is
  exported where ``--export-to`` asks.
* :func:`verify`: the recipe against the unscheduled model (forward and every gradient),
  a per-module report on rank 0.

The launcher (:mod:`slapo_fn.launch`) starts these processes and the command line
(:mod:`slapo_fn.cli`) calls the function of its command in each; a single-process run
calls it in the command's own process.

A rank of a launch writes its output to ``rank-<rank>.log`` in the run folder (rank 0's
loss lines and progress bar still reach the console), and a rank that fails leaves one
line there for the launcher: the first line of its error. A collective that waits longer
than ``--collective-timeout`` fails; the ranks that waited then find out through the
process group's store (PyTorch's c10d store, hosted by torchrun's agent, which outlives
any rank) which ranks did not arrive, and the lowest of them that did says which.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import hf, job
from . import train as loop
from .build import build
from .checkpoint_dir import free_bytes
from .data.loading import packs_apart
from .errors import CommandLineError, Problem
from .explain import model_flops
from .hardware import PROFILES, load_profile
from .inputs import resume_problems, resumed_options
from .loggers import WandbLog
from .options import Fault, parse_faults, world
from .pipelines import build_pipeline
from .presets import PRESETS, WEIGHT_FILES, tokenizer_of, weights_of
from .processes import RUN_DIR_ENV, rank_log, record_failure, record_pid
from .state import CheckpointSpaceError, CheckpointWriteError
from .verify import VerificationError
from .verify import verify as verify_schedule
from .weights import load_hf, save_hf

__all__ = ["setup", "teardown", "train", "verify"]

Options = job.Options
#: Seconds the ranks that reached a failed collective wait for the others to say so.
ARRIVAL_GRACE_S = 3.0
#: Failures said in their own words, without a traceback (a single process).
_EXPECTED = (FloatingPointError, CheckpointSpaceError, CheckpointWriteError)
#: Warnings of PyTorch that are harmless in what a rank of slapo-fn does, by message:
#: FSDP2 warns that a root module returned a view (an in-place op on it would skip an
#: all-gather; the loop applies none), DTensor that a packed (``_StridedShard``) tensor
#: is gathered in several steps (checkpoints gather packed tensors so, once), and the
#: profiler that each ``--profile-every`` trace holds its own step only (as asked).
HARMLESS_WARNINGS = (r"FSDP2-wrapped module \(.*\) returned a view tensor",
                     r"Warning: Profiler clears events at the end of each cycle")
HARMLESS_LOGS = {"torch.distributed.tensor._redistribute": "_StridedShard"}


def setup(options: Options) -> tuple[torch.device, DeviceMesh | None]:
    """Process group (if several ranks), device and mesh of this rank; its PID is left
    in the run folder for the launcher."""
    rank_count = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        record_pid(Path(run_dir), int(os.environ.get("RANK", "0")))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    ranks = world(dp=options.dp, tp=options.tp, pp=options.pp, cp=getattr(options, "cp", 1))
    if rank_count != ranks:
        raise CommandLineError(options.command, [Problem(
            "--dp/--tp/--pp", f"{rank_count} processes started for dp*tp*pp = {ranks} ranks",
            f"start {ranks} processes, or let slapo-fn start them (run it without torchrun)")])
    named = job.mesh_axes(options)
    if not named:  # one process, no data-parallel job of one: no process group
        return device, None
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=options.collective_timeout))
    mesh = init_device_mesh(device.type, tuple(s for _, s in named), mesh_dim_names=tuple(n for n, _ in named))
    return device, mesh


def teardown() -> None:
    """Wait for every rank, then leave the process group."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train(options: Options) -> int:
    """One rank of ``slapo-fn train``: the schedule, the model, the data, then
    :func:`slapo_fn.train.train`. Returns the exit code."""
    return _as_rank(_train, options)


def verify(options: Options) -> int:
    """One rank of ``slapo-fn verify``: the recipe's schedule against the unscheduled
    model on the same random batch; the report (or the failure) on rank 0. Returns the
    exit code: 1 where they differ."""
    return _as_rank(_verify, options)


def _as_rank(work: Callable[[Options, IO[str]], int], options: Options) -> int:
    """``work(options, console)`` as one rank: its output to its log file where a launch
    started it, a failure said in one line (refusals of bad input are the command line's
    to say: they pass through). Returns the exit code."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    rank = int(os.environ.get("RANK", "0"))
    console = _output_to_log(rank_log(Path(run_dir), rank), keep_stdout=rank == 0) if run_dir else sys.stderr
    _quiet_harmless()
    try:
        return work(options, console)
    except (ValueError, KeyError):
        raise
    except Exception as e:
        line, first = _said(e, options)
        if run_dir:
            traceback.print_exc()  # into the log
            record_failure(Path(run_dir), rank, line, lost_peer=dist.is_initialized() and _collective(e))
            if not first:
                time.sleep(ARRIVAL_GRACE_S)  # the rank that says who did not arrive exits first
        else:
            if not isinstance(e, _EXPECTED):
                traceback.print_exc()
            print(f"slapo-fn {options.command}: {line}", file=sys.stderr, flush=True)
        return 1


def _quiet_harmless() -> None:
    """Keep :data:`HARMLESS_WARNINGS` and :data:`HARMLESS_LOGS` out of this rank's output."""
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for name, needle in HARMLESS_LOGS.items():
        logging.getLogger(name).addFilter(_Without(needle))


class _Without(logging.Filter):
    """Drops the log records whose message holds ``needle``."""

    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle

    def filter(self, record: logging.LogRecord) -> bool:
        return self.needle not in record.getMessage()


def _output_to_log(log: Path, *, keep_stdout: bool) -> IO[str]:
    """Send this process's stderr (and stdout unless ``keep_stdout``) to ``log``, from the
    file descriptors down (C++ warnings included); returns a stream to the console's
    stderr, for a progress bar."""
    console = os.fdopen(os.dup(2), "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    if not keep_stdout:
        os.dup2(fd, 1)
    os.close(fd)
    return console


#: What a backend's error says where a collective timed out or its peer went away (gloo
#: closes the pair's socket, or the peer's kernel resets it; writing to it breaks the pipe).
LOST_PEER = ("Timed out", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _collective(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed: timed out, or lost a peer.

    >>> _collective(RuntimeError("[pair.cc:598] Read error [127.0.0.1]:41012: Connection reset by peer"))
    True
    >>> _collective(ValueError("bad batch"))
    False
    """
    return isinstance(e, dist.DistError) or any(s in str(e) for s in LOST_PEER)


def _said(e: BaseException, options: Options) -> tuple[str, bool]:
    """The one line that says why this rank failed — a collective's missing ranks where
    it failed waiting for them, else the first line of the error — and whether this rank
    is the one to say it first (the lowest rank that reached the collective)."""
    if dist.is_initialized() and _collective(e):
        missing, arrived = _arrivals(ARRIVAL_GRACE_S)
        if missing:
            who = ", ".join(map(str, missing))
            return (f"rank{'s' if len(missing) > 1 else ''} {who} did not arrive at a collective within "
                    f"{options.collective_timeout:g} s (--collective-timeout): stopped, hung or gone",
                    dist.get_rank() == min(arrived))
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    first = text.strip().splitlines()[0][:300] if text.strip() else ""
    return (f"{type(e).__name__}: {first}" if not isinstance(e, _EXPECTED) else first), True


def _arrivals(grace: float) -> tuple[list[int], list[int]]:
    """The ranks that have not reached a failed collective, and those that have: each
    rank that did says so in the process group's store, and waits up to ``grace``
    seconds for the others."""
    store = c10d._get_default_store()
    world, rank = dist.get_world_size(), dist.get_rank()
    key = "slapo_fn/arrived/{}".format
    store.set(key(rank), "1")
    deadline = time.monotonic() + grace
    while True:
        missing = [r for r in range(world) if not store.check([key(r)])]
        if not missing or time.monotonic() >= deadline:
            return missing, [r for r in range(world) if r not in missing]
        time.sleep(0.1)


def _train(options: Options, console: IO[str]) -> int:
    faults = parse_faults(options.fault)
    device, mesh = setup(options)
    rank = int(os.environ.get("RANK", "0"))
    sch = job.schedule_for(options, mesh, meta=True)
    data, tokens = job.run_data(options, sch.module)
    if tokens is not None and rank == 0:
        print(f"data: {getattr(data, 'data', data)}", flush=True)
    sch, autocast = loop.precision(sch, options.dtype)
    seq2seq = loop.Seq2Seq.of(sch.module)  # an encoder-decoder: the decoder reads the labels shifted right
    weights = weights_of(options.model)
    # a resumed run loads its checkpoint instead of the folder's weights
    init: Literal["empty", "full"] = "empty" if weights is not None and not options.resume else "full"
    if options.pp > 1:
        micro = options.microbatches or 2 * options.pp
        # under cp the loop hands each rank its chunks, with the targets shifted before the cut
        loss_fn = (seq2seq.loss if seq2seq is not None
                   else loop.next_token_loss if getattr(options, "cp", 1) > 1 else loop.causal_lm_loss)
        model: Any = build_pipeline(sch, microbatches=micro, schedule=options.schedule, loss_fn=loss_fn,
                                    init=init, seed=options.seed, device=device)
    else:
        model = build(sch, init=init, seed=options.seed, device=device)
    if packs_apart(data) and isinstance(model, torch.nn.Module):  # examples apart by position ids: no
        # cache, which would turn the reading of packed position ids off
        hf.train_without_cache(model)
    if init == "empty":
        load_hf(model, Path(options.model))
        if rank == 0:
            print(f"loaded weights from {options.model}", flush=True)
    elif not options.resume and rank == 0:
        _say_random_init(options)
    optimizer = loop.adamw(model, lr=options.lr, weight_decay=options.weight_decay, impl=options.optimizer_impl)
    torch.manual_seed(options.seed)  # dropout and other random ops of the steps, the same on every rank
    start = 0
    if options.resume:
        start = _resume(options, model, optimizer, data)
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    console_log = loop.ConsoleLog(every=options.log_every, start=start, total=options.steps,
                                  progress=not options.no_progress, bar_to=console) if rank == 0 else None
    loggers: list[Any] = []
    if rank == 0:
        loggers.append(console_log)
        if options.metrics:
            loggers.append(loop.JsonlLog(options.metrics))
        if options.tensorboard:
            loggers.append(loop.TensorBoardLog(options.tensorboard))
    if options.wandb and rank == 0:
        loggers.append(WandbLog(options.wandb, options.wandb_dir, mode=options.wandb_mode,
                                config={k: v for k, v in vars(options).items() if isinstance(v, str | int | float)}))
    injected = _Injected(faults)
    flops, peak = _flops(options, sch, device)
    probes = _Probes(options, rank, device)

    def on_step(step: int) -> None:
        injected.step(step)
        probes.step(step)

    try:
        probes.start()
        loop.train(model, optimizer, data, steps=options.steps, batch_size=options.batch, mesh=mesh, start_step=start,
                   dp_axis=job.data_axes(options),
                   lr_schedule=injected.lr(loop.LRSchedule(options.lr, warmup=options.warmup, decay=options.decay,
                                                           min_lr=options.min_lr, total=options.steps)),
                   grad_clip=options.grad_clip, grad_accum=options.grad_accum, autocast=autocast,
                   eval_every=options.eval_every, eval_batches=options.eval_batches,
                   checkpoint=loop.Checkpointing(options.checkpoint_dir, every=options.save_every, keep=options.keep,
                                                 free_space=injected.free_space,
                                                 meta={"options": resumed_options(options)})
                   if options.checkpoint_dir else None,
                   log=loggers, memory=bool(options.metrics or options.tensorboard), on_step=on_step,
                   nonfinite=options.nonfinite, max_skipped=options.max_skipped, say=_say, flops=flops,
                   peak_flops=peak, seq2seq=seq2seq)
        if console_log is not None:
            console_log.finish()
    finally:
        probes.stop()
        for logger in loggers:
            logger.close()
    if options.export_to:
        tokenizer = tokens.tokenizer if tokens is not None and tokens.tokenizer is not None \
            else tokenizer_of(options.model)
        save_hf(model, options.export_to, tokenizer=tokenizer)
        if rank == 0:
            print(f"exported to {options.export_to}", flush=True)
    teardown()
    return 0


def _flops(options: Options, sch: Any, device: torch.device) -> tuple[float, float | None]:
    """FLOPs of one step on one rank (``explain``'s count for the global batch, over the
    ranks) and one rank's peak FLOP/s at the run's dtype (``--hardware``; ``auto``: the
    GPU's profile by its name, the CPU's without one; ``None`` for a GPU without one)."""
    total, _recompute = model_flops(sch, tokens=options.batch * options.seq, seq=options.seq)
    ranks = world(dp=options.dp, tp=options.tp, pp=options.pp, cp=getattr(options, "cp", 1))
    name = options.hardware
    if name == "auto":
        gpu = torch.cuda.get_device_name(device).lower() if device.type == "cuda" else ""
        name = "cpu" if not gpu else next((p for p in PROFILES if p != "cpu" and p in gpu), "")
    return total / ranks, load_profile(name).peak(options.dtype) if name else None


def _say(text: str) -> None:
    print(f"slapo-fn train: {text}", flush=True)


def _resume(options: Options, model: Any, optimizer: torch.optim.Optimizer, data: object) -> int:
    """The step the newest checkpoint that verifies continues at, its state loaded."""
    start = loop.resume(model, optimizer, options.checkpoint_dir, data=data, say=_say)
    if start >= options.steps:  # checked before the launch; here for a job started by torchrun itself
        raise CommandLineError(options.command, resume_problems(options))
    if isinstance(data, job.Positioned) and data.resumed_at not in (None, start):
        raise CommandLineError(options.command, [Problem(
            "--batch", f"the checkpoint at step {start} has consumed {data.resumed_at} batches of --batch "
                       f"{options.batch}", "resume with the saved run's --batch")])
    return start


def _say_random_init(options: Options) -> None:
    """One line where a Hugging Face folder has a config but no weights: it trains from random ones."""
    if Path(options.model, "config.json").is_file() and options.model not in PRESETS:
        print(f"slapo-fn {options.command}: {options.model} has config.json but no weights "
              f"({' or '.join(WEIGHT_FILES)}): training from random initialization (seed {options.seed})", flush=True)


class _Probes:
    """``--profile-every N``: a ``torch.profiler`` trace of every Nth step, one Chrome
    trace file per rank and step (Perfetto opens it); ``--memory-snapshot``: the CUDA
    allocator's history recorded from the start and its snapshot dumped per rank when the
    run ends, however it ends (out of memory included). Both write to ``--profile-dir``."""

    def __init__(self, options: Options, rank: int, device: torch.device) -> None:
        self.folder, self.rank, self.done = Path(options.profile_dir), rank, 0
        self.snapshot = bool(options.memory_snapshot) and device.type == "cuda"
        if options.memory_snapshot and device.type != "cuda" and rank == 0:
            print("slapo-fn train: --memory-snapshot is CUDA-only (the CUDA caching allocator's history): no snapshot "
                  "on CPU", flush=True)
        self.profiler: torch.profiler.profile | None = None
        every = int(options.profile_every)
        if every:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            warmup = 1 if every > 1 else 0
            self.profiler = torch.profiler.profile(
                activities=activities, on_trace_ready=self._export, record_shapes=False,
                schedule=torch.profiler.schedule(wait=every - 1 - warmup, warmup=warmup, active=1))

    def start(self) -> None:
        if self.profiler is not None or self.snapshot:
            self.folder.mkdir(parents=True, exist_ok=True)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        if self.profiler is not None:
            self.profiler.start()

    def step(self, step: int) -> None:
        self.done = step
        if self.profiler is not None:
            self.profiler.step()

    def stop(self) -> None:
        if self.profiler is not None:
            self.done += 1  # a trace stopped short is the step under way: the one that failed
            self.profiler.stop()
            self.profiler = None
        if self.snapshot:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"memory-rank-{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = False

    def _export(self, profiler: torch.profiler.profile) -> None:
        profiler.export_chrome_trace(str(self.folder / f"rank-{self.rank}-step-{self.done}.json"))


class _Injected:
    """``--fault``: the failures a test asks for, at their steps. ``exit`` and ``hang`` act
    on the last rank after the step; ``nan`` turns the learning rate of the step and those
    after it to NaN; ``full-disk`` has every save after the step find no free space."""

    def __init__(self, faults: tuple[Fault, ...]) -> None:
        self.faults, self.done = {f.kind: f.step for f in faults}, 0

    def step(self, step: int) -> None:
        self.done = step
        rank = int(os.environ.get("RANK", "0"))
        kind = next((k for k in ("exit", "hang") if self.faults.get(k) == step), None)
        if kind is None or rank != int(os.environ.get("WORLD_SIZE", "1")) - 1:
            return
        print(f"slapo-fn: injected fault {kind!r} on rank {rank}", file=sys.stderr, flush=True)
        if kind == "exit":
            os._exit(3)
        while True:  # hang: the others wait on the next collective until they time out or are killed
            time.sleep(3600)

    def lr(self, schedule: Callable[[int], float]) -> Callable[[int], float]:
        bad = self.faults.get("nan")
        if bad is None:
            return schedule
        return lambda step: math.nan if step + 1 >= bad else schedule(step)

    def free_space(self, path: Path) -> int:
        full = self.faults.get("full-disk")
        return 0 if full is not None and self.done >= full else free_bytes(path)


def _verify(options: Options, console: IO[str]) -> int:
    _device, mesh = setup(options)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)  # the model's random initialisation
    sch = job.schedule_for(options, mesh, meta=False)  # a Hugging Face folder's weights where it has some
    if rank == 0 and weights_of(options.model) is not None:
        print(f"loaded weights from {options.model}", flush=True)
    vocab = hf.vocab_size(sch.module)
    ids = torch.randint(0, vocab, (options.batch, options.seq), generator=torch.Generator().manual_seed(0))
    seq2seq = loop.Seq2Seq.of(sch.module)  # an encoder-decoder's decoder reads the tokens shifted right
    kwargs = {} if seq2seq is None else {"decoder_input_ids": seq2seq.inputs({"labels": ids})["decoder_input_ids"]}
    code = 0
    try:
        report = verify_schedule(sch, ids, rtol=options.rtol, atol=options.atol, kwargs=kwargs)
    except VerificationError as e:
        if rank == 0:
            print(f"FAILED: {e}", flush=True)
        code = 1
    else:
        if rank == 0:
            print(_report(report), flush=True)
    teardown()
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
