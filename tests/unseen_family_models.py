"""The families of ``test_unseen_families.py``, which slapo_fn has no recipe for: each a
tiny random model built from a config (or written here, as nanoGPT, timm's ViT, MLP-Mixer
and torchtitan's LLaMA are), its inputs, and a hand-written Megatron plan (and, where the
family has one, its own ``base_model_tp_plan``). No hub.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from models import NanoAttention, NanoChunkAttention, NanoGPT, tiny_bart
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import slapo_fn as sf

VOCAB = 128
Plan = Callable[[sf.Schedule], sf.Schedule]


def _ids(seq: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))


def _lm_kw() -> dict[str, Any]:
    return {"vocab_size": VOCAB, "num_hidden_layers": 2, "use_cache": False, "attn_implementation": "eager"}


# ----------------------------------------------------------------------------- models and plans


def _column(*names: str, packed: int = 1) -> sf.Rewrite:
    rw = sf.shard.at(names[0], axis=0, packed=packed)
    for name in names[1:]:
        rw = rw >> sf.shard.at(name, axis=0, packed=packed)
    return rw


def _row(name: str) -> sf.Rewrite:
    return sf.shard.at(name, axis=1)


def _llama_like(layers: str) -> sf.Rewrite:
    attn = sf.scope("self_attn", _column("q_proj", "k_proj", "v_proj") >> _row("o_proj"))
    return sf.foreach(layers, attn >> sf.scope("mlp", _column("gate_proj", "up_proj") >> _row("down_proj")))


def _mistral() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        **_lm_kw())
    return MistralForCausalLM(cfg), (_ids(),), _llama_like("model.layers.*")


def _phi3(hidden: int, kv_heads: int) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        from transformers import Phi3Config, Phi3ForCausalLM

        cfg = Phi3Config(hidden_size=hidden, intermediate_size=128, num_attention_heads=4, num_key_value_heads=kv_heads,
                         pad_token_id=0, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                         attention_dropout=0.0, **_lm_kw())
        plan = sf.foreach("model.layers.*",
                          sf.scope("self_attn", _column("qkv_proj", packed=3) >> _row("o_proj"))
                          >> sf.scope("mlp", _column("gate_up_proj", packed=2) >> _row("down_proj")))
        return Phi3ForCausalLM(cfg), (_ids(),), plan

    return make


def _gemma2() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, sliding_window=4, **_lm_kw())
    return Gemma2ForCausalLM(cfg), (_ids(),), _llama_like("model.layers.*")


def _fused_block(layers: str, attn: str, qkv: str, packed: int) -> Plan:
    """q|k|v fused in ``attn.qkv`` (column, ``packed``), ``attn.dense`` row; ``mlp.dense_h_to_4h`` column,
    ``mlp.dense_4h_to_h`` row (the GPT-NeoX / Falcon / BLOOM names)."""
    return sf.foreach(layers,
                      sf.scope(attn, _column(qkv, packed=packed) >> _row("dense"))
                      >> sf.scope("mlp", _column("dense_h_to_4h") >> _row("dense_4h_to_h")))


def _neox(packed: int) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    # query_key_value's rows are per head [q_h | k_h | v_h]: a plain column shard keeps whole heads;
    # packed=3 cuts it as if it were [Q | K | V] (GPT-2's layout), which it is not
    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        cfg = GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0, **_lm_kw())
        plan = _fused_block("gpt_neox.layers.*", "attention", "query_key_value", packed)
        return GPTNeoXForCausalLM(cfg), (_ids(),), plan

    return make


def _gpt_neo() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    # global and local (sliding window) attention; the causal mask is a buffer sliced by sizes
    cfg = GPTNeoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=32,
                       attention_types=[[["global", "local"], 1]], window_size=4, embed_dropout=0.0,
                       attention_dropout=0.0, resid_dropout=0.0, use_cache=False, attn_implementation="eager")
    plan = sf.foreach("transformer.h.*",
                      sf.scope("attn.attention", _column("q_proj", "k_proj", "v_proj") >> _row("out_proj"))
                      >> sf.scope("mlp", _column("c_fc") >> _row("c_proj")))
    return GPTNeoForCausalLM(cfg), (_ids(),), plan


def _falcon(**arch: Any) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    # query_key_value's rows are per group of heads, which a plain column shard keeps whole: per kv
    # head [q q | k | v] (the new decoder architecture), per head [q | k | v] (the old one, with
    # rotary positions or with ALiBi built for every head and merged with the batch)
    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        from transformers import FalconConfig, FalconForCausalLM

        cfg = FalconConfig(hidden_size=64, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                           **arch, **_lm_kw())
        return FalconForCausalLM(cfg), (_ids(),), _fused_block("transformer.h.*", "self_attention",
                                                               "query_key_value", 1)

    return make


def _bloom() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import BloomConfig, BloomForCausalLM

    kw = _lm_kw()
    cfg = BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0,
                      attention_dropout=0.0, use_cache=False, attn_implementation=kw["attn_implementation"])
    return BloomForCausalLM(cfg), (_ids(),), _fused_block("transformer.h.*", "self_attention", "query_key_value", 1)


def _seq2seq_plan() -> Plan:
    def attn(name: str) -> sf.Rewrite:
        return sf.scope(name, _column("q_proj", "k_proj", "v_proj") >> _row("out_proj"))

    mlp = _column("fc1") >> _row("fc2")
    return sf.foreach("encoder.layers.*", attn("self_attn") >> mlp) >> sf.foreach(
        "decoder.layers.*", attn("self_attn") >> attn("encoder_attn") >> mlp)


def _bart() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    ids = _ids()
    return tiny_bart(), (ids, torch.ones_like(ids), _ids(seed=1)), _seq2seq_plan()


class _Whisper(nn.Module):
    """``WhisperModel`` fed ``input_features`` and ``decoder_input_ids`` positionally."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor, decoder_ids: torch.Tensor) -> Any:
        return self.model(input_features=features, decoder_input_ids=decoder_ids)


