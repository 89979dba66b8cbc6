"""The table of cases of ``test_tp_regressions.py`` (the issue "Layouts that are right for
every plan"): each a model, a schedule rewrite and its inputs (:data:`CASES`), with the
verdict it must give on 2 ranks (:data:`EXPECTED`: equal to the unsharded model, or the
start of the ``LayoutError`` that refuses it before it runs), and the run of one case on a
rank (:func:`_case`). A class or a rewrite sits beside the case that needs it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from models import megatron_llama, tiny_bert, tiny_llama, token_ids
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from tp_checks import parity

import slapo_fn as sf


class NormHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


class EmbedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.embed(ids)))


class ShardThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _weighted(out: Any, _: Any) -> torch.Tensor:
    if isinstance(out, dict) and set(out) == {"loss"}:
        return out["loss"]
    if not isinstance(out, torch.Tensor):
        out = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    return (out.float() * torch.linspace(0.5, 1.5, out.shape[-1])).pow(2).mean()


X = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
IDS = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(2))

CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[sf.Schedule], sf.Schedule], tuple[Any, ...]]] = {
    # PyTorch's own SP layout for the LM head after the final norm
    "sp-norm-then-column-head": (
        NormHead,
        lambda s: sf.sequence_parallel(sf.shard(s, "head", axis=0), ["norm", "head"]),
        (X,),
    ),
    "vocab-embedding-first-in-sp-chain": (
        EmbedNorm,
        lambda s: sf.sequence_parallel(sf.shard(s, "embed", axis=0), ["embed", "norm"]),
        (IDS,),
    ),
    "sequence-shard-before-an-unsharded-linear": (
        ShardThenLinear,
        lambda s: sf.sync(s, "a", "fwd_post", Shard(1)),
        (X,),
    ),
    # 5 tokens over 2 ranks: uneven shards would abort the process group on the next collective
    "uneven-sequence": (
        NormHead,
        lambda s: sf.sequence_parallel(sf.shard(s, "head", axis=0), ["body", "norm", "head"]),
        (torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3)),),
    ),
    "root-sync-with-child-syncs": (
        ShardThenLinear,
        lambda s: sf.sync(sf.sync(sf.shard(s, "b", axis=0), "a", "fwd_pre", Shard(1)), "", "fwd_post", Replicate(),
                          src=Shard(1)),
        (X,),
    ),
    # a packed column's local output is [A_r|B_r]: a row reading it as one contiguous shard
    # was silently wrong (0.4 of the output's scale); the row packed alike is exact
    "packed-column-into-a-contiguous-row": (
        lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
        lambda s: sf.shard(sf.shard(s, "0", axis=0, packed=2), "2", axis=1),
        (X,),
    ),
    "packed-column-into-a-row-packed-alike": (
        lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
        lambda s: sf.shard(sf.shard(s, "0", axis=0, packed=2), "2", axis=1, packed=2),
        (X,),
    ),
    # a chain member between a Megatron pair: it split and gathered the column's feature
    # shard along the sequence, mixing the ranks' features (silently wrong, 0.2 of 1); the
    # data flow (0 feeds the member, not the row) now gathers the column's output instead
    "sp-member-inside-a-pair": (
        lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
        lambda s: sf.sequence_parallel(sf.shard(sf.shard(s, "0", axis=0), "2", axis=1), "1"),
        (X,),
    ),
    # decoder layers in the chain with only their MLPs sharded: attention on sequence shards
    "sp-layers-with-unsharded-attention": (
        lambda: tiny_llama(2),
        lambda s: sf.sequence_parallel(
            sf.shard(sf.shard(s, "model.layers.*.mlp.{gate,up}_proj", axis=0), "model.layers.*.mlp.down_proj",
                     axis=1),
            ["model.layers.*", "model.norm"]),
        (token_ids(),),
    ),
    # the norms alone, not their decoder layers: each norm's sequence shard would reach the
    # MLP (outside the chain) whole-length; it was a raw shape error inside LlamaDecoderLayer
    "sp-norms-without-their-layers": (
        lambda: tiny_llama(2),
        lambda s: sf.sequence_parallel(
            sf.shard(sf.shard(s, "model.layers.*.mlp.{gate,up}_proj", axis=0), "model.layers.*.mlp.down_proj",
                     axis=1),
            "model.layers.*.post_attention_layernorm"),
        (token_ids(),),
    ),
    # the "up_proj and down_proj sharded, gate_proj not": the up output was kept
    # sharded and met gate's full one ("size of tensor a (128) must match b (64)"); the
    # data flow sees down_proj fed by an unsharded module, so up_proj's output is gathered
    "llama-mlp-gate-unsharded": (
        lambda: tiny_llama(1),
        lambda s: sf.shard(sf.shard(s, "model.layers.0.mlp.up_proj", axis=0), "model.layers.0.mlp.down_proj",
                           axis=1),
        (token_ids(),),
    ),
    # gate column, up row, down row: module order paired gate with up (a row registered
    # after it that never reads it): a shape error in the parent's forward
    "gate-column-up-row-down-row": (
        lambda: Gated(),
        lambda s: sf.shard(sf.shard(sf.shard(s, "gate", axis=0), "up", axis=1), "down", axis=1),
        (X,),
    ),
    # LLaMA registers self_attn before input_layernorm: in module order the two norms of a
    # layer followed one another, in data flow self_attn runs between them on a sequence shard
    "sp-layer-norms-around-attention": (
        lambda: tiny_llama(1),
        lambda s: sf.sequence_parallel(s, "model.layers.0.{input,post_attention}_layernorm"),
        (token_ids(),),
    ),
    # the column's output meets the block's input before the row: gathered, not kept local
    "column-into-residual-then-row": (
        lambda: Residual(),
        lambda s: sf.shard(sf.shard(s, "a", axis=0), "b", axis=1),
        (X,),
    ),
    # the vocab embedding enters the chain by reduce-scattering its partial output: told that
    # the ids arrive split as well, it split the sequence twice (output (2, 2, 8) for (2, 4, 8))
    "vocab-first-in-a-chain-told-its-input-is-split": (
        EmbedNorm,
        lambda s: sf.sequence_parallel(sf.shard(s, "embed", axis=0), ["embed", "norm"], input_layout=Shard(1)),
        (IDS,),
    ),
    # the chain's last member keeps its output split (fwd_post Shard(1)): the Linear after the
    # chain ran on half the tokens, silently (output (2, 2, 8) for (2, 4, 8))
    "sp-exit-kept-split-before-a-linear": (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)),
        lambda s: sf.sequence_parallel(sf.sync(s, "1", "fwd_post", Shard(1)), ["0", "1"]),
        (X,),
    ),
    # F.linear(x, self.proj.weight): the parent bypasses proj's installed forward ("mixed
    # torch.Tensor and DTensor" inside the parent's code)
    "child-read-functionally-while-sharded": (
        lambda: nn.Sequential(OrderedDict(reads=ReadsChild(), out=nn.Linear(8, 8))),
        lambda s: sf.shard(s, "reads.proj", axis=0),
        (X,),
    ),
    # a feature shard handed to a Linear that needs all 8 features: a raw matmul shape error
    "feature-sync-into-an-unsharded-linear": (
        ShardThenLinear,
        lambda s: sf.sync(s, "b", "fwd_pre", Shard(-1)),
        (X,),
    ),
    # an axis=1 embedding first in a chain: silently wrong (max abs diff 1.49 of 1.2)
    "feature-sharded-embedding-in-a-chain": (
        EmbedNorm,
        lambda s: sf.sequence_parallel(sf.shard(s, "embed", axis=1), ["embed", "norm"]),
        (IDS,),
    ),
    # an unsharded gate split by its own sync beside an up column: up was gathered (its row
    # also read gate, not a column) and met gate's split output: raw "size of tensor a (4)"
    "gate-split-by-a-sync-beside-an-up-column": (
        lambda: Gated(),
        lambda s: sf.sync(sf.shard(sf.shard(s, "up", axis=0), "down", axis=1), "gate", "fwd_post", Shard(-1),
                          src=Replicate()),
        (X,),
    ),
    # the same with the gate an activation split on entry (its fwd_pre sync): its output is this
    # rank's features, so up stays split for down (one all-reduce, no gather of up)
    "activation-split-on-entry-beside-an-up-column": (
        lambda: GatedAct(),
        lambda s: sf.sync(sf.shard(sf.shard(s, "up", axis=0), "down", axis=1), "act", "fwd_pre", Shard(-1),
                          src=Replicate()),
        (X,),
    ),
    # a pointwise module handed split features is the model's output, and the root's fwd_post
    # sync to Replicate() without src= took it as replicated: output (2, 4, 4) for (2, 4, 8)
    "split-output-under-a-root-sync-without-src": (
        lambda: nn.Sequential(OrderedDict(fc=nn.Linear(8, 8), act=nn.ReLU())),
        lambda s: sf.sync(sf.sync(s, "", "fwd_post", Replicate()), "act", "fwd_pre", Shard(-1), src=Replicate()),
        (X,),
    ),
    # a token shard through an activation whose sync states a layout to itself (it moves
    # nothing, but hid the activation from the walk): fc2 took half the sequence, output (2, 2, 8)
    "token-shard-through-a-no-op-sync": (
        lambda: nn.Sequential(OrderedDict(fc1=nn.Linear(8, 8), act=nn.ReLU(), fc2=nn.Linear(8, 8))),
        lambda s: sf.sync(sf.sync(s, "act", "fwd_post", Shard(-1), src=Shard(-1)), "fc1", "fwd_post", Shard(1)),
        (X,),
    ),
    # a(x) + b(x) with b's output split along the sequence: in module order nothing with
    # parameters came after b, so it was let through (a raw shape error in the add)
    "token-shard-meets-a-branch": (
        lambda: nn.Sequential(OrderedDict(branches=Branches(), out=nn.Identity())),
        lambda s: sf.sync(s, "branches.b", "fwd_post", Shard(1)),
        (X,),
    ),
}


class ReadsChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.linear(x, self.proj.weight, self.proj.bias))


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


class GatedAct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act, self.up, self.down = nn.SiLU(), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(x) * self.up(x))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.gate(x)) * self.up(x))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) + x)


class UntracedHeads(nn.Module):
    """Attention viewed by a head count of a name slapo_fn does not know (``self.nh``),
    behind a branch on a value, so fx cannot trace it: at tp=2 the view would take this
    rank's 4 features for 2 whole heads of 2 — silently wrong attention."""

    def __init__(self) -> None:
        super().__init__()
        self.nh = 2
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, self.nh, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        a = a if x.sum() > 0 else -a
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


