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

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import Problem

__all__ = [
    "EVAL_FRACTION",
    "FAULTS",
    "FLAGS",
    "STDLIB",
    "STDLIB_BYTES",
    "Fault",
    "Split",
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


def axes(*, dp: int, tp: int, pp: int, dp_shard: int | None = None,
         data_parallel: bool = False, cp: int = 1) -> list[tuple[str, int]]:
    """The mesh axes of ``dp/cp/tp/pp`` larger than one, in mesh order (``dp``, ``pp``, ``cp``, ``tp``:
    tensor parallelism innermost, context parallelism next, as torchtitan orders them);
    ``dp`` of one too where ``data_parallel`` asks for data parallelism over it (FSDP2 over
    one rank: ``--dp 1 --dp-mode fsdp``). With ``dp_shard`` (HSDP), the ``dp`` ranks are
    ``dp // dp_shard`` replicas (``dp_replicate``) of ``dp_shard`` ranks that shard the
    parameters (``dp``).

    >>> axes(dp=4, tp=2, pp=1, dp_shard=2)
    [('dp_replicate', 2), ('dp', 2), ('tp', 2)]
    """
    data = [("dp_replicate", dp // dp_shard), ("dp", dp_shard)] if dp_shard else [("dp", dp)]
    return [(n, s) for n, s in (*data, ("pp", pp), ("cp", cp), ("tp", tp)) if s > 1 or (n == "dp" and data_parallel)]


def world(*, dp: int, tp: int, pp: int, cp: int = 1) -> int:
    """Ranks of a job of ``dp x cp x tp x pp``."""
    return dp * cp * tp * pp


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


#: How :class:`Split` names the sizes in its problems: the command line's flags.
FLAGS: Mapping[str, str] = {"batch": "--batch", "dp": "--dp", "grad_accum": "--grad-accum", "pp": "--pp",
                            "microbatches": "--microbatches", "seq": "--seq", "tp": "--tp", "sp": "--sp"}


@dataclass(frozen=True)
class Split:
    """How a step's global batch of ``batch`` sequences is divided — over ``dp``
    data-parallel ranks, ``grad_accum`` micro-steps and (with ``pp`` > 1) ``microbatches``
    pipeline microbatches (default ``2 * pp``), and with sequence parallelism (``sp``)
    each sequence of ``seq`` tokens over ``tp`` ranks — and whether it divides evenly:
    the one check ``explain``, ``train`` and ``tune`` share, so that none of them shows
    or tries a split another refuses.

    >>> Split(batch=8, dp=4, pp=4).problems()[0].reason
    '2 sequences per data-parallel rank and micro-step (--batch 8 / --dp 4) do not split into 8 microbatches \
(the default: 2 x --pp)'
    >>> Split(batch=32, dp=4, pp=4).per_microbatch
    1
    """

    batch: int
    dp: int = 1
    grad_accum: int = 1
    pp: int = 1
    microbatches: int | None = None
    seq: int | None = None
    tp: int = 1
    sp: bool = False

    @property
    def micro(self) -> int:
        """Pipeline microbatches of a micro-step (1 without a pipeline)."""
        return (self.microbatches or 2 * self.pp) if self.pp > 1 else 1

    @property
    def per_rank(self) -> int:
        """Sequences per data-parallel rank and micro-step."""
        return self.batch // (self.dp * self.grad_accum)

    @property
    def per_microbatch(self) -> int:
        """Sequences per pipeline microbatch (per data-parallel rank and micro-step)."""
        return self.per_rank // self.micro

    @staticmethod
    def default_batch(*, dp: int, pp: int, microbatches: int | None = None, at_least: int = 8) -> int:
        """The smallest global batch of at least ``at_least`` sequences that splits evenly
        over ``dp`` ranks and the pipeline's microbatches.

        >>> Split.default_batch(dp=4, pp=4), Split.default_batch(dp=2, pp=1)
        (32, 8)
        """
        unit = dp * Split(batch=1, pp=pp, microbatches=microbatches).micro
        return unit * math.ceil(at_least / unit)

    def problems(self, names: Mapping[str, str] = FLAGS) -> list[Problem]:
        """Every way this split is uneven, each naming the size at fault (by ``names``)."""
        n = names
        problems = []
        accum = self.grad_accum
        if self.batch % (self.dp * accum):
            even = math.ceil(self.batch / (self.dp * accum)) * self.dp * accum
            over = f"{n['dp']} {self.dp} data-parallel ranks" + (f" x {n['grad_accum']} {accum} micro-steps"
                                                                   if accum > 1 else "")
            problems.append(Problem(n["batch"], f"a global batch of {self.batch} sequences does not split evenly "
                                                f"over {over}",
                                    f"{n['batch']} {even} (a multiple of {n['dp']}"
                                    + (f" x {n['grad_accum']}" if accum > 1 else "") + ")"))
        elif self.pp > 1 and self.per_rank % self.micro:
            local, micro = self.per_rank, self.micro
            divisors = [str(d) for d in range(self.pp, local + 1) if local % d == 0]  # at least one per stage
            default = "" if self.microbatches else f" (the default: 2 x {n['pp']})"
            per = f"{n['batch']} {self.batch} / {n['dp']} {self.dp}" + (f" / {n['grad_accum']} {accum}"
                                                                       if accum > 1 else "")
            problems.append(Problem(n["microbatches"] if self.microbatches else n["batch"],
                                    f"{local} sequences per data-parallel rank and micro-step ({per}) do not split "
                                    f"into {micro} microbatches{default}",
                                    f"{n['batch']} {micro * self.dp * accum * math.ceil(local / micro)}"
                                    + (f", or {n['microbatches']} among {', '.join(divisors)}" if divisors else "")))
        if self.sp and self.tp > 1 and self.seq is not None and self.seq % self.tp:
            down = self.seq - self.seq % self.tp
            up = down + self.tp
            problems.append(Problem(n["seq"], f"{self.seq} tokens per sequence do not split evenly over the "
                                              f"{n['tp']} {self.tp} ranks that {n['sp']} splits each sequence over",
                                    f"{n['seq']} {up}" + (f" or {down}" if down else "")
                                    + f" (a multiple of {n['tp']}), or drop {n['sp']}"))
        return problems
