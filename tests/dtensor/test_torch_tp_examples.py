"""PyTorch's tensor-parallel example tests, ported to slapo_fn schedules.

PyTorch's ``test/distributed/tensor/parallel/test_tp_examples.py`` holds twelve tests:
``test_mlp_training`` (with and without sequence parallelism), ``test_mlp_inference``,
``test_transformer_training``, ``test_transformer_req_grad``, ``test_weight_tying``,
``test_loss_parallel`` and six tests of ``loss_parallel`` on two-dimensional meshes. Each is
ported here: the same model, weights, inputs and steps, parallelized twice — PyTorch's own
plan from the test (``parallelize_module`` with its styles, ``Transformer.parallelize``,
``loss_parallel``) and the equivalent written with slapo_fn's public API (``sf.shard``,
``sf.sequence_parallel``, ``sf.sync``, ``sf.vocab_parallel_cross_entropy``). Both are
compared with the single-process model (outputs, every gradient, the parameters after the
optimizer step where the test takes one), PyTorch's counts with the test's own expected
counts, and slapo_fn's collectives with PyTorch's (no more, over the forward, backward and
optimizer step together). Tests that need four GPUs there run on four gloo ranks here.

slapo_fn costs no more collectives than PyTorch's engine on any of them (the SP MLP's bias
and the embedding split by its dimension were the last two over).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import mesh
from models import megatron_torch_transformer
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.testing._internal.distributed._tensor.common_dtensor import MLPModule, ModelArgs, Transformer
from tp_checks import CountCollectives, counts

import slapo_fn as sf

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

LR = 0.25


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _err(got: torch.Tensor, want: torch.Tensor | None) -> float:
    """The largest difference, relative to ``want``'s scale where that is above 1: the
    second output after a step at ``LR`` reaches about 64, where one float32 rounding is
    7.6e-6 (an absolute 1e-5 failed by two roundings on another CPU)."""
    assert want is not None
    return float((got.detach() - want.detach()).abs().max() / want.detach().abs().max().clamp(min=1.0))


def _total(c: dict[str, int]) -> int:
    return sum(c.values())


def _params_close(model: nn.Module, ref: nn.Module, grads: bool = False) -> float:
    """The largest difference of ``model``'s parameters (or gradients) from ``ref``'s, by name."""
    want = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        a, b = (p.grad, want[name].grad) if grads else (p, want[name])
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        worst = max(worst, float((_full(a.detach()) - b.detach()).abs().max()))
    return worst


_RUNS: dict[str, Any] = {}


def _once(key: str, pool: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn``'s rank results, run once per session under ``key``."""
    if key not in _RUNS:
        _RUNS[key] = pool.run(fn, *args, timeout=120)
    return _RUNS[key]


# ----------------------------------------------------------------------------- test_mlp_training / inference


def _mlp_schedule(model: nn.Module, sp: bool) -> sf.Schedule:
    """``net1`` column, ``net2`` row; with sequence parallelism the two and the ReLU between
    them run as one chain on rows split along dimension 0, which arrive split
    (``input_layout=Shard(0)``, PyTorch's ``ColwiseParallel(input_layouts=Shard(0))``) and
    leave split (a ``fwd_post`` sync on the chain's last member, PyTorch's
    ``RowwiseParallel(output_layouts=Shard(0))``)."""
    sch = sf.create_schedule(model, mesh=mesh((2,), ("tp",)))
    sch = sf.shard(sf.shard(sch, "net1", axis=0), "net2", axis=1)
    if sp:
        sch = sf.sequence_parallel(sch, ["net1", "relu", "net2"], seq_axis=0, input_layout=Shard(0))
        sch = sf.sync(sch, "net2", "fwd_post", Shard(0))
    return sch


