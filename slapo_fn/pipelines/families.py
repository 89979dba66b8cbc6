"""Per-family knowledge for splitting a model into pipeline stages: data, not code paths.

A stage keeps only its own layers of the cut sequence; the other children on the path
from the root to that sequence are *roles*:

* ``pre``  — runs before the sequence (embeddings): kept in the first stage only;
* ``post`` — runs after it (final norm, LM head, pooler): kept in the last stage only;
* ``shared`` — needed by every stage (LLaMA's ``rotary_emb``: no parameters, recomputes
  RoPE from the position ids each stage receives).

Roles come from the model's own structure: Hugging Face's ``base_model_pp_plan`` (its
keys are in execution order; children it does not list are shared) and ``_pp_plan`` (heads
after the base model) where the model has them, else the order in which children were
registered. A :class:`Family` overrides what that gets wrong for one model type and says
what replaces a ``pre`` module in the stages after the first, which are fed hidden states
through the model's ``inputs_embeds`` argument:

* ``absent`` (default for modules with parameters): a :class:`NotInStage` that fails
  loudly if called — a family whose forward calls it with ``inputs_embeds`` needs an entry;
* ``identity`` (default for modules without parameters, e.g. dropout, applied once, in
  the first stage);
* ``zeros``: a scalar zero, for position embeddings added inside the forward (GPT-2
  ``wpe``, OPT ``embed_positions``);
* ``inputs``: returns its ``inputs_embeds`` argument (BERT's ``embeddings`` module).

``post`` modules in stages before the last become ``nn.Identity``.

A Hugging Face model type without an entry in :data:`FAMILIES` gets a **derived** adapter
(:func:`derive_family`): its roles and stand-ins read off its structure (the input
embedding is ``absent``, a module taking ``inputs_embeds`` is ``inputs``, another
``nn.Embedding`` is ``zeros`` — a position table added to the embeddings —, any other
``pre`` module is ``identity`` — a LayerNorm or dropout applied to them —, a module with
buffers and no parameters, a rotary table, is ``shared``), then checked for parity when
the cut is made (:func:`resolve_family`): the model's stages, chained in one process, must
give the model's own output on a small batch. Where a first guess fails, each ``post``
module placed by registration order alone is tried as a ``pre`` one (Bart's decoder
registers ``layernorm_embedding`` after its layers); where none passes, the cut is
refused with the difference found.

Example:
    >>> FAMILIES["gpt2"].later["wpe"]
    'zeros'
    >>> family_of(object()) == Family()
    True
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeAlias

import torch
from torch import nn

from ..errors import Problem, ScheduleError
from ..hf import (
    LAYER_COUNT_ATTRS,
    PER_LAYER_ATTRS,
    PIPELINE_STAGES,
    StageRole,
    StageStandIn,
    config_of,
    config_value,
    input_embedding,
    is_encoder_decoder,
    model_type,
    position_limit,
    small_config,
    stage_config,
)
from ..tree import child_names, get_module, join, shallow_clone, split

__all__ = [
    "FAMILIES",
    "Family",
    "InputsEmbeds",
    "Later",
    "NotInStage",
    "Role",
    "ZeroPositions",
    "derive_family",
    "encoder_decoder_problem",
    "family_of",
    "later_stand_in",
    "output_tensor",
    "parity_error",
    "resolve_family",
    "roles",
    "small_twin",
    "stage_tree",
]

Role: TypeAlias = StageRole
Later: TypeAlias = StageStandIn


@dataclass(frozen=True)
class Family:
    """Stage-split knowledge for one model type (``config.model_type``).

    ``roles`` overrides the role of a child (by its name at any level on the path to the
    sequence); ``later`` says what stands in for a ``pre`` module in later stages.
    """

    roles: Mapping[str, Role] = field(default_factory=lambda: MappingProxyType({}))
    later: Mapping[str, Later] = field(default_factory=lambda: MappingProxyType({}))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Family) and dict(self.roles) == dict(other.roles) and dict(self.later) == dict(
            other.later
        )

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.roles.items())), tuple(sorted(self.later.items()))))


#: Hugging Face model types whose stage split is known to be right: the structural
#: defaults (LLaMA-like forwards feed inputs_embeds straight to the layers), or more
#: (the per-family data lives in :data:`slapo_fn.hf.PIPELINE_STAGES`).
FAMILIES: Mapping[str, Family] = MappingProxyType(
    {name: Family(roles, later) for name, (roles, later) in PIPELINE_STAGES.items()}
)


def family_of(model: Any) -> Family:
    """The :class:`Family` of ``model`` (by ``model.config.model_type``); the structural
    defaults for a model that is not a Hugging Face one.

    A Hugging Face model type without an entry is refused rather than guessed: its
    forward may transform ``inputs_embeds`` (Gemma scales them by sqrt(hidden)), which the
    later stages would then apply again, silently.
    """
    kind = model_type(model)
    if kind is None:
        return Family()
    if kind not in FAMILIES:
        raise ScheduleError("cut_pipeline_stage", [Problem(
            "", f"no pipeline stage adapter for model_type {kind!r} (known: {', '.join(sorted(FAMILIES))})",
            f"check what {type(model).__name__}.forward does with inputs_embeds and the modules before its layers, "
            "then pass family=Family(...) to split_stages, or add the model type to "
            "slapo_fn.pipelines.families.FAMILIES")])
    return FAMILIES[kind]


class NotInStage(nn.Module):
    """Stands in for a module that lives in another pipeline stage; calling it is an error."""

    def __init__(self, path: str, stage: int, owner: str) -> None:
        super().__init__()
        self.path = path
        self.stage = stage
        self.owner = owner

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(
            f"slapo_fn pipeline: {self.path!r} lives in the {self.owner} stage, but stage {self.stage}'s forward "
            f"called it. This model family needs a stage adapter: add its model_type to "
            f"slapo_fn.pipelines.families.FAMILIES with later={{{self.path.rsplit('.', 1)[-1]!r}: 'zeros' | "
            f"'identity' | 'inputs'}}"
        )

    def extra_repr(self) -> str:
        return f"{self.path!r} is in the {self.owner} stage"


class ZeroPositions(nn.Module):
    """A position embedding that adds nothing: returns a scalar zero (broadcasts)."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(())


