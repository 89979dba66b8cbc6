"""``explain``: what a schedule will build — the tree, annotations, parameter counts and bytes.

Runs on meta-device models and needs no process group. ``print(sch)`` shows the same
tree; repeated identical siblings (the decoder layers of a transformer) are folded into
one entry (``layers.[0-79] ×80``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .dtensor.explain import TensorParallelExplanation, explain_tensor_parallel
from .memory import MemoryTable, per_rank_memory
from .pipelines.explain import stage_table
from .render import format_bytes, format_dtype, format_param, render_tree
from .schedule import Schedule
from .tree import walk
from .verify import check_inputs

__all__ = ["Explanation", "ModuleRow", "explain", "format_bytes", "format_dtype", "format_param", "render_tree"]

@dataclass(frozen=True)
class ModuleRow:
    path: str
    type: str
    parameters: int
    bytes: int
    annotations: tuple[str, ...]


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found; ``str()`` renders it."""

    tree: str
    rows: tuple[ModuleRow, ...]
    total_parameters: int
    total_bytes: int
    history: tuple[str, ...]
    #: The pipeline stage table (:func:`slapo_fn.pipelines.stage_table`), "" without cuts.
    stages: str = ""
    #: Layouts, per-rank parameter bytes and per-boundary collectives
    #: (:func:`slapo_fn.dtensor.explain.explain_tensor_parallel`); ``None`` without a mesh.
    tensor_parallel: TensorParallelExplanation | None = None
    #: Parameters, gradients and optimizer state per rank (:func:`slapo_fn.memory.per_rank_memory`).
    memory: MemoryTable | None = None
    #: The example inputs the activation and collective sizes are computed for, as text
    #: (``input 0: int64 (4, 2048)``); "" without inputs.
    assumed: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Everything ``str()`` prints, as plain JSON-able data (``json.dumps`` it):
        rows, annotations, the tensor-parallel layouts and collectives, the memory table,
        the stage table and the history.

        >>> import json, torch.nn as nn, slapo_fn as sf
        >>> d = sf.explain(sf.create_schedule(nn.Linear(2, 3))).as_dict()
        >>> d["total_parameters"], json.loads(json.dumps(d))["rows"][0]["type"]
        (9, 'Linear')
        """
        return _plain(self)

    def __str__(self) -> str:
        annotated = [(r.path or "<root>", ", ".join(r.annotations)) for r in self.rows if r.annotations]
        out = [self.tree, "", f"parameters: {self.total_parameters:,} ({format_bytes(self.total_bytes)})"]
        if self.assumed:
            out.append(f"sizes below are for the inputs given: {self.assumed}")
        if annotated:
            out.append("annotations:")
            out += [f"  {path}: {text}{_times(n)}" for (path, text), n in _fold_numbered(annotated)]
        if self.tensor_parallel is not None:
            out.append(str(self.tensor_parallel))
        if self.stages:
            out.append(self.stages)
        if self.memory is not None and (self.tensor_parallel is not None or self.stages):
            out.append(str(self.memory))
        if self.history:
            folded = _fold_numbered([(h, "") for h in self.history])
            note = ", repeated ones folded" if len(folded) < len(self.history) else ""
            out.append(f"rewrites ({len(self.history)}{note}):")
            out += [f"  {i}. {h}{_times(n)}" for i, ((h, _), n) in enumerate(folded, 1)]
        return "\n".join(out)


_NUMBER = re.compile(r"(?<=\.)\d+(?=[.']|$)")


def _times(n: int) -> str:
    return f"  ×{n}" if n > 1 else ""


def _indices(numbers: list[int]) -> str:
    """``[0-31]``, ``[7,15,23]`` or ``[0-3,8]``: the numbers as a selector token."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return "[" + ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs) + "]"


