"""Bad layouts: one LayoutError naming every offending path, shapes, mesh axis and fix; input unchanged."""

from __future__ import annotations

import pytest
import torch
from dist import mesh
from models import tiny_llama
from torch import nn

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _errors(rank: int, world: int) -> list[str]:
    m = mesh((world,), ("tp",))
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8, bias=False), nn.Linear(9, 9))
    sch = sf.create_schedule(model, mesh=m)
    out = []
    for call in (
        lambda: sf.shard(sch, ["0", "2"], axis=0),  # 6 % 4, 9 % 2: non-divisible (all at once)
        lambda: sf.shard(sch, "1", axis=2),  # axis out of range
        lambda: sf.shard(sch, "1", axis=0, mesh_axis="dp"),  # missing mesh axis
        lambda: sf.shard(sch, "1", axis=0, packed=3),  # packed does not divide 8
        lambda: sf.shard(sf.shard(sch, "1", axis=0), "1.weight", axis=1),  # sharded twice differently
    ):
        try:
            call()
            out.append("no error")
        except sf.LayoutError as e:
            out.append(str(e))
    heads = sf.create_schedule(tiny_llama(1), mesh=m)
    try:
        sf.shard(heads, "model.layers.0.self_attn.k_proj", axis=0)
        out.append("no error")
    except sf.LayoutError as e:
        out.append(str(e))
    out.append(str(len(sch.annotations)))
    return out


def test_layout_errors_name_path_shape_mesh_axis_and_fix(dist4) -> None:
    msgs = dist4.run(_errors, timeout=60)[0]
    assert "'2.weight'" in msgs[0] and "size 4 of mesh axis 'tp'" in msgs[0] and "(9, 9)" in msgs[0]
    assert "problems" in msgs[0] and "fix:" in msgs[0]
    assert "axis 2 is out of range for weight of shape (8, 6)" in msgs[1]
    assert "mesh axis 'dp' is not in the mesh ('tp',)" in msgs[2]
    assert "packed=3 does not divide axis 0 of shape (8, 6)" in msgs[3]
    assert "already sharded" in msgs[4] and "'1.weight'" in msgs[4]
    assert "2 heads (of head_dim 16) are not divisible by the size 4 of mesh axis 'tp'" in msgs[5]
    assert msgs[6] == "0"  # the input schedule is unchanged


def test_shard_without_mesh_is_a_layout_error() -> None:
    with pytest.raises(sf.LayoutError, match=r"the schedule has no mesh"):
        sf.shard(sf.create_schedule(nn.Linear(4, 4)), "", axis=0)
    assert torch.is_tensor(nn.Linear(2, 2).weight)


def test_a_root_module_can_be_sharded_and_planned() -> None:
    from slapo_fn.dtensor.boundary import plan
    from slapo_fn.dtensor.testing import fake_mesh

    sch = sf.shard(sf.create_schedule(nn.Linear(8, 8), mesh=fake_mesh(2)), "", axis=0)
    assert "" in plan(sch).modules