def _whisper() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                        max_source_positions=16, max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, use_cache=False, attn_implementation="eager", pad_token_id=0,
                        bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)
    model = _Whisper(WhisperModel(cfg))
    # frozen sinusoidal positions: parity wants a gradient on every parameter; the forward is unchanged
    model.model.encoder.embed_positions.weight.requires_grad_(True)
    features = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))

    def plan(sch: sf.Schedule) -> sf.Schedule:
        return sf.scope("model", _seq2seq_plan())(sch)

    return model, (features, _ids()), plan


def _vit() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=16,
                    patch_size=4, num_channels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    attn_implementation="eager")
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    plan = sf.foreach("layers.*", sf.scope("attention", _column("q_proj", "k_proj", "v_proj") >> _row("o_proj"))
                      >> sf.scope("mlp", _column("fc1") >> _row("fc2")))
    return ViTModel(cfg, add_pooling_layer=False), (pixels,), plan


def _torch_encoder() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4))
    # in_proj_weight/bias are [Q | K | V] parameters of MultiheadAttention (no Linear of their own);
    # out_proj is a Linear that F.multi_head_attention_forward reads functionally
    attn = (sf.shard.at("self_attn.in_proj_weight", axis=0, packed=3)
            >> sf.shard.at("self_attn.in_proj_bias", axis=0, packed=3) >> _row("self_attn.out_proj"))
    return model, (x,), sf.foreach("layers.*", attn >> _column("linear1") >> _row("linear2"))


def _torch_encoder_attn_replicated() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    """The same, out_proj left replicated (in_proj gathered per use, the MLP Megatron)."""
    model, inputs, _ = _torch_encoder()
    attn = sf.shard.at("self_attn.in_proj_weight", axis=0, packed=3) >> sf.shard.at("self_attn.in_proj_bias", axis=0,
                                                                                     packed=3)
    return model, inputs, sf.foreach("layers.*", attn >> _column("linear1") >> _row("linear2"))


# ---- beyond the list: families with layouts of their own


