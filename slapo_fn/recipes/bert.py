"""BERT / RoBERTa encoders: Megatron TP on self-attention and the feed-forward block.

The row-parallel partners live in sibling modules (``attention.output.dense`` beside
``attention.self``, ``output.dense`` beside ``intermediate``), so the recipe states that
the column outputs stay sharded until them: one all-reduce per block each way."""

from __future__ import annotations

from types import MappingProxyType

from ..kernels import Attention
from ._recipe import Recipe, Shard, Stack

BERT = Recipe(
    name="bert",
    model_types=("bert", "roberta"),
    stacks=(
        Stack(
            "**.encoder.layer.*",
            MappingProxyType({
                "attention.self.query": Shard(0),
                "attention.self.key": Shard(0),
                "attention.self.value": Shard(0),
                "attention.output.dense": Shard(1),
                "intermediate.dense": Shard(0),
                "output.dense": Shard(1),
            }),
            sharded_outputs=("attention.self.{query,key,value}", "intermediate.dense"),
            sharded_inputs=("attention.output.dense", "output.dense"),
        ),
    ),
    sp=("**.encoder.layer.*",),
    kernels=MappingProxyType({"**.encoder.layer.*.attention.self": Attention.from_hf}),
    kv_heads=None,
)
