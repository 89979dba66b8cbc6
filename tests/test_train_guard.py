"""Runs that never lose or corrupt silently, in one process: the guard on non-finite steps,
saves that do not fit or fail part-way, and checkpoints whose every file is verified."""

from __future__ import annotations

import errno
import json
import math
import random
import warnings
from pathlib import Path

import pytest
import torch
from test_train import ToyLM, data
from torch import nn

import slapo_fn as sf
from slapo_fn.checkpoint_dir import MANIFEST, RANK_STATE, checkpoints, manifest_problems, partials
from slapo_fn.state import CheckpointFallback, CheckpointSpaceError, CheckpointWriteError
from slapo_fn.train import Checkpointing, JsonlLog, LRSchedule, NonFiniteError, adamw, resume, train


class NanFrom:
    """A learning rate that turns NaN from step ``bad`` (0-based) on, for ``count`` steps."""

    def __init__(self, bad: int, count: int = 10**9) -> None:
        self.bad, self.count = bad, count

    def __call__(self, step: int) -> float:
        return math.nan if self.bad <= step < self.bad + self.count else 1e-2


def _model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = ToyLM()
    return model, adamw(model, lr=1e-2)


def test_a_nan_learning_rate_stops_before_the_update_and_saves_nothing(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    metrics = JsonlLog(tmp_path / "m.jsonl")
    kept: dict[str, torch.Tensor] = {}

    def remember(step: int) -> None:
        kept.update({k: v.clone() for k, v in model.state_dict().items()})

    with pytest.raises(NonFiniteError, match=r"^step 4: loss [\d.]+, grad_norm [\d.]+, lr nan is not finite: "
                                             r"stopped before the optimizer update, nothing saved; the newest "
                                             r"checkpoint is step 2$") as info:
        train(model, opt, data(), steps=8, batch_size=4, lr_schedule=NanFrom(3), on_step=remember, log=[metrics],
              checkpoint=Checkpointing(tmp_path / "ckpt", every=2))
    metrics.close()
    assert info.value.step == 4
    assert all(torch.equal(v, kept[k]) for k, v in model.state_dict().items())  # no update at step 4
    assert [c.name for c in checkpoints(tmp_path / "ckpt")] == ["step-00000002"]
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]  # valid JSON throughout
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["lr"] is None and rows[-1]["skipped"] is True


def test_skip_drops_non_finite_steps_up_to_max_skipped() -> None:
    model, opt = _model_and_opt()
    said: list[str] = []
    records = train(model, opt, data(), steps=6, batch_size=4, lr_schedule=NanFrom(2, count=2), nonfinite="skip",
                    max_skipped=2, say=said.append)
    assert [r.skipped for r in records] == [False, False, True, True, False, False]
    third = records[2]
    assert said[0] == (f"step 3 skipped: loss {third.loss:.6g}, grad_norm {third.grad_norm:.6g}, lr nan is not "
                       "finite (1 of at most 2 skipped)") and len(said) == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    model, opt = _model_and_opt()
    with pytest.raises(NonFiniteError, match=r"^step 4: .* the 2th skipped step \(more than max_skipped=1\)"):
        train(model, opt, data(), steps=6, batch_size=4, lr_schedule=NanFrom(2), nonfinite="skip", max_skipped=1,
              say=said.append)


def test_a_save_without_room_prunes_first_then_skips_with_one_line(tmp_path: Path) -> None:
    free = {"bytes": 10**12}
    model, opt = _model_and_opt()
    said: list[str] = []
    plan = Checkpointing(tmp_path, every=1, keep=3, free_space=lambda _: free["bytes"])
    train(model, opt, data(), steps=3, batch_size=4, checkpoint=plan)
    size = sum(f.stat().st_size for f in (tmp_path / "step-00000003").iterdir())
    free["bytes"] = size - 1  # one checkpoint's room short: the oldest go first, the newest stays
    with pytest.raises(CheckpointSpaceError, match=r"step-00000003 stays the newest") as info:
        sf.save(model, opt, tmp_path, step=4, free_space=lambda _: free["bytes"])
    assert info.value.errno == errno.ENOSPC
    assert [c.name for c in checkpoints(tmp_path)] == ["step-00000003"] and not partials(tmp_path)
    model, opt = _model_and_opt()
    plan = Checkpointing(tmp_path, every=1, keep=3, free_space=lambda _: 0)
    with pytest.raises(CheckpointSpaceError):  # the last save of a run is not skipped: the run must not look saved
        train(model, opt, data(), steps=2, batch_size=4, checkpoint=plan, say=said.append)
    assert said == [f"step 1 not saved: 0.0 MiB free at {tmp_path}, the checkpoint needs about "
                    f"{size / 2**20:,.1f} MiB; step-00000003 stays the newest"]


def test_a_save_that_fails_part_way_removes_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model_and_opt()
    sf.save(model, opt, tmp_path, step=1)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".partial-step-00000002"))

    monkeypatch.setattr(torch, "save", full)  # the rank state is written last, after DCP's files
    with pytest.raises(CheckpointWriteError, match=r"saving step 2 to .* failed \(No space left on device: .*\); "
                                                   r"its partial folder is removed, LATEST is unchanged"):
        sf.save(model, opt, tmp_path, step=2, rank_state={"step": 2})
    assert not partials(tmp_path) and [c.name for c in checkpoints(tmp_path)] == ["step-00000001"]


def _flip(file: Path, rng: random.Random) -> str:
    raw = bytearray(file.read_bytes())
    at = rng.randrange(len(raw))
    raw[at] ^= 1 << rng.randrange(8)
    file.write_bytes(bytes(raw))
    return f"{file.name}@{at}"


def test_twenty_random_bit_flips_are_each_detected_and_resume_falls_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, opt = _model_and_opt()
    train(model, opt, data(), steps=4, batch_size=4, lr_schedule=LRSchedule(1e-2),
          checkpoint=Checkpointing(tmp_path / "ckpt", every=2))
    newest = tmp_path / "ckpt" / "step-00000004"
    files = sorted(f for f in newest.iterdir() if f.name != MANIFEST)
    assert {f.suffix for f in files} == {"", ".distcp", ".pt"} and (newest / RANK_STATE.format(rank=0)) in files
    pristine = {f: f.read_bytes() for f in files}
    rng = random.Random(38)
    for _ in range(20):
        target = rng.choice(files)
        where = _flip(target, rng)
        assert [p.path for p in manifest_problems(newest)] == [str(target)], where
        fresh, fresh_opt = _model_and_opt()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resume(fresh, fresh_opt, tmp_path / "ckpt") == 2, where
        said = [str(w.message) for w in caught if issubclass(w.category, CheckpointFallback)]
        assert len(said) == 1 and f"{target}: does not match its digest" in said[0], (where, said)
        target.write_bytes(pristine[target])
    assert manifest_problems(newest) == []
