"""Tensor / sequence / vocab parallel on attention, tiny LLaMA (GQA), GPT-2 (packed Conv1D),
embedding + LM head with the parallel loss, and a 2-D mesh — parity and exact collectives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import VOCAB, megatron_llama, tiny_gpt2, tiny_llama, token_ids
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from tp_checks import parity

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _attention(rank: int, world: int) -> dict:
    model = tiny_llama(1, attn_implementation="sdpa")
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 8, 64)
    rope = model.model.rotary_emb(x, torch.arange(8)[None].expand(2, 8))

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attn

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.attn(h, position_embeddings=rope, attention_mask=None)[0]

    rw = sf.scope(
        "attn",
        sf.shard.at("q_proj", axis=0)
        >> sf.shard.at("k_proj", axis=0)
        >> sf.shard.at("v_proj", axis=0)
        >> sf.shard.at("o_proj", axis=1),
    )
    return parity(Attn(), rw, (x,), shape=(world,))


@pytest.mark.parametrize("n", [2])
def test_attention_qkv_column_o_row_one_all_reduce_each_way(dist_pool, n: int) -> None:
    for r in dist_pool(n).run(_attention, timeout=90):
        assert r["fwd"] == {"all_reduce": 1}
        assert r["bwd"] == {"all_reduce": 1}  # q/k/v input gradients fused into one
        assert r["predicted"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


def _llama8() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, use_cache=False)
    return LlamaForCausalLM(cfg)


def _llama(rank: int, world: int) -> dict:
    model = tiny_llama(2) if world == 2 else _llama8()  # kv heads divisible by TP
    return parity(model, megatron_llama, (token_ids(),), shape=(world,))


@pytest.mark.parametrize("n", [2, 4])
def test_llama_gqa_decoder_parity(dist_pool, n: int) -> None:
    for r in dist_pool(n).run(_llama, timeout=120):
        # per decoder layer: 2 all-reduces forward (o_proj, down_proj), 2 backward (block inputs)
        assert r["fwd"] == {"all_reduce": 4}
        assert r["bwd"] == {"all_reduce": 4}
        assert r["predicted"] == {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}
        assert "model.layers.0.self_attn.k_proj.weight" in r["dtensors"]


def _gpt2(rank: int, world: int) -> dict:
    model = tiny_gpt2(2)
    rw = sf.foreach(
        "transformer.h.*",
        sf.shard.at("attn.c_attn", axis=1, packed=3)
        >> sf.shard.at("attn.c_proj", axis=0)
        >> sf.shard.at("mlp.c_fc", axis=1)
        >> sf.shard.at("mlp.c_proj", axis=0),
    )
    return parity(model, rw, (token_ids(),), shape=(world,))


def test_gpt2_packed_c_attn(dist2) -> None:
    for r in dist2.run(_gpt2, timeout=120):
        assert r["fwd"] == {"all_reduce": 4}
        assert r["bwd"] == {"all_reduce": 4}
        assert r["placements"]["transformer.h.0.attn.c_attn.weight"][0] == "_S(1, 3)"  # packed [Q|K|V]


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def _vocab(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = LM()
    ids = token_ids()
    labels = token_ids(seed=1)

    def loss(out: torch.Tensor, sch: sf.Schedule) -> torch.Tensor:
        if sch.mesh is None:
            return F.cross_entropy(out.flatten(0, 1), labels.flatten())
        return sf.vocab_parallel_cross_entropy(out, labels, sch.mesh)

    def rw(s: sf.Schedule) -> sf.Schedule:
        s = sf.shard(sf.shard(s, "embed", axis=0), "head", axis=0)
        return sf.sync(s, "head", "fwd_post", Shard(-1))

    return parity(model, rw, (ids,), shape=(world,), loss=loss)


@pytest.mark.parametrize("n", [2, 4])
def test_vocab_parallel_embedding_head_and_loss(dist_pool, n: int) -> None:
    for r in dist_pool(n).run(_vocab, timeout=90):
        # embedding: 1 all-reduce; head: input enter (backward all-reduce); loss: 3 all-reduces
        assert r["fwd"] == {"all_reduce": 4}
        assert r["bwd"] == {"all_reduce": 1}


def _sp(rank: int, world: int) -> dict:
    model = tiny_llama(2).model  # the decoder stack (embeddings, layers, final norm)

    def rw(s: sf.Schedule) -> sf.Schedule:
        s = megatron_llama(s, "layers.*")
        return sf.sequence_parallel(s, ["layers.*", "norm"])

    return parity(model, rw, (token_ids(seq=8),), shape=(world,),
                  loss=lambda out, _: out.last_hidden_state.pow(2).mean())


def test_sequence_parallel_llama_all_gathers_and_reduce_scatters_activations(dist2) -> None:
    for r in dist2.run(_sp, timeout=120):
        assert set(r["fwd"]) <= {"all_gather", "reduce_scatter"}, r["fwd"]
        # per layer: 2 all-gathers (block inputs) + 2 reduce-scatters (block outputs); + the exit all-gather
        assert r["fwd"] == {"all_gather": 5, "reduce_scatter": 4}
        # backward mirrors them; the gradients of the norm weights (2 per layer + the final norm),
        # which saw only this rank's sequence positions, are all-reduced together at the end of
        # backward (one collective), so every gradient is Replicate
        assert r["bwd"] == {"all_gather": 5, "reduce_scatter": 4, "all_reduce": 1}
        assert all(p == ("R",) for n, p in r["grad_placements"].items() if "norm" in n), r["grad_placements"]
        assert r["predicted"] == {"forward": r["fwd"], "backward": r["bwd"]}


def _sp_head(rank: int, world: int, returned: bool) -> dict:
    """A sequence-parallel LLaMA with its LM head column-parallel (torchtitan's layout);
    ``returned``: a model that also returns the final norm's output (read beside the head)."""
    model = tiny_llama(1)

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.lm_head = model.model, model.lm_head

        def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.model(ids).last_hidden_state
            return self.lm_head(h), h

    def rw(s: sf.Schedule) -> sf.Schedule:
        s = sf.sequence_parallel(megatron_llama(s, "model.layers.*"), ["model.layers.*", "model.norm"])
        return sf.shard(s, "lm_head", axis=0)

    if not returned:
        return parity(model, rw, (token_ids(seq=8),), shape=(world,))
    return parity(Both(), rw, (token_ids(seq=8),), shape=(world,),
                  loss=lambda out, _: out[0].pow(2).mean() + out[1].pow(3).mean())


@pytest.mark.parametrize("returned", [False, True], ids=["head-alone", "also-returned"])
def test_a_column_after_the_chain_is_entered_by_its_exit(dist2, returned: bool) -> None:
    """The final norm's output, read by the column-parallel LM head alone, is gathered along
    the sequence by the chain's exit with a reduce-scatter of its gradient (PyTorch's
    ``ColwiseParallel(input_layouts=Shard(1))``): the head enters no region of its own, and
    the async-TP matcher sees the gather and the scatter beside the head's matmuls. Where
    the model returns that output too, its gradient is whole: the exit slices it back and
    the head's input gradient is all-reduced, as before."""
    for r in dist2.run(_sp_head, returned, timeout=150):
        assert r["predicted"] == {"forward": r["fwd"], "backward": r["bwd"]}, r
        # the layer's 2, the exit's and the head's logits; the layer's 2
        assert r["fwd"] == {"all_gather": 4, "reduce_scatter": 2}, r
        if returned:  # the head's input gradient and the norms' gradients all-reduced
            assert r["bwd"] == {"all_gather": 3, "reduce_scatter": 2, "all_reduce": 2}, r
        else:  # the exit's reduce-scatter; the norms' gradients alone are all-reduced
            assert r["bwd"] == {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 1}, r


def _bart_cross(rank: int, world: int) -> dict:
    from models import tiny_bart

    def rw(s: sf.Schedule) -> sf.Schedule:
        attn = "decoder.layers.*.encoder_attn."
        return sf.shard(sf.shard(s, attn + "{q_proj,k_proj,v_proj}", axis=0), attn + "out_proj", axis=1)

    ids = token_ids()
    return parity(tiny_bart(), rw, (ids, torch.ones_like(ids), token_ids(seed=1)), shape=(world,), tracker=False,
                  loss=lambda out, _: out.last_hidden_state.float().pow(2).mean())


def test_columns_in_different_layers_reading_one_tensor_enter_once(dist2) -> None:
    """Every decoder layer's cross-attention k/v read the encoder's output, handed down
    unchanged through the decoder and its layers: one entry for all of them (their
    partial input gradients summed by autograd, then one all-reduce, as PyTorch's Partial
    DTensor gradients are), beside each layer's q entered on its own hidden states."""
    for r in dist2.run(_bart_cross, timeout=120):
        assert r["fwd"] == {"all_reduce": 2} and r["bwd"] == {"all_reduce": 3}, r
        assert r["predicted"] == {"forward": r["fwd"], "backward": r["bwd"]}, r


def _two_d(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    from models import MLP

    model = MLP(8, 16)
    x = torch.randn(2, 3, 8)
    return parity(model, lambda s: sf.shard(sf.shard(s, "fc1", axis=0), "fc2", axis=1), (x,),
                  shape=(2, world // 2), names=("dp", "tp"))


def test_two_d_mesh_leaves_dp_replicated(dist4) -> None:
    for r in dist4.run(_two_d, timeout=90):
        # parameters live on the tp sub-mesh: replicated over dp (as FSDP2's 2-D composition expects)
        assert r["meshes"]["fc1.weight"] == r["meshes"]["fc2.bias"] == ("tp",)
        assert r["placements"]["fc1.weight"] == (str(Shard(0)),)
        assert r["placements"]["fc2.weight"] == (str(Shard(1)),)
        assert r["placements"]["fc2.bias"] == (str(Replicate()),)
        assert r["fwd"] == {"all_reduce": 1} and r["bwd"] == {"all_reduce": 1}


def _bert(rank: int, world: int) -> dict:
    from models import tiny_bert

    def megatron(s: sf.Schedule) -> sf.Schedule:
        layer = "encoder.layer.*."
        s = sf.shard(sf.shard(s, layer + "attention.self.{query,key,value}", axis=0), layer + "attention.output.dense",
                     axis=1)
        return sf.shard(sf.shard(s, layer + "intermediate.dense", axis=0), layer + "output.dense", axis=1)

    torch.manual_seed(0)
    return parity(tiny_bert(2), megatron, (token_ids(),), shape=(world,), tracker=False,
                  loss=lambda out, _: out.last_hidden_state.float().pow(2).mean())


def test_bert_pairs_its_columns_with_rows_in_sibling_modules(dist2) -> None:
    """BERT keeps q/k/v in ``attention.self`` and their row in ``attention.output`` (and the
    MLP's in ``intermediate`` and ``output``): paired across their parents, one all-reduce
    forward and one backward per block, as Megatron-LM's BERT (was 20 collectives for 2
    layers: every column's output gathered, every row's input split again)."""
    for r in dist2.run(_bert, timeout=120):
        assert not r["on_dtensors"]
        assert r["fwd"] == {"all_reduce": 4} and r["bwd"] == {"all_reduce": 4}, r
        assert r["predicted"] == {"forward": r["fwd"], "backward": r["bwd"]}
