"""Selectors: every form lowers to one Selection; no match is a SelectorError with help."""

from __future__ import annotations

import pytest
from torch import nn

import slapo_fn as sf
from slapo_fn.select import select
from tests.models import Net, tiny_llama


@pytest.fixture(scope="module")
def net() -> nn.Module:
    return Net(depth=4)


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("blocks.1.mlp", ("blocks.1.mlp",)),
        ("blocks.*.mlp", tuple(f"blocks.{i}.mlp" for i in range(4))),
        ("blocks.[1-2].norm", ("blocks.1.norm", "blocks.2.norm")),
        ("blocks.[0,3]", ("blocks.0", "blocks.3")),
        ("blocks.*.mlp.fc?", tuple(f"blocks.{i}.mlp.fc{j}" for i in range(4) for j in (1, 2))),
        ("**.fc2", tuple(f"blocks.{i}.mlp.fc2" for i in range(4))),
        ("blocks.0.{mlp,norm}", ("blocks.0.norm", "blocks.0.mlp")),
        ("blocks.1.mlp.{fc2,act}", ("blocks.1.mlp.act", "blocks.1.mlp.fc2")),
        ("", ("",)),
        (["head", "embed", "head"], ("head", "embed")),
    ],
)
def test_path_globs(net: nn.Module, where: object, expected: tuple[str, ...]) -> None:
    assert select(where).modules(net) == expected


def test_types_predicates_and_unions(net: nn.Module) -> None:
    assert select(sf.of_type(nn.LayerNorm)).modules(net) == tuple(f"blocks.{i}.norm" for i in range(4))
    assert select(sf.where_fn(lambda p, m: p.endswith("3.mlp"))).modules(net) == ("blocks.3.mlp",)
    both = select([sf.of_type(nn.Embedding), "blocks.0.mlp.fc1"])
    assert both.modules(net) == ("embed", "blocks.0.mlp.fc1")


def test_parameter_paths(net: nn.Module) -> None:
    assert select("blocks.0.mlp.fc1.weight").parameters(net) == ("blocks.0.mlp.fc1.weight",)
    assert select("blocks.[0-1].mlp.fc1").parameters(net) == (
        "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc1.bias", "blocks.1.mlp.fc1.weight", "blocks.1.mlp.fc1.bias")
    assert select("blocks.0.mlp.fc*.bias").paths(net) == ("blocks.0.mlp.fc1.bias", "blocks.0.mlp.fc2.bias")


def test_relative_selection_under_a_missing_base(net: nn.Module) -> None:
    with pytest.raises(sf.SelectorError, match="close matches: 'blocks'"):
        select("mlp").under("blokcs.0").modules(net)


def test_relative_selection(net: nn.Module) -> None:
    assert select("mlp.fc1").under("blocks.2").modules(net) == ("blocks.2.mlp.fc1",)
    assert select(sf.of_type(nn.Linear)).under("blocks.1").modules(net) == ("blocks.1.mlp.fc1", "blocks.1.mlp.fc2")


def test_no_match_names_key_prefix_token_and_close_matches(net: nn.Module) -> None:
    with pytest.raises(sf.SelectorError, match=r"'blocks.\*' \(4 modules\) matched, but nothing under it matches "
                                               r"'mpl'.*close matches: 'mlp'") as info:
        select("blocks.*.mpl.fc1").modules(net)
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, ValueError)
    assert (err.key, err.prefix, err.token, err.candidates) == ("blocks.*.mpl.fc1", "blocks.*", "mpl", ("mlp",))
    assert "Linear(" not in str(err)  # never a module repr


def test_no_match_on_ranges_types_and_predicates(net: nn.Module) -> None:
    with pytest.raises(sf.SelectorError, match=r"nothing under it matches '\[7-9\]'"):
        select("blocks.[7-9]").modules(net)
    with pytest.raises(sf.SelectorError, match=r"of_type\(Conv2d\).*matches no module"):
        select(sf.of_type(nn.Conv2d)).modules(net)
    with pytest.raises(sf.SelectorError, match="where_fn"):
        select(sf.where_fn(lambda p, m: False)).modules(net)
    with pytest.raises(sf.SelectorError, match="'weight' is a parameter, and this primitive acts on modules"):
        select("head.weight").modules(net)
    with pytest.raises(sf.SelectorError, match="no parameters of their own"):
        select("blocks.0.mlp.act").parameters(net)


def test_bad_selector_types() -> None:
    with pytest.raises(TypeError, match="a selector is a path string"):
        select(3)
    with pytest.raises(TypeError, match="of_type takes classes"):
        sf.of_type("Linear")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="where_fn takes a callable"):
        sf.where_fn(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot mix relative"):
        select([select("a").under("b"), "c"])
    with pytest.raises(sf.ScheduleTypeError, match="a selector is a path string"):
        sf.checkpoint(sf.create_schedule(Net()), 3)  # type: ignore[arg-type]


def test_hf_llama_paths() -> None:
    llama = tiny_llama()
    assert select("model.layers.*.self_attn.[qkv]_proj").modules(llama) == tuple(
        f"model.layers.{i}.self_attn.{n}_proj" for i in range(2) for n in "qkv")
    with pytest.raises(sf.SelectorError, match="close matches: 'self_attn'"):
        select("model.layers.0.self_atn").modules(llama)
