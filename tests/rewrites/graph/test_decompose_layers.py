"""``decompose`` by rule: every called linear layer (``nn.Linear``, a subclass, Hugging
Face's ``Conv1D`` and a subclass of it) stays called for its own forward with its bias left
out (``SeparateBias`` mixed into its class), and its parent adds the bias; a subclass's own
forward (a LoRA's low-rank term) is kept, not replaced by a bare ``F.linear``."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo_fn as sf
from slapo_fn.hf import is_conv1d
from slapo_fn.rewrites.graph.decompose import SeparateBias, SeparateBiasLinear, separate_bias
from tests.models import LoRA


def _conv1d_kinds() -> tuple[type[nn.Module], type[nn.Module]]:
    from transformers.pytorch_utils import Conv1D

    class Plain(Conv1D):  # type: ignore[misc]
        """Conv1D's own forward: a Conv1D."""

    class Scaled(Conv1D):  # type: ignore[misc]
        """A forward of its own: not taken for a Conv1D."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2  # type: ignore[no-any-return]

    return Plain, Scaled


class Block(nn.Module):
    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(F.gelu(self.first(x)))  # type: ignore[no-any-return]


def test_a_conv1d_subclass_is_a_conv1d_where_it_keeps_the_product() -> None:
    plain, scaled = _conv1d_kinds()
    assert is_conv1d(plain(4, 4)) and not is_conv1d(scaled(4, 4))
    assert is_conv1d(SeparateBias.of(plain(4, 4)))  # its forward the product alone, declared so


@pytest.mark.parametrize("layers", ["lora", "conv1d subclass"])
def test_every_called_linear_layer_keeps_its_own_forward_with_the_bias_added_after(layers: str) -> None:
    torch.manual_seed(0)
    first, second = (LoRA(8, 8), nn.Linear(8, 8)) if layers == "lora" else (_conv1d_kinds()[0](8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        first.bias.uniform_(-1, 1)
    model = Block(first, second)
    sch = sf.decompose(sf.trace(sf.create_schedule(model), ""), "")
    calls = [n.target for n in sch.module.graph.nodes if n.op in ("call_function", "call_module")]
    assert calls[:2] == ["first", operator.add] and calls.count(operator.add) == 2
    got = sch["first"].module
    assert isinstance(got, SeparateBias) and isinstance(got, type(first)) and got.bias is first.bias
    assert type(sch["second"].module) is SeparateBiasLinear is separate_bias(nn.Linear)
    x = torch.randn(3, 8)
    torch.testing.assert_close(got(x) + got.bias, first(x))
    report = sf.verify(sch, x)  # the LoRA's A and B in the numbers and gradients too
    assert report.max_output_diff < 1e-6 and len(report.gradients) == len(list(model.parameters()))
    with pytest.raises(sf.ScheduleError, match="decomposed already"):
        sf.decompose(sch, "first")  # its bias would be added twice
