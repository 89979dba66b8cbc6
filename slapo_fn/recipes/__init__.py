"""Schedules for Hugging Face model families, written only with the public API.

Each family is a :class:`Recipe` value — data plus combinators — taking the same
:class:`Knobs`: ``tp``, ``sequence_parallel``, ``checkpoint``, ``stages``, ``dp_mode``,
``kernels``, ``compile``. :func:`for_model` picks one from the model's config;
:func:`from_tp_plan` schedules any model that carries a ``base_model_tp_plan``, and
:func:`from_model_plan` makes a whole :class:`Recipe` around it (tensor parallelism by the
plan, the other knobs on the plan's repeated layers) for a family that has no recipe.

Example:
    >>> import slapo_fn as sf
    >>> from slapo_fn.rewrites.checkpoint import CHECKPOINT
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                      num_attention_heads=4, vocab_size=128))
    >>> recipe = sf.recipes.for_model(model)
    >>> sch = recipe(sf.create_schedule(model), checkpoint=1.0, kernels=True)
    >>> recipe.name, sorted(sch.annotations.of_kind(CHECKPOINT))
    ('llama', ['model.layers.0', 'model.layers.1'])
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from torch import nn
from torch.distributed.tensor import Replicate

from ..dtensor import expert_tensor_parallel, shard, sync, tp_local
from ..errors import LayoutError, Problem, ScheduleError
from ..hf import config_of
from ..hf import model_type as model_type_of
from ..schedule import Schedule
from ..select import select
from ..tree import parent_path
from ._recipe import HSDP_AXES, Knobs, Recipe, Shard, Stack
from .albert import ALBERT
from .bart import BART
from .bert import BERT
from .fused_qkv import BLOOM, FALCON
from .gpt2 import GPT2
from .gpt_neo import GPT_NEO
from .llama import LLAMA, QWEN3
from .moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE, MoeRecipe
from .opt import OPT
from .t5 import T5
from .wide_resnet import WIDE_RESNET

__all__ = ["ALBERT", "BART", "BERT", "BLOOM", "FALCON", "GPT2", "GPT_NEO", "HSDP_AXES", "LLAMA", "MIXTRAL", "OPT",
           "QWEN2_MOE", "QWEN3", "QWEN3_MOE", "RECIPES",
           "T5", "WIDE_RESNET", "Knobs", "MoeRecipe", "Recipe", "Shard", "Stack", "check_tp_plan", "for_model",
           "from_model_plan", "from_tp_plan", "plan_stacks", "tp_plan_of"]

#: Every recipe, by name.
RECIPES: Mapping[str, Recipe] = MappingProxyType({r.name: r for r in (LLAMA, QWEN3, GPT2, GPT_NEO, BERT, ALBERT, OPT,
                                                                       T5, BART, BLOOM, FALCON, MIXTRAL, QWEN2_MOE,
                                                                       QWEN3_MOE, WIDE_RESNET)})


def for_model(model: nn.Module) -> Recipe:
    """The recipe for ``model``'s family, from its Hugging Face ``config.model_type``."""
    model_type = model_type_of(model)
    for recipe in RECIPES.values():
        if model_type in recipe.model_types:
            return recipe
    known = sorted(t for r in RECIPES.values() for t in r.model_types)
    has_plan = " (it has one)" if tp_plan_of(model) else ""
    raise ScheduleError("recipes.for_model", [Problem("", f"no recipe for model_type {model_type!r}",
                                                      f"known: {', '.join(known)}; or use from_model_plan(model) / "
                                                      f"from_tp_plan(sch) when the model has a base_model_tp_plan"
                                                      f"{has_plan}")])


def tp_plan_of(model: object) -> dict[str, str]:
    """The Hugging Face tensor-parallel plan of a model or of its config
    (``config.base_model_tp_plan``, paths relative to the base model), or ``{}``."""
    config = config_of(model)
    plan = getattr(model if config is None else config, "base_model_tp_plan", None)
    return dict(plan) if plan else {}


def _base(model: nn.Module) -> str:
    """Where the base model sits in ``model`` (``"model"`` for a causal LM; ``""`` when it
    is the base model)."""
    prefix = getattr(model, "base_model_prefix", "")
    return prefix if prefix and prefix in model._modules else ""