def _untraced_heads(gather: bool) -> Callable[[sf.Schedule], sf.Schedule]:
    def rewrite(s: sf.Schedule) -> sf.Schedule:
        s = sf.shard(sf.shard(s, ["0.q", "0.k", "0.v"], axis=0), "0.o", axis=1)
        for c in ("q", "k", "v") if gather else ():
            s = sf.sync(s, f"0.{c}", "fwd_post", Replicate())
        return s

    return rewrite


def _slapo_bert(s: sf.Schedule) -> sf.Schedule:
    """Slapo's own BERT schedule, translated: Megatron shards, an all-reduce of the input
    gradient stated on each column (``sync(mode="bwd_post", sync_op_or_fn="all_reduce")``)
    and on the module holding them, and a module replaced (its kernel fused) elsewhere."""
    attn = "encoder.layer.*.attention."
    s = sf.shard(sf.shard(s, attn + "self.{query,key,value}", axis=0), attn + "output.dense", axis=1)
    s = sf.sync(s, attn + "self.{query,key,value}", "bwd_post", Replicate(), src=Partial())
    s = sf.sync(s, attn + "self", "bwd_post", Replicate(), src=Partial())
    return sf.replace(s, "embeddings.LayerNorm", lambda old, path: type(old)(old.normalized_shape, old.eps))


