"""A checkpoint directory on disk: which checkpoints it holds, whether their files are
intact, and how much room the next one needs. No torch: the command line reads it before
any rank starts, and :mod:`slapo_fn.state` writes and loads through it.

On disk::

    path/
      LATEST                  name of the newest complete, verified checkpoint
      step-00000012/          DCP files (.metadata, __0_0.distcp, ...), train-state-<rank>.pt
        manifest.json         size and xxh3-128 digest of every other file, written last
      .partial-step-00000013/ a save under way (or one killed part-way: not a checkpoint)

A checkpoint is a step directory with a manifest. The manifest is written last, into the
partial folder, atomically (a temporary file renamed), and the folder is renamed to its
step only then; ``LATEST`` is replaced after that. So ``LATEST`` never names a partial or
unverified checkpoint, and a file changed after the save (a flipped bit, a truncation) no
longer matches its digest. xxh3-128 (the ``xxhash`` package) hashes at memory speed: the
digests cost a small share of the save (``benchmarks/checkpoint_digest.py``).

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp()) / "step-00000003"
>>> folder.mkdir()
>>> _ = (folder / "a.bin").write_bytes(b"weights")
>>> write_manifest(folder, digests(folder, sorted(f.name for f in folder.iterdir())), step=3)
>>> manifest_problems(folder)
[]
>>> _ = (folder / "a.bin").write_bytes(b"weightz")
>>> print(manifest_problems(folder)[0].reason)
does not match its digest in manifest.json (the file changed after the save: a flipped bit or a partial write)
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from .errors import Problem

__all__ = [
    "DIGEST",
    "LATEST",
    "MANIFEST",
    "PARTIAL",
    "RANK_STATE",
    "checkpoints",
    "complete",
    "digests",
    "free_bytes",
    "latest",
    "manifest_meta",
    "manifest_problems",
    "partials",
    "prune",
    "size_of",
    "step_name",
    "step_of",
    "write_manifest",
]

#: The file naming the newest checkpoint of a directory.
LATEST = "LATEST"
#: The digests of a checkpoint's files, written last.
MANIFEST = "manifest.json"
#: The prefix of a save under way.
PARTIAL = ".partial-"
#: Each rank's own state in a checkpoint (RNG, data position): ``RANK_STATE.format(rank=r)``.
RANK_STATE = "train-state-{rank}.pt"
#: The hash of the manifest: xxh3, 128 bits.
DIGEST = "xxh3_128"
_CHUNK = 8 << 20


def step_name(step: int) -> str:
    """The directory name of checkpoint ``step``.

    >>> step_name(12)
    'step-00000012'
    """
    return f"step-{step:08d}"


def step_of(checkpoint: Path) -> int:
    """The step of a checkpoint directory (``step-00000012``: 12; another name: 0).

    >>> step_of(Path("ckpt/step-00000012")), step_of(Path("ckpt"))
    (12, 0)
    """
    kind, _, number = checkpoint.name.partition("-")
    return int(number) if kind == "step" and number.isdigit() else 0


def latest(path: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``LATEST`` names under ``path`` (or ``path`` itself if it is one
    checkpoint: a ``.metadata``), or ``None``."""
    root = Path(path)
    if (root / ".metadata").exists():
        return root
    pointer = root / LATEST
    if not pointer.exists():
        return None
    return root / pointer.read_text().strip()


def checkpoints(path: str | os.PathLike[str]) -> list[Path]:
    """The checkpoints under ``path``, newest first: the one ``LATEST`` names, then the
    older step directories by step (interrupted saves, ``.partial-*``, are not
    checkpoints). ``path`` itself if it is one checkpoint (a ``.metadata``)."""
    found = latest(path)
    if found is None or found == Path(path):
        return [] if found is None else [found]
    root = Path(path)
    newest = step_of(found)
    older = sorted((d for d in root.iterdir() if d.is_dir() and d.name.startswith("step-") and d != found
                    and step_of(d) < newest), key=step_of, reverse=True) if root.is_dir() else []
    return [found, *older]


