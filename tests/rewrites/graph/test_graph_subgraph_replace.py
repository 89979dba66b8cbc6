"""Partial ``replace``: hooks moved or refused, horizontal (QKV) replacement of several matches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo_fn as sf
from slapo_fn.rewrites.graph import call_module
from tests.fingerprint import fingerprint, same


class Proj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.linear(x)) * 2)


class LinearRelu(nn.Module):
    """What the matched ``relu(linear(x))`` computes, as one module sharing the weights."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x))


def linear_relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(call_module(r"linear", x))


def test_replace_moves_fwd_pre_and_bwd_post_hooks_to_the_new_module() -> None:
    model = Proj()
    seen: list[tuple[str, str]] = []
    sch = sf.trace(sf.create_schedule(model), "")
    sch = sf.hook(sch, "linear", "fwd_pre", lambda m, args: seen.append(("fwd_pre", type(m).__name__)))
    sch = sf.hook(sch, "linear", "bwd_post", lambda m, gi, go: seen.append(("bwd_post", type(m).__name__)))
    (match,) = sf.find(sch, "", linear_relu)
    new = sf.replace(sch, "", LinearRelu(model.linear), subgraph=match)
    assert [str(h).split(":")[0] for h in new["replaced"].annotations["hooks"]] == ["fwd_pre", "bwd_post"]
    assert "linear" not in new.annotations
    x = torch.randn(2, 4, requires_grad=True)
    sf.build(new)(x).sum().backward()
    assert seen == [("fwd_pre", "LinearRelu"), ("bwd_post", "LinearRelu")]
    assert sch["linear"].annotations["hooks"]  # the input schedule is unchanged


@pytest.mark.parametrize("mode", ["fwd_post", "bwd_pre"])
def test_replace_refuses_to_drop_a_hook_naming_it_and_its_path(mode: str) -> None:
    model = Proj()
    before = fingerprint(model)

    def watch(*args: Any) -> None:
        return None

    sch = sf.hook(sf.trace(sf.create_schedule(model), ""), "linear", mode, watch)
    (match,) = sf.find(sch, "", linear_relu)
    with pytest.raises(sf.ScheduleError, match=rf"(?s)'linear': its {mode}:.*watch hook would be dropped.*fix:") as e:
        sf.replace(sch, "", LinearRelu(model.linear), subgraph=match)
    assert e.value.paths == ("linear",)
    assert same(fingerprint(model), before) and sch["linear"].annotations["hooks"]


def test_replace_refuses_hooks_registered_on_the_module_object() -> None:
    model = Proj()
    model.linear.register_forward_hook(lambda m, a, o: None)
    sch = sf.trace(sf.create_schedule(model), "")
    (match,) = sf.find(sch, "", linear_relu)
    with pytest.raises(sf.ScheduleError, match=r"'linear': has hooks registered on the module object"):
        sf.replace(sch, "", LinearRelu(model.linear), subgraph=match)


class Attention(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj((q @ k.transpose(-1, -2)).softmax(-1) @ v)


class FusedQKV(nn.Module):
    """q, k and v projections as one matmul, returning the three as a tuple."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
        super().__init__()
        self.qkv = nn.Linear(q.in_features, 3 * q.out_features)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            self.qkv.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.qkv(x).chunk(3, dim=-1))


def test_horizontal_qkv_replacement_keeps_forward_and_gradients() -> None:
    model = Attention()
    before = fingerprint(model)
    x = torch.randn(2, 5, 8)
    sch = sf.trace(sf.create_schedule(model), "", example_inputs=(x,))
    m_q, m_k, m_v = sf.find(sch, "", r"[qkv]_proj")
    new = sf.replace(sch, "", FusedQKV(model.q_proj, model.k_proj, model.v_proj), subgraph=[m_q, m_k, m_v])
    calls = [str(n.target) for n in new.module.graph.nodes if n.op == "call_module"]
    assert calls == ["replaced", "o_proj"] and "q_proj" not in new.module._modules
    built = sf.build(new)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = built(x1), model(x2)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    fused = built.replaced.qkv
    torch.testing.assert_close(fused.weight.grad, torch.cat([model.q_proj.weight.grad, model.k_proj.weight.grad,
                                                             model.v_proj.weight.grad]))
    torch.testing.assert_close(built.o_proj.weight.grad, model.o_proj.weight.grad)
    model.zero_grad()
    assert same(fingerprint(model), before) and sch.module.q_proj is model.q_proj


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def test_matches_that_cannot_be_replaced_by_one_module_are_typed_errors() -> None:
    sch = sf.trace(sf.create_schedule(Attention()), "")
    m_q, m_k, _ = sf.find(sch, "", r"[qkv]_proj")
    two = lambda x: (x, x)
    with pytest.raises(sf.ScheduleError, match=r"<root>: the matches cannot be replaced by one module: .*share nodes"):
        sf.replace(sch, "", two, subgraph=[m_q, m_q])
    with pytest.raises(sf.ScheduleError, match="lists no match"):
        sf.replace(sch, "", two, subgraph=[])
    with pytest.raises(sf.ScheduleTypeError, match="expected Match values from sf.find, got str"):
        sf.replace(sch, "", two, subgraph=[m_q, "k_proj"])  # type: ignore[list-item]
    chain = sf.trace(sf.create_schedule(Chain()), "")
    fc1, fc2 = sf.find(chain, "", r"fc[12]")
    with pytest.raises(sf.ScheduleError, match=r"match 1 reads values of match 0"):
        sf.replace(chain, "", two, subgraph=[fc1, fc2])
    nested = sf.trace(sf.create_schedule(nn.Sequential(Attention(), Attention())), "")
    (q0,) = sf.find(nested, "0", r"q_proj")
    (q1,) = sf.find(nested, "1", r"q_proj")
    with pytest.raises(sf.ScheduleError, match=r"some were found in '1', not here"):
        sf.replace(nested, "0", two, subgraph=[q0, q1])
    with pytest.raises(sf.ScheduleError, match="returns"):  # one output per match, in order
        sf.replace(sf.trace(sf.create_schedule(Attention()), "", example_inputs=(torch.randn(2, 5, 8),)), "",
                   lambda x: x, subgraph=[m_q, m_k])
