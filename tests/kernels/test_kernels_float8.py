"""float8 linears (``float8=True`` on a recipe, ``--float8``): torchao's converter where the
hardware multiplies in float8, a typed refusal elsewhere; a converted layer sharded as a
column or a row with the collectives of a plain ``Linear``. torchao computes float8 on
the CPU too (emulated), which is how the conversion and its sharding are checked here."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import tiny_llama
from torch import nn

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh
from slapo_fn.kernels import float8 as f8
from slapo_fn.kernels import gpu
from slapo_fn.recipes import _recipe


def _gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a test GPU")


def test_float8_is_refused_with_the_reason_where_the_hardware_cannot_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    here = gpu.float8_problem()
    if not torch.cuda.is_available():  # this machine: no GPU (or no torchao)
        assert here is not None and ("CUDA GPU" in here.reason or "torchao" in here.reason), here
        model = tiny_llama()
        with pytest.raises(sf.HardwareError, match="float8"):
            sf.recipes.for_model(model)(sf.create_schedule(model), float8=True)
    if here is not None and "torchao" in here.reason:
        return
    _gpu(monkeypatch, (8, 0))
    old = gpu.float8_problem("--float8")
    assert old is not None and "compute capability 8.0" in old.reason and "--float8" in old.fix, old
    _gpu(monkeypatch, (9, 0))
    assert gpu.float8_problem() is None


def test_which_linears_convert() -> None:
    """Plain linears inside the layers whose widths, over tp ranks, stay multiples of 16."""
    model = nn.ModuleDict({"a": nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 48), nn.Linear(8, 64)),
                           "b": nn.Linear(64, 64)})
    assert f8.float8_paths(model, ["a"], tp=1) == ["a.0", "a.1"]
    assert f8.float8_paths(model, ["a"], tp=2) == ["a.0"]  # 48 / 2 is no multiple of 16


torchao = pytest.importorskip("torchao.float8")


def test_a_float8_recipe_converts_the_layers_linears_and_shards_them_as_columns_and_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_recipe, "float8_problem", lambda: None)  # as on an sm_89+ GPU
    model = tiny_llama()
    sch = sf.recipes.for_model(model)(sf.create_schedule(model, mesh=fake_mesh(2)), tp=2, float8=True)
    from torchao.float8.float8_linear import Float8Linear

    from slapo_fn.dtensor.roles import Column, Row
    from slapo_fn.dtensor.shard import ROLE
    from slapo_fn.tree import get_module

    roles = sch.annotations.of_kind(ROLE)
    converted = {p for p, m in sch.module.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(roles), (converted, roles)
    kinds = [type(r) for r in roles.values()]
    assert kinds.count(Column) == 2 * 5 and kinds.count(Row) == 2 * 2, roles
    assert type(get_module(sch.module, "lm_head")) is nn.Linear  # not a layer's: torchtitan leaves the head too
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear  # the schedule's input is unchanged


def _exact(shape: tuple[int, ...], split: int, parts: int, g: torch.Generator) -> torch.Tensor:
    """Values of ±1 and ±2 with a 2 in every shard along ``split``: exact in float8 (e4m3 and
    e5m2) with any shard's or the whole tensor's scale."""
    t = (torch.randint(1, 3, shape, generator=g) * (torch.randint(0, 2, shape, generator=g) * 2 - 1)).float()
    for chunk in t.chunk(parts, split):
        chunk[(0,) * chunk.dim()] = 2.0
    return t


def _float8_layers(rank: int, world: int) -> dict[str, Any]:
    from torchao.float8 import convert_to_float8_training
    from tp_checks import parity

    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    for axis in (0, 1):
        lin = nn.Linear(32, 64) if axis == 0 else nn.Linear(64, 32)
        with torch.no_grad():
            lin.weight.copy_(_exact(tuple(lin.weight.shape), axis, world, g))
            lin.bias.copy_(_exact(tuple(lin.bias.shape), 0, world, g))
        model = nn.Sequential(convert_to_float8_training(lin))
        x = _exact((2, 3, lin.in_features), 2, world, g)
        weights = _exact((lin.out_features,), 0, world, g)

        def loss(y: Any, sch: Any, weights: torch.Tensor = weights) -> torch.Tensor:
            return (y * weights).sum()

        r = parity(model, lambda s, axis=axis: sf.shard(s, "0", axis=axis), (x,), shape=(world,), loss=loss,
                   atol=0.0)
        out[str(axis)] = {k: r[k] for k in ("fwd", "bwd", "predicted", "grads")}
    lin = convert_to_float8_training(nn.Linear(32, 64))
    x = torch.randn(4, 32, generator=g)
    out["quantizes"] = not torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-4)
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_float8_column_and_row_compute_the_single_process_numbers_with_a_linears_collectives(dist2) -> None:
    """On values exact in float8 (each shard's scale then quantizes as the whole's does), a
    sharded Float8Linear's output, input gradient and every parameter gradient equal the
    single process's exactly; its collectives are a plain Linear's; and float8 is real:
    on random values its numbers are not F.linear's."""
    for r in dist2.run(_float8_layers, timeout=90):
        assert r["quantizes"], r
        column, row = r["0"], r["1"]
        assert column["grads"] == row["grads"] == 2, r
        assert {"forward": column["fwd"], "backward": column["bwd"]} == column["predicted"], r
        assert {"forward": row["fwd"], "backward": row["bwd"]} == row["predicted"], r
        assert column["predicted"] == {"forward": {"all_gather": 1}, "backward": {"all_reduce": 1}}, r
        assert row["predicted"] == {"forward": {"all_reduce": 1}, "backward": {"all_gather": 1}}, r