class InputsEmbeds(nn.Module):
    """An embeddings module that passes ``inputs_embeds`` (the received hidden states) on."""

    def forward(self, *args: Any, inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if inputs_embeds is None:
            raise RuntimeError("slapo_fn pipeline: a later stage's embeddings need inputs_embeds (the hidden states)")
        return inputs_embeds


#: What each stand-in kind builds; ``absent`` is a :class:`NotInStage` naming the module.
_STAND_INS: Mapping[Later, Callable[[], nn.Module]] = MappingProxyType(
    {"identity": nn.Identity, "zeros": ZeroPositions, "inputs": InputsEmbeds}
)

#: The stages that keep a child of each role, by ``(first, last)``: the others get a stand-in.
_KEPT: Mapping[Role, Callable[[bool, bool], bool]] = MappingProxyType({
    StageRole.PRE: lambda first, last: first,
    StageRole.POST: lambda first, last: last,
    StageRole.SHARED: lambda first, last: True,
})


def later_stand_in(kind: Later, module: nn.Module, path: str, stage: int) -> nn.Module:
    """The module standing in for the ``pre`` module ``module`` (at ``path``) in ``stage``.

    Example:
        >>> type(later_stand_in("zeros", nn.Embedding(4, 2), "wpe", 1)).__name__
        'ZeroPositions'
    """
    make = _STAND_INS.get(kind)
    return make() if make is not None else NotInStage(path, stage, "first")


def default_later(module: nn.Module) -> Later:
    """``identity`` for a module without parameters (dropout), else ``absent``."""
    return "absent" if any(True for _ in module.parameters()) else "identity"


# -- stage trees ----------------------------------------------------------------------------
def _plan_keys(owner: object, attr: str) -> tuple[str, ...] | None:
    plan = getattr(owner, attr, None)
    return tuple(plan) if isinstance(plan, Mapping) and plan else None


def roles(root: nn.Module, sequence: str, family: Family | None = None) -> dict[str, Role]:
    """``{path: role}`` of every child on the path from ``root`` to ``sequence`` that is
    not itself on that path (see the module docstring for how roles are found)."""
    family = family if family is not None else FAMILIES.get(model_type(root) or "", Family())
    out: dict[str, Role] = {}
    module, prefix = root, ""
    for token in split(sequence):
        names = child_names(module)
        config = getattr(module, "config", None)
        base_plan = _plan_keys(config, "base_model_pp_plan") if config is not None else None
        head_plan = _plan_keys(type(module), "_pp_plan")
        for name in names:
            if name == token:
                continue
            role: Role
            if base_plan is not None and token in base_plan:
                role = (
                    StageRole.SHARED
                    if name not in base_plan
                    else (StageRole.PRE if base_plan.index(name) < base_plan.index(token) else StageRole.POST)
                )
            elif head_plan is not None and name in head_plan:
                role = StageRole.POST
            else:
                role = StageRole.PRE if names.index(name) < names.index(token) else StageRole.POST
            out[join(prefix, name)] = family.roles.get(name, role)
        module = module._modules[token]  # type: ignore[assignment]
        prefix = join(prefix, token)
    return out


def _stand_in(role: Role, module: nn.Module, path: str, stage: int, family: Family) -> nn.Module:
    """A ``pre`` module in a later stage per the family; a ``post`` one, in an earlier stage,
    hands its input on."""
    if role == StageRole.POST:
        return nn.Identity()
    name = split(path)[-1]
    return later_stand_in(family.later.get(name, default_later(module)), module, path, stage)


def stage_tree(
    root: nn.Module, sequence: str, keep: tuple[str, ...], stage: int, first: bool, last: bool,
    found: Mapping[str, Role], family: Family,
) -> nn.Module:
    """The tree of one stage: ancestors of ``sequence`` cloned, everything else shared."""
    tokens = split(sequence)
    seq = shallow_clone(get_module(root, sequence))
    keys = list(seq._modules)
    seq._modules = type(seq._modules)((k, v) for k, v in seq._modules.items() if k in keep)
    replacement: nn.Module = seq
    for depth in range(len(tokens) - 1, -1, -1):
        parent_path = join(*tokens[:depth])
        clone = shallow_clone(get_module(root, parent_path))
        if (config := clone.__dict__.get("config")) is not None:
            clone.config = stage_config(config, [keys.index(k) for k in keep], len(keys))
        for name, child in list(clone._modules.items()):
            path = join(parent_path, name)
            if name == tokens[depth]:
                clone._modules[name] = replacement
            elif child is not None:
                role = found.get(path, StageRole.SHARED)
                if not _KEPT[role](first, last):
                    clone._modules[name] = _stand_in(role, child, path, stage, family)
        replacement = clone
    return replacement


# -- what a stage hands on ------------------------------------------------------------------
def output_tensor(output: Any) -> torch.Tensor:
    """The tensor in a model's output: itself, its ``logits`` or ``last_hidden_state``, or
    the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"slapo_fn pipeline: cannot find the output tensor in a {type(output).__name__}")


class StageOutput:
    """What a stage hands on: for a stage before the last, the output of its last layer
    (captured by a forward hook on it), not what the model's forward makes of it after the
    sequence — a head's post-processing (Gemma2's logit soft-capping, a logit scale) would
    otherwise transform the hidden states that cross to the next stage; for the last
    stage (``layer=None``) the model's output tensor."""

    def __init__(self, module: nn.Module, layer: str | None) -> None:
        self._latest: torch.Tensor | None = None
        self._handle = None
        if layer is not None:
            self._handle = get_module(module, layer).register_forward_hook(self._keep)

    def _keep(self, _: nn.Module, args: Any, output: Any) -> None:
        self._latest = output_tensor(output)

    def __call__(self, output: Any) -> torch.Tensor:
        latest, self._latest = self._latest, None
        return latest if latest is not None else output_tensor(output)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()


