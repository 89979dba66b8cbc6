"""Pipeline parallelism: stage cuts on unmodified models, stage derivation, and a runner
over ``torch.distributed.pipelining``.

* :func:`cut_pipeline_stage` — a primitive: a stage boundary after a layer of a sequence
  (of an encoder or a decoder too, or between calls of a shared layer: :mod:`.chain`);
* :func:`split_stages` — the stages of a schedule, each a pure structural rewrite of its
  tree and a schedule of its own (:class:`Stage`);
* :func:`build_pipeline` — this rank's built stage(s) and a :class:`Pipeline` runner
  (``gpipe``, ``1f1b``, ``interleaved``, ``looped-bfs``, ``zero-bubble``, ``zbv``);
* :func:`stage_table` — the per-stage layers, parameters and bytes (``explain`` shows it).

Example:
    >>> import slapo_fn as sf
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    ...                   num_attention_heads=2, num_key_value_heads=2)
    >>> sch = sf.cut_pipeline_stage(sf.create_schedule(LlamaForCausalLM(cfg)), "model.layers.[0,2]")
    >>> [s.layers for s in sf.pipelines.split_stages(sch)]
    [('0',), ('1', '2'), ('3',)]
"""

from .cut import StageCut, cut_pipeline_stage
from .explain import StageRow, StageTable, stage_table
from .families import FAMILIES, Family
from .runner import (
    SCHEDULES,
    Pipeline,
    ScheduleName,
    TiedGroup,
    build_pipeline,
    build_stages,
    schedule_problem,
    stage_ranks,
)
from .split import Stage, roles, split_stages

__all__ = [
    "FAMILIES",
    "SCHEDULES",
    "Family",
    "Pipeline",
    "ScheduleName",
    "Stage",
    "StageCut",
    "StageRow",
    "StageTable",
    "TiedGroup",
    "build_pipeline",
    "build_stages",
    "cut_pipeline_stage",
    "roles",
    "schedule_problem",
    "split_stages",
    "stage_ranks",
    "stage_table",
]
