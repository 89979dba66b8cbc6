"""The tensor-parallel plan as a pure function of a schedule, on a fake process group (no
data moves): per-module contracts, the boundaries where layouts meet with their forward and
backward collectives, ``counts()``; and the pure helpers under it — layouts
(``slapo_fn.dtensor.layout``) and the collective of a placement change (``collective_of``).

What the plans predict is checked against real gloo runs in ``test_plan_parity.py``.
"""

from __future__ import annotations

import pytest
import torch
from models import PreNormLayer as Layer
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import slapo_fn as sf
from slapo_fn.dtensor.boundary import Boundary, Plan, implicit, plan
from slapo_fn.dtensor.layout import Layout, describe, from_spec, packed_shard, shard_axes
from slapo_fn.dtensor.roles import Column, EmbedDim, Gathered, Row, VocabEmbed
from slapo_fn.dtensor.shard import LAYOUT
from slapo_fn.dtensor.sync import collective_of
from slapo_fn.dtensor.testing import fake_mesh

NONE: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}


def schedule(model: nn.Module, *shape: int) -> sf.Schedule:
    return sf.create_schedule(model, mesh=fake_mesh(*(shape or (2,))))


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def listing(p: Plan) -> list[str]:
    return [str(b) for b in p.boundaries]


def megatron(sch: sf.Schedule, col: str = "0", row: str = "2", **kw: str) -> sf.Schedule:
    return sf.shard(sf.shard(sch, col, axis=0, **kw), row, axis=1, **kw)


# ----------------------------------------------------------------------------- no tensor parallelism


def test_a_schedule_without_tp_annotations_plans_nothing() -> None:
    for sch in (sf.create_schedule(mlp()), schedule(mlp())):
        p = plan(sch)
        assert p.boundaries == () and dict(p.modules) == {} and p.counts() == NONE


def test_plan_is_pure_and_repeatable() -> None:
    sch = megatron(schedule(mlp()))
    before = dict(sch.annotations.of_kind(LAYOUT))
    assert plan(sch) == plan(sch)
    assert dict(sch.annotations.of_kind(LAYOUT)) == before


# ----------------------------------------------------------------------------- column / row


def test_column_then_row_is_a_megatron_pair_one_all_reduce_each_way() -> None:
    p = plan(megatron(schedule(mlp())))
    assert listing(p) == [
        "0 input: R→R@tp  fwd: -  bwd: all_reduce",
        "2 output: P→R@tp  fwd: all_reduce  bwd: -",
    ]
    enter, leave = p.boundaries
    assert enter == Boundary("0", "input", "R", "R", "tp", (), ("all_reduce",), True, "input")
    assert leave == Boundary("2", "output", "P", "R", "tp", ("all_reduce",), (), True, "output")
    assert p.counts() == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
    assert set(p.modules) == {"0", "2"}  # GELU in between needs nothing
    assert p.modules["0"].role == Column("tp") and p.modules["0"].partnered
    assert p.modules["2"].role == Row("tp") and p.modules["2"].partnered
    assert implicit(p) == []  # the pair's contract states every boundary


def test_a_lone_column_all_gathers_its_output_implicitly() -> None:
    p = plan(sf.shard(schedule(mlp()), "0", axis=0))
    assert listing(p) == [
        "0 input: R→R@tp  fwd: -  bwd: all_reduce",
        "0 output: S(-1)→R@tp  fwd: all_gather  bwd: -  (implicit)",
    ]
    assert p.boundaries[1].tensor == "output" and not p.boundaries[1].explicit
    assert p.counts() == {"forward": {"all_gather": 1}, "backward": {"all_reduce": 1}}
    assert not p.modules["0"].partnered
    (problem,) = implicit(p)  # what build(strict=True) refuses
    assert problem.path == "0" and "S(-1)→R" in problem.reason and "fwd_post" in problem.fix


