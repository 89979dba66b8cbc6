"""Checkpoints of packed layouts (``sf.shard(..., packed=3)``, GPT-2's fused [Q|K|V] as a
``_StridedShard`` DTensor): a tensor-parallel save holds the true full tensors and loads,
bit-identical with its optimizer state, under any other layout; so does a dp2×tp2 save
with FSDP2 over the packed tensors (whose layout DTensor's own ``full_tensor`` gets wrong)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist import mesh
from models import tiny_gpt2, token_ids, train
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import slapo_fn as sf

C_ATTN = "transformer.h.0.attn.c_attn"
LR = 1e-2


def gpt2() -> nn.Module:
    """Tiny GPT-2 without dropout (forward outputs comparable across builds), weights
    unlike the fresh seeded ones, so that every round trip proves a load happened."""
    model = tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def fresh() -> nn.Module:
    return tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def tp(sch: sf.Schedule, packed: int = 3) -> sf.Schedule:
    """Megatron TP of every GPT-2 block; ``packed=1`` shards [Q|K|V] as one tensor instead
    (a different layout of the same parameters), with ``attn.c_proj`` left unsharded: the
    attention splits ``c_attn``'s output into q/k/v, so kept sharded for a row partner it
    would need packed=3 (build refuses it), while gathered it is the same model."""
    attn = sf.shard.at("attn.c_attn", axis=1, packed=packed)
    if packed > 1:
        attn = attn >> sf.shard.at("attn.c_proj", axis=0)
    return sf.foreach(
        "transformer.h.*",
        attn >> sf.shard.at("mlp.c_fc", axis=1) >> sf.shard.at("mlp.c_proj", axis=0),
    )(sch)


def _full(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t
    return full.detach().clone()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer, *, forward: bool = True) -> dict[str, Any]:
    """Full parameters and AdamW moments by FQN, and the logits on fixed inputs."""
    params = {n: _full(p) for n, p in model.named_parameters()}
    moments = {f"{n}.{k}": _full(opt.state[p][k]) for n, p in model.named_parameters() if p in opt.state
               for k in ("exp_avg", "exp_avg_sq")}
    if not forward:
        return {"params": params, "moments": moments}
    with torch.no_grad():
        logits = _full(model(token_ids()).logits)
    return {"params": params, "moments": moments, "logits": logits}


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


# -- ranks ------------------------------------------------------------------------------
def _save_packed(rank: int, world: int, path: str, step: int, layout: str = "packed") -> dict[str, Any]:
    if layout == "fsdp":
        built = sf.build(sf.data_parallel(sf.create_schedule(gpt2(), mesh=mesh((world,), ("dp",))), mesh_axis="dp"))
    else:
        built = sf.build(tp(sf.create_schedule(gpt2(), mesh=mesh((world,), ("tp",)))))
        assert type(built.get_parameter(f"{C_ATTN}.weight").placements[0]).__name__ == "_StridedShard"
    opt = torch.optim.AdamW(built.parameters(), lr=LR)
    train(built, opt, token_ids(batch=4), 2)
    sf.save(built, opt, path, step=step)
    return snapshot(built, opt)


def _load(rank: int, world: int, path: str, layout: str, resave: int) -> dict[str, Any]:
    if layout == "fsdp":
        sch = sf.data_parallel(sf.create_schedule(fresh(), mesh=mesh((world,), ("dp",))), mesh_axis="dp")
    else:
        sch = tp(sf.create_schedule(fresh(), mesh=mesh((world,), ("tp",))), packed=3 if layout == "packed" else 1)
    built = sf.build(sch)
    opt = torch.optim.AdamW(built.parameters(), lr=LR)
    step = sf.load(built, opt, path)
    out = snapshot(built, opt)
    out["step"] = step
    if resave:
        sf.save(built, opt, path, step=resave)
    return out


def single_process(path: Path) -> tuple[dict[str, Any], int]:
    built = sf.build(sf.create_schedule(fresh()))
    opt = torch.optim.AdamW(built.parameters(), lr=LR)
    step = sf.load(built, opt, path)
    return snapshot(built, opt), step


# -- the saved checkpoint -------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(dist_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A checkpoint (step 1) of a trained tp=2 packed GPT-2, and what that model held."""
    path = tmp_path_factory.mktemp("packed")
    results = dist_pool(2).run(_save_packed, str(path), 1, timeout=200)
    for r in results[1:]:
        assert_identical(r["params"], results[0]["params"])
    return path, results[0]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_the_checkpoint_holds_the_true_full_tensors(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, ref = saved
    dcp_to_torch_save(path / "step-00000001", tmp_path / "full.pt")  # read with no model: the stored values
    on_disk = torch.load(tmp_path / "full.pt", weights_only=False)
    assert_identical({k: on_disk["model"][k] for k in ref["params"]}, ref["params"])
    state = on_disk["optim"]["state"]
    assert_identical({f"{n}.{k}": state[n][k] for n in ref["params"] for k in ("exp_avg", "exp_avg_sq")},
                     ref["moments"])


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_packed_tp2_to_packed_tp2(saved: tuple[Path, dict[str, Any]], dist_pool: Any) -> None:
    path, ref = saved
    for r in dist_pool(2).run(_load, str(path), "packed", 0, timeout=200):
        assert r["step"] == 1
        assert_identical(r["params"], ref["params"])
        assert_identical(r["moments"], ref["moments"])
        assert torch.equal(r["logits"], ref["logits"])  # same layout, same computation


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_packed_tp2_to_single_process(saved: tuple[Path, dict[str, Any]]) -> None:
    path, ref = saved
    got, step = single_process(path)
    assert step == 1
    assert_identical(got["params"], ref["params"])
    assert_identical(got["moments"], ref["moments"])
    plain = fresh()  # the unscheduled model with the saved weights computes the same logits exactly
    plain.load_state_dict(ref["params"], strict=False)
    with torch.no_grad():
        assert torch.equal(got["logits"], plain(token_ids()).logits)
    torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5)  # tp sums in another order


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["unpacked", "fsdp"])
def test_packed_tp2_to_other_two_rank_layouts(saved: tuple[Path, dict[str, Any]], dist_pool: Any,
                                              layout: str) -> None:
    path, ref = saved
    for r in dist_pool(2).run(_load, str(path), layout, 0, timeout=200):
        assert r["step"] == 1
        assert_identical(r["params"], ref["params"])
        assert_identical(r["moments"], ref["moments"])
        if layout == "fsdp":
            torch.testing.assert_close(r["logits"], ref["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_packed_tp2_to_packed_tp4_and_back_to_one_process(dist_pool: Any, tmp_path: Path) -> None:
    ref = dist_pool(2).run(_save_packed, str(tmp_path), 1, timeout=200)[0]
    for r in dist_pool(4).run(_load, str(tmp_path), "packed", 2, timeout=200):  # and save again, from tp=4
        assert r["step"] == 1
        assert_identical(r["params"], ref["params"])
        assert_identical(r["moments"], ref["moments"])
        torch.testing.assert_close(r["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    got, step = single_process(tmp_path)
    assert step == 2
    assert_identical(got["params"], ref["params"])
    assert_identical(got["moments"], ref["moments"])
    for r in dist_pool(2).run(_load, str(tmp_path), "packed", 0, timeout=200):  # tp=4 packed -> tp=2 packed
        assert_identical(r["params"], ref["params"])
        assert_identical(r["moments"], ref["moments"])
        assert torch.equal(r["logits"], ref["logits"])


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_fsdp2_to_packed_tp2(dist_pool: Any, tmp_path: Path) -> None:
    ref = dist_pool(2).run(_save_packed, str(tmp_path), 1, "fsdp", timeout=200)[0]
    for r in dist_pool(2).run(_load, str(tmp_path), "packed", 0, timeout=200):
        assert_identical(r["params"], ref["params"])
        assert_identical(r["moments"], ref["moments"])
        torch.testing.assert_close(r["logits"], ref["logits"], rtol=1e-5, atol=1e-5)


# -- FSDP2 over packed TP (dp2 x tp2): checked against the ranks' local tensors ----------------
MOMENTS = ("exp_avg", "exp_avg_sq")


def build_2d(model: nn.Module) -> nn.Module:
    return sf.build(sf.data_parallel(tp(sf.create_schedule(model, mesh=mesh((2, 2), ("dp", "tp")))), mesh_axis="dp"))


def _locals(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Each parameter and AdamW moment: this rank's local tensor (and the full tensor where
    DTensor gets that right, i.e. not for the packed ``c_attn``), and the logits."""
    tensors = {n: p for n, p in model.named_parameters()}
    tensors |= {f"{n}.{k}": opt.state[p][k] for n, p in model.named_parameters() for k in MOMENTS}
    local = {n: t.to_local().detach().clone() for n, t in tensors.items()}
    full = {n: _full(t) for n, t in tensors.items() if ".c_attn." not in n}
    with torch.no_grad():
        logits = _full(model(token_ids()).logits)
    return {"local": local, "full": full, "logits": logits}


def _save_2d(rank: int, world: int, path: str) -> dict[str, Any]:
    built = build_2d(gpt2())
    placements = built.get_parameter(f"{C_ATTN}.bias").placements
    assert [type(p).__name__ for p in placements] == ["_StridedShard", "_StridedShard"]  # FSDP2 over packed
    opt = torch.optim.AdamW(built.parameters(), lr=LR)
    train(built, opt, token_ids(batch=4).chunk(2)[rank // 2], 2)
    sf.save(built, opt, path, step=1)
    return {**_locals(built, opt), "export": sf.full_state_dict(built)}


def _load_2d(rank: int, world: int, path: str) -> dict[str, Any]:
    built = build_2d(fresh())
    opt = torch.optim.AdamW(built.parameters(), lr=LR)
    assert sf.load(built, opt, path) == 1
    return _locals(built, opt)


def assemble(locals_: list[torch.Tensor], packed_dim: int, packed: int = 3) -> torch.Tensor:
    """The full tensor of a packed TP tensor under FSDP2 on a (dp=2, tp=2) mesh, by hand from
    the ranks' local tensors (rank = 2 dp + tp): FSDP2 cuts tp's local tensor along axis 0."""
    tp_local = [torch.cat([locals_[2 * dp + t] for dp in range(2)]) for t in range(2)]
    return torch.cat([tp_local[t].chunk(packed, packed_dim)[c] for c in range(packed) for t in range(2)], packed_dim)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_fsdp_over_packed_tp_round_trips(dist4: Any, tmp_path: Path) -> None:
    saved = dist4.run(_save_2d, str(tmp_path), timeout=200)
    reference = dict(saved[0]["full"])
    for name in saved[0]["local"]:
        if ".c_attn." in name:  # weight: packed along axis 1; bias: along axis 0
            reference[name] = assemble([r["local"][name] for r in saved], 0 if ".bias" in name else 1)
    params = {n: t for n, t in reference.items() if not n.endswith(MOMENTS)}
    assert all(torch.equal(r["export"][n], params[n]) for r in saved for n in params)  # sf.full_state_dict
    for rank, r in enumerate(dist4.run(_load_2d, str(tmp_path), timeout=200)):  # same layout: same local tensors
        assert_identical(r["local"], saved[rank]["local"])
        assert torch.equal(r["logits"], saved[rank]["logits"])
    got, _ = single_process(tmp_path)
    assert_identical(got["params"], params)
    assert_identical(got["moments"], {n: t for n, t in reference.items() if n.endswith(MOMENTS)})
    torch.testing.assert_close(got["logits"], saved[0]["logits"], rtol=1e-5, atol=1e-5)


def _layouts(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from slapo_fn.state import _Relayout

    m = mesh((2, 2), ("dp", "tp"))
    out = {}
    for name, placements in {
        "tp_shard": (Replicate(), Shard(0)),
        "fsdp_over_tp": (_StridedShard(0, split_factor=2), Shard(0)),  # FSDP2 over column TP: DCP reads it
        "packed": (Replicate(), _StridedShard(0, split_factor=3)),
        "fsdp_over_packed": (_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=3)),
        "shard_then_packed": (Shard(0), _StridedShard(0, split_factor=3)),
    }.items():
        t = DTensor.from_local(torch.zeros(6), m, placements, run_check=False, shape=torch.Size([24]),
                               stride=(1,))
        try:
            relayout = _Relayout.of(t, "w")
            out[name] = "as is" if relayout is None else str(relayout.safe)
        except sf.ScheduleError as e:
            out[name] = str(e)
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_which_layouts_are_relaid(dist4: Any) -> None:
    for r in dist4.run(_layouts, timeout=60):
        assert r["tp_shard"] == r["fsdp_over_tp"] == "as is"
        assert r["packed"] == "(Replicate(), Shard(dim=0))"
        assert r["fsdp_over_packed"] == "(Replicate(), Shard(dim=0))"
        assert "tensor dimension 0 is sharded packed and also by other mesh dimensions" in r["shard_then_packed"]
        assert "fix: shard a packed dimension over one mesh axis only" in r["shard_then_packed"]
