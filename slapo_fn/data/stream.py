"""Streaming what was not prepared: :class:`StreamData` reads a corpus with ``datasets``'
iterable mode, tokenizes and packs it on the fly, and saves its position in the checkpoint.

A :class:`StreamSource` is a file or folder of JSON lines, parquet or text files (read by
``datasets.load_dataset(..., streaming=True)``; a text file is one document), a folder
saved with ``save_to_disk``, or a ``datasets`` dataset object. Each data-parallel rank
streams its own part, split by ``datasets.distributed.split_dataset_by_node`` (whole
files per rank where their number divides the ranks, else every n-th row), so the ranks'
documents are disjoint and together cover each epoch once. Rows are packed by a
:class:`~slapo_fn.data.packing.Packer`; an epoch that ends continues into the next, the
rows running on across the boundary, as torchtitan's ``HuggingFaceDataset`` does.

Rows are read in order, so a stream is not a pure function of the step: its
:meth:`~StreamData.state_dict` — the ``datasets`` position after the last example read,
and the packer's examples not yet emitted — goes into each rank's checkpoint, and
:meth:`~StreamData.load_state_dict` continues from there, bit for bit, without reading
the stream from its start (``datasets`` goes straight to the file, and within it skips
whole Arrow batches without decoding them) and without tokenizing anything twice.

Documents are streamed in corpus order, not shuffled: ``datasets``' shuffle buffer is not
restored on resume (its documentation says so), which would break the bit-identical
resume. Shuffle the corpus beforehand, or prepare it (:func:`~slapo_fn.data.prepare`:
every epoch in a fresh order).

Example:
    >>> import tempfile, pathlib
    >>> file = pathlib.Path(tempfile.mkdtemp()) / "c.jsonl"
    >>> _ = file.write_text('{"text": "hello"}\\n{"text": "world"}\\n')
    >>> data = StreamData(StreamSource(file), Codec.byte_level(), seq_len=4)
    >>> data.batch(0, batch_size=2)["input_ids"].tolist()
    [[104, 101, 108, 108], [111, 256, 119, 111]]
    >>> saved = data.state_dict()
    >>> again = StreamData(StreamSource(file), Codec.byte_level(), seq_len=4)
    >>> again.load_state_dict(saved)
    >>> torch.equal(again.batch(1, batch_size=2)["input_ids"], data.batch(1, batch_size=2)["input_ids"])
    True
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from ..errors import Problem, ScheduleError
from .chat import render_chat
from .codec import Codec
from .packing import Mode, Packer
from .problems import a, check_int, error, in_order_problems, raise_all
from .sources import JSON_SUFFIXES, is_saved_dataset, walk

if TYPE_CHECKING:
    import datasets

__all__ = ["Format", "StreamData", "StreamSource"]

Format = Literal["text", "chat", "auto"]
#: Read and tokenized at a time (one batched call of the tokenizer): examples until this
#: much text, or this many examples — enough for the tokenizer's batching, little enough
#: that the first step does not wait on more than it needs.
READ_CHARS = 1 << 17
READ_EXAMPLES = 256
#: ``to_iterable_dataset`` shards of a dataset saved on disk: any data-parallel size that
#: divides it gets whole shards.
_SAVED_SHARDS = 64


def _builder(file: Path) -> str:
    suffix = file.suffix.lower()
    return "json" if suffix in JSON_SUFFIXES else "parquet" if suffix == ".parquet" else "text"


@dataclass(frozen=True)
class StreamSource:
    """A corpus to stream: ``path`` (files, or a folder saved by ``datasets``) or
    ``dataset`` (a ``datasets`` object); documents are rows' ``text_field`` (``format``
    ``"text"``) or chat ``messages`` (``"chat"``); ``"auto"`` reads the first row to tell."""

    path: Path | None = None
    dataset: Any = None
    text_field: str = "text"
    format: Format = "auto"

    def __post_init__(self) -> None:
        if (self.path is None) == (self.dataset is None):
            raise error("StreamSource", "needs a path or a dataset, and not both", "StreamSource(Path('corpus/'))")
        if self.path is not None:
            object.__setattr__(self, "path", Path(self.path))

    @property
    def name(self) -> str:
        return str(self.path) if self.path is not None else f"<{type(self.dataset).__name__}>"

    def open(self) -> datasets.IterableDataset:
        """The whole stream (not split between ranks), from its start."""
        import datasets

        data = self.dataset
        if data is None:
            assert self.path is not None
            if is_saved_dataset(self.path):
                data = datasets.load_from_disk(str(self.path))
            else:
                builder, files = self._files()
                # load_dataset counts each load of a builder with a request to the Hub, which waits
                # 3 s where the network is closed (a cluster's nodes): local files are not the Hub's
                datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
                options = {"sample_by": "document"} if builder == "text" else {}
                return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                             streaming=True, **options)
        if isinstance(data, datasets.DatasetDict):
            if "train" not in data:
                raise error(self.name, f"is a DatasetDict without a 'train' split (splits: {', '.join(data)})",
                            "save the training split, or name it 'train'")
            data = data["train"]
        if isinstance(data, datasets.Dataset):
            if not len(data):
                raise _no_rows(self.name)
            data = data.to_iterable_dataset(num_shards=max(1, min(_SAVED_SHARDS, len(data))))
        return data

    def _files(self) -> tuple[str, list[Path]]:
        assert self.path is not None
        if not self.path.exists():
            raise error(self.path, "no such file or folder", "a JSON-lines, parquet or text file, or a folder of them")
        files = [self.path] if self.path.is_file() else [f for f in walk(self.path) if f.stat().st_size]
        kinds = sorted({_builder(f) for f in files})
        if len(kinds) > 1:
            raise error(self.path, f"mixes {' and '.join(kinds)} files, which one stream cannot read together",
                        f"one kind per source; to use both, mix them: --data '{self.path}/a:0.5,{self.path}/b:0.5'")
        if not files:
            raise error(self.path, "holds no file with anything in it", "point at a corpus")
        return kinds[0], files

    @functools.cached_property
    def fingerprint(self) -> str:
        """The files' names, sizes and modification times (or the dataset's own fingerprint)."""
        if self.path is None:
            what = str(getattr(self.dataset, "_fingerprint", None) or type(self.dataset).__name__)
        elif self.path.is_file():
            what = f"{self.path.resolve()}/{self.path.stat().st_size}/{self.path.stat().st_mtime_ns}"
        else:
            what = "|".join(f"{f}/{f.stat().st_size}/{f.stat().st_mtime_ns}" for f in walk(self.path))
        return hashlib.sha256(f"{what}/{self.text_field}/{self.format}".encode()).hexdigest()[:16]

    def first_row(self) -> Mapping[str, Any] | None:
        """The stream's first row, or ``None`` if it has none."""
        return next(iter(self.open()), None)

    def checked_format(self, codec: Codec | None = None) -> Literal["text", "chat"]:
        """What its rows are, from the first row; a :class:`~slapo_fn.errors.ScheduleError`
        for a stream with no rows, a first row without the field its format reads, or chat
        rows with a tokenizer that has no chat template (``codec``, where given)."""
        row = self.first_row()
        if row is None:
            raise _no_rows(self.name)
        fields = ", ".join(map(str, row)) or "none"
        chat = isinstance(row.get("messages"), list)
        if self.format == "chat" and not chat:
            raise error(self.name, f"is read as chat, and its first row has no 'messages' list (fields: {fields})",
                        "rows like {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}, ...]}, or "
                        "--data-format text")
        if self.format == "text" or (self.format == "auto" and not chat):
            if not isinstance(row.get(self.text_field), str):
                raise error(self.name, f"its first row has no {self.text_field!r} string (fields: {fields})",
                            f"rows with a {self.text_field!r} string, chat rows with 'messages', or "
                            "--text-field NAME")
            return "text"
        if codec is not None and not getattr(codec.tokenizer, "chat_template", None):
            raise error(self.name, f"holds chat rows, and the tokenizer {codec.name} has no chat template to "
                                   "render them", "a tokenizer whose tokenizer_config.json has a chat_template")
        return "chat"


