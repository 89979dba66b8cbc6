"""Derive pipeline stages from a schedule's stage cuts: a pure structural rewrite per stage.

Stage ``s`` is the schedule's model with

* only its own layers left in the cut sequence, under their original keys (a
  ``ModuleList`` whose ``_modules`` holds ``"2"``, ``"3"``: FQNs equal the original's);
* ``pre`` modules (embeddings) only in the first stage, ``post`` modules (final norm,
  head) only in the last, ``shared`` ones everywhere (see :mod:`.families`).

Only the modules on the path from the root to the sequence and the sequence itself are
copied; every kept subtree and parameter is shared with the schedule (O(depth × fan-out)).
The stage's annotations are the schedule's that still resolve in it, so ``build`` of a
stage schedule applies tensor parallelism, checkpointing and compilation to that stage
only. The model's own forward runs each stage: the first with the batch's ``input_ids``,
the others with the received hidden states as ``inputs_embeds``; attention masks and
position ids are keyword inputs every stage receives, so masks and RoPE are recomputed
locally and only the hidden states cross a boundary.

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    ...                   num_attention_heads=2, num_key_value_heads=2)
    >>> sch = sf.cut_pipeline_stage(sf.create_schedule(LlamaForCausalLM(cfg)), "model.layers.1")
    >>> [(s.index, s.layers, s.pre, s.post) for s in split_stages(sch)]
    [(0, ('0', '1'), True, False), (1, ('2', '3'), False, True)]
    >>> sorted(n for n, _ in split_stages(sch)[1].schedule.module.named_parameters())[:2]
    ['lm_head.weight', 'model.layers.2.input_layernorm.weight']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..errors import Problem, ScheduleError
from ..schedule import Schedule
from ..tree import child_names, get_module, join, shallow_clone, split
from .cut import PIPELINE_CUT, sequence_of
from .families import Family, Role, default_later, family_of, later_stand_in

__all__ = ["Stage", "roles", "split_stages"]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of a schedule.

    ``layers`` are the keys of its layers in the cut ``sequence``; ``pre``/``post``
    whether it holds the modules before/after the sequence; ``schedule`` the stage as a
    schedule of its own (build it with :func:`slapo_fn.build`).
    """

    index: int
    sequence: str
    layers: tuple[str, ...]
    pre: bool
    post: bool
    schedule: Schedule

    @property
    def layer_paths(self) -> tuple[str, ...]:
        return tuple(join(self.sequence, k) for k in self.layers)


def _plan_keys(owner: object, attr: str) -> tuple[str, ...] | None:
    plan = getattr(owner, attr, None)
    return tuple(plan) if isinstance(plan, Mapping) and plan else None


def roles(root: nn.Module, sequence: str, family: Family | None = None) -> dict[str, Role]:
    """``{path: role}`` of every child on the path from ``root`` to ``sequence`` that is
    not itself on that path (see :mod:`.families` for how roles are found)."""
    family = family if family is not None else family_of(root)
    out: dict[str, Role] = {}
    tokens = split(sequence)
    module, prefix = root, ""
    for token in tokens:
        names = child_names(module)
        config = getattr(module, "config", None)
        base_plan = _plan_keys(config, "base_model_pp_plan") if config is not None else None
        head_plan = _plan_keys(type(module), "_pp_plan")
        for name in names:
            if name == token:
                continue
            role: Role
            if base_plan is not None and token in base_plan:
                role = (
                    "shared"
                    if name not in base_plan
                    else ("pre" if base_plan.index(name) < base_plan.index(token) else "post")
                )
            elif head_plan is not None and name in head_plan:
                role = "post"
            else:
                role = "pre" if names.index(name) < names.index(token) else "post"
            out[join(prefix, name)] = family.roles.get(name, role)
        module = module._modules[token]  # type: ignore[assignment]
        prefix = join(prefix, token)
    return out


def _stand_in(
    kind_role: Role, module: nn.Module, path: str, stage: int, family: Family
) -> nn.Module:
    if kind_role == "post":
        return nn.Identity()
    name = split(path)[-1]
    return later_stand_in(family.later.get(name, default_later(module)), module, path, stage)


def _stage_tree(
    root: nn.Module, sequence: str, keep: tuple[str, ...], stage: int, first: bool, last: bool,
    found: Mapping[str, Role], family: Family,
) -> nn.Module:
    """The tree of one stage: ancestors of ``sequence`` cloned, everything else shared."""
    tokens = split(sequence)
    seq = shallow_clone(get_module(root, sequence))
    seq._modules = type(seq._modules)((k, v) for k, v in seq._modules.items() if k in keep)
    replacement: nn.Module = seq
    for depth in range(len(tokens) - 1, -1, -1):
        parent_path = join(*tokens[:depth])
        clone = shallow_clone(get_module(root, parent_path))
        for name, child in list(clone._modules.items()):
            path = join(parent_path, name)
            if name == tokens[depth]:
                clone._modules[name] = replacement
            elif child is not None:
                role = found.get(path, "shared")
                if (role == "pre" and not first) or (role == "post" and not last):
                    clone._modules[name] = _stand_in(role, child, path, stage, family)
        replacement = clone
    return replacement


def split_stages(sch: Schedule, *, family: Family | None = None) -> tuple[Stage, ...]:
    """The pipeline stages of ``sch`` (one per stage cut, plus one), in order.

    Pure: the schedule and its modules are unchanged; each stage shares every kept
    module and parameter with the schedule. A schedule without cuts is one stage.
    """
    cuts = tuple(sch.annotations.of_kind(PIPELINE_CUT))
    if not cuts:
        return (Stage(0, "", (), True, True, sch),)
    sequence = sequence_of(cuts[0])
    try:
        keys = tuple(child_names(get_module(sch.module, sequence)))
    except KeyError:
        raise ScheduleError(
            "split_stages",
            [Problem(sequence, "the cut sequence no longer exists in the schedule's tree", "cut after rewriting")],
        ) from None
    indices = sorted(keys.index(split(c)[-1]) for c in cuts)
    bounds = [0, *(i + 1 for i in indices), len(keys)]
    family = family if family is not None else family_of(sch.module)
    found = roles(sch.module, sequence, family)
    last = len(bounds) - 2
    stages = []
    for s in range(last + 1):
        keep = keys[bounds[s] : bounds[s + 1]]
        tree = _stage_tree(sch.module, sequence, keep, s, s == 0, s == last, found, family)
        stage_sch = sch.with_module(tree, replaced=("",))
        stage_sch = stage_sch.evolve(annotations=stage_sch.annotations.without(PIPELINE_CUT))
        stages.append(Stage(s, sequence, keep, s == 0, s == last, stage_sch))
    return tuple(stages)