def _mlp_training(rank: int, world: int, sp: bool) -> dict[str, Any]:
    """``_test_mlp_training_e2e``: forward and ``sum().backward()`` under a count, the
    gradients (the reference's summed over ranks with sequence parallelism: each rank fed
    its own rows), one SGD step, the parameters, and the outputs on a second input."""
    torch.manual_seed(rank if sp else 0)
    inp = torch.rand(8, 10)
    model = MLPModule("cpu")
    ref = copy.deepcopy(model)
    plan = {"net1": ColwiseParallel(input_layouts=Shard(0)) if sp else ColwiseParallel(),
            "net2": RowwiseParallel(output_layouts=Shard(0)) if sp else RowwiseParallel()}
    built = {"torch": parallelize_module(copy.deepcopy(model), mesh((world,), ("tp",)), plan),
             "slapo_fn": sf.build(_mlp_schedule(model, sp))}
    out_ref = ref(inp)
    out_ref.sum().backward()
    if sp:
        for p in ref.parameters():
            dist.all_reduce(p.grad)  # not counted: the reference's, as the test does
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    opt_ref.step()
    inp2 = torch.rand(8, 10)
    out2_ref = ref(inp2)
    result: dict[str, Any] = {}
    for name, m in built.items():
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        with CountCollectives() as comm:
            out = m(inp)
            out.sum().backward()
        r = {"out": _err(_full(out), out_ref), "comms": counts(comm),
             "grads": _params_close(m, ref, grads=True)}
        with CountCollectives() as step:
            opt.step()
        r["step"] = counts(step)
        r["params"] = _params_close(m, ref)
        r["out2"] = _err(_full(m(inp2)), out2_ref)
        result[name] = r
    return result


def _mlp_inference(rank: int, world: int) -> dict[str, Any]:
    """``_test_mlp_inference`` under ``torch.inference_mode()``: the outputs and the forward's collectives."""
    torch.manual_seed(0)
    inp = torch.rand(8, 10)
    model = MLPModule("cpu")
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    built = {"torch": parallelize_module(copy.deepcopy(model), mesh((world,), ("tp",)), plan),
             "slapo_fn": sf.build(_mlp_schedule(model, False))}
    result = {}
    with torch.inference_mode():
        want = model(inp)
        for name, m in built.items():
            with CountCollectives() as comm:
                out = m(inp)
            result[name] = {"out": _err(_full(out), want), "comms": counts(comm)}
    return result


def _mlp_results(pool: Any, sp: bool) -> list[dict[str, Any]]:
    return _once(f"mlp-{sp}", pool, _mlp_training, sp)  # type: ignore[no-any-return]


@pytest.mark.parametrize("sp", [True, False], ids=["seq_parallel", "tp"])
def test_mlp_training(dist2: Any, sp: bool) -> None:
    for r in _mlp_results(dist2, sp):
        for name in ("torch", "slapo_fn"):
            got = r[name]
            assert max(got["out"], got["grads"], got["params"], got["out2"]) < 1e-5, (name, got)
            assert got["step"] == {}, (name, got["step"])
        # the test's own counts for PyTorch's plan (forward and backward together)
        assert r["torch"]["comms"] == ({"all_gather": 2, "reduce_scatter": 1} if sp else {"all_reduce": 1})


@pytest.mark.parametrize("sp", [True, False], ids=["seq_parallel", "tp"])
def test_mlp_training_collectives_no_more_than_pytorchs(dist2: Any, sp: bool) -> None:
    for r in _mlp_results(dist2, sp):
        assert _total(r["slapo_fn"]["comms"]) <= _total(r["torch"]["comms"]), (r["slapo_fn"]["comms"],
                                                                                 r["torch"]["comms"])


def test_the_sp_mlp_chain_pairs_its_column_and_row_through_the_relu_member() -> None:
    """``relu``, a chain member between ``net1`` and ``net2``, moves no layout (neither the
    chain's entry nor its exit, pointwise): the pair is Megatron's on local shards, not a
    DTensor region."""
    from slapo_fn.dtensor.testing import fake_mesh

    sch = sf.shard(sf.shard(sf.create_schedule(MLPModule("cpu"), mesh=fake_mesh(2)), "net1", axis=0), "net2", axis=1)
    sch = sf.sync(sf.sequence_parallel(sch, ["net1", "relu", "net2"], seq_axis=0, input_layout=Shard(0)),
                  "net2", "fwd_post", Shard(0))
    p = sf.dtensor.plan(sch)
    assert p.on_dtensors == () and p.modules["net1"].partners == ("net2",)
    assert p.counts() == {"forward": {"all_gather": 1, "reduce_scatter": 1},
                          "backward": {"reduce_scatter": 1, "all_gather": 1}}


