"""The tensor-parallel part of ``explain``: layouts, per-rank parameter bytes, and the
collectives one forward and one backward issue, per module boundary — without devices;
also the data-parallel collectives (:func:`data_parallel_collectives`: FSDP2, HSDP, DDP
buckets), those of a vocab-parallel loss (:func:`loss_collectives`), and the fake run
(:func:`activation_shapes`) whose saved tensors give ``explain`` its activation memory.

Everything comes from the schedule's annotations and its :func:`~.boundary.plan`; the
only computation is optional: with example inputs (real, meta or fake tensors — only
their shapes and dtypes matter) the *unsharded* model runs once under
``FakeTensorMode`` to learn each module's activation shapes, which gives every
collective its size. Without inputs the collectives are listed and counted, and their
bytes are ``None``.

``bytes`` of a collective is the size of the full (unsharded) tensor it operates on:
the all-reduced tensor, the all-gathered result, the reduce-scattered input (what
``torch.distributed`` calls the buffer size; a ring moves about ``(n-1)/n`` of it per
rank for an all-gather or a reduce-scatter and twice that for an all-reduce).

Example:
    >>> import torch, torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    >>> sch = sf.shard(sf.shard(sf.create_schedule(model, mesh=fake_mesh(2)), "0", axis=0), "2", axis=1)
    >>> tp = explain_tensor_parallel(sch, torch.empty(4, 8, device="meta", requires_grad=True))
    >>> tp.rank_bytes, tp.total_bytes
    (576, 1120)
    >>> tp.counts()
    {'forward': {'all_reduce': 1}, 'backward': {'all_reduce': 1}}
    >>> print(tp)
    tensor parallel over mesh (tp=2):
      parameter bytes per rank: 576 B (of 1.1 KiB unsharded); TP shards only: the memory table adds FSDP and stages
        0: 288 B
        2: 288 B
      collectives per step (2: forward 1, backward 1; 256 B):
        0 input R→R@tp  bwd all_reduce  128 B  [shard]
        2 output P→R@tp  fwd all_reduce  128 B  [shard]
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Shard
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module

from ..hf import EXPERTS_PER_TOKEN_ATTRS, config_of, config_value, evenly_routed_experts
from ..render import format_bytes, format_param
from ..schedule import Schedule
from ..tree import get_module, join, parent_path, private_copy, walk
from .context import CP
from .data_parallel import DATA_PARALLEL, DataParallelSpec
from .dryrun import dtensor_collectives
from .experts import EXPERTS
from .layout import Layout
from .lookups import _flows_memo as flows_memo
from .lookups import _users as users
from .plan import plan
from .planned import Boundary
from .sequence import SEQ
from .shard import LAYOUT, ROLE, mesh_dims
from .sync import SYNC, SyncSpec

__all__ = ["ActivationShapes", "Collective", "ParamLayout", "TensorParallelExplanation", "activation_shapes",
           "data_parallel_collectives", "explain_tensor_parallel", "loss_collectives"]

Direction = Literal["forward", "backward"]
Origin = Literal["shard", "sync", "sequence_parallel", "implicit", "data_parallel", "pipeline", "loss", "dtensor",
                 "context_parallel"]

_SIDE_OF_MODE = {"fwd_pre": "input", "fwd_post": "output", "bwd_post": "input grad"}


@dataclass(frozen=True)
class Collective:
    """One collective that one training step issues at a module boundary.

    ``origin`` says who asked for it: ``"shard"`` (the contract of a ``shard`` call,
    e.g. a row-parallel output's all-reduce), ``"sync"`` (a ``sync`` call),
    ``"sequence_parallel"`` (the chain's entry and exit), or ``"implicit"`` (resharding
    between layouts nobody stated; ``build(strict=True)`` refuses those)."""

    path: str
    side: str
    direction: Direction
    op: str
    src: str
    dst: str
    mesh_axis: str
    origin: Origin
    bytes: int | None = None

    @property
    def asked(self) -> bool:
        """Whether the user asked for it (anything but ``"implicit"``)."""
        return self.origin != "implicit"

    def describe(self) -> str:
        """Everything but the path: ``output P→R@tp  fwd all_reduce  16.0 MiB  [shard]``."""
        size = "? B" if self.bytes is None else format_bytes(self.bytes)
        short = "fwd" if self.direction == "forward" else "bwd"
        return f"{self.side} {self.src}→{self.dst}@{self.mesh_axis}  {short} {self.op}  {size}  [{self.origin}]"

    def __str__(self) -> str:
        return f"{self.path or '<root>'} {self.describe()}"


@dataclass(frozen=True)
class ParamLayout:
    """A parameter's layout (``f32[4096@tp, 1024]``), full bytes and this rank's bytes."""

    path: str
    layout: str
    bytes: int
    rank_bytes: int

    @property
    def sharded(self) -> bool:
        return self.rank_bytes != self.bytes


@dataclass(frozen=True)
class ActivationShapes:
    """The first tensor input and output (shape, dtype) of each module of the unsharded
    model on the example inputs — what a boundary's collective moves."""

    inputs: Mapping[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    outputs: Mapping[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    #: Modules whose first input needs no gradient (raw model inputs, frozen producers):
    #: their input boundaries issue no backward collective.
    no_grad_inputs: frozenset[str] = frozenset()
    #: Every tensor autograd saved for backward (parameters and buffers left out, a
    #: storage counted once, where first saved), in order: ``(module path, bytes)``, the
    #: path being the innermost module running when it was saved ("" for the root's
    #: own code: the loss of a Hugging Face model called with labels).
    saved: tuple[tuple[str, int], ...] = ()
    #: Modules in the order their forward ran (first call each).
    order: tuple[str, ...] = ()
    #: How many times each module's forward ran (a shared layer called by a loop: as many
    #: times as the loop runs); a module left out ran once or not at all.
    calls: Mapping[str, int] = field(default_factory=dict)

    def bytes_of(self, boundary: Boundary, params: Mapping[str, ParamLayout]) -> int | None:
        """Bytes of the full tensor at ``boundary`` (``None`` when the shape is unknown)."""
        if boundary.tensor.startswith("param:"):  # one parameter, or several reduced together
            found = [params.get(join(boundary.path, n)) for n in boundary.tensor.removeprefix("param:").split(",")]
            return None if any(p is None for p in found) else sum(p.bytes for p in found if p is not None)
        table = self.outputs if boundary.tensor == "output" else self.inputs
        entry = table.get(boundary.path)
        if entry is None:
            return None
        shape, dtype = entry
        return _numel(shape) * _itemsize(dtype)


@dataclass(frozen=True)
class TensorParallelExplanation:
    """What :func:`explain_tensor_parallel` found; ``str()`` renders it.

    ``module_bytes`` maps each module with parameters to the bytes of its own
    parameters on one rank (a sharded parameter counts its local shard; a tied one
    counts once, at its first path); ``rank_bytes`` is their sum."""

    mesh: str
    params: tuple[ParamLayout, ...]
    module_bytes: Mapping[str, int]
    rank_bytes: int
    total_bytes: int
    collectives: tuple[Collective, ...]
    #: Why activation bytes are unknown ("" when they are known).
    shapes_note: str = ""

    def counts(self) -> dict[str, dict[str, int]]:
        """``{"forward": {op: n}, "backward": {op: n}}`` — what ``CommDebugMode`` counts in one step."""
        out: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
        for c in self.collectives:
            out[c.direction][c.op] = out[c.direction].get(c.op, 0) + 1
        return out

    def bytes(self, direction: Direction | None = None) -> int | None:
        """Total bytes of the collectives (of one direction), ``None`` if some size is unknown."""
        sizes = [c.bytes for c in self.collectives if direction is None or c.direction == direction]
        return None if any(b is None for b in sizes) else sum(b for b in sizes if b is not None)

    @property
    def implicit(self) -> tuple[Collective, ...]:
        """The collectives nobody asked for (what ``build(strict=True)`` refuses)."""
        return tuple(c for c in self.collectives if not c.asked)

    def __str__(self) -> str:
        lines = [f"tensor parallel over mesh ({self.mesh}):"]
        per_rank, unsharded = format_bytes(self.rank_bytes), format_bytes(self.total_bytes)
        lines.append(f"  parameter bytes per rank: {per_rank} (of {unsharded} unsharded)"
                     + ("; TP shards only: the memory table adds FSDP and stages"
                        if self.rank_bytes != self.total_bytes else ""))
        for path, text, count in _fold((p, format_bytes(b)) for p, b in self.module_bytes.items()):
            lines.append(f"    {path or '<root>'}" + (f" ×{count}: {text} each" if count > 1 else f": {text}"))
        c = self.counts()
        total = self.bytes()
        size = "" if total is None else f"; {format_bytes(total)}"
        lines.append(
            f"  collectives per step ({len(self.collectives)}: forward {sum(c['forward'].values())}, "
            f"backward {sum(c['backward'].values())}{size}):"
        )
        if self.shapes_note:
            lines.append(f"    (bytes unknown: {self.shapes_note})")
        for path, text, count in _fold((x.path, x.describe()) for x in self.collectives):
            lines.append(f"    {path or '<root>'} {text}" + (f"  ×{count}" if count > 1 else ""))
        return "\n".join(lines)


def _fold(entries: Iterable[tuple[str, str]]) -> list[tuple[str, str, int]]:
    """``(path, text)`` pairs → ``(path or pattern, text, count)``: entries whose paths
    differ only in numeric tokens (``layers.0`` … ``layers.31``) and whose texts are equal
    fold into one ``layers.*`` line, in first-seen order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for path, text in entries:
        tokens = path.split(".")
        pattern = ".".join("*" if t.isdigit() else t for t in tokens) if len(tokens) > 1 else path
        groups.setdefault((pattern, text), []).append(path)
    return [(pat if len(paths) > 1 else paths[0], text, len(paths)) for (pat, text), paths in groups.items()]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _first_input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The tensor the boundary runtime converts: the first tensor positional argument,
    else the first tensor keyword argument (as :func:`.region.map_input`)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            return v
    return None


def _first_output(value: Any) -> torch.Tensor | None:
    """The first tensor of an output (a tensor, or the first tensor of a tuple/list)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple | list):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def _signature(m: nn.Module) -> tuple[Any, ...]:
    """What makes two layers interchangeable for the fake run: type, and every
    parameter's and buffer's name, shape and dtype."""
    return (type(m), tuple((n, tuple(t.shape), t.dtype) for n, t in (*m.named_parameters(), *m.named_buffers())))


def _repeated_layers(model: nn.Module) -> dict[str, int]:
    """``{ModuleList path: length}`` of the lists of more than two identical layers (the
    decoder layers of a transformer), outermost only."""
    found: dict[str, int] = {}
    for path, m in walk(model):
        if not isinstance(m, nn.ModuleList) or len(m) <= 2 or any(path.startswith(f + ".") for f in found):
            continue
        kids = list(m)
        first = _signature(kids[0])
        if all(_signature(k) == first for k in kids[1:]):
            found[path] = len(kids)
    return found


def _expand(path: str, lists: Mapping[str, int]) -> list[str]:
    """The paths a record of the fake run stands for: a record under the second layer of
    a shortened list stands for that layer and every one after it."""
    for lst, n in lists.items():
        prefix = f"{lst}.1" if lst else "1"
        if path == prefix or path.startswith(prefix + "."):
            rest = path[len(prefix):]
            return [f"{lst}.{i}{rest}" if lst else f"{i}{rest}" for i in range(1, n)]
    return [path]


def activation_shapes(
    module: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any], *, shorten: bool = True
) -> ActivationShapes:
    """Run ``module`` (unsharded, any device, meta included) once under ``FakeTensorMode``
    on inputs of the given shapes and record each module's first input and output,
    whether that input needs a gradient (with autograd on, as in training), and every
    tensor saved for backward.

    ``module`` is not touched: the run uses a private structural copy whose parameters
    and buffers are fake tensors. With ``shorten``, a list of more than two identical
    layers runs only its first two, and the second one's records stand for the rest
    (the first may save what all share, e.g. rotary tables): 126 decoder layers cost
    two. Raises what the model's forward raises.
    """
    model = private_copy(module, copy_data=False)
    evenly_routed_experts(model)  # routing by data (nonzero) cannot run on fake tensors
    lists = _repeated_layers(model) if shorten else {}
    for path in lists:
        owner = get_module(model, parent_path(path))
        name = path.rsplit(".", 1)[-1]
        layers = [m for m in get_module(model, path)._modules.values() if m is not None]
        owner._modules[name] = nn.ModuleList(layers[:2])
    ins: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    outs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    no_grad: set[str] = set()
    running: list[str] = [""]
    order: dict[str, None] = {}
    calls: dict[str, int] = {}
    saved: list[tuple[str, int]] = []
    storages: set[StorageWeakRef] = set()

    def enter(path: str) -> Any:
        def push(_: nn.Module, __: tuple[Any, ...]) -> None:
            running.append(path)
            order.setdefault(path, None)
            calls[path] = calls.get(path, 0) + 1

        return push

    def leave(_: nn.Module, __: tuple[Any, ...], ___: Any) -> None:
        running.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(t.untyped_storage())
        if key not in storages:
            storages.add(key)
            saved.append((running[-1], t.untyped_storage().nbytes()))
        return t

    def hook(path: str) -> Any:
        def record(_: nn.Module, args: tuple[Any, ...], kw: dict[str, Any], output: Any) -> None:
            if path in outs or path in ins:
                return
            x, y = _first_input(args, kw), _first_output(output)
            if x is not None:
                ins[path] = (tuple(x.shape), x.dtype)
                if not x.requires_grad:
                    no_grad.add(path)
            if y is not None:
                outs[path] = (tuple(y.shape), y.dtype)

        return record

    for path, m in walk(model):
        m.register_forward_pre_hook(enter(path))
        m.register_forward_hook(leave)
        m.register_forward_hook(hook(path), with_kwargs=True)
    with FakeTensorMode(allow_non_fake_inputs=False):

        def fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            return torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu", requires_grad=t.requires_grad)

        state = {
            n: fake(t)
            for n, t in (*model.named_parameters(), *model.named_buffers())
        }
        args = [fake(a) for a in inputs]
        kw = {k: fake(v) for k, v in kwargs.items()}
        storages.update(StorageWeakRef(t.untyped_storage()) for t in state.values() if isinstance(t, torch.Tensor))
        with (_reparametrize_module(model, state, tie_weights=True), torch.enable_grad(), _unpacked_sequences(),
              torch.autograd.graph.saved_tensors_hooks(pack, _unpack)):
            model(*args, **kw)
    several = {p: n for p, n in calls.items() if n > 1}
    if not lists:
        return ActivationShapes(ins, outs, frozenset(no_grad), tuple(saved), tuple(order), several)
    return ActivationShapes(
        {q: v for p, v in ins.items() for q in _expand(p, lists)},
        {q: v for p, v in outs.items() for q in _expand(p, lists)},
        frozenset(q for p in no_grad for q in _expand(p, lists)),
        tuple((q, b) for p, b in saved for q in _expand(p, lists)),
        tuple(q for p in order for q in _expand(p, lists)),
        {q: n for p, n in several.items() for q in _expand(p, lists)},
    )


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def _unpacked_sequences() -> Iterator[None]:
    """While the fake run runs: Hugging Face's mask code treats fake tensors as tracing
    and, unable to read position ids, assumes packed sequences and builds a 4-D mask
    that the real run skips (and with it grouped-query SDPA, repeating K and V). The
    example inputs hold one sequence per row, so say so: no packed sequences."""
    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "find_packed_sequence_indices", None)
    if module is None or original is None:
        yield
        return
    module.find_packed_sequence_indices = lambda position_ids: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.find_packed_sequence_indices = original  # type: ignore[attr-defined]


