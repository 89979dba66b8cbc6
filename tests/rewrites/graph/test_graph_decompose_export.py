"""decompose on graphs of torch.export: its unflattened modules (``InterpreterModule``),
its Linears as modules of their own, or their code inlined by ``trace(flatten=True)``;
then Slapo's ``fuse_bias_gelu`` (decompose, find ``gelu(x + bias)``, fuse) on ALBERT's
layer traced that way. Numbers, gradients and FQNs are the eager model's."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import slapo_fn as sf


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))  # type: ignore[no-any-return]


def _exported(flatten: bool) -> sf.Schedule:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sf.trace(sf.create_schedule(Outer()), "", tracer="export", example_inputs=((x,), {}), flatten=flatten)


def _linears_with_bias(module: nn.Module) -> int:
    """The linears run with their bias inside (not decomposed), over every graph under ``module``."""
    count = 0
    for m in module.modules():
        graph = m.graph if isinstance(m, fx.GraphModule) else m.__dict__.get("graph")
        if not isinstance(graph, fx.Graph) or (m is not module and not _called(module, m)):
            continue
        count += sum(1 for n in graph.nodes if n.op == "call_function" and n.target in (
            F.linear, torch.ops.aten.linear.default) and (len(n.args) > 2 or "bias" in n.kwargs))
    return count


def _called(root: nn.Module, m: nn.Module) -> bool:
    """Whether some graph under ``root`` calls ``m`` (else it only holds parameters)."""
    names = {id(mod): name for name, mod in root.named_modules()}
    target = names[id(m)]
    for name, mod in root.named_modules():
        graph = mod.graph if isinstance(mod, fx.GraphModule) else mod.__dict__.get("graph")
        prefix = f"{name}." if name else ""
        if isinstance(graph, fx.Graph) and any(n.op == "call_module" and prefix + str(n.target) == target
                                               for n in graph.nodes):
            return True
    return False


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("where", ["", "inner", "inner.fc"])
def test_decompose_splits_the_bias_off_linears_torch_export_traced(flatten: bool, where: str) -> None:
    sch = _exported(flatten)
    assert type(sch.module.inner).__name__ == "InterpreterModule"
    before = _linears_with_bias(sch.module)
    got = sf.decompose(sch, where)
    # the root's graph calls its own Linears: both where inlined, `out` alone where `inner` keeps a graph
    assert _linears_with_bias(got.module) == before - (2 if where == "" and flatten else 1)
    x = torch.randn(2, 3, 4, requires_grad=True)
    a, b = sf.build(sch), sf.build(got)
    ya, yb = a(x), b(x)
    torch.testing.assert_close(yb, ya)
    ya.sum().backward()
    yb.sum().backward()
    assert [n for n, _ in b.named_parameters()] == [n for n, _ in a.named_parameters()]
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, msg=n)


def test_decompose_refuses_a_holder_with_no_linear_under_it() -> None:
    class Act(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.gelu(x)

    model = nn.Sequential(nn.Linear(4, 4), Act())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sch = sf.trace(sf.create_schedule(model), "", tracer="export", example_inputs=((torch.randn(2, 4),), {}),
                       flatten=True)
    with pytest.raises(sf.ScheduleError, match="decompose splits an nn.Linear"):
        sf.decompose(sch, "1")


def test_slapos_fuse_bias_gelu_on_albert_traced_by_export_is_equal() -> None:
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    cfg = AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                       num_hidden_layers=1, hidden_act="gelu", attention_probs_dropout_prob=0.0,
                       hidden_dropout_prob=0.0)
    model = AlbertModel(cfg).eval()
    layer = "encoder.albert_layer_groups.0.albert_layers.0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sch = sf.trace(sf.create_schedule(model), layer, example_inputs=((torch.randn(2, 6, 32),), {}), flatten=True)
    assert type(sch[f"{layer}.attention"].module).__name__ == "InterpreterModule"
    sch = sf.decompose(sch, f"{layer}.attention")  # the attention's q/k/v/dense, inlined into the layer's graph
    sch = sf.decompose(sch, f"{layer}.ffn")

    def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.gelu(x + bias)

    found = sf.find(sch, layer, bias_gelu)
    assert len(found) == 1 and found[0].inputs[1] == "ffn_bias"
    sch = sf.fuse(sch, layer, found[0], compiler=None, name="FusedBiasGeLU")
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    built = sf.build(sch)
    want, got = model(ids).last_hidden_state, built(ids).last_hidden_state
    torch.testing.assert_close(got, want)
    want.sum().backward()
    got.sum().backward()
    grads = dict(built.named_parameters())
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n].grad, p.grad, msg=n)
