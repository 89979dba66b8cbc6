"""The Schedule value: frozen, copy-on-write, views, printing, meta device."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import slapo_fn as sf
from slapo_fn.tree import set_at, shallow_clone
from tests.fingerprint import fingerprint, same
from tests.models import Net, tiny_llama


def test_schedule_is_frozen() -> None:
    sch = sf.create_schedule(Net())
    with pytest.raises(dataclasses.FrozenInstanceError):
        sch.module = nn.Linear(1, 1)  # type: ignore[misc]
    with pytest.raises(TypeError):
        sch.annotations["x"] = {}  # type: ignore[index]


def test_create_schedule_does_not_copy_or_touch_the_model() -> None:
    model = Net()
    before = fingerprint(model)
    sch = sf.create_schedule(model)
    assert sch.module is model and sch.original is model and sch.history == ()
    assert same(before, fingerprint(model))


def test_create_schedule_rejects_non_modules_and_bad_meshes() -> None:
    with pytest.raises(sf.ScheduleTypeError, match="expected an nn.Module, got int"):
        sf.create_schedule(3)  # type: ignore[arg-type]
    with pytest.raises(sf.ScheduleTypeError, match="mesh must be a DeviceMesh"):
        sf.create_schedule(Net(), mesh="tp")  # type: ignore[arg-type]


def test_shallow_clone_has_fresh_containers_and_shared_leaves() -> None:
    m = nn.Linear(2, 2)
    m.register_forward_hook(lambda *a: None)
    c = shallow_clone(m)
    assert type(c) is nn.Linear and c is not m
    for attr in ("_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks",
                 "_backward_hooks", "_non_persistent_buffers_set"):
        assert getattr(c, attr) is not getattr(m, attr), attr
        assert getattr(c, attr) == getattr(m, attr), attr
    assert c.weight is m.weight


def test_set_at_copies_only_the_path() -> None:
    model = Net(depth=4)
    new_mlp = nn.Identity()
    root = set_at(model, "blocks.2.mlp", new_mlp)
    assert root is not model and root.blocks is not model.blocks and root.blocks[2] is not model.blocks[2]
    assert root.blocks[2].mlp is new_mlp and model.blocks[2].mlp is not new_mlp
    assert root.embed is model.embed and root.head is model.head
    assert all(root.blocks[i] is model.blocks[i] for i in (0, 1, 3))
    assert root.blocks[2].norm is model.blocks[2].norm
    assert root.head.weight is root.embed.weight  # tie kept


def test_view_is_read_only_and_describes_the_path() -> None:
    sch = sf.checkpoint(sf.create_schedule(Net()), "blocks.0")
    view = sch["blocks.0"]
    assert view.path == "blocks.0" and view.type.__name__ == "Block"
    assert view.children == ("norm", "mlp")
    assert "checkpoint" in view.annotations
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.path = "x"  # type: ignore[misc]
    assert dict(sch["blocks.0.mlp.fc1"].parameters) == {"weight": ((16, 8), torch.float32),
                                                        "bias": ((16,), torch.float32)}
    with pytest.raises(sf.SelectorError, match="close matches: 'blocks'"):
        sch["blokcs.0"]
    with pytest.raises(sf.SelectorError, match=r"(?s)a view needs one exact module path; this selects 3.*"
                                               r"fix: index with one of them, e.g. sch\['blocks.0'\]"):
        sch["blocks.*"]


def test_print_shows_tree_layouts_and_annotations() -> None:
    sch = sf.annotate(sf.checkpoint(sf.create_schedule(Net(depth=3)), "blocks.1"), "embed.weight", "lr", 2.0)
    text = str(sch)
    assert "embed: Embedding" in text
    assert "· weight: f32[16, 8]  [tags(lr=2.0)]" in text
    assert "1: Block  [checkpoint]" in text
    assert "[0-2]" not in text  # an annotated block breaks the fold
    assert "[0-2]: Block ×3" in str(sf.create_schedule(Net(depth=3)))
    assert repr(sch) == "Schedule(Net, 2 rewrites, 2 annotated paths, mesh=None)"


def test_meta_device_schedules_and_explain_need_no_memory() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                             num_attention_heads=32, num_key_value_heads=32, vocab_size=32000))
    sch = sf.create_schedule(model)
    sch = sf.foreach("model.layers.*", sf.checkpoint.at("") >> sf.annotate.at("mlp.up_proj.weight", "tp", 0))(sch)
    sch = sf.replace(sch, "model.norm", lambda old, path: nn.RMSNorm(4096, device="meta"))
    info = sf.explain(sch)
    assert info.total_parameters == 6_738_415_616
    assert "[0-31]: LlamaDecoderLayer ×32  [checkpoint]" in info.tree
    assert all(p.is_meta for p in sch.module.parameters())


def test_tied_parameters_stay_tied_across_rewrites() -> None:
    llama = tiny_llama(tie_word_embeddings=True)
    assert llama.lm_head.weight is llama.model.embed_tokens.weight
    sch = sf.replace(sf.create_schedule(llama), "model.layers.0.mlp", lambda old, path: old)
    sch = sf.replace(sch, "model.norm", lambda old, path: nn.RMSNorm(64, eps=1e-6))
    assert sch.module.lm_head.weight is sch.module.model.embed_tokens.weight
    built = sf.build(sch)
    assert built.lm_head.weight is built.model.embed_tokens.weight
    assert built.lm_head.weight is not llama.lm_head.weight
