"""DTensor regions per subtree (slapo_fn.dtensor.regions): what the plan cannot prove runs
on DTensors in the smallest subtree entered and left whole; the rest on local shards."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import slapo_fn as sf
from slapo_fn.dtensor.plan import plan
from slapo_fn.dtensor.regions import region_roots, regions_of
from slapo_fn.dtensor.testing import fake_mesh
from tests.models import megatron_llama, tiny_llama, token_ids


def test_each_problem_gets_the_nearest_fitting_ancestor_and_nested_roots_merge() -> None:
    fits = {"a", "a.b", "c"}.__contains__
    assert region_roots(["a.b.c", "a.x"], fits) == ("a",)
    assert region_roots(["c.d"], fits) == ("c",)
    assert region_roots(["a.b.c.d", "c.d"], fits) == ("a.b", "c")
    assert region_roots(["d.e"], fits) == ("",)
    assert region_roots([""], fits) == ("",)


def _split_q(sch: sf.Schedule) -> sf.Schedule:
    return sf.sync(sch, "model.layers.0.self_attn.q_proj", "fwd_post", Shard(-1))


def test_a_split_inside_one_attention_puts_only_that_attention_on_dtensors() -> None:
    sch = _split_q(sf.create_schedule(tiny_llama(), mesh=fake_mesh(2)))
    p = plan(sch)
    assert p.on_dtensors
    assert regions_of(sch, p) == ("model.layers.0.self_attn",)


def test_a_proven_plan_has_no_region() -> None:
    sch = megatron_llama(sf.create_schedule(tiny_llama(), mesh=fake_mesh(2)))
    assert regions_of(sch, plan(sch)) == ()


def test_a_split_stated_outside_the_region_widens_it_to_hold_both() -> None:
    sch = _split_q(sf.create_schedule(tiny_llama(), mesh=fake_mesh(2)))
    # a split stated on the second layer's MLP would reach the attention's boundary: the region
    # grows to the smallest subtree holding both
    both = sf.sync(sch, "model.layers.1.mlp", "fwd_post", Shard(1))
    assert regions_of(both, plan(both)) == ("model",)


def _run(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    from tests.dist import mesh

    model, ids = tiny_llama(), token_ids()
    sch = _split_q(sf.create_schedule(model, mesh=mesh((world,), ("tp",))))
    built = sf.build(sch)
    ref = model(ids).logits
    with CommDebugMode() as comm:
        out = built(ids).logits
    # only the attention is entered as a region; the root and the other layer run on local shards
    entered = {path for path, m in built.named_modules() if "region.<locals>" in getattr(m.forward, "__qualname__", "")}
    return {"close": torch.allclose(out, ref, atol=1e-5), "forward": comm.get_total_counts(), "entered": entered}


def test_the_region_runs_equal_with_one_gather(dist2: Any) -> None:
    for r in dist2.run(_run):
        assert r["close"], r
        assert r["forward"] == 1, r  # q gathered once for the attention (heads whole), nothing else
        assert r["entered"] == {"model.layers.0.self_attn"}, r


def _bart_run(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from tests.dist import mesh
    from tests.models import tiny_bart

    model, ids = tiny_bart(), token_ids()
    sch = sf.create_schedule(model, mesh=mesh((world,), ("tp",)))
    attn = "encoder.layers.0.self_attn"
    for name in ("q_proj", "k_proj", "v_proj"):
        sch = sf.shard(sch, f"{attn}.{name}", axis=0)
    # a gather stated on v puts the attention on DTensors, its weights split by heads
    sch = sf.sync(sf.shard(sch, f"{attn}.out_proj", axis=1), f"{attn}.v_proj", "fwd_post", Replicate())
    built = sf.build(sch)
    ref = model(input_ids=ids, decoder_input_ids=ids, output_attentions=True)
    with CommDebugMode() as comm:
        out = built(input_ids=ids, decoder_input_ids=ids).last_hidden_state
    # asked for, the weights are what Hugging Face's capture hook reads: the DTensor, whole values
    asked = built(input_ids=ids, decoder_input_ids=ids, output_attentions=True).encoder_attentions[0]
    return {"close": torch.allclose(out, ref.last_hidden_state, atol=1e-5), "forward": comm.get_total_counts(),
            "dtensor": isinstance(asked, DTensor),
            "weights": torch.allclose(asked.full_tensor(), ref.encoder_attentions[0], atol=1e-6)}


def test_a_region_hands_on_what_its_caller_drops_as_it_is(dist2: Any) -> None:
    """BART's encoder layer unpacks its attention's ``(output, weights)`` and drops the
    weights, split by heads in the region: making them whole would cost a gather nothing
    reads, so they leave as the DTensor they are, as PyTorch's engine hands them on."""
    for r in dist2.run(_bart_run):
        assert r["close"], r
        # v gathered (the stated sync) and the row's sum; the dropped weights not gathered (was 4)
        assert r["forward"] == 3, r
        assert r["dtensor"] and r["weights"], r


