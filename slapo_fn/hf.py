"""Everything the package knows about Hugging Face ``transformers`` models, in one place.

``transformers`` is an optional extra: nothing here imports it. Its classes are
recognised by name and module (``type(m).__mro__``), its configs and modules read by the
attribute names below. Other modules ask these functions instead of guessing attribute
names or checking class names themselves; only ``recipes/`` (per-family data) and
``kernels/`` (drop-ins for specific Hugging Face modules) read family attributes directly.

* what a module is: :func:`is_pretrained_model`, :func:`is_transformers_module`,
  :func:`is_conv1d`;
* its config: :func:`config_of`, :func:`model_type`, :func:`vocab_size`,
  :func:`config_value` with the name tuples ``*_ATTRS``;
* weight initialisation: :func:`init_owner`, :func:`reset_weights`,
  :func:`clear_initialized_flags`;
* attention heads: :data:`HEAD_COUNT_ATTRS`, :data:`HEAD_DIM_ATTRS`, :func:`head_dim_of`,
  :func:`mixes_tokens`;
* pipeline stages: :data:`PIPELINE_STAGES` (per model type, what the stage split needs);
* what a forward takes: :data:`TOKEN_ID_ARGS`, :func:`input_embedding`, :func:`extra_keywords`;
* weight files: :func:`tied_weights`, :func:`ignored_on_load`, :func:`recompute_buffers`,
  and the checkpoint conversions (per-expert keys of the files ↔ fused 3-D expert
  parameters of the model): :func:`checkpoint_keys` (:class:`Stacked`, :class:`Joined`)
  and :func:`checkpoint_state` (what :func:`slapo_fn.load_hf` and :func:`slapo_fn.save_hf`
  need to know);
* training with recomputation: :func:`train_without_cache`.

Example:
    >>> import torch.nn as nn
    >>> is_pretrained_model(nn.Linear(2, 2)), model_type(nn.Linear(2, 2))
    (False, None)
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Literal, TypeAlias, Unpack, get_args, get_origin

import torch
from torch import nn

from .tree import adds_bias, walk

__all__ = [
    "CONFIG_HEAD_COUNT_ATTRS",
    "EXPERTS_PER_TOKEN_ATTRS",
    "EXPERT_COUNT_ATTRS",
    "FFN_SIZE_ATTRS",
    "GATED_MLP_MODEL_TYPES",
    "HEAD_COUNT_ATTRS",
    "HEAD_DIM_ATTRS",
    "HEAD_WIDTH_ATTRS",
    "HIDDEN_SIZE_ATTRS",
    "LAYER_COUNT_ATTRS",
    "PIPELINE_STAGES",
    "POSITION_LIMIT_ATTRS",
    "QUERY_HEAD_ATTRS",
    "TOKEN_ID_ARGS",
    "Assembly",
    "CheckpointKeys",
    "Joined",
    "Stacked",
    "StageRole",
    "StageStandIn",
    "checkpoint_keys",
    "checkpoint_state",
    "clear_initialized_flags",
    "config_of",
    "config_value",
    "experts_transposed",
    "extra_keywords",
    "gate_up_packing",
    "head_dim_of",
    "ignored_on_load",
    "init_owner",
    "input_embedding",
    "is_conv1d",
    "is_encoder_decoder",
    "is_pretrained_model",
    "is_transformers_module",
    "linear_features",
    "model_type",
    "position_limit",
    "recompute_buffers",
    "reset_weights",
    "stage_config",
    "tied_weights",
    "vocab_size",
]


# -- what a module is ---------------------------------------------------------------------
def is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face *model*: a subclass of transformers'
    ``PreTrainedModel`` (it has a ``config`` and owns ``_init_weights``). Its layers and
    attention modules are not.

    >>> import torch.nn as nn
    >>> is_pretrained_model(nn.Linear(2, 2))
    False
    """
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(module).__mro__
    )


