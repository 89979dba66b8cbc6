"""Text rendering shared by ``print(sch)``, ``explain``, layouts, the stage and memory tables.

This module sits at the bottom of the package (it imports only torch and
:mod:`slapo_fn.tree`), so every layer may use it without reaching up to ``explain``.

A parameter renders as ``f32[4096, 1024]``; an annotation value with a
``format(shape, dtype)`` method (a tensor-parallel ``Layout``) renders the parameter
in its own form (``f32[4096@tp, 1024]``) instead of being listed as a tag.

Example:
    >>> import torch.nn as nn
    >>> print(render_tree(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3)), "", {}))
    <root>: Sequential
      0: Linear
        · weight: f32[3, 2]
        · bias: f32[3]
      1: Linear
        · weight: f32[3, 3]
        · bias: f32[3]
    >>> format_bytes(1536)
    '1.5 KiB'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .tree import join

__all__ = ["ParamFormat", "format_bytes", "format_dtype", "format_param", "render_tree"]

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


@runtime_checkable
class ParamFormat(Protocol):
    """An annotation value that renders the parameter it annotates (a ``Layout``)."""

    def format(self, shape: Sequence[int], dtype: torch.dtype) -> str: ...


def format_dtype(dtype: torch.dtype) -> str:
    """Short dtype names for layouts: ``f32``, ``bf16``, ``i64``…"""
    return _DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def format_bytes(n: int) -> str:
    """``1536`` → ``1.5 KiB``: byte counts as explain, the stage table and memory print them."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    raise AssertionError


def format_param(tensor: torch.Tensor, annotations: Mapping[str, Any] | None = None) -> str:
    """``f32[4096, 1024]``; an annotation that is a :class:`ParamFormat` renders its own
    form (``f32[4096@tp, 1024]``)."""
    for value in (annotations or {}).values():
        if isinstance(value, ParamFormat):
            return str(value.format(tuple(tensor.shape), tensor.dtype))
    return f"{format_dtype(tensor.dtype)}[{', '.join(str(d) for d in tensor.shape)}]"


def _fmt_annotations(kinds: Mapping[str, Any]) -> str:
    parts = []
    for kind, value in kinds.items():
        if isinstance(value, ParamFormat):
            continue  # rendered in the parameter's shape
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
    """The tree under ``module`` (at ``path``) with parameters and annotations; identical
    numbered siblings fold into one entry (``layers.[0-79] ×80``)."""
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
