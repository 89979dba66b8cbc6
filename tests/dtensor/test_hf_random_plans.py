"""Random plans over real Hugging Face models, on 2 gloo ranks: equal or refused.

The layout property test (``test_layout_properties.py``) draws module trees written here;
this one draws plans over models nobody here wrote: tiny LLaMA, Mistral, GPT-2 (packed
``Conv1D``), BERT, OPT, GPT-J, GPT-NeoX, Phi-3, Qwen3 and OLMo-2 built from configs. A plan is a random part of
the family's Megatron plan (whole pairs, or a column without its row, a row without its
columns), random extra shards on any ``Linear``/``Embedding``/``Conv1D`` along either axis,
random ``sync`` calls, and sometimes a sequence-parallel chain over the layers and the
final norm. Each case either raises ``LayoutError``/``ScheduleError`` (at schedule time, in
build, or at the first forward) or equals the single-process model on the output and
every gradient, with ``explain``'s counts equal to the collectives that ran.

* CI (profile ``gate``, derandomised): ``BATCHES`` × ``BATCH`` cases, a fixed set.
* More: ``SLAPO_HF_PLANS=40 HYPOTHESIS_PROFILE=explore pytest tests/dtensor/test_hf_random_plans.py``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from models import tiny_bert, tiny_gpt2, tiny_llama
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.hf import is_conv1d

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

BATCH = 8
_TRACE = bool(os.environ.get("SLAPO_HF_PLANS_TRACE"))
BATCHES = int(os.environ.get("SLAPO_HF_PLANS", "5"))
VOCAB = 128

#: per family: the layers' pattern, what else a chain over them takes (the final norm), and
#: the Megatron plan of one layer: (module path in the layer, axis, packed)
_LAYER_PLANS: dict[str, tuple[str, tuple[str, ...], tuple[tuple[str, int, int], ...]]] = {
    "llama": ("model.layers", ("model.norm",), (
        ("self_attn.q_proj", 0, 1), ("self_attn.k_proj", 0, 1), ("self_attn.v_proj", 0, 1),
        ("self_attn.o_proj", 1, 1), ("mlp.gate_proj", 0, 1), ("mlp.up_proj", 0, 1), ("mlp.down_proj", 1, 1))),
    "mistral": ("model.layers", ("model.norm",), (
        ("self_attn.q_proj", 0, 1), ("self_attn.k_proj", 0, 1), ("self_attn.v_proj", 0, 1),
        ("self_attn.o_proj", 1, 1), ("mlp.gate_proj", 0, 1), ("mlp.up_proj", 0, 1), ("mlp.down_proj", 1, 1))),
    "gpt2": ("transformer.h", ("transformer.ln_f",), (
        ("attn.c_attn", 1, 3), ("attn.c_proj", 0, 1), ("mlp.c_fc", 1, 1), ("mlp.c_proj", 0, 1))),
    "bert": ("encoder.layer", (), (
        ("attention.self.query", 0, 1), ("attention.self.key", 0, 1), ("attention.self.value", 0, 1),
        ("attention.output.dense", 1, 1), ("intermediate.dense", 0, 1), ("output.dense", 1, 1))),
    "opt": ("model.decoder.layers", ("model.decoder.final_layer_norm",), (
        ("self_attn.q_proj", 0, 1), ("self_attn.k_proj", 0, 1), ("self_attn.v_proj", 0, 1),
        ("self_attn.out_proj", 1, 1), ("fc1", 0, 1), ("fc2", 1, 1))),
    "gptj": ("transformer.h", ("transformer.ln_f",), (
        ("attn.q_proj", 0, 1), ("attn.k_proj", 0, 1), ("attn.v_proj", 0, 1), ("attn.out_proj", 1, 1),
        ("mlp.fc_in", 0, 1), ("mlp.fc_out", 1, 1))),
    "neox": ("gpt_neox.layers", ("gpt_neox.final_layer_norm",), (
        ("attention.query_key_value", 0, 1), ("attention.dense", 1, 1), ("mlp.dense_h_to_4h", 0, 1),
        ("mlp.dense_4h_to_h", 1, 1))),
    # [q|k|v] sliced at fixed positions, [gate|up] chunked
    "phi3": ("model.layers", ("model.norm",), (
        ("self_attn.qkv_proj", 0, 3), ("self_attn.o_proj", 1, 1), ("mlp.gate_up_proj", 0, 2),
        ("mlp.down_proj", 1, 1))),
    # RMSNorms over each head (Qwen3) and over the whole projection (OLMo-2)
    "qwen3": ("model.layers", ("model.norm",), (
        ("self_attn.q_proj", 0, 1), ("self_attn.k_proj", 0, 1), ("self_attn.v_proj", 0, 1),
        ("self_attn.o_proj", 1, 1), ("mlp.gate_proj", 0, 1), ("mlp.up_proj", 0, 1), ("mlp.down_proj", 1, 1))),
    "olmo2": ("model.layers", ("model.norm",), (
        ("self_attn.q_proj", 0, 1), ("self_attn.k_proj", 0, 1), ("self_attn.v_proj", 0, 1),
        ("self_attn.o_proj", 1, 1), ("mlp.gate_proj", 0, 1), ("mlp.up_proj", 0, 1), ("mlp.down_proj", 1, 1))),
}
FAMILIES = tuple(_LAYER_PLANS)


@functools.cache
def _model(family: str) -> nn.Module:
    """The family's tiny model (2 layers, random weights from seed 0); never mutated."""
    torch.manual_seed(0)
    if family == "llama":
        return tiny_llama()
    if family == "gpt2":
        return tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "bert":
        return tiny_bert()
    from transformers import (
        GPTJConfig,
        GPTJForCausalLM,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        OPTConfig,
        OPTForCausalLM,
    )

    lm: dict[str, Any] = {"vocab_size": VOCAB, "use_cache": False, "attn_implementation": "eager"}
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                num_key_value_heads=2, num_hidden_layers=2, **lm))
    if family == "opt":
        return OPTForCausalLM(OPTConfig(hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                                        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                        word_embed_proj_dim=64, **lm))
    if family == "gptj":
        return GPTJForCausalLM(GPTJConfig(n_embd=64, n_layer=2, n_head=4, n_positions=32, rotary_dim=8,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **lm))
    if family in ("phi3", "qwen3", "olmo2"):
        import transformers

        name = {"phi3": "Phi3", "qwen3": "Qwen3", "olmo2": "Olmo2"}[family]
        extra: dict[str, Any] = {"head_dim": 16} if family == "qwen3" else {}
        if family == "phi3":
            extra = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
        cfg = getattr(transformers, f"{name}Config")(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                     num_key_value_heads=2, num_hidden_layers=2, **extra, **lm)
        return getattr(transformers, f"{name}ForCausalLM")(cfg)  # type: ignore[no-any-return]
    assert family == "neox"
    return GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                            num_hidden_layers=2, max_position_embeddings=32, rotary_pct=0.5,
                                            hidden_dropout=0.0, attention_dropout=0.0, **lm))


