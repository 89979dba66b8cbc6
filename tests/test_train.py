"""The training loop as a function (``slapo_fn.train``): every loop option against a
hand-written single-process reference, resume (bit for bit, and past a broken newest
checkpoint), loggers, and the distributed cases (FSDP2 gradient sync on the last
micro-step only, clipping across TP and FSDP meshes, FSDP2 mixed precision)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist import mesh
from models import megatron_llama, tiny_llama
from torch import nn

import slapo_fn as sf
from slapo_fn.data import Arithmetic
from slapo_fn.train import (
    Checkpointing,
    JsonlLog,
    LRSchedule,
    StepRecord,
    TensorBoardLog,
    TokenBatches,
    TrainError,
    adamw,
    causal_lm_loss,
    precision,
    resume,
    train,
)

VOCAB = 32


class ToyLM(nn.Module):
    """A causal LM small enough for many steps: embedding, norm, dropout, head."""

    def __init__(self, dim: int = 16, dropout: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.drop(self.norm(self.embed(ids))))


class Masked:
    """Arithmetic batches with an uneven share of ignored labels per row, so that a mean
    per micro-batch would differ from the mean over the batch's tokens."""

    def __init__(self) -> None:
        self.inner = TokenBatches(Arithmetic(VOCAB, seed=3), seq_len=12)

    def batch(self, step: int, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> dict[str, torch.Tensor]:
        b = self.inner.batch(step, batch_size, dp_rank=dp_rank, dp_size=dp_size)
        for row in range(b["labels"].shape[0]):
            b["labels"][row, 1 : 1 + (row * 3 + step) % 9] = -100
        return b


def data() -> TokenBatches:
    return TokenBatches(Arithmetic(VOCAB, seed=1), seq_len=12)


def reference(model: nn.Module, opt: torch.optim.Optimizer, batches: Any, steps: int, batch: int, *,
              lr_at: Callable[[int], float] | None = None, clip: float | None = None) -> list[float]:
    """The textbook loop: the whole batch at once, torch's own clipping."""
    losses = []
    for step in range(steps):
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        b = batches.batch(step, batch)
        logits = model(b["input_ids"])
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1), ignore_index=-100)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def hand_adamw(model: ToyLM, lr: float, wd: float) -> torch.optim.AdamW:
    decay = [model.embed.weight, model.head.weight]
    rest = [model.norm.weight, model.norm.bias, model.head.bias]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}], lr=lr,
                             betas=(0.9, 0.95), eps=1e-8)


def assert_same_weights(a: nn.Module, b: nn.Module, **tol: float) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, msg=name, **tol)


# -- the learning-rate schedule ---------------------------------------------------------------------
@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_lr_schedule_warms_up_then_decays_to_min_lr(decay: str) -> None:
    lr, low, warmup, total = 1e-3, 1e-4, 4, 14
    s = LRSchedule(lr, warmup=warmup, decay=decay, min_lr=low, total=total)  # type: ignore[arg-type]
    assert [s(i) for i in range(warmup)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    after = [s(i) for i in range(warmup, total)]
    frac = [i / 10 for i in range(10)]  # 10 steps of decay, the last one 9/10 of the way
    expected = {"constant": [lr] * 10, "linear": [lr - (lr - low) * f for f in frac],
                "cosine": [low + (lr - low) * (1 + math.cos(math.pi * f)) / 2 for f in frac]}[decay]
    assert after == pytest.approx(expected)
    assert s(10_000) == pytest.approx(lr if decay == "constant" else low)  # past the end: stays at the floor


def test_lr_schedule_refuses_bad_values_at_once() -> None:
    with pytest.raises(TrainError, match=r"(?s)4 problems.*'lr'.*'warmup'.*'decay'.*'min_lr'"):
        LRSchedule(0.0, warmup=-1, decay="step", min_lr=-1.0)  # type: ignore[arg-type]


# -- each loop option against the textbook loop ---------------------------------------------------------
def test_plain_loop_equals_the_reference() -> None:
    model, ref = ToyLM(), ToyLM()
    records = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data(), steps=5, batch_size=4)
    expected = reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data(), 5, 4)
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-6)
    assert [r.step for r in records] == [1, 2, 3, 4, 5]
    assert all(r.tokens == 4 * 12 for r in records)
    assert_same_weights(model, ref)


def test_lr_schedule_is_applied_each_step() -> None:
    schedule = LRSchedule(5e-2, warmup=2, decay="cosine", min_lr=1e-3, total=6)
    model, ref = ToyLM(), ToyLM()
    records = train(model, torch.optim.SGD(model.parameters(), lr=123.0), data(), steps=6, batch_size=4,
                    lr_schedule=schedule)
    reference(ref, torch.optim.SGD(ref.parameters(), lr=123.0), data(), 6, 4, lr_at=schedule)
    assert [r.lr for r in records] == pytest.approx([schedule(i) for i in range(6)])
    assert_same_weights(model, ref)


