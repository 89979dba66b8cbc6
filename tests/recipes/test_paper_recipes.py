"""The recipes of the Slapo paper's other models — ALBERT, GPT-Neo, RoBERTa (through BERT's)
and a torchvision Wide ResNet: at TP=2 on 2 gloo ranks each equals the unsharded model
(forward, every gradient) at Megatron's collective counts, with its attention kernel and
with sequence parallelism; single-process knobs (kernels, checkpointing) keep the numbers."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from models import WideResNet, tiny_albert, tiny_gpt_neo, tiny_roberta, token_ids
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh
from slapo_fn.rewrites.checkpoint import CHECKPOINT

FACTORIES = {"albert": tiny_albert, "gpt_neo": tiny_gpt_neo, "roberta": tiny_roberta}


def _loss(out: Any, _: sf.Schedule) -> torch.Tensor:
    value = getattr(out, "logits", None)
    if value is None:
        value = out.last_hidden_state
    pooled = getattr(out, "pooler_output", None)  # ALBERT: so the pooler gets gradients too
    return value.float().pow(2).mean() + (0 if pooled is None else pooled.float().pow(2).mean())


def _tp2(rank: int, world: int, name: str, sequence_parallel: bool, kernels: bool) -> dict[str, Any]:
    model = FACTORIES[name]()
    recipe = sf.recipes.for_model(model)
    # CommDebugMode's module tracker fails on a module called twice (ALBERT's shared layer):
    # there the collectives are counted without it
    r = parity(model, lambda s: recipe(s, tp=world, sequence_parallel=sequence_parallel, kernels=kernels),
               (token_ids(seq=8),), shape=(world,), loss=_loss, atol=2e-5, tracker=name != "albert")
    sch = recipe(sf.create_schedule(model, mesh=fake_mesh(world)), tp=world, sequence_parallel=sequence_parallel,
                 kernels=kernels)
    explained: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    for c in sf.explain(sch, token_ids(seq=8)).collectives:  # explain, on the example inputs
        if c.origin not in ("loss", "data_parallel", "pipeline"):
            explained[c.direction][c.op] = explained[c.direction].get(c.op, 0) + 1
    return {**r, "explained": explained}


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kernels", [False, True], ids=["hf", "kernels"])
@pytest.mark.parametrize("name", ["albert", "gpt_neo", "roberta"])
def test_paper_recipe_tp2_matches_the_unsharded_model(dist2: Any, name: str, kernels: bool) -> None:
    for r in dist2.run(_tp2, name, False, kernels, timeout=200):
        assert r["grads"] > 0
        # Megatron's optimum: one all-reduce per attention block and per MLP block, each way,
        # per call of a layer (ALBERT: one shared layer, called twice)
        assert r["fwd"] == {"all_reduce": 4} and r["bwd"] == {"all_reduce": 4}, (r["fwd"], r["bwd"])
        # explain counts ALBERT's shared layer once per call, as its fake run calls it (the
        # plan alone, without inputs, counts each module once)
        assert r["explained"] == {"forward": r["fwd"], "backward": r["bwd"]}, r["explained"]


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["albert", "gpt_neo", "roberta"])
def test_paper_recipe_tp2_with_sequence_parallel_and_kernels(dist2: Any, name: str) -> None:
    for r in dist2.run(_tp2, name, True, True, timeout=200):
        assert r["grads"] > 0
        if name == "albert":
            # its attention block holds its own residual and norm and runs on the whole sequence:
            # one all-reduce per call in place of a reduce-scatter; its feed-forward pair is SP's
            assert r["fwd"] == {"all_gather": 6, "all_reduce": 2, "reduce_scatter": 2}, r["fwd"]
            assert r["explained"] == {"forward": r["fwd"], "backward": r["bwd"]}, r["explained"]
            continue
        assert set(r["fwd"]) <= {"all_gather", "reduce_scatter"}, r["fwd"]
        assert r["predicted"] == {"forward": r["fwd"], "backward": r["bwd"]}


# -- single process ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["albert", "gpt_neo", "roberta"])
def test_paper_recipe_checkpoint_and_kernels_keep_numbers(name: str) -> None:
    model = FACTORIES[name]()
    recipe = sf.recipes.for_model(model)
    sch = recipe(sf.create_schedule(model), checkpoint=1.0, kernels=True)
    assert len(sch.annotations.of_kind(CHECKPOINT)) == (1 if name == "albert" else 2)  # ALBERT: one shared layer
    sf.verify(sch, token_ids(), train=True, rtol=1e-4, atol=1e-4)


def test_for_model_finds_the_paper_families() -> None:
    assert [sf.recipes.for_model(f()).name for f in FACTORIES.values()] == ["albert", "gpt_neo", "bert"]


def test_albert_cannot_be_cut_between_calls_of_its_one_layer() -> None:
    with pytest.raises(sf.LayoutError, match=r"stages=2 for 1 layers"):
        sf.recipes.ALBERT(sf.create_schedule(tiny_albert(), mesh=fake_mesh(2, names=("pp",))), stages=2)


def test_wide_resnet_recipe_checkpoints_blocks_and_keeps_numbers_and_batch_statistics() -> None:
    recipe = sf.recipes.WIDE_RESNET
    sch = recipe(sf.create_schedule(WideResNet()), checkpoint=1.0)
    assert list(sch.annotations.of_kind(CHECKPOINT)) == ["layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer4.0"]
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    plain, checkpointed = WideResNet().train(), sf.build(sch).train()
    for model in (plain, checkpointed):
        model(x).sum().backward()
    for (name, want), got in zip(plain.named_buffers(), checkpointed.buffers(), strict=True):
        torch.testing.assert_close(got, want, msg=name)  # each batch counted once, not again in recomputation
    sf.verify(sch, x, train=True, rtol=1e-4, atol=1e-5)


def test_a_recipe_without_a_tensor_parallel_plan_refuses_tp() -> None:
    blocks_only = dataclasses.replace(sf.recipes.WIDE_RESNET, name="blocks", stacks=(sf.recipes.Stack("layer1.*"),))
    with pytest.raises(sf.LayoutError, match=r"recipe 'blocks' has no tensor-parallel plan"):
        blocks_only(sf.create_schedule(WideResNet(), mesh=fake_mesh(2)), tp=2)
