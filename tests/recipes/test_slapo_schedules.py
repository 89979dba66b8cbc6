"""Slapo's own schedules for the models of its paper (BERT, RoBERTa, ALBERT, GPT-2, GPT-Neo,
OPT, T5), translated into slapo_fn (tests/slapo_schedules.py; WideResNet's is in
test_wide_resnet_tp.py), at tp=2 on 2 gloo ranks, on tiny models built from configs
(2 layers, hidden 64, random weights): the forward output and every parameter gradient
equal the unscheduled model's, at the Megatron optimum counted by ``CommDebugMode``
(:data:`EXPECTED`, per model). RoBERTa's and T5's schedules shard one side of a tied
embedding, which slapo_fn refuses by one typed line that says what to change; with that
change they run equal too. Slapo's pipeline cuts, translated, run at pp=2 equal to the
single process for each model, and BART's."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import slapo_schedules as S
import torch
from encdec_models import bart
from models import VOCAB, tiny_albert, tiny_bert, tiny_gpt2, tiny_gpt_neo, tiny_roberta, token_ids
from torch import nn
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh


def tiny_opt() -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    ffn_dim=128, max_position_embeddings=32, word_embed_proj_dim=64, dropout=0.0,
                                    attention_dropout=0.0, use_cache=False, pad_token_id=1))


def tiny_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                               use_cache=False))


FACTORIES = {"bert": lambda: tiny_bert(2), "roberta": tiny_roberta, "albert": tiny_albert,
             "gpt2": lambda: tiny_gpt2(2), "gpt_neo": tiny_gpt_neo, "opt": tiny_opt, "t5": tiny_t5}


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    ids = token_ids(seq=8)
    return (ids, torch.ones_like(ids), token_ids(seq=6, seed=1)) if name == "t5" else (ids,)


def _loss(out: Any, _: sf.Schedule) -> torch.Tensor:
    value = getattr(out, "logits", None)
    if value is None:
        value = out.last_hidden_state
    pooled = getattr(out, "pooler_output", None)  # BERT, ALBERT: so the pooler gets gradients too
    return value.float().pow(2).mean() + (0 if pooled is None else pooled.float().pow(2).mean())


#: RoBERTa's and T5's schedules with what slapo_fn's refusal says to change (their tied
#: embeddings sharded alike under every path).
FIXED = {"roberta": S.roberta_untied_fix, "t5": S.t5_untied_fix}


def _tp2(rank: int, world: int, name: str, ckpt_ratio: float = 0.0, **options: Any) -> dict[str, Any]:
    # CommDebugMode's module tracker fails on a module called twice (ALBERT's shared layer,
    # T5's relative position bias, a checkpointed layer's recomputation): there the
    # collectives are counted without it
    schedule = FIXED.get(name, S.SCHEDULES[name])
    if ckpt_ratio or options:
        schedule = functools.partial(schedule, ckpt_ratio=ckpt_ratio, **options)
    r = parity(FACTORIES[name](), schedule, _inputs(name), shape=(world,), loss=_loss, atol=2e-5,
               tracker=name not in ("albert", "t5") and not ckpt_ratio, predict=False)
    functional = {d: {op: n for op, n in r[d].items() if not op.endswith("_")} for d in ("fwd", "bwd")}
    return {**{k: r[k] for k in ("grads", "on_dtensors", "placements")}, **functional}


#: The collectives of one forward and one backward at tp=2, by model: Megatron's optimum, one
#: all-reduce each way per attention block and per MLP block (per call: ALBERT's one layer is
#: called twice); Slapo's embedding post-hook's in-place all-reduce (``allreduce_``, c10d's,
#: forward only: its backward is the identity) is not in these counts: CommDebugMode sees
#: c10d's in-place ops in one test of a pool's process and not in the next, so only the
#: functional collectives (``_c10d_functional``, what slapo_fn issues) are compared; the
#: hook's reduction shows in the output, which is wrong without it; a vocabulary-split LM head's logits gathered
#: forward and its input gradient all-reduced backward (GPT-2, GPT-Neo, OPT).
EXPECTED: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "bert": ({"all_reduce": 4}, {"all_reduce": 4}),
    "albert": ({"all_reduce": 4}, {"all_reduce": 4}),
    "gpt2": ({"all_reduce": 4, "all_gather": 1}, {"all_reduce": 5}),
    "gpt_neo": ({"all_reduce": 4, "all_gather": 1}, {"all_reduce": 5}),
    "opt": ({"all_reduce": 4, "all_gather": 1}, {"all_reduce": 5}),
    # RobertaLMHead holds its decoder's bias as its own ``bias`` too (for resizing): split
    # there alike, it is gathered for the head's forward, which never reads it (128 floats)
    "roberta": ({"all_reduce": 4, "all_gather": 2}, {"all_reduce": 5}),
    # T5: 2 encoder blocks (attention, MLP) and 2 decoder blocks (self attention, cross
    # attention, MLP): 10 pairs; a cross attention's columns read two inputs (q the decoder's
    # states, k/v the encoder's output): the k/v of both decoder blocks read one tensor, whose
    # partial gradients are summed before one all-reduce: 10 + 1 backward, and the LM head's
    "t5": ({"all_reduce": 10, "all_gather": 1}, {"all_reduce": 12}),
}


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_slapos_schedule_at_tp2_is_the_unsharded_model_at_the_megatron_optimum(dist2: Any, name: str) -> None:
    got = dist2.run(_tp2, name, timeout=200)
    assert got[0]["fwd"] == got[1]["fwd"] and got[0]["bwd"] == got[1]["bwd"]
    r = got[0]
    assert r["grads"] == sum(1 for _ in FACTORIES[name]().parameters())
    assert not r["on_dtensors"]
    assert (r["fwd"], r["bwd"]) == EXPECTED[name], (r["fwd"], r["bwd"])


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_slapos_checkpointing_with_tp2_keeps_the_numbers_and_recomputes_the_attention_reductions(dist2: Any) -> None:
    # Slapo's ``ckpt_ratio=1.0``: both GPT-2 layers checkpointed. The recomputation in the
    # backward issues the attention's forward all-reduce again; PyTorch's (non-reentrant)
    # checkpoint stops recomputing once it has what backward saved, before the MLP's row
    # reduction, whose output nothing inside the layer saves: one more per layer
    got = dist2.run(_tp2, "gpt2", 1.0, timeout=200)
    assert got[0]["grads"] == sum(1 for _ in FACTORIES["gpt2"]().parameters())
    assert (got[0]["fwd"], got[0]["bwd"]) == (EXPECTED["gpt2"][0], {"all_reduce": 5 + 2}), got[0]


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_slapos_gpt2_schedule_with_bias_gelu_fused_runs_on_local_shards_at_the_megatron_optimum(dist2: Any) -> None:
    # Slapo's fuse_bias_gelu in place of the fused MLP kernel: each c_fc (a Conv1D) decomposed,
    # still called for its matmul on this rank's shard, its bias fused with the GeLU after it
    plan = sf.dtensor.plan(S.gpt2(sf.create_schedule(FACTORIES["gpt2"](), mesh=fake_mesh(2)), fuse_bias_gelu=True))
    assert plan.on_dtensors == (), [f"{q.path}: {q.reason}" for q in plan.on_dtensors]
    got = dist2.run(_tp2, "gpt2", fuse_bias_gelu=True, timeout=200)
    assert got[0]["grads"] == sum(1 for _ in FACTORIES["gpt2"]().parameters()) and not got[0]["on_dtensors"]
    assert (got[0]["fwd"], got[0]["bwd"]) == EXPECTED["gpt2"], got[0]


# -- what slapo_fn refuses in Slapo's schedules, and the line that says what to change ------
@pytest.mark.parametrize(("name", "tied"), [("roberta", "lm_head.decoder.weight"), ("t5", "lm_head.weight")])
def test_slapos_schedule_sharding_one_side_of_a_tied_embedding_is_refused_with_the_fix(name: str, tied: str) -> None:
    # Slapo shards the word embedding and leaves the tied LM head (RoBERTa's masked-LM
    # decoder; T5's head and its stacks' embed_tokens) as it was, untying them silently
    sch = S.SCHEDULES[name](sf.create_schedule(FACTORIES[name](), mesh=fake_mesh(2)))
    problems = {q.path: q for q in sf.dtensor.plan(sch).on_dtensors}
    assert tied in problems, list(problems)
    assert "(tied)" in problems[tied].reason and "the tie would come apart" in problems[tied].reason
    assert problems[tied].fix.startswith("shard both alike"), problems[tied].fix


# -- pp=2: Slapo's pipeline cuts (``sch["h.0"].cut_pipeline_stage()``), translated ----------
def _masked_lm(kind: str) -> nn.Module:
    import transformers as t

    torch.manual_seed(0)
    sizes: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                             "intermediate_size": 128, "hidden_dropout_prob": 0.0,
                             "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 40}
    if kind == "bert":
        return t.BertForMaskedLM(t.BertConfig(**sizes))
    return t.AlbertForMaskedLM(t.AlbertConfig(embedding_size=32, **sizes))


#: Each model with an LM head (dropout 0), where Slapo cuts it into two stages, and the
#: arguments of ``cut_pipeline_stage``. Slapo cuts BERT and RoBERTa after ``encoder.layer.N``,
#: GPT-2 and GPT-Neo after ``h.N``, OPT after ``decoder.layers.N``, T5 always between the
#: encoder and the decoder (after its last block); ALBERT's Slapo schedule copies BERT's
#: ``encoder.layer.N``, which ALBERT has not: its one shared layer is cut between calls.
#: Slapo has no BART schedule: it is cut as T5.
PIPELINED: dict[str, tuple[Callable[[], nn.Module], str, dict[str, Any]]] = {
    "gpt2": (lambda: tiny_gpt2(2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "transformer.h.0", {}),
    "bert": (lambda: _masked_lm("bert"), "bert.encoder.layer.0", {}),
    "roberta": (tiny_roberta, "roberta.encoder.layer.0", {}),
    "albert": (lambda: _masked_lm("albert"), "albert.encoder.albert_layer_groups.0", {"calls": 0}),
    "gpt_neo": (tiny_gpt_neo, "transformer.h.0", {}),
    "opt": (tiny_opt, "model.decoder.layers.0", {}),
    "t5": (tiny_t5, "encoder.block.1", {}),
    "bart": (bart, "model.encoder.layers.1", {}),
}


def _pp2(rank: int, world: int, name: str) -> dict[str, Any]:
    import torch.nn.functional as F
    from dist import mesh

    make, cut, how = PIPELINED[name]
    ids, target = token_ids(4, 8), token_ids(4, 8, seed=2)
    kwargs: dict[str, Any] = {}
    if name in ("t5", "bart"):
        kwargs, target = {"attention_mask": torch.ones_like(ids), "decoder_input_ids": token_ids(4, 6, seed=1)}, \
            token_ids(4, 6, seed=2)

    def ce(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), t.flatten())

    reference = make()
    ref_loss = ce(reference(ids, **kwargs).logits, target)
    ref_loss.backward()
    sch = sf.cut_pipeline_stage(sf.create_schedule(make(), mesh=mesh((world,), ("pp",))), cut, **how)
    pipe = sf.build_pipeline(sch, microbatches=2, schedule="1f1b", loss_fn=ce)
    loss = pipe.step(ids, target=target, **kwargs)
    diffs = {n: (p.grad - reference.get_parameter(n).grad).abs().max().item() for n, p in pipe.named_parameters()}
    return {"loss": loss.item(), "ref": ref_loss.item(), "diffs": diffs}


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(PIPELINED))
def test_slapos_pipeline_cut_at_pp2_gives_the_single_process_loss_and_gradients(dist2: Any, name: str) -> None:
    for r in dist2.run(_pp2, name, timeout=100):
        assert r["loss"] == pytest.approx(r["ref"], abs=1e-5)
        assert r["diffs"] and max(r["diffs"].values()) < 1e-5, r["diffs"]
