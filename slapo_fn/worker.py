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
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import hf, job
from . import train as loop
from .build import build
from .errors import CommandLineError, Problem
from .options import Fault, axes, parse_fault
from .pipelines import build_pipeline
from .presets import PRESETS, WEIGHT_FILES, tokenizer_of, weights_of
from .processes import RUN_DIR_ENV, record_pid
from .verify import VerificationError
from .verify import verify as verify_schedule
from .weights import load_hf, save_hf

__all__ = ["PG_TIMEOUT_S", "setup", "teardown", "train", "verify"]

#: Seconds a collective waits for the other ranks before the process group fails it.
PG_TIMEOUT_S = 60

Options = job.Options


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
    if rank_count != job.world(options):
        raise CommandLineError(options.command, [Problem(
            "--dp/--tp/--pp", f"{rank_count} processes started for dp*tp*pp = {job.world(options)} ranks",
            f"start {job.world(options)} processes, or let slapo-fn start them (run it without torchrun)")])
    if rank_count == 1:
        return device, None
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    mesh_axes = axes(dp=options.dp, tp=options.tp, pp=options.pp)
    mesh = init_device_mesh(device.type, tuple(s for _, s in mesh_axes), mesh_dim_names=tuple(n for n, _ in mesh_axes))
    return device, mesh


def teardown() -> None:
    """Wait for every rank, then leave the process group."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train(options: Options) -> int:
    """One rank of ``slapo-fn train``: the schedule, the model, the data, then
    :func:`slapo_fn.train.train`. Returns the exit code."""
    fault = parse_fault(options.fault)
    device, mesh = setup(options)
    rank = int(os.environ.get("RANK", "0"))
    sch = job.schedule_for(options, mesh, meta=True)
    data, tokens = job.run_data(options, sch.module)
    if isinstance(data, job.Positioned) and rank == 0:
        print(f"data: {data.data}", flush=True)
    sch, autocast = loop.precision(sch, options.dtype)
    weights = weights_of(options.model)
    # a resumed run loads its checkpoint instead of the folder's weights
    init: Literal["empty", "full"] = "empty" if weights is not None and not options.resume else "full"
    if options.pp > 1:
        micro = options.microbatches or 2 * options.pp
        model: Any = build_pipeline(sch, microbatches=micro, schedule=options.schedule, loss_fn=loop.causal_lm_loss,
                                    init=init, seed=options.seed, device=device)
    else:
        model = build(sch, init=init, seed=options.seed, device=device)
    if init == "empty":
        load_hf(model, Path(options.model))
        if rank == 0:
            print(f"loaded weights from {options.model}", flush=True)
    elif not options.resume and rank == 0:
        _say_random_init(options)
    optimizer = loop.adamw(model, lr=options.lr, weight_decay=options.weight_decay)
    torch.manual_seed(options.seed)  # dropout and other random ops of the steps, the same on every rank
    start = 0
    if options.resume:
        start = _resume(options, model, optimizer, data)
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    loggers: list[Any] = []
    if rank == 0:
        loggers.append(loop.ConsoleLog(every=options.log_every, start=start, total=options.steps,
                                       progress=not options.no_progress))
        if options.metrics:
            loggers.append(loop.JsonlLog(options.metrics))
        if options.tensorboard:
            loggers.append(loop.TensorBoardLog(options.tensorboard))
    try:
        loop.train(model, optimizer, data, steps=options.steps, batch_size=options.batch, mesh=mesh, start_step=start,
                   lr_schedule=loop.LRSchedule(options.lr, warmup=options.warmup, decay=options.decay,
                                               min_lr=options.min_lr, total=options.steps),
                   grad_clip=options.grad_clip, grad_accum=options.grad_accum, autocast=autocast,
                   eval_every=options.eval_every, eval_batches=options.eval_batches,
                   checkpoint=loop.Checkpointing(options.checkpoint_dir, every=options.save_every)
                   if options.checkpoint_dir else None,
                   log=loggers, memory=bool(options.metrics or options.tensorboard),
                   on_step=None if fault is None else lambda step: _inject(fault, step))
    finally:
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


def _resume(options: Options, model: Any, optimizer: torch.optim.Optimizer, data: object) -> int:
    """The step the newest loadable checkpoint continues at, its state loaded."""
    start = loop.resume(model, optimizer, options.checkpoint_dir, data=data,
                        say=lambda text: print(f"slapo-fn train: {text}", flush=True))
    if start >= options.steps:  # checked before the launch; here for a job started by torchrun itself
        raise CommandLineError(options.command, job.resume_problems(options))
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


def _inject(fault: Fault, step: int) -> None:
    """``--fault``: fail as ``fault`` says after its step, on the last rank."""
    rank = int(os.environ.get("RANK", "0"))
    if step != fault.step or rank != int(os.environ.get("WORLD_SIZE", "1")) - 1:
        return
    print(f"slapo-fn: injected fault {fault.kind!r} on rank {rank}", file=sys.stderr, flush=True)
    if fault.kind == "exit":
        os._exit(3)
    while True:  # hang: the others wait on the next collective until they time out or are killed
        time.sleep(3600)


def verify(options: Options) -> int:
    """One rank of ``slapo-fn verify``: the recipe's schedule against the unscheduled
    model on the same random batch; the report (or the failure) on rank 0. Returns the
    exit code: 1 where they differ."""
    _device, mesh = setup(options)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)  # the model's random initialisation
    sch = job.schedule_for(options, mesh, meta=False)  # a Hugging Face folder's weights where it has some
    if rank == 0 and weights_of(options.model) is not None:
        print(f"loaded weights from {options.model}", flush=True)
    vocab = hf.vocab_size(sch.module)
    ids = torch.randint(0, vocab, (options.batch, options.seq), generator=torch.Generator().manual_seed(0))
    code = 0
    try:
        report = verify_schedule(sch, ids, rtol=options.rtol, atol=options.atol)
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
