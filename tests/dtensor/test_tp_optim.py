"""Every parameter of a model built on a mesh is a DTensor, and so is its gradient:
PyTorch's optimizers (default, foreach, fused) and ``clip_grad_norm_`` work on it and
train it exactly like the single-process model (2 and 4 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from dist import mesh
from models import megatron_llama, tiny_llama, token_ids
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, foreach=True),
}


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, n: int = 3) -> list[float]:
    norms = []
    for _ in range(n):
        model(ids, labels=ids).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    return norms


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_like_reference(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...],
                          sp: bool, fsdp: bool) -> dict:
    out: dict = {}
    for name, make in OPTIMIZERS.items():
        torch.manual_seed(0)
        model = tiny_llama()
        ids = token_ids()
        sch = megatron_llama(sf.create_schedule(model, mesh=mesh(shape, names)))
        if sp:
            sch = sf.sequence_parallel(sch, ["model.layers.*", "model.norm"])
        if fsdp:
            sch = sf.data_parallel(sch)
        built = sf.build(sch)
        reference = sf.build(sf.create_schedule(model))
        kinds = {type(p).__name__ for p in built.parameters()}
        meshes = {tuple(p.device_mesh.mesh_dim_names or ()) for p in built.parameters() if isinstance(p, DTensor)}
        norms = _steps(built, make(list(built.parameters())), ids)
        norms_ref = _steps(reference, make(list(reference.parameters())), ids)
        ref = dict(reference.named_parameters())
        worst = max(float((_full(p.data) - ref[n].data).abs().max()) for n, p in built.named_parameters())
        grads = {type(p.grad).__name__ for p in built.parameters() if p.grad is not None}
        out[name] = {"kinds": kinds, "meshes": meshes, "worst": worst, "grads": grads,
                     "norms": norms, "norms_ref": norms_ref}
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp_trains_like_the_reference_with_every_optimizer_and_clipping(dist2, sp: bool) -> None:
    for result in dist2.run(_train_like_reference, (2,), ("tp",), sp, False, timeout=240):
        for name, r in result.items():
            assert r["kinds"] == {"DTensor"}, (name, r["kinds"])  # every parameter, sharded or not
            assert r["meshes"] == {("tp",)}, name
            assert r["worst"] < 1e-4, (name, r["worst"])  # 3 Adam steps normalise last-bit differences
            assert r["norms"] == pytest.approx(r["norms_ref"], rel=1e-5), name


def test_dp_x_tp_with_fsdp2_trains_like_the_reference(dist4) -> None:
    for result in dist4.run(_train_like_reference, (2, 2), ("dp", "tp"), False, True, timeout=280):
        for name, r in result.items():
            assert r["kinds"] == {"DTensor"}, (name, r["kinds"])
            assert r["meshes"] == {("dp", "tp")}, (name, r["meshes"])  # one mesh: clip_grad_norm_ works
            assert r["worst"] < 1e-4, (name, r["worst"])  # 3 Adam steps normalise last-bit differences
            assert r["norms"] == pytest.approx(r["norms_ref"], rel=1e-5), name


def _optimizer_step_collectives(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = tiny_llama()
    ids = token_ids()
    sch = sf.sequence_parallel(megatron_llama(sf.create_schedule(model, mesh=mesh((world,), ("tp",)))),
                               ["model.layers.*", "model.norm"])
    built = sf.build(sch)
    opt = torch.optim.AdamW(built.parameters(), lr=1e-2, foreach=True)
    built(ids, labels=ids).loss.backward()
    with CommDebugMode() as step:
        opt.step()
    grads = {tuple(map(str, p.grad.placements)) == tuple(map(str, p.placements)) for p in built.parameters()}
    return {"step": step.get_total_counts(), "grads_match_params": grads}


def test_with_sequence_parallelism_an_optimizer_step_needs_no_collective(dist2) -> None:
    # every gradient has its parameter's placement (norm and bias gradients are all-reduced in
    # backward), so AdamW's step is local; PyTorch's own SP layout leaves Partial ones to reduce
    for r in dist2.run(_optimizer_step_collectives, timeout=120):
        assert r["grads_match_params"] == {True}
        assert r["step"] == 0