# -- derived adapters, checked for parity -----------------------------------------------------
#: Largest relative difference (to 1 + max |output|) that the parity check accepts.
PARITY_TOLERANCE = 1e-4


def _has(module: nn.Module, what: str) -> bool:
    return any(True for _ in getattr(module, what)())


def _takes(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _later_of(module: nn.Module, embedding: nn.Module | None) -> Later:
    if module is embedding or not _has(module, "parameters"):
        return default_later(module)
    if _takes(module, "inputs_embeds"):
        return "inputs"
    return "zeros" if isinstance(module, nn.Embedding) else "identity"


def derive_family(root: nn.Module, sequence: str) -> tuple[Family, ...]:
    """Candidate adapters for ``root`` cut in ``sequence``, most likely first: the
    structural one (see the module docstring), then one per ``post`` module with
    parameters beside the sequence and outside the model's ``base_model_pp_plan`` that
    runs it as a ``pre`` one instead (an embedding LayerNorm registered after the layers)."""
    found = roles(root, sequence, Family())
    embedding = input_embedding(root)
    output = getattr(root, "get_output_embeddings", lambda: None)()
    parent = split(sequence)[:-1]
    plan = _plan_keys(getattr(get_module(root, join(*parent)), "config", None), "base_model_pp_plan") or ()
    shared: dict[str, Role] = {}
    later: dict[str, Later] = {}
    flips: list[str] = []
    for path, role in found.items():
        module, name = get_module(root, path), split(path)[-1]
        if not _has(module, "parameters") and _has(module, "buffers"):
            shared[name] = StageRole.SHARED  # a rotary table: recomputed from the position ids in every stage
        elif role == StageRole.PRE:
            later[name] = _later_of(module, embedding)
        elif role == StageRole.POST and split(path)[:-1] == parent and name not in plan and module is not output \
                and _has(module, "parameters"):
            flips.append(name)
    base = Family(MappingProxyType(shared), MappingProxyType(later))
    return (base, *(
        Family(MappingProxyType({**shared, name: StageRole.PRE}), MappingProxyType({**later, name: "identity"}))
        for name in flips
    ))


@contextmanager
def _eval(modules: list[nn.Module]) -> Iterator[None]:
    flags = [(m, m.training) for m in modules]
    try:
        for m, _ in flags:
            m.training = False
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _sample_ids(root: nn.Module) -> torch.Tensor:
    config = config_of(root)
    vocab = int(config_value(config, "vocab_size", default=2))
    length = max(2, min(6, position_limit(config)))
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(0))


