"""What the plan knows about the layouts that syncs state, without running anything
(a fake 2-rank mesh): a stated ``src`` nothing in the schedule makes, a row's input stated
against its columns, a sharded module's output stated twice or from another layout, a
Megatron pair half gathered, a gather inside a sequence-parallel chain — each refused
with the module named — and the collectives the plan counts where syncs gather a pair's
activation or split a column's input. The same cases run on 2 ranks, equal or refused, in
``test_layout_properties.CLOSED``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from tp_regression_cases import Branches  # a(x) + b(x)

import slapo_fn as sf
from slapo_fn.dtensor.checks import refusals
from slapo_fn.dtensor.plan import plan
from slapo_fn.dtensor.testing import fake_mesh
from slapo_fn.rewrites._common import INSTALLED


class Block(nn.Module):
    """A hand-written block (not ``torch.nn``'s): ``fc2(gelu(fc1(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Softmaxed(nn.Module):
    """``fc2(softmax(fc1(x)))``: code between the pair that mixes the features."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.softmax(self.fc1(x), dim=-1))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class Untraceable(nn.Module):
    """A hand-written block fx cannot trace (control flow on a value): its flow is unknown."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if x.sum() > 0 else self.fc(-x)


class UntracedSum(nn.Module):
    """A hand-written sum over the features behind a branch on a value (fx cannot trace it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True) if x.sum() > 0 else -x.sum(-1, keepdim=True)


class Sum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True)


class LocalSum(nn.Module):
    """Hand-written tensor parallelism: sums this rank's half of the features."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.chunk(2, -1)[0].sum(-1, keepdim=True)


def schedule(model: nn.Module) -> sf.Schedule:
    return sf.create_schedule(model, mesh=fake_mesh(2))


def refused(sch: sf.Schedule) -> list[tuple[str, str]]:
    """The statements the plan's layouts contradict: build refuses them."""
    return [(p.path, p.reason) for p in refusals(sch, plan(sch))]


def off_local(sch: sf.Schedule) -> list[tuple[str, str]]:
    """What keeps the model off local shards: a contradiction (refused), or code the plan
    cannot prove right on them (the model then runs on DTensor activations)."""
    p = plan(sch)
    return [(q.path, q.reason) for q in (*refusals(sch, p), *p.on_dtensors)]


@pytest.mark.parametrize("src", [Partial(), Shard(1), Shard(-1)])
def test_a_src_the_data_flow_contradicts_is_refused(src: object) -> None:
    sch = sf.shard(schedule(nn.Sequential(Block(), Block())), "1.fc1", axis=0)  # features split after it
    ((path, reason),) = refused(sf.sync(sch, "0", "fwd_post", Replicate(), src=src))
    assert path == "0" and "by the data flow, what reaches it leaves its output Replicate()" in reason
    ((path, reason),) = refused(sf.sync(sch, "1", "fwd_pre", Replicate(), src=src))
    assert path == "1" and "by the data flow its input arrives Replicate()" in reason


@pytest.mark.parametrize(
    ("src", "words"),
    [(Partial(), "sum the ranks' copies"), (Shard(1), "gather copies"), (Shard(-1), "gather copies")],
)
def test_where_the_flow_is_unknown_a_src_nothing_in_the_schedule_makes_is_refused(src: object, words: str) -> None:
    sch = sf.sync(schedule(nn.Sequential(Untraceable())), "0", "fwd_post", Replicate(), src=src)
    ((path, reason),) = refused(sch)
    assert path == "0" and "nothing in the schedule makes" in reason and words in reason
    # this rank's features handed to a module's own code, which may sum them (a partial sum), or
    # give them back: trusted
    split = sf.sync(schedule(nn.Sequential(nn.Linear(8, 8), UntracedSum())), "1", "fwd_pre", Shard(-1))
    assert refused(sf.sync(split, "1", "fwd_post", Replicate(), src=src)) == [] or src == Shard(1)
    col = sf.shard(schedule(nn.Sequential(nn.Linear(8, 8), UntracedSum())), "0", axis=0)
    # a lone column gathers its output: nothing split reaches a module's code, so no partial sum
    lone = refused(sf.sync(col, "1", "fwd_post", Replicate(), src=src))
    assert [p for p, _ in lone] == ["1"]


def test_a_src_the_schedule_makes_there_is_trusted() -> None:
    # this rank's features summed by a hand-written module: a partial sum (Slapo's sync)
    summed = sf.sync(schedule(nn.Sequential(nn.Linear(8, 8), Sum())), "1", "fwd_pre", Shard(-1))
    assert refused(sf.sync(summed, "1", "fwd_post", Replicate(), src=Partial())) == []
    # a chain member's output is a sequence shard
    base = schedule(nn.Sequential(Block(), Block()))
    sp = sf.sequence_parallel(sf.shard(sf.shard(base, "1.fc1", axis=0), "1.fc2", axis=1), ["1"])
    assert refused(sf.sync(sp, "1", "fwd_post", Replicate(), src=Shard(1))) == []
    # a sync from a layout to itself moves nothing
    alone = schedule(nn.Sequential(Block()))
    assert refused(sf.sync(alone, "0", "fwd_post", Shard(1), src=Shard(1))) == []


def test_a_module_installed_by_replace_may_compute_this_ranks_share() -> None:
    base = schedule(nn.Sequential(nn.Linear(8, 8), Block()))
    plain = sf.sync(base, "1", "fwd_post", Replicate(), src=Partial())
    assert [p for p, _ in refused(plain)] == ["1"]
    installed = sf.replace(base, "1", LocalSum(), check_shapes=False)
    assert str(installed.annotations.get("1", INSTALLED)) == "LocalSum in place of Block"
    assert refused(sf.sync(installed, "1", "fwd_post", Replicate(), src=Partial())) == []
    assert base.annotations.get("1", INSTALLED) is None  # the input is untouched


def test_a_rows_stated_input_must_be_what_arrives() -> None:
    branches = sf.shard(schedule(nn.Sequential(Branches())), "0.b", axis=1)
    ((path, reason),) = refused(sf.sync(branches, "0.b", "fwd_pre", Replicate(), src=Shard(-1)))
    assert path == "0.b" and "by the data flow its input arrives Replicate()" in reason
    pair = sf.shard(sf.shard(schedule(nn.Sequential(Block())), "0.fc1", axis=0), "0.fc2", axis=1)
    ((path, reason),) = refused(sf.sync(pair, "0.fc2", "fwd_pre", Replicate(), src=Partial()))
    assert path == "0.fc2" and "'0.fc1' keep their outputs split, so its input arrives Shard(-1)" in reason
    assert refused(sf.sync(pair, "0.fc2", "fwd_pre", Replicate(), src=Shard(-1))) == []
    assert refused(sf.sync(pair, "0.fc2", "fwd_pre", Replicate(), src=Replicate())) == []  # moves nothing


def test_a_sharded_modules_output_is_converted_once_from_its_own_layout() -> None:
    row = sf.shard(schedule(nn.Sequential(Block())), "0.fc2", axis=1)
    ((path, reason),) = refused(sf.sync(row, "0.fc2", "fwd_post", Replicate(), src=Shard(1)))
    assert path == "0.fc2" and "its output is Partial()" in reason
    twice = sf.sync(sf.sync(row, "0.fc2", "fwd_post", Shard(1)), "0.fc2", "fwd_post", Replicate())
    assert refused(twice) == []  # converted in turn, on DTensor activations (test_sync.py)
    assert [(p, "2 fwd_post syncs" in r) for p, r in off_local(twice)] == [("0.fc2", True)]
    assert refused(sf.sync(row, "0.fc2", "fwd_post", Shard(1), src=Partial())) == []


def test_a_row_split_by_features_before_a_residual_add_is_off_local() -> None:
    row = sf.shard(schedule(nn.Sequential(Branches())), "0.a", axis=1)
    problems = off_local(sf.sync(row, "0.a", "fwd_post", Shard(-1)))
    assert [p for p, _ in problems] == ["0.a"] and "combined with other values" in problems[0][1]


def test_half_of_a_pair_gathered_is_off_local() -> None:
    sch = sf.shard(schedule(nn.Sequential(Gated())), "0.gate", axis=0)
    sch = sf.shard(sf.shard(sch, "0.up", axis=0), "0.down", axis=1)
    ((path, reason),) = off_local(sf.sync(sch, "0.gate", "fwd_post", Replicate()))
    assert path == "0.down" and "'0.gate', which a fwd_post sync gathers" in reason and "'0.up'" in reason


def test_a_gather_inside_a_chain_runs_on_dtensors_but_its_exit_does_not() -> None:
    sch = sf.shard(schedule(nn.Sequential(Gated(), nn.LayerNorm(8))), "0.gate", axis=0)
    sch = sf.sequence_parallel(sf.shard(sf.shard(sch, "0.up", axis=0), "0.down", axis=1), ["0", "1"])
    ((path, reason),) = off_local(sf.sync(sch, "0.gate", "fwd_pre", Replicate(), src=Shard(1)))
    assert path == "0.gate" and "gathers the sequence for this module alone" in reason
    assert [p for p, _ in off_local(sf.sync(sch, "0", "fwd_post", Replicate()))] == ["0"]
    assert off_local(sf.sync(sch, "1", "fwd_post", Replicate())) == []  # the chain's exit


def test_a_pair_whose_activation_a_sync_gathers_counts_the_rows_local_split() -> None:
    pair = sf.shard(sf.shard(schedule(nn.Sequential(Block())), "0.fc1", axis=0), "0.fc2", axis=1)
    kept = plan(pair).counts()
    assert kept == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
    gathered = plan(sf.sync(pair, "0.fc1", "fwd_post", Replicate())).counts()
    # the sync all-gathers forward; the row splits the whole input itself, made from the column's
    # gather through GELU alone: its gradient is put among zeros, which the gather slices back
    assert gathered == {"forward": {"all_gather": 1, "all_reduce": 1}, "backward": {"all_reduce": 1}}
    # a gather stated on the row's input: its split's gradient all-gathers (a fwd_pre sync may sit
    # after code that needs the whole gradient)
    pre = plan(sf.sync(pair, "0.fc2", "fwd_pre", Replicate())).counts()
    assert pre == {"forward": {"all_gather": 1, "all_reduce": 1}, "backward": {"all_gather": 1, "all_reduce": 1}}
    # code between that mixes the features (a softmax over them): the gradient is gathered
    mixed = plan(sf.sync(sf.shard(sf.shard(schedule(nn.Sequential(Softmaxed())), "0.fc1", axis=0), "0.fc2", axis=1),
                         "0.fc1", "fwd_post", Replicate())).counts()
    assert mixed == pre


def test_a_column_handed_split_features_counts_its_gather_and_enters_alone() -> None:
    sch = sf.shard(sf.shard(schedule(nn.Sequential(Branches())), "0.a", axis=0), "0.b", axis=0)
    assert plan(sch).counts() == {"forward": {"all_gather": 2}, "backward": {"all_reduce": 1}}
    split = plan(sf.sync(sch, "0.a", "fwd_pre", Shard(-1))).counts()
    # split locally (backward all-gather), gathered back by the column (forward all-gather), and
    # the column enters the region with that tensor alone (its own backward all-reduce)
    assert split == {"forward": {"all_gather": 3}, "backward": {"all_gather": 1, "all_reduce": 2}}


def _megatron(prefix: str, names: tuple[str, ...], rows: tuple[str, ...]) -> sf.Combinator:
    step = None
    for name in names:
        at = sf.shard.at(name, axis=1 if name in rows else 0)
        step = at if step is None else step >> at
    assert step is not None
    return sf.foreach(prefix, step)


def test_a_wrong_src_inside_a_module_lists_layers_is_refused() -> None:
    """Decoder layers live in a ``ModuleList`` (no ``forward`` of its own) that the model's
    loop calls: what reaches ``layers.1`` is read from the model's flow. A stated src the
    flow contradicts there was trusted (a ``Partial()`` all-reduced a whole output: twice
    the value), on PyTorch's test ``Transformer`` and on a Hugging Face LLaMA whose
    config asks for a cache."""
    from models import tiny_llama
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    args = ModelArgs(n_layers=2, vocab_size=16, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0)
    torch_tp = _megatron("layers.*", ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                      "feed_forward.w1", "feed_forward.w2"), ("attention.wo", "feed_forward.w2"))
    sch = torch_tp(schedule(Transformer(args)))
    assert refused(sch) == []
    ((path, reason),) = refused(sf.sync(sch, "layers.0.feed_forward", "fwd_post", Replicate(), src=Partial()))
    assert path == "layers.0.feed_forward" and "leaves its output Replicate()" in reason
    ((path, reason),) = refused(sf.sync(sch, "layers.1.attention_norm", "fwd_pre", Replicate(), src=Shard(-1)))
    assert path == "layers.1.attention_norm" and "its input arrives Replicate()" in reason

    hf_tp = _megatron("model.layers.*", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
                      ("self_attn.o_proj", "mlp.down_proj"))
    llama = hf_tp(schedule(tiny_llama(2, use_cache=True)))
    assert refused(llama) == []
    ((path, reason),) = refused(sf.sync(llama, "model.layers.1.mlp", "fwd_post", Replicate(), src=Partial()))
    assert path == "model.layers.1.mlp" and "leaves its output Replicate()" in reason
    ((path, _),) = refused(sf.sync(llama, "model.norm", "fwd_pre", Replicate(), src=Shard(-1)))
    assert path == "model.norm"