@functools.cache
def _shardable(family: str) -> tuple[str, ...]:
    return tuple(n for n, m in _model(family).named_modules()
                 if type(m) in (nn.Linear, nn.Embedding) or is_conv1d(m))


@functools.cache
def _modules(family: str) -> tuple[str, ...]:
    """Every module path but the containers' (ModuleLists), the root as ``""``."""
    return tuple(n for n, m in _model(family).named_modules() if not isinstance(m, nn.ModuleList))


def _megatron(family: str) -> tuple[tuple[str, int, int], ...]:
    """Every layer's Megatron shard calls, as (path, axis, packed)."""
    layers, _, per_layer = _LAYER_PLANS[family]
    return tuple((f"{layers}.{i}.{q}", axis, packed) for i in range(2) for q, axis, packed in per_layer)


_LAYOUTS = {"R": Replicate(), "S(-1)": Shard(-1), "S(1)": Shard(1)}
_SOURCES = {**_LAYOUTS, "P": Partial()}


@dataclass(frozen=True)
class Case:
    family: str
    shards: tuple[tuple[str, int, int], ...]  # (path, axis, packed)
    syncs: tuple[tuple[str, str, str, str | None], ...] = ()  # (path, mode, layout, src)
    sp: bool = False

    def apply(self, sch: sf.Schedule) -> sf.Schedule:
        for path, axis, packed in self.shards:
            sch = sf.shard(sch, path, axis=axis, packed=packed)
        for path, mode, layout, src in self.syncs:
            sch = sf.sync(sch, path, mode, _LAYOUTS[layout], src=None if src is None else _SOURCES[src])
        if self.sp:
            layers, tail, _ = _LAYER_PLANS[self.family]
            sch = sf.sequence_parallel(sch, [f"{layers}.*", *tail])
        return sch


