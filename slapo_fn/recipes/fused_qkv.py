"""BLOOM and Falcon: one ``query_key_value`` projection whose rows are whole groups of
heads (each head's [q|k|v], or each kv head's queries with its key and value), so a plain
column shard keeps whole groups on each rank; the build reads the groups from the
attention's traced view and makes its head counts this rank's, and cuts the ALiBi bias
the model builds for every head to this rank's heads."""

from __future__ import annotations

from types import MappingProxyType

from ._recipe import Recipe, Shard, Stack

COLUMN, ROW = Shard(0), Shard(1)

_FUSED = Stack(
    "**.h.*",
    MappingProxyType({
        "self_attention.query_key_value": COLUMN,
        "self_attention.dense": ROW,
        "mlp.dense_h_to_4h": COLUMN,
        "mlp.dense_4h_to_h": ROW,
    }),
)

BLOOM = Recipe(name="bloom", model_types=("bloom",), stacks=(_FUSED,), sp=("**.h.*", "**.ln_f"), heads="n_head",
               kv_heads=None)

#: Falcon's multi-query attention (falcon-7b: one key and one value head for every query head)
#: cannot split its kv head: the build refuses it at tp > 1, naming the attention.
FALCON = Recipe(name="falcon", model_types=("falcon",), stacks=(_FUSED,), sp=("**.h.*", "**.ln_f"),
                kv_heads="num_kv_heads")
