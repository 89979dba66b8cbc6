"""A split of features into heads, however the code spells it, at tp=2 on gloo.

Column q/k/v and row o: each rank keeps its q/k/v output as its share of the features,
and the attention's code views that share into this rank's heads. The planner reads the
view's result shape off the traced values, so every spelling of one split is one split:
Hugging Face's ``view(*shape[:-1], -1, d)``, Slapo's (and older Hugging Face's)
``view(x.size()[:-1] + (h, d))``, ``reshape(*x.shape[:2], h, d)``, ``view(b, s, h, d)``
with the sizes read off the tensor, and einops' ``rearrange``. Each runs on local shards,
equal to the single process, at the Megatron optimum: one all-reduce forward (the row's
output) and one backward (the columns' input gradient).
"""

from __future__ import annotations

import math
from typing import Any

import einops
import pytest
import torch
from torch import nn
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.dtensor.features import ApartKind
from slapo_fn.dtensor.flow import flow

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

D, HEADS = 16, 4
MEGATRON = {"fwd": {"all_reduce": 1}, "bwd": {"all_reduce": 1}}


class Attention(nn.Module):
    """Attention whose split into heads (and merge back) is spelled ``spelling``."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling = spelling
        self.num_attention_heads, self.attention_head_size = HEADS, D // HEADS
        self.all_head_size = D
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        h, d = self.num_attention_heads, self.attention_head_size
        if self.spelling == "hugging-face":
            return x.view(*x.shape[:-1], -1, d)
        if self.spelling == "size-tuple":  # Slapo's schedules, ALBERT and GPT-2 before transformers 4.48
            return x.view(x.size()[:-1] + (h, d))  # noqa: RUF005 (the spelling under test)
        if self.spelling == "starred-shape":
            return x.reshape(*x.shape[:2], h, d)
        if self.spelling == "sizes-read-off":
            b, s, _ = x.size()
            return x.view(b, s, h, d)
        return einops.rearrange(x, "b s (h d) -> b s h d", h=h)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        if self.spelling == "size-tuple":
            return y.reshape(y.size()[:-2] + (self.all_head_size,))  # noqa: RUF005
        if self.spelling == "einops":
            return einops.rearrange(y, "b s h d -> b s (h d)")
        return y.flatten(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split(f(x)).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.attention_head_size)
        y = (scores.softmax(-1) @ v).transpose(1, 2)
        return self.o(self.merge(y))  # type: ignore[no-any-return]


SPELLINGS = ("hugging-face", "size-tuple", "starred-shape", "sizes-read-off", "einops")


def _megatron(s: sf.Schedule) -> sf.Schedule:
    return sf.shard(sf.shard(s, ["q", "k", "v"], axis=0), "o", axis=1)


def _loss(out: Any, _: sf.Schedule) -> torch.Tensor:
    y = out[0] if isinstance(out, tuple) else out
    return (y * torch.linspace(0.5, 1.5, y.shape[-1])).pow(2).mean()  # type: ignore[no-any-return]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_reads_as_one_split_into_heads(spelling: str) -> None:
    fl = flow(Attention(spelling))
    assert fl is not None
    for name in "qkv":
        how = fl.apart[name]
        assert how.kind is ApartKind.HEADS and how.dims[0] in (HEADS, -1), (name, how)
        assert name not in fl.mixes
    # the count the view reads is the attention's own attribute, which build makes this rank's
    if fl.apart["q"].dims[0] == HEADS:
        assert fl.counts["q"][0] == "num_attention_heads"


def _run(rank: int, world: int, spelling: str) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(3))
    r = parity(Attention(spelling), _megatron, (x,), shape=(world,), loss=_loss)
    return {"on_dtensors": r["on_dtensors"], "fwd": r["fwd"], "bwd": r["bwd"], "grads": r["grads"]}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_runs_equal_on_local_shards_at_the_megatron_optimum(dist2: Any, spelling: str) -> None:
    got = dist2.run(_run, spelling, timeout=120)
    assert got[0] == got[1]
    assert not got[0]["on_dtensors"]
    assert {"fwd": got[0]["fwd"], "bwd": got[0]["bwd"]} == MEGATRON
    assert got[0]["grads"] == 8


def _albert_attention() -> nn.Module:
    """Hugging Face's ALBERT attention as Slapo's schedules (and transformers before 4.48)
    spell it: ``transpose_for_scores`` by ``x.size()[:-1] + (h, d)``, merged back by
    ``size()[:-2] + (all_head_size,)``."""
    from transformers import AlbertConfig
    from transformers.models.albert.modeling_albert import AlbertAttention

    class SlapoSpelledAlbertAttention(AlbertAttention):  # type: ignore[misc]
        def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
            new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)  # noqa: RUF005
            return x.view(new_x_shape).permute(0, 2, 1, 3)

        def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, **_: Any) -> Any:
            q = self.transpose_for_scores(self.query(hidden_states))
            k = self.transpose_for_scores(self.key(hidden_states))
            v = self.transpose_for_scores(self.value(hidden_states))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
            probs = self.attention_dropout(scores.softmax(-1))
            context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
            context = context.view(context.size()[:-2] + (self.all_head_size,))  # noqa: RUF005
            out = self.output_dropout(self.dense(context))
            return self.LayerNorm(hidden_states + out), probs

    cfg = AlbertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, attention_probs_dropout_prob=0.0,
                       hidden_dropout_prob=0.0)
    return SlapoSpelledAlbertAttention(cfg)


def _albert_plan(s: sf.Schedule) -> sf.Schedule:
    return sf.shard(sf.shard(s, ["query", "key", "value"], axis=0), "dense", axis=1)


def _run_albert(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    r = parity(_albert_attention(), _albert_plan, (x,), shape=(world,), loss=_loss)
    return {"on_dtensors": r["on_dtensors"], "fwd": r["fwd"], "bwd": r["bwd"], "grads": r["grads"]}


def test_albert_attention_in_slapos_spelling_runs_equal_at_the_megatron_optimum(dist2: Any) -> None:
    got = dist2.run(_run_albert, timeout=120)
    assert got[0] == got[1]
    assert not got[0]["on_dtensors"]
    assert {"fwd": got[0]["fwd"], "bwd": got[0]["bwd"]} == MEGATRON
    assert got[0]["grads"] == 10  # q, k, v, dense, LayerNorm: weight and bias each


def _gpt2_attention() -> nn.Module:
    """Hugging Face's GPT-2 attention as Slapo's schedules (and transformers before 4.48)
    spell it: [Q|K|V] split by ``split_size``, each viewed by ``size()[:-1] + (heads,
    head_dim)``, merged back by ``size()[:-2] + (heads * head_dim,)``."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    class SlapoSpelledGPT2Attention(GPT2Attention):  # type: ignore[misc]
        def _split_heads(self, tensor: torch.Tensor, num_heads: int, attn_head_size: int) -> torch.Tensor:
            new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)  # noqa: RUF005
            return tensor.view(new_shape).permute(0, 2, 1, 3)

        def _merge_heads(self, tensor: torch.Tensor, num_heads: int, attn_head_size: int) -> torch.Tensor:
            tensor = tensor.permute(0, 2, 1, 3).contiguous()
            new_shape = tensor.size()[:-2] + (num_heads * attn_head_size,)  # noqa: RUF005
            return tensor.view(new_shape)

        def forward(self, hidden_states: torch.Tensor, *_: Any, **__: Any) -> Any:
            query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
            query = self._split_heads(query, self.num_heads, self.head_dim)
            key = self._split_heads(key, self.num_heads, self.head_dim)
            value = self._split_heads(value, self.num_heads, self.head_dim)
            scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_dim)
            out = torch.matmul(self.attn_dropout(scores.softmax(-1)), value)
            out = self._merge_heads(out, self.num_heads, self.head_dim)
            return self.resid_dropout(self.c_proj(out)), None

    cfg = GPT2Config(n_embd=32, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, attn_implementation="eager")
    return SlapoSpelledGPT2Attention(cfg)


def _gpt2_plan(s: sf.Schedule) -> sf.Schedule:
    return sf.shard(sf.shard(s, "c_attn", axis=1, packed=3), "c_proj", axis=0)


def _run_gpt2(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    r = parity(_gpt2_attention(), _gpt2_plan, (x,), shape=(world,), loss=_loss)
    return {"on_dtensors": r["on_dtensors"], "fwd": r["fwd"], "bwd": r["bwd"], "grads": r["grads"]}


def test_gpt2_attention_in_slapos_spelling_runs_equal_at_the_megatron_optimum(dist2: Any) -> None:
    got = dist2.run(_run_gpt2, timeout=120)
    assert got[0] == got[1]
    assert not got[0]["on_dtensors"]
    assert {"fwd": got[0]["fwd"], "bwd": got[0]["bwd"]} == MEGATRON
    assert got[0]["grads"] == 4  # c_attn and c_proj: weight and bias each
