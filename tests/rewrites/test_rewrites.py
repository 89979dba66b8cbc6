"""Dynamic-graph primitives: replace, checkpoint, hook, annotate, compile — behaviour and every error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slapo_fn as sf
from tests.fingerprint import fingerprint, same
from tests.models import MLP, Net, tiny_gpt2, tiny_llama, token_ids


class TwoArgs(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


def _unchanged_after(sch: sf.Schedule, fn: object) -> None:
    """Run the failing call; the schedule and its tree must be untouched afterwards."""
    before, history, notes = fingerprint(sch.module), sch.history, sch.annotations
    with pytest.raises((sf.ScheduleError, sf.SelectorError)):
        fn()  # type: ignore[operator]
    assert same(before, fingerprint(sch.module)) and sch.history == history and sch.annotations == notes


# -- replace ------------------------------------------------------------------------
def test_replace_with_module_and_factory() -> None:
    model = Net(depth=3)
    sch = sf.create_schedule(model)
    sch = sf.replace(sch, "blocks.*.mlp.act", lambda old, path: nn.Tanh())
    assert all(type(sch.module.blocks[i].mlp.act) is nn.Tanh for i in range(3))
    assert all(type(model.blocks[i].mlp.act) is nn.GELU for i in range(3))
    seen: list[str] = []
    sf.replace(sch, "blocks.[0-1].norm", lambda old, path: seen.append(path) or old)
    assert seen == ["blocks.0.norm", "blocks.1.norm"]


def test_replace_root() -> None:
    sch = sf.replace(sf.create_schedule(MLP()), "", MLP())
    assert isinstance(sch.module, MLP) and sch.module is not sch.original


def test_replace_keeps_annotations_that_still_resolve_and_drops_the_rest() -> None:
    sch = sf.create_schedule(Net(depth=1))
    sch = sf.checkpoint(sch, "blocks.0.mlp")
    sch = sf.annotate(sch, "blocks.0.mlp.fc1.weight", "tag", 1)
    sch = sf.replace(sch, "blocks.0.mlp", lambda old, path: nn.Sequential(nn.Linear(8, 8)))
    assert "blocks.0.mlp" in sch.annotations  # the location is still checkpointed
    assert "blocks.0.mlp.fc1.weight" not in sch.annotations  # fc1 is gone


def test_replace_errors_name_every_path_and_leave_the_schedule_unchanged() -> None:
    sch = sf.create_schedule(Net(depth=2))
    with pytest.raises(sf.ScheduleError, match=r"(?s)2 problems.*'blocks.0.mlp'.*'blocks.1.mlp'.*pass a factory"):
        sf.replace(sch, "blocks.*.mlp", MLP())
    with pytest.raises(sf.ScheduleTypeError, match=r"must be an nn.Module or fn\(old, path\)"):
        sf.replace(sch, "blocks.0.mlp", 3)  # type: ignore[arg-type]
    with pytest.raises(sf.ScheduleTypeError, match="the factory returned int, not an nn.Module"):
        sf.replace(sch, "blocks.0.mlp", lambda old, path: 3)  # type: ignore[arg-type,return-value]
    with pytest.raises(sf.ScheduleError, match=r"(?s)requires 'y'.*fix: give the replacement a forward"):
        sf.replace(sch, "blocks.0.mlp", TwoArgs())
    with pytest.raises(sf.ScheduleError, match="is inside another selected module"):
        sf.replace(sch, ["blocks.0", "blocks.0.mlp"], lambda old, path: old)
    _unchanged_after(sch, lambda: sf.replace(sch, "blocks.*.mlp", MLP()))
    _unchanged_after(sch, lambda: sf.replace(sch, "blocks.0.mlpp", MLP()))


def test_replace_accepts_a_forward_with_extra_defaults_or_kwargs() -> None:
    class Loose(nn.Module):
        def forward(self, x: torch.Tensor, scale: float = 1.0, **kw: object) -> torch.Tensor:
            return x * scale

    sch = sf.replace(sf.create_schedule(Net(depth=1)), "blocks.0.mlp", Loose())
    assert isinstance(sch["blocks.0.mlp"].module, Loose)


def test_replace_hf_rmsnorm_keeps_numbers() -> None:
    llama = tiny_llama()

    class FusedRMSNorm(nn.Module):
        def __init__(self, old: nn.Module) -> None:
            super().__init__()
            self.weight = old.weight  # shares the parameter: same FQN, same storage
            self.eps = old.variance_epsilon

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return nn.functional.rms_norm(hidden_states, self.weight.shape, self.weight, self.eps)

    sch = sf.replace(sf.create_schedule(llama), sf.of_type(type(llama.model.norm)),
                     lambda old, path: FusedRMSNorm(old))
    report = sf.verify(sch, token_ids(), rtol=1e-5, atol=1e-5)
    assert len(report.gradients) == len(list(llama.parameters()))


# -- checkpoint -----------------------------------------------------------------------
@pytest.mark.parametrize("policy", [None, [torch.ops.aten.mm], "fn"])
def test_checkpoint_hf_llama_is_bit_identical(policy: object) -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    if policy == "fn":
        def save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
        policy = save_matmuls
    sch = sf.checkpoint(sf.create_schedule(tiny_llama()), "model.layers.*", policy=policy)
    report = sf.verify(sch, token_ids(), rtol=0, atol=0)
    assert report.max_grad_diff == 0.0 and report.max_output_diff == 0.0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_checkpoint_of_a_model_with_its_default_cache_trains_and_still_generates(family: str) -> None:
    """Hugging Face configs default to ``use_cache=True``: a recomputed decoder layer would
    append its keys and values to the cache twice (a selective checkpoint refused it in
    backward). Training forwards run without a cache, as HF's own gradient checkpointing
    does; a forward without gradients still returns one."""
    model = (tiny_llama if family == "llama" else tiny_gpt2)(use_cache=True)
    where = "model.layers.*" if family == "llama" else "transformer.h.*"
    sch = sf.checkpoint(sf.create_schedule(model), where, policy=[torch.ops.aten.mm])
    report = sf.verify(sch, token_ids(), rtol=0, atol=0)
    assert report.max_grad_diff == 0.0 and report.max_output_diff == 0.0
    built = sf.build(sch)
    with torch.no_grad():
        assert built(token_ids()).past_key_values is not None
    assert built(token_ids(), use_cache=True).past_key_values is not None  # asked for: kept


def test_checkpoint_gpt2_with_dropout_in_train_mode_is_bit_identical() -> None:
    sch = sf.checkpoint(sf.create_schedule(tiny_gpt2()), "transformer.h.*")
    report = sf.verify(sch, token_ids(), train=True, rtol=0, atol=0)
    assert report.max_grad_diff == 0.0


def test_checkpoint_actually_recomputes() -> None:
    calls: list[int] = []
    sch = sf.hook(sf.create_schedule(MLP()), "fc1", "fwd_post", lambda m, a, o: calls.append(1))
    sch = sf.checkpoint(sch, "")
    built = sf.build(sch)
    built(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert len(calls) == 2  # forward, then the recomputation in backward


@pytest.mark.parametrize("policy", [None, [torch.ops.aten.convolution]])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_checkpoint_of_batch_norms_counts_each_batch_once(policy: object, momentum: float | None) -> None:
    """Recomputing a batch norm in training mode would fold its batch into the running
    statistics a second time: they and the batch count stay as one forward leaves them."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Conv2d(4, 2, 1))

    plain, checkpointed = sf.build(sf.create_schedule(net())), sf.build(sf.checkpoint(sf.create_schedule(net()), "",
                                                                                       policy=policy))
    x = torch.randn(2, 3, 6, 6)
    for model in (plain, checkpointed):
        model.train()
        for _ in range(2):
            model(x).pow(2).sum().backward()
    for (name, want), got in zip(plain.named_buffers(), checkpointed.buffers(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    for want, got in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def test_checkpoint_errors() -> None:
    sch = sf.checkpoint(sf.create_schedule(Net(depth=2)), "blocks.0")
    with pytest.raises(sf.SelectorError, match="'weight' is a parameter.*acts on modules"):
        sf.checkpoint(sch, "head.weight")
    with pytest.raises(sf.ScheduleError, match=r"(?s)cannot nest: 'blocks.0.mlp' is inside 'blocks.0'"):
        sf.checkpoint(sch, "blocks.0.mlp")
    with pytest.raises(sf.ScheduleError, match=r"(?s)2 problems.*cannot nest"):
        sf.checkpoint(sch, ["blocks.0.norm", "blocks.0.mlp"])
    with pytest.raises(sf.ScheduleTypeError, match="policy must be None, a list of aten ops"):
        sf.checkpoint(sch, "blocks.1", policy=["mm"])
    _unchanged_after(sch, lambda: sf.checkpoint(sch, "blocks.0.mlp"))
    assert sf.checkpoint(sch, "blocks.0", policy=[torch.ops.aten.mm]).annotations["blocks.0"]["checkpoint"].save


# -- hook ----------------------------------------------------------------------------
def test_hooks_run_in_order_in_the_built_model_only() -> None:
    model = MLP()
    log: list[str] = []
    sch = sf.create_schedule(model)
    sch = sf.hook(sch, "fc1", "fwd_pre", lambda m, args: log.append("pre") or None)
    sch = sf.hook(sch, "fc1", "fwd_post", lambda m, args, out: log.append("post") or out * 2)
    sch = sf.hook(sch, "fc2", "bwd_post", lambda m, gin, gout: log.append("bwd") or None)
    sch = sf.hook(sch, "fc2", "bwd_pre", lambda m, gout: log.append("bwd_pre") or None)
    sch = sf.hook(sch, "fc1", "fwd_pre", lambda m, args, kwargs: log.append("kw") or None, with_kwargs=True)
    x = torch.randn(2, 8, requires_grad=True)
    built = sf.build(sch)
    out = built(x)
    assert log == ["pre", "kw", "post"]
    torch.testing.assert_close(out, model.fc2(model.act(model.fc1(x) * 2)))
    out.sum().backward()
    assert log[3:] == ["bwd_pre", "bwd"]
    assert not model.fc1._forward_hooks and not model.fc1._forward_pre_hooks


def test_hook_errors() -> None:
    sch = sf.create_schedule(MLP())
    with pytest.raises(sf.ScheduleError, match=r"(?s)unknown hook mode 'forward'.*use one of fwd_pre, fwd_post"):
        sf.hook(sch, "fc1", "forward", print)
    with pytest.raises(sf.ScheduleTypeError, match="the hook must be callable, got int"):
        sf.hook(sch, "fc1", "fwd_post", 3)  # type: ignore[arg-type]
    with pytest.raises(sf.ScheduleError, match="with_kwargs applies to forward hooks only"):
        sf.hook(sch, "fc1", "bwd_post", print, with_kwargs=True)
    _unchanged_after(sch, lambda: sf.hook(sch, "fc1", "forward", print))


# -- annotate ------------------------------------------------------------------------
def test_annotate_tags_survive_build_and_do_not_touch_the_original() -> None:
    model = MLP()
    sch = sf.annotate(sf.create_schedule(model), "fc*.weight", "lr_scale", 0.1)
    sch = sf.annotate(sch, "fc1.weight", "lr_scale", 0.2)
    sch = sf.annotate(sch, "fc1", "role", "up")
    built = sf.build(sch)
    assert (built.fc1.weight.lr_scale, built.fc2.weight.lr_scale, built.fc1.role) == (0.2, 0.1, "up")
    assert not hasattr(model.fc1.weight, "lr_scale") and not hasattr(model.fc1, "role")
    assert dict(sch["fc1"].annotations["tags"]) == {"role": "up"}


def test_annotate_errors() -> None:
    sch = sf.create_schedule(MLP())
    with pytest.raises(sf.ScheduleError, match=r"(?s)2 problems.*'grad' is already an attribute of Parameter"):
        sf.annotate(sch, "fc*.weight", "grad", 1)
    with pytest.raises(sf.ScheduleError, match="is not a plain identifier"):
        sf.annotate(sch, "fc1.weight", "lr scale", 1)
    with pytest.raises(sf.ScheduleError, match="'forward' is already an attribute of Linear"):
        sf.annotate(sch, "fc1", "forward", 1)
    with pytest.raises(sf.SelectorError, match="close matches: 'weight'"):
        sf.annotate(sch, "fc1.wieght", "x", 1)
    _unchanged_after(sch, lambda: sf.annotate(sch, "fc*.weight", "grad", 1))


# -- compile -------------------------------------------------------------------------
def test_compile_errors() -> None:
    sch = sf.compile(sf.create_schedule(Net(depth=2)), "blocks.0")
    with pytest.raises(sf.ScheduleError, match=r"(?s)unknown torch.compile option\(s\) fulgraph.*use only"):
        sf.compile(sch, "blocks.1", fulgraph=True)
    with pytest.raises(sf.ScheduleError, match="compile regions cannot nest"):
        sf.compile(sch, "blocks.0.mlp")
    _unchanged_after(sch, lambda: sf.compile(sch, "blocks.0.mlp"))


@pytest.mark.slow
def test_compile_hf_llama_mlp_and_gpt2_block_keep_numbers_and_fqns() -> None:
    llama = tiny_llama()
    sch = sf.compile(sf.create_schedule(llama), "model.layers.0.mlp")
    sf.verify(sch, token_ids(), rtol=1e-4, atol=1e-5)
    built = sf.build(sch)
    assert list(built.state_dict()) == list(llama.state_dict())
    gpt2 = tiny_gpt2()
    sch = sf.compile(sf.create_schedule(gpt2), "transformer.h.1.mlp")
    sf.verify(sch, token_ids(), rtol=1e-4, atol=1e-5)
    assert list(sf.build(sch).state_dict()) == list(gpt2.state_dict())


def test_state_dict_keys_unchanged_by_checkpoint_hook_annotate_compile() -> None:
    for model in (tiny_llama(), tiny_gpt2()):
        sch = sf.create_schedule(model)
        layers = "model.layers" if hasattr(model, "model") else "transformer.h"
        sch = sf.checkpoint(sch, f"{layers}.0")
        sch = sf.compile(sch, f"{layers}.1")
        sch = sf.hook(sch, f"{layers}.1", "fwd_post", lambda m, a, o: None)
        sch = sf.annotate(sch, f"{layers}.*", "stage", 0)
        built = sf.build(sch)
        assert list(built.state_dict()) == list(model.state_dict())
        assert [n for n, _ in built.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_rmsnorm_kernel_refuses_what_is_not_an_rmsnorm() -> None:
    from slapo_fn.kernels import RMSNorm

    with pytest.raises(TypeError, match="model.layers.0.mlp: not an RMSNorm with a weight and an epsilon"):
        RMSNorm.from_hf(nn.ReLU(), "model.layers.0.mlp")


def test_replace_gpt2_activation_keeps_numbers() -> None:
    gpt2 = tiny_gpt2()
    sch = sf.replace(sf.create_schedule(gpt2), "transformer.h.*.mlp.act", lambda old, path: nn.GELU("tanh"))
    report = sf.verify(sch, token_ids(), rtol=1e-4, atol=1e-4)  # another GELU kernel: float noise only
    assert report.outputs and len(report.gradients) == len(list(gpt2.parameters()))
    assert type(gpt2.transformer.h[0].mlp.act) is not nn.GELU
