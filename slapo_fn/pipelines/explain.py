"""The stage table of a schedule with pipeline cuts: layers, parameters and bytes per stage.

Needs no process group. Parameters are counted per stage as that stage's build will
hold them: a parameter kept by two stages (a tied embedding / LM head) counts in both.
With a ``pp`` mesh axis the table also says which ``pp`` rank runs each stage (round
robin; V-shaped schedules place them otherwise, see :func:`.stage_ranks`).

Example:
    >>> import slapo_fn as sf
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=4, n_head=2, vocab_size=32, n_positions=8))
    >>> print(stage_table(sf.cut_pipeline_stage(sf.create_schedule(model), "transformer.h.1")))
    pipeline stages (2):
      stage  layers               parameters  bytes     holds
      0      transformer.h.[0-1]  7,200       28.1 KiB  pre
      1      transformer.h.[2-3]  7,104       27.8 KiB  post
    shared by several stages: transformer.wte.weight (stage 0) = lm_head.weight (stage 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..dtensor.explain import ActivationShapes, Collective
from ..render import format_bytes
from ..schedule import Schedule
from .cut import PIPELINE_CUT, pp_size
from .runner import stage_ranks
from .split import split_stages

__all__ = ["StageRow", "StageTable", "pipeline_collectives", "stage_table"]


@dataclass(frozen=True)
class StageRow:
    """One stage: its index, layer paths, parameter count and bytes, whether it holds the
    modules before (``pre``) / after (``post``) the sequence, and its ``pp`` rank."""

    index: int
    layers: tuple[str, ...]
    parameters: int
    bytes: int
    pre: bool
    post: bool
    rank: int | None


@dataclass(frozen=True)
class StageTable:
    """The stages of a schedule; ``str()`` renders the table (empty without cuts)."""

    rows: tuple[StageRow, ...]
    shared: tuple[tuple[tuple[int, str], ...], ...]

    def __str__(self) -> str:
        if len(self.rows) < 2:
            return ""
        def fold(layers: tuple[str, ...]) -> str:
            # per sequence in turn (an encoder's layers, then a decoder's); a layer called
            # several times (ALBERT's shared one) once, with its number of calls
            groups: list[tuple[str, list[str]]] = []
            for path in layers:
                base, _, key = path.rpartition(".")
                if groups and groups[-1][0] == base:
                    groups[-1][1].append(key)
                else:
                    groups.append((base, [key]))
            return ", ".join(
                (f"{base}.{keys[0]}" + (f" ×{len(keys)}" if len(keys) > 1 else "")) if len(set(keys)) == 1
                else f"{base}.[{keys[0]}-{keys[-1]}]"
                for base, keys in groups
            )

        with_rank = any(r.rank is not None for r in self.rows)
        header = ["stage", "layers", "parameters", "bytes", "holds"] + (["pp rank"] if with_rank else [])
        table = [
            [
                str(r.index),
                fold(r.layers),
                f"{r.parameters:,}",
                format_bytes(r.bytes),
                "+".join(n for n, f in (("pre", r.pre), ("post", r.post)) if f) or "-",
            ]
            + ([str(r.rank)] if with_rank else [])
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
        lines = [f"pipeline stages ({len(self.rows)}):"]
        for row in [header, *table]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        for group in self.shared:
            lines.append(
                "shared by several stages: " + " = ".join(f"{fqn} (stage {s})" for s, fqn in group)
            )
        return "\n".join(lines)


def stage_table(sch: object) -> StageTable:
    """The :class:`StageTable` of ``sch`` (one row per stage; no rows without cuts)."""
    if not isinstance(sch, Schedule) or not sch.annotations.of_kind(PIPELINE_CUT):
        return StageTable((), ())
    stages = split_stages(sch)
    size = pp_size(sch)
    ranks = stage_ranks(len(stages), size) if size else (None,) * len(stages)
    rows = []
    holders: dict[int, list[tuple[int, str]]] = {}
    for stage in stages:
        count = nbytes = 0
        for name, p in stage.schedule.module.named_parameters():
            count += p.numel()
            nbytes += p.numel() * p.element_size()
            holders.setdefault(id(p), []).append((stage.index, name))
        rows.append(StageRow(stage.index, stage.layer_paths, count, nbytes, stage.pre, stage.post, ranks[stage.index]))
    return StageTable(tuple(rows), tuple(tuple(m) for m in holders.values() if len(m) > 1))


def pipeline_collectives(sch: Schedule, shapes: ActivationShapes | None, microbatches: int,
                          pp_rank: int = 0) -> tuple[Collective, ...]:
    """The point-to-point transfers of one step of ``pp`` rank ``pp_rank`` (the boundaries
    of its stages with their neighbours): for each
    microbatch, the activation sent forward over the ``pp`` axis and its gradient sent
    back (each a ``send`` on one rank and a ``recv`` on the next; listed once, as
    ``send_recv``). ``bytes`` is one microbatch's tensor at the boundary (the output of
    the stage's last layer), ``None`` without example inputs."""
    if not isinstance(sch, Schedule) or not sch.annotations.of_kind(PIPELINE_CUT):
        return ()
    stages = split_stages(sch)
    micro = max(1, microbatches)
    ranks = stage_ranks(len(stages), pp_size(sch) or len(stages))
    out: list[Collective] = []
    for st in stages[:-1]:
        if pp_rank not in (ranks[st.index], ranks[st.index + 1]):
            continue
        last = st.layer_paths[-1]
        entry = shapes.outputs.get(last) if shapes is not None else None
        nbytes = None if entry is None else math.prod(entry[0]) * _itemsize(entry[1]) // micro
        for direction in ("forward", "backward"):
            side = "output" if direction == "forward" else "output grad"
            for _ in range(micro):
                out.append(Collective(last, side, direction, "send_recv", f"stage {st.index}",  # type: ignore[arg-type]
                                      f"stage {st.index + 1}", "pp", "pipeline", nbytes))
    return tuple(out)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()