def is_transformers_module(module: nn.Module) -> bool:
    """Whether ``module``'s class (or a base class) comes from the ``transformers``
    package: any Hugging Face module — a whole model, a decoder layer, an attention block
    or a ``Conv1D`` — whose code ``torch.fx`` cannot trace.

    >>> import torch.nn as nn
    >>> is_transformers_module(nn.Linear(2, 2))
    False
    """
    return any(c.__module__.startswith("transformers.") for c in type(module).__mro__)


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face ``Conv1D`` (GPT-2's linear layer, ``x @ weight + bias`` with the weight
    stored (in, out)), recognised without importing transformers; a subclass too, where it
    computes that product: it keeps ``Conv1D``'s forward, or its class says
    ``adds_bias = False`` (its forward is the product alone, its caller adds the bias, as
    :func:`~slapo_fn.decompose` leaves it). A subclass with a forward of its own is not one.

    >>> import torch.nn as nn
    >>> is_conv1d(nn.Linear(2, 2))
    False
    """
    kind = type(module)
    base = next((c for c in kind.__mro__ if c.__name__ == "Conv1D"), None)
    return (base is not None and hasattr(module, "nf") and hasattr(module, "nx")
            and (getattr(kind, "forward", None) is getattr(base, "forward", None)
                 or not adds_bias(module)))


def linear_features(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a linear layer: ``nn.Linear`` or Hugging Face's
    ``Conv1D`` (``nx``, ``nf``); ``None`` for any other module.

    >>> import torch.nn as nn
    >>> linear_features(nn.Linear(4, 6)), linear_features(nn.ReLU())
    ((4, 6), None)
    """
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return int(vars(module)["nx"]), int(vars(module)["nf"])
    return None


# -- config -------------------------------------------------------------------------------
#: Config attributes holding the hidden size, in the order they are tried (LLaMA/OPT/BERT,
#: GPT-2, T5).
HIDDEN_SIZE_ATTRS = ("hidden_size", "n_embd", "d_model")
#: Config attributes holding the MLP width (GPT-2's ``n_inner`` may be ``None``: 4 × hidden).
FFN_SIZE_ATTRS = ("intermediate_size", "ffn_dim", "n_inner", "d_ff")
#: Config attributes holding the number of layers.
LAYER_COUNT_ATTRS = ("num_hidden_layers", "n_layer", "num_layers")
#: Config attributes holding the number of attention heads.
CONFIG_HEAD_COUNT_ATTRS = ("num_attention_heads", "n_head", "num_heads")
#: Model types whose MLP is gated (``down(act(gate(x)) * up(x))``: three projections).
GATED_MLP_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})

_MISSING: Any = object()


def config_of(model: Any) -> Any | None:
    """The Hugging Face config of ``model`` (its ``config`` attribute), or ``None``.

    >>> import torch.nn as nn
    >>> config_of(nn.Linear(2, 2)) is None
    True
    """
    return getattr(model, "config", None)


def model_type(model: Any) -> str | None:
    """``config.model_type`` of a Hugging Face model, or of a config itself (``"llama"``,
    ``"gpt2"`` …); ``None`` for anything else.

    >>> from types import SimpleNamespace
    >>> model_type(SimpleNamespace(config=SimpleNamespace(model_type="gpt2")))
    'gpt2'
    >>> model_type(SimpleNamespace(model_type="opt")), model_type(object())
    ('opt', None)
    """
    config = config_of(model)
    value = getattr(model if config is None else config, "model_type", None)
    return value if isinstance(value, str) else None


def config_value(config: Any, *names: str, default: Any = _MISSING) -> Any:
    """The first of the attributes ``names`` of ``config`` that is not ``None`` (different
    families name the same size differently: pass one of the ``*_ATTRS`` tuples); else
    ``default``, or ``AttributeError`` without one.

    >>> from types import SimpleNamespace
    >>> config_value(SimpleNamespace(n_embd=64), *HIDDEN_SIZE_ATTRS)
    64
    >>> config_value(SimpleNamespace(n_inner=None), *FFN_SIZE_ATTRS, default=None) is None
    True
    """
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is _MISSING:
        raise AttributeError(f"config has none of {names}")
    return default


def vocab_size(model: Any) -> int:
    """The vocabulary size of a Hugging Face model (``config.vocab_size``).

    >>> from types import SimpleNamespace
    >>> vocab_size(SimpleNamespace(config=SimpleNamespace(vocab_size=256)))
    256
    """
    return int(config_value(config_of(model), "vocab_size"))


#: Config attributes holding the longest sequence a model's position table covers.
POSITION_LIMIT_ATTRS = ("max_position_embeddings", "n_positions", "max_target_positions", "n_ctx")


def position_limit(config: Any, default: int = 1 << 30) -> int:
    """The longest sequence ``config``'s model takes (:data:`POSITION_LIMIT_ATTRS`), else ``default``.

    >>> from types import SimpleNamespace
    >>> position_limit(SimpleNamespace(n_positions=8)), position_limit(None, 4)
    (8, 4)
    """
    value = config_value(config, *POSITION_LIMIT_ATTRS, default=default)
    return int(value) if isinstance(value, int) else default


