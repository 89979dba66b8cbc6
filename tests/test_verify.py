"""verify / verified: parity of outputs and every gradient; the first diverging module is named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slapo_fn as sf
from tests.models import Net, tiny_bert, tiny_llama, token_ids


def test_verify_passes_and_reports_every_gradient() -> None:
    model = Net(depth=2)
    report = sf.verify(sf.checkpoint(sf.create_schedule(model), "blocks.*"), torch.randint(0, 16, (2, 4)))
    names = {n for n, _ in model.named_parameters()}
    assert set(report.gradients) == names and report.max_grad_diff == 0.0
    assert str(report).startswith("verified 1 outputs (max |diff| 0) and")
    assert all(p.grad is None for p in model.parameters())  # verify leaves the original alone


def test_verify_names_the_first_diverging_module() -> None:
    sch = sf.replace(sf.create_schedule(Net(depth=3)), "blocks.1.mlp.act", nn.ReLU())
    with pytest.raises(sf.VerificationError, match=r"first diverging module: 'blocks.1.mlp.act'") as info:
        sf.verify(sch, torch.randint(0, 16, (2, 4)))
    assert info.value.module == "blocks.1.mlp.act" and info.value.max_abs_diff > 0
    assert isinstance(info.value, AssertionError)


def test_verify_hf_divergence_inside_a_decoder_layer() -> None:
    llama = tiny_llama()
    sch = sf.hook(sf.create_schedule(llama), "model.layers.1.mlp.down_proj", "fwd_post", lambda m, a, o: o * 1.01)
    with pytest.raises(sf.VerificationError, match="first diverging module: 'model.layers.1.mlp.down_proj'"):
        sf.verify(sch, token_ids())


def test_verify_catches_gradient_only_differences() -> None:
    def scale_grad(module: nn.Module, grad_output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(g * 2 for g in grad_output)

    sch = sf.hook(sf.create_schedule(Net(depth=2)), "blocks.1.mlp.fc2", "bwd_pre", scale_grad)
    with pytest.raises(sf.VerificationError, match=r"gradients of \d+ parameter\(s\) differ.*outputs match") as info:
        sf.verify(sch, torch.randint(0, 16, (2, 4)))
    assert "blocks.1.mlp.fc2.weight" in info.value.parameters and info.value.module is None
    sf.verify(sch, torch.randint(0, 16, (2, 4)), backward=False)


def test_verify_against_an_explicit_reference_and_with_kwargs() -> None:
    bert = tiny_bert()
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    sch = sf.checkpoint(sf.create_schedule(bert), "encoder.layer.*")
    report = sf.verify(sch, ids, kwargs={"attention_mask": mask}, train=True, rtol=0, atol=0)
    assert "output.last_hidden_state" in report.outputs
    other = tiny_bert()
    with torch.no_grad():
        other.pooler.dense.weight.mul_(2.0)
    with pytest.raises(sf.VerificationError, match="first diverging module: 'pooler.dense'"):
        sf.verify(sch, ids, reference=other)


def test_verify_meta_models_materialises_both_sides() -> None:
    with torch.device("meta"):
        model = Net(depth=2)
    report = sf.verify(sf.checkpoint(sf.create_schedule(model), "blocks.0"), torch.randint(0, 16, (2, 4)))
    assert report.max_grad_diff == 0.0


def test_verify_output_structure_mismatch() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    sch = sf.replace(sf.create_schedule(nn.Sequential(nn.Identity())), "", lambda old, path: Pair())
    with pytest.raises(sf.VerificationError, match="outputs differ in structure"):
        sf.verify(sch, torch.randn(2))


def test_verified_checks_a_rewrite_as_it_is_applied() -> None:
    ids = torch.randint(0, 16, (2, 4))
    sch = sf.create_schedule(Net(depth=2))
    good = sf.verified(sf.checkpoint.at("blocks.0"), ids)
    assert "blocks.0" in good(sch).annotations
    assert repr(good) == "verified(checkpoint.at('blocks.0'))"
    bad = sf.verified(sf.replace.at("blocks.0.mlp.act", nn.ReLU()), ids)
    with pytest.raises(sf.VerificationError, match="blocks.0.mlp.act"):
        sf.foreach("", bad)(sch)
    assert sch.history == () and type(sch.module.blocks[0].mlp.act) is nn.GELU
    with pytest.raises(sf.ScheduleTypeError, match="expected a Rewrite"):
        sf.verified(sf.checkpoint, ids)  # type: ignore[arg-type]
