"""Bad input through the API gets one clear answer (issue 15): a typed slapo_fn error
naming the path, the reason and a fix, raised before any work starts, with the
schedule, the model and the checkpoint directory unchanged.

* ``CASES``: one row per wrong use — what is called, the error class, a pattern the
  message must match (it names the path), and whether the check must come before any
  build (``verify``'s input checks);
* a Hypothesis property: random wrong selectors, axes, meshes and arguments on random
  small models give a slapo_fn error or a schedule, nothing else, and change nothing;
* on 2 gloo ranks: the GPT-2 recipe at tp=2 blames the module that was replaced (not the
  packed ``c_attn``), and correct recipes verify at the default tolerances while a small
  real bug does not.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh
from tests.fingerprint import fingerprint, same
from tests.models import Net, tiny_gpt2, tiny_llama, token_ids

#: The errors a wrong use may raise: slapo_fn's own, all of them.
TYPED = (sf.ScheduleError, sf.SelectorError, sf.VerificationError)


@cache
def llama() -> nn.Module:
    """4 layers, hidden 64, vocabulary 128; never mutated (every case checks that)."""
    return tiny_llama(4)


@cache
def net() -> nn.Module:
    return Net(depth=2)  # embed (vocabulary 16) -> 2 blocks -> head


def snapshot(subject: object) -> tuple[str, Any]:
    """Everything a wrong use must leave as it was."""
    if isinstance(subject, sf.Schedule):
        original = fingerprint(subject.original) if subject.original is not None else []
        return "schedule", (fingerprint(subject.module), subject.annotations, subject.history, original)
    if isinstance(subject, nn.Module):
        return "module", fingerprint(subject)
    if isinstance(subject, Path):
        files = sorted(p for p in subject.rglob("*") if p.is_file()) if subject.is_dir() else [subject]
        return "files", [(str(p), p.read_bytes()) for p in files if p.exists()]
    raise TypeError(subject)


def unchanged(before: tuple[str, Any], after: tuple[str, Any]) -> bool:
    kind, was = before
    now = after[1]
    if kind == "schedule":
        return same(was[0], now[0]) and was[1] == now[1] and was[2] == now[2] and same(was[3], now[3])
    if kind == "files":
        return bool(was == now)
    return same(was, now)


@dataclass(frozen=True)
class Case:
    """``setup(tmp)`` returns the things that must stay unchanged and the call that must fail."""

    setup: Callable[[Path], tuple[tuple[object, ...], Callable[[], object]]]
    error: type[Exception]
    match: str
    #: verify/explain input checks: refused before anything is built
    before_build: bool = False


def _llama_sch(mesh: Any = None) -> sf.Schedule:
    return sf.create_schedule(llama(), mesh=mesh)


def _on(sch: sf.Schedule, call: Callable[[sf.Schedule], object]) -> tuple[tuple[object, ...], Callable[[], object]]:
    return (sch, sch.module), lambda: call(sch)


def _verify(*inputs: Any, **options: Any) -> Callable[[Path], tuple[tuple[object, ...], Callable[[], object]]]:
    return lambda _: _on(_llama_sch(), lambda s: sf.verify(s, *inputs, **options))


def _checkpoint(tmp: Path, optimizer: bool = False) -> Path:
    model = net()
    opt = torch.optim.AdamW(model.parameters()) if optimizer else None
    sf.save(model, opt, tmp / "ck", step=1)
    return tmp / "ck"


def _truncated(tmp: Path) -> tuple[tuple[object, ...], Callable[[], object]]:
    ck = _checkpoint(tmp)
    data = next((ck / "step-00000001").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    model = Net(depth=2)
    return (ck, model), lambda: sf.load(model, None, ck)


def _bad_metadata(tmp: Path) -> tuple[tuple[object, ...], Callable[[], object]]:
    ck = _checkpoint(tmp)
    (ck / "step-00000001" / ".metadata").write_bytes(b"not a pickle")
    model = Net(depth=2)
    return (ck, model), lambda: sf.load(model, None, ck)


def _other_model(tmp: Path) -> tuple[tuple[object, ...], Callable[[], object]]:
    ck = _checkpoint(tmp)
    model = Net(dim=4, depth=3)
    return (ck, model), lambda: sf.load(model, None, ck)


def _no_optimizer_state(tmp: Path) -> tuple[tuple[object, ...], Callable[[], object]]:
    ck = _checkpoint(tmp)
    model = Net(depth=2)
    opt = torch.optim.AdamW(model.parameters())
    return (ck, model), lambda: sf.load(model, opt, ck)


def _a_file(tmp: Path) -> Path:
    (tmp / "a_file").write_text("not a checkpoint")
    return tmp / "a_file"


CASES: dict[str, Case] = {
    # -- selectors
    "range past the end": Case(
        lambda _: _on(_llama_sch(), lambda s: sf.checkpoint(s, "model.layers.[0-99]")), sf.SelectorError,
        r"'model.layers.\[0-99\]': 'model.layers' has children 0-3; '\[0-99\]' also asks for 4-99.*"
        r"fix: select only existing indices, e.g. 'model.layers.\[0-3\]'"),
    "list past the end": Case(
        lambda _: _on(_llama_sch(), lambda s: sf.checkpoint(s, "model.layers.[1,7]")), sf.SelectorError,
        r"'model.layers' has children 0-3; '\[1,7\]' also asks for 7.*e.g. 'model.layers.1'"),
    "unclosed range": Case(
        lambda _: _on(_llama_sch(), lambda s: sf.checkpoint(s, "model.layers.[0-")), sf.SelectorError,
        r"'model.layers.\[0-': syntax error at column 14: '\[' is not closed"),
    # -- shard: fixes name only what exists
    "shard an activation": Case(
        lambda _: _on(_llama_sch(fake_mesh(2)), lambda s: sf.shard(s, "model.layers.0.mlp.act_fn", axis=0)),
        sf.LayoutError, r"'model.layers.0.mlp.act_fn': a SiLUActivation has no parameters to shard\n.*"
                        r"fix: shard a layer beside it, e.g. 'model.layers.0.mlp.gate_proj'"),
    "shard a container": Case(
        lambda _: _on(_llama_sch(fake_mesh(2)), lambda s: sf.shard(s, "model.layers.0.mlp", axis=0)),
        sf.LayoutError, r"'model.layers.0.mlp': cannot shard a LlamaMLP as a whole.*"
                        r"fix: shard the layers inside it, e.g. 'model.layers.0.mlp.gate_proj'"),
    "shard a bias that is None": Case(
        lambda _: _on(_llama_sch(fake_mesh(2)), lambda s: sf.shard(s, "model.layers.0.mlp.up_proj.bias", axis=0)),
        sf.SelectorError, r"'model.layers.0.mlp.up_proj' \(Linear\) has no 'bias'.*"
                          r"fix: select 'model.layers.0.mlp.up_proj' \(its parameters: "
                          r"'model.layers.0.mlp.up_proj.weight'\)"),
    # -- replacements that do not fit
    "replacement of another output shape": Case(
        lambda _: _on(_llama_sch(), lambda s: sf.replace(s, "model.norm", nn.Linear(64, 32))), sf.ScheduleError,
        r"'model.norm': Linear returns shape\(s\) \(2, 3, 32\) where LlamaRMSNorm returns \(2, 3, 64\)"),
    "replacement that cannot take the input": Case(
        lambda _: _on(_llama_sch(), lambda s: sf.replace(s, "model.layers.0.mlp.up_proj", nn.Linear(32, 128))),
        sf.ScheduleError, r"'model.layers.0.mlp.up_proj': Linear fails on an input Linear takes, of shape "
                          r"\(2, 3, 64\): RuntimeError"),
    "misfit let through names its module in verify": Case(
        lambda _: _on(_llama_sch(), lambda s: sf.verify(
            sf.replace(s, "model.norm", nn.Linear(64, 32), check_shapes=False), token_ids())),
        sf.VerificationError, r"the schedule fails where the reference runs, in 'lm_head' \(Linear\): RuntimeError"
                              r".*first diverging module: 'model.norm', whose output has shape\(s\) \(2, 8, 32\) "
                              r"where the reference's has \(2, 8, 64\)"),
    # -- recipes
    "unknown recipe knob": Case(
        lambda _: _on(_llama_sch(fake_mesh(2)), lambda s: sf.recipes.LLAMA(s, tpp=2)), sf.ScheduleTypeError,
        r"'tpp': is not a recipe knob\n\s+fix: did you mean 'tp'\? valid knobs: tp, sequence_parallel, checkpoint, "
        r"stages, dp_mode, kernels, compile"),
    "recipe knob of the wrong type": Case(
        lambda _: _on(_llama_sch(fake_mesh(2)), lambda s: sf.recipes.LLAMA(s, tp="2")), sf.ScheduleTypeError,
        r"'tp': expects int, got str '2'"),
    "stages without a pp axis": Case(
        lambda _: _on(_llama_sch(fake_mesh(2)), lambda s: sf.recipes.LLAMA(s, stages=3)), sf.LayoutError,
        r"stages=3 needs a mesh with a 'pp' axis; the schedule's mesh is \('tp',\)"),
    "stage cuts past the layers": Case(
        lambda _: _on(_llama_sch(fake_mesh(2, names=("pp",))), lambda s: sf.recipes.LLAMA(s, stages=(1, 3))),
        sf.LayoutError, r"stages=\(1, 3\): cut\(s\) after layer\(s\) \[3\] impossible with 4 layers"),
    "tensor parallelism of degree 0": Case(
        lambda _: _on(_llama_sch(), lambda s: sf.recipes.LLAMA(s, tp=0)), sf.LayoutError,
        r"tp=0: a tensor-parallel degree is at least 1"),
    # -- verify / explain inputs
    "verify float ids": Case(_verify(token_ids().float()), sf.ScheduleTypeError,
                             r"verify: 'input_ids': holds token ids, but is a float32 tensor", before_build=True),
    "verify ids outside the vocabulary": Case(
        _verify(token_ids() + 200), sf.ScheduleError,
        r"'input_ids': has ids 2\d\d..3\d\d, outside the vocabulary 0..127", before_build=True),
    "verify 3-D ids": Case(_verify(token_ids()[None]), sf.ScheduleError,
                           r"'input_ids': has shape \(1, 2, 8\): token ids are \(batch, sequence\)",
                           before_build=True),
    "verify misspelt keyword": Case(
        _verify(token_ids(), kwargs={"atention_mask": torch.ones(2, 8)}), sf.ScheduleTypeError,
        r"\"kwargs\['atention_mask'\]\": is not an argument of LlamaForCausalLM.forward \(its \*\*kwargs would "
        r"swallow it and ignore it\)\n\s+fix: did you mean 'attention_mask'\?", before_build=True),
    "verify mask of another shape": Case(
        _verify(token_ids(), kwargs={"attention_mask": torch.ones(2, 5)}), sf.ScheduleError,
        r"'attention_mask': has shape \(2, 5\) for input_ids of shape \(2, 8\)", before_build=True),
    "verify negative rtol": Case(_verify(token_ids(), rtol=-1e-3), sf.ScheduleError,
                                 r"'rtol': is -0.001; a tolerance is a number >= 0", before_build=True),
    "verify NaN atol": Case(_verify(token_ids(), atol=float("nan")), sf.ScheduleError, r"'atol': is nan",
                            before_build=True),
    "verify too many inputs": Case(
        lambda _: _on(sf.create_schedule(net()), lambda s: sf.verify(s, torch.zeros(2, 4, dtype=torch.long),
                                                                     torch.zeros(2))),
        sf.ScheduleTypeError, r"'input 1': is past the 1 positional parameter\(s\) of Net.forward\(ids\)",
        before_build=True),
    "verify: the reference fails": Case(
        lambda _: _on(sf.create_schedule(net()), lambda s: sf.verify(s, torch.full((2, 4), 99))),
        sf.ScheduleError, r"'embed': the reference model fails on these inputs in 'embed' \(Embedding\): "
                          r"IndexError: index out of range"),
    "explain float ids": Case(
        lambda _: _on(_llama_sch(fake_mesh(2)), lambda s: sf.explain(s, token_ids().float())),
        sf.ScheduleTypeError, r"explain: 'input_ids': holds token ids, but is a float32 tensor"),
    # -- checkpoints
    "save to a file": Case(lambda tmp: ((_a_file(tmp), net()), lambda: sf.save(net(), None, tmp / "a_file")),
                           sf.ScheduleError, r"save: '.*a_file': is a file, not a directory"),
    "save under a file": Case(lambda tmp: ((_a_file(tmp), net()), lambda: sf.save(net(), None, tmp / "a_file" / "x")),
                              sf.ScheduleError, r"'.*a_file/x': '.*a_file' on its way is a file"),
    "load a truncated checkpoint": Case(_truncated, sf.ScheduleError,
                                        r"load: '.*step-00000001/__0_0.distcp': is truncated: 100 bytes"),
    "load unreadable metadata": Case(_bad_metadata, sf.ScheduleError,  # found by its digest before DCP reads it
                                     r"load: '.*step-00000001/.metadata': is truncated: 12 bytes where the manifest "
                                     r"says \d+"),
    "load another model's checkpoint": Case(
        _other_model, sf.ScheduleError,
        r"load: '.*step-00000001': was written from another model: 6 of this model's 20 tensors are not in it "
        r"\('blocks.2.norm.weight'.*; 12 have another shape \('embed.weight': saved \(16, 8\), here \(16, 4\)"),
    "load from a file": Case(lambda tmp: ((_a_file(tmp),), lambda: sf.load(Net(depth=2), None, tmp / "a_file")),
                             sf.ScheduleError, r"load: '.*a_file': is a file, not a checkpoint directory"),
    "load optimizer state that was not saved": Case(
        _no_optimizer_state, sf.ScheduleError,
        r"'.*step-00000001': holds no optimizer state \(saved with optimizer=None\)"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_one_clear_typed_answer(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    subjects, call = case.setup(tmp_path)
    before = [snapshot(s) for s in subjects]
    if case.before_build:
        def no_build(*args: object, **kwargs: object) -> None:
            raise AssertionError("verify built the schedule before checking its inputs")

        monkeypatch.setattr(sys.modules["slapo_fn.verify"], "build", no_build)
    with pytest.raises(case.error, match="(?s)" + case.match) as info:
        call()
    assert isinstance(info.value, TYPED)
    assert len(str(info.value).splitlines()) <= 12, str(info.value)
    assert "Traceback" not in str(info.value)
    for subject, was in zip(subjects, before, strict=True):
        assert unchanged(was, snapshot(subject)), f"{name}: {subject!r} changed"


_QUOTED = re.compile(r"'([\w.\[\]-]+)'")


@pytest.mark.parametrize("where", ["model.layers.0.mlp.act_fn", "model.layers.0.mlp", "model.layers.0.mlp.up_proj.bias",
                                   "model.layers.1.input_layernorm", "model.embed_tokens.weight.x"])
def test_shard_fixes_name_only_paths_that_exist(where: str) -> None:
    sch = _llama_sch(fake_mesh(2))
    with pytest.raises(TYPED) as info:
        sf.shard(sch, where, axis=0)
    error = info.value
    fixes = [p.fix for p in error.problems] if isinstance(error, sf.ScheduleError) else [error.fix]
    named = [q for fix in fixes for q in _QUOTED.findall(fix)]
    assert named, fixes
    for path in named:
        assert path != where
        sf.select(path).paths(llama())  # raises if it does not exist


@pytest.mark.parametrize(("pattern", "column", "what"), [
    ("model.layers.[0-", 14, r"'\[' is not closed"),
    ("model..layers", 7, "an empty name"),
    ("model.layers.", 14, "an empty name"),
    ("model.layers.{q,k", 14, r"'\{' is not closed"),
    ("model.layers]", 13, r"'\]' without an opening '\['"),
    ("model.layers.[3-1]", 14, r"the range \[3-1\] is empty"),
    ("model.layers.[-2]", 14, r"the range \[-2\] needs a first and a last index"),
    ("model.layers.[]", 14, r"'\[\]' selects nothing"),
    ("model.layers.*.mlp}", 19, r"'\}' without an opening '\{'"),
])
def test_malformed_selectors_point_at_the_column(pattern: str, column: int, what: str) -> None:
    with pytest.raises(sf.SelectorError, match=f"syntax error at column {column}: {what}") as info:
        sf.select(pattern)
    assert info.value.column == column
    caret = str(info.value).splitlines()[2]
    assert caret.index("^") - 4 == column - 1 and str(info.value).splitlines()[1].strip() == pattern
    with pytest.raises(sf.SelectorError, match="syntax error"):
        sf.checkpoint.at(pattern)  # a Rewrite value checks it when it is made


def test_ranges_within_the_children_and_char_classes_still_select() -> None:
    model = llama()
    assert sf.select("model.layers.[1-3]").modules(model) == tuple(f"model.layers.{i}" for i in (1, 2, 3))
    assert sf.select("model.layers.[0,3].self_attn.[qk]_proj").modules(model) == (
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
        "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj")
    assert len(sf.select("**.[0-3]").modules(model)) == 4


def test_replace_accepts_a_fitting_replacement_and_a_misfit_on_request() -> None:
    sch = _llama_sch()
    from slapo_fn.kernels import RMSNorm

    sf.replace(sch, "model.norm", lambda old, path: RMSNorm.from_hf(old))  # same shapes: accepted
    sf.replace(sch, "model.layers.0.mlp.act_fn", nn.Linear(128, 128))  # an activation's width is unknown: no verdict
    widened = sf.replace(sch, "model.layers.0.mlp.up_proj", nn.Linear(64, 256), check_shapes=False)
    assert widened.module.model.layers[0].mlp.up_proj.out_features == 256


def test_verify_tolerances_are_relative_to_each_tensor_and_default_by_dtype() -> None:
    """A change of a few ulps of a tensor's largest element passes at the defaults (the
    error reduction order leaves, also on elements that cancel to ~0); a change of 1e-3 of
    the scale, a real bug's size, fails; exact tolerances still ask for equality."""
    ids = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))

    def nudge(size: float) -> Callable[..., torch.Tensor]:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            scale = out.abs().max()
            return out + size * scale * torch.linspace(-1, 1, out.numel()).view_as(out)

        return hook

    sch = sf.create_schedule(net())
    report = sf.verify(sf.hook(sch, "blocks.1.mlp.fc2", "fwd_post", nudge(4e-7)), ids)
    assert report.max_output_diff > 0
    with pytest.raises(sf.VerificationError, match="first diverging module: 'blocks.1.mlp.fc2'"):
        sf.verify(sf.hook(sch, "blocks.1.mlp.fc2", "fwd_post", nudge(1e-3)), ids)
    with pytest.raises(sf.VerificationError):
        sf.verify(sf.hook(sch, "blocks.1.mlp.fc2", "fwd_post", nudge(4e-7)), ids, rtol=0, atol=0)
    assert sf.verify(sch, ids, rtol=0, atol=0).max_grad_diff == 0.0


