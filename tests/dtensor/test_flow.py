"""dtensor/flow.py: the data flow among a parent's children, traced by need."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import tiny_llama
from torch import nn

import slapo_fn as sf
from slapo_fn.dtensor.flow import INPUT, OUTPUT, SIDE, Apart, ApartKind, flow, pointwise
from slapo_fn.dtensor.testing import fake_mesh


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)) + x)


class Heads(nn.Module):
    """Views by the input's shape: a shape is not data."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.size()
        return self.o(self.q(x).view(b, s, 2, 2).reshape(b, s, 4))


class Reads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.proj.weight, self.proj.bias)


class CastsLikeT5(nn.Module):
    """Reads a child's weight only for its dtype (T5's DenseReluDense): not a read."""

    def __init__(self) -> None:
        super().__init__()
        self.wo = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(x.to(self.wo.weight.dtype))


class Branchy(nn.Module):
    """Control flow on a tensor's values: fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else x


def test_feeders_and_consumers_look_through_pointwise_children() -> None:
    fl = flow(Residual())
    assert fl is not None
    assert fl.feeders("b") == {"act", INPUT}
    through = {"act"}.__contains__
    assert fl.feeders("b", through) == {"a", INPUT}
    assert fl.consumers("a", through) == {"b"}
    assert fl.consumers("b") == {OUTPUT}
    assert fl.reaching_output() == {"b"}


def test_shapes_read_for_a_view_are_not_data_and_same_input_is_one_value() -> None:
    fl = flow(Heads())
    assert fl is not None and fl.feeders("o") == {"q"}
    llama_layer = tiny_llama(1).model.layers[0]
    mlp = flow(llama_layer.mlp)
    assert mlp is not None and mlp.same_input("gate_proj", "up_proj") and not mlp.same_input("gate_proj", "down_proj")
    layer = flow(llama_layer)  # a decoder layer taking **kwargs traces through the wrapper
    assert layer is not None and layer.feeders("self_attn") == {"input_layernorm"}


def test_order_is_the_code_s_not_the_registration_s() -> None:
    """OPT's decoder registers its final norm before its layers and calls it after them."""
    from transformers import OPTConfig, OPTForCausalLM

    decoder = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                       num_attention_heads=2, word_embed_proj_dim=32)).model.decoder
    assert list(decoder._modules) == ["embed_tokens", "embed_positions", "final_layer_norm", "layers"]
    fl = flow(decoder)
    assert fl is not None
    assert fl.order == ("embed_tokens", "embed_positions", "layers.0", "layers.1", "final_layer_norm")


def test_functional_reads_are_recorded_and_untraceable_parents_have_no_flow() -> None:
    fl = flow(Reads())
    assert fl is not None and fl.reads == {"proj"} and not fl.called("proj")
    cast = flow(CastsLikeT5())
    assert cast is not None and cast.reads == set() and cast.feeders("wo") == {INPUT}
    assert flow(Branchy()) is None


def test_attention_that_unpacks_shapes_into_arguments_traces() -> None:
    """Hugging Face attention views by ``(*hidden_states.shape[:-1], -1, head_dim)``, which
    plain fx cannot trace, and unpacks ``position_embeddings``, declared optional: it traces
    with a tuple of sizes for each shape. The rotary ``cos``/``sin`` reach ``o_proj`` as
    side values, not as the hidden states; the attention weights returned beside the
    result are not its output; q/k/v are viewed into heads."""
    fl = flow(tiny_llama(1).model.layers[0].self_attn)
    assert fl is not None
    assert all(fl.feeders(c) == {INPUT} for c in ("q_proj", "k_proj", "v_proj"))
    assert fl.feeders("o_proj") == {"q_proj", "k_proj", "v_proj", SIDE} and fl.output == {"o_proj"}
    assert fl.same_input("q_proj", "v_proj") and fl.apart["k_proj"] == Apart(ApartKind.HEADS, dims=(-1, 16))


