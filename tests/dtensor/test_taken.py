"""dtensor/taken.py and lookups.read_positions: which positions of a child's tuple output
the code above it reads."""

from __future__ import annotations

import torch
from models import tiny_bart, tiny_bert
from torch import nn

import slapo_fn as sf
from slapo_fn.dtensor.flow import flow
from slapo_fn.dtensor.lookups import read_positions
from slapo_fn.dtensor.testing import fake_mesh


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x * 2


class Reads(nn.Module):
    """Reads the first of ``a``'s pair, hands its second on, reads ``b`` whole and ``c`` by a slice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Pair(), Pair(), Pair()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h, w = self.a(x)
        both = torch.stack(self.b(h)).sum(0)
        rest = self.c(h)[1:]
        return both + rest[0], w


class Drops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Reads()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.inner(x)
        return out


def test_positions_read_handed_on_and_read_otherwise() -> None:
    fl = flow(Reads())
    assert fl is not None
    assert dict(fl.taken["a"]) == {0: None, 1: 1}
    assert "b" not in fl.taken  # read whole: every position counts as read
    assert "c" not in fl.taken  # a slice


def test_a_position_handed_on_is_read_where_the_caller_reads_it() -> None:
    handed = sf.create_schedule(Drops(), mesh=fake_mesh(2))
    assert read_positions(handed, "inner.a") == frozenset({0})  # its second reaches only a dropped position
    assert read_positions(handed, "inner") == frozenset({0})
    # the model's own result is the user's: everything it returns is read
    assert read_positions(sf.create_schedule(Reads(), mesh=fake_mesh(2)), "a") == frozenset({0, 1})


def test_hugging_face_attention_weights_are_dropped_by_their_layers() -> None:
    bert = sf.create_schedule(tiny_bert(), mesh=fake_mesh(2))
    # BertAttention hands its self-attention's weights on; BertLayer drops them
    assert read_positions(bert, "encoder.layer.0.attention.self") == frozenset({0})
    bart = sf.create_schedule(tiny_bart(), mesh=fake_mesh(2))
    assert read_positions(bart, "encoder.layers.1.self_attn") == frozenset({0})
    assert read_positions(bart, "decoder.layers.0.encoder_attn") == frozenset({0})