def test_mlp_inference(dist2: Any) -> None:
    for r in dist2.run(_mlp_inference, timeout=60):
        assert r["torch"]["out"] < 1e-5 and r["slapo_fn"]["out"] < 1e-5, r
        assert _total(r["slapo_fn"]["comms"]) <= _total(r["torch"]["comms"]), r


# ----------------------------------------------------------------------------- test_transformer_training / req_grad

#: ``test_transformer_training``'s expected counts of PyTorch's plan: (forward, backward, optimizer step)
EXPECTED = {
    False: ({"all_reduce": 6, "all_gather": 1}, {"all_reduce": 9}, {}),
    True: ({"reduce_scatter": 6, "all_gather": 6}, {"reduce_scatter": 5, "all_gather": 6}, {"all_reduce": 30}),
}


def _transformer(
    rank: int, world: int, sp: bool, dtype: str, tie: bool, thaw: tuple[str, ...] | None
) -> dict[str, Any]:
    """``test_transformer_training`` (``thaw`` None) and ``test_transformer_req_grad`` (the
    parameters left trainable; the others frozen after the optimizers are made, as there;
    weights untied): one forward, ``sum().backward()`` and Adam step, each counted, on the
    reference, ``Transformer.parallelize`` and slapo_fn's schedule of the same plan. The
    test runs PyTorch's attention on DTensors on GPUs; on CPU it runs on the math kernel."""
    torch.manual_seed(0)
    args = ModelArgs(dropout_p=0.0, weight_tying=tie)
    model = Transformer(args).to(dtype=getattr(torch, dtype))
    tp = mesh((world,), ("tp",))
    sch = megatron_torch_transformer(sf.create_schedule(model, mesh=tp))
    if sp:
        sch = sf.sequence_parallel(sch, ["layers.*", "norm"])
    built = {"reference": copy.deepcopy(model),
             "torch": Transformer.parallelize(copy.deepcopy(model), tp, sp, local_output_for_attn=dtype == "float64"),
             "slapo_fn": sf.build(sch)}
    opts = {name: torch.optim.Adam(m.parameters(), lr=LR) for name, m in built.items()}
    if thaw is not None:
        for m in built.values():
            for n, p in m.named_parameters():
                p.requires_grad_(n in thaw)
    torch.manual_seed(0)
    inp = torch.randint(args.vocab_size, (8, 8))
    result: dict[str, Any] = {}
    for name, m in built.items():
        # PyTorch's attention on DTensors (float32) meets the plain mask tensor: implicit_replication, as on GPU
        context = implicit_replication if name == "torch" else contextlib.nullcontext
        with sdpa_kernel(SDPBackend.MATH), context():
            with CountCollectives() as fwd:
                out = m(inp)
            with CountCollectives() as bwd:
                out.sum().backward()
        with context(), CountCollectives() as step:
            opts[name].step()
        result[name] = {"out": _full(out).detach(), "fwd": counts(fwd), "bwd": counts(bwd), "step": counts(step)}
    ref = built["reference"]
    for name in ("torch", "slapo_fn"):
        r = result[name]
        r["out"] = float((r["out"] - result["reference"]["out"]).abs().max())
        r["params"] = _params_close(built[name], ref)
    result["grads"] = {name: _params_close(built[name], ref, grads=True) for name in ("torch", "slapo_fn")}
    return result


def _transformer_results(pool: Any, *key: Any) -> list[dict[str, Any]]:
    return _once(f"transformer-{key}", pool, _transformer, *key)  # type: ignore[no-any-return]


