"""Distributed checkpoints that reshard: ``save``, ``load``, ``full_state_dict``.

Built on ``torch.distributed.checkpoint`` (DCP) and its ``get_state_dict`` /
``set_state_dict``: the keys are the FQNs of the unscheduled model, every rank writes its
own shards, and a checkpoint written under one layout (dp2×tp2, pp2, FSDP…) loads under
another (tp4, a single process without a process group, …), model and optimizer state.

On disk::

    path/
      LATEST              name of the newest complete checkpoint ("step-00000012")
      step-00000012/      DCP files (.metadata + one file per rank)

A save writes a new step directory under a temporary name, renames it when every rank is
done, and only then replaces ``LATEST`` (an atomic ``os.replace``): a save interrupted
part-way leaves the previous checkpoint loadable.

Example:
    >>> import tempfile, torch, torch.nn as nn, slapo_fn as sf
    >>> model = nn.Linear(2, 2)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> path = tempfile.mkdtemp()
    >>> _ = sf.save(model, opt, path, step=3)
    >>> other = nn.Linear(2, 2)
    >>> sf.load(other, torch.optim.AdamW(other.parameters()), path)
    3
    >>> torch.equal(other.weight, model.weight)
    True
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from .errors import Problem, ScheduleError

__all__ = ["full_state_dict", "latest", "load", "save"]

_LATEST = "LATEST"


def _modules(model: object) -> list[nn.Module]:
    """The modules a rank holds: a module, a sequence of them, or a pipeline runner
    (:class:`slapo_fn.Pipeline`, whose ``modules`` maps stage indices to modules)."""
    if isinstance(model, nn.Module):
        return [model]
    stages = getattr(model, "modules", None)  # a pipeline runner: {stage index: module}
    if isinstance(stages, Mapping) and all(isinstance(m, nn.Module) for m in stages.values()):
        return list(stages.values())
    if isinstance(model, Sequence) and model and all(isinstance(m, nn.Module) for m in model):
        return list(model)
    raise ScheduleError("save/load", [Problem("", f"expected a built model (nn.Module), a list of them or a "
                                                  f"pipeline runner, got {type(model).__name__}",
                                              "pass the result of sf.build(sch) or sf.build_pipeline(sch, ...)")])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _states(model: object, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    modules = _modules(model)
    if optimizer is None:
        merged: dict[str, Any] = {}
        for m in modules:
            merged.update(get_model_state_dict(m))
        return {"model": merged}
    if len(modules) != 1:  # several stages on this rank: a container, keys unprefixed again
        model_sd, optim_sd = get_state_dict(nn.ModuleList(modules), optimizer)
        return {"model": _unprefix(model_sd), "optim": _map_optim(optim_sd, lambda k: k.split(".", 1)[1])}
    model_sd, optim_sd = get_state_dict(modules[0], optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _unprefix(state: dict[str, Any]) -> dict[str, Any]:
    return {k.split(".", 1)[1]: v for k, v in state.items()}


def _map_optim(optim: dict[str, Any], rename: Any) -> dict[str, Any]:
    """Rename the parameter keys of an optimizer state dict as returned by ``get_state_dict``."""
    groups = [{**g, "params": [rename(k) for k in g["params"]]} for g in optim.get("param_groups", [])]
    return {"state": {rename(k): v for k, v in optim.get("state", {}).items()}, "param_groups": groups}


def latest(path: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``path`` (or ``path`` itself if it is one)."""
    root = Path(path)
    if (root / ".metadata").exists():
        return root
    pointer = root / _LATEST
    if not pointer.exists():
        return None
    return root / pointer.read_text().strip()


def save(
    model: object,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    step: int = 0,
    keep: int = 2,
) -> Path:
    """Save model (and optimizer) state as checkpoint ``step`` under ``path``; every rank
    calls it. Keeps the newest ``keep`` checkpoints. Returns the checkpoint's directory.

    Keys are the original model's FQNs, so the checkpoint loads under any other layout.
    """
    root = Path(path)
    name = f"step-{step:08d}"
    final, partial = root / name, root / f".partial-{name}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    with warnings.catch_warnings():  # without a process group DCP warns that it saves in one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_states(model, optimizer), checkpoint_id=str(partial))
    _barrier()
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        tmp = root / f".{_LATEST}.tmp"
        tmp.write_text(name + "\n")
        os.replace(tmp, root / _LATEST)
        _prune(root, keep, name)
    _barrier()
    return final


def _prune(root: Path, keep: int, newest: str) -> None:
    steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for old in steps[: max(0, len(steps) - max(keep, 1))]:
        if old.name != newest:
            shutil.rmtree(old, ignore_errors=True)


def load(model: object, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike[str]) -> int:
    """Load the newest checkpoint under ``path`` into ``model`` (and ``optimizer``),
    resharding to their current layout; every rank calls it. Returns the saved step."""
    found = latest(path)
    if found is None:
        raise ScheduleError("load", [Problem(str(path), "no checkpoint here (no LATEST, no .metadata)",
                                             "pass the directory given to sf.save")])
    state = _states(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(found))
    modules = _modules(model)
    if optimizer is None:
        for m in modules:
            set_state_dict(m, [], model_state_dict=_subset(state["model"], m), optim_state_dict={})
    elif len(modules) == 1:
        set_state_dict(modules[0], optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        owner = {k: i for i, m in enumerate(modules) for k in get_model_state_dict(m)}
        prefixed = {f"{owner[k]}.{k}": v for k, v in state["model"].items() if k in owner}
        optim = _map_optim(state["optim"], lambda k: f"{owner[k]}.{k}")
        set_state_dict(nn.ModuleList(modules), optimizer, model_state_dict=prefixed, optim_state_dict=optim)
    name = found.name
    return int(name.split("-", 1)[1]) if name.startswith("step-") else 0


def _subset(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    keys = set(get_model_state_dict(module))
    return {k: v for k, v in state.items() if k in keys}


def full_state_dict(model: object) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on every rank, with the original FQNs: loadable by
    the unscheduled model (e.g. a Hugging Face model's ``load_state_dict``)."""
    out: dict[str, torch.Tensor] = {}
    for m in _modules(model):
        for key, value in get_model_state_dict(m, options=StateDictOptions(full_state_dict=True)).items():
            assert isinstance(value, torch.Tensor)
            out[key] = value.detach().clone()
    return out


