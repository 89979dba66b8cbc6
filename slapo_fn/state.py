"""Distributed checkpoints that reshard: ``save``, ``load``, ``full_state_dict``.

Built on ``torch.distributed.checkpoint`` (DCP) and its ``get_state_dict`` /
``set_state_dict``: the keys are the FQNs of the unscheduled model, every rank writes its
own shards, and a checkpoint written under one layout (dp2×tp2, pp2, FSDP…) loads under
another (tp4, a single process without a process group, …), model and optimizer state.

On disk (:mod:`slapo_fn.checkpoint_dir`)::

    path/
      LATEST              name of the newest complete, verified checkpoint ("step-00000012")
      step-00000012/      DCP files (.metadata + one file per rank), each rank's own state
                          (``rank_state``: train-state-<rank>.pt), manifest.json

A save writes a new step directory under a temporary name; when every rank is done, the
ranks hash the files between them (xxh3-128) and rank 0 writes the manifest of their
sizes and digests, renames the directory, and only then replaces ``LATEST`` (an atomic
``os.replace``): a save interrupted part-way leaves the previous checkpoint loadable, a
failed one removes its folder, and ``LATEST`` never names a checkpoint without a manifest.
Before writing, a save checks the free space against the previous checkpoint's size (or,
for the first, the bytes of the state it saves): when short it deletes the oldest
checkpoints first, and when that is not enough it writes nothing
(:class:`CheckpointSpaceError`). :func:`load` verifies every file against the manifest
before any tensor is read, the ranks sharing the reading, and falls back past a
checkpoint that does not verify.

Packed parameters (``sf.shard(..., packed=k)``: a ``_StridedShard`` placement, each of
``k`` fused chunks sharded separately) are a layout DCP cannot describe: its planner gives
each rank one box of the full tensor, but a packed shard is ``k`` boxes, so a save fails
("overlapping chunks") and a load reads the wrong elements without an error. ``save``
therefore redistributes every such tensor (parameters and optimizer state alike) to the
plain ``Shard`` of the same tensor dimension before handing it to DCP, and ``load`` reads
into that plain layout and redistributes back. The checkpoint holds the true full tensor
in its original element order, chunked like any column-parallel one, so it loads under
any layout (packed or not, other TP degrees, FSDP, a single process). FSDP2 over a packed
dimension (a packed bias under ``data_parallel`` on a dp×tp mesh) is undone too: its
chunks are gathered over dp first, and saved replicated over dp (DCP writes one copy).
The cost is a redistribution per packed tensor at save and load, and while it runs one
extra copy of 1/tp of each packed tensor per rank (the redistribution itself may gather
one full tensor at a time).

Example:
    >>> import tempfile, torch, torch.nn as nn, slapo_fn as sf
    >>> model = nn.Linear(2, 2)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> path = tempfile.mkdtemp()
    >>> _ = sf.save(model, opt, path, step=3)
    >>> other = nn.Linear(2, 2)
    >>> sf.load(other, torch.optim.AdamW(other.parameters()), path)
    3
    >>> torch.equal(other.weight, model.weight)
    True
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor as dtensor
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .checkpoint_dir import (
    PARTIAL,
    RANK_STATE,
    checkpoints,
    digests,
    free_bytes,
    latest,
    manifest_problems,
    prune,
    size_of,
    step_name,
    step_of,
    write_manifest,
)
from .errors import Problem, ScheduleError
from .ranks import every_rank

__all__ = [
    "CheckpointFallback",
    "CheckpointSpaceError",
    "CheckpointWriteError",
    "checkpoints",
    "full_state_dict",
    "latest",
    "load",
    "loadable",
    "rank_state",
    "save",
    "step_of",
]


def _modules(model: object) -> list[nn.Module]:
    """The modules a rank holds: a module, a sequence of them, or a pipeline runner
    (:class:`slapo_fn.Pipeline`, whose ``modules`` maps stage indices to modules)."""
    if isinstance(model, nn.Module):
        return [model]
    stages = getattr(model, "modules", None)  # a pipeline runner: {stage index: module}
    if isinstance(stages, Mapping) and all(isinstance(m, nn.Module) for m in stages.values()):
        return list(stages.values())
    if isinstance(model, Sequence) and model and all(isinstance(m, nn.Module) for m in model):
        return list(model)
    raise ScheduleError("save/load", [Problem("", f"expected a built model (nn.Module), a list of them or a "
                                                  f"pipeline runner, got {type(model).__name__}",
                                              "pass the result of sf.build(sch) or sf.build_pipeline(sch, ...)")])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


#: Module-tree segments that wrappers add to parameter names (activation checkpointing,
#: torch.compile, FSDP1): not part of the model's FQNs, so not of a checkpoint's keys.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _clean_fqns(tree: Any) -> Any:
    """A functional optimizer state (``sf.optim``: nested dicts keyed by FQNs) with
    wrapper segments removed from its keys, sharing the tensors."""
    if isinstance(tree, Mapping):
        out = {}
        for k, v in tree.items():
            key = k
            if isinstance(k, str):
                for seg in _WRAPPER_SEGMENTS:
                    key = key.replace(seg, "")
            out[key] = _clean_fqns(v)
        return out
    if isinstance(tree, list | tuple):
        return type(tree)(_clean_fqns(v) for v in tree)
    return tree


def _copy_into(target: Any, loaded: Any) -> None:
    """Write the values of ``loaded`` (a tree shaped like ``target``) into ``target``'s
    tensors, in place, where they are not already the same tensors."""
    if isinstance(target, torch.Tensor):
        if loaded is not target:
            with torch.no_grad():
                dst = target.to_local() if isinstance(target, DTensor) else target
                src = loaded.to_local() if isinstance(loaded, DTensor) else loaded
                dst.copy_(src)
    elif isinstance(target, Mapping):
        for k, v in target.items():
            _copy_into(v, loaded[k])
    elif isinstance(target, list | tuple):
        for v, w in zip(target, loaded, strict=True):
            _copy_into(v, w)


OptimizerState = torch.optim.Optimizer | Mapping[str, Any] | None


def _states(model: object, optimizer: OptimizerState) -> dict[str, Any]:
    modules = _modules(model)
    if isinstance(optimizer, Mapping):  # a functional optimizer's state (sf.optim): a pytree of tensors
        return {**_states(model, None), "optim": _clean_fqns(optimizer)}
    if optimizer is None:
        merged: dict[str, Any] = {}
        for m in modules:
            merged.update(get_model_state_dict(m))
        return {"model": merged}
    if len(modules) != 1:  # several stages on this rank: a container, keys unprefixed again
        model_sd, optim_sd = get_state_dict(nn.ModuleList(modules), optimizer)
        return {"model": _unprefix(model_sd), "optim": _map_optim(optim_sd, lambda k: k.split(".", 1)[1])}
    model_sd, optim_sd = get_state_dict(modules[0], optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _unprefix(state: dict[str, Any]) -> dict[str, Any]:
    return {k.split(".", 1)[1]: v for k, v in state.items()}


def _map_optim(optim: dict[str, Any], rename: Any) -> dict[str, Any]:
    """Rename the parameter keys of an optimizer state dict as returned by ``get_state_dict``."""
    groups = [{**g, "params": [rename(k) for k in g["params"]]} for g in optim.get("param_groups", [])]
    return {"state": {rename(k): v for k, v in optim.get("state", {}).items()}, "param_groups": groups}


# -- packed (_StridedShard) tensors: a DCP-safe layout with the same values -----------------
_Where = tuple[object, ...]  # a value's place in a (nested) state dict: the keys / indices down to it


def _sharded_dim(p: Placement) -> int | None:
    return p.dim if isinstance(p, Shard | _StridedShard) else None


@dataclass(frozen=True)
class _Relayout:
    """How a DTensor that DCP cannot describe is saved: its own layout, and the DCP-safe
    one with the same values (``safe``: each packed ``_StridedShard(d, k)`` -> ``Shard(d)``,
    each FSDP2 ``_StridedShard`` over a packed dimension -> ``Replicate``).

    DCP describes a rank's part of a tensor as one box. A ``_StridedShard(d, split_factor=s)``
    on mesh dimension ``i`` is one box only when ``s`` is the product of the sizes of the
    later mesh dimensions that also shard ``d``: then it is how FSDP2 shards the local
    tensor of a TP layout, and DCP reads it right. Any other is *packed* (``sf.shard(...,
    packed=k)``: ``k`` boxes per rank). FSDP2 over a packed dimension (``fully_shard`` of a
    packed bias: ``(_StridedShard(0, 2), _StridedShard(0, 3))``) is a layout that DTensor's
    own ``redistribute``/``full_tensor`` get wrong too, so its FSDP2 chunks are gathered by
    hand (:meth:`gather`, :meth:`scatter`) from the local tensor of the packed layout.
    Everything here depends on the layout only, never on the rank: every rank agrees.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    safe: tuple[Placement, ...]
    outer: tuple[int, ...]  # mesh dims of FSDP2 _StridedShards over a packed tensor dimension
    packed: tuple[int, ...]  # mesh dims of packed _StridedShards

    @staticmethod
    def of(t: DTensor, name: str = "") -> _Relayout | None:
        """The relayout ``t`` (state-dict key ``name``) needs, or ``None`` when DCP handles
        its layout as it is. Raises :class:`ScheduleError` for a packed layout it cannot undo."""
        mesh, placements = t.device_mesh, tuple(t.placements)
        dims = [_sharded_dim(p) for p in placements]

        def inner(i: int) -> int:  # how many parts the later mesh dims cut tensor dim dims[i] into
            return math.prod(mesh.size(j) for j in range(i + 1, len(dims)) if dims[j] == dims[i])

        packed = tuple(i for i, p in enumerate(placements)
                       if isinstance(p, _StridedShard) and p.split_factor != inner(i))
        if not packed:
            return None
        packed_dims = {dims[i] for i in packed}
        outer = tuple(i for i, p in enumerate(placements)
                      if isinstance(p, _StridedShard) and i not in packed and dims[i] in packed_dims)
        for i in packed:
            uses = [j for j, d in enumerate(dims) if d == dims[i] and j != i]
            if inner(i) != 1 or any(j not in outer for j in uses) or len(uses) > 1:
                raise ScheduleError("save/load", [Problem(
                    name, f"cannot checkpoint a tensor of layout {placements} on mesh {tuple(mesh.shape)}: tensor "
                        f"dimension {dims[i]} is sharded packed and also by other mesh dimensions",
                    "shard a packed dimension over one mesh axis only (FSDP2 over it is fine)")])
        safe = tuple(Shard(dims[i]) if i in packed else Replicate() if i in outer else p  # type: ignore[arg-type]
                     for i, p in enumerate(placements))
        return _Relayout(mesh, placements, t.shape, tuple(t.stride()), safe, outer, packed)

    def _fsdp_views(self) -> tuple[torch.Size, tuple[Placement, ...], tuple[Placement, ...]]:
        """The packed layout's local tensor as a global one (its shape), chunked by FSDP2
        (each outer mesh dim -> ``Shard``), and gathered (-> ``Replicate``)."""
        shape = list(self.shape)
        for i in self.packed:
            if any(_sharded_dim(self.placements[j]) == _sharded_dim(self.placements[i]) for j in self.outer):
                shape[_sharded_dim(self.placements[i])] //= self.mesh.size(i)  # type: ignore[index]
        dims = [_sharded_dim(p) for p in self.placements]
        chunked = tuple(Shard(dims[i]) if i in self.outer else Replicate() if i in self.packed else p  # type: ignore[arg-type]
                        for i, p in enumerate(self.placements))
        gathered = tuple(Replicate() if i in self.outer or i in self.packed else p
                         for i, p in enumerate(self.placements))
        return torch.Size(shape), chunked, gathered

    def _unfsdp(self) -> tuple[Placement, ...]:
        return tuple(Replicate() if i in self.outer else p for i, p in enumerate(self.placements))

    def gather(self, t: DTensor) -> DTensor:
        """``t`` (this layout) in the safe layout, same values."""
        with torch.no_grad():
            if self.outer:
                shape, chunked, gathered = self._fsdp_views()
                part = DTensor.from_local(t.to_local(), self.mesh, chunked, run_check=False, shape=shape,
                                          stride=_contiguous(shape))
                local = part.redistribute(self.mesh, gathered).to_local()  # FSDP2's chunks, all-gathered
                t = DTensor.from_local(local, self.mesh, self._unfsdp(), run_check=False, shape=self.shape,
                                       stride=self.stride)
            return t.redistribute(self.mesh, self.safe)

    def empty(self, dtype: torch.dtype) -> DTensor:
        """An unfilled DTensor of the safe layout: a target for DCP to read into."""
        return dtensor.empty(self.shape, dtype=dtype, device_mesh=self.mesh, placements=self.safe)

    def scatter(self, t: DTensor) -> DTensor:
        """``t`` (the safe layout) back in this layout, same values: the inverse of :meth:`gather`."""
        with torch.no_grad():
            t = t.redistribute(self.mesh, self._unfsdp())
            if self.outer:
                shape, chunked, gathered = self._fsdp_views()
                whole = DTensor.from_local(t.to_local(), self.mesh, gathered, run_check=False, shape=shape,
                                           stride=_contiguous(shape))
                local = whole.redistribute(self.mesh, chunked).to_local()  # FSDP2's chunk of it
                t = DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                       stride=self.stride)
            return t


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= n
    return tuple(reversed(out))