# Slapo's bwd_post all-reduces on columns restate what their entries do: summed again, every input
# gradient was twice too large wherever the schedule also held a replace (the check was skipped)
CASES["slapo-bwd-post-syncs-on-columns-beside-a-replace"] = (lambda: tiny_bert(layers=1), _slapo_bert, (IDS,))
# tp_local on a module the whole activation reaches: its gradients were summed over the ranks (x2)
CASES["tp-local-on-a-norm-that-sees-the-whole-input"] = (
    lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)), lambda s: sf.tp_local(s, "1"), (X,))
CASES["tp-local-on-llamas-final-norm"] = (
    lambda: tiny_llama(layers=1), lambda s: sf.tp_local(megatron_llama(s), "model.norm"), (IDS,))


CASES["untraced-attention-paired-by-module-order"] = (
    lambda: nn.Sequential(UntracedHeads(), nn.Linear(8, 8)), _untraced_heads(gather=False), (X,))
CASES["untraced-attention-with-its-columns-gathered"] = (
    lambda: nn.Sequential(UntracedHeads(), nn.Linear(8, 8)), _untraced_heads(gather=True), (X,))


class Positions(nn.Embedding):
    """Learned positions (OPT's): an Embedding whose own forward computes the ids it looks up."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(torch.arange(ids.shape[-1]).expand_as(ids) + 2)


class TokensAndPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos, self.out = nn.Embedding(16, 8), Positions(8, 8), nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids) + self.pos(ids))


# a vocab-parallel forward would replace Positions' own: raw "unexpected keyword argument" on OPT's
CASES["embedding-subclass-with-its-own-forward"] = (TokensAndPositions, lambda s: sf.shard(s, "pos", axis=0), (IDS,))
CASES["embedding-subclass-sharded-by-its-weight"] = (
    TokensAndPositions, lambda s: sf.shard(s, "pos.weight", axis=0), (IDS,))


class LossOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.lin(x).pow(2).mean()}


# a fwd_post sync on a module whose output holds no tensor it converts was skipped silently
CASES["sync-on-an-output-without-an-activation"] = (
    LossOnly, lambda s: sf.sync(s, "", "fwd_post", Shard(1)), (X,))

# sequence parallelism over (batch, features) activations split the features as if they were
# the sequence: a norm then saw half of them (raw error), code over them would be silently wrong
FLAT = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _norm_mlp_sp(seq_axis: int, members: list[str]) -> Callable[[sf.Schedule], sf.Schedule]:
    return lambda s: sf.sequence_parallel(sf.shard(sf.shard(s, "1", axis=0), "2", axis=1), members, seq_axis=seq_axis)


CASES["sp-over-2d-activations"] = (
    lambda: nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)), _norm_mlp_sp(1, ["0", "1", "2"]),
    (FLAT,))
CASES["sp-over-2d-activations-by-the-batch"] = (
    lambda: nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)), _norm_mlp_sp(0, ["0", "1", "2"]),
    (FLAT,))
CASES["sp-over-2d-activations-entered-by-a-row"] = (
    lambda: nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)),
    lambda s: sf.sequence_parallel(sf.shard(sf.shard(s, "0", axis=0), "1", axis=1), ["1", "2"]), (FLAT,))



class SeqMixing(nn.Module):
    """A block whose own code acts over the sequence (here a softmax over it) between its
    norm and its MLP: in a sequence-parallel chain that code runs on this rank's tokens."""

    def __init__(self, code: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.code = code
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.code(self.norm(x)))))


