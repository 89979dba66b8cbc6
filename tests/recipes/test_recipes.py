"""Recipes: every family at TP=2 on 2 gloo ranks equals the unsharded model (forward, every
gradient, Megatron's collective counts); knobs; errors; single-process kernels + checkpoint."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import VOCAB, tiny_bert, tiny_gpt2, tiny_llama, token_ids
from torch import nn
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.dtensor.shard import LAYOUT
from slapo_fn.dtensor.testing import fake_mesh
from slapo_fn.recipes import Knobs
from slapo_fn.rewrites.checkpoint import CHECKPOINT
from slapo_fn.rewrites.compile import COMPILE


def tiny_opt() -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                    num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=64,
                                    dropout=0.0, attention_dropout=0.0, use_cache=False))


def tiny_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                               use_cache=False, decoder_start_token_id=0))


def tiny_qwen3() -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False))


def tiny_bloom() -> nn.Module:
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0,
                                        attention_dropout=0.0, use_cache=False))


def tiny_falcon() -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)  # the new decoder architecture (falcon-40b's): 2 kv heads, attention beside the MLP
    return FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_kv_heads=2, new_decoder_architecture=True, hidden_dropout=0.0,
                                          attention_dropout=0.0, use_cache=False))


FACTORIES = {"llama": tiny_llama, "qwen3": tiny_qwen3, "gpt2": lambda: tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0,
                                                                               attn_pdrop=0.0),
             "bert": tiny_bert, "opt": tiny_opt, "t5": tiny_t5, "bloom": tiny_bloom, "falcon": tiny_falcon}


def _loss(out: Any, _: sf.Schedule) -> torch.Tensor:
    value = getattr(out, "logits", None)
    if value is None:
        value = out.last_hidden_state
    pooled = getattr(out, "pooler_output", None)  # BERT: so the pooler gets gradients too
    return value.float().pow(2).mean() + (0 if pooled is None else pooled.float().pow(2).mean())


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    ids = token_ids(seq=8)
    if name == "t5":
        return (ids, torch.ones_like(ids), token_ids(seq=6, seed=1))  # input_ids, attention_mask, decoder ids
    return (ids,)


class _T5Call(nn.Module):
    """Positional inputs for T5 (input_ids, attention_mask, decoder_input_ids)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, decoder_ids: torch.Tensor) -> Any:
        return self.model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)


def _tp2(rank: int, world: int, name: str, sequence_parallel: bool, kernels: bool = False) -> dict[str, Any]:
    model = FACTORIES[name]()
    recipe = sf.recipes.for_model(model)
    if name == "t5":
        wrapped = _T5Call(model)
        return parity(wrapped, lambda s: _under(s, recipe, sequence_parallel), _inputs(name), shape=(world,),
                      loss=_loss, atol=2e-5, tracker=False)
    # CommDebugMode's module tracker hooks each module's output, which Falcon adds to in place
    return parity(model, lambda s: recipe(s, tp=world, sequence_parallel=sequence_parallel, kernels=kernels),
                  _inputs(name), shape=(world,), loss=_loss, atol=2e-5, tracker=name != "falcon")


def _under(sch: sf.Schedule, recipe: sf.recipes.Recipe, sp: bool) -> sf.Schedule:
    """Apply a recipe to the model under a thin wrapper (its paths gain a ``model.`` prefix)."""
    inner = recipe(sf.create_schedule(sch.module.model, mesh=sch.mesh), tp=2, sequence_parallel=sp)
    return sf.replace(sch, "model", inner.module).evolve(
        annotations=sf.Annotations({f"model.{k}" if k else "model": v for k, v in inner.annotations.items()}))


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2", "bert", "opt", "t5", "bloom", "falcon"])
def test_recipe_tp2_matches_the_unsharded_model(dist2: Any, name: str) -> None:
    for r in dist2.run(_tp2, name, False, timeout=200):
        assert r["grads"] > 0
        # Megatron's optimum: one all-reduce per attention block and per MLP block, each way
        blocks = 10 if name == "t5" else 4  # T5: 2 encoder blocks x 2 + 2 decoder blocks x 3 (cross-attention)
        assert r["fwd"] == {"all_reduce": blocks}, r["fwd"]
        # T5's cross-attention q reads the decoder's states, k/v the encoder's output: each block's
        # q enters the tensor-parallel region on its own, and the k/v of every block enter once,
        # on the one tensor the encoder's output is (one more all-reduce backward in all)
        # Qwen3's per-head q/k norms (tp_local) see this rank's heads: their weight gradients are
        # all-reduced together at the end of backward, so that every gradient is Replicate like its parameter
        norms = 1 if name == "qwen3" else 0
        assert r["bwd"] == {"all_reduce": blocks + (1 if name == "t5" else 0) + norms}, r["bwd"]
        assert r["predicted"] == {"forward": r["fwd"], "backward": r["bwd"]}


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2", "bert"])
def test_recipe_tp2_with_kernels_matches_the_unsharded_model(dist2: Any, name: str) -> None:
    for r in dist2.run(_tp2, name, False, True, timeout=200):  # the attention/MLP kernels run on local heads
        norms = 1 if name == "qwen3" else 0  # Qwen3's per-head q/k norm weight gradients, together
        assert r["fwd"] == {"all_reduce": 4} and r["bwd"] == {"all_reduce": 4 + norms}, (r["fwd"], r["bwd"])


