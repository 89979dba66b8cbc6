"""Hugging Face weight folders in and out of any layout: ``load_hf`` and ``save_hf``.

Loading straight into shards::

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    sch = sf.recipes.for_model(model)(sf.create_schedule(model, mesh=mesh), tp=2, dp_mode="fsdp")
    built = sf.build(sch, init="empty")        # only this rank's shards, uninitialised
    sf.load_hf(built, folder)                  # each rank reads only its slices

Every rank reads, with ``safetensors.safe_open(...).get_slice``, exactly the elements of
its local shards (from ``model.safetensors``, or the files a
``model.safetensors.index.json`` names), so a rank's peak memory is its shards plus one
slice, never a full model. The slices come from the DTensor layout itself: plain
``Shard``, packed ``_StridedShard`` (``sf.shard(..., packed=3)``: GPT-2's fused
[Q|K|V], one slice per chunk) and FSDP2's ``_StridedShard`` over a tensor-parallel
(or packed) dimension (FSDP2 chunks the tensor-parallel local tensor) — see
:func:`local_ranges`. DCP's ``HuggingFaceStorageReader`` reads a packed layout wrongly
without an error; this does not use it.

Mixture-of-experts folders: transformers keeps experts as fused 3-D parameters
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) while
``save_pretrained`` writes, and Hub checkpoints hold, one 2-D tensor per expert
(Mixtral's ``block_sparse_moe.experts.N.w1/w2/w3``). The file keys are mapped by
transformers' own checkpoint conversion for the model type
(:func:`slapo_fn.hf.checkpoint_keys`): a fused parameter is a stack of per-expert tensors,
[gate; up] a concatenation of two stacks, and a rank reads only the experts and slices
its shard covers (expert parallel: its E/ep experts; expert tensor parallel: its rows of
each w1 and w3). A conversion with any other operation is refused before anything is read.

Before any data is read, every key and shape is checked against the files' headers:
missing keys (a tied LM head reads its embedding's key), unexpected keys, shape
mismatches and dtype changes FSDP2 cannot make are one :class:`WeightsMismatchError`
listing them all, and the model is untouched. Non-persistent buffers (rotary
``inv_freq``) are recomputed by the model's own initialisation.

Export: :func:`save_hf` gathers full tensors (packed and FSDP2-over-packed ones in their
original element order, through :func:`slapo_fn.state.full_state_dict`), pipeline
stages to rank 0, and writes one ``model.safetensors`` (tied copies left out, as
``save_pretrained`` does), ``config.json`` and, when given, the tokenizer files.
``AutoModelForCausalLM.from_pretrained(folder)`` then computes the same logits. The keys
are those ``save_pretrained`` writes (transformers' reverse conversion: one tensor per
expert under the checkpoint's names, :func:`slapo_fn.hf.checkpoint_state`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .build import UNFILLED, reset_fsdp_shards
from .errors import Problem, ScheduleError, ScheduleTypeError
from .hf import (
    Assembly,
    CheckpointKeys,
    Stacked,
    checkpoint_keys,
    checkpoint_state,
    config_of,
    ignored_on_load,
    recompute_buffers,
    tied_weights,
)
from .pipelines.runner import Pipeline
from .state import full_state_dict
from .tree import walk

__all__ = ["WeightsMismatchError", "load_hf", "local_ranges", "save_hf"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
#: Tokenizer files copied by ``save_hf(..., tokenizer=folder)``.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class WeightsMismatchError(ScheduleError, KeyError):
    """A weight folder does not fit the model: ``missing`` keys (the model has, the files
    lack), ``unexpected`` keys (the files have, the model lacks) and ``mismatched`` ones
    (``{key: (in the files, in the model)}`` shapes or dtypes). Every problem is listed;
    nothing was loaded."""

    def __init__(self, what: str, problems: Sequence[Problem], *, missing: Sequence[str] = (),
                 unexpected: Sequence[str] = (), mismatched: Mapping[str, tuple[Any, Any]] | None = None) -> None:
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.mismatched = dict(mismatched or {})
        super().__init__(what, problems)

    def __str__(self) -> str:  # KeyError would quote the message
        return ValueError.__str__(self)


# -- what is loaded: the modules a rank holds and the keys of the whole model ------------------
@dataclass(frozen=True)
class _Target:
    """This rank's modules and the keys/shapes of the whole model (every pipeline stage)."""

    modules: tuple[nn.Module, ...]
    shapes: Mapping[str, tuple[int, ...]]  # every key of the whole model -> global shape
    tied: Mapping[str, str]  # target -> source FQN
    root: nn.Module  # the (first) whole model: its class and config say how its files are named