def test_a_lone_row_splits_its_replicated_input_implicitly() -> None:
    p = plan(sf.shard(schedule(mlp()), "2", axis=1))
    assert listing(p) == [
        "2 input: R→S(-1)@tp  fwd: -  bwd: all_gather  (implicit)",
        "2 output: P→R@tp  fwd: all_reduce  bwd: -",
    ]
    assert p.counts() == {"forward": {"all_reduce": 1}, "backward": {"all_gather": 1}}
    (problem,) = implicit(p)
    assert problem.path == "2" and "fwd_pre" in problem.fix


class _TwoRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(x)


def test_rows_handed_one_whole_value_split_it_once() -> None:
    """Two rows on one replicated input (two projections of one attention's hidden states
    sharded by rows) share its split: autograd sums their split gradients, and one
    all-gather makes the input's gradient whole (PyTorch's engine sums them on the one
    DTensor too). The runtime shares it within the same group (``entry_group``)."""
    p = plan(sf.shard(schedule(_TwoRows()), ["a", "b"], axis=1))
    assert p.counts() == {"forward": {"all_reduce": 2}, "backward": {"all_gather": 1}}
    assert p.modules["a"].entry_group == p.modules["b"].entry_group != ""


def test_a_row_before_a_column_is_no_pair() -> None:
    sch = sf.shard(sf.shard(schedule(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))), "0", axis=1), "1", axis=0)
    p = plan(sch)
    assert not p.modules["0"].partnered and not p.modules["1"].partnered
    assert listing(p) == [
        "0 input: R→S(-1)@tp  fwd: -  bwd: all_gather  (implicit)",
        "0 output: P→R@tp  fwd: all_reduce  bwd: -",
        "1 input: R→R@tp  fwd: -  bwd: all_reduce",
        "1 output: S(-1)→R@tp  fwd: all_gather  bwd: -  (implicit)",
    ]


class _Attention(nn.Module):
    def __init__(self, traceable: bool = True) -> None:
        super().__init__()
        self.traceable = traceable
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        y = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        if not self.traceable and not bool(y.isfinite().all()):  # a branch on values: fx cannot trace it
            y = y.nan_to_num()
        return self.o(y)


def test_sibling_columns_reading_one_input_enter_once() -> None:
    # q / k / v of an attention: one all-reduce of the summed input gradient, not three
    sch = sf.shard(sf.shard(schedule(nn.Sequential(_Attention())), ["0.q", "0.k", "0.v"], axis=0), "0.o", axis=1)
    p = plan(sch)
    assert listing(p) == [
        "0.q input: R→R@tp  fwd: -  bwd: all_reduce",
        "0.k input: R→R@tp  fwd: -  bwd: -",
        "0.v input: R→R@tp  fwd: -  bwd: -",
        "0.o output: P→R@tp  fwd: all_reduce  bwd: -",
    ]
    assert all(p.modules[c].partnered for c in ("0.q", "0.k", "0.v", "0.o"))
    assert len({p.modules[c].entry_group for c in ("0.q", "0.k", "0.v")}) == 1


def test_columns_of_a_parent_fx_cannot_trace_enter_each_on_their_own() -> None:
    """Which columns read one tensor is unknown there, and equal input widths are no proof
    (an attention's ``v`` and ``o``): each column is its own entry group, which the
    runtime keeps to, so explain counts what runs."""
    sch = sf.shard(schedule(nn.Sequential(_Attention(traceable=False))), ["0.q", "0.k", "0.v"], axis=0)
    p = plan(sch)
    assert [line for line in listing(p) if " input:" in line] == [
        f"0.{c} input: R→R@tp  fwd: -  bwd: all_reduce" for c in "qkv"]
    assert len({p.modules[c].entry_group for c in ("0.q", "0.k", "0.v")}) == 3


def test_a_sharded_root_module_prints_as_root() -> None:
    p = plan(sf.shard(schedule(nn.Linear(8, 8)), "", axis=1))
    assert listing(p)[1] == "<root> output: P→R@tp  fwd: all_reduce  bwd: -"
    assert p.boundaries[0].path == ""


