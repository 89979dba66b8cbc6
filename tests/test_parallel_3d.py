"""3D parallelism from one schedule: dp x pp x tp on 8 gloo ranks, and the 2-D cuts of it,
train a tiny LLaMA for three optimizer steps with the single-process losses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist import mesh
from models import VOCAB, tiny_llama

import slapo_fn as sf
from slapo_fn.recipes import LLAMA, Knobs

STEPS = 3
BATCH, SEQ = 8, 8


def llama() -> torch.nn.Module:
    return tiny_llama(layers=4, num_key_value_heads=2)


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def reference_losses() -> list[float]:
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids, target = batch(step)
        loss = ce(model(ids).logits, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...], knobs: dict[str, Any],
           fused: bool = False) -> Any:
    import torch.distributed as dist

    m = mesh(shape, names)
    sch = LLAMA(sf.create_schedule(llama(), mesh=m), Knobs(**knobs))
    dp = m.size(names.index("dp")) if "dp" in names else 1
    dp_rank = m.get_local_rank("dp") if "dp" in names else 0
    pipelined = "pp" in names
    model = sf.build_pipeline(sch, microbatches=2, schedule="1f1b", loss_fn=ce) if pipelined else sf.build(sch)
    # foreach=True (AdamW's default on CUDA) or fused=True: every parameter is a DTensor, none plain
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **({"fused": True} if fused else {"foreach": True}))
    losses = []
    for step in range(STEPS):
        ids, target = (t.chunk(dp)[dp_rank] for t in batch(step))
        if pipelined:
            loss = model.step(ids, target=target)
        else:
            loss = ce(model(ids).logits, target)
            loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(value, group=m.get_group("dp"))
        losses.append(value.item() / dp)
    return losses


#: name: (mesh shape, axis names, recipe knobs); a name ending in "-fused" steps AdamW with fused=True
CASES = {
    "dp2xpp2xtp2": ((2, 2, 2), ("dp", "pp", "tp"), {"tp": 2, "stages": 2, "dp_mode": "fsdp"}),
    "dp2xpp2xtp2-fused": ((2, 2, 2), ("dp", "pp", "tp"), {"tp": 2, "stages": 2, "dp_mode": "fsdp"}),
    "dp2xtp2": ((2, 2), ("dp", "tp"), {"tp": 2, "dp_mode": "fsdp"}),
    "pp2xtp2": ((2, 2), ("pp", "tp"), {"tp": 2, "stages": 2}),
    "pp2xtp2-fused": ((2, 2), ("pp", "tp"), {"tp": 2, "stages": 2}),
    "dp2xtp2-ddp-sp-checkpoint": ((2, 2), ("dp", "tp"), {"tp": 2, "dp_mode": "ddp", "sequence_parallel": True,
                                                         "checkpoint": 1.0}),
}


@pytest.mark.dist
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_training_matches_single_process(dist_pool: Any, case: str) -> None:
    shape, names, knobs = CASES[case]
    expected = reference_losses()
    results = dist_pool(len(names) and int(torch.tensor(shape).prod())).run(
        _train, shape, names, knobs, case.endswith("-fused"), timeout=400)
    for losses in results:
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
