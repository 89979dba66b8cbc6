"""``torch.compile`` over tensor parallelism: slapo_fn beside ``parallelize_module``.

A LLaMA at tp=2 on 2 gloo ranks (``--sp``: with sequence parallelism, PyTorch's side
laid out as torchtitan does), the same plan both ways (benchmarks/tp_overhead.py's), from
the same weights. Each is run eager, with every decoder layer compiled (torchtitan's
way: ``Module.compile`` per block) and with the whole model compiled, inductor by
default. Reported per variant: the median step (forward, loss, backward, SGD update),
the compiled/eager ratio, the graphs dynamo made and its graph breaks. The issue's
target: slapo_fn's compiled/eager ratio no worse than ``parallelize_module``'s, with one
graph per block shape and no break.

Prints one JSON line::

    .venv/bin/python benchmarks/compile_tp.py [--sp] [--layers 4] [--hidden 256] [--repeats 10]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _run(rank: int, world: int, layers: int, hidden: int, repeats: int, sp: bool, backend: str) -> dict[str, Any]:
    import torch
    import torch._dynamo
    from dist import mesh
    from torch._dynamo.utils import counters
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from tp_overhead import _plan, _sp_styles
    from transformers import LlamaConfig, LlamaForCausalLM

    import slapo_fn as sf

    m = mesh((world,), ("tp",))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, use_cache=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))

    def slapo(where: str | None) -> torch.nn.Module:
        sch = sf.recipes.for_model(model)(sf.create_schedule(model, mesh=m), tp=world, sequence_parallel=sp)
        return sf.build(sch if where is None else sf.compile(sch, where, backend=backend))

    def torch_tp(where: str | None) -> torch.nn.Module:
        styles = _sp_styles(layers) if sp else {k: ColwiseParallel() if v == "colwise" else RowwiseParallel()
                                                for k, v in _plan(layers).items()}
        built = parallelize_module(copy.deepcopy(model), m, styles)
        if where == "":
            built.compile(backend=backend)
        elif where is not None:
            for layer in built.model.layers:
                layer.compile(backend=backend)
        return built

    torch._dynamo.reset()
    counters.clear()
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    out: dict[str, Any] = {}

    def step(name: str) -> float:
        built, opt = models[name]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        built(ids).logits.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    for engine, make in (("slapo_fn", slapo), ("parallelize_module", torch_tp)):
        for variant, where in (("eager", None), ("per_block", "model.layers.*"), ("whole", "")):
            name = f"{engine}/{variant}"
            graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
            built = make(where)
            models[name] = (built, torch.optim.SGD(built.parameters(), lr=1e-3))
            for _ in range(2):  # the compile, then a check that nothing recompiles
                step(name)
            out[name] = {"graphs": counters["stats"]["unique_graphs"] - graphs,
                         "breaks": sum(counters["graph_break"].values()) - breaks, "times": []}
    for _ in range(repeats):  # interleaved: load from other processes hits every variant alike
        for name in models:
            out[name]["times"].append(step(name))
    for entry in out.values():
        entry["step_s"] = statistics.median(entry.pop("times"))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)

    from dist import WorkerPool

    with WorkerPool(2) as pool:
        results = pool.run(_run, args.layers, args.hidden, args.repeats, args.sp, args.backend, timeout=args.timeout)
    runs = {k: {**v, "step_s": max(r[k]["step_s"] for r in results)} for k, v in results[0].items()}
    ratio = {engine: {variant: round(runs[f"{engine}/{variant}"]["step_s"] / runs[f"{engine}/eager"]["step_s"], 3)
                      for variant in ("per_block", "whole")} for engine in ("slapo_fn", "parallelize_module")}
    report = {"benchmark": "compile_tp", "model": f"llama layers={args.layers} hidden={args.hidden}",
              "sequence_parallel": args.sp, "world": 2, "backend": args.backend, "repeats": args.repeats,
              "step_median_s": {k: round(v["step_s"], 5) for k, v in runs.items()},
              "compiled_over_eager": ratio,
              "graphs": {k: v["graphs"] for k, v in runs.items()},
              "graph_breaks": {k: v["breaks"] for k, v in runs.items()},
              "target": "slapo_fn's compiled/eager no worse than parallelize_module's; one graph per block shape, "
                        "no break"}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