def _check_transformer(r: dict[str, Any], dtype: str) -> None:
    tol = 1e-7 if dtype == "float64" else 2e-4
    for name in ("torch", "slapo_fn"):
        assert r[name]["out"] < tol and r["grads"][name] < tol and r[name]["params"] < tol, (name, r)
    ours, theirs = r["slapo_fn"], r["torch"]
    # slapo_fn all-reduces the sequence-parallel norms' gradients in backward, PyTorch's plan in the step
    assert _total(ours["fwd"]) + _total(ours["bwd"]) + _total(ours["step"]) <= (
        _total(theirs["fwd"]) + _total(theirs["bwd"]) + _total(theirs["step"])), (ours, theirs)
    assert ours["step"] == {}, ours["step"]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("sp", [True, False], ids=["seq_parallel", "tp"])
def test_transformer_training(dist2: Any, sp: bool, dtype: str) -> None:
    for r in _transformer_results(dist2, sp, dtype, True, None):
        _check_transformer(r, dtype)
        fwd, bwd, step = EXPECTED[sp]
        assert (r["torch"]["fwd"], r["torch"]["bwd"], r["torch"]["step"]) == (fwd, bwd, step)


#: ``test_transformer_req_grad``'s cases: (trainable parameters, sequence parallel, dtype, the
#: backward and optimizer-step counts the test expects of PyTorch's plan)
REQ_GRAD = {
    "seq_parallel_float32_thaw_all": (None, True, "float32", {"reduce_scatter": 5, "all_gather": 6},
                                      {"all_reduce": 30}),
    "float64_thaw_all": (None, False, "float64", {"all_reduce": 9}, {}),
    "seq_parallel_float32_thaw_norm__output": (("output.weight", "norm.weight", "norm.bias"), True, "float32",
                                               {"reduce_scatter": 1}, {"all_reduce": 6}),
    "seq_parallel_float32_thaw_output__tok_embeddings": (("tok_embeddings.weight", "output.weight"), True, "float32",
                                                         {"reduce_scatter": 5, "all_gather": 5}, {}),
    "seq_parallel_float32_thaw_norm__output__tok_embeddings": (
        ("tok_embeddings.weight", "output.weight", "norm.weight", "norm.bias"), True, "float32",
        {"reduce_scatter": 5, "all_gather": 5}, {"all_reduce": 6}),
    "seq_parallel_float32_thaw_layers_1_ffn_norm__norm__output__tok_embeddings": (
        ("tok_embeddings.weight", "output.weight", "norm.weight", "norm.bias", "layers.1.ffn_norm.weight",
         "layers.1.ffn_norm.bias"), True, "float32", {"reduce_scatter": 5, "all_gather": 5}, {"all_reduce": 12}),
    "seq_parallel_float32_thaw_varied": (
        ("tok_embeddings.weight", "layers.0.attention.wv.weight", "layers.0.feed_forward.w1.bias",
         "layers.1.ffn_norm.bias", "layers.1.feed_forward.w2.weight", "output.weight"), True, "float32",
        {"reduce_scatter": 5, "all_gather": 5}, {"all_reduce": 3}),
}


@pytest.mark.parametrize("case", list(REQ_GRAD))
def test_transformer_req_grad(dist2: Any, case: str) -> None:
    thaw, sp, dtype, bwd, step = REQ_GRAD[case]
    for r in _transformer_results(dist2, sp, dtype, False, thaw):
        _check_transformer(r, dtype)
        assert (r["torch"]["bwd"], r["torch"]["step"]) == (bwd, step)


# ----------------------------------------------------------------------------- test_weight_tying


