"""Typed errors of slapo_fn.

Every error names the offending path(s), the reason and a fix, and inherits the
builtin category a caller would catch (``KeyError``/``ValueError``/``TypeError``/
``AssertionError``). A primitive reports *every* offending path at once and leaves
its input schedule unchanged.

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> sch = sf.create_schedule(nn.Sequential(nn.Linear(2, 2)))
    >>> try:
    ...     sf.checkpoint(sch, "1")
    ... except sf.SelectorError as e:
    ...     print(e.key, e.token)
    1 1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CommandLineError",
    "HardwareError",
    "LayoutError",
    "Problem",
    "ScheduleError",
    "ScheduleTypeError",
    "SelectorError",
    "VerificationError",
]


@dataclass(frozen=True)
class Problem:
    """One offending path: where, what is wrong, and how to fix it."""

    path: str
    reason: str
    fix: str = ""

    def __str__(self) -> str:
        where = repr(self.path) if self.path else "<root>"
        text = f"{where}: {self.reason}"
        return f"{text}\n      fix: {self.fix}" if self.fix else text


def _render(what: str, problems: Sequence[Problem]) -> str:
    if len(problems) == 1:
        return f"{what}: {problems[0]}"
    lines = [f"{what}: {len(problems)} problems"]
    lines += [f"  - {p}" for p in problems]
    return "\n".join(lines)


class ScheduleError(ValueError):
    """A rewrite cannot be applied as asked; the input schedule is unchanged.

    ``problems`` lists every offending path with its reason and fix;
    ``paths`` is the tuple of those paths.
    """

    def __init__(self, what: str, problems: Sequence[Problem]) -> None:
        self.what = what
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__(_render(what, self.problems))

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p.path for p in self.problems)

    @property
    def path(self) -> str:
        return self.problems[0].path if self.problems else ""


class CommandLineError(ScheduleError):
    """Arguments, files or a model config that ``slapo-fn`` refuses before any work
    starts. Each problem's ``path`` is the flag (``"--steps"``) or the file at fault; all
    problems found are reported at once. A ``ValueError``, like every bad-input error of
    slapo_fn.

    >>> print(CommandLineError("train", [Problem("--steps", "must be at least 1, got 0", "--steps 40")]))
    slapo-fn train: '--steps': must be at least 1, got 0
          fix: --steps 40
    """

    def __init__(self, command: str, problems: Sequence[Problem]) -> None:
        super().__init__(f"slapo-fn {command}", problems)
        self.command = command


class ScheduleTypeError(ScheduleError, TypeError):
    """An argument of a rewrite has the wrong type (e.g. a replacement that is not a module)."""


class HardwareError(ScheduleError):
    """What the hardware of this process cannot run as asked: float8 linears without a
    CUDA GPU of compute capability 8.9 or more, or without torchao. Raised before any
    module is converted or rank started."""


class LayoutError(ScheduleError):
    """A layout (placement) cannot hold: shape not divisible, axis out of range, mesh axis missing, …

    ``src``/``dst`` are the layouts involved where there are two (conflicting shards,
    a boundary that cannot be resharded), else ``None``.
    """

    def __init__(
        self,
        what: str,
        problems: Sequence[Problem],
        *,
        src: object | None = None,
        dst: object | None = None,
    ) -> None:
        super().__init__(what, problems)
        self.src = src
        self.dst = dst


class SelectorError(KeyError, ValueError):
    """A selector matched nothing (or matched what the primitive cannot act on).

    Attributes: ``key`` (the selector as written), ``prefix`` (the longest prefix that
    matched), ``token`` (the first token that failed), ``candidates`` (close matches among
    the children at that level), ``fix`` and, for a malformed pattern, ``column`` (1-based,
    where it goes wrong; else ``None``).
    """

    def __init__(
        self,
        key: str,
        *,
        reason: str,
        prefix: str = "",
        token: str = "",
        candidates: Sequence[str] = (),
        fix: str = "",
        column: int | None = None,
    ) -> None:
        self.key = key
        self.reason = reason
        self.column = column
        self.prefix = prefix
        self.token = token
        self.candidates: tuple[str, ...] = tuple(candidates)
        self.fix = fix
        super().__init__(key)

    def __str__(self) -> str:
        text = f"selector {self.key!r}: {self.reason}"
        if self.candidates:
            text += f"; close matches: {', '.join(repr(c) for c in self.candidates)}"
        if self.fix:
            text += f"\n      fix: {self.fix}"
        return text


class VerificationError(AssertionError):
    """The scheduled model's numbers differ from the reference.

    ``module`` is the FQN of the first module (in execution order) whose output diverged,
    or ``None`` when only gradients differ; ``parameters`` lists the parameters whose
    gradients differ; ``max_abs_diff`` is the largest absolute difference seen.
    """

    def __init__(
        self,
        message: str,
        *,
        module: str | None = None,
        parameters: Sequence[str] = (),
        max_abs_diff: float = 0.0,
    ) -> None:
        self.module = module
        self.parameters: tuple[str, ...] = tuple(parameters)
        self.max_abs_diff = max_abs_diff
        super().__init__(message)
