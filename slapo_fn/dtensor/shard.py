"""``shard``: distribute a module's weight (bias following) or a named parameter over a mesh axis.

Linear layers, embeddings and convolutions shard as a whole (a column, a row); norms over
channels and grouped convolutions keep this rank's channels between them.

The primitive only records annotations — kind ``"layout"`` on each parameter path (a
:class:`~slapo_fn.dtensor.layout.Layout`) and kind ``"tp"`` on the module path (a
:class:`Role`: column, row, channels, vocab, embed_dim or param) — and validates eagerly. The
``tensor_parallel`` build phase turns them into DTensor parameters and boundary
resharding (see :mod:`slapo_fn.dtensor.plan`).

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> sch = sf.create_schedule(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), mesh=fake_mesh(2))
    >>> sch = sf.shard(sf.shard(sch, "0", axis=0), "2", axis=1)
    >>> print(sch)
    <root>: Sequential
      0: Linear  [column@tp]
        · weight: f32[16@tp, 8]
        · bias: f32[16@tp]
      1: GELU
      2: Linear  [row@tp]
        · weight: f32[8, 16@tp]
        · bias: f32[8]
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..combinators import primitive
from ..errors import LayoutError, Problem, ScheduleTypeError
from ..hf import head_dim_of, is_conv1d
from ..schedule import Key, Schedule
from ..select import Selection
from ..tree import adds_bias, get_module, join, parent_path, split, uncalled, walk
from .layout import Layout, from_spec, packed_shard
from .roles import (
    CHANNEL_NORMS,
    CONVOLUTIONS,
    Channels,
    Column,
    EmbedDim,
    Gathered,
    Role,
    Row,
    VocabEmbed,
    run_own_forward,
)

__all__ = ["LAYOUT", "ROLE", "Role", "feature_dims", "mesh_dims", "shard", "tied_paths"]

LAYOUT: Key[Layout] = Key("layout")
ROLE: Key[Role] = Key("tp")

def mesh_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    names = mesh.mesh_dim_names
    return tuple(names) if names else tuple(f"dim{i}" for i in range(mesh.ndim))


def _problem_mesh(sch: Schedule, path: str, mesh_axis: str) -> Problem | None:
    if sch.mesh is None:
        return Problem(
            path,
            "the schedule has no mesh",
            f'sf.create_schedule(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=({mesh_axis!r},)))',
        )
    if mesh_axis not in mesh_dims(sch.mesh):
        return Problem(
            path,
            f"mesh axis {mesh_axis!r} is not in the mesh {mesh_dims(sch.mesh)} of shape {tuple(sch.mesh.shape)}",
            f"pass mesh_axis= one of {mesh_dims(sch.mesh)}, or build the mesh with mesh_dim_names=(..., {mesh_axis!r})",
        )
    return None


def _problem_uncalled(sch: Schedule, path: str) -> Problem | None:
    """A module with no ``forward`` of its own (an ``nn.ModuleList``, ``nn.ModuleDict``)
    is never called, its items are: a sync or a chain boundary on it would never run."""
    m = get_module(sch.module, path)
    if not uncalled(m):
        return None
    return Problem(
        path,
        f"is a {type(m).__name__} with no forward of its own: its parent calls its items, never it, so a hook on "
        "it would never run",
        f"select its items instead: {join(path, '*')!r}",
    )


def _heads_problem(root: nn.Module, path: str, dim: int, packed: int, size: int, mesh_axis: str) -> Problem | None:
    parent = get_module(root, parent_path(path))
    # only ``head_dim`` (LLaMA, GPT-2, OPT …): BERT's 6 heads over 4 ranks build and match
    head_dim = head_dim_of(parent, ("head_dim",))
    if head_dim is None or (dim // packed) % head_dim:
        return None
    heads = dim // packed // head_dim
    if heads % size:
        return Problem(
            path,
            f"{heads} heads (of head_dim {head_dim}) are not divisible by the size {size} of mesh axis {mesh_axis!r}",
            f"use a mesh axis whose size divides {heads}, or leave {path!r} unsharded",
        )
    return None


@dataclass(frozen=True)
class _Plan:
    module: str
    role: Role | None
    params: tuple[tuple[str, Layout], ...]


def _layout(sch: Schedule, placement: Placement, mesh_axis: str) -> Layout:
    assert sch.mesh is not None
    dims = mesh_dims(sch.mesh)
    placements = tuple(placement if n == mesh_axis else Replicate() for n in dims)
    return Layout(placements, dims, tuple(sch.mesh.shape))


def _check_param(
    sch: Schedule, path: str, shape: Sequence[int], layout: Layout, packed: int, problems: list[Problem]
) -> None:
    for name, size, p in zip(layout.mesh_dims, layout.mesh_shape, layout.placements, strict=True):
        if not isinstance(p, Shard | _StridedShard):
            continue
        if not -len(shape) <= p.dim < len(shape):
            problems.append(
                Problem(
                    path,
                    f"axis {p.dim} is out of range for a parameter of shape {tuple(shape)}",
                    f"use an axis in 0..{len(shape) - 1}",
                )
            )
            continue
        dim = shape[p.dim]
        if packed < 1 or dim % packed:
            problems.append(
                Problem(
                    path,
                    f"packed={packed} does not divide axis {p.dim} of shape {tuple(shape)}",
                    f"use packed= a divisor of {dim} (e.g. 3 for a fused [Q|K|V])",
                )
            )
        elif dim % (size * packed):
            chunk = f"each of the {packed} packed chunks ({dim // packed})" if packed > 1 else f"dimension {dim}"
            problems.append(
                Problem(
                    path,
                    f"{chunk} of axis {p.dim} of shape {tuple(shape)} is not divisible by the size {size} "
                    f"of mesh axis {name!r}",
                    f"pad the dimension to a multiple of {size * packed}, use a smaller mesh axis, "
                    "or shard another axis",
                )
            )
    existing = sch.annotations.get(path, LAYOUT)
    if existing is not None and existing != layout:
        problems.append(
            Problem(
                path,
                f"already sharded as {existing} {existing.format(shape, _dtype(sch, path))}; now asked for {layout}",
                "shard each parameter once (or with the same layout)",
            )
        )


def _dtype(sch: Schedule, path: str) -> torch.dtype:
    tokens = split(path)
    param = get_module(sch.module, ".".join(tokens[:-1]))._parameters[tokens[-1]]
    assert param is not None  # shard validated that the parameter exists
    return param.dtype


def _placement_from(
    sch: Schedule,
    path: str,
    ndim: int,
    layout: Sequence[Placement] | Sequence[str | None] | None,
    problems: list[Problem],
) -> Layout | None:
    assert sch.mesh is not None
    dims, shape = mesh_dims(sch.mesh), tuple(sch.mesh.shape)
    assert layout is not None
    if all(isinstance(p, Placement) for p in layout):
        if len(layout) != len(dims):
            problems.append(
                Problem(
                    path,
                    f"layout has {len(layout)} placements for a mesh of {len(dims)} dimensions {dims}",
                    "give one placement per mesh dimension, e.g. (Replicate(), Shard(0))",
                )
            )
            return None
        return Layout(tuple(layout), dims, shape)  # type: ignore[arg-type]
    if len(layout) != ndim:
        problems.append(
            Problem(
                path,
                f"PartitionSpec-style layout {tuple(layout)!r} has {len(layout)} entries for a {ndim}-D parameter",
                "give one mesh-axis name (or None) per tensor dimension, e.g. ('tp', None)",
            )
        )
        return None
    try:
        return from_spec(layout, dims, shape)  # type: ignore[arg-type]
    except KeyError as e:
        problems.append(
            Problem(path, f"mesh axis {e.args[0]!r} is not in the mesh {dims}", f"use mesh-axis names from {dims}")
        )
    except ValueError as e:
        problems.append(Problem(path, str(e), "shard a tensor dimension over each mesh axis at most once"))
    return None


def _module_plan(
    sch: Schedule,
    path: str,
    module: nn.Module,
    axis: int | None,
    mesh_axis: str,
    packed: int,
    layout: Sequence[Placement] | Sequence[str | None] | None,
    problems: list[Problem],
) -> _Plan | None:
    if isinstance(module, CHANNEL_NORMS) or (isinstance(module, CONVOLUTIONS) and module.groups > 1):
        return _channels_plan(sch, path, module, axis, mesh_axis, packed, layout, problems)
    weight = module._parameters.get("weight")
    if not _a_layer(module) or weight is None:
        problems.append(_whole_module_problem(sch.module, path, module))
        return None
    if layout is not None:
        lay = _placement_from(sch, path + ".weight", weight.dim(), layout, problems)
        if lay is None:
            return None
        tp = [p for n, p in zip(lay.mesh_dims, lay.placements, strict=True) if n == mesh_axis]
        others = [p for n, p in zip(lay.mesh_dims, lay.placements, strict=True) if n != mesh_axis]
        if any(isinstance(p, Shard | _StridedShard) for p in others) or not tp or not isinstance(tp[0], Shard):
            return _Plan(path, Gathered(mesh_axis), (("weight", lay),))
        axis = tp[0].dim % weight.dim()
    if axis is None:
        problems.append(Problem(path, "neither axis= nor layout= given", "pass axis=0 (column) or axis=1 (row)"))
        return None
    if not -weight.dim() <= axis < weight.dim():
        problems.append(
            Problem(
                path,
                f"axis {axis} is out of range for weight of shape {tuple(weight.shape)}",
                f"use an axis in 0..{weight.dim() - 1}",
            )
        )
        return None
    axis %= weight.dim()
    w = _layout(sch, packed_shard(axis, packed), mesh_axis)
    has_bias = module._parameters.get("bias") is not None
    out_axis = 1 if is_conv1d(module) else 0
    if isinstance(module, nn.Embedding):
        return _Plan(path, (VocabEmbed if axis == 0 else EmbedDim)(mesh_axis, packed), (("weight", w),))
    if isinstance(module, CONVOLUTIONS) and packed != 1:
        problems.append(Problem(path, f"packed={packed}: a convolution's channels are not fused chunks",
                                f"shard(sch, {path!r}, axis={axis})"))
        return None
    column = axis == out_axis
    bias = _layout(sch, packed_shard(0, packed), mesh_axis) if column else _layout(sch, Replicate(), mesh_axis)
    params: tuple[tuple[str, Layout], ...] = (("weight", w), ("bias", bias)) if has_bias else (("weight", w),)
    if isinstance(module, nn.Linear):  # a subclass's own parameters (LoRA's A and B) split alike
        out_f, in_f = weight.shape
        for name, p in module._parameters.items():
            if p is None or name in ("weight", "bias"):
                continue
            fdim = feature_dims(tuple(p.shape), out_f, in_f)[0 if column else 1]
            if fdim is not None:
                params += ((name, _layout(sch, packed_shard(fdim, packed if column else 1), mesh_axis)),)
    dim = 1 if isinstance(module, CONVOLUTIONS) else -1  # a convolution's channels: dim 1 of N, C, ...
    return _Plan(path, (Column if column else Row)(mesh_axis, packed, dim), params)


def _over_channels(module: nn.Module) -> bool:
    """A convolution or a norm over channels (``N, C, ...``)."""
    return isinstance(module, (*CONVOLUTIONS, *CHANNEL_NORMS))


def _channels_plan(
    sch: Schedule,
    path: str,
    module: nn.Module,
    axis: int | None,
    mesh_axis: str,
    packed: int,
    layout: Sequence[Placement] | Sequence[str | None] | None,
    problems: list[Problem],
) -> _Plan | None:
    """A convolution whose groups are more than one (depthwise included), or a norm over
    channels: ``axis=0`` splits its channels, whole groups on each rank, and every
    per-channel tensor with them (a BatchNorm's running statistics too); the module then
    computes this rank's channels from its own (:class:`~.roles.Channels`)."""
    assert sch.mesh is not None
    kind = type(module).__name__
    size = sch.mesh.size(mesh_dims(sch.mesh).index(mesh_axis))
    if layout is not None or packed != 1 or axis not in (0, -_ndim(module)):
        given = f"layout={tuple(layout)!r}" if layout is not None else f"axis={axis}, packed={packed}"
        what = "its channels are its groups' own" if isinstance(module, CONVOLUTIONS) else "it computes per channel"
        problems.append(Problem(path, f"a {kind} is sharded by its channels only ({what}); got {given}",
                                f"shard(sch, {path!r}, axis=0): each rank holds whole groups of channels"))
        return None
    if isinstance(module, CONVOLUTIONS):
        channels, groups = module.out_channels, module.groups
    elif isinstance(module, nn.GroupNorm):
        channels, groups = module.num_channels, module.num_groups
    else:
        channels = groups = int(getattr(module, "num_features", 0))
    if groups % size:
        grouped = isinstance(module, (*CONVOLUTIONS, nn.GroupNorm))
        unit = f"{groups} groups of {channels} channels" if grouped else f"{channels} channels"
        part = ": a rank would hold part of a group" if grouped else ""
        problems.append(Problem(path, f"a {kind}'s {unit} do not divide by the size {size} of mesh axis "
                                      f"{mesh_axis!r}{part}",
                                f"use a mesh axis whose size divides {groups}, or leave {path!r} unsharded"))
        return None
    split = _layout(sch, Shard(0), mesh_axis)
    names = ("weight", "bias", "running_mean", "running_var")
    tensors = tuple((n, split) for n in names if _tensor_of(module, n) is not None)
    return _Plan(path, Channels(mesh_axis, dim=1), tensors)


def _ndim(module: nn.Module) -> int:
    w = module._parameters.get("weight")
    return 1 if w is None else w.dim()


def _tensor_of(module: nn.Module, name: str) -> torch.Tensor | None:
    """A module's own parameter or buffer ``name``, or ``None``."""
    return module._parameters.get(name, module._buffers.get(name))


def feature_dims(shape: Sequence[int], out_features: int, in_features: int) -> tuple[int | None, int | None]:
    """Which dimension of a linear layer's parameter of ``shape`` indexes its output
    features and which its input features (``None``: none does), laid out as the weight
    ``(out, in)`` and the bias ``(out,)`` are: the first dimension where it has the output
    width, the last (another one) where it has the input width. A column splits every
    parameter along its output features (LoRA's ``B (out, r)`` with the weight's rows), a
    row along its input features (LoRA's ``A (r, in)`` with the weight's columns); one with
    neither (``A`` of a column, ``B`` of a row) is whole on every rank, its gradient a
    partial sum all-reduced. A parameter laid out otherwise (an input scale ``(in,)`` of a
    square layer) is read wrong, and the probe of :func:`_shards_as_a_layer` then refuses
    the split (the module runs on gathered parameters instead)."""
    out = 0 if shape and shape[0] == out_features else None
    inp = len(shape) - 1 if shape and shape[-1] == in_features and len(shape) - 1 != out else None
    return out, inp


def _split_features(module: nn.Module, role: Role | None) -> tuple[int, int] | None:
    """The weight dimension a column's outputs or a row's inputs split (attention's heads,
    where its parent has them) and its packing; ``None`` for other roles."""
    conv = is_conv1d(module)
    if isinstance(role, Column):
        return (1 if conv else 0), role.packed
    if isinstance(role, Row):
        return (0 if conv else 1), 1
    return None


def _check_arguments(axis: object, mesh_axis: object, packed: object, layout: object) -> None:
    """Arguments of the wrong type or meaningless values, refused before any path is read."""
    typed = []
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
        typed.append(Problem("axis", f"expected an int (a tensor dimension), got {type(axis).__name__} {axis!r}",
                             "axis=0 (column-parallel) or axis=1 (row-parallel)"))
    if not isinstance(mesh_axis, str):
        typed.append(Problem("mesh_axis", f"expected a mesh-axis name, got {type(mesh_axis).__name__}",
                             "mesh_axis='tp'"))
    if isinstance(packed, bool) or not isinstance(packed, int):
        typed.append(Problem("packed", f"expected an int, got {type(packed).__name__} {packed!r}",
                             "packed=3 for a fused [Q|K|V]; 1 otherwise"))
    if layout is not None and (isinstance(layout, str) or not isinstance(layout, Sequence)):
        typed.append(Problem("layout", f"expected a sequence of placements or mesh-axis names, got "
                                       f"{type(layout).__name__}", "layout=('tp', None) or (Shard(0),)"))
    if typed:
        raise ScheduleTypeError("shard", typed)
    if isinstance(packed, int) and packed < 1:
        raise LayoutError("shard", [Problem("packed", f"is {packed}; it counts fused chunks, at least 1",
                                            "packed=1, or the number of fused chunks (3 for [Q|K|V])")])


def _a_layer(module: nn.Module) -> bool:
    """A Linear, Embedding, Conv1D, convolution or norm over channels with a weight (a
    subclass too)."""
    return (isinstance(module, nn.Linear | nn.Embedding) or is_conv1d(module) or _over_channels(module)) \
        and module._parameters.get("weight") is not None


def _own_forward(module: nn.Module) -> str | None:
    """The base layer (``"Linear"``, ``"Embedding"``) whose forward a subclass overrides
    with one that computes something else, or ``None``. Read by running both forwards on
    a small probe of the module (its own attributes, small random parameters, no
    children): Falcon's ``FalconLinear`` (``x @ W.T + b``) is a Linear; a forward that
    differs, or fails on the probe, is not."""
    for base in (nn.Linear, nn.Embedding):
        if isinstance(module, base) and type(module).forward is not base.forward:
            return None if _acts_as(module, base) else base.__name__
    return None


def _acts_as(module: nn.Module, base: type[nn.Linear] | type[nn.Embedding]) -> bool:
    g = torch.Generator().manual_seed(0)
    probe = copy.copy(module)  # its own __dict__: the module itself is not touched
    params: dict[str, torch.Tensor | None]
    if base is nn.Linear:
        params = {"weight": torch.randn(3, 5, generator=g),
                  "bias": torch.randn(3, generator=g) if module._parameters.get("bias") is not None else None}
        vars(probe).update(in_features=5, out_features=3)
        x = torch.randn(2, 5, generator=g)
    else:
        params = {"weight": torch.randn(7, 3, generator=g)}
        vars(probe).update(num_embeddings=7, embedding_dim=3, padding_idx=None)
        x = torch.tensor([[0, 3, 6, 2]])
    vars(probe).update(_parameters=params, _buffers={}, _modules={}, _forward_hooks={}, _forward_pre_hooks={})
    try:
        with torch.no_grad():
            got, want = type(module).forward(probe, x), base.forward(probe, x)  # type: ignore[arg-type]
        return isinstance(got, torch.Tensor) and got.shape == want.shape and bool(torch.allclose(got, want))
    except Exception:  # the subclass's forward needs more than a layer of its kind: not one
        return False


_KNOWN = "Linear, Embedding, Conv1D, Conv1d/2d/3d, BatchNorm, InstanceNorm, GroupNorm"


#: The probe's sizes (output, input features) and its number of ranks: distinct widths, so
#: that a dimension of one is never read as the other.
_PROBE_OUT, _PROBE_IN, _PROBE_RANKS = 6, 4, 2


def _shards_as_a_layer(module: nn.Module, plan: _Plan) -> bool:
    """Whether a ``Linear`` subclass's own forward, run on each rank's shards as ``plan``'s
    role runs it (:meth:`.roles.Role.local_forward`), gives what its forward gives on the
    whole: a column's outputs concatenated, or a row's partial sums added up with the bias
    after. Read on a small probe of the module (its attributes, parameters of the probe's
    widths laid out as :func:`feature_dims` reads them, two ranks). The probe's values are
    small integers, with the largest magnitude in every shard: a forward that casts to a low
    precision with a scale from each tensor's largest value (float8) computes them exactly.
    A forward mixing features (a top-k, a softmax or a norm over its outputs), or one that
    fails on the probe, does not shard as a layer."""
    role = plan.role
    if not isinstance(module, nn.Linear) or not isinstance(role, Column | Row) or role.packed != 1:
        return False
    weight = module._parameters["weight"]
    assert weight is not None
    out_f, in_f = weight.shape
    g = torch.Generator().manual_seed(0)
    full: dict[str, torch.Tensor | None] = {}
    split_dim: dict[str, int | None] = {}
    column = isinstance(role, Column)
    for name, p in module._parameters.items():
        if p is None:
            full[name] = None
            continue
        if not p.dtype.is_floating_point:
            return False
        dims = feature_dims(tuple(p.shape), out_f, in_f)
        shape = [_PROBE_OUT if d == dims[0] else _PROBE_IN if d == dims[1] else n for d, n in enumerate(p.shape)]
        split_dim[name] = dims[0] if column else dims[1]
        full[name] = _probe_values(shape, split_dim[name], g)
    x = _probe_values([3, _PROBE_IN], None if column else 1, g)
    probe = copy.copy(module)  # its own __dict__: the module itself is not touched
    vars(probe).update(in_features=_PROBE_IN, out_features=_PROBE_OUT, _modules={}, _forward_hooks={},
                       _forward_pre_hooks={}, _parameters=dict(full))
    bias = full.get("bias") if adds_bias(module) else None
    try:
        with torch.no_grad():
            want = run_own_forward(probe, full, x)
            parts = []
            for r in range(_PROBE_RANKS):
                local = {n: _shard_of(t, split_dim.get(n), r) for n, t in full.items()}
                if column:
                    parts.append(run_own_forward(probe, local, x))
                else:
                    if "bias" in local:  # a row's bias is added once, after the sum
                        local["bias"] = None
                    parts.append(run_own_forward(probe, local, x.chunk(_PROBE_RANKS, -1)[r]))
            got = torch.cat(parts, -1) if column else sum(parts[1:], parts[0]) + (0 if bias is None else bias)
        return (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and got.shape == want.shape
                and bool(torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-4)))
    except Exception:  # the subclass's forward needs more than a layer of its kind: not one
        return False