def test_a_partitionspec_layout_plans_as_the_axis_it_names() -> None:
    by_axis = plan(megatron(schedule(mlp())))
    by_spec = plan(sf.shard(sf.shard(schedule(mlp()), "0", layout=("tp", None)), "2", layout=(None, "tp")))
    assert by_spec == by_axis


# ----------------------------------------------------------------------------- embeddings


def test_a_vocab_parallel_embedding_all_reduces_its_partial_output() -> None:
    p = plan(sf.shard(schedule(nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8))), "0", axis=0))
    # token ids have no gradient: no input boundary at all
    assert listing(p) == ["0 output: P→R@tp  fwd: all_reduce  bwd: -"]
    assert p.modules["0"].role == VocabEmbed("tp")
    assert p.counts() == {"forward": {"all_reduce": 1}, "backward": {}}


def test_an_embedding_sharded_on_its_feature_axis_all_gathers_its_output() -> None:
    p = plan(sf.shard(schedule(nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8))), "0", axis=1))
    assert listing(p) == ["0 output: S(-1)→R@tp  fwd: all_gather  bwd: -  (implicit)"]
    assert p.modules["0"].role == EmbedDim("tp")
    assert p.counts() == {"forward": {"all_gather": 1}, "backward": {}}


def test_an_embed_dim_embedding_feeding_a_row_hands_it_its_features() -> None:
    # paired like a column (PyTorch's ColwiseParallel on an embedding): no gather and split again
    sch = sf.shard(sf.shard(schedule(nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8))), "0", axis=1), "1", axis=1)
    assert plan(sch).counts() == {"forward": {"all_reduce": 1}, "backward": {}}


def test_a_vocab_parallel_head_kept_sharded_reduce_scatters() -> None:
    sch = sf.sync(sf.shard(schedule(nn.Sequential(nn.Embedding(16, 8))), "0", axis=0), "0", "fwd_post", Shard(-1))
    assert listing(plan(sch)) == ["0 output: P→S(-1)@tp  fwd: reduce_scatter  bwd: all_gather"]


# ----------------------------------------------------------------------------- packed


def test_a_packed_column_plans_like_a_column_with_its_packing_in_the_role() -> None:
    sch = sf.shard(schedule(nn.Sequential(nn.Linear(8, 24))), "0", axis=0, packed=3)
    p = plan(sch)
    assert p.modules["0"].role == Column("tp", packed=3)
    assert str(p.modules["0"].role) == "column@tp×3"
    assert [(b.path, b.side, b.forward, b.backward) for b in p.boundaries] == [
        ("0", "input", (), ("all_reduce",)),
        ("0", "output", ("all_gather",), ()),
    ]
    assert sch.annotations.get("0.weight", LAYOUT).placements == (_StridedShard(0, split_factor=3),)


def test_a_packed_column_paired_with_a_row_keeps_its_heads_local() -> None:
    # GPT-2's fused [Q|K|V] c_attn (Conv1D: axis=1 is column) with c_proj as its row
    from models import tiny_gpt2

    attn = "transformer.h.0.attn"
    sch = sf.shard(sf.shard(schedule(tiny_gpt2(1)), f"{attn}.c_attn", axis=1, packed=3), f"{attn}.c_proj", axis=0)
    p = plan(sch)
    assert listing(p) == [
        f"{attn}.c_attn input: R→R@tp  fwd: -  bwd: all_reduce",
        f"{attn}.c_proj output: P→R@tp  fwd: all_reduce  bwd: -",
    ]
    assert p.modules[f"{attn}.c_attn"].role == Column("tp", packed=3)


def test_a_lone_packed_column_output_boundary_names_its_packed_layout() -> None:
    p = plan(sf.shard(schedule(nn.Sequential(nn.Linear(8, 24))), "0", axis=0, packed=3))
    assert p.boundaries[1].src == "S(-1)×3"


# ----------------------------------------------------------------------------- sequence parallel






def sp_layers(n: int = 2) -> sf.Schedule:
    model = nn.Sequential(*(Layer() for _ in range(n)), nn.LayerNorm(8))
    sch = megatron(schedule(model), "*.mlp.fc1", "*.mlp.fc2")
    return sf.sequence_parallel(sch, [*map(str, range(n)), str(n)])