class _EmbeddingHead(nn.Module):
    """The test's ``TestModule``: an embedding and a Linear of the embedding's shape."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embedding = nn.Embedding(16, 8)
        torch.manual_seed(2)
        self.fc = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(x))  # type: ignore[no-any-return]


def _weight_tying(rank: int, world: int) -> dict[str, Any]:
    """The embedding split by features (``ColwiseParallel`` on an embedding: ``Shard(1)``),
    the Linear row-parallel (weight ``Shard(1)``): untied, each weight its own gradient;
    tied (after parallelize there, before scheduling here: one parameter, one layout), one
    gradient for both, equal to the tied reference's."""
    tp = mesh((world,), ("tp",))
    torch.manual_seed(0)
    inp = torch.randint(16, (5,))
    out: dict[str, Any] = {}
    for tied in (False, True):
        model = _EmbeddingHead()
        ref = copy.deepcopy(model)
        if tied:
            ref.fc.weight = ref.embedding.weight
        pt = parallelize_module(copy.deepcopy(model), tp, {"embedding": ColwiseParallel(), "fc": RowwiseParallel()})
        if tied:
            pt.fc.weight = pt.embedding.weight
            model.fc.weight = model.embedding.weight
        sch = sf.shard(sf.shard(sf.create_schedule(model, mesh=tp), "embedding", axis=1), "fc", axis=1)
        built = {"torch": pt, "slapo_fn": sf.build(sch)}
        ref(inp).sum().backward()
        for name, m in built.items():
            with CountCollectives() as comm:
                m(inp).sum().backward()
            grads = (m.embedding.weight.grad, m.fc.weight.grad)
            out[(name, tied)] = {
                "comms": counts(comm), "grads": _params_close(m, ref, grads=True),
                "same": m.fc.weight is m.embedding.weight and grads[0] is grads[1],
                "differ": not torch.equal(_full(grads[0]), _full(grads[1]))}
    return out


def test_weight_tying(dist2: Any) -> None:
    for r in _once("tying", dist2, _weight_tying):
        for tied in (False, True):
            for name in ("torch", "slapo_fn"):
                got = r[(name, tied)]
                assert got["grads"] < 1e-5, (name, tied, got)
                assert got["same"] == tied and got["differ"] == (not tied), (name, tied, got)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_weight_tying_collectives_no_more_than_pytorchs(dist2: Any, tied: bool) -> None:
    r = _once("tying", dist2, _weight_tying)[0]
    assert _total(r[("slapo_fn", tied)]["comms"]) <= _total(r[("torch", tied)]["comms"]), (
        r[("slapo_fn", tied)]["comms"], r[("torch", tied)]["comms"])


# ----------------------------------------------------------------------------- test_loss_parallel (1-D mesh)


def _class_last(x: torch.Tensor) -> torch.Tensor:
    """PyTorch's loss takes the classes in dimension 1, slapo_fn's in the last."""
    return x.movedim(1, -1)


def _slapo_loss(x: torch.Tensor, target: torch.Tensor, mesh_: Any, reduction: str, *,
                rows: tuple[slice, ...] = (), weight: torch.Tensor | None = None,
                mesh_axis: str = "tp") -> tuple[torch.Tensor, torch.Tensor, dict[str, int], dict[str, int]]:
    """``vocab_parallel_cross_entropy`` on this rank's classes (and ``rows``) of ``x``: the
    loss of ``reduction``, this rank's gradient, and the collectives forward and backward."""
    tp = mesh_.get_local_rank(mesh_axis)
    classes = x.shape[1] // mesh_.size(mesh_.mesh_dim_names.index(mesh_axis))
    local = _class_last(x.detach())[rows][..., tp * classes:(tp + 1) * classes].clone().requires_grad_(True)
    labels = target[rows]
    with CountCollectives() as fwd:
        y = sf.vocab_parallel_cross_entropy(local, labels, mesh_, mesh_axis=mesh_axis, weight=weight,
                                            reduction=reduction)  # type: ignore[arg-type]
    with CountCollectives() as bwd:
        (y.sum() if reduction == "none" else y).backward()
    assert local.grad is not None
    return y.detach(), local.grad, counts(fwd), counts(bwd)


_SETUPS = ((2, (8, 16), (8,)), (3, (8, 16, 12), (8, 12)))  # nll_loss_forward and nll_loss2d_forward


