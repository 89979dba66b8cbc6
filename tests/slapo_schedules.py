"""Slapo's own schedules (slapo/model_schedule/*.py) for the seven models of its paper,
translated into slapo_fn as a Slapo user moving their schedules would write them.

Each Slapo schedule does, per model: replace the attention with its fused kernel (and,
for GPT-2 and GPT-Neo, the MLP with its fused MLP); shard the attention's projections and
the MLP Megatron-style (``shard("weight", axis=0)`` on the columns, ``axis=1`` on the rows)
with its stated syncs (``bwd_post`` all-reduce on a column's input gradient, ``fwd_post``
all-reduce on a row's output); shard the word embedding's rows by vocabulary between a
masking pre-hook and a post-hook that zeros the rows outside this rank's and all-reduces
(a callable sync); shard a separate ``lm_head`` by vocabulary with its input gradient
all-reduced (GPT-2, GPT-Neo, OPT); and checkpoint layers by a ratio. The translation:

* Slapo ``sch[p].shard("weight", axis=a)`` (and ``"bias"``) on a Linear → ``sf.shard(sch, p,
  axis=a)`` (the module's own layout: a column's bias splits with its weight, a row's does
  not); ``shard("weight", axis=0)`` on an embedding → ``sf.shard(sch, f"{p}.weight", axis=0)``
  (by parameter path: the hooks run the module on this rank's rows);
* ``sync(mode="bwd_post", sync_op_or_fn="all_reduce")`` → ``sf.sync(sch, p, "bwd_post",
  Replicate(), src=Partial())``; ``sync(mode="fwd_post", sync_op_or_fn="all_reduce")`` →
  ``sf.sync(sch, p, "fwd_post", Replicate())`` (from the row's own ``Partial``);
* ``sync(mode=..., sync_op_or_fn=<hook>)`` → ``sf.sync(sch, p, mode, layout, src=..., fn=hook)``
  with the layouts the hook takes and gives stated;
* replacing attention by Slapo's ``FlashAttention`` / the MLP by ``FusedMLP`` →
  ``sf.replace`` by slapo_fn's kernels (``Attention.from_hf``, ``FusedMLP.from_hf``), whose
  projections keep the Hugging Face names (``query``/``key``/``value``, ``q_proj``...);
  Slapo's ``fix_attention_mask_shape`` (the mask expanded to this rank's heads) has no
  equivalent: the kernels take their head counts from the module the build makes this
  rank's;
* ``checkpoint()`` of the first ``ratio`` of the layers → ``sf.checkpoint``.

Slapo's T5 schedule replaces the attention with epoi's T5 attention and fuses q/k/v (k/v in
the cross attention) by ``find`` + ``replace``; slapo_fn has no T5 attention kernel, so the
translation shards Hugging Face's ``q``/``k``/``v``/``o`` with the same stated syncs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import slapo_fn as sf
from slapo_fn.kernels import Attention, FusedMLP


def column(sch: sf.Schedule, paths: list[str]) -> sf.Schedule:
    """Slapo's column: weight (and bias) on axis 0, the input gradient all-reduced."""
    return sf.sync(sf.shard(sch, paths, axis=0), paths, "bwd_post", Replicate(), src=Partial())


def row(sch: sf.Schedule, paths: list[str]) -> sf.Schedule:
    """Slapo's row: weight on axis 1, the output all-reduced."""
    return sf.sync(sf.shard(sch, paths, axis=1), paths, "fwd_post", Replicate())