#: Config attributes holding one entry per layer, which a forward indexes by the position
#: of the layer in the loop over its layer list (``config.layer_types[i]``: Gemma2's
#: sliding/full attention).
PER_LAYER_ATTRS = ("layer_types",)


def stage_config(config: Any, keep: Sequence[int], layers: int) -> Any:
    """``config`` for a pipeline stage that keeps the layers at positions ``keep`` of a
    layer list of ``layers``: a shallow copy whose per-layer lists (:data:`PER_LAYER_ATTRS`)
    hold the kept layers' entries, in order — the stage's forward loops over its own
    layers only. ``config`` itself where nothing needs changing.

    >>> from types import SimpleNamespace
    >>> stage_config(SimpleNamespace(layer_types=["s", "f", "s", "f"]), [1, 2], 4).layer_types
    ['f', 's']
    """
    changed = {
        name: [value[i] for i in keep]
        for name in PER_LAYER_ATTRS
        if isinstance(value := getattr(config, name, None), list | tuple) and len(value) == layers
    }
    if not changed or list(keep) == list(range(layers)):
        return config
    clone = copy.copy(config)
    clone.__dict__.update(changed)
    return clone


#: The sizes of a model's small twin (:func:`small_config`): same class, same structure.
_SMALL = {"hidden": 64, "ffn": 128, "heads": 4, "head_dim": 16, "layers": 3}


def small_config(config: Any) -> Any | None:
    """A copy of a Hugging Face ``config`` with the same structure at a tiny size (hidden
    64, 4 heads, at most 3 layers; vocabulary and special tokens unchanged), to build a
    real twin of a model that lives on the meta device; ``None`` for no config.

    >>> from types import SimpleNamespace
    >>> c = small_config(SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
    ...                                  num_hidden_layers=32, layer_types=["a", "b"] * 16))
    >>> (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers, c.layer_types)
    (64, 4, 2, 3, ['a', 'b', 'a'])
    """
    if config is None:
        return None
    small = copy.deepcopy(config)
    heads = next((getattr(config, n) for n in CONFIG_HEAD_COUNT_ATTRS if isinstance(getattr(config, n, None), int)),
                 None)
    for name in HIDDEN_SIZE_ATTRS:
        if isinstance(getattr(config, name, None), int):
            _set(small, name, _SMALL["hidden"])
    for name in FFN_SIZE_ATTRS:
        if isinstance(getattr(config, name, None), int):
            _set(small, name, _SMALL["ffn"])
    for name in CONFIG_HEAD_COUNT_ATTRS:
        if isinstance(getattr(config, name, None), int):
            _set(small, name, _SMALL["heads"])
    kv = getattr(config, "num_key_value_heads", None)
    if isinstance(kv, int) and heads:
        _set(small, "num_key_value_heads", _SMALL["heads"] if kv >= heads else (1 if kv == 1 else 2))
    if isinstance(getattr(config, "head_dim", None), int):
        _set(small, "head_dim", _SMALL["head_dim"])
    layers = None
    for name in LAYER_COUNT_ATTRS:
        if isinstance(value := getattr(config, name, None), int):
            layers = min(value, _SMALL["layers"])
            _set(small, name, layers)
    if layers is not None:
        for name in PER_LAYER_ATTRS:
            if isinstance(value := getattr(config, name, None), list | tuple):
                _set(small, name, list(value)[:layers])
    return small


def _set(config: Any, name: str, value: Any) -> None:
    with contextlib.suppress(AttributeError):  # a derived property (Falcon's head_dim) follows the sizes set
        setattr(config, name, value)


def is_encoder_decoder(model: nn.Module) -> bool:
    """Whether ``model`` is a whole Hugging Face encoder-decoder model (Bart, T5, Whisper):
    its config says ``is_encoder_decoder`` and its forward takes ``decoder_input_ids`` (the
    encoder or decoder alone share the config but not that argument).

    >>> import torch.nn as nn
    >>> is_encoder_decoder(nn.Linear(2, 2))
    False
    """
    if not getattr(config_of(model), "is_encoder_decoder", False):
        return False
    try:
        return "decoder_input_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


# -- weight initialisation ----------------------------------------------------------------
def init_owner(owners: Mapping[str, nn.Module], path: str) -> nn.Module | None:
    """The nearest Hugging Face ``PreTrainedModel`` at or above ``path``, among ``owners``
    (``{path: model}`` of the tree's pretrained models): the one whose ``_init_weights``
    initialises the module at ``path``.

    >>> import torch.nn as nn
    >>> root = nn.Linear(2, 2)
    >>> init_owner({"": root}, "a.b") is root, init_owner({"x": root}, "a.b")
    (True, None)
    """
    tokens = path.split(".") if path else []
    for i in range(len(tokens), -1, -1):
        owner = owners.get(".".join(tokens[:i]))
        if owner is not None:
            return owner
    return None


