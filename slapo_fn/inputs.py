"""The checks of a job's inputs that read files, before any rank starts — fast, so that
bad input is refused within seconds: none of them builds a model or imports the layout
engine.

* the model's config (a preset, or a Hugging Face config or folder) and ``--seq``
  against its positions;
* ``--data``: its tokenizer against the model's vocabulary, then a sample of every file
  (:func:`sample_problems`: the head of each, read by :func:`slapo_fn.data.read_documents`
  as the ranks read it, and tokenized with the run's tokenizer); a plain text file read
  as bytes that is not UTF-8 gets a warning;
* ``--resume``: a complete checkpoint (its manifest, its files' sizes) before ``--steps``.

What the schedule refuses is checked next, by :func:`slapo_fn.job.check_schedule`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import hf
from .checkpoint_dir import complete, latest, manifest_meta, manifest_problems, step_of
from .data import ByteText, Codec, read_documents
from .data.loading import data_problems as source_problems
from .data.manifest import TOKENIZER, is_prepared
from .data.spec import kind, parse
from .errors import CommandLineError, Problem, ScheduleError
from .options import EVAL_FRACTION, is_stdlib
from .presets import config_for, tokenizer_of

__all__ = [
    "RESUMED_OPTIONS",
    "SAMPLE_BYTES",
    "SAMPLE_FILES",
    "check_inputs",
    "codec",
    "config",
    "data_problems",
    "default_seq",
    "packed",
    "resume_problems",
    "resumed_options",
    "sample_problems",
    "tokenizer_source",
]

Options = argparse.Namespace


def tokenizer_source(options: Options) -> str | None:
    """What tokenizes ``--data``: ``--tokenizer`` (a folder, or ``"bytes"``), else the
    ``--model`` folder's own tokenizer, else ``None``."""
    if options.tokenizer is not None:
        return str(options.tokenizer)
    found = tokenizer_of(options.model)
    return None if found is None else str(found)


def packed(options: Options) -> bool:
    """Whether ``--data`` is tokenized and packed (:class:`slapo_fn.data.TokenData`: masks,
    a held-out split, resumable) rather than read as random byte windows (the behaviour of
    earlier versions, kept for a plain text file when no tokenizer is given)."""
    if options.data is None:
        return False
    if tokenizer_source(options) is not None or is_stdlib(options.data) or options.stream:
        return True
    path = Path(options.data)
    return not path.is_file() or path.suffix.lower() in (".jsonl", ".json")


def codec(options: Options) -> Codec:
    """The tokenizer of ``--data`` as a :class:`slapo_fn.data.Codec`."""
    source = tokenizer_source(options)
    if source is None and options.data is not None and is_prepared(Path(options.data)) \
            and (Path(options.data) / TOKENIZER).is_dir():
        source = str(Path(options.data) / TOKENIZER)  # the folder's own tokenizer
    return Codec.byte_level() if source in (None, "bytes") else Codec.of(Path(source))


def check_inputs(options: Options) -> Any:
    """Refuse, before any process starts, what the arguments alone do not show and the
    files do: a model config that cannot be read or is no causal LM, ``--seq`` past its
    positions, a tokenizer that does not fit its vocabulary, data the ranks would refuse
    (a sample of every file), nothing to resume. Returns the model's config."""
    model_config = config(options.model, options.command)
    _check_sequence_length(model_config, options)
    if options.command == "train":
        tokens = _codec_or_none(options)
        problems = _eval_problems(options) or data_problems(options, model_config, tokens)
        if not problems and tokens is not None:
            problems = sample_problems(options, tokens)
        elif not problems:
            _warn_bytes(options)
        problems += resume_problems(options)
        if problems:
            raise CommandLineError(options.command, problems)
    return model_config