def parity_error(root: nn.Module, sequence: str, family: Family) -> str | None:
    """Why ``root``'s stages under ``family`` (up to three, chained in one process) do not
    give ``root``'s own output on a small batch of token ids; ``None`` when they do."""
    keys = tuple(child_names(get_module(root, sequence)))
    parts = min(3, len(keys))
    bounds = [round(i * len(keys) / parts) for i in range(parts + 1)]
    found = roles(root, sequence, family)
    trees = [
        stage_tree(root, sequence, keys[bounds[s]:bounds[s + 1]], s, s == 0, s == parts - 1, found, family)
        for s in range(parts)
    ]
    extra = {"use_cache": False} if _takes(root, "use_cache") else {}
    ids = _sample_ids(root)
    modules = [m for tree in (root, *trees) for m in tree.modules()]
    calls = dict.fromkeys(keys, 0)
    layers = get_module(root, sequence)
    hooks = [layers._modules[k].register_forward_pre_hook(  # type: ignore[union-attr]
        lambda *_, k=k: calls.__setitem__(k, calls[k] + 1)) for k in keys]
    try:
        with torch.no_grad(), _eval(modules):
            try:
                reference = output_tensor(root(input_ids=ids, **extra))
            finally:
                for hook in hooks:
                    hook.remove()
            shared = {k: n for k, n in calls.items() if n > 1}
            if shared:
                return (f"the model calls its layer(s) {', '.join(f'{k!r} {n} times' for k, n in shared.items())} "
                        "in one forward (parameters shared across calls, as ALBERT's): a stage holds layers, not "
                        "calls, so stages cannot be cut between those calls this way; say after which calls with "
                        "cut_pipeline_stage(sch, layer, calls=k)")
            hidden = ids
            for s, tree in enumerate(trees):
                last = join(sequence, keys[bounds[s + 1] - 1]) if s < parts - 1 else None
                out = StageOutput(tree, last)
                try:
                    fed = {"input_ids": ids} if s == 0 else {"inputs_embeds": hidden}
                    hidden = out(tree(**fed, **extra))
                finally:
                    out.remove()
    except Exception as e:
        return f"the stages fail where the model runs: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if hidden.shape != reference.shape:
        return f"the stages give shape {tuple(hidden.shape)}, the model {tuple(reference.shape)}"
    diff = float((hidden - reference).abs().max()) / (1.0 + float(reference.abs().max()))
    return None if diff <= PARITY_TOLERANCE else f"the stages differ from the model by {diff:.3g} (relative)"


