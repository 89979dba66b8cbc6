"""LLaMA family (LLaMA, Qwen2, Mistral; Qwen3 with its per-head q/k norms): Megatron TP
with GQA, sequence parallelism, fused RMSNorm."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from ..kernels import Attention, RMSNorm
from ._recipe import Recipe, Shard, Stack

COLUMN, ROW = Shard(0), Shard(1)

LLAMA = Recipe(
    name="llama",
    model_types=("llama", "qwen2", "mistral"),
    stacks=(
        Stack(
            "**.layers.*",
            MappingProxyType({
                "self_attn.q_proj": COLUMN,
                "self_attn.k_proj": COLUMN,
                "self_attn.v_proj": COLUMN,
                "self_attn.o_proj": ROW,
                "mlp.gate_proj": COLUMN,
                "mlp.up_proj": COLUMN,
                "mlp.down_proj": ROW,
            }),
        ),
    ),
    sp=("**.layers.*", "**.norm"),
    attention="self_attn",
    kernels=MappingProxyType({
        "**.layers.*.self_attn": Attention.from_hf,
        "**.layers.*.{input,post_attention}_layernorm": RMSNorm.from_hf,
        "**.norm": RMSNorm.from_hf,
    }),
)

#: Qwen3 normalises q and k per head after the projections: on this rank's heads.
QWEN3 = replace(
    LLAMA,
    name="qwen3",
    model_types=("qwen3",),
    stacks=(replace(LLAMA.stacks[0], local=("self_attn.{q_norm,k_norm}",)),),
)
