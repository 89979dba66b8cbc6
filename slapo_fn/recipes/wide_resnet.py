"""Wide ResNets as torchvision builds them (``wide_resnet50_2``: ``layer1``..``layer4`` of
bottleneck blocks): activation checkpointing, ``compile`` and pipeline cuts act on the
blocks, data parallelism on the whole. It has no tensor-parallel plan: its layers are
convolutions, which ``sf.shard`` does not lay out as a whole yet, so ``tp > 1`` is refused
rather than run replicated."""

from __future__ import annotations

from ._recipe import Recipe, Stack

WIDE_RESNET = Recipe(
    name="wide_resnet",
    model_types=(),  # torchvision models carry no Hugging Face config: call the recipe itself
    stacks=(Stack("layer{1,2,3,4}.*"),),
    heads="",
    kv_heads=None,
)
