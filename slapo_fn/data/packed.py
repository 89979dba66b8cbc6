"""TokenData: real text, tokenized in memory and packed into fixed-length sequences with
attention masks and labels, sharded over data-parallel ranks, with a held-out split: a pure
function of ``(seed, step)``, so that a resumed run sees exactly the batches an
uninterrupted one would. For the small corpora that fit in every rank's memory (the
``stdlib`` demo, a fine-tuning set of a few MB); see :mod:`slapo_fn.data` for the rest.

Sources: a text file, a folder of files, JSONL with a ``text`` field, a Hugging Face
``datasets`` dataset saved with ``save_to_disk``, or a list of strings (such as
:func:`~slapo_fn.data.stdlib_corpus`). Tokenizers: see :class:`~slapo_fn.data.Codec`.

Example:
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
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from ..errors import Problem
from .codec import Codec
from .order import PositionalRows
from .problems import check_int as _check_int
from .problems import error as _error
from .problems import raise_all as _raise_all
from .sources import read_documents

if TYPE_CHECKING:
    import datasets
    import tokenizers
    from transformers import PreTrainedTokenizerBase

__all__ = ["IGNORE_INDEX", "Batch", "TokenData"]

IGNORE_INDEX = -100
"""The label of a position that predicts nothing (``torch.nn.functional.cross_entropy``'s default)."""


class Batch(TypedDict):
    """One data-parallel rank's share of a global batch, ``[rows, seq_len]`` int64 each:
    the keyword arguments of a Hugging Face causal LM (``model(**batch).loss``)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


def check_options(seq_len: object, seed: object, eval_fraction: object) -> None:
    """Refuse a ``seq_len`` under 2, a negative ``seed`` or an ``eval_fraction`` outside [0, 1)."""
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
class TokenData(PositionalRows):
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
        >>> saved = data.state(step=3, batch_size=2)
        >>> saved["position"], data.resume(saved, batch_size=2)
        (6, 3)
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
        check_options(seq_len, seed, eval_fraction)
        codec = Codec.of(tokenizer)  # a bad tokenizer fails before a large corpus is read
        return cls.from_texts(read_documents(source, text_field=text_field), codec, seq_len=seq_len, seed=seed,
                              eval_fraction=eval_fraction)

    @classmethod
    def from_texts(cls, texts: Iterable[str],
                   tokenizer: PreTrainedTokenizerBase | tokenizers.Tokenizer | Codec | str | Path | None = None,
                   *, seq_len: int, seed: int = 0, eval_fraction: float = 0.0,
                   chunk: int = 512) -> TokenData:
        """Tokenize ``texts`` (documents, in order; empty ones left out) ``chunk`` at a time and pack them."""
        check_options(seq_len, seed, eval_fraction)
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
        check_options(seq_len, seed, eval_fraction)
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

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of the packed rows and the split: equal for the same corpus, tokenizer and ``seq_len``."""
        digest = hashlib.sha256(self.rows.numpy().tobytes())
        digest.update(self.lengths.numpy().tobytes())
        digest.update(f"{self.n_train}/{self.eos_id}/{self.vocab}".encode())
        return digest.hexdigest()[:16]

    # ----------------------------------------------------------------- rows

    def _order(self, epoch: int, within: torch.Tensor) -> torch.Tensor:
        return _permutation(self.n_train, self.seed, epoch)[within]

    def _rows(self, index: torch.Tensor) -> Batch:
        input_ids = self.rows[index].long()
        mask = torch.arange(self.seq_len) < self.lengths[index, None]
        return Batch(input_ids=input_ids, attention_mask=mask.long(),
                     labels=input_ids.masked_fill(~mask, IGNORE_INDEX))
