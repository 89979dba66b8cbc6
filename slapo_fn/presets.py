"""Named model configurations for the ``slapo-fn`` command (random weights: no hub needed).

``build_model(name_or_path, meta=...)`` returns a Hugging Face language model (a causal
LM, or an encoder-decoder's sequence-to-sequence LM) built from a
preset below or from a local config (a ``config.json`` file or a folder holding one).
A Hugging Face *folder* may also hold weights (:func:`weights_of`: ``model.safetensors``
or a sharded ``model.safetensors.index.json``) and a tokenizer (:func:`tokenizer_of`);
``build_model(folder)`` off the meta device loads those weights, and ``slapo-fn train``
reads them straight into each rank's shards (``sf.build(sch, init="empty")`` +
``sf.load_hf``).

>>> sorted(PRESETS)[:3]
['bart-tiny', 'gpt-neo-tiny', 'gpt2-small']
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from .errors import Problem, ScheduleError

__all__ = ["PRESETS", "WEIGHT_FILES", "build_model", "config_for", "tokenizer_of", "weights_of"]

_LLAMA_BASE = {"model_type": "llama", "use_cache": False, "tie_word_embeddings": False}

PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "llama-tiny": {**_LLAMA_BASE, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    "llama-small": {**_LLAMA_BASE, "vocab_size": 256, "hidden_size": 256, "intermediate_size": 512,
                    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4},
    "llama-1b": {**_LLAMA_BASE, "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
                 "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4},
    "llama-7b": {**_LLAMA_BASE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32},
    "qwen2-tiny": {"model_type": "qwen2", "use_cache": False, "vocab_size": 256, "hidden_size": 64,
                   "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2},
    "gpt2-tiny": {"model_type": "gpt2", "use_cache": False, "vocab_size": 256, "n_embd": 64, "n_layer": 2,
                  "n_head": 4, "n_positions": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                  "bos_token_id": 0, "eos_token_id": 0},
    "gpt2-small": {"model_type": "gpt2", "use_cache": False, "vocab_size": 256, "n_embd": 256, "n_layer": 4,
                   "n_head": 8, "n_positions": 512, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                   "bos_token_id": 0, "eos_token_id": 0},
    "gpt-neo-tiny": {"model_type": "gpt_neo", "use_cache": False, "vocab_size": 256, "hidden_size": 64,
                     "num_layers": 2, "num_heads": 4, "attention_types": [[["global", "local"], 1]],
                     "window_size": 8, "max_position_embeddings": 256, "embed_dropout": 0.0,
                     "attention_dropout": 0.0, "resid_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0},
    "opt-tiny": {"model_type": "opt", "use_cache": False, "vocab_size": 256, "hidden_size": 64, "ffn_dim": 128,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256,
                 "word_embed_proj_dim": 64, "dropout": 0.0, "attention_dropout": 0.0},
    # encoder-decoders: the decoder reads the labels shifted right (slapo_fn.train.Seq2Seq)
    "t5-tiny": {"model_type": "t5", "use_cache": False, "vocab_size": 256, "d_model": 64, "d_kv": 16, "d_ff": 128,
                "num_layers": 2, "num_heads": 4, "dropout_rate": 0.0, "decoder_start_token_id": 0,
                "pad_token_id": 0, "eos_token_id": 1},
    "bart-tiny": {"model_type": "bart", "use_cache": False, "vocab_size": 256, "d_model": 64, "encoder_layers": 2,
                  "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                  "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "max_position_embeddings": 256, "dropout": 0.0,
                  "attention_dropout": 0.0, "activation_dropout": 0.0, "pad_token_id": 1, "bos_token_id": 0,
                  "eos_token_id": 2, "decoder_start_token_id": 2},
})


#: The files of a Hugging Face folder that hold its weights (one of them is enough).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
#: Files that make a folder one ``AutoTokenizer.from_pretrained`` can load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _folder(name_or_path: str | Path) -> Path | None:
    """``name_or_path`` as a Hugging Face folder (a folder holding ``config.json``), or ``None``."""
    if str(name_or_path) in PRESETS:
        return None
    path = Path(name_or_path)
    return path if (path / "config.json").is_file() else None


def weights_of(name_or_path: str | Path) -> Path | None:
    """The weight file of a Hugging Face folder (``model.safetensors`` or its sharded
    index), or ``None`` for a preset, a ``config.json`` file or a folder without weights.

    >>> weights_of("llama-tiny") is None
    True
    """
    folder = _folder(name_or_path)
    if folder is None:
        return None
    return next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)


def tokenizer_of(name_or_path: str | Path) -> Path | None:
    """The folder itself when ``name_or_path`` is a Hugging Face folder with tokenizer
    files (``tokenizer.json``, ``tokenizer_config.json``, ...), else ``None``.

    >>> tokenizer_of("llama-tiny") is None
    True
    """
    folder = _folder(name_or_path)
    if folder is None or not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    return folder


def config_for(name_or_path: str, *, causal: bool = False) -> Any:
    """The Hugging Face config of a preset name or a local config file/folder; with
    ``causal``, one of a language model :func:`build_model` can build: a causal LM
    (``AutoModelForCausalLM``) or an encoder-decoder (``AutoModelForSeq2SeqLM``).

    A file that is not JSON, has no or an unknown ``model_type`` (with close matches, not
    the list of every type), or values transformers refuses, is one
    :class:`~slapo_fn.errors.ScheduleError` naming the file:

    >>> import json, tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "config.json").write_text(json.dumps({"model_type": "lama"}))
    >>> config_for(str(folder))
    Traceback (most recent call last):
    ...
    slapo_fn.errors.ScheduleError: model: '.../config.json': unknown model_type 'lama'; close matches: 'llama', ...
          fix: a model_type of transformers (transformers.CONFIG_MAPPING), e.g. 'llama' or 'gpt2'
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    path = Path(name_or_path)
    file = path / "config.json" if path.is_dir() else path

    def refuse(reason: str, fix: str = "write it with transformers: config.save_pretrained(folder)") -> ScheduleError:
        return ScheduleError("model", [Problem(str(file), reason, fix)])

    if name_or_path in PRESETS:
        options = dict(PRESETS[name_or_path])
        config = AutoConfig.for_model(options.pop("model_type"), **options)
    elif not file.is_file():
        close = difflib.get_close_matches(name_or_path, list(PRESETS), n=3)
        raise ScheduleError("model", [Problem(name_or_path, "unknown model: neither a preset nor a config.json or a "
                                                           "folder holding one" + (
                                                               f"; close matches: {', '.join(map(repr, close))}"
                                                               if close else ""),
                                              f"use a preset ({', '.join(sorted(PRESETS))}) or the path of a "
                                              "Hugging Face config.json")])
    else:
        try:
            options = json.loads(file.read_bytes())
        except json.JSONDecodeError as e:
            raise refuse(f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise refuse(f"cannot be read: {e}") from None
        kind = options.get("model_type") if isinstance(options, dict) else None
        if not isinstance(kind, str):
            raise refuse('has no "model_type" (a JSON object with e.g. "model_type": "llama" is expected)')
        if kind not in CONFIG_MAPPING:
            close = difflib.get_close_matches(kind, list(CONFIG_MAPPING.keys()), n=3)
            raise refuse(f"unknown model_type {kind!r}" + (f"; close matches: {', '.join(map(repr, close))}"
                                                          if close else ""),
                         "a model_type of transformers (transformers.CONFIG_MAPPING), e.g. 'llama' or 'gpt2'")
        options.setdefault("use_cache", False)
        options.pop("model_type")
        try:
            config = AutoConfig.for_model(kind, **options)
        except Exception as e:  # transformers' own complaint about the config's values, in one line
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise refuse(f"transformers cannot make a {kind!r} config of it: {type(e).__name__}: {first}") from None
    if causal and _auto_class(config) is None:
        raise ScheduleError("model", [Problem(
            name_or_path if name_or_path in PRESETS else str(file),
            f"model_type {config.model_type!r} has no language model in transformers (AutoModelForCausalLM or, "
            "for an encoder-decoder, AutoModelForSeq2SeqLM): slapo-fn builds, trains and explains language models",
            "the config of a language model, e.g. model_type 'llama', 'qwen2', 'gpt2', 'opt', 't5' or 'bart'")])
    return config


def _auto_class(config: Any) -> Any:
    """The transformers auto class that builds ``config``'s language model: the
    sequence-to-sequence one for an encoder-decoder config (Bart also has a decoder-only
    causal LM), the causal one otherwise; ``None`` where it has neither."""
    from transformers import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
    )

    if getattr(config, "is_encoder_decoder", False) and type(config) in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING:
        return AutoModelForSeq2SeqLM
    return AutoModelForCausalLM if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else None


def build_model(name_or_path: str, *, meta: bool = False, pretrained: bool = True) -> nn.Module:
    """A language model for ``name_or_path`` (a causal LM, or an encoder-decoder's
    sequence-to-sequence LM): on the meta device if ``meta``; else with the folder's
    weights where it has some (:func:`weights_of`, and ``pretrained``), random ones
    otherwise."""
    config = config_for(name_or_path, causal=True)
    auto = _auto_class(config)
    if meta:
        with torch.device("meta"):
            return auto.from_config(config)  # type: ignore[no-any-return]
    if pretrained and weights_of(name_or_path) is not None:
        return auto.from_pretrained(str(name_or_path), config=config, local_files_only=True)  # type: ignore[no-any-return]
    return auto.from_config(config)  # type: ignore[no-any-return]
