"""Issue 39, item 4: a ``decompose``d and ``fuse``d bias+GeLU on a column-sharded Linear,
in either order of the rewrites (Slapo's ``fuse_bias_gelu`` then ``shard_mlp``, or the
other way), at tp=2 on gloo.

``decompose`` keeps a Linear called for its matmul (the parent adds its bias after the
call); the parent's read of that bias is an operand of the column's output, handed as this
rank's share, and the fused ``gelu(x + bias)`` passes the column's layout on to its row:
the layer runs on local shards at the unfused layer's collectives (one all-reduce each
way), with ``sf.dtensor.plan(sch).on_dtensors`` empty. Decomposing the row too, its bias
is added once by the parent after the all-reduce.

The same on GPT-2's layers: a decomposed Hugging Face ``Conv1D`` (weight stored (in,
out), forward ``addmm`` + ``view``) sharded as a column (``axis=1``, packed [Q|K|V] too)
or a row (``axis=0``): ``decompose`` keeps every linear layer called for its own forward
with its bias left out (its class with ``SeparateBias`` mixed in, which ``shard`` reads as
the layer it was), and a fused ``act(x + bias)`` passes the column's layout on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import LoRA
from torch import nn
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh
from slapo_fn.hf import is_conv1d

D = 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))  # type: ignore[no-any-return]


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias)


def _megatron(sch: sf.Schedule) -> sf.Schedule:
    return sf.shard(sf.shard(sch, "fc_in", axis=0), "fc_out", axis=1)


def _fused(sch: sf.Schedule, where: str = "fc_in") -> sf.Schedule:
    sch = sf.decompose(sf.trace(sch, ""), where)
    (match,) = sf.find(sch, "", bias_gelu)
    return sf.fuse(sch, "", match, compiler=None)


ORDERS = {"unfused": _megatron, "fuse-then-shard": lambda s: _megatron(_fused(s)),
          "shard-then-fuse": lambda s: _fused(_megatron(s)),
          "both-decomposed": lambda s: _fused(_megatron(s), "")}  # the row's bias added by the parent


@pytest.mark.parametrize("order", ["fuse-then-shard", "shard-then-fuse", "both-decomposed"])
def test_a_fused_bias_gelu_on_a_column_runs_on_local_shards_at_the_unfused_counts(order: str) -> None:
    unfused = sf.dtensor.plan(ORDERS["unfused"](sf.create_schedule(MLP(), mesh=fake_mesh(2))))
    p = sf.dtensor.plan(ORDERS[order](sf.create_schedule(MLP(), mesh=fake_mesh(2))))
    assert p.on_dtensors == (), [f"{q.path}: {q.reason}" for q in p.on_dtensors]
    assert p.counts() == unfused.counts() == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


def test_a_fused_bias_gelu_on_a_lora_column_runs_on_local_shards_at_the_unfused_counts() -> None:
    # the LoRA's A, whole on every rank, has a partial gradient; the bias the parent adds is
    # split with the column, its gradient this rank's share: no reason for a region
    unfused = sf.dtensor.plan(_megatron(sf.create_schedule(LoraMLP(), mesh=fake_mesh(2))))
    for rewrite in (ORDERS["fuse-then-shard"], ORDERS["shard-then-fuse"]):
        p = sf.dtensor.plan(rewrite(sf.create_schedule(LoraMLP(), mesh=fake_mesh(2))))
        assert p.on_dtensors == (), [f"{q.path}: {q.reason}" for q in p.on_dtensors]
        assert p.counts() == unfused.counts() == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 2}}


def test_a_lone_column_whose_bias_its_parent_adds_is_not_proven_on_local_shards() -> None:
    # its output is gathered, whole, while the bias the parent adds is split: DTensors decide
    p = sf.dtensor.plan(sf.shard(_fused(sf.create_schedule(MLP(), mesh=fake_mesh(2))), "fc_in", axis=0))
    assert [(q.path, q.reason.split(",")[0]) for q in p.on_dtensors] == [
        ("<root>", "adds 'fc_in.bias' to the output of 'fc_in' itself")]


class LoraMLP(MLP):
    """Its column a Linear subclass with a forward of its own (a LoRA: ``A`` whole on every
    rank in a column, ``B`` split with the weight's rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in = LoRA(D, 4 * D)


class ReadsItsColumn(MLP):
    """A traced parent computing its column's linear itself (what ``decompose`` makes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(F.linear(x, self.fc_in.weight, self.fc_in.bias)))  # type: ignore[no-any-return]


def test_a_parent_reading_its_columns_parameters_is_told_so_not_that_fx_cannot_trace_it() -> None:
    # fx traces it: the one reason is the read (before, also "fx cannot trace its forward")
    p = sf.dtensor.plan(_megatron(sf.create_schedule(ReadsItsColumn(), mesh=fake_mesh(2))))
    assert [(q.path, q.reason.split(",")[0]) for q in p.on_dtensors] == [
        ("<root>", "reads the parameters of its child 'fc_in' itself instead of calling it")]


# -- GPT-2's Conv1D ---------------------------------------------------------------------
HEADS = 4


def gpt2_mlp() -> nn.Module:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(0)
    mlp = GPT2MLP(4 * D, GPT2Config(n_embd=D, resid_pdrop=0.0))
    _biased(mlp)
    return mlp


def _biased(module: nn.Module) -> None:
    """Biases far from zero (Conv1D's start at zero): one added twice, or not at all, shows."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-1, 1)


class Attention(nn.Module):
    """GPT-2's attention as fx traces it: packed ``c_attn`` cut into q, k, v, heads, causal
    SDPA, ``c_proj`` (Hugging Face's own ``GPT2Attention`` needs torch.export). Its
    ``split(self.split_size)``, traced, holds the whole block size (16): refused below; a
    ``chunk(3)`` splits this rank's share into its blocks."""

    def __init__(self, chunks: bool = True) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.chunks = chunks
        torch.manual_seed(0)
        self.c_attn, self.c_proj, self.split_size = Conv1D(3 * D, D), Conv1D(D, D), D
        _biased(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        qkv = self.c_attn(x).chunk(3, dim=2) if self.chunks else self.c_attn(x).split(self.split_size, dim=2)
        q, k, v = (qkv[i].view(b, s, -1, D // HEADS).transpose(1, 2) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, s, -1))  # type: ignore[no-any-return]


def bias_gelu_new(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    from slapo_fn.rewrites.graph import call_module

    return call_module("act", x + bias)  # type: ignore[no-any-return]


def _mlp_shards(sch: sf.Schedule) -> sf.Schedule:
    return sf.shard(sf.shard(sch, "c_fc", axis=1), "c_proj", axis=0)


def _fused_gpt2(sch: sf.Schedule, where: str = "c_fc") -> sf.Schedule:
    """Slapo's ``fuse_bias_gelu`` on GPT-2's MLP: decompose, find ``act(x + bias)``, fuse."""
    sch = sf.decompose(sf.trace(sch, "", example_inputs=(torch.randn(2, 6, D),)), where)
    (match,) = sf.find(sch, "", bias_gelu_new)
    return sf.fuse(sch, "", match, compiler=None)


def _attn_shards(sch: sf.Schedule) -> sf.Schedule:
    return sf.shard(sf.shard(sch, "c_attn", axis=1, packed=3), "c_proj", axis=0)


def _decomposed(sch: sf.Schedule) -> sf.Schedule:
    return sf.decompose(sf.trace(sch, ""), ["c_attn", "c_proj"])


Rewrite = Callable[[sf.Schedule], sf.Schedule]
GPT2: dict[str, tuple[Callable[[], nn.Module], Rewrite, Rewrite]] = {
    # name: (model, the unfused Megatron plan, the decomposed one)
    "mlp fuse-then-shard": (gpt2_mlp, _mlp_shards, lambda s: _mlp_shards(_fused_gpt2(s))),
    "mlp shard-then-fuse": (gpt2_mlp, _mlp_shards, lambda s: _fused_gpt2(_mlp_shards(s))),
    "mlp both decomposed": (gpt2_mlp, _mlp_shards, lambda s: _fused_gpt2(_mlp_shards(s), "")),
    "attention decompose-then-shard": (Attention, _attn_shards, lambda s: _attn_shards(_decomposed(s))),
    "attention shard-then-decompose": (Attention, _attn_shards, lambda s: _decomposed(_attn_shards(s))),
}


@pytest.mark.parametrize("case", list(GPT2))
def test_a_decomposed_conv1d_is_planned_on_local_shards_at_the_unfused_counts(case: str) -> None:
    model, megatron, decomposed = GPT2[case]
    unfused = sf.dtensor.plan(megatron(sf.create_schedule(model(), mesh=fake_mesh(2))))
    sch = decomposed(sf.create_schedule(model(), mesh=fake_mesh(2)))
    column = sch["c_fc" if case.startswith("mlp") else "c_attn"].module  # still called, read as a Conv1D
    assert type(column).__name__ == "SeparateBiasConv1D" and is_conv1d(column)
    p = sf.dtensor.plan(sch)
    assert p.on_dtensors == (), [f"{q.path}: {q.reason}" for q in p.on_dtensors]
    assert p.counts() == unfused.counts() == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


#: Every case at tp=2 on gloo, one pool: (model, rewrite).
EVERY: dict[str, tuple[Callable[[], nn.Module], Rewrite]] = {
    **{f"linear {order}": (MLP, rewrite) for order, rewrite in ORDERS.items()},
    "lora fuse-then-shard": (LoraMLP, ORDERS["fuse-then-shard"]),
    **{f"conv1d {case}": (model, rewrite) for case, (model, _, rewrite) in GPT2.items()},
}


def _run(rank: int, world: int, case: str) -> dict[str, Any]:
    model, rewrite = EVERY[case]
    torch.manual_seed(0)
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(3))
    r = parity(model(), rewrite, (x,), shape=(world,), predict=False)
    return {k: r[k] for k in ("fwd", "bwd", "grads", "on_dtensors")}


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_a_fused_bias_gelu_on_a_column_runs_equal_either_order_at_the_unfused_counts(dist2: Any) -> None:
    for case in EVERY:  # parity checks the output, the input's gradient and every parameter's
        got = dist2.run(_run, case, timeout=120)
        params = sum(1 for _ in EVERY[case][0]().parameters())
        assert got[0]["grads"] == params and not got[0]["on_dtensors"], case  # on local shards, every order
        # DTensor's propagation finds the same collectives as the local plan of the unfused layer (a
        # LoRA column's whole A: its partial gradient all-reduced, as without the fusion)
        bwd = {"all_reduce": 2 if case.startswith("lora") else 1}
        assert (got[0]["fwd"], got[0]["bwd"]) == ({"all_reduce": 1}, bwd), (case, got[0])


def test_a_traced_parent_splitting_its_packed_column_by_a_traced_size_is_refused_not_cut_wrong() -> None:
    # the traced code holds split(16), the whole block; build's local split_size never reaches
    # it, and the rank's 24 features would be cut 16 + 8 (an IndexError on the third block)
    sch = _attn_shards(_decomposed(sf.create_schedule(Attention(chunks=False), mesh=fake_mesh(2))))
    assert [(q.path, q.reason.split(", so")[0].rsplit("(", 1)[-1]) for q in sf.dtensor.plan(sch).on_dtensors] == [
        ("c_attn", "a traced forward holds the sizes it was traced with)")]
