"""Bart's recipe at TP=2 on 2 gloo ranks: forward and every gradient equal to the unsharded
model's, at Megatron's collective counts, the decoder's cross-attention sharded too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import VOCAB, token_ids
from tp_checks import parity

import slapo_fn as sf


def _tp2(rank: int, world: int) -> dict[str, Any]:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    model = BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, use_cache=False, pad_token_id=1, decoder_start_token_id=2))
    recipe = sf.recipes.for_model(model)
    inputs = (token_ids(seq=8), torch.ones(2, 8, dtype=torch.long), token_ids(seq=6, seed=1))
    return parity(model, lambda s: recipe(s, tp=world), inputs, shape=(world,), atol=2e-5, predict=False)


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_bart_recipe_tp2_matches_the_unsharded_model(dist2: Any) -> None:
    for r in dist2.run(_tp2, timeout=150):
        assert r["grads"] > 0
        # one all-reduce per row-parallel layer forward: 2 encoder layers × (attention, MLP),
        # 2 decoder layers × (self-attention, cross-attention, MLP)
        assert r["fwd"] == {"all_reduce": 10}, r["fwd"]
        # and backward one per input of a column group: the encoder layers' attention and MLP
        # inputs; the decoder layers' self-attention, cross-attention query and MLP inputs; and
        # one for the cross-attention keys/values of both decoder layers, which read one tensor
        # (the encoder's output): their partial gradients are summed first, as PyTorch's are
        assert r["bwd"] == {"all_reduce": 2 * 2 + 2 * 3 + 1}, r["bwd"]
