"""Schedule a Hugging Face LLaMA step by step, verifying the numbers after every step.

Run on 4 local processes (a pp=2 x tp=2 mesh; gloo on CPU):

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 examples/tutorial.py

The model code is never edited: every step is a rewrite of the schedule, and every step
is checked against the unscheduled model — forward and every gradient — by sf.verify.
docs/tutorial.md walks through it.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import slapo_fn as sf
from slapo_fn.kernels import RMSNorm


def say(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def snapshot(model: torch.nn.Module) -> list[tuple[object, ...]]:
    """Structure, hooks, parameter objects and values: what no rewrite may change."""
    return [(name, type(m), len(m._forward_hooks) + len(m._forward_pre_hooks),
             tuple((n, id(p), p.detach().clone()) for n, p in m.named_parameters(recurse=False)))
            for name, m in model.named_modules()]


def same(a: list[tuple[object, ...]], b: list[tuple[object, ...]]) -> bool:
    return len(a) == len(b) and all(
        x[:3] == y[:3] and all(p[:2] == q[:2] and torch.equal(p[2], q[2]) for p, q in zip(x[3], y[3], strict=True))
        for x, y in zip(a, b, strict=True))


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))

    # 0. The model, as Hugging Face wrote it (random weights from a config).
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    before = snapshot(model)
    sch = sf.create_schedule(model, mesh=mesh)

    def check(step: str, sch: sf.Schedule, **tolerance: float) -> None:
        report = sf.verify(sch, ids, **tolerance)
        say(f"{step:<44} {report}")

    check("0. nothing scheduled", sch)

    # 1. Replace modules: PyTorch's fused RMSNorm kernel for every HF RMSNorm. The kernel
    #    takes over the old module's weight Parameter, so FQNs and state dicts are unchanged.
    norms = sf.of_type(type(model.model.norm))
    sch = sf.replace(sch, norms, RMSNorm.from_hf)
    check("1. replace: fused RMSNorm", sch, rtol=1e-4, atol=1e-5)

    # 2. Tensor parallelism, Megatron style, as a rewrite value applied to every layer:
    #    column-parallel q/k/v and gate/up, row-parallel o and down. One all-reduce forward
    #    and one backward per attention block and per MLP block.
    attention = sf.shard.at("q_proj", axis=0) >> sf.shard.at("k_proj", axis=0) >> sf.shard.at("v_proj", axis=0) \
        >> sf.shard.at("o_proj", axis=1)
    mlp = sf.shard.at("gate_proj", axis=0) >> sf.shard.at("up_proj", axis=0) >> sf.shard.at("down_proj", axis=1)
    sch = sf.foreach("model.layers.*", sf.scope("self_attn", attention) >> sf.scope("mlp", mlp))(sch)
    check("2. shard: Megatron attention + MLP (tp=2)", sch, rtol=1e-4, atol=1e-5)

    # 3. Sequence parallelism: norms run on sequence shards; the all-reduces become
    #    all-gathers + reduce-scatters.
    sch = sf.sequence_parallel(sch, ["model.layers.*", "model.norm"])
    check("3. sequence parallel", sch, rtol=1e-4, atol=1e-5)

    # 4. Activation checkpointing of every other layer, selectively keeping matmul outputs.
    even = lambda view: int(view.path.rsplit(".", 1)[1]) % 2 == 0
    sch = sf.foreach("model.layers.*", sf.when(even, sf.checkpoint.at("", policy=[torch.ops.aten.mm])))(sch)
    check("4. checkpoint layers 0 and 2 (selective)", sch, rtol=1e-4, atol=1e-5)

    # 5. A pipeline cut after layer 1: two stages over the mesh axis "pp". verify checks the
    #    whole schedule; the pipeline's own loss is compared with the unscheduled model's.
    sch = sf.cut_pipeline_stage(sch, "model.layers.1")
    check("5. cut_pipeline_stage after layer 1", sch, rtol=1e-4, atol=1e-5)

    def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    target = torch.roll(ids, -1, dims=1)
    pipe = sf.build_pipeline(sch, microbatches=2, schedule="1f1b", loss_fn=ce)
    loss = pipe.step(ids, target=target)
    expected = ce(model(ids).logits, target)
    say(f"{'   pipeline step: loss':<44} {loss.item():.6f} (unscheduled model: {expected.item():.6f})")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)

    # What was built, per rank, without running anything: layouts, collectives, stages, memory.
    say("\n" + str(sf.explain(sch, torch.zeros_like(ids, device="meta"))).split("\n\n", 1)[1])
    say("\nthe model given to create_schedule was never modified:", same(before, snapshot(model)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit("run me with: python -m torch.distributed.run --standalone --nproc-per-node 4 "
                         "examples/tutorial.py")
    main()
