"""CPU time and peak memory of ``explain`` at LLaMA scale, everything included: layouts,
every collective, activations per stage and the step-time estimate (issue 16, item 5).

* ``405b``: LLaMA-3-405B's shape (126 layers, hidden 16384, 128 heads with 8 KV heads,
  vocabulary 128256, MLP 53248) at tp8 × pp16 × dp64 (8192 ranks), FSDP over dp, 1F1B
  with 32 microbatches, global batch 2048 × seq 8192 (one sequence per microbatch). Targets: < 5 s CPU, < 1 GB.
* ``70b``: LLaMA-70B's shape (80 layers, hidden 8192, 64/8 heads, MLP 28672, vocabulary
  128256) at tp8 × pp8 × dp4 (256 ranks), batch 64 × seq 8192 (16 microbatches of one). Target: < 2 s CPU.

Each case runs in a fresh process (``--case NAME``: one case in this process) so that
the peak memory (``peak_mb``: ``ru_maxrss`` minus the process's size before the model is
built, after imports; ``process_peak_mb``: the whole process, imports included) and
the CPU time (``time.process_time``, from the model's construction on the meta device to
the printed text) are its own. Prints one JSON line.

    .venv/bin/python benchmarks/explain_scale.py
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

CASES: dict[str, dict[str, Any]] = {
    "405b": {"layers": 126, "hidden": 16384, "heads": 128, "kv": 8, "ffn": 53248, "vocab": 128256,
             "tp": 8, "pp": 16, "dp": 64, "batch": 2048, "seq": 8192, "targets": {"cpu_s": 5.0, "peak_mb": 1000}},
    "70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv": 8, "ffn": 28672, "vocab": 128256,
            "tp": 8, "pp": 8, "dp": 4, "batch": 64, "seq": 8192, "targets": {"cpu_s": 2.0}},
}


def run_case(name: str) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    import slapo_fn as sf
    from slapo_fn.dtensor.testing import fake_world
    from slapo_fn.recipes import Knobs, for_model

    case = CASES[name]
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began, wall = time.process_time(), time.perf_counter()
    cfg = LlamaConfig(hidden_size=case["hidden"], intermediate_size=case["ffn"], num_hidden_layers=case["layers"],
                      num_attention_heads=case["heads"], num_key_value_heads=case["kv"], vocab_size=case["vocab"],
                      use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    world = case["tp"] * case["pp"] * case["dp"]
    micro = 2 * case["pp"]
    with fake_world(world):
        mesh = init_device_mesh("cpu", (case["dp"], case["pp"], case["tp"]), mesh_dim_names=("dp", "pp", "tp"))
        knobs = Knobs(tp=case["tp"], sequence_parallel=True, checkpoint=1.0, stages=case["pp"], dp_mode="fsdp")
        sch = for_model(model)(sf.create_schedule(model, mesh=mesh), knobs)
        built_s = time.process_time() - began
        ids = torch.zeros((case["batch"] // case["dp"], case["seq"]), dtype=torch.long, device="meta")
        info = sf.explain(sch, ids, microbatches=micro, pipeline_schedule="1f1b", hardware="h100")
        text = str(info)
    cpu_s = time.process_time() - began
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kb) / 1024
    assert info.memory is not None and info.time is not None
    return {"case": name, "ranks": world, "parameters": info.total_parameters, "cpu_s": round(cpu_s, 2),
            "schedule_cpu_s": round(built_s, 2), "wall_s": round(time.perf_counter() - wall, 2),
            "peak_mb": round(peak_mb, 1),
            "process_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "text_lines": text.count("\n") + 1,
            "max_rank_gib": round(info.memory.max_total_bytes / 2**30, 2),
            "step_s": round(info.time.step_s, 3), "mfu": round(info.time.mfu, 3),
            "collectives": len(info.collectives), "targets": case["targets"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), default=None, help="run one case in this process")
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(run_case(args.case)))
        return
    results = []
    for name in CASES:
        out = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"benchmark": "explain_scale", "results": results}))


if __name__ == "__main__":
    main()
