"""DTensor regions per subtree (slapo_fn.dtensor.regions): what the plan cannot prove runs
on DTensors in the smallest subtree entered and left whole; the rest on local shards."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Shard

import slapo_fn as sf
from slapo_fn.dtensor.plan import plan
from slapo_fn.dtensor.regions import region_roots, regions_of
from slapo_fn.dtensor.testing import fake_mesh
from tests.models import megatron_llama, tiny_llama, token_ids


def test_each_problem_gets_the_nearest_fitting_ancestor_and_nested_roots_merge() -> None:
    fits = {"a", "a.b", "c"}.__contains__
    assert region_roots(["a.b.c", "a.x"], fits) == ("a",)
    assert region_roots(["c.d"], fits) == ("c",)
    assert region_roots(["a.b.c.d", "c.d"], fits) == ("a.b", "c")
    assert region_roots(["d.e"], fits) == ("",)
    assert region_roots([""], fits) == ("",)


def _split_q(sch: sf.Schedule) -> sf.Schedule:
    return sf.sync(sch, "model.layers.0.self_attn.q_proj", "fwd_post", Shard(-1))


def test_a_split_inside_one_attention_puts_only_that_attention_on_dtensors() -> None:
    sch = _split_q(sf.create_schedule(tiny_llama(), mesh=fake_mesh(2)))
    p = plan(sch)
    assert p.on_dtensors
    assert regions_of(sch, p) == ("model.layers.0.self_attn",)


def test_a_proven_plan_has_no_region() -> None:
    sch = megatron_llama(sf.create_schedule(tiny_llama(), mesh=fake_mesh(2)))
    assert regions_of(sch, plan(sch)) == ()


def test_a_split_stated_outside_the_region_widens_it_to_hold_both() -> None:
    sch = _split_q(sf.create_schedule(tiny_llama(), mesh=fake_mesh(2)))
    # a split stated on the second layer's MLP would reach the attention's boundary: the region
    # grows to the smallest subtree holding both
    both = sf.sync(sch, "model.layers.1.mlp", "fwd_post", Shard(1))
    assert regions_of(both, plan(both)) == ("model",)


def _run(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    from tests.dist import mesh

    model, ids = tiny_llama(), token_ids()
    sch = _split_q(sf.create_schedule(model, mesh=mesh((world,), ("tp",))))
    built = sf.build(sch)
    ref = model(ids).logits
    with CommDebugMode() as comm:
        out = built(ids).logits
    # only the attention is entered as a region; the root and the other layer run on local shards
    entered = {path for path, m in built.named_modules() if "region.<locals>" in getattr(m.forward, "__qualname__", "")}
    return {"close": torch.allclose(out, ref, atol=1e-5), "forward": comm.get_total_counts(), "entered": entered}


def test_the_region_runs_equal_with_one_gather(dist2: Any) -> None:
    for r in dist2.run(_run):
        assert r["close"], r
        assert r["forward"] == 1, r  # q gathered once for the attention (heads whole), nothing else
        assert r["entered"] == {"model.layers.0.self_attn"}, r