class WithWeights(nn.Module):
    """A sub-module returning ``(hidden, extra)``, as Hugging Face attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), x * 2.0


class SeqMixingAfterATuple(SeqMixing):
    """The softmax over the sequence on the first item of a sub-module's tuple: ``[0]``
    picks the item, it drops no dimension of the activation."""

    def __init__(self) -> None:
        super().__init__(lambda h: h)
        self.sub = WithWeights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.sub(self.norm(x))[0]
        return x + self.fc2(torch.relu(self.fc1(h * h.softmax(1))))


def _seq_mixing_sp(s: sf.Schedule) -> sf.Schedule:
    return sf.sequence_parallel(sf.shard(sf.shard(s, "*.fc1", axis=0), "*.fc2", axis=1), ["0", "1"])


# silently wrong before: each rank's softmax / cumsum / token index over its own tokens
CASES["sp-member-code-softmax-over-the-sequence"] = (
    lambda: nn.Sequential(SeqMixing(lambda h: h * h.softmax(1)), SeqMixing(lambda h: h)), _seq_mixing_sp, (X,))
CASES["sp-member-code-cumsum-over-the-sequence"] = (
    lambda: nn.Sequential(SeqMixing(lambda h: h.cumsum(1)), SeqMixing(lambda h: h)), _seq_mixing_sp, (X,))
class LearnedPositions(SeqMixing):
    """Learned positions added in the block, sliced to its input's length."""

    def __init__(self) -> None:
        super().__init__(lambda h: h)
        self.pos = nn.Parameter(torch.randn(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) + self.pos[: x.size(1)]
        return x + self.fc2(torch.relu(self.fc1(h)))


# positions made from this rank's share of the sequence: every rank's tokens start at 0
CASES["sp-member-code-positions-sliced-by-its-length"] = (
    lambda: nn.Sequential(LearnedPositions(), SeqMixing(lambda h: h)), _seq_mixing_sp, (X,))
CASES["sp-member-code-positions-counted-to-its-length"] = (
    lambda: nn.Sequential(SeqMixing(lambda h: h * torch.arange(h.shape[1]).unsqueeze(-1)), SeqMixing(lambda h: h)),
    _seq_mixing_sp, (X,))
CASES["sp-member-code-viewed-by-its-length"] = (
    lambda: nn.Sequential(SeqMixing(lambda h: h.view(h.size(0), h.size(1), 2, 4).flatten(2)),
                          SeqMixing(lambda h: h)), _seq_mixing_sp, (X,))


class TokenRoll(nn.Module):
    """A module of a user's own, without children, whose code moves the tokens."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.roll(x, 1, dims=1)


class UserRMSNorm(nn.Module):
    """A user's own norm without children: over each token's features."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Branchy(nn.Module):
    """A module without children that fx cannot trace (a branch on a tensor's value)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if bool(x.sum() > 0) else x


class BranchyMix(nn.Module):
    """A module with a child whose forward fx cannot trace (a branch on a tensor's value),
    and that sums over the tokens on the way."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + h.mean(1, keepdim=True) if bool(h.abs().sum() > 0) else h


class CodeAfter(SeqMixing):
    """The block's own code after its MLP (on its output, handed to no module after)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.code(x + self.fc2(torch.relu(self.fc1(self.norm(x)))))


# the batch and the tokens flattened together, x.view(-1, x.shape[-1]), was read as the tokens
# merged into the last dimension: an op over the flattened dimension 0 (over every token) went
# unseen, silently wrong
CASES["sp-member-code-over-flattened-tokens-softmax"] = (
    lambda: nn.Sequential(CodeAfter(lambda h: h.view(-1, h.shape[-1]).softmax(0).view(h.shape)),
                          SeqMixing(lambda h: h)), _seq_mixing_sp, (X,))
CASES["sp-member-code-over-flattened-tokens-mean"] = (
    lambda: nn.Sequential(CodeAfter(lambda h: h + h.view(-1, h.shape[-1]).mean(0)), SeqMixing(lambda h: h)),
    _seq_mixing_sp, (X,))


# modules without children were not walked: their own code on a token shard went unread
CASES["sp-member-leaf-module-over-the-sequence"] = (
    lambda: nn.Sequential(SeqMixing(TokenRoll()), SeqMixing(lambda h: h)), _seq_mixing_sp, (X,))
CASES["sp-member-leaf-module-over-each-token"] = (
    lambda: nn.Sequential(SeqMixing(UserRMSNorm()), SeqMixing(lambda h: h)), _seq_mixing_sp, (X,))
CASES["sp-member-child-fx-cannot-trace"] = (
    lambda: nn.Sequential(SeqMixing(BranchyMix()), SeqMixing(lambda h: h)), _seq_mixing_sp, (X,))
CASES["sp-member-leaf-module-fx-cannot-trace"] = (
    lambda: nn.Sequential(SeqMixing(Branchy()), SeqMixing(lambda h: h)), _seq_mixing_sp, (X,))



class TokenMixWithWeights(nn.Module):
    """A user's own module with parameters whose code mixes the tokens (each token plus a
    learned share of the running sum before it), as a router reading every token does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + h.cumsum(1) * self.scale


def _run_whole(path: str, gather: bool = True, split: bool = True,
               srcs: bool = True) -> Callable[[sf.Schedule], sf.Schedule]:
    """The fix the refusal of code over the sequence names: ``path`` runs on the whole
    sequence, its input gathered by one sync and its output split back by another."""

    def rewrite(s: sf.Schedule) -> sf.Schedule:
        s = _seq_mixing_sp(s)
        if gather:
            s = sf.sync(s, path, "fwd_pre", Replicate(), **({"src": Shard(1)} if srcs else {}))
        if split:
            s = sf.sync(s, path, "fwd_post", Shard(1), **({"src": Replicate()} if srcs else {}))
        return s

    return rewrite


def _mixing_layers() -> nn.Module:
    return nn.Sequential(SeqMixing(TokenMixWithWeights()), SeqMixing(TokenMixWithWeights()))


# a module run on the whole sequence inside a chain member: its parameters' gradients are whole
# on every rank (summed over the ranks as a chain's norms are, they would count every token twice)
CASES["sp-module-run-on-the-whole-sequence"] = (_mixing_layers, _run_whole("*.code"), (X,))
CASES["sp-module-run-on-the-whole-sequence-srcs-left-out"] = (_mixing_layers, _run_whole("*.code", srcs=False),
                                                              (X,))
CASES["sp-leaf-run-on-the-whole-sequence"] = (
    lambda: nn.Sequential(SeqMixing(TokenRoll()), SeqMixing(lambda h: h)), _run_whole("0.code"), (X,))
CASES["sp-module-gathered-not-split-back"] = (_mixing_layers, _run_whole("*.code", split=False), (X,))
CASES["sp-module-split-back-not-gathered"] = (_mixing_layers, _run_whole("*.code", gather=False), (X,))
# a member itself: leaving it out of the chain is the same, and says so
CASES["sp-member-run-on-the-whole-sequence"] = (_mixing_layers, _run_whole("0"), (X,))


class BiasedHeads(nn.Module):
    """Attention that adds a bias per head, handed in by its caller, to its scores (MPT's
    ALiBi: the model builds it for every head)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = 2, 4
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for t in (self.q(x), self.k(x),
                                                                                         self.v(x)))
        att = (q @ k.transpose(-1, -2) + bias[:, -s:, -s:]).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, s, -1))


class WithSlopes(nn.Module):
    """A block that builds a bias per head from slopes (a buffer, or ``learned``) and hands
    it to its attention."""

    def __init__(self, learned: bool) -> None:
        super().__init__()
        self.attn = BiasedHeads()
        slopes = torch.tensor([0.5, 0.25]).view(2, 1, 1)
        if learned:
            self.slopes = nn.Parameter(slopes)
        else:
            self.register_buffer("slopes", slopes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        return x + self.attn(x, self.slopes * -torch.arange(s, dtype=x.dtype).view(1, 1, s))


class OwnSlopes(BiasedHeads):
    """The bias per head built by the attention itself from a buffer of its own: on this
    rank's one head, it broadcasts to both, and the attention hands its row all 8 features."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("slopes", torch.tensor([0.5, 0.25]).view(2, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        s = x.shape[1]
        return x + super().forward(x, self.slopes * -torch.arange(s, dtype=x.dtype).view(1, 1, s))


def _biased_attention(s: sf.Schedule) -> sf.Schedule:
    s = sf.shard(s, ["0.attn.q", "0.attn.k", "0.attn.v"], axis=0)
    return sf.shard(s, "0.attn.o", axis=1)


# the bias for both heads met this rank's one: a raw shape error from the model's code before
CASES["attention-bias-per-head-from-the-caller"] = (lambda: nn.Sequential(WithSlopes(False)), _biased_attention, (X,))
CASES["attention-bias-per-head-learned"] = (lambda: nn.Sequential(WithSlopes(True)), _biased_attention, (X,))
# equal loss and wrong gradients, with no error, before the row refused a whole-width input
CASES["attention-bias-of-its-own-per-head"] = (
    lambda: nn.Sequential(OwnSlopes()), lambda s: sf.shard(sf.shard(s, ["0.q", "0.k", "0.v"], axis=0), "0.o", axis=1),
    (X,))

def _seq_first_sp(s: sf.Schedule) -> sf.Schedule:
    """The chain over (sequence, batch, features) activations: nn.Transformer's default layout."""
    return sf.sequence_parallel(sf.shard(sf.shard(s, "*.fc1", axis=0), "*.fc2", axis=1), ["0", "1"], seq_axis=0)


class BatchFirst(nn.Module):
    """A sequence-first block that hands its child the activation batch first."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.transpose(0, 1)).transpose(0, 1)


class TokenMix(nn.Module):
    """A norm, then a softmax over the tokens (batch first)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return h * h.softmax(1)


class MixThenMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix, self.mlp = BatchFirst(TokenMix()), SeqMixing(lambda h: h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.mix(x))


# the child's code was read only where it takes the tokens at the chain's dimension: handed
# them elsewhere (transposed batch first), its softmax over them went unread, silently wrong
CASES["sp-seq-first-child-handed-the-tokens-batch-first"] = (
    lambda: nn.Sequential(MixThenMlp(), SeqMixing(lambda h: h)),
    lambda s: sf.sequence_parallel(sf.shard(sf.shard(s, ["0.mlp.fc1", "1.fc1"], axis=0), ["0.mlp.fc2", "1.fc2"],
                                            axis=1), ["0", "1"], seq_axis=0),
    (X,))
CASES["sp-seq-first-member-code-over-the-sequence"] = (
    lambda: nn.Sequential(SeqMixing(lambda h: h * h.softmax(0)), SeqMixing(lambda h: h)), _seq_first_sp, (X,))
CASES["sp-seq-first-member-code-over-the-batch"] = (
    lambda: nn.Sequential(SeqMixing(lambda h: h * h.softmax(1)), SeqMixing(lambda h: h)), _seq_first_sp, (X,))
CASES["sp-member-code-softmax-after-a-tuple"] = (
    lambda: nn.Sequential(SeqMixingAfterATuple(), SeqMixing(lambda h: h)), _seq_mixing_sp, (X,))
CASES["sp-member-code-over-each-token"] = (
    lambda: nn.Sequential(SeqMixing(lambda h: h * h.softmax(-1)), SeqMixing(lambda h: h)), _seq_mixing_sp, (X,))


class FlatMlp(SeqMixing):
    """OPT's decoder layer: the batch and the tokens merged into one dimension around the
    MLP (``merge``), a residual on the merged rows, and a view back (``back``)."""

    def __init__(self, merge: Callable[[torch.Tensor], torch.Tensor],
                 back: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], code: Callable[..., Any] = lambda h: h
                 ) -> None:
        super().__init__(code)
        self.merge, self.back = merge, back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.merge(x)
        return self.back(flat + self.fc2(torch.relu(self.fc1(self.code(self.norm(flat))))), x)


