"""Peak activation memory per rank under context parallelism: cp4 against cp1, in one run.

A LLaMA-shaped causal LM (``--hidden`` 256, ``--layers`` 4, 8 heads over 4 K/V heads,
``--vocab`` 8192, random weights) trains one step (forward, loss, backward) on one
sequence of ``--seq`` 1024 tokens:

* ``cp1`` — the model as it is, in one process (rank 0, before the others start work);
* ``cp4`` — ``sf.context_parallel`` over a ``cp`` mesh axis of 4 gloo ranks: each rank
  runs 256 tokens, all-gathering K and V per layer.

Memory is the PyTorch profiler's record of every CPU allocation and free
(``slapo_fn.memory.profiled_peak_bytes``): the peak allocated above the step's start.
The gradients are allocated by a warm-up step first, so the peak is activations and
temporaries (gradient buffers are the same size at every cp). Beside the measured peaks,
``sf.explain``'s estimate of the activation bytes per rank at cp1 and cp4 (gathered keys
and values counted at full length). Prints one JSON line.
Run: ``python benchmarks/context_parallel_memory.py [--seq 1024] [--cp 4]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import slapo_fn as sf
from slapo_fn.memory import profiled_peak_bytes


def _model(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, use_cache=False,
        attn_implementation="sdpa"))


def _peak(model: nn.Module, ids: torch.Tensor) -> tuple[int, float]:
    """Peak bytes of one training step after a warm-up step (gradients allocated), and its loss."""

    def step() -> float:
        out = model(ids, labels=ids)
        out.loss.backward()
        return float(out.loss)

    step()
    losses: list[float] = []
    peak = profiled_peak_bytes(lambda: losses.append(step()))
    return peak, losses[0]


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0))
    result: dict[str, Any] = {"rank": rank}
    if rank == 0:
        result["cp1"] = _peak(_model(args), ids)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        built = sf.build(sf.context_parallel(sf.create_schedule(_model(args), mesh=mesh)))
        dist.barrier()
        result["cp"] = _peak(built, ids)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    queue.put(result)


def _predicted(args: argparse.Namespace) -> dict[str, int]:
    """``sf.explain``'s activation bytes per rank at cp1 and at ``--cp`` (a fake mesh, in
    this process): its estimate beside the measured peaks."""
    from slapo_fn.dtensor.testing import fake_mesh, fake_world

    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0))
    out = {}
    with fake_world(args.cp):
        for name, cp in (("cp1", False), ("cp", True)):
            sch = sf.create_schedule(_model(args), mesh=fake_mesh(args.cp, names=("cp",)))
            ex = sf.explain(sf.context_parallel(sch) if cp else sch, ids, kwargs={"labels": ids})
            out[name] = int(ex.memory.rows[0].activation_bytes or 0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--cp", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, args.cp, port, args, queue)) for r in range(args.cp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    if any(p.exitcode != 0 for p in procs):
        for p in procs:
            p.kill()
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    results = sorted((queue.get() for _ in procs), key=lambda r: r["rank"])
    predicted = _predicted(args)
    cp1_peak, cp1_loss = results[0]["cp1"]
    peaks = [r["cp"][0] for r in results]
    print(json.dumps({
        "benchmark": "context_parallel_memory", "model": "LlamaForCausalLM (random weights)", "seq": args.seq,
        "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "heads": 8, "kv_heads": 4,
        "cp": args.cp, "cp1_peak_bytes": cp1_peak, "cp_peak_bytes_per_rank": peaks,
        "ratio_max_rank": round(max(peaks) / cp1_peak, 4), "target_ratio": 0.35,
        "loss_cp1": round(cp1_loss, 6), "loss_cp": round(results[0]["cp"][1], 6),
        "explain_activation_bytes": predicted, "explain_ratio": round(predicted["cp"] / predicted["cp1"], 4),
        "memory_method": "torch.profiler memory timeline (profile_memory=True), peak above step start, "
                         "gradients allocated by a warm-up step",
    }))


if __name__ == "__main__":
    main()
