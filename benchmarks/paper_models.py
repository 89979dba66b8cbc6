"""The Slapo paper's experiment on one device: each of its models, Hugging Face eager against
its slapo_fn recipe, one training step.

Models (random weights, from configs, the paper's seven families): BERT, RoBERTa and ALBERT
(masked LM), GPT-2 and GPT-Neo (causal LM; GPT-Neo with alternating global and local
attention), OPT (causal LM), T5 (conditional generation) and a torchvision Wide ResNet
(``wide_resnet50_2``'s module tree, ``tests/models.py``). ``--size small`` (the default, for
a CPU) is 4 layers of hidden 256, seq 128, batch 4 (Wide ResNet: 8 bottlenecks, width 16,
64x64 images); ``--size base`` is
BERT-base-like (12 layers of hidden 768, seq 512, batch 8; Wide ResNet at its real depth
and width on 224x224), for a GPU.

Variants, the same weights:

* ``eager`` — the Hugging Face model as built (its default attention implementation);
* ``recipe`` — ``sf.recipes.for_model(model)`` (Wide ResNet: ``sf.recipes.WIDE_RESNET``)
  with ``kernels=True`` (the family's attention / MLP kernels; OPT, T5 and Wide ResNet have
  none);
* ``recipe+ckpt`` — the same with ``checkpoint=1.0`` (every layer recomputed in backward).

A step = forward + the model's own loss (``labels=``; cross-entropy for Wide ResNet) +
backward. Time: median over ``--repeat`` steps, variants interleaved, of the process CPU
time on CPU (``time.process_time``: robust to this shared machine's load) or of the
synchronised wall time on a GPU; ``speedup`` = eager / variant. Memory: the peak bytes a
step allocates above what was live before it (PyTorch's profiler memory timeline on CPU,
``torch.cuda.max_memory_allocated`` on a GPU), gradients already allocated. On a GPU also
``tokens_per_s`` (images/s for Wide ResNet) and ``mfu``: ``flops_per_step`` (the FLOPs of
one step, reported on every device, counted by ``torch.utils.flop_counter.FlopCounterMode``
on the eager step: model FLOPs, recomputation not counted) over the step time and the GPU's
dense peak at the step's dtype (``slapo_fn.hardware`` profiles).

Prints one JSON line per model. ``python benchmarks/paper_models.py [--size small|base]
[--repeat N] [--models bert,t5,...] [--dtype float32|bfloat16]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import slapo_fn as sf
from slapo_fn.hardware import PROFILES, load_profile
from slapo_fn.memory import profiled_peak_bytes

Step = Callable[[], None]

SIZES: dict[str, dict[str, int]] = {
    "small": {"layers": 4, "hidden": 256, "heads": 4, "seq": 128, "batch": 4, "vocab": 8192, "image": 64},
    "base": {"layers": 12, "hidden": 768, "heads": 12, "seq": 512, "batch": 8, "vocab": 30522, "image": 224},
}
MODELS = ("bert", "roberta", "albert", "gpt2", "gpt_neo", "opt", "t5", "wide_resnet")


def make(name: str, s: dict[str, int]) -> nn.Module:
    """The model ``name`` at size ``s``, no dropout (so every variant computes the same step)."""
    import transformers as tf

    torch.manual_seed(0)
    h, layers, heads, ff = s["hidden"], s["layers"], s["heads"], 4 * s["hidden"]
    positions = max(s["seq"] + 2, 512)
    encoder = {"vocab_size": s["vocab"], "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
               "intermediate_size": ff, "max_position_embeddings": positions, "hidden_dropout_prob": 0.0,
               "attention_probs_dropout_prob": 0.0}
    if name == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(**encoder))
    if name == "roberta":
        return tf.RobertaForMaskedLM(tf.RobertaConfig(**encoder))
    if name == "albert":
        return tf.AlbertForMaskedLM(tf.AlbertConfig(**encoder, embedding_size=128))
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=s["vocab"], n_embd=h, n_layer=layers, n_head=heads,
                                                n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0,
                                                attn_pdrop=0.0, use_cache=False))
    if name == "gpt_neo":
        return tf.GPTNeoForCausalLM(tf.GPTNeoConfig(vocab_size=s["vocab"], hidden_size=h, num_layers=layers,
                                                    num_heads=heads, attention_types=[[["global", "local"],
                                                                                       layers // 2]],
                                                    window_size=s["seq"] // 2, max_position_embeddings=positions,
                                                    embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0,
                                                    use_cache=False))
    if name == "opt":
        return tf.OPTForCausalLM(tf.OPTConfig(vocab_size=s["vocab"], hidden_size=h, num_hidden_layers=layers,
                                              ffn_dim=ff, num_attention_heads=heads,
                                              max_position_embeddings=positions, word_embed_proj_dim=h,
                                              dropout=0.0, attention_dropout=0.0, use_cache=False))
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=s["vocab"], d_model=h, d_kv=h // heads, d_ff=ff,
                                                         num_layers=layers, num_decoder_layers=layers,
                                                         num_heads=heads, dropout_rate=0.0, use_cache=False,
                                                         decoder_start_token_id=0))
    from models import WideResNet

    if s["image"] >= 224:  # wide_resnet50_2 itself
        return WideResNet(blocks=(3, 4, 6, 3), width=64, classes=1000)
    return WideResNet(blocks=(2, 2, 2, 2), width=16)


def inputs(name: str, s: dict[str, int], device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if name == "wide_resnet":
        return {"x": torch.randn(s["batch"], 3, s["image"], s["image"], generator=g).to(device),
                "y": torch.randint(0, 10, (s["batch"],), generator=g).to(device)}
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def step_of(model: nn.Module, batch: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> Step:
    """One training step: the model's own loss (``labels=``), or cross-entropy of images' classes."""
    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**batch).loss if "labels" in batch else F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()

    return step


def recipe_schedule(name: str, model: nn.Module, checkpoint: bool) -> sf.Schedule:
    recipe = sf.recipes.WIDE_RESNET if name == "wide_resnet" else sf.recipes.for_model(model)
    return recipe(sf.create_schedule(model), kernels=True, checkpoint=1.0 if checkpoint else None)


def timed(step: Step, device: torch.device) -> float:
    """Seconds of one step: process CPU time on CPU, synchronised wall time on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start
    cpu = time.process_time()
    step()
    return time.process_time() - cpu


