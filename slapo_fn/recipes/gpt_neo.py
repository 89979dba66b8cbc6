"""GPT-Neo decoders: Megatron TP on separate q/k/v projections (``nn.Linear``, unlike
GPT-2's packed ``Conv1D``) and the MLP; global and local (windowed) attention layers shard
alike, and the kernels keep each layer's window."""

from __future__ import annotations

from types import MappingProxyType

from ..kernels import Attention, FusedMLP
from ._recipe import Recipe, Shard, Stack

GPT_NEO = Recipe(
    name="gpt_neo",
    model_types=("gpt_neo",),
    stacks=(
        Stack(
            "**.h.*",
            MappingProxyType({
                "attn.attention.q_proj": Shard(0),
                "attn.attention.k_proj": Shard(0),
                "attn.attention.v_proj": Shard(0),
                "attn.attention.out_proj": Shard(1),
                "mlp.c_fc": Shard(0),
                "mlp.c_proj": Shard(1),
            }),
        ),
    ),
    sp=("**.h.*", "**.ln_f"),
    kernels=MappingProxyType({"**.h.*.attn.attention": Attention.from_hf, "**.h.*.mlp": FusedMLP.from_hf}),
    heads="num_heads",
    kv_heads=None,
)
