"""Reports of a search: the JSON file of every trial, console rows and table, the plot.

Example:
    >>> from slapo_fn.tune.space import Config
    >>> from slapo_fn.tune.trial import Trial
    >>> row(Trial(Config.of({"tp": 2}), "ok", tokens_per_s=1234.5, train_mem_bytes=2**20), 1, 4)
    '[1/4] ok       tp=2  1,234 tok/s  mem 1.0 MiB'
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .space import _show
from .trial import Trial
from .tuner import TuneResult, _mib, summary

__all__ = ["plot", "row", "table", "to_json", "write_json"]


def row(trial: Trial, done: int, total: int, knobs: Sequence[str] | None = None) -> str:
    """One line of progress for a decided trial (``knobs``: the ones to show; all by default)."""
    shown = " ".join(f"{k}={_show(trial.config.get(k))}" for k in knobs) if knobs is not None else str(trial.config)
    figures = f"{trial.tokens_per_s:,.0f} tok/s" if trial.tokens_per_s is not None else trial.reason
    memory = f"  mem {_mib(trial.train_mem_bytes)}" if trial.train_mem_bytes is not None else ""
    return f"[{done}/{total}] {trial.status:<8} {shown}  {figures}{memory}"


def to_json(result: TuneResult) -> dict[str, Any]:
    """Every trial with its config, figures, status and reason; the space; the best and
    the command that reproduces it."""
    best = result.best
    return {
        "summary": summary(result),
        "space": {"knobs": {k.name: list(k.values()) for k in result.space.knobs},
                  "constraints": [c.name for c in result.space.constraints],
                  "fixed": dict(result.space.fixed)},
        "memory_budget": result.memory_budget,
        "trials": [t.as_json() for t in result.trials],
        "best": None if best is None else best.as_json(),
        "best_command": result.best_command,
    }


def write_json(result: TuneResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(result), indent=1, default=str) + "\n")
    return path


def table(result: TuneResult) -> Any:
    """A ``rich`` table of every trial, the measured ones by throughput, best first."""
    from rich.table import Table

    knobs = [k.name for k in result.space.knobs if len(k.values()) > 1]
    out = Table(title=f"slapo-fn tune: {len(result.trials)} trials ({result.strategy}; {result.stopped})")
    for name in [*knobs, "status", "tokens/s", "train mem", "estimate", "reason"]:
        # every column keeps its whole name, piped or not (a console of 80 columns would
        # cut "checkpoint" to "checkp…"); only the reason wraps
        out.add_column(name, justify="right" if name in ("tokens/s", "train mem", "estimate") else "left",
                       min_width=len(name), no_wrap=name != "reason")
    order = sorted(result.trials, key=lambda t: (t.tokens_per_s is None, -(t.tokens_per_s or 0.0)))
    best = result.best
    for t in order:
        style = "bold green" if t is best else ("red" if t.status in ("crash", "oom", "timeout") else None)
        out.add_row(*(_show(t.config.get(k)) for k in knobs), t.status,
                    "-" if t.tokens_per_s is None else f"{t.tokens_per_s:,.0f}", _mib(t.train_mem_bytes),
                    _mib(t.estimate_bytes), t.reason[:60], style=style)
    return out


def print_table(console: Any, result: TuneResult) -> None:
    """Print :func:`table` on ``console`` (a ``rich`` console) whole: wider than the
    console where it needs to be, as when piped (rich then assumes 80 columns)."""
    from rich.measure import Measurement

    rendered = table(result)
    need = Measurement.get(console, console.options, rendered).minimum
    console.print(rendered, width=max(console.width, need), crop=False)


def _position(values: list[Any], value: Any) -> int:
    return [repr(v) for v in values].index(repr(value))


def plot(result: TuneResult, path: Path) -> Path:
    """Throughput against each knob that varies (one panel per knob; failed trials as red
    crosses at zero, pruned ones as grey dots), saved to ``path`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    knobs = [k for k in result.space.knobs if len(k.values()) > 1] or list(result.space.knobs[:1])
    fig, axes = plt.subplots(1, len(knobs), figsize=(3.2 * len(knobs), 3.0), squeeze=False, sharey=True)
    for ax, knob in zip(axes[0], knobs):
        values = list(knob.values())
        for t in result.trials:
            x = _position(values, t.config.get(knob.name))
            if t.ok:
                ax.scatter(x, t.tokens_per_s, color="tab:blue")
            elif t.status == "pruned":
                ax.scatter(x, 0, color="grey", marker=".")
            else:
                ax.scatter(x, 0, color="tab:red", marker="x")
        ax.set_xticks(range(len(values)), [_show(v) for v in values])
        ax.set_xlabel(knob.name)
    axes[0][0].set_ylabel("tokens/s")
    best = result.best
    fig.suptitle(f"{result.space.fixed.get('model', '')}: best {best.config if best else '-'}", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
