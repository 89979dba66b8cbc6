"""What a compiled LLaMA decoder layer saves for backward, against the eager layer, on CPU.

``explain`` counts a module compiled with ``sf.compile`` as it runs eager (an upper bound
its memory note states): Inductor's min-cut partitioner recomputes cheap elementwise ops
in backward instead of saving their outputs. This measures by how much, three ways, on a
layer of ``llama-1b``'s proportions scaled down (hidden 512, 8 heads of 64, one KV head,
MLP 1408; the recipe's kernels; bf16):

* ``eager`` and ``compiled``: the bytes autograd saves per layer in a real forward
  (``saved_tensors_hooks``, parameters left out, a storage counted once), eager and under
  ``torch.compile`` (Inductor), from a model of 4 layers less one of 2, halved;
* ``partitioner_on_fake``: the same layer traced by AOTAutograd on fake CPU tensors (no
  compute) with Inductor's decompositions and its min-cut partitioner: the forward graph's
  outputs the backward reads, less views of parameters — what explain could count for a
  compiled module at any size without running it.

Prints one JSON line::

    .venv/bin/python benchmarks/compiled_saves.py [--tokens 512] [--batch 2]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._functorch.aot_autograd import aot_module
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

import slapo_fn as sf


def llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1408, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=1, use_cache=False)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def built(layers: int, compiled: bool) -> nn.Module:
    model = llama(layers)
    return sf.build(sf.recipes.for_model(model)(sf.create_schedule(model), kernels=True, compile=compiled))


def saved_bytes(run: Callable[[], Any], skip: set[StorageWeakRef]) -> int:
    """Bytes of the tensors autograd saves while ``run()`` runs, each storage once, ``skip`` left out."""
    seen, total = set(skip), [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(t.untyped_storage())
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total[0]


def measured_per_layer(compiled: bool, ids: torch.Tensor) -> float:
    """Saved bytes of one layer: a model of 4 layers less one of 2, halved (the second run, compiled)."""
    totals = []
    for layers in (2, 4):
        model = built(layers, compiled)
        params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
        for _ in range(2):  # the first compiled call compiles
            got = saved_bytes(lambda m=model: m(ids).logits, params)
        totals.append(got)
    return (totals[1] - totals[0]) / 2


def partitioned_on_fake(ids: torch.Tensor) -> int:
    """Saved bytes of layer 0 by AOTAutograd's min-cut partitioner on fake tensors."""
    model = built(2, False)
    layer = model.model.layers[0]
    call: dict[str, Any] = {}

    def grab(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        call["args"], call["kwargs"] = args, kwargs

    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(ids)
    handle.remove()
    held = len(list(layer.parameters())) + len(list(layer.buffers()))
    found: list[int] = []

    def partition(joint: Any, joint_inputs: Any, **kw: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kw)
        inputs = [n for n in fw.graph.nodes if n.op == "placeholder"]
        params = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in inputs[:held]}
        outputs = {n.name: n for n in fw.graph.output_node().args[0] if isinstance(n, torch.fx.Node)}
        seen: set[StorageWeakRef] = set()
        total = 0
        for n in bw.graph.nodes:
            node = outputs.get(n.name) if n.op == "placeholder" and not n.name.startswith("tangents") else None
            val = node.meta.get("val") if node is not None else None
            if not isinstance(val, torch.Tensor):
                continue
            key = StorageWeakRef(val.untyped_storage())
            if key not in params and key not in seen:
                seen.add(key)
                total += val.untyped_storage().nbytes()
        found.append(total)
        return fw, bw

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        def fake(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return mode.from_tensor(x)
            return tuple(fake(y) for y in x) if isinstance(x, tuple) else x

        args = [fake(a) for a in call["args"]]
        args[0].requires_grad_(True)
        kwargs = {k: fake(v) for k, v in call["kwargs"].items()}
        aot_module(layer, fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g, partition_fn=partition,
                   decompositions=select_decomp_table())(*args, **kwargs)
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="sequence length")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    ids = torch.randint(0, 512, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    eager = measured_per_layer(False, ids)
    compiled = measured_per_layer(True, ids)
    fake = partitioned_on_fake(ids)
    mib = 2**20
    print(json.dumps({"benchmark": "compiled_saves", "torch": torch.__version__, "batch": args.batch,
                      "tokens": args.tokens, "eager_mib_per_layer": round(eager / mib, 3),
                      "compiled_mib_per_layer": round(compiled / mib, 3),
                      "partitioner_on_fake_mib": round(fake / mib, 3),
                      "compiled_over_eager": round(compiled / eager, 3),
                      "note": "partitioner_on_fake counts layer 0 alone, with the rotary cos/sin it reads "
                              "(shared by every layer, so absent from the per-layer difference)"}))


if __name__ == "__main__":
    main()
