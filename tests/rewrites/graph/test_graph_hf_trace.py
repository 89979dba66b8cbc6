"""Tracing Hugging Face modules: BERT and GPT-Neo attention with parity, fx first then
export, flatten without leaves, and Slapo's softmax-attention pattern in BERT."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import slapo_fn as sf
from slapo_fn.rewrites.graph import TraceFallbackWarning
from tests.fingerprint import fingerprint, same
from tests.models import tiny_bert, tiny_llama


def tiny_bert_eager() -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=32, attn_implementation="eager")
    return BertModel(cfg)


def tiny_gpt_neo() -> nn.Module:
    from transformers import GPTNeoConfig, GPTNeoModel

    torch.manual_seed(0)
    cfg = GPTNeoConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=32,
                       attention_types=[[["global", "local"], 1]], window_size=4, bos_token_id=0, eos_token_id=0)
    return GPTNeoModel(cfg)


def assert_parity(traced: nn.Module, original: nn.Module, x: torch.Tensor) -> None:
    """Forward and gradients (input and every parameter) of ``traced`` equal ``original``'s."""
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(1)
    out = traced(x1)[0]
    torch.manual_seed(1)
    ref = original(x2)[0]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)
    got = {n: p.grad for n, p in traced.named_parameters()}
    want = {n: p.grad for n, p in original.named_parameters()}
    assert list(got) == list(want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)


def test_bert_attention_with_a_child_named_self_traces_with_parity() -> None:
    attention = tiny_bert(1).encoder.layer[0].attention  # children: `self`, `output`
    before = fingerprint(attention)
    x = torch.randn(2, 8, 64)
    with pytest.warns(TraceFallbackWarning, match=r"torch.fx cannot trace it.*traced with torch.export"):
        sch = sf.trace(sf.create_schedule(attention), "", example_inputs=(x,))
    assert [str(n.target) for n in sch.module.graph.nodes if n.op == "call_module"] == ["self", "output"]
    assert sch["self"].module is attention.self
    built = sf.build(sch)
    assert_parity(built, attention, x)  # training mode: dropout draws the same masks
    attention.zero_grad()
    assert same(fingerprint(attention), before)


def test_gpt_neo_self_attention_keeps_lifted_tensor_constants() -> None:
    attn = tiny_gpt_neo().h[0].attn.attention
    x = torch.randn(2, 8, 64)
    with pytest.warns(TraceFallbackWarning):
        sch = sf.trace(sf.create_schedule(attn), "", example_inputs=(x,))
    constants = [str(n.target) for n in sch.module.graph.nodes if n.op == "get_attr" and "lifted" in str(n.target)]
    assert constants and all(isinstance(getattr(sch.module, c), torch.Tensor) for c in constants)
    assert list(sf.build(sch).state_dict()) == list(attn.state_dict())  # constants are not state
    assert_parity(sf.build(sch), attn, x)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Slapo's attention core: matmul -> scale -> softmax -> dropout -> matmul."""
    return torch.matmul(F.dropout(F.softmax(torch.matmul(q, k) * 0.125, dim=-1)), v)


def test_softmax_attention_pattern_found_in_exported_bert_self_attention() -> None:
    self_attention = tiny_bert_eager().encoder.layer[0].attention.self.eval()
    x = torch.randn(2, 8, 64)
    with pytest.warns(TraceFallbackWarning):
        sch = sf.trace(sf.create_schedule(self_attention), "", example_inputs=(x,))
    (core,) = sf.find(sch, "", softmax_attention)
    assert core.ops == ("matmul", "mul", "softmax", "dropout", "matmul")
    assert core.escaping == (core.nodes[3],)  # the attention probabilities are also returned
    fused = sf.fuse(sch, "", core, compiler=None)
    out, probs = sf.build(fused)(x)
    ref_out, ref_probs = self_attention(x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(probs, ref_probs)


def test_hf_module_is_traced_with_fx_first_without_example_inputs() -> None:
    model = tiny_llama(1)
    sch = sf.create_schedule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TraceFallbackWarning)
        traced = sf.trace(sch, "model.layers.0.mlp")
    mlp = traced["model.layers.0.mlp"].module
    assert isinstance(mlp, fx.GraphModule) and mlp.gate_proj is model.model.layers[0].mlp.gate_proj
    assert [m.modules for m in sf.find(traced, "model.layers.0.mlp", r"(gate|up|down)_proj")] == [
        ("model.layers.0.mlp.gate_proj",), ("model.layers.0.mlp.up_proj",), ("model.layers.0.mlp.down_proj",)]
    x = torch.randn(2, 8, 64)
    torch.testing.assert_close(mlp(x), model.model.layers[0].mlp(x))
    with pytest.raises(sf.ScheduleError, match=r"(?s)'model.layers.0': torch.fx cannot trace it: .*"
                                             r"tracing with torch.export needs example inputs"):
        sf.trace(sch, "model.layers.0")


def test_flatten_exposes_hf_childrens_graphs_without_leaves() -> None:
    attention = tiny_bert(1).encoder.layer[0].attention.eval()
    x = torch.randn(2, 8, 64)
    with pytest.warns(TraceFallbackWarning):
        sch = sf.trace(sf.create_schedule(attention), "", flatten=True, example_inputs=(x,))
    calls = [str(n.target) for n in sch.module.graph.nodes if n.op == "call_module"]
    assert calls == ["self.query", "self.key", "self.value", "output.dense", "output.dropout", "output.LayerNorm"]
    assert sf.find(sch, "", lambda node: node.op == "call_function" and "scaled_dot_product" in str(node.target))
    assert list(sf.build(sch).state_dict()) == list(attention.state_dict())
    torch.testing.assert_close(sf.build(sch)(x)[0], attention(x)[0])
