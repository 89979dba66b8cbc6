"""The step-time estimate: hardware profiles as data, FLOPs from shapes, ring formulas,
overlap and bubble as stated, the CLI's --hardware, and the tuner ranking by it. (How
well it ranks real runs on this CPU is measured in benchmarks/explain_ranking.py, not
in a timed test.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import tiny_llama

import slapo_fn as sf
from slapo_fn.cli import main
from slapo_fn.explain import model_flops
from slapo_fn.hardware import PROFILES, estimate_step, load_profile, ring_seconds


def test_every_shipped_profile_loads_and_a_toml_file_defines_one(tmp_path: Path) -> None:
    for name in PROFILES:
        p = load_profile(name)
        assert p.peak("bf16") > 0 and 0 < p.efficiency <= 1 and p.intra_node_gb_s >= p.inter_node_gb_s
    assert load_profile("h200").memory_gib == 141 and load_profile("a100").peak("bf16") < load_profile("h100").peak(
        "bf16")
    mine = tmp_path / "mine.toml"
    mine.write_text('name = "mine"\nefficiency = 0.5\nintra_node_gb_s = 100\ninter_node_gb_s = 10\n'
                    "devices_per_node = 4\n[peak_tflops]\nbf16 = 100\n")
    p = load_profile(mine)
    assert (p.name, p.peak("bf16"), p.devices_per_node) == ("mine", 100e12, 4)
    with pytest.raises(ValueError, match=r"no hardware profile 'b200': name one of a100, cpu, h100, h200"):
        load_profile("b200")


def test_flops_are_6n_plus_attention_from_the_config() -> None:
    model = tiny_llama(3)
    cfg = model.config
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    tokens, seq = 4 * 16, 16
    head = cfg.hidden_size // cfg.num_attention_heads
    attention = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head * seq
    assert model_flops(sf.create_schedule(model), tokens, seq) == (float((6 * n + attention) * tokens), 0.0)
    # checkpointing two of three layers adds their forward again
    sch = sf.checkpoint(sf.create_schedule(model), "model.layers.[0-1]")
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    _, recompute = model_flops(sch, tokens, seq)
    assert recompute == pytest.approx((2 * 2 * layer + attention / 3 * 2 / 3) * tokens)


def test_ring_formulas_overlap_and_bubble_as_stated() -> None:
    h100 = load_profile("h100")
    assert ring_seconds("all_reduce", 8e9, 8, 1.0) == pytest.approx(2 * 7 / 8 * 8)
    assert ring_seconds("all_gather", 8e9, 8, 1.0) == pytest.approx(7 / 8 * 8)
    assert ring_seconds("reduce_scatter", 8e9, 1, 1.0) == 0.0
    axes = {"dp": 4, "tp": 8}  # tp inside a node of 8, dp across nodes
    flops = 1e15
    base = estimate_step(h100, flops=flops, recompute_flops=0, dtype="bf16", comm=[], axis_sizes=axes)
    assert base.compute_s == pytest.approx(flops / (989e12 * h100.efficiency))
    assert base.mfu == pytest.approx(h100.efficiency)
    tp = estimate_step(h100, flops=flops, recompute_flops=0, dtype="bf16", axis_sizes=axes,
                       comm=[("tp", 8, "all_reduce", 10**9, 1)])
    intra = 2 * 7 / 8 * 1e9 / (h100.intra_node_gb_s * 1e9) + h100.latency_us * 1e-6
    assert tp.exposed_comm_s == pytest.approx(intra) and tp.step_s == pytest.approx(base.step_s + intra)
    # FSDP collectives hide behind compute until they exceed it; they cross nodes
    small = estimate_step(h100, flops=flops, recompute_flops=0, dtype="bf16", axis_sizes=axes, comm=[],
                          overlapped=[("dp", 4, "all_gather", 10**9, 1)])
    assert small.exposed_comm_s == 0.0 and small.step_s == pytest.approx(base.step_s)
    assert small.comm_by_axis_s["dp"] == pytest.approx(3 / 4 * 1e9 / (h100.inter_node_gb_s * 1e9) + 1e-5)
    big = estimate_step(h100, flops=flops, recompute_flops=0, dtype="bf16", axis_sizes=axes, comm=[],
                        overlapped=[("dp", 4, "all_gather", 10**12, 1)])
    assert big.step_s == pytest.approx(big.comm_by_axis_s["dp"])
    piped = estimate_step(h100, flops=flops, recompute_flops=0, dtype="bf16", comm=[], axis_sizes=axes,
                          stages=4, microbatches=8)
    assert piped.bubble_s == pytest.approx(base.step_s * 3 / 8)


def test_explain_estimates_time_and_checkpointing_costs_recompute() -> None:
    model = tiny_llama(4)
    x = torch.zeros(4, 32, dtype=torch.long)
    plain = sf.explain(sf.create_schedule(model), x, hardware="h100").time
    ckpt = sf.explain(sf.checkpoint(sf.create_schedule(model), "model.layers.*"), x, hardware="h100").time
    assert plain is not None and ckpt is not None
    assert ckpt.recompute_s > 0 == plain.recompute_s and ckpt.step_s > plain.step_s and ckpt.mfu < plain.mfu
    assert plain.tokens_per_s_per_rank == pytest.approx(4 * 32 / plain.step_s)
    assert "MFU" in str(plain) and "assumes: FSDP2 prefetch" in str(plain)
    assert sf.explain(sf.create_schedule(model), x).time is None  # no profile, no estimate


def test_cli_explain_hardware_flag_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["explain", "--model", "llama-tiny", "--tp", "2", "--dp", "2", "--batch", "4", "--seq", "32"]
    assert main([*argv, "--hardware", "cpu", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["time"]["profile"].startswith("CPU") and d["time"]["mfu"] > 0
    assert set(d["by_axis"]) == {"tp", "dp"} and d["by_axis"]["dp"]["reduce_scatter"]["count"] > 0
    assert all(r["activation_bytes"] > 0 for r in d["memory"]["rows"])
    toml = tmp_path / "slow.toml"
    toml.write_text(load_profile("cpu").name.join(['name = "', '"\n']) + "efficiency = 0.01\nintra_node_gb_s = 1\n"
                    "inter_node_gb_s = 1\n[peak_tflops]\nfp32 = 0.001\n")
    assert main([*argv, "--hardware", str(toml)]) == 0
    text = capsys.readouterr().out
    assert "step time on CPU" in text and "tokens/s per rank" in text
    assert "assumed: global batch 4 × seq 32 (2 sequences per data-parallel rank); compute dtype fp32 (the default; " \
           f"--dtype bf16 for mixed precision); hardware {toml}" in text
    assert "collectives of one step on one rank, by mesh axis" in text and "  dp: all_gather ×" in text
    assert main([*argv, "--hardware", "b200"]) != 0
    assert "slapo-fn explain: no hardware profile 'b200'" in capsys.readouterr().err


def test_cli_explain_dtype_is_the_estimates_and_said(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    times = {}
    for dtype in ("fp32", "bf16"):
        assert main(["explain", "--model", "llama-1b", "--batch", "4", "--seq", "512", "--dtype", dtype, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["dtype"] == dtype
        times[dtype] = d["time"]["step_s"]
    assert times["bf16"] < times["fp32"] / 3  # an H100's bf16 peak is 15x its fp32 one
    marked = tmp_path / "config.json"
    marked.write_text(json.dumps({**sf.presets.PRESETS["llama-1b"], "dtype": "bfloat16"}))
    assert main(["explain", "--model", str(marked), "--batch", "4", "--seq", "512"]) == 0
    out = capsys.readouterr().out
    assert "; compute dtype bf16 (the config's dtype); hardware h100" in out
    assert f"{times['bf16'] * 1e3:.1f} ms per step" in out


def test_the_tuner_runs_the_fastest_estimated_first() -> None:
    from slapo_fn.tune import Config, Trial, space_for, tune

    space = space_for("llama-tiny", 1, checkpoint=[None, 1.0], batch=[2, 8])

    def fake(config: Config, folder: Path) -> Trial:
        return Trial(config, "ok", tokens_per_s=1.0)

    result = tune(space, run=fake)
    estimated = [t.estimate_tokens_per_s for t in result.trials]
    assert None not in estimated and estimated == sorted(estimated, reverse=True)  # type: ignore[type-var]
    # more sequences per step amortise the per-call overhead; recomputation costs
    by = {(t.config.num("batch"), t.config.get("checkpoint")): t.estimate_tokens_per_s for t in result.trials}
    assert by[(8, None)] > by[(2, None)] and by[(8, None)] > by[(8, 1.0)]
