"""Tokenizers as :mod:`slapo_fn.data` uses them (:class:`Codec`), and :func:`train_bpe`,
a byte-level BPE trained on the fly, offline, in seconds."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..errors import Problem, ScheduleError
from .encoder import Encoder
from .problems import a as _a
from .problems import error as _error

if TYPE_CHECKING:
    import tokenizers
    from transformers import PreTrainedTokenizerBase

__all__ = ["EOS_TOKEN", "Codec", "train_bpe"]

EOS_TOKEN = "<|endoftext|>"
"""The end-of-document token of tokenizers trained by :func:`train_bpe`."""

_EOS_NAMES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


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
    exported model; ``encoder`` the same tokenizer as a picklable value for worker
    processes (``None`` for a slow ``transformers`` tokenizer, which has no ``tokenizers``
    backend), and :attr:`fingerprint` says whether two codecs encode alike.

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
    encoder: Encoder | None = field(default=None, repr=False)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of the tokenizer (its ``tokenizers`` JSON, or its vocabulary where it has
        none), EOS and vocabulary size: equal for tokenizers that encode alike."""
        if self.encoder is not None:
            return self.encoder.fingerprint
        digest = hashlib.sha256(json.dumps(sorted(self.tokenizer.get_vocab().items())).encode())
        digest.update(f"/{self.eos_id}/{self.vocab}".encode())
        return digest.hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    @staticmethod
    def byte_level() -> Codec:
        def encode_batch(texts: Sequence[str]) -> list[list[int]]:
            return [list(t.encode("utf-8")) for t in texts]

        def decode(ids: Sequence[int]) -> str:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

        return Codec("bytes", 257, 256, encode_batch, decode, encoder=Encoder.byte_level())

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

    backend = getattr(tok, "backend_tokenizer", None)
    encoder = Encoder(backend.to_str(), eos, len(tok)) if backend is not None else None
    return Codec(name, len(tok), eos, encode_batch, decode, tok, encoder)


def _tokenizers_codec(tok: tokenizers.Tokenizer) -> Codec:
    eos = next((i for i in map(tok.token_to_id, _EOS_NAMES) if i is not None), None)
    if eos is None:
        raise _error("tokenizer", f"the tokenizer has none of the EOS tokens {', '.join(_EOS_NAMES)}",
                     f"add one: tokenizer.add_special_tokens([{EOS_TOKEN!r}])")

    def encode_batch(texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(ids: Sequence[int]) -> str:
        return tok.decode(list(ids), skip_special_tokens=False)

    vocab = tok.get_vocab_size(with_added_tokens=True)
    return Codec("tokenizers.Tokenizer", vocab, eos, encode_batch, decode, tok, Encoder(tok.to_str(), eos, vocab))

