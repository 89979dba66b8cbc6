"""The ``slapo-fn`` command: ``train``, ``explain``, ``verify``.

* ``slapo-fn train --model llama-small --dp 2 --tp 2 --steps 40`` builds the model from a
  named config (or a local Hugging Face ``config.json``), schedules it with its family's
  recipe for the requested ``--dp/--tp/--pp``, starts the local processes itself through
  ``torchrun`` (gloo on CPU, NCCL on GPUs), trains on a synthetic task (or ``--data
  file.txt``, byte-level) with a progress bar, writes distributed checkpoints
  (``--checkpoint-dir``, ``--save-every``) and resumes from them (``--resume``).
* ``slapo-fn explain --model llama-7b --tp 8 --pp 4 --dp 4`` prints the schedule, its
  layouts, collectives, stages and per-rank memory without starting a job (meta device,
  a fake process group).
* ``slapo-fn verify --model llama-tiny --tp 2`` checks the recipe against the unscheduled
  model (forward and every gradient) on the requested ranks and prints a per-module report.

A multi-process run is a ``torchrun`` child in its own session; its workers write their
PIDs under ``--run-dir``, and whatever way the run ends (success, a failed or killed
rank, Ctrl-C) the launcher makes sure none of them is left running.
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
    train.add_argument("--metrics", default=None, help="write per-step figures as JSON lines to this file")

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
    return parser


# -- launching ----------------------------------------------------------------------------
def _world(args: argparse.Namespace) -> int:
    return int(args.dp * args.tp * args.pp)


def _in_worker() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("SLAPO_FN_WORKER") == "1"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_workers(run_dir: Path) -> None:
    for path in run_dir.glob("pid-*"):
        try:
            pid = int(path.read_text())
        except ValueError:
            continue
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


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
    axes = [(n, s) for n, s in (("dp", args.dp), ("pp", args.pp), ("tp", args.tp)) if s > 1]
    mesh = init_device_mesh(device.type, tuple(s for _, s in axes), mesh_dim_names=tuple(n for n, _ in axes))
    return device, mesh


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
    from .presets import build_model

    model = build_model(args.model, meta=meta)
    return recipes.for_model(model)(create_schedule(model, mesh=mesh), _knobs(args))


def _train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from . import build, build_pipeline, load, save
    from .data import Arithmetic, ByteText

    device, mesh = _setup(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sch = _schedule(args, mesh, meta=True)
    data = ByteText.from_file(args.data, args.seed) if args.data else Arithmetic(sch.module.config.vocab_size,
                                                                                 args.seed)
    vocab = sch.module.config.vocab_size
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
            value = loss.detach().float().clone()
            if args.dp > 1:
                dist.all_reduce(value, group=mesh.get_group("dp"))
                value /= args.dp
            last = value.item()
            first = last if first is None else first
            rate = args.batch * args.seq / (time.perf_counter() - began)
            if rank == 0:
                if progress is not None:
                    progress.set_postfix(loss=f"{last:.4f}", tok_s=f"{rate:,.0f}")
                    progress.update(1)
                if (step + 1) % args.log_every == 0 or step == start or step + 1 == args.steps:
                    print(f"step {step + 1} loss {last:.6f} tokens/s {rate:.0f}", flush=True)
                if metrics is not None:
                    metrics.write(json.dumps({"step": step + 1, "loss": last, "tokens_per_s": rate}) + "\n")
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


def _verify(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from . import create_schedule, recipes, verify
    from .presets import build_model
    from .verify import VerificationError

    _device, mesh = _setup(args)
    if args.pp > 1:
        raise SystemExit("slapo-fn verify: pipelines are verified by their tests; use --tp/--dp")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(args.seed if hasattr(args, "seed") else 0)
    model = build_model(args.model)
    knobs = _knobs(args)
    sch = recipes.for_model(model)(create_schedule(model, mesh=mesh), knobs)
    vocab = int(getattr(model, "config").vocab_size)  # noqa: B009 (nn.Module's __getattr__ types it as a Tensor)
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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .explain import explain

    world = _world(args)
    mesh = None
    if world > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        axes = [(n, s) for n, s in (("dp", args.dp), ("pp", args.pp), ("tp", args.tp)) if s > 1]
        mesh = init_device_mesh("cpu", tuple(s for _, s in axes), mesh_dim_names=tuple(n for n, _ in axes))
    try:
        sch = _schedule(args, mesh, meta=True)
        shape = (args.batch // args.dp, args.seq)  # one data-parallel rank's batch: the bytes of its collectives
        info = explain(sch, torch.zeros(shape, dtype=torch.long, device="meta"))
        axes_text = " x ".join(f"{n}{s}" for n, s in (("dp", args.dp), ("pp", args.pp), ("tp", args.tp)) if s > 1)
        print(f"{args.model}: {info.total_parameters:,} parameters; {axes_text or 'one process'} "
              f"({world} ranks); recipe knobs: {_knobs(args)}")
        text = str(info)
        if not args.tree:
            text = text.split("\n\n", 1)[-1]  # everything after the tree
        print(text)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``slapo-fn`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        if args.command == "explain":
            return _explain(args)
        if _world(args) > 1 and not _in_worker():
            return launch(argv, _world(args), getattr(args, "run_dir", None))
        if args.command == "train":
            return _train(args)
        return _verify(args)
    except (ValueError, KeyError) as e:  # bad input (typed slapo_fn errors included): the message, no traceback
        print(f"slapo-fn {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
