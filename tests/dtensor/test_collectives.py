"""``collectives.enter_all``: several tensors' gradients all-reduced in one collective
per dtype (a sequence-parallel norm's weight and bias), checked on 2 gloo ranks against
the sum written out, with the collectives counted."""

from __future__ import annotations

import pytest
import torch
from dist import mesh
from torch.distributed.tensor.debug import CommDebugMode

from slapo_fn.dtensor import collectives as C

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _rank_loss(rank: int, w: torch.Tensor, b: torch.Tensor, s: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    # rank-dependent use: each rank's local gradient is a different partial sum; `unused`
    # gets none (autograd hands the node zeros)
    used = (w * (rank + 1)).sum() + (b * b).sum() * (rank + 2) + (s * 3.0).sum() * (rank + 1)
    return used + 0 * unused.sum().detach()


def _enter_all(rank: int, world: int) -> dict:
    m = mesh((world,), ("tp",))
    torch.manual_seed(0)
    w, b = torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    s, unused = torch.randn(5, dtype=torch.float64, requires_grad=True), torch.randn(2, requires_grad=True)
    with CommDebugMode() as comm:
        outs = C.enter_all([w, b, s, unused], (m, 0))
        same = all(torch.equal(o, x) for o, x in zip(outs, (w, b, s, unused), strict=True))
        _rank_loss(rank, *outs).backward()
    # what the all-reduce must give: the sum over ranks of each rank's local gradient
    ranks = range(world)
    want_w = sum(torch.full_like(w, r + 1.0) for r in ranks)
    want_b = sum(2 * b.detach() * (r + 2) for r in ranks)
    want_s = sum(torch.full_like(s, 3.0 * (r + 1)) for r in ranks)
    # torch.func.grad through the same node: a first-order gradient inside a transform
    fg = torch.func.grad(lambda t: _rank_loss(rank, *C.enter_all([t, b.detach(), s.detach(), unused], (m, 0))))(
        w.detach()
    )
    return {
        "same": same,
        "w": float((w.grad - want_w).abs().max()),
        "b": float((b.grad - want_b).abs().max()),
        "s": float((s.grad - want_s).abs().max()),
        "s_dtype": str(s.grad.dtype),
        "unused": unused.grad is None or float(unused.grad.abs().max()),
        "comms": {str(k): v for k, v in comm.get_comm_counts().items()},
        "func": float((fg - want_w).abs().max()),
    }


def test_enter_all_reduces_every_gradient_in_one_collective_per_dtype(dist2) -> None:
    for r in dist2.run(_enter_all, timeout=60):
        assert r["same"], "forward is the identity"
        assert r["w"] == 0.0 and r["b"] < 1e-6 and r["s"] == 0.0, r
        assert r["s_dtype"] == "torch.float64"
        assert r["unused"] in (True, 0.0), r
        # float32 (w, b, unused) flattened into one all-reduce, float64 (s) in another
        assert sum(v for k, v in r["comms"].items() if "all_reduce" in k) == 2, r["comms"]
        assert r["func"] == 0.0, r


def _sequence_pairs(rank: int, world: int) -> dict:
    """A sequence-parallel pair, compiled: the sequence gathered into a column's matmul,
    the row's matmul reduce-scattered back (and the reverse in backward), handed to the
    matchers of inductor's async tensor parallelism as its post-grad passes see them."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes import micro_pipeline_tp as mp
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    axis = (mesh((world,), ("tp",)), 0)
    found = {"all_gather_matmul": 0, "matmul_reduce_scatter": 0}

    def count(gm: torch.fx.GraphModule, _: object) -> object:
        view_to_reshape(gm)
        found["all_gather_matmul"] += sum(bool(mp._find_consumer_matmuls(g.res_node))
                                          for g in mp.find_all_gather_patterns(gm.graph))
        found["matmul_reduce_scatter"] += sum(mp._find_producer_matmul(s.input_node) is not None
                                              for s in mp.find_reduce_scatter_patterns(gm.graph))
        return make_boxed_func(gm.forward)

    def pair(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = torch.relu(C.gather_rs(x, 1, axis) @ w1)  # (batch, sequence, features): the sequence is dim 1
        return C.reduce_scatter(h @ w2, 1, axis)

    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, requires_grad=True)
    w1, w2 = torch.randn(8, 6, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    eager = pair(x, w1, w2)
    compiled = torch.compile(pair, backend=aot_autograd(fw_compiler=count, bw_compiler=count,
                                                        decompositions=select_decomp_table()), fullgraph=True)
    y = compiled(x, w1, w2)
    y.sum().backward()
    return {**found, "same": bool(torch.allclose(y, eager))}


def test_sequence_collectives_take_the_forms_async_tp_fuses_with_their_matmuls(dist2) -> None:
    """Gathered and scattered along the sequence (dimension 1) as PyTorch's own collectives
    lay them out (no move of the dimension to the front and back): forward, the gather
    into the first matmul and the second matmul into the scatter; backward, the gradient's
    gather into the second's input gradient matmul."""
    for r in dist2.run(_sequence_pairs, timeout=90):
        assert r["same"] and r["all_gather_matmul"] >= 2 and r["matmul_reduce_scatter"] >= 1, r