def from_model_plan(model: nn.Module) -> Recipe:
    """A :class:`Recipe` for a model whose family has none, made from its own
    ``base_model_tp_plan``: tensor parallelism is :func:`from_tp_plan`; the repeated
    layers the plan names (``layers.*`` of ``"layers.*.mlp.up_proj"``) are the layers that
    ``checkpoint``, ``compile`` and ``stages`` act on; ``dp_mode`` applies as in any recipe.
    It has no kernels. With ``sequence_parallel``, those layers run on sequence shards,
    and so do the norms after them that the model's ``base_model_pp_plan`` names (the
    final norm), as PyTorch's SP plan does; what may not run so is refused at build
    (code over the sequence, attention without its projections sharded), never run.

    >>> from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    >>> model = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                                          intermediate_size=128, vocab_size=128))
    >>> recipe = from_model_plan(model)
    >>> recipe.name, [s.layers for s in recipe.stacks], recipe.sp
    ('gpt_neox (base_model_tp_plan)', ['gpt_neox.layers.*'], ('gpt_neox.layers.*', 'gpt_neox.final_layer_norm'))
    """
    model_type = model_type_of(model)
    plan = tp_plan_of(model)
    if not plan:
        raise ScheduleError("recipes.from_model_plan", [Problem(
            "", f"model_type {model_type!r} has no recipe and no base_model_tp_plan",
            "write a Recipe for the family (slapo_fn.recipes), or give the model a base_model_tp_plan "
            "(e.g. in its config.json) or pass one to from_tp_plan(sch, plan)")])
    base = _base(model)
    relative = plan_stacks(plan)
    stacks = [f"{base}.{layers}" if base else layers for layers in relative]
    if not stacks:
        raise ScheduleError("recipes.from_model_plan", [Problem(
            "", f"the base_model_tp_plan of model_type {model_type!r} names no repeated layers ('layers.*.…')",
            "shard it with from_tp_plan(sch) and the other rewrites by hand")])
    sp = tuple(stacks) + _norms_after(model, base, relative[0]) if len(stacks) == 1 else ()
    # with sequence parallelism the block holding a layer's experts runs on the whole sequence:
    # its router reads every token (its input gathered, its output split back)
    whole = tuple(sorted({parent_path(path[len(relative[0]) + 1:]) for path, style in plan.items()
                          if style in _EXPERT_STYLES and path.startswith(relative[0] + ".")} - {""}))
    # the model's own plan: entries for layers it lacks (DeepSeek's dense first layers) are skipped
    return _PlanRecipe(name=f"{model_type} (base_model_tp_plan)", model_types=(str(model_type),),
                       stacks=tuple(Stack(layers, whole=whole if len(stacks) == 1 else ()) for layers in stacks),
                       sp=sp, extra_tp=from_tp_plan)



def plan_stacks(plan: Mapping[str, str]) -> list[str]:
    """The repeated layers a tensor-parallel plan names, relative to the base model
    (``layers.*`` of ``"layers.*.mlp.up_proj"``), in the plan's order.

    >>> plan_stacks({"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"})
    ['layers.*']
    """
    stacks: list[str] = []
    for path in plan:
        tokens = path.split(".")
        if "*" in tokens:
            layers = ".".join(tokens[: tokens.index("*") + 1])
            if layers not in stacks:
                stacks.append(layers)
    return stacks


def _norms_after(model: nn.Module, base: str, layers: str) -> tuple[str, ...]:
    """The modules the model's ``base_model_pp_plan`` names after its repeated ``layers``
    (``layers.*``, relative to the base model) that are norms (a module of its own
    parameters and no children: the final norm), as paths."""
    config = config_of(model)
    pp = getattr(model if config is None else config, "base_model_pp_plan", None) or {}
    names = list(pp)
    stack = layers.removesuffix(".*")
    if stack not in names:
        return ()
    found = []
    for name in names[names.index(stack) + 1:]:
        path = f"{base}.{name}" if base else name
        module = _module_at(model, path)
        if module is not None and not module._modules and any(True for _ in module.parameters(recurse=False)):
            found.append(path)
    return tuple(found)


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


class _PlanRecipe(Recipe):
    """A recipe made by :func:`from_model_plan`: ``sequence_parallel`` is refused where the
    plan names no single stack of layers to run on sequence shards (``sp`` is empty)."""

    def _check(self, sch: Schedule, knobs: Knobs) -> None:
        super()._check(sch, knobs)
        if knobs.sequence_parallel and not self.sp:
            raise LayoutError(f"recipes.{self.name}", [Problem(
                "", "sequence_parallel needs one stack of repeated layers, and this base_model_tp_plan names "
                    f"{len(self.stacks)}", "drop sequence_parallel (--sp), or write a Recipe with its sp modules")])


#: Column- and row-wise layers (rows take a Megatron pair's split input, or split a whole one
#: themselves: ``rowwise_split_input``), and vocab- / feature-split embeddings.
_STYLES = {"colwise": 0, "local_colwise": 0, "rowwise": 1, "local_rowwise": 1, "rowwise_rep": 1,
           "rowwise_split_input": 1, "embedding_rowwise": 0, "embedding_colwise": 1}
