"""The values of a boundary plan: :class:`Plan`, each module's :class:`ModulePlan` and the
:class:`Boundary` where layouts meet, with how placements and module paths are written in
them and in the problems the checks raise.

One reason to change: what a plan records (what ``explain`` prints, the runtime installs
and ``build(strict=True)`` checks). :func:`~.plan.plan` makes these values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..errors import Problem
from .experts import Experts
from .rng import RngSpec
from .roles import Role
from .sequence import SeqSpec
from .sync import SyncSpec

__all__ = ["Boundary", "ModulePlan", "Plan"]


@dataclass(frozen=True)
class Boundary:
    """One module boundary where layouts meet: ``src``→``dst`` over ``mesh_axis``, the
    collectives it costs in one forward and one backward, and whether the user asked
    for it (``explicit``: stated by ``shard``'s own contract or by ``sync``)."""

    path: str
    side: str
    src: str
    dst: str
    mesh_axis: str
    forward: tuple[str, ...] = ()
    backward: tuple[str, ...] = ()
    explicit: bool = True
    tensor: str = "input"  # which tensor's full size the collective moves: input, output, param:<name>[,<name>...]

    def __str__(self) -> str:
        flag = "" if self.explicit else "  (implicit)"
        return (
            f"{self.path or '<root>'} {self.side}: {self.src}→{self.dst}@{self.mesh_axis}  "
            f"fwd: {', '.join(self.forward) or '-'}  bwd: {', '.join(self.backward) or '-'}{flag}"
        )


@dataclass(frozen=True)
class ModulePlan:
    """What the tensor-parallel build phase installs on one module."""

    path: str
    role: Role | None = None
    seq: SeqSpec | None = None
    partnered: bool = False
    entry: SeqSpec | None = None
    exit: SeqSpec | None = None
    syncs: tuple[SyncSpec, ...] = ()
    rng: RngSpec | None = None
    local_params: bool = False  # SP region / tp_local: replicated params with Partial gradients
    local_axis: str = ""  # tp_local: the mesh axis of those Partial gradients
    experts: Experts | None = None  # expert_parallel: this experts module runs its pairs by all-to-all
    partners: tuple[str, ...] = ()  # a column kept local: the rows it feeds; a row: the columns feeding it
    #: a column: columns of one group handed one tensor enter the region once; a row: rows of
    #: one group handed one whole tensor split it once
    entry_group: str = ""
    #: a row: the plan takes its input as this rank's features (from its partners, a sync, or as
    #: stated), so it counts no split of its own; a whole-width input then contradicts the plan
    split_input: bool = False
    #: a row that splits its whole input locally, made by its columns' own gathers through
    #: elementwise code alone (:func:`.pairs._gathered_through_elementwise`): its split's
    #: backward puts this rank's gradient among zeros, with no gather of it
    pads_split: bool = False
    #: an output that reaches its parent's code as this rank's features, where that code was
    #: read with the output taken as (batch, sequence, features): the first such op, as text.
    #: The runtime refuses an output of another rank (a 2-D ``(batch, features)``), for which
    #: the reading (``softmax(1)`` over the sequence) would be wrong.
    read_as_3d: str = ""
    #: a column inside a sequence-parallel chain whose parent gathers the sequence for more
    #: than its columns (:func:`.chains._shared_gathers`): the gather's gradient is this rank's slice of
    #: a whole one, and the column enters the region itself (an all-reduce of its gradient)
    shared_gather: bool = False
    #: a column inside a sequence-parallel chain, under a parent that gathers the sequence,
    #: whose input is the parent's other argument (a cross-attention's k/v on the encoder
    #: states, whole on every rank), not the gathered one: it enters the region itself (an
    #: all-reduce of its input gradient)
    side_input: bool = False
    #: a column whose caller enters the tensor-parallel region for it: the caller's first
    #: argument reaches its columns over the axis alone (q/k/v on an attention's hidden
    #: states), so the caller's forward enters it once (one all-reduce of its gradient, as
    #: autograd sums the columns' partial ones first), decided here, not matched at run time
    entered: bool = False
    #: a sequence-parallel chain's exit read by columns alone (:func:`.plan._exit_columns`):
    #: those columns; its all-gather enters the region for them, and its backward
    #: reduce-scatters their partial input gradients, summed by autograd
    exit_columns: tuple[str, ...] = ()
    #: a column entered by such an exit: the exit's path (it enters no region of its own)
    entered_at: str = ""

    @property
    def enters(self) -> bool:
        """Whether its role takes whole activations and splits its output's features (a
        column): it enters the tensor-parallel region, whose gradient is all-reduced."""
        return self.role is not None and not self.role.own_forward and isinstance(self.role.takes(3), Replicate)

    @property
    def posts(self) -> tuple[SyncSpec, ...]:
        """The ``fwd_post`` syncs converted after the module's forward, in the order stated:
        all of them, but for a sharded module's first, which its own output boundary
        converts (from its role's output: a row's ``Partial()``, a column's ``Shard(-1)``);
        each later one converts from the layout the one before it made."""
        posts = tuple(s for s in self.syncs if s.mode == "fwd_post")
        return posts[1:] if self.role is not None and not self.role.own_forward else posts

    @property
    def keeps_features(self) -> bool:
        """A column paired with rows whose output stays this rank's features for them: no
        ``fwd_post`` sync of its own gathers it (:func:`_gathers_output`). Its parent's code
        then runs on this rank's heads, and build makes the parent's head counts local."""
        role = self.role
        return (self.partnered and role is not None and role.splits_output
                and not _gathers_output(self.syncs, role.mesh_axis))


def _gathers_output(specs: Iterable[SyncSpec], axis: str) -> bool:
    """Whether a ``fwd_post`` sync among ``specs`` moves an output split by features over
    ``axis`` off that split (to ``Replicate()`` or a sequence shard)."""
    return any(s.mode == "fwd_post" and s.mesh_axis == axis and not _last_dim(s.layout) for s in specs)


@dataclass(frozen=True)
class Plan:
    modules: Mapping[str, ModulePlan]
    boundaries: tuple[Boundary, ...] = field(default=())
    #: the replicated parameters that run on activation shards (sequence-parallel norms,
    #: ``tp_local`` modules) keep ``Partial`` gradients through backward, and one callback
    #: at its end all-reduces them together, one collective per mesh axis and dtype (as
    #: Megatron-LM reduces its sequence-parallel norms' gradients after backward). Where the
    #: mesh has axes the parameters do not live on (FSDP's ``dp``, ``pp``), whose own hooks
    #: read the gradients during backward, each module's are reduced where they are made.
    grads_after_backward: bool = False
    #: Why the plan cannot prove the model right on local shards (:func:`.checks.unproven`): where
    #: any, the build runs the smallest subtrees holding them (:mod:`.regions`; the whole model
    #: where none fits) on DTensor activations (:mod:`.region`), whose
    #: collectives are DTensor's own (:mod:`.dryrun` counts them on example inputs), not
    #: :attr:`boundaries`.
    on_dtensors: tuple[Problem, ...] = ()

    def counts(self) -> dict[str, dict[str, int]]:
        """``{"forward": {op: n}, "backward": {op: n}}`` for one step (each module called once)."""
        out: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
        for b in self.boundaries:
            for op in b.forward:
                out["forward"][op] = out["forward"].get(op, 0) + 1
            for op in b.backward:
                out["backward"][op] = out["backward"].get(op, 0) + 1
        return out


def _named(path: str) -> str:
    """A module's path as a message names it: quoted, or "the root"."""
    return repr(path) if path else "the root"


def _last_dim(p: Placement | None) -> bool:
    return isinstance(p, Shard) and p.dim == -1


def _d(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    return "P" if isinstance(p, Partial) else "R"


def _code(p: Placement) -> str:
    """A placement as it is written: ``Shard(-1)``, ``Replicate()``, ``Partial()``."""
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    return "Partial()" if isinstance(p, Partial) else "Replicate()"
