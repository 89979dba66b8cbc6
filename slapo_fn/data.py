"""Training data for ``slapo-fn train`` and for training loops written in Python.

Three kinds of data, each a pure function of ``(seed, step)``, so that a resumed run sees
exactly the batches an uninterrupted one would:

* :class:`TokenData` — real text, tokenized and packed into fixed-length sequences with
  attention masks and labels, sharded over data-parallel ranks, with a held-out split.
  Sources: a text file, a folder of files, JSONL with a ``text`` field, a Hugging Face
  ``datasets`` dataset saved with ``save_to_disk``, or a list of strings (such as
  :func:`stdlib_corpus`, real text that every Python installation has). Tokenizers: a model
  folder's (``AutoTokenizer``), any ``transformers``/``tokenizers`` tokenizer, one trained
  on the fly by :func:`train_bpe`, or bytes (:meth:`Codec.byte_level`, needs nothing).
* :class:`Arithmetic` — sequences ``start, start+k, start+2k, … (mod vocab)``: a model
  learns to continue them within a few dozen steps, so the loss visibly falls.
* :class:`ByteText` — random windows of a text file, one token per byte (vocab 256).

Example:
    >>> batch = Arithmetic(vocab=32).batch(step=0, size=2, length=5)
    >>> batch.shape
    torch.Size([2, 5])
    >>> bool(((batch[:, 1] - batch[:, 0]) % 32 == (batch[:, 2] - batch[:, 1]) % 32).all())
    True

    >>> data = TokenData.from_texts(["one document", "and another"], seq_len=8)
    >>> data
    TokenData(3 train + 0 eval sequences of 8 tokens, vocab 257, seed 0, bytes)
    >>> sorted(data.batch(0, batch_size=2))
    ['attention_mask', 'input_ids', 'labels']

**Packing.** Documents are tokenized without special tokens and concatenated, each followed
by the EOS token: ``doc₀ EOS doc₁ EOS …``. The stream is cut into rows of ``seq_len``
tokens. A last partial row (at least 2 tokens) is kept, padded with EOS ids that have
``attention_mask`` 0 and ``labels`` -100; every other position has ``labels`` equal to
``input_ids`` (the Hugging Face convention: the model, or the loop, shifts by one, so
position ``i`` is trained to predict ``labels[i + 1]``). **Attention crosses documents**
within a row, as in GPT-2/GPT-3 pre-training: the EOS between two documents tells the model
that a new one begins, the masks stay 2-D (what every Hugging Face model accepts), and no
tokens are wasted on padding. Only padding is masked.

**Order.** Training rows are visited in a fresh permutation per epoch, drawn from ``seed``
and the epoch number. Global batch ``step`` is rows ``step·B … step·B + B - 1`` of that
endless sequence (``B`` is the *global* batch size); data-parallel rank ``r`` of ``n``
takes the ``r``-th of ``n`` equal slices of it, so the ranks' rows are disjoint and the
global batch does not depend on ``n``. (A batch that straddles two epochs may hold a row
twice, once from each epoch; with a ``B`` that divides the training rows, none does.)
Nothing is consumed: :meth:`TokenData.batch` is a pure function of ``step``, and resuming
is calling it with the next step (:meth:`TokenData.state` / :meth:`TokenData.resume` check
that a checkpoint's data is this data).

**Held-out split.** The last ``ceil(eval_fraction · rows)`` rows of the corpus, in corpus
order and independent of the seed, so eval losses of runs with different seeds compare.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sysconfig
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch

from .errors import Problem, ScheduleError

if TYPE_CHECKING:
    import datasets
    import tokenizers
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "IGNORE_INDEX",
    "Arithmetic",
    "Batch",
    "ByteText",
    "Codec",
    "Dataset",
    "TokenData",
    "read_documents",
    "stdlib_corpus",
    "train_bpe",
]

IGNORE_INDEX = -100
"""The label of a position that predicts nothing (``torch.nn.functional.cross_entropy``'s default)."""

EOS_TOKEN = "<|endoftext|>"
"""The end-of-document token of tokenizers trained by :func:`train_bpe`."""

_EOS_NAMES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
_SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
_MAX_LISTED = 5  # row problems listed one by one before the rest are counted


# --------------------------------------------------------------------------- synthetic and byte-level


@dataclass(frozen=True)
class Arithmetic:
    vocab: int
    seed: int = 0
    max_step: int = 8

    def batch(self, step: int, size: int, length: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab, (size, 1), generator=gen)
        stride = torch.randint(1, self.max_step, (size, 1), generator=gen)
        return (start + stride * torch.arange(length)) % self.vocab


@dataclass(frozen=True)
class ByteText:
    data: bytes
    seed: int = 0

    @staticmethod
    def from_file(path: str | Path, seed: int = 0) -> ByteText:
        data = Path(path).read_bytes()
        if len(data) < 2:
            raise ValueError(f"{path}: a text file of at least 2 bytes is needed, got {len(data)}")
        return ByteText(data, seed)

    @property
    def vocab(self) -> int:
        return 256

    @functools.cached_property
    def _tokens(self) -> torch.Tensor:
        """The file's bytes as a uint8 tensor, made once (``batch`` runs every step)."""
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8)

    def batch(self, step: int, size: int, length: int) -> torch.Tensor:
        tokens = self._tokens
        if tokens.numel() <= length:
            tokens = tokens.repeat(length // tokens.numel() + 2)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, tokens.numel() - length, (size,), generator=gen)
        return torch.stack([tokens[s : s + length] for s in starts.tolist()]).long()


Dataset = Arithmetic | ByteText


# --------------------------------------------------------------------------- errors


def _error(path: object, reason: str, fix: str) -> ScheduleError:
    return ScheduleError("data", [Problem(str(path), reason, fix)])


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


def _raise_all(problems: list[Problem]) -> None:
    if problems:
        shown = problems[:_MAX_LISTED]
        if len(problems) > _MAX_LISTED:
            shown.append(Problem(problems[_MAX_LISTED].path, f"and {len(problems) - _MAX_LISTED} more like these"))
        raise ScheduleError("data", shown)


# --------------------------------------------------------------------------- sources


def read_documents(source: str | Path | Sequence[str] | datasets.Dataset | datasets.DatasetDict, *,
                   text_field: str = "text") -> list[str]:
    """The documents of ``source``, in a fixed order; empty documents are left out.

    * a text file: one document (read as UTF-8);
    * a ``.jsonl``/``.ndjson``/``.json`` file: one document per row's ``text_field``
      (``.json`` may also hold one JSON list of rows);
    * a folder saved by ``datasets``' ``save_to_disk``: its rows' ``text_field`` (of a
      ``DatasetDict``, the ``"train"`` split), read with ``datasets.load_from_disk``;
    * any other folder: every file under it, by sorted relative path (hidden files and
      ``__pycache__`` skipped), each read as above by its suffix;
    * a ``datasets.Dataset``/``DatasetDict`` object: as a saved one;
    * a list or tuple of strings: the documents themselves.

    Raises :class:`~slapo_fn.errors.ScheduleError` naming the path, the reason and a fix
    for a missing path, a file that is not UTF-8, a row without ``text_field`` and a
    source without any text.

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "b.jsonl").write_text('{"text": "second"}\\n{"text": "third"}\\n')
        >>> _ = (folder / "a.txt").write_text("first")
        >>> read_documents(folder)
        ['first', 'second', 'third']
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise _error(path, "no such file or folder",
                         "the path of a text file, a folder of them, a JSONL file with a 'text' field, or a "
                         "dataset saved with datasets' save_to_disk")
        docs = _read_folder(path, text_field) if path.is_dir() else _read_file(path, text_field)
        where: object = path
    elif isinstance(source, (list, tuple)):
        bad = [Problem(f"<documents>[{i}]", f"is {_a(type(d).__name__)}, not a string", "pass strings only")
               for i, d in enumerate(source) if not isinstance(d, str)]
        _raise_all(bad)
        docs, where = list(source), "<documents>"
    elif hasattr(source, "column_names"):  # a datasets.Dataset or DatasetDict object
        docs, where = _read_dataset(source, "<dataset>", text_field), "<dataset>"
    else:
        raise ScheduleError("data", [Problem("<source>", f"{_a(type(source).__name__)} is not a data source",
                                             "a path (str or Path), a list of strings, or a datasets.Dataset")])
    docs = [d for d in docs if d]
    if not docs:
        raise _error(where, "holds no text (no document with at least one character)",
                     "point at a corpus with text in it, or use slapo_fn.data.stdlib_corpus() for a demo")
    return docs


def _read_file(path: Path, text_field: str) -> list[str]:
    text = _read_text(path)
    if path.suffix.lower() in _JSON_SUFFIXES:
        return _json_rows(path, text, text_field)
    return [text]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _error(path, f"is not UTF-8 text ({e.reason} at byte {e.start})",
                     "convert it to UTF-8, or move it out of the corpus") from None
    except OSError as e:
        raise _error(path, f"cannot be read ({e.strerror})", "make it readable") from None


def _json_rows(path: Path, text: str, text_field: str) -> list[str]:
    rows: list[tuple[str, Any]] = []  # (where, the row, or a Problem if the line is not JSON)
    whole: Any = None
    if path.suffix.lower() == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # not one JSON value: read it as JSON lines
    if isinstance(whole, list):
        rows = [(f"{path}[{i}]", row) for i, row in enumerate(whole)]
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((f"{path}:{number}", json.loads(line)))
                except json.JSONDecodeError as e:
                    rows.append((f"{path}:{number}", Problem(f"{path}:{number}", f"is not JSON ({e.msg})",
                                                             "one JSON object per line, e.g. {\"text\": \"...\"}")))
    docs = []
    problems: list[Problem] = []
    for where, row in rows:
        if isinstance(row, Problem):
            problems.append(row)
            continue
        value = row.get(text_field) if isinstance(row, dict) else None
        if isinstance(value, str):
            docs.append(value)
            continue
        if not isinstance(row, dict):
            reason = f"is {_a(type(row).__name__)} (JSON), not an object with a {text_field!r} field"
        elif text_field not in row:
            reason = f"has no {text_field!r} field (fields: {', '.join(map(str, row)) or 'none'})"
        else:
            reason = f"its {text_field!r} is {_a(type(value).__name__)}, not a string"
        fields = [k for k, v in row.items() if isinstance(v, str)] if isinstance(row, dict) else []
        fix = f'give each row a "{text_field}" string'
        if fields and text_field not in row:
            fix += f", or read another field: text_field={fields[0]!r}"
        problems.append(Problem(where, reason, fix))
    _raise_all(problems)
    return docs


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def _read_folder(path: Path, text_field: str) -> list[str]:
    if _is_saved_dataset(path):
        try:
            import datasets
        except ImportError:
            raise _error(path, "is a dataset saved by the `datasets` library, which is not installed",
                         "pip install 'slapo_fn[hf]' (or pip install datasets)") from None
        return _read_dataset(datasets.load_from_disk(str(path)), path, text_field)
    docs: list[str] = []
    for file in _walk(path):
        docs += _read_file(file, text_field)
    return docs


def _walk(root: Path, suffix: str | None = None) -> Iterator[Path]:
    """Files under ``root`` in sorted order, files of a folder before its subfolders."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIPPED_DIRS)
        for name in sorted(files):
            if not name.startswith(".") and (suffix is None or name.endswith(suffix)):
                yield Path(folder, name)


def _read_dataset(dataset: Any, where: object, text_field: str) -> list[str]:
    if not hasattr(dataset, "features"):  # a DatasetDict: take its training split
        if "train" not in dataset:
            raise _error(where, f"is a DatasetDict without a 'train' split (splits: {', '.join(dataset)})",
                         "save the training split (dataset['name'].save_to_disk(...)), or name it 'train'")
        dataset = dataset["train"]
    if text_field not in dataset.column_names:
        strings = [c for c, f in dataset.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
        fix = f"a dataset with a {text_field!r} column"
        if strings:
            fix += f", or read another column: text_field={strings[0]!r}"
        raise _error(where, f"has no {text_field!r} column (columns: {', '.join(dataset.column_names)})", fix)
    return [t for t in dataset[text_field] if isinstance(t, str)]


def stdlib_corpus(max_bytes: int | None = 4_000_000) -> list[str]:
    """The Python standard library's own ``.py`` sources: real text that every machine has.

    Files come in a fixed order (sorted names, a folder's files before its subfolders;
    ``site-packages`` and ``__pycache__`` skipped; files that are not UTF-8 skipped), one
    document each, until ``max_bytes`` are read (``None``: all, tens of MB); the file that
    reaches the cap is cut after its last whole line that fits. The same Python version
    gives the same corpus.

    Example:
        >>> docs = stdlib_corpus(max_bytes=100_000)
        >>> 0 < sum(len(d.encode()) for d in docs) <= 100_000
        True
    """
    docs: list[str] = []
    total = 0
    for file in _walk(Path(sysconfig.get_paths()["stdlib"]), ".py"):
        raw = file.read_bytes()
        full = max_bytes is not None and total + len(raw) >= max_bytes
        if max_bytes is not None and total + len(raw) > max_bytes:
            raw = raw[: raw.rfind(b"\n", 0, max_bytes - total) + 1]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text:
            docs.append(text)
        total += len(raw)
        if full:
            break
    return docs


# --------------------------------------------------------------------------- tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int = 1024, *, min_frequency: int = 2,
              save_to: str | Path | None = None) -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer trained on ``texts`` with ``tokenizers``, in seconds, offline.

    It has ``vocab_size`` tokens (fewer if the texts have too few distinct pairs), the 256
    byte symbols among them, so it encodes any text and decodes it back exactly, and one
    special token, ``<|endoftext|>``, its EOS and padding token. The same texts give the
    same tokenizer. With ``save_to``, it is also saved there as a folder that
    ``AutoTokenizer.from_pretrained`` (and :meth:`TokenData.from_source`) load.

    Example:
        >>> tok = train_bpe(["def f(x):\\n    return x + 1\\n"] * 20, vocab_size=300)
        >>> tok.decode(tok.encode("def g(y): return y"))
        'def g(y): return y'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        raise ScheduleError("data", [Problem("vocab_size", f"{vocab_size} leaves no room for merges: the byte "
                                             f"alphabet and EOS take {len(alphabet) + 1} tokens",
                                             "vocab_size=512 to 2048 for a small model")])
    docs = [t for t in texts if t]
    if not docs:
        raise _error("<texts>", "no text to train a tokenizer on", "pass a non-empty corpus")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    if save_to is not None:
        fast.save_pretrained(str(save_to))
    return fast


@dataclass(frozen=True, eq=False)
class Codec:
    """A tokenizer as :class:`TokenData` uses it: batch encoding, decoding, vocabulary, EOS.

    Make one with :meth:`of` (from a model folder or a tokenizer object) or
    :meth:`byte_level` (UTF-8 bytes 0–255 and EOS 256, needs no library).
    ``tokenizer`` is the object it wraps (``None`` for bytes), e.g. to save it beside an
    exported model.

    Example:
        >>> codec = Codec.byte_level()
        >>> codec.encode("hé"), codec.eos_id, codec.vocab
        ([104, 195, 169], 256, 257)
        >>> codec.decode([104, 195, 169, 256])
        'hé'
    """

    name: str
    vocab: int
    eos_id: int
    encode_batch: Callable[[Sequence[str]], list[list[int]]] = field(repr=False)
    decode: Callable[[Sequence[int]], str] = field(repr=False)
    tokenizer: Any = field(default=None, repr=False)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    @staticmethod
    def byte_level() -> Codec:
        def encode_batch(texts: Sequence[str]) -> list[list[int]]:
            return [list(t.encode("utf-8")) for t in texts]

        def decode(ids: Sequence[int]) -> str:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

        return Codec("bytes", 257, 256, encode_batch, decode)

    @staticmethod
    def of(tokenizer: PreTrainedTokenizerBase | tokenizers.Tokenizer | Codec | str | Path | None) -> Codec:
        """``tokenizer`` as a codec: ``None`` gives bytes; a folder path is read with
        ``AutoTokenizer.from_pretrained`` (nothing is downloaded)."""
        if tokenizer is None:
            return Codec.byte_level()
        if isinstance(tokenizer, Codec):
            return tokenizer
        if isinstance(tokenizer, (str, Path)):
            return _folder_codec(Path(tokenizer))
        if hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "token_to_id"):  # a tokenizers.Tokenizer
            return _tokenizers_codec(cast("tokenizers.Tokenizer", tokenizer))
        if hasattr(tokenizer, "convert_tokens_to_ids"):  # a transformers tokenizer
            return _transformers_codec(cast("PreTrainedTokenizerBase", tokenizer), type(tokenizer).__name__)
        raise ScheduleError("data", [Problem("tokenizer", f"{_a(type(tokenizer).__name__)} is not a tokenizer",
                                             "a model folder, a transformers or tokenizers tokenizer, or None "
                                             "for bytes")])


