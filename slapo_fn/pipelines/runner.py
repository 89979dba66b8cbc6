"""``build_pipeline``: this rank's pipeline stages and a training-step runner.

The engine is ``torch.distributed.pipelining``: every stage this rank owns is built with
:func:`slapo_fn.build` from its stage schedule (:func:`.split_stages`) — so tensor
parallelism, checkpointing and compilation apply to the stage only — and wrapped in a
``PipelineStage`` over the process group of the mesh's ``pp`` axis; a
``torch.distributed.pipelining`` schedule runs the microbatches.

How the stages talk to the unmodified model: a forward-pre-hook on each built stage
passes the received hidden states as ``inputs_embeds`` (the first stage gets the
batch's ``input_ids``), keyword inputs (``attention_mask``, ``position_ids``) reach every
stage, and a forward hook returns the tensor that crosses to the next stage — the output of the
stage's last layer, captured by a hook on it — or, in the last stage, the model output's
``logits`` (or ``last_hidden_state``) that goes into ``loss_fn``.
These hooks live on build's private copies only.

Tied parameters split across stages (GPT-2's ``wte``/``lm_head``): each owning stage
holds its own copy, initialised equal. After the backward of every :meth:`Pipeline.step`
their gradients are summed over the owning stages (locally, then an all-reduce over a
process group of just the owning ranks), so every copy holds the full gradient of the
tied parameter — the single-process gradient. Where the stages' plans lay the copies out
differently (an embedding split by features in the first stage, the tied LM head whole in
the last), each rank's pieces would not line up: the gradient is then summed whole and
each copy takes its own layout of the sum (:attr:`TiedGroup.whole`). An optimizer that treats all copies alike
(one optimizer type and hyper-parameters on every rank, as usual) then keeps them equal
after every step, bit for bit.

Example (on every rank of a 2-rank job; needs a process group)::

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    sch = sf.cut_pipeline_stage(sf.create_schedule(model, mesh=mesh), "model.layers.1")
    pipe = sf.build_pipeline(sch, microbatches=4, schedule="1f1b", loss_fn=loss_fn)
    opt = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(input_ids, target=labels)   # the same loss on every rank
    opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from ..build import BuildOptions, build, has_meta, materialise
from ..dtensor.arriving import stated_model_output
from ..dtensor.context_runtime import pipeline_loss, pipeline_problems
from ..dtensor.layout import Layout
from ..dtensor.runtime import refused
from ..dtensor.sequence import SEQ
from ..dtensor.shard import LAYOUT
from ..dtensor.sync import SYNC
from ..errors import LayoutError, Problem, ScheduleError, ScheduleTypeError
from ..hf import init_owner, is_pretrained_model, reset_weights
from ..schedule import Schedule
from ..tree import join, private_copy, split, walk
from .chain import ChainRun
from .cut import pp_size
from .families import StageOutput
from .split import Stage, split_stages

__all__ = ["SCHEDULES", "Pipeline", "ScheduleName", "TiedGroup", "build_pipeline", "build_stages", "schedule_problem",
           "stage_ranks"]

ScheduleName: TypeAlias = Literal["gpipe", "1f1b", "interleaved", "looped-bfs", "zero-bubble", "zbv"]


@dataclass(frozen=True)
class _Kind:
    cls: type[PipelineScheduleSingle] | type[PipelineScheduleMulti]
    multi: bool
    style: Literal["loop", "v"] = "loop"
    per_rank: int | None = None  # stages per rank required (None: any)
    split_backward: bool = False  # backward in an input pass and a later weight pass


#: The schedule names ``build_pipeline`` accepts and the torch schedule each runs.
SCHEDULES: Mapping[str, _Kind] = {
    "gpipe": _Kind(ScheduleGPipe, multi=False, per_rank=1),
    "1f1b": _Kind(Schedule1F1B, multi=False, per_rank=1),
    "interleaved": _Kind(ScheduleInterleaved1F1B, multi=True),
    "looped-bfs": _Kind(ScheduleLoopedBFS, multi=True),
    "zero-bubble": _Kind(ScheduleInterleavedZeroBubble, multi=True, split_backward=True),
    "zbv": _Kind(ScheduleZBVZeroBubble, multi=True, style="v", per_rank=2, split_backward=True),
}


def stage_ranks(num_stages: int, pp: int, style: Literal["loop", "v"] = "loop") -> tuple[int, ...]:
    """The ``pp`` rank of every stage: round robin (``loop``) or V-shaped (``v``).

    >>> stage_ranks(4, 2), stage_ranks(4, 2, "v")
    ((0, 1, 0, 1), (0, 1, 1, 0))
    """
    if style == "v":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(num_stages))
    return tuple(s % pp for s in range(num_stages))


@dataclass(frozen=True)
class TiedGroup:
    """One parameter of the schedule held by several stages: ``members`` are
    ``(stage index, FQN)`` pairs, ``ranks`` the ``pp`` ranks that own them; ``whole``
    where the stages' schedules lay the copies out differently over the mesh, so that
    their gradients are summed as whole tensors, not shard by shard."""

    members: tuple[tuple[int, str], ...]
    ranks: tuple[int, ...]
    whole: bool = False


def _laid_out(stage: Stage, fqn: str) -> Layout | None:
    """How ``stage``'s schedule lays out the parameter at ``fqn``: its layout, ``None`` for
    whole on every rank."""
    lay = stage.schedule.annotations.get(fqn, LAYOUT)
    return None if lay is None or lay.is_replicated else lay


def _tied_groups(stages: tuple[Stage, ...], placement: tuple[int, ...]) -> tuple[TiedGroup, ...]:
    holders: dict[int, list[tuple[int, str]]] = {}
    for stage in stages:
        seen: set[int] = set()
        for name, p in stage.schedule.module.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                holders.setdefault(id(p), []).append((stage.index, name))
    by_index = {stage.index: stage for stage in stages}
    return tuple(
        TiedGroup(tuple(m), tuple(sorted({placement[s] for s, _ in m})),
                  whole=len({_laid_out(by_index[s], fqn) for s, fqn in m}) > 1)
        for m in holders.values() if len(m) > 1
    )


def _takes(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _install_io(module: nn.Module, stage: Stage, built: Schedule) -> None:
    """Hooks on build's private copy: inputs → the HF forward's arguments, output → a tensor
    (a stage before the last hands on its last layer's output: :class:`.StageOutput`); for
    a stage of a chain of sequences, a :class:`.ChainRun` as its forward. ``built``: the
    schedule the stage was built from (:func:`stage_schedule`)."""
    if stage.chain is not None:
        ChainRun(module, stage.chain, stage.bounds, stage.index).install()
        return
    first = stage.pre
    no_cache = _takes(module, "use_cache")
    last = None if stage.post else stage.layer_paths[-1]
    if last is not None and stage.schedule.annotations.get(last, SEQ) is not None:
        # the layer runs on sequence shards: its own output is this rank's part of the
        # sequence; the model's output has been through the chain's exit, which gathers it
        last = None
    hand_on = StageOutput(module, last)
    # the model's output a plan states split (the last stage's): the loss gets it whole, as a
    # model run in one process gives it
    leaving = {axis: p for axis, p in stated_model_output(built).items()
               if not isinstance(p, Replicate)} if stage.post else {}
    mesh = built.mesh
    gathers = [(mesh[axis], p) for axis, p in leaving.items()] if mesh is not None else []

    def pre(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        extra = {"use_cache": False} if no_cache and "use_cache" not in kwargs else {}
        if first:
            return args, {**kwargs, **extra}
        return (), {**kwargs, **extra, "inputs_embeds": args[0]}

    def post(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> torch.Tensor:
        tensor = hand_on(output)
        if isinstance(tensor, DTensor):
            # a stage run on DTensor activations (a region): what crosses to the next stage, or
            # reaches the loss, is the whole value, as from a stage on plain tensors
            tensor = tensor.full_tensor()
        for over, placement in gathers:
            tensor = DTensor.from_local(tensor, over, [placement], run_check=False).full_tensor()
        # A stage before the last returns its hidden states through the model's head stand-in
        # (``lm_head`` is an Identity there), often as a view (``hidden[:, 0:]``); zero-bubble
        # schedules detach stage outputs in place, which views refuse: hand on a copy.
        return tensor.clone() if tensor._is_view() else tensor

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True)


def _pp_axis_size(sch: Schedule, mesh_axis: str) -> int:
    """The size of the mesh's ``mesh_axis``; a :class:`ScheduleError` without one."""
    pp = pp_size(sch, mesh_axis)
    if pp is None:
        names = tuple(getattr(sch.mesh, "mesh_dim_names", None) or ())
        raise ScheduleError(
            "build_pipeline",
            [
                Problem(
                    "",
                    f"the schedule's mesh has no {mesh_axis!r} axis (mesh axes: {names or 'no mesh'})",
                    'sf.create_schedule(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)))',
                )
            ],
        )
    return pp


def _pp_group(sch: Schedule, mesh_axis: str) -> tuple[dist.ProcessGroup, int, int]:
    """The ``mesh_axis`` process group, this rank in it and its size (the axis exists:
    :func:`_pp_axis_size` checked)."""
    assert sch.mesh is not None
    group = sch.mesh.get_group(mesh_axis)
    return group, dist.get_rank(group), dist.get_world_size(group)


@dataclass(frozen=True, eq=False)
class Pipeline:
    """This rank's part of a pipeline: its stage modules (original FQNs) and the runner.

    ``modules`` maps each local stage index to its built module; ``stage_indices`` lists
    them; ``placement[s]`` is the ``pp`` rank of stage ``s``; ``tied`` lists parameters
    held by several stages, whose gradients :meth:`step` keeps summed.
    """

    modules: Mapping[int, nn.Module]
    stages: tuple[Stage, ...]
    placement: tuple[int, ...]
    schedule_name: str
    microbatches: int
    runner: PipelineScheduleSingle | PipelineScheduleMulti
    pipeline_stages: tuple[PipelineStage, ...]
    group: dist.ProcessGroup
    tied: tuple[TiedGroup, ...]
    tied_groups: Mapping[tuple[int, ...], dist.ProcessGroup | None]

    @property
    def stage_indices(self) -> tuple[int, ...]:
        return tuple(self.modules)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's stage parameters under their original FQNs."""
        for module in self.modules.values():
            yield from module.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's stage parameters (for the optimizer)."""
        for _, p in self.named_parameters():
            yield p

    def step(self, *inputs: torch.Tensor, target: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """One training step — forward and backward of every microbatch — and the mean
        microbatch loss, on every rank of the pipeline.

        Call it on every ``pp`` rank with the same arguments: ``inputs`` feed the first
        stage (``input_ids``), keyword tensors (``attention_mask``, ``position_ids``, batch
        first; an encoder-decoder's ``decoder_input_ids``) reach every stage, ``target`` the
        loss of the last. The stages of a chain (:mod:`.chain`) each get ``input_ids`` too. Gradients accumulate
        in ``.grad`` as with ``loss.backward()`` on the whole batch (mean of microbatch
        losses); zero them with the optimizer as usual.
        """
        self._check(inputs, target, kwargs)
        if self.stages[0].chain is not None:
            # every stage of a chain runs the model's forward on the batch's token ids
            kwargs = {**kwargs, "input_ids": inputs[0]}
        losses: list[torch.Tensor] = []
        self.runner.step(*inputs, target=target, losses=losses, return_outputs=False, **kwargs)
        self._sync_tied()
        last = self.placement[-1]
        mine = dist.get_rank(self.group)
        loss = torch.stack([x.detach() for x in losses]).mean() if mine == last else torch.zeros(())
        loss = loss.to(torch.float32 if not loss.is_floating_point() else loss.dtype)
        dist.broadcast(loss, group=self.group, group_src=last)
        return loss

    def _check(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, kwargs: Mapping[str, Any]) -> None:
        problems: list[Problem] = []
        if not inputs or not isinstance(inputs[0], torch.Tensor):
            raise ScheduleTypeError(
                "Pipeline.step",
                [Problem("inputs", "the first input must be a tensor (input_ids)", "pipe.step(ids, target=y)")],
            )
        batch = inputs[0].shape[0]
        if batch % self.microbatches:
            problems.append(
                Problem(
                    "inputs[0]",
                    f"the batch of {batch} does not split into {self.microbatches} equal microbatches",
                    f"use a batch that is a multiple of {self.microbatches}, or build_pipeline(..., microbatches=k) "
                    f"with k dividing {batch}",
                )
            )
        named = {"target": target, **{f"{k}=": v for k, v in kwargs.items()}}
        named.update({f"inputs[{i}]": x for i, x in enumerate(inputs[1:], 1)})
        for name, value in named.items():
            if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] != batch):
                problems.append(
                    Problem(
                        name.rstrip("="),
                        f"has shape {tuple(value.shape)}: every tensor is split into microbatches along dim 0, "
                        f"which must be the batch ({batch})",
                        "expand it to the batch, e.g. position_ids.expand(batch, -1)",
                    )
                )
        if problems:
            raise ScheduleError("Pipeline.step", problems)

    @torch.no_grad()
    def _sync_tied(self) -> None:
        for tie in self.tied:
            local = [self.modules[s].get_parameter(fqn) for s, fqn in tie.members if s in self.modules]
            if not local:
                continue
            grads = [p.grad for p in local]
            like = next((g for g in grads if g is not None), None)
            total = torch.zeros_like(local[0]) if like is None else torch.zeros_like(like)
            for g in grads:
                if g is not None:
                    total += g
            if tie.whole and isinstance(total, DTensor):
                total = total.full_tensor()
            group = self.tied_groups.get(tie.ranks)
            if group is not None:
                dist.all_reduce(_local(total), group=group)
            for p in local:
                mine = _laid_out_as(total, p) if tie.whole else total
                if p.grad is None:
                    p.grad = mine.clone()
                else:
                    p.grad.copy_(mine)


