"""sf.func and sf.optim in one process: partition specs (round trips, errors), gradients
of pytrees, the model as a function, pure optimizers against torch.optim step for step,
global norms and clipping against torch's, checkpoints of optimizer state, and the
transforms PyTorch cannot do over DTensors."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import MLP
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import slapo_fn as sf
from slapo_fn.dtensor.spec import placements_of, spec_of
from slapo_fn.func import P, Packed

MESH_DIMS, MESH_SHAPE = ("dp", "tp", "pp"), (2, 4, 2)


# ----------------------------------------------------------------------------- specs


def test_partition_specs_compare_like_jax() -> None:
    assert P("tp", None) == P("tp") == ("tp",)
    assert P(("tp",)) == P("tp")
    assert hash(P("tp", None, None)) == hash(P("tp"))
    assert P("dp", "tp") != P("tp", "dp")
    assert repr(P(None, ("dp", "tp"), Packed("tp", 3))) == "P(None, ('dp', 'tp'), Packed('tp', 3))"
    with pytest.raises(TypeError, match="PartitionSpec entry"):
        P(3)


@st.composite
def spec_and_shape(draw: st.DrawFn) -> tuple[P, tuple[int, ...]]:
    ndim = draw(st.integers(1, 3))
    free = list(MESH_DIMS)
    entries: list[object] = []
    shape = []
    for _ in range(ndim):
        kind = draw(st.sampled_from(["none", "one", "two", "packed"]))
        parts = 1
        if kind == "one" and free:
            name = draw(st.sampled_from(free))
            free.remove(name)
            entries.append(name)
            parts = MESH_SHAPE[MESH_DIMS.index(name)]
        elif kind == "two" and len(free) >= 2:
            pair = draw(st.permutations(free))[:2]
            for n in pair:
                free.remove(n)
            entries.append(tuple(pair))
            parts = math.prod(MESH_SHAPE[MESH_DIMS.index(n)] for n in pair)
        elif kind == "packed" and free:
            name = draw(st.sampled_from(free))
            free.remove(name)
            k = draw(st.integers(2, 3))
            entries.append(Packed(name, k))
            parts = MESH_SHAPE[MESH_DIMS.index(name)] * k
        else:
            entries.append(None)
        shape.append(parts * draw(st.integers(1, 3)))
    return P(*entries), tuple(shape)


@given(spec_and_shape())
@settings(max_examples=200, deadline=None)
def test_specs_round_trip_through_placements(case: tuple[P, tuple[int, ...]]) -> None:
    spec, shape = case
    placements = placements_of(spec, MESH_DIMS, MESH_SHAPE, shape=shape)
    assert spec_of(placements, MESH_DIMS, ndim=len(shape), mesh_shape=MESH_SHAPE) == spec


def test_spec_layouts_are_dtensor_placements() -> None:
    assert placements_of(P("tp", None), MESH_DIMS, MESH_SHAPE) == (Replicate(), Shard(0), Replicate())
    assert placements_of(P(None, ("dp", "tp")), MESH_DIMS, MESH_SHAPE) == (Shard(1), Shard(1), Replicate())
    # FSDP2 over a TP shard: the TP axis is major
    assert placements_of(P(("tp", "dp")), MESH_DIMS, MESH_SHAPE) == (_StridedShard(0, split_factor=4), Shard(0),
                                                                     Replicate())
    assert placements_of(P(Packed("tp", 3)), MESH_DIMS, MESH_SHAPE) == (Replicate(), _StridedShard(0, split_factor=3),
                                                                        Replicate())


def test_bad_specs_name_the_leaf_and_every_problem() -> None:
    with pytest.raises(sf.LayoutError) as info:
        placements_of(P("xx", "tp", "tp", None), MESH_DIMS, MESH_SHAPE, shape=(6, 6, 8), path="w")
    text = str(info.value)
    assert info.value.paths == ("w",) * 4, text
    assert "mesh axis 'xx', which the mesh lacks" in text
    assert "uses mesh axis 'tp' twice" in text
    assert "4 entries for a tensor of 3 dimensions" in text
    assert "dimension 1 of size 6 does not split into 4 even parts" in text
    with pytest.raises(sf.LayoutError, match="cannot lay out"):
        placements_of(P(("pp", "tp", "dp")), MESH_DIMS, MESH_SHAPE)


def test_specs_of_plain_tensors_and_other_leaves() -> None:
    tree = {"a": torch.zeros(2, 3), "b": [torch.zeros(4), "text"], "c": None}
    assert sf.func.specs(tree) == {"a": P(None, None), "b": [P(None), None], "c": None}


def test_partial_has_no_spec() -> None:
    from torch.distributed.tensor import Partial

    with pytest.raises(sf.LayoutError, match="Partial over mesh axis 'tp'"):
        spec_of((Replicate(), Partial(), Replicate()), MESH_DIMS, ndim=2, path="g")


# ----------------------------------------------------------------------------- gradients and apply_fn


def test_value_and_grad_of_pytrees_with_aux_and_several_argnums() -> None:
    tree = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([3]), "nested": (torch.tensor(2.0),)}
    x = torch.tensor([5.0, 7.0])

    def f(t: dict, y: torch.Tensor) -> tuple[torch.Tensor, str]:
        return (t["w"] * y).sum() * t["nested"][0] + t["n"].float().sum(), "aux"

    (value, aux), (gt, gy) = sf.func.value_and_grad(f, argnums=(0, 1), has_aux=True)(tree, x)
    assert value.item() == (5 + 14) * 2 + 3 and aux == "aux"
    assert gt["w"].tolist() == [10.0, 14.0] and gt["n"] is None and gt["nested"][0].item() == 19.0
    assert gy.tolist() == [2.0, 4.0]
    assert not tree["w"].requires_grad  # the inputs are not touched
    grads, aux = sf.func.grad(f, has_aux=True)(tree, x)
    assert grads["w"].tolist() == [10.0, 14.0] and aux == "aux"


def test_value_and_grad_refuses_what_is_not_a_scalar_loss() -> None:
    with pytest.raises(sf.ScheduleTypeError, match=r"scalar float loss, got a tensor of shape \(2,\)"):
        sf.func.value_and_grad(lambda t: t * 2)(torch.ones(2))
    with pytest.raises(sf.ScheduleTypeError, match=r"has_aux=True: the function must return \(loss, aux\)"):
        sf.func.value_and_grad(lambda t: t.sum(), has_aux=True)(torch.ones(2))
    with pytest.raises(sf.ScheduleTypeError, match="argnums"):
        sf.func.value_and_grad(lambda t: t.sum(), argnums=3)(torch.ones(2))


def test_apply_fn_runs_the_model_with_its_own_or_other_parameters() -> None:
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(3, 8)
    apply_fn, params, buffers = sf.func.functional(model)
    assert set(params) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"} and buffers == {}
    assert all(params[k] is p for k, p in model.named_parameters())  # the model's own: donate updates them
    assert torch.equal(apply_fn(params, x), model(x))
    doubled = {k: 2 * v.detach() for k, v in params.items()}
    expect = nn.functional.linear(nn.functional.gelu(nn.functional.linear(x, doubled["fc1.weight"],
                                                                          doubled["fc1.bias"])),
                                  doubled["fc2.weight"], doubled["fc2.bias"])
    assert torch.allclose(apply_fn(doubled, x), expect)
    with pytest.raises(sf.ScheduleError, match="'fc3.weight'"):
        apply_fn({"fc3.weight": torch.zeros(1)}, x)


def test_gradients_of_the_models_own_parameters_leave_grad_as_it_was() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(3, 8)
    apply_fn, params, _ = sf.func.functional(model)
    model.fc1.weight.grad = torch.full_like(model.fc1.weight, 7.0)
    _loss, grads = sf.func.value_and_grad(lambda p: apply_fn(p, x).square().mean())(params)
    assert torch.equal(model.fc1.weight.grad, torch.full_like(model.fc1.weight, 7.0))
    assert model.fc2.weight.grad is None
    model.fc1.weight.grad = None
    model(x).square().mean().backward()
    assert all(torch.allclose(grads[k], p.grad) for k, p in model.named_parameters())
    by_torch = torch.func.grad(lambda p: apply_fn(p, x).square().mean())({k: v.detach() for k, v in params.items()})
    assert all(torch.allclose(grads[k], by_torch[k]) for k in grads)


# ----------------------------------------------------------------------------- optimizers


def _train(make_opt: object, functional: bool, steps: int = 5, **kw: object) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    if not functional:
        opt = make_opt(model.parameters())  # type: ignore[operator]
        for _ in range(steps):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.named_parameters()}
    init, update = make_opt  # type: ignore[misc]
    apply_fn, params, _ = sf.func.functional(model)
    state = init(params)
    for _ in range(steps):
        _, grads = sf.func.value_and_grad(lambda p: apply_fn(p, x).square().mean())(params)
        params, state = update(grads, state, params, **kw)
    return {k: v.detach().clone() for k, v in params.items()}


ADAMW = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}


@pytest.mark.parametrize("flags", [{}, {"foreach": True}, {"foreach": False}, {"fused": True}, {"amsgrad": True},
                                   {"maximize": True}], ids=str)
def test_pure_adamw_equals_torch_adamw(flags: dict) -> None:
    ours = _train(sf.optim.adamw(**ADAMW, **flags), functional=True)
    theirs = _train(lambda ps: torch.optim.AdamW(ps, **ADAMW, **flags), functional=False)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), {k: (ours[k] - theirs[k]).abs().max() for k in ours}


@pytest.mark.parametrize("flags", [{}, {"foreach": True}, {"fused": True}], ids=str)
@pytest.mark.parametrize("default", [torch.float32, torch.float64], ids=str)
def test_adamw_step_counters_live_where_torch_adamw_keeps_them(flags: dict, default: torch.dtype) -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        ours = sf.optim.adamw(**ADAMW, **flags).init({"w": torch.ones(3)})["step"]["w"]
        param = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([param], **ADAMW, **flags)
        param.grad = torch.ones(3)
        opt.step()
        theirs = opt.state[param]["step"]
    finally:
        torch.set_default_dtype(previous)
    assert (ours.device, ours.dtype, ours.shape) == (theirs.device, theirs.dtype, theirs.shape)
    # the fused kernels count on the parameter's device (meta stands in for a CUDA one here)
    init, update = sf.optim.adamw(**ADAMW, **flags)
    params = {"w": torch.ones(3, device="meta")}
    state = init(params)
    assert state["step"]["w"].device.type == ("meta" if flags.get("fused") else "cpu")
    update({"w": torch.ones(3, device="meta")}, state, params)


@pytest.mark.parametrize("args", [{"lr": 0.1}, {"lr": 0.1, "momentum": 0.9}, {"lr": 0.1, "momentum": 0.9,
                                  "dampening": 0.5}, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                  "weight_decay": 0.01}, {"lr": 0.1, "momentum": 0.5, "foreach": True}], ids=str)
def test_pure_sgd_equals_torch_sgd(args: dict) -> None:
    ours = _train(sf.optim.sgd(**args), functional=True)
    theirs = _train(lambda ps: torch.optim.SGD(ps, **args), functional=False)
    assert all(torch.allclose(ours[k], theirs[k], atol=1e-7, rtol=0) for k in ours)


def test_donate_false_leaves_params_and_state_unchanged_and_a_schedule_sets_lr() -> None:
    init, update = sf.optim.adamw(lambda step: 0.1 / step, weight_decay=0.0)
    params = {"w": torch.tensor([1.0, -1.0])}
    state = init(params)
    grads = {"w": torch.tensor([1.0, 1.0])}
    new, new_state = update(grads, state, params, donate=False)
    assert params["w"].tolist() == [1.0, -1.0] and state["step"]["w"].item() == 0.0
    assert new["w"] is not params["w"] and new_state["step"]["w"].item() == 1.0
    assert new["w"].tolist() == pytest.approx([0.9, -1.1])  # step 1: lr 0.1, Adam's first step is lr * sign
    again, _ = update(grads, new_state, new, donate=True)
    assert again["w"] is new["w"] and again["w"].tolist() == pytest.approx([0.85, -1.15])  # step 2: lr 0.05


def test_none_gradients_leave_their_parameter_alone() -> None:
    init, update = sf.optim.adamw(0.1)
    params = {"a": torch.ones(2), "b": torch.ones(2)}
    params, state = update({"a": torch.ones(2), "b": None}, init(params), params)
    assert params["b"].tolist() == [1.0, 1.0] and state["step"]["b"].item() == 0.0
    assert params["a"].tolist() != [1.0, 1.0]


def test_optimizer_arguments_are_checked() -> None:
    with pytest.raises(sf.ScheduleError, match="2 problems") as info:
        sf.optim.adamw(-1.0, betas=(0.9, 1.5))
    assert set(info.value.paths) == {"lr", "betas[1]"}
    with pytest.raises(sf.ScheduleError, match="nesterov"):
        sf.optim.sgd(0.1, nesterov=True)
    init, update = sf.optim.sgd(0.1)
    with pytest.raises(sf.ScheduleTypeError, match="grads"):
        update({"x": torch.ones(1)}, init({"w": torch.ones(1)}), {"w": torch.ones(1)})


# ----------------------------------------------------------------------------- norms and clipping


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf])
def test_global_norm_and_clipping_equal_torchs(p: float) -> None:
    torch.manual_seed(0)
    grads = {"a": torch.randn(3, 4), "b": [torch.randn(5) * 3], "c": "not a tensor"}
    tensors = [grads["a"], grads["b"][0]]
    assert sf.func.global_norm(grads, norm_type=p).item() == pytest.approx(
        torch.nn.utils.get_total_norm(tensors, p).item(), rel=1e-6)
    clipped, norm = sf.func.clip_by_global_norm(grads, 0.5, norm_type=p)
    holders = [nn.Parameter(torch.zeros_like(t)) for t in tensors]
    for h, t in zip(holders, tensors, strict=True):
        h.grad = t.clone()
    expect = torch.nn.utils.clip_grad_norm_(holders, 0.5, norm_type=p)
    reference = [h.grad for h in holders]
    assert norm.item() == pytest.approx(expect.item(), rel=1e-6)
    assert torch.allclose(clipped["a"], reference[0]) and torch.allclose(clipped["b"][0], reference[1])
    assert clipped["c"] == "not a tensor" and not torch.equal(grads["a"], clipped["a"])  # new tensors


def test_module_clip_grad_norm_equals_torchs() -> None:
    torch.manual_seed(0)
    a, b, x = MLP(), MLP(), torch.randn(3, 8)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(x).square().sum().backward()
    assert sf.clip_grad_norm_(a, 0.1).item() == pytest.approx(torch.nn.utils.clip_grad_norm_(b.parameters(),
                                                                                              0.1).item())
    assert all(torch.allclose(pa.grad, pb.grad) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def test_non_finite_norms_are_reported_not_hidden() -> None:
    grads = {"ok": torch.ones(2), "bad": torch.tensor([1.0, float("nan")])}
    _clipped, norm = sf.func.clip_by_global_norm(grads, 1.0)
    assert math.isnan(norm.item())
    assert sf.func.global_norm({"x": torch.tensor([float("inf")])}).item() == math.inf
    with pytest.raises(sf.func.NonFiniteNormError, match="'bad'") as info:
        sf.func.clip_by_global_norm(grads, 1.0, error_if_nonfinite=True)
    assert info.value.paths == ("['bad']",)
    assert isinstance(info.value, FloatingPointError)


# ----------------------------------------------------------------------------- checkpoints and transforms


def test_functional_optimizer_state_saves_and_loads() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(3, 8)
    init, update = sf.optim.adamw(1e-2)
    apply_fn, params, _ = sf.func.functional(model)
    state = init(params)
    _, grads = sf.func.value_and_grad(lambda p: apply_fn(p, x).sum())(params)
    params, state = update(grads, state, params)
    path = tempfile.mkdtemp()
    sf.save(model, state, path, step=7)
    other = MLP()
    _, params2, _ = sf.func.functional(other)
    state2 = init(params2)
    assert sf.load(other, state2, path) == 7
    assert all(torch.equal(state2["exp_avg"][k], state["exp_avg"][k]) for k in state["exp_avg"])
    assert all(torch.equal(state2["step"][k], state["step"][k]) for k in state["step"])
    assert all(torch.equal(params2[k], params[k]) for k in params)


def test_vmap_and_jvp_work_on_plain_tensors() -> None:
    assert sf.func.vmap(lambda t: t.sum())(torch.ones(3, 2)).tolist() == [2.0, 2.0, 2.0]
    out, tangent = sf.func.jvp(lambda t: t * t, (torch.tensor(3.0),), (torch.tensor(1.0),))
    assert (out.item(), tangent.item()) == (9.0, 6.0)


def test_a_pipeline_apply_fn_is_used_through_value_and_grad() -> None:
    from slapo_fn.func import PipelineApply

    apply_fn = PipelineApply(pipeline=None)  # type: ignore[arg-type]
    with pytest.raises(sf.ScheduleTypeError, match="value_and_grad"):
        apply_fn({}, torch.ones(1))


def test_gradients_of_some_parameters_leave_the_others_grad_alone() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(3, 8)
    apply_fn, params, _ = sf.func.functional(model)
    model.fc2.bias.grad = torch.ones_like(model.fc2.bias)
    subset = {k: params[k] for k in ("fc1.weight", "fc1.bias")}
    _, grads = sf.func.value_and_grad(lambda p: apply_fn(p, x).square().mean())(subset)
    assert set(grads) == {"fc1.weight", "fc1.bias"}
    assert model.fc2.weight.grad is None and torch.equal(model.fc2.bias.grad, torch.ones_like(model.fc2.bias))
    assert all(p.grad is None for p in (model.fc1.weight, model.fc1.bias))


def test_sharding_a_tree_by_bad_specs_names_every_leaf_and_moves_nothing() -> None:
    from slapo_fn.dtensor.testing import fake_mesh, fake_world

    with fake_world(2):
        mesh = fake_mesh(2, names=("tp",))
        tree = {"w": torch.zeros(3, 4), "b": torch.zeros(4), "n": 1}
        with pytest.raises(sf.LayoutError) as info:
            sf.func.shard(tree, {"w": P("tp"), "b": P("dp"), "n": None}, mesh)
        assert info.value.paths == ("['w']", "['b']"), str(info.value)
        assert "dimension 0 of size 3 does not split into 2 even parts" in str(info.value)
        assert "names mesh axis 'dp', which the mesh lacks" in str(info.value)
        with pytest.raises(sf.ScheduleTypeError, match="specs' structure"):
            sf.func.shard(tree, {"w": P("tp")}, mesh)
        with pytest.raises(sf.ScheduleTypeError, match="plain tensor and no mesh"):
            sf.func.constrain(torch.zeros(2), P("tp"))