@st.composite
def cases(draw: Any) -> Case:
    family = draw(st.sampled_from(FAMILIES))
    megatron = _megatron(family)
    kept = draw(st.lists(st.booleans(), min_size=len(megatron), max_size=len(megatron)))
    base = draw(st.sampled_from(["all", "some", "none"]))
    shards = [s for s, keep in zip(megatron, kept, strict=True) if base == "all" or (base == "some" and keep)]
    taken = {p for p, _, _ in shards}
    for path in draw(st.lists(st.sampled_from(_shardable(family)), max_size=3, unique=True)):
        if path not in taken:
            shards.append((path, draw(st.sampled_from([0, 1])), 1))
            taken.add(path)
    syncs = []
    for _ in range(draw(st.integers(0, 2))):
        where = draw(st.sampled_from(["shard", "parent", "any"] if shards else ["any"]))
        if where == "any":  # a norm, a layer, the root, a dropout
            path = draw(st.sampled_from(_modules(family)))
        else:
            path = draw(st.sampled_from([p for p, _, _ in shards]))
            path = path.rsplit(".", 1)[0] if where == "parent" else path  # attention, MLP
        mode = draw(st.sampled_from(["fwd_post", "fwd_pre"]))
        src = draw(st.sampled_from([None, None, *_SOURCES]))
        syncs.append((path, mode, draw(st.sampled_from(list(_LAYOUTS))), src))
    return Case(family, tuple(shards), tuple(syncs), draw(st.integers(0, 3)) == 0)


_FIELDS = ("logits", "last_hidden_state", "pooler_output")