def test_a_models_root_traces_past_size_checks_token_shapes_and_its_cache() -> None:
    """PyTorch's test ``Transformer`` unpacks ``_bsz, seq_len = tokens.size()`` (token ids,
    two dimensions) and raises where ``seq_len > max_seq_len``: the shape tracer tries two
    dimensions and the other way of the size branch. A Hugging Face model whose config
    asks for a cache traces without one. Both loops call their ``ModuleList``'s items by
    their dotted names, in order."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    model = Transformer(ModelArgs(n_layers=2, vocab_size=16, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0))
    fl = flow(model)
    assert fl is not None and fl.feeders("layers.0", pointwise_only(model)) == {"tok_embeddings", "pos_embeddings"}
    assert fl.feeders("layers.1") == {"layers.0"} and fl.feeders("pos_embeddings") == set()
    assert fl.output == {"output"}
    cached = tiny_llama(2, use_cache=True).model
    fl = flow(cached)
    assert fl is not None and fl.feeders("layers.1") == {"layers.0", "rotary_emb"}
    assert fl.reaching_output() == {"norm"}


def test_factories_on_traced_sizes_and_dtypes_trace() -> None:
    """OPT's decoder builds its mask with ``torch.ones(batch, seq)`` and T5's attention its
    position bias with ``torch.zeros((1, heads, q, k))`` and ``torch.finfo(key.dtype)``:
    plain fx fails on a factory given traced sizes and on a dtype it cannot read. The shape
    tracer records the factory as a call on sizes (no data reaches it) and answers a
    dtype, so both trace; the factories are torch's own again after the trace."""
    from transformers import OPTConfig, OPTForCausalLM, T5Config, T5ForConditionalGeneration

    ones = torch.ones
    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                   num_attention_heads=4, max_position_embeddings=32, use_cache=False))
    fl = flow(opt.model.decoder)
    assert fl is not None and fl.feeders("layers.1") == {"layers.0"}
    assert fl.feeders("layers.0") == {"embed_tokens", "embed_positions"}
    assert fl.reaching_output() == {"final_layer_norm"}
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))
    fl = flow(t5.encoder.block[0].layer[0].SelfAttention)
    assert fl is not None and all(fl.feeders(c) == {INPUT} for c in "qkv")
    assert fl.feeders("o") == {"q", "k", "v", "relative_attention_bias"} and fl.output == {"o"}
    assert torch.ones is ones and torch.ones(2).sum() == 2


def test_a_module_is_traced_with_the_values_its_caller_hands_it() -> None:
    """A decoder block calls its cross-attention only when handed encoder states, which a
    block traced alone is not: the values a parent hands a child (``Flow.given``) trace it.
    T5's cross-attention then reads k/v from its ``key_value_states`` and q from its hidden
    states, where traced alone all three read the hidden states; the plan's flows follow
    the calls down from the model, and predict the entries the run makes."""
    from transformers import T5Config, T5ForConditionalGeneration

    from slapo_fn.dtensor.lookups import _flow_of

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))
    block, cross = t5.decoder.block[0], t5.decoder.block[0].layer[1]
    alone = flow(block)
    assert alone is not None and not alone.called("layer.1") and flow(cross.EncDecAttention) is not None
    handed = flow(block, frozenset({"encoder_hidden_states"}))
    assert handed is not None and handed.called("layer.1") and "key_value_states" in handed.given["layer.1"]
    attn = flow(cross.EncDecAttention, frozenset({"key_value_states"}))
    assert attn is not None and attn.feeders("q") == {INPUT} and attn.feeders("k") == attn.feeders("v") == {SIDE}
    assert not attn.same_input("q", "k") and attn.same_input("k", "v")
    sch = sf.create_schedule(t5, mesh=fake_mesh(2))
    assert _flow_of(sch, "decoder.block.1.layer.1.EncDecAttention") == attn
    assert _flow_of(sch, "encoder.block.0.layer.0.SelfAttention").feeders("k") == {INPUT}


