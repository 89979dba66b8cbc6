"""``verify``: forward and backward parity of a schedule against a reference model."""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from .build import _has_meta, build
from .combinators import Rewrite
from .dtensor.collectives import _all_gather
from .dtensor.sequence import SEQ
from .dtensor.shard import ROLE, mesh_dims
from .errors import Problem, ScheduleError, ScheduleTypeError, SelectorError, VerificationError
from .hf import TOKEN_ID_ARGS, extra_keywords, input_embedding, is_pretrained_model
from .ranks import every_rank
from .schedule import Schedule, create_schedule
from .seeding import seeded
from .tree import private_copy, walk

__all__ = ["DEFAULT_TOLERANCES", "VerifyReport", "check_inputs", "verified", "verify"]

#: ``(rtol, atol)`` by dtype: a tensor ``b`` matches the reference ``a`` where
#: ``|a - b| <= atol + rtol * scale`` element by element, ``scale`` being the largest
#: finite ``|a|`` of the whole tensor. Tensor parallelism sums the same terms in another
#: order, which changes the last bits *relative to the size of the summands*: an element
#: that cancels to nearly zero keeps an error of the order of the tensor's large elements,
#: which an element-wise relative test (``torch.testing``'s) rejects. Measured on the
#: recipes at tp=2 in float32: at most 9e-7 of the scale; the float32 rtol leaves a factor
#: of 10 above that. A bug (a wrong shard order, a missing reduction, a doubled gradient,
#: a replaced activation) moves elements by a large part of the scale.
DEFAULT_TOLERANCES: Mapping[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (4e-3, 1e-5),
}


#: Low-precision dtypes, whose results are also compared with a float32 run of the
#: reference (see :func:`_anchored`).
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _anchored(b: torch.Tensor, a: torch.Tensor, a32: torch.Tensor | None, atol: float | None) -> bool:
    """For a low-precision tensor: whether the schedule's ``b`` is no further from the
    float32 reference ``a32`` than twice the low-precision reference ``a`` is (the largest
    difference over the tensor, plus ``atol``) — the test kernel libraries use. In
    bfloat16, summing in another order (tensor parallelism) moves a gradient by as much
    as the reference's own rounding does, far beyond a fixed share of its scale; a bug
    moves it much further from the float32 result than rounding does."""
    if a32 is None or a.dtype not in LOW_PRECISION or a.shape != b.shape or a32.shape != a.shape:
        return False
    exact = a32.double()
    own = (a.double() - exact).abs().max().item() if a.numel() else 0.0
    ours = (b.double() - exact).abs().max().item() if b.numel() else 0.0
    t = DEFAULT_TOLERANCES[a.dtype][1] if atol is None else atol
    return math.isfinite(ours) and ours <= 2 * own + t


def _float32_reference(ref: nn.Module) -> nn.Module | None:
    """A float32 copy of ``ref`` when it holds low-precision floating tensors, else None."""
    tensors = [*ref.parameters(), *ref.buffers()]
    if not any(t.dtype in LOW_PRECISION for t in tensors):
        return None
    return private_copy(ref, copy_data=True).float()