def peak_bytes(step: Step, device: torch.device) -> int:
    if device.type != "cuda":
        return profiled_peak_bytes(step)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def step_flops(step: Step) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


def bench(name: str, s: dict[str, int], repeat: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    model = make(name, s).to(device).train()
    batch = inputs(name, s, device)
    schedules = {"eager": sf.create_schedule(model), "recipe": recipe_schedule(name, model, False),
                 "recipe+ckpt": recipe_schedule(name, model, True)}
    built = {v: sf.build(sch, copy=False) for v, sch in schedules.items()}
    steps = {v: step_of(m, batch, dtype, device) for v, m in built.items()}
    for _ in range(2):  # warm-up: gradients allocated, kernels chosen, the process's first-use costs paid
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(repeat):
        for v, step in steps.items():
            times[v].append(timed(step, device))
    med = {v: statistics.median(ts) for v, ts in times.items()}
    peaks = {v: peak_bytes(step, device) for v, step in steps.items()}
    replaced = sorted({type(m).__name__ for m in built["recipe"].modules()}
                      - {type(m).__name__ for m in built["eager"].modules()})
    out: dict[str, Any] = {
        "model": name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "config": {**{k: s[k] for k in (("batch", "image") if name == "wide_resnet" else ("batch", "seq", "layers",
                                                                                              "hidden"))},
                   "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)},
        "kernels": replaced,
        "step_s": {v: round(t, 4) for v, t in med.items()},
        "speedup": {v: round(med["eager"] / t, 3) for v, t in med.items() if v != "eager"},
        "peak_MB": {v: round(b / 2**20, 1) for v, b in peaks.items()},
        "memory_saved": {v: round(1 - b / peaks["eager"], 3) for v, b in peaks.items() if v != "eager"},
    }
    flops = step_flops(steps["eager"])
    out["flops_per_step"] = flops
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower()
        profile = next((p for p in PROFILES if p != "cpu" and p in gpu), None)
        peak = load_profile(profile).peak({torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")) \
            if profile else None
        units = s["batch"] * (1 if name == "wide_resnet" else s["seq"])
        out["tokens_per_s" if name != "wide_resnet" else "images_per_s"] = {
            v: round(units / t, 1) for v, t in med.items()}
        out["mfu"] = None if peak is None else {v: round(flops / t / peak, 4) for v, t in med.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose among {', '.join(MODELS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in names:
        print(json.dumps(bench(name, SIZES[args.size], args.repeat, getattr(torch, args.dtype), device)), flush=True)


if __name__ == "__main__":
    main()
