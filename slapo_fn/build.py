"""``build``: materialise a schedule as an ``nn.Module``, in one canonical order.

Whatever order the rewrites were written in, ``build`` applies them as:

1. structural rewrites (already in the tree: ``replace``, graph rewrites);
2. materialisation of meta-device tensors (``init``) and placement (``device``);
3. then :data:`PHASES`, in this fixed order: context parallelism (attention on the rank's
   chunks, the root cutting its inputs), tensor and sequence parallelism (DTensor
   parameters, local forwards, boundary collectives), the sum of gradients over ``cp``, tags, hooks, activation
   checkpointing, compilation, data parallelism (FSDP2 / replicate over ``dp``).

Everything happens on a private structural copy of the schedule's tree, so PyTorch APIs
that act in place (``fully_shard``, composable ``checkpoint``, ``Module.compile``) never
touch a module a schedule owns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .dtensor.context_runtime import apply_context_parallel, sum_gradients_over_cp
from .dtensor.data_parallel import apply_data_parallel
from .dtensor.runtime import apply_tensor_parallel
from .errors import Problem, ScheduleError, ScheduleTypeError
from .hf import clear_initialized_flags, init_owner, is_pretrained_model, reset_weights
from .rewrites.annotate import apply_tags
from .rewrites.checkpoint import apply_checkpoints
from .rewrites.compile import apply_compile
from .rewrites.hook import apply_hooks
from .schedule import Schedule
from .seeding import seeded
from .tree import join, private_copy, walk

__all__ = ["UNFILLED", "BuildOptions", "Init", "allocate", "build", "has_meta", "materialise", "reset_fsdp_shards"]

#: Attribute :func:`allocate` sets on the buffers it gives storage without values, so that
#: a loader knows which non-persistent buffers it must recompute (a buffer that had real
#: values before ``build`` keeps them and has no such mark).
UNFILLED = "_slapo_fn_unfilled"

Init: TypeAlias = "Literal['reset', 'full', 'empty'] | Callable[[nn.Module, str], None] | None"


@dataclass(frozen=True)
class BuildOptions:
    """Options every build phase sees."""

    init: Init = None
    device: torch.device | None = None
    strict: bool = False
    seed: int = 0


Phase: TypeAlias = Callable[[nn.Module, Schedule, BuildOptions], None]


def _context_parallel(model: nn.Module, sch: Schedule, _: BuildOptions) -> None:
    apply_context_parallel(model, sch)


def _cp_gradients(model: nn.Module, sch: Schedule, _: BuildOptions) -> None:
    sum_gradients_over_cp(model, sch)


def _tensor_parallel(model: nn.Module, sch: Schedule, options: BuildOptions) -> None:
    apply_tensor_parallel(model, sch, strict=options.strict)


def _tags(model: nn.Module, sch: Schedule, _: BuildOptions) -> None:
    apply_tags(model, sch)


def _hooks(model: nn.Module, sch: Schedule, _: BuildOptions) -> None:
    apply_hooks(model, sch)


def _checkpoint(model: nn.Module, sch: Schedule, _: BuildOptions) -> None:
    apply_checkpoints(model, sch)


def _compile(model: nn.Module, sch: Schedule, _: BuildOptions) -> None:
    apply_compile(model, sch)


def _data_parallel(model: nn.Module, sch: Schedule, _: BuildOptions) -> None:
    apply_data_parallel(model, sch)


#: The canonical order of build phases after materialisation.
PHASES: tuple[tuple[str, Phase], ...] = (
    ("context_parallel", _context_parallel),
    ("tensor_parallel", _tensor_parallel),
    ("cp_gradients", _cp_gradients),
    ("tags", _tags),
    ("hooks", _hooks),
    ("checkpoint", _checkpoint),
    ("compile", _compile),
    ("data_parallel", _data_parallel),
)


def build(
    sch: Schedule,
    *,
    init: Init = None,
    device: torch.device | str | None = None,
    strict: bool = False,
    copy: bool = True,
    seed: int = 0,
) -> nn.Module:
    """Materialise ``sch`` as a new ``nn.Module`` with the original's FQNs.

    * ``copy=True`` (default): the built model owns its parameter data, so training it
      never changes the model given to :func:`create_schedule`. ``copy=False`` makes its
      parameters new ``Parameter`` objects that view the original storage (no memory; an
      optimizer step then changes values the original sees too).
    * Meta-device tensors are materialised on ``device`` (default CPU) and initialised by
      ``init``: ``"reset"`` (each module's own initialisation: Hugging Face
      ``_init_weights`` or ``reset_parameters``), ``"full"`` (the same, seeded with
      ``seed`` on full-size tensors, so the weights equal the single-device model's
      whatever the layout) or ``fn(module, path)``.
    * ``strict=True`` refuses layouts that need resharding the user did not ask for.

    Example:
        >>> import torch, torch.nn as nn, slapo_fn as sf
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        >>> built = sf.build(sf.checkpoint(sf.create_schedule(model), "0"))
        >>> list(built.state_dict()) == list(model.state_dict())
        True
    """
    if not isinstance(sch, Schedule):
        raise ScheduleTypeError(
            "build",
            [Problem("", f"expected a Schedule, got {type(sch).__name__}", "sf.build(sf.create_schedule(model))")],
        )
    options = BuildOptions(init=init, device=None if device is None else torch.device(device), strict=strict, seed=seed)
    model = private_copy(sch.module, copy_data=copy)
    if init == "empty":
        # lay the meta tensors out first (DTensor / FSDP2 placements cost no memory on meta),
        # then give each rank's shards storage: no full tensor is ever allocated
        if options.device is not None and not any(has_meta(m) for _, m in walk(model)):
            model.to(options.device)
        for _, phase in PHASES:
            phase(model, sch, options)
        allocate(model, options.device or torch.device("cpu"))
        return model
    materialise(model, options)
    for _, phase in PHASES:
        phase(model, sch, options)
    return model


def has_meta(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters or buffers (not its children's) include a
    meta-device tensor (a DTensor whose local shard is on meta counts).

    >>> import torch.nn as nn
    >>> has_meta(nn.Linear(2, 2)), has_meta(nn.Linear(2, 2, device="meta"))
    (False, True)
    """
    return _has_meta(module)