def _split_input_run(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    from tests.dist import mesh

    model, ids = tiny_llama(), token_ids()
    sch = megatron_llama(sf.create_schedule(model, mesh=mesh((world,), ("tp",))))
    # the attention told its hidden states arrive split by features: q, k and v each want them whole
    sch = sf.sync(sch, "model.layers.0.self_attn", "fwd_pre", Shard(-1))
    built = sf.build(sch)
    ref = model(ids).logits
    ref.sum().backward()
    with CommDebugMode() as fwd:
        out = built(ids).logits
    with CommDebugMode() as bwd:
        out.sum().backward()
    grads = {n: float((b.grad.full_tensor() - a.grad).abs().max() / a.grad.abs().max())
             for (n, a), (_, b) in zip(model.named_parameters(), built.named_parameters(), strict=True)}
    grads = {n: d for n, d in grads.items() if d > 1e-6}
    return {"close": torch.allclose(out, ref, atol=1e-5), "grads": grads,
            "forward": _counts(fwd), "backward": _counts(bwd)}


def _counts(comm: Any) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}


def test_columns_reading_one_activation_in_a_region_move_it_once(dist2: Any) -> None:
    """q, k and v read the one activation a sync states split by features: they share one
    move back to whole (Activations.moved), and a move back to where a value was moved
    from within the pass is that value. The stated split and its gathers cost nothing, and
    the columns' partial gradients are reduced with the rest (was 3 gathers forward, 3
    reduce-scatters and a gather backward)."""
    for r in dist2.run(_split_input_run):
        assert r["close"] and not r["grads"], r  # every gradient within 1e-6 of its magnitude
        assert r["forward"] == {"all_reduce": 4}, r  # the rows' sums, as with no sync
        assert r["backward"] == {"all_reduce": 4}, r


class _ScalesInPlace(nn.Module):
    """Scales the input it is handed in place, then a column/row pair."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return self.o(self.q(x))


class _InPlaceTop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.block = nn.Linear(8, 8), _ScalesInPlace()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.pre(x))


def _in_place_run(rank: int, world: int) -> dict[str, Any]:
    from tests.dist import mesh

    torch.manual_seed(0)
    model, x = _InPlaceTop(), torch.randn(2, 4, 8)
    sch = sf.shard(sf.shard(sf.create_schedule(model, mesh=mesh((world,), ("tp",))), "block.q", axis=0), "block.o",
                   axis=1)
    built = sf.build(sf.sync(sch, "block", "fwd_pre", Shard(-1)))
    ref = model(x)
    ref.sum().backward()
    out = built(x)
    out.sum().backward()
    grads = [torch.allclose(b.grad.full_tensor(), a.grad, atol=1e-5)
             for a, b in zip(model.parameters(), built.parameters(), strict=True)]
    return {"close": torch.allclose(out, ref, atol=1e-5), "grads": all(grads)}


def test_a_value_changed_in_place_after_its_move_is_moved_again(dist2: Any) -> None:
    """The block scales the split it is handed in place: its column's move back to whole
    is of the scaled value, not the one the split was made from."""
    for r in dist2.run(_in_place_run):
        assert r["close"] and r["grads"], r


class _Scores(nn.Module):
    """Returns ``(out, scores)``: a softmax over the features of ``q``'s output."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(self.q(x), dim=-1)
        return self.o(scores) + x, scores


