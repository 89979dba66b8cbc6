"""The functional loop (sf.func + sf.optim) on gloo ranks, against the module loop and
the single-process model: at tp=2, at dp2×tp2 with FSDP2, and at pp=2 (GPT-2, whose tied
embedding and head sit on different stages). Also global norms across meshes, constrain,
local with a psum inside, torch.func.grad over apply_fn, and optimizer state saved at
tp=2 and loaded at dp=2."""

from __future__ import annotations

import math
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist import mesh
from models import VOCAB, megatron_llama, tiny_llama, token_ids
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import slapo_fn as sf
from slapo_fn.func import P

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

STEPS, LR, WD, MAX_NORM = 3, 1e-2, 0.1, 0.5


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def gpt2(layers: int = 2) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=8, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _reference(make: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The unscheduled model in one process: torch's clip_grad_norm_ and AdamW."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = ce(model(batch["ids"]).logits, batch["target"])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}}


def _build(layout: str, world: int) -> Any:
    if layout == "pp2":
        sch = sf.cut_pipeline_stage(sf.create_schedule(gpt2(), mesh=mesh((world,), ("pp",))), "transformer.h.0")
        return sf.build_pipeline(sch, microbatches=2, schedule="1f1b", loss_fn=ce)
    shape, names = ((2,), ("tp",)) if layout == "tp2" else ((2, 2), ("dp", "tp"))
    sch = megatron_llama(sf.create_schedule(tiny_llama(), mesh=mesh(shape, names)))
    if layout == "dp2tp2":
        sch = sf.data_parallel(sch)
    return sf.build(sch)


def _functional_loop(layout: str, world: int, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    built = _build(layout, world)
    apply_fn, params, _ = sf.func.functional(built)
    if layout == "pp2":
        step_fn = sf.func.value_and_grad(apply_fn)
        args: tuple[Any, ...] = (batch["ids"],)
        kwargs = {"target": batch["target"]}
    else:
        def loss_fn(ps: dict[str, torch.Tensor], ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return ce(apply_fn(ps, ids).logits, target)

        step_fn = sf.func.value_and_grad(loss_fn)
        args, kwargs = (batch["ids"], batch["target"]), {}
    init, update = sf.optim.adamw(LR, weight_decay=WD)
    state = init(params)
    pipe = built if layout == "pp2" else None
    losses, norms = [], []
    for _ in range(STEPS):
        loss, grads = step_fn(params, *args, **kwargs)
        grads, norm = sf.func.clip_by_global_norm(grads, MAX_NORM, pipeline=pipe)
        params, state = update(grads, state, params)
        losses.append(float(loss.detach()))
        norms.append(float(norm))
    untouched = all(p.grad is None for _, p in built.named_parameters())
    return {"losses": losses, "norms": norms, "params": {n: _full(p).detach().clone() for n, p in params.items()},
            "untouched": untouched, "state_layouts_match": all(
                sf.func.specs(state["exp_avg"])[n] == sf.func.specs(params)[n] for n in params)}


def _module_loop(layout: str, world: int, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    built = _build(layout, world)
    opt = torch.optim.AdamW(list(built.parameters()), lr=LR, weight_decay=WD, foreach=True)
    losses, norms = [], []
    for _ in range(STEPS):
        if layout == "pp2":
            loss = built.step(batch["ids"], target=batch["target"])
        else:
            loss = ce(built(batch["ids"]).logits, batch["target"])
            loss.backward()
        norms.append(float(sf.clip_grad_norm_(built, MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms,
            "params": {n: _full(p).detach().clone() for n, p in built.named_parameters()}}


def _loops(rank: int, world: int, layout: str) -> dict[str, Any]:
    batch = {"ids": token_ids(4, 8, seed=1), "target": token_ids(4, 8, seed=2)}
    make = gpt2 if layout == "pp2" else tiny_llama
    ref = _reference(make, batch)
    fun = _functional_loop(layout, world, batch)
    mod = _module_loop(layout, world, batch)
    worst = {k: max(float((p - ref["params"][n]).abs().max()) for n, p in r["params"].items())
             for k, r in (("functional", fun), ("module", mod))}
    fun_vs_mod = max(float((p - mod["params"][n]).abs().max()) for n, p in fun["params"].items())
    return {"ref": {k: ref[k] for k in ("losses", "norms")}, "fun": {k: fun[k] for k in ("losses", "norms")},
            "mod": {k: mod[k] for k in ("losses", "norms")}, "worst": worst, "fun_vs_mod": fun_vs_mod,
            "untouched": fun["untouched"], "state_layouts_match": fun["state_layouts_match"],
            "names": sorted(fun["params"])}


@pytest.mark.parametrize(("layout", "world"), [("tp2", 2), ("dp2tp2", 4), ("pp2", 2)])
def test_functional_loop_equals_module_loop_and_the_single_process_model(dist_pool: Any, layout: str,
                                                                         world: int) -> None:
    results = dist_pool(world).run(_loops, layout, timeout=280)
    for r in results:
        assert r["ref"]["norms"][0] > MAX_NORM  # clipping is active
        # functional loop == module loop (torch.optim.AdamW(foreach=True) + sf.clip_grad_norm_)
        assert r["fun"]["losses"] == pytest.approx(r["mod"]["losses"], abs=1e-5), layout
        assert r["fun"]["norms"] == pytest.approx(r["mod"]["norms"], rel=1e-5), layout
        assert r["fun_vs_mod"] < 1e-5, layout  # pure AdamW == torch.optim.AdamW
        # both == the single-process model with torch's clip_grad_norm_ and AdamW
        assert r["fun"]["losses"] == pytest.approx(r["ref"]["losses"], abs=1e-5), layout
        assert r["fun"]["norms"] == pytest.approx(r["ref"]["norms"], rel=1e-5), layout
        assert r["mod"]["norms"] == pytest.approx(r["ref"]["norms"], rel=1e-5), layout
        assert max(r["worst"].values()) < 1e-4, (layout, r["worst"])
        assert r["untouched"], "value_and_grad must leave .grad as it found it"
        assert r["state_layouts_match"]
    if layout == "pp2":  # each rank updates its own stage; the tie is on both
        assert "lm_head.weight" in results[1]["names"] and "transformer.wte.weight" in results[0]["names"]


# ----------------------------------------------------------------------------- global norms across meshes


def _mixed_norms(rank: int, world: int) -> list[dict[str, float]]:
    full_mesh = mesh((2, 2), ("dp", "tp"))
    tp_mesh = full_mesh["tp"]
    torch.manual_seed(0)
    full = {f"t{i}": torch.randn(4, 6) * (i + 1) for i in range(6)}
    grads: dict[str, torch.Tensor] = {
        "t0": distribute_tensor(full["t0"], full_mesh, [Shard(0), Shard(1)]),
        "t1": distribute_tensor(full["t1"], full_mesh, [Replicate(), Shard(0)]),
        "t2": distribute_tensor(full["t2"], tp_mesh, [Shard(1)]),  # the TP sub-mesh
        "t3": distribute_tensor(full["t3"], tp_mesh, [Replicate()]),
        "t4": full["t4"],  # a plain tensor
        "t5": distribute_tensor(full["t5"], full_mesh, [Shard(0), Replicate()]),
    }
    out = []
    for p in (2.0, 1.0, math.inf):
        expect = torch.nn.utils.get_total_norm(list(full.values()), p)
        with CommDebugMode() as comm:
            got = sf.func.global_norm(grads, norm_type=p)
        out.append({"p": p, "got": float(got), "expect": float(expect), "collectives": comm.get_total_counts()})
    return out


def test_global_norm_across_meshes_equals_the_single_process_norm(dist4: Any) -> None:
    for per_rank in dist4.run(_mixed_norms, timeout=120):
        for r in per_rank:
            assert r["got"] == pytest.approx(r["expect"], rel=1e-6), r
            # one all-reduce per (mesh, sharded mesh dim) group, not per leaf: t0 (dp, tp),
            # t1 and t5 (tp | dp) on the full mesh, t2 on the tp sub-mesh
            assert r["collectives"] <= 5, r


# ----------------------------------------------------------------------------- constrain, local, torch.func


def _constrain(rank: int, world: int) -> dict[str, Any]:
    tp = mesh((2,), ("tp",))
    x = torch.arange(12.0).reshape(3, 4).requires_grad_(True)
    with CommDebugMode() as comm:
        y = sf.func.constrain(x, P(None, "tp"), tp)
        local = y.to_local().detach().clone()
        z = sf.func.constrain(y * y, P())
        z.to_local().sum().backward()
    return {"local": local, "placements": [str(p) for p in y.placements], "grad": x.grad.clone(),
            "counts": {str(k): v for k, v in comm.get_comm_counts().items()}}


def test_constrain_forward_and_backward(dist2: Any) -> None:
    x = torch.arange(12.0).reshape(3, 4)
    for rank, r in enumerate(dist2.run(_constrain, timeout=60)):
        assert torch.equal(r["local"], x[:, 2 * rank: 2 * rank + 2])
        assert r["placements"] == ["S(1)"]
        assert torch.equal(r["grad"], 2 * x)  # d/dx sum(x*x), back through the gather and the split
        assert sum(r["counts"].values()) >= 1  # the gather back to P() is a collective


def _local_psum(rank: int, world: int) -> dict[str, Any]:
    tp = mesh((2,), ("tp",))
    w = distribute_tensor(torch.arange(8.0).reshape(2, 4), tp, [Shard(1)]).requires_grad_(True)

    def partial_norm(local_w: torch.Tensor) -> torch.Tensor:
        return sf.func.psum((local_w * local_w).sum(), "tp", tp)

    fn = sf.func.local(partial_norm, in_specs=(P(None, "tp"),), out_specs=P(), mesh=tp)
    out = fn(w)
    out.to_local().backward()
    return {"out": float(_full(out).detach()), "grad": _full(w.grad).detach().clone(),
            "spec": sf.func.specs({"w": w})["w"]}


def test_local_with_a_psum_inside(dist2: Any) -> None:
    w = torch.arange(8.0).reshape(2, 4)
    for r in dist2.run(_local_psum, timeout=60):
        assert r["out"] == float((w * w).sum())
        assert torch.equal(r["grad"], 2 * w)
        assert r["spec"] == P(None, "tp")


def _torch_func_grad(rank: int, world: int) -> dict[str, float]:
    ids, target = token_ids(2, 8, seed=1), token_ids(2, 8, seed=2)
    built = sf.build(megatron_llama(sf.create_schedule(tiny_llama(), mesh=mesh((2,), ("tp",)))))
    apply_fn, params, _ = sf.func.functional(built)

    def loss_fn(ps: dict[str, torch.Tensor]) -> torch.Tensor:
        return ce(apply_fn(ps, ids).logits, target)

    detached = {k: v.detach() for k, v in params.items()}
    by_torch = torch.func.grad(loss_fn)(detached)
    _, ours = sf.func.value_and_grad(loss_fn)(params)
    reference = tiny_llama()
    ce(reference(ids).logits, target).backward()
    return {
        # arithmetic on the DTensors torch.func.grad returned (they must outlive the transform)
        "torch_vs_ours": max(float((_full(by_torch[k] * 1) - _full(ours[k])).abs().max()) for k in ours),
        "ours_vs_ref": max(float((_full(ours[k]) - reference.get_parameter(k).grad).abs().max()) for k in ours),
        "same_layouts": float(sf.func.specs(by_torch) == sf.func.specs(params)),
    }


def test_torch_func_grad_over_apply_fn_of_a_tp_llama(dist2: Any) -> None:
    for r in dist2.run(_torch_func_grad, timeout=120):
        assert r["torch_vs_ours"] < 1e-6
        assert r["ours_vs_ref"] < 1e-5
        assert r["same_layouts"] == 1.0


def _vmap_refused(rank: int, world: int) -> str:
    tp = mesh((2,), ("tp",))
    w = distribute_tensor(torch.ones(4, 4), tp, [Shard(0)])
    try:
        sf.func.vmap(lambda t: t * 2)(w)
    except sf.func.TransformError as e:
        return str(e)
    return "accepted"


def test_vmap_over_dtensors_is_refused_with_a_clear_error(dist2: Any) -> None:
    for text in dist2.run(_vmap_refused, timeout=60):
        assert "cannot vmap over DTensor code" in text and "'args[0]'" in text, text


# ----------------------------------------------------------------------------- optimizer state under another layout


def _state_resharded(rank: int, world: int, path: str) -> dict[str, Any]:
    ids = token_ids(2, 8, seed=1)
    init, update = sf.optim.adamw(LR, weight_decay=WD)

    def trained(sch: sf.Schedule) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        built = sf.build(sch)
        apply_fn, params, _ = sf.func.functional(built)
        state = init(params)
        _, grads = sf.func.value_and_grad(lambda ps: apply_fn(ps, ids, labels=ids).loss)(params)
        params, state = update(grads, state, params)
        return built, params, state

    built, params, state = trained(megatron_llama(sf.create_schedule(tiny_llama(), mesh=mesh((2,), ("tp",)))))
    sf.save(built, state, path, step=1)
    saved = {k: _full(v).clone() for k, v in state["exp_avg_sq"].items()}
    other = sf.build(sf.data_parallel(sf.create_schedule(tiny_llama(), mesh=mesh((2,), ("dp",)))))
    _, params2, _ = sf.func.functional(other)
    state2 = init(params2)
    step = sf.load(other, state2, path)
    layouts = {str(sf.func.specs(state2["exp_avg_sq"])[k]) for k in state2["exp_avg_sq"]}
    return {
        "step": step,
        "state_diff": max(float((_full(v) - saved[k]).abs().max()) for k, v in state2["exp_avg_sq"].items()),
        "steps": sorted({float(v) for v in state2["step"].values()}),
        "param_diff": max(float((_full(params2[k]) - _full(params[k])).abs().max()) for k in params),
        "layouts": sorted(layouts),
    }


def test_optimizer_state_saved_at_tp2_loads_at_dp2(dist2: Any) -> None:
    path = tempfile.mkdtemp()
    for r in dist2.run(_state_resharded, path, timeout=120):
        assert r["step"] == 1
        assert r["state_diff"] == 0.0 and r["param_diff"] == 0.0
        assert r["steps"] == [1.0]
        assert "P('dp', None)" in r["layouts"]  # FSDP2's layout, not the saved TP one


# ----------------------------------------------------------------------------- torch.compile of the whole step


def _compiled_steps(rank: int, world: int) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    ids = token_ids(2, 8, seed=1)

    def run(compiled: bool) -> tuple[list[float], list[int]]:
        built = sf.build(megatron_llama(sf.create_schedule(tiny_llama(), mesh=mesh((2,), ("tp",)))))
        apply_fn, params, _ = sf.func.functional(built)
        init, update = sf.optim.adamw(LR, weight_decay=WD)
        state = init(params)
        value_and_grad = sf.func.value_and_grad(lambda ps, x: ce(apply_fn(ps, x).logits, x))

        def step(params: dict, state: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
            loss, grads = value_and_grad(params, x)
            grads, _ = sf.func.clip_by_global_norm(grads, MAX_NORM)
            params, state = update(grads, state, params)
            return loss, params, state

        fn = torch.compile(step, backend="eager") if compiled else step
        losses, graphs = [], []
        for _ in range(10):
            loss, params, state = fn(params, state, ids)
            losses.append(float(loss))
            graphs.append(int(counters["stats"]["unique_graphs"]))
        return losses, graphs

    torch._dynamo.reset()
    counters.clear()
    compiled, graphs = run(True)
    eager, _ = run(False)
    return {"compiled": compiled, "eager": eager, "graphs": graphs}


@pytest.mark.slow  # about 90 s on 2 cores, most of it dynamo tracing
def test_the_whole_functional_step_compiles_once(dist2: Any) -> None:
    for r in dist2.run(_compiled_steps, timeout=280):
        assert r["graphs"][0] >= 1
        assert r["graphs"][1:] == [r["graphs"][0]] * 9, r["graphs"]  # no recompiles over 10 steps
        assert r["compiled"] == pytest.approx(r["eager"], rel=2e-5)  # dynamo folds Python scalars in float64


def _specs_of_a_schedule(rank: int, world: int) -> dict[str, Any]:
    sch = megatron_llama(sf.create_schedule(tiny_llama(), mesh=mesh((2,), ("tp",))))
    sch = sf.shard(sch, "lm_head", layout=P(None, "tp"))  # a spec as the layout of a shard
    _, params, _ = sf.func.functional(sf.build(sch))
    got = sf.func.specs(params)
    rendered = {k: sf.dtensor.Layout(tuple(v.placements), ("tp",), (2,)).format(tuple(v.shape), v.dtype)
                for k, v in params.items() if k.startswith(("lm_head", "model.layers.0.self_attn"))}
    again = sf.func.specs(sf.func.shard({k: _full(v) for k, v in params.items()}, got, params["lm_head.weight"]
                                        .device_mesh))
    return {"specs": {k: repr(v) for k, v in got.items()}, "rendered": rendered, "round_trip": again == got}


def test_specs_agree_with_the_schedule_and_round_trip(dist2: Any) -> None:
    for r in dist2.run(_specs_of_a_schedule, timeout=120):
        specs = r["specs"]
        assert specs["model.layers.0.self_attn.q_proj.weight"] == "P('tp', None)"
        assert specs["model.layers.0.self_attn.o_proj.weight"] == "P(None, 'tp')"
        assert specs["model.layers.1.mlp.down_proj.weight"] == "P(None, 'tp')"
        assert specs["model.norm.weight"] == "P(None)"
        assert specs["lm_head.weight"] == "P(None, 'tp')"
        assert r["rendered"]["lm_head.weight"] == "f32[128, 64@tp]"  # what explain prints
        assert r["rendered"]["model.layers.0.self_attn.q_proj.weight"] == "f32[64@tp, 64]"
        assert r["round_trip"]


def _new_values_on_dtensor_plans(rank: int, world: int) -> list[str]:
    """Per plan the model runs (partly) on DTensors for: the loss and every gradient of
    ``value_and_grad`` over ``apply_fn`` with new parameter values (every one halved, new
    tensors, as a JAX-style update makes them) against the single-process model with the
    same values; each gradient in its parameter's layout."""
    from torch.distributed.tensor import Shard

    ids = token_ids()
    plans = {
        # a sequence-parallel chain with no shard in it: the whole model on DTensors, its norms'
        # gradients partial sums (no hook on the tensors passed in reduced them)
        "chain": lambda s: sf.sequence_parallel(s, ["model.layers.*", "model.norm"]),
        # one attention on DTensors: its islands read their parameters by name (get_parameter
        # refused a plain tensor there: "`weight` is not an nn.Parameter")
        "region": lambda s: sf.sync(megatron_llama(s), "model.layers.0.self_attn", "fwd_pre", Shard(-1)),
    }
    out = []
    for name, plan in plans.items():
        built = sf.build(plan(sf.create_schedule(tiny_llama(), mesh=mesh((world,), ("tp",)))))
        apply_fn, params, _ = sf.func.functional(built)
        r_apply, r_params, _ = sf.func.functional(tiny_llama())
        new = {k: (v.detach() * 0.5).requires_grad_() for k, v in params.items()}
        r_new = {k: (v.detach() * 0.5).requires_grad_() for k, v in r_params.items()}
        loss, grads = sf.func.value_and_grad(lambda p, f=apply_fn: f(p, ids).logits.pow(2).mean())(new)
        want, r_grads = sf.func.value_and_grad(lambda p, f=r_apply: f(p, ids).logits.pow(2).mean())(r_new)
        worst = max((_full(g) - r_grads[k]).abs().max().item() for k, g in grads.items())
        placed = all(tuple(g.placements) == tuple(params[k].placements) for k, g in grads.items())
        out.append(f"{name}: loss {abs(loss.item() - want.item()) < 1e-5} grads {worst < 1e-5} placed {placed}")
    return out


def test_value_and_grad_with_new_values_on_plans_on_dtensors(dist2: Any) -> None:
    for r in dist2.run(_new_values_on_dtensor_plans, timeout=200):
        assert r == [f"{n}: loss True grads True placed True" for n in ("chain", "region")], r