def test_an_attention_with_head_counts_build_cannot_adjust_runs_on_dtensors() -> None:
    """Falcon-7B's multi-query attention: its fused ``query_key_value`` holds ``num_heads``
    query heads, then one key and one value head (``view(B, S, num_heads + 2, head_dim)``),
    so no head count build could make this rank's counts its features: its ``reshape(batch,
    self.num_heads, ...)`` would meet this rank's share. The plan cannot keep it on local
    shards, naming the column and the attention; the model runs on DTensor activations.
    Falcon's other layouts ([q|k|v] per head, [q q|k|v] per kv head) are whole groups of
    heads on each rank, whose counts build makes this rank's."""
    from transformers import FalconConfig, FalconForCausalLM

    def falcon(**arch: Any) -> sf.Schedule:
        cfg = FalconConfig(hidden_size=64, num_attention_heads=4, vocab_size=64, num_hidden_layers=1,
                           use_cache=False, **arch)
        return schedule(FalconForCausalLM(cfg))

    def sharded(base: sf.Schedule) -> sf.Schedule:
        return sf.shard(sf.shard(base, "transformer.h.0.self_attention.query_key_value", axis=0),
                        "transformer.h.0.self_attention.dense", axis=1)

    base = falcon(multi_query=True, new_decoder_architecture=False)
    ((path, reason),) = off_local(sharded(base))
    assert path == "transformer.h.0.self_attention.query_key_value"
    assert "'transformer.h.0.self_attention' counts heads in num_heads" in reason
    # its output gathered, the attention sees the whole features: accepted
    gathered = sf.sync(sf.shard(base, "transformer.h.0.self_attention.query_key_value", axis=0),
                       "transformer.h.0.self_attention.query_key_value", "fwd_post", Replicate())
    assert off_local(gathered) == []
    # the MLP beside it (no heads) is sharded as usual
    mlp = sf.shard(sf.shard(base, "transformer.h.0.mlp.dense_h_to_4h", axis=0), "transformer.h.0.mlp.dense_4h_to_h",
                   axis=1)
    assert off_local(mlp) == []
    assert off_local(sharded(falcon(num_kv_heads=2, new_decoder_architecture=True))) == []
    assert off_local(sharded(falcon(multi_query=False, new_decoder_architecture=False))) == []


