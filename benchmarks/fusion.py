"""Eager vs ``fuse``d elementwise chains on this CPU: forward+backward median time.

Cases: a GPT-2-style MLP (Linear -> bias + GeLU -> Linear; the bias+GeLU fused) and a
BERT-style output (Linear -> bias + dropout + residual + LayerNorm fused). Prints one
JSON line: per case the medians (ms) of the whole module eager and with the region fused
(both include the large matmuls, which fusion does not touch), of the matched region
alone — the elementwise-bound part — left eager (``compiler=None``) and compiled
(``compiler="inductor"``), their ratios, and the one-off compile time (s).
Run: ``python benchmarks/fusion.py``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import slapo_fn as sf


class GptMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class BertOutput(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dense = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(dim)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(self.dropout(self.dense(h)) + residual)


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
    sch = sf.decompose(sf.trace(sf.create_schedule(model), ""), linear)
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
    torch.manual_seed(0)
    dim, tokens, repeat = 768, 2048, 20
    x = torch.randn(tokens, dim, requires_grad=True)
    h = torch.randn(tokens, 4 * dim, requires_grad=True)
    result = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "shape": {"tokens": tokens, "dim": dim},
        "gpt2_mlp_bias_gelu": case(GptMLP(dim), "c_fc", bias_gelu, (x,), repeat),
        "bert_bias_dropout_residual_layernorm": case(
            BertOutput(dim), "dense", bias_dropout_residual_norm, (h, x), repeat
        ),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
