"""Pipeline stage cuts and stage derivation, in one process: the annotation, purity,
stages as structural rewrites with the original FQNs, the chained stages equal to the
model (LLaMA, GPT-2, BERT, OPT), typed errors reported all at once, the stage table."""

from __future__ import annotations

import pytest
import torch
from fingerprint import fingerprint, same
from models import VOCAB, Net, token_ids
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import slapo_fn as sf
from slapo_fn.dtensor.sync import SYNC
from slapo_fn.dtensor.testing import fake_mesh
from slapo_fn.pipelines import build_stages, split_stages, stage_table
from slapo_fn.pipelines.families import NotInStage, ZeroPositions
from slapo_fn.pipelines.runner import stage_schedule
from slapo_fn.rewrites.checkpoint import CHECKPOINT


def llama(layers: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return LlamaForCausalLM(cfg)


def gpt2(layers: int = 4) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=16,
                                      use_cache=False, bos_token_id=0, eos_token_id=0))


def bert(layers: int = 4) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=16))


def opt(layers: int = 4) -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, ffn_dim=64,
                                    num_attention_heads=4, max_position_embeddings=16, word_embed_proj_dim=32,
                                    use_cache=False, pad_token_id=1))


def qwen3(layers: int = 4) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False)
    return Qwen3ForCausalLM(config)


def mistral(layers: int = 4) -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                            use_cache=False))


FAMILIES = {"llama": (llama, "model.layers"), "gpt2": (gpt2, "transformer.h"), "bert": (bert, "bert.encoder.layer"),
            "opt": (opt, "model.decoder.layers"), "qwen3": (qwen3, "model.layers"),
            "mistral": (mistral, "model.layers")}


def _output(out: object) -> torch.Tensor:
    return out.logits  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("cuts", ["[1]", "[0,2]", "[0-2]"])
def test_chained_stages_equal_the_model_forward_and_backward(family: str, cuts: str) -> None:
    make, seq = FAMILIES[family]
    model = make().eval()
    ids = token_ids(2, 8, seed=3)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    expected = _output(model(ids, attention_mask=mask))
    expected.square().mean().backward()
    sch = sf.cut_pipeline_stage(sf.create_schedule(model), f"{seq}.{cuts}")
    stages = build_stages(sch)
    assert len(stages) == cuts.count(",") + 2 if "-" not in cuts else len(stages) == 4
    x = ids
    for stage in stages.values():
        x = stage.eval()(x, attention_mask=mask)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)
    x.square().mean().backward()
    grads: dict[str, torch.Tensor] = {}
    for stage in stages.values():
        for name, p in stage.named_parameters():
            grads[name] = grads[name] + p.grad if name in grads else p.grad  # type: ignore[operator]
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    assert set(grads) <= names
    for name, g in grads.items():
        ref = model.get_parameter(name).grad
        if name in ("lm_head.weight", "transformer.wte.weight", "model.decoder.embed_tokens.weight",
                    "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"):
            continue  # tied: each stage holds one part of the gradient (the pipeline sums them)
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7, msg=name)


def test_stages_are_structural_rewrites_with_original_fqns_and_shared_parameters() -> None:
    model = llama()
    before = fingerprint(model)
    sch = sf.cut_pipeline_stage(sf.create_schedule(model), "model.layers.1")
    first, last = split_stages(sch)
    assert (first.layers, last.layers) == (("0", "1"), ("2", "3"))
    assert list(last.schedule.module.model.layers._modules) == ["2", "3"]
    full = dict(model.named_parameters())
    for stage in (first, last):
        for name, p in stage.schedule.module.named_parameters():
            assert p is full[name]  # shared, not copied
        assert stage.schedule.module.model.rotary_emb is model.model.rotary_emb  # shared role
        assert "pipeline_cut" not in str(stage.schedule.annotations)
    assert isinstance(last.schedule.module.model.embed_tokens, NotInStage)
    assert isinstance(first.schedule.module.lm_head, nn.Identity)
    assert isinstance(first.schedule.module.model.norm, nn.Identity)
    assert last.schedule.module.model.layers._modules["2"] is model.model.layers[2]
    names = [set(dict(s.schedule.module.named_parameters())) for s in (first, last)]
    assert names[0] | names[1] == set(full) and not names[0] & names[1]
    assert same(before, fingerprint(model))
    assert sch.module is model