def _unpack(tree: Any, relayouts: dict[_Where, _Relayout], *, read: bool, at: _Where = ()) -> Any:
    """``tree`` (a state dict, nested) with every DTensor that DCP cannot handle replaced
    by one with the same values in a DCP-safe layout (:class:`_Relayout`), noted in
    ``relayouts`` by place. ``read``: the new tensors are targets of a load (unfilled)."""
    if isinstance(tree, DTensor):
        relayout = _Relayout.of(tree, ".".join(map(str, at)))
        if relayout is None:
            return tree
        relayouts[at] = relayout
        return relayout.empty(tree.dtype) if read else relayout.gather(tree)
    if isinstance(tree, Mapping):
        return {k: _unpack(v, relayouts, read=read, at=(*at, k)) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_unpack(v, relayouts, read=read, at=(*at, i)) for i, v in enumerate(tree))
    return tree


def _repack(tree: Any, relayouts: dict[_Where, _Relayout], at: _Where = ()) -> Any:
    """After a load, the inverse of :func:`_unpack`: each replaced tensor, now filled, back
    in the layout it had (so that its local shards land right)."""
    if at in relayouts and isinstance(tree, DTensor):
        return relayouts[at].scatter(tree)
    if isinstance(tree, Mapping):
        return {k: _repack(v, relayouts, (*at, k)) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_repack(v, relayouts, (*at, i)) for i, v in enumerate(tree))
    return tree


