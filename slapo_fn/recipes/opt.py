"""OPT decoders: Megatron TP (the build gives attention its local head count)."""

from __future__ import annotations

from types import MappingProxyType

from ._recipe import Recipe, Shard, Stack

OPT = Recipe(
    name="opt",
    model_types=("opt",),
    stacks=(
        Stack(
            "**.decoder.layers.*",
            MappingProxyType({
                "self_attn.q_proj": Shard(0),
                "self_attn.k_proj": Shard(0),
                "self_attn.v_proj": Shard(0),
                "self_attn.out_proj": Shard(1),
                "fc1": Shard(0),
                "fc2": Shard(1),
            }),
        ),
    ),
    sp=("**.decoder.layers.*",),
    sp_optional=("**.decoder.final_layer_norm",),  # OPT-350m normalises in each layer, not after them
    kv_heads=None,
)
