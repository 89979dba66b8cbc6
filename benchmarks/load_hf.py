"""Loading a Hugging Face folder at tp=2: straight into shards vs ``from_pretrained`` + ``build``.

Two ways to get a tensor-parallel LLaMA (~110M parameters, fp32) on 2 gloo ranks from
a ``save_pretrained`` folder:

(a) ``slapo_fn``: the model on the meta device, ``sf.build(sch, init="empty")`` (only
    each rank's shards are allocated), ``sf.load_hf(model, folder)`` (each rank reads
    only its slices with safetensors ``get_slice``);
(b) ``AutoModelForCausalLM.from_pretrained(folder)`` on every rank, then
    ``sf.build(sch)`` of the same schedule.

Each way runs in fresh worker processes, one after the other, ``--repeats`` times,
alternating. Per rank: the growth of peak RSS from just before loading to just after
(Linux's VmHWM, reset just before loading; file pages mapped by safetensors count, for
both) and the wall time (ranks synchronised by a barrier before and after). Both ways
are checked to give the same logits. Prints one JSON line::

    .venv/bin/python benchmarks/load_hf.py [--repeats 2] [--layers 12] [--hidden 768] [--vocab 16000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _config(layers: int, hidden: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                       tie_word_embeddings=False, use_cache=False)


def _status_kib(key: str) -> int:
    """A figure of this process's memory from the kernel's own accounting (Linux), in kB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _load(rank: int, world: int, how: str, folder: str) -> dict[str, Any]:

    import torch
    import torch.distributed as dist
    from dist import mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    import slapo_fn as sf

    tp = mesh((world,), ("tp",))
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    recipe = sf.recipes.for_model(meta)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from now: the imports' peak must not hide the load's
    start_rss = _status_kib("VmRSS")
    start = time.perf_counter()
    if how == "load_hf":
        model = sf.build(recipe(sf.create_schedule(meta, mesh=tp), tp=world), init="empty")
        built = time.perf_counter()
        sf.load_hf(model, folder)
    else:
        full = AutoModelForCausalLM.from_pretrained(folder)
        built = time.perf_counter()
        model = sf.build(recipe(sf.create_schedule(full, mesh=tp), tp=world))
        del full
    done = time.perf_counter()
    dist.barrier()
    seconds = time.perf_counter() - start
    peak_kib = _status_kib("VmHWM") - start_rss
    with torch.no_grad():
        logits = model.eval()(torch.arange(16).view(1, 16)).logits
    return {"peak_mib": peak_kib / 1024, "seconds": seconds, "first_s": built - start, "second_s": done - built,
            "logits_sum": float(logits.double().sum())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=16000)
    args = parser.parse_args(argv)

    import torch
    from dist import WorkerPool
    from transformers import AutoModelForCausalLM

    world = 2
    runs: dict[str, list[list[dict[str, Any]]]] = {"load_hf": [], "from_pretrained": []}
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(args.layers, args.hidden, args.vocab))
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        for _ in range(args.repeats):
            for how in runs:
                with WorkerPool(world) as pool:
                    runs[how].append(pool.run(_load, how, folder, timeout=600))
    same = {r["logits_sum"] for rs in runs.values() for ranks in rs for r in ranks}

    def per_rank(how: str, key: str) -> list[float]:
        return [round(statistics.median(ranks[r][key] for ranks in runs[how]), 3) for r in range(world)]

    ours, theirs = per_rank("load_hf", "peak_mib"), per_rank("from_pretrained", "peak_mib")
    t_ours, t_theirs = per_rank("load_hf", "seconds"), per_rank("from_pretrained", "seconds")
    report = {
        "benchmark": "load_hf",
        "model": f"llama {args.layers}x{args.hidden} vocab {args.vocab}",
        "params_m": round(params / 1e6, 1),
        "fp32_mib": round(params * 4 / 2**20, 1),
        "tp": world,
        "repeats": args.repeats,
        "peak_mib_per_rank": {"load_hf": ours, "from_pretrained_build": theirs},
        "seconds_per_rank": {"load_hf": t_ours, "from_pretrained_build": t_theirs},
        # load_hf: (build on meta, load_hf); from_pretrained_build: (from_pretrained, build)
        "parts_seconds_rank0": {how: [per_rank(how, "first_s")[0], per_rank(how, "second_s")[0]] for how in runs},
        "memory_ratio": round(max(ours) / max(theirs), 3),
        "time_ratio": round(max(t_ours) / max(t_theirs), 3),
        "same_logits": len(same) == 1,
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
