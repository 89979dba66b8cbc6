"""Pipelines for Hugging Face families without a hand-written stage adapter: the adapter
derived from the model's structure and checked for parity at the cut. GPT-Neo, Phi-3,
Gemma2, GPT-NeoX and Falcon at 2 and 4 stages on 2 and 4 gloo ranks give the
single-process loss and every gradient; ``explain`` with a pp=2 mesh works for each;
BLOOM and the decoders of Bart and Whisper cut; whole encoder-decoders, ViT, a family
whose forward cannot be split and a meta model are refused with typed errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist import mesh
from torch import nn

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh
from slapo_fn.pipelines import build_stages
from slapo_fn.pipelines.cut import PIPELINE_CUT

VOCAB, BATCH, SEQ, MICRO = 64, 8, 8, 4
DROP = {"attention_dropout": 0.0, "hidden_dropout": 0.0}


def make(family: str, layers: int = 4) -> tuple[nn.Module, str]:
    """A tiny random ``family`` causal LM (dropout 0) and the path of its layer list."""
    import transformers as t

    torch.manual_seed(0)
    common: dict[str, Any] = {"vocab_size": VOCAB, "use_cache": False, "pad_token_id": 0, "bos_token_id": 0,
                              "eos_token_id": 0}
    sizes = {"hidden_size": 32, "num_attention_heads": 4}
    if family == "gpt_neo":
        cfg = t.GPTNeoConfig(num_layers=layers, num_heads=4, hidden_size=32, max_position_embeddings=32,
                             attention_types=[[["global", "local"], layers // 2]], window_size=4, embed_dropout=0.0,
                             attention_dropout=0.0, resid_dropout=0.0, **common)
        return t.GPTNeoForCausalLM(cfg), "transformer.h"
    if family == "phi3":
        cfg = t.Phi3Config(intermediate_size=64, num_hidden_layers=layers, num_key_value_heads=2, **sizes, **common)
        return t.Phi3ForCausalLM(cfg), "model.layers"
    if family == "gemma2":
        cfg = t.Gemma2Config(intermediate_size=64, num_hidden_layers=layers, num_key_value_heads=2, head_dim=8,
                             sliding_window=4, **sizes, **common)
        return t.Gemma2ForCausalLM(cfg), "model.layers"
    if family == "gpt_neox":
        cfg = t.GPTNeoXConfig(intermediate_size=64, num_hidden_layers=layers, **DROP, **sizes, **common)
        return t.GPTNeoXForCausalLM(cfg), "gpt_neox.layers"
    if family == "falcon":
        cfg = t.FalconConfig(num_hidden_layers=layers, **DROP, **sizes, **common)
        return t.FalconForCausalLM(cfg), "transformer.h"
    if family == "bloom":
        cfg = t.BloomConfig(n_layer=layers, n_head=4, hidden_size=32, **DROP, **common)
        return t.BloomForCausalLM(cfg), "transformer.h"
    raise KeyError(family)


FAMILIES = ("gpt_neo", "phi3", "gemma2", "gpt_neox", "falcon")


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids, target = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :2] = 0  # left padding: the mask reaches every stage
    return ids, target, mask


def _parity(rank: int, world: int, family: str) -> dict[str, Any]:
    """One 1F1B step of ``family`` cut into ``world`` stages (one per rank) against the model."""
    ids, target, mask = _batch()
    reference, seq = make(family)
    ref_loss = ce(reference(ids, attention_mask=mask).logits, target)
    ref_loss.backward()
    model, _ = make(family)
    cuts = "[1]" if world == 2 else "[0-2]"
    sch = sf.cut_pipeline_stage(sf.create_schedule(model, mesh=mesh((world,), ("pp",))), f"{seq}.{cuts}")
    pipe = sf.build_pipeline(sch, microbatches=MICRO, schedule="1f1b", loss_fn=ce)
    loss = pipe.step(ids, target=target, attention_mask=mask)
    diffs = {name: (p.grad - reference.get_parameter(name).grad).abs().max().item()
             for name, p in pipe.named_parameters()}
    return {"loss": loss.item(), "ref": ref_loss.item(), "diffs": diffs}


def _every_parameter(family: str) -> set[str]:
    return {n for n, _ in make(family)[0].named_parameters(remove_duplicate=False)}  # tied head included


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_derived_adapter_gives_the_single_process_loss_and_gradients(
    dist_pool: Any, family: str, world: int
) -> None:
    results = dist_pool(world).run(_parity, family, timeout=90)
    seen: set[str] = set()
    for r in results:
        assert r["loss"] == pytest.approx(r["ref"], abs=1e-5)
        assert r["diffs"] and max(r["diffs"].values()) < 1e-5, r["diffs"]
        seen |= set(r["diffs"])
    assert seen == _every_parameter(family)  # every parameter lives in some stage, with the model's gradient


@pytest.mark.parametrize("family", FAMILIES)
def test_explain_shows_the_stages_of_a_derived_adapter_on_a_pp_mesh(family: str) -> None:
    model, seq = make(family)
    sch = sf.cut_pipeline_stage(sf.create_schedule(model, mesh=fake_mesh(2, names=("pp",))), f"{seq}.1")
    text = str(sf.explain(sch))
    assert "pipeline stages (2):" in text and f"{seq}.[0-1]" in text and f"{seq}.[2-3]" in text, text


def test_bloom_cuts_with_its_embedding_layernorm_in_the_first_stage_only() -> None:
    model, seq = make("bloom")
    sch = sf.cut_pipeline_stage(sf.create_schedule(model), f"{seq}.[0-2]")
    family = next(iter(sch.annotations.of_kind(PIPELINE_CUT).values())).family
    assert family is not None and family.later["word_embeddings_layernorm"] == "identity"
    ids, _target, mask = _batch()
    hidden: torch.Tensor = ids
    for stage in build_stages(sch).values():
        hidden = stage(hidden, attention_mask=mask)
    assert torch.allclose(hidden, model(ids, attention_mask=mask).logits, atol=1e-6)


def _seq2seq(kind: str) -> nn.Module:
    import transformers as t

    torch.manual_seed(0)
    sizes = {"vocab_size": VOCAB, "d_model": 32, "encoder_layers": 2, "decoder_layers": 4, "encoder_attention_heads": 4,
             "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "dropout": 0.0,
             "use_cache": False, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "decoder_start_token_id": 0}
    if kind == "bart":
        return t.BartForConditionalGeneration(t.BartConfig(max_position_embeddings=32, **sizes))
    return t.WhisperForConditionalGeneration(
        t.WhisperConfig(num_mel_bins=8, max_source_positions=16, max_target_positions=32, **sizes))


@pytest.mark.parametrize("kind", ["bart", "whisper"])
def test_an_encoder_decoder_decoder_cuts_alone_and_whisper_whole_is_refused(kind: str) -> None:
    model = _seq2seq(kind)
    if kind == "whisper":  # whole Bart and T5 cut: test_pipeline_encdec.py
        with pytest.raises(sf.ScheduleError, match=r"(?s)'model.encoder.layers, model.decoder.layers'.*"
                                                   r"forward takes no input_ids.*fix: pipeline one sequence"):
            sf.cut_pipeline_stage(sf.create_schedule(model), "model.decoder.layers.1")
    decoder = model.get_decoder()
    sch = sf.cut_pipeline_stage(sf.create_schedule(decoder), "layers.[0-2]")
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    encoded = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))
    hidden: torch.Tensor = ids
    for stage in build_stages(sch).values():
        hidden = stage(hidden, encoder_hidden_states=encoded)
    want = decoder(ids, encoder_hidden_states=encoded).last_hidden_state
    assert torch.allclose(hidden, want, atol=1e-6)
    hidden.sum().backward()


def test_vit_is_refused_it_takes_no_inputs_embeds() -> None:
    import transformers as t

    model = t.ViTForImageClassification(t.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                    intermediate_size=64, image_size=8, patch_size=4))
    path = next(p for p, m in model.named_modules() if isinstance(m, nn.ModuleList)) + ".0"
    with pytest.raises(sf.ScheduleError, match="ViTForImageClassification.forward takes no inputs_embeds"):
        sf.cut_pipeline_stage(sf.create_schedule(model), path)


class _Config:
    model_type = "toy-scaled"
    vocab_size = VOCAB


class ScalesItsInputsEmbeds(nn.Module):
    """A Hugging Face-like model whose forward transforms ``inputs_embeds`` (as Gemma once
    scaled them): later stages would apply the scale again, so no derived adapter passes."""

    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()
        self.embed = nn.Embedding(VOCAB, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = (self.embed(input_ids) if inputs_embeds is None else inputs_embeds) * 3.0
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


def test_a_family_whose_stages_differ_from_the_model_is_refused_at_the_cut() -> None:
    sch = sf.create_schedule(ScalesItsInputsEmbeds())
    with pytest.raises(sf.ScheduleError, match=r"(?s)no pipeline stage adapter for model_type 'toy-scaled', and none "
                                               r"derived .* passes the parity check: the stages differ from the model "
                                               r"by .*fix: check what ScalesItsInputsEmbeds.forward does"):
        sf.cut_pipeline_stage(sch, "layers.1")
    assert sch.history == ()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_meta_model_gets_the_adapter_its_real_twin_passes(family: str) -> None:
    from slapo_fn.pipelines.families import resolve_family

    real, seq = make(family, layers=4)
    with torch.device("meta"):
        meta, _ = make(family, layers=4)
    assert any(p.is_meta for p in meta.parameters())
    assert resolve_family(meta, seq) == resolve_family(real, seq)  # checked on a small real twin
    cut = sf.cut_pipeline_stage(sf.create_schedule(meta), f"{seq}.1")
    assert len(cut.history) == 1


def test_a_meta_model_without_a_buildable_twin_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import slapo_fn.pipelines.families as families

    with torch.device("meta"):
        model, seq = make("phi3", layers=2)
    monkeypatch.setattr(families, "small_config", lambda config: None)  # no twin can be built
    with pytest.raises(sf.ScheduleError, match=r"(?s)model_type 'phi3', its parameters are on the meta device, and "
                                               r"no small real twin"):
        sf.cut_pipeline_stage(sf.create_schedule(model), f"{seq}.0")


@pytest.mark.timeout(120)
def test_explain_pp2_from_the_command_line_for_a_family_without_an_adapter(tmp_path: Any) -> None:
    import subprocess
    import sys

    from transformers import Phi3Config

    Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2).save_pretrained(tmp_path)
    result = subprocess.run([sys.executable, "-m", "slapo_fn.cli", "explain", "--model", str(tmp_path / "config.json"),
                             "--pp", "2"], capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "0      model.layers.[0-1]" in result.stdout and "1      model.layers.[2-3]" in result.stdout
