"""find: Slapo's matching behaviours on traced modules, and the Match value."""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo_fn as sf
from slapo_fn.rewrites.graph import call_module


def traced(model: nn.Module, path: str = "", **kw: object) -> sf.Schedule:
    return sf.trace(sf.create_schedule(model), path, **kw)


class ReluRes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return F.relu(y) + y + torch.relu(x)  # one residual relu, one distractor relu


def test_exact_match_relu_plus_x() -> None:
    sch = traced(ReluRes())
    matches = sf.find(sch, "", lambda x: F.relu(x) + x)
    assert [m.ops for m in matches] == [("relu", "add")]
    (m,) = matches
    assert m.inputs == ("fc",) and m.input_names == ("x",) and len(m) == 2


def test_functional_pattern_matches_module() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    (m,) = sf.find(traced(model), "", lambda x: F.relu(x))
    assert m.ops == ("1",) and m.modules == ("1",)


class TwoPath(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc1(x) + self.fc2(x)) * 2


def test_two_path_pattern_with_call_module_regex() -> None:
    sch = traced(TwoPath())
    pattern = lambda x: F.relu(call_module(r"fc1", x) + call_module(r"fc2", x))
    (m,) = sf.find(sch, "", pattern)
    assert m.ops == ("fc1", "fc2", "add", "relu") and m.inputs == ("x",)
    absent = lambda x: F.relu(call_module(r"fc3", x) + call_module(r"fc2", x))
    assert sf.find(sch, "", absent, allow_empty=True) == []
    with pytest.raises(sf.ScheduleError, match=r"call_module\('fc3'\) \(nearest: fc[12], fc[12]\) are not in"):
        sf.find(sch, "", absent)


class Tree(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ((x + y) * (y - z)).sum() + (x - z).mean()


def test_tree_pattern_several_inputs() -> None:
    (m,) = sf.find(traced(Tree()), "", lambda x, y, z: (x + y) * (y - z))
    assert sorted(m.ops) == ["add", "mul", "sub"]
    assert m.inputs == ("x", "y", "z") and m.outputs == (m.nodes[-1],)


class Diamond(nn.Module):
    def forward(self, m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        a = m + n
        return torch.tanh(a * 2 + a * 3) - n


def test_diamond_exactly_four_nodes() -> None:
    def pattern(m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        a = m + n
        return a * 2 + a * 3

    (match,) = sf.find(traced(Diamond()), "", pattern)
    assert len(match.nodes) == 4 and sorted(match.ops) == ["add", "add", "mul", "mul"]
    assert "tanh" not in match.ops and "sub" not in match.ops


class Attention(nn.Module):
    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], self.heads, -1).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.q_proj(x)), self.split(self.k_proj(x)), self.split(self.v_proj(x))
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v


def test_horizontal_matches_in_qkv_order() -> None:
    def pattern(x: torch.Tensor) -> torch.Tensor:
        t = call_module(r"[qkv]_proj", x)
        return t.view(t.shape[0], t.shape[1], 2, -1).permute(0, 2, 1, 3)

    matches = sf.find(traced(Attention()), "", pattern)
    assert [m.modules for m in matches] == [("q_proj",), ("k_proj",), ("v_proj",)]
    by_regex = sf.find(traced(Attention()), "", r"[qkv]_proj")
    assert [m.modules for m in by_regex] == [("q_proj",), ("k_proj",), ("v_proj",)]


class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc1 = nn.Linear(8, 6)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(6, 4)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1)
        return self.fc3(self.relu2(self.fc2(self.relu1(self.fc1(x)))))


def test_linear_relu_module_pattern_matched_twice() -> None:
    pattern = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
    matches = sf.find(traced(LeNet()), "", pattern)
    assert [m.modules for m in matches] == [("fc1", "relu1"), ("fc2", "relu2")]


def test_node_predicate_and_regex_on_nested_paths() -> None:
    model = nn.Sequential(TwoPath(), TwoPath())
    sch = traced(model, "", flatten=True)
    assert [m.ops for m in sf.find(sch, "", r".*fc2")] == [("0.fc2",), ("1.fc2",)]
    relus = sf.find(sch, "", lambda node: node.op == "call_function" and node.target is F.relu)
    assert [m.ops for m in relus] == [("relu",), ("relu",)]