def _flat(merge: Callable[[torch.Tensor], torch.Tensor] = lambda h: h.reshape(-1, h.size(-1)),
          back: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda y, x: y.view(x.shape),
          code: Callable[..., Any] = lambda h: h, seq_axis: int = 1
          ) -> tuple[Callable[[], nn.Module], Callable[[sf.Schedule], sf.Schedule], tuple[Any, ...]]:
    rewrite = _seq_first_sp if seq_axis == 0 else _seq_mixing_sp
    return lambda: nn.Sequential(FlatMlp(merge, back, code), FlatMlp(merge, back, code)), rewrite, (X,)


# OPT's layer: refused before (the merge was taken for code over the tokens); each row of the
# merged dimension is a token, so the column gathers them, and the row scatters them, along it
CASES["sp-member-mlp-on-the-batch-and-tokens-merged"] = _flat()
CASES["sp-member-mlp-on-the-batch-and-tokens-merged-seq-first"] = _flat(seq_axis=0)
CASES["sp-member-mlp-on-the-batch-and-tokens-flattened"] = _flat(
    lambda h: h.flatten(0, -2), lambda y, x: y.view(x.size(0), x.size(1), x.size(-1)))
CASES["sp-member-mlp-on-merged-tokens-viewed-back-as-another"] = _flat(
    back=lambda y, x: y.view_as(x).transpose(0, 1).reshape(x.shape))