def embedding_hooks(sch: sf.Schedule, vocab: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Slapo's ``shard_word_embedding`` hooks: ids outside this rank's rows masked to 0 and
    shifted; their output rows zeroed and all-reduced (in place, outside autograd, as
    Slapo's ``dist.all_reduce``: its backward is the identity, every rank's output gradient
    being the whole one). A ``fwd_post`` callable reads the ids its caller handed (before
    the pre-hook), as Slapo's BERT hook means to."""
    m = sch.mesh
    assert m is not None
    size, rank, group = m.size(0), m.get_local_rank(0), m.get_group(0)
    start, end = rank * vocab // size, (rank + 1) * vocab // size

    def fwd_pre_hook(_module: nn.Module, args: tuple[Any, ...]) -> torch.Tensor:
        outside = (args[0] < start) | (args[0] >= end)
        return (args[0] - start).masked_fill(outside, 0)

    def fwd_post_hook(_module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        outside = (args[0] < start) | (args[0] >= end)
        output = output.masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group)
        return output

    return fwd_pre_hook, fwd_post_hook


def word_embedding(sch: sf.Schedule, path: str, vocab: int) -> sf.Schedule:
    """Slapo's ``shard_word_embedding``: the rows split by vocabulary, the hooks stated:
    the ids arrive whole and go in as this rank's (whole on every rank: ``Replicate``), the
    output leaves partial and is reduced by the post-hook."""
    pre, post = embedding_hooks(sch, vocab)
    sch = sf.shard(sch, f"{path}.weight", axis=0)
    sch = sf.sync(sch, path, "fwd_pre", Replicate(), src=Replicate(), fn=pre)
    return sf.sync(sch, path, "fwd_post", Replicate(), src=Partial(), fn=post)


def lm_head(sch: sf.Schedule, path: str) -> sf.Schedule:
    """Slapo's output embedding: weight rows by vocabulary, its input gradient all-reduced
    (the logits are then gathered: Slapo's loss reads whole logits)."""
    return sf.sync(sf.shard(sch, path, axis=0), path, "bwd_post", Replicate(), src=Partial())


def checkpoint_layers(sch: sf.Schedule, layers: list[str], ratio: float) -> sf.Schedule:
    """Slapo's ``checkpoint(ckpt_ratio=...)``: the first ``ratio`` of the layers."""
    picked = layers[: int(len(layers) * ratio)]
    return sf.checkpoint(sch, picked) if picked else sch


def bert(sch: sf.Schedule, prefix: str = "", *, ckpt_ratio: float = 0.0) -> sf.Schedule:
    """slapo/model_schedule/bert.py (and roberta.py, which calls it)."""
    p = f"{prefix}." if prefix else ""
    layers = list(sf.select(f"{p}encoder.layer.*").modules(sch.module))
    sch = sf.replace(sch, [f"{q}.attention.self" for q in layers], Attention.from_hf)
    for q in layers:
        columns = [f"{q}.attention.self.{n}" for n in ("query", "key", "value")] + [f"{q}.intermediate.dense"]
        rows = [f"{q}.attention.output.dense", f"{q}.output.dense"]
        sch = row(column(sch, columns), rows)
        # Slapo's shard never gathers: a column's output stays this rank's features. slapo_fn
        # pairs a column with a row it can see (a sibling) by itself; BERT's rows live in other
        # modules (attention.output.dense beside attention.self), so the user states it
        sch = sf.sync(sch, columns, "fwd_post", Shard(-1))
        sch = sf.sync(sch, rows, "fwd_pre", Shard(-1), src=Shard(-1))
    cfg = sch[prefix].module.config if prefix else sch.module.config
    sch = word_embedding(sch, f"{p}embeddings.word_embeddings", cfg.vocab_size)
    return checkpoint_layers(sch, layers, ckpt_ratio)


def _config(sch: sf.Schedule, prefix: str) -> Any:
    return (sch[prefix].module if prefix else sch.module).config


def albert(sch: sf.Schedule, prefix: str = "", *, ckpt_ratio: float = 0.0) -> sf.Schedule:
    """slapo/model_schedule/albert.py: the one shared layer (group 0, layer 0)."""
    p = f"{prefix}." if prefix else ""
    layer = f"{p}encoder.albert_layer_groups.0.albert_layers.0"
    sch = sf.replace(sch, f"{layer}.attention", Attention.from_hf)
    sch = column(sch, [f"{layer}.attention.{n}" for n in ("query", "key", "value")])
    sch = row(sch, [f"{layer}.attention.dense"])
    sch = column(sch, [f"{layer}.ffn"])
    sch = row(sch, [f"{layer}.ffn_output"])
    sch = word_embedding(sch, f"{p}embeddings.word_embeddings", _config(sch, prefix).vocab_size)
    return checkpoint_layers(sch, [layer], ckpt_ratio)


def gpt2(sch: sf.Schedule, prefix: str = "transformer", *, ckpt_ratio: float = 0.0,
         fuse_bias_gelu: bool = False) -> sf.Schedule:
    """slapo/model_schedule/gpt2.py: attention and MLP replaced by fused kernels, then
    sharded (GPT-2's ``Conv1D`` stores its weight (in, out): Slapo's fused kernels hold
    ``nn.Linear``s, slapo_fn's keep the ``Conv1D``s, so the column is axis 1, packed [Q|K|V]).
    ``fuse_bias_gelu``: the MLP kept, its ``c_fc`` decomposed and its bias fused with the
    GeLU after it (Slapo's ``fuse_bias_gelu``: ``decompose``, ``trace``, ``find``, ``fuse``)."""
    p = f"{prefix}." if prefix else ""
    layers = list(sf.select(f"{p}h.*").modules(sch.module))
    sch = sf.replace(sch, [f"{q}.attn" for q in layers], Attention.from_hf)
    if fuse_bias_gelu:
        hidden = torch.zeros(1, 4, _config(sch, prefix).n_embd)
        for q in layers:
            sch = sf.decompose(sf.trace(sch, f"{q}.mlp", example_inputs=(hidden,)), f"{q}.mlp.c_fc")
            (match,) = sf.find(sch, f"{q}.mlp", _bias_gelu)
            sch = sf.fuse(sch, f"{q}.mlp", match, compiler=None)
    else:
        sch = sf.replace(sch, [f"{q}.mlp" for q in layers], FusedMLP.from_hf)
    for q in layers:
        attn = f"{q}.attn.c_attn"
        sch = sf.sync(sf.shard(sch, attn, axis=1, packed=3), attn, "bwd_post", Replicate(), src=Partial())
        proj = f"{q}.attn.c_proj"
        sch = sf.sync(sf.shard(sch, proj, axis=0), proj, "fwd_post", Replicate())
        fc = f"{q}.mlp.c_fc"
        sch = sf.sync(sf.shard(sch, fc, axis=1), fc, "bwd_post", Replicate(), src=Partial())
        out = f"{q}.mlp.c_proj"
        sch = sf.sync(sf.shard(sch, out, axis=0), out, "fwd_post", Replicate())
    sch = word_embedding(sch, f"{p}wte", _config(sch, prefix).vocab_size)
    if "lm_head" in sch.module._modules:
        sch = lm_head(sch, "lm_head")
    return checkpoint_layers(sch, layers, ckpt_ratio)


def _bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Slapo's bias+GeLU pattern on GPT-2's MLP, whose activation is its ``act`` child."""
    from slapo_fn.rewrites.graph import call_module

    return call_module("act", x + bias)  # type: ignore[no-any-return]


def gpt_neo(sch: sf.Schedule, prefix: str = "transformer", *, ckpt_ratio: float = 0.0) -> sf.Schedule:
    """slapo/model_schedule/gpt_neo.py: as GPT-2's, on ``attn.attention`` (no bias in q/k/v)."""
    p = f"{prefix}." if prefix else ""
    layers = list(sf.select(f"{p}h.*").modules(sch.module))
    sch = sf.replace(sch, [f"{q}.attn.attention" for q in layers], Attention.from_hf)
    sch = sf.replace(sch, [f"{q}.mlp" for q in layers], FusedMLP.from_hf)
    for q in layers:
        sch = column(sch, [f"{q}.attn.attention.{n}" for n in ("q_proj", "k_proj", "v_proj")])
        sch = row(sch, [f"{q}.attn.attention.out_proj"])
        sch = column(sch, [f"{q}.mlp.c_fc"])
        sch = row(sch, [f"{q}.mlp.c_proj"])
    sch = word_embedding(sch, f"{p}wte", _config(sch, prefix).vocab_size)
    if "lm_head" in sch.module._modules:
        sch = lm_head(sch, "lm_head")
    return checkpoint_layers(sch, layers, ckpt_ratio)


def opt(sch: sf.Schedule, prefix: str = "model", *, ckpt_ratio: float = 0.0) -> sf.Schedule:
    """slapo/model_schedule/opt.py. slapo_fn has no OPT attention kernel: Hugging Face's
    ``q_proj``/``k_proj``/``v_proj``/``out_proj`` are sharded in place of Slapo's fused qkv."""
    p = f"{prefix}." if prefix else ""
    layers = list(sf.select(f"{p}decoder.layers.*").modules(sch.module))
    for q in layers:
        sch = column(sch, [f"{q}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")])
        sch = row(sch, [f"{q}.self_attn.out_proj"])
        sch = column(sch, [f"{q}.fc1"])
        sch = row(sch, [f"{q}.fc2"])
    sch = word_embedding(sch, f"{p}decoder.embed_tokens", _config(sch, prefix).vocab_size)
    if "lm_head" in sch.module._modules:
        sch = sf.shard(sch, "lm_head", axis=0)  # Slapo's OPT states no sync on it
    return checkpoint_layers(sch, layers, ckpt_ratio)