class _CalledTwice(nn.Module):
    """One ``_Scores`` module at two paths: the first call drops its scores, the second reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.first = _Scores()
        self.second = self.first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.first(x)
        h, scores = self.second(h)
        return h * scores


def _sync_only_run(rank: int, world: int) -> dict[str, Any]:
    from tests.dist import mesh

    torch.manual_seed(0)
    model, x = _CalledTwice(), torch.randn(2, 4, 8)
    # a split stated on q reaches the module's result: the whole model is the region, and the
    # module at its second path is on the way too, not an island inside it
    built = sf.build(sf.sync(sf.create_schedule(model, mesh=mesh((world,), ("tp",))), "first.q", "fwd_post", Shard(-1)))
    return {"close": torch.allclose(built(x), model(x), atol=1e-5)}


def test_a_module_on_the_way_at_one_path_is_no_island_at_another(dist2: Any) -> None:
    for r in dist2.run(_sync_only_run):
        assert r["close"], r


def _split_param_run(rank: int, world: int) -> dict[str, Any]:
    from tests.models import tiny_bart
    from tests.tp_checks import parity

    ids = token_ids()

    def plan_(sch: sf.Schedule) -> sf.Schedule:  # embeddings split by features, a lone column: on DTensors
        for path in ("decoder.embed_tokens", "encoder.embed_positions"):
            sch = sf.shard(sch, path, axis=1)
        return sf.shard(sch, "decoder.layers.1.fc2", axis=0)

    r = parity(tiny_bart(), plan_, (ids, torch.ones_like(ids), ids), shape=(world,), tracker=False, predict=False,
               loss=lambda out, _: out.last_hidden_state.float().pow(2).mean())
    return {"on_dtensors": r["on_dtensors"], "placements": r["placements"], "grads": r["grad_placements"]}


def test_a_split_parameter_in_a_region_gets_its_gradient_split(dist2: Any) -> None:
    """BART's position embedding split by features, on DTensors: DTensor's backward found
    the gradient of its output whole (gathered for the sum with the token embeddings) and
    left the weight's gradient whole on every rank. It is cut to this rank's piece, locally,
    so the optimizer steps on the parameter's own layout with no collective."""
    for r in dist2.run(_split_param_run, timeout=120):
        assert r["on_dtensors"], r
        assert r["grads"]["encoder.embed_positions.weight"] == ("S(1)",), r
        assert all(r["grads"][n] == pl for n, pl in r["placements"].items() if n in r["grads"]), r


# ----------------------------------------------------------------------------- regions inside chains


def _chain_with_a_lone_attention(sch: sf.Schedule) -> sf.Schedule:
    """Megatron LLaMA (3 layers) as one sequence-parallel chain with its final norm, but
    layer 1's ``o_proj`` left whole: its q/k/v are columns no row reads inside the chain,
    which the plan cannot prove on local shards."""
    sch = megatron_llama(sch, "model.layers.[0,2]")
    sch = sf.shard(sch, "model.layers.1.self_attn.{q,k,v}_proj", axis=0)
    sch = sf.shard(sch, "model.layers.1.mlp.{gate,up}_proj", axis=0)
    sch = sf.shard(sch, "model.layers.1.mlp.down_proj", axis=1)
    return sf.sequence_parallel(sch, ["model.layers.*", "model.norm"])


def test_in_a_chain_a_problem_inside_one_member_puts_that_member_alone_on_dtensors() -> None:
    sch = _chain_with_a_lone_attention(sf.create_schedule(tiny_llama(layers=3), mesh=fake_mesh(2)))
    p = plan(sch)
    assert {q.path for q in p.on_dtensors} >= {"model.layers.1.self_attn.q_proj"}
    assert regions_of(sch, p) == ("model.layers.1",)
    # a member with a sync of its own is no region: what it states is a layout of the stream
    synced = sf.sync(sch, "model.layers.1", "fwd_pre", Shard(1), src=Shard(1))
    assert regions_of(synced, plan(synced)) == ("",)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        return x + self.down(torch.relu(h))