def _folder_codec(folder: Path) -> Codec:
    if not folder.is_dir():
        raise _error(folder, "no such tokenizer folder (nothing is downloaded)",
                     "a folder with tokenizer files (e.g. a model saved with save_pretrained), or train one "
                     "with slapo_fn.data.train_bpe(texts, save_to=folder)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise _error(folder, f"holds no tokenizer AutoTokenizer can load ({str(e).splitlines()[0]})",
                     "a folder with tokenizer.json (or the files of a slow tokenizer) and tokenizer_config.json"
                     ) from None
    return _transformers_codec(tok, str(folder))


def _transformers_codec(tok: PreTrainedTokenizerBase, name: str) -> Codec:
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    if not isinstance(eos, int):
        raise _error(name, "the tokenizer has no EOS (or SEP) token to put between documents",
                     "add one: tokenizer.add_special_tokens({'eos_token': '<|endoftext|>'})")

    def encode_batch(texts: Sequence[str]) -> list[list[int]]:
        ids: Any = tok(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [list(map(int, row)) for row in ids]

    def decode(ids: Sequence[int]) -> str:
        return str(tok.decode(list(ids)))

    return Codec(name, len(tok), eos, encode_batch, decode, tok)


def _tokenizers_codec(tok: tokenizers.Tokenizer) -> Codec:
    eos = next((i for i in map(tok.token_to_id, _EOS_NAMES) if i is not None), None)
    if eos is None:
        raise _error("tokenizer", f"the tokenizer has none of the EOS tokens {', '.join(_EOS_NAMES)}",
                     f"add one: tokenizer.add_special_tokens([{EOS_TOKEN!r}])")

    def encode_batch(texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(ids: Sequence[int]) -> str:
        return tok.decode(list(ids), skip_special_tokens=False)

    return Codec("tokenizers.Tokenizer", tok.get_vocab_size(with_added_tokens=True), eos, encode_batch, decode, tok)


# --------------------------------------------------------------------------- packed, sharded, resumable


class Batch(TypedDict):
    """One data-parallel rank's share of a global batch, ``[rows, seq_len]`` int64 each:
    the keyword arguments of a Hugging Face causal LM (``model(**batch).loss``)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


def _check_int(name: str, value: object, low: int, fix: str) -> list[Problem]:
    if isinstance(value, bool) or not isinstance(value, int):
        return [Problem(name, f"must be an int, got {type(value).__name__} {value!r}", fix)]
    return [] if value >= low else [Problem(name, f"must be at least {low}, got {value}", fix)]


def _check_options(seq_len: object, seed: object, eval_fraction: object) -> None:
    problems = _check_int("seq_len", seq_len, 2, "seq_len=2 or more tokens per row (e.g. 128)")
    problems += _check_int("seed", seed, 0, "a non-negative int seed, e.g. seed=0")
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) \
            or not 0 <= eval_fraction < 1:
        problems.append(Problem("eval_fraction", f"must be a number in [0, 1), got {eval_fraction!r}",
                                "eval_fraction=0.05 holds out the last 5% of rows; 0 holds out none"))
    _raise_all(problems)


@functools.lru_cache(maxsize=8)
def _permutation(rows: int, seed: int, epoch: int) -> torch.Tensor:
    """Epoch ``epoch``'s order of ``rows`` training rows; a pure function of its arguments."""
    digest = hashlib.sha256(f"slapo_fn.data/{seed}/{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.randperm(rows, generator=gen)


@dataclass(frozen=True, eq=False)
class TokenData:
    """Tokenized text packed into rows of ``seq_len`` tokens: sharded, deterministic, resumable.

    Build it with :meth:`from_source`, :meth:`from_texts` or :meth:`from_token_ids`; ask it
    for :meth:`batch` ``(step, …)`` on every data-parallel rank, and for
    :meth:`eval_batches`. See the module docstring for how rows are packed, ordered and
    held out.

    Example:
        >>> data = TokenData.from_texts(["abcdef", "ghij"], seq_len=4, seed=1)
        >>> rows = data.batch(0, batch_size=3)["input_ids"]
        >>> data.codec.decode(rows[rows != data.eos_id].tolist()) != ""
        True
        >>> a = data.batch(5, batch_size=2, dp_rank=0, dp_size=2)["input_ids"]
        >>> b = data.batch(5, batch_size=2, dp_rank=1, dp_size=2)["input_ids"]
        >>> torch.equal(torch.cat([a, b]), data.batch(5, batch_size=2)["input_ids"])
        True
    """

    rows: torch.Tensor = field(repr=False)
    """``[n, seq_len]`` token ids (int32), training rows first, then the held-out ones."""
    lengths: torch.Tensor = field(repr=False)
    """``[n]`` real (unpadded) tokens per row; only the corpus's last row may be short."""
    n_train: int
    eos_id: int
    vocab: int
    seed: int = 0
    codec: Codec = field(default_factory=Codec.byte_level, repr=False)

    def __repr__(self) -> str:
        return (f"TokenData({self.n_train} train + {self.n_eval} eval sequences of {self.seq_len} tokens, "
                f"vocab {self.vocab}, seed {self.seed}, {self.codec.name})")

    # ----------------------------------------------------------------- building

    @classmethod
    def from_source(cls, source: str | Path | Sequence[str] | datasets.Dataset | datasets.DatasetDict,
                    tokenizer: PreTrainedTokenizerBase | tokenizers.Tokenizer | Codec | str | Path | None = None,
                    *, seq_len: int, seed: int = 0, eval_fraction: float = 0.0,
                    text_field: str = "text") -> TokenData:
        """Read ``source`` (see :func:`read_documents`), tokenize and pack it.

        ``tokenizer``: a model or tokenizer folder (``AutoTokenizer.from_pretrained``), a
        ``transformers`` or ``tokenizers`` tokenizer, a :class:`Codec`, or ``None`` for
        bytes (vocabulary 257: 256 bytes and EOS).

        Example:
            >>> import tempfile, pathlib
            >>> file = pathlib.Path(tempfile.mkdtemp()) / "corpus.jsonl"
            >>> _ = file.write_text('{"text": "hello"}\\n{"text": "world"}\\n')
            >>> data = TokenData.from_source(file, seq_len=4)
            >>> data.rows[0].tolist(), data.eos_id
            ([104, 101, 108, 108], 256)
        """
        _check_options(seq_len, seed, eval_fraction)
        codec = Codec.of(tokenizer)  # a bad tokenizer fails before a large corpus is read
        return cls.from_texts(read_documents(source, text_field=text_field), codec, seq_len=seq_len, seed=seed,
                              eval_fraction=eval_fraction)

    @classmethod
    def from_texts(cls, texts: Iterable[str],
                   tokenizer: PreTrainedTokenizerBase | tokenizers.Tokenizer | Codec | str | Path | None = None,
                   *, seq_len: int, seed: int = 0, eval_fraction: float = 0.0,
                   chunk: int = 512) -> TokenData:
        """Tokenize ``texts`` (documents, in order; empty ones left out) ``chunk`` at a time and pack them."""
        _check_options(seq_len, seed, eval_fraction)
        codec = Codec.of(tokenizer)
        docs = [t for t in texts if t]
        if not docs:
            raise _error("<texts>", "holds no text (no document with at least one character)",
                         "pass a non-empty corpus, e.g. slapo_fn.data.stdlib_corpus()")
        ids = (row for start in range(0, len(docs), chunk) for row in codec.encode_batch(docs[start:start + chunk]))
        return cls.from_token_ids(ids, eos_id=codec.eos_id, vocab=codec.vocab, seq_len=seq_len, seed=seed,
                                  eval_fraction=eval_fraction, codec=codec)

    @classmethod
    def from_token_ids(cls, documents: Iterable[Sequence[int]], *, eos_id: int, vocab: int, seq_len: int,
                       seed: int = 0, eval_fraction: float = 0.0, codec: Codec | None = None) -> TokenData:
        """Pack already tokenized documents: ``doc₀ EOS doc₁ EOS …`` cut into rows of ``seq_len``.

        Example:
            >>> data = TokenData.from_token_ids([[1, 2, 3], [4, 5]], eos_id=0, vocab=6, seq_len=4)
            >>> data.rows.tolist(), data.lengths.tolist()
            ([[1, 2, 3, 0], [4, 5, 0, 0]], [4, 3])
        """
        _check_options(seq_len, seed, eval_fraction)
        problems = _check_int("vocab", vocab, 1, "the tokenizer's vocabulary size")
        if not problems and not (isinstance(eos_id, int) and 0 <= eos_id < vocab):
            problems.append(Problem("eos_id", f"{eos_id!r} is not a token id below vocab {vocab}",
                                    "the tokenizer's EOS id"))
        _raise_all(problems)
        stream = array("q")
        for doc in documents:
            if len(doc):
                stream.extend(doc)
                stream.append(eos_id)
        if not stream:
            raise _error("<documents>", "holds no tokens (every document is empty)", "pass a non-empty corpus")
        tokens = torch.frombuffer(stream, dtype=torch.int64)
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            raise _error("<documents>", f"has token ids outside [0, {vocab}): {int(tokens.min())}..{int(tokens.max())}",
                         "encode with the tokenizer whose vocabulary is given")
        full, rest = divmod(tokens.numel(), seq_len)
        if rest >= 2:  # a last partial row that still predicts something: pad it
            tokens = torch.cat([tokens, tokens.new_full((seq_len - rest,), eos_id)])
        rows = tokens[: (full + (rest >= 2)) * seq_len].view(-1, seq_len).to(torch.int32)
        lengths = torch.full((rows.shape[0],), seq_len, dtype=torch.int64)
        if rest >= 2:
            lengths[-1] = rest
        n_eval = math.ceil(eval_fraction * rows.shape[0])
        if n_eval >= rows.shape[0]:
            raise _error("<documents>", f"packs into {rows.shape[0]} row(s) of {seq_len} tokens, too few to hold "
                                        f"out {eval_fraction:.0%} and still train",
                         "a larger corpus, a shorter seq_len, or a smaller eval_fraction")
        return cls(rows, lengths, rows.shape[0] - n_eval, eos_id, vocab, seed,
                   codec if codec is not None else Codec.byte_level())

    # ----------------------------------------------------------------- sizes

    @property
    def seq_len(self) -> int:
        return int(self.rows.shape[1])

    @property
    def n_eval(self) -> int:
        return int(self.rows.shape[0]) - self.n_train

    def steps_per_epoch(self, batch_size: int) -> int:
        """Full global batches in one pass over the training rows (batches run on across epochs)."""
        return self.n_train // batch_size

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of the packed rows and the split: equal for the same corpus, tokenizer and ``seq_len``."""
        digest = hashlib.sha256(self.rows.numpy().tobytes())
        digest.update(self.lengths.numpy().tobytes())
        digest.update(f"{self.n_train}/{self.eos_id}/{self.vocab}".encode())
        return digest.hexdigest()[:16]

    # ----------------------------------------------------------------- batches

    def batch(self, step: int, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """Data-parallel rank ``dp_rank``'s ``batch_size // dp_size`` rows of global batch ``step``.

        ``batch_size`` is the global batch (all ranks together). A pure function of its
        arguments and the seed: call it with the step number, also after a resume.
        """
        problems = _check_int("step", step, 0, "the 0-based step number")
        problems += self._check_dp(batch_size, dp_rank, dp_size)
        _raise_all(problems)
        local = batch_size // dp_size
        start = step * batch_size + dp_rank * local
        positions = torch.arange(start, start + local)
        epochs, within = positions // self.n_train, positions % self.n_train
        index = torch.empty_like(positions)
        for epoch in epochs.unique().tolist():
            chosen = epochs == epoch
            index[chosen] = _permutation(self.n_train, self.seed, epoch)[within[chosen]]
        return self._batch(index)

    def eval_batches(self, batch_size: int, *, dp_rank: int = 0, dp_size: int = 1) -> Iterator[Batch]:
        """The held-out rows in corpus order, ``n_eval // batch_size`` global batches (a
        remainder smaller than one batch is left out), rank ``dp_rank``'s share of each.

        Every rank gets the same number of batches, so a loop can all-reduce after each.
        """
        problems = self._check_dp(batch_size, dp_rank, dp_size)
        if not problems and self.n_eval < batch_size:
            problems.append(Problem("eval_fraction", f"holds out {self.n_eval} row(s), fewer than one batch of "
                                    f"{batch_size}", "a larger eval_fraction, or a smaller eval batch"))
        _raise_all(problems)
        local = batch_size // dp_size
        for b in range(self.n_eval // batch_size):
            start = self.n_train + b * batch_size + dp_rank * local
            yield self._batch(torch.arange(start, start + local))

    def _check_dp(self, batch_size: int, dp_rank: int, dp_size: int) -> list[Problem]:
        problems = _check_int("batch_size", batch_size, 1, "the global batch size, in rows")
        problems += _check_int("dp_size", dp_size, 1, "the number of data-parallel ranks")
        if not problems and batch_size % dp_size:
            fit = dp_size * max(1, batch_size // dp_size)
            problems.append(Problem("batch_size", f"{batch_size} rows do not split evenly over {dp_size} "
                                    "data-parallel ranks", f"a multiple of {dp_size}, e.g. {fit}"))
        if not problems and not (isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
            problems.append(Problem("dp_rank", f"{dp_rank!r} is not a rank of {dp_size}", f"0 to {dp_size - 1}"))
        return problems

    def _batch(self, index: torch.Tensor) -> Batch:
        input_ids = self.rows[index].long()
        mask = torch.arange(self.seq_len) < self.lengths[index, None]
        return Batch(input_ids=input_ids, attention_mask=mask.long(),
                     labels=input_ids.masked_fill(~mask, IGNORE_INDEX))

    # ----------------------------------------------------------------- resume

    def state(self, step: int, batch_size: int) -> dict[str, int | str]:
        """What a checkpoint saved after ``step`` steps stores about the data.

        ``position`` counts the global rows consumed; the rest identifies the data, so
        that :meth:`resume` can refuse a checkpoint of other data.

        Example:
            >>> data = TokenData.from_texts(["some text to train on"], seq_len=4)
            >>> saved = data.state(step=3, batch_size=2)
            >>> saved["position"], data.resume(saved, batch_size=2)
            (6, 3)
        """
        _raise_all(_check_int("step", step, 0, "the number of steps done") +
                   _check_int("batch_size", batch_size, 1, "the global batch size, in rows"))
        position = step * batch_size
        return {"position": position, "epoch": position // self.n_train, "seed": self.seed,
                "seq_len": self.seq_len, "fingerprint": self.fingerprint}

    def resume(self, state: Mapping[str, object], batch_size: int) -> int:
        """The step to continue at after ``state`` (from :meth:`state`); the next batch
        is ``batch(step, batch_size, …)``, the one the uninterrupted run would have seen.

        Raises :class:`~slapo_fn.errors.ScheduleError` listing what differs if ``state``
        was saved with another corpus, tokenizer, ``seq_len`` or seed, or at a position
        ``batch_size`` does not divide.
        """
        problems = []
        for key, mine in (("fingerprint", self.fingerprint), ("seq_len", self.seq_len), ("seed", self.seed)):
            if state.get(key) != mine:
                problems.append(Problem(f"state.{key}", f"the checkpoint's data has {key} "
                                        f"{state.get(key)!r}, this data {mine!r}",
                                        "resume with the corpus, tokenizer, seq_len, seed and eval_fraction "
                                        "of the saved run"))
        saved = state.get("position")
        position = saved if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 0 else -1
        problems += _check_int("batch_size", batch_size, 1, "the saved run's global batch size")
        if position < 0:
            problems.append(Problem("state.position", f"{saved!r} is not a row count",
                                    "a state returned by TokenData.state"))
        elif not problems and position % batch_size:
            problems.append(Problem("batch_size", f"{batch_size} does not divide the {position} rows consumed",
                                    "resume with the saved run's global batch size"))
        _raise_all(problems)
        return position // batch_size
