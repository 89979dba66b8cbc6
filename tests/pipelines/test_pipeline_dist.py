"""Pipeline parallelism on 2 gloo ranks: loss and every gradient equal to the unscheduled
single-process model for each schedule, tied GPT-2 weights equal after optimizer steps,
errors up front, and a killed rank that fails the job instead of hanging; and on 4 ranks,
tensor-parallel plans inside the stages (pp2 x tp2)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from dist import PG_TIMEOUT_S, RankError, mesh
from models import VOCAB, token_ids
from torch.distributed.tensor import Partial, Replicate, Shard

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

BATCH, SEQ, MICRO = 8, 8, 4


def llama(layers: int = 4) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return LlamaForCausalLM(cfg)


def gpt2(layers: int = 4) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=SEQ, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


MODELS = {"llama": (llama, "model.layers"), "gpt2": (gpt2, "transformer.h")}
#: (schedule, layers after which a stage is cut): 2 stages for single-stage schedules,
#: 4 (two per rank) for the multi-stage ones.
RUNS = (("gpipe", "[1]"), ("1f1b", "[1]"), ("interleaved", "[0-2]"), ("zero-bubble", "[0-2]"), ("zbv", "[0-2]"))


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = token_ids(BATCH, SEQ, seed=1)
    target = token_ids(BATCH, SEQ, seed=2)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :2] = 0  # some left padding: the mask must reach every stage
    return ids, target, mask


def _parity(rank: int, world: int, family: str, runs: tuple[tuple[str, str], ...]) -> list[dict]:
    make, seq = MODELS[family]
    ids, target, mask = _batch()
    reference = make()
    ref_loss = ce(reference(ids, attention_mask=mask).logits, target)
    ref_loss.backward()
    out = []
    for schedule, cuts in runs:
        model = make()
        sch = sf.cut_pipeline_stage(sf.create_schedule(model, mesh=mesh((world,), ("pp",))), f"{seq}.{cuts}")
        pipe = sf.build_pipeline(sch, microbatches=MICRO, schedule=schedule, loss_fn=ce)
        loss = pipe.step(ids, target=target, attention_mask=mask)
        diffs = {
            name: (p.grad - reference.get_parameter(name).grad).abs().max().item()
            for name, p in pipe.named_parameters()
        }
        out.append({"schedule": schedule, "loss": loss.item(), "ref": ref_loss.item(), "diffs": diffs,
                    "stages": pipe.stage_indices, "untouched": all(p.grad is None for p in model.parameters())})
    return out


def _every_parameter(family: str) -> set[str]:
    make, _ = MODELS[family]
    return {n for n, _ in make().named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_schedule_matches_single_process_loss_and_gradients(dist2, family: str) -> None:
    results = dist2.run(_parity, family, RUNS, timeout=150)
    names = _every_parameter(family)
    for i, (schedule, _) in enumerate(RUNS):
        per_rank = [r[i] for r in results]
        assert [r["schedule"] for r in per_rank] == [schedule, schedule]
        for r in per_rank:  # the loss on every rank, equal to the single-process loss
            assert r["loss"] == pytest.approx(r["ref"], rel=1e-5, abs=1e-6), (schedule, r)
            assert r["untouched"], "build_pipeline must not touch the user's model"
        covered = set().union(*(r["diffs"] for r in per_rank))
        if family == "gpt2":  # the tied LM head is checked under its own FQN in the last stage
            assert {"transformer.wte.weight", "lm_head.weight"} <= covered
        assert covered == names, (schedule, names ^ covered)
        worst = max(d for r in per_rank for d in r["diffs"].values())
        assert worst < 1e-5, (schedule, {k: v for r in per_rank for k, v in r["diffs"].items() if v >= 1e-5})
    if family == "llama":
        assert [r[2]["stages"] for r in results] == [(0, 2), (1, 3)]  # interleaved: round robin
        assert [r[4]["stages"] for r in results] == [(0, 3), (1, 2)]  # zbv: V-shaped


def _tied_training(rank: int, world: int, schedule: str, cuts: str, steps: int) -> dict:
    ids, target, mask = _batch()
    reference = gpt2()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    sch = sf.cut_pipeline_stage(sf.create_schedule(gpt2(), mesh=mesh((world,), ("pp",))), f"transformer.h.{cuts}")
    pipe = sf.build_pipeline(sch, microbatches=MICRO, schedule=schedule, loss_fn=ce)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for _ in range(steps):
        ref_loss = ce(reference(ids, attention_mask=mask).logits, target)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(pipe.step(ids, target=target, attention_mask=mask).item())
        opt.step()
        opt.zero_grad()
        ref_losses.append(ref_loss.item())
    params = dict(pipe.named_parameters())
    tied = {n: params[n].detach().clone() for n in ("transformer.wte.weight", "lm_head.weight") if n in params}
    worst = max((p - reference.get_parameter(n)).abs().max().item() for n, p in params.items())
    return {"losses": losses, "ref": ref_losses, "tied": tied, "worst": worst}


@pytest.mark.parametrize(("schedule", "cuts"), [("1f1b", "1"), ("zbv", "[0-2]")])
def test_gpt2_tied_embedding_and_head_stay_equal_after_optimizer_steps(dist2, schedule: str, cuts: str) -> None:
    results = dist2.run(_tied_training, schedule, cuts, 3, timeout=120)
    tied = {n: t for r in results for n, t in r["tied"].items()}
    assert set(tied) == {"transformer.wte.weight", "lm_head.weight"}
    assert torch.equal(tied["transformer.wte.weight"], tied["lm_head.weight"])  # bit for bit
    for r in results:
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5)
        assert r["worst"] < 1e-4  # after 3 AdamW steps (lr 1e-2): fp32 rounding, normalised by Adam
    if schedule == "zbv":  # both copies on rank 0 (stages 0 and 3): summed locally
        assert set(results[0]["tied"]) == {"transformer.wte.weight", "lm_head.weight"}


def _bad_inputs(rank: int, world: int) -> list[str]:
    sch = sf.cut_pipeline_stage(sf.create_schedule(llama(), mesh=mesh((world,), ("pp",))), "model.layers.1")
    messages = []
    for kwargs in ({"microbatches": 1, "schedule": "1f1b"}, {"microbatches": 4, "schedule": "interleaved-x"},
                   {"microbatches": 4, "schedule": "zbv"}):
        try:
            sf.build_pipeline(sch, loss_fn=ce, **kwargs)
        except sf.ScheduleError as e:
            messages.append(str(e))
    pipe = sf.build_pipeline(sch, microbatches=3, schedule="gpipe", loss_fn=ce)
    ids, target, _ = _batch()
    for call in (lambda: pipe.step(ids, target=target),
                 lambda: pipe.step(ids[:6], target=target[:6], position_ids=torch.arange(SEQ)[None].expand(1, -1))):
        try:
            call()
        except sf.ScheduleError as e:
            messages.append(str(e))
    return messages


def test_bad_microbatches_and_schedules_are_refused_up_front_on_every_rank(dist2) -> None:
    start = time.monotonic()
    for messages in dist2.run(_bad_inputs, timeout=60):
        assert len(messages) == 5
        assert "1 microbatches for 2 stages" in messages[0]
        assert "unknown schedule 'interleaved-x'" in messages[1]
        assert "schedule 'zbv' needs 4 stages" in messages[2]
        assert "batch of 8 does not split into 3 equal microbatches" in messages[3]
        assert "position_ids" in messages[4] and "(1, 8)" in messages[4]
    assert time.monotonic() - start < 30


def _stage_count_against_pp(rank: int, world: int) -> list[str]:
    sch = sf.create_schedule(llama(), mesh=mesh((world,), ("pp",)))
    messages = []
    try:
        sf.cut_pipeline_stage(sch, "model.layers.[0,1]")  # 3 stages on 2 ranks
    except sf.ScheduleError as e:
        messages.append(str(e))
    four = sf.cut_pipeline_stage(sch, "model.layers.[0-2]")  # 4 stages, two per rank: fine
    try:
        sf.build_pipeline(four, microbatches=4, schedule="1f1b", loss_fn=ce)  # one stage per rank only
    except sf.ScheduleError as e:
        messages.append(str(e))
    no_pp = sf.cut_pipeline_stage(sf.create_schedule(llama(), mesh=mesh((world,), ("tp",))), "model.layers.1")
    try:
        sf.build_pipeline(no_pp, microbatches=4, loss_fn=ce)
    except sf.ScheduleError as e:
        messages.append(str(e))
    return messages


def test_stage_counts_that_do_not_fit_the_pp_axis_are_schedule_errors(dist2) -> None:
    for messages in dist2.run(_stage_count_against_pp, timeout=60):
        assert len(messages) == 3
        assert "makes 3 stages for 2 ranks on the 'pp' mesh axis" in messages[0]
        assert "4 stages on 2 'pp' ranks: schedule '1f1b' needs 2 stages" in messages[1]
        assert "has no 'pp' axis" in messages[2]


def _pp_tp(rank: int, world: int) -> dict:
    ids, target, mask = _batch()
    reference = llama()
    ref_loss = ce(reference(ids, attention_mask=mask).logits, target)
    ref_loss.backward()
    sch = sf.create_schedule(llama(), mesh=mesh((2, 2), ("pp", "tp")))
    sch = sf.foreach("model.layers.*.mlp", sf.shard.at("gate_proj", axis=0) >> sf.shard.at("up_proj", axis=0)
                     >> sf.shard.at("down_proj", axis=1))(sch)
    sch = sf.cut_pipeline_stage(sch, "model.layers.1")
    pipe = sf.build_pipeline(sch, microbatches=MICRO, schedule="1f1b", loss_fn=ce)
    loss = pipe.step(ids, target=target, attention_mask=mask)
    diffs = {}
    for name, p in pipe.named_parameters():
        diffs[name] = (full(p.grad) - reference.get_parameter(name).grad).abs().max().item()
    return {"loss": loss.item(), "ref": ref_loss.item(), "diffs": diffs}


def test_pp_by_tp_on_a_two_dimensional_mesh(dist4) -> None:
    results = dist4.run(_pp_tp, timeout=120)
    for r in results:
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5)
        assert max(r["diffs"].values()) < 1e-5, r["diffs"]
    assert set().union(*(r["diffs"] for r in results)) == {n for n, _ in llama().named_parameters()}


def _tied_split_differently(sch: sf.Schedule) -> sf.Schedule:
    """The first stage's embedding split by features (its position embedding by rows), the
    last stage's tied LM head whole."""
    sch = sf.shard(sf.shard(sch, "transformer.wte", axis=1), "transformer.wpe", axis=0)
    return sf.foreach("transformer.h.*.mlp", sf.shard.at("c_fc", axis=1) >> sf.shard.at("c_proj", axis=0))(sch)


