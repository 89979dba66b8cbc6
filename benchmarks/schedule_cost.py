"""Cost of schedule rewrites on LLaMA-shaped meta-device models: is it independent of depth?

Builds LLaMA-shaped models (hidden 8192, GQA 64/8 heads) with 8 and 80 decoder layers on
the meta device, applies ``replace`` (fused RMSNorm), ``checkpoint`` and ``annotate`` to
every layer through ``foreach``, and reports the wall time per rewrite and in total, next
to ``copy.deepcopy`` of the same model. Prints one JSON line.

Targets (issue 2): per-rewrite cost 80-layer / 8-layer ≤ 1.5; the whole 80-layer schedule
under 1 s.

    .venv/bin/python benchmarks/schedule_cost.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import slapo_fn as sf
from slapo_fn.kernels import RMSNorm


def meta_llama(layers: int) -> torch.nn.Module:
    cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=32000)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


SCHEDULE = sf.foreach(
    "model.layers.*",
    sf.replace.at("{input,post_attention}_layernorm", lambda old, path: RMSNorm.from_hf(old, path))
    >> sf.checkpoint.at("")
    >> sf.annotate.at("mlp.down_proj.weight", "tp", "row"),
)


def measure(layers: int, repeats: int) -> dict[str, float]:
    model = meta_llama(layers)
    sch = sf.create_schedule(model)
    times, copies = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = SCHEDULE(sch)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        copy.deepcopy(model)
        copies.append(time.perf_counter() - start)
    rewrites = len(out.history)
    total = statistics.median(times)
    return {"layers": layers, "rewrites": rewrites, "total_s": total, "per_rewrite_us": total / rewrites * 1e6,
            "deepcopy_s": statistics.median(copies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    small, large = measure(8, args.repeats), measure(80, args.repeats)
    ratio = large["per_rewrite_us"] / small["per_rewrite_us"]
    print(json.dumps({
        "benchmark": "schedule_cost",
        "per_rewrite_us_8": round(small["per_rewrite_us"], 1),
        "per_rewrite_us_80": round(large["per_rewrite_us"], 1),
        "per_rewrite_ratio_80_over_8": round(ratio, 3),
        "total_s_80": round(large["total_s"], 4),
        "rewrites_80": large["rewrites"],
        "deepcopy_s_8": round(small["deepcopy_s"], 4),
        "deepcopy_s_80": round(large["deepcopy_s"], 4),
        "schedule_vs_deepcopy_80": round(large["total_s"] / large["deepcopy_s"], 3),
        "targets_met": ratio <= 1.5 and large["total_s"] < 1.0,
    }))


if __name__ == "__main__":
    main()