_ADAPTER_FIX = (
    "add the model type to slapo_fn.hf.PIPELINE_STAGES with the roles and stand-ins its forward needs "
    "(see slapo_fn.pipelines.families), or cut a model whose forward feeds inputs_embeds to its layers"
)


def encoder_decoder_problem(root: nn.Module, sequence: str) -> Problem:
    """Why a whole encoder-decoder model (Bart, T5, Whisper) is not cut, and the fix."""
    return Problem(
        sequence,
        f"{type(root).__name__} is an encoder-decoder model: a stage hands one tensor on, but its decoder "
        "layers also need the encoder's output, and later stages would be fed through the encoder's inputs",
        "pipeline the decoder alone: sch = sf.create_schedule(model.get_decoder()); cut its layers and pass "
        "encoder_hidden_states=... to Pipeline.step (keyword tensors reach every stage)")


def small_twin(root: nn.Module, *, same_depth: bool = False) -> nn.Module | None:
    """``root``'s class built on the CPU from :func:`~slapo_fn.hf.small_config` of its
    config (random weights, seeded), or ``None`` where that fails; with ``same_depth``,
    with ``root``'s layer counts and per-layer lists (narrow, not shallow)."""
    original = getattr(root, "config", None)
    config = small_config(original)
    if config is None:
        return None
    if same_depth:
        for name in (*LAYER_COUNT_ATTRS, *PER_LAYER_ATTRS):
            if hasattr(original, name):
                with contextlib.suppress(AttributeError):
                    setattr(config, name, copy.deepcopy(getattr(original, name)))
    try:
        with torch.device("cpu"), torch.random.fork_rng():
            torch.manual_seed(0)
            twin = type(root)(config)
    except Exception:
        return None
    return twin.float()


def resolve_family(root: nn.Module, sequence: str) -> Family:
    """The adapter for cutting ``root`` in ``sequence``: the :data:`FAMILIES` entry of its
    model type, the structural defaults for a model that is not a Hugging Face one, else
    the first :func:`derive_family` candidate that passes :func:`parity_error`.

    A model on the meta device is checked through a small real twin of it (same class,
    tiny sizes). Raises :class:`ScheduleError` for a whole encoder-decoder model, a meta
    model without a buildable twin, and a family no candidate passes."""
    kind = model_type(root)
    if kind is None:
        return Family()
    if is_encoder_decoder(root):
        raise ScheduleError("cut_pipeline_stage", [encoder_decoder_problem(root, sequence)])
    if kind in FAMILIES:
        return FAMILIES[kind]
    probe: nn.Module | None = root
    if any(p.is_meta for p in root.parameters()):
        # nothing to compute on: check the candidates on a small real twin (same class and
        # structure, tiny sizes); the roles found are names, the same in both
        probe = small_twin(root)
        if probe is None:
            raise ScheduleError("cut_pipeline_stage", [Problem(
                sequence,
                f"no pipeline stage adapter for model_type {kind!r}, its parameters are on the meta device, and no "
                "small real twin of it could be built: the derived adapter cannot be checked for parity",
                f"cut the model before moving it to the meta device (create it on the CPU), or {_ADAPTER_FIX}")])
    assert probe is not None
    reasons = []
    for family in derive_family(probe, sequence):
        reason = parity_error(probe, sequence, family)
        if reason is None:
            return family
        reasons.append(reason)
    raise ScheduleError("cut_pipeline_stage", [Problem(
        sequence,
        f"no pipeline stage adapter for model_type {kind!r}, and none derived from "
        f"{type(root).__name__}'s structure passes the parity check: {'; '.join(dict.fromkeys(reasons))}",
        f"check what {type(root).__name__}.forward does with inputs_embeds and the modules around its layers, "
        f"then {_ADAPTER_FIX}")])