# -- property: random wrong uses give a typed error or a schedule, and change nothing --------
LEAVES: list[Callable[[], nn.Module]] = [lambda: nn.Linear(4, 6), nn.ReLU, lambda: nn.LayerNorm(4),
                                         lambda: nn.Embedding(8, 4), lambda: nn.Linear(6, 4, bias=False)]
trees = st.recursive(st.sampled_from(range(len(LEAVES))), lambda kids: st.lists(kids, min_size=1, max_size=3),
                     max_leaves=8)


def make(spec: Any) -> nn.Module:
    if isinstance(spec, int):
        return LEAVES[spec]()
    if len(spec) == 2:
        return nn.ModuleList(make(s) for s in spec)
    return nn.ModuleDict({f"m{i}": make(s) for i, s in enumerate(spec)})


_ALPHABET = ".[]{}*?-,0123456789mxyz_"


@st.composite
def selectors(draw: st.DrawFn, paths: list[str]) -> object:
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return draw(st.text(_ALPHABET, max_size=12))
    if kind <= 3:  # a real path, mutated
        path = list(draw(st.sampled_from(paths)) or "m0")
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(path)))
            op = draw(st.integers(0, 2))
            if op == 0:
                path.insert(i, draw(st.sampled_from(_ALPHABET)))
            elif path and i < len(path):
                if op == 1:
                    del path[i]
                else:
                    path[i] = draw(st.sampled_from(_ALPHABET))
        return "".join(path)
    if kind == 4:
        a, b = draw(st.integers(0, 9)), draw(st.integers(0, 9))
        return f"{draw(st.sampled_from(paths))}.[{a}-{b}]".lstrip(".")
    if kind == 5:
        return draw(st.sampled_from(paths))  # valid: the other arguments may still be wrong
    return draw(st.sampled_from([3, None, [], ["m0", 2], b"m0", ("m0",)]))


