"""Inductor's async-TP matcher on a sequence-parallel LLaMA (benchmarks/async_tp_pairs.py,
one layer): it finds at least as many all-gather→matmul and matmul→reduce-scatter pairs in
slapo_fn's compiled graphs as in ``parallelize_module``'s, the LM head's entry from the
final norm's sequence shards included (issue 41)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_tp_pairs", ROOT / "benchmarks" / "async_tp_pairs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pairs(rank: int, world: int) -> dict[str, Any]:
    return _benchmark()._run(rank, world, 1, 64, True)  # type: ignore[no-any-return]


def test_slapo_fn_gives_the_async_tp_matcher_as_many_pairs_as_parallelize_module(dist2) -> None:
    for r in dist2.run(_pairs, timeout=220):
        ours, torch_tp = r["slapo_fn"], r["parallelize_module"]
        # one layer: q/k/v and gate/up gathered into (4 of them with the backward's), the LM head's
        # entry from the final norm's shards; o_proj and down_proj scattered, the head's backward
        assert torch_tp["all_gather_matmul"] > 0 and torch_tp["matmul_reduce_scatter"] > 0, r
        assert ours["all_gather_matmul"] >= torch_tp["all_gather_matmul"], r
        assert ours["matmul_reduce_scatter"] >= torch_tp["matmul_reduce_scatter"], r
