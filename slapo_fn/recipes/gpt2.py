"""GPT-2: Conv1D layers (weight stored (in, out)), so column-parallel shards tensor axis 1;
``c_attn`` is [Q|K|V] fused along that axis and shards each chunk (``packed=3``)."""

from __future__ import annotations

from types import MappingProxyType

from ..kernels import Attention, FusedMLP
from ._recipe import Recipe, Shard, Stack

GPT2 = Recipe(
    name="gpt2",
    model_types=("gpt2",),
    stacks=(
        Stack(
            "**.h.*",
            MappingProxyType({
                "attn.c_attn": Shard(1, packed=3),
                "attn.c_proj": Shard(0),
                "mlp.c_fc": Shard(1),
                "mlp.c_proj": Shard(0),
            }),
        ),
    ),
    sp=("**.h.*", "**.ln_f"),
    kernels=MappingProxyType({"**.h.*.attn": Attention.from_hf, "**.h.*.mlp": FusedMLP.from_hf}),
    heads="n_head",
    kv_heads=None,
)