MESHES = [((2,), ("tp",)), ((4,), ("tp",)), ((2,), ("dp",)), ((2, 2), ("dp", "tp")), ((2, 2), ("pp", "tp")), None]


def _call(kind: int, sch: sf.Schedule, where: Any, axis: Any, mesh_axis: Any, packed: Any) -> object:
    calls: list[Callable[[], object]] = [
        lambda: sf.shard(sch, where, axis=axis, mesh_axis=mesh_axis, packed=packed),
        lambda: sf.shard(sch, where, layout=(mesh_axis, None)),
        lambda: sf.checkpoint(sch, where),
        lambda: sf.replace(sch, where, nn.Linear(4, 5)),
        lambda: sf.sequence_parallel(sch, where, mesh_axis=mesh_axis, seq_axis=axis if isinstance(axis, int) else 1),
        lambda: sf.sync(sch, where, "fwd_post", Shard(axis) if isinstance(axis, int) else Replicate(),
                        mesh_axis=mesh_axis),
        lambda: sf.fork_rng(sch, where),
        lambda: sf.tp_local(sch, where, mesh_axis=mesh_axis),
        lambda: sf.cut_pipeline_stage(sch, where),
        lambda: sf.annotate(sch, where, "tag", 1),
        lambda: sf.foreach(where, sf.shard.at("", axis=axis))(sch),
        lambda: sf.build(sf.shard(sch, where, axis=axis, mesh_axis=mesh_axis)),
        lambda: sf.sync(sch, where, mesh_axis, Replicate(), mesh_axis="tp"),  # a mode that is a mesh-axis name
        lambda: sf.data_parallel(sch, mode=mesh_axis, mesh_axis=mesh_axis),
        lambda: sf.checkpoint(sch, where, policy=axis),
        lambda: sf.hook(sch, where, "fwd_post", axis),
        lambda: sf.replace(sch, where, axis),
        lambda: sf.build(sf.sequence_parallel(sf.shard(sch, where, axis=axis), where)),
    ]
    return calls[kind % len(calls)]()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), spec=trees)