def _codegen(packed: int, gathered: bool = False) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    """CodeGen's ``qkv_proj`` rows are 4 blocks of [q | v | k] (``mp_num = 4``, a constant),
    split at sizes of the whole output, in code fx cannot trace: refused; ``gathered``
    follows the refusal's fix (the column's output gathered, the row splits it)."""

    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        from transformers import CodeGenConfig, CodeGenForCausalLM

        cfg = CodeGenConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32, rotary_dim=8,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        attn = _column("qkv_proj", packed=packed) >> _row("out_proj")
        if gathered:
            attn = attn >> sf.sync.at("qkv_proj", "fwd_post", Replicate())
        plan = sf.foreach("transformer.h.*", sf.scope("attn", attn) >> sf.scope("mlp", _column("fc_in")
                                                                                >> _row("fc_out")))
        return CodeGenForCausalLM(cfg), (_ids(),), plan

    return make


def _gptj() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import GPTJConfig, GPTJForCausalLM

    # attention and MLP in parallel on one normed input; partial rotary (rotary_dim < head_dim)
    cfg = GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32, rotary_dim=8,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager")
    plan = sf.foreach("transformer.h.*",
                      sf.scope("attn", _column("q_proj", "k_proj", "v_proj") >> _row("out_proj"))
                      >> sf.scope("mlp", _column("fc_in") >> _row("fc_out")))
    return GPTJForCausalLM(cfg), (_ids(),), plan


def _bigcode(gathered: bool) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    """GPT-BigCode with multi-query attention: ``c_attn`` is [q (4 heads) | k | v (1 head
    each)], split by widths; sharded as is, refused; ``gathered`` follows the fix."""

    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

        cfg = GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32, multi_query=True,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                               attn_implementation="eager")
        attn = _column("c_attn") >> _row("c_proj")
        if gathered:
            attn = attn >> sf.sync.at("c_attn", "fwd_post", Replicate())
        plan = sf.foreach("transformer.h.*", sf.scope("attn", attn) >> sf.scope("mlp", _column("c_fc")
                                                                                >> _row("c_proj")))
        return GPTBigCodeForCausalLM(cfg), (_ids(),), plan

    return make


def _albert() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import AlbertConfig, AlbertModel

    # one layer module called 3 times (shared weights); the pooler is not in the loss
    cfg = AlbertConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       max_position_embeddings=32, attn_implementation="eager")
    plan = sf.foreach("encoder.albert_layer_groups.*.albert_layers.*",
                      sf.scope("attention", _column("query", "key", "value") >> _row("dense"))
                      >> _column("ffn") >> _row("ffn_output"))
    return AlbertModel(cfg), (_ids(),), plan


def _xglm() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import XGLMConfig, XGLMForCausalLM

    # merges the heads back with reshape(bsz, tgt_len, self.embed_dim): build makes embed_dim this
    # rank's width with the head count (refused at the first forward before)
    cfg = XGLMConfig(vocab_size=VOCAB, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=32, use_cache=False)
    plan = sf.foreach("model.layers.*",
                      sf.scope("self_attn", _column("q_proj", "k_proj", "v_proj") >> _row("out_proj"))
                      >> _column("fc1") >> _row("fc2"))
    return XGLMForCausalLM(cfg), (_ids(),), plan


def _mpt() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import MptConfig, MptForCausalLM

    cfg = MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=32, use_cache=False)
    plan = sf.foreach("transformer.blocks.*", sf.scope("attn", _column("Wqkv", packed=3) >> _row("out_proj"))
                      >> sf.scope("ffn", _column("up_proj") >> _row("down_proj")))
    return MptForCausalLM(cfg), (_ids(),), plan


def _gpt2(gathered: bool) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    """GPT-2's packed ``c_attn`` (split by ``split_size``): alone (no row partner, so its
    output is gathered), or ``gathered``: with ``c_proj`` row-parallel and the output
    gathered by a sync. Build made ``split_size`` this rank's for a gathered output too: a raw
    "too many values to unpack" from GPT-2's code."""

    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager")
        attn = sf.shard.at("c_attn", axis=1, packed=3)
        if gathered:
            attn = attn >> sf.shard.at("c_proj", axis=0) >> sf.sync.at("c_attn", "fwd_post", Replicate())
        return GPT2LMHeadModel(cfg), (_ids(),), sf.foreach("transformer.h.*", sf.scope("attn", attn))

    return make