def _float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in LOW_PRECISION else value
    if isinstance(value, Mapping):
        return {k: _float32(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_float32(v) for v in value)
    return value


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return (full_tensor() if callable(full_tensor) else t).detach()


def _leaves(value: Any, name: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Tensors inside nested tuples/lists/dicts (Hugging Face ``ModelOutput`` included)."""
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, Mapping):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{name}.{k}")]
    if isinstance(value, list | tuple):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{name}[{i}]")]
    return []


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else math.inf
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float | None, atol: float | None) -> bool:
    """Whether ``a`` matches the reference ``b`` (see :data:`DEFAULT_TOLERANCES`)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    if not a.numel():
        return True
    r, t = DEFAULT_TOLERANCES.get(a.dtype, (1e-5, 1e-5))
    r, t = (r if rtol is None else rtol), (t if atol is None else atol)
    ref = b.double()
    finite = ref.isfinite()
    if not torch.equal(finite, a.isfinite()) or not torch.equal(ref[~finite], a.double()[~finite]):
        return False  # NaN or ±inf where the other is not (or another one)
    scale = ref[finite].abs().max().item() if finite.any() else 0.0
    return bool(((a.double() - ref)[finite].abs() <= t + r * scale).all())


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` compared: max abs difference per output and per gradient."""

    outputs: Mapping[str, float]
    gradients: Mapping[str, float] = field(default_factory=dict)

    @property
    def max_output_diff(self) -> float:
        return max(self.outputs.values(), default=0.0)

    @property
    def max_grad_diff(self) -> float:
        return max(self.gradients.values(), default=0.0)

    def __str__(self) -> str:
        return (
            f"verified {len(self.outputs)} outputs (max |diff| {self.max_output_diff:.3g}) and "
            f"{len(self.gradients)} gradients (max |diff| {self.max_grad_diff:.3g})"
        )


def _run(model: nn.Module, inputs: tuple[Any, ...], kwargs: Mapping[str, Any], seed: int) -> Any:
    with seeded(seed):
        return model(*inputs, **kwargs)


Gather = Callable[[torch.Tensor, tuple[int, ...], int], torch.Tensor]

#: slapo_fn's own errors pass through verify unchanged: they name their path already.
_OWN_ERRORS = (ScheduleError, SelectorError, VerificationError)


def _no_gather(t: torch.Tensor, shape: tuple[int, ...], packed: int = 1) -> torch.Tensor:
    return t


def _chunk_major(t: torch.Tensor, dim: int, ranks: int, chunks: int) -> torch.Tensor:
    """Features gathered rank by rank from a packed column (each rank holds its slice of each
    of ``chunks`` fused chunks: ``[Q0|K0|V0|Q1|K1|V1]``) → the unsharded order (``[Q0|Q1|K0|K1|V0|V1]``)."""
    width = t.shape[dim] // (ranks * chunks)
    return t.unflatten(dim, (ranks, chunks, width)).transpose(dim, dim + 1).flatten(dim, dim + 2)


class _Ranks:
    """How ``verify`` runs inside a process group (a schedule with a mesh, on every
    rank): local activation shards are all-gathered to the reference's shape, and every
    verdict is agreed on by all ranks (so that they all take the same path through the
    collectives and all raise the same error)."""

    def __init__(self, sch: Schedule) -> None:
        self.active = sch.mesh is not None and dist.is_initialized() and dist.get_world_size() > 1
        self.gather: Gather = _no_gather
        #: Modules whose output is ``k`` fused chunks (GPT-2's ``c_attn``, ``packed=3``): their
        #: gathered features are put back in the reference's element order before comparing.
        self.packed = {p: r.packed for p, r in sch.annotations.of_kind(ROLE).items()
                       if isinstance(r.gives(3), _StridedShard)}
        if not self.active or sch.mesh is None:
            return
        axes = {r.mesh_axis for r in sch.annotations.of_kind(ROLE).values()}
        axes |= {q.mesh_axis for q in sch.annotations.of_kind(SEQ).values()}
        if len(axes) != 1:
            return
        dims = mesh_dims(sch.mesh)
        axis = (sch.mesh, dims.index(axes.pop()))
        size = int(sch.mesh.size(axis[1]))

        def gather(t: torch.Tensor, shape: tuple[int, ...], packed: int = 1) -> torch.Tensor:
            """A local shard (activations travel as local tensors between sharded modules:
            heads, features or sequence positions of this rank) → the full tensor. Shapes
            are the same on every rank, so every rank decides alike."""
            if tuple(t.shape) == shape or t.dim() != len(shape):
                return t
            diff = [d for d in range(t.dim()) if t.shape[d] != shape[d]]
            if len(diff) != 1 or t.shape[diff[0]] * size != shape[diff[0]]:
                return t
            full = _all_gather(t.detach(), diff[0], axis)
            if packed > 1 and t.shape[diff[0]] % packed == 0:
                full = _chunk_major(full, diff[0], size, packed)
            return full

        self.gather = gather

    def gathered(self, values: list[Any]) -> list[Any]:
        """``values`` of every rank (the local one alone outside a process group)."""
        if not self.active:
            return values
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, values)
        return [v for rank in out for v in rank]

    def agree(self, diffs: dict[str, float], bad: list[str]) -> tuple[dict[str, float], list[str]]:
        """The verdict of all ranks: per name the worst difference anywhere, bad if bad
        anywhere (``diffs``/``bad`` unchanged outside a process group)."""
        if not self.active:
            return diffs, bad
        every = self.gathered([(diffs, bad)])
        return {n: max(d[n] for d, _ in every) for n in diffs}, [n for n in diffs if any(n in b for _, b in every)]


@dataclass
class _Trace:
    """Every module's output leaves, in the order the modules finished (first call only);
    where a forward raised (``tolerate=True``), the innermost module still running then."""

    outputs: dict[str, list[tuple[str, torch.Tensor]]]
    failed_at: str | None = None
    error: Exception | None = None


def _module_outputs(
    model: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    seed: int,
    shapes: Mapping[str, list[tuple[int, ...]]] | None = None,
    ranks: _Ranks | None = None,
    *,
    tolerate: bool = False,
) -> _Trace:
    """Run ``model`` once, recording every module's output leaves; with ``shapes`` (the
    reference's), local shards are gathered to those shapes."""
    trace = _Trace({})
    running: list[str] = []
    handles = []
    gather = ranks.gather if ranks is not None else _no_gather
    packed = ranks.packed if ranks is not None else {}

    def enter(path: str) -> Callable[..., None]:
        def hook(_: nn.Module, __: Any) -> None:
            running.append(path)

        return hook

    def record(path: str) -> Callable[..., None]:
        def hook(_: nn.Module, __: Any, output: Any) -> None:
            if running and running[-1] == path:
                running.pop()
            if path not in trace.outputs:
                leaves = [(n, _full(t)) for n, t in _leaves(output)]
                want = (shapes or {}).get(path)
                if want is not None and len(want) == len(leaves):
                    leaves = [(n, gather(t, w, packed.get(path, 1))) for (n, t), w in zip(leaves, want, strict=True)]
                trace.outputs[path] = leaves

        return hook

    for path, module in walk(model):
        handles.append(module.register_forward_pre_hook(enter(path)))
        handles.append(module.register_forward_hook(record(path)))
    try:
        with torch.no_grad():
            _run(model, inputs, kwargs, seed)
    except _OWN_ERRORS:
        raise
    except Exception as e:
        if not tolerate:
            raise
        trace.error, trace.failed_at = e, (running[-1] if running else None)
    finally:
        for h in handles:
            h.remove()
    return trace


def _first_divergence(
    ref: nn.Module,
    built: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    seed: int,
    rtol: float | None,
    atol: float | None,
    ranks: _Ranks,
) -> tuple[str | None, float]:
    ref_outs = _module_outputs(ref, inputs, kwargs, seed).outputs
    shapes = {p: [tuple(t.shape) for _, t in leaves] for p, leaves in ref_outs.items()}
    built_outs = _module_outputs(built, inputs, kwargs, seed, shapes, ranks).outputs
    found: tuple[int, str, float] | None = None
    for i, (path, leaves) in enumerate(ref_outs.items()):
        other = built_outs.get(path)
        if other is None or len(other) != len(leaves):
            continue
        for (_, a), (_, b) in zip(leaves, other, strict=True):
            if not _close(b, a, rtol, atol):
                found = (i, path or "<root>", _diff(a, b))
                break
        if found is not None:
            break
    # every rank's first divergence; the earliest in execution order wins (the same on every rank)
    first = min((f for f in ranks.gathered([found]) if f is not None), default=None)
    return (None, 0.0) if first is None else (first[1], first[2])


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    line = line if len(line) <= limit else line[: limit - 1] + "…"
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def _at(model: nn.Module, path: str | None) -> str:
    if path is None:
        return "before any module ran"
    module = dict(walk(model)).get(path)
    kind = f" ({type(module).__name__})" if module is not None else ""
    return f"in {path or '<root>'!r}{kind}"


def _reference_failure(ref: nn.Module, inputs: tuple[Any, ...], kwargs: Mapping[str, Any], seed: int,
                       error: Exception) -> ScheduleError:
    """The reference itself fails on the inputs: the inputs (or the reference) are wrong,
    not the schedule. Names the module it failed in."""
    trace = _module_outputs(ref, inputs, kwargs, seed, tolerate=True)
    where = trace.failed_at
    return ScheduleError("verify", [Problem(
        where if where else "",
        f"the reference model fails on these inputs {_at(ref, where)}: {_one_line(error)}",
        f"check the inputs against {type(ref).__name__}.forward{_signature(ref)}; the schedule was not run",
    )])


def _schedule_failure(ref: nn.Module, built: nn.Module, inputs: tuple[Any, ...], kwargs: Mapping[str, Any],
                      seed: int, ranks: _Ranks, error: Exception, phase: str = "forward") -> VerificationError:
    """The reference runs and the built schedule raises: name the module it failed in and
    the first module whose output's shape differs from the reference's (a replacement that
    does not fit is usually there, while the error is raised by the module after it)."""
    if phase != "forward":
        return VerificationError(f"the schedule's {phase} fails where the reference's runs: {_one_line(error)}")
    ref_outs = _module_outputs(ref, inputs, kwargs, seed).outputs
    shapes = {p: [tuple(t.shape) for _, t in leaves] for p, leaves in ref_outs.items()}
    trace = _module_outputs(built, inputs, kwargs, seed, shapes, ranks, tolerate=True)
    misfit = None
    for path, leaves in ref_outs.items():
        other = trace.outputs.get(path)
        if other is not None and [t.shape for _, t in other] != [t.shape for _, t in leaves]:
            misfit = (path, [tuple(t.shape) for _, t in other], [tuple(t.shape) for _, t in leaves])
            break
    text = f"the schedule fails where the reference runs, {_at(built, trace.failed_at)}: {_one_line(error)}"
    module = trace.failed_at
    if misfit is not None:
        path, got, want = misfit
        text += (f"; first diverging module: {path or '<root>'!r}, whose output has shape(s) "
                 f"{', '.join(map(str, got))} where the reference's has {', '.join(map(str, want))}")
        module = path or "<root>"
    return VerificationError(text, module=module, max_abs_diff=math.inf)


def _signature(model: nn.Module) -> str:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return "(...)"
    shown = [p.name if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) else str(p)
             for p in params]
    text = ", ".join(shown[:6]) + (", …" if len(shown) > 6 else "")
    return f"({text})"


# -- inputs, checked against the model's forward before anything runs ---------------------
def check_inputs(model: nn.Module, inputs: tuple[Any, ...], kwargs: Mapping[str, Any], what: str = "verify") -> None:
    """Refuse inputs that ``model``'s forward cannot take, before anything is built or run,
    all problems at once: positional inputs past its parameters, keywords it does not take
    (also those a Hugging Face forward would swallow through ``**kwargs`` and ignore, with
    close matches), missing required ones; for a Hugging Face model, token ids
    (``input_ids``, ``decoder_input_ids``) that are not integer, not (batch, sequence), or
    outside the vocabulary of its input embedding, and an ``attention_mask`` of another
    shape. Raises :class:`~slapo_fn.errors.ScheduleTypeError` (wrong types) or
    :class:`~slapo_fn.errors.ScheduleError`, each problem naming the input.

    >>> import torch, torch.nn as nn
    >>> check_inputs(nn.Linear(2, 2), (torch.randn(1, 2),), {"bias": 1})
    Traceback (most recent call last):
    ...
    slapo_fn.errors.ScheduleTypeError: verify: "kwargs['bias']": is not an argument of Linear.forward
          fix: pass only its arguments: input
    """
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY)]
    var_kw = next((p for p in params if p.kind is p.VAR_KEYWORD), None)
    call = f"{type(model).__name__}.forward{_signature(model)}"
    typed: list[Problem] = []
    values: list[Problem] = []
    if not any(p.kind is p.VAR_POSITIONAL for p in params) and len(inputs) > len(positional):
        typed += [Problem(f"input {i}", f"is past the {len(positional)} positional parameter(s) of {call}",
                          "pass it by keyword in kwargs={...}, or drop it")
                  for i in range(len(positional), len(inputs))]
    extras = None if var_kw is None else extra_keywords(model, var_kw.annotation)
    allowed = set(named) | set(extras or ())
    for name in kwargs:
        if not isinstance(name, str) or (name in allowed) or (var_kw is not None and extras is None):
            continue
        close = difflib.get_close_matches(str(name), sorted(allowed), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        swallowed = " (its **kwargs would swallow it and ignore it)" if var_kw is not None else ""
        typed.append(Problem(f"kwargs[{name!r}]", f"is not an argument of {type(model).__name__}.forward{swallowed}",
                             f"{hint}pass only its arguments: {', '.join(named[:10])}"))
    if not typed:
        try:
            bound = signature.bind(*inputs, **kwargs).arguments
        except TypeError as e:
            raise ScheduleTypeError(what, [Problem("", f"{call} cannot take these inputs: {e}",
                                                   "pass the inputs the model's forward takes")]) from None
        typed, values = _token_problems(model, bound)
    if typed or values:
        raise (ScheduleTypeError if typed else ScheduleError)(what, typed + values)


def _token_problems(model: nn.Module, bound: Mapping[str, Any]) -> tuple[list[Problem], list[Problem]]:
    """Type and value problems of a Hugging Face model's token ids and attention mask."""
    if not is_pretrained_model(model):
        return [], []
    typed: list[Problem] = []
    values: list[Problem] = []
    embedding = input_embedding(model)
    for name in TOKEN_ID_ARGS:
        ids = bound.get(name)
        if ids is None:
            continue
        if not isinstance(ids, torch.Tensor):
            typed.append(Problem(name, f"holds token ids, but is a {type(ids).__name__}",
                                 "pass a tensor of integer ids, e.g. torch.tensor([[1, 2, 3]])"))
            continue
        if ids.is_floating_point() or ids.is_complex() or ids.dtype is torch.bool:
            typed.append(Problem(name, f"holds token ids, but is a {str(ids.dtype).removeprefix('torch.')} tensor",
                                 f"pass integer ids ({name}.long()); embed other values yourself and pass "
                                 "inputs_embeds= instead"))
            continue
        if ids.dim() != 2:
            values.append(Problem(name, f"has shape {tuple(ids.shape)}: token ids are (batch, sequence)",
                                  f"reshape it, e.g. {name}.view(-1, {name}.shape[-1]) or {name}.unsqueeze(0)"))
            continue
        if embedding is not None and type(ids) is torch.Tensor and ids.device.type != "meta" and ids.numel():
            low, high = int(ids.min()), int(ids.max())
            size = embedding.num_embeddings
            if low < 0 or high >= size:
                values.append(Problem(name, f"has ids {low}..{high}, outside the vocabulary 0..{size - 1} of the "
                                            "model's input embedding",
                                      f"map the ids into the vocabulary (its tokenizer), or build the model with "
                                      f"vocab_size > {high}"))
    ids, mask = bound.get("input_ids"), bound.get("attention_mask")
    if (isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and ids.dim() == 2 and mask.dim() == 2
            and mask.shape != ids.shape):
        values.append(Problem("attention_mask", f"has shape {tuple(mask.shape)} for input_ids of shape "
                                                f"{tuple(ids.shape)}",
                              "one entry per token: torch.ones_like(input_ids), 0 where padded"))
    return typed, values


def _check_options(sch: object, reference: object, rtol: object, atol: object, kwargs: object) -> None:
    if not isinstance(sch, Schedule):
        raise ScheduleTypeError("verify", [Problem("", f"expected a Schedule, got {type(sch).__name__}",
                                                   "sf.verify(sf.create_schedule(model), inputs)")])
    problems = []
    if reference is not None and not isinstance(reference, nn.Module):
        problems.append(Problem("reference", f"expected an nn.Module, got {type(reference).__name__}",
                                "pass the unscheduled model, or leave reference out (the schedule's original)"))
    if kwargs is not None and not isinstance(kwargs, Mapping):
        problems.append(Problem("kwargs", f"expected a mapping of keyword inputs, got {type(kwargs).__name__}",
                                "kwargs={'attention_mask': mask}"))
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(Problem(name, f"expected a number, got {type(value).__name__}",
                                    f"{name}=1e-5, or leave it out for the dtype's default"))
        elif math.isnan(value) or value < 0:
            problems.append(Problem(name, f"is {value}; a tolerance is a number >= 0",
                                    f"{name}=1e-5, or leave it out for the dtype's default (DEFAULT_TOLERANCES)"))
    if problems:
        kind = ScheduleTypeError if any("expected" in p.reason for p in problems) else ScheduleError
        raise kind("verify", problems)


def verify(
    sch: Schedule,
    *inputs: Any,
    reference: nn.Module | None = None,
    backward: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    train: bool = False,
    seed: int = 0,
    kwargs: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Check that the built schedule computes what ``reference`` computes.

    Runs ``reference`` (default: the model given to :func:`create_schedule`) and
    ``build(sch)`` on the same weights (no copies: both view the original storage) and
    inputs, compares every output tensor and, with ``backward=True``, every parameter
    gradient (DTensors gathered) after back-propagating the same random cotangents.
    Models run in eval mode unless ``train=True`` (then with the same RNG seed).
    Meta-device models are materialised with ``init="full"`` and ``seed``.

    Raises :class:`VerificationError` naming the first module (FQN, in execution order)
    whose output diverged, or the parameters whose gradients differ. Tolerances are
    relative to each tensor's scale, with defaults by dtype (:data:`DEFAULT_TOLERANCES`):
    a correct tensor-parallel schedule passes at the defaults, although it sums in
    another order. A bfloat16 or float16 reference also runs in float32 (a copy of its
    weights, upcast): a low-precision tensor outside the tolerance still matches when it
    is no further from the float32 result than twice the reference's own rounding error
    (plus ``atol``), as kernel libraries test their low-precision kernels.

    Before anything is built or run, the inputs are checked against the reference's
    forward (:func:`check_inputs`: unknown or misspelt keywords, token ids that are not
    integer, not 2-D or outside the vocabulary) and the options (a negative ``rtol``);
    each is a :class:`~slapo_fn.errors.ScheduleError` naming the input. If the reference
    itself fails on the inputs, a ``ScheduleError`` names the module it failed in; if only
    the schedule fails, a ``VerificationError`` names the module it failed in and the
    first module whose output shape differs from the reference's.

    Distributed: with a mesh in a running process group, call it on every rank (each
    with the same full weights and inputs). DTensor outputs and gradients are gathered
    with ``full_tensor()``, local activation shards (features, heads or sequence
    positions of this rank; packed columns' chunks put back in order) are all-gathered to
    the reference's shape before they are compared, and the verdict is agreed on by all
    ranks: every rank returns the same report or raises the same error, naming the
    earliest diverging module seen on any rank.

    Example:
        >>> import torch, torch.nn as nn, slapo_fn as sf
        >>> sch = sf.checkpoint(sf.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.Tanh())), "0")
        >>> print(sf.verify(sch, torch.randn(2, 4)))
        verified 1 outputs (max |diff| 0) and 2 gradients (max |diff| 0)
    """
    if sch.mesh is not None:  # every rank of the mesh builds and runs it: not some of them only
        every_rank("sf.verify", [int(r) for r in sch.mesh.mesh.flatten().tolist()])
    _check_options(sch, reference, rtol, atol, kwargs)
    kwargs = dict(kwargs or {})
    reference = sch.original if reference is None else reference
    assert reference is not None
    check_inputs(reference, inputs, kwargs)
    if any(_has_meta(m) for m in (*reference.modules(), *sch.module.modules())):
        ref = build(create_schedule(reference), init="full", seed=seed)
        built = build(sch, init="full", seed=seed)
    else:
        ref = private_copy(reference, copy_data=False)
        built = build(sch, copy=False)
    ref.train(train)
    built.train(train)
    ref32 = _float32_reference(ref)  # low precision: the float32 result anchors the comparison
    if ref32 is not None:
        ref32.train(train)

    ranks = _Ranks(sch)
    try:
        ref_value = _run(ref, inputs, kwargs, seed)
        ref32_value = None if ref32 is None else _run(ref32, _float32(inputs), _float32(kwargs), seed)
    except _OWN_ERRORS:
        raise
    except Exception as e:
        raise _reference_failure(ref, inputs, kwargs, seed, e) from e
    try:
        built_value = _run(built, inputs, kwargs, seed)
    except _OWN_ERRORS:
        raise
    except Exception as e:
        raise _schedule_failure(ref, built, inputs, kwargs, seed, ranks, e) from e
    out_ref, out_built = _leaves(ref_value), _leaves(built_value)
    if len(out_ref) == len(out_built):  # outputs left as local shards (e.g. vocab-sharded logits)
        out_built = [(n, ranks.gather(b, tuple(a.shape), 1))
                     for (_, a), (n, b) in zip(out_ref, out_built, strict=True)]
    if [n for n, _ in out_ref] != [n for n, _ in out_built]:
        raise VerificationError(
            f"the outputs differ in structure: reference has {[n for n, _ in out_ref]}, "
            f"the schedule {[n for n, _ in out_built]}",
            module="<root>",
            max_abs_diff=math.inf,
        )
    full = [(n, _full(a), _full(b)) for (n, a), (_, b) in zip(out_ref, out_built, strict=True)]  # one gather each
    out32 = dict(_leaves(ref32_value)) if ref32_value is not None else {}
    diffs = {n: _diff(a, b) for n, a, b in full}
    bad = [n for n, a, b in full
           if not _close(b, a, rtol, atol) and not _anchored(b, a, _detached(out32.get(n)), atol)]
    diffs, bad = ranks.agree(diffs, bad)
    if bad:
        module, diff = _first_divergence(ref, built, inputs, kwargs, seed, rtol, atol, ranks)
        where = (
            f"first diverging module: {module!r} (max |diff| {diff:.3g})"
            if module
            else "no single module's output diverged first"
        )
        raise VerificationError(
            f"outputs {', '.join(bad)} differ (max |diff| {max(diffs[n] for n in bad):.3g}); {where}",
            module=module,
            max_abs_diff=max(diffs[n] for n in bad),
        )
    if not backward:
        return VerifyReport(outputs=diffs)

    gen = torch.Generator().manual_seed(seed)
    pairs = [
        (a, b) for (_, a), (_, b) in zip(out_ref, out_built, strict=True) if a.is_floating_point() and a.requires_grad
    ]
    cotangents = [torch.randn(a.shape, generator=gen, dtype=a.dtype).to(a.device) for a, _ in pairs]
    if pairs:
        torch.autograd.backward([a for a, _ in pairs], cotangents)
        if ref32_value is not None:
            grads32 = [(out32[n], c.float()) for (n, a), c in zip(
                [(n, a) for n, a in out_ref if a.is_floating_point() and a.requires_grad], cotangents, strict=True)]
            torch.autograd.backward([o for o, _ in grads32], [c for _, c in grads32])
        try:
            torch.autograd.backward(
                [b for _, b in pairs], [_like(c, b) for c, (_, b) in zip(cotangents, pairs, strict=True)]
            )
        except _OWN_ERRORS:
            raise
        except Exception as e:
            raise _schedule_failure(ref, built, inputs, kwargs, seed, ranks, e, phase="backward") from e
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    ref32_grads = {} if ref32 is None else {n: p.grad for n, p in ref32.named_parameters() if p.grad is not None}
    built_params = dict(built.named_parameters())
    grad_diffs: dict[str, float] = {}
    bad_grads: list[str] = []
    for name, g in ref_grads.items():
        p = built_params.get(name)
        if p is None:
            continue
        gb = torch.zeros_like(g) if p.grad is None else _full(p.grad)
        grad_diffs[name] = _diff(g, gb)
        if not _close(gb, g, rtol, atol) and not _anchored(gb, g, ref32_grads.get(name), atol):
            bad_grads.append(name)
    grad_diffs, bad_grads = ranks.agree(grad_diffs, bad_grads)
    if bad_grads:
        worst = max(grad_diffs[n] for n in bad_grads)
        raise VerificationError(
            f"gradients of {len(bad_grads)} parameter(s) differ (max |diff| {worst:.3g}), outputs match: "
            f"{', '.join(bad_grads[:6])}{' …' if len(bad_grads) > 6 else ''}",
            parameters=bad_grads,
            max_abs_diff=worst,
        )
    return VerifyReport(outputs=diffs, gradients=grad_diffs)


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _like(cotangent: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The reference cotangent in the form of the scheduled output (a DTensor there)."""
    placements = getattr(output, "placements", None)
    if placements is None:
        return cotangent
    return distribute_tensor(cotangent, output.device_mesh, placements)  # type: ignore[attr-defined]


@dataclass(frozen=True, repr=False)
class Verified(Rewrite):
    rewrite: Rewrite
    inputs: tuple[Any, ...]
    options: tuple[tuple[str, Any], ...]

    def apply(self, sch: Schedule, base: str = "") -> Schedule:
        new = self.rewrite.apply(sch, base)
        verify(new, *self.inputs, **dict(self.options))
        return new

    def __repr__(self) -> str:
        return f"verified({self.rewrite!r})"


def verified(rewrite: Rewrite, *inputs: Any, **options: Any) -> Rewrite:
    """``rewrite``, checked with :func:`verify` on ``inputs`` as it is applied.

    >>> import torch, torch.nn as nn, slapo_fn as sf
    >>> rw = sf.verified(sf.checkpoint.at("0"), torch.randn(2, 4))
    >>> sch = rw(sf.create_schedule(nn.Sequential(nn.Linear(4, 4))))
    """
    if not isinstance(rewrite, Rewrite):
        raise ScheduleTypeError(
            "verified",
            [
                Problem(
                    "",
                    f"expected a Rewrite, got {type(rewrite).__name__}",
                    "sf.verified(sf.checkpoint.at('layers.0'), inputs)",
                )
            ],
        )
    return Verified(rewrite, inputs, tuple(options.items()))