def _shard_of(t: torch.Tensor | None, dim: int | None, rank: int) -> torch.Tensor | None:
    return t if t is None or dim is None else t.chunk(_PROBE_RANKS, dim)[rank]


def _probe_values(shape: Sequence[int], split: int | None, g: torch.Generator) -> torch.Tensor:
    """Values of ±1 and ±2 (exact in float8), with a 2 in every shard along ``split``."""
    t = (torch.randint(1, 3, tuple(shape), generator=g) * (torch.randint(0, 2, tuple(shape), generator=g) * 2 - 1))
    t = t.float()
    if t.numel():
        for chunk in t.chunk(_PROBE_RANKS, split) if split is not None else (t,):
            chunk[(0,) * chunk.dim()] = 2.0
    return t


def _whole_module_problem(root: nn.Module, path: str, module: nn.Module) -> Problem:
    """Why ``module`` cannot be sharded as a whole, with a fix naming only paths that exist:
    its own parameters, else the shardable modules inside it, else those beside it."""
    kind = type(module).__name__
    reason = f"cannot shard a {kind} as a whole (known: {_KNOWN})"
    own = [join(path, n) for n, p in module._parameters.items() if p is not None]
    if own:
        return Problem(path, reason, f"shard its parameters by path, e.g. shard(sch, {own[0]!r}, axis=0)")
    inside = [join(path, q) for q, m in walk(module) if q and _a_layer(m)]
    if inside:
        return Problem(path, reason, f"shard the layers inside it, e.g. {', '.join(repr(q) for q in inside[:3])}")
    tokens = split(path)
    parent_path = ".".join(tokens[:-1])
    beside = [join(parent_path, n) for n, m in get_module(root, parent_path)._modules.items()
              if m is not None and tokens and n != tokens[-1] and _a_layer(m)]
    inner = " (nor does anything inside it)" if any(True for _ in module.children()) else ""
    reason = f"a {kind} has no parameters to shard{inner}"
    if beside:
        return Problem(path, reason, f"shard a layer beside it, e.g. {', '.join(repr(q) for q in beside[:3])}")
    return Problem(path, reason, f"select a {_KNOWN} module (print(sch) shows the tree)")