def test_weight_decay_applies_to_matrices_only() -> None:
    model, ref, none = ToyLM(), ToyLM(), ToyLM()
    train(model, adamw(model, lr=1e-2, weight_decay=0.5), data(), steps=4, batch_size=4)
    reference(ref, hand_adamw(ref, 1e-2, 0.5), data(), 4, 4)
    reference(none, hand_adamw(none, 1e-2, 0.0), data(), 4, 4)
    assert_same_weights(model, ref)
    assert not torch.allclose(model.head.weight, none.head.weight)  # the decay did something


def test_grad_clip_equals_torch_clipping_and_logs_the_norm_before() -> None:
    model, ref = ToyLM(), ToyLM()
    records = train(model, torch.optim.SGD(model.parameters(), lr=0.5), data(), steps=4, batch_size=4,
                    grad_clip=0.05)
    reference(ref, torch.optim.SGD(ref.parameters(), lr=0.5), data(), 4, 4, clip=0.05)
    assert all(r.grad_norm > 0.05 for r in records)  # clipping was active every step
    assert_same_weights(model, ref)


def test_grad_norm_is_logged_without_clipping() -> None:
    model = ToyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    [record] = train(model, opt, data(), steps=1, batch_size=4)
    b = data().batch(0, 4)
    fresh = ToyLM()
    causal_lm_loss(fresh(b["input_ids"]), b["labels"]).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in fresh.parameters()]))
    assert record.grad_norm == pytest.approx(norm.item(), rel=1e-5)


@pytest.mark.parametrize("accum", [2, 4])
def test_grad_accumulation_equals_the_full_batch(accum: int) -> None:
    model, ref = ToyLM(), ToyLM()
    records = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), Masked(), steps=4, batch_size=8,
                    grad_accum=accum)
    expected = reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), Masked(), 4, 8)
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-6)
    assert_same_weights(model, ref, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_is_close_to_fp32_with_fp32_weights_and_optimizer_state() -> None:
    seen: list[torch.dtype] = []
    model, ref = ToyLM(), ToyLM()
    model.head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    _, cast = precision(sf.create_schedule(model), "bf16")
    assert cast == torch.bfloat16  # no FSDP: autocast
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    records = train(model, opt, data(), steps=4, batch_size=4, autocast=cast)
    expected = reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data(), 4, 4)
    assert set(seen) == {torch.bfloat16}  # the matmuls ran in bf16
    assert [r.loss for r in records] == pytest.approx(expected, rel=2e-2)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values() if v.is_floating_point())


def test_eval_every_reports_the_eval_loss_of_the_model_at_that_step() -> None:
    held_out = [data().batch(100 + i, 4) for i in range(3)]

    class WithEval(TokenBatches):
        def eval_batches(self, *, batch_size: int, dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
            return held_out

    model = ToyLM(dropout=0.5)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def keep(step: int) -> None:
        snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}

    records = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), WithEval(Arithmetic(VOCAB, 1), 12),
                    steps=4, batch_size=4, eval_every=2, eval_batches=2, on_step=keep)
    assert [r.eval_loss is not None for r in records] == [False, True, False, True]
    assert model.training  # back in training mode
    for r in records[1::2]:
        probe = ToyLM(dropout=0.5).eval()
        probe.load_state_dict(snapshots[r.step])
        with torch.no_grad():
            total = sum(causal_lm_loss(probe(b["input_ids"]), b["labels"], reduction="sum") for b in held_out[:2])
        assert r.eval_loss == pytest.approx(float(total) / (2 * 4 * 11), rel=1e-6)


def test_bad_arguments_are_one_error_naming_each() -> None:
    model = ToyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TrainError, match=r"(?s)'batch_size'.*2 data-parallel|'batch_size': a global batch of 6"):
        train(model, opt, data(), steps=2, batch_size=6, grad_accum=4)
    with pytest.raises(TrainError, match=r"(?s)3 problems.*'steps'.*'grad_clip'.*'eval_every'.*no eval_batches"):
        train(model, opt, data(), steps=0, batch_size=4, grad_clip=0.0, eval_every=2, start_step=0)
    with pytest.raises(TrainError, match=r"'data': list has no batch"):
        train(model, opt, [], steps=1, batch_size=4)  # type: ignore[arg-type]


# -- loggers -------------------------------------------------------------------------------------------
def test_jsonl_and_tensorboard_loggers_write_every_record(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = ToyLM()
    jsonl, board = JsonlLog(tmp_path / "m.jsonl"), TensorBoardLog(tmp_path / "tb")
    records = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data(), steps=3, batch_size=4,
                    log=[jsonl, board], memory=True)
    jsonl.close()
    board.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["loss"] == records[0].loss
    assert all(r["peak_mem_bytes"] > 0 and "tokens_per_s" in r for r in rows)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/peak_mem_bytes"} <= tags
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r.loss for r in records])