@pytest.mark.dist
@pytest.mark.timeout(240)
# BERT: its pairs are across parents; OPT: its MLP runs on the batch and the tokens merged; BLOOM:
# its ALiBi bias, built by the model for every head, meets this rank's heads
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "opt", "bloom", "falcon"])
def test_recipe_tp2_with_sequence_parallel(dist2: Any, name: str) -> None:
    for r in dist2.run(_tp2, name, True, timeout=200):
        assert set(r["fwd"]) <= {"all_gather", "reduce_scatter"}, r["fwd"]
        assert r["predicted"] == {"forward": r["fwd"], "backward": r["bwd"]}


# -- single process ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2", "bert", "opt"])
def test_recipe_checkpoint_and_kernels_keep_numbers(name: str) -> None:
    model = FACTORIES[name]()
    recipe = sf.recipes.for_model(model)
    sch = recipe(sf.create_schedule(model), Knobs(checkpoint=1.0, kernels=True))
    assert len(sch.annotations.of_kind(CHECKPOINT)) == 2
    sf.verify(sch, token_ids(), rtol=1e-4, atol=1e-4)


def test_knobs_choose_layers_and_cuts() -> None:
    from slapo_fn.recipes import LLAMA

    model = tiny_llama(layers=4)
    sch = LLAMA(sf.create_schedule(model), checkpoint=0.5)
    assert list(sch.annotations.of_kind(CHECKPOINT)) == ["model.layers.0", "model.layers.1"]
    sch = LLAMA(sf.create_schedule(model), checkpoint=(1, 3), compile=True)
    assert list(sch.annotations.of_kind(CHECKPOINT)) == ["model.layers.1", "model.layers.3"]
    assert len(sch.annotations.of_kind(COMPILE)) == 4


def test_opt_runs_its_final_norm_sequence_parallel_where_it_has_one() -> None:
    """OPT's decoder registers ``final_layer_norm`` before ``layers`` and calls it after them:
    it joins the chain as its last member. OPT-350m normalises in each layer and has none."""
    from transformers import OPTConfig, OPTForCausalLM

    from slapo_fn.dtensor.sequence import SEQ

    sch = sf.recipes.OPT(sf.create_schedule(tiny_opt(), mesh=fake_mesh(2)), tp=2, sequence_parallel=True)
    assert list(sch.annotations.of_kind(SEQ)) == ["model.decoder.layers.0", "model.decoder.layers.1",
                                                  "model.decoder.final_layer_norm"]
    sf.explain(sch, token_ids(seq=8))  # the plan takes the chain in the order the decoder runs it
    torch.manual_seed(0)
    opt_350m = OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                        num_attention_heads=4, word_embed_proj_dim=32, do_layer_norm_before=False,
                                        max_position_embeddings=32))
    sch = sf.recipes.OPT(sf.create_schedule(opt_350m, mesh=fake_mesh(2)), tp=2, sequence_parallel=True)
    assert list(sch.annotations.of_kind(SEQ)) == ["model.decoder.layers.0", "model.decoder.layers.1"]


