"""The slapo_fn demo: schedule a Hugging Face LLaMA, verify it, train it.

1. builds a small LLaMA from a config (random weights: there is no model hub here);
2. writes a schedule — fused RMSNorm kernels (replace), activation checkpointing on every
   decoder layer, torch.compile on the MLPs — without touching the model's code;
3. verifies the schedule against the original model (forward and every gradient);
4. trains the scheduled model for a few steps on a synthetic task (continue an
   arithmetic sequence mod the vocabulary) and prints the losses, which fall.

    .venv/bin/python examples/demo.py [--steps 40] [--no-compile]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import slapo_fn as sf
from slapo_fn.kernels import RMSNorm

VOCAB = 256


def batch(size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Arithmetic sequences mod VOCAB: a start and a step, then the sequence continues."""
    start = torch.randint(0, VOCAB, (size, 1), generator=generator)
    step = torch.randint(1, 8, (size, 1), generator=generator)
    return (start + step * torch.arange(length)) % VOCAB


def schedule(model: torch.nn.Module, *, compile_mlp: bool) -> sf.Schedule:
    sch = sf.create_schedule(model)
    per_layer = sf.replace.at("{input,post_attention}_layernorm", RMSNorm.from_hf) >> sf.checkpoint.at("")
    if compile_mlp:
        per_layer = per_layer >> sf.compile.at("mlp", dynamic=False)
    sch = sf.foreach("model.layers.*", per_layer)(sch)
    return sf.replace(sch, "model.norm", RMSNorm.from_hf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (faster start)")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = LlamaForCausalLM(config)
    sch = schedule(model, compile_mlp=not args.no_compile)
    print(sf.explain(sch))

    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    report = sf.verify(sch, batch(4, 32, gen), rtol=1e-4, atol=1e-4)  # a fused kernel reorders float ops
    print(f"\n{report}  [{time.perf_counter() - start:.1f} s, compile included]")

    built = sf.build(sch)
    built.train()
    optimizer = torch.optim.AdamW(built.parameters(), lr=3e-3)
    first = last = 0.0
    for step in range(1, args.steps + 1):
        ids = batch(16, 32, gen)
        loss = built(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last = loss.item()
        first = first or last
        if step == 1 or step % 5 == 0 or step == args.steps:
            print(f"step {step:3d}  loss {last:.4f}")
    print(f"\nloss {first:.3f} -> {last:.3f}; the original model was not touched: "
          f"{all(p.grad is None for p in model.parameters())}")
    if not last < first:
        raise SystemExit("the loss did not fall")


if __name__ == "__main__":
    main()
