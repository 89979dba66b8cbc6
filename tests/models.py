"""Tiny models for tests: Hugging Face ones built from configs (random weights), and plain trees."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
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


def tiny_bart(**overrides: object) -> nn.Module:
    """``BartModel`` (encoder-decoder, 2 + 2 layers, eager attention, no dropout); its inputs
    are ``(input_ids, attention_mask, decoder_input_ids)``."""
    from transformers import BartConfig, BartModel

    torch.manual_seed(0)
    options: dict[str, object] = {
        "vocab_size": VOCAB, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "max_position_embeddings": 32,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "use_cache": False,
        "attn_implementation": "eager"}
    return BartModel(BartConfig(**{**options, **overrides}))


def tiny_albert() -> nn.Module:
    """Two calls of one shared layer (ALBERT's ``num_hidden_groups=1``)."""
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    return AlbertModel(AlbertConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, max_position_embeddings=32))


def tiny_gpt_neo() -> nn.Module:
    """A global and a local (window 4 < the sequence) attention layer."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(0)
    return GPTNeoForCausalLM(GPTNeoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                                          attention_types=[[["global", "local"], 1]], window_size=4,
                                          max_position_embeddings=32, embed_dropout=0.0, attention_dropout=0.0,
                                          resid_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0))


def tiny_roberta() -> nn.Module:
    """The masked-LM model: its ``lm_head.decoder`` is tied to the word embeddings."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(0)
    return RobertaForMaskedLM(RobertaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                                            attention_probs_dropout_prob=0.0, max_position_embeddings=40))


def token_ids(batch: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


class LoRA(nn.Linear):
    """A Linear subclass with a forward of its own: ``x Wᵀ + b + x Aᵀ Bᵀ`` (rank 2)."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        self.lora_a, self.lora_b = nn.Parameter(torch.randn(2, i)), nn.Parameter(torch.randn(o, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b)


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


class NanoAttention(nn.Module):
    """nanoGPT's causal self-attention, as written there: q/k/v split off ``c_attn`` by
    ``self.n_embd`` (a size of the whole width) and viewed by ``C // self.n_head``."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class NanoChunkAttention(NanoAttention):
    """The same with ``chunk(3)`` in place of the split by ``n_embd``: the blocks are then
    this rank's, but each is still viewed into ``self.n_head`` heads of the whole width."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, attention: type[NanoAttention] = NanoAttention) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = attention(n_embd, n_head)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(n_embd, 4 * n_embd), "c_proj": nn.Linear(4 * n_embd, n_embd)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's model at 2 layers: learned positions, the head tied to the embedding."""

    def __init__(self, n_embd: int = 32, n_head: int = 4, attention: type[NanoAttention] = NanoAttention,
                 vocab: int = VOCAB) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, n_embd), "wpe": nn.Embedding(16, n_embd),
            "h": nn.ModuleList([NanoBlock(n_embd, n_head, attention) for _ in range(2)]),
            "ln_f": nn.LayerNorm(n_embd)})
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # type: ignore[no-any-return]


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck (1x1 → 3x3 → 1x1 convolutions, each with a
    BatchNorm; the 3x3 strided; ``width`` = ``planes * base_width / 64``, doubled in a
    Wide ResNet), its names and order as torchvision's."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 base_width: int = 128) -> None:
        super().__init__()
        width = planes * base_width // 64
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)  # type: ignore[no-any-return]


class WideResNet(nn.Module):
    """torchvision's ``wide_resnet50_2`` module tree (``conv1``, ``bn1``, ``relu``, ``maxpool``,
    ``layer1``..``layer4`` of :class:`Bottleneck` blocks, ``avgpool``, ``fc``), tiny: ``width``
    in place of 64 channels and ``blocks`` per stage in place of (3, 4, 6, 3)."""

    def __init__(self, blocks: tuple[int, int, int, int] = (2, 1, 1, 1), width: int = 8, classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._layer(width, blocks[0])
        self.layer2 = self._layer(width * 2, blocks[1], stride=2)
        self.layer3 = self._layer(width * 4, blocks[2], stride=2)
        self.layer4 = self._layer(width * 8, blocks[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, classes)

    def _layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride,
                                                 bias=False), nn.BatchNorm2d(planes * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))  # type: ignore[no-any-return]


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


def torch_transformer_layer() -> sf.Rewrite:
    """One decoder layer of PyTorch's test ``Transformer`` (``common_dtensor``) sharded as its
    ``Transformer.parallelize`` shards it: q/k/v and w1 column-parallel (axis 0 of an
    nn.Linear weight), wo and w2 row-parallel."""
    import slapo_fn as sf

    return (sf.shard.at("attention.wq", axis=0) >> sf.shard.at("attention.wk", axis=0)
            >> sf.shard.at("attention.wv", axis=0) >> sf.shard.at("attention.wo", axis=1)
            >> sf.shard.at("feed_forward.w1", axis=0) >> sf.shard.at("feed_forward.w2", axis=1))


def megatron_torch_transformer(sch: sf.Schedule) -> sf.Schedule:
    """``Transformer.parallelize``'s plan in slapo_fn (its sequence parallelism apart): both
    embeddings vocab-parallel (``RowwiseParallel`` on an nn.Embedding is ``Shard(0)``), every
    layer Megatron, the head column-parallel (tied: the same ``Shard(0)`` as tok_embeddings)."""
    import slapo_fn as sf

    sch = sf.shard(sch, ["tok_embeddings", "pos_embeddings"], axis=0)
    sch = sf.foreach("layers.*", torch_transformer_layer())(sch)
    return sf.shard(sch, "output", axis=0)

