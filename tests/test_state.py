"""Distributed checkpoints: round trips across layouts, resume, atomic saves, HF export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist import mesh
from models import megatron_llama, tiny_llama, token_ids, train
from torch import nn

import slapo_fn as sf
from slapo_fn.state import CheckpointFallback


def llama() -> nn.Module:
    return tiny_llama(num_key_value_heads=4)  # kv heads divisible by tp=4


def perturbed(model: nn.Module) -> dict[str, torch.Tensor]:
    """A state dict unlike the freshly initialised one, so a round trip proves a load happened."""
    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
            for k, v in model.state_dict().items()}


# -- single process -----------------------------------------------------------------
def test_round_trip_model_and_optimizer_bit_identical(tmp_path: Path) -> None:
    model = sf.build(sf.checkpoint(sf.create_schedule(tiny_llama()), "model.layers.*"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, token_ids(), 2)
    sf.save(model, opt, tmp_path, step=2)
    other = sf.build(sf.create_schedule(tiny_llama()))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    assert sf.load(other, other_opt, tmp_path) == 2
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
    state_a, state_b = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert all(torch.equal(state_a[i]["exp_avg"], state_b[i]["exp_avg"]) for i in state_a)


def test_resume_continues_with_the_same_losses(tmp_path: Path) -> None:
    ids = token_ids(batch=4)
    model = sf.build(sf.create_schedule(tiny_llama()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    uninterrupted = train(model, opt, ids, 4)
    first = sf.build(sf.create_schedule(tiny_llama()))
    first_opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    assert train(first, first_opt, ids, 2) == uninterrupted[:2]
    sf.save(first, first_opt, tmp_path, step=2)
    resumed = sf.build(sf.create_schedule(tiny_llama()))
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    assert sf.load(resumed, resumed_opt, tmp_path) == 2
    assert train(resumed, resumed_opt, ids, 2) == uninterrupted[2:]


def test_an_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(4, 4)
    sf.save(model, None, tmp_path, step=1)
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    real_save = torch.distributed.checkpoint.save

    def crash(state: Any, checkpoint_id: str) -> None:
        real_save(state, checkpoint_id=checkpoint_id)  # the files are written …
        raise KeyboardInterrupt  # … but the process dies before the save completes

    monkeypatch.setattr(torch.distributed.checkpoint, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        sf.save(model, None, tmp_path, step=2)
    monkeypatch.undo()
    fresh = nn.Linear(4, 4)
    assert sf.load(fresh, None, tmp_path) == 1
    assert torch.equal(fresh.weight, saved)
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000001"


def test_keep_prunes_old_checkpoints(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    for step in range(1, 5):
        sf.save(model, None, tmp_path, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-00000003", "step-00000004"]


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(sf.ScheduleError, match=r"(?s)no checkpoint here.*fix: pass the directory given to sf.save"):
        sf.load(nn.Linear(2, 2), None, tmp_path)
    with pytest.raises(sf.ScheduleError, match="expected a built model"):
        sf.save("model", None, tmp_path)


# -- across layouts (gloo) ------------------------------------------------------------
def _save_2d(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    model = llama()
    model.load_state_dict(perturbed(model))
    sch = megatron_llama(sf.create_schedule(model, mesh=mesh((2, 2), ("dp", "tp"))))
    built = sf.build(sf.data_parallel(sch, mesh_axis="dp"))
    opt = torch.optim.AdamW(built.parameters(), lr=1e-2)
    ids = token_ids(batch=4).chunk(2)[rank // 2]
    train(built, opt, ids, 1)
    sf.save(built, opt, path, step=1)
    return sf.full_state_dict(built)


def _load_tp4(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    built = sf.build(megatron_llama(sf.create_schedule(llama(), mesh=mesh((4,), ("tp",)))))
    opt = torch.optim.AdamW(built.parameters(), lr=1e-2)
    assert sf.load(built, opt, path) == 1
    sf.save(built, opt, path, step=2)  # and write it again, from tp4
    return sf.full_state_dict(built)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_dp2_tp2_to_tp4_to_single_process_to_hf(dist4: Any, tmp_path: Path) -> None:
    saved = dist4.run(_save_2d, str(tmp_path), timeout=200)
    assert all(set(s) == set(saved[0]) for s in saved)
    reference = saved[0]
    for full in dist4.run(_load_tp4, str(tmp_path), timeout=200):
        assert set(full) == set(reference)
        assert all(torch.equal(full[k], reference[k]) for k in reference)
    single = sf.build(sf.create_schedule(llama()))
    assert sf.load(single, torch.optim.AdamW(single.parameters()), tmp_path) == 2
    assert all(torch.equal(single.state_dict()[k], v) for k, v in reference.items())
    hf = llama()
    hf.load_state_dict(reference)  # the export loads into the plain Hugging Face model
    ids = token_ids()
    torch.testing.assert_close(hf(ids).logits, single(ids).logits, rtol=0, atol=0)


def test_a_load_failing_half_way_leaves_the_model_and_optimizer_as_they_were(tmp_path, monkeypatch) -> None:
    """DCP reads item by item into the tensors it is given; a read that fails after some
    items (a corrupted file past its first tensor) must not leave them half-loaded."""
    from torch.distributed import checkpoint as dcp

    model = nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    sf.save(model, opt, tmp_path, step=1)
    with torch.no_grad():
        model.weight.add_(1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state[model.weight].items()}
    real_load = dcp.load

    def fails_after_the_first_tensor(state: dict, **kwargs: object) -> None:
        real_load(state, **kwargs)  # every tensor given is now filled ...
        raise RuntimeError("unpickling stack underflow")  # ... and the next item fails

    monkeypatch.setattr(dcp, "load", fails_after_the_first_tensor)
    with pytest.raises(sf.ScheduleError, match="cannot be read: RuntimeError: unpickling stack underflow"):
        sf.load(model, opt, tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(torch.equal(opt.state[model.weight][k], v) for k, v in moments.items())


def test_a_checkpoint_corrupted_inside_is_one_short_error_or_falls_back(tmp_path) -> None:
    import os
    import warnings

    model = nn.Linear(16, 16)
    sf.save(model, None, tmp_path, step=1)
    older = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    newest = sf.save(model, None, tmp_path, step=2)
    data = next(f for f in newest.iterdir() if f.suffix == ".distcp")
    data.write_bytes(os.urandom(data.stat().st_size))  # same size, garbage inside: DCP's own read fails
    other = nn.Linear(16, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sf.load(other, None, tmp_path) == 1  # the newest that verifies
    said = [str(w.message) for w in caught if issubclass(w.category, CheckpointFallback)]
    assert len(said) == 1 and f"{data}: does not match its digest in manifest.json" in said[0], said
    assert torch.equal(other.weight, older["weight"])
    with pytest.raises(sf.ScheduleError, match=r"\.distcp': does not match its digest") as info:
        sf.load(nn.Linear(16, 16), None, tmp_path, fallback=False)
    assert len(str(info.value).splitlines()) <= 3
    with pytest.raises(sf.ScheduleError, match=r"step-00000002': cannot be read: CheckpointException") as info:
        sf.load(nn.Linear(16, 16), None, tmp_path, fallback=False, verify=False)  # DCP's own read fails
    assert len(str(info.value).splitlines()) <= 3


def test_a_save_without_a_step_does_not_overwrite_one(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    assert sf.save(model, None, tmp_path).name == "step-00000000"
    with pytest.raises(sf.ScheduleError, match=r"step-00000000': is there already, and a save without step= would "
                                               r"overwrite it\n      fix: pass the training step"):
        sf.save(model, None, tmp_path)
    assert sf.save(model, None, tmp_path, step=0).name == "step-00000000"  # asked for: replaced
