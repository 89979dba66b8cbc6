"""Pipeline stages of a model with several layer sequences (an encoder and a decoder): every
stage runs the model's own forward on the batch, and the values crossing a stage boundary
are the outputs of the layers that later stages read but earlier stages ran.

The *chain* is the model's top-level layer sequences (``ModuleList``/``Sequential`` of
several layers, not inside another one) in the order its forward calls them — T5's
``encoder.block`` then ``decoder.block``, Bart's ``model.encoder.layers`` then
``model.decoder.layers``. Its layers, in that order, are cut into contiguous stages.

Stage ``s`` is the model's tree with, in every sequence of the chain,

* its own layers, under their original keys;
* a :class:`Replay` at the key of the sequence's last layer that an earlier stage ran:
  it returns that layer's output as the earlier stage computed it (received) — the hidden
  states, and whatever else the layer returns that the next layer reads: T5's position
  biases, its decoder's cross-attention bias;
* no other layer (the model's loop runs the stage's layers only).

So a stage's inputs are the outputs of the last layer of each sequence that earlier stages
ran: the encoder's last layer output (the stage that holds it hands it on to every decoder
stage, the encoder's final norm recomputed from it where read) and the decoder's current
hidden states and biases. Everything else a layer reads — the attention masks, the encoder
attention mask — is recomputed from the batch, which every stage receives as keywords.

The modules beside the sequences are placed by where the forward calls them (found by
one probe forward on a small batch): a module called among a stage's layers is that
stage's; one called before a replayed layer of its sequence (an embedding of the encoder,
in a decoder stage) has its output replaced by the replay, so an embedding table there is
a :class:`Placeholder` (zeros of its output's shape, no parameters) and anything else is
recomputed; one called after (the encoder's final norm) is recomputed in every stage that
reads it, its parameters held by each and their gradients summed (as tied parameters
are); one only later stages call is a :class:`~.families.NotInStage`. A stage before the
last stops its forward after its own last layer.

Recomputing differs from the model in one way: a dropout among the recomputed modules (T5's
after the encoder's final norm) draws its own mask in each stage that recomputes it, where
the model draws one for all its decoder layers; with dropout off the stages are exact.

The probe also records what each sequence's layers return (a tensor, or a tuple of
tensors and ``None``s) and refuses a layer called more than once per forward. The chain
is checked for parity when the cut is made: the stages chained in one process must give
the model's output (:func:`chain_parity_error`).

Example:
    >>> import torch, transformers as t
    >>> cfg = t.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
    ...                  decoder_start_token_id=0, dropout_rate=0.0)
    >>> chain = find_chain(t.T5ForConditionalGeneration(cfg))
    >>> chain.sequences, chain.layouts
    (('encoder.block', 'decoder.block'), ((True, True, False), (True, True, True)))
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch import nn

from ..errors import Problem, ScheduleError
from ..hf import TOKEN_ID_ARGS, config_of, config_value, position_limit
from ..tree import child_names, get_module, join, shallow_clone, split, walk
from .families import PARITY_TOLERANCE, NotInStage, output_tensor, small_twin

__all__ = [
    "Chain",
    "ChainRun",
    "Layout",
    "Placeholder",
    "Replay",
    "StopStage",
    "chain_parity_error",
    "chain_stage_tree",
    "find_chain",
    "layer_sequences",
    "resolve_chain",
    "stage_bounds",
]

#: What a layer returns: ``None`` for one tensor, else a tuple with ``True`` where an
#: element is a tensor and ``False`` where it is ``None``.
Layout: TypeAlias = tuple[bool, ...] | None


def _is_sequence(module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleList | nn.Sequential) and all(k.isdigit() for k in module._modules)


def layer_sequences(root: nn.Module, least: int = 2) -> tuple[str, ...]:
    """The paths of ``root``'s layer sequences of at least ``least`` layers that are not
    inside another one, in registration order (a T5 block's ``layer`` list is inside
    ``block``).

    >>> import torch.nn as nn
    >>> m = nn.Module(); m.a = nn.ModuleList(nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(2))
    >>> layer_sequences(m)
    ('a',)
    """
    out: list[str] = []
    for path, module in walk(root):
        if _is_sequence(module) and len(module._modules) >= least and not any(path.startswith(p + ".") for p in out):
            out.append(path)
    return tuple(out)


@dataclass(frozen=True)
class Chain:
    """The layer sequences a stage split runs through, in call order, with what their
    layers return (``layouts``); ``order`` is the layer of every layer call, in call order
    (a layer the forward calls several times, as ALBERT's shared one, once per call), and
    ``routed`` the sequences holding such a layer (kept whole in their stages, each call
    run or replayed); ``calls`` gives, for each module beside the sequences, the positions
    of its calls (``(path, slots)``, a slot being the number of layer calls before it)."""

    sequences: tuple[str, ...]
    layouts: tuple[Layout, ...]
    calls: tuple[tuple[str, tuple[int, ...]], ...]
    order: tuple[str, ...] = ()
    routed: tuple[str, ...] = ()

    def layout(self, sequence: str) -> Layout:
        return self.layouts[self.sequences.index(sequence)]

    def index(self, layer: str, call: int = 0) -> int:
        """The position in :attr:`order` of call ``call`` (0-based) of ``layer``; a
        ``ValueError`` where the forward calls it fewer times."""
        seen = -1
        for i, path in enumerate(self.order):
            if path == layer:
                seen += 1
                if seen == call:
                    return i
        raise ValueError(f"{layer!r} is called {seen + 1} times, not {call + 1}")

    def count(self, layer: str) -> int:
        """How many times the forward calls ``layer``."""
        return self.order.count(layer)


class StopStage(Exception):
    """Raised after a stage's last layer: the rest of the forward belongs to later stages."""


def _flat(value: Any, layout: Layout, where: str) -> tuple[torch.Tensor, ...]:
    if layout is None:
        if isinstance(value, torch.Tensor):
            return (value,)
    elif isinstance(value, tuple | list) and len(value) == len(layout) and all(
            isinstance(v, torch.Tensor) if flag else v is None for v, flag in zip(value, layout, strict=True)):
        return tuple(v for v, flag in zip(value, layout, strict=True) if flag)
    raise RuntimeError(f"slapo_fn pipeline: {where!r} returned {_describe(value)}, but the probe forward at the cut "
                       f"found {_describe_layout(layout)}: cut again with the same forward arguments")


def _describe(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _describe_layout(layout: Layout) -> str:
    return "Tensor" if layout is None else f"({', '.join('Tensor' if f else 'NoneType' for f in layout)})"


def _rebuild(values: tuple[torch.Tensor, ...], layout: Layout) -> Any:
    if layout is None:
        return values[0]
    it = iter(values)
    return tuple(next(it) if flag else None for flag in layout)


def _width(layout: Layout) -> int:
    return 1 if layout is None else sum(layout)


class Replay(nn.Module):
    """Stands in for the last layer of a sequence that an earlier stage ran: returns that
    layer's output as received from it (set by :class:`ChainRun` before each forward)."""

    def __init__(self, path: str, layout: Layout) -> None:
        super().__init__()
        self.path = path
        self.layout = layout
        self.received: tuple[torch.Tensor, ...] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.received is None:
            raise RuntimeError(f"slapo_fn pipeline: the replay of {self.path!r} was called without its received output")
        return _rebuild(self.received, self.layout)

    def extra_repr(self) -> str:
        return f"{self.path!r} ran in an earlier stage"


class Placeholder(nn.Module):
    """Stands in for an embedding table whose output an earlier stage used and this one
    replaces by a replay: zeros of the embedding's output shape (a broadcast scalar, no
    memory), in the table's dtype and device (a buffer of no elements follows them)."""

    like: torch.Tensor

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.width = embedding.embedding_dim
        self.register_buffer("like", torch.empty(0, dtype=embedding.weight.dtype, device=embedding.weight.device),
                             persistent=False)

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros((), dtype=self.like.dtype, device=ids.device).expand(*ids.shape, self.width)

    def extra_repr(self) -> str:
        return f"zeros of width {self.width}"


# -- the probe ------------------------------------------------------------------------------
def _takes(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def probe_inputs(root: nn.Module) -> dict[str, Any]:
    """Keyword inputs of a small batch for ``root``'s forward: token ids (2 × ≤6) for each
    of :data:`~slapo_fn.hf.TOKEN_ID_ARGS` it takes, and ``use_cache=False`` where it takes it."""
    config = config_of(root)
    vocab = int(config_value(config, "vocab_size", default=2))
    length = max(2, min(6, position_limit(config)))
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {name: ids for name in TOKEN_ID_ARGS if _takes(root, name)}
    if _takes(root, "use_cache"):
        out["use_cache"] = False
    return out


def _ancestors(sequences: Sequence[str]) -> set[str]:
    return {join(*split(seq)[:depth]) for seq in sequences for depth in range(len(split(seq)))}


def beside(root: nn.Module, sequences: Sequence[str]) -> tuple[str, ...]:
    """The paths of the modules beside the sequences: children of their ancestors that are
    neither an ancestor nor a sequence."""
    ancestors = _ancestors(sequences)
    return tuple(
        join(parent, name)
        for parent in sorted(ancestors, key=lambda p: (len(split(p)), p))
        for name in child_names(get_module(root, parent))
        if join(parent, name) not in ancestors and join(parent, name) not in sequences
    )


@dataclass
class _Probe:
    """What one probe forward saw: the sequences in the order of their first call, the
    layer of every layer call in order, each layer's number of calls, what each sequence's
    layers return, the slots of the calls of the modules beside them."""

    slot: int = 0
    stack: list[str] = field(default_factory=list)
    sequences: list[str] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    calls: dict[str, list[int]] = field(default_factory=dict)
    problem: str | None = None


def _run_probe(root: nn.Module, candidates: tuple[str, ...]) -> _Probe:
    """One forward of ``root`` on :func:`probe_inputs`, recording the order in which the
    candidate sequences and their layers are called, what their layers return, and where
    the modules beside them are called."""
    rec = _Probe()
    layer_of = {join(seq, k): seq for seq in candidates for k in child_names(get_module(root, seq))}
    ancestors = _ancestors(candidates)
    paths_of: dict[int, list[str]] = {}
    for path in beside(root, candidates):
        paths_of.setdefault(id(get_module(root, path)), []).append(path)
    with ExitStack() as hooks:
        for path, seq in layer_of.items():
            layer = get_module(root, path)

            def before(*_: Any, path: str = path, seq: str = seq) -> None:
                if seq not in rec.sequences:
                    rec.sequences.append(seq)
                rec.counts[path] = rec.counts.get(path, 0) + 1
                rec.order.append(path)

            def after(_: nn.Module, __: Any, output: Any, seq: str = seq) -> None:
                layout: Layout | str
                if isinstance(output, torch.Tensor):
                    layout = None
                elif isinstance(output, tuple | list) and all(isinstance(v, torch.Tensor) or v is None
                                                              for v in output):
                    layout = tuple(isinstance(v, torch.Tensor) for v in output)
                else:
                    rec.problem = rec.problem or f"a layer of {seq!r} returns {_describe(output)}, not tensors"
                    return
                if rec.layouts.setdefault(seq, layout) != layout:
                    rec.problem = rec.problem or f"the layers of {seq!r} return different structures"
                rec.slot += 1

            hooks.enter_context(layer.register_forward_pre_hook(before))
            hooks.enter_context(layer.register_forward_hook(after))
        for path in sorted(ancestors):
            module = get_module(root, path)

            def push(*_: Any, path: str = path) -> None:
                rec.stack.append(path)

            def pop(*_: Any) -> None:
                rec.stack.pop()

            hooks.enter_context(module.register_forward_pre_hook(push))
            hooks.enter_context(module.register_forward_hook(pop, always_call=True))
        for paths in paths_of.values():
            module = get_module(root, paths[0])

            def called(*_: Any, paths: list[str] = paths) -> None:
                inside = rec.stack[-1] if rec.stack else None
                for path in paths:
                    if join(*split(path)[:-1]) == inside:
                        rec.calls.setdefault(path, []).append(rec.slot)

            hooks.enter_context(module.register_forward_pre_hook(called))
        with torch.no_grad():
            root(**probe_inputs(root))
    return rec


def find_chain(root: nn.Module) -> Chain:
    """The :class:`Chain` of ``root`` (probed on ``root``, or on a small real twin of it when
    its parameters are on the meta device); a :class:`ScheduleError` naming the reason
    where one probe forward on a small batch of token ids fails or finds layers it cannot
    hand on (called several times, or returning something other than tensors)."""
    candidates = layer_sequences(root, least=1)
    if not _takes(root, "input_ids"):
        raise ScheduleError("cut_pipeline_stage", [Problem(
            ", ".join(candidates),
            f"{type(root).__name__} has several layer sequences, and its forward takes no input_ids: every stage of "
            "such a model runs the forward on the batch's token ids (the layers of other stages replayed)",
            "pipeline one sequence's module alone (e.g. sf.create_schedule(model.get_decoder()), passing "
            "encoder_hidden_states=... to Pipeline.step), or a model whose forward takes input_ids")])
    probe = root
    if any(p.is_meta for p in root.parameters()):
        twin = small_twin(root, same_depth=True)  # the same layers, called in the same order
        if twin is None:
            raise ScheduleError("cut_pipeline_stage", [Problem(
                candidates[0] if candidates else "",
                "its parameters are on the meta device and no small real twin of it could be built, so the forward "
                "that places its stages cannot be probed",
                "cut the model before moving it to the meta device (create it on the CPU)")])
        probe = twin
    was = [(m, m.training) for m in probe.modules()]
    try:
        for m, _ in was:
            m.training = False
        rec = _run_probe(probe, candidates)
    except Exception as e:
        raise ScheduleError("cut_pipeline_stage", [Problem(
            ", ".join(candidates),
            f"{type(root).__name__} has several layer sequences, and its forward fails on a small batch of token ids "
            f"({', '.join(_kwargs(root)) or 'no token-id argument'}), which places its stages: "
            f"{type(e).__name__}: {_first_line(e)}",
            "pipeline one sequence's module alone (e.g. sf.create_schedule(model.get_decoder()), passing "
            "encoder_hidden_states=... to Pipeline.step), or a model whose forward takes input_ids")]) from None
    finally:
        for m, flag in was:
            m.training = flag
    if rec.problem is not None:
        raise ScheduleError("cut_pipeline_stage", [Problem(
            ", ".join(rec.sequences), f"{rec.problem}: a stage hands on only tensors",
            "pipeline a model whose layers return a tensor or a tuple of tensors")])
    missing = [p for p in dict.fromkeys(rec.order) if not _exists(root, p)]
    if missing:
        raise ScheduleError("cut_pipeline_stage", [Problem(
            ", ".join(missing), "the small real twin probed in place of this meta-device model has layers it lacks",
            "cut the model before moving it to the meta device (create it on the CPU)")])
    sequences = tuple(rec.sequences)
    routed = tuple(seq for seq in sequences if any(n > 1 for p, n in rec.counts.items() if _under(p, seq)))
    return Chain(sequences, tuple(rec.layouts[s] for s in sequences),
                 tuple((p, tuple(slots)) for p, slots in sorted(rec.calls.items())), tuple(rec.order), routed)


def _exists(root: nn.Module, path: str) -> bool:
    try:
        get_module(root, path)
    except KeyError:
        return False
    return True


def _under(path: str, sequence: str) -> bool:
    return path.startswith(sequence + ".")


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:200]


def _kwargs(root: nn.Module) -> list[str]:
    return [name for name in TOKEN_ID_ARGS if _takes(root, name)]


# -- stage trees ----------------------------------------------------------------------------
def stage_bounds(layers: int, cuts: Sequence[int]) -> tuple[int, ...]:
    """The first layer index of every stage and the end: cuts after layers ``cuts``.

    >>> stage_bounds(6, [1, 3])
    (0, 2, 4, 6)
    """
    return (0, *(i + 1 for i in sorted(cuts)), layers)


def _stage_of(bounds: Sequence[int], index: int) -> int:
    return next(s for s in range(len(bounds) - 1) if index < bounds[s + 1]) if index < bounds[-1] else len(bounds) - 2


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _placed(root: nn.Module, chain: Chain, layers: tuple[str, ...], bounds: Sequence[int], stage: int,
            path: str, slots: tuple[int, ...]) -> nn.Module:
    """The module at ``path`` (beside the sequences) in ``stage``: itself, a
    :class:`Placeholder` or a :class:`NotInStage` (see the module docstring)."""
    module = get_module(root, path)
    if not _has_parameters(module):
        return module
    if not slots:
        return module if stage == 0 else NotInStage(path, stage, "first")
    parent = join(*split(path)[:-1])
    mine = [seq for seq in chain.sequences if seq.startswith(parent + ".") or not parent]
    replays = [max((i for i, p in enumerate(layers) if p.startswith(seq + ".") and i < bounds[stage]), default=-1)
               for seq in mine]
    owners = [_stage_of(bounds, k) for k in slots]
    if stage in owners:
        return module
    earlier = [k for k, owner in zip(slots, owners, strict=True) if owner < stage]
    if any(k > max(replays, default=-1) for k in earlier):
        return module  # read after the replays: recomputed here
    if earlier:
        return Placeholder(module) if isinstance(module, nn.Embedding) else module
    return NotInStage(path, stage, _ordinal(min(owners)))


def _ordinal(stage: int) -> str:
    return ("first", "second", "third", "fourth")[stage] if stage < 4 else f"{stage + 1}th"


def chain_stage_tree(root: nn.Module, chain: Chain, bounds: Sequence[int], stage: int) -> nn.Module:
    """The tree of ``stage`` (layer calls ``bounds[stage]:bounds[stage + 1]`` of the chain):
    ancestors of the sequences cloned, everything else shared (see the module docstring);
    a sequence whose layers are called several times is kept whole (its calls routed by
    :class:`ChainRun`)."""
    order = chain.order
    lo, hi = bounds[stage], bounds[stage + 1]
    replaced: dict[str, nn.Module] = {}
    for seq in chain.sequences:
        if seq in chain.routed:
            continue
        clone = shallow_clone(get_module(root, seq))
        index = {k: order.index(join(seq, k)) for k in clone._modules if join(seq, k) in order}
        before = [k for k, i in index.items() if i < lo]
        kept: dict[str, nn.Module | None] = {}
        if before:
            kept[before[-1]] = Replay(join(seq, before[-1]), chain.layout(seq))
        kept.update((k, m) for k, m in clone._modules.items() if k in index and lo <= index[k] < hi)
        clone._modules = type(clone._modules)(kept)  # type: ignore[assignment]
        replaced[seq] = clone
    calls = dict(chain.calls)
    for path in beside(root, chain.sequences):
        replaced[path] = _placed(root, chain, order, bounds, stage, path, calls.get(path, ()))
    ancestors = sorted(_ancestors(chain.sequences), key=lambda p: -len(split(p)))
    clones: dict[str, nn.Module] = {}
    for parent in ancestors:
        clone = shallow_clone(get_module(root, parent))
        for name in list(clone._modules):
            path = join(parent, name)
            if path in clones:
                clone._modules[name] = clones[path]
            elif path in replaced:
                clone._modules[name] = replaced[path]
        clones[parent] = clone
    return clones[""]


# -- running a stage ------------------------------------------------------------------------
@dataclass
class _Routed:
    """A sequence whose layers are called several times: the chain positions of its calls,
    in order, the position of its last call in this stage, and its layers."""

    sequence: str
    layout: Layout
    positions: tuple[int, ...]
    own_last: int | None
    layers: tuple[str, ...]


class ChainRun:
    """Runs one stage of a chain: its forward takes the batch's ``input_ids`` (stage 0,
    positionally) or the received layer outputs (later stages, positionally, with the
    batch's ``input_ids`` as a keyword), sets the replays, runs the model's forward and
    returns the layer outputs later stages read (a tuple), or in the last stage the model
    output's tensor. A layer called several times is routed call by call: a call an
    earlier stage ran returns its received output, a call of this stage runs. Install with
    :meth:`install` (on build's private copy), or call it."""

    def __init__(self, module: nn.Module, chain: Chain, bounds: Sequence[int], stage: int) -> None:
        self.module = module
        self.forward = module.forward
        self.stage = stage
        self.last = stage == len(bounds) - 2
        self.no_cache = _takes(module, "use_cache")
        order = chain.order
        self.lo, self.hi = lo, hi = bounds[stage], bounds[stage + 1]
        self.inputs: list[tuple[str, Replay | None, int]] = []  # per received sequence: its replay and width
        self.outputs: list[tuple[str, str | None]] = []  # per handed-on sequence: (sequence, own layer or None)
        self.recorded: dict[str, tuple[torch.Tensor, ...]] = {}
        self.received: dict[str, tuple[torch.Tensor, ...]] = {}
        self.routed: list[_Routed] = []
        self._handles: list[Any] = []
        for seq in chain.sequences:
            positions = tuple(i for i, p in enumerate(order) if _under(p, seq))
            before = [i for i in positions if i < lo]
            own = [i for i in positions if lo <= i < hi]
            if seq in chain.routed:
                self.routed.append(_Routed(seq, chain.layout(seq), positions, own[-1] if own else None,
                                           tuple(dict.fromkeys(order[i] for i in positions))))
            if before:
                replay = None if seq in chain.routed else get_module(module, order[before[-1]])
                self.inputs.append((seq, replay if isinstance(replay, Replay) else None, _width(chain.layout(seq))))
            if own:
                self.outputs.append((seq, order[own[-1]]))
                if seq not in chain.routed:
                    self._record(seq, order[own[-1]], chain.layout(seq), stop=own[-1] == hi - 1 and not self.last)
            elif before:
                self.outputs.append((seq, None))

    def _record(self, seq: str, path: str, layout: Layout, stop: bool) -> None:
        def keep(_: nn.Module, __: Any, output: Any) -> None:
            self.recorded[seq] = _flat(output, layout, path)
            if stop:
                raise StopStage

        self._handles.append(get_module(self.module, path).register_forward_hook(keep))

    def _route(self, routed: _Routed, path: str, forward: Any, cursor: Iterator[int]) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            at = next(cursor, None)
            if at is None:
                raise RuntimeError(f"slapo_fn pipeline: {path!r} is called more often than in the probe forward at "
                                   "the cut: cut again with the same forward arguments")
            if at < self.lo:
                return _rebuild(self.received[routed.sequence], routed.layout)
            output = forward(*args, **kwargs)
            if at == routed.own_last:
                self.recorded[routed.sequence] = _flat(output, routed.layout, path)
                if at == self.hi - 1 and not self.last:
                    raise StopStage
            return output

        return call

    @contextmanager
    def _routing(self) -> Iterator[None]:
        """Route the calls of the layers called several times (instance ``forward``s,
        removed after the forward: the layers may be shared with the model)."""
        installed: list[nn.Module] = []
        try:
            for routed in self.routed:
                cursor = iter(routed.positions)
                for path in routed.layers:
                    layer = get_module(self.module, path)
                    layer.forward = self._route(routed, path, layer.forward, cursor)  # type: ignore[method-assign]
                    installed.append(layer)
            yield
        finally:
            for layer in installed:
                layer.__dict__.pop("forward", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = dict(kwargs)
        if self.no_cache:
            kwargs.setdefault("use_cache", False)
        if self.stage == 0:
            kwargs["input_ids"] = args[0]
        else:
            self._receive(args)
        self.recorded.clear()
        try:
            with self._routing():
                output = self.forward(**kwargs)
        except StopStage:
            output = None
        finally:
            for _, replay, _ in self.inputs:
                if replay is not None:
                    replay.received = None
        if self.last:
            self.received.clear()
            return output_tensor(output)
        flat: list[torch.Tensor] = []
        for seq, own in self.outputs:
            values = self.recorded[seq] if own is not None else self.received[seq]
            # point-to-point sends take contiguous tensors (T5's position bias is an
            # expanded one); zero-bubble schedules detach stage outputs in place, which
            # views (and the received tensors passed on) refuse: hand on copies of those
            flat += [v.contiguous() if not v.is_contiguous() else v.clone() if v._is_view() or own is None else v
                     for v in values]
        self.received.clear()
        return tuple(flat)

    def _receive(self, args: tuple[Any, ...]) -> None:
        want = sum(w for _, _, w in self.inputs)
        if len(args) != want:
            raise RuntimeError(f"slapo_fn pipeline: stage {self.stage} takes {want} received tensors, got {len(args)}")
        at = 0
        self.received.clear()
        for seq, replay, width in self.inputs:
            values = tuple(args[at:at + width])
            at += width
            self.received[seq] = values
            if replay is not None:
                replay.received = values

    def install(self) -> None:
        """Make this the module's forward (on a private copy: the instance attribute)."""
        self.module.forward = self  # type: ignore[method-assign]

    def remove(self) -> None:
        """Remove the hooks and restore the module's own forward."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.module.__dict__.get("forward") is self:
            del self.module.__dict__["forward"]


def chain_parity_error(root: nn.Module, chain: Chain) -> str | None:
    """Why ``root``'s stages (up to four, chained in one process) do not give ``root``'s own
    output on a small batch; ``None`` when they do."""
    parts = min(4, len(chain.order))
    bounds = tuple(round(i * len(chain.order) / parts) for i in range(parts + 1))
    trees = [chain_stage_tree(root, chain, bounds, s) for s in range(parts)]
    kwargs = probe_inputs(root)
    was = [(m, m.training) for tree in (root, *trees) for m in tree.modules()]
    runs: list[ChainRun] = []
    try:
        for m, _ in was:
            m.training = False
        with torch.no_grad():
            reference = output_tensor(root(**kwargs))
            # the stages share their layers with the model: hook them only after its own run
            runs += [ChainRun(tree, chain, bounds, s) for s, tree in enumerate(trees)]
            ids = kwargs.pop("input_ids")
            hidden: Any = runs[0](ids, **kwargs)
            for run in runs[1:]:
                hidden = run(*hidden, input_ids=ids, **kwargs)
    except Exception as e:
        return f"the stages fail where the model runs: {type(e).__name__}: {_first_line(e)}"
    finally:
        for run in runs:
            run.remove()
        for m, flag in was:
            m.training = flag
    if hidden.shape != reference.shape:
        return f"the stages give shape {tuple(hidden.shape)}, the model {tuple(reference.shape)}"
    diff = float((hidden - reference).abs().max()) / (1.0 + float(reference.abs().max()))
    return None if diff <= PARITY_TOLERANCE else f"the stages differ from the model by {diff:.3g} (relative)"


def resolve_chain(root: nn.Module) -> Chain:
    """:func:`find_chain`, checked by :func:`chain_parity_error` (on ``root``, or its small
    twin where ``root`` is on the meta device); a :class:`ScheduleError` where it fails."""
    chain = find_chain(root)
    probe = root if not any(p.is_meta for p in root.parameters()) else small_twin(root, same_depth=True)
    reason = chain_parity_error(probe, chain) if probe is not None else None
    if reason is not None:
        raise ScheduleError("cut_pipeline_stage", [Problem(
            ", ".join(chain.sequences),
            f"{type(root).__name__}'s stages, each running its forward with the layers of the others replayed, "
            f"do not give its output: {reason}",
            "pipeline one sequence's module alone (e.g. sf.create_schedule(model.get_decoder()))")])
    return chain