def _origin(sch: Schedule, b: Boundary) -> Origin:
    if not b.explicit:
        return "implicit"
    syncs: tuple[SyncSpec, ...] = sch.annotations.get(b.path, SYNC, ())
    if any(_SIDE_OF_MODE[s.mode] == b.side for s in syncs):
        return "sync"
    if sch.annotations.get(b.path, SEQ) is not None and sch.annotations.get(b.path, ROLE) is None:
        return "sequence_parallel"
    if b.tensor.startswith("param:") and not b.path and sch.annotations.of_kind(SEQ):
        return "sequence_parallel"  # the chains' norms' gradients, reduced together after backward
    return "shard"


def parameter_layouts(sch: Schedule) -> tuple[tuple[ParamLayout, ...], dict[str, int]]:
    """Every parameter's layout and bytes (full and on one rank), and per-rank bytes per
    module (own parameters; tied ones once)."""
    layouts: dict[str, Layout] = sch.annotations.of_kind(LAYOUT)
    seen: set[int] = set()
    params: list[ParamLayout] = []
    per_module: dict[str, int] = {}
    for path, m in walk(sch.module):
        own = 0
        for name, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            full_path = join(path, name)
            lay = layouts.get(full_path)
            shape = tuple(p.shape)
            local = lay.local_shape(shape) if lay is not None else shape
            size = p.element_size()
            text = lay.format(shape, p.dtype) if lay is not None else _plain(shape, p.dtype)
            params.append(ParamLayout(full_path, text, _numel(shape) * size, _numel(local) * size))
            own += _numel(local) * size
        if own:
            per_module[path] = own
    return tuple(params), per_module