def reset_weights(module: nn.Module, owner: nn.Module | None) -> bool:
    """Initialise ``module``'s own tensors in place: by ``owner._init_weights(module)``
    (Hugging Face's per-model initialisation) where ``owner`` has it, else by
    ``module.reset_parameters()``. ``False`` when neither exists.

    >>> import torch.nn as nn
    >>> reset_weights(nn.Linear(2, 2), None), reset_weights(nn.ReLU(), None)
    (True, False)
    """
    init_weights = getattr(owner, "_init_weights", None)
    if callable(init_weights):
        init_weights(module)
        return True
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
        return True
    return False


def clear_initialized_flags(module: nn.Module) -> None:
    """Forget that Hugging Face initialised ``module`` and its own parameters and buffers
    (the ``_is_hf_initialized`` flags ``_init_weights`` skips on), so that it initialises
    them again (after meta tensors got new storage).

    >>> import torch.nn as nn
    >>> m = nn.Linear(2, 2)
    >>> m._is_hf_initialized = True
    >>> clear_initialized_flags(m); hasattr(m, "_is_hf_initialized")
    False
    """
    module.__dict__.pop("_is_hf_initialized", None)
    for t in (*module._parameters.values(), *module._buffers.values()):
        if t is not None:
            t.__dict__.pop("_is_hf_initialized", None)


# -- attention heads ----------------------------------------------------------------------
#: Attention-module attributes that count its query heads (not its key/value groups).
QUERY_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
#: Attention-module attributes that count heads (query or key/value heads).
HEAD_COUNT_ATTRS = (*QUERY_HEAD_ATTRS, "num_key_value_heads", "n_kv_heads", "num_kv_heads")
#: Attention-module attributes that hold the size of one head (LLaMA/GPT-2, T5, BERT).
HEAD_DIM_ATTRS = ("head_dim", "key_value_proj_dim", "attention_head_size")
#: Attention-module attributes that hold the width of all its heads together (XGLM's
#: ``reshape(bsz, tgt_len, self.embed_dim)`` merging them back; BERT's ``all_head_size``).
HEAD_WIDTH_ATTRS = ("embed_dim", "all_head_size")
#: Experts-module attributes that hold its number of experts (Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss
#: experts read ``num_experts`` in their forwards to size their per-expert tables).
EXPERT_COUNT_ATTRS = ("num_experts",)
#: Config attributes that hold how many experts each token is routed to (Mixtral, Qwen-MoE,
#: DeepSeek-V3: ``num_experts_per_tok``; gpt-oss: ``num_experts_per_tok`` too; older: ``moe_topk``).
EXPERTS_PER_TOKEN_ATTRS = ("num_experts_per_tok", "moe_topk")


def gate_up_packing(experts: nn.Module) -> int:
    """How many fused chunks a Hugging Face experts module's first projection holds along
    its intermediate dimension: 2 for [gate; up] concatenated (``has_gate`` and
    ``is_concatenated``, the default of ``@use_experts_implementation``), 1 for interleaved
    gate/up rows or no gate (each rank's contiguous slice then holds whole pairs).

    >>> import torch.nn as nn
    >>> gate_up_packing(nn.Linear(2, 2))
    2
    """
    own = vars(experts)
    return 2 if own.get("has_gate", True) and own.get("is_concatenated", True) else 1


def experts_transposed(experts: nn.Module) -> bool | None:
    """Whether a Hugging Face experts module stores its matrices as [E, in, out]
    (``is_transposed``, gpt-oss) rather than [E, out, in] (Mixtral, Qwen-MoE); ``None``
    for a module that does not say.

    >>> import torch.nn as nn
    >>> experts_transposed(nn.Linear(2, 2)) is None
    True
    """
    value = vars(experts).get("is_transposed")
    return value if isinstance(value, bool) else None


def mixes_tokens(module: nn.Module) -> bool:
    """Whether ``module`` looks like attention — a class named ``...Attention`` (Hugging
    Face's, ``nn.MultiheadAttention``) or one holding a head count or head size — whose
    output at one position reads every position's input. For refusing layouts only: a
    module this misses is not assumed to be per-token.

    >>> import torch.nn as nn
    >>> mixes_tokens(nn.MultiheadAttention(8, 2)), mixes_tokens(nn.Linear(2, 2))
    (True, False)
    """
    if any(c.__name__.endswith("Attention") for c in type(module).__mro__):
        return True
    own = vars(module)
    return any(isinstance(own.get(a), int) for a in (*HEAD_COUNT_ATTRS, *HEAD_DIM_ATTRS))