def config(model: str, command: str) -> Any:
    """The Hugging Face config of ``--model`` (a preset or a config.json), or a
    :class:`CommandLineError` naming the file: not JSON, no or an unknown ``model_type``
    (with close matches, not the list of every type), no causal LM for it."""
    try:
        return config_for(model, causal=True)
    except ScheduleError as e:
        raise CommandLineError(command, e.problems) from None


def default_seq(config: Any) -> int:
    """``explain``'s sequence length when ``--seq`` is left out: 2048, or the model's
    positions where fewer."""
    return min(2048, hf.position_limit(config))


def _check_sequence_length(config: Any, options: Options) -> None:
    """``--seq`` against the positions ``config``'s model covers: a longer one is refused
    before any work (the model's position table would fail on it, deep inside a rank)."""
    limit = hf.position_limit(config)
    seq = getattr(options, "seq", None)
    if seq is not None and seq > limit:
        raise CommandLineError(options.command, [Problem(
            "--seq", f"{seq} is longer than the {limit} positions {options.model!r} covers (its config's "
                     "max_position_embeddings or n_positions)", f"--seq {limit}")])


def _eval_problems(options: Options) -> list[Problem]:
    """``--eval-every`` needs data with a held-out split."""
    if not options.eval_every:
        return []
    if options.data is None or not packed(options):
        what = "the synthetic task" if options.data is None else \
            f"{options.data}, read as byte windows (no tokenizer given),"
        return [Problem("--eval-every", f"{what} has no held-out split",
                        "--data FILE with --tokenizer FOLDER (or --tokenizer bytes), or leave out --eval-every")]
    if options.eval_fraction == 0:
        return [Problem("--eval-every", "--eval-fraction 0 holds out no rows to evaluate on",
                        f"--eval-fraction {EVAL_FRACTION} (or leave it out: {EVAL_FRACTION})")]
    return []


def data_problems(options: Options, config: Any, tokens: Codec | None = None) -> list[Problem]:
    """``--data``'s symbols against the model's vocabulary: the tokenizer's (``tokens``,
    or loaded here; not the data), or 256 for byte windows."""
    vocab = hf.config_value(config, "vocab_size", default=None)
    if options.data is None or vocab is None:
        return []
    if not packed(options):
        symbols = ByteText(b"").vocab  # byte-level text: one token per byte value
        if symbols <= vocab:
            return []
        return [Problem("--data", f"{options.data} is read as bytes ({symbols} symbols); the model's vocabulary has "
                                  f"only {vocab}",
                        "a model with vocab_size >= 256, a --tokenizer FOLDER whose vocabulary fits, or no --data "
                        "(the synthetic task fits any vocabulary)")]
    try:
        tokens = tokens if tokens is not None else codec(options)
    except ScheduleError as e:
        first = e.problems[0] if e.problems else Problem("", str(e), "")
        return [Problem("--tokenizer" if options.tokenizer is not None else "--model", f"{first.path}: {first.reason}",
                        "a folder with tokenizer files (tokenizer.json, tokenizer_config.json), or --tokenizer bytes")]
    if tokens.vocab <= vocab:
        return _source_problems(options, tokens)
    where = "--tokenizer" if options.tokenizer is not None else "--model"
    return [Problem(where, f"the tokenizer {tokens.name} has {tokens.vocab} tokens; the model's vocabulary has only "
                           f"{vocab} (token ids would fall outside the embedding)",
                    "a tokenizer with at most vocab_size tokens, or a model whose config.json has vocab_size >= "
                    f"{tokens.vocab}")]


def _source_problems(options: Options, tokens: Codec) -> list[Problem]:
    """What ``--data``'s sources hold, read as little as it takes (a prepared folder's
    manifest, a stream's first row): :func:`slapo_fn.data.data_problems`."""
    if is_stdlib(options.data):
        return []
    return source_problems(options.data, tokens, stream=options.stream, text_field=options.text_field,
                           data_format=options.data_format, eval_every=bool(options.eval_every))