def _first_stage_on_dtensors(sch: sf.Schedule) -> sf.Schedule:
    """A token split stated inside the first stage's layer: that stage runs on DTensor
    activations and hands on a DTensor."""
    sch = sf.foreach("transformer.h.*.mlp", sf.shard.at("c_fc", axis=1) >> sf.shard.at("c_proj", axis=0))(sch)
    return sf.sync(sch, "transformer.h.0.mlp.dropout", "fwd_pre", Shard(1))


def _model_output_split_by_features(sch: sf.Schedule) -> sf.Schedule:
    """Sequence parallelism over the layers and the final norm, and the model's output
    (``transformer``, which every stage holds part of) stated split by features: the sync
    belongs to the last stage, where that output is made, not to every stage's end."""
    sch = sf.foreach("transformer.h.*.mlp", sf.shard.at("c_fc", axis=1) >> sf.shard.at("c_proj", axis=0))(sch)
    sch = sf.sequence_parallel(sch, ["transformer.h.*", "transformer.ln_f"])
    return sf.sync(sch, "transformer", "fwd_post", Shard(-1))


def _logits_split_along_the_sequence(sch: sf.Schedule) -> sf.Schedule:
    """The model's output (the last stage's logits) stated split along the sequence: the
    loss gets them whole, as from one process."""
    sch = sf.foreach("transformer.h.*.mlp", sf.shard.at("c_fc", axis=1) >> sf.shard.at("c_proj", axis=0))(sch)
    return sf.sync(sch, "", "fwd_post", Shard(1))


