r"""How :mod:`slapo_fn.data` says what is wrong: :class:`~slapo_fn.errors.ScheduleError`\s
of kind ``"data"``, each problem naming the path (a file, a row, an argument), the reason
and the fix; many problems of one kind are listed up to :data:`MAX_LISTED`, then counted."""

from __future__ import annotations

from ..errors import Problem, ScheduleError

MAX_LISTED = 5
"""Problems listed one by one before the rest are counted."""


def error(path: object, reason: str, fix: str) -> ScheduleError:
    """One problem as a raisable error."""
    return ScheduleError("data", [Problem(str(path), reason, fix)])


def a(noun: str) -> str:
    """``noun`` with its indefinite article: ``a list``, ``an int``."""
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


def raise_all(problems: list[Problem]) -> None:
    """Raise every problem of ``problems`` at once (the first :data:`MAX_LISTED`, then a count); nothing if none."""
    if problems:
        shown = problems[:MAX_LISTED]
        if len(problems) > MAX_LISTED:
            shown.append(Problem(problems[MAX_LISTED].path, f"and {len(problems) - MAX_LISTED} more like these"))
        raise ScheduleError("data", shown)


def check_int(name: str, value: object, low: int, fix: str) -> list[Problem]:
    """``[]`` if ``value`` is an int of at least ``low``, else the problem."""
    if isinstance(value, bool) or not isinstance(value, int):
        return [Problem(name, f"must be an int, got {type(value).__name__} {value!r}", fix)]
    return [] if value >= low else [Problem(name, f"must be at least {low}, got {value}", fix)]


def in_order_problems(what: str, step: int, next_step: int | None, batch_size: int, dp_size: int) -> list[Problem]:
    """The problems of asking data read in order (``what``: a stream, a mixture of them)
    for ``step`` where ``next_step`` is next (``None``: any), with a global batch that
    must split evenly over ``dp_size`` ranks."""
    problems = check_int("batch_size", batch_size, 1, "the global batch size, in rows")
    if not problems and batch_size % dp_size:
        problems.append(Problem("batch_size", f"{batch_size} rows do not split evenly over {dp_size} "
                                "data-parallel ranks", f"a multiple of {dp_size}"))
    if next_step is not None and step != next_step:
        problems.append(Problem("step", f"{what} is read in order: step {step} asked where step {next_step} is next",
                                f"ask for step {next_step} (resume from a checkpoint to go back)"))
    return problems
