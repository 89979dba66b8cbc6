"""What the options of a ``slapo-fn`` run mean, read without torch.

The command line checks its arguments before torch loads, and the ranks it starts read
the same options again; both read them here: the mesh axes of ``--dp/--pp/--tp``, sizes
written ``80GiB``, the ``stdlib[:SIZE]`` data source, the held-out share of ``--data``
and the ``--fault KIND:STEP`` a test injects.

>>> axes(dp=2, tp=4, pp=1)
[('dp', 2), ('tp', 4)]
>>> parse_size("512MiB") == 512 * 2**20
True
>>> parse_faults("exit:3")
(Fault(kind='exit', step=3),)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "EVAL_FRACTION",
    "FAULTS",
    "STDLIB",
    "STDLIB_BYTES",
    "Fault",
    "axes",
    "eval_fraction",
    "is_stdlib",
    "parse_faults",
    "parse_size",
    "stdlib_bytes",
    "world",
]

#: ``--data stdlib``: the Python standard library's sources as a corpus.
STDLIB = "stdlib"
#: Bytes of the standard library's sources that ``--data stdlib`` reads (``stdlib:SIZE``: another amount).
STDLIB_BYTES = 2_000_000
#: The held-out share of ``--data`` without ``--eval-fraction``, with ``--eval-every`` or
#: not: the training rows of a run do not depend on whether it evaluates.
EVAL_FRACTION = 0.05
#: What ``--fault KIND:STEP`` injects at STEP: ``exit`` (the last rank exits with code 3),
#: ``hang`` (the last rank stops answering: the others wait on the next collective),
#: ``nan`` (the learning rate is NaN from STEP on), ``full-disk`` (the free-space probe
#: of checkpoint saves finds no room from STEP on).
FAULTS = ("exit", "hang", "nan", "full-disk")

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12}


def axes(*, dp: int, tp: int, pp: int) -> list[tuple[str, int]]:
    """The mesh axes of ``dp/tp/pp`` larger than one, in mesh order (``dp``, ``pp``, ``tp``)."""
    return [(n, s) for n, s in (("dp", dp), ("pp", pp), ("tp", tp)) if s > 1]


def world(*, dp: int, tp: int, pp: int) -> int:
    """Ranks of a job of ``dp x tp x pp``."""
    return dp * tp * pp


def parse_size(text: str) -> int:
    """Bytes of a size written ``512MiB``, ``80GiB``, ``2MB`` or a number; ``ValueError`` else.

    >>> parse_size("2MB"), parse_size("1.5KiB")
    (2000000, 1536)
    """
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number):].lower()
    try:
        return int(float(number) * _UNITS[unit])
    except (KeyError, ValueError):
        raise ValueError(f"size {text!r}: use e.g. 512MiB, 80GiB or a number of bytes") from None


def is_stdlib(data: str | None) -> bool:
    """Whether ``--data`` names the standard library's sources (``stdlib`` or ``stdlib:SIZE``)."""
    return data is not None and data.partition(":")[0] == STDLIB


def stdlib_bytes(data: str) -> int | None:
    """The byte cap of ``--data stdlib[:SIZE]`` (``None``: all of it); ``ValueError`` for a bad SIZE.

    >>> stdlib_bytes("stdlib"), stdlib_bytes("stdlib:all"), stdlib_bytes("stdlib:1KiB")
    (2000000, None, 1024)
    """
    _, _, size = data.partition(":")
    if not size:
        return STDLIB_BYTES
    return None if size == "all" else parse_size(size)


def eval_fraction(fraction: float | None) -> float:
    """The share of ``--data`` held out: ``--eval-fraction`` if given, else
    :data:`EVAL_FRACTION` (whether or not the run evaluates, so that ``--eval-every``
    never changes the rows it trains on)."""
    return EVAL_FRACTION if fraction is None else float(fraction)


@dataclass(frozen=True)
class Fault:
    """A failure a test injects at optimizer step ``step`` (see :data:`FAULTS`)."""

    kind: str
    step: int


def parse_faults(spec: str | None) -> tuple[Fault, ...]:
    """``--fault KIND:STEP[,KIND:STEP...]`` as :class:`Fault` values (none for ``None``);
    ``ValueError`` for another spec.

    >>> parse_faults("full-disk:3,nan:6")
    (Fault(kind='full-disk', step=3), Fault(kind='nan', step=6))
    """
    if spec is None:
        return ()
    faults = []
    for one in spec.split(","):
        kind, _, step = one.strip().partition(":")
        if kind not in FAULTS or not step.isdigit():
            raise ValueError(f"--fault {spec!r}: use {' or '.join(f'{k}:STEP' for k in FAULTS)}, or several "
                             "separated by commas")
        faults.append(Fault(kind, int(step)))
    return tuple(faults)
