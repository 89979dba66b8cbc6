"""Models with several layer sequences for the pipeline tests: tiny T5 and Bart (random
weights, from configs) and a plain two-stack model, with the cuts the tests make."""

from __future__ import annotations

import torch
from models import VOCAB
from torch import nn


def t5() -> nn.Module:
    import transformers as t

    torch.manual_seed(0)
    cfg = t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
                     dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False)
    return t.T5ForConditionalGeneration(cfg)


def bart() -> nn.Module:
    import transformers as t

    torch.manual_seed(0)
    cfg = t.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False, pad_token_id=0,
                       bos_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return t.BartForConditionalGeneration(cfg)


class Mix(nn.Module):
    """A decoder-like layer: reads the stream and the other stack's output."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x) + memory.mean(1, keepdim=True))


class TwoStacks(nn.Module):
    """Not a Hugging Face model: an embedding used by both stacks, a norm between them at
    the root, the second stack reading the first one's (normed) output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.a = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.b = nn.ModuleList(Mix() for _ in range(3))
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.a:
            x = torch.tanh(layer(x))
        memory = self.norm(x)
        y = self.embed(input_ids)
        for mix in self.b:
            y = mix(y, memory)
        return self.head(y)


MODELS = {"t5": (t5, "encoder.block", "decoder.block"), "bart": (bart, "model.encoder.layers", "model.decoder.layers"),
          "two-stacks": (TwoStacks, "a", "b")}
#: cuts (as ``(sequence 0 or 1, layer)``): inside the encoder, inside the decoder, and 4
#: stages (inside the encoder, between encoder and decoder, inside the decoder)
CUTS = {"encoder": ((0, 0),), "decoder": ((1, 0),), "four": ((0, 0), (0, 1), (1, 1))}