def _whole(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` as the whole output of ``shape``: where a plan states the model's output
    sharded (vocab-parallel logits, a sequence shard), gathered along the dimension that
    differs, by plain c10d (not one of the model's collectives the test counts); the
    gradient flows to this rank's piece alone, as the plan's own backward expects."""
    if t.shape == shape:
        return t
    dim = next(d for d in range(t.dim()) if t.shape[d] != shape[d])
    pieces = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(pieces, t.detach().contiguous())
    rank = torch.distributed.get_rank()
    return torch.cat([t if r == rank else p for r, p in enumerate(pieces)], dim=dim)


def _loss_against(reference: Any) -> Callable[[Any, sf.Schedule], torch.Tensor]:
    """Every output the model returns, whole, features weighted unevenly (a permutation of
    them cannot cancel out)."""
    shapes = {f: reference[f].shape for f in _FIELDS if isinstance(reference.get(f), torch.Tensor)}

    def loss(out: Any, _: sf.Schedule) -> torch.Tensor:
        whole = [_whole(out[f], shape) for f, shape in shapes.items()]
        return sum((t.float() * torch.linspace(0.5, 1.5, t.shape[-1])).pow(2).mean() for t in whole)  # type: ignore[return-value]

    return loss


def _run(rank: int, world: int, batch: list[Case]) -> list[tuple[str, str]]:
    """(status, why) per case on this rank: ``equal``, ``refused``, or what broke."""
    out = []
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for case in batch:
        if _TRACE:  # which case a rank was on when it died (a native crash leaves no traceback)
            print(f"rank {rank}: {case!r}", file=sys.stderr, flush=True)
        model = _model(case.family)
        with torch.no_grad():
            loss = _loss_against(model(ids))
        try:
            r = parity(model, case.apply, (ids,), shape=(world,), loss=loss, tracker=False)
        except (sf.LayoutError, sf.ScheduleError) as e:
            out.append(("refused", str(e).splitlines()[0][:300]))
            continue
        except Exception as e:  # wrong numbers (AssertionError) or a raw error from model code
            out.append(("broken", f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"))
            continue
        # on DTensor activations explain counts DTensor's own collectives on fake tensors, or says it cannot
        if r["predicted"] is not None and (r["predicted"]["forward"] != r["fwd"]
                                           or r["predicted"]["backward"] != r["bwd"]):
            out.append(("explain", f"predicted {r['predicted']}, ran forward {r['fwd']} backward {r['bwd']}"))
            continue
        out.append(("equal", ""))
    return out


def _settings(n: int) -> Callable[[Any], Any]:
    return settings(max_examples=n, deadline=None, database=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_random_plans_over_hugging_face_models_are_equal_or_refused(dist2: Any) -> None:
    stats: dict[str, int] = {}
    t0 = time.monotonic()

    @_settings(BATCHES)
    @given(st.lists(cases(), min_size=BATCH, max_size=BATCH))
    def batch(todo: list[Case]) -> None:
        per_rank = dist2.run(_run, todo, timeout=300)
        failures = []
        for i, case in enumerate(todo):
            results = [r[i] for r in per_rank]
            status = results[0][0]
            stats[status] = stats.get(status, 0) + 1
            if status not in ("equal", "refused") or len(set(results)) > 1:
                failures.append(f"{case!r}\n    " + "\n    ".join(f"rank {k}: {s}: {w}"
                                                                 for k, (s, w) in enumerate(results)))
        assert not failures, f"{len(failures)} of {len(todo)} cases broke the promise:\n" + "\n".join(failures)

    batch()
    print(f"\nhf random plans: {sum(stats.values())} cases in {time.monotonic() - t0:.1f} s: {stats}")
    assert stats.get("equal", 0) >= sum(stats.values()) // 6, f"too few cases ran to the end: {stats}"


def check(case: Case, pool: Any) -> list[tuple[str, str]]:
    """One case on ``pool`` (a repro: ``check(Case(...), dist2)`` in a test)."""
    return [r[0] for r in pool.run(_run, [case], timeout=300)]



#: Cases the search found, kept with the outcome each must now have.
FOUND: dict[str, tuple[Case, str]] = {
    # a fwd_post sync on the root of a model returning a ModelOutput was skipped (the runtime
    # converted tensors and tuples only) while explain counted it
    "root-sync-on-a-model-output": (Case("llama", _megatron("llama"), (("", "fwd_post", "S(1)", None),)), "equal"),
    # vocab-parallel logits kept split, beside an embedding sharded by features
    "logits-kept-split": (Case("neox", (("lm_head", 0, 1), ("gpt_neox.embed_in", 1, 1)),
                               (("lm_head", "fwd_post", "S(-1)", None),)), "equal"),
    # BERT's embeddings (fx cannot trace them) with one sharded by features: the plan took their
    # output for unknown, so a stated Shard(-1) downstream was believed and gathered whole features
    # (a raw shape error); a feature-split embedding gathers its output, so they are whole
    "src-believed-after-untraced-embeddings": (Case(
        "bert", (("encoder.layer.0.attention.self.query", 0, 1), ("embeddings.position_embeddings", 1, 1),
                 ("pooler.dense", 0, 1)),
        (("encoder.layer.0.attention.self", "fwd_post", "R", "S(-1)"), ("pooler.dense", "fwd_post", "S(-1)", None))),
        "refused"),
    # a row's fwd_pre sync stating Shard(-1) arrives (from itself: it converts nothing) in a
    # decoder layer the flow cannot see into, fed whole by an unsharded fc1: the plan believed
    # it, the runtime split the input by its shape (numbers right, one all-gather explain did
    # not count); refused at the first forward, naming the row
    "row-stated-split-but-fed-whole": (Case(
        "opt", (("model.decoder.layers.1.fc2", 1, 1),), (("model.decoder.layers.1.fc2", "fwd_pre", "S(-1)", "S(-1)"),)),
        "refused"),
    # OPTForCausalLM calls self.model.decoder, never self.model: a sync on 'model' never ran, and
    # the parameters 'model' was to hand on as local values stayed DTensors (a raw "mixed
    # torch.Tensor and DTensor" from the embedding)
    "sync-on-a-module-its-parent-bypasses": (Case("opt", (), (("model", "fwd_post", "R", None),)), "refused"),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_cases_the_search_found_keep_their_outcome(dist2: Any, name: str) -> None:
    case, outcome = FOUND[name]
    assert [status for status, _ in check(case, dist2)] == [outcome] * 2
