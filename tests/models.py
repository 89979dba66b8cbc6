"""Tiny models for tests: Hugging Face ones built from configs (random weights), and plain trees."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    import slapo_fn as sf

VOCAB = 128


def tiny_llama(layers: int = 2, **overrides: object) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    options: dict[str, object] = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "use_cache": False}
    cfg = LlamaConfig(num_hidden_layers=layers, **{**options, **overrides})
    return LlamaForCausalLM(cfg)


def tiny_gpt2(layers: int = 2, **overrides: object) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    options: dict[str, object] = {"vocab_size": VOCAB, "n_embd": 64, "n_head": 4, "n_positions": 32,
                                  "use_cache": False, "bos_token_id": 0, "eos_token_id": 0}
    cfg = GPT2Config(n_layer=layers, **{**options, **overrides})
    return GPT2LMHeadModel(cfg)


def tiny_bert(layers: int = 2) -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=32)
    return BertModel(cfg)


def token_ids(batch: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class PreNormLayer(nn.Module):
    """A pre-norm residual layer, as in LLaMA: ``x + mlp(norm(x))``."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    """embed -> blocks -> head, with the head tied to the embedding."""

    def __init__(self, dim: int = 8, depth: int = 3, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, steps: int) -> list[float]:
    """``steps`` language-model steps on ``ids`` (labels = inputs); the losses."""
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def megatron_llama(sch: sf.Schedule, layers: str = "model.layers.*") -> sf.Schedule:
    """Megatron tensor parallelism of every LLaMA-family decoder layer under ``layers``:
    q/k/v and gate/up column-parallel, o and down row-parallel."""
    import slapo_fn as sf

    attn = sf.shard.at("q_proj", axis=0) >> sf.shard.at("k_proj", axis=0) >> sf.shard.at("v_proj", axis=0)
    attn = attn >> sf.shard.at("o_proj", axis=1)
    mlp = sf.shard.at("gate_proj", axis=0) >> sf.shard.at("up_proj", axis=0) >> sf.shard.at("down_proj", axis=1)
    return sf.foreach(layers, sf.scope("self_attn", attn) >> sf.scope("mlp", mlp))(sch)