def test_a_sequence_parallel_chain_enters_once_gathers_reduce_scatters_and_leaves_once() -> None:
    p = plan(sp_layers(2))
    assert listing(p) == [
        "0 input: R→S(1)@tp  fwd: -  bwd: all_gather",
        "0.mlp.fc1 input: S(1)→R@tp  fwd: all_gather  bwd: reduce_scatter",
        "0.mlp.fc2 output: P→S(1)@tp  fwd: reduce_scatter  bwd: all_gather",
        "1.mlp.fc1 input: S(1)→R@tp  fwd: all_gather  bwd: reduce_scatter",
        "1.mlp.fc2 output: P→S(1)@tp  fwd: reduce_scatter  bwd: all_gather",
        "2 output: S(1)→R@tp  fwd: all_gather  bwd: -",
        "<root> param grads after backward (6 params): P→R@tp  fwd: -  bwd: all_reduce",
    ]
    assert all(b.explicit for b in p.boundaries) and implicit(p) == []
    assert p.grads_after_backward
    assert p.boundaries[-1].tensor == "param:2.weight,2.bias,0.norm.weight,0.norm.bias,1.norm.weight,1.norm.bias"
    # activations: all-gathers and reduce-scatters only; the norms' parameters saw sequence
    # shards, so their gradients are all-reduced (Replicate), all norms' weights and biases
    # together at the end of backward; the row biases, added before the reduce-scatter, need none
    assert p.counts() == {
        "forward": {"all_gather": 3, "reduce_scatter": 2},
        "backward": {"all_gather": 3, "reduce_scatter": 2, "all_reduce": 1},
    }


def test_on_a_mesh_with_axes_the_parameters_do_not_use_each_norm_reduces_its_own() -> None:
    """FSDP2 (``dp``) and pipeline hooks read gradients during backward: where the mesh has
    such an axis, each norm's gradients are reduced in its own backward, not after it."""
    sch = megatron(schedule(nn.Sequential(Layer(), nn.LayerNorm(8)), 2, 2), "*.mlp.fc1", "*.mlp.fc2")
    p = plan(sf.sequence_parallel(sch, ["0", "1"]))
    assert not p.grads_after_backward
    assert [line for line in listing(p) if "param grads" in line] == [
        "1 param grads weight, bias: P→R@tp  fwd: -  bwd: all_reduce",
        "0.norm param grads weight, bias: P→R@tp  fwd: -  bwd: all_reduce",
    ]


def test_sequence_parallel_entry_exit_and_replicated_norms() -> None:
    p = plan(sp_layers(2))
    assert p.modules["0"].entry is not None and p.modules["0"].exit is None
    assert p.modules["1"].entry is None and p.modules["1"].exit is None
    assert p.modules["2"].exit is not None and p.modules["2"].local_params  # the final norm
    for norm in ("0.norm", "1.norm"):  # replicated parameters, all-reduced (Replicate) gradients
        assert p.modules[norm].local_params and p.modules[norm].role is None
        assert p.modules[norm].seq is not None and p.modules[norm].seq.seq_axis == 1
    assert p.modules["0.mlp.fc1"].seq is not None and p.modules["0.mlp.fc1"].partnered


def test_a_chain_of_norm_column_row_modules() -> None:
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8))
    p = plan(sf.sequence_parallel(megatron(schedule(model), "1", "2"), ["0", "1", "2"]))
    assert listing(p) == [
        "0 input: R→S(1)@tp  fwd: -  bwd: all_gather",
        "1 input: S(1)→R@tp  fwd: all_gather  bwd: reduce_scatter",
        "2 output: P→S(1)@tp  fwd: reduce_scatter  bwd: all_gather",
        "2 output: S(1)→R@tp  fwd: all_gather  bwd: -",
        "<root> param grads after backward (2 params): P→R@tp  fwd: -  bwd: all_reduce",
    ]