def test_random_wrong_uses_give_typed_errors_and_change_nothing(data: st.DataObject, spec: Any) -> None:
    torch.manual_seed(0)
    model = make(spec)
    shape_names = data.draw(st.sampled_from(MESHES))
    mesh = None if shape_names is None else fake_mesh(*shape_names[0], names=shape_names[1])
    sch = sf.create_schedule(model, mesh=mesh)
    paths = [p for p, _ in model.named_modules()] + [p for p, _ in model.named_parameters()]
    where = data.draw(selectors(paths))
    axis = data.draw(st.one_of(st.integers(-4, 4), st.none(), st.just("0")))
    mesh_axis = data.draw(st.sampled_from(["tp", "dp", "pp", "x"]))
    packed = data.draw(st.sampled_from([1, 2, 3, 0, -1]))
    kind = data.draw(st.integers(0, 17))
    before_model, before_sch = fingerprint(model), (fingerprint(sch.module), sch.annotations, sch.history)
    try:
        result = _call(kind, sch, where, axis, mesh_axis, packed)
    except TYPED as e:
        assert str(e) and "Traceback" not in str(e)
    else:
        assert isinstance(result, sf.Schedule | nn.Module)
    assert same(before_model, fingerprint(model))
    assert same(before_sch[0], fingerprint(sch.module))
    assert sch.annotations == before_sch[1] and sch.history == before_sch[2]


