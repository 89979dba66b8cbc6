"""Hardware profiles (data: the TOML files beside this module) and the step-time estimate
that ``explain`` prints and the tuner ranks configurations by.

A profile names peak dense FLOP/s per dtype, the share of it training reaches
(``efficiency``), and link bandwidths: mesh axes that fit inside a node
(``devices_per_node``, counting from the innermost axis) use ``intra_node_gb_s``, the
others ``inter_node_gb_s``.

Example:
    >>> h100 = load_profile("h100")
    >>> h100.name, h100.peak_tflops["bf16"]
    ('H100 SXM (NVLink + InfiniBand)', 989.0)
    >>> t = estimate_step(h100, flops=6 * 8e9 * 4096, recompute_flops=0, dtype="bf16",
    ...                   comm=[("tp", 8, "all_reduce", 1 << 30, 64)], axis_sizes={"tp": 8})
    >>> round(t.compute_s, 3), round(t.exposed_comm_s, 4)
    (0.442, 0.0048)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import tomllib

__all__ = ["PROFILES", "HardwareProfile", "StepTime", "estimate_step", "load_profile", "ring_seconds"]

#: The profiles shipped with slapo_fn (``--hardware NAME``).
PROFILES = ("a100", "cpu", "h100", "h200")


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator and its links, read from TOML."""

    name: str
    peak_tflops: Mapping[str, float]
    efficiency: float
    intra_node_gb_s: float
    inter_node_gb_s: float
    devices_per_node: int
    latency_us: float = 10.0
    memory_gib: float | None = None
    #: Framework time per module call (Python, dispatch, kernel launch) not hidden
    #: behind compute; a backward call counts twice. Matters on CPU and for tiny models.
    overhead_us_per_call: float = 0.0

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` ("fp32", "bf16", …; fp32 when unknown)."""
        return 1e12 * float(self.peak_tflops.get(dtype, self.peak_tflops.get("fp32", 1.0)))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (:data:`PROFILES`) or a TOML file by path; a missing
    one is a ``ValueError`` naming the shipped ones.

    >>> load_profile("cpu").devices_per_node
    64
    """
    text: str
    if str(name_or_path) in PROFILES:
        text = resources.files(__package__).joinpath(f"{name_or_path}.toml").read_text()
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"no hardware profile {str(name_or_path)!r}: name one of {', '.join(PROFILES)} "
                             "or give a TOML file (see slapo_fn/hardware/h100.toml)")
        text = path.read_text()
    data = tomllib.loads(text)
    return HardwareProfile(
        name=str(data.get("name", name_or_path)),
        peak_tflops={str(k): float(v) for k, v in data["peak_tflops"].items()},
        efficiency=float(data.get("efficiency", 0.5)),
        intra_node_gb_s=float(data["intra_node_gb_s"]),
        inter_node_gb_s=float(data["inter_node_gb_s"]),
        devices_per_node=int(data.get("devices_per_node", 8)),
        latency_us=float(data.get("latency_us", 10.0)),
        memory_gib=float(data["memory_gib"]) if "memory_gib" in data else None,
        overhead_us_per_call=float(data.get("overhead_us_per_call", 0.0)),
    )


def ring_seconds(op: str, nbytes: float, ranks: int, gb_s: float) -> float:
    """Seconds of one collective by the ring formula: an all-reduce moves
    ``2(n-1)/n`` of the tensor per rank, an all-gather or reduce-scatter ``(n-1)/n``,
    a point-to-point transfer all of it.

    >>> ring_seconds("all_reduce", 1e9, 2, 1.0)
    1.0
    """
    if op == "send_recv":
        share = 1.0
    elif ranks <= 1:
        return 0.0
    elif op == "all_reduce":
        share = 2 * (ranks - 1) / ranks
    else:
        share = (ranks - 1) / ranks
    return share * nbytes / (gb_s * 1e9)


@dataclass(frozen=True)
class StepTime:
    """The estimate of one training step on one rank, and what it assumes."""

    profile: str
    step_s: float
    compute_s: float
    recompute_s: float
    exposed_comm_s: float
    overlapped_comm_s: float
    bubble_s: float
    mfu: float
    tokens_per_s_per_rank: float
    comm_by_axis_s: Mapping[str, float] = field(default_factory=dict)
    assumptions: tuple[str, ...] = ()

    def __str__(self) -> str:
        axes = ", ".join(f"{a} {s * 1e3:.1f} ms" for a, s in self.comm_by_axis_s.items()) or "none"
        lines = [
            f"step time on {self.profile}: {self.step_s * 1e3:.1f} ms per step; MFU {self.mfu:.1%}; "
            f"{self.tokens_per_s_per_rank:,.0f} tokens/s per rank",
            f"  compute {self.compute_s * 1e3:.1f} ms (recompute {self.recompute_s * 1e3:.1f} ms), exposed "
            f"communication {self.exposed_comm_s * 1e3:.1f} ms, overlapped {self.overlapped_comm_s * 1e3:.1f} ms, "
            f"pipeline bubble {self.bubble_s * 1e3:.1f} ms",
            f"  communication by mesh axis: {axes}",
        ]
        lines += [f"  assumes: {a}" for a in self.assumptions]
        return "\n".join(lines)


def _link(axis: str, axis_sizes: Mapping[str, int], profile: HardwareProfile) -> float:
    """Bandwidth of ``axis``: intra-node when it and the axes inside it fit in a node."""
    names = list(axis_sizes)
    inner = math.prod(axis_sizes[n] for n in names[names.index(axis):]) if axis in names else 1
    return profile.intra_node_gb_s if inner <= profile.devices_per_node else profile.inter_node_gb_s


#: Collectives of these origins overlap with compute (FSDP2 prefetch, DDP buckets).
OVERLAPPED = ("data_parallel",)


def estimate_step(
    profile: HardwareProfile,
    *,
    flops: float,
    recompute_flops: float,
    dtype: str,
    comm: Sequence[tuple[str, int, str, int, int]],
    axis_sizes: Mapping[str, int],
    overlapped: Sequence[tuple[str, int, str, int, int]] = (),
    stages: int = 1,
    microbatches: int = 1,
    stages_per_rank: int = 1,
    tokens: float = 0.0,
    calls: int = 0,
) -> StepTime:
    """The step time of one rank.

    ``flops`` is the model FLOPs of one step on this rank (6N + 12·L·H·Q·T per token,
    divided over the ranks), ``recompute_flops`` what checkpointing adds; compute takes
    ``(flops + recompute_flops) / (peak × efficiency)``. ``comm`` lists ``(axis, axis
    size, op, bytes, count)`` of collectives on the critical path (TP, SP, pipeline
    transfers), ``overlapped`` those hidden behind compute when shorter (FSDP2
    prefetch, DDP buckets): each costs its ring time plus ``latency_us`` per call. A
    pipeline of ``stages`` with ``microbatches`` adds the bubble ``(stages - 1) /
    (microbatches × stages_per_rank)`` of the busy time. ``tokens`` is the step's tokens
    on this rank (the global tokens over all ranks), for tokens/s. ``calls`` module
    calls (forward, backward counted twice, recomputation) cost
    ``overhead_us_per_call`` each, counted as compute.
    """
    rate = profile.peak(dtype) * profile.efficiency
    compute = flops / rate + calls * profile.overhead_us_per_call * 1e-6
    recompute = recompute_flops / rate
    by_axis: dict[str, float] = {}

    def cost(items: Sequence[tuple[str, int, str, int, int]]) -> float:
        total = 0.0
        for axis, size, op, nbytes, count in items:
            t = ring_seconds(op, nbytes, size, _link(axis, axis_sizes, profile)) + count * profile.latency_us * 1e-6
            by_axis[axis] = by_axis.get(axis, 0.0) + t
            total += t
        return total

    exposed = cost(comm)
    hidden = cost(overlapped)
    busy = compute + recompute + exposed
    exposed += max(0.0, hidden - (compute + recompute))
    busy = compute + recompute + exposed
    bubble = busy * (stages - 1) / (max(1, microbatches) * max(1, stages_per_rank)) if stages > 1 else 0.0
    step = busy + bubble
    mfu = flops / (step * profile.peak(dtype)) if step > 0 else 0.0
    assumptions = (
        f"{profile.efficiency:.0%} of peak {dtype} FLOP/s for compute; FLOPs 6N + 12·L·H·Q·T per token "
        "(+ the forward again for checkpointed layers)"
        + (f"; {profile.overhead_us_per_call:g} µs per module call" if profile.overhead_us_per_call else ""),
        "ring all-reduce 2(n-1)/n, all-gather / reduce-scatter (n-1)/n of the bytes per link, "
        f"{profile.latency_us:g} µs per collective; axes inside {profile.devices_per_node} devices use the "
        "intra-node link",
        "FSDP2 prefetch and DDP buckets overlap compute (only what exceeds it shows); TP/SP collectives "
        "and pipeline transfers do not (no async TP)",
        "pipeline bubble (stages - 1) / (microbatches × stages per rank) of the busy time",
    )
    return StepTime(profile.name, step, compute, recompute, exposed, hidden, bubble, mfu,
                    tokens / step if step > 0 else 0.0, by_axis, assumptions)