def test_gpt2_later_stages_add_no_position_embedding_and_keep_the_tied_head() -> None:
    model = gpt2()
    first, last = split_stages(sf.cut_pipeline_stage(sf.create_schedule(model), "transformer.h.1"))
    assert isinstance(last.schedule.module.transformer.wpe, ZeroPositions)
    assert isinstance(last.schedule.module.transformer.drop, nn.Identity)
    assert last.schedule.module.lm_head.weight is model.transformer.wte.weight
    assert first.schedule.module.transformer.wpe is model.transformer.wpe


def test_other_annotations_follow_their_stage() -> None:
    sch = sf.create_schedule(llama())
    sch = sf.checkpoint(sch, "model.layers.[0-3]")
    sch = sf.cut_pipeline_stage(sch, "model.layers.1")
    first, last = split_stages(sch)
    assert set(first.schedule.annotations.of_kind(CHECKPOINT)) == {"model.layers.0", "model.layers.1"}
    assert set(last.schedule.annotations.of_kind(CHECKPOINT)) == {"model.layers.2", "model.layers.3"}


def test_a_module_a_stage_stands_in_for_leaves_its_annotations_behind() -> None:
    # GPT-2's later stages add no position embedding: a zeros stand-in, with no rows to split
    sch = sf.create_schedule(gpt2(), mesh=fake_mesh(2))
    sch = sf.shard(sf.shard(sch, "transformer.wpe", axis=0), "transformer.h.3.mlp.c_fc", axis=1)
    first, last = split_stages(sf.cut_pipeline_stage(sch, "transformer.h.1"))
    assert isinstance(last.schedule.module.transformer.wpe, ZeroPositions)
    assert "transformer.wpe" in first.schedule.annotations and "transformer.wpe.weight" in first.schedule.annotations
    assert not {"transformer.wpe", "transformer.wpe.weight"} & set(last.schedule.annotations)
    assert "transformer.h.3.mlp.c_fc" in last.schedule.annotations


def test_a_sync_on_a_module_every_stage_holds_goes_to_the_stage_that_takes_or_gives_it() -> None:
    sch = sf.create_schedule(gpt2(), mesh=fake_mesh(2))
    sch = sf.sync(sf.sync(sch, "transformer", "fwd_post", Shard(-1)), "transformer", "fwd_pre", Replicate())
    sch = sf.sync(sch, "transformer.h.3.mlp", "fwd_post", Replicate())
    first, middle, last = split_stages(sf.cut_pipeline_stage(sch, "transformer.h.[0,1]"))
    built = [stage_schedule(st) for st in (first, middle, last)]
    modes = [tuple(s.mode for s in b.annotations.get("transformer", SYNC) or ()) for b in built]
    assert modes == [("fwd_pre",), (), ("fwd_post",)]
    assert "transformer" not in built[1].annotations
    assert "transformer.h.3.mlp" in built[2].annotations.of_kind(SYNC)


def test_cut_records_history_and_leaves_the_input_unchanged() -> None:
    sch = sf.create_schedule(llama())
    cut = sf.cut_pipeline_stage(sch, "model.layers.1")
    assert not sch.annotations and sch.history == ()
    assert [repr(h) for h in cut.history] == ["cut_pipeline_stage.at('model.layers.1')"]
    again = sf.cut_pipeline_stage.at("model.layers.2")(cut)
    assert [s.layers for s in split_stages(again)] == [("0", "1"), ("2",), ("3",)]