def test_a_sync_or_chain_on_a_module_list_is_refused_when_stated() -> None:
    """An ``nn.ModuleList`` is never called (the model's loop calls its items): a sync or a
    chain boundary on it never ran, so ``sync(sch, 'layers', 'fwd_post', Shard(1))`` was
    accepted and silently did nothing. Refused at the call, naming its items; the input
    schedule is unchanged."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    sch = schedule(Transformer(ModelArgs(n_layers=2, vocab_size=16, max_seq_len=8, dim=16, n_heads=4)))
    calls = [
        lambda: sf.sync(sch, "layers", "fwd_post", Shard(1)),
        lambda: sf.sync(sch, "layers", "fwd_pre", Replicate(), src=Shard(1)),
        lambda: sf.sequence_parallel(sch, ["layers", "norm"]),
    ]
    for call in calls:
        with pytest.raises(sf.LayoutError) as e:
            call()
        assert "'layers': is a ModuleList with no forward of its own" in str(e.value)
        assert "select its items instead: 'layers.*'" in str(e.value)
    assert len(sch.annotations) == 0
    assert len(sf.sequence_parallel(sch, ["layers.*", "norm"]).annotations) == 3  # its items are accepted


class Spare(nn.Module):
    """``fc(x) + outer[0](x)``: ``spare`` is never called, ``alias`` is ``fc`` again,
    ``inner.fc1`` is never called either (its holder ``inner`` is not); ``outer`` is never
    called, but its item is, from here (as OPT's root calls ``model.decoder``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.spare, self.inner = nn.Linear(8, 8), nn.Linear(8, 8), Block()
        self.outer = nn.Sequential(Block())
        self.alias = self.fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.outer[0](x)


def test_a_statement_on_a_module_the_forward_never_calls_is_refused_at_build() -> None:
    """T5 reaches its ``shared`` embedding through ``encoder.embed_tokens`` and
    ``decoder.embed_tokens`` (its weight tied to theirs and the LM head's), never as
    ``shared``: a sync on it never ran, and build accepted it. Refused at build, every such
    path at once, naming the called paths that hold it; the schedule is unchanged."""
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                             dropout_rate=0.0, use_cache=False, decoder_start_token_id=0))
    sch = sf.sync(schedule(t5), "shared", "fwd_post", Shard(-1))
    before = sch.annotations
    with pytest.raises(sf.LayoutError) as e:
        sf.build(sch)
    said = str(e.value)
    assert "'shared': is never called in the model's forward, so its syncs would never run" in said
    assert "shares its parameters (tied) with 'decoder.embed_tokens', 'encoder.embed_tokens', 'lm_head'" in said
    assert "fix: state it on 'decoder.embed_tokens', 'encoder.embed_tokens', 'lm_head'" in said
    assert sch.annotations == before
    assert refused(sf.sync(schedule(t5), "encoder.embed_tokens", "fwd_post", Replicate())) == []  # it is called

    base = schedule(Spare())
    stated = sf.sync(sf.sync(sf.sync(base, "spare", "fwd_post", Shard(-1)), "alias", "fwd_pre", Replicate()),
                     "inner.fc1", "fwd_post", Shard(-1))
    found = dict(refused(stated))
    assert sorted(found) == ["alias", "inner.fc1", "spare"]  # all at once
    assert found["spare"].endswith("so its syncs would never run")
    assert "it is the same module as 'fc', which the forward calls" in found["alias"]
    assert refused(sf.sync(base, "fc", "fwd_pre", Replicate())) == []
    assert refused(sf.sync(base, "outer.0.fc1", "fwd_pre", Replicate())) == []  # run past its uncalled holder