def test_sequence_parallel_on_another_seq_axis_and_mesh_axis() -> None:
    sch = schedule(nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8)), 2, 2)
    p = plan(sf.sequence_parallel(sf.sequence_parallel(sch, "0", mesh_axis="dp", seq_axis=0), "1"))
    assert listing(p) == [
        "0 input: R→S(0)@dp  fwd: -  bwd: all_gather",
        "0 output: S(0)→R@dp  fwd: all_gather  bwd: -",
        "1 input: R→S(1)@tp  fwd: -  bwd: all_gather",
        "1 output: S(1)→R@tp  fwd: all_gather  bwd: -",
        "<root> param grads after backward (2 params): P→R@dp  fwd: -  bwd: all_reduce",
        "<root> param grads after backward (2 params): P→R@tp  fwd: -  bwd: all_reduce",
    ]


def test_a_sync_after_the_chain_replaces_its_exit() -> None:
    sch = sf.sync(sf.sequence_parallel(schedule(nn.Sequential(nn.LayerNorm(8))), "0"), "0", "fwd_post", Replicate())
    p = plan(sch)
    assert listing(p) == [
        "0 input: R→S(1)@tp  fwd: -  bwd: all_gather",
        "0 output: S(1)→R@tp  fwd: all_gather  bwd: -",
        "<root> param grads after backward (2 params): P→R@tp  fwd: -  bwd: all_reduce",
    ]
    assert p.modules["0"].exit is None  # the sync is the exit


def test_a_vocab_embedding_entering_a_sequence_parallel_chain_splits_the_sequence_once() -> None:
    model = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8))
    try:
        sch = sf.sequence_parallel(sf.shard(schedule(model), "0", axis=0), ["0", "1"])
        p = plan(sch)
    except sf.LayoutError:
        return  # refusing it up front is right too
    # Megatron: the embedding's partial output is reduce-scattered into the chain, ids stay whole
    assert not [b for b in p.boundaries if b.path == "0" and b.side == "input"]
    # backward: the reduce-scatter's all-gather, and the norm's two parameter gradients together
    assert p.counts() == {"forward": {"reduce_scatter": 1, "all_gather": 1},
                          "backward": {"all_gather": 1, "all_reduce": 1}}


# ----------------------------------------------------------------------------- sync


