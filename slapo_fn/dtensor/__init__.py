"""Tensor and sequence parallelism as DTensor layouts, with automatic resharding.

* :func:`shard` — DTensor parameters (column / row / vocab / packed / any parameter);
* :func:`sync` — state an activation's layout at a module boundary;
* :func:`sequence_parallel` — run a chain of modules on sequence shards;
* :func:`context_parallel` — split long sequences over a ``cp`` axis (K/V all-gathered);
* :func:`expert_parallel` — mixture-of-experts experts over a mesh axis, all-to-all dispatch;
* :func:`expert_tensor_parallel` — each expert's matrices split over a mesh axis (Megatron-style);
* :func:`fork_rng` — per-TP-rank randomness;
* :func:`tp_local` — replicated parameters of modules that see this rank's shard;
* :func:`vocab_parallel_cross_entropy` — the loss on vocab-sharded logits;
* :func:`~slapo_fn.dtensor.plan.plan` — the boundary contracts and collectives (pure);

The ``tensor_parallel`` build phase (:func:`~slapo_fn.dtensor.runtime.apply_tensor_parallel`)
turns the annotations into DTensor parameters and local-tensor forwards.
"""

from .context import context_parallel
from .experts import Experts, expert_parallel, expert_tensor_parallel
from .layout import Layout
from .local import tp_local
from .loss import vocab_parallel_cross_entropy
from .plan import plan
from .planned import Boundary, Plan
from .rng import fork_rng
from .roles import Column, EmbedDim, Gathered, Role, Row, VocabEmbed
from .runtime import apply_tensor_parallel
from .sequence import sequence_parallel
from .shard import shard
from .sync import sync

__all__ = [
    "Boundary",
    "Column",
    "EmbedDim",
    "Experts",
    "Gathered",
    "Layout",
    "Plan",
    "Role",
    "Row",
    "VocabEmbed",
    "apply_tensor_parallel",
    "context_parallel",
    "expert_parallel",
    "expert_tensor_parallel",
    "fork_rng",
    "plan",
    "sequence_parallel",
    "shard",
    "sync",
    "tp_local",
    "vocab_parallel_cross_entropy",
]
