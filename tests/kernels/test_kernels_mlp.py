"""FusedMLP and RMSNorm kernels: parity with the Hugging Face / plain modules they replace,
parameters kept, every error; the compiled variants (slow: inductor) too."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import slapo_fn as sf
from slapo_fn.kernels import CompiledRMSNorm, FusedMLP, KernelError, RMSNorm, fused_mlp
from tests.models import MLP, tiny_gpt2, tiny_llama, token_ids


def _gpt2_dropout(p: float) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=4, n_positions=16, resid_pdrop=p, bos_token_id=0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


# -- FusedMLP ------------------------------------------------------------------------------
def test_gpt2_mlp_outputs_and_gradients() -> None:
    model = tiny_gpt2()
    sch = sf.replace(sf.create_schedule(model), "transformer.h.*.mlp", FusedMLP.from_hf)
    assert all(isinstance(sch.module.get_submodule(f"transformer.h.{i}.mlp"), FusedMLP) for i in range(2))
    report = sf.verify(sch, token_ids(), rtol=1e-5, atol=1e-5)
    assert len(report.gradients) == len(list(model.parameters()))


def test_gpt2_mlp_dropout_in_training_uses_the_same_random_stream() -> None:
    sch = sf.replace(sf.create_schedule(_gpt2_dropout(0.5)), "transformer.h.*.mlp", FusedMLP.from_hf)
    sf.verify(sch, token_ids(), train=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: MLP(8, 16),  # fc1 / act=nn.GELU() / fc2
        lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 8)),
        lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8, bias=False), nn.Dropout(0.0)),
    ],
    ids=["fc1-act-fc2", "sequential-tanh", "sequential-no-bias-dropout"],
)
def test_plain_linear_gelu_linear(make: object) -> None:
    torch.manual_seed(0)
    model = make()  # type: ignore[operator]
    sch = sf.replace(sf.create_schedule(model), "", FusedMLP.from_hf)
    assert isinstance(sch.module, FusedMLP)
    assert list(sch.module.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(sch.module.parameters(), model.parameters(), strict=True))
    sf.verify(sch, torch.randn(3, 5, 8))


def test_fused_mlp_function_for_conv1d_layout() -> None:
    g = torch.Generator().manual_seed(0)
    x, w1, b1 = torch.randn(4, 6, generator=g), torch.randn(6, 12, generator=g), torch.randn(12, generator=g)
    w2, b2 = torch.randn(12, 6, generator=g), torch.randn(6, generator=g)
    want = (torch.nn.functional.gelu(x @ w1 + b1, approximate="tanh") @ w2) + b2
    torch.testing.assert_close(fused_mlp(x, w1, b1, w2, b2, transposed=True), want)
    torch.testing.assert_close(fused_mlp(x, w1, None, w2, None, transposed=True),
                               torch.nn.functional.gelu(x @ w1, approximate="tanh") @ w2)


def test_fused_mlp_errors() -> None:
    relu_mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(KernelError, match=r"h\.0\.mlp: its activation ReLU is not a GeLU"):
        FusedMLP.from_hf(relu_mlp, "h.0.mlp")
    with pytest.raises(KernelError, match="is not a recognised GeLU MLP"):
        FusedMLP.from_hf(nn.Linear(2, 2), "lm_head")
    llama = tiny_llama()
    with pytest.raises(KernelError, match="LlamaMLP is not a recognised GeLU MLP"):
        sf.replace(sf.create_schedule(llama), "model.layers.*.mlp", FusedMLP.from_hf)
    with pytest.raises(KernelError, match="both be nn.Linear or both Conv1D"):
        FusedMLP(("fc1", nn.Linear(2, 2)), ("fc2", nn.Conv1d(2, 2, 1)))
    with pytest.raises(KernelError, match="approximate must be"):
        FusedMLP(("fc1", nn.Linear(2, 2)), ("fc2", nn.Linear(2, 2)), approximate="erf")  # type: ignore[arg-type]


class _Scaled(nn.Linear):
    """A Linear subclass with a forward of its own: the kernel would compute without it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class _Renamed(nn.Linear):
    """A Linear subclass that keeps Linear's forward (as torch's NonDynamicallyQuantizableLinear)."""


def test_fused_mlp_takes_layers_by_their_forward_not_their_class_name() -> None:
    with pytest.raises(KernelError, match="both be nn.Linear or both Conv1D"):
        FusedMLP(("fc1", _Scaled(4, 8)), ("fc2", nn.Linear(8, 4)))
    torch.manual_seed(0)
    fc1, fc2 = _Renamed(4, 8), _Renamed(8, 4)
    x = torch.randn(2, 3, 4)
    fused = FusedMLP(("fc1", fc1), ("fc2", fc2), approximate="none")
    torch.testing.assert_close(fused(x), fc2(torch.nn.functional.gelu(fc1(x))))


# -- RMSNorm -------------------------------------------------------------------------------
def test_rmsnorm_on_llama_keeps_weights_and_matches() -> None:
    model = tiny_llama()
    sch = sf.replace(sf.create_schedule(model), "model.layers.*.{input,post_attention}_layernorm", RMSNorm.from_hf)
    sch = sf.replace(sch, "model.norm", RMSNorm.from_hf)
    assert sch.module.get_submodule("model.norm").weight is model.get_submodule("model.norm").weight
    sf.verify(sch, token_ids(), rtol=1e-5, atol=1e-5)


def test_rmsnorm_half_precision_casts_like_hf() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(16).to(torch.bfloat16)
    nn.init.normal_(hf.weight)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    out = RMSNorm.from_hf(hf)(x)
    assert out.dtype == hf(x).dtype
    torch.testing.assert_close(out, hf(x))


def test_rmsnorm_errors() -> None:
    with pytest.raises(KernelError, match=r"model\.embed: not an RMSNorm with a weight and an eps.* \(got Embedding\)"):
        CompiledRMSNorm.from_hf(nn.Embedding(3, 4), "model.embed")


@pytest.mark.slow
def test_compiled_rmsnorm_and_mlp_match() -> None:
    """The ``torch.compile`` variants (inductor; the first call compiles)."""
    model = tiny_llama()
    sch = sf.replace(sf.create_schedule(model), "model.layers.*.{input,post_attention}_layernorm",
                     CompiledRMSNorm.from_hf)
    assert sch.module.get_submodule("model.layers.0.input_layernorm").compiled
    sf.verify(sch, token_ids(), rtol=1e-5, atol=1e-5)
    gpt2 = tiny_gpt2()
    sch = sf.replace(sf.create_schedule(gpt2), "transformer.h.*.mlp", functools.partial(FusedMLP.from_hf, compile=True))
    assert sch.module.get_submodule("transformer.h.0.mlp").compiled
    sf.verify(sch, token_ids(), rtol=1e-5, atol=1e-5)
