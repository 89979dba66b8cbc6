"""Convolutions as layouts: ``sf.shard`` of a ``Conv1d``/``Conv2d``/``Conv3d`` is a column
(``axis=0``: output channels, its output split on dim 1 of ``N, C, ...``) or a row
(``axis=1``: input channels, its output a partial sum, the bias added once after it); a
norm over channels (BatchNorm, GroupNorm) or a grouped/depthwise convolution sharded
``axis=0`` keeps this rank's channels (whole groups) and runs on them between the pair."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.dtensor import plan
from slapo_fn.dtensor.checks import refusals
from slapo_fn.dtensor.roles import Channels, Column, Row
from slapo_fn.dtensor.shard import LAYOUT, ROLE
from slapo_fn.dtensor.testing import fake_mesh


class ConvBlock(nn.Module):
    """A column convolution, a norm over its channels, an activation, a depthwise
    convolution and a row convolution back to the input's channels, beside a residual."""

    def __init__(self, dims: int, norm: Callable[[int], nn.Module], c: int = 4, mid: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.up = conv(c, mid, 3, padding=1)
        self.norm = norm(mid)
        self.act = nn.ReLU()
        self.dw = conv(mid, mid, 3, padding=1, groups=mid)
        self.down = conv(mid, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.dw(self.act(self.norm(self.up(x)))))  # type: ignore[no-any-return]


CASES: dict[str, tuple[int, Callable[[int], nn.Module], tuple[int, ...]]] = {
    "conv1d+batchnorm": (1, nn.BatchNorm1d, (2, 4, 12)),
    "conv2d+groupnorm": (2, lambda c: nn.GroupNorm(4, c), (2, 4, 6, 6)),
    "conv3d+batchnorm": (3, nn.BatchNorm3d, (2, 4, 3, 4, 4)),
}


class Centred(nn.Module):
    """Code between a column and its row that reduces over the channels (``dim=1``: needs
    all of them) or over the spatial dimensions (each channel alone), after the column
    or after a norm on its channels."""

    def __init__(self, dim: int | tuple[int, ...], norm: Callable[[int], nn.Module] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dim = dim
        self.a = nn.Conv2d(4, 8, 1)
        self.norm = None if norm is None else norm(8)
        self.b = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.norm is not None:
            h = self.norm(h)
        return self.b(torch.relu(h - h.mean(dim=self.dim, keepdim=True)))  # type: ignore[no-any-return]


class TwoColumns(nn.Module):
    """Two columns on one input, one through a norm on its channels, added (two tensors
    split alike) and handed to one row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Conv2d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.b = nn.Conv2d(4, 8, 1)
        self.c = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.bn(self.a(x)) + self.b(x)))  # type: ignore[no-any-return]


def _pair(sch: sf.Schedule) -> sf.Schedule:
    sch = sf.shard(sf.shard(sch, "a", axis=0), "b", axis=1)
    return sf.shard(sch, "norm", axis=0) if sch.module.norm is not None else sch


def _megatron(sch: sf.Schedule) -> sf.Schedule:
    sch = sf.shard(sch, ["up", "norm", "dw"], axis=0)
    return sf.shard(sch, "down", axis=1)


def _block_tp2(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for name, (dims, norm, shape) in CASES.items():
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        r = parity(ConvBlock(dims, norm), _megatron, (x,), shape=(world,), loss=lambda o, _: o.pow(2).mean())
        out[name] = {k: r[k] for k in ("fwd", "bwd", "predicted", "grads")}
    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(4))
    r = parity(TwoColumns(), lambda s: sf.shard(sf.shard(s, ["a", "bn", "b"], axis=0), "c", axis=1), (x,),
               shape=(world,), loss=lambda o, _: o.pow(2).mean())
    out["two columns added"] = {k: r[k] for k in ("fwd", "bwd", "predicted", "grads")}
    for alone, axis in (("up", 0), ("down", 1)):  # a column gathers its channels, a row splits them
        x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(3))
        r = parity(ConvBlock(2, nn.BatchNorm2d), lambda s, q=alone, a=axis: sf.shard(s, q, axis=a), (x,),
                   shape=(world,), loss=lambda o, _: o.pow(2).mean())
        out[f"{alone} alone"] = {k: r[k] for k in ("fwd", "bwd", "predicted", "grads")}
    for dim, after_norm in ((1, None), ((2, 3), None), (1, nn.BatchNorm2d)):
        x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(2))
        r = parity(Centred(dim, after_norm), _pair, (x,), shape=(world,), loss=lambda o, _: o.pow(2).mean())
        out[f"mean over {dim}" + (" after a norm" if after_norm else "")] = {k: r[k] for k in ("fwd", "bwd", "grads")}
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_conv_column_norm_depthwise_row_is_one_megatron_pair_at_tp2(dist2: Any) -> None:
    for r in dist2.run(_block_tp2, timeout=100):
        # over the channels the code needs them all: run on DTensor activations (gathered), equal
        assert r.pop("mean over 1")["grads"] == 4
        assert r.pop("mean over 1 after a norm")["grads"] == 6
        # both columns enter once on their one input; their split sum goes to the row as it is
        got = r.pop("two columns added")
        assert (got["grads"], got["fwd"], got["bwd"]) == (8, {"all_reduce": 1}, {"all_reduce": 1}), got
        assert got["predicted"] == {"forward": got["fwd"], "backward": got["bwd"]}, got
        for alone, fwd, bwd in (("up", {"all_gather": 1}, {"all_reduce": 1}),
                                ("down", {"all_reduce": 1}, {"all_gather": 1})):
            got = r.pop(f"{alone} alone")
            assert (got["grads"], got["fwd"], got["bwd"]) == (8, fwd, bwd), (alone, got)
            assert got["predicted"] == {"forward": fwd, "backward": bwd}, (alone, got)
        # over the spatial dimensions each channel is alone: the pair runs on local shards
        assert r.pop("mean over (2, 3)") == {"fwd": {"all_reduce": 1}, "bwd": {"all_reduce": 1}, "grads": 4}
        for name, got in r.items():
            assert got["grads"] == 8, name  # every parameter's gradient equal (parity checks each)
            # one all-reduce after the row forward, one of the column's input gradient backward
            assert got["fwd"] == {"all_reduce": 1} and got["bwd"] == {"all_reduce": 1}, (name, got)
            assert got["predicted"] == {"forward": got["fwd"], "backward": got["bwd"]}, (name, got)


def test_shard_lays_out_a_convolution_by_channels() -> None:
    sch = _megatron(sf.create_schedule(ConvBlock(2, nn.BatchNorm2d), mesh=fake_mesh(2)))
    roles = sch.annotations.of_kind(ROLE)
    assert roles == {"up": Column("tp", dim=1), "norm": Channels("tp", dim=1), "dw": Channels("tp", dim=1),
                     "down": Row("tp", dim=1)}
    # N, C, H, W: the channels are dim 1, what the column gives, the norm keeps and the row takes
    assert roles["up"].gives(4) == roles["norm"].takes(4) == roles["norm"].gives(4) == roles["down"].takes(4) \
        == Shard(1)
    layouts = {q: lay.placements for q, lay in sch.annotations.of_kind(LAYOUT).items()}
    split, whole = (Shard(0),), (Replicate(),)
    assert layouts == {"up.weight": split, "up.bias": split, "down.weight": (Shard(1),), "down.bias": whole,
                       "norm.weight": split, "norm.bias": split, "norm.running_mean": split,
                       "norm.running_var": split, "dw.weight": split, "dw.bias": split}
    p = plan(sch)
    assert p.modules["up"].partners == ("down",) and p.modules["down"].partners == ("up",)
    assert not refusals(sch, p)
    assert "up: Conv2d  [column@tp[dim 1]]" in str(sch)


@pytest.mark.parametrize(("module", "axis", "reason"), [
    (nn.Conv2d(4, 6, 1), 0, r"'m.weight': dimension 6 of axis 0 of shape \(6, 4, 1, 1\) is not divisible by the size"),
    (nn.Conv2d(6, 8, 1), 1, r"'m.weight': dimension 6 of axis 1 .* not divisible by the size 4"),
    (nn.BatchNorm2d(6), 0, r"'m': a BatchNorm2d's 6 channels do not divide by the size 4 of mesh axis 'tp'"),
    (nn.GroupNorm(2, 8), 0, r"'m': a GroupNorm's 2 groups of 8 channels do not divide by the size 4"),
    (nn.Conv2d(6, 6, 3, groups=6), 0, r"'m': a Conv2d's 6 groups of 6 channels do not divide by the size 4"),
    (nn.Conv2d(8, 8, 3, groups=2), 0, r"'m': a Conv2d's 2 groups of 8 channels do not divide by the size 4"),
    (nn.Conv2d(8, 8, 3, groups=4), 1, r"'m': a Conv2d is sharded by its channels only \(its channels are its "
                                      r"groups' own\); got axis=1"),
    (nn.BatchNorm2d(8), 1, r"'m': a BatchNorm2d is sharded by its channels only \(it computes per channel\)"),
])
def test_shard_refuses_channels_and_groups_that_do_not_divide_by_name(module: nn.Module, axis: int,
                                                                        reason: str) -> None:
    sch = sf.create_schedule(_Holder(module), mesh=fake_mesh(4))
    with pytest.raises(sf.LayoutError, match=reason):
        sf.shard(sch, "m", axis=axis)


class _Holder(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("norm", [None, nn.BatchNorm2d, lambda c: nn.GroupNorm(2, c)],
                         ids=["after the column", "after a BatchNorm2d", "after a GroupNorm"])
@pytest.mark.parametrize(("dim", "local"), [(1, False), ((2, 3), True), (-1, True)])
def test_code_between_a_convolution_pair_is_read_along_the_channels(
        dim: int | tuple[int, ...], local: bool, norm: Callable[[int], nn.Module] | None) -> None:
    # a reduction over dim 1 mixes the channels; over the spatial dimensions (the last one
    # too: W, not the features) it keeps each channel alone
    sch = _pair(sf.create_schedule(Centred(dim, norm), mesh=fake_mesh(2)))
    found = plan(sch).on_dtensors
    assert not found if local else ["mean(dim=1)" in p.reason for p in found] == [True], found


def test_a_norm_split_by_channels_outside_a_pair_is_refused_by_name() -> None:
    # the norm alone: its input arrives with every channel, nothing keeps them split for it
    sch = sf.shard(sf.create_schedule(ConvBlock(2, nn.BatchNorm2d), mesh=fake_mesh(2)), "norm", axis=0)
    found = refusals(sch, plan(sch))
    assert [p.path for p in found] == ["norm"], found
    assert "its input comes whole from 'up'" in found[0].reason, found[0]
    # after a column with no row: the column gathers its output, and what the norm hands on needs every channel
    sch = sf.shard(sf.shard(sf.create_schedule(ConvBlock(2, nn.BatchNorm2d), mesh=fake_mesh(2)), "up", axis=0),
                   "norm", axis=0)
    found = refusals(sch, plan(sch))
    assert [p.path for p in found] == ["norm"] and "its output reaches 'dw'" in found[0].reason, found
    # Megatron's pair with its split stated by syncs to the channels: not read as a split yet, so
    # refused with the fix (the pair needs no sync)
    sch = _megatron(sf.create_schedule(ConvBlock(2, nn.BatchNorm2d), mesh=fake_mesh(2)))
    sch = sf.sync(sf.sync(sch, "up", "fwd_post", Shard(1)), "down", "fwd_pre", Shard(1), src=Shard(1))
    found = [p for p in refusals(sch, plan(sch)) if p.path == "norm"]
    assert found and "drop the syncs on 'down', 'up'" in found[0].fix, found