# -- on 2 gloo ranks ---------------------------------------------------------------------
def _tp2(rank: int, world: int) -> dict[str, Any]:
    from dist import mesh

    out: dict[str, Any] = {}
    ids = token_ids(batch=8, seq=32)
    gpt2 = tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    sch = sf.recipes.GPT2(sf.create_schedule(gpt2, mesh=mesh((world,), ("tp",))), tp=world)
    out["gpt2"] = str(sf.verify(sch, ids))  # at the default tolerances
    try:
        sf.verify(sf.replace(sch, "transformer.h.1.mlp.act", nn.ReLU()), ids)
    except sf.VerificationError as e:
        out["blame"] = e.module
    sp = sf.recipes.LLAMA(sf.create_schedule(tiny_llama(2), mesh=mesh((world,), ("tp",))), tp=world,
                          sequence_parallel=True)
    out["llama_sp"] = str(sf.verify(sp, ids))

    def scale(module: nn.Module, grad_output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(g * 1.001 for g in grad_output)  # a real bug: 0.1% on one layer's gradients

    try:
        sf.verify(sf.hook(sp, "model.layers.1.mlp.down_proj", "bwd_pre", scale), ids)
    except sf.VerificationError as e:
        out["bug"] = e.parameters
    return out


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_tp2_blames_the_replaced_module_and_tolerances_fit(dist2: Any) -> None:
    results = dist2.run(_tp2, timeout=120)
    for r in results:
        assert r["gpt2"].startswith("verified 1 outputs"), r["gpt2"]
        assert r.get("blame") == "transformer.h.1.mlp.act", r  # not the packed transformer.h.0.attn.c_attn
        assert r["llama_sp"].startswith("verified 1 outputs"), r["llama_sp"]
        assert "model.layers.1.mlp.down_proj.weight" in r.get("bug", ()), r
    assert results[0] == results[1]

