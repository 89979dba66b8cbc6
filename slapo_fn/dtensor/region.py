"""DTensor regions: code whose layouts the plan cannot prove runs on DTensor activations.

Between sharded modules, slapo_fn keeps activations as local tensors with a layout the
plan knows (Megatron style: the collectives are the plan's, at module boundaries). Where
the plan cannot prove that code between modules is right on local shards (a split by a
full size, a tied parameter sharded on one side, a column in a chain that no row reads),
that code runs on DTensor activations instead, and PyTorch's own sharding propagation
decides each op's layout and redistributes where it must. A region is entered with the
layouts the plan knows (usually ``Replicate``) and left the same way.

Inside a region:

* every parameter is the DTensor the build made it (no local values swapped in);
* a sharded module runs its role's local forward on the local shards of its input,
  redistributed to what the role takes (:meth:`Role.takes`), and hands on a DTensor of
  what it gives (:meth:`Role.gives`), then converted to the layout a ``fwd_post`` sync or
  a sequence-parallel chain states, as PyTorch's ``ParallelStyle`` does with
  ``use_local_output=False``;
* plain tensors the model makes (masks, rotary tables) count as replicated, and an op
  DTensor cannot shard runs on whole values (:class:`OnDTensors`); CPU attention has the
  rules PyTorch gives CUDA's (:mod:`.rules`);
* a replicated parameter whose gradient DTensor leaves ``Partial`` (a norm on sequence
  shards) has it all-reduced as it is made, so every gradient has its parameter's
  placement and an optimizer step needs no collective.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _MaskPartial, _StridedShard
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import _StopRecomputationError
from torch.utils.weak import WeakIdKeyDictionary

from ..rewrites.checkpoint import CHECKPOINTED
from ..tree import tensor_at
from . import rules  # noqa: F401  (CPU attention's sharding rules, registered on import)
from .collectives import enter_all, even, gather, reduce, settled, unpack, wait
from .roles import Role, local_value, reading, whole_params

__all__ = ["Activations", "BiasShare", "OnDTensors", "OncePerBackward", "placed", "reduce_together", "region",
           "same_tensor"]

#: How many moved activations a region's pass remembers (:meth:`Activations.moved`).
_RECENT = 4


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a is b``, or both whole-tensor aliases (``view_as``) of one base tensor: module
    backward hooks hand each module its own alias of what it is called on."""
    if a is b:
        return True
    base_a = a if a._base is None else a._base
    base_b = b if b._base is None else b._base
    return (
        base_a is base_b
        and a.shape == b.shape == base_a.shape
        and a.stride() == b.stride() == base_a.stride()
        and a.dtype == b.dtype
    )


class BiasShare(torch.autograd.Function):
    """``b / n`` forward: this rank's share of a bias that the reduction after it sums once.
    The gradient passes unscaled: the reduce-scatter's backward all-gathers, so every
    rank's gradient before the reduction is the whole one, and so is the bias gradient
    (``Replicate``, like the bias, with no collective: PyTorch's RowwiseParallel gets the
    same from adding a replicated bias to a Partial output)."""

    @staticmethod
    def forward(b: torch.Tensor, n: int) -> torch.Tensor:  # type: ignore[override]
        return b / n

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def output_slot(value: Any) -> int | str | None:
    """Where in a module's output ``value`` the tensor it stands for sits: ``-1`` for the
    value itself, the index of a tuple's first tensor (Hugging Face layers return
    ``(hidden, weights)``), the key of a mapping's first tensor field other than ``loss``
    (a ``ModelOutput``'s ``logits`` or ``last_hidden_state``; its loss is computed from
    them); ``None`` where it holds none."""
    if isinstance(value, torch.Tensor):
        return -1
    if isinstance(value, tuple | list):
        return next((i for i, v in enumerate(value) if isinstance(v, torch.Tensor)), None)
    if isinstance(value, Mapping):
        return next((k for k, v in value.items() if isinstance(v, torch.Tensor) and k != "loss"), None)
    return None


