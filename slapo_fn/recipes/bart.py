"""Bart (encoder-decoder): Megatron TP in both stacks, the decoder's cross-attention
included (the build gives attention its local head count); pipelines cut through the
encoder's layers, then the decoder's."""

from __future__ import annotations

from types import MappingProxyType

from ._recipe import Recipe, Shard, Stack

_ATTENTION = {"q_proj": Shard(0), "k_proj": Shard(0), "v_proj": Shard(0), "out_proj": Shard(1)}
_FF = {"fc1": Shard(0), "fc2": Shard(1)}


def _plan(*attentions: str) -> MappingProxyType[str, Shard]:
    return MappingProxyType({**{f"{a}.{k}": v for a in attentions for k, v in _ATTENTION.items()}, **_FF})


BART = Recipe(
    name="bart",
    model_types=("bart",),
    stacks=(
        Stack("model.encoder.layers.*", _plan("self_attn")),
        Stack("model.decoder.layers.*", _plan("self_attn", "encoder_attn")),
    ),
    heads="encoder_attention_heads",
    kv_heads="decoder_attention_heads",  # each head count the recipe checks against tp: the decoder's
)