def _owner_groups(mesh: DeviceMesh, mesh_axis: str, owners: tuple[tuple[int, ...], ...],
                  rank: int) -> dict[tuple[int, ...], dist.ProcessGroup | None]:
    """The process group of each set of ``pp`` ranks in ``owners`` that this ``pp`` rank
    (``rank``) is in: ``None`` for itself alone.

    Every rank of the mesh creates the group of every owner set in every ``pp`` group of the
    mesh, in one order, as a ``DeviceMesh`` creates its groups (of the whole mesh where
    ``mesh`` is a slice of one: the other slices' ranks make their groups in the same calls).
    Groups made only by their members (``use_local_synchronization``) are named by how
    many groups each member has already made, so members that made different groups
    before (ranks 0, 2, 3 a group without rank 1, then all four) would wait for each other
    under different names."""
    root = getattr(mesh, "_get_root_mesh", None)  # a slice (mesh["pp"]): its whole mesh
    whole = root() if callable(root) else mesh
    if mesh_axis not in tuple(whole.mesh_dim_names or ()):
        whole = mesh
    ranks = whole.mesh
    dim = tuple(whole.mesh_dim_names or ()).index(mesh_axis)
    rows = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
    me = dist.get_rank()
    groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for tie in dict.fromkeys(owners):
        if len(tie) == 1:
            if rank in tie:
                groups[tie] = None
            continue
        for row in rows:
            members = [row[r] for r in tie]
            made = dist.new_group(members)
            if me in members:
                groups[tie] = made
    return groups


