"""slapo_fn — a functional schedule language for training large PyTorch models.

A model is written once, plainly; how it trains fast is a *schedule*: a chain of pure
rewrites of its module tree, each returning a new :class:`Schedule`.

>>> import torch, torch.nn as nn, slapo_fn as sf
>>> model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
>>> sch = sf.create_schedule(model)
>>> sch = sf.checkpoint(sch, "0")
>>> sch = sf.annotate(sch, "2.weight", "lr_scale", 0.5)
>>> report = sf.verify(sch, torch.randn(2, 8))
>>> built = sf.build(sch)
"""

from . import func, kernels, optim, recipes
from .build import build
from .combinators import Primitive, Rewrite, chain, foreach, primitive, scope, when
from .dtensor import fork_rng, sequence_parallel, shard, sync, tp_local, vocab_parallel_cross_entropy
from .dtensor.data_parallel import data_parallel
from .dtensor.experts import expert_parallel, expert_tensor_parallel
from .dtensor.spec import P, Packed
from .errors import LayoutError, Problem, ScheduleError, ScheduleTypeError, SelectorError, VerificationError
from .explain import Explanation, explain
from .func import clip_grad_norm_
from .pipelines import Pipeline, build_pipeline, cut_pipeline_stage
from .rewrites import annotate, checkpoint, compile, hook, replace  # noqa: A004
from .rewrites.graph import Match, decompose, find, fuse, trace
from .schedule import Annotations, Key, Schedule, View, create_schedule
from .select import Selection, of_type, select, where_fn
from .state import full_state_dict, load, save
from .verify import VerifyReport, verified, verify
from .weights import WeightsMismatchError, load_hf, save_hf

__version__ = "0.1.0"

__all__ = [
    "Annotations",
    "Explanation",
    "Key",
    "LayoutError",
    "Match",
    "P",
    "Packed",
    "Pipeline",
    "Primitive",
    "Problem",
    "Rewrite",
    "Schedule",
    "ScheduleError",
    "ScheduleTypeError",
    "Selection",
    "SelectorError",
    "VerificationError",
    "VerifyReport",
    "View",
    "WeightsMismatchError",
    "annotate",
    "build",
    "build_pipeline",
    "chain",
    "checkpoint",
    "clip_grad_norm_",
    "compile",
    "create_schedule",
    "cut_pipeline_stage",
    "data_parallel",
    "decompose",
    "expert_parallel",
    "expert_tensor_parallel",
    "explain",
    "find",
    "foreach",
    "fork_rng",
    "full_state_dict",
    "func",
    "fuse",
    "hook",
    "kernels",
    "load",
    "load_hf",
    "of_type",
    "optim",
    "primitive",
    "recipes",
    "replace",
    "save",
    "save_hf",
    "scope",
    "select",
    "sequence_parallel",
    "shard",
    "sync",
    "tp_local",
    "trace",
    "verified",
    "verify",
    "vocab_parallel_cross_entropy",
    "when",
    "where_fn",
]