def _read_whole(options: Options) -> bool:
    """Whether ``--data`` is one source the ranks read whole into memory (text, JSON
    lines, a saved dataset): the one kind :func:`sample_problems` samples. Prepared
    folders, streams and mixtures are checked by :func:`_source_problems`."""
    try:
        spec = parse(options.data)
    except ScheduleError:
        return False
    return not spec.mixture and not spec.sources[0].stdlib and \
        kind(spec, spec.sources[0], stream=options.stream, data_format=options.data_format) == "memory"


#: The options a resumed run must share with the run that saved its checkpoint: they
#: decide which rows each step trains on.
RESUMED_OPTIONS = ("data", "tokenizer", "text_field", "seq", "batch", "seed", "eval_fraction")


def resumed_options(options: Options) -> dict[str, Any]:
    """The values of :data:`RESUMED_OPTIONS` in ``options`` (JSON data: a checkpoint's
    manifest keeps them)."""
    return {k: getattr(options, k, None) for k in RESUMED_OPTIONS}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    return "(none)" if value is None else str(value)


def _codec_or_none(options: Options) -> Codec | None:
    """The tokenizer of packed ``--data``; ``None`` for other data, or where it cannot be
    loaded (:func:`data_problems` says why)."""
    if not packed(options):
        return None
    try:
        return codec(options)
    except ScheduleError:
        return None


#: Bytes of each data file the launcher reads before spawning, and how many files at most
#: (spread over the corpus, first and last included).
SAMPLE_BYTES, SAMPLE_FILES = 64 << 10, 256