class CheckpointSpaceError(OSError):
    """:func:`save` wrote nothing: the filesystem has less room than the checkpoint needs,
    even after the oldest checkpoints were deleted. The message is one line with the
    figures; the newest checkpoint is left as it was. An ``OSError`` (``ENOSPC``)."""


class CheckpointWriteError(OSError):
    """:func:`save` failed part-way (a full disk, an I/O error): its partial folder is
    removed and ``LATEST`` is unchanged. The message is one line, with the system's
    reason (``No space left on device``)."""


#: A function giving the free bytes at a path (:func:`slapo_fn.checkpoint_dir.free_bytes`).
FreeSpace = Callable[[Path], int]


def save(
    model: object,
    optimizer: OptimizerState,
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    keep: int = 2,
    rank_state: Mapping[str, Any] | None = None,
    free_space: FreeSpace = free_bytes,
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Save model (and optimizer) state as checkpoint ``step`` under ``path``; every rank
    calls it. Keeps the newest ``keep`` checkpoints. Returns the checkpoint's directory.

    ``optimizer`` is a ``torch.optim`` optimizer, the state of a functional optimizer
    (:mod:`slapo_fn.optim`: a pytree of tensors keyed by FQNs), or ``None``.
    ``rank_state``: this rank's own state (RNG, data position: tensors and plain values),
    saved beside the shards and verified with them (:func:`rank_state` reads it back).
    ``meta``: JSON data kept in the manifest (the options of the run that saved it;
    :func:`slapo_fn.checkpoint_dir.manifest_meta` reads it without torch).

    ``step`` names the checkpoint (the training step); a save of a step that is there
    already replaces it. Without ``step`` the checkpoint is step 0, and a step 0 already
    there is an error rather than overwritten.

    Keys are the original model's FQNs, so the checkpoint loads under any other layout.
    Every file gets a digest in the checkpoint's manifest. With less free space than the
    checkpoint needs (``free_space(path)`` on rank 0, against the previous checkpoint's
    size), the oldest checkpoints are deleted first; when that is not enough nothing is
    written: :class:`CheckpointSpaceError`. A save that fails part-way removes its folder:
    :class:`CheckpointWriteError`.
    """
    _check_save_target(path)
    every_rank("sf.save")
    root = Path(path)
    if step is None:
        if (root / step_name(0)).exists():
            raise ScheduleError("save", [Problem(str(root / step_name(0)), "is there already, and a save without "
                                                 "step= would overwrite it", "pass the training step: "
                                                 "sf.save(model, optimizer, path, step=N) (step=0 replaces it)")])
        step = 0
    name = step_name(step)
    final, partial = root / name, root / f"{PARTIAL}{name}"
    states = _states(model, optimizer)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    short = _make_room(root, keep, _state_bytes(states) if not checkpoints(root) else 0, free_space)
    if short:
        raise CheckpointSpaceError(errno.ENOSPC, short)
    try:
        with warnings.catch_warnings():  # without a process group DCP warns that it saves in one process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(_unpack(states, {}, read=False), checkpoint_id=str(partial))
        if rank_state is not None:
            torch.save(dict(rank_state), partial / RANK_STATE.format(rank=_rank()))
        _barrier()
        files = _gathered(digests(partial, _share(sorted(f.name for f in partial.iterdir() if f.is_file()))))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointWriteError(_errno(e), f"saving step {step} to {root} failed ({_reason(e)}); its partial "
                                              "folder is removed, LATEST is unchanged") from e
    if _rank() == 0:
        write_manifest(partial, files, step=step, meta=meta)
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        tmp = root / ".LATEST.tmp"
        tmp.write_text(name + "\n")
        os.replace(tmp, root / "LATEST")
        prune(root, keep, protect=[final])
    _barrier()
    return final


def rank_state(checkpoint: Path, rank: int) -> dict[str, Any] | None:
    """The ``rank_state`` rank ``rank`` saved in ``checkpoint`` (rank 0's where that rank
    saved none: a run resumed on more ranks), or ``None`` where there is none. Call it
    after :func:`load` verified the checkpoint."""
    mine, first = checkpoint / RANK_STATE.format(rank=rank), checkpoint / RANK_STATE.format(rank=0)
    found = mine if mine.is_file() else first if first.is_file() else None
    return None if found is None else dict(torch.load(found, weights_only=True))


def _share(names: Sequence[str]) -> list[str]:
    """This rank's share of ``names`` to hash or verify: every world-th one."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return [n for i, n in enumerate(names) if i % world == _rank()]


def _gathered(part: dict[str, Any]) -> dict[str, Any]:
    """The union of every rank's ``part`` (a dict), on every rank."""
    if not dist.is_initialized():
        return part
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in p.items()}


