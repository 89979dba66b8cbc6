"""Schedules for Hugging Face model families, written only with the public API.

Each family is a :class:`Recipe` value — data plus combinators — taking the same
:class:`Knobs`: ``tp``, ``sequence_parallel``, ``checkpoint``, ``stages``, ``dp_mode``,
``kernels``, ``compile``. :func:`for_model` picks one from the model's config;
:func:`from_tp_plan` schedules any model that carries a ``base_model_tp_plan``.

Example:
    >>> import slapo_fn as sf
    >>> from slapo_fn.rewrites.checkpoint import CHECKPOINT
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                      num_attention_heads=4, vocab_size=128))
    >>> recipe = sf.recipes.for_model(model)
    >>> sch = recipe(sf.create_schedule(model), checkpoint=1.0, kernels=True)
    >>> recipe.name, sorted(sch.annotations.of_kind(CHECKPOINT))
    ('llama', ['model.layers.0', 'model.layers.1'])
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from torch import nn

from ..dtensor import shard
from ..errors import Problem, ScheduleError
from ..hf import model_type as model_type_of
from ..schedule import Schedule
from ._recipe import Knobs, Recipe, Shard, Stack
from .bert import BERT
from .gpt2 import GPT2
from .llama import LLAMA, QWEN3
from .opt import OPT
from .t5 import T5

__all__ = ["BERT", "GPT2", "LLAMA", "OPT", "QWEN3", "RECIPES", "T5", "Knobs", "Recipe", "Shard", "Stack", "for_model",
           "from_tp_plan"]

#: Every recipe, by name.
RECIPES: Mapping[str, Recipe] = MappingProxyType({r.name: r for r in (LLAMA, QWEN3, GPT2, BERT, OPT, T5)})


def for_model(model: nn.Module) -> Recipe:
    """The recipe for ``model``'s family, from its Hugging Face ``config.model_type``."""
    model_type = model_type_of(model)
    for recipe in RECIPES.values():
        if model_type in recipe.model_types:
            return recipe
    known = sorted(t for r in RECIPES.values() for t in r.model_types)
    raise ScheduleError("recipes.for_model", [Problem("", f"no recipe for model_type {model_type!r}",
                                                      f"known: {', '.join(known)}; or use from_tp_plan(sch) when "
                                                      "the model has a base_model_tp_plan")])


_STYLES = {"colwise": 0, "local_colwise": 0, "colwise_rep": 0, "rowwise": 1, "local_rowwise": 1, "rowwise_rep": 1}


def from_tp_plan(sch: Schedule, plan: Mapping[str, str] | None = None) -> Schedule:
    """Shard ``sch`` by a Hugging Face tensor-parallel plan (``{"layers.*.self_attn.q_proj":
    "colwise", …}``; default: the model's ``config.base_model_tp_plan``), over mesh axis
    ``"tp"``. Paths are relative to the base model (``model.`` is prefixed for a causal
    LM). Styles other than column/row-wise are refused by name.
    """
    model = sch.module
    if plan is None:
        plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    if not plan:
        raise ScheduleError("from_tp_plan", [Problem("", "the model has no base_model_tp_plan",
                                                     "pass plan={path: 'colwise' | 'rowwise'}")])
    prefix = getattr(model, "base_model_prefix", "")
    base = prefix if prefix and prefix in model._modules else ""
    bad = [Problem(path, f"tensor-parallel style {style!r} has no slapo_fn equivalent here",
                   "colwise/rowwise only, or write the layout with sf.shard/sf.sync")
           for path, style in plan.items() if style not in _STYLES]
    if bad:
        raise ScheduleError("from_tp_plan", bad)
    for path, style in plan.items():
        sch = shard(sch, f"{base}.{path}" if base else path, axis=_STYLES[style])
    return sch
