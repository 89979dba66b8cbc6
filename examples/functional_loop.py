"""A LLaMA trained the JAX way at dp2×tp2: a function, a pytree of DTensor parameters,
gradients, clipping and AdamW as functions of pytrees.

Run on 4 local processes (gloo on CPU, NCCL on GPUs)::

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 examples/functional_loop.py

The same model is trained twice from the same weights: with ``sf.func`` and ``sf.optim``
(``functional``, ``value_and_grad``, ``clip_by_global_norm``, ``adamw``), and as a module
with ``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_``. Rank 0 prints both
loss curves and their largest difference.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import slapo_fn as sf

VOCAB = 256


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return LlamaForCausalLM(cfg)


def schedule(mesh: object) -> sf.Schedule:
    """Megatron tensor parallelism on every decoder layer, then FSDP2 over dp."""
    sch = sf.create_schedule(model(), mesh=mesh)
    attn = sf.shard.at("q_proj", axis=0) >> sf.shard.at("k_proj", axis=0) >> sf.shard.at("v_proj", axis=0)
    attn = attn >> sf.shard.at("o_proj", axis=1)
    mlp = sf.shard.at("gate_proj", axis=0) >> sf.shard.at("up_proj", axis=0) >> sf.shard.at("down_proj", axis=1)
    sch = sf.foreach("model.layers.*", sf.scope("self_attn", attn) >> sf.scope("mlp", mlp))(sch)
    return sf.data_parallel(sch)


def batch(step: int, dp_rank: int) -> torch.Tensor:
    """This dp rank's half of the global batch of arithmetic sequences (mod VOCAB)."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    start = torch.randint(0, VOCAB, (4, 1), generator=g)
    stride = torch.randint(1, 8, (4, 1), generator=g)
    return (start + stride * torch.arange(16)) % VOCAB


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def functional_losses(mesh: object, steps: int, dp_rank: int) -> list[float]:
    apply_fn, params, _ = sf.func.functional(sf.build(schedule(mesh)))
    init, update = sf.optim.adamw(3e-3, weight_decay=0.1)
    state = init(params)

    def loss_fn(params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        return lm_loss(apply_fn(params, ids).logits, ids)

    step_fn = sf.func.value_and_grad(loss_fn)
    losses = []
    for step in range(steps):
        loss, grads = step_fn(params, batch(step, dp_rank))
        grads, _ = sf.func.clip_by_global_norm(grads, 1.0)
        params, state = update(grads, state, params)  # donate=True: in place, as JAX's donate_argnums
        losses.append(float(loss))
    return losses


def module_losses(mesh: object, steps: int, dp_rank: int) -> list[float]:
    built = sf.build(schedule(mesh))
    opt = torch.optim.AdamW(built.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        ids = batch(step, dp_rank)
        loss = lm_loss(built(ids).logits, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(built.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
        functional = functional_losses(mesh, args.steps, dp_rank)
        module = module_losses(mesh, args.steps, dp_rank)
        # the loss is this dp rank's; average over dp to print the global one
        both = torch.tensor([functional, module])
        dist.all_reduce(both, group=mesh.get_group("dp"))
        both /= mesh.size(0)
        if dist.get_rank() == 0:
            for step in range(args.steps):
                print(f"step {step:2d}  functional {both[0, step].item():.6f}  module {both[1, step].item():.6f}")
            print(f"largest difference: {(both[0] - both[1]).abs().max().item():.2e}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