def test_an_untraceable_module_with_nothing_planned_inside_gives_back_what_it_takes() -> None:
    """BERT's embeddings and Mixtral's routed experts cannot be traced; with nothing planned
    in them they compute on the whole values they are given, as the model does. What
    follows them was 'unknown', so a ``src=Partial()`` on a whole output was trusted (twice
    the value)."""
    from transformers import BertConfig, BertForMaskedLM, MixtralConfig, MixtralForCausalLM

    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4))
    mlp = sf.foreach("bert.encoder.layer.*", sf.shard.at("intermediate.dense", axis=0)
                     >> sf.shard.at("output.dense", axis=1))(schedule(bert))
    assert refused(mlp) == []
    ((path, reason),) = refused(sf.sync(mlp, "bert.encoder.layer.0.output", "fwd_post", Replicate(), src=Partial()))
    assert path == "bert.encoder.layer.0.output" and "leaves its output Replicate()" in reason
    assert refused(sf.sync(mlp, "bert.encoder.layer.0.output.dense", "fwd_post", Replicate(), src=Partial())) == []

    mixtral = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               num_local_experts=4))
    attn = _megatron("model.layers.*", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                        "self_attn.o_proj"), ("self_attn.o_proj",))(schedule(mixtral))
    assert refused(attn) == []
    ((path, reason),) = refused(sf.sync(attn, "model.layers.0.mlp", "fwd_post", Replicate(), src=Partial()))
    assert path == "model.layers.0.mlp" and "leaves its output Replicate()" in reason