def test_a_member_whose_exit_gather_enters_the_columns_after_it_is_no_region() -> None:
    """The chain's last member hands its output to a column alone (an LM head): its exit's
    gather is that column's entry (a reduce-scatter of the column's partial gradient), which
    a region, handing back a whole gradient, would sum over the ranks again."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), nn.Linear(16, 24))
    sch = sf.create_schedule(model, mesh=fake_mesh(2))
    sch = sf.shard(sf.shard(sch, "0.up", axis=0), "0.down", axis=1)
    sch = sf.shard(sf.shard(sch, "1.up", axis=0), "2", axis=0)  # 1.up: a column no row reads
    sch = sf.sequence_parallel(sch, ["0", "1"])
    p = plan(sch)
    assert p.modules["1"].exit_columns == ("2",) and p.on_dtensors
    assert regions_of(sch, p) == ("",)


def _chain_run(rank: int, world: int, whole: bool) -> dict[str, Any]:
    import slapo_fn.dtensor.runtime as runtime
    from tests.dist import mesh
    from tests.tp_checks import CountCollectives, counts, full

    model, ids = tiny_llama(layers=3), token_ids()
    sch = _chain_with_a_lone_attention(sf.create_schedule(model, mesh=mesh((world,), ("tp",))))
    proper = runtime.regions_of
    if whole:  # the build as it was: the whole model on DTensors wherever a chain is planned
        runtime.regions_of = lambda s, p: ("",) if proper(s, p) else ()  # type: ignore[assignment]
    try:
        built = sf.build(sch)
    finally:
        runtime.regions_of = proper
    entered = {path for path, m in built.named_modules() if "region.<locals>" in getattr(m.forward, "__qualname__", "")}
    with torch.no_grad():  # the token shard enters without a gradient too
        evaluated = built(ids).logits
    want = model(ids).logits
    want.float().pow(2).mean().backward()
    with CountCollectives() as comm:
        built(ids).logits.float().pow(2).mean().backward()
    grads = dict(model.named_parameters())
    worst = max(float((full(q.grad) - grads[n].grad).abs().max()) for n, q in built.named_parameters())
    return {"entered": entered, "eval": torch.allclose(evaluated, want, atol=1e-5), "grads": worst,
            "comms": sum(counts(comm).values())}


def test_a_member_region_runs_equal_beside_members_on_local_shards_and_costs_no_more(dist2: Any) -> None:
    member = dist2.run(_chain_run, False, timeout=120)
    whole = dist2.run(_chain_run, True, timeout=120)
    for r, w in zip(member, whole, strict=True):
        assert r["entered"] == {"model.layers.1"} and w["entered"] == {""}, (r, w)
        assert r["eval"] and r["grads"] < 1e-5, r
        # the gradients of the norms on token shards all wait for one reduction at the end of
        # backward, those of the region's and of the members on local shards alike
        assert r["comms"] <= w["comms"], (r, w)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class _AddsInPlace(nn.Module):
    """Falcon's way: the residual added into the MLP's output with ``+=``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(16), _Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(self.norm(x))
        out += x
        return out


def _in_place_result_run(rank: int, world: int) -> dict[str, Any]:
    from tests.dist import mesh
    from tests.tp_checks import full

    torch.manual_seed(0)
    model = nn.Sequential(_AddsInPlace(), _AddsInPlace())
    sch = sf.create_schedule(model, mesh=mesh((world,), ("tp",)))
    sch = sf.shard(sf.shard(sch, "*.mlp.up", axis=0), "*.mlp.down", axis=1)
    sch = sf.sync(sch, "1.mlp.up", "fwd_post", Shard(1))  # a token shard the plan cannot follow: a region
    built = sf.build(sch)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    built(x).pow(2).mean().backward()
    model(x).pow(2).mean().backward()
    grads = dict(model.named_parameters())
    return {"regions": regions_of(sch, plan(sch)),
            "grads": max(float((full(q.grad) - grads[n].grad).abs().max()) for n, q in built.named_parameters())}


def test_model_code_may_change_a_regions_result_in_place(dist2: Any) -> None:
    """A subtree region's result is handed back as a tensor of its own: DTensor's
    ``to_local`` view, made inside an autograd Function, refused Falcon's ``+=`` with a raw
    error from inside the model's code."""
    for r in dist2.run(_in_place_result_run, timeout=120):
        assert r["regions"] == ("1.mlp",) and r["grads"] < 1e-5, r


def _uneven_run(rank: int, world: int) -> str:
    from tests.dist import mesh

    torch.manual_seed(0)
    model = nn.Sequential(_AddsInPlace(), _AddsInPlace())
    sch = sf.create_schedule(model, mesh=mesh((world,), ("tp",)))
    sch = sf.shard(sf.shard(sch, "*.mlp.up", axis=0), "*.mlp.down", axis=1)
    built = sf.build(sf.sync(sch, "1.mlp.up", "fwd_post", Shard(1)))
    try:  # 5 tokens over 2 ranks
        built(torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
    except sf.LayoutError as e:
        return str(e)
    return "ran"


def test_a_split_stated_in_a_region_that_the_axis_does_not_divide_is_refused_on_every_rank(dist2: Any) -> None:
    """DTensor shards 5 tokens over 2 ranks as 3 and 2, and its backward then issued
    collectives that differed between the ranks: a hang until the process group's timeout
    (ViT's 17 tokens with a token split stated on a projection). Refused at the move, on
    every rank alike, as on local shards."""
    for r in dist2.run(_uneven_run, timeout=60):
        assert "do not split evenly over the 2 ranks" in r, r