def t5(sch: sf.Schedule, prefix: str = "", *, ckpt_ratio: float = 0.0) -> sf.Schedule:
    """slapo/model_schedule/t5.py: self attention, cross attention and the feed-forward of
    every block; the shared embedding by vocabulary."""
    p = f"{prefix}." if prefix else ""
    sch, blocks = _t5_blocks(sch, p)
    sch = word_embedding(sch, f"{p}shared", _config(sch, prefix).vocab_size)
    return checkpoint_layers(sch, blocks, ckpt_ratio)


def _t5_blocks(sch: sf.Schedule, p: str) -> tuple[sf.Schedule, list[str]]:
    """Slapo's T5 schedule on the blocks: attention and feed-forward pairs with their syncs."""
    enc = list(sf.select(f"{p}encoder.block.*").modules(sch.module))
    dec = list(sf.select(f"{p}decoder.block.*").modules(sch.module))
    attentions = [f"{q}.layer.0.SelfAttention" for q in enc + dec] + [f"{q}.layer.1.EncDecAttention" for q in dec]
    for a in attentions:
        sch = column(sch, [f"{a}.{n}" for n in "qkv"])
        sch = row(sch, [f"{a}.o"])
    for ff in [f"{q}.layer.1.DenseReluDense" for q in enc] + [f"{q}.layer.2.DenseReluDense" for q in dec]:
        sch = column(sch, [f"{ff}.wi"])
        sch = row(sch, [f"{ff}.wo"])
    # Slapo's fix_position_bias_shape: the first block's relative position bias made for this
    # rank's heads (an embedding over buckets by heads, split by heads and kept split)
    for path in [q for q in sch.paths() if q.endswith("relative_attention_bias")]:
        sch = sf.sync(sf.shard(sch, path, axis=1), path, "fwd_post", Shard(-1))
    return sch, enc + dec


