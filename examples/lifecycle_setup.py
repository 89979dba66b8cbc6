"""The starting point of ``make demo``'s lifecycle: a tokenizer and an untrained model folder.

``python examples/lifecycle_setup.py demo-out/base`` trains a byte-level BPE tokenizer
(``slapo_fn.data.train_bpe``, seconds, offline) on the Python standard library's own
sources (``slapo_fn.data.stdlib_corpus``: real text that every machine has) and writes it,
with the ``config.json`` of a small LLaMA whose vocabulary is the tokenizer's, into the
folder. ``slapo-fn train --model demo-out/base --data stdlib`` then pre-trains that model
from random weights, tokenizing with the folder's tokenizer (it says it has no weights).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import LlamaConfig

from slapo_fn.data import stdlib_corpus, train_bpe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where the tokenizer files and config.json go")
    parser.add_argument("--vocab", type=int, default=1024, help="tokens of the BPE tokenizer")
    parser.add_argument("--corpus-bytes", type=int, default=1_000_000, help="stdlib bytes to train it on")
    args = parser.parse_args()
    tokenizer = train_bpe(stdlib_corpus(max_bytes=args.corpus_bytes), vocab_size=args.vocab, save_to=args.folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=False, use_cache=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.eos_token_id)
    config.save_pretrained(args.folder)
    print(f"{args.folder}: a {len(tokenizer)}-token BPE tokenizer trained on the standard library, and the "
          f"config.json of a {config.num_hidden_layers}-layer LLaMA (hidden {config.hidden_size}); no weights yet")


if __name__ == "__main__":
    main()
