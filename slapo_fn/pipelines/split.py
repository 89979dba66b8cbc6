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
only; those of a module the stage holds a stand-in for (a later stage's position
embedding, which adds nothing there) are the original module's and are dropped with it.
The model's own forward runs each stage: the first with the batch's ``input_ids``, the
others with the received hidden states as ``inputs_embeds``; attention masks and
position ids are keyword inputs every stage receives, so masks and RoPE are recomputed
locally and only the hidden states cross a boundary.

A schedule cut in a model with several layer sequences (an encoder and a decoder), or
between calls of a shared layer, is split by :mod:`.chain` instead: each stage runs the
model's forward on the batch, the layers of earlier stages replayed, and what crosses a
boundary is the outputs of the layers later stages read.

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

from dataclasses import dataclass

from torch import nn

from ..errors import Problem, ScheduleError
from ..schedule import Schedule
from ..tree import child_names, get_module, join, split
from .chain import Chain, chain_stage_tree, stage_bounds
from .cut import PIPELINE_CUT, StageCut, cut_positions, sequence_of
from .families import Family, family_of, roles, stage_tree

__all__ = ["Stage", "roles", "split_stages"]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of a schedule.

    ``layer_paths`` are its layers; ``pre``/``post`` whether it holds the modules
    before/after the sequence (it is the first/last stage); ``schedule`` the stage as a
    schedule of its own (build it with :func:`slapo_fn.build`); ``chain`` the layer
    sequences of a model with several, whose stages replay the layers of the others
    (:mod:`.chain`), ``None`` for one cut sequence (later stages fed its hidden states);
    then ``bounds`` are every stage's first position in the chain's layer calls (and the
    end), and ``layer_paths`` the layer of each of its calls.
    """

    index: int
    layer_paths: tuple[str, ...]
    pre: bool
    post: bool
    schedule: Schedule
    chain: Chain | None = None
    bounds: tuple[int, ...] = ()

    @property
    def sequence(self) -> str:
        """The sequence holding the stage's last layer."""
        return sequence_of(self.layer_paths[-1]) if self.layer_paths else ""

    @property
    def layers(self) -> tuple[str, ...]:
        """The keys of the stage's layers in their sequences."""
        return tuple(split(p)[-1] for p in self.layer_paths)


def split_stages(sch: Schedule, *, family: Family | None = None) -> tuple[Stage, ...]:
    """The pipeline stages of ``sch`` (one per stage cut, plus one), in order.

    Pure: the schedule and its modules are unchanged; each stage shares every kept
    module and parameter with the schedule. A schedule without cuts is one stage.
    ``family`` defaults to the adapter :func:`.cut_pipeline_stage` resolved (and checked)
    when the cut was made.
    """
    marks = sch.annotations.of_kind(PIPELINE_CUT)
    cuts = tuple(marks)
    if not cuts:
        return (Stage(0, (), True, True, sch),)
    chain = next((c.chain for c in marks.values() if c.chain is not None), None)
    if chain is not None:
        return _chain_stages(sch, chain, marks)
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
    if family is None:
        family = next((c.family for c in marks.values() if c.family is not None), None) or family_of(sch.module)
    found = roles(sch.module, sequence, family)
    last = len(bounds) - 2
    stages = []
    for s in range(last + 1):
        keep = keys[bounds[s] : bounds[s + 1]]
        tree = stage_tree(sch.module, sequence, keep, s, s == 0, s == last, found, family)
        stage_sch = _stage_schedule(sch, tree)
        stages.append(Stage(s, tuple(join(sequence, k) for k in keep), s == 0, s == last, stage_sch))
    return tuple(stages)


def _stage_schedule(sch: Schedule, tree: nn.Module) -> Schedule:
    """``sch`` over one stage's ``tree``, with the annotations that still resolve in it
    and are still about the module they were made for: a path whose module the stage
    replaced by one of another class (a stand-in) drops its own annotations and its
    parameters' (a position embedding split by rows, standing in as zeros in a later
    stage, has no rows to split there). The stage cuts are dropped too.

    Example:
        >>> import torch.nn as nn, slapo_fn as sf
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> sch = sf.checkpoint(sf.checkpoint(sf.create_schedule(model), "0"), "1")
        >>> sorted(_stage_schedule(sch, nn.Sequential(nn.Identity(), model[1])).annotations)
        ['1']
    """
    staged = sch.with_module(tree, replaced=("",))
    stale = set()
    for path in staged.annotations:
        owner = path if _module_at(sch.module, path) is not None else join(*split(path)[:-1])
        before, after = _module_at(sch.module, owner), _module_at(tree, owner)
        if before is not None and after is not None and type(after) is not type(before):
            stale.add(path)
    return staged.evolve(annotations=staged.annotations.drop(stale).without(PIPELINE_CUT))


def _module_at(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return get_module(root, path)
    except (KeyError, AttributeError):
        return None


def _chain_stages(sch: Schedule, chain: Chain, marks: dict[str, StageCut]) -> tuple[Stage, ...]:
    try:
        bounds = stage_bounds(len(chain.order), [i for p, c in marks.items() for i in cut_positions(chain, p, c)])
    except ValueError:
        raise ScheduleError(
            "split_stages",
            [Problem(", ".join(chain.sequences), "the cut sequences no longer hold the cut layers in the schedule's "
                     "tree", "cut after rewriting")],
        ) from None
    stages = []
    last = len(bounds) - 2
    for s in range(last + 1):
        stage_sch = _stage_schedule(sch, chain_stage_tree(sch.module, chain, bounds, s))
        stages.append(Stage(s, chain.order[bounds[s]:bounds[s + 1]], s == 0, s == last, stage_sch, chain, bounds))
    return tuple(stages)