def test_models_alike_but_for_their_number_of_layers_have_their_own_flows() -> None:
    """The flow of a model names each layer its loop calls: one traced for two layers is no
    flow of four (the cache of flows by shape sees the items of the list)."""
    two, four = tiny_llama(2).model, tiny_llama(4).model
    assert flow(two) is not None and not flow(two).called("layers.2")
    fl = flow(four)
    assert fl is not None and fl.feeders("layers.3") == {"layers.2", "rotary_emb"}
    assert not fl.called("layers.4")  # its loop runs config.num_hidden_layers of them
    stack = Stack(2)
    assert flow(stack) is not None and not flow(stack).called("layers.2")
    deeper = flow(Stack(3))  # alike in class, forward and attributes read: not the flow of Stack(2)
    assert deeper is not None and deeper.feeders("layers.2") == {"layers.1"}
    stack.layers.append(nn.Linear(4, 4))  # the same list, an item more: traced again
    assert flow(stack) is not None and flow(stack).feeders("layers.2") == {"layers.1"}


class Stack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def pointwise_only(parent: nn.Module) -> Any:
    return lambda q: pointwise(parent.get_submodule(q))


def test_a_module_output_split_into_blocks_or_viewed_into_heads() -> None:
    class Packed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.gate_up, self.heads, self.out = (nn.Linear(8, 24), nn.Linear(8, 16), nn.Linear(8, 24),
                                                           nn.Linear(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).split(8, dim=2)
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            h = self.heads(x).view(*x.shape[:-1], 2, 12)
            return self.out(q * k + v + gate * up + h[..., :4].flatten(-2))

    fl = flow(Packed())
    assert fl is not None
    assert fl.apart == {"qkv": Apart(ApartKind.BLOCKS, dims=(8,)), "gate_up": Apart(ApartKind.BLOCKS, 2),
                        "heads": Apart(ApartKind.HEADS, dims=(2, 12))}


def test_an_output_sliced_at_fixed_positions() -> None:
    class Sliced(nn.Module):  # Phi-3's attention: q, k, v sliced out of qkv by their full widths
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(8, 16), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            qkv = self.qkv(x)
            q, k, v = qkv[..., :8], qkv[..., 8:12], qkv[..., 12:]
            return self.out(q + torch.cat([k, v], -1))

    fl = flow(Sliced())
    assert fl is not None and fl.apart == {"qkv": Apart(ApartKind.SLICES, 3)}
    sch = sf.shard(sf.shard(sf.create_schedule(Sliced(), mesh=fake_mesh(2)), "qkv", axis=0), "out", axis=1)
    # this rank's share holds other features than the slices take: not on local shards
    assert any("3 slices at fixed feature positions" in p.reason for p in sf.dtensor.plan(sch).on_dtensors)


def test_tracing_leaves_the_module_as_it_was_and_a_changed_attribute_traces_again() -> None:
    class Flag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.skip = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen = True  # set on the traced copy, not on this module
            return x if self.skip else self.b(self.a(x))

    m = Flag()
    fl = flow(m)
    assert fl is not None and fl.feeders("b") == {"a"} and not hasattr(m, "seen")
    m.skip = True
    again = flow(m)
    assert again is not None and not again.called("b")


def test_pointwise_modules() -> None:
    assert pointwise(nn.GELU()) and pointwise(nn.Dropout(0.1)) and pointwise(nn.Identity())
    assert not pointwise(nn.Softmax(-1)) and not pointwise(nn.LayerNorm(4)) and not pointwise(nn.GLU())


class _TanhGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * torch.sigmoid(1.702 * x)


class OwnGelu(nn.Module):  # BLOOM's BloomGelu: its own class, an autograd.Function of elementwise code
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TanhGelu.apply(x)


class OwnSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.softmax(-1)


class OwnCenter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True)


class Remembers(nn.Module):  # elementwise, but it keeps its last input: tracing must not set it
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x
        return x * 2