def _decided(value: Any) -> Any:
    """Rank 0's ``value``, on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _state_bytes(states: Mapping[str, Any]) -> int:
    """Bytes of the tensors of every rank's state dict, each key once (the global shape of
    a sharded one): about what a first checkpoint writes."""
    def walk(tree: Any, at: str) -> dict[str, int]:
        if isinstance(tree, torch.Tensor):
            return {at: tree.numel() * tree.element_size()}  # a DTensor's numel is its global one
        if isinstance(tree, Mapping):
            return {k: v for key, sub in tree.items() for k, v in walk(sub, f"{at}/{key}").items()}
        if isinstance(tree, list | tuple):
            return {k: v for i, sub in enumerate(tree) for k, v in walk(sub, f"{at}/{i}").items()}
        return {}

    return sum(_gathered(walk(states, "")).values())


def _make_room(root: Path, keep: int, estimate: int, free_space: FreeSpace) -> str:
    """On rank 0: whether the next checkpoint fits, deleting the oldest ones first (keeping
    the newest) where it would not; ``""`` when it fits, else why not, on every rank."""
    why = ""
    if _rank() == 0:
        found = checkpoints(root)
        need = size_of(found[0]) if found else estimate
        free = free_space(root)
        deleted = 0
        while free < need and len(found) > 1 and prune(root, len(found) - 1):
            found, deleted = checkpoints(root), deleted + 1
            free = free_space(root)
        if free < need:
            why = (f"not saved: {free / 2**20:,.1f} MiB free at {root}, the checkpoint needs about "
                   f"{need / 2**20:,.1f} MiB" + (f" ({deleted} older checkpoint(s) deleted to make room)" if deleted
                                                 else "")
                   + (f"; {found[0].name} stays the newest" if found else ""))
    return str(_decided(why))


def _errno(e: BaseException) -> int:
    cause = _os_error(e)
    return cause.errno if cause is not None and cause.errno is not None else errno.EIO


def _os_error(e: BaseException | None) -> OSError | None:
    """The first ``OSError`` in ``e``, its causes, or a DCP failure's per-rank errors."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, OSError):
            return e
        for failure in (getattr(e, "failures", None) or {}).values():  # DCP's: (exception, traceback) by rank
            first = failure[0] if isinstance(failure, tuple) and failure else failure
            found = _os_error(first if isinstance(first, BaseException) else None)
            if found is not None:
                return found
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _reason(e: BaseException) -> str:
    """One line on why a save failed: the system's reason where an OSError is at its root."""
    cause = _os_error(e)
    if cause is not None and cause.strerror:
        return cause.strerror + (f": {cause.filename}" if cause.filename else "")
    return f"{type(e).__name__}: {_first_line(e)}"