def _opt_gathered() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    """OPT's q/k/v gathered by syncs before a row-parallel ``out_proj``: build halved
    ``num_heads`` as for kept columns, so ``view(bsz, -1, self.num_heads, head_dim)`` on
    the whole output doubled the sequence (refused at the first forward by the mask's
    shape; silently wrong where no mask is added)."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                    max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, use_cache=False,
                    attn_implementation="eager", word_embed_proj_dim=64)
    attn = _column("q_proj", "k_proj", "v_proj") >> _row("out_proj")
    for name in ("q_proj", "k_proj", "v_proj"):
        attn = attn >> sf.sync.at(name, "fwd_post", Replicate())
    return OPTForCausalLM(cfg), (_ids(),), sf.foreach("model.decoder.layers.*", sf.scope("self_attn", attn))


def _llama_kin(name: str, gathered: tuple[str, ...] = (), **extra: Any) -> Callable[[],
                                                                         tuple[nn.Module, tuple[Any, ...], Plan]]:
    """A family laid out like LLaMA (``model.layers.*`` with q/k/v/o and gate/up/down), with
    the named attention projections' outputs ``gathered`` by syncs (a refusal's fix)."""

    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        import transformers

        cfg = getattr(transformers, f"{name}Config")(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                     **extra, **_lm_kw())
        attn = _column("q_proj", "k_proj", "v_proj") >> _row("o_proj")
        for column in gathered:
            attn = attn >> sf.sync.at(column, "fwd_post", Replicate())
        plan = sf.foreach("model.layers.*", sf.scope("self_attn", attn)
                          >> sf.scope("mlp", _column("gate_proj", "up_proj") >> _row("down_proj")))
        return getattr(transformers, f"{name}ForCausalLM")(cfg), (_ids(),), plan

    return make


def _glm() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import GlmConfig, GlmForCausalLM

    # a fused [gate | up] chunked in two; its own plan gathers it (colwise_gather_output) for a
    # row that splits its whole input (rowwise_split_input)
    cfg = GlmConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    pad_token_id=0, **_lm_kw())
    plan = sf.foreach("model.layers.*",
                      sf.scope("self_attn", _column("q_proj", "k_proj", "v_proj") >> _row("o_proj"))
                      >> sf.scope("mlp", _column("gate_up_proj", packed=2) >> _row("down_proj")))
    return GlmForCausalLM(cfg), (_ids(),), plan


def _persimmon(gathered: bool) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    """Persimmon's ``query_key_value`` viewed as (heads, 3, head_dim), then LayerNorms over
    q and k: refused by its head count; ``gathered`` follows the fix."""

    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        from transformers import PersimmonConfig, PersimmonForCausalLM

        cfg = PersimmonConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, qk_layernorm=True,
                              hidden_dropout=0.0, **_lm_kw())
        attn = _column("query_key_value") >> _row("dense")
        if gathered:
            attn = attn >> sf.sync.at("query_key_value", "fwd_post", Replicate())
        plan = sf.foreach("model.layers.*", sf.scope("self_attn", attn)
                          >> sf.scope("mlp", _column("dense_h_to_4h") >> _row("dense_4h_to_h")))
        return PersimmonForCausalLM(cfg), (_ids(),), plan

    return make


def _nanogpt(gathered: bool, chunk: bool = False) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    """nanoGPT with GPT-2's Megatron plan (``c_attn`` packed=3): its split by ``n_embd``,
    a size build does not make this rank's, cut this rank's share into the wrong blocks (a
    raw "not enough values to unpack"); refused before running, and ``gathered`` follows
    the refusal's fix."""

    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        attn = sf.shard.at("c_attn", axis=0, packed=3) >> _row("c_proj")
        if gathered:
            attn = attn >> sf.sync.at("c_attn", "fwd_post", Replicate())
        plan = sf.foreach("transformer.h.*", sf.scope("attn", attn) >> sf.scope("mlp", _column("c_fc")
                                                                               >> _row("c_proj")))
        return NanoGPT(attention=NanoChunkAttention if chunk else NanoAttention), (_ids(),), plan

    return make


