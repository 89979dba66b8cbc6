"""``--data`` as training data: :func:`open_data` builds what each rank reads, and
:func:`data_problems` is what the parent refuses before any rank starts.

Example:
    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "a.jsonl").write_text('{"text": "aaaa"}\\n' * 20)
    >>> _ = (folder / "b.jsonl").write_text('{"text": "bbbb"}\\n' * 20)
    >>> from slapo_fn.data import Codec
    >>> data = open_data(f"{folder}/a.jsonl:0.7,{folder}/b.jsonl:0.3", Codec.byte_level(), seq_len=8)
    >>> data.batch(0, batch_size=4)["input_ids"].shape
    torch.Size([4, 8])
    >>> data_problems("missing.jsonl:0.5,b.jsonl:-1", Codec.byte_level())[0].reason
    'b.jsonl: a mixture weight must be a positive number, got -1'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from ..errors import Problem, ScheduleError
from .codec import Codec
from .manifest import Manifest
from .mixture import Cursor, Mixture, RowSource
from .packed import TokenData
from .prepared import PreparedData, tokenizer_problems
from .spec import DataSpec, Source, kind, parse
from .stream import Format, StreamData, StreamSource

__all__ = ["data_problems", "open_data"]

Data = TokenData | PreparedData | StreamData | Mixture


def open_data(data: str | DataSpec, codec: Codec, *, seq_len: int, seed: int = 0, eval_fraction: float = 0.0,
              stream: bool = False, text_field: str = "text", data_format: Format = "auto",
              chat_packing: Literal["apart", "padded"] | Callable[[], Literal["apart", "padded"]] = "apart") -> Data:
    """The training data ``data`` (a ``--data`` string, see :mod:`slapo_fn.data.spec`)
    names, tokenized with ``codec`` into rows of ``seq_len``: ``TokenData``,
    ``PreparedData``, ``StreamData`` or a ``Mixture`` of the last two. Chat examples are
    packed ``chat_packing`` (see :func:`slapo_fn.data.attention.packing_for`; a function
    is asked only where there are chat examples)."""
    spec = parse(data) if isinstance(data, str) else data
    _refuse_stdlib_in_mixture(spec)
    opened: list[TokenData | PreparedData | StreamData] = []
    for source in spec.sources:
        how = kind(spec, source, stream=stream, data_format=data_format)
        if how == "prepared":
            opened.append(PreparedData.open(source.path, seq_len=seq_len, seed=seed, tokenizer=codec,
                                            eval_fraction=0.0 if spec.mixture else eval_fraction))
        elif how == "memory":
            opened.append(TokenData.from_source(source.path, codec, seq_len=seq_len, seed=seed,
                                                eval_fraction=eval_fraction, text_field=text_field))
        else:
            chat = StreamSource(source.path, text_field=text_field, format=data_format)
            opened.append(StreamData(chat, codec, seq_len=seq_len, mode=None if data_format == "text" else
                                     _mode(chat, codec, chat_packing)))
    if not spec.mixture:
        return opened[0]
    rows: list[RowSource] = [Cursor(d) if isinstance(d, PreparedData | TokenData) else d for d in opened]
    return Mixture(rows, spec.weights, seed=seed, names=[s.name for s in spec.sources])


def _mode(source: StreamSource, codec: Codec,
          chat_packing: Literal["apart", "padded"] | Callable[[], Literal["apart", "padded"]]) \
        -> Literal["crossing", "apart", "padded"]:
    if source.checked_format(codec) != "chat":
        return "crossing"
    return chat_packing() if callable(chat_packing) else chat_packing


def packs_apart(data: object) -> bool:
    """Whether ``data``'s rows keep examples apart by ``position_ids`` (a model must then
    run without a cache, which would turn that reading off)."""
    if isinstance(data, Mixture):
        return any(packs_apart(s) for s in data.sources)
    return getattr(data, "mode", None) == "apart"


def data_problems(data: str, codec: Codec, *, stream: bool = False, text_field: str = "text",
                  data_format: Format = "auto", eval_every: bool = False) -> list[Problem]:
    """Everything about ``data`` that can be refused before any rank starts: a weight that
    is not positive, a missing source, a prepared folder that is incomplete or was prepared
    with another tokenizer than ``codec``, a stream with no rows, a first row without the
    field its format reads, chat rows without a chat template, ``stdlib`` in a mixture, and
    ``eval_every`` where there is no held-out split. Each problem's path is ``--data``
    (or ``--tokenizer``); first rows are read, nothing else."""
    try:
        spec = parse(data)
        _refuse_stdlib_in_mixture(spec)
    except ScheduleError as e:
        return list(e.problems)
    problems: list[Problem] = []
    for source in spec.sources:
        if source.stdlib:
            continue
        if not source.path.exists():
            problems.append(Problem("--data", f"{source.name}: no such file or folder",
                                    "a prepared folder, a JSON-lines, parquet or text file, or a folder of them"))
            continue
        try:
            problems += _source_problems(spec, source, codec, stream, text_field, data_format, eval_every)
        except ScheduleError as e:
            problems += [Problem("--data", f"{p.path}: {p.reason}", p.fix) for p in e.problems]
    return problems


def _source_problems(spec: DataSpec, source: Source, codec: Codec, stream: bool, text_field: str,
                     data_format: Format, eval_every: bool) -> list[Problem]:
    how = kind(spec, source, stream=stream, data_format=data_format)
    if how == "prepared":
        manifest = Manifest.read(source.path)
        mismatch = tokenizer_problems(manifest, codec, source.path)
        return [Problem("--tokenizer", f"{p.path} {p.reason}", p.fix) for p in mismatch]
    if how == "stream":
        StreamSource(source.path, text_field=text_field, format=data_format).checked_format(codec)
        if eval_every:
            where = "a mixture" if spec.mixture else f"{source.name}, streamed,"
            return [Problem("--eval-every", f"{where} has no held-out split",
                            "prepare the corpus (slapo-fn prepare), whose rows have one (--eval-fraction), or "
                            "leave out --eval-every")]
    return []


def _refuse_stdlib_in_mixture(spec: DataSpec) -> None:
    if spec.mixture and any(s.stdlib for s in spec.sources):
        raise ScheduleError("data", [Problem("--data", "stdlib is a demo corpus held in memory; it is not mixed",
                                             "write the documents to a JSON-lines file and mix that file")])
