"""``explain``: what a schedule will build — the tree, annotations, parameter counts and bytes.

Runs on meta-device models and needs no process group. ``print(sch)`` shows the same
tree; repeated identical siblings (the decoder layers of a transformer) are folded into
one entry (``layers.[0-79] ×80``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .schedule import Schedule
from .tree import join

if TYPE_CHECKING:
    from .dtensor.explain import TensorParallelExplanation
    from .memory import MemoryTable

__all__ = ["Explanation", "ModuleRow", "explain", "format_bytes", "format_dtype", "format_param", "render_tree"]

_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
    torch.uint8: "u8",
    torch.int8: "i8",
}


def format_dtype(dtype: torch.dtype) -> str:
    """Short dtype names for layouts: ``f32``, ``bf16``, ``i64``…"""
    return _DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def format_param(tensor: torch.Tensor, annotations: Mapping[str, Any] | None = None) -> str:
    """``f32[4096, 1024]``; a ``"layout"`` annotation with ``format(shape, dtype)`` can
    render its own form (``f32[4096@tp, 1024]``)."""
    layout = (annotations or {}).get("layout")
    if layout is not None and hasattr(layout, "format"):
        return str(layout.format(tuple(tensor.shape), tensor.dtype))
    dtype = format_dtype(tensor.dtype)
    return f"{dtype}[{', '.join(str(d) for d in tensor.shape)}]"


def _fmt_annotations(kinds: Mapping[str, Any]) -> str:
    parts = []
    for kind, value in kinds.items():
        if kind == "layout":
            continue
        if isinstance(value, tuple):
            parts += [str(v) for v in value]
        elif isinstance(value, Mapping):
            parts.append(f"{kind}({', '.join(f'{k}={v!r}' for k, v in value.items())})")
        else:
            parts.append(str(value))
    return f"  [{'; '.join(parts)}]" if parts else ""


def _signature(module: nn.Module, path: str, annotations: Mapping[str, Mapping[str, Any]]) -> object:
    """A hashable summary of a subtree (types, parameter shapes, annotations) relative to
    ``path``, used to fold identical siblings."""
    own = tuple((n, tuple(p.shape), p.dtype) for n, p in module._parameters.items() if p is not None)
    notes = tuple(
        sorted((k[len(path) :], str(dict(v))) for k, v in annotations.items() if k == path or k.startswith(path + "."))
    )
    children = tuple((n, _signature(c, join(path, n), {})) for n, c in module._modules.items() if c is not None)
    return (type(module), own, notes, children)


def _fold(names: list[str]) -> str:
    if [int(n) for n in names] == list(range(int(names[0]), int(names[0]) + len(names))):
        return f"[{names[0]}-{names[-1]}]"
    return "[" + ",".join(names) + "]"


def render_tree(module: nn.Module, path: str, annotations: Mapping[str, Mapping[str, Any]]) -> str:
    """The tree under ``module`` (at ``path``) with parameters and annotations."""
    lines: list[str] = []

    def param_lines(m: nn.Module, p_path: str, indent: str) -> None:
        for name, p in m._parameters.items():
            if p is not None:
                full = join(p_path, name)
                lines.append(
                    f"{indent}· {name}: {format_param(p, annotations.get(full))}"
                    f"{_fmt_annotations(annotations.get(full, {}))}"
                )

    def visit(m: nn.Module, m_path: str, label: str, indent: str, count: int) -> None:
        times = f" ×{count}" if count > 1 else ""
        lines.append(f"{indent}{label}: {type(m).__name__}{times}{_fmt_annotations(annotations.get(m_path, {}))}")
        inner = indent + "  "
        param_lines(m, m_path, inner)
        children = [(n, c) for n, c in m._modules.items() if c is not None]
        i = 0
        while i < len(children):
            name, child = children[i]
            sig = _signature(child, join(m_path, name), annotations)
            j = i + 1
            while (
                j < len(children)
                and name.isdigit()
                and children[j][0].isdigit()
                and _signature(children[j][1], join(m_path, children[j][0]), annotations) == sig
            ):
                j += 1
            group = [n for n, _ in children[i:j]]
            visit(child, join(m_path, name), _fold(group) if len(group) > 1 else name, inner, len(group))
            i = j

    visit(module, path, path or "<root>", "", 1)
    return "\n".join(lines)


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

    def __str__(self) -> str:
        annotated = [(r.path or "<root>", ", ".join(r.annotations)) for r in self.rows if r.annotations]
        out = [self.tree, "", f"parameters: {self.total_parameters:,} ({format_bytes(self.total_bytes)})"]
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


def _fold_numbered(items: list[tuple[str, str]]) -> list[tuple[tuple[str, str], int]]:
    """Group entries equal up to the layer numbers in their paths (``layers.3`` → ``layers.*``),
    in order of first appearance, with their counts; single entries keep their numbers."""
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for key, text in items:
        groups.setdefault((_NUMBER.sub("*", key), text), []).append((key, text))
    return [(key if len(members) > 1 else members[0], len(members)) for key, members in groups.items()]


def format_bytes(n: int) -> str:
    """``1536`` → ``1.5 KiB``: byte counts as explain, the stage table and memory print them."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    raise AssertionError


def explain(sch: Schedule, *inputs: Any, kwargs: Mapping[str, Any] | None = None) -> Explanation:
    """Explain ``sch``: the folded tree, parameter counts and bytes per module (tied
    parameters counted once), annotations and the rewrite history; with a mesh, the
    tensor-parallel section (``.tensor_parallel``: layouts, per-rank parameter bytes,
    the collectives of one step per module boundary). Optional example ``inputs`` /
    ``kwargs`` (meta tensors suffice: only shapes matter) give those collectives their bytes.

    >>> import torch.nn as nn, slapo_fn as sf
    >>> sch = sf.checkpoint(sf.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))), "0")
    >>> sf.explain(sch).total_parameters
    40
    """
    seen: set[int] = set()
    rows = []
    total = total_bytes = 0
    from .tree import walk

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
    )


def _tensor_parallel(
    sch: Schedule, inputs: tuple[Any, ...], kwargs: Mapping[str, Any] | None
) -> TensorParallelExplanation | None:
    if sch.mesh is None:
        return None
    from .dtensor.explain import explain_tensor_parallel

    return explain_tensor_parallel(sch, *inputs, kwargs=kwargs)


def _memory(sch: Schedule) -> MemoryTable:
    from .memory import per_rank_memory

    return per_rank_memory(sch)


def _stages(sch: Schedule) -> str:
    from .pipelines.explain import stage_table

    return str(stage_table(sch))