def test_a_wrong_src_after_a_reused_dropout_is_refused() -> None:
    """T5's stack calls one dropout after the embedding and again after its final norm: the
    flow merged the two calls, so the first block seemed fed by the final norm (a cycle,
    'unknown'), and a ``src=Partial()`` on a block's whole output was trusted."""
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))
    ff = _megatron("encoder.block.*", ("layer.1.DenseReluDense.wi", "layer.1.DenseReluDense.wo"),
                   ("layer.1.DenseReluDense.wo",))(schedule(t5))
    assert refused(ff) == []
    block = "encoder.block.0.layer.1.DenseReluDense"
    ((path, reason),) = refused(sf.sync(ff, block, "fwd_post", Replicate(), src=Partial()))
    assert path == block and "leaves its output Replicate()" in reason
    assert refused(sf.sync(ff, f"{block}.wo", "fwd_post", Replicate(), src=Partial())) == []


def test_a_partial_src_where_the_flow_is_unknown_needs_a_module_that_could_sum_split_features() -> None:
    """Where fx cannot trace a model's stack (OPT's decoder did not: ``torch.ones(batch,
    seq)`` in its mask code), what its layers make is 'unknown', and a ``src=Partial()``
    on a layer's whole output was trusted because columns existed somewhere: an
    all-reduce of a replicated value, twice the model's numbers. Columns paired with rows
    by the data flow hand their split to rows alone, which reduce it: no module's code
    could have made a partial sum, so the sync is refused. Where a sync hands split
    features to a module's own code, the ``src`` is still trusted (a column paired by
    module order alone is refused itself)."""
    from transformers import OPTConfig, OPTForCausalLM

    stack = sf.foreach("layers.*", sf.shard.at("fc1", axis=0) >> sf.shard.at("fc2", axis=1))(
        schedule(UntracedStack()))
    assert off_local(stack) == []
    ((path, reason),) = off_local(sf.sync(stack, "layers.0", "fwd_post", Replicate(), src=Partial()))
    assert path == "layers.0" and "nothing in the schedule makes Partial() there" in reason
    assert off_local(sf.sync(stack, "layers.0.fc2", "fwd_post", Replicate(), src=Partial())) == []  # a row's own
    # paired by module order (fx cannot trace the parent): refused whatever the src
    pair = sf.shard(sf.shard(schedule(nn.Sequential(UntracedPair(), nn.Linear(8, 8))), "0.fc1", axis=0),
                    "0.fc2", axis=1)
    assert [p for p, _ in off_local(pair)] == ["0"]

    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                   num_attention_heads=4, max_position_embeddings=32, use_cache=False))
    megatron = _megatron("model.decoder.layers.*", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                    "self_attn.out_proj", "fc1", "fc2"), ("self_attn.out_proj", "fc2"))
    sch = megatron(schedule(opt))
    assert off_local(sch) == []
    for layer in ("model.decoder.layers.0", "model.decoder.layers.1.self_attn"):
        assert [p for p, _ in off_local(sf.sync(sch, layer, "fwd_post", Replicate(), src=Partial()))] == [layer]
    assert off_local(sf.sync(sch, "model.decoder.layers.0.fc2", "fwd_post", Replicate(), src=Partial())) == []


