"""Worker-side checks for the tensor-parallel tests (run on every rank by tests/dist.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from dist import mesh
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import slapo_fn as sf
from slapo_fn.dtensor.boundary import plan
from slapo_fn.dtensor.dryrun import dtensor_collectives


def counts(mode: CommDebugMode | CountCollectives) -> dict[str, int]:
    if isinstance(mode, CountCollectives):
        return dict(mode.seen)
    return {str(k).split(".")[-1].replace("_into_tensor", "").replace("_tensor", ""): v
            for k, v in mode.get_comm_counts().items() if v}


class CountCollectives(TorchDispatchMode):
    """Counts functional collectives like CommDebugMode, without its module tracker (which
    fails on models that call one module from two parents, e.g. T5's shared embedding).

    An op on DTensors is handed back to DTensor (``NotImplemented``, as CommDebugMode does):
    a mode runs before tensor subclasses, so otherwise the collectives DTensor's sharding
    propagation issues inside that op's dispatch would run with this mode switched off and
    go uncounted; DTensor then re-dispatches the local ops and collectives, seen here."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        op = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and op != "wait_tensor" and not op.startswith("_"):
            name = func.__name__.split(".")[0].replace("_into_tensor", "").replace("_tensor", "")
            self.seen[name] = self.seen.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _activation(out: Any) -> torch.Tensor | None:
    """A model output's activation: itself, its logits or last hidden state, or a tuple's first."""
    if isinstance(out, tuple | list) and out:
        out = out[0]
    for name in ("logits", "last_hidden_state"):
        found = getattr(out, name, None)
        if isinstance(found, torch.Tensor):
            return found
    return out if isinstance(out, torch.Tensor) and out.is_floating_point() else None


def _default_loss(out: Any, _: sf.Schedule) -> torch.Tensor:
    return (out if isinstance(out, torch.Tensor) else out.logits).float().pow(2).mean()


@dataclass(frozen=True)
class Reference:
    """The single-process run :func:`parity` compares with: the loss, the output's
    activation, the inputs' gradients (``None`` for integer inputs) and every parameter's
    (by name; ``None`` where the loss does not reach it)."""

    loss: torch.Tensor
    activation: torch.Tensor | None
    input_grads: tuple[torch.Tensor | None, ...]
    grads: dict[str, torch.Tensor | None]


def single_process(
    model: nn.Module, inputs: tuple[Any, ...], loss: Callable[[Any, sf.Schedule], torch.Tensor] | None = None
) -> Reference:
    """``model`` built unsharded (a private copy), one forward and backward of ``loss``."""
    loss = loss or _default_loss
    ref = sf.build(sf.create_schedule(model))
    ref.eval()
    ref_in = tuple(t.clone().requires_grad_(True) if t.is_floating_point() else t for t in inputs)
    out = ref(*ref_in)
    value = loss(out, sf.create_schedule(model))
    value.backward()
    act = _activation(out)
    return Reference(
        loss=value.detach(),
        activation=None if act is None else act.detach(),
        input_grads=tuple(t.grad if t.is_floating_point() else None for t in ref_in),
        grads={n: p.grad for n, p in ref.named_parameters()},
    )


def parity(
    model: nn.Module,
    rewrite: Callable[[sf.Schedule], sf.Schedule],
    inputs: tuple[Any, ...],
    *,
    shape: tuple[int, ...],
    names: tuple[str, ...] = ("tp",),
    loss: Callable[[Any, sf.Schedule], torch.Tensor] | None = None,
    atol: float = 1e-5,
    tracker: bool = True,
    reference: Reference | None = None,
    predict: bool = True,
) -> dict[str, Any]:
    """Build ``rewrite(sch)`` and the unsharded model from the same weights; compare the
    forward output, every gradient, and return collective counts (fwd/bwd) + explain's
    (``predicted``; ``None`` without ``predict``). ``reference``: the unsharded run, where
    the caller keeps one per model and loss (:func:`reference`), else made here."""
    m = mesh(shape, names)
    sch = rewrite(sf.create_schedule(model, mesh=m))
    built = sf.build(sch)
    built.eval()
    loss = loss or _default_loss
    ref = reference or single_process(model, inputs, loss)
    inputs = tuple(t.clone().requires_grad_(True) if t.is_floating_point() else t for t in inputs)
    mode = CommDebugMode if tracker else CountCollectives
    with mode() as fwd:
        out = built(*inputs)
        value = loss(out, sch)
    with mode() as bwd:
        value.backward()
    torch.testing.assert_close(value.detach(), ref.loss, atol=atol, rtol=1e-4)
    # the output itself, where it is a whole tensor: a loss symmetric in the tokens would not
    # see them permuted (each rank's rows gathered in another order)
    got, want = _activation(out), ref.activation
    if got is not None and want is not None and not isinstance(got, DTensor) and got.shape == want.shape:
        torch.testing.assert_close(got.detach(), want, atol=atol, rtol=1e-4, msg=lambda s: f"output: {s}")
    for a, b in zip(ref.input_grads, inputs, strict=True):
        if b.is_floating_point():
            torch.testing.assert_close(b.grad, a, atol=atol, rtol=1e-4, msg=lambda s: f"input grad: {s}")
    grads = ref.grads
    checked = 0
    for name, p in built.named_parameters():
        g_ref = grads[name]
        if g_ref is None:  # not in the loss (a pooler): no gradient on either side
            assert p.grad is None, f"{name}: a gradient where the reference has none"
            continue
        assert p.grad is not None, name
        torch.testing.assert_close(full(p.grad), g_ref, atol=atol, rtol=1e-4, msg=lambda s, n=name: f"{n}: {s}")
        checked += 1
    # a plan run on DTensor activations: DTensor's own collectives, counted by explain's fake run
    # (None where the model cannot run on fake tensors: explain then says the counts are unknown)
    the_plan = plan(sch)
    on_dtensors = bool(the_plan.on_dtensors)
    predicted = None if not predict else _fake_counts(sch, inputs) if on_dtensors else the_plan.counts()
    return {
        "fwd": counts(fwd),
        "bwd": counts(bwd),
        "predicted": predicted,
        "on_dtensors": on_dtensors,
        "grads": checked,
        "dtensors": sorted(n for n, p in built.named_parameters() if isinstance(p, DTensor)),
        "placements": {n: tuple(map(str, p.placements)) for n, p in built.named_parameters() if isinstance(p, DTensor)},
        "grad_placements": {n: tuple(map(str, p.grad.placements)) for n, p in built.named_parameters()
                            if isinstance(p.grad, DTensor)},
        "meshes": {n: tuple(p.device_mesh.mesh_dim_names or ()) for n, p in built.named_parameters()
                   if isinstance(p, DTensor)},
    }


def _fake_counts(sch: sf.Schedule, inputs: tuple[Any, ...]) -> dict[str, dict[str, int]] | None:
    found, _ = dtensor_collectives(sch, inputs)
    if found is None:
        return None
    out: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    for r in found:
        out[r.direction][r.op] = out[r.direction].get(r.op, 0) + 1
    return out
