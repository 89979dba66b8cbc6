"""dtensor/flow.py: the data flow among a parent's children, traced by need."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from models import tiny_llama
from torch import nn

from slapo_fn.dtensor.flow import INPUT, OUTPUT, flow, pointwise


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)) + x)


class Heads(nn.Module):
    """Views by the input's shape: a shape is not data."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.size()
        return self.o(self.q(x).view(b, s, 2, 2).reshape(b, s, 4))


class Reads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.proj.weight, self.proj.bias)


class CastsLikeT5(nn.Module):
    """Reads a child's weight only for its dtype (T5's DenseReluDense): not a read."""

    def __init__(self) -> None:
        super().__init__()
        self.wo = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(x.to(self.wo.weight.dtype))


class Branchy(nn.Module):
    """Control flow on a tensor's values: fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else x


def test_feeders_and_consumers_look_through_pointwise_children() -> None:
    fl = flow(Residual())
    assert fl is not None
    assert fl.feeders("b") == {"act", INPUT}
    through = {"act"}.__contains__
    assert fl.feeders("b", through) == {"a", INPUT}
    assert fl.consumers("a", through) == {"b"}
    assert fl.consumers("b") == {OUTPUT}
    assert fl.reaching_output() == {"b"}


def test_shapes_read_for_a_view_are_not_data_and_same_input_is_one_value() -> None:
    fl = flow(Heads())
    assert fl is not None and fl.feeders("o") == {"q"}
    llama_layer = tiny_llama(1).model.layers[0]
    mlp = flow(llama_layer.mlp)
    assert mlp is not None and mlp.same_input("gate_proj", "up_proj") and not mlp.same_input("gate_proj", "down_proj")
    layer = flow(llama_layer)  # a decoder layer taking **kwargs traces through the wrapper
    assert layer is not None and layer.feeders("self_attn") == {"input_layernorm"}


def test_functional_reads_are_recorded_and_untraceable_parents_have_no_flow() -> None:
    fl = flow(Reads())
    assert fl is not None and fl.reads == {"proj"} and not fl.called("proj")
    cast = flow(CastsLikeT5())
    assert cast is not None and cast.reads == set() and cast.feeders("wo") == {INPUT}
    assert flow(Branchy()) is None
    assert flow(tiny_llama(1).model.layers[0].self_attn) is None  # unpacks *input_shape: module order then


def test_tracing_leaves_the_module_as_it_was_and_a_changed_attribute_traces_again() -> None:
    class Flag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.skip = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen = True  # set on the traced copy, not on this module
            return x if self.skip else self.b(self.a(x))

    m = Flag()
    fl = flow(m)
    assert fl is not None and fl.feeders("b") == {"a"} and not hasattr(m, "seen")
    m.skip = True
    again = flow(m)
    assert again is not None and not again.called("b")


def test_pointwise_modules() -> None:
    assert pointwise(nn.GELU()) and pointwise(nn.Dropout(0.1)) and pointwise(nn.Identity())
    assert not pointwise(nn.Softmax(-1)) and not pointwise(nn.LayerNorm(4)) and not pointwise(nn.GLU())