def _state_keys(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(FQN, tensor)`` of the parameters and persistent buffers of ``module``, ties at
    every name (as ``state_dict`` lists them), without calling state-dict hooks."""
    for path, m in walk(module):
        for name, p in m._parameters.items():
            if p is not None:
                yield (f"{path}.{name}" if path else name), p
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                yield (f"{path}.{name}" if path else name), b


def _target(model: object, what: str) -> _Target:
    if isinstance(model, Pipeline):
        modules = tuple(model.modules.values())
        wholes: Sequence[nn.Module] = [s.schedule.module for s in model.stages]
    elif isinstance(model, nn.Module):
        modules = (model,)
        wholes = modules
    elif isinstance(model, Mapping) and model and all(isinstance(m, nn.Module) for m in model.values()):
        modules = tuple(model.values())  # stages built by sf.pipelines.build_stages, all in one process
        wholes = modules
    else:
        raise ScheduleTypeError(what, [Problem("", f"expected a built model (nn.Module) or a pipeline "
                                                   f"(sf.Pipeline), got {type(model).__name__}",
                                               "pass the result of sf.build(sch, init='empty') or "
                                               "sf.build_pipeline(sch, ..., init='empty')")])
    shapes: dict[str, tuple[int, ...]] = {}
    tied: dict[str, str] = {}
    for whole in wholes:
        shapes.update({k: tuple(t.shape) for k, t in _state_keys(whole)})
        tied.update(tied_weights(whole))
    return _Target(modules, shapes, tied, wholes[0])


# -- the files: headers only ----------------------------------------------------------------
@dataclass(frozen=True)
class _Header:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def _files(folder: Path) -> list[Path]:
    index = folder / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [folder / name for name in dict.fromkeys(weight_map.values())]
    if (folder / _SINGLE).is_file():
        return [folder / _SINGLE]
    return sorted(folder.glob("*.safetensors"))


def _headers(folder: Path, what: str) -> dict[str, _Header]:
    if not folder.is_dir():
        raise ScheduleError(what, [Problem(str(folder), "is not a directory",
                                           "pass a Hugging Face model folder (config.json, *.safetensors)")])
    files = _files(folder)
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        reason = (f"{_INDEX} names files that are not there: {', '.join(f.name for f in missing)}" if missing
                  else "holds no *.safetensors file")
        raise ScheduleError(what, [Problem(str(folder), reason,
                                           "save the model with save_pretrained(folder) (safetensors, the default) "
                                           "or sf.save_hf(model, folder)")])
    out: dict[str, _Header] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    sl = f.get_slice(key)
                    out[key] = _Header(file, tuple(sl.get_shape()), _DTYPES.get(sl.get_dtype(), torch.float32))
        except Exception as e:  # a truncated or corrupted file: one line naming it
            raise ScheduleError(what, [Problem(str(file), f"cannot be read as safetensors ({type(e).__name__}: "
                                                          f"{str(e)[:120]})",
                                               "download or save the folder again")]) from None
    return out


# -- where this rank's elements are ------------------------------------------------------------
Ranges = tuple[tuple[int, int], ...]  # (start, stop) runs of global indices along one tensor dimension


def _chunk(index: torch.Tensor, parts: int, part: int) -> torch.Tensor:
    """``torch.chunk``'s ``part``-th piece of ``index`` into ``parts`` (empty past the end),
    which is how ``Shard`` and FSDP2 cut a dimension."""
    size = -(-index.numel() // parts) if index.numel() else 0
    return index[part * size:(part + 1) * size]


def _sharded_dim(p: Placement) -> int | None:
    return p.dim if isinstance(p, Shard | _StridedShard) else None


def local_ranges(t: DTensor) -> tuple[Ranges, ...]:
    """Per tensor dimension, the runs of global indices this rank's local tensor of ``t``
    holds, in the order it holds them (its local tensor is the outer product of them).

    Mesh dimensions are applied in order, as DTensor defines its placements (``Shard``:
    a ``torch.chunk``; a packed ``_StridedShard(d, k)``: ``k`` chunks each split over the
    mesh dimension, the rank's parts concatenated), except FSDP2's ``_StridedShard`` over
    a dimension later mesh dimensions shard too (its ``split_factor`` their product):
    FSDP2 chunks the local tensor those leave, so it applies last. This is where FSDP2
    over a packed dimension differs from DTensor's own reading of the placements.

    Example (rank 0 of a 2-rank mesh on a fake process group, put back afterwards):
        >>> import torch
        >>> from torch.distributed.tensor import distribute_tensor, Shard
        >>> from slapo_fn.dtensor.testing import fake_mesh, fake_world
        >>> with fake_world(2):
        ...     local_ranges(distribute_tensor(torch.zeros(4, 6), fake_mesh(2, names=("tp",)), [Shard(0)],
        ...                                    src_data_rank=None))
        (((0, 2),), ((0, 6),))
    """
    mesh, placements = t.device_mesh, tuple(t.placements)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return tuple(() for _ in t.shape)
    dims = [_sharded_dim(p) for p in placements]

    def later(i: int) -> int:
        return math.prod(mesh.size(j) for j in range(i + 1, len(dims)) if dims[j] == dims[i])

    outer = [i for i, p in enumerate(placements)
             if isinstance(p, _StridedShard) and later(i) > 1 and p.split_factor == later(i)]
    index = [torch.arange(n) for n in t.shape]
    for i, p in enumerate(placements):
        d = dims[i]
        if d is None or i in outer:
            continue
        n, r = mesh.size(i), coordinate[i]
        if isinstance(p, _StridedShard):
            pieces = torch.chunk(index[d], int(p.split_factor)) if index[d].numel() else ()
            index[d] = torch.cat([_chunk(piece, n, r) for piece in pieces]) if pieces else index[d]
        else:
            index[d] = _chunk(index[d], n, r)
    for i in outer:
        d = dims[i]
        assert d is not None
        index[d] = _chunk(index[d], mesh.size(i), coordinate[i])
    return tuple(_runs(ix) for ix in index)


def _runs(index: torch.Tensor) -> Ranges:
    runs: list[tuple[int, int]] = []
    for v in index.tolist():
        if runs and runs[-1][1] == v:
            runs[-1] = (runs[-1][0], v + 1)
        else:
            runs.append((v, v + 1))
    return tuple(runs)


def _read(sl: Any, ranges: Sequence[Ranges]) -> torch.Tensor:
    """The block of a safetensors slice ``sl`` at ``ranges`` (one run per dimension: one
    read; several runs: one read per combination, concatenated)."""
    many = next((d for d, runs in enumerate(ranges) if len(runs) != 1), None)
    if many is None:
        return sl[tuple(slice(a, b) for a, b in (runs[0] for runs in ranges))]
    parts = [_read(sl, [*ranges[:many], (run,), *ranges[many + 1:]]) for run in ranges[many]]
    return torch.cat(parts, dim=many)


class _Files(contextlib.ExitStack):
    """The safetensors files one tensor is read from, each opened (memory-mapped) on first
    use and all closed on exit. A load opens them per tensor: the pages a mapping has
    touched count in the process's resident memory until it is unmapped, so one mapping
    held over the whole load would grow it by every file read, up to the checkpoint's size
    on each rank."""

    def __init__(self, headers: Mapping[str, _Header]) -> None:
        super().__init__()
        self._headers = headers
        self._open: dict[Path, Any] = {}

    def handle(self, key: str) -> Any:
        file = self._headers[key].file
        if file not in self._open:
            self._open[file] = self.enter_context(safe_open(str(file), framework="pt"))
        return self._open[file]

    def slice(self, key: str) -> Any:
        return self.handle(key).get_slice(key)


def _read_assembled(node: Assembly, ranges: Sequence[Ranges], slice_of: Callable[[str], Any],
                    headers: Mapping[str, _Header]) -> torch.Tensor:
    """The block at ``ranges`` (global runs per dimension of the assembled tensor) of a
    tensor transformers assembles from several in the files (:class:`~slapo_fn.hf.Stacked`
    experts, a :class:`~slapo_fn.hf.Joined` [gate; up]): only the parts and the slices of
    them the block covers are read — a rank holding experts 2 and 3 of 4 reads those two."""
    if isinstance(node, str):
        return _read(slice_of(node), ranges)
    d = node.dim
    pieces: list[torch.Tensor] = []
    if isinstance(node, Stacked):
        rest = [*ranges[:d], *ranges[d + 1:]]
        for a, b in ranges[d]:
            pieces += [_read_assembled(node.parts[i], rest, slice_of, headers).unsqueeze(d) for i in range(a, b)]
    else:
        sizes = [(_shape(part, headers) or ())[d] for part in node.parts]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        for a, b in ranges[d]:
            for part, start, size in zip(node.parts, offsets, sizes, strict=True):
                lo, hi = max(a, start), min(b, start + size)
                if lo < hi:
                    run = ((lo - start, hi - start),)
                    pieces.append(_read_assembled(part, [*ranges[:d], run, *ranges[d + 1:]], slice_of, headers))
    return torch.cat(pieces, dim=d)


# -- load --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    """One tensor to fill: where it lives in the model and in the files."""

    key: str
    source: Assembly
    tensor: torch.Tensor
    ranges: tuple[Ranges, ...] | None  # None: the whole tensor
    dtype: torch.dtype


def _leaves(node: Assembly) -> Iterator[str]:
    """The file keys an assembly reads, in order."""
    if isinstance(node, str):
        yield node
    else:
        for part in node.parts:
            yield from _leaves(part)


def _shape(node: Assembly, headers: Mapping[str, _Header]) -> tuple[int, ...] | None:
    """The shape of an assembled tensor; ``None`` when its parts do not fit together
    (experts of different shapes)."""
    if isinstance(node, str):
        return headers[node].shape
    shapes = [_shape(p, headers) for p in node.parts]
    first = shapes[0] if shapes else None
    if first is None or any(sh is None for sh in shapes):
        return None
    d = node.dim
    if isinstance(node, Stacked):
        return (*first[:d], len(shapes), *first[d:]) if all(sh == first for sh in shapes) else None
    rest = [(*sh[:d], *sh[d + 1:]) for sh in shapes if sh is not None]
    if len(first) <= d or any(r != rest[0] for r in rest):
        return None
    return (*first[:d], sum(sh[d] for sh in shapes if sh is not None), *first[d + 1:])


def _describe(node: Assembly) -> str:
    """``'model.layers.0.block_sparse_moe.experts.0.w1.weight' …`` for messages."""
    leaves = list(_leaves(node))
    return repr(leaves[0]) if len(leaves) == 1 else f"{len(leaves)} per-expert tensors ({leaves[0]} …)"


def _check(target: _Target, headers: Mapping[str, _Header], keys: CheckpointKeys, ignored: Sequence[Any],
           dtype: torch.dtype | None, folder: Path) -> tuple[dict[str, Assembly], dict[str, torch.dtype]]:
    """Every key of the model in the files with its shape, and nothing else in them; the
    source (a file key, or how transformers' conversion assembles it) of each model key;
    the dtype each local tensor must have. Raises one :class:`WeightsMismatchError`
    listing every problem."""
    sources: dict[str, Assembly] = {}
    missing: list[str] = []
    unsupported: list[str] = []
    for key in target.shapes:
        source = keys.sources.get(key)
        if source is None and key in target.tied:
            source = keys.sources.get(target.tied[key])
        if source is not None:
            sources[key] = source
        elif key in keys.unsupported:
            unsupported.append(key)
        else:
            missing.append(key)
    used = {leaf for source in sources.values() for leaf in _leaves(source)} | keys.consumed
    unexpected = [k for k in headers if k not in used and k not in target.shapes
                  and not any(p.search(k) for p in ignored)]
    mismatched = {k: (_shape(s, headers), target.shapes[k]) for k, s in sources.items()
                  if _shape(s, headers) != target.shapes[k]}
    remedy = ("load the folder saved from this model's architecture and config, or schedule the model the folder "
              "was saved from")
    if keys.model is not None and not keys.converted and missing and unexpected:
        remedy += (f"; transformers has no checkpoint conversion mapping for model type {keys.model!r}, so the files' "
                   "keys must be the model's own (save them with sf.save_hf, or register a mapping with transformers' "
                   "register_checkpoint_conversion_mapping)")
    problems = [Problem(k, "is not in the weight files", remedy) for k in missing]
    problems += [Problem(k, f"cannot be read slice by slice: {keys.unsupported[k]}",
                         "load the full model with from_pretrained and sf.build(sch) from it, or convert the folder "
                         "once with save_pretrained of a from_pretrained model") for k in unsupported]
    problems += [Problem(k, f"is in the weight files ({headers[k].file.name}) but not in the model",
                         "build the model from this folder's config.json (AutoConfig.from_pretrained(folder))")
                 for k in unexpected]
    problems += [Problem(k, (f"has shape {list(f)} in the weight files" if f is not None else
                             "is made of weight-file tensors whose shapes do not fit together")
                         + f" and {list(m)} in the model"
                         + ("" if isinstance(sources[k], str) else f" (from {_describe(sources[k])})"),
                         "build the model from this folder's config.json") for k, (f, m) in mismatched.items()]
    wanted: dict[str, torch.dtype] = {}
    fsdp_casts: list[str] = []
    for module in target.modules:
        fsdp = {id(p) for m in module.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
        for key, t in _state_keys(module):
            if key not in sources or not t.is_floating_point():
                continue
            want = dtype or headers[next(_leaves(sources[key]))].dtype
            if not want.is_floating_point:
                continue
            wanted[key] = want
            if want != t.dtype and id(t) in fsdp:
                fsdp_casts.append(key)
    if fsdp_casts:
        have = {t.dtype for m in target.modules for k, t in _state_keys(m) if k in fsdp_casts}
        want_s = sorted({str(wanted[k]) for k in fsdp_casts})
        problems.append(Problem(fsdp_casts[0], f"{len(fsdp_casts)} FSDP2-sharded tensors are {sorted(map(str, have))} "
                                               f"and would have to become {want_s}: FSDP2 fixes a parameter's dtype "
                                               "when it shards it",
                                f"pass dtype={sorted(map(str, have))[0]} to keep the model's dtype, or create the "
                                f"model in {want_s[0]} before create_schedule (e.g. from_config(config, "
                                f"dtype={want_s[0]}) on the meta device)"))
    if problems:
        raise WeightsMismatchError(f"load_hf({str(folder)!r})", problems, missing=[*missing, *unsupported],
                                   unexpected=unexpected, mismatched=mismatched)
    return sources, wanted


def _plans(target: _Target, sources: Mapping[str, Assembly], wanted: Mapping[str, torch.dtype]) -> list[_Plan]:
    plans: list[_Plan] = []
    seen: set[int] = set()
    for module in target.modules:
        for key, t in _state_keys(module):
            if id(t) in seen:
                continue
            seen.add(id(t))
            ranges = local_ranges(t) if isinstance(t, DTensor) else None
            if isinstance(t, DTensor):
                if any(isinstance(p, Partial) for p in t.placements):
                    raise ScheduleError("load_hf", [Problem(key, f"has a Partial layout {t.placements}",
                                                            "load into parameters that are sharded or replicated")])
                local_shape = tuple(sum(b - a for a, b in runs) for runs in ranges or ())
                if local_shape != tuple(t.to_local().shape):
                    raise ScheduleError("load_hf", [Problem(
                        key, f"layout {t.placements} on mesh {tuple(t.device_mesh.shape)}: the local tensor is "
                             f"{tuple(t.to_local().shape)}, its slices would be {local_shape}",
                        "report this layout; sf.load(...) of a DCP checkpoint is the fallback")])
            plans.append(_Plan(key, sources[key], t, ranges, wanted.get(key, t.dtype)))
    return plans


def _cast(target: _Target, plans: Sequence[_Plan]) -> None:
    """Give each parameter and persistent buffer the dtype it is loaded in (same object:
    ties and optimizer references hold)."""
    cast = [p for p in plans if p.tensor.dtype != p.dtype]
    if not cast:
        return
    for plan in cast:
        t = plan.tensor
        new = t.detach().to(plan.dtype)
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(new, requires_grad=t.requires_grad)
        torch.utils.swap_tensors(t, new)


def load_hf(model: Any, folder: str | os.PathLike[str], *, dtype: torch.dtype | None = None) -> Any:
    """Load a Hugging Face weight folder into ``model`` in place, in its current layout;
    every rank calls it (no communication). Returns ``model``.

    ``model`` is a built model (best ``sf.build(sch, init="empty")``: only this rank's
    shards were ever allocated) or a pipeline (``sf.build_pipeline(sch, ...,
    init="empty")``, each rank loading its own stages). Each rank reads only the elements
    of its local shards from ``model.safetensors`` (or the files of
    ``model.safetensors.index.json``): tensor-parallel, packed (``sf.shard(...,
    packed=3)``), FSDP2 and 3D layouts alike. A tied LM head is read from its embedding's
    key; non-persistent buffers (rotary ``inv_freq``) are recomputed. ``dtype``: the dtype
    to load in (default: each tensor as stored). Keys are read through transformers'
    checkpoint conversion for the model type, so a mixture-of-experts folder of per-expert
    tensors (``save_pretrained``'s, the Hub's) fills the fused expert parameters, each rank
    reading only its experts (``sf.expert_parallel``) and slices (``sf.expert_tensor_parallel``).

    Raises :class:`WeightsMismatchError` (a :class:`ScheduleError`) listing every missing
    key, unexpected key and shape mismatch (a fused expert parameter whose per-expert
    tensors are missing or do not fit), and every key transformers converts with an
    operation that cannot be read slice by slice, before any data is read: nothing is
    half loaded.

    Example:
        >>> import tempfile, torch, slapo_fn as sf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                   num_attention_heads=2, num_key_value_heads=2)
        >>> folder = tempfile.mkdtemp(); LlamaForCausalLM(cfg).save_pretrained(folder)
        >>> with torch.device("meta"):
        ...     meta = LlamaForCausalLM(cfg)
        >>> model = sf.load_hf(sf.build(sf.create_schedule(meta), init="empty"), folder)
        >>> torch.equal(model.lm_head.weight, LlamaForCausalLM.from_pretrained(folder).lm_head.weight)
        True
    """
    root = Path(folder)
    what = f"load_hf({str(root)!r})"
    target = _target(model, what)
    headers = _headers(root, what)
    ignored = [p for m in target.modules for p in ignored_on_load(m)]
    keys = checkpoint_keys(target.root, headers, target.shapes)
    sources, wanted = _check(target, headers, keys, ignored, dtype, root)
    plans = _plans(target, sources, wanted)
    unfillable = [f"{path}" for m in target.modules for path, sub in walk(m)
                  if any(getattr(sub._buffers.get(n), UNFILLED, False) for n in sub._non_persistent_buffers_set)]
    with torch.no_grad():
        _cast(target, plans)
        for module in target.modules:  # before the parameters: a module's own init may reset them
            paths = [p for p, sub in walk(module) if sub._non_persistent_buffers_set]
            failed = set(recompute_buffers(module, paths))
            bad = [p for p in unfillable if p in failed]
            if bad:
                raise ScheduleError(what, [Problem(p, "has non-persistent buffers that are not in weight files and "
                                                      "no initialisation that recomputes them",
                                                   "build from a model whose buffers hold values (not meta), or "
                                                   "give the module reset_parameters()") for p in bad])
        for plan in plans:
            with _Files(headers) as files:  # closed after each tensor: see _Files
                if plan.ranges is None:
                    shape = _shape(plan.source, headers) or ()
                    whole = tuple(((0, n),) for n in shape)
                    data = (_read_assembled(plan.source, whole, files.slice, headers) if shape or not isinstance(
                        plan.source, str) else files.handle(plan.source).get_tensor(plan.source))
                    dst = plan.tensor
                else:
                    data = (_read_assembled(plan.source, plan.ranges, files.slice, headers) if all(plan.ranges)
                            else torch.empty(0))
                    dst = plan.tensor.to_local()  # type: ignore[attr-defined]
                if dst.numel():
                    dst.copy_(data.reshape(dst.shape))
        for module in target.modules:
            for _, sub in walk(module):
                for b in sub._buffers.values():
                    if b is not None and UNFILLED in b.__dict__:
                        delattr(b, UNFILLED)
                if isinstance(sub, FSDPModule):
                    reset_fsdp_shards(sub)
    return model


# -- save --------------------------------------------------------------------------------------
def _pipeline_state(model: Pipeline, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Every stage's full tensors on global rank 0 (gathered over its ``pp`` group); ``None``
    on the other ranks."""
    ranks = dist.get_process_group_ranks(model.group)
    if 0 not in ranks:
        return None
    out: list[Any] | None = [None] * len(ranks) if dist.get_rank() == 0 else None
    dist.gather_object(state, out, dst=0, group=model.group)
    if out is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in out:
        merged.update(part)
    return merged


def _config(target: _Target) -> Any:
    return next((c for m in target.modules if (c := config_of(m)) is not None), None)


def _save_tokenizer(tokenizer: Any, folder: Path) -> None:
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))
        return
    source = Path(tokenizer)
    found = [source / n for n in _TOKENIZER_FILES if (source / n).is_file()]
    if not found:
        raise ScheduleError("save_hf", [Problem(str(source), "holds no tokenizer files "
                                                             f"({', '.join(_TOKENIZER_FILES[:3])} …)",
                                                "pass a tokenizer object (AutoTokenizer.from_pretrained(...)) or "
                                                "the folder it was saved to")])
    for file in found:
        shutil.copyfile(file, folder / file.name)