class _Head(nn.Module):
    """One head as in Karpathy's "GPT from scratch": its own key/query/value layers and the
    attention written out, ``q @ k.transpose(-2, -1)``; no head count anywhere."""

    def __init__(self, n_embd: int, size: int) -> None:
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(n_embd, size, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, q = self.key(x), self.query(x)
        t = x.shape[1]
        wei = (q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5).masked_fill(
            torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return wei.softmax(-1) @ self.value(x)  # type: ignore[no-any-return]


class _HeadsBlock(nn.Module):
    def __init__(self, n_embd: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.heads = nn.ModuleList([_Head(n_embd, n_embd // n_head) for _ in range(n_head)])
        self.proj = nn.Linear(n_embd, n_embd)
        self.ffwd = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd))
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.proj(torch.cat([head(h) for head in self.heads], dim=-1))
        return x + self.ffwd(self.ln2(x))


class _ScratchGPT(nn.Module):
    def __init__(self, n_embd: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, n_embd), nn.Embedding(16, n_embd)
        self.blocks = nn.Sequential(_HeadsBlock(n_embd), _HeadsBlock(n_embd))
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.lm_head(self.ln_f(self.blocks(x)))  # type: ignore[no-any-return]


def _scratch(heads: bool) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    """The MLP (an ``nn.Sequential``) Megatron-sharded, and with ``heads`` every head's
    key/query/value too (their outputs gathered for the concatenation, the projection a row)."""

    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        plan = _column("ffwd.0") >> _row("ffwd.2")
        if heads:
            plan = plan >> sf.foreach("heads.*", _column("key", "query", "value")) >> _row("proj")
        return _ScratchGPT(), (_ids(),), sf.foreach("blocks.*", plan)

    return make


class _TitanAttention(nn.Module):
    """torchtitan's LLaMA attention (rotary left out): grouped-query heads counted in
    ``n_heads`` / ``n_kv_heads``, viewed with ``-1`` heads, ``repeat_kv`` by ``n_rep``."""

    def __init__(self, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.n_rep = n_heads, n_kv_heads, n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q, k, v = (w(x).view(bs, seqlen, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        k, v = (t.repeat_interleave(self.n_rep, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))  # type: ignore[no-any-return]


class _TitanBlock(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.attention = _TitanAttention(dim)
        self.feed_forward = nn.ModuleDict({"w1": nn.Linear(dim, 64, bias=False), "w2": nn.Linear(64, dim, bias=False),
                                           "w3": nn.Linear(dim, 64, bias=False)})
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        ff = self.feed_forward
        return h + ff.w2(F.silu(ff.w1(self.ffn_norm(h))) * ff.w3(self.ffn_norm(h)))  # type: ignore[no-any-return]


class _Titan(nn.Module):
    """torchtitan's LLaMA layout: layers in a ModuleDict, the output layer apart from the
    embedding."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleDict({str(i): _TitanBlock(dim) for i in range(2)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))  # type: ignore[no-any-return]


def _titan() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    """torchtitan's own TP plan for it (vocab-parallel embedding and output)."""
    plan = (sf.scope("attention", _column("wq", "wk", "wv") >> _row("wo"))
            >> sf.scope("feed_forward", _column("w1", "w3") >> _row("w2")))
    whole = sf.foreach("layers.*", plan) >> sf.shard.at("tok_embeddings", axis=0) >> sf.shard.at("output", axis=0)
    return _Titan(), (_ids(),), whole


def _distilbert() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import DistilBertConfig, DistilBertModel

    cfg = DistilBertConfig(vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4, dropout=0.0,
                           attention_dropout=0.0)
    attn = _column("q_lin", "k_lin", "v_lin") >> _row("out_lin")
    plan = sf.foreach("transformer.layer.*", sf.scope("attention", attn) >> sf.scope("ffn", _column("lin1")
                                                                                   >> _row("lin2")))
    return DistilBertModel(cfg), (_ids(),), plan


def _bert_like(layers: str, attention: str, q: str, k: str, v: str, o: str) -> Plan:
    """BERT's layout: q/k/v in one module, the output projection in another beside it."""
    return sf.foreach(layers, sf.scope(attention, _column(q, k, v) >> _row(o))
                      >> _column("intermediate.dense") >> _row("output.dense"))


def _deberta_v2() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import DebertaV2Config, DebertaV2Model

    cfg = DebertaV2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    plan = _bert_like("encoder.layer.*", "attention", "self.query_proj", "self.key_proj", "self.value_proj",
                      "output.dense")
    return DebertaV2Model(cfg), (_ids(),), plan


def _bert() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    """BERT by hand-written shards (no recipe, no syncs): the columns' outputs are gathered
    for rows in other parents, which split them again."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    plan = _bert_like("encoder.layer.*", "attention", "self.query", "self.key", "self.value", "output.dense")
    return BertModel(cfg, add_pooling_layer=False), (_ids(),), plan


def _electra() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    """ELECTRA: BERT's encoder after an embedding projection (embedding size 32 to hidden 64)."""
    from transformers import ElectraConfig, ElectraModel

    cfg = ElectraConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    plan = _bert_like("encoder.layer.*", "attention", "self.query", "self.key", "self.value", "output.dense")
    return ElectraModel(cfg), (_ids(),), plan


def _encoder_kw() -> dict[str, Any]:
    return {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _bert_kin(name: str, **extra: Any) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    """A family laid out like BERT (``encoder.layer.*``: attention.self's query/key/value,
    attention.output.dense, intermediate.dense, output.dense), by hand-written shards."""

    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        import transformers

        cfg = getattr(transformers, f"{name}Config")(**_encoder_kw(), **extra)
        model = getattr(transformers, f"{name}Model")(cfg)
        plan = _bert_like("encoder.layer.*", "attention", "self.query", "self.key", "self.value", "output.dense")
        return model, (_ids(),), plan

    return make


def _phi() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    """Phi (1 and 2): attention and MLP in parallel on one norm's output, ``dense`` its row."""
    from transformers import PhiConfig, PhiForCausalLM

    cfg = PhiConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, **_lm_kw())
    plan = sf.foreach("model.layers.*", sf.scope("self_attn", _column("q_proj", "k_proj", "v_proj") >> _row("dense"))
                      >> sf.scope("mlp", _column("fc1") >> _row("fc2")))
    return PhiForCausalLM(cfg), (_ids(),), plan


def _starcoder2() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    cfg = Starcoder2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           **_lm_kw())
    plan = sf.foreach("model.layers.*", sf.scope("self_attn", _column("q_proj", "k_proj", "v_proj") >> _row("o_proj"))
                      >> sf.scope("mlp", _column("c_fc") >> _row("c_proj")))
    return Starcoder2ForCausalLM(cfg), (_ids(),), plan


def _gemma3(local: bool) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    """Gemma 3: per-head q/k norms; ``local``: declared to run on this rank's heads."""

    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, **_lm_kw())
        attn = _column("q_proj", "k_proj", "v_proj") >> _row("o_proj")
        if local:
            attn = attn >> sf.tp_local.at(["q_norm", "k_norm"])
        plan = sf.foreach("model.layers.*", sf.scope("self_attn", attn)
                          >> sf.scope("mlp", _column("gate_proj", "up_proj") >> _row("down_proj")))
        return Gemma3ForCausalLM(cfg), (_ids(),), plan

    return make


def _clip_text() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16)
    attn = sf.scope("self_attn", _column("q_proj", "k_proj", "v_proj") >> _row("out_proj"))
    plan = sf.foreach("encoder.layers.*", attn >> sf.scope("mlp", _column("fc1") >> _row("fc2")))
    return CLIPTextModel(cfg), (_ids(),), plan


def _mixtral(whole: bool = False) -> tuple[nn.Module, tuple[Any, ...], Plan]:
    """Mixtral with its attention sharded and its experts left whole (``whole``: under SP,
    the experts' block gathers the tokens and splits its output back, as torchtitan's
    ``PrepareModuleInputOutput`` around its MoE)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, **_lm_kw())
    layer = sf.scope("self_attn", _column("q_proj", "k_proj", "v_proj") >> _row("o_proj"))
    if whole:
        layer = layer >> sf.sync.at("mlp", "fwd_pre", Replicate(), src=Shard(1)) >> sf.sync.at(
            "mlp", "fwd_post", Shard(1), src=Replicate())
    return MixtralForCausalLM(cfg), (_ids(),), sf.foreach("model.layers.*", layer)


def _mpnet() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    from transformers import MPNetConfig, MPNetModel

    cfg = MPNetConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return MPNetModel(cfg), (_ids(),), _bert_like("encoder.layer.*", "attention.attn", "q", "k", "v", "o")


def _nemotron() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    """Nemotron: LLaMA's attention, an MLP of up and down only (squared ReLU), LayerNorm1P."""
    from transformers import NemotronConfig, NemotronForCausalLM

    cfg = NemotronConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         **_lm_kw())
    plan = sf.foreach("model.layers.*", sf.scope("self_attn", _column("q_proj", "k_proj", "v_proj") >> _row("o_proj"))
                      >> sf.scope("mlp", _column("up_proj") >> _row("down_proj")))
    return NemotronForCausalLM(cfg), (_ids(),), plan


def _fnet() -> tuple[nn.Module, tuple[Any, ...], Plan]:
    """FNet mixes its tokens by a Fourier transform, no attention: only its MLP is sharded."""
    from transformers import FNetConfig, FNetModel

    cfg = FNetConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     hidden_dropout_prob=0.0)
    return FNetModel(cfg), (_ids(),), sf.foreach("encoder.layer.*", _column("intermediate.dense")
                                                 >> _row("output.dense"))


class TimmAttention(nn.Module):
    """timm's ViT attention as written there: one ``qkv`` reshaped to (3, heads, head_dim),
    blocks first, so ``packed=3`` is its layout; ``merge`` is how the heads are put back:
    ``reshape(B, N, C)`` with the input's width (refused at build: that width is not this
    rank's) or ``reshape(B, N, -1)``."""

    def __init__(self, dim: int, num_heads: int, merge: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.merge = num_heads, dim // num_heads, merge
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        x = (attn @ v).transpose(1, 2)
        return self.proj(x.reshape(B, N, C) if self.merge == "C" else x.reshape(B, N, -1))


class TimmMlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TimmBlock(nn.Module):
    def __init__(self, dim: int, merge: str) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), TimmAttention(dim, 4, merge)
        self.norm2, self.mlp = nn.LayerNorm(dim), TimmMlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmViT(nn.Module):
    """timm's ``VisionTransformer`` after its patch embedding: blocks in an ``nn.Sequential``."""

    def __init__(self, merge: str, dim: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(TimmBlock(dim, merge), TimmBlock(dim, merge))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x))


def _timm_vit(merge: str, packed: int) -> Callable[[], tuple[nn.Module, tuple[Any, ...], Plan]]:
    def make() -> tuple[nn.Module, tuple[Any, ...], Plan]:
        plan = sf.foreach("blocks.*", sf.scope("attn", _column("qkv", packed=packed) >> _row("proj"))
                          >> sf.scope("mlp", _column("fc1") >> _row("fc2")))
        return TimmViT(merge), (torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3)),), plan

    return make


class MixerBlock(nn.Module):
    """MLP-Mixer's block: an MLP across the tokens (on the transposed activation), then one
    across the channels."""

    def __init__(self, dim: int, tokens: int) -> None:
        super().__init__()
        self.norm1, self.token_mlp = nn.LayerNorm(dim), TimmMlp(tokens, 2 * tokens)
        self.norm2, self.channel_mlp = nn.LayerNorm(dim), TimmMlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


def _mixer(token: bool) -> tuple[nn.Module, tuple[Any, ...], Plan]:
    model = nn.Sequential(MixerBlock(32, 8), MixerBlock(32, 8))
    plan = sf.foreach("*", sf.scope("channel_mlp", _column("fc1") >> _row("fc2")))
    if token:  # Megatron across the tokens too: its features are the sequence
        plan = plan >> sf.foreach("*", sf.scope("token_mlp", _column("fc1") >> _row("fc2")))
    return model, (torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3)),), plan
