"""Training data for ``slapo-fn train`` and for training loops written in Python.

Every kind gives :func:`slapo_fn.train.train` what it reads: ``batch(step, batch_size,
dp_rank=, dp_size=)``, this data-parallel rank's rows of global batch ``step`` (a dict of
``input_ids``, ``labels`` and ``attention_mask`` or ``position_ids``), and what it needs to
resume: a pure function of ``(seed, step)``, or a position saved in the checkpoint.

Which to use:

* :class:`TokenData` — a small corpus (up to some hundred MB: the ``stdlib`` demo, a
  fine-tuning set), read and tokenized in memory on every rank; shuffled rows and a
  held-out split.
* :func:`prepare` then :class:`PreparedData` — pre-training corpora of any size,
  tokenized once in parallel worker processes into a memory-mapped token file (as
  Megatron-LM's ``.bin``/``.idx``); training maps it, starts in seconds and each rank
  reads only its own rows, in a fresh order every epoch.
* :class:`StreamData` — a large folder, JSONL or parquet set, or a ``datasets`` dataset
  that was not prepared: streamed with ``datasets``' iterable mode, split between
  data-parallel ranks by ``split_dataset_by_node``, tokenized and packed on the fly (as
  torchtitan's Hugging Face datasets); its position is saved in the checkpoint.
* :class:`Mixture` — several of the above sampled by weight, per row, deterministically
  from the seed and the step.
* chat JSONL (rows of ``messages``) in a stream or a mixture — rendered with the
  tokenizer's chat template, loss on the assistant turns only, examples packed apart
  (:mod:`slapo_fn.data.chat`).
* :class:`Arithmetic` and :class:`ByteText` — synthetic and byte-level data for demos.

Names are imported on first use (this package imports neither torch nor ``datasets`` by
itself), so that :func:`prepare`'s worker processes start light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .codec import EOS_TOKEN, Codec, train_bpe
    from .loading import data_problems, open_data
    from .manifest import Manifest
    from .mixture import Cursor, Mixture
    from .packed import IGNORE_INDEX, Batch, TokenData
    from .prepared import PreparedData
    from .preparing import prepare
    from .sources import read_documents, stdlib_corpus
    from .stream import StreamData, StreamSource
    from .synthetic import Arithmetic, ByteText, Dataset

#: Where each public name lives.
_EXPORTS: dict[str, str] = {
    "EOS_TOKEN": ".codec",
    "Codec": ".codec",
    "train_bpe": ".codec",
    "IGNORE_INDEX": ".packed",
    "Batch": ".packed",
    "TokenData": ".packed",
    "Manifest": ".manifest",
    "Cursor": ".mixture",
    "Mixture": ".mixture",
    "StreamData": ".stream",
    "StreamSource": ".stream",
    "data_problems": ".loading",
    "open_data": ".loading",
    "PreparedData": ".prepared",
    "prepare": ".preparing",
    "read_documents": ".sources",
    "stdlib_corpus": ".sources",
    "Arithmetic": ".synthetic",
    "ByteText": ".synthetic",
    "Dataset": ".synthetic",
}

__all__ = [
    "EOS_TOKEN",
    "IGNORE_INDEX",
    "Arithmetic",
    "Batch",
    "ByteText",
    "Codec",
    "Cursor",
    "Dataset",
    "Manifest",
    "Mixture",
    "PreparedData",
    "StreamData",
    "StreamSource",
    "TokenData",
    "data_problems",
    "open_data",
    "prepare",
    "read_documents",
    "stdlib_corpus",
    "train_bpe",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
