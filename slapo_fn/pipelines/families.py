"""Per-family knowledge for splitting a model into pipeline stages: data, not code paths.

A stage keeps only its own layers of the cut sequence; the other children on the path
from the root to that sequence are *roles*:

* ``pre``  — runs before the sequence (embeddings): kept in the first stage only;
* ``post`` — runs after it (final norm, LM head, pooler): kept in the last stage only;
* ``shared`` — needed by every stage (LLaMA's ``rotary_emb``: no parameters, recomputes
  RoPE from the position ids each stage receives).

Roles come from the model's own structure: Hugging Face's ``base_model_pp_plan`` (its
keys are in execution order; children it does not list are shared) and ``_pp_plan`` (heads
after the base model) where the model has them, else the order in which children were
registered. A :class:`Family` overrides what that gets wrong for one model type and says
what replaces a ``pre`` module in the stages after the first, which are fed hidden states
through the model's ``inputs_embeds`` argument:

* ``absent`` (default for modules with parameters): a :class:`NotInStage` that fails
  loudly if called — a family whose forward calls it with ``inputs_embeds`` needs an entry;
* ``identity`` (default for modules without parameters, e.g. dropout, applied once, in
  the first stage);
* ``zeros``: a scalar zero, for position embeddings added inside the forward (GPT-2
  ``wpe``, OPT ``embed_positions``);
* ``inputs``: returns its ``inputs_embeds`` argument (BERT's ``embeddings`` module).

``post`` modules in stages before the last become ``nn.Identity``.

Example:
    >>> FAMILIES["gpt2"].later["wpe"]
    'zeros'
    >>> family_of(object()) == Family()
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeAlias

import torch
from torch import nn

from ..errors import Problem, ScheduleError
from ..hf import PIPELINE_STAGES, StageRole, StageStandIn, model_type

__all__ = [
    "FAMILIES",
    "Family",
    "InputsEmbeds",
    "Later",
    "NotInStage",
    "Role",
    "ZeroPositions",
    "family_of",
    "later_stand_in",
]

Role: TypeAlias = StageRole
Later: TypeAlias = StageStandIn


@dataclass(frozen=True)
class Family:
    """Stage-split knowledge for one model type (``config.model_type``).

    ``roles`` overrides the role of a child (by its name at any level on the path to the
    sequence); ``later`` says what stands in for a ``pre`` module in later stages.
    """

    roles: Mapping[str, Role] = field(default_factory=lambda: MappingProxyType({}))
    later: Mapping[str, Later] = field(default_factory=lambda: MappingProxyType({}))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Family) and dict(self.roles) == dict(other.roles) and dict(self.later) == dict(
            other.later
        )

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.roles.items())), tuple(sorted(self.later.items()))))


#: Hugging Face model types whose stage split is known to be right: the structural
#: defaults (LLaMA-like forwards feed inputs_embeds straight to the layers), or more
#: (the per-family data lives in :data:`slapo_fn.hf.PIPELINE_STAGES`).
FAMILIES: Mapping[str, Family] = MappingProxyType(
    {name: Family(roles, later) for name, (roles, later) in PIPELINE_STAGES.items()}
)


def family_of(model: Any) -> Family:
    """The :class:`Family` of ``model`` (by ``model.config.model_type``); the structural
    defaults for a model that is not a Hugging Face one.

    A Hugging Face model type without an entry is refused rather than guessed: its
    forward may transform ``inputs_embeds`` (Gemma scales them by sqrt(hidden)), which the
    later stages would then apply again, silently.
    """
    kind = model_type(model)
    if kind is None:
        return Family()
    if kind not in FAMILIES:
        raise ScheduleError("cut_pipeline_stage", [Problem(
            "", f"no pipeline stage adapter for model_type {kind!r} (known: {', '.join(sorted(FAMILIES))})",
            f"check what {type(model).__name__}.forward does with inputs_embeds and the modules before its layers, "
            "then pass family=Family(...) to split_stages, or add the model type to "
            "slapo_fn.pipelines.families.FAMILIES")])
    return FAMILIES[kind]


class NotInStage(nn.Module):
    """Stands in for a module that lives in another pipeline stage; calling it is an error."""

    def __init__(self, path: str, stage: int, owner: str) -> None:
        super().__init__()
        self.path = path
        self.stage = stage
        self.owner = owner

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(
            f"slapo_fn pipeline: {self.path!r} lives in the {self.owner} stage, but stage {self.stage}'s forward "
            f"called it. This model family needs a stage adapter: add its model_type to "
            f"slapo_fn.pipelines.families.FAMILIES with later={{{self.path.rsplit('.', 1)[-1]!r}: 'zeros' | "
            f"'identity' | 'inputs'}}"
        )

    def extra_repr(self) -> str:
        return f"{self.path!r} is in the {self.owner} stage"


class ZeroPositions(nn.Module):
    """A position embedding that adds nothing: returns a scalar zero (broadcasts)."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(())


class InputsEmbeds(nn.Module):
    """An embeddings module that passes ``inputs_embeds`` (the received hidden states) on."""

    def forward(self, *args: Any, inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if inputs_embeds is None:
            raise RuntimeError("slapo_fn pipeline: a later stage's embeddings need inputs_embeds (the hidden states)")
        return inputs_embeds


def later_stand_in(kind: Later, module: nn.Module, path: str, stage: int) -> nn.Module:
    """The module standing in for the ``pre`` module ``module`` (at ``path``) in ``stage``."""
    if kind == "identity":
        return nn.Identity()
    if kind == "zeros":
        return ZeroPositions()
    if kind == "inputs":
        return InputsEmbeds()
    return NotInStage(path, stage, "first")


def default_later(module: nn.Module) -> Later:
    """``identity`` for a module without parameters (dropout), else ``absent``."""
    return "absent" if any(True for _ in module.parameters()) else "identity"
