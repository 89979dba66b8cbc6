"""Eager vs ``fuse``d elementwise chains on this CPU: forward+backward median time.

Cases, on the Hugging Face modules themselves (built from configs, GPT-2 / BERT-base
widths, 4 x 512 tokens, training mode):

* ``gpt2_mlp_bias_gelu_new`` — ``GPT2MLP``: ``c_fc`` (``Conv1D``) is decomposed and its
  bias add fused with GPT-2's ``gelu_new`` activation (``NewGELUActivation``: eight
  elementwise ops in eager);
* ``bert_bias_dropout_residual_layernorm`` — ``BertOutput``: ``dense`` is decomposed and
  its bias add fused with dropout (p = 0.1), the residual add and ``LayerNorm``; the
  fused dropout draws counter-based masks (``slapo_fn.kernels.counter_dropout``);
* ``contrast_single_op_gelu`` — a Linear -> ``F.gelu(approximate="tanh")`` -> Linear MLP
  whose bias + GeLU is two ATen kernels in eager: shown for contrast, fusion has
  little to remove there on a CPU.

Per case the medians (ms) of the whole module eager and with the region fused (both
include the matmuls, which fusion does not touch), of the matched region alone — the
elementwise-bound part — left eager (``compiler=None``) and compiled
(``compiler="inductor"``), their ratios, and the one-off compile time (s). The target
(>= 1.3x) is on the regions of the two Hugging Face cases. Prints one JSON line.
Run: ``python benchmarks/fusion.py [--repeat N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import slapo_fn as sf
from slapo_fn.rewrites.graph import call_module


class GeluMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


def bias_gelu_new(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return call_module(r"act", x + b)


def bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + b)


def bias_dropout_residual_norm(x: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(F.dropout(x + b) + r, (1,))


def step_time(model: nn.Module, inputs: tuple[torch.Tensor, ...], repeat: int) -> float:
    def step() -> None:
        model(*inputs).sum().backward()

    for _ in range(3):
        step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def case(
    model: nn.Module, linear: str, pattern: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], repeat: int
) -> dict[str, float]:
    sch = sf.decompose(sf.trace(sf.create_schedule(model), "", example_inputs=inputs), linear)
    (match,) = sf.find(sch, "", pattern)
    fused = sf.build(sf.fuse(sch, "", match))
    eager = sf.build(sf.create_schedule(model))
    for m in (fused, eager):
        m.train()
    start = time.perf_counter()
    fused(*inputs).sum().backward()
    compile_s = time.perf_counter() - start
    eager_ms = step_time(eager, inputs, repeat)
    fused_ms = step_time(fused, inputs, repeat)
    region = {kind: region_time(sf.build(sf.fuse(sch, "", match, compiler=compiler, name="region")), inputs, repeat)
              for kind, compiler in (("eager", None), ("fused", "inductor"))}
    return {
        "eager_ms": round(eager_ms, 3),
        "fused_ms": round(fused_ms, 3),
        "speedup": round(eager_ms / fused_ms, 3),
        "region_eager_ms": round(region["eager"], 3),
        "region_fused_ms": round(region["fused"], 3),
        "region_speedup": round(region["eager"] / region["fused"], 3),
        "compile_s": round(compile_s, 2),
    }


def region_time(built: nn.Module, inputs: tuple[torch.Tensor, ...], repeat: int) -> float:
    """Forward+backward of the matched region alone (the elementwise-bound part), on the
    arguments it receives inside the model."""
    built.train()
    seen: dict[str, tuple[torch.Tensor, ...]] = {}
    handle = built.region.register_forward_pre_hook(lambda module, args: seen.setdefault("args", args))
    built(*inputs)
    handle.remove()
    args = tuple(a.detach().clone().requires_grad_(a.is_floating_point()) for a in seen["args"])
    return step_time(built.region, args, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # torch.export's deprecation chatter while tracing
    from transformers import BertConfig, GPT2Config
    from transformers.models.bert.modeling_bert import BertOutput
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(0)
    dim, batch, seq = 768, 4, 512
    x = torch.randn(batch, seq, dim, requires_grad=True)
    h = torch.randn(batch, seq, 4 * dim, requires_grad=True)
    gpt2 = GPT2MLP(4 * dim, GPT2Config(n_embd=dim))
    bert = BertOutput(BertConfig(hidden_size=dim, intermediate_size=4 * dim))
    result = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "shape": {"tokens": batch * seq, "dim": dim},
        "gpt2_mlp_bias_gelu_new": case(gpt2, "c_fc", bias_gelu_new, (x,), args.repeat),
        "bert_bias_dropout_residual_layernorm": case(bert, "dense", bias_dropout_residual_norm, (h, x), args.repeat),
        "contrast_single_op_gelu": case(GeluMLP(dim), "c_fc", bias_gelu, (x,), args.repeat),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