# refused: merged, code over the rows, a view that regroups them, a module that is not per token
CASES["sp-member-merged-tokens-softmax-over-the-rows"] = _flat(code=lambda h: h.softmax(0))
CASES["sp-member-merged-tokens-cumsum-over-the-rows"] = _flat(code=lambda h: h.cumsum(-2))
# over each row's features: right on this rank's rows (refused before, as if over the rows)
CASES["sp-member-merged-tokens-cumsum-over-each-row"] = _flat(code=lambda h: h.cumsum(-1))
CASES["sp-member-merged-tokens-softmax-over-each-row"] = _flat(code=lambda h: h * h.softmax(1))
CASES["sp-member-merged-tokens-mean-over-each-row"] = _flat(code=lambda h: h - h.mean(-1, keepdim=True))
CASES["sp-member-merged-tokens-regrouped"] = _flat(
    back=lambda y, x: y.view(-1, 2, x.shape[-1]).flip(1).reshape(x.shape))
CASES["sp-member-merged-tokens-handed-to-a-block"] = _flat(code=TokenMix())
CASES["sp-member-merged-tokens-viewed-by-its-own-size"] = _flat(
    back=lambda y, x: y.view(y.size(0), -1))
CASES["sp-member-merged-tokens-returned-merged"] = _flat(back=lambda y, x: y)