def test_recipe_errors_are_reported_together() -> None:
    from slapo_fn.recipes import LLAMA

    model = tiny_llama()  # 4 heads, 2 kv heads
    sch = sf.create_schedule(model, mesh=fake_mesh(4))
    with pytest.raises(sf.LayoutError, match=r"(?s)num_key_value_heads=2 is not divisible by tp=4"):
        LLAMA(sch, tp=4)
    with pytest.raises(sf.LayoutError, match=r"(?s)2 problems.*tp=2 needs a mesh with a 'tp' axis of size 2.*"
                                             r"checkpoint ratio 1.5"):
        LLAMA(sch, tp=2, checkpoint=1.5)
    with pytest.raises(sf.LayoutError, match="sequence_parallel needs tp > 1"):
        LLAMA(sf.create_schedule(model), sequence_parallel=True)
    with pytest.raises(sf.ScheduleError, match=r"checkpoint layer\(s\) \[5\] out of range"):
        LLAMA(sf.create_schedule(model), checkpoint=(5,))
    with pytest.raises(sf.ScheduleError, match="stages=3 for 2 layers"):
        LLAMA(sf.create_schedule(model), stages=3)


def test_for_model_and_from_tp_plan() -> None:
    assert sf.recipes.for_model(tiny_gpt2()).name == "gpt2"
    assert sf.recipes.for_model(tiny_qwen3()).name == "qwen3"
    with pytest.raises(sf.ScheduleError, match="no recipe for model_type None"):
        sf.recipes.for_model(nn.Linear(2, 2))
    model = tiny_llama()
    sch = sf.recipes.from_tp_plan(sf.create_schedule(model, mesh=fake_mesh(2)))
    by_plan = sch.annotations.of_kind(LAYOUT)
    by_recipe = sf.recipes.LLAMA(sf.create_schedule(model, mesh=fake_mesh(2)), tp=2).annotations.of_kind(LAYOUT)
    assert {k: str(v) for k, v in by_plan.items()} == {k: str(v) for k, v in by_recipe.items()}
    with pytest.raises(sf.ScheduleError, match="style 'gather' has no slapo_fn equivalent"):
        sf.recipes.from_tp_plan(sf.create_schedule(model, mesh=fake_mesh(2)), {"layers.*.mlp": "gather"})
    with pytest.raises(sf.ScheduleError, match="has no base_model_tp_plan"):
        sf.recipes.from_tp_plan(sf.create_schedule(tiny_gpt2(), mesh=fake_mesh(2)))


def _pipeline(rank: int, world: int, name: str) -> dict[str, Any]:
    import torch.nn.functional as F
    from dist import mesh

    def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    ids, target = token_ids(batch=4, seq=8), token_ids(batch=4, seq=8, seed=1)
    extra = {"decoder_input_ids": token_ids(batch=4, seq=8, seed=2)} if name == "t5" else {}
    reference = FACTORIES[name]()
    ref_loss = ce(reference(ids, **extra).logits, target)
    ref_loss.backward()
    model = FACTORIES[name]()
    recipe = sf.recipes.for_model(model)
    sch = recipe(sf.create_schedule(model, mesh=mesh((world,), ("pp",))), stages=2, checkpoint=1.0)
    pipe = sf.build_pipeline(sch, microbatches=2, schedule="1f1b", loss_fn=ce)
    loss = pipe.step(ids, target=target, **extra)
    diffs = {n: (p.grad - reference.get_parameter(n).grad).abs().max().item() for n, p in pipe.named_parameters()}
    return {"loss": loss.item(), "ref": ref_loss.item(), "diffs": diffs}


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_recipe_in_a_two_stage_pipeline_matches_one_process(dist2: Any, name: str) -> None:
    results = dist2.run(_pipeline, name, timeout=200)
    for r in results:
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5)
        assert max(r["diffs"].values()) < 1e-5, r["diffs"]
    # every parameter lives on some stage (GPT-2's tied head: on the last, under its own name;
    # T5's shared embedding: under one of its names in each stage that holds it)
    first: dict[int, str] = {}
    canon = {n: first.setdefault(id(p), n) for n, p in FACTORIES[name]().named_parameters(remove_duplicate=False)}
    covered = set().union(*(r["diffs"] for r in results))
    assert {canon[n] for n in covered} == set(first.values())
    assert name != "gpt2" or "lm_head.weight" in covered