class CheckpointFallback(UserWarning):
    """:func:`load` skipped an unusable newest checkpoint (truncated, corrupted, partial)
    and loaded the newest loadable one: the warning's message is one line saying which
    and why (``slapo-fn train --resume`` prints it)."""


def loadable(path: str | os.PathLike[str]) -> Path | None:
    """The checkpoint :func:`load` (with ``fallback``) would read under ``path``: the
    newest one whose files are all there, of the sizes its manifest gives, and readable;
    or ``None``. Digests and whether it fits a model are not checked here (cheap: the
    command line asks before any rank starts).

    >>> import tempfile
    >>> loadable(tempfile.mkdtemp()) is None
    True
    """
    root = Path(path)
    return next((c for c in checkpoints(path) if not manifest_problems(c, digest=False)
                 and not _unreadable(c, root)), None)


def load(model: object, optimizer: OptimizerState, path: str | os.PathLike[str], *, fallback: bool = True,
         verify: bool = True) -> int:
    """Load the newest checkpoint under ``path`` into ``model`` (and ``optimizer``),
    resharding to their current layout; every rank calls it. Returns the saved step.

    With ``verify`` (the default) every file of the checkpoint is checked against its
    manifest (size and xxh3-128 digest, the ranks sharing the reading) before any tensor
    is read: a changed, truncated or missing file, or a missing manifest, makes the
    checkpoint corrupt. ``verify=False`` skips the digests (and loads a checkpoint
    without a manifest).

    With ``fallback`` (the default), a newest checkpoint that is corrupt or cannot be
    read — a step directory ``LATEST`` names that is missing, an unreadable
    ``.metadata``, one DCP fails to read — is skipped for the newest one that verifies
    and loads, with a one-line :class:`CheckpointFallback` warning naming the bad file;
    when none loads, the newest one's problems are the error. A checkpoint of another
    model is never skipped: it is a :class:`ScheduleError` naming the first mismatching
    keys.

    A functional optimizer's state (:mod:`slapo_fn.optim`) is loaded in place into the
    tensors of the tree given, which ``init(params)`` made in the current layout."""
    root = Path(path)
    every_rank("sf.load")
    if root.is_file():
        raise ScheduleError("load", [Problem(str(root), "is a file, not a checkpoint directory",
                                             "pass the directory given to sf.save")])
    candidates = checkpoints(path)
    if not candidates:
        raise ScheduleError("load", [Problem(str(path), "no checkpoint here (no LATEST, no .metadata)",
                                             "pass the directory given to sf.save")])
    if not fallback:
        candidates = candidates[:1]
    skipped: list[tuple[Path, Problem]] = []
    for i, found in enumerate(candidates):
        problems = (_verified(found) if verify else []) or _unreadable(found, root)
        if not problems:
            _check_matches(model, optimizer, found)
            try:
                step = _load_from(model, optimizer, found)
            except (Exception, CheckpointException) as e:  # DCP could not read it (the same on all ranks);
                # DCP's CheckpointException is a BaseException: a plain `except Exception` misses it
                unreadable = Problem(str(found), f"cannot be read: {type(e).__name__}: {_first_line(e)}",
                                     "its files are corrupted: save again, or load an earlier step directory")
                if i + 1 == len(candidates):  # one line, not DCP's multi-screen CheckpointException
                    raise ScheduleError("load", [unreadable, *(p for _, p in skipped)]) from e
                skipped.append((found, unreadable))
                continue
            if skipped:
                first, why = skipped[0]
                more = f" ({len(skipped)} skipped)" if len(skipped) > 1 else ""
                warnings.warn(CheckpointFallback(
                    f"checkpoint {first.name} is unusable: {why.path}: {why.reason}; loaded {found.name}, the "
                    f"newest that verifies{more}"), stacklevel=2)
            return step
        if i == 0:
            newest = problems
        skipped.append((found, problems[0]))
    raise ScheduleError("load", newest)