def test_sync_boundaries_fwd_pre_fwd_post_bwd_post() -> None:
    sch = schedule(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    sch = sf.sync(sch, "0", "fwd_pre", Shard(-1))
    sch = sf.sync(sch, "0", "fwd_post", Replicate(), src=Partial())
    sch = sf.sync(sch, "1", "bwd_post", Replicate(), src=Partial())
    p = plan(sch)
    assert listing(p) == [
        "0 input: R→S(-1)@tp  fwd: -  bwd: all_gather",
        "0 output: P→R@tp  fwd: all_reduce  bwd: -",
        "1 input grad: P→R@tp  fwd: -  bwd: all_reduce",
    ]
    assert [b.tensor for b in p.boundaries] == ["input", "output", "input"]
    assert all(b.explicit for b in p.boundaries)
    assert p.counts() == {"forward": {"all_reduce": 1}, "backward": {"all_gather": 1, "all_reduce": 1}}
    assert [s.mode for s in p.modules["0"].syncs] == ["fwd_pre", "fwd_post"]
    assert p.modules["0"].role is None


def test_sync_of_a_column_output_replaces_its_implicit_gather() -> None:
    col = sf.shard(schedule(nn.Sequential(nn.Linear(8, 8))), "0", axis=0)
    kept = plan(sf.sync(col, "0", "fwd_post", Shard(-1)))  # src defaults to the column's own S(-1)
    assert listing(kept) == [
        "0 input: R→R@tp  fwd: -  bwd: all_reduce",
        "0 output: S(-1)→S(-1)@tp  fwd: -  bwd: -",
    ]
    stated = plan(sf.sync(col, "0", "fwd_post", Replicate()))
    assert listing(stated)[1] == "0 output: S(-1)→R@tp  fwd: all_gather  bwd: -"
    assert implicit(stated) == []


def test_sync_of_a_row_output_reduce_scatters_and_a_stated_input_is_explicit() -> None:
    row = sf.shard(schedule(mlp()), "2", axis=1)
    p = plan(sf.sync(row, "2", "fwd_post", Shard(1)))
    assert "2 output: P→S(1)@tp  fwd: reduce_scatter  bwd: all_gather" in listing(p)
    pre = plan(sf.sync(row, "2", "fwd_pre", Shard(-1)))
    assert listing(pre) == [
        "2 output: P→R@tp  fwd: all_reduce  bwd: -",
        "2 input: R→S(-1)@tp  fwd: -  bwd: all_gather",
    ]
    assert implicit(pre) == []
    replicated = plan(sf.sync(row, "2", "fwd_pre", Replicate()))  # stated replicated: split locally
    assert "2 input: R→S(-1)@tp  fwd: -  bwd: all_gather" in listing(replicated)
    assert replicated.counts() == pre.counts() and implicit(replicated) == []


def test_sync_of_a_module_on_a_gathered_parameter() -> None:
    sch = sf.shard(schedule(nn.Sequential(nn.LayerNorm(8))), "0.weight", axis=0, packed=2)
    p = plan(sf.sync(sch, "0", "fwd_post", Replicate(), src=Partial()))
    assert listing(p) == [
        "0 param weight: (tp=S(0)×2)→R@tp  fwd: all_gather  bwd: -  (implicit)",
        "0 output: P→R@tp  fwd: all_reduce  bwd: -",
    ]
    assert p.boundaries[0].tensor == "param:weight" and p.modules["0"].role == Gathered("tp")
    (problem,) = implicit(p)
    assert "as a whole" in problem.fix


def test_sync_bwd_post_of_a_replicated_gradient_moves_nothing() -> None:
    sch = sf.sync(schedule(nn.Sequential(nn.Linear(4, 4))), "0", "bwd_post", Replicate(), src=Replicate())
    assert listing(plan(sch)) == ["0 input grad: R→R@tp  fwd: -  bwd: -"]
    assert plan(sch).counts() == NONE


def test_sync_bwd_post_to_a_shard_is_refused() -> None:
    sch = schedule(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(sf.LayoutError):
        sf.sync(sch, "0", "bwd_post", Shard(0), src=Partial())


# ----------------------------------------------------------------------------- other annotations


def test_fork_rng_is_planned_without_boundaries_and_tp_local_all_reduces_its_gradients() -> None:
    sch = megatron(schedule(nn.Sequential(nn.Linear(8, 16), nn.Dropout(), nn.Linear(16, 8))))
    p = plan(sf.fork_rng(sch, "1"))
    assert p.modules["1"].rng is not None and p.modules["1"].rng.mesh_axis == "tp"
    assert p.counts() == plan(sch).counts()
    local = plan(sf.tp_local(schedule(mlp()), "0"))
    assert listing(local) == [
        "<root> param grads after backward (2 params): P→R@tp  fwd: -  bwd: all_reduce",
    ]
    assert local.modules["0"].local_params and local.modules["0"].local_axis == "tp"


def test_a_sharded_plain_parameter_is_gathered_before_its_module_runs() -> None:
    p = plan(sf.shard(schedule(nn.Sequential(nn.LayerNorm(8))), "0.weight", axis=0))
    assert listing(p) == ["0 param weight: (tp=S(0))→R@tp  fwd: all_gather  bwd: -  (implicit)"]


# ----------------------------------------------------------------------------- 2-D mesh


def test_on_a_2d_mesh_boundaries_name_the_mesh_axis() -> None:
    tp = plan(megatron(schedule(mlp(), 2, 2)))
    assert listing(tp) == listing(plan(megatron(schedule(mlp()))))  # the dp axis changes nothing
    dp = plan(megatron(schedule(mlp(), 2, 2), mesh_axis="dp"))
    assert listing(dp) == [
        "0 input: R→R@dp  fwd: -  bwd: all_reduce",
        "2 output: P→R@dp  fwd: all_reduce  bwd: -",
    ]


def test_on_a_2d_mesh_a_column_and_a_row_on_different_axes_are_no_pair() -> None:
    sch = sf.shard(sf.shard(schedule(mlp(), 2, 2), "0", axis=0), "2", axis=1, mesh_axis="dp")
    p = plan(sch)
    assert not p.modules["0"].partnered and not p.modules["2"].partnered
    assert listing(p) == [
        "0 input: R→R@tp  fwd: -  bwd: all_reduce",
        "0 output: S(-1)→R@tp  fwd: all_gather  bwd: -  (implicit)",
        "2 input: R→S(-1)@dp  fwd: -  bwd: all_gather  (implicit)",
        "2 output: P→R@dp  fwd: all_reduce  bwd: -",
    ]


def test_on_a_2d_mesh_a_weight_sharded_over_both_axes_is_gathered_twice() -> None:
    sch = sf.shard(schedule(mlp(), 2, 2), "0", layout=("dp", "tp"))
    p = plan(sch)
    assert p.modules["0"].role == Gathered("tp")
    assert listing(p) == ["0 param weight: (dp=S(0), tp=S(1))→R@tp  fwd: all_gather, all_gather  bwd: -  (implicit)"]


# ----------------------------------------------------------------------------- plans the build does not follow


def test_a_column_chain_of_equal_widths_enters_twice() -> None:
    """Columns share an entry only when the data flow calls them on one tensor."""
    sch = sf.shard(schedule(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))), ["0", "1"], axis=0)
    assert plan(sch).counts() == {"forward": {"all_gather": 2}, "backward": {"all_reduce": 2}}