def roberta(sch: sf.Schedule, prefix: str = "roberta", *, ckpt_ratio: float = 0.0) -> sf.Schedule:
    """slapo/model_schedule/roberta.py: BERT's schedule."""
    return bert(sch, prefix, ckpt_ratio=ckpt_ratio)


SCHEDULES: dict[str, Callable[..., sf.Schedule]] = {
    "bert": bert, "roberta": roberta, "albert": albert, "gpt2": gpt2, "gpt_neo": gpt_neo, "opt": opt, "t5": t5}


def roberta_untied_fix(sch: sf.Schedule) -> sf.Schedule:
    """RoBERTa's schedule with what slapo_fn's refusal says to change: the masked-LM head,
    tied to the word embedding, sharded alike (by vocabulary, as Slapo's GPT-2 shards its
    head), its bias under both of its paths."""
    return sf.shard(lm_head(roberta(sch), "lm_head.decoder"), "lm_head.bias", axis=0)


def t5_untied_fix(sch: sf.Schedule) -> sf.Schedule:
    """T5's schedule (its blocks) with what slapo_fn's refusal says to change: every path of the shared
    embedding sharded alike. The stacks call their own ``embed_tokens`` (the same weight
    as ``shared``, which the model never calls): Slapo's hooks go on those, and the tied
    LM head is a vocabulary-split head as Slapo's GPT-2's."""
    sch, _ = _t5_blocks(sch, "")
    vocab = _config(sch, "").vocab_size
    for path in ("encoder.embed_tokens", "decoder.embed_tokens"):
        sch = word_embedding(sch, path, vocab)
    sch = sf.shard(sch, "shared.weight", axis=0)
    return lm_head(sch, "lm_head")