def test_tensorboard_missing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(sf.ScheduleError, match=r"(?s)tensorboard package.*pip install 'slapo_fn\[tensorboard\]'"):
        TensorBoardLog(tmp_path / "tb")


# -- resume --------------------------------------------------------------------------------------------
def _run(steps: int, *, start: int = 0, directory: Path | None = None, every: int = 0,
         said: list[str] | None = None) -> list[StepRecord]:
    """A dropout model, so that the RNG state matters, from scratch or resumed."""
    torch.manual_seed(11)
    model = ToyLM(dropout=0.3)
    opt = adamw(model, lr=2e-2, weight_decay=0.1)
    schedule = LRSchedule(2e-2, warmup=2, decay="cosine", total=8)
    if start:
        assert directory is not None
        torch.rand(7)  # the resumed process draws other numbers before: resume restores the generator
        start = resume(model, opt, directory, say=said.append if said is not None else None)
    return train(model, opt, data(), steps=steps, batch_size=4, lr_schedule=schedule, start_step=start,
                 checkpoint=Checkpointing(directory, every=every) if directory is not None else None)


def test_a_resumed_run_has_the_uninterrupted_losses_bit_for_bit(tmp_path: Path) -> None:
    whole = _run(8)
    _run(4, directory=tmp_path, every=2)
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000004"
    assert (tmp_path / "step-00000004" / "train-state-0.pt").is_file()
    resumed = _run(8, start=1, directory=tmp_path)
    assert [r.step for r in resumed] == [5, 6, 7, 8]
    assert [r.loss for r in resumed] == [r.loss for r in whole[4:]]  # exactly
    assert [r.grad_norm for r in resumed] == [r.grad_norm for r in whole[4:]]


def _truncate(step: Path) -> None:
    data_file = next(step.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])


def _bad_metadata(step: Path) -> None:
    (step / ".metadata").write_bytes(b"not a pickle")


def _missing(step: Path) -> None:
    for f in step.iterdir():
        f.unlink()
    step.rmdir()


@pytest.mark.parametrize("damage", [_truncate, _bad_metadata, _missing], ids=["truncated", "bad-metadata", "missing"])
def test_resume_falls_back_past_a_broken_newest_checkpoint(tmp_path: Path, damage: Callable[[Path], None]) -> None:
    whole = _run(8)
    _run(4, directory=tmp_path, every=2)
    damage(tmp_path / "step-00000004")
    said: list[str] = []
    resumed = _run(8, start=1, directory=tmp_path, said=said)
    assert len(said) == 1, said
    assert "step-00000004" in said[0] and "loaded step-00000002" in said[0], said
    assert [r.step for r in resumed] == [3, 4, 5, 6, 7, 8]
    assert [r.loss for r in resumed] == [r.loss for r in whole[2:]]


def test_resume_from_another_models_checkpoint_is_one_clear_error(tmp_path: Path) -> None:
    small = ToyLM(dim=16)
    sf.save(small, adamw(small, lr=1e-2), tmp_path, step=2)
    big = ToyLM(dim=24)
    with pytest.raises(sf.ScheduleError, match=r"was written from another model: .*another shape \('embed.weight'"):
        resume(big, adamw(big, lr=1e-2), tmp_path)


def test_every_checkpoint_broken_is_the_newest_ones_error(tmp_path: Path) -> None:
    _run(4, directory=tmp_path, every=2)
    _truncate(tmp_path / "step-00000004")
    _truncate(tmp_path / "step-00000002")
    model = ToyLM(dropout=0.3)
    with pytest.raises(sf.ScheduleError, match=r"step-00000004/.*is truncated"):
        resume(model, adamw(model, lr=1e-2), tmp_path)


# -- several ranks (gloo) --------------------------------------------------------------------------------
def _count_reduce_scatters(monkey: list[int]) -> Callable[[], None]:
    import torch.distributed as dist

    real = dist.reduce_scatter_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        monkey[0] += 1
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counting  # type: ignore[assignment]

    def undo() -> None:
        dist.reduce_scatter_single = real  # type: ignore[assignment]

    return undo