def test_a_module_of_elementwise_code_is_pointwise_and_one_over_its_features_is_not() -> None:
    remembers = Remembers()
    assert pointwise(remembers) and not hasattr(remembers, "last")
    assert pointwise(OwnGelu())
    assert not pointwise(OwnSoftmax()) and not pointwise(OwnCenter())
    holder = nn.Sequential(OwnGelu())  # a module with children is judged by them, not its code
    assert not pointwise(holder)


class GroupedHeads(nn.Module):
    """Falcon's and BLOOM's attention: q, k and v of each head side by side in one fused
    projection, taken out by an index of the group's dimension; the ALiBi bias it is handed
    is ``(batch * heads, 1, keys)``, added by ``baddbmm`` on the batch and heads merged."""

    def __init__(self, merged: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.merged = 2, 4, merged
        self.qkv, self.o = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, alibi: torch.Tensor) -> torch.Tensor:
        bsz, s, _ = x.shape
        fused = self.qkv(x).view(bsz, s, self.num_heads, 3, self.head_dim)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
        if self.merged:
            n = bsz * self.num_heads
            scores = alibi.baddbmm(q.reshape(n, s, self.head_dim), k.reshape(n, s, self.head_dim).mT)
            scores = scores.view(bsz, self.num_heads, s, s)
        else:
            scores = q @ k.mT + alibi.view(bsz, self.num_heads, 1, -1)
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(bsz, s, -1))


@pytest.mark.parametrize("merged", [True, False])
def test_a_bias_added_to_heads_merged_with_the_batch_is_found(merged: bool) -> None:
    from slapo_fn.dtensor.features import Meets

    fl = flow(GroupedHeads(merged))
    assert fl is not None
    assert fl.apart == {"qkv": Apart(ApartKind.HEADS, dims=(2, 3, 4))}
    # the batch and heads merged, the heads inner, at its first dimension (of 3)
    assert fl.per_head == {"alibi": Meets(-3, merged=True)}


def test_a_shape_unpacked_from_a_slice_of_it_is_a_read_of_its_length() -> None:
    """``bsz, s = x.shape[:2]`` then ``torch.arange(s)``: positions of this rank's tokens."""

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            _, s = x.shape[:2]
            return self.proj(x) + torch.arange(s, dtype=x.dtype)[:, None]

    fl = flow(Positions())
    assert fl is not None and fl.tokens[1].mixes is not None and "arange" in fl.tokens[1].mixes
    assert fl.tokens[0].mixes is None  # the batch's length is not read


def test_modules_alike_in_what_their_forward_reads_trace_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLaMA's attention layers differ in ``layer_idx``, which their forward reads only
    with a cache: the second layer's flow is the first's, traced once; a module whose
    forward reads an attribute that differs traces again."""
    import slapo_fn.dtensor.flow as flow_module

    traced: list[str] = []
    real = flow_module._trace

    def counting(parent: nn.Module, given: frozenset[str] = frozenset(), leaf: bool = False) -> Any:
        traced.append(type(parent).__name__)
        return real(parent, given, leaf)

    monkeypatch.setattr(flow_module, "_trace", counting)
    monkeypatch.setattr(flow_module, "_BY_SHAPE", {})
    layers = tiny_llama(2).model.layers
    first, second = flow(layers[0].self_attn), flow(layers[1].self_attn)
    assert first is second and first is not None and traced == ["LlamaAttention"]

    class Skips(nn.Module):
        def __init__(self, skip: bool) -> None:
            super().__init__()
            self.a, self.skip = nn.Linear(4, 4), skip

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if self.skip else self.a(x)

    kept, skipped = flow(Skips(False)), flow(Skips(True))
    assert kept is not None and skipped is not None and kept.called("a") and not skipped.called("a")
    assert traced.count("Skips") == 2


def test_what_a_child_is_returned_with_is_not_what_is_returned_beside_it() -> None:
    """LlamaForCausalLM returns the logits beside the model's cache and hidden states in a
    ModelOutput: the logits are combined with nothing else."""
    fl = flow(tiny_llama(1))
    assert fl is not None
    assert fl.returned_with("lm_head") == {"lm_head"}

    class Sum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x) * self.b(x), x

    summed = flow(Sum())
    assert summed is not None and summed.returned_with("a") == {"a", "b"}


def test_tracing_leaves_the_model_s_buffers_as_they_were() -> None:
    """GPT-J's attention assigns its ``embed_positions`` buffer in forward; traced on a copy
    that shared ``_buffers`` with the model, the model's buffer took the traced value and
    its next forward failed ("Input tensor rank should be one of [4, 5]")."""
    from transformers import GPTJConfig, GPTJForCausalLM

    model = GPTJForCausalLM(GPTJConfig(n_embd=64, n_head=4, n_layer=1, vocab_size=128, rotary_dim=8))
    attn = model.transformer.h[0].attn
    buffers = dict(attn._buffers)
    ids = torch.randint(0, 128, (2, 8))
    want = model(ids).logits
    flow(attn)
    assert attn._buffers == buffers and all(attn._buffers[k] is v for k, v in buffers.items())
    torch.testing.assert_close(model(ids).logits, want)


class Reuses(nn.Module):
    """One dropout called twice, as T5's stack does (after the embedding, after the final norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(4, 4), nn.Dropout(0.0), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.b(self.drop(self.a(x))))


