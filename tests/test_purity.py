"""Purity laws, property-based: no rewrite (or build) mutates the model or any earlier schedule;
untouched subtrees are shared; rewrites on disjoint paths commute."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import slapo_fn as sf
from tests.fingerprint import fingerprint, same
from tests.models import tiny_bert, tiny_gpt2, tiny_llama

LEAVES: list[Callable[[], nn.Module]] = [lambda: nn.Linear(4, 4), nn.ReLU, lambda: nn.LayerNorm(4), nn.GELU]

trees = st.recursive(
    st.sampled_from(range(len(LEAVES))),
    lambda children: st.lists(children, min_size=1, max_size=3),
    max_leaves=10,
)


def make(spec: Any) -> nn.Module:
    torch.manual_seed(0)
    if isinstance(spec, int):
        return LEAVES[spec]()
    return nn.ModuleDict({f"m{i}": make(s) for i, s in enumerate(spec)})


def fingerprint_schedule(sch: sf.Schedule) -> tuple[list[Any], sf.Annotations, tuple[object, ...]]:
    return fingerprint(sch.module), sch.annotations, sch.history


def same_schedule(a: tuple[list[Any], sf.Annotations, tuple[object, ...]], sch: sf.Schedule) -> bool:
    tree, notes, history = a
    return same(tree, fingerprint(sch.module)) and notes == sch.annotations and history == sch.history


def _identity_forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return output


REWRITES: list[Callable[[sf.Schedule, str], sf.Schedule]] = [
    lambda sch, p: sf.replace(sch, p, lambda old, path: nn.Identity()),
    lambda sch, p: sf.checkpoint(sch, p),
    lambda sch, p: sf.checkpoint(sch, p, policy=[torch.ops.aten.mm]),
    lambda sch, p: sf.hook(sch, p, "fwd_post", _identity_forward),
    lambda sch, p: sf.annotate(sch, p, "tag", p),
    lambda sch, p: sf.compile(sch, p, backend="eager"),
]


def _layout_rewrites() -> list[Callable[[sf.Schedule, str], sf.Schedule]]:
    from torch.distributed.tensor import Replicate

    return [
        lambda sch, p: sf.shard(sch, p, axis=0),
        lambda sch, p: sf.shard(sch, p, axis=1),
        lambda sch, p: sf.fork_rng(sch, p),
        lambda sch, p: sf.sequence_parallel(sch, p),
        lambda sch, p: sf.sync(sch, p, "fwd_post", Replicate()),
    ]


def apply_sequence(model: nn.Module, steps: list[tuple[int, int]], *, mesh: Any = None,
                   rewrites: list[Callable[[sf.Schedule, str], sf.Schedule]] = REWRITES) -> None:
    """Apply rewrites one by one; after each, the model and every earlier schedule are unchanged."""
    original = fingerprint(model)
    sch = sf.create_schedule(model, mesh=mesh)
    earlier: list[tuple[sf.Schedule, Any]] = [(sch, fingerprint_schedule(sch))]
    for kind, which in steps:
        paths = list(sch.paths())
        path = paths[which % len(paths)]
        old_root = sch.module
        try:
            new = rewrites[kind % len(rewrites)](sch, path)
        except (sf.ScheduleError, sf.SelectorError):
            assert same_schedule(earlier[-1][1], sch)  # a failed rewrite leaves its input untouched
            continue
        if kind % len(rewrites) == 0:  # replace: structural
            _check_sharing(old_root, new.module, path)
        else:
            assert new.module is old_root  # annotation rewrites copy nothing of the tree
        sch = new
        earlier.append((sch, fingerprint_schedule(sch)))
        for old_sch, print_ in earlier:
            assert same_schedule(print_, old_sch)
        assert same(original, fingerprint(model))
    with contextlib.suppress(sf.LayoutError):  # a refused build (an SP chain nothing gathers for) changes nothing
        sf.build(sch)
    assert same(original, fingerprint(model))
    for old_sch, print_ in earlier:
        assert same_schedule(print_, old_sch)


def _check_sharing(old_root: nn.Module, new_root: nn.Module, changed: str) -> None:
    """Every module off the path to ``changed`` is the very same object in the new tree."""
    new_modules = dict(new_root.named_modules(remove_duplicate=False))
    for path, module in old_root.named_modules(remove_duplicate=False):
        on_path = changed == path or changed.startswith(path + ".") or path == ""
        inside = path.startswith(changed + ".") or (changed == "" and path != "")
        if not on_path and not inside:
            assert new_modules[path] is module, path
        if on_path and path != changed:
            assert new_modules[path] is not module and type(new_modules[path]) is type(module)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=trees, steps=st.lists(st.tuples(st.integers(0, len(REWRITES) - 1), st.integers(0, 50)), max_size=8))
def test_random_rewrites_on_random_trees_are_pure(spec: Any, steps: list[tuple[int, int]]) -> None:
    apply_sequence(make(spec), steps)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gpt2, tiny_bert], ids=["llama", "gpt2", "bert"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.integers(0, len(REWRITES) - 1), st.integers(0, 200)), min_size=1, max_size=6))
def test_random_rewrites_on_hf_models_are_pure(factory: Callable[[], nn.Module], steps: list[tuple[int, int]]) -> None:
    apply_sequence(factory(), steps)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=trees, steps=st.lists(st.tuples(st.integers(0, 10), st.integers(0, 50)), max_size=8))
def test_layout_rewrites_and_their_build_are_pure(spec: Any, steps: list[tuple[int, int]]) -> None:
    from slapo_fn.dtensor.testing import fake_mesh

    apply_sequence(make(spec), steps, mesh=fake_mesh(2), rewrites=REWRITES + _layout_rewrites())


@settings(max_examples=40, deadline=None)
@given(spec=trees, a=st.tuples(st.integers(0, len(REWRITES) - 1), st.integers(0, 50)),
       b=st.tuples(st.integers(0, len(REWRITES) - 1), st.integers(0, 50)))
def test_rewrites_on_disjoint_paths_commute(spec: Any, a: tuple[int, int], b: tuple[int, int]) -> None:
    model = make(spec)
    paths = [p for p, _ in model.named_modules(remove_duplicate=False)]
    pa, pb = paths[a[1] % len(paths)], paths[b[1] % len(paths)]
    nested = pa == pb or pa == "" or pb == "" or pa.startswith(pb + ".") or pb.startswith(pa + ".")
    if nested:
        return
    sch = sf.create_schedule(model)
    try:
        ab = REWRITES[b[0]](REWRITES[a[0]](sch, pa), pb)
        ba = REWRITES[a[0]](REWRITES[b[0]](sch, pb), pa)
    except (sf.ScheduleError, sf.SelectorError):
        return
    assert ab.annotations == ba.annotations
    original = {id(m) for m in model.modules()}

    def shape(root: nn.Module) -> list[tuple[str, type, object]]:
        # modules of the original must be the very same objects; new ones (replacements,
        # cloned ancestors) are compared by type
        return [(p, type(m), id(m) if id(m) in original and not _is_ancestor(p, pa, pb) else "new")
                for p, m in root.named_modules(remove_duplicate=False)]

    assert shape(ab.module) == shape(ba.module)


def _is_ancestor(path: str, *changed: str) -> bool:
    return any(path == "" or c == path or c.startswith(path + ".") for c in changed)
