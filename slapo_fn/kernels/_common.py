"""What the kernels share: their typed error and the check that a module is what a kernel expects."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from ..errors import Problem, ScheduleTypeError

__all__ = ["KernelError", "expect_type", "fail", "require_attrs"]


class KernelError(ScheduleTypeError):
    """A kernel cannot stand in for a module (wrong type, unsupported option) or was given
    input it cannot take.

    A :class:`~slapo_fn.errors.ScheduleTypeError`, hence both a ``TypeError`` and a
    ``ValueError``; ``problems`` names the path, the reason and the fix.

    Example:
        >>> import torch.nn as nn
        >>> from slapo_fn.kernels import RotaryAttention
        >>> try:
        ...     RotaryAttention.from_hf(nn.Linear(2, 2), "layers.0.self_attn")
        ... except KernelError as e:
        ...     print(e.path)
        layers.0.self_attn
    """

    def __init__(self, kernel: str, problems: Sequence[Problem]) -> None:
        super().__init__(kernel, problems)
        lines = [f"{p.path or '<root>'}: {p.reason} [{kernel}]" + (f"\n      fix: {p.fix}" if p.fix else "")
                 for p in self.problems]
        self.args = ("\n".join(lines),)


def fail(kernel: str, path: str, reason: str, fix: str) -> KernelError:
    return KernelError(kernel, [Problem(path, reason, fix)])


def expect_type(kernel: str, old: nn.Module, path: str, names: Iterable[str], fix: str) -> None:
    """Raise :class:`KernelError` unless ``type(old).__name__`` is one of ``names``.

    Kernels check Hugging Face modules by class name: the modules are copies of each other
    across families (``MistralAttention`` is ``LlamaAttention`` plus a sliding window), and
    a name says which variant's semantics the kernel was checked against.
    """
    names = tuple(names)
    if type(old).__name__ not in names:
        raise fail(
            kernel,
            path,
            f"{type(old).__name__} is not one of the modules this kernel replaces ({', '.join(names)})",
            fix,
        )


def require_attrs(kernel: str, old: nn.Module, path: str, attrs: Iterable[str]) -> None:
    """Raise :class:`KernelError` naming every attribute of ``old`` that is missing."""
    missing = [a for a in attrs if not hasattr(old, a)]
    if missing:
        raise fail(
            kernel,
            path,
            f"{type(old).__name__} has no {', '.join(missing)}",
            "replace the module this kernel was written for (see its docstring)",
        )
