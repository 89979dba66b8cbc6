"""Models whose layers live in an ``nn.ModuleList`` that the model's loop calls — PyTorch's
test ``Transformer`` and a Hugging Face LLaMA whose config asks for a cache — under plans
nobody tuned for: partial ones, wrong ``src``\\ s, token and feature splits in odd places.
Each is equal to the unsharded model (loss, input and every gradient; explain's counts
equal the run's), on local shards or on DTensor activations, or a ``LayoutError`` before
running for a statement its layouts contradict. Before the plan read the flow past
the list, a wrong ``src`` inside a layer all-reduced a whole value (twice the output), a
layer left unsharded beside a sharded one met DTensor parameters in its norms, and a row
split by features leaving its block reached a raw shape error."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from models import tiny_llama
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
from tp_checks import parity

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

Plan = Callable[[sf.Schedule], sf.Schedule]
R = Replicate()


def _pairs(prefix: str, columns: tuple[str, ...], rows: tuple[str, ...]) -> Plan:
    step = sf.shard.at(columns[0], axis=0)
    for name in columns[1:]:
        step = step >> sf.shard.at(name, axis=0)
    for name in rows:
        step = step >> sf.shard.at(name, axis=1)
    return sf.foreach(prefix, step)


TORCH = _pairs("layers.*", ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"),
               ("attention.wo", "feed_forward.w2"))
LLAMA = _pairs("model.layers.*", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                                  "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj"))

#: plan -> "equal", or a phrase of the refusal
TORCH_PLANS: dict[str, tuple[Plan, str]] = {
    "megatron": (TORCH, "equal"),
    "sp": (lambda s: sf.sequence_parallel(TORCH(s), ["layers.*", "norm"]), "equal"),
    "sp-layers-only": (lambda s: sf.sequence_parallel(TORCH(s), ["layers.*"]), "equal"),
    "one-mlp-only": (lambda s: sf.shard(sf.shard(s, "layers.0.feed_forward.w1", axis=0),
                                        "layers.0.feed_forward.w2", axis=1), "equal"),
    "mlp-from-partial": (lambda s: sf.sync(TORCH(s), "layers.0.feed_forward", "fwd_post", R, src=Partial()),
                         "what reaches it leaves its output Replicate()"),
    "norm-from-split": (lambda s: sf.sync(TORCH(s), "layers.1.attention_norm", "fwd_pre", R, src=Shard(-1)),
                        "its input arrives Replicate()"),
    # a row's output kept split by features into the next layer: on DTensor activations
    "row-split-by-features": (lambda s: sf.sync(TORCH(s), "layers.0.feed_forward.w2", "fwd_post", Shard(-1)),
                              "equal"),
    # a layer run on token shards outside a chain (its attention needs every token): on DTensors
    "layer-on-tokens": (lambda s: sf.sync(sf.sync(TORCH(s), "layers.1", "fwd_pre", Shard(1)), "layers.1",
                                          "fwd_post", R, src=Shard(1)), "equal"),
}
LLAMA_PLANS: dict[str, tuple[Plan, str]] = {
    "megatron": (LLAMA, "equal"),
    "sp": (lambda s: sf.sequence_parallel(LLAMA(s), ["model.layers.*", "model.norm"]), "equal"),
    "first-layer-only": (lambda s: _pairs("model.layers.0", ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))(s),
                         "equal"),
    "mlp-from-partial": (lambda s: sf.sync(LLAMA(s), "model.layers.1.mlp", "fwd_post", R, src=Partial()),
                         "what reaches it leaves its output Replicate()"),
    "row-split-by-features": (lambda s: sf.sync(LLAMA(s), "model.layers.1.mlp.down_proj", "fwd_post", Shard(-1)),
                              "equal"),
}


def _outcomes(rank: int, world: int, family: str) -> dict[str, str]:
    out = {}
    for name, (plan, _) in (TORCH_PLANS if family == "torch" else LLAMA_PLANS).items():
        torch.manual_seed(0)
        if family == "torch":
            model = Transformer(ModelArgs(n_layers=2, vocab_size=16, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0))
        else:
            model = tiny_llama(2, use_cache=True)
        ids = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
        try:
            r = parity(model, plan, (ids,), shape=(world,), tracker=False)
        except sf.LayoutError as e:
            out[name] = "refused: " + str(e)
            continue
        except Exception as e:  # wrong numbers (AssertionError) or a raw error from model code
            out[name] = f"bug: {type(e).__name__}: {e}"
            continue
        ran = {"forward": r["fwd"], "backward": r["bwd"]}
        if r["predicted"] is None:  # on DTensor activations, in a model explain's fake run cannot follow
            out[name] = "equal" if r["on_dtensors"] else "counts: explain predicted none"
            continue
        predicted = {k: {op: n for op, n in v.items() if n} for k, v in r["predicted"].items()}
        out[name] = "equal" if predicted == ran else f"counts: ran {ran}, explain {predicted}"
    return out


_RESULTS: dict[str, list[dict[str, str]]] = {}


def _results(pool, family: str) -> list[dict[str, str]]:
    if family not in _RESULTS:
        _RESULTS[family] = pool.run(_outcomes, family, timeout=240)
    return _RESULTS[family]


@pytest.mark.parametrize("family", ["torch", "llama"])
def test_layers_in_a_module_list_are_equal_or_refused_before_running(dist2, family: str) -> None:
    results = _results(dist2, family)
    assert results[0].keys() == results[1].keys()
    expected = TORCH_PLANS if family == "torch" else LLAMA_PLANS
    for name, (_, want) in expected.items():
        got = results[0][name]
        if want == "equal":
            assert got == "equal", (name, got)
        else:
            assert got.startswith("refused: ") and want in got, (name, got)


def test_explain_counts_a_row_split_by_features_on_dtensors(dist2) -> None:
    assert _results(dist2, "torch")[0]["row-split-by-features"] == "equal"