def complete(path: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint under ``path`` whose files are all there, of the sizes its
    manifest gives (digests are not read: cheap), or ``None``."""
    return next((c for c in checkpoints(path) if not manifest_problems(c, digest=False)), None)


def partials(path: str | os.PathLike[str]) -> list[Path]:
    """The folders of saves under way, or left by saves that were killed part-way."""
    root = Path(path)
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PARTIAL)) if root.is_dir() else []


# -- digests ----------------------------------------------------------------------------------
def _digest(file: Path) -> str:
    h = xxhash.xxh3_128()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digests(folder: Path, names: Iterable[str]) -> dict[str, dict[str, int | str]]:
    """Size and digest of each of ``names`` in ``folder`` (a rank hashes its share of a
    checkpoint's files; the shares are merged into one manifest)."""
    return {name: {"bytes": (folder / name).stat().st_size, DIGEST: _digest(folder / name)} for name in names}


def write_manifest(folder: Path, files: Mapping[str, Mapping[str, int | str]], *, step: int,
                   meta: Mapping[str, Any] | None = None) -> None:
    """Write ``folder``'s manifest of ``files`` (name -> size and digest) and ``meta`` (JSON
    data of the caller's: the options of the run that saved it), whole or not at all (a
    temporary file renamed)."""
    body = {"format": 1, "step": step, "digest": DIGEST, "meta": dict(meta or {}),
            "files": dict(sorted(files.items()))}
    tmp = folder / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def manifest_meta(folder: Path) -> dict[str, Any]:
    """The ``meta`` a checkpoint's manifest carries (``{}`` where it has none)."""
    try:
        meta = json.loads((folder / MANIFEST).read_text()).get("meta")
    except (OSError, ValueError, AttributeError):
        return {}
    return dict(meta) if isinstance(meta, dict) else {}


def _manifest(folder: Path) -> dict[str, dict[str, int | str]] | Problem:
    file = folder / MANIFEST
    fix = "load an earlier checkpoint, or (at your own risk) load this one unverified: sf.load(..., verify=False)"
    if not file.is_file():
        return Problem(str(file), "is missing: the save did not finish, or the checkpoint was written before "
                                  "checkpoints carried digests", fix)
    try:
        body = json.loads(file.read_text())
        files = body["files"]
        if body.get("digest") != DIGEST or not isinstance(files, dict):
            raise ValueError(f"digest {body.get('digest')!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Problem(str(file), f"cannot be read ({type(e).__name__}: {str(e)[:80]})", fix)
    return files


def manifest_problems(folder: Path, share: tuple[int, int] = (0, 1), *, digest: bool = True) -> list[Problem]:
    """What is wrong with ``folder``'s files against its manifest: a missing manifest, a
    file missing, of another size, or (with ``digest``) whose digest differs; ``[]`` when
    every file verifies. ``share`` ``(i, n)``: check only every ``n``-th file from the
    ``i``-th, so that ``n`` ranks split the reading."""
    files = _manifest(folder)
    if isinstance(files, Problem):
        return [files]
    fix = "load an earlier checkpoint (resume falls back to the newest that verifies), or save again"
    problems = []
    index, count = share
    for i, (name, entry) in enumerate(sorted(files.items())):
        file = folder / name
        if not file.is_file():
            problems.append(Problem(str(file), "is missing: the manifest lists it", fix))
        elif (size := file.stat().st_size) != entry.get("bytes"):
            what = "is truncated" if size < int(entry.get("bytes", 0)) else "was rewritten"
            problems.append(Problem(str(file), f"{what}: {size} bytes where the manifest says {entry.get('bytes')}",
                                    fix))
        elif digest and i % count == index and _digest(file) != entry.get(DIGEST):
            problems.append(Problem(str(file), f"does not match its digest in {MANIFEST} (the file changed after "
                                               "the save: a flipped bit or a partial write)", fix))
    return problems


# -- room for the next one ------------------------------------------------------------------
def size_of(folder: Path) -> int:
    """Bytes of the files in ``folder`` (a checkpoint: what the next one will about take)."""
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) if folder.is_dir() else 0


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


def prune(path: str | os.PathLike[str], keep: int, *, protect: Sequence[Path] = ()) -> list[Path]:
    """Delete the oldest checkpoints under ``path`` until ``keep`` are left (at least
    one), never those in ``protect`` nor the newest one that has a manifest; returns the
    deleted ones."""
    found = sorted(checkpoints(path), key=step_of)
    guarded = set(protect) | {next((c for c in reversed(found) if (c / MANIFEST).is_file()), found[-1])} \
        if found else set(protect)
    gone: list[Path] = []
    for old in found:
        if len(found) - len(gone) <= max(keep, 1):
            break
        if old not in guarded and old != Path(path):
            shutil.rmtree(old, ignore_errors=True)
            gone.append(old)
    return gone