PP_TP_PLANS = {"logits-split-along-the-sequence": _logits_split_along_the_sequence,
               "tied-split-differently": _tied_split_differently, "first-stage-on-dtensors": _first_stage_on_dtensors,
               "model-output-split-by-features": _model_output_split_by_features}


def _gpt2_pp_tp(rank: int, world: int, which: str) -> dict:
    """GPT-2 at pp2 x tp2 under plan ``which``: two AdamW steps beside one process."""
    ids, target, mask = _batch()
    reference = gpt2(2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    sch = PP_TP_PLANS[which](sf.create_schedule(gpt2(2), mesh=mesh((2, 2), ("pp", "tp"))))
    pipe = sf.build_pipeline(sf.cut_pipeline_stage(sch, "transformer.h.0"), microbatches=MICRO, schedule="1f1b",
                             loss_fn=ce)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, ref_losses, diffs = [], [], {}
    for _ in range(2):
        losses.append(pipe.step(ids, target=target, attention_mask=mask).item())
        ref_loss = ce(reference(ids, attention_mask=mask).logits, target)
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        if not diffs:  # the first step's gradients
            diffs = {n: (full(p.grad) - reference.get_parameter(n).grad).abs().max().item()
                     for n, p in pipe.named_parameters()}
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    tied = {n: full(p).detach() for n, p in pipe.named_parameters()
            if n in ("transformer.wte.weight", "lm_head.weight")}
    return {"losses": losses, "ref": ref_losses, "diffs": diffs, "tied": tied}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("which", PP_TP_PLANS)
def test_tensor_parallel_plans_inside_stages_give_the_single_process_training(dist4, which: str) -> None:
    results = dist4.run(_gpt2_pp_tp, which, timeout=120)
    for r in results:
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5)
        assert max(r["diffs"].values()) < 1e-5, r["diffs"]
    # the tied copies, one in each stage, are equal after two steps
    wte, head = (next(r["tied"][n] for r in results if n in r["tied"])
                 for n in ("transformer.wte.weight", "lm_head.weight"))
    assert torch.equal(wte, head)


