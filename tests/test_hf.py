"""slapo_fn.hf: what the package knows about Hugging Face models, on tiny models built
from configs (positive cases) and plain torch modules (negative cases)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    T5Config,
)

import slapo_fn as sf
from slapo_fn import hf
from slapo_fn.pipelines.families import FAMILIES, Family, family_of
from slapo_fn.tree import walk


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def _bert() -> BertModel:
    return BertModel(BertConfig(vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=16))


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


# -- what a module is ---------------------------------------------------------------------
def test_is_pretrained_model_holds_for_models_only() -> None:
    gpt2, llama = _gpt2(), _llama()
    assert hf.is_pretrained_model(gpt2) and hf.is_pretrained_model(gpt2.transformer)
    assert hf.is_pretrained_model(llama) and hf.is_pretrained_model(llama.model)
    assert not hf.is_pretrained_model(gpt2.transformer.h[0])
    assert not hf.is_pretrained_model(llama.model.layers[0].self_attn)
    assert not hf.is_pretrained_model(nn.Linear(2, 2))
    assert not hf.is_pretrained_model(_Plain())


def test_is_transformers_module_holds_for_every_transformers_class() -> None:
    gpt2, llama = _gpt2(), _llama()
    assert hf.is_transformers_module(gpt2)
    assert hf.is_transformers_module(gpt2.transformer.h[0])
    assert hf.is_transformers_module(gpt2.transformer.h[0].attn.c_attn)  # Conv1D (transformers.pytorch_utils)
    assert hf.is_transformers_module(llama.model.layers[0].mlp)

    class Subclass(type(llama.model.layers[0].mlp)):  # type: ignore[misc]
        pass

    assert hf.is_transformers_module(Subclass(llama.config))  # by its base classes
    # torch classes inside a Hugging Face model are not transformers modules
    assert not hf.is_transformers_module(llama.model.layers[0].mlp.gate_proj)
    assert not hf.is_transformers_module(nn.Linear(2, 2))
    assert not hf.is_transformers_module(_Plain())


def test_is_conv1d_recognises_gpt2_conv1d_only() -> None:
    gpt2 = _gpt2()
    attn = gpt2.transformer.h[0].attn
    assert hf.is_conv1d(attn.c_attn) and hf.is_conv1d(attn.c_proj)
    assert tuple(attn.c_attn.weight.shape) == (32, 96)  # stored (in, out)
    assert not hf.is_conv1d(gpt2.lm_head)
    assert not hf.is_conv1d(nn.Linear(2, 2))

    class Conv1D(nn.Module):  # the name alone is not enough
        pass

    assert not hf.is_conv1d(Conv1D())


# -- config -------------------------------------------------------------------------------
def test_config_model_type_and_vocab_size_of_models_and_configs() -> None:
    gpt2, llama = _gpt2(), _llama()
    assert hf.config_of(gpt2) is gpt2.config
    assert hf.model_type(gpt2) == "gpt2" and hf.model_type(llama) == "llama"
    assert hf.model_type(llama.config) == "llama"  # a config itself
    assert hf.model_type(OPTConfig()) == "opt"
    assert hf.vocab_size(gpt2) == 64 and hf.vocab_size(llama) == 64
    assert hf.config_of(nn.Linear(2, 2)) is None
    assert hf.model_type(nn.Linear(2, 2)) is None and hf.model_type(object()) is None
    assert hf.model_type(SimpleNamespace(config=SimpleNamespace(model_type=3))) is None  # not a str
    with pytest.raises(AttributeError, match="vocab_size"):
        hf.vocab_size(nn.Linear(2, 2))


def test_config_value_reads_each_family_s_names() -> None:
    gpt2, llama = GPT2Config(n_embd=32, n_layer=3, n_head=4), _llama().config
    t5 = T5Config(d_model=32, d_ff=48, num_layers=2, num_heads=4)
    sizes = [
        tuple(hf.config_value(c, *names, default=None) for names in (
            hf.HIDDEN_SIZE_ATTRS, hf.FFN_SIZE_ATTRS, hf.LAYER_COUNT_ATTRS, hf.CONFIG_HEAD_COUNT_ATTRS))
        for c in (gpt2, llama, t5)
    ]
    assert sizes == [(32, None, 3, 4), (32, 64, 2, 4), (32, 48, 2, 4)]  # GPT-2's n_inner is None
    with pytest.raises(AttributeError, match=r"config has none of \('hidden_size', 'n_embd', 'd_model'\)"):
        hf.config_value(SimpleNamespace(), *hf.HIDDEN_SIZE_ATTRS)
    assert hf.config_value(SimpleNamespace(a=None, b=0), "a", "b") == 0  # None is skipped, 0 is not
    assert {"llama", "mistral"} <= hf.GATED_MLP_MODEL_TYPES and "gpt2" not in hf.GATED_MLP_MODEL_TYPES


# -- weight initialisation ----------------------------------------------------------------
def test_init_owner_is_the_nearest_pretrained_model_above_a_path() -> None:
    llama = _llama()
    owners = {path: m for path, m in walk(llama) if hf.is_pretrained_model(m)}
    assert set(owners) == {"", "model"}
    assert hf.init_owner(owners, "model.layers.0.mlp.up_proj") is llama.model
    assert hf.init_owner(owners, "model") is llama.model
    assert hf.init_owner(owners, "lm_head") is llama
    assert hf.init_owner({}, "model.layers.0") is None
    assert hf.init_owner(owners, "") is llama


def test_reset_weights_uses_the_owner_s_init_weights_else_reset_parameters() -> None:
    llama = _llama()
    proj = llama.model.layers[0].mlp.up_proj
    with torch.no_grad():
        proj.weight.fill_(7.0)
    hf.clear_initialized_flags(proj)
    assert hf.reset_weights(proj, llama)
    std = llama.config.initializer_range
    assert proj.weight.abs().max() < 10 * std and 0.5 * std < proj.weight.std() < 1.5 * std  # HF's normal(0, std)

    plain = nn.Linear(8, 8)
    with torch.no_grad():
        plain.weight.fill_(7.0)
    assert hf.reset_weights(plain, None)  # reset_parameters
    assert plain.weight.abs().max() < 1.0
    assert not hf.reset_weights(nn.ReLU(), None)
    assert hf.reset_weights(nn.ReLU(), _Plain()) is False  # an owner without _init_weights


def test_clear_initialized_flags_on_the_module_and_its_own_tensors_only() -> None:
    llama = _llama()
    attn = llama.model.layers[0].self_attn
    q = attn.q_proj
    q.__dict__["_is_hf_initialized"] = True
    q.weight.__dict__["_is_hf_initialized"] = True
    attn.__dict__["_is_hf_initialized"] = True
    hf.clear_initialized_flags(q)
    assert "_is_hf_initialized" not in vars(q) and "_is_hf_initialized" not in vars(q.weight)
    assert vars(attn)["_is_hf_initialized"] is True  # the parent keeps its own
    hf.clear_initialized_flags(nn.ReLU())  # nothing to clear is fine


def test_build_on_meta_initialises_a_hugging_face_model_through_hf() -> None:
    with torch.device("meta"):
        meta = _llama()
    built = sf.build(sf.create_schedule(meta), init="reset")
    std = meta.config.initializer_range
    w = built.model.layers[0].mlp.up_proj.weight
    assert not w.is_meta and 0.5 * std < float(w.detach().std()) < 1.5 * std


# -- attention heads ----------------------------------------------------------------------
def test_head_dim_of_attention_modules() -> None:
    gpt2, llama, bert = _gpt2(), _llama(), _bert()
    assert hf.head_dim_of(gpt2.transformer.h[0].attn) == 8
    assert hf.head_dim_of(llama.model.layers[0].self_attn) == 8
    assert hf.head_dim_of(bert.encoder.layer[0].attention.self) == 12  # attention_head_size
    assert hf.head_dim_of(bert.encoder.layer[0].attention.self, ("head_dim",)) is None
    assert hf.head_dim_of(llama.model.layers[0].mlp) is None
    assert hf.head_dim_of(nn.Linear(2, 2)) is None
    zero = nn.Module()
    zero.head_dim = 0
    assert hf.head_dim_of(zero) is None


def test_head_count_attributes_name_the_counts_of_attention_modules() -> None:
    gpt2, bert = _gpt2(), _bert()
    gpt2_attn, bert_attn = gpt2.transformer.h[0].attn, bert.encoder.layer[0].attention.self
    assert [a for a in hf.HEAD_COUNT_ATTRS if a in vars(gpt2_attn)] == ["num_heads"]
    assert [a for a in hf.HEAD_COUNT_ATTRS if a in vars(bert_attn)] == ["num_attention_heads"]
    assert "head_dim" in hf.HEAD_DIM_ATTRS


# -- pipeline stages ----------------------------------------------------------------------
def test_pipeline_families_are_built_from_the_hf_table() -> None:
    assert set(FAMILIES) == set(hf.PIPELINE_STAGES)
    for name, (roles, later) in hf.PIPELINE_STAGES.items():
        assert FAMILIES[name] == Family(roles, later)
    assert FAMILIES["gpt2"].later["wpe"] == "zeros"
    assert FAMILIES["opt"].roles["final_layer_norm"] == "post"
    assert FAMILIES["bert"] == FAMILIES["roberta"]
    assert family_of(_gpt2()) == FAMILIES["gpt2"]
    assert family_of(nn.Linear(2, 2)) == Family()
