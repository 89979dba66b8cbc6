"""``async_tp=True`` (``--async-tp``): inductor's micro-pipelined tensor parallelism in the
compiled layers of a sequence-parallel recipe, refused where no CUDA GPU runs it and
without the knobs it needs."""

from __future__ import annotations

import pytest
import torch
from models import tiny_llama

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh
from slapo_fn.recipes import _recipe
from slapo_fn.rewrites.compile import COMPILE


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs async TP")
def test_async_tp_is_refused_where_no_cuda_gpu_runs_it() -> None:
    model = tiny_llama()
    sch = sf.create_schedule(model, mesh=fake_mesh(2))
    with pytest.raises(sf.HardwareError, match="async_tp.*no CUDA GPU"):
        sf.recipes.for_model(model)(sch, tp=2, sequence_parallel=True, compile=True, async_tp=True)


def test_async_tp_turns_on_inductors_micro_pipeline_in_the_compiled_layers_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_recipe, "async_tp_problem", lambda: None)  # as on a CUDA GPU
    model = tiny_llama()
    recipe = sf.recipes.for_model(model)
    sch = sf.create_schedule(model, mesh=fake_mesh(2))
    with pytest.raises(sf.LayoutError, match="needs tp > 1, sequence_parallel and compile"):
        recipe(sch, tp=2, sequence_parallel=True, async_tp=True)
    done = recipe(sch, tp=2, sequence_parallel=True, compile=True, async_tp=True)
    compiled = done.annotations.of_kind(COMPILE)
    assert sorted(compiled) == ["model.layers.0", "model.layers.1"], compiled
    assert all(dict(o) == {"options": {"_micro_pipeline_tp": True}} for o in compiled.values()), compiled
    plain = recipe(sch, tp=2, sequence_parallel=True, compile=True).annotations.of_kind(COMPILE)
    assert all(dict(o) == {} for o in plain.values()), plain