def _dp2_tp2(rank: int, world: int, accum: int) -> tuple[list[float], list[float], int]:
    sch = megatron_llama(sf.create_schedule(tiny_llama(), mesh=mesh((2, 2), ("dp", "tp"))))
    model = sf.build(sf.data_parallel(sch))
    opt = adamw(model, lr=1e-2, weight_decay=0.1)
    count = [0]
    undo = _count_reduce_scatters(count)
    try:
        records = train(model, opt, TokenBatches(Arithmetic(128, seed=2), 16), steps=3, batch_size=8,
                        grad_accum=accum, grad_clip=0.3, lr_schedule=LRSchedule(1e-2, warmup=2, total=3))
    finally:
        undo()
    return [r.loss for r in records], [r.grad_norm for r in records], count[0]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_dp2_tp2_accumulation_and_clipping_equal_one_process(dist4: Any) -> None:
    ref = tiny_llama()
    expected = train(ref, adamw(ref, lr=1e-2, weight_decay=0.1), TokenBatches(Arithmetic(128, seed=2), 16), steps=3,
                     batch_size=8, grad_clip=0.3, lr_schedule=LRSchedule(1e-2, warmup=2, total=3))
    accumulated = dist4.run(_dp2_tp2, 2, timeout=240)
    whole = dist4.run(_dp2_tp2, 1, timeout=240)
    for losses, norms, _ in accumulated:
        assert losses == pytest.approx([r.loss for r in expected], rel=1e-5)
        assert norms == pytest.approx([r.grad_norm for r in expected], rel=1e-4)
        assert all(n > 0.3 for n in norms)  # clipped every step
    # FSDP2 reduce-scatters on the last micro-step only: as many as without accumulation
    assert [c for _, _, c in accumulated] == [c for _, _, c in whole]
    assert all(c > 0 for _, _, c in whole)


def _fsdp_bf16(rank: int, world: int) -> tuple[list[float], set[torch.dtype], set[torch.dtype], bool]:
    sch = sf.data_parallel(sf.create_schedule(tiny_llama(), mesh=mesh((2,), ("dp",))))
    sch, cast = precision(sch, "bf16")
    model = sf.build(sch)
    seen: set[torch.dtype] = set()
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    opt = adamw(model, lr=1e-2)
    records = train(model, opt, TokenBatches(Arithmetic(128, seed=2), 16), steps=3, batch_size=8, autocast=cast)
    masters = {p.to_local().dtype for p in model.parameters()}
    masters |= {v.to_local().dtype for s in opt.state.values() for k, v in s.items() if k != "step"}
    return [r.loss for r in records], seen, masters, cast is None


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_fsdp_bf16_mixed_precision_is_close_with_fp32_masters(dist2: Any) -> None:
    ref = tiny_llama()
    expected = train(ref, adamw(ref, lr=1e-2), TokenBatches(Arithmetic(128, seed=2), 16), steps=3, batch_size=8)
    for losses, seen, masters, fsdp_casts in dist2.run(_fsdp_bf16, timeout=240):
        assert fsdp_casts  # MixedPrecisionPolicy, no autocast on top
        assert seen == {torch.bfloat16}
        assert masters == {torch.float32}
        assert losses == pytest.approx([r.loss for r in expected], rel=2e-2)


def _pp2(rank: int, world: int, accum: int) -> tuple[list[float], list[float], list[float | None]]:
    sch = sf.cut_pipeline_stage(sf.create_schedule(tiny_llama(), mesh=mesh((2,), ("pp",))), "model.layers.0")
    pipe = sf.build_pipeline(sch, microbatches=2, schedule="1f1b", loss_fn=causal_lm_loss)
    opt = adamw(pipe, lr=1e-2, weight_decay=0.1)
    records = train(pipe, opt, _exact_rows(), steps=3, batch_size=8, grad_accum=accum, grad_clip=0.3,
                    lr_schedule=LRSchedule(1e-2, warmup=2, total=3), eval_every=3)
    return [r.loss for r in records], [r.grad_norm for r in records], [r.eval_loss for r in records]


def _exact_rows() -> Any:
    """Packed rows that are each one whole document (no padding): a pipeline's mean of
    microbatch means is then the token mean the single-process loop takes."""
    from slapo_fn.data import TokenData

    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, 128, (15,), generator=g).tolist() for _ in range(40)]
    return TokenData.from_token_ids(docs, eos_id=0, vocab=128, seq_len=16, seed=1, eval_fraction=0.2)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_pipeline_accumulation_clipping_and_eval_equal_one_process(dist2: Any) -> None:
    ref = tiny_llama()
    expected = train(ref, adamw(ref, lr=1e-2, weight_decay=0.1), _exact_rows(), steps=3, batch_size=8,
                     grad_clip=0.3, lr_schedule=LRSchedule(1e-2, warmup=2, total=3), eval_every=3)
    for accum in (1, 2):
        for losses, norms, evals in dist2.run(_pp2, accum, timeout=240):
            assert losses == pytest.approx([r.loss for r in expected], rel=1e-5), accum
            assert norms == pytest.approx([r.grad_norm for r in expected], rel=1e-4), accum
            assert all(n > 0.3 for n in norms)  # clipped every step: across both stages
            assert evals[-1] == pytest.approx(expected[-1].eval_loss, rel=1e-5), accum
