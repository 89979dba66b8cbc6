"""Tensor-parallel overhead: one training step of a LLaMA-family model on 2 gloo ranks,
three ways side by side in the same run, from the same initial weights:

(a) ``slapo_fn``: ``shard`` q/k/v/gate/up on axis 0 and o/down on axis 1, ``build``;
(b) ``parallelize_module``: the same plan with ``ColwiseParallel`` / ``RowwiseParallel``
    (``torch.distributed.tensor.parallel``) on a copy;
(c) Hugging Face's own plan (``config.base_model_tp_plan``, applied by
    ``transformers.distributed.tensor_parallel.apply_tensor_parallelism``) on a copy.

A step is forward, a mean-square loss on the logits, backward, an SGD update and
``zero_grad``. Variants are timed interleaved (one step of each per repeat, ranks
synchronised by a barrier before and after), so that load from other processes on the
machine hits all three alike; the median per variant is reported. Collectives per step
are counted with ``CommDebugMode`` (forward and backward separately) and compared with
``slapo_fn.explain``'s prediction.

With ``--sp`` the same comparison runs with sequence parallelism: (a) slapo_fn's
``sequence_parallel`` over the decoder layers and the final norm, (b) PyTorch's own SP
layout (torchtitan's: ``SequenceParallel`` norms, ``PrepareModuleInput`` into attention
and the MLP, row layers' ``output_layouts=Shard(1)``, the LM head gathering the
sequence). Collectives are also counted for the optimizer step (AdamW, for-loop
implementation for both: PyTorch's layout mixes DTensor and plain parameters).

Prints one JSON line::

    .venv/bin/python benchmarks/tp_overhead.py [--repeats 20] [--layers 4] [--hidden 512] [--sp]
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

_SHORT = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


def _counts(mode: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for k, v in mode.get_comm_counts().items():
        name = str(k).split(".")[-1].rstrip("_")
        if v:
            out[_SHORT.get(name, name)] = out.get(_SHORT.get(name, name), 0) + int(v)
    return out


def _plan(layers: int) -> dict[str, str]:
    plan: dict[str, str] = {}
    for i in range(layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = "colwise"
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = "rowwise"
    return plan


def _sp_styles(layers: int) -> dict[str, Any]:
    """PyTorch's sequence-parallel layout of a Hugging Face LLaMA (torchtitan's plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    styles: dict[str, Any] = {
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                             use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        styles.update({
            f"{p}.input_layernorm": SequenceParallel(),
            f"{p}.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                 desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            f"{p}.post_attention_layernorm": SequenceParallel(),
            f"{p}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{p}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            f"{p}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            styles[f"{p}.{name}"] = ColwiseParallel()
    return styles


def _run(
    rank: int, world: int, layers: int, hidden: int, batch: int, seq: int, repeats: int, sp: bool = False
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from dist import mesh
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    import slapo_fn as sf

    m = mesh((world,), ("tp",))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        use_cache=False,
    )
    model = LlamaForCausalLM(cfg)  # SDPA attention (the default), on local heads
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    plan = _plan(layers)

    # (a) slapo_fn
    attn = sf.shard.at("q_proj", axis=0) >> sf.shard.at("k_proj", axis=0) >> sf.shard.at("v_proj", axis=0)
    attn = attn >> sf.shard.at("o_proj", axis=1)
    mlp = sf.shard.at("gate_proj", axis=0) >> sf.shard.at("up_proj", axis=0) >> sf.shard.at("down_proj", axis=1)
    sch = sf.foreach("model.layers.*", sf.scope("self_attn", attn) >> sf.scope("mlp", mlp))(
        sf.create_schedule(model, mesh=m)
    )
    if sp:
        sch = sf.sequence_parallel(sch, ["model.layers.*", "model.norm"])
    tp = sf.explain(sch, ids).tensor_parallel
    assert tp is not None
    models: dict[str, nn.Module] = {"slapo_fn": sf.build(sch)}

    # (b) parallelize_module, the same plan
    styles: dict[str, ParallelStyle] = (
        _sp_styles(layers) if sp else {k: ColwiseParallel() if v == "colwise" else RowwiseParallel()
                                       for k, v in plan.items()}
    )
    models["parallelize_module"] = parallelize_module(copy.deepcopy(model), m, styles)

    # (c) Hugging Face's own plan (the config's base_model_tp_plan, expanded to this model's paths)
    hf_plan: dict[str, str] | None = None
    hf_error = ""
    try:
        if sp:
            raise NotImplementedError("not compared with --sp (Hugging Face's plan has no sequence parallelism)")
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        base = cfg.base_model_tp_plan or {}
        # module entries install the forwards; parameter entries shard the weights (what HF's loader does)
        hf_plan = {}
        for i in range(layers):
            for k, v in base.items():
                path = f"model.layers.{i}.{k.removeprefix('layers.*.')}"
                hf_plan[path + ".weight"] = v
                hf_plan[path] = v
        models["hf_tp_plan"] = apply_tensor_parallelism(copy.deepcopy(model), m, hf_plan)
    except Exception as e:  # reported, not hidden: the JSON says why (c) is missing
        hf_error = f"{type(e).__name__}: {e}"

    optims = {k: torch.optim.SGD(v.parameters(), lr=1e-3) for k, v in models.items()}
    for v in models.values():
        v.train()

    def step(name: str) -> float:
        out = models[name](ids).logits
        loss = out.float().pow(2).mean()
        loss.backward()
        optims[name].step()
        optims[name].zero_grad(set_to_none=True)
        return float(loss.detach())

    def counted(name: str) -> dict[str, dict[str, int]]:
        with CommDebugMode() as fwd:
            loss = models[name](ids).logits.float().pow(2).mean()
        with CommDebugMode() as bwd:
            loss.backward()
        models[name].zero_grad(set_to_none=True)
        return {"forward": _counts(fwd), "backward": _counts(bwd)}

    def optimizer_step(name: str) -> dict[str, int]:
        opt = torch.optim.AdamW(models[name].parameters(), lr=1e-3, foreach=False)
        models[name](ids).logits.float().pow(2).mean().backward()
        with CommDebugMode() as mode:
            opt.step()
        models[name].zero_grad(set_to_none=True)
        return _counts(mode)

    reference_loss = model(ids).logits.float().pow(2).mean().item()  # the unsharded model, same weights
    collectives = {k: counted(k) for k in models}
    first_loss = {k: step(k) for k in models}  # also a warm-up step
    for k in models:  # after the first step: this one changes the weights
        collectives[k]["optimizer_step"] = optimizer_step(k)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(repeats):
        for name in models:
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    sharded = {k: sum(isinstance(p, DTensor) for p in v.parameters()) for k, v in models.items()}
    return {
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "collectives": collectives,
        "explain_predicted": tp.counts(),
        "explain_bytes": {"forward": tp.bytes("forward"), "backward": tp.bytes("backward")},
        "first_loss": first_loss,
        "unsharded_loss": reference_loss,
        "dtensor_params": sharded,
        "hf_error": hf_error,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=540.0)
    parser.add_argument("--sp", action="store_true", help="with sequence parallelism (see the docstring)")
    args = parser.parse_args(argv)

    from dist import WorkerPool

    world = 2
    with WorkerPool(world) as pool:
        results = pool.run(_run, args.layers, args.hidden, args.batch, args.seq, args.repeats, args.sp,
                           timeout=args.timeout)
    # a step ends when the slowest rank is done: the per-variant median of the ranks' maximum
    median = {k: max(r["median_s"][k] for r in results) for k in results[0]["median_s"]}
    ref = median["parallelize_module"]
    r0 = results[0]
    report: dict[str, Any] = {
        "benchmark": "tp_overhead",
        "model": f"llama layers={args.layers} hidden={args.hidden} heads=8 kv_heads=4",
        "sequence_parallel": args.sp,
        "world": world,
        "backend": "gloo",
        "batch": args.batch,
        "seq": args.seq,
        "repeats": args.repeats,
        "step_median_s": {k: round(v, 5) for k, v in median.items()},
        "ratio_vs_parallelize_module": {k: round(v / ref, 3) for k, v in median.items()},
        "target_slapo_fn_ratio": 0.9,  # issue 11: at or below 0.9x parallelize_module's step
        "collectives_per_step": r0["collectives"],
        "explain_predicted": r0["explain_predicted"],
        "explain_matches_slapo_fn": r0["explain_predicted"] == {
            k: v for k, v in r0["collectives"]["slapo_fn"].items() if k != "optimizer_step"
        },
        "explain_collective_bytes": r0["explain_bytes"],
        "first_step_loss": r0["first_loss"],
        "unsharded_loss": r0["unsharded_loss"],
        "dtensor_params": r0["dtensor_params"],
    }
    if r0["hf_error"]:
        report["hf_tp_plan_error"] = r0["hf_error"]
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