def _verified(found: Path) -> list[Problem]:
    """What is wrong with checkpoint ``found`` against its manifest, every rank checking
    the digests of its share of the files; the same answer on every rank."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = manifest_problems(found, (_rank(), world))
    if not dist.is_initialized():
        return mine
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return sorted({p for part in parts for p in part}, key=lambda p: p.path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160] if text else ""


def _load_from(model: object, optimizer: OptimizerState, found: Path) -> int:
    relayouts: dict[_Where, _Relayout] = {}
    # DCP reads into the tensors it is given, one item after another: into new ones, so that
    # a read failing half-way leaves the model and optimizer as they were
    state = _fresh(_unpack(_states(model, optimizer), relayouts, read=True))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(found))
    state = _repack(state, relayouts)
    modules = _modules(model)
    if isinstance(optimizer, Mapping):
        _copy_into(_clean_fqns(optimizer), state["optim"])
    if optimizer is None or isinstance(optimizer, Mapping):
        for m in modules:
            set_state_dict(m, [], model_state_dict=_subset(state["model"], m), optim_state_dict={})
    elif len(modules) == 1:
        set_state_dict(modules[0], optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        owner = {k: i for i, m in enumerate(modules) for k in get_model_state_dict(m)}
        prefixed = {f"{owner[k]}.{k}": v for k, v in state["model"].items() if k in owner}
        optim = _map_optim(state["optim"], lambda k: f"{owner[k]}.{k}")
        set_state_dict(nn.ModuleList(modules), optimizer, model_state_dict=prefixed, optim_state_dict=optim)
    return step_of(found)


def _fresh(tree: Any) -> Any:
    """``tree`` with every tensor replaced by an unfilled one of the same kind (a DTensor
    keeps its mesh and placements), for DCP to read into."""
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree.detach())
    if isinstance(tree, Mapping):
        return {k: _fresh(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_fresh(v) for v in tree)
    return tree


def _subset(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    keys = set(get_model_state_dict(module))
    return {k: v for k, v in state.items() if k in keys}


def full_state_dict(model: object) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on every rank, with the original FQNs: loadable by
    the unscheduled model (e.g. a Hugging Face model's ``load_state_dict``). Packed
    tensors go through the same DCP-safe layout as in :func:`save` first (DTensor's own
    ``full_tensor`` is wrong for FSDP2 over a packed dimension)."""
    out: dict[str, torch.Tensor] = {}
    for m in _modules(model):
        for key, value in get_model_state_dict(m).items():
            assert isinstance(value, torch.Tensor)
            if isinstance(value, DTensor):
                relayout = _Relayout.of(value, key)
                with torch.no_grad():
                    value = (relayout.gather(value) if relayout else value).full_tensor()
            out[key] = value.detach().clone()
    return out