def _outcome(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``, or what it raised (a keyword slapo_fn's loss does not take: a TypeError)."""
    try:
        return run()
    except TypeError as e:
        return {"raised": f"TypeError: {e}"}


def _loss_parallel_case(tp: Any, inputs: list[tuple[torch.Tensor, torch.Tensor]], reduction: str,
                        w: torch.Tensor | None) -> dict[str, Any]:
    per_input = []
    for x0, target in inputs:
        x = x0.clone().requires_grad_(True)
        y = F.cross_entropy(x, target, w, reduction=reduction)
        (y.sum() if reduction == "none" else y).backward()
        dist_x = distribute_tensor(x0.clone().requires_grad_(True), tp, [Shard(1)])
        with loss_parallel():
            with CountCollectives() as fwd:
                dist_y = F.cross_entropy(dist_x, target, w, reduction=reduction)
            with CountCollectives() as bwd:
                (dist_y.sum() if reduction == "none" else dist_y).backward()
        assert x.grad is not None and dist_x.grad is not None
        classes = 16 // tp.size()
        want_grad = _class_last(x.grad)[..., tp.get_local_rank() * classes:][..., :classes]
        loss, grad, f, b = _slapo_loss(x, target, tp, reduction, weight=w)
        per_input.append({
            "torch": (_err(dist_y.full_tensor(), y), _err(dist_x.grad.full_tensor(), x.grad), counts(fwd), counts(bwd)),
            "slapo_fn": (_err(loss, y), _err(grad, want_grad), f, b)})
    return {"inputs": per_input}


def _loss_parallel(rank: int, world: int) -> dict[str, Any]:
    """``test_loss_parallel`` with the classes sharded, per case of ``_LOSS_CASES``: for both
    input ranks, the loss's and gradient's largest errors and the collectives forward and
    backward of ``loss_parallel`` and of ``vocab_parallel_cross_entropy``. (The test's other
    shard dimensions PyTorch refuses; slapo_fn's loss takes this rank's classes by its
    signature, so there is nothing to refuse.)"""
    tp = mesh((world,), ("tp",))
    torch.manual_seed(0)
    weight = torch.rand(16)
    inputs = [(torch.rand(*size), torch.randint(16, target_size)) for _, size, target_size in _SETUPS]
    out = {}
    for key in _LOSS_CASES:
        reduction, weighted = key.split("-")
        w = weight if weighted == "weighted" else None
        out[key] = _outcome(lambda r=reduction, w=w: _loss_parallel_case(tp, inputs, r, w))
    return out


def _params(cases: dict[str, str]) -> list[Any]:
    """Test parameters, those slapo_fn cannot express (a reason given) strict xfails raising TypeError."""
    return [pytest.param(name, marks=[pytest.mark.xfail(strict=True, raises=TypeError, reason=why)] if why else [])
            for name, why in cases.items()]


#: reduction-weighted: the weighted ones are the test's own, the unweighted as well
_LOSS_CASES = {f"{red}-{w}": "" for red in ("none", "mean", "sum") for w in ("weighted", "unweighted")}


def _raise_missing(r: dict[str, Any]) -> None:
    if "raised" in r:
        raise TypeError(r["raised"])


@pytest.mark.parametrize("case", _params(_LOSS_CASES))
def test_loss_parallel(dist2: Any, case: str) -> None:
    for rank in _once("1d", dist2, _loss_parallel):
        _raise_missing(rank[case])
        for one in rank[case]["inputs"]:
            for name in ("torch", "slapo_fn"):
                assert one[name][0] < 1e-5 and one[name][1] < 1e-5, (name, one[name])
            assert one["torch"][2] == {"all_reduce": 3} and one["torch"][3] == {}  # the test's own counts
            assert _total(one["slapo_fn"][2]) + _total(one["slapo_fn"][3]) <= 3, one["slapo_fn"]


# ----------------------------------------------------------------------------- loss_parallel on 2-D meshes (4 ranks)


def _sum_over(t: torch.Tensor, m: Any, axis: str) -> torch.Tensor:
    """``t`` summed over mesh axis ``axis`` (not counted: what a ``Partial`` placement there
    leaves to its reader, as ``full_tensor()`` does in the test)."""
    t = t.clone()
    dist.all_reduce(t, group=m.get_group(axis))
    return t


#: the four 2-D-mesh tests that compute: mesh axes, the input's size and the dimension its
#: rows are split along over the non-tp axis (None: replicated there)
_MESHES_2D: dict[str, tuple[tuple[str, str], tuple[int, ...], int | None]] = {
    "multi_dim_mesh": (("dp", "tp"), (8, 16), 0), "replicate_non_tp_dim": (("rep", "tp"), (8, 16), None),
    "tp_not_last_dim": (("tp", "dp"), (8, 16), 0), "3d_input_non_batch_shard": (("cp", "tp"), (4, 16, 6), 2)}


def _loss_2d_case(case: str, reduction: str, w: torch.Tensor | None) -> dict[str, Any]:
    """One 2-D case: PyTorch's loss is a DTensor made whole (``full_tensor()``); slapo_fn's
    is this rank's rows' loss, summed over the non-tp axis where the rows are split (a
    mean: averaged, as a data-parallel gradient is). PyTorch's ``mean`` where the rows are
    split raises NotImplementedError ("one-dimensional"); that is checked, not compared."""
    names, size, batch_dim = _MESHES_2D[case]
    m = mesh((2, 2), names)
    other = next(n for n in names if n != "tp")
    torch.manual_seed(0)
    x = torch.rand(*size, requires_grad=True)
    target = torch.randint(16, (size[0], *size[2:]))
    y = F.cross_entropy(x, target, w, reduction=reduction)
    (y.sum() if reduction == "none" else y).backward()
    assert x.grad is not None
    place = [Shard(1) if n == "tp" else Replicate() if batch_dim is None else Shard(batch_dim) for n in names]
    tplace = [Replicate() if n == "tp" or batch_dim is None else Shard(max(batch_dim - 1, 0)) for n in names]
    dist_x = distribute_tensor(x.detach().clone().requires_grad_(True), m, place)
    dist_t = distribute_tensor(target, m, tplace)
    out: dict[str, Any] = {}
    with loss_parallel():
        if reduction == "mean" and batch_dim is not None:
            with pytest.raises(NotImplementedError, match="one-dimensional"):
                F.cross_entropy(dist_x, dist_t, w, reduction=reduction)
        else:
            with CountCollectives() as fwd:
                dist_y = F.cross_entropy(dist_x, dist_t, w, reduction=reduction)
            with CountCollectives() as bwd:
                (dist_y.sum() if reduction == "none" else dist_y).backward()
            assert dist_x.grad is not None
            out["torch"] = (_err(dist_y.full_tensor(), y), _err(dist_x.grad.full_tensor(), x.grad),
                            counts(fwd), counts(bwd))
    rows: tuple[slice, ...] = ()
    if batch_dim is not None:  # this rank's rows, in the class-last layout
        piece = size[batch_dim] // 2
        at = m.get_local_rank(other) * piece
        rows = (slice(None),) * max(batch_dim - 1, 0) + (slice(at, at + piece),)
    loss, grad, f, b = _slapo_loss(x, target, m, reduction, rows=rows, weight=w)
    if reduction == "none":  # this rank's rows' losses, against the same rows of the reference
        y = y[rows]
    elif batch_dim is not None:
        loss = _sum_over(loss, m, other) / (2 if reduction == "mean" else 1)
        grad = grad / (2 if reduction == "mean" else 1)  # the reference's mean runs over the whole batch
    classes = 16 // 2
    want = _class_last(x.grad)[rows][..., m.get_local_rank("tp") * classes:][..., :classes]
    out["slapo_fn"] = (_err(loss, y), _err(grad, want), f, b)
    return out


#: case-reduction[-weighted] the tests compute
_CASES_2D = {
    **{f"{case}-sum": "" for case in _MESHES_2D},
    "multi_dim_mesh-mean": "",
    "multi_dim_mesh-none": "",
    "multi_dim_mesh-sum-weighted": "",
    "multi_dim_mesh-none-weighted": "",
    "replicate_non_tp_dim-none": "",
    "3d_input_non_batch_shard-none": "",
}


def _loss_2d(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    weight = torch.rand(16)
    out = {}
    for key in _CASES_2D:
        case, reduction, *weighted = key.split("-")
        w = weight if weighted else None
        out[key] = _outcome(lambda c=case, r=reduction, w=w: _loss_2d_case(c, r, w))
    return out


@pytest.mark.parametrize("case", _params(_CASES_2D))
def test_loss_parallel_on_2d_meshes(dist4: Any, case: str) -> None:
    """``test_loss_parallel_multi_dim_mesh``, ``_replicate_non_tp_dim``, ``_tp_not_last_dim``
    and ``_3d_input_non_batch_shard``, case by case."""
    for rank in _once("2d", dist4, _loss_2d):
        r = rank[case]
        _raise_missing(r)
        assert r["slapo_fn"][0] < 1e-5 and r["slapo_fn"][1] < 1e-5, r
        if "torch" in r:
            ours, theirs = r["slapo_fn"], r["torch"]
            assert theirs[0] < 1e-5 and theirs[1] < 1e-5, r
            assert _total(ours[2]) + _total(ours[3]) <= _total(theirs[2]) + _total(theirs[3]), r


def _refusals_2d(rank: int, world: int) -> dict[str, str]:
    """``invalid_non_tp_placement``: logits ``Partial`` over the non-tp axis are refused
    (PyTorch: "Shard or Replicate"; slapo_fn: a schedule cannot make an activation Partial).
    ``plain_tensor_target_rejected_on_multi_dim``: labels that are not this rank's rows are
    refused (PyTorch: a plain target with rows split over dp "requires a DTensor"; slapo_fn's
    labels are this rank's, so the batch's whole labels do not match its rows)."""
    m = mesh((2, 2), ("dp", "tp"))
    out = {}
    dist_x = DTensor.from_local(torch.rand(4, 8, requires_grad=True), m, [Partial("sum"), Shard(1)], run_check=False)
    dist_t = DTensor.from_local(torch.randint(16, (4,)), m, [Replicate(), Replicate()], run_check=False)
    with loss_parallel(), pytest.raises(ValueError, match="Shard or Replicate"):
        F.cross_entropy(dist_x, dist_t, reduction="sum")
    sch = sf.shard(sf.create_schedule(nn.Linear(8, 16), mesh=m), "", axis=0)
    try:
        sf.sync(sch, "", "fwd_post", Partial(), mesh_axis="dp")
    except sf.LayoutError as e:
        out["partial"] = str(e)
    x = torch.rand(8, 16)
    target = torch.randint(16, (8,))
    with loss_parallel(), pytest.raises(ValueError, match="requires a DTensor"):
        F.cross_entropy(distribute_tensor(x, m, [Shard(0), Shard(1)]), target, reduction="sum")
    rows = x[4 * m.get_local_rank("dp"):][:4, 8 * m.get_local_rank("tp"):][:, :8]
    try:
        sf.vocab_parallel_cross_entropy(rows, target, m)  # the whole batch's labels for this rank's 4 rows
    except (ValueError, sf.ScheduleError) as e:
        out["labels"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # a raw error from inside the loss
        out["labels_raw"] = f"{type(e).__name__}: {e}"
    return out


def test_loss_parallel_invalid_non_tp_placement(dist4: Any) -> None:
    for r in _once("refusals", dist4, _refusals_2d):
        assert "cannot make an activation Partial(" in r.get("partial", ""), r


def test_loss_parallel_plain_tensor_target_rejected_on_multi_dim(dist4: Any) -> None:
    for r in _once("refusals", dist4, _refusals_2d):
        assert "labels" in r, r.get("labels_raw")
        assert "LayoutError" in r["labels"] and "does not match the logits' rows (4,)" in r["labels"], r["labels"]
