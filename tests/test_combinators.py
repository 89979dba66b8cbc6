"""Rewrite values: .at, >>, chain, foreach, scope, when; printing, equality, history, replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slapo_fn as sf
from slapo_fn.rewrites.annotate import TAGS
from slapo_fn.rewrites.checkpoint import CHECKPOINT
from tests.models import Net


def test_at_is_the_same_call_as_a_value() -> None:
    sch = sf.create_schedule(Net())
    direct = sf.checkpoint(sch, "blocks.0", policy=[torch.ops.aten.mm])
    via = sf.checkpoint.at("blocks.0", policy=[torch.ops.aten.mm])(sch)
    assert direct.annotations == via.annotations
    assert sf.checkpoint.at("blocks.0") == sf.checkpoint.at("blocks.0")
    assert sf.checkpoint.at("blocks.0") != sf.checkpoint.at("blocks.1")


def test_rewrites_print_as_the_calls_they_stand_for() -> None:
    rw = sf.checkpoint.at("up") >> sf.annotate.at("down.weight", "tp", 1) >> sf.compile.at("act", dynamic=False)
    assert repr(rw) == "checkpoint.at('up') >> annotate.at('down.weight', 'tp', 1) >> compile.at('act', dynamic=False)"
    assert repr(sf.foreach("layers.*", sf.scope("mlp", sf.checkpoint.at("")))) == \
        "foreach('layers.*', scope('mlp', checkpoint.at('')))"
    assert repr(sf.chain()) == "chain()"
    assert repr(sf.foreach(sf.of_type(nn.Linear), sf.checkpoint.at(""))) == \
        "foreach(of_type(Linear), checkpoint.at(''))"


def test_foreach_paths_are_relative_and_history_is_absolute() -> None:
    sch = sf.foreach("blocks.*", sf.checkpoint.at("mlp") >> sf.annotate.at("norm.weight", "decay", False))(
        sf.create_schedule(Net(depth=2)))
    assert [repr(h) for h in sch.history] == [
        "checkpoint.at('blocks.0.mlp')", "annotate.at('blocks.0.norm.weight', 'decay', False)",
        "checkpoint.at('blocks.1.mlp')", "annotate.at('blocks.1.norm.weight', 'decay', False)"]
    assert set(sch.annotations.of_kind(CHECKPOINT)) == {"blocks.0.mlp", "blocks.1.mlp"}


def test_history_replays_to_the_same_schedule() -> None:
    model = Net(depth=3)
    sch = sf.foreach("blocks.[0-1]", sf.checkpoint.at("mlp"))(sf.create_schedule(model))
    sch = sf.replace(sch, "blocks.2.mlp.act", lambda old, path: nn.Tanh())
    replayed = sf.chain(*sch.history)(sf.create_schedule(model))
    assert replayed.annotations == sch.annotations
    assert [repr(h) for h in replayed.history] == [repr(h) for h in sch.history]
    assert type(replayed["blocks.2.mlp.act"].module) is nn.Tanh


def test_foreach_with_types_and_nested_scopes() -> None:
    sch = sf.foreach("blocks.*", sf.foreach(sf.of_type(nn.Linear), sf.annotate.at("weight", "kind", "linear")))(
        sf.create_schedule(Net(depth=2)))
    assert sorted(sch.annotations.of_kind(TAGS)) == [f"blocks.{i}.mlp.fc{j}.weight" for i in (0, 1) for j in (1, 2)]


def test_scope_needs_exactly_one_match() -> None:
    sch = sf.create_schedule(Net(depth=2))
    assert "blocks.1.mlp" in sf.scope("blocks.1", sf.checkpoint.at("mlp"))(sch).annotations
    with pytest.raises(sf.ScheduleError, match=r"(?s)matches 2 modules.*use foreach"):
        sf.scope("blocks.*", sf.checkpoint.at("mlp"))(sch)


def test_when_guards_by_view() -> None:
    even = lambda view: int(view.path.rsplit(".", 1)[-1]) % 2 == 0
    sch = sf.foreach("blocks.*", sf.when(even, sf.checkpoint.at("")))(sf.create_schedule(Net(depth=4)))
    assert list(sch.annotations.of_kind(CHECKPOINT)) == ["blocks.0", "blocks.2"]


def test_combinator_type_errors() -> None:
    with pytest.raises(sf.ScheduleTypeError, match="argument 1.*not a Rewrite"):
        sf.chain(sf.checkpoint.at("a"), "b")  # type: ignore[arg-type]
    with pytest.raises(sf.ScheduleTypeError, match="expected a Rewrite"):
        sf.foreach("blocks.*", sf.checkpoint)  # type: ignore[arg-type]
    with pytest.raises(sf.ScheduleTypeError, match="predicate must be callable"):
        sf.when(True, sf.checkpoint.at(""))  # type: ignore[arg-type]
    with pytest.raises(sf.ScheduleTypeError, match="expected a Schedule, got Net"):
        sf.checkpoint.at("blocks.0")(Net())  # type: ignore[arg-type]
    missing = r"(?s)missing the selector `where`.*call it as checkpoint\(sch, where"
    with pytest.raises(sf.ScheduleTypeError, match=missing):
        sf.checkpoint(sf.create_schedule(Net()))
    with pytest.raises(sf.ScheduleTypeError, match="missing the selector `where`"):
        sf.checkpoint.at()
    with pytest.raises(sf.ScheduleTypeError, match="first argument must be a Schedule"):
        sf.checkpoint(Net(), "blocks.0")  # type: ignore[arg-type]
    with pytest.raises(sf.ScheduleTypeError,
                       match=r"(?s)bad arguments.*call it as checkpoint\(sch, where, \*, policy=None"):
        sf.checkpoint.at("blocks.0", polcy=None)  # type: ignore[call-arg]


FROZEN: sf.Key[bool] = sf.Key("frozen")


def test_custom_primitives_compose_like_builtin_ones() -> None:
    @sf.primitive
    def freeze(sch: sf.Schedule, where: sf.Selection) -> sf.Schedule:
        for path in where.parameters(sch.module):
            sch = sch.annotate_path(path, FROZEN, True)
        return sch

    sch = sf.foreach("blocks.*", freeze.at("norm"))(sf.create_schedule(Net(depth=2)))
    assert sorted(sch.annotations.of_kind(FROZEN)) == [f"blocks.{i}.norm.{n}" for i in (0, 1) for n in ("bias",
                                                                                                          "weight")]
    assert repr(sch.history[0]) == "freeze.at('blocks.0.norm')"
