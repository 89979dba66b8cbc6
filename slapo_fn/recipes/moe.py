"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): attention (and a shared
expert) Megatron-parallel over ``tp``, the routed experts spread over ``ep`` by
all-to-all (:func:`~slapo_fn.expert_parallel`) and, with ``tp > 1``, each expert split over
``tp`` as Hugging Face's own plan does (:func:`~slapo_fn.expert_tensor_parallel`).

The knobs are every recipe's (:class:`~slapo_fn.recipes.Knobs`) plus ``ep`` (the expert-
parallel degree, over the mesh axis ``"ep"``) and ``expert_tp`` (split each expert over
``tp``; default on when ``tp > 1``). The router and its auxiliary loss are the model's own.
With ``sequence_parallel``, the decoder layers and the final norm run on sequence shards,
and each experts' block on the whole sequence: its input is gathered and its output split
back, so the router reads every token, as without it.

Example:
    >>> import slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> cfg = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=4)
    >>> model = MixtralForCausalLM(cfg)
    >>> sch = sf.recipes.for_model(model)(sf.create_schedule(model, mesh=fake_mesh(2, 2, names=("ep", "tp"))),
    ...                                   tp=2, ep=2)
    >>> print(sch["model.layers.0.mlp.experts"].annotations["experts"])
    experts@ep×tp(4)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from ..dtensor.experts import expert_parallel, expert_tensor_parallel
from ..errors import LayoutError, Problem
from ..kernels import RMSNorm
from ..schedule import Schedule
from ._recipe import Knobs, Recipe, Shard, Stack

__all__ = ["MIXTRAL", "QWEN2_MOE", "QWEN3_MOE", "MoeRecipe"]

COLUMN, ROW = Shard(0), Shard(1)


@dataclass(frozen=True)
class MoeRecipe(Recipe):
    """A :class:`Recipe` whose blocks ``experts`` (a selector of mixture-of-experts blocks)
    take the extra knobs ``ep`` and ``expert_tp``."""

    experts: str = "**.layers.*.mlp"

    def __call__(  # type: ignore[override]
        self,
        sch: Schedule,
        knobs: Knobs | None = None,
        *,
        ep: int = 1,
        expert_tp: bool | None = None,
        **overrides: object,
    ) -> Schedule:
        """Schedule ``sch``: the family's recipe with ``knobs``, then the experts spread over
        ``"ep"`` (``ep > 1``) and split over ``"tp"`` (``expert_tp``, default ``tp > 1``).
        Returns a new schedule; the input is unchanged."""
        problems = []
        names = tuple(getattr(sch.mesh, "mesh_dim_names", None) or ())
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            problems.append(Problem("ep", f"is {ep!r}; the expert-parallel degree is an int, at least 1",
                                    "ep=1 is off; ep=2 spreads the experts over 2 ranks"))
        elif ep > 1 and ("ep" not in names or sch.mesh is None or sch.mesh.size(names.index("ep")) != ep):
            problems.append(Problem("", f"ep={ep} needs a mesh with an 'ep' axis of size {ep}; the schedule's mesh "
                                        f"is {names or 'missing'}",
                                    'sf.create_schedule(model, mesh=init_device_mesh("cpu", (ep, tp), '
                                    'mesh_dim_names=("ep", "tp")))'))
        if problems:
            raise LayoutError(f"recipes.{self.name}", problems)
        sch = super().__call__(sch, knobs, **overrides)  # validates the common knobs (tp an int ≥ 1)
        tp = int(overrides.get("tp", knobs.tp if knobs is not None else 1))  # type: ignore[call-overload]
        if ep > 1:
            sch = expert_parallel(sch, self.experts, mesh_axis="ep")
        if tp > 1 and (expert_tp if expert_tp is not None else True):
            sch = expert_tensor_parallel(sch, self.experts, mesh_axis="tp")
        return sch


_ATTENTION = {
    "self_attn.q_proj": COLUMN,
    "self_attn.k_proj": COLUMN,
    "self_attn.v_proj": COLUMN,
    "self_attn.o_proj": ROW,
}

_NORMS = MappingProxyType({
    "**.layers.*.{input,post_attention}_layernorm": RMSNorm.from_hf,
    "**.norm": RMSNorm.from_hf,
})

MIXTRAL = MoeRecipe(
    name="mixtral",
    model_types=("mixtral",),
    # with sequence parallelism the experts' block runs on the whole sequence: its router
    # reads every token (the input is gathered, the output split back, as torchtitan does)
    stacks=(Stack("**.layers.*", MappingProxyType(dict(_ATTENTION)), whole=("mlp",)),),
    sp=("**.layers.*", "**.norm"),
    kernels=_NORMS,
)

#: Qwen2-MoE adds a shared expert (a gated MLP) beside the routed ones: Megatron over tp.
QWEN2_MOE = replace(
    MIXTRAL,
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    stacks=(Stack("**.layers.*", MappingProxyType({
        **_ATTENTION,
        "mlp.shared_expert.gate_proj": COLUMN,
        "mlp.shared_expert.up_proj": COLUMN,
        "mlp.shared_expert.down_proj": ROW,
    }), whole=("mlp",)),),
)

#: Qwen3-MoE: no shared expert; q and k normalised per head after the projections.
QWEN3_MOE = replace(
    MIXTRAL,
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    stacks=(Stack("**.layers.*", MappingProxyType(dict(_ATTENTION)), local=("self_attn.{q_norm,k_norm}",),
                  whole=("mlp",)),),
)
