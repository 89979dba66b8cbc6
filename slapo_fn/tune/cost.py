"""The cost model that runs before any trial: per-rank memory and step time from shapes.

:func:`estimate` schedules the candidate with its recipe on the meta device over a fake
process group of the space's world size (nothing is allocated, no process started) and
asks :func:`slapo_fn.explain` — the same figures ``slapo-fn explain`` prints — for the
most loaded rank's memory and the step time on a hardware profile (``cpu`` by default):

* parameters, gradients and AdamW state — :func:`slapo_fn.memory.per_rank_memory`
  (tensor-parallel shards, FSDP shards, one pipeline stage);
* activations — :func:`slapo_fn.memory.activation_memory`, from a fake run; where
  that run fails, activations saved for backward by :func:`activation_bytes`, this formula (after
  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
  2022, counted in elements of the parameter dtype, ``e`` bytes each)::

      layer(b)  = s·b·(5·h + (4·h + m·f)/t) + 2·a·s²·b/t     (with sequence parallelism
                                                              the 5·s·b·h term is /t too)
      kept(b)   = s·b·h  (/t with sequence parallelism)      a checkpointed layer's input
      acts      = e · [ n·(L' − k)·layer(b) + n·k·kept(b) + (k > 0)·layer(b)
                        + n·(s·b·h + 2·s·b·V) ]

  with ``s`` the sequence length, ``h`` hidden size, ``f`` the MLP width, ``m`` 3 for a
  gated MLP (LLaMA: gate, up, activation) else 2, ``a`` heads, ``t`` = tp, ``V`` the
  vocabulary, ``L'`` the layers of one pipeline stage, ``k`` how many of them are
  checkpointed, ``b`` the sequences of one microbatch on one data-parallel rank
  (``batch / dp / microbatches``) and ``n`` the microbatches in flight on the first stage
  (1 without a pipeline; ``min(pp, microbatches)`` for 1F1B, all of them for GPipe). The
  ``(k > 0)·layer`` term is the one layer recomputed at a time in backward; ``s·b·h +
  2·s·b·V`` are the embedding output, the logits and their log-softmax.

A candidate *fits* when that sum is at most the budget. The estimate leaves out the
runtime's own footprint (CUDA context, allocator caching, the Python process), so the
budget is the memory the training state may use.

Example:
    >>> est = estimate(Config.of({"tp": 1, "checkpoint": None, "batch": 4}), "llama-tiny", world_size=1, seq=64)
    >>> est.state_bytes, est.activation_bytes > 0, est.fits(10**9)
    (1709056, True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..dtensor.testing import fake_world
from ..explain import explain
from ..hardware import HardwareProfile
from ..hf import (
    CONFIG_HEAD_COUNT_ATTRS,
    FFN_SIZE_ATTRS,
    GATED_MLP_MODEL_TYPES,
    HIDDEN_SIZE_ATTRS,
    LAYER_COUNT_ATTRS,
    config_of,
    config_value,
    model_type,
)
from ..memory import per_rank_memory
from ..presets import build_model
from ..recipes import Knobs, for_model
from ..schedule import create_schedule
from .space import Config

__all__ = ["Estimate", "ModelShape", "activation_bytes", "estimate"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the activation formula needs, read from a Hugging Face config."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    vocab: int
    gated: bool
    element_size: int = 4

    @staticmethod
    def of(config: Any) -> ModelShape:
        hidden = int(config_value(config, *HIDDEN_SIZE_ATTRS))
        return ModelShape(
            hidden=hidden,
            ffn=int(config_value(config, *FFN_SIZE_ATTRS, default=4 * hidden)),
            layers=int(config_value(config, *LAYER_COUNT_ATTRS)),
            heads=int(config_value(config, *CONFIG_HEAD_COUNT_ATTRS)),
            vocab=int(config_value(config, "vocab_size")),
            gated=model_type(config) in GATED_MLP_MODEL_TYPES,
        )


@dataclass(frozen=True)
class Estimate:
    """Per-rank bytes of the most loaded rank: training state and activations."""

    config: Config
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    #: The estimated step time and tokens/s of the whole job (``None`` without a profile).
    step_s: float | None = None
    tokens_per_s: float | None = None

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    def fits(self, budget: int | None) -> bool:
        return budget is None or self.total_bytes <= budget


def _microbatching(config: Config, shape: ModelShape) -> tuple[int, int, int]:
    """(sequences per microbatch, microbatches in flight, layers per stage) on the first stage."""
    batch, dp, pp = config.num("batch"), config.num("dp"), config.num("pp")
    per_rank = max(1, batch // dp)
    if pp <= 1:
        return per_rank, 1, shape.layers
    micro = config.num("microbatches") or 2 * pp
    in_flight = micro if config.get("schedule") == "gpipe" else min(pp, micro)
    return max(1, per_rank // micro), in_flight, math.ceil(shape.layers / pp)


def activation_bytes(config: Config, shape: ModelShape, seq: int) -> int:
    """Activations saved for backward on the most loaded rank (the formula above).

    >>> tiny = ModelShape(hidden=64, ffn=128, layers=2, heads=4, vocab=256, gated=True)
    >>> none, every = (activation_bytes(Config.of({"checkpoint": c, "batch": 4}), tiny, seq=64) for c in (None, 1.0))
    >>> none > every
    True
    """
    s, h, f, a, t = seq, shape.hidden, shape.ffn, shape.heads, max(1, config.num("tp"))
    sp = bool(config.get("sp")) and t > 1
    b, in_flight, layers = _microbatching(config, shape)
    m = 3 if shape.gated else 2
    replicated = 5 * s * b * h / (t if sp else 1)
    layer = replicated + s * b * (4 * h + m * f) / t + 2 * a * s * s * b / t
    kept = s * b * h / (t if sp else 1)
    ratio = config.get("checkpoint")
    k = 0 if ratio is None else round(layers * float(ratio))  # type: ignore[arg-type]
    elements = (in_flight * ((layers - k) * layer + k * kept) + (layer if k else 0)
                + in_flight * (s * b * h + 2 * s * b * shape.vocab))
    return math.ceil(elements) * shape.element_size


def _mesh(config: Config) -> Any:
    axes = [(n, config.num(n)) for n in ("dp", "pp", "tp") if config.num(n) > 1]
    if not axes:
        return None
    return init_device_mesh("cpu", tuple(s for _, s in axes), mesh_dim_names=tuple(n for n, _ in axes))


def estimate(config: Config, model: str | nn.Module, *, world_size: int, seq: int,
             hardware: str | HardwareProfile | None = "cpu") -> Estimate:
    """Schedule ``config`` for the preset (or ``config.json``) ``model`` on a fake process
    group and the meta device, and estimate the most loaded rank's memory and, with a
    ``hardware`` profile, the step time — both from :func:`slapo_fn.explain` (its fake
    run of one data-parallel rank's batch gives the activations; the closed formula
    :func:`activation_bytes` stands in where that run fails). Nothing is allocated and
    no process started. ``model`` may also be that preset already built on the meta
    device (scheduling never changes it), so that many configurations share one."""
    module = build_model(model, meta=True) if isinstance(model, str) else model
    dp, pp = config.num("dp"), config.num("pp")
    knobs = Knobs(tp=config.num("tp"), sequence_parallel=bool(config.get("sp")),
                  checkpoint=config.get("checkpoint"),  # type: ignore[arg-type]
                  stages=pp, dp_mode=config.get("dp_mode") if dp > 1 else None,  # type: ignore[arg-type]
                  kernels=bool(config.get("kernels")), compile=bool(config.get("compile")))
    micro = (config.num("microbatches") or 2 * pp) if pp > 1 else 1
    kind = str(config.get("schedule") or "1f1b")
    ids = torch.zeros((max(1, config.num("batch") // dp), seq), dtype=torch.long, device="meta")
    with fake_world(world_size):
        sch = for_model(module)(create_schedule(module, mesh=_mesh(config)), knobs)
        info = explain(sch, ids, microbatches=micro, pipeline_schedule=kind, hardware=hardware)
    table = info.memory if info.memory is not None else per_rank_memory(sch)
    row = max(table.rows, key=lambda r: r.total_bytes)
    acts = row.activation_bytes
    if acts is None:
        acts = activation_bytes(config, ModelShape.of(config_of(module)), seq)
    time = info.time
    return Estimate(config, row.param_bytes, row.grad_bytes, row.optimizer_bytes, acts,
                    step_s=None if time is None else time.step_s,
                    tokens_per_s=None if time is None else time.tokens_per_s_per_rank * world_size)