def evenly_routed_experts(model: nn.Module) -> list[str]:
    """On a private copy of a model, for a run on fake tensors (explain's): give each
    Hugging Face fused experts module a forward in which every expert takes an even share,
    ⌈T·k/E⌉, of the tokens — the shapes, FLOPs and saved tensors of evenly routed experts
    — since the real forwards index tokens by routing data (``nonzero``), which a fake
    run cannot, and ``grouped_mm``'s fake rule accepts only bfloat16. Modules with biases
    or transposed matrices keep their own forward. Returns the paths given one.

    >>> import torch.nn as nn
    >>> evenly_routed_experts(nn.Linear(2, 2))
    []
    """
    changed = []
    for path, m in walk(model):
        if not hasattr(type(m), "_apply_gate"):  # transformers' experts classes (use_experts_implementation)
            continue
        own = vars(m)
        if own.get("has_bias") or own.get("is_transposed") or not own.get("has_gate", True):
            continue
        if not all(isinstance(m._parameters.get(n), torch.Tensor) for n in ("gate_up_proj", "down_proj")):
            continue
        m.forward = _evenly_routed(m)
        changed.append(path)
    return changed


def _evenly_routed(module: nn.Module) -> Any:
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        gate_up, down = module._parameters["gate_up_proj"], module._parameters["down_proj"]  # the run's own
        act = module._modules["act_fn"]
        assert gate_up is not None and down is not None and act is not None
        tokens, experts, k = int(hidden_states.shape[0]), int(gate_up.shape[0]), int(top_k_index.shape[-1])
        share = max(1, min(tokens, -(-tokens * k // experts)))
        rows, weight = hidden_states[:share], top_k_weights[:share, :1].to(hidden_states.dtype)
        out = torch.zeros_like(hidden_states)
        for e in range(experts):
            gate, up = torch.nn.functional.linear(rows, gate_up[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(act(gate) * up, down[e]) * weight
            out = out + torch.nn.functional.pad(y, (0, 0, 0, tokens - share))
        return out

    return forward


def head_dim_of(module: nn.Module, names: Sequence[str] = HEAD_DIM_ATTRS) -> int | None:
    """The size of one attention head of a Hugging Face attention ``module``: the first of
    the attributes ``names`` (default :data:`HEAD_DIM_ATTRS`) it has as a positive int;
    ``None`` for other modules.

    >>> import torch.nn as nn
    >>> m = nn.Module()
    >>> m.head_dim = 8
    >>> head_dim_of(m), head_dim_of(nn.Linear(2, 2))
    (8, None)
    """
    return next((v for a in names if isinstance(v := getattr(module, a, None), int) and v > 0), None)


# -- pipeline stages ----------------------------------------------------------------------
class StageRole(StrEnum):
    """Where a child on the path to the cut sequence runs: before it (embeddings), after it
    (final norm, head) or in every stage (see :mod:`slapo_fn.pipelines.families`).

    Example:
        >>> StageRole.POST == "post"
        True
    """

    PRE = "pre"
    POST = "post"
    SHARED = "shared"


#: What stands in for a ``pre`` module in the stages after the first.
StageStandIn: TypeAlias = Literal["absent", "identity", "zeros", "inputs"]

_Stages: TypeAlias = tuple[Mapping[str, StageRole], Mapping[str, StageStandIn]]


def _stages(roles: dict[str, StageRole] | None = None, later: dict[str, StageStandIn] | None = None) -> _Stages:
    return MappingProxyType(dict(roles or {})), MappingProxyType(dict(later or {}))


_BERT = _stages(later={"embeddings": "inputs"})

#: Hugging Face model types whose stage split is known to be right, each with ``(roles,
#: later)``: roles that override the structural default (by child name) and what stands
#: in for a ``pre`` module in later stages. Empty for the structural defaults (LLaMA-like
#: forwards feed inputs_embeds straight to the layers).
PIPELINE_STAGES: Mapping[str, _Stages] = MappingProxyType(
    {
        "llama": _stages(),
        "mistral": _stages(),
        "qwen2": _stages(),
        "qwen3": _stages(),
        # GPT2Model.forward adds wpe(position_ids) to inputs_embeds, then dropout.
        "gpt2": _stages(later={"wpe": "zeros", "drop": "identity"}),
        # OPTDecoder registers final_layer_norm/project_out *before* its layers, adds
        # embed_positions(...) and applies project_in to inputs_embeds.
        "opt": _stages(
            roles={"final_layer_norm": StageRole.POST, "project_out": StageRole.POST},
            later={"embed_positions": "zeros", "project_in": "identity"},
        ),
        # BertModel always calls self.embeddings(..., inputs_embeds=...) (adds position and
        # token-type embeddings and a LayerNorm): later stages pass the hidden states on.
        "bert": _BERT,
        "roberta": _BERT,
    }
)


# -- what a forward takes -----------------------------------------------------------------
#: Arguments of a Hugging Face model's forward that carry token ids into its input
#: embedding: integer tensors of shape (batch, sequence), each id below the vocabulary size.
TOKEN_ID_ARGS = ("input_ids", "decoder_input_ids")

#: Keywords every Hugging Face model's forward takes through ``**kwargs`` (decorators pop them).
_DECORATOR_KEYWORDS = frozenset({"return_dict"})


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The embedding a Hugging Face model reads ``input_ids`` through, or ``None``."""
    get = getattr(model, "get_input_embeddings", None)
    if not is_pretrained_model(model) or not callable(get):
        return None
    try:
        embedding = get()
    except (NotImplementedError, AttributeError):
        return None
    return embedding if isinstance(embedding, nn.Embedding) else None


def extra_keywords(model: nn.Module, annotation: Any) -> frozenset[str] | None:
    """The names ``model.forward`` takes through its ``**kwargs`` (annotated ``annotation``):
    the keys of an ``Unpack[TypedDict]`` annotation, or for a Hugging Face model with a bare
    ``**kwargs`` those of ``transformers``' ``TransformersKwargs``; ``None`` where any name
    goes (a plain module's ``**kwargs``). Hugging Face forwards swallow unknown keywords:
    a misspelt ``atention_mask`` would be ignored without this list."""
    typed = get_args(annotation)[0] if get_origin(annotation) is Unpack and get_args(annotation) else None
    if typed is None and is_pretrained_model(model):
        try:
            from transformers.utils.generic import TransformersKwargs
        except ImportError:
            return None
        typed = TransformersKwargs
    keys = getattr(typed, "__required_keys__", frozenset()) | getattr(typed, "__optional_keys__", frozenset())
    if not keys:
        return None
    return frozenset(keys) | (_DECORATOR_KEYWORDS if is_pretrained_model(model) else frozenset())


# -- weight files -------------------------------------------------------------------------
def tied_weights(model: nn.Module) -> dict[str, str]:
    """``{target: source}`` FQNs of the parameters a Hugging Face ``model`` ties (the LM
    head to the input embedding when ``config.tie_word_embeddings``): a weight file holds
    only the source. Nested pretrained models are included, their keys prefixed. Empty for
    other modules.

    >>> import torch.nn as nn
    >>> tied_weights(nn.Linear(2, 2))
    {}
    """
    out: dict[str, str] = {}
    for prefix, m in walk(model):
        if not is_pretrained_model(m):
            continue
        expanded = getattr(m, "all_tied_weights_keys", None)
        if not isinstance(expanded, Mapping):
            get = getattr(m, "get_expanded_tied_weights_keys", None)
            expanded = get(all_submodels=False) if callable(get) else {}
        for target, source in dict(expanded or {}).items():
            key = f"{prefix}.{target}" if prefix else target
            out.setdefault(key, f"{prefix}.{source}" if prefix else source)
    return out


#: Keys of old Hugging Face weight files that current models recompute (per-layer rotary tables).
_ALWAYS_IGNORED = (r"rotary_emb\.inv_freq$",)


def ignored_on_load(model: nn.Module) -> tuple[re.Pattern[str], ...]:
    """Patterns of weight-file keys a Hugging Face ``model`` ignores when loading (its
    ``_keys_to_ignore_on_load_unexpected``, and rotary ``inv_freq`` tables older files hold).

    >>> import torch.nn as nn
    >>> [bool(p.search("model.rotary_emb.inv_freq")) for p in ignored_on_load(nn.Linear(2, 2))]
    [True]
    """
    patterns: list[str] = list(_ALWAYS_IGNORED)
    for _, m in walk(model):
        patterns += [str(p) for p in (getattr(m, "_keys_to_ignore_on_load_unexpected", None) or ())]
    return tuple(re.compile(p) for p in dict.fromkeys(patterns))


def recompute_buffers(model: nn.Module, paths: Sequence[str] | None = None) -> list[str]:
    """Recompute the non-persistent buffers (rotary ``inv_freq`` …; weight files do not
    hold them) of the modules of ``model`` at ``paths`` (default: every module that has
    some), in place, by the module's own initialisation (:func:`reset_weights`: its
    Hugging Face owner's ``_init_weights``, else ``reset_parameters``). Call it before
    loading parameters: a module's initialisation may also reset its parameters.
    Returns the paths it could not recompute.

    >>> import torch, torch.nn as nn
    >>> m = nn.Linear(2, 2)
    >>> m.register_buffer("scale", torch.zeros(2), persistent=False)
    >>> recompute_buffers(m)
    []
    """
    owners = {path: m for path, m in walk(model) if is_pretrained_model(m)}
    if paths is None:
        paths = [path for path, m in walk(model) if m._non_persistent_buffers_set]
    modules = dict(walk(model))
    failed = []
    for path in paths:
        module = modules[path]
        clear_initialized_flags(module)
        if not reset_weights(module, init_owner(owners, path)):
            failed.append(path)
    return failed


# -- checkpoint conversions: the keys of the files ↔ the parameters of the model -------------
@dataclass(frozen=True)
class Stacked:
    """A model tensor that is ``torch.stack(parts, dim)`` of the tensors in the files (one
    part per expert: transformers' ``MergeModulelist``); a part is a file key or another
    assembly.

    >>> Stacked(0, ("experts.0.w2.weight", "experts.1.w2.weight")).parts[1]
    'experts.1.w2.weight'
    """

    dim: int
    parts: tuple[Assembly, ...]


@dataclass(frozen=True)
class Joined:
    """A model tensor that is ``torch.cat(parts, dim)`` of the tensors in the files (the
    fused [gate; up] projection: transformers' ``Concatenate``), parts in this order.

    >>> Joined(1, (Stacked(0, ("g0", "g1")), Stacked(0, ("u0", "u1")))).dim
    1
    """

    dim: int
    parts: tuple[Assembly, ...]


#: How one model tensor is made of the tensors in the weight files: a file key (read as
#: is), or a :class:`Stacked` / :class:`Joined` of assemblies.
Assembly: TypeAlias = "str | Stacked | Joined"


@dataclass(frozen=True)
class CheckpointKeys:
    """What :func:`checkpoint_keys` found: ``sources``, every model key the files provide
    and how it is assembled; ``unsupported``, model keys transformers converts with an
    operation that cannot be read slice by slice (``{model key: why}``) and the file keys
    they consume (``consumed``); ``model``, the model's type (``None`` for a module that is
    not Hugging Face's) and ``converted``, whether transformers has a conversion mapping of
    its own for it (beyond the renamings of old files every model gets)."""

    sources: Mapping[str, Assembly]
    unsupported: Mapping[str, str] = field(default_factory=dict)
    consumed: frozenset[str] = frozenset()
    model: str | None = None
    converted: bool = False


def _conversions(model: nn.Module, *, legacy: bool = True) -> list[Any]:
    """transformers' own ordered list of weight transforms (``WeightRenaming``,
    ``WeightConverter``) that ``from_pretrained`` applies to ``model``'s files (with
    ``legacy``: also the renamings of old files every model gets); empty without
    transformers or for other modules."""
    if not is_pretrained_model(model):
        return []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # an older transformers: keys are loaded as they are named
        return []
    return list(get_model_conversion_mapping(model, add_legacy=legacy))  # type: ignore[arg-type]


def _assemble(converter: Any, collected: Mapping[str, list[str]]) -> Assembly | str:
    """Replay ``converter.operations`` on file keys (grouped by the source pattern that
    matched them, in transformers' order) symbolically; a ``str`` starting with ``"!"``
    names the operation that cannot be replayed."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    state: dict[str, list[str] | Assembly] = dict(collected)
    for op in converter.operations:
        if type(op) is MergeModulelist:
            state = {p: Stacked(int(op.dim), tuple(v)) if isinstance(v, list) else v for p, v in state.items()}
        elif type(op) is Concatenate:
            parts = [state[p] for p in converter.source_patterns if p in state]
            if any(isinstance(v, list) for v in parts):
                return f"!{op!r} of per-expert lists"
            state = {"": Joined(int(op.dim), tuple(v for v in parts if not isinstance(v, list)))}
        else:
            return f"!{op!r}"
    if len(state) != 1 or isinstance(only := next(iter(state.values())), list):
        return f"!{' → '.join(map(repr, converter.operations))} (not one tensor per model key)"
    return only


def checkpoint_keys(model: nn.Module, file_keys: Iterable[str], model_keys: Collection[str]) -> CheckpointKeys:
    """How the tensors of a Hugging Face weight folder (``file_keys``) make up ``model``'s
    parameters (``model_keys``), by transformers' own checkpoint conversion mapping for the
    model type (``get_model_conversion_mapping``: the renamings and converters
    ``from_pretrained`` applies). Mixtral files hold
    ``model.layers.0.block_sparse_moe.experts.3.w1.weight`` (one per expert) where the
    model has the fused ``model.layers.0.mlp.experts.gate_up_proj`` [E, 2I, H]: that key's
    source is ``Joined(1, (Stacked(0, w1 of every expert), Stacked(0, w3 ...)))``, experts
    in transformers' (natural) order. A key that no transform renames is its own source;
    keys the files lack are absent.

    >>> import torch.nn as nn
    >>> checkpoint_keys(nn.Linear(2, 2), ["weight", "bias"], ["weight", "bias"]).sources
    {'weight': 'weight', 'bias': 'bias'}
    """
    transforms = _conversions(model)
    if not transforms:
        return CheckpointKeys({k: k for k in file_keys})
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    sources: dict[str, Assembly] = {}
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(file_keys, key=dot_natural_key):  # the order from_pretrained collects experts in
        renamed, pattern = rename_source_key(key, renamings, converters)
        if renamed not in model_keys and key in model_keys:
            renamed, pattern = key, None
        if pattern is None:
            sources.setdefault(renamed, key)
        else:
            converter, collected = groups.setdefault(renamed, (by_pattern[pattern], {}))
            collected.setdefault(pattern, []).append(key)
    unsupported: dict[str, str] = {}
    consumed: set[str] = set()
    for target, (converter, collected) in groups.items():
        made = _assemble(converter, collected)
        if isinstance(made, str) and made.startswith("!"):
            unsupported[target] = f"transformers makes it with {made[1:]}"
            consumed.update(k for keys in collected.values() for k in keys)
        else:
            sources[target] = made
    return CheckpointKeys(sources, unsupported, frozenset(consumed), model_type(model) or type(model).__name__,
                          bool(_conversions(model, legacy=False)))


def checkpoint_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (full tensors of ``model``, keyed as the model names them) in the keys
    and layout ``save_pretrained`` writes: transformers' own reverse conversion
    (``revert_weight_conversion``), so fused 3-D experts become one 2-D tensor per expert
    under the checkpoint's names (Mixtral's ``block_sparse_moe.experts.N.w1.weight`` ...).
    ``state`` itself for other modules. Every tensor returned owns its memory (safetensors
    refuses views of one storage).

    >>> import torch, torch.nn as nn
    >>> checkpoint_state(nn.Linear(2, 2), {"weight": torch.zeros(2, 2)})["weight"].shape
    torch.Size([2, 2])
    """
    if not _conversions(model):
        return state
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, dict(state))  # type: ignore[arg-type]
    return {k: v if _owns_storage(v) else v.clone(memory_format=torch.contiguous_format) for k, v in out.items()}


def _owns_storage(t: torch.Tensor) -> bool:
    whole = t.numel() * t.element_size()
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == whole


def train_without_cache(model: nn.Module) -> list[str]:
    """Make each outermost Hugging Face model in ``model`` run the forwards that record
    an autograd graph (gradients enabled) with ``use_cache=False`` unless the caller
    passes ``use_cache`` or a cache (``cache``; ``past_key_values`` before transformers 5.24)
    — what Hugging Face's own gradient checkpointing does. A checkpointed decoder layer
    otherwise appends its keys and values to the model's cache a second time when it is
    recomputed in backward, which a selective checkpoint (``policy=``) rejects ("invocation
    ... not found in storage") and a full one hides in a cache of twice the length.
    Installs a forward pre-hook on ``model`` (build's private copy); returns the paths it
    hooked.

    >>> import torch.nn as nn
    >>> train_without_cache(nn.Linear(2, 2))
    []
    """
    hooked: list[str] = []
    for path, m in walk(model):
        if any(path == h or path.startswith(h + ".") if h else True for h in hooked):
            continue
        if not is_pretrained_model(m) or "use_cache" not in inspect.signature(type(m).forward).parameters:
            continue
        m.register_forward_pre_hook(_no_cache_when_training, with_kwargs=True)
        hooked.append(path)
    return hooked


def _no_cache_when_training(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if not torch.is_grad_enabled():  # recomputation happens in any mode that records a graph
        return None
    if any(kwargs.get(k) is not None for k in ("use_cache", "cache", "past_key_values")):
        return None
    return args, {**kwargs, "use_cache": False}
