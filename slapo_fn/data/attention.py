"""Which packing keeps a model family's examples apart: asked of the model, not of its name.

Hugging Face's LLaMA-family models (transformers 5.x ``masking_utils``) read per-example
``position_ids`` without an ``attention_mask`` and without a cache as packed sequences and
mask attention block-diagonally; GPT-2, whose positions are learned and whose mask code is
older, attends across them. :func:`packing_for` builds the family's small twin
(:func:`slapo_fn.hf.small_config`) and asks it: two examples run apart must give the same
logits as the two packed in one row with their own position ids. Where they do, chat
examples are packed ``"apart"``; where not (OPT, BLOOM), or where the twin cannot be built
small, one example per row, ``"padded"``, which is right for every model.

Training must run without a cache for this (a cache turns the packed-sequence reading
off): ``slapo-fn train`` does so (:func:`slapo_fn.hf.train_without_cache`); a loop of your
own passes ``use_cache=False``.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

import torch

from .. import hf

__all__ = ["packing_for"]


def packing_for(config: Any) -> Literal["apart", "padded"]:
    """``"apart"`` if the family of ``config`` (a Hugging Face causal LM's config) keeps
    examples packed in one row apart by their ``position_ids``, else ``"padded"``."""
    from transformers import AutoModelForCausalLM

    small = hf.small_config(config)
    if small is None:
        return "padded"
    try:
        return "apart" if _apart(AutoModelForCausalLM, small) else "padded"
    except (RuntimeError, ValueError, TypeError):  # a twin that cannot be built small: rows one example each
        return "padded"


def _apart(auto: Any, small: Any) -> bool:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = auto.from_config(small).eval()
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return False
    vocab = int(hf.config_value(small, "vocab_size"))
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randint(0, vocab, (1, 5), generator=gen), torch.randint(0, vocab, (1, 7), generator=gen)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        apart = torch.cat([model(first, use_cache=False).logits, model(second, use_cache=False).logits], dim=1)
        packed = model(torch.cat([first, second], dim=1), position_ids=positions, use_cache=False).logits
    return torch.allclose(apart, packed, atol=1e-4, rtol=1e-4)