def _laid_out_as(whole: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The whole gradient ``whole`` in parameter ``p``'s layout: this rank's piece of it,
    cut locally (every rank holds the same whole sum)."""
    if not isinstance(p, DTensor):
        return whole
    return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def schedule_problem(stages: tuple[Stage, ...], name: str) -> Problem | None:
    """Why schedule ``name`` cannot run ``stages``, or ``None``: a zero-bubble schedule
    (a backward split into an input and a weight pass) refuses the stages of several
    layer sequences (an encoder-decoder's). Torch's weight pass walks the graph its input
    pass freed where a stage hands on what it received or recomputes a module from it,
    as those stages do."""
    kind = SCHEDULES.get(name)
    if kind is None or not kind.split_backward or not stages or stages[0].chain is None:
        return None
    return Problem("",
                   f"schedule {name!r} splits the backward in two, which the stages of "
                   f"{' and '.join(stages[0].chain.sequences)} do not support",
                   "use 'gpipe' or '1f1b', or 'interleaved' or 'looped-bfs' for several stages per rank")


def _problems(
    stages: tuple[Stage, ...], pp: int, name: str, microbatches: int, loss_fn: object
) -> list[Problem]:
    problems = []
    kind = SCHEDULES.get(name)
    if kind is None:
        return [Problem("", f"unknown schedule {name!r}", f"use one of {', '.join(map(repr, SCHEDULES))}")]
    n = len(stages)
    unsupported = schedule_problem(stages, name)
    if unsupported is not None:
        problems.append(unsupported)
    if n == 1:
        problems.append(
            Problem("", "the schedule has no stage cuts", "sf.cut_pipeline_stage(sch, 'model.layers.1') first")
        )
    elif n % pp or (kind.per_rank is not None and n != kind.per_rank * pp):
        want = kind.per_rank * pp if kind.per_rank is not None else f"a multiple of {pp}"
        problems.append(
            Problem(
                "",
                f"{n} stages on {pp} 'pp' ranks: schedule {name!r} needs {want} stages",
                "cut into one stage per rank for 'gpipe'/'1f1b', several per rank for 'interleaved'/"
                "'zero-bubble', two per rank for 'zbv'",
            )
        )
    if not isinstance(microbatches, int) or microbatches < n:
        problems.append(
            Problem(
                "",
                f"{microbatches} microbatches for {n} stages: a pipeline needs at least one microbatch per stage",
                f"build_pipeline(sch, microbatches={n}, ...) or more",
            )
        )
    if not callable(loss_fn):
        problems.append(Problem("", "loss_fn must be callable(output, target) -> loss", "loss_fn=my_loss"))
    return problems


def build_stages(
    sch: Schedule,
    *,
    indices: tuple[int, ...] | None = None,
    init: Any = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    copy: bool = True,
) -> dict[int, nn.Module]:
    """Build stages of ``sch`` (all, or those in ``indices``) as modules with the
    original FQNs, each called like a pipeline stage: the first with ``input_ids``, the
    others with the previous stage's output tensor, keyword inputs (``attention_mask``)
    to all; each returns one tensor (hidden states, or the model's logits in the last).
    No process group needed: chaining them in one process is the model's forward.

    Example:
        >>> import torch, slapo_fn as sf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                   num_attention_heads=2, num_key_value_heads=2)
        >>> model = LlamaForCausalLM(cfg)
        >>> first, last = build_stages(sf.cut_pipeline_stage(sf.create_schedule(model), "model.layers.0")).values()
        >>> ids = torch.randint(0, 32, (2, 5))
        >>> torch.allclose(last(first(ids)), model(ids).logits, atol=1e-6)
        True
    """
    return _build_stages(split_stages(sch), indices, init=init, device=device, seed=seed, copy=copy, whole=sch)


def _copy_from(reference: nn.Module) -> Any:
    """An ``init`` for :func:`slapo_fn.build` that fills each module's own tensors from
    the module at the same path of ``reference`` (the whole model, materialised), where
    it has them with the same shapes; any other module is initialised as ``"reset"`` does."""
    modules = dict(walk(reference))
    owners = {path: m for path, m in modules.items() if is_pretrained_model(m)}

    def init(module: nn.Module, path: str) -> None:
        ref = modules.get(path)
        own = {n: t for n, t in (*module._parameters.items(), *module._buffers.items()) if t is not None}
        theirs = {} if ref is None else {n: t for n, t in (*ref._parameters.items(), *ref._buffers.items())
                                         if t is not None}
        if ref is None or any(n not in theirs or theirs[n].shape != t.shape for n, t in own.items()):
            reset_weights(module, init_owner(owners, path))
            return
        for name, t in own.items():
            t.copy_(theirs[name])

    return init


def _whole_init(whole: Schedule, init: Any, seed: int) -> Any:
    """``init="full"`` for a pipeline: every stage gets the weights of the single-device
    build (``build(whole, init="full", seed=seed)``). Stages initialised one by one would
    each start the seeded stream at their own first module, so every stage after the
    first would differ; instead the whole model is materialised once, seeded, in the
    single-device order (one full copy of the model per rank, freed after the build, as
    ``init="full"`` under tensor parallelism allocates full tensors too), and each stage
    copies its tensors from it."""
    if init != "full" or not any(has_meta(m) for _, m in walk(whole.module)):
        return init
    reference = private_copy(whole.module, copy_data=False)
    materialise(reference, BuildOptions(init="full", seed=seed))
    return _copy_from(reference)


#: Sync modes about a module's input (its forward's, or its input's gradient): the first stage's.
_ON_INPUT = ("fwd_pre", "bwd_post")


def stage_schedule(stage: Stage) -> Schedule:
    """What :func:`slapo_fn.build` builds of ``stage``: its schedule, with the syncs on the
    modules every stage holds a part of (the model above the cut layers) where their
    values are made: a sync on such a module's input in the first stage, one on its
    output in the last, not at every stage's end."""
    sch = stage.schedule
    sequences = stage.chain.sequences if stage.chain is not None else (stage.sequence,)
    spanning = {join(*split(q)[:i]) for q in sequences for i in range(len(split(q)))}
    annotations = sch.annotations
    for path, specs in sch.annotations.of_kind(SYNC).items():
        if path in spanning:
            kept = tuple(spec for spec in specs if (stage.pre if spec.mode in _ON_INPUT else stage.post))
            annotations = annotations.set(path, SYNC, kept) if kept else annotations.unset(path, SYNC)
    return sch.evolve(annotations=annotations)


def _build_stages(
    stages: tuple[Stage, ...], indices: tuple[int, ...] | None, *, whole: Schedule, init: Any = None, **build_kw: Any
) -> dict[int, nn.Module]:
    """Build the stages whose index is in ``indices`` (all with ``None``)."""
    init = _whole_init(whole, init, build_kw.get("seed", 0))
    modules: dict[int, nn.Module] = {}
    for stage in stages:
        if indices is None or stage.index in indices:
            built = stage_schedule(stage)
            module = build(built, init=init, **build_kw)
            _install_io(module, stage, built)
            modules[stage.index] = module
    return modules


def build_pipeline(
    sch: Schedule,
    *,
    microbatches: int,
    schedule: ScheduleName = "1f1b",
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    mesh_axis: str = "pp",
    init: Any = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    copy: bool = True,
) -> Pipeline:
    """Build this rank's pipeline stage(s) of ``sch`` and the runner of ``schedule``.

    ``schedule``: ``"gpipe"``, ``"1f1b"`` (one stage per ``pp`` rank), ``"interleaved"``
    (Interleaved1F1B), ``"looped-bfs"``, ``"zero-bubble"`` (InterleavedZeroBubble; several
    stages per rank, round robin) or ``"zbv"`` (ZBVZeroBubble: two stages per rank in a V).
    ``loss_fn(output, target)`` gets the last stage's output tensor (logits for a causal
    LM) for one microbatch; it should be a mean over the microbatch (gradients are
    averaged over microbatches). On a context-parallel schedule (``inputs_split=True``:
    each rank is handed its chunks, ``ContextSplit.collate``) it gets this rank's chunks
    of the logits and of the shifted targets; its mean is weighted to the global token
    mean over ``cp`` (:func:`~slapo_fn.dtensor.context_runtime.pipeline_loss`).
    ``init``/``device``/``seed``/``copy`` are passed to
    :func:`slapo_fn.build` for every stage. Refused up front (a :class:`ScheduleError`
    listing every problem): no ``pp`` axis on the mesh, a stage count the schedule
    cannot place on the ``pp`` ranks, fewer microbatches than stages; then a
    :class:`~slapo_fn.LayoutError` for what any stage's build refuses of its layouts, on
    every rank alike (each rank builds only its own stages). A batch that does
    not split into ``microbatches`` is refused by :meth:`Pipeline.step` before any
    communication. The schedule is unchanged.

    Example (on each rank; needs a process group)::

        >>> pipe = sf.build_pipeline(sch, microbatches=4, schedule="gpipe", loss_fn=ce)  # doctest: +SKIP
        >>> loss = pipe.step(ids, target=labels)                                        # doctest: +SKIP
    """
    if not isinstance(sch, Schedule):
        raise ScheduleTypeError(
            "build_pipeline",
            [Problem("", f"expected a Schedule, got {type(sch).__name__}", "sf.build_pipeline(sch, ...)")],
        )
    stages = split_stages(sch)
    pp = _pp_axis_size(sch, mesh_axis)
    problems = _problems(stages, pp, schedule, microbatches, loss_fn)
    problems += pipeline_problems(sch)
    if problems:
        raise ScheduleError("build_pipeline", problems)
    # each rank builds its own stages: a layout one stage refuses is refused on every rank,
    # before any of them waits on another
    refusals = list(dict.fromkeys(p for stage in stages for p in refused(stage_schedule(stage))))
    if refusals:
        raise LayoutError("build_pipeline", refusals)
    group, rank, _ = _pp_group(sch, mesh_axis)
    kind = SCHEDULES[schedule]
    placement = stage_ranks(len(stages), pp, kind.style)
    mine = tuple(s.index for s in stages if placement[s.index] == rank)
    modules = _build_stages(stages, mine, whole=sch, init=init, device=device, seed=seed, copy=copy)
    pipeline_stages = []
    for index, module in modules.items():
        where = next((p.device for p in module.parameters()), torch.device("cpu"))
        pipeline_stages.append(PipelineStage(module, index, len(stages), where, group=group))
    runner: PipelineScheduleSingle | PipelineScheduleMulti
    loss_fn = pipeline_loss(sch, loss_fn)  # context parallelism: the global token mean on every cp rank
    if kind.multi:
        runner = kind.cls(pipeline_stages, n_microbatches=microbatches, loss_fn=loss_fn)  # type: ignore[call-arg,arg-type]
    else:
        runner = kind.cls(pipeline_stages[0], n_microbatches=microbatches, loss_fn=loss_fn)  # type: ignore[call-arg,arg-type]
    tied = _tied_groups(stages, placement)
    assert sch.mesh is not None
    return Pipeline(
        modules=modules,
        stages=stages,
        placement=placement,
        schedule_name=schedule,
        microbatches=microbatches,
        runner=runner,
        pipeline_stages=tuple(pipeline_stages),
        group=group,
        tied=tied,
        tied_groups=_owner_groups(sch.mesh, mesh_axis, tuple(t.ranks for t in tied), rank),
    )
