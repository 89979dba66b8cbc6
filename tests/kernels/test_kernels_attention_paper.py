"""The attention kernels of the Slapo paper's other families: ALBERT's attention block (its
output projection, residual and norm inside) and GPT-Neo's global and local (windowed),
unscaled causal attention equal the Hugging Face modules on whole models — outputs and
every gradient, padded or not, in training mode, with a KV cache — and keep their names."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import slapo_fn as sf
from slapo_fn.kernels import Attention, KernelError, PostNormAttention, WindowedCausalAttention

VOCAB = 96
SEQ = 10
PATHS = {"albert": "encoder.albert_layer_groups.*.albert_layers.*.attention",
         "gpt_neo": "transformer.h.*.attn.attention"}


def _albert(**overrides: Any) -> nn.Module:
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    options: dict[str, Any] = {"vocab_size": VOCAB, "embedding_size": 32, "hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "intermediate_size": 96, "max_position_embeddings": 32}
    return AlbertModel(AlbertConfig(**{**options, **overrides})).eval()


def _gpt_neo(**overrides: Any) -> nn.Module:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(0)  # one global and one local layer, a window shorter than the sequence
    options: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                               "attention_types": [[["global", "local"], 1]], "window_size": 4,
                               "max_position_embeddings": 32, "use_cache": False, "bos_token_id": 0,
                               "eos_token_id": 0}
    return GPTNeoForCausalLM(GPTNeoConfig(**{**options, **overrides})).eval()


MODELS = {"albert": _albert, "gpt_neo": _gpt_neo}


def _ids(batch: int = 3, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


def _mask(kind: str) -> torch.Tensor | None:
    """None, or right padding of fewer tokens than GPT-Neo's window: every query keeps a key
    (a query whose window holds only padding gets eager's uniform-softmax artefact, whose
    gradient is rounding, as test_kernels_attention explains for left padding)."""
    if kind == "none":
        return None
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[0, -3:] = 0
    mask[2, -1:] = 0
    return mask


@pytest.mark.parametrize("padding", ["none", "right"])
@pytest.mark.parametrize("family", ["albert", "gpt_neo"])
def test_kernel_matches_hf_outputs_and_gradients(family: str, padding: str) -> None:
    model = MODELS[family]()
    sch = sf.replace(sf.create_schedule(model), PATHS[family], Attention.from_hf)
    mask = _mask(padding)
    report = sf.verify(sch, _ids(), kwargs={} if mask is None else {"attention_mask": mask}, rtol=1e-5, atol=1e-5)
    assert len(report.gradients) == len([p for p in model.parameters() if p.requires_grad])


def test_albert_in_training_mode_with_dropout_off_matches_and_names_are_kept() -> None:
    model = _albert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    sch = sf.replace(sf.create_schedule(model), PATHS["albert"], Attention.from_hf)
    assert sf.verify(sch, _ids(), train=True, rtol=1e-5, atol=1e-5).gradients
    built = sf.build(sch, copy=False)
    assert list(built.state_dict()) == list(model.state_dict())
    kernel = built.get_submodule("encoder.albert_layer_groups.0.albert_layers.0.attention")
    assert isinstance(kernel, PostNormAttention)


def test_gpt_neo_window_is_applied_not_ignored() -> None:
    """The local layer's window changes the output (a kernel ignoring it would not), and the
    kernel follows it; the global layer has none."""
    model = _gpt_neo()
    built = sf.build(sf.replace(sf.create_schedule(model), PATHS["gpt_neo"], Attention.from_hf), copy=False)
    kernels = [built.get_submodule(f"transformer.h.{i}.attn.attention") for i in (0, 1)]
    assert [type(k) for k in kernels] == [WindowedCausalAttention] * 2
    assert [k.sliding_window for k in kernels] == [None, 4]
    wide = _gpt_neo(window_size=SEQ)
    wide.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(wide(_ids()).logits, model(_ids()).logits, atol=1e-4)
        torch.testing.assert_close(built(_ids()).logits, model(_ids()).logits, rtol=1e-5, atol=1e-5)


def test_gpt_neo_kv_cache_decoding_matches() -> None:
    model = _gpt_neo()
    built = sf.build(sf.replace(sf.create_schedule(model), PATHS["gpt_neo"], Attention.from_hf), copy=False)
    ids = _ids(batch=2)
    with torch.no_grad():
        outs = []
        for m in (model, built):
            first = m(ids[:, :6], use_cache=True)
            step = m(ids[:, 6:], cache=first.past_key_values, use_cache=True)
            outs.append(torch.cat([first.logits, step.logits], dim=1))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_a_kernel_refuses_another_family_by_name() -> None:
    with pytest.raises(KernelError, match=r"GPTNeoSelfAttention is not one of the modules this kernel replaces"):
        PostNormAttention.from_hf(_gpt_neo().get_submodule("transformer.h.0.attn.attention"), "h.0")