# -- checks before any work: a short error naming the path, not a DCP traceback -------------
def _check_save_target(path: str | os.PathLike[str]) -> None:
    """``path`` must be a directory or not exist yet, under a writable directory."""
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ScheduleError("save", [Problem(str(root), "is a file, not a directory; a checkpoint is a directory "
                                                        "(LATEST and one folder per step)",
                                             "pass a directory path (new or one that sf.save wrote)")])
    ancestor = next((a for a in (root, *root.parents) if a.exists()), None)
    if ancestor is not None and not ancestor.is_dir():
        raise ScheduleError("save", [Problem(str(root), f"{str(ancestor)!r} on its way is a file, not a directory",
                                             "pass a path under a directory")])
    if ancestor is not None and not os.access(ancestor, os.W_OK | os.X_OK):
        raise ScheduleError("save", [Problem(str(root), f"{str(ancestor)!r} is not writable",
                                             "pass a directory you may write to")])


def _check_checkpoint(model: object, optimizer: object, path: str | os.PathLike[str]) -> None:
    """The newest checkpoint under ``path`` is readable and was written from this model
    (:func:`_unreadable`, :func:`_check_matches`): a short :class:`ScheduleError` naming
    the path instead of DCP's multi-screen exception."""
    root = Path(path)
    if root.is_file():
        raise ScheduleError("load", [Problem(str(root), "is a file, not a checkpoint directory",
                                             "pass the directory given to sf.save")])
    found = latest(path)
    if found is None:
        return  # load says: no checkpoint here
    problems = _unreadable(found, root)
    if problems:
        raise ScheduleError("load", problems)
    _check_matches(model, optimizer, found)