def save_hf(model: Any, folder: str | os.PathLike[str], *, tokenizer: Any = None) -> Path:
    """Write ``model`` (any layout: tensor-parallel, packed, FSDP2, pipeline, 3D) as a
    Hugging Face folder: one ``model.safetensors`` with the full tensors in their original
    element order, under the keys ``save_pretrained`` writes (fused experts as one tensor
    per expert; a tied LM head left out), ``config.json``
    (its dtype the saved one), ``generation_config.json`` where the model has one, and
    the tokenizer files when ``tokenizer`` is given (an object with ``save_pretrained``,
    or a folder holding them). Every rank calls it; rank 0 writes. Returns the folder.

    Memory: every tensor-parallel/FSDP rank gathers its stages' full tensors (one full
    copy of its stages per rank while it runs); pipeline stages are sent to rank 0.

    Example:
        >>> import tempfile, torch, slapo_fn as sf
        >>> from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                   num_attention_heads=2, num_key_value_heads=2)
        >>> model = sf.build(sf.create_schedule(LlamaForCausalLM(cfg)))
        >>> folder = sf.save_hf(model, tempfile.mkdtemp())
        >>> again = AutoModelForCausalLM.from_pretrained(folder)
        >>> torch.equal(again.lm_head.weight, model.lm_head.weight)
        True
    """
    root = Path(folder)
    target = _target(model, "save_hf")
    if root.exists() and not root.is_dir():
        raise ScheduleError("save_hf", [Problem(str(root), "is a file, not a folder",
                                                "pass a folder path (new, or one to overwrite files in)")])
    config = _config(target)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ScheduleError("save_hf", [Problem("", "the model has no Hugging Face config (model.config)",
                                                "save_hf writes Hugging Face models; use sf.save for others")])
    state: dict[str, torch.Tensor] | None = full_state_dict(list(target.modules))
    if isinstance(model, Pipeline):
        state = _pipeline_state(model, state or {})
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and state is not None:
        root.mkdir(parents=True, exist_ok=True)
        for key, source in target.tied.items():
            if key in state and source in state and torch.equal(state[key], state[source]):
                del state[key]
        keep = checkpoint_state(target.root, {k: v.contiguous() for k, v in state.items() if k in target.shapes})
        save_file(keep, str(root / _SINGLE), metadata={"format": "pt"})
        config = copy.deepcopy(config)
        floats = [v.dtype for v in keep.values() if v.is_floating_point()]
        if floats:
            config.dtype = max(set(floats), key=floats.count)
        config.save_pretrained(str(root))
        generation = next((g for m in target.modules if (g := getattr(m, "generation_config", None)) is not None),
                          None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(str(root))
        if tokenizer is not None:
            _save_tokenizer(tokenizer, root)
    if dist.is_initialized():
        dist.barrier()
    return root