class UntracedPair(nn.Module):
    """``fc2(fc1(x))`` behind a branch on a value, so fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h if h.sum() > 0 else -h)


class UntracedStack(nn.Module):
    """Two residual :class:`Block` layers in a ``ModuleList``, looped over behind a branch
    on a value (fx cannot trace the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x) if x.sum() > 0 else x - layer(x)
        return x


def test_split_features_stated_where_the_flow_is_unknown_need_a_column_that_hands_them_there() -> None:
    """Bart's decoder layers call their cross-attention only with encoder states, which
    the traced layer is not given: what reaches ``encoder_attn`` is 'unknown', and a
    ``src=Shard(-1)`` there was trusted because columns existed somewhere. Gathering a
    whole value made it twice as wide (a raw shape error inside the model). The columns
    here are paired with their rows by the data flow, so this rank's features live only
    between them: refused, naming the module."""
    sch = _bart_megatron()
    assert refused(sch) == []
    layer = "model.decoder.layers.0"
    for path, mode in [(f"{layer}.encoder_attn", "fwd_post"), (f"{layer}.encoder_attn_layer_norm", "fwd_pre"),
                       (f"{layer}.encoder_attn.k_proj", "fwd_pre")]:
        assert [p for p, _ in refused(sf.sync(sch, path, mode, Replicate(), src=Shard(-1)))] == [path]
    # a reduce-scatter over the features does not make its own src plausible
    self_made = sf.sync(sch, f"{layer}.encoder_attn", "fwd_post", Shard(-1), src=Partial())
    assert any(p == f"{layer}.encoder_attn" and "nothing in the schedule makes Partial()" in r
               for p, r in refused(self_made))