@primitive
def shard(
    sch: Schedule,
    where: Selection,
    axis: int | None = None,
    *,
    mesh_axis: str = "tp",
    packed: int = 1,
    layout: Sequence[Placement] | Sequence[str | None] | None = None,
) -> Schedule:
    """Shard the selected modules' weights (bias following) or the selected parameters.

    * ``nn.Linear``: ``axis=0`` is column-parallel (output features; bias sharded too),
      ``axis=1`` row-parallel (input features; bias replicated, added once after the
      reduction). HF ``Conv1D`` stores (in, out): ``axis=1`` is column, ``axis=0`` row.
      ``nn.Embedding``: ``axis=0`` is vocab-parallel, ``axis=1`` shards the embedding dim.
    * ``nn.Conv1d``/``Conv2d``/``Conv3d``: ``axis=0`` is a column over output channels (its
      output split on dim 1 of ``N, C, ...``), ``axis=1`` a row over input channels (a
      partial sum, the bias added once after it). A grouped or depthwise convolution, and
      a norm over channels (``BatchNorm``, ``InstanceNorm``, ``GroupNorm``), shard
      ``axis=0`` only: whole groups of channels on each rank, every per-channel tensor
      with them (a BatchNorm's running statistics too); it runs on this rank's channels
      between a column and the row it feeds, as an activation does, and is refused
      elsewhere. Groups (or channels) that do not divide by the mesh axis are refused.
    * A parameter path (``"h.0.ln_1.weight"``): that tensor only; its module then runs
      on the gathered parameter (correct for any module, at one all-gather per use).
      A ``Linear`` subclass with a forward of its own (float8, LoRA, quantized) is a
      column or row too, its forward run on each rank's shards, its own parameters split
      along the features its role splits (:func:`feature_dims`), where a probe shows that
      this computes what its forward does on the whole. One that does not (Llama-4's
      router, a top-k over its outputs), and an ``Embedding`` subclass computing more than
      its base (BART's and OPT's learned positions), keep their own forward, run on their
      parameters (the layer's layouts) gathered.
    * ``packed=k`` shards each of ``k`` fused chunks separately (GPT-2 ``c_attn`` =
      [Q|K|V]: ``axis=1, packed=3``).
    * ``layout=`` DTensor placements (one per mesh dimension) or a PartitionSpec-style
      tuple of mesh-axis names, one per tensor dimension (``("tp", None)``).

    Validates everything at once (axis range, divisibility by the mesh-axis size and by
    ``packed``, attention heads, mesh axis, conflicting earlier shards) and raises
    :class:`~slapo_fn.errors.LayoutError`. Returns a new schedule; the input is unchanged.

    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> sch = sf.create_schedule(nn.Linear(6, 6, bias=False), mesh=fake_mesh(4))
    >>> sf.shard(sch, "", axis=0)
    Traceback (most recent call last):
    ...
    slapo_fn.errors.LayoutError: shard: 'weight': dimension 6 of axis 0 of shape (6, 6) is not divisible by the \
size 4 of mesh axis 'tp'
          fix: pad the dimension to a multiple of 4, use a smaller mesh axis, or shard another axis
    """
    _check_arguments(axis, mesh_axis, packed, layout)
    paths = where.paths(sch.module)
    problems: list[Problem] = []
    for path in paths:
        p = _problem_mesh(sch, path, mesh_axis)
        if p is not None:
            problems.append(p)
    if problems:
        raise LayoutError("shard", problems)
    assert sch.mesh is not None
    size = sch.mesh.size(mesh_dims(sch.mesh).index(mesh_axis))
    plans: list[_Plan] = []
    for path in paths:
        try:
            module = get_module(sch.module, path)
        except KeyError:
            tokens = split(path)
            owner, name = ".".join(tokens[:-1]), tokens[-1]
            param = get_module(sch.module, owner)._parameters[name]
            assert param is not None
            if layout is not None:
                lay = _placement_from(sch, path, param.dim(), layout, problems)
            elif axis is None:
                problems.append(Problem(path, "neither axis= nor layout= given", "pass axis=0 or layout=('tp', None)"))
                lay = None
            else:
                lay = _layout(sch, packed_shard(axis, packed), mesh_axis)
            if lay is not None:
                _check_param(sch, path, tuple(param.shape), lay, packed, problems)
                plans.append(_Plan(owner, None, ((name, lay),)))
            continue
        plan = _module_plan(sch, path, module, axis, mesh_axis, packed, layout, problems)
        if plan is None:
            continue
        if _own_forward(module) is not None and not _shards_as_a_layer(module, plan):
            # a subclass computing more than its layer on each feature (learned positions made
            # from a mask, a router picking experts) keeps its own forward, which a sharded
            # layer's would replace: its parameters take the layer's layouts, gathered for each call
            plan = _Plan(path, Gathered(mesh_axis), plan.params)
        for name, lay in plan.params:
            tensor = _tensor_of(module, name)
            assert tensor is not None
            _check_param(sch, join(path, name), tuple(tensor.shape), lay, packed, problems)
        features = _split_features(module, plan.role)
        if features is not None:
            w = module._parameters["weight"]
            assert w is not None
            h = _heads_problem(sch.module, path, w.shape[features[0]], features[1], size, mesh_axis)
            if h is not None:
                problems.append(h)
        existing = sch.annotations.get(path, ROLE)
        if existing is not None and plan.role is not None and existing != plan.role:
            problems.append(
                Problem(path, f"already sharded as {existing}; now asked for {plan.role}", "shard each module once")
            )
        plans.append(plan)
    problems += _tie_problems(sch, {join(p.module, n): lay for p in plans for n, lay in p.params})
    if problems:
        raise LayoutError("shard", problems)
    for plan in plans:
        if plan.role is not None:
            sch = sch.annotate_path(plan.module, ROLE, plan.role)
        elif sch.annotations.get(plan.module, ROLE) is None:
            sch = sch.annotate_path(plan.module, ROLE, Gathered(mesh_axis))
        for name, lay in plan.params:
            sch = sch.annotate_path(join(plan.module, name), LAYOUT, lay)
    return sch


def tied_paths(root: nn.Module) -> dict[str, tuple[str, ...]]:
    """``{path: every path of the same Parameter}`` for parameters reachable at two or more
    paths (a tied embedding and LM head); untied parameters are left out."""
    groups: dict[int, list[str]] = {}
    for path, p in root.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(path)
    return {path: tuple(paths) for paths in groups.values() if len(paths) > 1 for path in paths}


def _tie_problems(sch: Schedule, new: dict[str, Layout]) -> list[Problem]:
    """A tied parameter has one layout: asking for another at one of its paths than the
    one it has (or is given now) at another path is refused, naming both paths."""
    ties = tied_paths(sch.module) if new else {}
    problems = []
    for path, lay in new.items():
        for other in ties.get(path, ()):
            if other == path:
                continue
            theirs = new.get(other, sch.annotations.get(other, LAYOUT))
            if theirs is not None and theirs != lay and (other not in new or path < other):
                problems.append(Problem(
                    path,
                    f"is the same parameter as {other!r} (tied), which is sharded as {theirs}; now asked for {lay}",
                    f"shard {path!r} and {other!r} alike (one layout for the tied tensor), or untie them first",
                ))
    return problems
