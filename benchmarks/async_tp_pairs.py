"""What inductor's async-TP matcher finds in a sequence-parallel LLaMA: slapo_fn beside
``parallelize_module``.

Micro-pipelined tensor parallelism (``torch._inductor.config._micro_pipeline_tp``) fuses
an all-gather with the matmuls that read its result, and a matmul with the reduce-scatter
of its output, where it recognises them in the graph (``micro_pipeline_tp.py``:
``find_all_gather_patterns``, ``find_reduce_scatter_patterns``). Its pass runs on CUDA
only; its matchers run on any graph. Here each model is compiled whole on 2 gloo ranks
by a backend that hands the forward and backward graphs AOTAutograd makes (with
inductor's decompositions, views as reshapes: what its post-grad passes see) to the matchers
and counts the collectives found and, of those, the pairs the pass would fuse (an
all-gather read by a matmul, a reduce-scatter of a matmul's output). Same plan both ways
(benchmarks/tp_overhead.py's, torchtitan's layout for PyTorch's side, whose LM head is
column-parallel: slapo_fn's is sharded alike, unless ``--recipe-head``), from the same weights.

Prints one JSON line::

    .venv/bin/python benchmarks/async_tp_pairs.py [--layers 2] [--hidden 128]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _counting_backend(found: dict[str, int]) -> Any:
    """A ``torch.compile`` backend that runs the async-TP matchers on each AOT graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes import micro_pipeline_tp as mp
    from torch._inductor.fx_passes.post_grad import remove_noop_ops, view_to_reshape

    def count(gm: Any, _: Any) -> Any:
        view_to_reshape(gm)  # as inductor hands its post-grad passes the graph,
        remove_noop_ops(gm.graph)  # and as they drop aliases and whole slices before the async-TP pass
        gathers = mp.find_all_gather_patterns(gm.graph)
        scatters = mp.find_reduce_scatter_patterns(gm.graph)
        found["all_gathers"] += len(gathers)
        found["reduce_scatters"] += len(scatters)
        found["all_gather_matmul"] += sum(bool(mp._find_consumer_matmuls(g.res_node)) for g in gathers)
        found["matmul_reduce_scatter"] += sum(mp._find_producer_matmul(s.input_node) is not None for s in scatters)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=count, bw_compiler=count, decompositions=select_decomp_table())


def _run(rank: int, world: int, layers: int, hidden: int, head: bool) -> dict[str, Any]:
    import torch
    import torch._dynamo
    from dist import mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from tp_overhead import _sp_styles
    from transformers import LlamaConfig, LlamaForCausalLM

    import slapo_fn as sf

    m = mesh((world,), ("tp",))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, use_cache=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    for engine in ("slapo_fn", "parallelize_module"):
        torch._dynamo.reset()
        found = dict.fromkeys(("all_gathers", "all_gather_matmul", "reduce_scatters", "matmul_reduce_scatter"), 0)
        if engine == "slapo_fn":
            sch = sf.recipes.for_model(model)(sf.create_schedule(model, mesh=m), tp=world, sequence_parallel=True)
            built = sf.build(sf.shard(sch, "lm_head", axis=0) if head else sch)
        else:
            built = parallelize_module(copy.deepcopy(model), m, _sp_styles(layers))
        compiled = torch.compile(built, backend=_counting_backend(found))
        compiled(ids).logits.float().pow(2).mean().backward()
        out[engine] = found
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--recipe-head", dest="head", action="store_false",
                        help="slapo_fn's LM head as its recipe leaves it (whole), not column-parallel as PyTorch's")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)

    from dist import WorkerPool

    with WorkerPool(2) as pool:
        results = pool.run(_run, args.layers, args.hidden, args.head, timeout=args.timeout)
    report = {"benchmark": "async_tp_pairs", "model": f"llama layers={args.layers} hidden={args.hidden}",
              "sequence_parallel": True, "world": 2,
              "lm_head": "column-parallel both ways" if args.head else "slapo_fn's whole",
              "found": results[0],
              "target": "slapo_fn's all_gather_matmul and matmul_reduce_scatter at least parallelize_module's"}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