def test_a_pointwise_child_called_twice_is_traced_as_code() -> None:
    fl = flow(Reuses())
    assert fl is not None and not fl.called("drop")
    assert fl.feeders("b") == {"a"} and fl.reaching_output() == {"b"}


class NamedHeads(nn.Module):
    """Attention whose head count is in ``self.nh`` and whose width is in ``self.dim``, names
    no list holds. ``use``: where else ``nh`` is read: ``"scale"`` scales q by it, ``"input"``
    views the input by it (neither is a size of the heads)."""

    def __init__(self, use: str = "") -> None:
        super().__init__()
        self.nh, self.hd, self.dim, self.use = 2, 4, 8, use
        self.q, self.k, self.o = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, s, _ = x.shape
        q = self.q(x).view(bsz, s, self.nh, self.hd).transpose(1, 2)
        k = self.k(x).view(bsz, s, self.nh, self.hd).transpose(1, 2)
        if self.use == "scale":
            q = q / self.nh
        if self.use == "input":
            x = x.view(bsz, s, self.nh, -1).flatten(-2)
        a = (q @ k.mT).softmax(-1) @ k
        return self.o(a.transpose(1, 2).reshape(bsz, s, self.dim)) + x


@pytest.mark.parametrize("use", ["", "scale", "input"])
def test_a_head_count_of_any_name_read_for_sizes_alone_is_found(use: str) -> None:
    """Traced again with ``nh`` doubled, q's and k's views count twice the heads and the
    code is the same but for the sizes of views of values computed from q and k: ``nh``
    counts their heads, and ``dim``, doubled alike, their width. Read for a scale, or to
    view the input, ``nh`` counts nothing build may change (nor then ``dim``)."""
    fl = flow(NamedHeads(use))
    assert fl is not None and fl.apart["q"] == Apart(ApartKind.HEADS, dims=(2, 4))
    assert dict(fl.counts) == ({"q": ("nh", "dim"), "k": ("nh", "dim")} if not use else {})


class MergedByWidth(nn.Module):
    """timm's attention merges its heads back by its input's width: ``B, N, C = x.shape``."""

    def __init__(self, by_width: bool) -> None:
        super().__init__()
        self.by_width = by_width
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape  # timm's names
        q, k, v = self.qkv(x).reshape(B, N, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        y = ((q @ k.mT).softmax(-1) @ v).transpose(1, 2)
        return self.proj(y.reshape(B, N, C) if self.by_width else y.reshape(B, N, -1))


def test_a_view_by_the_input_s_width_of_what_a_child_computed_is_noted() -> None:
    fl = flow(MergedByWidth(True))
    assert fl is not None and dict(fl.by_width) == {"qkv": "reshape(..., x's width)"}
    plain = flow(MergedByWidth(False))
    assert plain is not None and dict(plain.by_width) == {}