def _plain(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return format_param(torch.empty(shape, dtype=dtype, device="meta"))


def explain_tensor_parallel(
    sch: Schedule,
    *inputs: Any,
    kwargs: Mapping[str, Any] | None = None,
    shapes: ActivationShapes | None = None,
    failed: str = "",
    expert_imbalance: float = 1.0,
) -> TensorParallelExplanation:
    """Layouts, per-rank parameter bytes and per-boundary collectives of ``sch``.

    ``inputs`` (and ``kwargs``) are optional example inputs for the model; only their
    shapes and dtypes matter, so meta tensors are the cheap way to give them
    (``torch.empty(1, 2048, dtype=torch.long, device="meta")``). With them, every
    collective carries its bytes; without, ``bytes`` is ``None``. If the fake run fails,
    bytes stay unknown and ``shapes_note`` says why.

    Needs a schedule with a mesh (a :func:`~slapo_fn.dtensor.testing.fake_mesh` is
    enough); the counts equal what ``CommDebugMode`` counts in one real step: a module
    the example inputs run several times (ALBERT's shared layer, called once per layer)
    has its activation boundaries once per call; without example inputs, each module is
    taken to run once. Without example inputs every input boundary is assumed to need
    its gradient; with them, an input that needs none (a raw model input going straight
    into a column module) costs no backward collective, as in the real run.
    ``shapes`` (with ``failed``, why it is missing) is the fake run of those inputs
    when the caller already has it.
    """
    assert sch.mesh is not None, "explain_tensor_parallel needs a schedule with a mesh"
    dims = mesh_dims(sch.mesh)
    mesh = ", ".join(f"{n}={s}" for n, s in zip(dims, tuple(sch.mesh.shape), strict=True))
    params, per_module = parameter_layouts(sch)
    by_path = {p.path: p for p in params}
    note = failed or ("" if inputs or kwargs else "no example inputs (pass explain(sch, *inputs))")
    if shapes is None and not failed and (inputs or kwargs):
        try:
            shapes = activation_shapes(sch.module, inputs, dict(kwargs or {}))
        except Exception as e:  # explain never fails for a model it cannot run fake
            note = f"the fake run failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    collectives: list[Collective] = []
    p = plan(sch)
    if p.on_dtensors:  # DTensor chooses the collectives op by op: counted on a fake run
        found, why = dtensor_collectives(sch, inputs, kwargs) if inputs or kwargs else (None, "")
        note = why or ("runs on DTensor activations, whose collectives are DTensor's own: pass example "
                       f"inputs to count them ({p.on_dtensors[0].path!r}: {p.on_dtensors[0].reason})"
                       if found is None else "")
        collectives = [Collective("", "region", r.direction, r.op, "?", "?", r.mesh_axis, "dtensor", r.bytes)  # type: ignore[arg-type]
                       for r in found or ()]
    for b in () if p.on_dtensors else p.boundaries:
        origin = _origin(sch, b)
        size = shapes.bytes_of(b, by_path) if shapes is not None else None
        if shapes is not None and b.tensor in ("dispatch", "combine", "counts"):
            size = _expert_bytes(sch, b, shapes, expert_imbalance)
        if shapes is not None and size is None and not note:
            note = f"no activation recorded for {b.path!r} (not called by the example inputs)"
        no_grad = shapes is not None and b.tensor == "input" and b.path in shapes.no_grad_inputs
        # an activation's boundary is crossed on every call; a parameter's gradient is reduced once
        times = 1 if shapes is None or b.tensor.startswith("param:") else shapes.calls.get(b.path, 1)
        for direction, ops in (("forward", b.forward), ("backward", () if no_grad else b.backward)):
            for op in (op for op in ops for _ in range(times)):
                collectives.append(
                    Collective(b.path, b.side, direction, op, b.src, b.dst, b.mesh_axis, origin, size)  # type: ignore[arg-type]
                )
    return TensorParallelExplanation(
        mesh=mesh,
        params=params,
        module_bytes=per_module,
        rank_bytes=sum(per_module.values()),
        total_bytes=sum(p.bytes for p in params),
        collectives=tuple(collectives),
        shapes_note=note,
    )


def _expert_bytes(sch: Schedule, b: Boundary, shapes: ActivationShapes, imbalance: float = 1.0) -> int | None:
    """Bytes of an expert-parallel block's exchanges: its pair counts ([ep, E] integers,
    all-gathered) and its token-expert pairs (T·k rows of the hidden size, dispatched and
    combined by all-to-all; k the config's experts per token), evenly routed times
    ``imbalance``, the busiest rank's excess."""
    entry = shapes.inputs.get(b.path)
    spec = sch.annotations.get(b.path, EXPERTS)
    if entry is None or spec is None or sch.mesh is None:
        return None
    if b.tensor == "counts":
        return int(sch.mesh.size(mesh_dims(sch.mesh).index(b.mesh_axis))) * spec.num_experts * 8
    top_k = config_value(config_of(sch.module), *EXPERTS_PER_TOKEN_ATTRS, default=1)
    shape, dtype = entry
    return math.ceil(_numel(shape) * int(top_k) * _itemsize(dtype) * imbalance)


# ----------------------------------------------------------------------------- data parallelism

#: DDP's (and composable ``replicate``'s) gradient buckets: the first holds up to 1 MiB,
#: the others up to 25 MiB (``bucket_cap_mb``), filled in reverse registration order.
DDP_BUCKET_BYTES = (1 << 20, 25 << 20)


def _unit_bytes(sch: Schedule, params: Sequence[tuple[str, nn.Parameter]], shards: int) -> int:
    """Bytes of one FSDP unit's parameters after gathering over ``shards`` ranks: each
    parameter's TP-local shape with dim 0 padded up to a multiple of ``shards``."""
    layouts: dict[str, Layout] = sch.annotations.of_kind(LAYOUT)
    total = 0
    for name, p in params:
        lay = layouts.get(name)
        shape = list(lay.local_shape(tuple(p.shape)) if lay is not None else p.shape)
        if shape:
            shape[0] = -(-shape[0] // shards) * shards
        total += _numel(shape) * p.element_size()
    return total


def _ddp_buckets(sizes: Sequence[int]) -> list[int]:
    """Bucket sizes of gradients of ``sizes`` bytes (registration order) under DDP."""
    buckets: list[int] = []
    current = 0
    for size in reversed(sizes):
        current += size
        if current >= DDP_BUCKET_BYTES[min(len(buckets), 1)]:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def data_parallel_collectives(sch: Schedule, microbatches: int = 1) -> tuple[Collective, ...]:
    """The collectives data parallelism issues in one step on one rank, from the
    ``data_parallel`` annotation; ``microbatches`` > 1: those of a pipeline stage
    (``sch``) running that many microbatches:

    * FSDP2 (``fsdp``, and HSDP's shard axis): per unit (each block holding parameters,
      then the root with the rest) one all-gather forward; one again in backward when
      ``reshard_after_forward`` (the root too, as measured with torch 2.13); one
      reduce-scatter of its gradients. In a pipeline stage, with
      ``reshard_after_forward``, one all-gather per microbatch forward and one for the
      backward pass (the stage keeps its parameters gathered between its backward
      microbatches and reduces gradients on the last: measured with torch 2.13's 1F1B
      and GPipe);
    * HSDP: also one all-reduce per unit over the replicate axis (of the shard);
    * DDP (``ddp``): one all-reduce per gradient bucket (:data:`DDP_BUCKET_BYTES`).

    ``bytes`` is the full (gathered) tensor: the unit's parameters, TP-local, with dim 0
    padded as FSDP2 pads it.

    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_world
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    >>> with fake_world(2):
    ...     mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ...     sch = sf.data_parallel(sf.create_schedule(model, mesh=mesh))
    ...     [(c.path, c.direction, c.op) for c in data_parallel_collectives(sch)]  # doctest: +NORMALIZE_WHITESPACE
    [('1.0', 'forward', 'all_gather'), ('1.1', 'forward', 'all_gather'), ('', 'forward', 'all_gather'),
     ('1.0', 'backward', 'all_gather'), ('1.0', 'backward', 'reduce_scatter'),
     ('1.1', 'backward', 'all_gather'), ('1.1', 'backward', 'reduce_scatter'),
     ('', 'backward', 'all_gather'), ('', 'backward', 'reduce_scatter')]
    """
    spec: DataParallelSpec | None = sch.annotations.get("", DATA_PARALLEL)
    if spec is None or sch.mesh is None:
        return ()
    names = mesh_dims(sch.mesh)
    sizes = dict(zip(names, (int(s) for s in sch.mesh.shape), strict=True))
    named = [(n, p) for n, p in sch.module.named_parameters() if p.requires_grad]
    if spec.mode == "ddp":
        axis = spec.mesh_axes[-1]
        grads = [_unit_bytes(sch, [(n, p)], 1) for n, p in named]
        return tuple(Collective("", "grads", "backward", "all_reduce", "P", "R", axis, "data_parallel", b)
                     for b in _ddp_buckets(grads))
    shard_axis = spec.mesh_axes[-1]
    replicate_axis = spec.mesh_axes[0] if spec.mode == "hsdp" else None
    shards = sizes[shard_axis]
    units: list[tuple[str, list[tuple[str, nn.Parameter]]]] = []
    taken: set[str] = set()
    for block in spec.blocks:
        mine = [(n, p) for n, p in named if n.startswith(block + ".")]
        if mine:
            units.append((block, mine))
            taken.update(n for n, _ in mine)
    rest = [(n, p) for n, p in named if n not in taken]
    units.append(("", rest))
    out: list[Collective] = []
    full = {path: _unit_bytes(sch, ps, shards) for path, ps in units}
    forwards = microbatches if spec.reshard_after_forward else 1
    for _ in range(forwards):
        for path, ps in units:
            if ps:
                out.append(Collective(path, "params", "forward", "all_gather", f"S(0)@{shard_axis}", "R",
                                      shard_axis, "data_parallel", full[path]))
    for path, ps in units:
        if not ps:
            continue
        if spec.reshard_after_forward:
            out.append(Collective(path, "params", "backward", "all_gather", "S(0)", "R", shard_axis,
                                  "data_parallel", full[path]))
        out.append(Collective(path, "grads", "backward", "reduce_scatter", "P", "S(0)", shard_axis,
                              "data_parallel", full[path]))
        if replicate_axis is not None:
            out.append(Collective(path, "grads", "backward", "all_reduce", "P", "R", replicate_axis,
                                  "data_parallel", full[path] // shards))
    return tuple(out)


# ----------------------------------------------------------------------------- the loss


def loss_collectives(sch: Schedule, shapes: ActivationShapes | None) -> tuple[Collective, ...]:
    """The loss's collectives: a vocab-parallel head whose logits stay sharded (a column
    module with ``sync(…, "fwd_post", Shard(-1))``) needs the vocab-parallel loss
    (:func:`slapo_fn.dtensor.loss.vocab_parallel_cross_entropy`): three all-reduces
    forward (max, sum of exponentials, target logit) of one float32 per row, none
    backward. ``bytes`` is ``None`` without example inputs; nothing for other heads (their
    logits are gathered by a boundary listed with the tensor-parallel collectives), nor for
    a column kept split for modules of the model that read it (BERT's recipe states q/k/v
    and the MLP's first layer so, for their rows): the data flow shows their readers."""
    out: list[Collective] = []
    with flows_memo():
        kept_split = [(path, role) for path, role in sch.annotations.of_kind(ROLE).items() if role.enters and any(
            s.mode == "fwd_post" and isinstance(s.layout, Shard) and s.layout.dim == -1
            for s in sch.annotations.get(path, SYNC, ())) and not users(sch, path)]  # logits, kept split
    for path, role in kept_split:
        entry = shapes.outputs.get(path) if shapes is not None else None
        rows = None if entry is None else _numel(entry[0][:-1]) * _itemsize(torch.float32)
        for what in ("max", "sum exp", "target logit"):
            out.append(Collective(path, f"loss {what}", "forward", "all_reduce", "P", "R", role.mesh_axis,
                                  "loss", rows))
    return tuple(out)


# ----------------------------------------------------------------------------- context parallelism


def context_parallel_collectives(sch: Schedule, shapes: ActivationShapes | None) -> tuple[Collective, ...]:
    """The collectives :func:`~slapo_fn.dtensor.context.context_parallel` issues in one
    step on one rank: per attention module an all-gather of K and of V forward and a
    reduce-scatter of each one's gradient backward (``bytes``: the gathered tensor, this
    rank's heads under tensor parallelism; ``None`` without example inputs); the loss's
    all-reduce (one float) forward; the all-reduce of every parameter's gradient over
    ``cp`` backward (this rank's shard of it).

    >>> import torch, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                   num_attention_heads=4, num_key_value_heads=2)
    >>> sch = sf.context_parallel(sf.create_schedule(LlamaForCausalLM(cfg), mesh=fake_mesh(2, names=("cp",))))
    >>> [(c.side, c.op) for c in context_parallel_collectives(sch, None)][:4]  # doctest: +NORMALIZE_WHITESPACE
    [('key', 'all_gather'), ('value', 'all_gather'), ('key grad', 'reduce_scatter'),
     ('value grad', 'reduce_scatter')]
    """
    specs = sch.annotations.of_kind(CP)
    if not specs or sch.mesh is None:
        return ()
    axis = next(iter(specs.values())).mesh_axis
    sizes = dict(zip(mesh_dims(sch.mesh), (int(s) for s in sch.mesh.shape), strict=True))
    roles = sch.annotations.of_kind(ROLE)
    out: list[Collective] = []
    for path in specs:
        for what, proj in (("key", "k_proj"), ("value", "v_proj")):
            entry = shapes.outputs.get(join(path, proj)) if shapes is not None else None
            role = roles.get(join(path, proj))
            heads = sizes.get(role.mesh_axis, 1) if role is not None else 1
            size = None if entry is None else _numel(entry[0]) * _itemsize(entry[1]) // heads
            out.append(Collective(path, what, "forward", "all_gather", f"S(1)@{axis}", "R", axis,
                                  "context_parallel", size))
        for what in ("key", "value"):
            gathered = out[-2 if what == "key" else -1].bytes
            out.append(Collective(path, f"{what} grad", "backward", "reduce_scatter", "P", f"S(1)@{axis}", axis,
                                  "context_parallel", gathered))
    out.append(Collective("", "loss", "forward", "all_reduce", "P", "R", axis, "context_parallel",
                          _itemsize(torch.float32)))
    frozen = {n for n, q in sch.module.named_parameters() if not q.requires_grad}
    for p in parameter_layouts(sch)[0]:
        if p.path not in frozen:
            out.append(Collective(parent_path(p.path), "grads", "backward", "all_reduce", "P", "R", axis,
                                  "context_parallel", p.rank_bytes))
    return tuple(out)