#: Column layers whose output is gathered whole (``output_layouts=Replicate()``): a shard and a
#: ``fwd_post`` sync to ``Replicate()``, so the code after them sees every feature.
_GATHERED_STYLES = frozenset({"colwise_gather_output", "colwise_rep"})
#: Fused [gate; up] column layers (two chunks, each sharded): sf.shard(axis=0, packed=2).
_PACKED_STYLES = frozenset({"packed_colwise"})
#: Replicated parameters of modules that see this rank's shard (per-head q/k norms): sf.tp_local.
_LOCAL_STYLES = frozenset({"replicated_with_grad_allreduce"})
#: Mixture-of-experts experts split inside each expert (their packed_colwise / rowwise parameter
#: entries come with it): sf.expert_tensor_parallel.
_EXPERT_STYLES = frozenset({"moe_tp_experts"})
_KNOWN = frozenset(_STYLES) | _GATHERED_STYLES | _PACKED_STYLES | _LOCAL_STYLES | _EXPERT_STYLES


def check_tp_plan(plan: Mapping[str, str]) -> None:
    """Refuse, by path, every style of a Hugging Face tensor-parallel plan that
    :func:`from_tp_plan` has no equivalent for (a ``ScheduleError``)."""
    bad = [Problem(path, f"tensor-parallel style {style!r} has no slapo_fn equivalent here",
                   f"{'/'.join(sorted(_KNOWN))} only, or write the layout with sf.shard/sf.sync")
           for path, style in plan.items() if style not in _KNOWN]
    if bad:
        raise ScheduleError("from_tp_plan", bad)


def from_tp_plan(sch: Schedule, plan: Mapping[str, str] | None = None) -> Schedule:
    """Shard ``sch`` by a Hugging Face tensor-parallel plan (``{"layers.*.self_attn.q_proj":
    "colwise", …}``; default: the model's ``config.base_model_tp_plan``), over mesh axis
    ``"tp"``. Paths are relative to the base model (``model.`` is prefixed for a causal
    LM). Column/row-wise styles shard (``colwise_gather_output`` also gathers the output
    whole, a ``fwd_post`` sync to ``Replicate()``); ``packed_colwise`` shards a fused [gate; up] layer
    chunk by chunk; ``replicated_with_grad_allreduce`` (per-head norms) is
    :func:`~slapo_fn.dtensor.tp_local`; ``moe_tp_experts`` splits each expert of a
    mixture-of-experts experts module (:func:`~slapo_fn.expert_tensor_parallel`, which
    also lays out that module's ``packed_colwise`` / ``rowwise`` parameter entries); other
    styles are refused by name. The model's own plan may name modules of layer kinds the
    model does not have (Qwen2-MoE's dense ``mlp.gate_proj`` when every layer is sparse):
    those entries are skipped; a plan passed in must match.

    >>> import slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> cfg = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=4)
    >>> sch = from_tp_plan(sf.create_schedule(MixtralForCausalLM(cfg), mesh=fake_mesh(2)))
    >>> print(sch["model.layers.0.mlp.experts"].annotations["experts"])
    experts@tp(4)
    """
    model = sch.module
    own = plan is None
    if plan is None:
        plan = tp_plan_of(model)
    if not plan:
        raise ScheduleError("from_tp_plan", [Problem("", "the model has no base_model_tp_plan",
                                                     "pass plan={path: 'colwise' | 'rowwise'}")])
    check_tp_plan(plan)
    base = _base(model)

    def full(path: str) -> str:
        return f"{base}.{path}" if base else path

    def present(path: str) -> bool:
        try:
            return bool(select(full(path)).paths(model))
        except KeyError:
            return False

    entries = {path: style for path, style in plan.items() if not own or present(path)}
    experts = [path for path, style in entries.items() if style in _EXPERT_STYLES]
    for path, style in entries.items():
        if any(path.startswith(e + ".") for e in experts):
            continue  # an expert parameter: expert_tensor_parallel lays it out
        if style in _STYLES:
            sch = shard(sch, full(path), axis=_STYLES[style])
        elif style in _GATHERED_STYLES:
            sch = sync(shard(sch, full(path), axis=0), full(path), "fwd_post", Replicate())
        elif style in _PACKED_STYLES:
            sch = shard(sch, full(path), axis=0, packed=2)
    if experts:
        sch = expert_tensor_parallel(sch, [full(p) for p in experts])
    local = [full(path) for path, style in entries.items() if style in _LOCAL_STYLES]
    return tp_local(sch, local) if local else sch