def _size(example: Mapping[str, Any]) -> int:
    """About how many characters an example holds (its strings and its messages')."""
    return sum(len(v) if isinstance(v, str) else len(str(v)) if isinstance(v, list) else 0 for v in example.values())


def _no_rows(name: str) -> ScheduleError:
    return error(name, "has no rows: nothing to stream", "point at a corpus with rows in it")


class StreamData:
    """A :class:`StreamSource` as training rows of ``seq_len`` tokens: this data-parallel
    rank's share, tokenized with ``codec`` and packed in ``mode`` (default: ``"crossing"``
    for text, ``"apart"`` for chat) as they are read; resumable from :meth:`state_dict`.

    It reads in order: :meth:`batch` takes the step only to check that steps come in
    order (after :meth:`load_state_dict`, from the saved one).
    """

    def __init__(self, source: StreamSource, codec: Codec, *, seq_len: int, mode: Mode | None = None) -> None:
        raise_all(check_int("seq_len", seq_len, 2, "seq_len=2 or more tokens per row (e.g. 128)"))
        self.source, self.codec, self.seq_len = source, codec, seq_len
        self.format = source.checked_format(codec)
        self.mode: Mode = mode or ("apart" if self.format == "chat" else "crossing")
        if self.format == "chat" and self.mode == "crossing":
            raise error(source.name, "holds chat examples, which rows that cross examples would mix",
                        "mode='apart' (position ids per example) or 'padded' (one example per row)")
        self._packer = Packer(seq_len, self.mode, codec.eos_id, cut=self.format == "chat")
        self._ranks: tuple[int, int] | None = None
        self._epoch = 0
        self._whole: Any = None  # the whole stream, opened once
        self._dataset: Any = None  # this rank's part of it, in this epoch
        self._iterator: Iterator[Mapping[str, Any]] | None = None
        self._position: dict[str, Any] | None = None  # the dataset's state after the last example read
        self._read_this_epoch = 0
        self._step: int | None = None

    def __repr__(self) -> str:
        return (f"StreamData({self.source.name}, {self.format} packed {self.mode} into rows of {self.seq_len} "
                f"tokens, vocab {self.vocab}, {self.codec.name})")

    @property
    def vocab(self) -> int:
        return self.codec.vocab

    @property
    def eos_id(self) -> int:
        return self.codec.eos_id

    @functools.cached_property
    def fingerprint(self) -> str:
        text = f"{self.source.fingerprint}/{self.codec.fingerprint}/{self.seq_len}/{self.mode}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # ----------------------------------------------------------------- rows

    def batch(self, step: int, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> dict[str, torch.Tensor]:
        """This rank's ``batch_size // dp_size`` next rows, for global batch ``step``."""
        raise_all(in_order_problems("a stream", step, self._step, batch_size, dp_size))
        rows = self.rows(batch_size // dp_size, dp_rank=dp_rank, dp_size=dp_size)
        self._step = step + 1
        return rows

    def rows(self, count: int, *, dp_rank: int = 0, dp_size: int = 1) -> dict[str, torch.Tensor]:
        """This rank's next ``count`` rows, stacked (``[count, seq_len]`` each)."""
        self._bind(dp_rank, dp_size)
        out = []
        for _ in range(count):
            while not self._packer.ready:
                self._read()
            out.append(self._packer.row())
        return {k: torch.stack([r[k] for r in out]) for k in out[0]} if out else {}

    def _bind(self, dp_rank: int, dp_size: int) -> None:
        if self._ranks is None:
            self._ranks = (dp_rank, dp_size)
        elif self._ranks != (dp_rank, dp_size):
            raise error("dp_rank", f"this stream is read as data-parallel rank {self._ranks[0]} of {self._ranks[1]} "
                                   f"(as its checkpoint or its first batch says), asked for rank {dp_rank} of "
                                   f"{dp_size}", "resume with the saved run's --dp; one StreamData per rank")

    def _read(self) -> None:
        """Read and tokenize the next examples (an epoch that ends starts the next)."""
        if self._iterator is None:
            self._iterator = self._open()
        examples, chars = [], 0
        for example in self._iterator:
            examples.append(example)
            chars += _size(example)
            if chars >= READ_CHARS or len(examples) >= READ_EXAMPLES:
                break
        self._position = self._dataset.state_dict()
        if not examples:
            if not self._read_this_epoch:
                rank, size = self._ranks or (0, 1)
                raise error(self.source.name, f"gives data-parallel rank {rank} of {size} no rows",
                            "a corpus with at least as many rows (or files) as data-parallel ranks")
            self._epoch, self._position, self._read_this_epoch = self._epoch + 1, None, 0
            self._iterator = self._open()
            return
        self._read_this_epoch += len(examples)
        for ids, labels in self._tokenized(examples):
            self._packer.add(ids, labels)

    def _open(self) -> Iterator[Mapping[str, Any]]:
        from datasets.distributed import split_dataset_by_node

        rank, size = self._ranks or (0, 1)
        if self._whole is None:
            self._whole = self.source.open()
        dataset = split_dataset_by_node(self._whole, rank=rank, world_size=size)  # a new object, from the start
        dataset.set_epoch(self._epoch)
        if self._position is not None:
            dataset.load_state_dict(self._position)
        self._dataset = dataset
        return iter(dataset)

    def _tokenized(self, examples: list[Mapping[str, Any]]) -> list[tuple[np.ndarray, np.ndarray]]:
        if self.format == "chat":
            return [render_chat(self.codec.tokenizer, ex.get("messages"), self.source.name) for ex in examples]
        texts = []
        for ex in examples:
            value = ex.get(self.source.text_field)
            if not isinstance(value, str | None):
                raise error(self.source.name, f"a row's {self.source.text_field!r} is {a(type(value).__name__)}, "
                                              "not a string", f"rows with a {self.source.text_field!r} string")
            if value:
                texts.append(value)
        out = []
        for ids in self.codec.encode_batch(texts):
            tokens = np.asarray([*ids, self.codec.eos_id], dtype=np.int64)
            out.append((tokens, tokens))
        return out

    # ----------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the ``datasets`` position after the last example read, the
        examples read and not yet emitted, the epoch and the next step."""
        rank, size = self._ranks or (0, 1)
        return {"kind": "stream", "fingerprint": self.fingerprint, "dp_rank": rank, "dp_size": size,
                "epoch": self._epoch, "dataset": self._position, "read_this_epoch": self._read_this_epoch,
                "packer": self._packer.state_dict(), "step": self._step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` (from :meth:`state_dict`) was saved; a
        :class:`~slapo_fn.errors.ScheduleError` if it was saved by another stream,
        tokenizer, ``seq_len`` or packing."""
        if state.get("kind") != "stream" or state.get("fingerprint") != self.fingerprint:
            raise ScheduleError("data", [Problem("state.fingerprint", f"the checkpoint's data is {state.get('kind')} "
                                                 f"{state.get('fingerprint')!r}, this stream {self.fingerprint!r}",
                                                 "resume with the corpus, tokenizer, --seq and format of the "
                                                 "saved run")])
        self._ranks = (int(state["dp_rank"]), int(state["dp_size"]))
        self._epoch, self._position = int(state["epoch"]), state["dataset"]
        self._read_this_epoch = int(state["read_this_epoch"])
        self._packer.load_state_dict(state["packer"])
        self._iterator, self._step = None, state["step"]
