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

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import func, kernels, optim, recipes
    from .build import build
    from .combinators import Primitive, Rewrite, chain, foreach, primitive, scope, when
    from .dtensor import (
        context_parallel,
        fork_rng,
        sequence_parallel,
        shard,
        sync,
        tp_local,
        vocab_parallel_cross_entropy,
    )
    from .dtensor.data_parallel import data_parallel
    from .dtensor.experts import expert_parallel, expert_tensor_parallel
    from .dtensor.spec import P, Packed
    from .errors import (
        HardwareError,
        LayoutError,
        Problem,
        ScheduleError,
        ScheduleTypeError,
        SelectorError,
        VerificationError,
    )
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

#: Where each public name lives. ``import slapo_fn`` imports none of them (nor torch):
#: each is imported on first use (PEP 562), so ``slapo-fn --help`` answers at once.
_EXPORTS: dict[str, str] = {
    "build": ".build",
    "Primitive": ".combinators",
    "Rewrite": ".combinators",
    "chain": ".combinators",
    "foreach": ".combinators",
    "primitive": ".combinators",
    "scope": ".combinators",
    "when": ".combinators",
    "context_parallel": ".dtensor",
    "fork_rng": ".dtensor",
    "sequence_parallel": ".dtensor",
    "shard": ".dtensor",
    "sync": ".dtensor",
    "tp_local": ".dtensor",
    "vocab_parallel_cross_entropy": ".dtensor",
    "data_parallel": ".dtensor.data_parallel",
    "expert_parallel": ".dtensor.experts",
    "expert_tensor_parallel": ".dtensor.experts",
    "P": ".dtensor.spec",
    "Packed": ".dtensor.spec",
    "HardwareError": ".errors",
    "LayoutError": ".errors",
    "Problem": ".errors",
    "ScheduleError": ".errors",
    "ScheduleTypeError": ".errors",
    "SelectorError": ".errors",
    "VerificationError": ".errors",
    "Explanation": ".explain",
    "explain": ".explain",
    "clip_grad_norm_": ".func",
    "Pipeline": ".pipelines",
    "build_pipeline": ".pipelines",
    "cut_pipeline_stage": ".pipelines",
    "annotate": ".rewrites",
    "checkpoint": ".rewrites",
    "compile": ".rewrites",
    "hook": ".rewrites",
    "replace": ".rewrites",
    "Match": ".rewrites.graph",
    "decompose": ".rewrites.graph",
    "find": ".rewrites.graph",
    "fuse": ".rewrites.graph",
    "trace": ".rewrites.graph",
    "Annotations": ".schedule",
    "Key": ".schedule",
    "Schedule": ".schedule",
    "View": ".schedule",
    "create_schedule": ".schedule",
    "Selection": ".select",
    "of_type": ".select",
    "select": ".select",
    "where_fn": ".select",
    "full_state_dict": ".state",
    "load": ".state",
    "save": ".state",
    "VerifyReport": ".verify",
    "verified": ".verify",
    "verify": ".verify",
    "WeightsMismatchError": ".weights",
    "load_hf": ".weights",
    "save_hf": ".weights",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule: sf.func, sf.recipes, sf.dtensor, ...
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """``slapo_fn`` itself. Importing a submodule sets it as an attribute of its package;
    where a public function has the submodule's name (``build``, ``explain``, ``verify``,
    ``select``), the function keeps the name, as it did when all were imported eagerly."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__version__ = "0.1.0"

__all__ = [
    "Annotations",
    "Explanation",
    "HardwareError",
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
    "context_parallel",
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
