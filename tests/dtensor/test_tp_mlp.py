"""Tensor parallel MLPs on 2 and 4 gloo ranks: parity (forward, every gradient) and exact collectives."""

from __future__ import annotations

import itertools

import pytest
import torch
from models import MLP
from tp_checks import parity

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _megatron(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = MLP(8, 16)
    x = torch.randn(2, 3, 8)
    return parity(model, lambda s: sf.shard(sf.shard(s, "fc1", axis=0), "fc2", axis=1), (x,), shape=(world,))


@pytest.mark.parametrize("n", [2, 4])
def test_megatron_mlp_parity_and_one_all_reduce_each_way(dist_pool, n: int) -> None:
    for r in dist_pool(n).run(_megatron, timeout=60):
        assert r["grads"] == 4
        assert r["fwd"] == {"all_reduce": 1}
        assert r["bwd"] == {"all_reduce": 1}
        assert r["predicted"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


CHOICES = (None, 0, 1)


def _combo(rank: int, world: int) -> list:
    out = []
    for a, b in itertools.product(CHOICES, CHOICES):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        x = torch.randn(4, 8)

        def rw(s, a=a, b=b):
            if a is not None:
                s = sf.shard(s, "0", axis=a)
            if b is not None:
                s = sf.shard(s, "2", axis=b)
            return s

        r = parity(model, rw, (x,), shape=(world,))
        fwd_pred = r["predicted"]["forward"]
        bwd_pred = r["predicted"]["backward"]
        out.append(((a, b), r["fwd"] == fwd_pred, r["bwd"] == bwd_pred, r["fwd"], fwd_pred, r["bwd"], bwd_pred))
    return out


def test_every_combination_of_two_layers(dist2) -> None:
    for rank_result in dist2.run(_combo, timeout=120):
        for combo, fwd_ok, bwd_ok, *detail in rank_result:
            assert fwd_ok and bwd_ok, (combo, detail)


def _packed_norm(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6))
    x = torch.randn(4, 6)
    return parity(model, lambda s: sf.shard(s, "1.weight", axis=0, packed=3), (x,), shape=(world,))


def test_a_packed_shard_of_a_plain_parameter_is_gathered_as_predicted(dist2) -> None:
    # a _StridedShard placement (packed=3) is a shard too: gathered before the module runs
    for r in dist2.run(_packed_norm, timeout=60):
        assert r["grads"] == 4
        assert r["fwd"] == r["predicted"]["forward"] and r["bwd"] == r["predicted"]["backward"]