def test_match_is_frozen_and_absolute() -> None:
    model = nn.Sequential(nn.Identity(), TwoPath())
    sch = traced(model, "1")
    (m,) = sf.find(sch, "1", r"fc1")
    assert m.path == "1" and m.modules == ("1.fc1",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.path = "x"  # type: ignore[misc]
    assert m == sf.find(sch, "1", r"fc1")[0]


def test_find_on_untraced_module_is_an_error() -> None:
    sch = sf.create_schedule(TwoPath())
    with pytest.raises(sf.ScheduleError, match=r"(?s)not a traced module .*sf\.trace\(sch, ''\)"):
        sf.find(sch, "", r"fc1")


def test_find_bad_pattern_errors() -> None:
    sch = traced(TwoPath())
    with pytest.raises(sf.ScheduleError, match="bad regex"):
        sf.find(sch, "", "fc[")
    with pytest.raises(sf.ScheduleTypeError, match="a pattern is a regex"):
        sf.find(sch, "", 3)  # type: ignore[arg-type]
    with pytest.raises(sf.ScheduleError, match="cannot be traced"):
        sf.find(sch, "", lambda x: x if x.sum() > 0 else -x)
    with pytest.raises(sf.SelectorError):
        sf.find(sch, "nope", r"fc1")


def test_empty_find_says_what_the_graph_contains() -> None:
    sch = traced(ReluRes())
    with pytest.raises(sf.ScheduleError, match=r"(?s)regex 'gelu'.*modules \[fc\] and ops \[linear, relu, add\].*"
                                             r"nearest ops: relu") as info:
        sf.find(sch, "", "gelu")  # an op name given as a module regex
    assert info.value.paths == ("",)
    with pytest.raises(sf.ScheduleError, match=r"nearest module targets: fc"):
        sf.find(sch, "", "fcc")
    with pytest.raises(sf.ScheduleError, match=r"op\(s\) 'gelu' \(nearest: relu\) are not in the graph"):
        sf.find(sch, "", lambda x: F.gelu(x))
    with pytest.raises(sf.ScheduleError, match="the node predicate is true for no node"):
        sf.find(sch, "", lambda node: False)


class TwoValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(x)) + x  # relu and add read two different values


def test_pattern_reusing_a_parameter_where_graph_has_two_values_says_so() -> None:
    sch = traced(TwoValues())
    with pytest.raises(sf.ScheduleError, match=r"(?s)reads one parameter in several places.*different values.*"
                                             r"give each use its own parameter"):
        sf.find(sch, "", lambda x: F.relu(x) + x)
    (m,) = sf.find(sch, "", lambda x, y: F.relu(x) + y)
    assert m.ops == ("relu", "add")


class Escaping(nn.Module):
    def forward(self, m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        a = m + n
        return (a * 2 + a * 3) + a * 5  # a * 5 reads the diamond's inner value outside it


def diamond(m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    a = m + n
    return a * 2 + a * 3


def test_diamond_whose_inner_value_escapes_is_matched_and_value_kept() -> None:
    model = Escaping()
    sch = traced(model)
    (match,) = sf.find(sch, "", diamond)
    assert sorted(match.ops) == ["add", "add", "mul", "mul"] and match.escaping == ("add",)
    m, n = torch.randn(3, requires_grad=True), torch.randn(3)
    fused = sf.fuse(sch, "", match, compiler=None)
    assert torch.equal(sf.build(fused)(m, n), model(m, n))
    replaced = sf.replace(sch, "", lambda m, n: (m + n) * 5, subgraph=match)  # returns d only: a is recomputed
    assert torch.allclose(sf.build(replaced)(m, n), model(m, n))
    assert sum(node.target is operator.add for node in replaced.module.graph.nodes) == 2  # a, and the sum
    assert sf.find(sch, "", diamond) == [match]  # the input schedule is unchanged


class FlowsBack(nn.Module):
    def forward(self, m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        a = m + n
        b = torch.tanh(a)  # leaves the diamond and comes back into it
        return a * 2 + b * 3


def test_escaping_value_that_flows_back_is_not_a_match() -> None:
    with pytest.raises(sf.ScheduleError, match="not connected as in the pattern"):
        sf.find(traced(FlowsBack()), "", lambda m, n, b: (m + n) * 2 + b * 3 + (m + n))
    assert sf.find(traced(FlowsBack()), "", diamond, allow_empty=True) == []