def test_bad_cuts_are_reported_all_at_once_and_the_schedule_is_unchanged() -> None:
    sch = sf.cut_pipeline_stage(sf.create_schedule(llama()), "model.layers.1")
    notes, history = sch.annotations, sch.history
    with pytest.raises(sf.ScheduleError, match="cut_pipeline_stage: 4 problems") as info:
        sf.cut_pipeline_stage(sch, ["model.layers.1", "model.layers.0", "model.norm", "model.layers.3"])
    reasons = dict(zip(info.value.paths, (p.reason for p in info.value.problems)))
    assert "duplicate stage cut" in reasons["model.layers.1"]
    assert "out of order" in reasons["model.layers.0"]
    assert "not a layer of a sequence" in reasons["model.norm"]
    assert "last layer" in reasons["model.layers.3"]
    assert all(p.fix for p in info.value.problems)
    assert sch.annotations == notes and sch.history == history


def test_cut_inside_a_layer_names_the_parent_and_suggests_a_layer() -> None:
    with pytest.raises(sf.ScheduleError, match=r"not a layer of a sequence \(its parent is a LlamaDecoderLayer\)") as e:
        sf.cut_pipeline_stage(sf.create_schedule(llama()), "model.layers.0.mlp")
    assert "model.layers.1" in e.value.problems[0].fix


def test_cuts_in_two_sequences_of_a_forward_that_fails_on_token_ids_are_refused() -> None:
    """Several layer sequences make a chain (see test_pipeline_encdec.py), placed by one probe
    forward on token ids: a forward that fails there is refused with its error, typed."""

    class TwoStacks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
            self.b = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

        def forward(self, input_ids: torch.Tensor | None = None) -> torch.Tensor:
            raise NotImplementedError("no forward")

    with pytest.raises(sf.ScheduleError, match=r"(?s)'a, b'.*forward fails on a small batch of token ids.*"
                                               r"NotImplementedError: no forward"):
        sf.cut_pipeline_stage(sf.create_schedule(TwoStacks()), "a.0")


def test_a_model_without_inputs_embeds_is_refused() -> None:
    with pytest.raises(sf.ScheduleError, match="Net.forward takes no inputs_embeds"):
        sf.cut_pipeline_stage(sf.create_schedule(Net(depth=3)), "blocks.0")


def test_a_selector_that_matches_nothing_is_a_selector_error() -> None:
    with pytest.raises(sf.SelectorError, match="close matches"):
        sf.cut_pipeline_stage(sf.create_schedule(llama()), "model.layer.1")


def test_explain_shows_the_stage_table() -> None:
    sch = sf.cut_pipeline_stage(sf.create_schedule(gpt2()), "transformer.h.[0-2]")
    table = stage_table(sch)
    assert [r.layers for r in table.rows] == [("transformer.h.0",), ("transformer.h.1",), ("transformer.h.2",),
                                            ("transformer.h.3",)]
    assert [(r.pre, r.post) for r in table.rows] == [(True, False), (False, False), (False, False), (False, True)]
    total = sum(r.parameters for r in table.rows)
    tied = sch.module.transformer.wte.weight.numel()
    assert total == sum(p.numel() for p in sch.module.parameters()) + tied  # the tied copy counts twice
    assert table.shared == (((0, "transformer.wte.weight"), (3, "lm_head.weight")),)
    text = str(sf.explain(sch))
    assert "pipeline stages (4):" in text and "transformer.h.3" in text
    assert str(stage_table(sf.create_schedule(gpt2()))) == ""


def _albert(**overrides: int) -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(0)
    return AlbertForMaskedLM(AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=4,
                                          num_attention_heads=4, intermediate_size=64, **overrides))


def test_albert_shared_layers_are_refused_with_the_reason_not_an_index_error() -> None:
    """ALBERT calls one layer module several times: a one-module sequence has nowhere to cut,
    and layers called more than once per forward cannot be split into stages by call."""
    with pytest.raises(sf.ScheduleError, match=r"is the only layer of its sequence.*a stage holds modules, not calls"):
        sf.cut_pipeline_stage(sf.create_schedule(_albert()), "albert.encoder.albert_layer_groups.0")
    with pytest.raises(sf.ScheduleError, match=r"calls its layer\(s\) '0' 2 times, '1' 2 times in one forward"):
        sf.cut_pipeline_stage(sf.create_schedule(_albert(num_hidden_groups=2)), "albert.encoder.albert_layer_groups.0")
