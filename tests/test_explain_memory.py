"""explain's activation memory against measured runs on CPU: the predicted peak of
activations per rank is within 15% of the peak the PyTorch profiler's memory timeline
measures (``slapo_fn.memory.profiled_peak_bytes``) over one forward + backward of the
built model, gradients already allocated by a first step (so the measured peak holds
activations, their gradients and temporaries, not parameter gradients); the least of
ten measured steps, since with gloo the order of frees around collectives varies from
run to run: explain predicts the undisturbed peak."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import megatron_llama
from torch import nn

import slapo_fn as sf
from slapo_fn.kernels import FULL_LOGITS_LOSS
from slapo_fn.memory import profiled_peak_bytes

VOCAB = 128
Rewrite = Callable[[Any], Any]


def llama(layers: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        use_cache=False))


def gpt2(layers: int = 4) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=layers, n_head=4, n_positions=128,
                                      use_cache=False, bos_token_id=0, eos_token_id=0))


def ids(batch: int = 2, seq: int = 64) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


def checkpointed(ratio: float | None, layers: str) -> Rewrite:
    """Checkpoint the first ``ratio`` of the layers under ``layers`` (a ModuleList path)."""
    def rewrite(sch: Any) -> Any:
        if ratio is None:
            return sch
        count = len(sch[layers].module)
        k = round(count * ratio)
        return sf.checkpoint(sch, f"{layers}.[0-{k - 1}]") if k else sch
    return rewrite


def predicted_and_measured(model: nn.Module, sch: Any, x: torch.Tensor) -> tuple[int, int]:
    """(explain's activation peak of this rank, the profiler's measured peak)."""
    memory = sf.explain(sch, x, kwargs={"labels": x}).memory
    assert memory is not None and memory.rows[0].activation_bytes is not None
    built = sf.build(sch)
    built.train()
    torch.manual_seed(0)
    built(x, labels=x).loss.backward()  # gradients exist: the measured step accumulates into them

    def step() -> None:
        torch.manual_seed(0)
        built(x, labels=x).loss.backward()

    # the least of thirty: with gloo the order of frees around collectives varies from step
    # to step (under SP with full checkpointing one rank's ten steps ranged over 1.09-1.63 MB,
    # and about one run in five had all ten above 1.21 MB, outside the bound)
    return memory.rows[0].activation_bytes, min(profiled_peak_bytes(step) for _ in range(30))


FAMILIES = {"llama": (llama, "model.layers"), "gpt2": (gpt2, "transformer.h")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("ratio", [None, 0.5, 1.0])
def test_activation_peak_within_15_percent_on_one_process(family: str, ratio: float | None) -> None:
    make, layers = FAMILIES[family]
    model = make()
    sch = checkpointed(ratio, layers)(sf.create_schedule(model))
    predicted, measured = predicted_and_measured(model, sch, ids())
    assert abs(predicted - measured) <= 0.15 * measured, (family, ratio, predicted, measured)


def test_checkpointing_lowers_the_prediction_and_the_table_says_what_total_holds() -> None:
    model = llama()
    x = ids()
    peaks = []
    for ratio in (None, 0.5, 1.0):
        e = sf.explain(checkpointed(ratio, "model.layers")(sf.create_schedule(model)), x, kwargs={"labels": x})
        assert e.memory is not None
        row = e.memory.rows[0]
        assert row.activation_bytes is not None
        assert row.total_bytes == row.param_bytes + row.grad_bytes + row.optimizer_bytes + row.activation_bytes
        peaks.append(row.activation_bytes)
    assert peaks[0] > peaks[1] > peaks[2]
    text = str(e.memory)
    assert "activations" in text and "total = params" in text and "one recomputed at a time" in text
    data = e.as_dict()["memory"]
    assert data["rows"][0]["activation_bytes"] == peaks[2]


@pytest.mark.timeout(120)
def test_a_selective_checkpoint_is_never_predicted_below_its_measured_peak() -> None:
    """A selective policy keeps what it saves (here every matmul output), which the fake
    run does not tell apart: explain counts such modules as not checkpointed, so its
    prediction is an upper bound of the measured peak, never below it, and says so."""
    model = llama()
    x = ids()
    sch = sf.checkpoint(sf.create_schedule(model), "model.layers.*", policy=[torch.ops.aten.mm])
    predicted, measured = predicted_and_measured(model, sch, x)
    plain = sf.explain(sf.create_schedule(model), x, kwargs={"labels": x}).memory
    assert plain is not None and predicted == plain.rows[0].activation_bytes
    assert predicted >= measured, (predicted, measured)
    memory = sf.explain(sch, x, kwargs={"labels": x}).memory
    assert memory is not None and "4 selectively checkpointed modules counted as not checkpointed" in str(memory)


# ----------------------------------------------------------------------------- two gloo ranks


def _tp_cases(rank: int, world: int) -> dict[str, tuple[int, int]]:
    from dist import mesh

    from slapo_fn.recipes import Knobs, for_model

    out = {}
    x = ids()
    for name, sp in (("tp2", False), ("tp2+sp", True)):
        for ratio in (None, 1.0):
            model = llama()
            sch = megatron_llama(sf.create_schedule(model, mesh=mesh((2,), ("tp",))), "model.layers.*")
            if sp:
                sch = sf.sequence_parallel(sch, ["model.layers.*", "model.norm"])
            sch = checkpointed(ratio, "model.layers")(sch)
            out[f"{name} checkpoint={ratio}"] = predicted_and_measured(model, sch, x)
    for name, sp in (("gpt2 tp2", False), ("gpt2 tp2+sp", True)):  # by its recipe: packed [Q|K|V]
        for ratio in (None, 1.0):
            model = gpt2()
            knobs = Knobs(tp=2, sequence_parallel=sp, checkpoint=ratio)
            sch = for_model(model)(sf.create_schedule(model, mesh=mesh((2,), ("tp",))), knobs)
            out[f"{name} checkpoint={ratio}"] = predicted_and_measured(model, sch, x)
    return out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_activation_peak_within_15_percent_under_tp_and_sp(dist2: Any) -> None:
    for result in dist2.run(_tp_cases, timeout=220):
        for case, (predicted, measured) in result.items():
            assert abs(predicted - measured) <= 0.15 * measured, (case, predicted, measured)
        # sequence parallelism splits the residual stream: less than TP alone
        assert result["tp2+sp checkpoint=None"][0] < result["tp2 checkpoint=None"][0]


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _pp_cases(rank: int, world: int) -> dict[str, tuple[int, int]]:
    from dist import mesh

    out = {}
    x = ids(batch=8)
    for family in ("llama", "gpt2"):
        make, layers = FAMILIES[family]
        for schedule in ("1f1b", "gpipe"):
            model = make()
            sch = sf.cut_pipeline_stage(sf.create_schedule(model, mesh=mesh((2,), ("pp",))), f"{layers}.1")
            memory = sf.explain(sch, x, kwargs={"labels": x}, microbatches=4, pipeline_schedule=schedule).memory
            assert memory is not None
            predicted = memory.rows[rank].activation_bytes
            assert predicted is not None
            pipe = sf.build_pipeline(sch, microbatches=4, schedule=schedule, loss_fn=_ce)
            torch.manual_seed(0)
            pipe.step(x, target=x)  # gradients exist: the measured step accumulates into them

            def step(pipe: Any = pipe) -> None:
                torch.manual_seed(0)
                pipe.step(x, target=x)

            out[f"{family} {schedule} stage {rank}"] = (predicted, min(profiled_peak_bytes(step) for _ in range(3)))
    return out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_activation_peak_within_15_percent_per_pipeline_stage(dist2: Any) -> None:
    results = dist2.run(_pp_cases, timeout=220)
    for result in results:
        for case, (predicted, measured) in result.items():
            assert abs(predicted - measured) <= 0.15 * measured, (case, predicted, measured)
    # GPipe holds every microbatch on stage 0, 1F1B at most two
    assert results[0]["llama gpipe stage 0"][0] > results[0]["llama 1f1b stage 0"][0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_shortened_fake_run_records_what_the_full_one_does(family: str) -> None:
    from slapo_fn.dtensor.explain import activation_shapes

    model = FAMILIES[family][0](5)
    x = ids()
    short = activation_shapes(model, (x,), {"labels": x})
    full = activation_shapes(model, (x,), {"labels": x}, shorten=False)
    assert sorted(short.saved) == sorted(full.saved) and len(full.saved) > 5 * 8
    assert short.inputs == full.inputs and short.outputs == full.outputs
    assert set(short.order) == set(full.order) and short.no_grad_inputs == full.no_grad_inputs


def test_mixed_precision_halves_float_activations_but_not_the_loss_and_fsdp_shards_state() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from slapo_fn.dtensor.testing import fake_world

    model = llama()
    x = ids()
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        full = sf.explain(sf.data_parallel(sf.create_schedule(model, mesh=mesh)), x).memory
        half = sf.explain(sf.data_parallel(sf.create_schedule(model, mesh=mesh), param_dtype=torch.bfloat16), x).memory
    alone = sf.explain(sf.create_schedule(model), x).memory
    assert full is not None and half is not None and alone is not None
    acts = [m.rows[0].activation_bytes or 0 for m in (full, half, alone)]
    # the loss computes in float32 whatever the logits' dtype: its share is not halved
    loss = FULL_LOGITS_LOSS.nbytes(logits=x.numel() * VOCAB, head=0)
    assert acts[1] - loss == pytest.approx((acts[0] - loss) / 2, rel=0.01) and acts[0] == acts[2]
    assert full.rows[0].param_bytes < alone.rows[0].param_bytes
    assert "activations in torch.bfloat16" in str(half)
