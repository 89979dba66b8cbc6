"""``sequence_parallel``: run a chain of modules on sequence shards (Megatron SP).

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
    >>> sch = sf.sequence_parallel(sf.create_schedule(model, mesh=fake_mesh(2)), "0")
    >>> sch["0"].annotations["sequence_parallel"]
    SeqSpec(mesh_axis='tp', seq_axis=1, sharded_input=False)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..combinators import primitive
from ..errors import LayoutError, Problem
from ..rewrites._common import contains
from ..schedule import Key, Schedule
from ..select import Selection
from .shard import _problem_mesh, _problem_uncalled

__all__ = ["SEQ", "SeqSpec", "sequence_parallel"]

SEQ: Key[SeqSpec] = Key("sequence_parallel")


@dataclass(frozen=True)
class SeqSpec:
    mesh_axis: str
    seq_axis: int
    #: The chain's input arrives already split along ``seq_axis`` (PyTorch's
    #: ``input_layouts=Shard(1)``): the chain does not split it again.
    sharded_input: bool = False

    def __str__(self) -> str:
        given = ", input sharded" if self.sharded_input else ""
        return f"seq@{self.mesh_axis}(axis {self.seq_axis}{given})"


@primitive
def sequence_parallel(
    sch: Schedule,
    where: Selection,
    *,
    mesh_axis: str = "tp",
    seq_axis: int = 1,
    input_layout: Placement | None = None,
) -> Schedule:
    """Run the selected modules on sequence shards over ``mesh_axis``.

    The selected modules (in tree order) form a chain — each one's output feeds the
    next (decoder layers, then the final norm): the first one's input is split along
    ``seq_axis`` (no communication; all-gather backward), the last one's output is
    all-gathered. Inside, column-parallel modules all-gather their input along the
    sequence (reduce-scatter backward) and row-parallel / vocab-parallel ones
    reduce-scatter their output (all-gather backward): all-gathers and reduce-scatters
    only. Other parameters inside (norm weights) stay replicated; each rank sees only its
    own tokens, so their gradients are all-reduced in backward (``Replicate``, like the
    parameters: an optimizer step needs no collective).

    A module inside a member whose code reads every token (a mixture-of-experts block's
    router, a cumulative sum over the sequence) can run on the whole sequence, as
    PyTorch's ``PrepareModuleInputOutput`` does it: a ``fwd_pre`` sync gathers its input
    and a ``fwd_post`` sync splits its output back (one all-gather forward, one backward).
    It then runs replicated, and its parameters' gradients are whole on every rank::

        sch = sf.sync(sch, "model.layers.*.mlp", "fwd_pre", Replicate(), src=Shard(1))
        sch = sf.sync(sch, "model.layers.*.mlp", "fwd_post", Shard(1), src=Replicate())

    ``input_layout=Shard(seq_axis)`` states that what enters the chain is already split
    along the sequence (as PyTorch's ``input_layouts``): a vocab-parallel embedding whose
    output is reduce-scattered (``sf.sync(sch, "embed", "fwd_post", Shard(1))``), or a
    batch sharded on ``seq_axis=0``. The default, ``Replicate()``, splits it.
    Returns a new schedule; the input is unchanged.

    >>> import torch.nn as nn, slapo_fn as sf
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8))
    >>> sch = sf.shard(sf.shard(sf.create_schedule(model, mesh=fake_mesh(2)), "1", axis=0), "2", axis=1)
    >>> sf.dtensor.plan(sf.sequence_parallel(sch, ["0", "1", "2"])).counts()["forward"]
    {'all_gather': 2, 'reduce_scatter': 1}
    """
    paths = where.modules(sch.module)
    problems = [p for p in (_problem_mesh(sch, path, mesh_axis) for path in paths) if p is not None]
    problems += [p for p in (_problem_uncalled(sch, path) for path in paths) if p is not None]
    existing = set(sch.annotations.of_kind(SEQ))
    for path in paths:
        for other in existing | set(paths):
            if contains(other, path):
                problems.append(
                    Problem(
                        path, f"is inside sequence-parallel module {other!r}", f"select either {other!r} or {path!r}"
                    )
                )
                break
    sharded = isinstance(input_layout, Shard) and input_layout.dim == seq_axis
    if input_layout is not None and not isinstance(input_layout, Replicate) and not sharded:
        problems += [Problem(path, f"input_layout {input_layout!r} is neither Replicate() nor Shard({seq_axis})",
                             f"pass input_layout=Shard({seq_axis}) for an input already split along the sequence")
                     for path in paths[:1]]
    if problems:
        raise LayoutError("sequence_parallel", problems)
    for path in paths:
        sch = sch.annotate_path(path, SEQ, SeqSpec(mesh_axis, seq_axis, sharded))
    return sch