def _refusing_in_the_last_stage(rank: int, world: int) -> str:
    sch = sf.create_schedule(llama(), mesh=mesh((2, 2), ("pp", "tp")))
    sch = sf.sync(sch, "model.layers.3.mlp", "fwd_post", Replicate(), src=Partial())  # nothing makes a Partial
    try:
        sf.build_pipeline(sf.cut_pipeline_stage(sch, "model.layers.1"), microbatches=MICRO, loss_fn=ce)
    except sf.LayoutError as e:
        return str(e)
    return "built"


def test_a_layout_one_stage_refuses_is_refused_on_every_rank(dist4) -> None:
    messages = dist4.run(_refusing_in_the_last_stage, timeout=60)
    assert len(set(messages)) == 1, messages  # the first stage's ranks too, not left waiting
    assert "model.layers.3.mlp" in messages[0] and "build_pipeline" in messages[0]


def _killed(rank: int, world: int) -> None:
    sch = sf.cut_pipeline_stage(sf.create_schedule(llama(), mesh=mesh((world,), ("pp",))), "model.layers.1")

    def dying_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        os._exit(3)  # the last stage's rank dies in the middle of the step

    pipe = sf.build_pipeline(sch, microbatches=MICRO, schedule="1f1b", loss_fn=dying_loss)
    ids, target, _ = _batch()
    start = time.monotonic()
    try:
        pipe.step(ids, target=target)
    except Exception as e:
        raise RuntimeError(f"survivor failed after {time.monotonic() - start:.1f} s: {type(e).__name__}") from e


def test_a_killed_rank_fails_the_job_within_the_process_group_timeout(dist2) -> None:
    start = time.monotonic()
    try:
        with pytest.raises(RankError) as info:
            dist2.run(_killed, timeout=PG_TIMEOUT_S + 20)
        assert time.monotonic() - start < PG_TIMEOUT_S + 20
        assert "died" in info.value.tracebacks[1]
        assert "survivor failed after" in info.value.tracebacks.get(0, ""), info.value.tracebacks
    finally:
        dist2.kill()  # a rank is gone: the fixture starts a fresh pool for later tests