def _fold_numbered(items: list[tuple[str, str]]) -> list[tuple[tuple[str, str], int]]:
    """Group entries equal up to the layer numbers in their paths, in order of first
    appearance, with their counts; a group's path names the layers it holds where one
    number varies (``layers.[7,15,23]``, ``layers.[0-31]``), else ``layers.*``; single
    entries keep their numbers.

    >>> _fold_numbered([("m.layers.7", "cut"), ("m.layers.15", "cut"), ("m.layers.23", "cut")])
    [(('m.layers.[7,15,23]', 'cut'), 3)]
    """
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for key, text in items:
        groups.setdefault((_NUMBER.sub("*", key), text), []).append((key, text))
    out: list[tuple[tuple[str, str], int]] = []
    for (pattern, text), members in groups.items():
        if len(members) == 1:
            out.append((members[0], 1))
            continue
        numbers = [_NUMBER.findall(key) for key, _ in members]
        varying = [i for i in range(len(numbers[0])) if len({tuple(n)[i] for n in numbers}) > 1]
        if len(varying) == 1 and pattern.count("*") == len(numbers[0]):
            parts = pattern.split("*")
            fixed = numbers[0]
            pieces = [parts[0]]
            for i in range(len(fixed)):
                token = _indices([int(n[i]) for n in numbers]) if i == varying[0] else fixed[i]
                pieces += [token, parts[i + 1]]
            pattern = "".join(pieces)
        out.append(((pattern, text), len(members)))
    return out


def explain(sch: Schedule, *inputs: Any, kwargs: Mapping[str, Any] | None = None) -> Explanation:
    """Explain ``sch``: the folded tree, parameter counts and bytes per module (tied
    parameters counted once), annotations and the rewrite history; with a mesh, the
    tensor-parallel section (``.tensor_parallel``: layouts, per-rank parameter bytes,
    the collectives of one step per module boundary). Optional example ``inputs`` /
    ``kwargs`` (meta tensors suffice: only shapes matter) give those collectives their bytes;
    they are checked against the model's forward first (:func:`slapo_fn.verify.check_inputs`:
    float token ids for a language model, misspelt keywords, …).

    >>> import torch.nn as nn, slapo_fn as sf
    >>> sch = sf.checkpoint(sf.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))), "0")
    >>> sf.explain(sch).total_parameters
    40
    """
    if inputs or kwargs:
        check_inputs(sch.module, inputs, kwargs or {}, "explain")
    seen: set[int] = set()
    rows = []
    total = total_bytes = 0
    for path, m in walk(sch.module):
        count = nbytes = 0
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                count += p.numel()
                nbytes += p.numel() * p.element_size()
        total += count
        total_bytes += nbytes
        notes = tuple(
            f"{k}={v}" if not isinstance(v, tuple) else f"{k}={', '.join(map(str, v))}"
            for k, v in sch.annotations.get(path, {}).items()
        )
        rows.append(ModuleRow(path, type(m).__name__, count, nbytes, notes))
    return Explanation(
        tree=render_tree(sch.module, "", sch.annotations),
        rows=tuple(rows),
        total_parameters=total,
        total_bytes=total_bytes,
        history=tuple(repr(h) for h in sch.history),
        stages=_stages(sch),
        tensor_parallel=_tensor_parallel(sch, inputs, kwargs),
        memory=_memory(sch),
        assumed=_assumed(inputs, kwargs),
    )


def _plain(value: Any) -> Any:
    """``value`` as JSON data: dataclasses and mappings as dicts, sequences and sets as
    lists, numbers, strings, booleans and None as they are, anything else as its text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(_plain(v) for v in value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _assumed(inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> str:
    """``input 0: int64 (4, 2048); attention_mask=: int64 (4, 2048)``."""
    named = [(f"input {i}", x) for i, x in enumerate(inputs)] + [(f"{k}=", v) for k, v in (kwargs or {}).items()]
    return "; ".join(f"{name}: {format_dtype(x.dtype)} {tuple(x.shape)}" for name, x in named
                     if isinstance(x, torch.Tensor))


def _tensor_parallel(
    sch: Schedule, inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None
) -> TensorParallelExplanation | None:
    if sch.mesh is None:
        return None
    return explain_tensor_parallel(sch, *inputs, kwargs=kwargs)


def _memory(sch: Schedule) -> MemoryTable:
    return per_rank_memory(sch)


def _stages(sch: Schedule) -> str:
    return str(stage_table(sch))