def test_a_token_shard_stated_where_the_flow_is_unknown_needs_a_chain_there() -> None:
    """With the encoder's layers in a sequence-parallel chain, a chain existed over the
    axis, so a ``src=Shard(1)`` was trusted anywhere the flow is unknown (Bart's
    cross-attention): the sync gathered a whole value along the sequence, twice as long.
    A chain's shard lives in its members (its exit gathers it back): refused outside them,
    trusted on a member."""
    sch = _megatron("model.encoder.layers.*", (*_ATTN[:4], "fc1", "fc2"), ("self_attn.out_proj", "fc2"))(
        _bart_megatron())
    sch = sf.sequence_parallel(sch, ["model.encoder.layers.*"])
    assert refused(sch) == []
    layer = "model.decoder.layers.0"
    for path, mode in [(f"{layer}.encoder_attn", "fwd_post"), (f"{layer}.encoder_attn.k_proj", "fwd_pre"),
                       (f"{layer}.encoder_attn_layer_norm", "fwd_pre")]:
        ((where, reason),) = refused(sf.sync(sch, path, mode, Replicate(), src=Shard(1)))
        assert where == path and "nothing in the schedule makes Shard(1) there" in reason
    assert refused(sf.sync(sch, "model.encoder.layers.0", "fwd_post", Replicate(), src=Shard(1))) == []


