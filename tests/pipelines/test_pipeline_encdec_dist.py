"""T5 and Bart pipelined on 2 gloo ranks: the loss and every parameter gradient equal to the
unscheduled single-process model's, cut inside the decoder (gpipe), inside the encoder
(1f1b) and in four stages, two per rank (interleaved); ALBERT cut between calls of its
shared layer (1f1b), the layer's gradients summed over the two stages. Bart (and T5, slow)
on 4 ranks, and the tied-gradient groups that rule needs. Dropout on in checkpointed
stages: the recomputation draws the forward's masks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist import mesh
from encdec_models import CUTS, MODELS
from models import VOCAB, token_ids

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

BATCH, MICRO = 8, 4
RUNS = (("gpipe", "decoder"), ("1f1b", "encoder"), ("interleaved", "four"))


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    ids = token_ids(BATCH, 7, seed=1)
    mask = torch.ones(BATCH, 7, dtype=torch.long)
    mask[0, 5:] = 0
    decoder_ids = token_ids(BATCH, 5, seed=2)
    return ids, token_ids(BATCH, 5, seed=3), {"attention_mask": mask, "decoder_input_ids": decoder_ids}


def _parity(rank: int, world: int, kind: str) -> list[dict[str, Any]]:
    make, *seqs = MODELS[kind]
    ids, target, kwargs = _batch()
    reference = make()
    ref_loss = ce(reference(ids, **kwargs).logits, target)
    ref_loss.backward()
    out = []
    for schedule, cuts in RUNS:
        sch = sf.create_schedule(make(), mesh=mesh((world,), ("pp",)))
        sch = sf.cut_pipeline_stage(sch, [f"{seqs[s]}.{k}" for s, k in CUTS[cuts]])
        pipe = sf.build_pipeline(sch, microbatches=MICRO, schedule=schedule, loss_fn=ce)
        loss = pipe.step(ids, target=target, **kwargs)
        diffs = {name: (p.grad - reference.get_parameter(name).grad).abs().max().item()
                 for name, p in pipe.named_parameters()}
        out.append({"loss": loss.item(), "ref": ref_loss.item(), "diffs": diffs})
    try:  # zero-bubble schedules (a split backward): refused up front, by name
        sf.build_pipeline(sch, microbatches=MICRO, schedule="zbv", loss_fn=ce)
    except sf.ScheduleError as e:
        out.append({"refused": str(e)})
    return out


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_an_encoder_decoder_pipeline_matches_the_single_process_loss_and_gradients(dist2, kind: str) -> None:
    results = dist2.run(_parity, kind, timeout=180)
    make, *_ = MODELS[kind]
    model = make()
    first: dict[int, str] = {}
    canon = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    for i, (schedule, _) in enumerate(RUNS):
        per_rank = [r[i] for r in results]
        for r in per_rank:  # the loss on every rank, equal to the single-process loss
            assert r["loss"] == pytest.approx(r["ref"], rel=1e-5, abs=1e-6), (schedule, r)
        covered = {canon[n] for r in per_rank for n in r["diffs"]}
        assert covered == set(first.values()), (schedule, covered ^ set(first.values()))
        worst = {k: v for r in per_rank for k, v in r["diffs"].items() if v >= 1e-5}
        assert not worst, (schedule, worst)
    for r in results:
        assert "schedule 'zbv' splits the backward" in r[-1]["refused"]


def _albert_parity(rank: int, world: int) -> dict[str, Any]:
    from transformers import AlbertConfig, AlbertForMaskedLM

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return AlbertForMaskedLM(AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=4,
                                              num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.0))

    ids, target = token_ids(BATCH, 7, seed=1), token_ids(BATCH, 7, seed=3)
    reference = make()
    ref_loss = ce(reference(ids).logits, target)
    ref_loss.backward()
    sch = sf.create_schedule(make(), mesh=mesh((world,), ("pp",)))
    sch = sf.cut_pipeline_stage(sch, "albert.encoder.albert_layer_groups.0", calls=1)
    pipe = sf.build_pipeline(sch, microbatches=MICRO, schedule="1f1b", loss_fn=ce)
    loss = pipe.step(ids, target=target)
    diffs = {name: (p.grad - reference.get_parameter(name).grad).abs().max().item()
             for name, p in pipe.named_parameters()}
    return {"loss": loss.item(), "ref": ref_loss.item(), "diffs": diffs}


def test_albert_cut_between_calls_matches_the_single_process_loss_and_gradients(dist2) -> None:
    results = dist2.run(_albert_parity, timeout=120)
    for r in results:
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5, abs=1e-6), r
        assert max(r["diffs"].values()) < 1e-5, r["diffs"]
    # the shared layer lives in both stages, its gradient the sum of both stages' (the whole one)
    assert all(any(n.startswith("albert.encoder.albert_layer_groups.0.") for n in r["diffs"]) for r in results)


def _four_ranks(rank: int, world: int, kind: str) -> dict[str, Any]:
    make, *seqs = MODELS[kind]
    ids, target, kwargs = _batch()
    reference = make()
    ref_loss = ce(reference(ids, **kwargs).logits, target)
    ref_loss.backward()
    sch = sf.create_schedule(make(), mesh=mesh((world,), ("pp",)))
    sch = sf.cut_pipeline_stage(sch, [f"{seqs[s]}.{k}" for s, k in CUTS["four"]])
    pipe = sf.build_pipeline(sch, microbatches=MICRO, schedule="1f1b", loss_fn=ce)
    loss = pipe.step(ids, target=target, **kwargs)
    diffs = {name: (p.grad - reference.get_parameter(name).grad).abs().max().item()
             for name, p in pipe.named_parameters()}
    return {"loss": loss.item(), "ref": ref_loss.item(), "diffs": diffs}


@pytest.mark.parametrize("kind", [pytest.param("t5", marks=pytest.mark.slow), "bart"])
def test_an_encoder_decoder_on_four_pipeline_ranks_matches_the_single_process(dist4, kind: str) -> None:
    """pp=4: the encoder's output crosses two boundaries to the last decoder stage. Bart's
    encoder embedding norm is held by all four stages (recomputed before the replay) and its
    shared table by three: the tied-gradient groups nest (ranks 0, 2, 3, then all four)."""
    results = dist4.run(_four_ranks, kind, timeout=150)
    for r in results:
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5, abs=1e-6), r
        assert max(r["diffs"].values()) < 1e-5, r["diffs"]


def _owner_sums(groups: dict[tuple[int, ...], Any], owners: tuple[tuple[int, ...], ...],
                rank: int) -> dict[str, float]:
    out = {}
    for tie in owners:
        if rank in tie:
            value = torch.ones(())
            group = groups[tie]
            if group is not None:
                torch.distributed.all_reduce(value, group=group)
            out[str(tie)] = value.item()
    return out


def _nested_owner_groups(rank: int, world: int) -> dict[str, Any]:
    from slapo_fn.pipelines.runner import _owner_groups

    owners = ((0, 2, 3), (0, 1, 2, 3), (2, 3), (1,))
    nested = _owner_sums(_owner_groups(mesh((1, world), ("dp", "pp")), "pp", owners, rank), owners, rank)
    # two pp groups of 2, the schedule's mesh a slice of the 2 x 2 one: each row its own group
    pp = mesh((2, world // 2), ("dp", "pp"))["pp"]
    sliced = _owner_sums(_owner_groups(pp, "pp", ((0, 1),), rank % 2), ((0, 1),), rank % 2)
    return {"nested": nested, "sliced": sliced}


def test_tied_gradient_groups_whose_owner_sets_nest_are_made_on_every_rank(dist4) -> None:
    """The rule behind Bart at pp=4: a group of ranks 0, 2, 3 and then one of all four
    (torch names a group made only by its members by how many groups each has made:
    rank 1 would wait under another name)."""
    results = dist4.run(_nested_owner_groups, timeout=60)
    for rank, r in enumerate(results):
        assert r["nested"] == {str(t): float(len(t)) for t in ((0, 2, 3), (0, 1, 2, 3), (2, 3), (1,)) if rank in t}
        assert r["sliced"] == {"(0, 1)": 2.0}


def _dropout_run(rank: int, world: int, kind: str) -> list[dict[str, Any]]:
    make, *seqs = MODELS[kind]
    ids, target, kwargs = _batch()
    like = make()
    config = copy.deepcopy(like.config)
    config.dropout_rate = config.dropout = 0.2  # T5's and Bart's name of it
    out = []
    for checkpointed, seed in ((False, 0), (True, 0), (True, 1)):
        torch.manual_seed(0)  # the same weights each time
        model = type(like)(config)
        sch = sf.create_schedule(model, mesh=mesh((world,), ("pp",)))
        if checkpointed:  # every layer recomputed in the backward
            sch = sf.checkpoint(sch, [f"{seq}.{k}" for seq in seqs for k in range(2)])
        sch = sf.cut_pipeline_stage(sch, [f"{seqs[s]}.{k}" for s, k in CUTS["encoder"]])
        pipe = sf.build_pipeline(sch, microbatches=MICRO, schedule="1f1b", loss_fn=ce)
        for module in pipe.modules.values():
            module.train()
        torch.manual_seed(seed)
        loss = pipe.step(ids, target=target, **kwargs)
        out.append({"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()}})
    return out


@pytest.mark.parametrize("kind", ["t5", pytest.param("bart", marks=pytest.mark.slow)])
def test_dropout_in_checkpointed_stages_draws_the_masks_of_the_forward(dist2, kind: str) -> None:
    """Dropout on, every layer checkpointed: the recomputation in the backward restores the
    RNG state of the forward, so loss and gradients equal the pipeline without checkpoints
    (and another seed, other masks, differs: dropout is really on)."""
    for plain, checkpointed, other in dist2.run(_dropout_run, kind, timeout=120):
        assert checkpointed["loss"] == plain["loss"] != other["loss"]
        assert checkpointed["grads"].keys() == plain["grads"].keys()
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(checkpointed["grads"][name], grad, rtol=0, atol=0, msg=name)