def _has_meta(module: nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in (*module._parameters.values(), *module._buffers.values()))


def materialise(model: nn.Module, options: BuildOptions) -> None:
    """Give meta-device tensors of ``model`` real storage and initialise them (in place:
    ``model`` is build's private copy)."""
    pending = [(path, m) for path, m in walk(model) if _has_meta(m)]
    if not pending:
        if options.device is not None:
            model.to(options.device)
        return
    init = options.init if options.init is not None else "reset"
    if init not in ("reset", "full") and not callable(init):
        raise ScheduleError(
            "build",
            [Problem("", f"unknown init {init!r}", "use init='reset', 'full', 'empty' or init=fn(module, path)")],
        )
    owners = {path: m for path, m in walk(model) if is_pretrained_model(m)}
    if not callable(init):
        pending = _initialisation_order(model, owners)
    _to_empty(model, options.device or torch.device("cpu"))
    for _, m in pending:
        clear_initialized_flags(m)
    if options.device is not None:
        model.to(options.device)
    uninitialised: list[str] = []
    # the caller's CPU and CUDA streams stay as they are
    with seeded(options.seed if init == "full" else None), torch.no_grad():
        for path, m in pending:
            if callable(init):
                init(m, path)
            elif not reset_weights(m, init_owner(owners, path)):
                uninitialised.append(path)
    if uninitialised:
        raise ScheduleError(
            "build",
            [
                Problem(
                    p,
                    "has meta-device tensors and no way to initialise them (no reset_parameters, no Hugging "
                    "Face owner)",
                    "pass init=fn(module, path) or give the module real weights",
                )
                for p in uninitialised
            ],
        )


