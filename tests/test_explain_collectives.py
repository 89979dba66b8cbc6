"""explain's collectives of one step, for data parallelism (FSDP2, DDP), against what
the real run issues on 2 gloo ranks: counts as ``CommDebugMode`` counts them, and bytes
as a dispatch mode records them (the gathered result of an all-gather, the input of a
reduce-scatter, the tensor of an all-reduce); and the pipeline's sends and receives
against those the real schedule posts (its point-to-point batches, wrapped)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from models import tiny_llama, token_ids
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import slapo_fn as sf

#: c10d / functional op names -> explain's names
_OPS = {"_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
        "all_gather_into_tensor": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
        "allreduce_": "all_reduce", "all_reduce": "all_reduce"}


def _bytes(t: Any) -> int:
    if isinstance(t, list | tuple):
        return sum(_bytes(x) for x in t)
    return int(t.numel() * t.element_size())


class Recorder(TorchDispatchMode):
    """(op, bytes) of every collective issued, c10d and functional."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = func._overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional") and name in _OPS:
            op = _OPS[name]
            if func.namespace == "c10d":  # (output, input, …) or ([tensors], …)
                size = _bytes(args[0]) if op != "reduce_scatter" else _bytes(args[1])
            else:
                size = _bytes(args[0]) * (int(args[1]) if op == "all_gather" else 1)
            self.ops.append((op, size))
        return func(*args, **(kwargs or {}))


def _run(mode: str) -> dict[str, Any]:
    from dist import mesh

    model = tiny_llama(2)
    x = token_ids(batch=2, seq=8)
    sch = sf.data_parallel(sf.create_schedule(model, mesh=mesh((2,), ("dp",))), mode=mode)  # type: ignore[arg-type]
    explained = sf.explain(sch, x)
    built = sf.build(sch)
    with CommDebugMode() as comm, Recorder() as rec:
        built(x).logits.pow(2).mean().backward()
    measured_counts = Counter()
    for key, n in comm.get_comm_counts().items():
        name = str(key).split(".")[-1]
        if name in _OPS and n:
            measured_counts[_OPS[name]] += n
    predicted = [c for c in explained.collectives if c.mesh_axis == "dp"]
    return {
        "predicted_counts": dict(Counter(c.op for c in predicted)),
        "measured_counts": dict(measured_counts),
        "predicted_bytes": sorted((c.op, c.bytes) for c in predicted),
        "measured_bytes": sorted(rec.ops),
    }


def _cases(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {mode: _run(mode) for mode in ("fsdp", "ddp")}


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_data_parallel_collectives_equal_the_real_run(dist2: Any) -> None:
    for result in dist2.run(_cases, timeout=120):
        for mode, r in result.items():
            assert r["predicted_counts"] == r["measured_counts"], (mode, r)
            assert r["predicted_bytes"] == r["measured_bytes"], (mode, r)
        # FSDP2: 3 units (2 layers + root) gather forward and again backward, 3 reduce-scatters
        assert result["fsdp"]["predicted_counts"] == {"all_gather": 6, "reduce_scatter": 3}
        assert set(result["ddp"]["predicted_counts"]) == {"all_reduce"}


def _pp_run(rank: int, world: int) -> dict[str, Any]:
    import torch.nn.functional as F
    from dist import mesh
    from torch.distributed.pipelining import schedules

    model = tiny_llama(4)
    x = token_ids(batch=8, seq=8)
    sch = sf.cut_pipeline_stage(sf.create_schedule(model, mesh=mesh((2,), ("pp",))), "model.layers.1")
    explained = sf.explain(sch, x, microbatches=4)
    pipe = sf.build_pipeline(sch, microbatches=4, schedule="1f1b",
                             loss_fn=lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()))
    seen: list[tuple[str, int]] = []
    original = schedules._batch_p2p

    def counting(ops: list[Any], *args: Any, **kwargs: Any) -> Any:  # every send and receive, wrapped
        seen.extend((op.op.__name__, _bytes(op.tensor)) for op in ops)
        return original(ops, *args, **kwargs)

    schedules._batch_p2p = counting
    try:
        pipe.step(x, target=x)
    finally:
        schedules._batch_p2p = original
    predicted = [c for c in explained.collectives if c.mesh_axis == "pp"]
    return {"predicted": sorted(c.bytes or 0 for c in predicted), "measured": sorted(b for _, b in seen),
            "ops": dict(Counter(name for name, _ in seen))}


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_pipeline_transfers_equal_the_sends_and_receives_of_the_real_run(dist2: Any) -> None:
    for result in dist2.run(_pp_run, timeout=120):
        # each rank sends 4 activations or gradients and receives as many: 8 transfers
        assert result["predicted"] == result["measured"], result
        assert sum(result["ops"].values()) == 8 and set(result["ops"]) == {"isend", "irecv"}