def sample_problems(options: Options, tokens: Codec) -> list[Problem]:
    """What the ranks would refuse in ``--data``, found on a sample before they start:
    the head of each file (of :data:`SAMPLE_FILES` at most) read as the run reads it
    (:func:`slapo_fn.data.read_documents`: UTF-8, JSON rows with their text field) and
    tokenized with the run's tokenizer. A source the sample cannot stand for (the
    standard library, a saved ``datasets`` dataset) is left to the ranks."""
    if options.data is None or is_stdlib(options.data) or not _read_whole(options):
        return []
    source = Path(options.data)
    files = [source] if source.is_file() else _data_files(source)
    if not files:
        return []
    step = max(1, -(-len(files) // SAMPLE_FILES))
    chosen = sorted({*files[::step], files[-1]})
    problems: list[Problem] = []
    texts = 0
    with tempfile.TemporaryDirectory(prefix="slapo-fn-sample-") as folder:
        for file in chosen:
            sample = _head(file)
            if sample is None:
                continue
            copy = Path(folder, f"sample{file.suffix}")
            copy.write_bytes(sample)
            try:
                docs = read_documents(copy, text_field=options.text_field)
            except ScheduleError as e:
                # a file whose head has no text is fine as long as the corpus has some
                problems += [Problem(p.path.replace(str(copy), str(file)), p.reason, p.fix) for p in e.problems
                             if "holds no text" not in p.reason]
                continue
            texts += len(docs)
            try:
                tokens.encode_batch(docs[:16])
            except Exception as e:  # the tokenizer's own failure, whatever its type
                problems.append(Problem(str(file), f"the tokenizer {tokens.name} cannot encode it "
                                                   f"({type(e).__name__}: {str(e)[:120]})",
                                        "a tokenizer for this text"))
    if not problems and not texts and all(file.stat().st_size <= SAMPLE_BYTES for file in chosen):
        problems.append(Problem(str(source), "holds no text", "point --data at a corpus with text in it"))
    return problems[:5]


def _data_files(folder: Path) -> list[Path]:
    """The files of a corpus folder as the data reader walks it (hidden ones left out);
    none for a ``datasets`` dataset saved on disk, which is read whole by the ranks."""
    if (folder / "dataset_dict.json").is_file() or (folder / "dataset_info.json").is_file():
        return []
    return sorted(f for f in folder.rglob("*") if f.is_file()
                  and not any(part.startswith(".") or part == "__pycache__" for part in f.relative_to(folder).parts))


def _head(file: Path) -> bytes | None:
    """The first :data:`SAMPLE_BYTES` of ``file``, cut after its last whole line (JSON
    rows) or character; a ``.json`` file whole (one JSON value), or ``None`` where it is
    too large to read here."""
    size = file.stat().st_size
    if file.suffix.lower() == ".json":
        return file.read_bytes() if size <= 16 * SAMPLE_BYTES else None
    with open(file, "rb") as f:
        head = f.read(SAMPLE_BYTES)
        if size <= SAMPLE_BYTES:
            return head
        if file.suffix.lower() in (".jsonl", ".ndjson"):
            while b"\n" not in head and len(head) < 16 * SAMPLE_BYTES:  # one long first row
                more = f.read(SAMPLE_BYTES)
                if not more:
                    break
                head += more
            return head[: head.rfind(b"\n") + 1] if b"\n" in head else None
    return _whole_characters(head)


def _whole_characters(head: bytes) -> bytes:
    """``head`` without a UTF-8 character cut at its end."""
    for cut in range(4):
        try:
            (head[: len(head) - cut] if cut else head).decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start < len(head) - 4:
                return head  # invalid inside, not just cut: the reader says so
            continue
        return head[: len(head) - cut] if cut else head
    return head


def _warn_bytes(options: Options) -> None:
    """One warning where a plain text file read as bytes is not UTF-8 text (a binary or
    Latin-1 file): it trains on its bytes as they are."""
    if options.data is None or packed(options):
        return
    with open(options.data, "rb") as f:
        head = _whole_characters(f.read(SAMPLE_BYTES))
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        print(f"slapo-fn {options.command}: warning: {options.data} is not UTF-8 text ({e.reason} at byte {e.start}): "
              "it is read as raw bytes, one token per byte value; to train on it as text, convert it to UTF-8 and "
              "give --tokenizer", file=sys.stderr, flush=True)


def resume_problems(options: Options) -> list[Problem]:
    """With ``--resume``: a checkpoint to resume from, before step ``--steps``."""
    if not options.resume:
        return []
    found = complete(options.checkpoint_dir)  # load falls back past a broken one
    if found is None:
        newest = latest(options.checkpoint_dir)
        what = "no checkpoint to resume from (no LATEST file, no .metadata)" if newest is None else \
            f"its LATEST names {newest.name}, which is missing" if not newest.is_dir() else \
            f"no checkpoint is complete ({newest.name}: {manifest_problems(newest, digest=False)[0].reason})" \
            if manifest_problems(newest, digest=False) else "no checkpoint can be read"
        return [Problem("--checkpoint-dir", f"{options.checkpoint_dir}: {what}",
                        "drop --resume to start at step 0, or pass the --checkpoint-dir of an earlier run")]
    step = step_of(found)
    saved = manifest_meta(found).get("options")
    if isinstance(saved, dict):
        mine = resumed_options(options)
        differ = [k for k in mine if k in saved and saved[k] != mine[k]]
        if differ:
            said = "; ".join(f"{_flag(k)} {_shown(saved[k])} (this run: {_shown(mine[k])})" for k in differ)
            return [Problem("--resume", f"the checkpoint at step {step} in {options.checkpoint_dir} was saved by a run "
                                        f"with other data: {said}",
                            "resume with the saved run's " + ", ".join(_flag(k) for k in differ)
                            + ", or train from step 0 into another --checkpoint-dir")]
    if step < options.steps:
        return []
    return [Problem("--steps", f"the checkpoint in {options.checkpoint_dir} is at step {step}, and --steps "
                               f"{options.steps} is the step to train up to: nothing is left to train",
                    f"--steps {step + 1} or more (the total, not the steps to add), or drop --resume")]
