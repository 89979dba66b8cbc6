"""data_parallel: FSDP2 / DDP / HSDP through build, losses equal to single-process training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist import mesh
from models import tiny_gpt2, tiny_llama, token_ids, train
from torch import nn

import slapo_fn as sf
from slapo_fn.dtensor.data_parallel import find_blocks
from slapo_fn.dtensor.testing import fake_mesh

STEPS = 3


def gpt2_without_dropout() -> nn.Module:
    return tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


FACTORIES = {"llama": tiny_llama, "gpt2": gpt2_without_dropout}


def reference_losses(factory: Any, ids: torch.Tensor, lr: float = 0.05) -> list[float]:
    model = factory()
    return train(model, torch.optim.AdamW(model.parameters(), lr=lr), ids, STEPS)


def _train(rank: int, world: int, factory_name: str, shape: tuple[int, ...], names: tuple[str, ...],
           options: dict[str, Any], checkpoint: bool) -> dict[str, Any]:
    import torch.distributed as dist

    factory = FACTORIES[factory_name]
    model = factory()
    sch = sf.create_schedule(model, mesh=mesh(shape, names))
    if checkpoint:
        sch = sf.checkpoint(sch, sf.of_type(type(find_layer(model))))
    sch = sf.data_parallel(sch, **options)
    built = sf.build(sch)
    opt = torch.optim.AdamW(built.parameters(), lr=0.05)
    ids = token_ids(batch=2 * world, seq=8)
    local = ids.chunk(world)[rank]
    losses = []
    for _ in range(STEPS):
        loss = built(local, labels=local).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "ref": reference_losses(factory, ids),
            "names": [n for n, _ in built.named_parameters()], "orig": [n for n, _ in model.named_parameters()],
            "wrapped": type(built).__name__}


def find_layer(model: nn.Module) -> nn.Module:
    first = find_blocks(model)[0]
    return model.get_submodule(first)


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("model", "mode", "checkpoint"),
    [("llama", "fsdp", False), ("llama", "ddp", False), ("gpt2", "fsdp", True), ("llama", "fsdp", True)],
)
def test_two_ranks_train_like_one_process(dist2: Any, model: str, mode: str, checkpoint: bool) -> None:
    for r in dist2.run(_train, model, (2,), ("dp",), {"mode": mode}, checkpoint, timeout=200):
        torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=1e-6)
        assert r["names"] == r["orig"]  # FQNs unchanged by FSDP2 / replicate
        assert r["wrapped"].startswith("FSDP") or r["wrapped"].startswith("Replicate") or mode == "ddp"


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_hsdp_on_a_two_by_two_mesh(dist4: Any) -> None:
    options = {"mode": "hsdp", "mesh_axis": ("dp_replicate", "dp_shard")}
    for r in dist4.run(_train, "llama", (2, 2), ("dp_replicate", "dp_shard"), options, False, timeout=200):
        torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=1e-6)


def _mixed(rank: int, world: int) -> list[float]:
    model = tiny_llama()
    sch = sf.data_parallel(sf.create_schedule(model, mesh=mesh((2,), ("dp",))), param_dtype=torch.bfloat16,
                           reduce_dtype=torch.float32)
    built = sf.build(sch)
    ids = token_ids(batch=2, seq=8).chunk(world)[rank]
    loss = built(ids, labels=ids).loss
    loss.backward()
    return [loss.item(), float(next(built.parameters()).grad.dtype == torch.float32)]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_fsdp_mixed_precision_runs_in_bf16_and_keeps_fp32_grads(dist2: Any) -> None:
    ref = tiny_llama()
    ids = token_ids(batch=2, seq=8)
    for rank, (loss, fp32_grads) in enumerate(dist2.run(_mixed, timeout=100)):
        local = ids.chunk(2)[rank]
        expected = ref(local, labels=local).loss.item()
        assert loss != expected and abs(loss - expected) < 0.05  # bf16 compute, close to fp32
        assert fp32_grads == 1.0


# -- schedule-time errors (a fake process group, no data moves) -------------------------------
def test_find_blocks_of_hf_models() -> None:
    assert find_blocks(tiny_llama()) == ("model.layers.0", "model.layers.1")
    assert find_blocks(tiny_gpt2()) == ("transformer.h.0", "transformer.h.1")


def test_data_parallel_errors_are_reported_up_front() -> None:
    model = tiny_llama()
    with pytest.raises(sf.LayoutError, match=r"(?s)the schedule has no mesh.*fix: sf.create_schedule"):
        sf.data_parallel(sf.create_schedule(model))
    sch = sf.create_schedule(model, mesh=fake_mesh(2, 2, names=("dp", "tp")))
    with pytest.raises(sf.LayoutError, match=r"(?s)mesh axis 'fsdp' is not in the mesh \('dp', 'tp'\) of shape "
                                             r"\(2, 2\).*fix: pass mesh_axis= one of"):
        sf.data_parallel(sch, mesh_axis="fsdp")
    with pytest.raises(sf.LayoutError, match=r"(?s)2 problems.*unknown data-parallel mode 'zero3'.*no mesh"):
        sf.data_parallel(sf.create_schedule(model), mode="zero3")  # type: ignore[arg-type]
    with pytest.raises(sf.LayoutError, match=r"mode 'hsdp' takes two mesh axes, got \('dp',\)"):
        sf.data_parallel(sch, mode="hsdp")
    with pytest.raises(sf.LayoutError, match=r"mode 'fsdp' takes one mesh axis"):
        sf.data_parallel(sch, mesh_axis=("dp", "tp"))
    with pytest.raises(sf.ScheduleError, match="FSDP units cannot nest"):
        sf.data_parallel(sch, ["model.layers.0", "model.layers.0.mlp"])
    once = sf.data_parallel(sch)
    with pytest.raises(sf.ScheduleError, match=r"already data-parallel: fsdp@dp\(2 blocks\)"):
        sf.data_parallel(once, mode="ddp")
    assert "data_parallel" not in sch.annotations.get("", {})
    assert repr(once.history[-1]) == "data_parallel.at()"
    assert dict(once[""].annotations)["data_parallel"].blocks == ("model.layers.0", "model.layers.1")