def _loss_run(rank: int, world: int) -> dict[str, Any]:
    from dist import mesh
    from models import megatron_llama
    from torch.distributed.tensor import Shard

    tp = mesh((2,), ("tp",))
    model = tiny_llama(2)
    x = token_ids(batch=2, seq=8)
    sch = sf.shard(megatron_llama(sf.create_schedule(model, mesh=tp)), "lm_head", axis=0)
    sch = sf.sync(sch, "lm_head", "fwd_post", Shard(-1))
    predicted = [c for c in sf.explain(sch, x).collectives if c.origin == "loss"]
    logits = sf.build(sch)(x).logits
    with CommDebugMode() as fwd, Recorder() as rec:
        loss = sf.vocab_parallel_cross_entropy(logits, x, tp)
    with CommDebugMode() as bwd:
        torch.autograd.grad(loss, logits)
    return {"predicted": sorted((c.direction, c.op, c.bytes) for c in predicted),
            "measured": sorted(("forward", op, b) for op, b in rec.ops),
            "forward_count": sum(fwd.get_comm_counts().values()), "backward_count": sum(bwd.get_comm_counts().values())}


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_vocab_parallel_loss_collectives_equal_the_real_run(dist2: Any) -> None:
    for result in dist2.run(_loss_run, timeout=120):
        assert result["predicted"] == result["measured"], result
        assert result["forward_count"] == 3 and result["backward_count"] == 0
        assert result["predicted"][0][2] == 2 * 8 * 4  # one float32 per row (batch × seq)


def _hsdp_run(rank: int, world: int) -> dict[str, Any]:
    from dist import mesh

    model = tiny_llama(2)
    x = token_ids(batch=2, seq=8)
    sch = sf.data_parallel(sf.create_schedule(model, mesh=mesh((2, 2), ("rep", "dp"))), mode="hsdp",
                           mesh_axis=("rep", "dp"))
    predicted = [c for c in sf.explain(sch, x).collectives if c.origin == "data_parallel"]
    built = sf.build(sch)
    with Recorder() as rec:
        built(x).logits.pow(2).mean().backward()
    return {"predicted": sorted((c.op, c.bytes) for c in predicted), "measured": sorted(rec.ops),
            "axes": sorted({(c.op, c.mesh_axis) for c in predicted})}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_hsdp_collectives_equal_the_real_run_on_four_ranks(dist4: Any) -> None:
    for result in dist4.run(_hsdp_run, timeout=180):
        assert result["predicted"] == result["measured"], result
        assert result["axes"] == [("all_gather", "dp"), ("all_reduce", "rep"), ("reduce_scatter", "dp")]


def _per_rank_run(rank: int, world: int, kind: str) -> dict[str, Any]:
    """pp2 x tp2 or pp2 x dp2 on 4 ranks, 4 microbatches of 1F1B: the collectives this
    rank issues in a step (after the first, which also infers the stages' shapes) against
    explain's prediction for its pp rank."""
    import torch.nn.functional as F
    from dist import mesh
    from models import megatron_llama

    model = tiny_llama(4)
    x = token_ids(batch=8, seq=8)
    if kind == "tp":
        grid = mesh((2, 2), ("pp", "tp"))
        sch, local = megatron_llama(sf.create_schedule(model, mesh=grid)), x
    else:
        grid = mesh((2, 2), ("dp", "pp"))
        sch, local = sf.data_parallel(sf.create_schedule(model, mesh=grid)), x.chunk(2)[grid.get_local_rank("dp")]
    sch = sf.cut_pipeline_stage(sch, "model.layers.1")
    pp_rank = grid.get_local_rank("pp")
    predicted = [c for c in sf.explain(sch, local, microbatches=4, pp_rank=pp_rank).collectives
                 if c.mesh_axis == kind]
    pipe = sf.build_pipeline(sch, microbatches=4, schedule="1f1b",
                             loss_fn=lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()))
    pipe.step(local, target=local)
    with Recorder() as rec:
        pipe.step(local, target=local)
    return {"pp_rank": pp_rank, "predicted": sorted((c.op, c.bytes) for c in predicted), "measured": sorted(rec.ops)}


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_each_ranks_collectives_under_a_pipeline_equal_the_real_run(dist4: Any) -> None:
    """A stage's rank issues its own layers' collectives once per microbatch (explain used
    to charge every rank all layers, once): pp2 x tp2 and pp2 x dp2, rank by rank."""
    for kind in ("tp", "dp"):
        for result in dist4.run(_per_rank_run, kind, timeout=240):
            assert result["predicted"] == result["measured"], (kind, result)
            ops = Counter(op for op, _ in result["predicted"])
            # tp: 2 layers x (2 forward + 2 backward all-reduces) x 4 microbatches; dp (FSDP2 of 3 units): a
            # gather per microbatch and one for the backward pass, one reduce-scatter
            assert ops == ({"all_reduce": 32} if kind == "tp" else {"all_gather": 15, "reduce_scatter": 3}), ops


def test_columns_kept_split_for_their_rows_cost_no_loss_collectives() -> None:
    """BERT's recipe states q/k/v and the MLP's first layer ``fwd_post`` ``Shard(-1)``: rows
    read those features, no loss does. explain listed three "loss" all-reduces for each;
    only a head kept split for the vocab-parallel loss has them."""
    from transformers import BertConfig, BertForMaskedLM

    from slapo_fn.dtensor.testing import fake_mesh

    model = BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, max_position_embeddings=32))
    sch = sf.recipes.for_model(model)(sf.create_schedule(model, mesh=fake_mesh(2)), tp=2)
    assert not [c for c in sf.explain(sch, token_ids(batch=2, seq=8)).collectives if c.origin == "loss"]