def map_first_output(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to the tensor at its :func:`output_slot`, in a new object;
    ``value`` itself where it holds none."""
    slot = output_slot(value)
    if slot is None:
        return value
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return type(value)(**{**value, slot: fn(value[slot])})
    assert isinstance(slot, int)
    items = list(value)
    items[slot] = fn(items[slot])
    return type(value)(items) if isinstance(value, list) else tuple(items)


def map_input(
    args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return (*args[:i], fn(a), *args[i + 1 :]), kwargs
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return args, {**kwargs, k: fn(v)}
    return args, kwargs


class Activations:
    """How activations are DTensors in one build: the mesh and mesh-dimension names of the
    parameters (:func:`.plan.param_dims`), placements written per mesh-axis name."""

    def __init__(self, mesh: Any, dims: tuple[str, ...]) -> None:
        self.mesh, self.dims = mesh, dims
        # within one pass of a region (:func:`region`), the activations already moved for a
        # module's input: (the DTensor, where to, the moved one), the latest few
        # (each with its version then: a value changed in place since is not the one moved)
        self.moves: list[tuple[DTensor, int, tuple[Placement, ...], DTensor, int]] | None = None
        # within one pass, the whole values made of split ones (:meth:`note`): per DTensor,
        # the mesh dimensions it is whole on only because the values it was made of, split
        # there, were gathered
        self.gathered: WeakIdKeyDictionary | None = None

    def note(self, operands: Sequence[Any], out: Any) -> None:
        """What one op of the pass made: each whole DTensor in ``out`` is made of split
        values along a mesh dimension where every operand that takes a gradient is split
        there, or is itself such a value. A split of it later in the pass
        (:meth:`moved`) hands its gradient on split: the backward of what made it whole
        takes the gradient split (DTensor's rules for the op, a gather's backward), so
        gathering it first would add a collective. Where some operand is whole for its
        own sake (a replicated parameter, a value no split reached), the gradient is
        gathered once, at the split, rather than by each op it reaches after."""
        noted = self._noted()
        if noted is None:
            return
        grads = [a for a in operands if isinstance(a, torch.Tensor) and a.requires_grad]
        if not grads:
            return
        for t in pytree.tree_leaves(out):
            if not isinstance(t, DTensor):
                continue
            dims = frozenset(j for j, p in enumerate(t.placements) if isinstance(p, Replicate)
                             and all(self._split_at(a, j) for a in grads))
            if dims:
                noted[t] = dims

    def _noted(self) -> WeakIdKeyDictionary | None:
        """The pass's notes (:meth:`note`), ``None`` outside a pass and while a compiler
        traces: a block compiled on its own (torchtitan's way) runs inside a region's pass
        that eager code opened, and its graph must not read or write the eager
        bookkeeping (dynamo cannot trace a weak dictionary); its splits then gather their
        gradients, the same numbers at one more collective."""
        return None if torch.compiler.is_compiling() else self.gathered

    def _split_at(self, x: torch.Tensor, j: int) -> bool:
        assert self.gathered is not None
        return isinstance(x, DTensor) and (isinstance(x.placements[j], Shard) or j in self.gathered.get(x, ()))

    def _move(self, x: DTensor, places: tuple[Placement, ...]) -> DTensor:
        """``x`` redistributed to ``places``; a split of a value made whole of split ones
        (:meth:`note`) hands its gradient on as it comes back, split."""
        noted = self._noted()
        made = noted.get(x, frozenset()) if noted is not None else frozenset()
        changed = [j for j, (a, b) in enumerate(zip(x.placements, places, strict=True)) if a != b]
        if all(isinstance(x.placements[j], Replicate) and isinstance(places[j], Shard) and j in made
               for j in changed):
            done: DTensor = SplitKeepingGrad.apply(x, places)
        else:
            done = x.redistribute(x.device_mesh, places)
        self.note((x,), done)
        return done

    def moved(self, x: DTensor, places: tuple[Placement, ...]) -> DTensor:
        """``x`` redistributed to ``places``, once per pass for one DTensor: the columns
        reading one activation (q, k and v on split hidden states) share the move, so
        autograd sums their gradients before one collective back, as they enter once on
        local shards (:meth:`.runtime._Runtime.enter`), matched the same way
        (:func:`same_tensor`). A move back to where ``x`` was moved from within the pass
        is the value it was moved from: a split stated on whole hidden states and a
        column's gather of them cost nothing forward, and the column's partial gradient
        is reduced once, not reduce-scattered and gathered again. A value changed in place
        since its move is moved again. Outside a pass, or while a compiler traces, moved
        each time, and inside a checkpointed module, whose recomputation must run the ops its
        forward ran."""
        if tuple(x.placements) == places:
            return x
        if self.moves is None or torch.compiler.is_compiling() or CHECKPOINTED.get():
            return x.redistribute(x.device_mesh, places)
        for prev, seen, where, done, made in self.moves:
            if prev._version != seen or done._version != made:
                continue
            if where == places and same_tensor(prev, x):
                return done
            if tuple(prev.placements) == places and same_tensor(done, x):
                return prev  # moved back where it came from: the value it was moved from
        done = self._move(x, places)
        self.moves.append((x, x._version, places, done, done._version))
        del self.moves[:-_RECENT]
        return done

    def placements(self, **by_axis: Placement) -> tuple[Placement, ...]:
        """Placements over the activation mesh, ``Replicate`` on the axes not named."""
        return tuple(by_axis.get(d, Replicate()) for d in self.dims)

    def replicated(self) -> tuple[Placement, ...]:
        return self.placements()

    def to_dtensor(self, x: Any, placements: tuple[Placement, ...] | None = None) -> Any:
        """``x`` as a DTensor: a DTensor is redistributed to ``placements`` (kept as it is
        where none are given), a plain tensor taken as holding them (``Replicate``)."""
        if isinstance(x, DTensor):
            return x if placements is None or tuple(x.placements) == placements else x.redistribute(
                x.device_mesh, placements)
        if not isinstance(x, torch.Tensor):
            return x
        return DTensor.from_local(x, self.mesh, placements or self.replicated(), run_check=False)

    def to_local(self, x: Any, placements: tuple[Placement, ...] | None = None) -> Any:
        """``x`` as a local tensor of ``placements`` (``Replicate`` where none are given)."""
        if not isinstance(x, DTensor):
            return x
        want = placements or self.replicated()
        if tuple(x.placements) != want:
            x = x.redistribute(x.device_mesh, want)
        return x.to_local()

    def locals_of(self, value: Any) -> Any:
        """``value`` with every DTensor in it a whole (replicated) local tensor."""
        return pytree.tree_map(lambda v: self.to_local(v) if isinstance(v, DTensor) else v, value)


def _tree(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` on every tensor in ``value`` (tuples, lists, dicts and Hugging Face's
    ``ModelOutput``, which keeps its type)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping) and hasattr(value, "to_tuple"):  # a ModelOutput: keep its type
        return type(value)(**{k: _tree(fn, v) for k, v in value.items()})
    return pytree.tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, value)


def region(acts: Activations, forward: Callable[..., Any], leaving: Mapping[str, Placement],
           whole_in: bool = False, read: frozenset[int] | None = None,
           stream_in: Mapping[str, Placement] | None = None,
           stream_out: Mapping[str, Placement] | None = None) -> Callable[..., Any]:
    """``forward`` (the root's) run on DTensor activations: the plain tensors it is handed
    count as replicated where an op first meets them with a DTensor (:class:`OnDTensors`),
    and each tensor it returns leaves as a local tensor, whole on every mesh axis but
    those ``leaving`` states a layout for (a sync keeping the model's output split).
    ``whole_in``: the root is handed whole values (a subtree's root, entered from code on
    local shards), and each activation among them enters once, as one replicated DTensor:
    every reader's partial input gradient (q, k and v's) is then summed on it and
    all-reduced once, where each reader entering it alone would reduce its own. The
    model's root is not: a sequence-parallel chain may be told its input arrives split.
    ``read``: where the root returns a tuple, the positions of it that some code reads
    (:func:`.lookups.read_positions`; ``None``: any may be); the others are handed on as
    they are, DTensors, as PyTorch's engine hands on every activation: an attention's
    weights its caller drops cost no collective to make whole. A forward hook that reads
    such a position (Hugging Face's ``output_attentions`` capture) gets the DTensor, its
    values whole (``full_tensor()``); code mixing it with local tensors fails loudly.
    ``stream_in``, ``stream_out``: the root is a member of a sequence-parallel chain,
    handed its first tensor argument, and returning its first tensor, as this rank's share
    of the residual stream, laid out as these state per mesh axis (``None``: whole, where the
    chain's entry splits it or its exit gathers it); every other tensor as ``whole_in`` and
    ``leaving`` say."""

    def placed_as(by_axis: Mapping[str, Placement], t: torch.Tensor) -> tuple[Placement, ...]:
        return acts.placements(**{d: normalized(p, t.dim()) for d, p in by_axis.items()})

    def arriving(t: torch.Tensor) -> torch.Tensor:
        assert stream_in is not None
        if isinstance(t, DTensor):
            return t
        return DTensor.from_local(t, acts.mesh, placed_as(stream_in, t), run_check=False)

    def own(t: torch.Tensor) -> torch.Tensor:
        # DTensor's to_local is a view made inside an autograd Function, which autograd refuses
        # to change in place; model code around a subtree may (Falcon adds the attention's output
        # into the MLP's with +=), so a subtree's results are tensors of their own (one copy)
        return t.clone() if whole_in and t.requires_grad else t

    def leaving_first(t: torch.Tensor) -> torch.Tensor:
        assert stream_out is not None
        return own(acts.to_local(t, placed_as(stream_out, t))) if isinstance(t, DTensor) else t

    def local(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            return t
        places = tuple(p if p == normalized(leaving.get(d, Replicate()), t.dim()) else Replicate()
                       for d, p in zip(acts.dims, t.placements, strict=True))
        return own(acts.to_local(t, places))

    def entered(t: Any) -> Any:
        takes_grad = isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
        return acts.to_dtensor(t) if takes_grad and not isinstance(t, DTensor) else t

    def run(*args: Any, **kwargs: Any) -> Any:
        if stream_in is not None:  # this rank's tokens, with or without a gradient (no_grad evaluation)
            args, kwargs = map_input(args, kwargs, arriving)
        if whole_in:
            args, kwargs = pytree.tree_map(entered, (args, kwargs))
        outer, acts.moves, made = acts.moves, [], acts.gathered
        acts.gathered = None if torch.compiler.is_compiling() else WeakIdKeyDictionary()
        try:
            with OnDTensors(acts):
                out = forward(*args, **kwargs)
        finally:
            acts.moves, acts.gathered = outer, made
        if stream_out is not None:
            out = map_first_output(out, leaving_first)
        if read is not None and type(out) is tuple:
            return settled(tuple(_tree(local, v) if i in read else v for i, v in enumerate(out)))
        return settled(_tree(local, out))

    return run


class OnDTensors(TorchFunctionMode):
    """What a region's code needs of DTensor beyond its own dispatch:

    * a plain tensor meeting a DTensor in an op (a mask, a rotary table, token ids the
      model made) becomes a replicated DTensor first, so that autograd saves DTensors and
      the backward, which runs outside the region, never mixes the two;
    * an op that DTensor cannot shard (a view into sizes the shards do not divide,
      ``(3, heads, head_dim)`` out of a split ``3*width``; an op with no sharding rule) runs
      on the whole values, gathered first (:func:`_on_whole_values`): computed where
      DTensor alone would refuse it.

    Each op's result is noted in ``acts`` (:meth:`Activations.note`), where one is given.
    """

    def __init__(self, acts: Activations | None = None) -> None:
        super().__init__()
        self.acts = acts

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat, spec = pytree.tree_flatten((args, kwargs))
        ref = next((a for a in flat if isinstance(a, DTensor)), None)
        if ref is None:
            return func(*args, **kwargs)
        out = self._run(func, args, kwargs, flat, spec, ref)
        if self.acts is not None:
            self.acts.note(flat, out)
        return out

    def _run(self, func: Any, args: Any, kwargs: Any, flat: list[Any], spec: Any, ref: DTensor) -> Any:
        if any(type(a) is torch.Tensor or (isinstance(a, nn.Parameter) and not isinstance(a, DTensor)) for a in flat):
            mesh = ref.device_mesh
            flat = [DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim, run_check=False)
                    if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in flat]
            args, kwargs = pytree.tree_unflatten(flat, spec)
        try:
            out = func(*args, **kwargs)
        except _StopRecomputationError:  # a checkpoint's recomputation has what it needs: it stops here
            raise
        except Exception:  # no rule for it, or none for its shards: the op itself on whole values
            if any(isinstance(a, DTensor) and is_fake(a._local_tensor) for a in flat):
                raise  # a fake run (explain's count) fails where it cannot follow the real one
            return _on_whole_values(func, args, kwargs)
        # what the op made: a layout one of its operands holds already is handed through as it is
        # (a packed column's weight, detached or made a Parameter by FSDP's unshard in a block's
        # pre-forward hook, which runs inside the region)
        given = {p for a in flat if isinstance(a, DTensor) for p in a.placements}
        made = [p for t in pytree.tree_leaves(out) if isinstance(t, DTensor) for p in t.placements if p not in given]
        if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in made):
            # a mean or max over a split dimension: DTensor cannot take its gradient back from the
            # sums the rest of backward hands it, so it is taken on whole values
            return _on_whole_values(func, args, kwargs)
        if any(isinstance(p, _StridedShard) for p in made):
            # split in strides (a view merging the batch and a split sequence): made whole from its
            # operands, a plain gather, rather than from the result, whose gather DTensor sizes in a
            # way torch.compile cannot follow (the same one collective either way)
            return _on_whole_values(func, args, kwargs)
        return pytree.tree_map(lambda t: _contiguous(_settled(t, given)), out)


def _contiguous(x: Any) -> Any:
    """``x`` with its local tensor contiguous where the DTensor says it is. DTensor takes a
    result's strides from the op's meta kernel, while its local tensor comes from whichever
    kernel ran on the shard: CPU attention's output is laid out as (batch, tokens, heads,
    dim) by the meta kernel and as (batch, heads, tokens, dim) by the math kernel (or its
    fake kernel, under ``torch.compile``), so after a ``transpose`` the wrapper can say
    contiguous where the local is not, and the model's next ``view`` or ``reshape`` (which
    reads the wrapper's strides and views) fails on the local tensor."""
    if not isinstance(x, DTensor) or not x.is_contiguous() or x._local_tensor.is_contiguous():
        return x
    return DTensor.from_local(x.to_local(grad_placements=x.placements).contiguous(), x.device_mesh, x.placements,
                              run_check=False, shape=x.shape, stride=x.stride())


def _settled(x: Any, given: Collection[Placement] = ()) -> Any:
    """A DTensor an op left in a layout the region does not hand on, made whole there,
    unless an operand held it already (``given``: the op made nothing new):

    * split in strides (``_StridedShard``: the batch and a split sequence merged into one
      dimension): DTensor's rules for ops over such a dimension are not all right for it
      (a cumulative sum over the merged rows came out wrong);
    * a partial sum (a matmul over split features): left pending, DTensor carries it into
      the residual stream and every norm after it reduces it again, where one all-reduce
      here makes it whole for all (a role's output is made whole the same way). A norm's
      pending partial (``_NormPartial``) is left to the op that reads it: its gradient
      cannot be taken back from a sum;
    * rows looked up in this rank's share of a vocabulary (``_MaskPartial``: an embedding
      that reads, through a tie, a weight split by rows, as a LLaMA's tied head sharded
      alone leaves its embedding): DTensor keeps their mask on the placement, which every
      value made from them shares and the first reduction spends, so the next one (a
      norm's ``x * rsqrt(var)`` after its ``x.float().pow(2)``) fails. Reduced here, once,
      as PyTorch's ``RowwiseParallel`` reduces its embedding's output; its gradient is
      made whole first (the lookup's backward takes it whole, not as a partial sum).
    """
    if not isinstance(x, DTensor) or not any(_unsettled(p) and p not in given for p in x.placements):
        return x
    places = [Replicate() if _unsettled(p) and p not in given else p for p in x.placements]
    if not any(isinstance(p, _MaskPartial) for p in x.placements):
        return x.redistribute(x.device_mesh, places)
    local = x.redistribute(x.device_mesh, places).to_local(grad_placements=places)
    return DTensor.from_local(local, x.device_mesh, places, run_check=False, shape=x.shape, stride=x.stride())


def _unsettled(p: Placement) -> bool:
    return isinstance(p, _StridedShard | _MaskPartial) or type(p) is Partial


def _on_whole_values(func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` on the whole values of its DTensor arguments, run as the single-process op
    on every rank (its results replicated DTensors): where DTensor has no sharding rule
    for an op or cannot express its result on the shards (a view into sizes the shards do
    not divide; ``torch._grouped_mm`` on CPU), the op is still computed, at the cost of
    gathering its operands. An op that fails on whole values fails as it would unsharded."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    mesh = next(a for a in flat if isinstance(a, DTensor)).device_mesh
    whole = [Replicate()] * mesh.ndim
    local = [a.redistribute(mesh, whole).to_local() if isinstance(a, DTensor) else a for a in flat]
    largs, lkwargs = pytree.tree_unflatten(local, spec)
    out = func(*largs, **lkwargs)
    return pytree.tree_map(lambda t: DTensor.from_local(t, mesh, whole, run_check=False)
                           if isinstance(t, torch.Tensor) else t, out)


def reduce_partial_grads(params: Iterable[torch.Tensor], after_backward: bool = False) -> list[Any]:
    """Hooks on every DTensor parameter among ``params`` (each once) that make its gradient
    take the parameter's placement, so that an optimizer step needs no collective: a
    replicated parameter used on activation shards gets a ``Partial`` or a ``Shard``
    gradient, and a split one may get a whole gradient where DTensor's backward found the
    gradient of its output whole (an embedding split by features whose output was gathered
    for a sum), which is cut to this rank's piece here, locally. Returns the hook handles.

    ``after_backward`` (the mesh holds no axis whose own hooks read gradients during
    backward, FSDP's ``dp``): the gradients stay as they are through backward, and one
    callback at its end all-reduces the ``Partial`` ones together, one collective per
    set of mesh axes and dtype, as Megatron-LM reduces its sequence-parallel norms'
    gradients after backward (:attr:`.planned.Plan.grads_after_backward`): the build
    hands every region's parameters and those of the modules on local shards whose
    gradients are partial sums here at once. Else each one is reduced as it is made."""
    found: dict[int, DTensor] = {id(p): p for p in params if isinstance(p, DTensor) and p.requires_grad}
    chosen = list(found.values())
    if after_backward:
        pending = OncePerBackward(lambda: _to_placements(chosen))
        return [p.register_post_accumulate_grad_hook(pending.queue) for p in chosen]

    return [p.register_hook(lambda g, pl=tuple(p.placements): placed(g, pl)) for p in chosen]


def placed(g: torch.Tensor, placements: Sequence[Placement]) -> torch.Tensor:
    """A gradient ``g`` in ``placements`` (its parameter's): a DTensor elsewhere is
    redistributed (a ``Partial`` one all-reduced, a whole one cut locally); anything else
    is returned as it is."""
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(placements):
        return g.redistribute(g.device_mesh, placements)
    return g


class OncePerBackward:
    """``callback`` run once at the end of each backward in which :meth:`queue` is called
    (a post-accumulate-grad hook on parameters): installed on the parameters, not in any
    forward, so a compiler tracing the blocks sees none of it."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback, self.queued = callback, -1

    def queue(self, _: torch.Tensor) -> None:
        task = int(torch._C._current_graph_task_id())
        if task != self.queued:
            self.queued = task
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.queued = -1
        self.callback()


def reduce_together(items: Sequence[tuple[torch.Tensor, DTensor]], dims: tuple[int, ...]) -> None:
    """Each parameter's gradient (``items``: parameter, its ``Partial`` gradient, one dtype)
    all-reduced over the mesh dimensions ``dims``, flattened together in the order given
    (alike on every rank: one collective per dimension), and made ``Replicate`` there."""
    mesh = items[0][1].device_mesh
    with torch.no_grad():
        flat = torch.cat([g._local_tensor.reshape(-1) for _, g in items])
        for i in dims:
            flat = reduce(flat, (mesh, i))
        # the end of backward: nothing left to overlap, and a gradient never read would
        # leave its all-reduce pending for the life of the process
        flat = wait(flat)
        for (p, g), piece in zip(items, flat.split([g._local_tensor.numel() for _, g in items]), strict=True):
            placements = [Replicate() if j in dims else pl for j, pl in enumerate(g.placements)]
            p.grad = DTensor.from_local(piece.view_as(g._local_tensor), mesh, placements, run_check=False,
                                        shape=g.shape, stride=g.stride())


def _to_placements(params: list[DTensor]) -> None:
    """At the end of a backward, every gradient of ``params`` to its parameter's
    placements: the ``Partial`` ones of whole parameters reduced together per (mesh
    dimensions, dtype) (:func:`reduce_together`), any other difference (a ``Shard``
    gradient of a replicated parameter, a whole one of a split parameter) redistributed
    on its own."""
    groups: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[torch.Tensor, DTensor]]] = {}
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor) or tuple(g.placements) == tuple(p.placements):
            continue
        partial = tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, Partial))
        whole = all(isinstance(pl, Replicate) for pl in p.placements)
        if whole and partial and all(isinstance(pl, Partial | Replicate) for pl in g.placements):
            groups.setdefault((partial, g.dtype), []).append((p, g))
        else:
            with torch.no_grad():
                p.grad = g.redistribute(g.device_mesh, p.placements)
    for (dims, _), items in groups.items():
        reduce_together(items, dims)


def normalized(p: Placement, ndim: int) -> Placement:
    """``p`` with a negative shard dimension counted from the front of ``ndim`` dimensions."""
    return Shard(p.dim % ndim) if isinstance(p, Shard) and not isinstance(p, _StridedShard) else p


class SplitKeepingGrad(torch.autograd.Function):
    """A DTensor split where it was whole (a local slice), its gradient handed back as it
    comes, split: DTensor's own ops, splitting a replicated operand inside their dispatch,
    hand its gradient back so too. (``redistribute``'s backward would gather it.)"""

    @staticmethod
    def forward(x: DTensor, places: tuple[Placement, ...]) -> DTensor:  # type: ignore[override]
        return x.redistribute(x.device_mesh, places)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def relayout(acts: Activations, x: torch.Tensor, axis: str, layout: Placement) -> DTensor:
    """A DTensor activation moved to ``layout`` over mesh axis ``axis`` (the other axes kept),
    by :meth:`Activations.moved`. A split the axis does not divide is refused, as on local
    shards (:func:`.collectives.even`): DTensor would shard it unevenly, and its backward
    then issued collectives that differ between the ranks (a hang, then a timeout)."""
    dt: DTensor = acts.to_dtensor(x)
    places = list(dt.placements)
    i = acts.dims.index(axis)
    places[i] = to = normalized(layout, dt.dim())
    if type(to) is Shard and to != dt.placements[i]:
        even(dt, to.dim, (acts.mesh, i), "tensor parallel forward on DTensors")
    return acts.moved(dt, tuple(places))


def role_on_dtensors(acts: Activations, m: nn.Module, role: Role, out: Placement | None) -> Callable[..., Any]:
    """A sharded module's forward inside a region, as PyTorch's parallel styles run with
    ``use_local_output=False``: its input moved to what its role takes and made local
    (the layout of its local gradient declared), the role's local forward on the shards,
    the result a DTensor of what the role gives, moved to ``out`` where that is stated (a
    ``fwd_post`` sync, a sequence-parallel chain's shard). A partial sum is never handed
    on (made whole, then the bias the role left out is added), and a packed column's
    output is put back whole in its module's own order (DTensor's ops would take its
    strided shards for plain ones)."""
    axis = role.mesh_axis
    i = acts.dims.index(axis)
    rank, size = acts.mesh.get_local_rank(i), acts.mesh.size(i)

    def forward(x: torch.Tensor) -> Any:
        dt: DTensor = acts.to_dtensor(x)
        takes = role.takes(dt.dim())
        if takes is None:  # token ids: whole on every rank, with no gradient
            local, base = acts.to_local(dt), list(acts.replicated())
        else:
            dt = relayout(acts, dt, axis, takes)
            base = list(dt.placements)
            grad = [*base[:i], role.input_grad(dt.dim()), *base[i + 1:]]
            local = dt.to_local(grad_placements=grad)
        # the parameters it reads whole (a LoRA's A in a column): their gradients all-reduced
        whole: list[DTensor] = [getattr(m, n) for n in whole_params(m, role)]
        reduced = enter_all([p.to_local() for p in whole], (acts.mesh, i)) if whole else ()
        y = role.local_forward(m, local, rank, reading(list(zip(whole, reduced, strict=True)), local_value))
        gives = role.gives(y.dim())
        if isinstance(gives, _StridedShard):
            y, gives = unpack(gather(y, -1, (acts.mesh, i)), role.packed, size), Replicate()
        places = [Replicate() if isinstance(p, Shard) and p.dim >= y.dim() else p for p in base]
        places[i] = gives
        to = Replicate() if out is None and isinstance(gives, Partial) else out
        bias = role.bias_after(m)
        if bias is not None and isinstance(gives, Partial) and isinstance(to, Shard):
            # each rank adds its share before the reduce-scatter, which adds the bias once; its
            # gradient is then whole on every rank, as PyTorch's RowwiseParallel gets it
            y, bias = role.add_bias(y, BiasShare.apply(acts.to_local(bias), size)), None
        result: torch.Tensor = DTensor.from_local(y, acts.mesh, places, run_check=False)
        if to is not None:
            result = relayout(acts, result, axis, to)
        return result if bias is None else role.add_bias(result, bias)

    return forward


def island(acts: Activations, m: nn.Module, forward: Callable[..., Any],
           apart: Collection[str] = ()) -> Callable[..., Any]:
    """The forward of a module inside a region that holds no sharded parameter: where every
    DTensor it is handed is replicated, it runs as the single-process module on the local
    values (its parameters' local values swapped in), and its results are replicated
    DTensors, as DTensor itself would compute them but with no op dispatched through it
    (a router's ``torch._grouped_mm``, which DTensor cannot propagate on CPU, runs too);
    handed a split or partial value, it runs on DTensors. The submodules ``apart`` (paths
    relative to ``m``: checkpointed ones, recomputed in backward outside this forward) are
    islands of their own, and swap their own values in."""
    params = {n: p for n, p in m.named_parameters() if isinstance(p, DTensor)
              and not any(n.startswith(q + ".") for q in apart)}
    if any(not all(isinstance(pl, Replicate) for pl in p.placements) for p in params.values()):
        return forward  # a sharded parameter (one side of a tie): DTensor computes with it

    def run(*args: Any, **kwargs: Any) -> Any:
        flat = pytree.tree_leaves((args, kwargs))
        if not all(not isinstance(a, DTensor) or all(isinstance(p, Replicate) for p in a.placements) for a in flat):
            return forward(*args, **kwargs)
        args, kwargs = pytree.tree_map(lambda a: a.to_local() if isinstance(a, DTensor) else a, (args, kwargs))
        values = {n: _parameter(m, n).to_local() for n in params}
        with _reparametrize_module(m, values):  # type: ignore[arg-type]
            out = forward(*args, **kwargs)
        return _tree(acts.to_dtensor, out)

    return run


def _parameter(m: nn.Module, name: str) -> DTensor:
    """``m``'s parameter ``name`` as it is now (an FSDP2 block swaps its own in its forward;
    ``torch.func.functional_call`` puts a plain tensor there, not an ``nn.Parameter``, so it
    is read as an attribute)."""
    p = tensor_at(m, name)
    assert isinstance(p, DTensor)
    return p
