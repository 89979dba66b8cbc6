"""slapo_fn.tune without running trials: spaces, constraints, the cost model, strategies and
the search loop (with a simulated objective in place of real trials)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
from rich.console import Console

from slapo_fn.dtensor.testing import fake_world
from slapo_fn.errors import ScheduleError
from slapo_fn.tune import (
    TPE,
    Categorical,
    Config,
    Grid,
    IntRange,
    NoValidPointError,
    PowersOfTwo,
    Random,
    Space,
    Trial,
    estimate,
    space_for,
    strategy,
    train_args,
    tune,
)
from slapo_fn.tune.cost import ModelShape, activation_bytes
from slapo_fn.tune.report import print_table, table, to_json
from slapo_fn.tune.space import batch_divides, heads_divisible, microbatches_at_least_pp
from slapo_fn.tune.trial import _reason


def test_knob_values_and_bad_knobs() -> None:
    assert PowersOfTwo("batch", 2, 16).values() == (2, 4, 8, 16)
    assert IntRange("microbatches", 1, 7, step=3).values() == (1, 4, 7)
    with pytest.raises(ScheduleError, match="not increasing powers of two"):
        PowersOfTwo("batch", 3, 16)
    with pytest.raises(ScheduleError, match="empty range 4..2"):
        IntRange("microbatches", 4, 2)
    with pytest.raises(ScheduleError, match="repeated choices"):
        Categorical("tp", (1, 1))
    with pytest.raises(ScheduleError, match="no choices"):
        Categorical("tp", ())
    with pytest.raises(ScheduleError, match="knob given twice"):
        Space((Categorical("tp", (1,)), Categorical("tp", (2,))))


def test_constraints_reject_impossible_points_with_reasons() -> None:
    assert heads_divisible(4, 2).why_not(Config.of({"tp": 4})) == "kv_heads=2 is not divisible by tp=4"
    assert microbatches_at_least_pp().why_not(Config.of({"pp": 4, "microbatches": 2})) is not None
    assert microbatches_at_least_pp().why_not(Config.of({"pp": 2, "microbatches": 2})) is None
    assert batch_divides().why_not(Config.of({"batch": 6, "dp": 4})) == ("a global batch of 6 sequences does not split "
                                                                          "evenly over dp 4 data-parallel ranks")
    space = space_for("llama-tiny", 4, tp=[1, 2, 4], pp=[1, 2], microbatches=[1, 2, 4], batch=[4, 8])
    for config in space.valid():
        assert config.num("dp") * config.num("tp") * config.num("pp") == 4
        assert config.num("tp") in (1, 2)  # kv_heads=2: tp=4 never valid
        assert config.num("pp") == 1 or config.num("microbatches") >= config.num("pp")
    assert all(c["tp"] != 4 for c in space.valid())


def test_a_space_with_no_valid_point_is_a_typed_error_naming_the_constraints() -> None:
    space = space_for("llama-tiny", 4, dp=[1], tp=[1, 2], pp=[1], sp=[False], checkpoint=[None])
    with pytest.raises(NoValidPointError, match=r"dp\*tp\*pp == 4.*no valid point: rejects 2 of 2 points") as err:
        space.valid()
    assert err.value.problems[0].path == "dp*tp*pp == 4"
    assert isinstance(err.value, ValueError)
    with pytest.raises(NoValidPointError, match="kv_heads=2 is not divisible by tp=4"):
        space_for("llama-tiny", 4, tp=[4], dp=[1]).valid()
    with pytest.raises(ScheduleError, match="'bogus': not a knob"):
        space_for("llama-tiny", 2, bogus=[1])


def test_impossible_combinations_never_run() -> None:
    space = space_for("llama-tiny", 4, tp=[1, 2, 4], pp=[1, 2], checkpoint=[None, 1.0], batch=[2, 4, 8])
    ran: list[Config] = []

    def fake(config: Config, folder: Path) -> Trial:
        assert space.why_not(config) is None, config
        ran.append(config)
        return Trial(config, "ok", tokens_per_s=float(config.num("batch")))

    for chosen in (Grid(), Random(seed=3), *([TPE(seed=1)] if importlib.util.find_spec("optuna") else [])):
        ran.clear()
        result = tune(space, strategy=chosen, run=fake)
        assert len(ran) == len(set(ran)) == len(space.valid())  # each valid point once, nothing else
        assert result.best is not None and result.best.config.num("batch") == 8


def test_estimate_counts_sharded_state_and_checkpointing_lowers_activations() -> None:
    with fake_world(2):
        one = estimate(Config.of({"dp": 2, "tp": 1, "batch": 4}), "llama-small", world_size=2, seq=64)
        two = estimate(Config.of({"dp": 1, "tp": 2, "batch": 4}), "llama-small", world_size=2, seq=64)
    whole = estimate(Config.of({"batch": 4}), "llama-small", world_size=1, seq=64)
    assert whole.param_bytes * 4 == whole.state_bytes  # params + grads + 2 AdamW states
    assert one.param_bytes < 0.55 * whole.param_bytes  # FSDP over 2
    assert two.param_bytes < 0.6 * whole.param_bytes  # TP over 2 (embeddings stay whole)
    shape = ModelShape(hidden=256, ffn=512, layers=4, heads=8, vocab=256, gated=True)
    none, half, every = (activation_bytes(Config.of({"checkpoint": c, "batch": 8}), shape, 128)
                         for c in (None, 0.5, 1.0))
    assert none > half > every
    sp = activation_bytes(Config.of({"tp": 2, "sp": True, "batch": 8}), shape, 128)
    assert sp < activation_bytes(Config.of({"tp": 2, "batch": 8}), shape, 128) < none


def test_memory_pruning_rejects_what_does_not_fit_and_keeps_what_does() -> None:
    space = space_for("llama-tiny", 1, checkpoint=[None, 1.0], batch=[2, 32], fixed={"seq": 128})
    ests = {c: estimate(c, "llama-tiny", world_size=1, seq=128) for c in space.valid()}
    small = min(ests.values(), key=lambda e: e.total_bytes)
    big = max(ests.values(), key=lambda e: e.total_bytes)
    budget = (small.total_bytes + big.total_bytes) // 2
    ran: list[Config] = []

    def fake(config: Config, folder: Path) -> Trial:
        ran.append(config)
        return Trial(config, "ok", tokens_per_s=1.0)

    result = tune(space, memory_budget=budget, run=fake)
    pruned = {t.config for t in result.trials if t.status == "pruned"}
    assert pruned == {c for c, e in ests.items() if e.total_bytes > budget} and big.config in pruned
    assert set(ran) == {c for c, e in ests.items() if e.total_bytes <= budget} and small.config in ran
    assert all("> budget" in t.reason for t in result.trials if t.status == "pruned")
    with pytest.raises(NoValidPointError, match="none of the 4 valid points fits the budget"):
        tune(space, memory_budget=small.total_bytes - 1, run=fake)


def test_early_stop_trials_and_time_budget() -> None:
    space = Space((PowersOfTwo("batch", 1, 64),))  # 7 points, no model: no estimate
    calls: list[int] = []

    def fake(config: Config, folder: Path) -> Trial:
        calls.append(config.num("batch"))
        return Trial(config, "ok", tokens_per_s=10.0 if config.num("batch") == 2 else 1.0)

    result = tune(space, strategy=Grid(), patience=2, run=fake)
    assert calls == [1, 2, 4, 8] and result.stopped == "no improvement in 2 trials"
    assert result.trials_to_best == 2
    calls.clear()
    assert len(tune(space, max_trials=3, run=fake).trials) == 3
    calls.clear()
    result = tune(space, time_budget=0.0, run=fake)
    assert calls == [] and result.stopped == "time budget 0 s" and result.best is None


def test_failed_trials_are_recorded_and_the_search_goes_on() -> None:
    space = Space((Categorical("tp", (1, 2)), Categorical("batch", (2, 4))))

    def fake(config: Config, folder: Path) -> Trial:
        if config.num("tp") == 2:
            return Trial(config, "crash", "exit 3: boom")
        return Trial(config, "ok", tokens_per_s=float(config.num("batch")))

    result = tune(space, run=fake)
    assert [t.status for t in result.trials] == ["ok", "ok", "crash", "crash"]
    report = to_json(result)
    assert report["summary"]["failed"] == 2 and report["best"]["config"] == {"tp": 1, "batch": 4}
    assert report["trials"][2]["reason"] == "exit 3: boom"
    assert table(result).row_count == 4
    piped = io.StringIO()
    print_table(Console(file=piped, width=60), result)  # not a terminal: 80 columns or fewer
    header = next(line for line in piped.getvalue().splitlines() if "status" in line)
    assert all(name in header for name in ("tp", "batch", "status", "tokens/s", "train mem", "estimate", "reason"))


def test_tpe_needs_optuna_or_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optuna" else real(name, *a))
    assert strategy("auto") == Random(0)  # degrades to random search
    with pytest.raises(ScheduleError, match=r"(?s)needs optuna.*pip install 'slapo_fn\[tune\]'"):
        TPE().start((Config.of({"tp": 1}),), None)
    with pytest.raises(ScheduleError, match="unknown strategy"):
        strategy("annealing")


def test_trial_flags_and_failure_reasons() -> None:
    args = train_args(Config.of({"dp": 2, "pp": 1, "microbatches": 4, "dp_mode": "ddp", "sp": False,
                                 "checkpoint": None, "batch": 4}), {"model": "m", "steps": 2, "warmup": 1})
    assert args == ["--model", "m", "--dp", "2", "--tp", "1", "--pp", "1", "--batch", "4", "--dp-mode", "ddp",
                    "--steps", "3"]
    assert _reason("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried", 1)[0] == "oom"
    assert _reason("", -9)[0] == "oom"
    status, why = _reason("[rank0]: ValueError: bad\n[rank1]: RuntimeError: Connection reset\nChildFailedError: x",
                          1)
    assert status == "crash" and why == "exit 1: ValueError: bad"


def test_cli_tune_reports_an_empty_space(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from slapo_fn.cli import main

    assert main(["tune", "--world-size", "4", "--dp", "1", "--tp", "1,2", "--out", str(tmp_path)]) == 2
    assert "no valid point" in capsys.readouterr().err
    assert main(["tune", "--memory-budget", "lots", "--out", str(tmp_path)]) == 2
    assert "size 'lots'" in capsys.readouterr().err