class Mixer(nn.Module):
    """BERT's ``attention.self``: its columns' outputs mixed (a stand-in for attention over
    the whole sequence: a cumulative sum over it), returned for a row in another module."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x).cumsum(1)


class Out(nn.Module):
    """BERT's ``attention.output``: a row, then a norm over it and the residual handed in."""

    def __init__(self, code: str = "") -> None:
        super().__init__()
        self.code = code
        self.dense, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        if self.code == "softmax":  # over the sequence, after the row's reduce-scatter
            h = h.softmax(1)
        elif self.code == "reuse":  # the whole-sequence input read beside the row
            h = h + x.mean(-1, keepdim=True)
        return self.norm(h + residual)


class CrossLayer(nn.Module):
    """A layer of BERT's shape: columns in one child, their row in a sibling."""

    def __init__(self, code: str = "", leak: bool = False) -> None:
        super().__init__()
        self.leak = leak
        self.mix, self.out = Mixer(), Out(code)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mix(x)
        y = self.out(m, x)
        return y + m if self.leak else y  # leak: the whole sequence added to a token shard


def _cross_sp(code: str = "", leak: bool = False) -> tuple[Callable[[], nn.Module],
                                                           Callable[[sf.Schedule], sf.Schedule], tuple[Any, ...]]:
    def rewrite(s: sf.Schedule) -> sf.Schedule:
        s = sf.foreach("*", sf.shard.at("mix.q", axis=0) >> sf.shard.at("out.dense", axis=1))(s)
        return sf.sequence_parallel(s, ["0", "1"])

    return (lambda: nn.Sequential(CrossLayer(code, leak), CrossLayer(code, leak)), rewrite, (X,))


CASES["sp-pairs-across-parents"] = _cross_sp()
CASES["sp-pairs-across-parents-softmax-after-the-row"] = _cross_sp("softmax")
CASES["sp-pairs-across-parents-input-read-beside-the-row"] = _cross_sp("reuse")
CASES["sp-pairs-across-parents-whole-sequence-leaks"] = _cross_sp(leak=True)


def _case(rank: int, world: int, name: str) -> str:
    make, rewrite, inputs = CASES[name]
    torch.manual_seed(0)
    try:
        parity(make(), rewrite, inputs, shape=(world,), loss=_weighted, tracker=False)
    except sf.LayoutError as e:
        return "refused: " + " | ".join(line.strip() for line in str(e).splitlines()[:2])
    return "equal"


