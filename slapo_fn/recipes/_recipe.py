"""What a recipe is: data about one model family, and the knobs a user turns.

A :class:`Recipe` names where a family's repeated layers are, how each layer's linear
layers shard (a Megatron plan: column ``0`` / row ``1`` / packed), which modules run
sequence-parallel, which modules have fused kernels, and where pipeline cuts go.
:meth:`Recipe.__call__` turns it and a :class:`Knobs` value into one chain of public
rewrites, in a fixed order: kernels (replace) → tensor parallel (shard) → sequence
parallel → activation checkpointing → compile → pipeline cuts → data parallel (float8
linears, where asked, replace the layers' linears first, as torchtitan converts before it
parallelizes). Nothing
in here knows a model class: model-specific knowledge is the recipe's data.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Literal

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard as DShard

from ..combinators import Rewrite, chain, foreach
from ..dtensor import context_parallel, sequence_parallel, shard, sync, tp_local
from ..dtensor.data_parallel import data_parallel
from ..errors import HardwareError, LayoutError, Problem, ScheduleError, ScheduleTypeError, SelectorError
from ..kernels.float8 import float8_linear, float8_paths
from ..kernels.gpu import async_tp_problem, float8_problem
from ..pipelines import cut_pipeline_stage
from ..rewrites import checkpoint, compile, replace  # noqa: A004
from ..schedule import Schedule
from ..select import select

__all__ = ["Knobs", "Recipe", "Shard", "Stack"]

Factory = Callable[[nn.Module, str], nn.Module]


@dataclass(frozen=True)
class Shard:
    """How one linear layer of a block shards: ``axis`` 0 = column-parallel (output
    features), 1 = row-parallel (input features) — for Hugging Face ``Conv1D`` (weight
    stored (in, out)) the tensor axes are swapped, which the recipe states as data. A
    convolution shards the same way over its channels, and a norm over channels between
    a column and its row takes ``axis`` 0 (its channels split with the column's)."""

    axis: int
    packed: int = 1


@dataclass(frozen=True)
class Stack:
    """One sequence of repeated blocks (``layers``, a selector) and how each block's
    linear layers shard (``tp_plan``: paths relative to a block → :class:`Shard`)."""

    layers: str
    tp_plan: Mapping[str, Shard] = field(default_factory=lambda: MappingProxyType({}))
    local: tuple[str, ...] = ()  # modules that see this rank's shard (per-head norms): sf.tp_local
    # column modules whose row-parallel partners are not their siblings (BERT): the columns'
    # outputs stay sharded and the rows' inputs arrive sharded, stated with sync
    sharded_outputs: tuple[str, ...] = ()
    sharded_inputs: tuple[str, ...] = ()
    # modules that run on the whole sequence under sequence parallelism (a mixture-of-experts
    # block, whose routing reads every token): their input is gathered, their output split back
    whole: tuple[str, ...] = ()


#: The mesh axes of ``dp_mode="hsdp"``: the replicas, then the ranks each shards over.
HSDP_AXES: tuple[str, str] = ("dp_replicate", "dp")


@dataclass(frozen=True)
class Knobs:
    """The knobs of every recipe.

    * ``tp``: tensor-parallel degree over the mesh axis ``"tp"`` (1 = off);
    * ``sequence_parallel``: norms and dropout on sequence shards (needs ``tp > 1``);
    * ``checkpoint``: ``None``, a ratio of layers (``1.0`` = every layer, ``0.5`` = the
      first half) or explicit layer indices;
    * ``stages``: pipeline stages over the mesh axis ``"pp"``, cut evenly (``int``) or after
      the given layer indices, over the layers of every stack in order (T5's encoder, then
      its decoder);
    * ``dp_mode``: ``None`` or ``"fsdp"``/``"ddp"`` over ``"dp"``, or ``"hsdp"`` over
      :data:`HSDP_AXES` (replicas over ``"dp_replicate"``, each sharded over ``"dp"``);
    * ``kernels``: swap in the family's fused kernels;
    * ``compile``: ``torch.compile`` each layer;
    * ``cp``: context-parallel degree over the mesh axis ``"cp"`` (1 = off): each
      sequence split over ``cp`` ranks (:func:`~slapo_fn.dtensor.context.context_parallel`
      of the recipe's ``attention``);
    * ``cp_inputs_split``: with ``cp > 1``, the model takes each rank's chunks of the
      sequence from its loader (``inputs_split=True``; the training loop cuts them,
      :meth:`~slapo_fn.dtensor.context_runtime.ContextSplit.collate`) instead of the
      global batch;
    * ``float8``: the layers' linears as torchao's float8 training linears (torchtitan's
      recipe; :mod:`slapo_fn.kernels.float8`), sharded as the plain ones; refused with a
      :class:`~slapo_fn.errors.HardwareError` where this process has no CUDA GPU of
      compute capability 8.9 or more, or no torchao;
    * ``async_tp``: micro-pipelined tensor parallelism (torchtitan's async TP): inductor
      fuses each sequence-parallel all-gather with the matmuls reading it and each matmul
      with the reduce-scatter of its output, in the compiled layers (an inductor option of
      their ``torch.compile``; PyTorch sets up the symmetric memory itself). Needs ``tp > 1``,
      ``sequence_parallel`` and ``compile``; a :class:`~slapo_fn.errors.HardwareError` where
      this process has no CUDA GPU.
    """

    tp: int = 1
    sequence_parallel: bool = False
    checkpoint: float | tuple[int, ...] | None = None
    stages: int | tuple[int, ...] = 1
    dp_mode: Literal["fsdp", "ddp", "hsdp"] | None = None
    kernels: bool = False
    compile: bool = False
    cp: int = 1
    cp_inputs_split: bool = False
    float8: bool = False
    async_tp: bool = False


@dataclass(frozen=True)
class Recipe:
    """A model family's schedule, as data. ``stacks`` are its sequences of repeated
    blocks with their tensor-parallel plans (T5 has an encoder and a decoder stack);
    ``sp`` lists what runs sequence-parallel, in order, and ``sp_optional`` what joins it
    where the model has it (OPT-350m has no final norm); ``kernels`` maps selectors to
    replacement factories; ``extra_tp`` adds family-specific layout rewrites;
    ``heads``/``kv_heads`` name the config's head counts (checked against ``tp``)."""

    name: str
    model_types: tuple[str, ...]
    stacks: tuple[Stack, ...]
    sp: tuple[str, ...] = ()
    sp_optional: tuple[str, ...] = ()
    kernels: Mapping[str, Factory] = field(default_factory=lambda: MappingProxyType({}))
    extra_tp: Callable[[Schedule], Schedule] | None = None
    heads: str = "num_attention_heads"
    kv_heads: str | None = "num_key_value_heads"
    #: Each layer's attention module (relative to a stack's layers), which ``cp`` splits;
    #: ``None``: the family's attention cannot be split (:func:`~slapo_fn.dtensor.context.context_parallel`).
    attention: str | None = None

    def layer_paths(self, sch: Schedule) -> list[list[str]]:
        """The block paths of each stack, in order."""
        return [list(select(stack.layers).modules(sch.module)) for stack in self.stacks]

    def __call__(self, sch: Schedule, knobs: Knobs | None = None, **overrides: object) -> Schedule:
        """Schedule ``sch`` with ``knobs`` (a :class:`Knobs`, or its fields as keywords).
        Returns a new schedule; the input is unchanged."""
        knobs = _knobs(self.name, knobs, overrides)
        self._check(sch, knobs)
        stacks = self.layer_paths(sch)
        steps: list[Rewrite] = []
        if knobs.float8:
            converted = float8_paths(sch.module, [p for stack in stacks for p in stack], knobs.tp)
            if converted:
                steps.append(replace.at(converted, float8_linear))
        if knobs.kernels:
            steps += [replace.at(where, factory) for where, factory in self.kernels.items()]
        if knobs.cp > 1:
            steps.append(context_parallel.at([f"{stack.layers}.{self.attention}" for stack in self.stacks],
                                             inputs_split=knobs.cp_inputs_split))
        if knobs.tp > 1:
            for stack in self.stacks:
                block = chain(*(shard.at(path, axis=s.axis, packed=s.packed) for path, s in stack.tp_plan.items()))
                if stack.local:
                    block = block >> tp_local.at(list(stack.local))
                if stack.sharded_outputs:
                    block = block >> sync.at(list(stack.sharded_outputs), "fwd_post", DShard(-1))
                if stack.sharded_inputs:
                    block = block >> sync.at(list(stack.sharded_inputs), "fwd_pre", DShard(-1), src=DShard(-1))
                steps.append(foreach(stack.layers, block))
            if knobs.sequence_parallel:
                steps.append(sequence_parallel.at([*self.sp, *(p for p in self.sp_optional if _has(sch, p))]))
                steps += [foreach(stack.layers, sync.at(list(stack.whole), "fwd_pre", Replicate(), src=DShard(1))
                                  >> sync.at(list(stack.whole), "fwd_post", DShard(1), src=Replicate()))
                          for stack in self.stacks if stack.whole]
        layers = [p for stack in stacks for p in stack]
        chosen = _checkpointed(layers, knobs.checkpoint)
        if chosen:
            steps.append(checkpoint.at(chosen))
        if knobs.compile:
            # async TP: inductor's micro-pipeline pass in these graphs only (no global config)
            steps.append(compile.at(layers, options={"_micro_pipeline_tp": True}) if knobs.async_tp
                         else compile.at(layers))
        # the stages run through every stack's layers, in order (an encoder's, then a decoder's)
        # in one call: one cut at a time would pass through stage counts the pp axis cannot
        # place (3 stages of 4 on 2 ranks)
        cuts = _cuts(list(dict.fromkeys(layers)), knobs.stages)
        if cuts:
            steps.append(cut_pipeline_stage.at(cuts))
        if knobs.dp_mode is not None:
            steps.append(data_parallel.at(mode=knobs.dp_mode, mesh_axis=HSDP_AXES) if knobs.dp_mode == "hsdp"
                         else data_parallel.at(mode=knobs.dp_mode))  # over data_parallel's own axis, "dp"
        sch = chain(*steps)(sch)
        if knobs.tp > 1 and self.extra_tp is not None:
            sch = self.extra_tp(sch)
        return sch

    def _check(self, sch: Schedule, knobs: Knobs) -> None:
        hardware = [found for on, check in ((knobs.float8, float8_problem), (knobs.async_tp, async_tp_problem))
                    if on and (found := check()) is not None]
        if hardware:
            raise HardwareError(f"recipes.{self.name}", hardware)
        problems = []
        if knobs.async_tp and not (knobs.tp > 1 and knobs.sequence_parallel and knobs.compile):
            problems.append(Problem("", "async_tp fuses the all-gathers and reduce-scatters of sequence parallelism "
                                        "with their matmuls in compiled layers: it needs tp > 1, sequence_parallel "
                                        "and compile",
                                    "set tp=2 (or more), sequence_parallel=True and compile=True, or drop async_tp"))
        config = getattr(sch.module, "config", None)
        if knobs.tp > 1:
            names = tuple(getattr(sch.mesh, "mesh_dim_names", None) or ())
            if "tp" not in names or sch.mesh is None or sch.mesh.size(names.index("tp")) != knobs.tp:
                problems.append(Problem("", f"tp={knobs.tp} needs a mesh with a 'tp' axis of size {knobs.tp}; the "
                                            f"schedule's mesh is {names or 'missing'}",
                                        'sf.create_schedule(model, mesh=init_device_mesh("cpu", (tp,), '
                                        'mesh_dim_names=("tp",)))'))
            if not any(stack.tp_plan for stack in self.stacks) and self.extra_tp is None:
                problems.append(Problem("", f"tp={knobs.tp}: recipe {self.name!r} has no tensor-parallel plan (its "
                                            "stacks shard no layer), so every rank would compute the whole model",
                                        "drop tp (tp=1, or --tp 1) and scale with dp_mode, checkpoint or stages"))
            for attr in (self.heads, self.kv_heads):
                count = getattr(config, attr, None) if attr else None
                if isinstance(count, int) and count % knobs.tp:
                    problems.append(Problem("", f"{attr}={count} is not divisible by tp={knobs.tp}",
                                            f"choose tp among the divisors of {count}"))
        if knobs.cp > 1 and self.attention is None:
            problems.append(Problem("", f"cp={knobs.cp}: recipe {self.name!r} names no attention module that "
                                        "context parallelism can split",
                                    "drop cp (cp=1, or --cp 1)"))
        if knobs.tp < 1:
            problems.append(Problem("", f"tp={knobs.tp}: a tensor-parallel degree is at least 1", "tp=1 is off"))
        if knobs.sequence_parallel and knobs.tp == 1:
            problems.append(Problem("", "sequence_parallel needs tp > 1", "set tp=2 (or more) or drop it"))
        elif knobs.sequence_parallel and not [*self.sp, *(p for p in self.sp_optional if _has(sch, p))]:
            problems.append(Problem("", f"sequence_parallel: recipe {self.name!r} names no modules to run on "
                                        "sequence shards", "drop sequence_parallel (--sp); tp alone still applies"))
        if isinstance(knobs.checkpoint, float) and not 0.0 <= knobs.checkpoint <= 1.0:
            problems.append(Problem("", f"checkpoint ratio {knobs.checkpoint} is not in [0, 1]",
                                    "checkpoint=1.0 checkpoints every layer"))
        problems += _stage_problems(sch, knobs, self)
        if problems:
            raise LayoutError(f"recipes.{self.name}", problems)


_KNOB_TYPES: dict[str, tuple[type, ...]] = {
    "tp": (int,), "sequence_parallel": (bool,), "checkpoint": (float, int, tuple, type(None)), "stages": (int, tuple),
    "dp_mode": (str, type(None)), "kernels": (bool,), "compile": (bool,), "cp": (int,), "float8": (bool,),
    "async_tp": (bool,), "cp_inputs_split": (bool,),
}


def _knobs(name: str, knobs: Knobs | None, overrides: Mapping[str, object]) -> Knobs:
    """``knobs`` with ``overrides``; unknown names and values of the wrong type are refused
    together, naming each knob and listing the valid ones."""
    if knobs is not None and not isinstance(knobs, Knobs):
        raise ScheduleTypeError(f"recipes.{name}", [Problem(
            "knobs", f"expected a Knobs value, got {type(knobs).__name__}",
            "pass Knobs(tp=2, ...) or the knobs as keywords: recipe(sch, tp=2, checkpoint=1.0)")])
    valid = [f.name for f in fields(Knobs)]
    problems = []
    for key, value in overrides.items():
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(Problem(key, "is not a recipe knob", f"{hint}valid knobs: {', '.join(valid)}"))
        elif not isinstance(value, _KNOB_TYPES[key]) or (isinstance(value, bool) and bool not in _KNOB_TYPES[key]):
            problems.append(Problem(key, f"expects {' or '.join(t.__name__ for t in _KNOB_TYPES[key])}, got "
                                         f"{type(value).__name__} {value!r}", f"see help(Knobs) for what {key} means"))
    if problems:
        raise ScheduleTypeError(f"recipes.{name}", problems)
    merged = {**(vars(knobs) if knobs else {}), **overrides}
    if isinstance(merged.get("checkpoint"), int) and not isinstance(merged["checkpoint"], bool):
        merged["checkpoint"] = float(merged["checkpoint"])  # checkpoint=1 is the ratio 1.0
    return Knobs(**merged)  # type: ignore[arg-type]


def _stage_problems(sch: Schedule, knobs: Knobs, recipe: Recipe) -> list[Problem]:
    """Pipeline stages need a ``pp`` mesh axis (``stages=3`` on a mesh without one is
    refused) and, cut evenly, at most one stage per layer."""
    stages = knobs.stages
    many = stages > 1 if isinstance(stages, int) else bool(stages)
    names = tuple(getattr(sch.mesh, "mesh_dim_names", None) or ())
    problems = []
    if many and "pp" not in names:
        problems.append(Problem("", f"stages={stages} needs a mesh with a 'pp' axis; the schedule's mesh is "
                                    f"{names or 'missing'}",
                                'sf.create_schedule(model, mesh=init_device_mesh("cpu", (pp,), '
                                'mesh_dim_names=("pp",))) (or add "pp" to the mesh\'s axes), or drop stages'))
    layers = len({p for stack in recipe.layer_paths(sch) for p in stack})
    if isinstance(stages, int) and not 1 <= stages <= layers:
        problems.append(Problem("", f"stages={stages} for {layers} layers", f"use 1..{layers} stages"))
    if isinstance(stages, tuple):
        bad = [i for i in stages if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers - 1]
        if bad:
            problems.append(Problem("", f"stages={stages}: cut(s) after layer(s) {bad} impossible with {layers} "
                                        "layers (a cut goes after a layer, not the last)",
                                    f"cut after layer indices in 0..{layers - 2}"))
    return problems


def _checkpointed(layers: Sequence[str], which: float | tuple[int, ...] | None) -> list[str]:
    if which is None:
        return []
    if not isinstance(which, tuple):  # a ratio of the layers
        return list(layers[: round(len(layers) * float(which))])
    bad = [i for i in which if not 0 <= i < len(layers)]
    if bad:
        raise ScheduleError("recipes", [Problem("", f"checkpoint layer(s) {bad} out of range: the model has "
                                                    f"{len(layers)} layers", f"use indices 0..{len(layers) - 1}")])
    return [layers[i] for i in which]


def _cuts(layers: Sequence[str], stages: int | tuple[int, ...]) -> list[str]:
    if isinstance(stages, int):  # 1..len(layers), checked by Recipe._check
        return [layers[len(layers) * i // stages - 1] for i in range(1, stages)]
    return [layers[i] for i in stages]


def _has(sch: Schedule, where: str) -> bool:
    """Whether ``where`` selects any module of ``sch``'s model."""
    try:
        return bool(select(where).modules(sch.module))
    except SelectorError:
        return False