def _initialisation_order(model: nn.Module, owners: Mapping[str, nn.Module]) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that initialising its meta-device tensors calls, each once,
    children before parents (Hugging Face's order, ``PreTrainedModel.initialize_weights``):
    every module with meta-device tensors of its own, and every module with none of its own
    under a Hugging Face owner (``owners``: ``{path: model}``) whose descendants' tensors are
    all on meta. ``_init_weights`` keys branches on such parents (T5's attention initialises
    its ``q``/``k``/``v``/``o`` by the head size, GPT-2's blocks scale their residual
    projections): a parent runs after its children, so its branch has the last word, as
    when the model is made on a device; a parent of no tensors of its own with real tensors
    below it is skipped, so that it never overwrites them.

    >>> import torch.nn as nn
    >>> m = nn.Sequential(nn.Linear(2, 2, device="meta"), nn.Linear(2, 2))
    >>> [path for path, _ in _initialisation_order(m, {})]
    ['0']
    """
    order: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(path: str, m: nn.Module) -> bool | None:
        """Whether every tensor at and below ``m`` is on meta (``None``: it has none)."""
        if id(m) in seen:
            return _all_meta(m)
        seen.add(id(m))
        below = [visit(join(path, name), child) for name, child in m._modules.items() if child is not None]
        own = _tensors(m)
        if own:
            if _has_meta(m):
                order.append((path, m))
            return all(t.is_meta for t in own) and all(b is not False for b in below)
        whole = any(b is True for b in below) and all(b is not False for b in below)
        if whole and callable(getattr(init_owner(owners, path), "_init_weights", None)):
            order.append((path, m))
        return whole if any(b is not None for b in below) else None

    visit("", model)
    return order


def _tensors(m: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]


def _all_meta(m: nn.Module) -> bool | None:
    """Whether every tensor at and below ``m`` is on meta (``None``: it has none)."""
    tensors = [t for _, sub in walk(m) for t in _tensors(sub)]
    return all(t.is_meta for t in tensors) if tensors else None


def _empty_like(
    t: torch.Tensor, device: torch.device, memo: dict[int, torch.Tensor], *, unfilled: bool
) -> torch.Tensor:
    """An uninitialised tensor like ``t`` on ``device`` (a ``Parameter`` for a parameter,
    its attributes kept), one per ``t`` in ``memo`` so that shared tensors stay shared; a
    plain one is marked :data:`UNFILLED` with ``unfilled``."""
    if id(t) not in memo:
        data = torch.empty_like(t, device=device)
        if isinstance(t, nn.Parameter):
            new: torch.Tensor = nn.Parameter(data, requires_grad=t.requires_grad)
            new.__dict__.update(t.__dict__)
        else:
            new = data
            if unfilled:
                setattr(new, UNFILLED, True)
        memo[id(t)] = new
    return memo[id(t)]


def _to_empty(model: nn.Module, device: torch.device) -> None:
    """Like ``Module.to_empty`` but keeps tensors shared between modules shared (tied
    weights), which ``to_empty`` does not."""
    memo: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        return _empty_like(t, device, memo, unfilled=False)

    for _, m in walk(model):
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                m._parameters[name] = empty(p)  # type: ignore[assignment]
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = empty(b)


def allocate(model: nn.Module, device: torch.device) -> None:
    """Give every meta-device tensor of ``model`` uninitialised storage on ``device``, in
    place, in its current layout: a DTensor gets its *local* shard only (its ``Parameter``
    object is kept, by ``torch.utils.swap_tensors``, so ties and FSDP2's references to
    it hold), a plain tensor a tensor of its shape (tensors shared between modules stay
    shared). FSDP2 modules then re-register their padded shards, as their ``to_empty``
    does.

    >>> import torch, torch.nn as nn
    >>> m = nn.Linear(2, 3, device="meta")
    >>> allocate(m, torch.device("cpu")); m.weight.device.type, tuple(m.weight.shape)
    ('cpu', (3, 2))
    """
    memo: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        return _empty_like(t, device, memo, unfilled=True)

    swapped: set[int] = set()
    for _, m in walk(model):
        for name, p in m._parameters.items():
            if p is None or id(p) in swapped:
                continue
            if isinstance(p, DTensor) and p.to_local().is_meta:
                local = torch.empty_like(p.to_local(), device=device)
                dt = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())
                torch.utils.swap_tensors(p, nn.Parameter(dt, requires_grad=p.requires_grad))
                swapped.add(id(p))
            elif p.is_meta:
                m._parameters[name] = empty(p)  # type: ignore[assignment]
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = empty(b)
    for _, m in walk(model):
        if isinstance(m, FSDPModule):
            reset_fsdp_shards(m)


def reset_fsdp_shards(module: FSDPModule) -> None:
    """FSDP2 keeps a padded copy of each local shard it manages; after the shard got new
    storage it must be made again (what ``FSDPModule._apply`` does after ``to_empty``).
    Private API of torch's FSDP2 (checked on torch 2.11 and 2.13)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.12: one optional group per FSDP module
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    with torch.no_grad():
        for group in groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()
