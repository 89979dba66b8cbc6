"""Expert parallelism (``sf.expert_parallel``): tiny Mixtral and Qwen2-MoE at ep2 against the
single-process model (logits, loss with the router's auxiliary loss, every gradient, AdamW
steps), routing edge cases on a bare experts module, collective counts and bytes, the
capacity cap, checkpoints across layouts, validation, and the cost model for explain."""

from __future__ import annotations

import math
import tempfile
from typing import Any

import pytest
import torch
from dist import mesh
from fingerprint import fingerprint, same
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode
from tp_checks import CountCollectives, counts, full

import slapo_fn as sf
from slapo_fn.dtensor.experts import EXPERTS, Experts, expert_costs
from slapo_fn.dtensor.plan import plan
from slapo_fn.dtensor.shard import LAYOUT
from slapo_fn.dtensor.sync import SYNC
from slapo_fn.dtensor.testing import fake_mesh

VOCAB = 128


def tiny_mixtral(layers: int = 2, experts: int = 4, implementation: str = "grouped_mm") -> nn.Module:
    """``implementation``: Hugging Face's experts forward, ``"grouped_mm"`` (the default) or
    ``"eager"`` (a loop over the experts)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                        num_experts_per_tok=2, use_cache=False, experts_implementation=implementation)
    return MixtralForCausalLM(cfg)


def tiny_qwen2_moe(layers: int = 2) -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         shared_expert_intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, use_cache=False)
    return Qwen2MoeForCausalLM(cfg)


def tiny_qwen3_moe(layers: int = 2) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, use_cache=False)
    return Qwen3MoeForCausalLM(cfg)


FAMILIES = {"mixtral": tiny_mixtral, "qwen2_moe": tiny_qwen2_moe, "qwen3_moe": tiny_qwen3_moe,
            "mixtral_eager": lambda: tiny_mixtral(implementation="eager")}


def ids(batch: int = 2, seq: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


class AllToAllBytes(TorchDispatchMode):
    """Bytes this rank hands to each all-to-all (what it sends, itself included), and the
    bytes of those that leave it (for ``rank``)."""

    def __init__(self, rank: int = 0) -> None:
        super().__init__()
        self.rank = rank
        self.sent: list[int] = []
        self.off_rank = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "_c10d_functional" and func.__name__.startswith("all_to_all_single"):
            x, in_splits = args[0], args[2]  # (input, output splits, input splits, group)
            self.sent.append(x.numel() * x.element_size())
            self.off_rank += (x.shape[0] - in_splits[self.rank]) * (x[0].numel() * x.element_size() if len(x) else 0)
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- whole models


def _model_parity(rank: int, world: int, family: str, steps: int) -> dict[str, Any]:
    model = FAMILIES[family]()
    before = fingerprint(model)
    sch = sf.expert_parallel(sf.create_schedule(model, mesh=mesh((world,), ("ep",))), "model.layers.*.mlp")
    built, ref = sf.build(sch), sf.build(sf.create_schedule(model))
    x = ids()
    r = ref(x, labels=x, output_router_logits=True)
    r.loss.backward()
    # CommDebugMode's module tracker fails inside Hugging Face's eager experts loop: count the
    # functional collectives with a plain dispatch mode instead (the same counts)
    mode = CountCollectives if family == "mixtral_eager" else CommDebugMode
    with mode() as fwd:
        o = built(x, labels=x, output_router_logits=True)
    with mode() as bwd:
        o.loss.backward()
    torch.testing.assert_close(o.logits, r.logits, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(o.aux_loss, r.aux_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(o.loss, r.loss, atol=1e-6, rtol=1e-6)
    ref_params = dict(ref.named_parameters())
    checked = []
    for name, p in built.named_parameters():
        assert isinstance(p, DTensor), name
        assert p.grad is not None, name
        torch.testing.assert_close(full(p.grad), ref_params[name].grad, atol=1e-6, rtol=1e-5,
                                   msg=lambda s, n=name: f"{n}: {s}")
        checked.append(name)
    # AdamW steps on both: parameters stay equal
    opt, opt_ref = torch.optim.AdamW(built.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        x = ids(seed=10 + step)
        o, r = built(x, labels=x, output_router_logits=True), ref(x, labels=x, output_router_logits=True)
        o.loss.backward()
        r.loss.backward()
        torch.testing.assert_close(o.loss, r.loss, atol=1e-5, rtol=1e-5)
        losses.append((o.loss.item(), r.loss.item()))
    for name, p in built.named_parameters():
        # Adam divides by the gradients' root mean square: last-bit differences of near-zero
        # gradients move a weight by up to lr × their relative error
        torch.testing.assert_close(full(p.detach()), ref_params[name].detach(), atol=1e-5, rtol=1e-4,
                                   msg=lambda s, n=name: f"after {steps} steps, {n}: {s}")
    assert same(fingerprint(model), before)  # the model given to slapo_fn is untouched
    assert model.model.layers[0].mlp.experts.num_experts == 4  # build's copy holds the local count
    experts = {n: (tuple(p.to_local().shape), tuple(map(str, p.placements)))
               for n, p in built.named_parameters() if ".experts." in n}
    return {"fwd": counts(fwd), "bwd": counts(bwd), "predicted": plan(sch).counts(), "grads": checked,
            "losses": losses, "experts": experts}


@pytest.mark.dist
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "mixtral_eager"])
def test_ep2_matches_the_single_process_model(dist2, family: str) -> None:
    for rank, r in enumerate(dist2.run(_model_parity, family, 3, timeout=150)):
        # per MoE layer: dispatch + combine all-to-all both ways; forward all-gathers of the pair
        # counts and of the output, backward one of the token/weight gradients; nothing else
        assert r["fwd"] == {"all_to_all_single": 4, "all_gather": 4}, rank
        assert r["bwd"] == {"all_to_all_single": 4, "all_gather": 2}, rank
        assert r["predicted"] == {"forward": {"all_to_all": 4, "all_gather": 4},
                                  "backward": {"all_to_all": 4, "all_gather": 2}}
        assert "model.layers.0.mlp.gate.weight" in r["grads"]  # the router's gradient is checked
        assert len(r["losses"]) == 3
        gate_up, down = (r["experts"][f"model.layers.0.mlp.experts.{n}"] for n in ("gate_up_proj", "down_proj"))
        assert gate_up[0][0] == down[0][0] == 2  # E/ep = 4/2 experts per rank
        assert gate_up[1] == ("S(0)",)


def _bf16(rank: int, world: int) -> bool:
    """bf16 tokens with fp32 routing weights (Mixtral's router): the gradients of both travel
    in one all-gather, as bytes."""
    model = tiny_mixtral().to(torch.bfloat16)
    sch = sf.expert_parallel(sf.create_schedule(model, mesh=mesh((world,), ("ep",))), "model.layers.*.mlp")
    built, ref = sf.build(sch), sf.build(sf.create_schedule(model))
    x = ids()
    o, r = built(x, labels=x, output_router_logits=True), ref(x, labels=x, output_router_logits=True)
    o.loss.backward()
    r.loss.backward()
    torch.testing.assert_close(o.logits, r.logits, atol=2e-2, rtol=2e-2)
    ref_params = dict(ref.named_parameters())
    for name, p in built.named_parameters():
        torch.testing.assert_close(full(p.grad), ref_params[name].grad, atol=2e-2, rtol=5e-2,
                                   msg=lambda s, n=name: f"{n}: {s}")
    return bool(o.logits.dtype == torch.bfloat16)


@pytest.mark.dist
def test_ep2_in_bfloat16(dist2) -> None:
    assert dist2.run(_bf16, timeout=120) == [True, True]


def _verified(rank: int, world: int) -> str:
    sch = sf.expert_parallel(sf.create_schedule(tiny_mixtral(), mesh=mesh((world,), ("ep",))), "model.layers.*.mlp")
    return str(sf.verify(sch, ids()))


@pytest.mark.dist
def test_verify_checks_an_ep2_schedule(dist2) -> None:
    for report in dist2.run(_verified, timeout=120):
        assert report.startswith("verified 1 outputs") and "21 gradients" in report


# ----------------------------------------------------------------------------- a bare experts module


class Routed(nn.Module):
    """An experts module fed a fixed routing (no router), to force edge cases."""

    def __init__(self, experts: nn.Module, index: torch.Tensor) -> None:
        super().__init__()
        self.experts = experts
        self.register_buffer("index", index)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.index, w)


def _experts(tokens: int, index: torch.Tensor, capacity_factor: float | None = None) -> dict[str, Any]:
    model = tiny_mixtral(1)
    routed = Routed(model.model.layers[0].mlp.experts, index)
    k = index.shape[1]
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3))
    w = torch.rand(tokens, k, generator=torch.Generator().manual_seed(4))
    sch = sf.expert_parallel(sf.create_schedule(routed, mesh=mesh((2,), ("ep",))), "",
                             capacity_factor=capacity_factor)
    built, ref = sf.build(sch), sf.build(sf.create_schedule(routed))
    w_ref = w
    if capacity_factor is not None:  # the pairs over each expert's cap (latest tokens) contribute zero
        cap = math.ceil(capacity_factor * tokens * k / 4)
        keep = torch.ones_like(w)
        seen = [0] * 4
        for t in range(tokens):
            for j in range(k):
                e = int(index[t, j])
                seen[e] += 1
                if seen[e] > cap:
                    keep[t, j] = 0
        w_ref = w * keep
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    xb, wb = x.clone().requires_grad_(True), w_ref.clone().requires_grad_(True)
    sent = AllToAllBytes(mesh((2,), ("ep",)).get_local_rank(0))
    with sent:
        out = built(xa, wa)
    expected = ref(xb, wb)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    with AllToAllBytes(sent.rank) as back:
        out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-5, rtol=1e-5)
    if capacity_factor is None:
        torch.testing.assert_close(wa.grad, wb.grad, atol=1e-5, rtol=1e-5)
    else:
        kept = w_ref != 0
        torch.testing.assert_close(wa.grad[kept], wb.grad[kept], atol=1e-5, rtol=1e-5)
    grads = dict(ref.named_parameters())
    for name, p in built.named_parameters():
        torch.testing.assert_close(full(p.grad), grads[name].grad, atol=1e-5, rtol=1e-5,
                                   msg=lambda s, n=name: f"{n}: {s}")
    costs = expert_costs(sch, tokens=tokens, top_k=k)
    return {"sent": sent.sent, "off_rank": sent.off_rank + back.off_rank, "predicted": costs.all_to_all_bytes}


def _edge(rank: int, world: int, case: str) -> dict[str, Any]:
    tokens = 9  # odd: the token slices are padded
    if case == "one_expert":  # top-1, every token to expert 0 (rank 0); rank 1's experts get none
        index = torch.zeros(tokens, 1, dtype=torch.long)
    elif case == "empty_experts":  # top-2 over experts 0 and 3 only: experts 1 and 2 get nothing
        index = torch.tensor([[0, 3], [3, 0]] * 4 + [[0, 3]])
    elif case == "uniform":  # every token to one expert on each rank: half of each rank's pairs leave it
        tokens = 8
        index = torch.tensor([[0, 2], [3, 1]] * 4)
    else:  # capacity: at most ceil(0.5 × 9 tokens × 2 / 4 experts) = 3 pairs per expert; experts 0 and 1 get 6
        index = torch.tensor([[0, 1]] * 6 + [[2, 3]] * 3)
    cf = 0.5 if case == "capacity" else None
    r = _experts(tokens, index, cf)
    # the bytes this rank sent: its kept pairs (rows of 64 floats) in dispatch, the pairs its
    # experts received in combine
    rows = -(-tokens // 2)  # 5 of the 9 tokens per rank, the last one padding on rank 1
    kept = torch.ones(index.shape, dtype=torch.bool)
    if cf is not None:
        cap = math.ceil(cf * tokens * index.shape[1] / 4)
        seen = [0] * 4
        for pos, e in enumerate(index.reshape(-1).tolist()):
            seen[e] += 1
            kept.view(-1)[pos] = seen[e] <= cap
    r["pairs"] = int(kept[rank * rows : (rank + 1) * rows].sum())
    r["received"] = int((kept & (index // 2 == rank)).sum())  # experts 2r and 2r + 1 live here
    return r


@pytest.mark.dist
@pytest.mark.parametrize("case", ["one_expert", "empty_experts", "capacity", "uniform"])
def test_routing_edge_cases_match_and_move_exact_bytes(dist2, case: str) -> None:
    for r in dist2.run(_edge, case, timeout=90):
        # forward: dispatch (this rank's kept pairs), then combine (what its experts computed), 64 floats each
        assert r["sent"] == [r["pairs"] * 64 * 4, r["received"] * 64 * 4]
        if case == "uniform":  # evenly routed: what explain's cost model predicts, forward and backward
            assert r["off_rank"] == r["predicted"] == 4 * 4 * 64 * 4


# ----------------------------------------------------------------------------- composition


def _attention_tp(sch: sf.Schedule) -> sf.Schedule:
    return sf.foreach(
        "model.layers.*.self_attn",
        sf.shard.at(["q_proj", "k_proj", "v_proj"], axis=0) >> sf.shard.at("o_proj", axis=1),
    )(sch)


def _composed(rank: int, world: int, kind: str, family: str = "mixtral") -> dict[str, Any]:
    model = tiny_mixtral() if family == "mixtral" else tiny_qwen2_moe()
    # CommDebugMode's module tracker miscounts Qwen2-MoE's shared expert (its input is a view)
    tracker = CommDebugMode if family == "mixtral" else CountCollectives
    if kind in ("ep_tp", "ep_etp"):  # attention tensor-parallel over tp, experts over ep (and split over tp)
        sch = sf.create_schedule(model, mesh=mesh((2, 2), ("ep", "tp")))
        sch = sf.expert_parallel(_attention_tp(sch), "model.layers.*.mlp", mesh_axis="ep")
        if kind == "ep_etp":
            sch = sf.expert_tensor_parallel(sch, "model.layers.*.mlp", mesh_axis="tp")
        batches = [ids()]
    elif kind == "ep_on_tp":  # the experts spread over the tensor-parallel ranks (torchtitan's default)
        sch = sf.create_schedule(model, mesh=mesh((world,), ("tp",)))
        sch = sf.expert_parallel(_attention_tp(sch), "model.layers.*.mlp", mesh_axis="tp")
        batches = [ids()]
    elif kind == "etp":  # attention and each expert tensor-parallel over tp (Hugging Face's plan)
        sch = sf.create_schedule(model, mesh=mesh((world,), ("tp",)))
        sch = sf.expert_tensor_parallel(_attention_tp(sch), "model.layers.*.mlp")
        batches = [ids()]
    else:  # dp_ep: FSDP2 over dp (a batch per dp rank), experts over ep
        m = mesh((2, 2), ("dp", "ep"))
        sch = sf.data_parallel(sf.expert_parallel(sf.create_schedule(model, mesh=m), "model.layers.*.mlp"))
        batches = [ids(seed=1), ids(seed=2)]
        mine = batches[m.get_local_rank(0)]
    built, ref = sf.build(sch), sf.build(sf.create_schedule(model))
    x = mine if kind == "dp_ep" else batches[0]
    with tracker() as fwd:
        o = built(x, labels=x, output_router_logits=True)
    with tracker() as bwd:
        o.loss.backward()
    r = ref(x, labels=x, output_router_logits=True)
    torch.testing.assert_close(o.logits, r.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o.loss, r.loss, atol=1e-6, rtol=1e-6)
    ref.zero_grad()
    for b in batches:  # data parallel: the mean of the replicas' gradients
        (ref(b, labels=b, output_router_logits=True).loss / len(batches)).backward()
    ref_params = dict(ref.named_parameters())
    placements = {}
    for name, p in built.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(full(p.grad), ref_params[name].grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda s, n=name: f"{n}: {s}")
        placements[name] = tuple(map(str, p.placements))
    opt, opt_ref = torch.optim.AdamW(built.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt.step()
    opt_ref.step()
    # AdamW's first step is g/(|g|+eps) per element: a gradient element near eps (1e-8) moves by a
    # visible part of lr (1e-3) when summed in another order; 5e-5 is 5% of a step
    for name, p in built.named_parameters():
        torch.testing.assert_close(full(p.detach()), ref_params[name].detach(), atol=5e-5, rtol=1e-4,
                                   msg=lambda s, n=name: f"after a step, {n}: {s}")
    return {"fwd": counts(fwd), "bwd": counts(bwd), "predicted": plan(sch).counts(), "placements": placements}


@pytest.mark.dist
@pytest.mark.slow
def test_ep2_with_attention_tp2_on_four_ranks(dist4) -> None:
    for r in dist4.run(_composed, "ep_tp", timeout=240):
        assert r["fwd"] == {"all_reduce": 2, "all_to_all_single": 4, "all_gather": 4}
        assert r["bwd"] == {"all_reduce": 2, "all_to_all_single": 4, "all_gather": 2}
        assert r["predicted"] == {"forward": {"all_reduce": 2, "all_to_all": 4, "all_gather": 4},
                                  "backward": {"all_reduce": 2, "all_to_all": 4, "all_gather": 2}}
        assert r["placements"]["model.layers.0.self_attn.q_proj.weight"] == ("R", "S(0)")
        assert r["placements"]["model.layers.0.mlp.experts.gate_up_proj"] == ("S(0)", "R")


@pytest.mark.dist
def test_ep_reusing_the_tp_ranks(dist2) -> None:
    for r in dist2.run(_composed, "ep_on_tp", timeout=150):
        assert r["fwd"] == {"all_reduce": 2, "all_to_all_single": 4, "all_gather": 4}
        assert r["bwd"] == {"all_reduce": 2, "all_to_all_single": 4, "all_gather": 2}
        assert r["placements"]["model.layers.0.mlp.experts.gate_up_proj"] == ("S(0)",)


@pytest.mark.dist
def test_experts_tensor_parallel_tp2(dist2) -> None:
    for r in dist2.run(_composed, "etp", timeout=150):
        # per layer: attention one all-reduce each way; experts one forward (partial outputs) and one
        # backward (the tokens' and routing weights' gradients together)
        assert r["fwd"] == r["bwd"] == {"all_reduce": 4}
        assert r["predicted"] == {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}
        assert r["placements"]["model.layers.0.mlp.experts.gate_up_proj"] == ("_S(1, 2)",)
        assert r["placements"]["model.layers.0.mlp.experts.down_proj"] == ("S(2)",)


@pytest.mark.dist
@pytest.mark.slow
def test_ep2_with_experts_and_attention_tp2_on_four_ranks(dist4) -> None:
    for r in dist4.run(_composed, "ep_etp", timeout=240):
        assert r["fwd"] == {"all_reduce": 4, "all_to_all_single": 4, "all_gather": 4}
        assert r["bwd"] == {"all_reduce": 4, "all_to_all_single": 4, "all_gather": 2}
        assert r["predicted"] == {"forward": {"all_reduce": 4, "all_to_all": 4, "all_gather": 4},
                                  "backward": {"all_reduce": 4, "all_to_all": 4, "all_gather": 2}}
        assert r["placements"]["model.layers.0.mlp.experts.gate_up_proj"] == ("S(0)", "_S(1, 2)")


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_over_dp_with_ep2_on_four_ranks(dist4) -> None:
    for r in dist4.run(_composed, "dp_ep", timeout=240):
        assert r["fwd"]["all_to_all_single"] == 4 and r["bwd"]["all_to_all_single"] == 4
        # experts: E/ep along dim 0 on ep, then FSDP2 shards those along dp
        assert r["placements"]["model.layers.0.mlp.experts.gate_up_proj"] == ("_S(0, 2)", "S(0)")
        assert r["placements"]["model.layers.0.mlp.gate.weight"] == ("S(0)", "R")


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ep_tp", "dp_ep"])
def test_qwen2_moe_composes_on_four_ranks(dist4, kind: str) -> None:
    """Qwen2-MoE (a shared expert beside the routed ones) at tp2 attention × ep2 and at
    FSDP2 dp2 × ep2: forward, loss with the aux loss, every gradient and one AdamW step
    equal the single-process model (checked inside _composed), with the experts' all-to-alls."""
    for r in dist4.run(_composed, kind, "qwen2_moe", timeout=240):
        assert r["fwd"]["all_to_all_single"] == 4 and r["bwd"]["all_to_all_single"] == 4, r
        assert r["placements"]["model.layers.0.mlp.shared_expert.gate_proj.weight"][-1] == "R"


def _pipelined(rank: int, world: int) -> dict[str, Any]:
    import torch.nn.functional as F

    def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    x, target = ids(batch=4, seq=8), ids(batch=4, seq=8, seed=5)
    reference = tiny_mixtral()
    ref_loss = ce(reference(x).logits, target)
    ref_loss.backward()
    model = tiny_mixtral()
    sch = sf.create_schedule(model, mesh=mesh((2, 2), ("pp", "ep")))
    sch = sf.cut_pipeline_stage(sf.expert_parallel(sch, "model.layers.*.mlp"), "model.layers.0")
    pipe = sf.build_pipeline(sch, microbatches=2, schedule="1f1b", loss_fn=ce)
    loss = pipe.step(x, target=target)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(full(p.grad), reference.get_parameter(name).grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda s, n=name: f"{n}: {s}")
    return {"loss": None if loss is None else float(loss), "ref": float(ref_loss),
            "experts": sorted(n for n, _ in pipe.named_parameters() if ".experts." in n)}


@pytest.mark.dist
@pytest.mark.slow
def test_ep2_in_two_pipeline_stages_on_four_ranks(dist4) -> None:
    results = dist4.run(_pipelined, timeout=240)
    for r in results:
        if r["loss"] is not None:  # the last stage
            assert r["loss"] == pytest.approx(r["ref"], rel=1e-5)
    assert {tuple(r["experts"]) for r in results} == {
        (f"model.layers.{i}.mlp.experts.down_proj", f"model.layers.{i}.mlp.experts.gate_up_proj") for i in (0, 1)}


# ----------------------------------------------------------------------------- recipes and Hugging Face plans


def _recipe(rank: int, world: int, family: str, how: str) -> dict[str, Any]:
    model = FAMILIES[family]()
    if how == "tp_plan":  # the model's own base_model_tp_plan, incl. packed_colwise and moe_tp_experts
        sch = sf.recipes.from_tp_plan(sf.create_schedule(model, mesh=mesh((world,), ("tp",))))
    elif how == "plan_sp":  # as for a family without a recipe: its own plan, SP with the experts' block whole
        sch = sf.recipes.from_model_plan(model)(sf.create_schedule(model, mesh=mesh((world,), ("tp",))), tp=world,
                                                sequence_parallel=True)
    elif how in ("recipe_tp", "recipe_tp_sp"):  # with SP, the experts' block runs on the whole sequence
        sch = sf.recipes.for_model(model)(sf.create_schedule(model, mesh=mesh((world,), ("tp",))), tp=world,
                                          sequence_parallel=how == "recipe_tp_sp")
    else:
        sch = sf.recipes.for_model(model)(sf.create_schedule(model, mesh=mesh((world,), ("ep",))), ep=world,
                                          checkpoint=1.0)
    built, ref = sf.build(sch), sf.build(sf.create_schedule(model))
    x = ids(seq=8 if how.endswith("_sp") else 7)  # sequence shards split evenly
    # CommDebugMode's module tracker hands each module its own alias of a viewed input, which
    # hides from the runtime that Qwen2-MoE's shared gate/up projections read one tensor
    with CountCollectives() as fwd:
        o = built(x, labels=x, output_router_logits=True)
    with CountCollectives() as bwd:
        o.loss.backward()
    r = ref(x, labels=x, output_router_logits=True)
    r.loss.backward()
    torch.testing.assert_close(o.logits, r.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o.loss, r.loss, atol=1e-6, rtol=1e-6)
    ref_params = dict(ref.named_parameters())
    for name, p in built.named_parameters():
        torch.testing.assert_close(full(p.grad), ref_params[name].grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda s, n=name: f"{n}: {s}")
    return {"fwd": counts(fwd), "bwd": counts(bwd), "predicted": plan(sch).counts(),
            "experts": str(sch.annotations.get("model.layers.0.mlp.experts", EXPERTS))}


@pytest.mark.parametrize(("family", "how"), [("mixtral", "tp_plan"), ("qwen2_moe", "tp_plan"),
                                             ("qwen2_moe", "recipe_tp"), ("mixtral", "recipe_ep"),
                                             ("qwen3_moe", "tp_plan"), ("qwen3_moe", "recipe_tp"),
                                             ("mixtral", "recipe_tp_sp"), ("qwen2_moe", "recipe_tp_sp"),
                                             ("qwen3_moe", "recipe_tp_sp"), ("mixtral", "plan_sp"),
                                             ("qwen2_moe", "plan_sp")])
@pytest.mark.dist
def test_moe_recipes_and_hf_plans_match_the_single_process_model(dist2, family: str, how: str) -> None:
    for r in dist2.run(_recipe, family, how, timeout=150):
        assert r["experts"] == ("experts@ep(4)" if how == "recipe_ep" else "experts@tp(4)")
        predicted = {d: {k.replace("all_to_all", "all_to_all_single"): v for k, v in c.items()}
                     for d, c in r["predicted"].items()}
        if how == "recipe_ep":  # checkpointed layers recompute the counts' all-gather, dispatch and combine in
            # backward, and stop early, before the output's all-gather, which no saved tensor needs
            predicted["backward"]["all_to_all_single"] += predicted["forward"]["all_to_all_single"]
            predicted["backward"]["all_gather"] += 2
        assert {"forward": r["fwd"], "backward": r["bwd"]} == predicted


def test_hf_plan_and_recipe_agree_on_mixtral() -> None:
    model = tiny_mixtral()
    by_plan = sf.recipes.from_tp_plan(sf.create_schedule(model, mesh=fake_mesh(2)))
    by_recipe = sf.recipes.MIXTRAL(sf.create_schedule(model, mesh=fake_mesh(2)), tp=2)
    assert {k: str(v) for k, v in by_plan.annotations.of_kind(LAYOUT).items()} == \
        {k: str(v) for k, v in by_recipe.annotations.of_kind(LAYOUT).items()}
    assert by_plan.annotations.of_kind(EXPERTS) == by_recipe.annotations.of_kind(EXPERTS)
    # as a family without a recipe: the experts' block runs whole under SP, and the plan's
    # entries for layers the model does not have (DeepSeek's and GLM's dense first layers) are skipped
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.mlp.gate_proj": "colwise"}
    recipe = sf.recipes.from_model_plan(model)
    assert recipe.stacks[0].whole == ("mlp",)
    sch = recipe(sf.create_schedule(model, mesh=fake_mesh(2)), tp=2, sequence_parallel=True)
    assert [str(s) for s in sch.annotations.get("model.layers.1.mlp", SYNC)] == [
        "fwd_pre S(1)→R@tp (all_gather)", "fwd_post R→S(1)@tp (local)"]
    assert sf.recipes.for_model(tiny_qwen2_moe()) is sf.recipes.QWEN2_MOE
    with pytest.raises(sf.LayoutError, match="ep=2 needs a mesh with an 'ep' axis of size 2"):
        sf.recipes.MIXTRAL(sf.create_schedule(model, mesh=fake_mesh(2)), ep=2)
    with pytest.raises(sf.SelectorError):  # a plan passed in must match the model
        sf.recipes.from_tp_plan(sf.create_schedule(model, mesh=fake_mesh(2)), {"layers.*.mlp.up_proj": "colwise"})


# ----------------------------------------------------------------------------- checkpoints


def _save_ep2_load_ep1(rank: int, world: int, folder: str) -> bool:
    model = tiny_mixtral()
    sch = sf.expert_parallel(sf.create_schedule(model, mesh=mesh((world,), ("ep",))), "model.layers.*.mlp")
    built = sf.build(sch)
    with torch.no_grad():  # make the saved weights differ from the model's own
        for p in built.parameters():
            p.add_(1.0)
    sf.save(built, None, folder, step=1)
    single = sf.build(sf.create_schedule(tiny_mixtral()))
    sf.load(single, None, folder)
    expected = {n: full(p.detach()) for n, p in built.named_parameters()}
    loaded = dict(single.named_parameters())
    assert set(expected) == set(loaded)
    return all(torch.equal(loaded[n].detach(), expected[n]) for n in expected)


@pytest.mark.dist
def test_save_at_ep2_loads_at_ep1_bit_identical(dist2) -> None:
    folder = tempfile.mkdtemp()
    assert dist2.run(_save_ep2_load_ep1, folder, timeout=120) == [True, True]


# ----------------------------------------------------------------------------- schedules (no processes)


def test_expert_parallel_records_layouts_and_leaves_the_input_unchanged() -> None:
    model = tiny_mixtral()
    sch = sf.create_schedule(model, mesh=fake_mesh(2, names=("ep",)))
    new = sf.expert_parallel(sch, "model.layers.*.mlp", mesh_axis="ep")
    assert sch.annotations.of_kind(EXPERTS) == {}
    assert new.annotations.of_kind(EXPERTS) == {
        f"model.layers.{i}.mlp.experts": Experts("ep", 4, ("gate_up_proj", "down_proj")) for i in range(2)}
    lay = new.annotations.get("model.layers.1.mlp.experts.down_proj", LAYOUT)
    assert lay is not None and lay.local_shape((4, 64, 128)) == (2, 64, 128)
    assert "expert_parallel" in str(new.history[-1])
    # the same request again is a no-op; another capacity is refused
    assert sf.expert_parallel(new, "model.layers.*.mlp").annotations.of_kind(EXPERTS) == \
        new.annotations.of_kind(EXPERTS)
    with pytest.raises(sf.LayoutError, match="already spread as experts@ep"):
        sf.expert_parallel(new, "model.layers.0.mlp", capacity_factor=2.0)


def test_expert_parallel_errors_name_path_reason_and_fix() -> None:
    model = tiny_mixtral()
    with pytest.raises(sf.LayoutError, match=r"'model.layers.0.mlp.experts': 4 experts are not divisible by the "
                                             r"size 3 of mesh axis 'ep'") as e:
        sf.expert_parallel(sf.create_schedule(model, mesh=fake_mesh(3, names=("ep",))), "model.layers.*.mlp")
    assert e.value.paths == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")  # every one at once
    sch = sf.create_schedule(model, mesh=fake_mesh(2, names=("ep",)))
    with pytest.raises(sf.LayoutError, match=r"mesh axis 'tp' is not in the mesh \('ep',\)"):
        sf.expert_parallel(sch, "model.layers.*.mlp", mesh_axis="tp")
    with pytest.raises(sf.LayoutError, match="the schedule has no mesh"):
        sf.expert_parallel(sf.create_schedule(model), "model.layers.*.mlp")
    with pytest.raises(sf.LayoutError, match="a MixtralAttention is not a mixture-of-experts block") as e:
        sf.expert_parallel(sch, "model.layers.*.self_attn")
    assert "fix: select the MoE blocks only" in str(e.value)
    with pytest.raises(sf.LayoutError, match="is a parameter, not a mixture-of-experts block"):
        sf.expert_parallel(sch, "model.layers.0.mlp.gate.weight")
    sharded = sf.shard(sch, "model.layers.0.mlp.experts.gate_up_proj", axis=1, mesh_axis="ep")
    with pytest.raises(sf.LayoutError, match=r"experts': is already sharded as param@ep \(sf.shard of its parameters"):
        sf.expert_parallel(sharded, "model.layers.*.mlp")
    with pytest.raises(sf.LayoutError, match="capacity_factor': is -1.0; .* must be positive"):
        sf.expert_parallel(sch, "model.layers.*.mlp", capacity_factor=-1.0)
    with pytest.raises(sf.ScheduleTypeError, match="capacity_factor': expected a number or None, got str"):
        sf.expert_parallel(sch, "model.layers.*.mlp", capacity_factor="1")  # type: ignore[arg-type]
    with pytest.raises(sf.ScheduleTypeError, match="mesh_axis': expected a mesh-axis name, got int"):
        sf.expert_parallel(sch, "model.layers.*.mlp", mesh_axis=1)  # type: ignore[arg-type]
    assert sch.annotations.of_kind(EXPERTS) == {}


def test_expert_tensor_parallel_composes_with_expert_parallel() -> None:
    sch = sf.create_schedule(tiny_mixtral(), mesh=fake_mesh(2, 2, names=("ep", "tp")))
    both = sf.expert_tensor_parallel(sf.expert_parallel(sch, "model.layers.*.mlp"), "model.layers.*.mlp")
    other_order = sf.expert_parallel(sf.expert_tensor_parallel(sch, "model.layers.*.mlp"), "model.layers.*.mlp")
    for s in (both, other_order):
        spec = s.annotations.get("model.layers.0.mlp.experts", EXPERTS)
        assert spec == Experts("ep", 4, ("gate_up_proj", "down_proj"), None, "tp") and str(spec) == "experts@ep×tp(4)"
        gate_up = s.annotations.get("model.layers.0.mlp.experts.gate_up_proj", LAYOUT)
        assert str(gate_up) == "(ep=S(0), tp=S(1)×2)"  # the fused [gate; up], chunk by chunk
        assert gate_up.local_shape((4, 256, 64)) == (2, 128, 64)
        assert str(s.annotations.get("model.layers.0.mlp.experts.down_proj", LAYOUT)) == "(ep=S(0), tp=S(2))"
    assert plan(both).counts() == {"forward": {"all_gather": 4, "all_to_all": 4, "all_reduce": 2},
                                   "backward": {"all_to_all": 4, "all_reduce": 2, "all_gather": 2}}
    with pytest.raises(sf.LayoutError, match=r"intermediate size 128 is not divisible by the size 3 of mesh axis"):
        sf.expert_tensor_parallel(sf.create_schedule(tiny_mixtral(), mesh=fake_mesh(3, names=("tp",))),
                                  "model.layers.0.mlp")


def test_qwen2_moe_shared_expert_stays_replicated() -> None:
    sch = sf.create_schedule(tiny_qwen2_moe(), mesh=fake_mesh(2, names=("ep",)))
    new = sf.expert_parallel(sch, "model.layers.*.mlp")
    layouts = new.annotations.of_kind(LAYOUT)
    assert sorted(layouts) == sorted(f"model.layers.{i}.mlp.experts.{n}" for i in range(2)
                                     for n in ("gate_up_proj", "down_proj"))


def test_expert_costs_for_explain() -> None:
    sch = sf.expert_parallel(sf.create_schedule(tiny_mixtral(), mesh=fake_mesh(2, names=("ep",))),
                             "model.layers.*.mlp")
    costs = expert_costs(sch, tokens=64)  # top_k from the config's num_experts_per_tok
    assert costs == expert_costs(sch, tokens=64, top_k=2)
    # per layer, f32: gate_up [4, 256, 64] + down [4, 64, 128] = 4 * 24576 * 4 bytes, half per rank
    assert costs.param_bytes == 2 * (4 * (256 * 64 + 64 * 128) * 4) // 2
    # per layer: 32 tokens × 2 pairs per rank, half of them leave; 4 all-to-alls of 64 floats per pair
    assert costs.all_to_all_bytes == 2 * 4 * 32 * 64 * 4
    predicted = plan(sch).counts()
    assert costs.all_to_all_count == 8 == predicted["forward"]["all_to_all"] + predicted["backward"]["all_to_all"]
    skewed = expert_costs(sch, tokens=64, top_k=2, imbalance=1.5)
    assert skewed.all_to_all_bytes == costs.all_to_all_bytes * 3 // 2
    assert expert_costs(sch, tokens=64, top_k=2, dtype=torch.bfloat16).all_to_all_bytes == costs.all_to_all_bytes // 2
    assert costs.blocks == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


def test_explain_sizes_the_expert_exchanges_and_runs_the_experts_fake() -> None:
    """explain's fake run routes evenly (the real experts index tokens by routing data,
    which fake tensors cannot): activations are counted, the pairs dispatched and combined
    are T·k rows of the hidden size (the full tensor; each rank sends (ep−1)/ep² of it, as
    expert_costs says), the counts are [ep, E] integers, and the expert parameters are
    split over ep in the memory table."""
    model = tiny_mixtral()
    sch = sf.expert_parallel(sf.create_schedule(model, mesh=fake_mesh(2, names=("ep",))), "model.layers.*.mlp")
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    info = sf.explain(sch, ids)
    text = str(info)
    assert "fake run failed" not in text and "activations" in text
    sizes = {(c.side, c.direction, c.op): c.bytes for c in info.tensor_parallel.collectives
             if c.path == "model.layers.0.mlp.experts"}
    hidden, pairs = model.config.hidden_size, 4 * 16 * model.config.num_experts_per_tok
    assert sizes[("dispatch", "forward", "all_to_all")] == pairs * hidden * 4
    assert sizes[("combine", "backward", "all_to_all")] == pairs * hidden * 4
    assert sizes[("counts", "forward", "all_gather")] == 2 * 4 * 8
    costs = expert_costs(sch, tokens=4 * 16)
    per_exchange = costs.all_to_all_bytes // costs.all_to_all_count  # what leaves one rank, one all-to-all
    assert per_exchange == pairs * hidden * 4 * (2 - 1) // 2**2
    skewed = sf.explain(sch, ids, expert_imbalance=1.5).tensor_parallel
    assert skewed is not None
    assert {c.bytes for c in skewed.collectives if c.side in ("dispatch", "combine")} == {pairs * hidden * 4 * 3 // 2}
    assert expert_costs(sch, tokens=4 * 16, imbalance=1.5).all_to_all_bytes == costs.all_to_all_bytes * 3 // 2
    with pytest.raises(sf.ScheduleError, match="expert_imbalance': must be a number >= 1, got 0.5"):
        sf.explain(sch, ids, expert_imbalance=0.5)
    assert "fake run failed" not in str(sf.explain(sf.create_schedule(model), ids))  # unsharded: the same
    for path, _ in model.named_modules():  # the user's model is untouched by the stand-in forward
        assert "forward" not in vars(model.get_submodule(path))