def test_a_row_fed_by_a_row_splits_its_input() -> None:
    """The data flow pairs a row only with the columns that feed it."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 8))
    sch = sf.shard(sf.shard(schedule(model), "0", axis=0), ["1", "2"], axis=1)
    p = plan(sch)
    assert "2 input: R→S(-1)@tp  fwd: -  bwd: all_gather  (implicit)" in listing(p)
    assert p.counts()["backward"] == {"all_reduce": 1, "all_gather": 1}


# ----------------------------------------------------------------------------- Boundary, Plan.counts


def test_boundary_str_and_counts_of_a_hand_written_plan() -> None:
    bounds = (
        Boundary("a", "input", "R", "R", "tp", (), ("all_reduce",)),
        Boundary("b", "output", "S(-1)", "R", "tp", ("all_gather",), (), False, "output"),
        Boundary("", "param w", "(tp=S(0))", "R", "tp", ("all_gather", "all_gather"), (), False, "param:w"),
    )
    assert [str(b) for b in bounds] == [
        "a input: R→R@tp  fwd: -  bwd: all_reduce",
        "b output: S(-1)→R@tp  fwd: all_gather  bwd: -  (implicit)",
        "<root> param w: (tp=S(0))→R@tp  fwd: all_gather, all_gather  bwd: -  (implicit)",
    ]
    p = Plan({}, bounds)
    assert p.counts() == {"forward": {"all_gather": 3}, "backward": {"all_reduce": 1}}
    assert [q.path for q in implicit(p)] == ["b", ""]


# ----------------------------------------------------------------------------- collective_of


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        (Replicate(), Replicate(), ((), ())),
        (Shard(1), Shard(1), ((), ())),
        (Partial(), Partial(), ((), ())),
        (Partial(), Replicate(), (("all_reduce",), ())),
        (Partial(), Shard(0), (("reduce_scatter",), ("all_gather",))),
        (Replicate(), Shard(-1), ((), ("all_gather",))),  # a local split: no traffic forward
        (Shard(1), Replicate(), (("all_gather",), ())),
        (Shard(0), Shard(1), (("all_gather",), ("all_gather",))),
    ],
    ids=lambda v: describe(v) if not isinstance(v, tuple) else None,
)
def test_collective_of_each_placement_change(src: object, dst: object, expected: object) -> None:
    assert collective_of(src, dst) == expected  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- layout


def test_describe_each_placement() -> None:
    assert [describe(p) for p in (Shard(0), Shard(-1), Replicate(), Partial(), packed_shard(1, 3))] == [
        "S(0)",
        "S(-1)",
        "R",
        "P",
        "S(1)×3",
    ]


def test_packed_shard_is_a_shard_unless_packed() -> None:
    assert packed_shard(0, 1) == Shard(0)
    assert packed_shard(1, 3) == _StridedShard(1, split_factor=3)


def test_layout_format_local_shape_and_str() -> None:
    lay = Layout((Replicate(), Shard(0)), ("dp", "tp"), (2, 4))
    assert lay.format((4096, 1024), torch.float32) == "f32[4096@tp, 1024]"
    assert lay.format((4096, 1024), torch.bfloat16).endswith("[4096@tp, 1024]")
    assert lay.local_shape((4096, 1024)) == (1024, 1024)
    assert str(lay) == "(dp=R, tp=S(0))" and not lay.is_replicated and shard_axes(lay) == ("tp",)


def test_layout_over_two_axes_negative_dims_and_packing() -> None:
    both = Layout((Shard(0), Shard(-1)), ("dp", "tp"), (2, 4))
    assert both.format((8, 16), torch.float32) == "f32[8@dp, 16@tp]"
    assert both.local_shape((8, 16)) == (4, 4)
    assert shard_axes(both) == ("dp", "tp") and both.axes_of(1, 2) == (("tp", 1),)
    same_dim = Layout((Shard(1), Shard(1)), ("dp", "tp"), (2, 4))
    assert same_dim.format((8, 16), torch.float32) == "f32[8, 16@dp@tp]"
    assert same_dim.local_shape((8, 16)) == (8, 2)
    packed = Layout((packed_shard(0, 3),), ("tp",), (2,))
    assert packed.format((24, 8), torch.float32) == "f32[24@tp×3, 8]"
    assert packed.local_shape((24, 8)) == (12, 8) and packed.axes_of(0, 2) == (("tp", 3),)
    assert str(packed) == "(tp=S(0)×3)"
    replicated = Layout((Replicate(), Replicate()), ("dp", "tp"), (2, 4))
    assert replicated.is_replicated and shard_axes(replicated) == ()
    assert replicated.local_shape((8, 16)) == (8, 16) and replicated.format((8,), torch.float32) == "f32[8]"


def test_from_spec_reads_mesh_axis_names_per_tensor_dim() -> None:
    dims, shape = ("dp", "tp"), (2, 4)
    assert from_spec(("tp", None), dims, shape) == Layout((Replicate(), Shard(0)), dims, shape)
    assert from_spec((None, "tp"), dims, shape).placements == (Replicate(), Shard(1))
    assert from_spec(("dp", "tp"), dims, shape).placements == (Shard(0), Shard(1))
    assert from_spec((("dp", "tp"), None), dims, shape).placements == (Shard(0), Shard(0))
    assert from_spec((None, None), dims, shape).is_replicated
    assert from_spec((), dims, shape).is_replicated


def test_from_spec_errors() -> None:
    with pytest.raises(KeyError, match="pp"):
        from_spec(("pp", None), ("dp", "tp"), (2, 4))
    with pytest.raises(ValueError, match=r"mesh axis 'tp' appears twice in \('tp', 'tp'\)"):
        from_spec(("tp", "tp"), ("dp", "tp"), (2, 4))
    with pytest.raises(ValueError, match="appears twice"):
        from_spec((("tp", "tp"),), ("tp",), (2,))


def test_shard_reports_from_spec_errors_as_layout_errors() -> None:
    sch = schedule(mlp())
    with pytest.raises(sf.LayoutError, match=r"mesh axis 'pp' is not in the mesh \('tp',\)"):
        sf.shard(sch, "0.weight", layout=("pp", None))
    with pytest.raises(sf.LayoutError, match="appears twice"):
        sf.shard(sch, "0.weight", layout=("tp", "tp"))
