"""trace, decompose, fuse, partial replace / checkpoint: numbers, FQNs, purity, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import slapo_fn as sf
from slapo_fn.hf import is_conv1d
from slapo_fn.rewrites.graph.decompose import SeparateBiasLinear
from tests.fingerprint import fingerprint, same
from tests.models import Net, tiny_gpt2, tiny_llama


class GptMLP(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc_in = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class BertOutput(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.dense = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(dim)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(self.dropout(self.dense(h)) + residual)


class Layer(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.mlp = GptMLP(dim)
        self.out = BertOutput(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.mlp.fc_in(x)), x) + self.mlp(x)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias)


def bias_dropout_res_norm(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(F.dropout(x + bias) + residual, (16,))


def test_trace_keeps_children_paths_fqns_and_identity() -> None:
    model = Net()
    before = fingerprint(model)
    sch = sf.create_schedule(model)
    sch2 = sf.trace(sch, "blocks.1")
    gm = sch2["blocks.1"].module
    assert isinstance(gm, fx.GraphModule) and isinstance(sch2["blocks.1.mlp"].module, fx.GraphModule)
    assert sch2["blocks.1.norm"].module is model.blocks[1].norm
    assert sch2["blocks.1.mlp.fc1"].module is model.blocks[1].mlp.fc1
    assert sch2["blocks.0"].module is model.blocks[0] and sch2["embed"].module is model.embed
    assert list(sf.build(sch2).state_dict()) == list(model.state_dict())
    sf.verify(sch2, torch.tensor([[1, 2, 3]]))
    assert sch.module is model and same(fingerprint(model), before)


def test_trace_flatten_inlines_children_and_leaves_keep_them() -> None:
    model = Layer()
    sch = sf.trace(sf.create_schedule(model), "", flatten=True)
    targets = {str(n.target) for n in sch.module.graph.nodes if n.op == "call_module"}
    assert targets == {"mlp.fc_in", "mlp.fc_out", "out.dense", "out.dropout", "out.norm"}
    kept = sf.trace(sf.create_schedule(model), "", flatten=True, leaves=["out"])
    assert {str(n.target) for n in kept.module.graph.nodes if n.op == "call_module"} >= {"out"}
    assert kept["out"].module is model.out
    sf.verify(sch, torch.randn(2, 16))


def test_hooks_and_annotations_survive_tracing() -> None:
    model = Layer()
    seen: list[str] = []
    model.register_forward_hook(lambda m, a, o: seen.append("root"))
    model.out.register_forward_hook(lambda m, a, o: seen.append("out"))
    sch = sf.create_schedule(model)
    sch = sf.hook(sch, "mlp", "fwd_post", lambda m, a, o: seen.append("mlp"))
    sch = sf.annotate(sch, "out.dense.weight", "lr_scale", 0.5)
    sch = sf.trace(sch, "", flatten=True)
    assert sch["mlp"].annotations["hooks"] and sch.annotations["out.dense.weight"]["tags"]["lr_scale"] == 0.5
    built = sf.build(sch)
    built(torch.randn(1, 16))
    assert sorted(seen) == ["mlp", "out", "root"]
    assert built.out.dense.weight.lr_scale == 0.5


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


def test_untraceable_module_names_path_and_reason() -> None:
    sch = sf.create_schedule(nn.Sequential(nn.Linear(2, 2), Branchy()))
    with pytest.raises(sf.ScheduleError, match=r"(?s)'1': torch.fx cannot trace it: .*control flow") as info:
        sf.trace(sch, "1")
    assert info.value.paths == ("1",)
    with pytest.raises(sf.ScheduleError, match=r"(?s)'1'.*control flow"):
        sf.trace(sch, "")  # the child is traced too (flatten=False), and fails the same way
    with pytest.raises(sf.ScheduleTypeError, match="tracer must be"):
        sf.trace(sch, "0", tracer="jit")  # type: ignore[arg-type]


def test_decompose_keeps_numbers_and_fqns() -> None:
    model = GptMLP()
    sch = sf.decompose(sf.trace(sf.create_schedule(model), ""), "fc_in")
    ops = [n.target for n in sch.module.graph.nodes if n.op in ("call_function", "call_module")]
    assert ops[:2] == ["fc_in", __import__("operator").add] and "fc_out" in ops
    # still called, for its matmul alone: the same parameters under the same FQNs
    fc_in = sch["fc_in"].module
    assert type(fc_in) is SeparateBiasLinear and type(model.fc_in) is nn.Linear
    assert fc_in.weight is model.fc_in.weight and fc_in.bias is model.fc_in.bias
    x = torch.randn(3, 16)
    torch.testing.assert_close(fc_in(x) + fc_in.bias, model.fc_in(x), rtol=0, atol=0)
    report = sf.verify(sch, x)
    assert report.max_output_diff == 0 and len(report.gradients) == 4
    every = sf.decompose(sf.trace(sf.create_schedule(model), ""), "")
    assert all(type(every[n.target].module) is SeparateBiasLinear
               for n in every.module.graph.nodes if n.op == "call_module")


def test_decompose_errors() -> None:
    sch = sf.create_schedule(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(sf.ScheduleError, match="no traced ancestor"):
        sf.decompose(sch, "0")
    traced = sf.trace(sch, "")
    with pytest.raises(sf.ScheduleError, match="decompose splits an nn.Linear"):
        sf.decompose(traced, "1")
    hooked = sf.hook(traced, "0", "fwd_post", lambda m, a, o: None)
    with pytest.raises(sf.ScheduleError, match="has hooks"):
        sf.decompose(hooked, "0")


def test_fuse_bias_gelu_eager_region() -> None:
    model = GptMLP()
    sch = sf.decompose(sf.trace(sf.create_schedule(model), ""), "fc_in")
    (match,) = sf.find(sch, "", bias_gelu)
    fused = sf.fuse(sch, "", match, compiler=None, name="bias_gelu")
    assert "bias_gelu" in fused.module._modules and not list(fused["bias_gelu"].module.parameters())
    assert list(sf.build(fused).state_dict()) == list(model.state_dict())
    assert sf.verify(fused, torch.randn(3, 16)).max_output_diff == 0
    with pytest.raises(sf.ScheduleError, match="no longer fits"):
        sf.fuse(fused, "", match, compiler=None)  # the nodes are gone
    with pytest.raises(sf.ScheduleError, match="is taken"):
        sf.fuse(sch, "", match, compiler=None, name="fc_in")


def test_fuse_bias_dropout_residual_norm_same_seed_eager() -> None:
    model = BertOutput()
    sch = sf.decompose(sf.trace(sf.create_schedule(model), ""), "dense")
    (match,) = sf.find(sch, "", bias_dropout_res_norm)
    assert match.ops == ("add", "dropout", "add", "norm")
    fused = sf.fuse(sch, "", match, compiler=None)
    sf.verify(fused, torch.randn(4, 64), torch.randn(4, 16), train=True)


@pytest.mark.slow
def test_fuse_compiled_with_inductor_matches_eager() -> None:
    model = BertOutput()
    sch = sf.decompose(sf.trace(sf.create_schedule(model), ""), "dense")
    (match,) = sf.find(sch, "", bias_dropout_res_norm)
    fused = sf.fuse(sch, "", match, options={"fallback_random": True})
    assert dict(fused["fused"].annotations["compile"]) == {"backend": "inductor", "options": {"fallback_random": True}}
    sf.verify(fused, torch.randn(4, 64), torch.randn(4, 16), train=True, rtol=1e-4, atol=1e-5)
    mlp = sf.decompose(sf.trace(sf.create_schedule(GptMLP()), ""), "fc_in")
    mlp = sf.fuse(mlp, "", sf.find(mlp, "", bias_gelu)[0])
    sf.verify(mlp, torch.randn(3, 16), rtol=1e-4, atol=1e-5)


class BertSelfAttention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(0.0)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + mask
        ctx = torch.matmul(self.dropout(F.softmax(scores, dim=-1)), v)
        return ctx.permute(0, 2, 1, 3).flatten(2)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) / 4.0 + mask
    return torch.matmul(F.dropout(F.softmax(scores, dim=-1)), v)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_schedule() -> tuple[BertSelfAttention, sf.Schedule, tuple[torch.Tensor, torch.Tensor]]:
    model = BertSelfAttention()
    x, mask = torch.randn(2, 5, 16), torch.zeros(2, 1, 1, 5)
    mask[1, ..., -2:] = -1e4
    return model, sf.trace(sf.create_schedule(model), "", example_inputs=(x, mask)), (x, mask)


def test_partial_replace_attention_core_by_sdpa() -> None:
    _, sch, inputs = attention_schedule()
    (core,) = sf.find(sch, "", attention_core)
    assert core.input_names == ("q", "k", "v", "mask") and "dropout" in core.ops
    new = sf.replace(sch, "", sdpa, subgraph=core)
    assert "dropout" not in new.module._modules and "replaced" in new.module._modules
    assert [n for n in new.module.graph.nodes if n.target is F.softmax] == []
    sf.verify(new, *inputs)


def test_partial_replace_checks_order_arity_and_shapes() -> None:
    _, sch, _ = attention_schedule()
    (core,) = sf.find(sch, "", attention_core)
    swapped = lambda k, q, v, mask: sdpa(q, k, v, mask)
    with pytest.raises(sf.ScheduleError, match=r"in another order.*\n.*forward\(q, k, v, mask\)"):
        sf.replace(sch, "", swapped, subgraph=core)
    with pytest.raises(sf.ScheduleError, match="takes 3 inputs"):
        sf.replace(sch, "", lambda q, k, v: q, subgraph=core)
    with pytest.raises(sf.ScheduleError, match=r"returns \[\(\(2, 2, 5\), torch.float32\)\]"):
        sf.replace(sch, "", lambda q, k, v, mask: q.sum(-1), subgraph=core)
    assert sf.find(sch, "", attention_core) == [core]  # the input schedule is unchanged


class TwoOut(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.sin(x)
        b = torch.cos(x)
        return a * 2 + b * 3


def test_partial_replace_with_several_outputs() -> None:
    sch = sf.trace(sf.create_schedule(TwoOut()), "", example_inputs=(torch.randn(3),))

    def pattern(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sin(x), torch.cos(x)

    (m,) = sf.find(sch, "", pattern)
    assert len(m.outputs) == 2
    new = sf.replace(sch, "", lambda x: (torch.sin(x), torch.cos(x)), subgraph=m)
    sf.verify(new, torch.randn(3))
    with pytest.raises(sf.ScheduleError, match="returns"):
        sf.replace(sch, "", lambda x: (torch.cos(x), torch.sin(x)[:2]), subgraph=m)


def test_partial_checkpoint_recomputes_only_the_subgraph() -> None:
    model, sch, inputs = attention_schedule()
    (core,) = sf.find(sch, "", attention_core)
    ck = sf.checkpoint(sch, "", subgraph=core)
    assert "checkpoint" in ck["checkpointed"].annotations
    assert list(sf.build(ck).state_dict()) == list(model.state_dict())
    sf.verify(ck, *inputs)
    with pytest.raises(sf.ScheduleError, match="cannot nest"):
        sf.checkpoint(sf.checkpoint(sch, ""), "", subgraph=core)


def test_graph_rewrites_are_pure() -> None:
    model = Layer()
    before = fingerprint(model)
    s0 = sf.create_schedule(model)
    s1 = sf.trace(s0, "", flatten=True)
    s1_print = s1.module.code
    s2 = sf.decompose(s1, "mlp.fc_in")
    s3 = sf.fuse(s2, "", sf.find(s2, "", bias_gelu)[0], compiler=None)
    s4 = sf.checkpoint(s3, "", subgraph=sf.find(s3, "", r"out\.norm")[0])
    sf.build(s4)(torch.randn(2, 16)).sum().backward()
    assert same(fingerprint(model), before) and s0.module is model
    assert s1.module.code == s1_print and s3.module is not s2.module
    assert s4["out.dense"].module is model.out.dense and s4["mlp.fc_out"].module is model.mlp.fc_out
    assert [str(h).split(".at(")[0] for h in s4.history] == ["trace", "decompose", "fuse", "checkpoint"]


def test_trace_hf_llama_decoder_layer_and_find() -> None:
    model = tiny_llama(1)
    layer = model.model.layers[0]
    x = torch.randn(2, 8, 64)
    pe = model.model.rotary_emb(x, torch.arange(8)[None].expand(2, 8))
    sch = sf.create_schedule(layer)
    traced = sf.trace(sch, "", example_inputs=((x,), {"position_embeddings": pe}))
    assert isinstance(traced.module, fx.GraphModule)
    assert traced["self_attn"].module is layer.self_attn and traced["mlp"].module is layer.mlp
    residuals = sf.find(traced, "", lambda a, b: a + b)
    assert len(residuals) == 2
    assert [m.modules for m in sf.find(traced, "", r"self_attn|mlp")] == [("self_attn",), ("mlp",)]
    sf.verify(traced, x, kwargs={"position_embeddings": pe})
    with pytest.raises(TypeError, match="not traced with"):
        traced.module(x, position_embeddings=pe, attention_mask=torch.zeros(2, 1, 8, 8))
    with pytest.raises(sf.ScheduleError, match="needs example inputs"):
        sf.trace(sch, "")


def test_trace_hf_gpt2_block_in_place_and_find() -> None:
    model = tiny_gpt2(1).eval()
    h = torch.randn(2, 8, 64)
    sch = sf.trace(sf.create_schedule(model), "transformer.h.0", example_inputs=(h,))
    block = sch["transformer.h.0"].module
    assert isinstance(block, fx.GraphModule) and sch["transformer.h.0.attn"].module is model.transformer.h[0].attn
    (m,) = sf.find(sch, "transformer.h.0", lambda x: call_mlp(x))
    assert m.modules == ("transformer.h.0.ln_2", "transformer.h.0.mlp")
    assert torch.equal(block(h), model.transformer.h[0](h))
    assert list(sf.build(sch).state_dict()) == list(model.state_dict())


def call_mlp(x: torch.Tensor) -> torch.Tensor:
    from slapo_fn.rewrites.graph import call_module

    return call_module("mlp", call_module("ln_2", x))


def hf_gpt2_mlp() -> nn.Module:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(0)
    return GPT2MLP(64, GPT2Config(n_embd=16, resid_pdrop=0.0))


def bias_gelu_new(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    from slapo_fn.rewrites.graph import call_module

    return call_module(r"act", x + bias)


def test_decompose_hf_conv1d_and_fuse_bias_with_gelu_new() -> None:
    model = hf_gpt2_mlp()
    x = torch.randn(2, 5, 16)
    traced = sf.trace(sf.create_schedule(model), "", example_inputs=(x,))
    sch = sf.decompose(traced, ["c_fc", "c_proj"])
    calls = [n.target for n in sch.module.graph.nodes if n.op in ("call_function", "call_module")]
    # still called for their matmul (read by shard as the Conv1Ds they were), each bias added after
    assert calls[:2] == ["c_fc", __import__("operator").add] and calls.count(__import__("operator").add) == 2
    assert [type(sch[p].module).__name__ for p in ("c_fc", "c_proj")] == ["SeparateBiasConv1D"] * 2
    assert sch["c_fc"].module.weight is model.c_fc.weight and is_conv1d(sch["c_fc"].module)
    assert list(sf.build(sch).state_dict()) == list(model.state_dict())
    sf.verify(sch, x, rtol=1e-5, atol=1e-6)
    (match,) = sf.find(sch, "", bias_gelu_new)
    assert match.ops == ("add", "act")
    fused = sf.fuse(sch, "", match, compiler=None)
    sf.verify(fused, x, rtol=1e-5, atol=1e-6)
    assert type(traced.module.c_fc).__name__ == "Conv1D"  # the input schedule is untouched


def test_fuse_with_inductor_draws_counter_dropout_masks_unless_fallback_random() -> None:
    from slapo_fn.kernels import CounterDropout, counter_dropout

    model = BertOutput()
    sch = sf.decompose(sf.trace(sf.create_schedule(model), ""), "dense")
    (match,) = sf.find(sch, "", bias_dropout_res_norm)
    fused = sf.fuse(sch, "", match)
    assert type(fused.module.fused.dropout) is CounterDropout and fused.module.fused.dropout.p == 0.1
    assert type(model.dropout) is nn.Dropout and type(sch.module.dropout) is nn.Dropout
    for kept in (sf.fuse(sch, "", match, options={"fallback_random": True}), sf.fuse(sch, "", match, compiler=None)):
        assert type(kept.module.fused.dropout) is nn.Dropout

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(self.fc(x), 0.2, training=True) * 2

    fsch = sf.decompose(sf.trace(sf.create_schedule(Functional()), ""), "fc")
    (match,) = sf.find(fsch, "", lambda x, b: F.dropout(x + b) * 2)
    region = sf.fuse(fsch, "", match).module.fused
    (node,) = [n for n in region.graph.nodes if n.op == "call_function" and "dropout" in str(n.target)]
    assert node.target is counter_dropout and node.args[1:] == (0.2, True, False)


@pytest.mark.slow
def test_fused_counter_dropout_trains_and_evaluates_like_eager() -> None:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertOutput as HFBertOutput

    torch.manual_seed(0)
    model = HFBertOutput(BertConfig(hidden_size=16, intermediate_size=64, hidden_dropout_prob=0.5))
    h, r = torch.randn(4, 32, 64), torch.randn(4, 32, 16)
    sch = sf.decompose(sf.trace(sf.create_schedule(model), "", example_inputs=(h, r)), "dense")
    fused = sf.fuse(sch, "", sf.find(sch, "", bias_dropout_res_norm)[0])
    sf.verify(fused, h, r, rtol=1e-4, atol=1e-5)  # eval mode: no dropout, the same numbers as eager
    built = sf.build(fused).train()
    out = built(h, r)
    out.sum().backward()
    assert not torch.allclose(out, built.eval()(h, r)) and torch.isfinite(built.dense.bias.grad).all()

    # the compiled backward applies the forward's mask: d(sum y)/d bias = column sums of mask / (1 - p)
    drop = nn.Sequential(nn.Linear(64, 16), nn.Dropout(0.5))
    dsch = sf.decompose(sf.trace(sf.create_schedule(drop), ""), "0")
    dbuilt = sf.build(sf.fuse(dsch, "", sf.find(dsch, "", lambda x, b: F.dropout(x + b))[0])).train()
    y = dbuilt(h)
    y.sum().backward()
    kept = (y != 0).float()
    assert abs(float(kept.mean()) - 0.5) < 0.05
    assert torch.allclose(dbuilt.get_submodule("0").bias.grad, (kept * 2.0).sum((0, 1)))
