"""``context_parallel``: long sequences split over a ``cp`` mesh axis (the Llama 3 scheme).

The sequence of ``S`` tokens is cut into ``2·cp`` chunks; rank ``r`` of the ``cp`` axis
holds chunks ``r`` and ``2·cp−1−r`` (``load_balance=True``: every rank then has the same
causal work), or the one chunk ``r`` of ``cp`` (``load_balance=False``). Everything but
attention (embeddings, norms, MLPs, the head, the loss) runs on the rank's tokens only;
attention keeps the rank's queries and all-gathers keys and values over ``cp`` (their
gradients are reduce-scattered back), with the causal mask of the rank's global
positions. This works with any attention kernel and on CPU, where PyTorch's ring
attention (``torch.distributed.tensor.experimental.context_parallel``) does not run.

The layout itself is a few pure functions of ``(rank, size, sequence length)``, here;
the build phase (:mod:`.context_runtime`) installs it.

Example:
    >>> import slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2)
    >>> sch = sf.create_schedule(LlamaForCausalLM(cfg), mesh=fake_mesh(2, names=("cp",)))
    >>> sch = sf.context_parallel(sch)
    >>> print(sch["model.layers.0.self_attn"].annotations["context_parallel"])
    cp@cp(allgather, load-balanced)
    >>> chunks(rank=0, size=2, load_balance=True), positions(0, 2, 8, load_balance=True).tolist()
    ((0, 3), [0, 1, 6, 7])
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..combinators import primitive
from ..errors import LayoutError, Problem
from ..kernels import RotaryAttention
from ..kernels._common import KernelError
from ..rewrites._common import contains
from ..schedule import Key, Schedule
from ..select import Selection, select
from .context_ring import ring_problems
from .shard import _problem_mesh, _problem_uncalled

__all__ = ["CP", "IGNORE_INDEX", "CPSpec", "chunk_count", "chunks", "context_parallel", "key_positions", "positions",
           "shifted", "split_batch", "take"]

CP: Key[CPSpec] = Key("context_parallel")
#: Label value that no loss counts, as in Hugging Face.
IGNORE_INDEX = -100

#: The attention modules of a Hugging Face decoder, selected when ``where`` is not given.
DEFAULT_WHERE = "model.layers.*.self_attn"

#: How attention gets the other ranks' keys and values: ``"allgather"`` (the Llama 3
#: scheme, any device and mask) or ``"ring"`` (PyTorch's ring attention, CUDA).
Impl = Literal["allgather", "ring"]
_IMPLS = ("allgather", "ring")


@dataclass(frozen=True)
class CPSpec:
    """How a selected attention module (and the model's inputs) are split over ``mesh_axis``."""

    mesh_axis: str = "cp"
    load_balance: bool = True
    impl: Impl = "allgather"
    #: The loader already hands each rank its chunks (``take`` of the global batch).
    inputs_split: bool = False

    def __str__(self) -> str:
        balanced = ", load-balanced" if self.load_balance else ", contiguous"
        split = ", inputs split" if self.inputs_split else ""
        return f"cp@{self.mesh_axis}({self.impl}{balanced}{split})"


def chunk_count(size: int, load_balance: bool) -> int:
    """How many chunks the sequence is cut into: ``2·size`` load-balanced, else ``size``.

    >>> chunk_count(4, True), chunk_count(4, False)
    (8, 4)
    """
    return 2 * size if load_balance else size


def chunks(rank: int, size: int, load_balance: bool) -> tuple[int, ...]:
    """The chunks rank ``rank`` of ``size`` holds, in the order it holds them.

    >>> chunks(1, 4, True), chunks(1, 4, False)
    ((1, 6), (1,))
    """
    return (rank, 2 * size - 1 - rank) if load_balance else (rank,)


def positions(rank: int, size: int, seq: int, load_balance: bool, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens of a sequence of ``seq`` tokens (1-D).

    >>> positions(1, 2, 8, load_balance=True).tolist(), positions(1, 2, 8, load_balance=False).tolist()
    ([2, 3, 4, 5], [4, 5, 6, 7])
    """
    n = seq // chunk_count(size, load_balance)
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in chunks(rank, size, load_balance)])


def key_positions(size: int, seq: int, load_balance: bool, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of the keys an all-gather over ``size`` ranks concatenates (rank
    0's tokens, then rank 1's, ...); ``argsort`` of it puts gathered keys in global order.

    >>> key_positions(2, 8, load_balance=True).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    return torch.cat([positions(r, size, seq, load_balance, device) for r in range(size)])


def take(x: torch.Tensor, dim: int, rank: int, size: int, load_balance: bool) -> torch.Tensor:
    """Rank ``rank``'s chunks of ``x`` along ``dim`` (the sequence), concatenated: what the
    built model cuts from the global batch, and what a loader hands each rank with
    ``inputs_split=True``.

    >>> take(torch.arange(8)[None], 1, rank=0, size=2, load_balance=True).tolist()
    [[0, 1, 6, 7]]
    """
    pieces = x.chunk(chunk_count(size, load_balance), dim)
    return torch.cat([pieces[c] for c in chunks(rank, size, load_balance)], dim)


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """``labels[:, 1:]`` padded with the ignored label: the target of each position.

    >>> shifted(torch.tensor([[5, 6, 7]])).tolist()
    [[6, 7, -100]]
    """
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def split_batch(batch: Mapping[str, torch.Tensor], rank: int, size: int, load_balance: bool) \
        -> dict[str, torch.Tensor]:
    """Rank ``rank``'s chunks of a global batch of ``(batch, seq, ...)`` tensors: what a
    loader hands each ``cp`` rank of a model built with ``inputs_split=True``.

    ``labels`` (Hugging Face's convention: lined up with ``input_ids``) become
    ``shift_labels``, shifted over the whole sequence before the cut (the shift crosses
    chunk boundaries); ``position_ids`` are cut, or made from the rank's global positions
    where the batch has none; every other tensor with the sequence in dim 1 is cut. The
    sequence must be a multiple of :func:`chunk_count` (else a :class:`LayoutError`).

    >>> b = split_batch({"input_ids": torch.arange(8)[None], "labels": torch.arange(8)[None]}, 1, 2, True)
    >>> {k: v.tolist() for k, v in b.items()}
    {'input_ids': [[2, 3, 4, 5]], 'shift_labels': [[3, 4, 5, 6]], 'position_ids': [[2, 3, 4, 5]]}
    """
    ids = batch.get("input_ids", batch.get("inputs_embeds"))
    if ids is None or ids.dim() < 2:
        raise LayoutError("split_batch", [Problem("input_ids", "the batch has no (batch, seq) input_ids or "
                                                  "inputs_embeds to split", "hand it the global batch")])
    seq, n = ids.shape[1], chunk_count(size, load_balance)
    if seq == 0 or seq % n:
        raise LayoutError("split_batch", [Problem("input_ids", f"the sequence of {seq} tokens cannot be cut into "
                                                  f"{n} equal chunks over cp={size}",
                                                  f"pad or pack the sequences to a multiple of {n} tokens")])
    out = {}
    for k, v in batch.items():
        if k == "labels":
            out["shift_labels"] = take(shifted(v), 1, rank, size, load_balance)
        elif v.dim() >= 2 and v.shape[1] == seq:
            out[k] = take(v, 1, rank, size, load_balance)
        else:
            out[k] = v
    if "position_ids" not in out:
        out["position_ids"] = positions(rank, size, seq, load_balance, ids.device)[None].expand(ids.shape[0], -1)
    return out


def _takes(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False


def _problem_attention(sch: Schedule, path: str) -> Problem | None:
    """Why the module at ``path`` cannot run context-parallel, or ``None``."""
    module = sch[path].module
    if isinstance(module, RotaryAttention):
        return None
    if not _takes(module, "position_embeddings"):
        return Problem(
            path,
            f"{type(module).__name__} does not receive its positions from the model (its forward takes no "
            "position_embeddings): positions it makes itself (ALiBi, relative or learned biases) would be those "
            "of this rank's chunk, not the global ones",
            "context_parallel splits rotary attention whose cos/sin the model computes from position_ids "
            "(handed to each layer as position_embeddings); train this model without context parallelism",
        )
    try:
        RotaryAttention.from_hf(module, path)
    except KernelError as e:
        return Problem(path, f"its attention cannot be split: {e.problems[0].reason}", e.problems[0].fix)
    return None


def _problems_root(sch: Schedule) -> list[Problem]:
    root = sch.module
    problems = []
    if not (_takes(root, "input_ids") or _takes(root, "inputs_embeds")):
        problems.append(Problem("", f"{type(root).__name__}'s forward takes no input_ids or inputs_embeds to split",
                                "schedule the model whose forward takes the token ids (a Hugging Face model)"))
    if not _takes(root, "position_ids"):
        problems.append(Problem("", f"{type(root).__name__}'s forward takes no position_ids: the model cannot be "
                                    "told the global positions of this rank's tokens",
                                "schedule a model that takes position_ids (a Hugging Face decoder)"))
    return problems


@primitive
def context_parallel(
    sch: Schedule,
    where: Selection | None = None,
    *,
    mesh_axis: str = "cp",
    load_balance: bool = True,
    impl: str = "allgather",
    inputs_split: bool = False,
) -> Schedule:
    """Split the sequence over ``mesh_axis``: the selected attention modules (default:
    :data:`DEFAULT_WHERE`) all-gather keys and values over it, everything else runs on
    the rank's tokens.

    The built model takes the global batch on every rank of ``mesh_axis`` and cuts its
    own chunks (``input_ids``/``inputs_embeds``, ``labels``, ``position_ids``; the rotary
    tables follow the positions); with ``inputs_split=True`` a loader hands each rank its
    chunks (:func:`take`) and, for a loss, the labels already shifted (``shift_labels=``,
    the shift crosses chunk boundaries). Labels are shifted globally before the split and
    the loss is the mean over the global tokens, on every rank. Each rank's parameter
    gradients are summed over ``mesh_axis`` in backward (as data parallelism sums them):
    after ``backward()`` they equal the single process's.

    The attention modules run on :class:`~slapo_fn.kernels.RotaryAttention` with a mask of
    the rank's global positions (a sliding window included). ``impl="ring"`` runs
    PyTorch's own ring attention instead (:mod:`.context_ring`; CUDA meshes only,
    load-balanced causal attention without a window or dropout: refused otherwise, by
    path, with the fix ``impl="allgather"``). Attention whose positions
    the model does not pass (ALiBi, learned or relative biases) is refused here. The
    sequence length must be a multiple of ``2·cp`` (``cp`` without ``load_balance``):
    the first forward refuses one that is not, before any model code runs. A padding
    ``attention_mask`` is refused (pack the sequences). Returns a new schedule; the input
    is unchanged (example: the module docstring).
    """
    paths = (where or select(DEFAULT_WHERE)).modules(sch.module)
    problems = [p for p in (_problem_mesh(sch, path, mesh_axis) for path in paths) if p is not None]
    problems += [p for p in (_problem_uncalled(sch, path) for path in paths) if p is not None]
    if impl not in _IMPLS:
        problems.append(Problem(paths[0] if paths else "", f"unknown impl {impl!r}",
                                f"one of {', '.join(map(repr, _IMPLS))}"))
    spec = CPSpec(mesh_axis, load_balance, "ring" if impl == "ring" else "allgather", inputs_split)
    existing = sch.annotations.of_kind(CP)
    for other in sorted({v for v in existing.values() if v != spec}, key=str):
        problems.append(Problem("", f"the schedule already splits the sequence as {other}, not {spec}",
                                "call context_parallel with the same options for every selection"))
    for path in paths:
        inside = next((o for o in (*existing, *paths) if o != path and contains(o, path)), None)
        if inside is not None:
            problems.append(Problem(path, f"is inside context-parallel module {inside!r}",
                                    f"select either {inside!r} or {path!r}"))
        elif (problem := _problem_attention(sch, path)) is not None:
            problems.append(problem)
        elif impl == "ring":
            module = sch[path].module
            kernel = module if isinstance(module, RotaryAttention) else RotaryAttention.from_hf(module, path)
            assert isinstance(kernel, RotaryAttention)  # from_hf on the class builds the class
            problems += ring_problems(path, kernel, getattr(sch.mesh, "device_type", "cpu"), load_balance)
    problems += _problems_root(sch)
    if problems:
        raise LayoutError("context_parallel", problems)
    for path in paths:
        sch = sch.annotate_path(path, CP, spec)
    return sch
