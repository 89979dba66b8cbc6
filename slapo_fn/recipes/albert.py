"""ALBERT encoders: one layer's parameters shared by every call of it (``num_hidden_layers``
calls of ``num_hidden_groups`` groups), Megatron TP inside that layer.

The attention module holds its own output projection, residual and norm (``dense``,
``LayerNorm``), so both Megatron pairs are siblings (``attention.{query,key,value}`` →
``attention.dense``, ``ffn`` → ``ffn_output``): one all-reduce per pair each way, per call.
Activation checkpointing and ``compile`` act on the shared layer (every call of it);
pipeline stages are cut between layer *modules*, of which a one-group ALBERT has one.
With ``sequence_parallel`` the feed-forward pair runs Megatron-SP (all-gather in,
reduce-scatter out) and the attention block on the whole sequence (all-gather in, all-reduce
out, its output sliced back to this rank's tokens)."""

from __future__ import annotations

from types import MappingProxyType

from ..kernels import Attention
from ._recipe import Recipe, Shard, Stack

_LAYERS = "**.encoder.albert_layer_groups.*.albert_layers.*"

ALBERT = Recipe(
    name="albert",
    model_types=("albert",),
    stacks=(
        Stack(
            _LAYERS,
            MappingProxyType({
                "attention.query": Shard(0),
                "attention.key": Shard(0),
                "attention.value": Shard(0),
                "attention.dense": Shard(1),
                "ffn": Shard(0),
                "ffn_output": Shard(1),
            }),
            # under sequence parallelism the attention block runs on the whole sequence (its
            # input gathered, its output split back): its own residual and norm read the input
            # the projections read, which the planner gathers once for both
            whole=("attention",),
        ),
    ),
    sp=(_LAYERS,),
    kernels=MappingProxyType({f"{_LAYERS}.attention": Attention.from_hf}),
    kv_heads=None,
)