def _unreadable(found: Path, root: Path) -> list[Problem]:
    """Why the checkpoint ``found`` cannot be read (missing, a ``.metadata`` that cannot
    be read, data files missing or shorter than the metadata says), or ``[]``."""
    fix = "load another checkpoint (an earlier step), or save again"
    if not (found / ".metadata").is_file():
        return [Problem(str(found), f"{root / 'LATEST'} names it, but it is missing or incomplete (no .metadata)"
                        if found.parent == root else "is missing or incomplete (no .metadata)",
                        "point LATEST at a complete step directory, or save again")]
    try:
        metadata = dcp.FileSystemReader(str(found)).read_metadata()
    except Exception as e:
        return [Problem(str(found), f"is corrupted: its .metadata cannot be read ({type(e).__name__}: "
                                    f"{str(e)[:120]})", fix)]
    return [Problem(str(found / name), why, fix) for name, why in _short_files(found, metadata)[:4]]


def _check_matches(model: object, optimizer: object, found: Path) -> None:
    """The readable checkpoint ``found`` was written from this model: every key this
    model's state has is saved with its shape (a checkpoint may hold more: a pipeline
    stage loads its own part), and optimizer state is there if one is loaded."""
    metadata = dcp.FileSystemReader(str(found)).read_metadata()
    saved = metadata.state_dict_metadata
    expected = {f"model.{k}": v for k, v in _states(model, None)["model"].items()}
    missing = [k for k in expected if k not in saved]
    shapes = [(k, tuple(info.size), tuple(v.shape)) for k, v in expected.items()
              if isinstance(info := saved.get(k), TensorStorageMetadata) and isinstance(v, torch.Tensor)
              and tuple(info.size) != tuple(v.shape)]
    reasons = []
    if missing:
        shown = ", ".join(repr(k.removeprefix("model.")) for k in missing[:3])
        reasons.append(f"{len(missing)} of this model's {len(expected)} tensors are not in it ({shown}"
                       f"{', …' if len(missing) > 3 else ''})")
    if shapes:
        k, was, now = shapes[0]
        reasons.append(f"{len(shapes)} have another shape ({k.removeprefix('model.')!r}: saved {was}, here {now}"
                       f"{', …' if len(shapes) > 1 else ''})")
    if reasons:
        raise ScheduleError("load", [Problem(str(found), "was written from another model: " + "; ".join(reasons),
                                             "load the checkpoint this model wrote, or build the model that wrote "
                                             "this one")])
    if optimizer is not None and not any(k.startswith("optim.") for k in saved):
        raise ScheduleError("load", [Problem(str(found), "holds no optimizer state (saved with optimizer=None)",
                                             "load it with optimizer=None, or save with the optimizer")])


def _short_files(found: Path, metadata: Any) -> list[tuple[str, str]]:
    """Data files the metadata points into that are missing or shorter than it says."""
    need: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", None) or {}:
        item = metadata.storage_data[info]
        name = getattr(item, "relative_path", None)
        if isinstance(name, str):
            need[name] = max(need.get(name, 0), int(getattr(item, "offset", 0)) + int(getattr(item, "length", 0)))
    out = []
    for name, size in sorted(need.items()):
        file = found / name
        if not file.is_file():
            out.append((name, "is missing: the checkpoint's metadata points into it"))
        elif file.stat().st_size < size:
            out.append((name, f"is truncated: {file.stat().st_size} bytes where the metadata needs {size}"))
    return out
