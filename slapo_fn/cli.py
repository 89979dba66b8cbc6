"""The ``slapo-fn`` command: ``train``, ``explain``, ``verify``, ``tune``.

* ``slapo-fn train --model llama-small --dp 2 --tp 2 --steps 40`` builds the model from a
  named config (or a local Hugging Face ``config.json``), schedules it with its family's
  recipe for the requested ``--dp/--tp/--pp`` (a family without one: with the model's own
  ``base_model_tp_plan``, ``slapo_fn.recipes.from_model_plan``), starts the local processes itself through
  ``torchrun`` (gloo on CPU, NCCL on GPUs), trains on a synthetic task (or ``--data
  file.txt``, byte-level) with a progress bar, writes distributed checkpoints
  (``--checkpoint-dir``, ``--save-every``) and resumes from them (``--resume``).
* ``slapo-fn explain --model llama-7b --tp 8 --pp 4 --dp 4`` prints the schedule, its
  layouts, collectives, stages and per-rank memory without starting a job (meta device,
  a fake process group).
* ``slapo-fn verify --model llama-tiny --tp 2`` checks the recipe against the unscheduled
  model (forward and every gradient) on the requested ranks and prints a per-module report.
* ``slapo-fn tune --model llama-tiny --world-size 2 --tp 1,2 --checkpoint none,all --batch 2,4``
  searches the recipe's knobs (constraints, then a memory estimate, then short ``train``
  trials) and prints the ``train`` command of the fastest config (slapo_fn.tune).

A multi-process run is a ``torchrun`` child in its own session; its workers write their
PIDs under ``--run-dir``, and whatever way the run ends (success, a failed or killed
rank, Ctrl-C) the launcher makes sure none of them is left running.

Imports of torch and of the rest of the package are made inside the commands, on use:
``slapo-fn --help`` and a refused argument answer at once, before torch loads (~4 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["main"]

PG_TIMEOUT_S = 60


# -- arguments --------------------------------------------------------------------------
def _parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-tiny", help="a preset (see slapo_fn.presets) or a config.json path")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (mesh axis 'dp')")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (mesh axis 'tp')")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages, one per rank (mesh axis 'pp')")
    p.add_argument("--dp-mode", choices=("fsdp", "ddp"), default="fsdp")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    p.add_argument("--checkpoint", type=float, default=None, metavar="RATIO",
                   help="activation checkpointing of the first RATIO of the layers (1.0 = all)")
    p.add_argument("--kernels", action="store_true", help="the family's fused kernels")
    p.add_argument("--compile", action="store_true", help="torch.compile every layer")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches (default: 2 x pp)")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, interleaved, zero-bubble, zbv")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slapo-fn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model with a recipe on local processes")
    _parallel_args(train)
    train.add_argument("--steps", type=int, default=40)
    train.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    train.add_argument("--seq", type=int, default=64, help="sequence length")
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--data", default=None, help="a text file (byte-level); default: a synthetic task")
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

    explain = sub.add_parser("explain", help="explain the schedule of a model and parallel config (no job)")
    _parallel_args(explain)
    explain.add_argument("--tree", action="store_true", help="print the whole (folded) module tree too")
    explain.add_argument("--batch", type=int, default=8, help="global batch, for the bytes of each collective")
    explain.add_argument("--seq", type=int, default=2048, help="sequence length, for the bytes of each collective")

    verify = sub.add_parser("verify", help="check a recipe against the unscheduled model")
    _parallel_args(verify)
    verify.add_argument("--seq", type=int, default=16)
    verify.add_argument("--batch", type=int, default=2)
    verify.add_argument("--rtol", type=float, default=1e-4)
    verify.add_argument("--atol", type=float, default=1e-5)
    verify.add_argument("--run-dir", default=None)
    _tune_args(sub.add_parser("tune", help="search the recipe's knobs for the fastest config that fits"))
    return parser


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


# -- launching ----------------------------------------------------------------------------
def _world(args: argparse.Namespace) -> int:
    return int(args.dp * args.tp * args.pp)


def _in_worker() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("SLAPO_FN_WORKER") == "1"


def _kill_workers(run_dir: Path) -> None:
    from .processes import kill, worker_pids

    kill(worker_pids(run_dir))


def launch(argv: Sequence[str], nproc: int, run_dir: str | None) -> int:
    """Run ``slapo-fn argv`` on ``nproc`` local processes with torchrun; return its exit
    code. No worker outlives this call."""
    own_dir = run_dir is None
    folder = Path(tempfile.mkdtemp(prefix="slapo-fn-run-") if run_dir is None else run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("pid-*"):
        stale.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "--monitor-interval=0.5", "-m", "slapo_fn.cli", *argv]
    env = dict(os.environ, SLAPO_FN_RUN_DIR=str(folder), SLAPO_FN_WORKER="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))))
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    code = 1
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        print("\nslapo-fn: interrupted, stopping the workers", file=sys.stderr)
        _stop(proc)
        code = 130
    finally:
        if proc.poll() is None:
            _stop(proc)
        _kill_workers(folder)
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)
    return code


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- inside a worker ------------------------------------------------------------------------
def _setup(args: argparse.Namespace) -> tuple[Any, Any]:
    """Process group (if several ranks), device and mesh for this worker."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = os.environ.get("SLAPO_FN_RUN_DIR")
    if run_dir:
        Path(run_dir, f"pid-{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world != _world(args):
        raise SystemExit(f"slapo-fn: {world} processes for dp*tp*pp = {_world(args)}")
    if world == 1:
        return device, None
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    axes = _axes(args)
    mesh = init_device_mesh(device.type, tuple(s for _, s in axes), mesh_dim_names=tuple(n for n, _ in axes))
    return device, mesh


def _axes(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The mesh axes of ``--dp/--pp/--tp`` larger than one, in mesh order."""
    return [(n, s) for n, s in (("dp", args.dp), ("pp", args.pp), ("tp", args.tp)) if s > 1]


def _teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _knobs(args: argparse.Namespace) -> Any:
    from .recipes import Knobs

    return Knobs(tp=args.tp, sequence_parallel=args.sp, checkpoint=args.checkpoint, stages=args.pp,
                 dp_mode=args.dp_mode if args.dp > 1 else None, kernels=args.kernels, compile=args.compile)


def _schedule(args: argparse.Namespace, mesh: Any, *, meta: bool) -> Any:
    from . import create_schedule, recipes
    from .hf import model_type
    from .presets import build_model

    model = build_model(args.model, meta=meta)
    plan = _fallback_plan(model, args)
    if plan is None:
        return recipes.for_model(model)(create_schedule(model, mesh=mesh), _knobs(args))
    sch = recipes.from_model_plan(model)(create_schedule(model, mesh=mesh), _knobs(args))
    if os.environ.get("RANK", "0") == "0":
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
    if args.sp:
        raise ValueError(f"--sp needs a recipe; model_type {kind!r} has only a base_model_tp_plan, which does not "
                         "say which modules may run on sequence shards")
    if args.tp > 1:
        recipes.check_tp_plan(plan)
    return plan


def _train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from . import build, build_pipeline, hf, load, save
    from .data import Arithmetic, ByteText

    base_mem = _peak_memory(None)
    fault = _fault(args.fault)
    device, mesh = _setup(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sch = _schedule(args, mesh, meta=True)
    vocab = hf.vocab_size(sch.module)
    data = ByteText.from_file(args.data, args.seed) if args.data else Arithmetic(vocab, args.seed)
    if data.vocab > vocab:
        raise SystemExit(f"slapo-fn: the data has {data.vocab} symbols, the model's vocabulary {vocab}")

    def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    if args.pp > 1:
        micro = args.microbatches or 2 * args.pp
        model: Any = build_pipeline(sch, microbatches=micro, schedule=args.schedule, loss_fn=ce, init="full",
                                    seed=args.seed, device=device)
    else:
        model = build(sch, init="full", seed=args.seed, device=device)
        model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 0
    if args.resume:
        if not args.checkpoint_dir:
            raise SystemExit("slapo-fn: --resume needs --checkpoint-dir")
        start = load(model, optimizer, args.checkpoint_dir)
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    dp_rank = mesh.get_local_rank("dp") if mesh is not None and args.dp > 1 else 0
    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=start, desc="train", unit="step", file=sys.stderr)
    metrics = open(args.metrics, "a") if args.metrics and rank == 0 else None  # noqa: SIM115
    first = last = None
    try:
        for step in range(start, args.steps):
            began = time.perf_counter()
            tokens = data.batch(step, args.batch, args.seq + 1)
            local = tokens.chunk(args.dp)[dp_rank].to(device)
            inputs, target = local[:, :-1], local[:, 1:]
            if args.pp > 1:
                loss = model.step(inputs, target=target)
            else:
                loss = ce(model(inputs).logits, target)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if fault is not None and step + 1 == fault[1] and rank == int(os.environ.get("WORLD_SIZE", "1")) - 1:
                _inject(fault[0])
            value = loss.detach().float().clone()
            if args.dp > 1:
                dist.all_reduce(value, group=mesh.get_group("dp"))
                value /= args.dp
            last = value.item()
            first = last if first is None else first
            rate = args.batch * args.seq / (time.perf_counter() - began)
            memory = _step_memory(device, base_mem) if args.metrics else None
            if rank == 0:
                if progress is not None:
                    progress.set_postfix(loss=f"{last:.4f}", tok_s=f"{rate:,.0f}")
                    progress.update(1)
                if (step + 1) % args.log_every == 0 or step == start or step + 1 == args.steps:
                    print(f"step {step + 1} loss {last:.6f} tokens/s {rate:.0f}", flush=True)
                if metrics is not None:
                    metrics.write(json.dumps({"step": step + 1, "loss": last, "tokens_per_s": rate,
                                              **(memory or {})}) + "\n")
            if args.checkpoint_dir and args.save_every and (step + 1) % args.save_every == 0:
                save(model, optimizer, args.checkpoint_dir, step=step + 1)
        if args.checkpoint_dir and start < args.steps:
            save(model, optimizer, args.checkpoint_dir, step=args.steps)
    finally:
        if progress is not None:
            progress.close()
        if metrics is not None:
            metrics.close()
    if rank == 0 and first is not None:
        print(f"done: loss {first:.4f} -> {last:.4f} over steps {start + 1}..{args.steps}", flush=True)
    _teardown()
    return 0


def _peak_memory(device: Any) -> int:
    """This process's peak memory in bytes: ``torch.cuda.max_memory_allocated`` on a GPU,
    else the peak resident set size since this process started (``VmHWM`` of
    ``/proc/self/status``; ``getrusage``'s ``ru_maxrss`` where there is no ``/proc`` — on
    Linux it carries the launching process's peak across ``exec``, so a worker started by
    a big parent, like a test runner, would report the parent's)."""
    if device is not None and device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _step_memory(device: Any, base: int) -> dict[str, Any]:
    """The peak memory of the most loaded rank so far (``peak_mem_bytes``) and its growth
    since the start of training (``train_mem_bytes``: on CPU the peak RSS less the RSS of
    the imports; on a GPU the same as the peak), reduced over ranks with MAX."""
    import torch
    import torch.distributed as dist

    peak = _peak_memory(device)
    grown = peak - (0 if device.type == "cuda" else base)
    if dist.is_initialized():
        both = torch.tensor([peak, grown], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        peak, grown = (int(v) for v in both.tolist())
    return {"peak_mem_bytes": peak, "train_mem_bytes": grown, "mem_kind": device.type}


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
    from .verify import VerificationError

    _device, mesh = _setup(args)
    if args.pp > 1:
        raise SystemExit("slapo-fn verify: pipelines are verified by their tests; use --tp/--dp")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)  # the model's random initialisation
    sch = _schedule(args, mesh, meta=False)
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
    if world > 1:
        axes = _axes(args)
        started = not dist.is_initialized()
        mesh = fake_mesh(*(s for _, s in axes), names=tuple(n for n, _ in axes))
    try:
        sch = _schedule(args, mesh, meta=True)
        shape = (args.batch // args.dp, args.seq)  # one data-parallel rank's batch: the bytes of its collectives
        info = explain(sch, torch.zeros(shape, dtype=torch.long, device="meta"))
        axes_text = " x ".join(f"{n}{s}" for n, s in _axes(args))
        print(f"{args.model}: {info.total_parameters:,} parameters; {axes_text or 'one process'} "
              f"({world} ranks); recipe knobs: {_knobs(args)}")
        text = str(info)
        if not args.tree:
            text = text.split("\n\n", 1)[-1]  # everything after the tree
        print(text)
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
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
    args = _parser().parse_args(argv)
    try:
        if args.command == "explain":
            return _explain(args)
        if args.command == "tune":
            return _tune(args)
        if _world(args) > 1 and not _in_worker():
            from .presets import config_for

            _fallback_plan(config_for(args.model), args)  # bad input is refused here, once, before any process starts
            return launch(argv, _world(args), getattr(args, "run_dir", None))
        if args.command == "train":
            return _train(args)
        return _verify(args)
    except (ValueError, KeyError) as e:  # bad input (typed slapo_fn errors included): the message, no traceback
        print(f"slapo-fn {args.command}: {e}", file=sys.stderr)
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