_ATTN = tuple(f"{a}.{n}" for a in ("self_attn", "encoder_attn") for n in ("q_proj", "k_proj", "v_proj", "out_proj"))


def _bart_megatron() -> sf.Schedule:
    """A tiny Bart whose decoder layers are Megatron-sharded, cross-attention included."""
    from transformers import BartConfig, BartForConditionalGeneration

    bart = BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32))
    return _megatron("model.decoder.layers.*", (*_ATTN, "fc1", "fc2"),
                     ("self_attn.out_proj", "encoder_attn.out_proj", "fc2"))(schedule(bart))


class UntracedAttention(nn.Module):
    """A hand-written attention fx cannot trace (a branch on a value): its q/k/v and out
    pair by module order, and the code between them is unknown."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = (q @ k.transpose(-1, -2)).softmax(-1)
        return self.out(scores @ v if x.sum() > 0 else v)


class UntracedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = UntracedAttention(), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


def test_a_pair_matched_by_module_order_alone_runs_on_dtensors_until_its_columns_gather() -> None:
    """An attention fx cannot trace pairs its q/k/v and out by module order alone, and
    what its code does with this rank's features between them is unknown (a view by a
    head count slapo_fn does not know would take them for whole heads). It used to be
    trusted, and so was a ``src=Partial()`` on it. The model runs on DTensor activations,
    the plan naming the attention and the syncs that gather its columns; with those, on
    local shards, and a ``src=Partial()`` nothing makes is refused anywhere."""
    sch = _megatron("*", ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.fc1", "mlp.fc2"),
                    ("attn.out", "mlp.fc2"))(schedule(nn.Sequential(UntracedLayer(), UntracedLayer())))
    problems = plan(sch).on_dtensors
    assert [p.path for p in problems] == ["0.attn", "1.attn"]
    assert "fx cannot trace its forward" in problems[0].reason and "'0.attn.q', '0.attn.k', '0.attn.v'" in (
        problems[0].reason)
    assert "sf.sync(sch, '0.attn.v', 'fwd_post', Replicate())" in problems[0].fix
    gathered = sch
    for layer in ("0", "1"):
        for col in ("q", "k", "v"):
            gathered = sf.sync(gathered, f"{layer}.attn.{col}", "fwd_post", Replicate())
    assert off_local(gathered) == []
    for module in ("1", "1.attn", "1.mlp"):
        ((path, reason),) = off_local(sf.sync(gathered, module, "fwd_post", Replicate(), src=Partial()))
        assert path == module and "nothing in the schedule makes Partial() there" in reason


def test_gpt_neos_attention_traces_so_its_row_is_known_to_reduce() -> None:
    """GPT-Neo's attention slices its causal-mask buffer by traced sizes
    (``self.bias[:, :, k - q:k, :k]``), which fx traced only once buffers were traced
    values too. Its q/k/v and out_proj now pair by the data flow, out_proj reduces its
    own output, and a ``src=Partial()`` on the attention itself is refused as well."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from slapo_fn.dtensor.flow import flow

    neo = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                         attention_types=[[["global", "local"], 1]], max_position_embeddings=32))
    fl = flow(neo.transformer.h[1].attn.attention)
    assert fl is not None and fl.feeders("out_proj") == {"v_proj", "attn_dropout"}
    sch = _megatron("transformer.h.*", ("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj",
                                        "attn.attention.out_proj", "mlp.c_fc", "mlp.c_proj"),
                    ("attn.attention.out_proj", "mlp.c_proj"))(schedule(neo))
    assert refused(sch) == []
    for module in ("transformer.h.1", "transformer.h.1.attn", "transformer.h.1.attn.attention"):
        ((path, reason),) = refused(sf.sync(sch, module, "fwd_post", Replicate(), src=Partial()))
        assert path == module and "Partial()" in reason
