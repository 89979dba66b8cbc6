"""Wide ResNets as torchvision builds them (``wide_resnet50_2``: ``layer1``..``layer4`` of
bottleneck blocks): activation checkpointing, ``compile`` and pipeline cuts act on the
blocks, data parallelism on the whole.

Tensor parallelism is Megatron's pair over channels in each block: ``conv1`` splits its
output channels (a column), ``bn1`` and the ReLU run on this rank's channels (the
BatchNorm's weight, bias and running statistics split with them), and ``conv2`` sums over
its input channels (a row): one all-reduce forward after ``conv2`` and one backward at
``conv1``'s input per block, where sharding the weights alone would gather them. ``conv3``,
its norms and the shortcut stay whole, as the ``fc`` head and the stem do."""

from __future__ import annotations

from types import MappingProxyType

from ._recipe import Recipe, Shard, Stack

WIDE_RESNET = Recipe(
    name="wide_resnet",
    model_types=(),  # torchvision models carry no Hugging Face config: call the recipe itself
    stacks=(Stack("layer{1,2,3,4}.*", MappingProxyType({
        "conv1": Shard(0),
        "bn1": Shard(0),
        "conv2": Shard(1),
    })),),
    heads="",
    kv_heads=None,
)
