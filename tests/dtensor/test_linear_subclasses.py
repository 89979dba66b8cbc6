"""``nn.Linear`` subclasses with a forward of their own (float8, LoRA, a scaled product)
sharded as columns and rows: each rank runs the subclass's forward on its shards, with the
collectives of a plain ``Linear``; a forward that mixes output features keeps its own
forward on gathered parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist import mesh
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.dtensor.roles import Column, Gathered, Row
from slapo_fn.dtensor.shard import LAYOUT, feature_dims
from slapo_fn.dtensor.testing import fake_mesh


class Scaled(nn.Linear):
    """``(x @ W.T) * gain + b``: the numbers of a linear layer, not by ``F.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x @ self.weight.T) * 0.5
        return y if self.bias is None else y + self.bias


class Lora(nn.Linear):
    """A frozen-shaped layer plus a low-rank update ``x A.T B.T`` (its own parameters)."""

    def __init__(self, i: int, o: int, r: int = 2) -> None:
        super().__init__(i, o)
        self.lora_A = nn.Parameter(torch.randn(r, i) / i**0.5)
        self.lora_B = nn.Parameter(torch.randn(o, r) / r**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + 0.5 * F.linear(F.linear(x, self.lora_A), self.lora_B)


class Normed(nn.Linear):
    """Its outputs divided by their norm: each depends on every feature, so it is no column."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y / y.norm(dim=-1, keepdim=True)


def _mlp(cls: type[nn.Linear], square: bool = False) -> nn.Sequential:
    return nn.Sequential(cls(8, 8 if square else 16), nn.GELU(), cls(8 if square else 16, 8))


def _megatron(s: sf.Schedule) -> sf.Schedule:
    return sf.shard(sf.shard(s, "0", axis=0), "2", axis=1)


def _runs(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for cls in (nn.Linear, Scaled, Lora):
        for square in (False, True):
            torch.manual_seed(0)
            r = parity(_mlp(cls, square), _megatron, (torch.randn(2, 3, 8),), shape=(world,))
            name = f"{cls.__name__}{'-square' if square else ''}"
            out[name] = {k: r[k] for k in ("fwd", "bwd", "predicted", "grads")}
    # on DTensor activations (two fwd_post syncs stacked on the column: the region's path)
    torch.manual_seed(0)
    r = parity(_mlp(Lora), _on_dtensors, (torch.randn(2, 3, 8),), shape=(world,), predict=False)
    out["Lora-on-dtensors"] = {k: r[k] for k in ("on_dtensors", "grads")}
    out["compiled"] = _compiled(world)
    return out


def _compiled(world: int) -> dict[str, Any]:
    """Three identical LoRA blocks compiled one by one (``fullgraph``): one graph for all."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(*[_mlp(Lora) for _ in range(3)])
    sch = sf.create_schedule(model, mesh=mesh((world,), ("tp",)))
    sch = sf.shard(sf.shard(sch, "*.0", axis=0), "*.2", axis=1)
    built = sf.build(sf.compile(sch, "*", backend="eager", fullgraph=True))
    ref = sf.build(sf.create_schedule(model))
    graphs, worst = [], 0.0
    for step in range(2):
        x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(step)).requires_grad_()  # as every block's
        built(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    grads = dict(ref.named_parameters())
    for name, p in built.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (g - grads[name].grad).abs().max().item())
    return {"graphs": graphs, "breaks": sum(counters["graph_break"].values()), "grad": worst}


def _on_dtensors(s: sf.Schedule) -> sf.Schedule:
    s = sf.sync(sf.sync(_megatron(s), "0", "fwd_post", Shard(-1)), "0", "fwd_post", Replicate())
    return s


def test_a_subclass_runs_its_own_forward_on_shards_with_the_collectives_of_a_linear(dist2) -> None:
    """Forward, input and every parameter gradient equal the single process (``parity``);
    a scaled linear costs what a plain one does (one all-reduce each way); LoRA's
    replicated ``A`` (column) and ``B`` (row) add one all-reduce of their gradients, as
    explain predicts."""
    for r in dist2.run(_runs, timeout=120):
        megatron = {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
        for name in ("Linear", "Scaled", "Linear-square", "Scaled-square"):
            got = r[name]
            assert {"forward": got["fwd"], "backward": got["bwd"]} == megatron == got["predicted"], (name, got)
        for name in ("Lora", "Lora-square"):
            got = r[name]
            assert got["grads"] == 8, got
            assert {"forward": got["fwd"], "backward": got["bwd"]} == got["predicted"] == {
                "forward": {"all_reduce": 1}, "backward": {"all_reduce": 2}}, (name, got)
        assert r["Lora-on-dtensors"] == {"on_dtensors": True, "grads": 8}, r
        compiled = r["compiled"]
        assert compiled["graphs"] == [1, 1] and compiled["breaks"] == 0 and compiled["grad"] < 1e-5, compiled


def test_each_parameter_splits_along_the_features_its_role_splits() -> None:
    sch = _megatron(sf.create_schedule(_mlp(Lora), mesh=fake_mesh(2)))
    plan = sf.dtensor.plan(sch)
    assert plan.modules["0"].role == Column("tp") and plan.modules["2"].role == Row("tp")
    layouts = {p: str(lay) for p, lay in sch.annotations.of_kind(LAYOUT).items()}
    assert layouts["0.lora_B"] == layouts["0.weight"] == layouts["0.bias"]  # output features
    assert layouts["2.lora_A"] == layouts["2.weight"]  # input features
    assert "0.lora_A" not in layouts and "2.lora_B" not in layouts
    # the rule, as shapes: (out, in) = (6, 4)
    assert [feature_dims(s, 6, 4) for s in [(6, 4), (6,), (2, 4), (6, 2), (4,), (3,)]] == [
        (0, 1), (0, None), (None, 1), (0, None), (None, 0), (None, None)]
    assert [feature_dims(s, 5, 5) for s in [(5, 5), (5,), (2, 5), (5, 2)]] == [(0, 1), (0, None), (None, 1), (0, None)]


@pytest.mark.parametrize("cls", [Normed], ids=lambda c: c.__name__)
def test_a_forward_mixing_output_features_keeps_its_own_on_gathered_parameters(cls: type[nn.Linear]) -> None:
    sch = _megatron(sf.create_schedule(_mlp(cls), mesh=fake_mesh(2)))
    plan = sf.dtensor.plan(sch)
    assert plan.modules["0"].role == Gathered("tp") == plan.modules["2"].role


class _AddsBiasTwice(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.bias


def test_a_row_whose_forward_adds_its_bias_otherwise_than_once_is_not_a_row() -> None:
    """A row adds the bias once after the sum: a forward adding it twice (a column still)
    would be summed wrong as a row, and runs gathered."""
    sch = _megatron(sf.create_schedule(_mlp(_AddsBiasTwice), mesh=fake_mesh(2)))
    plan = sf.dtensor.plan(sch)
    assert plan.modules["0"].role == Column("tp") and plan.modules["2"].role == Gathered("tp")
