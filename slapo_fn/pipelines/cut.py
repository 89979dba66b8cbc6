"""``cut_pipeline_stage``: a pipeline stage boundary after a layer of a sequence."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from ..combinators import primitive
from ..errors import Problem, ScheduleError
from ..hf import is_encoder_decoder
from ..schedule import Key, Schedule
from ..select import Selection
from ..tree import get_module, join, split, walk
from .chain import Chain, layer_sequences, resolve_chain
from .families import Family, encoder_decoder_problem, resolve_family

__all__ = ["PIPELINE_CUT", "StageCut", "cut_pipeline_stage", "pp_size", "sequence_of"]

PIPELINE_CUT: Key[StageCut] = Key("pipeline_cut")


@dataclass(frozen=True)
class StageCut:
    """The annotation of a layer after which a new pipeline stage begins; ``family`` is
    the stage adapter resolved (and, for a derived one, checked for parity) at the cut;
    ``chain`` the layer sequences of a model with several (an encoder and a decoder),
    probed and checked for parity at the cut (:mod:`.chain`); ``calls`` the calls of a
    layer the forward calls several times after which stages end (ALBERT's shared layer)."""

    family: Family | None = field(default=None, compare=False)
    chain: Chain | None = field(default=None, compare=False)
    calls: tuple[int, ...] = ()

    def __str__(self) -> str:
        return "stage cut after" + (f" calls {', '.join(map(str, self.calls))}" if self.calls else "")


def sequence_of(layer: str) -> str:
    """The path of the sequence holding ``layer`` (``"model.layers.3"`` → ``"model.layers"``)."""
    return join(*split(layer)[:-1])


def pp_size(sch: Schedule, mesh_axis: str = "pp") -> int | None:
    """The size of the ``mesh_axis`` axis of the schedule's mesh, or ``None`` without one."""
    names = tuple(getattr(sch.mesh, "mesh_dim_names", None) or ())
    if sch.mesh is None or mesh_axis not in names:
        return None
    return int(sch.mesh.size(names.index(mesh_axis)))


def _is_sequence(module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleList | nn.Sequential) and all(k.isdigit() for k in module._modules)


def _sequences(root: nn.Module) -> list[str]:
    return [p for p, m in walk(root) if _is_sequence(m) and len(m._modules) > 1]


def _takes_inputs_embeds(model: nn.Module) -> bool:
    try:
        return "inputs_embeds" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _example(root: nn.Module) -> str:
    seqs = _sequences(root)
    if not seqs:
        return "this model has no ModuleList/Sequential of layers to cut"
    keys = list(get_module(root, seqs[0])._modules)
    return f"cut after a layer of a sequence, e.g. cut_pipeline_stage(sch, {join(seqs[0], keys[len(keys) // 2 - 1])!r})"


@primitive
def cut_pipeline_stage(sch: Schedule, where: Selection, calls: int | Sequence[int] | None = None) -> Schedule:
    """Start a new pipeline stage after the selected layer(s) of a sequence.

    ``where`` names layers of one ``ModuleList``/``Sequential`` (``"model.layers.1"``, or
    several at once: ``"model.layers.[0,1,2]"``). The stages are derived from the
    unmodified model by :func:`slapo_fn.pipelines.split_stages` and run by
    :func:`slapo_fn.build_pipeline`. Refused, all at once and with the input unchanged:
    a path that is not a layer of a sequence (or is its last layer), a layer cut twice,
    a cut in another sequence than earlier cuts or before an earlier cut (cut in layer
    order), a model whose forward takes no ``inputs_embeds`` (later stages are fed the
    hidden states through it), a Hugging Face model type without a stage adapter in
    :data:`~slapo_fn.pipelines.families.FAMILIES`, and, when the mesh has a ``pp`` axis of size P, more than
    P stages unless their number is a multiple of P (several stages per rank, for
    interleaved schedules: make those cuts in one call). Returns a new schedule; the
    input is unchanged.

    A model with several layer sequences (an encoder and a decoder: T5, Bart) is cut after
    any layer of them, in the order its forward runs them, between them too; ``calls=k``
    (or several) cuts after the k-th call (0-based) of a layer the forward calls several
    times (ALBERT's shared layer), the stages on either side both holding its parameters,
    their gradients summed. Those stages run the model's forward on the batch with the
    layers of other stages replayed (:mod:`slapo_fn.pipelines.chain`), and need neither
    ``inputs_embeds`` nor an adapter; the chain is probed and checked for parity at the cut.

    Example:
        >>> import slapo_fn as sf
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=4, n_head=2, vocab_size=32, n_positions=8))
        >>> sch = sf.cut_pipeline_stage(sf.create_schedule(model), "transformer.h.1")
        >>> print(sch["transformer.h.1"].annotations["pipeline_cut"])
        stage cut after
        >>> try:
        ...     sf.cut_pipeline_stage(sch, "transformer.h.0.attn")
        ... except sf.ScheduleError as e:
        ...     print(e.problems[0].reason)
        is not a layer of a sequence (its parent is a GPT2Block)
    """
    paths = where.paths(sch.module)
    existing = sch.annotations.of_kind(PIPELINE_CUT)
    if calls is not None or len(layer_sequences(sch.module)) > 1 or any(c.chain is not None
                                                                          for c in existing.values()):
        return _cut_chain(sch, paths, existing, (calls,) if isinstance(calls, int) else
                          None if calls is None else tuple(calls))
    problems: list[Problem] = []
    seen_sequence = sequence_of(next(iter(existing))) if existing else None
    last_index = max((_index(sch.module, p) for p in existing), default=-1)
    new: list[str] = []
    for path in paths:
        tokens = split(path)
        try:
            parent = get_module(sch.module, sequence_of(path)) if tokens else None
        except KeyError:
            parent = None
        if parent is None or not _is_sequence(parent) or tokens[-1] not in parent._modules:
            what = "the root" if not tokens else (type(parent).__name__ if parent is not None else "a parameter")
            problems.append(
                Problem(path, f"is not a layer of a sequence (its parent is {_a(what)})", _example(sch.module))
            )
            continue
        keys = list(parent._modules)
        index = keys.index(tokens[-1])
        seq = sequence_of(path)
        if path in existing:
            problems.append(Problem(path, "is cut already (duplicate stage cut)", "cut each layer once"))
        elif seen_sequence is not None and seq != seen_sequence:
            problems.append(
                Problem(
                    path,
                    f"is in the sequence {seq!r}, but the stages are cut in {seen_sequence!r}; stages must "
                    f"form one chain",
                    f"cut only layers of {seen_sequence!r}",
                )
            )
        elif len(keys) == 1:
            problems.append(
                Problem(path, "is the only layer of its sequence: there is no place between layers to cut (a layer "
                              "the model calls several times, as ALBERT's shared one, is still one module: a stage "
                              "holds modules, not calls)",
                        f"cut between its calls, if the forward calls it several times: cut_pipeline_stage(sch, "
                        f"{path!r}, calls=1) starts a stage after its second call")
            )
        elif index == len(keys) - 1:
            problems.append(
                Problem(path, "is the last layer of its sequence: the stage after it would be empty",
                        f"cut after an earlier layer, at most {join(seq, keys[-2])!r}")
            )
        elif index <= last_index:
            problems.append(
                Problem(
                    path,
                    f"comes before the existing cut after {join(seq, keys[last_index])!r} (out of order)",
                    "cut in layer order, or make all cuts in one call: "
                    f"cut_pipeline_stage(sch, '{seq}.[{index},{last_index}]')",
                )
            )
        else:
            new.append(path)
            seen_sequence = seen_sequence or seq
            last_index = index
    if new and is_encoder_decoder(sch.module):
        problems.append(encoder_decoder_problem(sch.module, sequence_of(new[0])))
    elif new and not _takes_inputs_embeds(sch.module):
        problems.append(
            Problem(
                "",
                f"{type(sch.module).__name__}.forward takes no inputs_embeds: stages after the first are fed the "
                "hidden states through it",
                "cut a Hugging Face model (LLaMA family, GPT-2, BERT, OPT …) or give the model's forward an "
                "inputs_embeds argument that skips the embedding",
            )
        )
    if not problems:
        problems += _stage_count(sch, len(existing) + len(new) + 1, new)
    if problems:
        raise ScheduleError("cut_pipeline_stage", problems)
    if not new:
        return sch
    # the adapter is resolved (a derived one checked for parity) now, not at build
    known = next((c.family for c in existing.values() if c.family is not None), None)
    family = known if known is not None else resolve_family(sch.module, sequence_of(new[0]))
    for path in new:
        sch = sch.annotate_path(path, PIPELINE_CUT, StageCut(family))
    return sch


def _stage_count(sch: Schedule, stages: int, new: list[str]) -> list[Problem]:
    size = pp_size(sch)
    if size is None or stages <= size or not stages % size:
        return []
    return [Problem(
        new[-1] if new else "",
        f"makes {stages} stages for {size} ranks on the 'pp' mesh axis: more stages than ranks must be a "
        f"multiple of them (several stages per rank)",
        f"cut into {size} stages, or {2 * size} for interleaved schedules, making those cuts in one call",
    )]


def cut_positions(chain: Chain, path: str, cut: StageCut) -> tuple[int, ...]:
    """The positions in the chain's call order after which ``cut`` (at ``path``) starts stages."""
    return tuple(chain.index(path, k) for k in (cut.calls or (0,)))


def _cut_chain(sch: Schedule, paths: Sequence[str], existing: dict[str, StageCut],
               calls: tuple[int, ...] | None) -> Schedule:
    """Cuts in a model with several layer sequences, or between calls of a layer: after any
    layer call of the chain of sequences its forward runs, in call order (between an encoder
    and a decoder too), the chain probed and checked for parity once (:mod:`.chain`)."""
    sequences = layer_sequences(sch.module, least=1)
    problems: list[Problem] = []
    candidates: list[str] = []
    for path in paths:
        tokens = split(path)
        if not tokens or sequence_of(path) not in sequences or tokens[-1] not in get_module(
                sch.module, sequence_of(path))._modules:
            problems.append(Problem(path, f"is not a layer of the model's layer sequences ({', '.join(sequences)})",
                                    _example(sch.module)))
        else:
            candidates.append(path)
    if problems:
        raise ScheduleError("cut_pipeline_stage", problems)
    chain = next((c.chain for c in existing.values() if c.chain is not None), None) or resolve_chain(sch.module)
    order = chain.order
    taken = {i for p, c in existing.items() for i in cut_positions(chain, p, c)}
    last_index = max(taken, default=-1)
    new: dict[str, tuple[int, ...]] = {}
    for path in candidates:
        count = chain.count(path)
        wanted = calls if calls is not None else (0,) if count == 1 else None
        if count == 0:
            problems.append(Problem(path, f"is in a sequence the forward does not run (it runs "
                                          f"{', '.join(chain.sequences)})",
                                    f"cut after a layer of {chain.sequences[0]!r}"))
            continue
        if wanted is None:
            problems.append(Problem(path, f"is called {count} times in one forward (its parameters shared across the "
                                          "calls): say after which calls a stage ends",
                                    f"cut_pipeline_stage(sch, {path!r}, calls={count // 2 - 1 if count > 1 else 0}) "
                                    f"(calls 0..{count - 2}, 0-based)"))
            continue
        bad = [k for k in wanted if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < count]
        if bad:
            problems.append(Problem(path, f"calls={list(wanted)}: the forward calls it {count} time(s), so call(s) "
                                          f"{bad} do not exist", f"calls in 0..{count - 1} (0-based)"))
            continue
        for k in sorted(wanted):
            at = chain.index(path, k)
            where = f"{path} (call {k})" if count > 1 else path
            if at in taken:
                problems.append(Problem(where, "is cut already (duplicate stage cut)", "cut each layer call once"))
            elif at == len(order) - 1:
                problems.append(Problem(where, "is the last layer call the forward makes: the stage after it would be "
                                               "empty", f"cut after an earlier layer, at most {order[-2]!r}"))
            elif at <= last_index:
                problems.append(Problem(where, f"comes before the existing cut after {order[last_index]!r} (out of "
                                               f"order: the forward runs {' then '.join(chain.sequences)})",
                                        "cut in the order the forward runs the layers, or make all cuts in one call"))
            else:
                new[path] = (*new.get(path, ()), k)
                taken.add(at)
                last_index = at
    problems += _stage_count(sch, len(taken) + 1, list(new)) if not problems else []
    if problems:
        raise ScheduleError("cut_pipeline_stage", problems)
    for path, ks in new.items():
        before = existing.get(path)
        merged = tuple(sorted({*(before.calls if before is not None else ()), *ks}))
        cut = StageCut(chain=chain, calls=merged if chain.count(path) > 1 else ())
        sch = sch.annotate_path(path, PIPELINE_CUT, cut)
    return sch


def _a(what: str) -> str:
    return what if what.startswith(("the ", "a ")) else f"a {what}"


def _index(root: nn.Module, layer: str) -> int:
    return list(get_module(root, sequence_of(layer))._modules).index(split(layer)[-1])