EXPECTED = {
    "slapo-bwd-post-syncs-on-columns-beside-a-replace": "equal",
    "tp-local-on-a-norm-that-sees-the-whole-input": "refused: build: '1': is declared tp_local",
    "tp-local-on-llamas-final-norm": "refused: build: 'model.norm': is declared tp_local",
    "sp-member-leaf-module-over-the-sequence": "equal",
    "sp-member-leaf-module-over-each-token": "equal",
    "sp-seq-first-child-handed-the-tokens-batch-first": "equal",
    "sp-member-code-over-flattened-tokens-softmax": "equal",
    "sp-member-code-over-flattened-tokens-mean": "equal",
    "sp-member-mlp-on-the-batch-and-tokens-merged": "equal",
    "sp-member-mlp-on-the-batch-and-tokens-merged-seq-first": "equal",
    "sp-member-mlp-on-the-batch-and-tokens-flattened": "equal",
    "sp-member-mlp-on-merged-tokens-viewed-back-as-another": "equal",
    "sp-member-merged-tokens-softmax-over-the-rows": "equal",
    "sp-member-merged-tokens-regrouped": "equal",
    "sp-member-merged-tokens-cumsum-over-the-rows": "equal",
    "sp-member-merged-tokens-cumsum-over-each-row": "equal",
    "sp-member-merged-tokens-softmax-over-each-row": "equal",
    "sp-member-merged-tokens-mean-over-each-row": "equal",
    "sp-member-merged-tokens-handed-to-a-block": "equal",
    "sp-member-merged-tokens-viewed-by-its-own-size": "equal",
    "sp-member-merged-tokens-returned-merged": "equal",
    "sp-member-child-fx-cannot-trace": "equal",
    "sp-member-leaf-module-fx-cannot-trace": "equal",
    "sp-module-run-on-the-whole-sequence": "equal",
    "sp-module-run-on-the-whole-sequence-srcs-left-out": "equal",
    "sp-leaf-run-on-the-whole-sequence": "equal",
    # the code over the tokens, and the lone sync
    "sp-module-gathered-not-split-back": "equal",
    "sp-module-split-back-not-gathered": "equal",
    "sp-member-run-on-the-whole-sequence": "equal",
    "attention-bias-per-head-from-the-caller": "equal",
    "attention-bias-per-head-learned": "refused: tensor parallel forward: '0.attn': runs on this rank's 1 of its 2 "
                                       "heads and adds its argument 'bias' to them; that argument, of shape (2, 1, 4), "
                                       "meets the heads at dimension -3 and is learned",
    "attention-bias-of-its-own-per-head": "refused: tensor parallel forward: '0.o': takes this rank's 4 of the 8 "
                                          "features",
    "sp-pairs-across-parents": "equal",
    "sp-pairs-across-parents-softmax-after-the-row": "equal",
    "sp-pairs-across-parents-input-read-beside-the-row": "equal",
    "sp-pairs-across-parents-whole-sequence-leaks": "equal",
    "sp-norm-then-column-head": "equal",
    "vocab-embedding-first-in-sp-chain": "equal",
    # the Linear after the sync would see half the tokens: its gradients would be partial
    "sequence-shard-before-an-unsharded-linear": "equal",
    "root-sync-with-child-syncs": "equal",
    "packed-column-into-a-contiguous-row": "equal",
    "packed-column-into-a-row-packed-alike": "equal",
    "sp-member-inside-a-pair": "equal",
    "llama-mlp-gate-unsharded": "equal",
    "gate-column-up-row-down-row": "equal",
    "sp-layer-norms-around-attention": "equal",
    "column-into-residual-then-row": "equal",
    "vocab-first-in-a-chain-told-its-input-is-split": "equal",
    "sp-exit-kept-split-before-a-linear": "equal",
    "child-read-functionally-while-sharded": "equal",
    "feature-sync-into-an-unsharded-linear": "equal",
    "feature-sharded-embedding-in-a-chain": "equal",
    "gate-split-by-a-sync-beside-an-up-column": "equal",
    "activation-split-on-entry-beside-an-up-column": "equal",
    "split-output-under-a-root-sync-without-src": "equal",
    "token-shard-through-a-no-op-sync": "equal",
    "token-shard-meets-a-branch": "equal",
    "sp-layers-with-unsharded-attention": "equal",
    "sp-norms-without-their-layers": "equal",
    "uneven-sequence": "refused: split: <root>: dimension 1 of an activation of shape (2, 5, 8) has 5 elements",
    "untraced-attention-paired-by-module-order": "equal",
    "untraced-attention-with-its-columns-gathered": "equal",
    "embedding-subclass-with-its-own-forward": "equal",
    "embedding-subclass-sharded-by-its-weight": "equal",
    "sync-on-an-output-without-an-activation": "refused: tensor parallel forward: '<root>': returned dict, with no "
                                               "tensor for a fwd_post sync to convert",
    "sp-over-2d-activations": "refused: tensor parallel forward: '0': sequence_parallel splits dimension 1 of its 2-D "
                              "activation (4, 8), its last: that holds the features",
    "sp-over-2d-activations-by-the-batch": "equal",
    "sp-member-code-softmax-over-the-sequence": "equal",
    "sp-member-code-cumsum-over-the-sequence": "equal",
    "sp-member-code-over-each-token": "equal",
    "sp-member-code-positions-sliced-by-its-length": "equal",
    "sp-member-code-positions-counted-to-its-length": "equal",
    "sp-member-code-viewed-by-its-length": "equal",
    "sp-seq-first-member-code-over-the-sequence": "equal",
    "sp-seq-first-member-code-over-the-batch": "equal",
    "sp-member-code-softmax-after-a-tuple": "equal",
    "sp-over-2d-activations-entered-by-a-row": "refused: tensor parallel forward: '1': sequence_parallel splits "
                                               "dimension 1 of its 2-D activation (4, 8)",
}
