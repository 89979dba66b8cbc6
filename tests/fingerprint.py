"""A fingerprint of everything a rewrite must not change in a module tree."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_HOOK_DICTS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def fingerprint(root: nn.Module) -> list[Any]:
    """Structure, identities, values, flags and hooks of every module, parameter and buffer."""
    out: list[Any] = []
    for path, m in root.named_modules(remove_duplicate=False):
        out.append((path, type(m), id(m), m.training, sorted(m.__dict__),
                    tuple((k, id(v)) for k, v in m._modules.items()),
                    tuple((h, tuple(getattr(m, h, {}).keys())) for h in _HOOK_DICTS)))
        for name, p in m._parameters.items():
            out.append((path, name, id(p), None if p is None else
                        (p.requires_grad, p.grad is None, tuple(p.shape), _value(p), sorted(p.__dict__))))
        for name, b in m._buffers.items():
            out.append((path, name, id(b), None if b is None else (tuple(b.shape), _value(b))))
    return out


def _value(t: torch.Tensor) -> object:
    if t.is_meta:
        return ("meta", t.dtype)
    return t.detach().clone()


def same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if len(x) != len(y):
            return False
        for u, v in zip(x, y):
            if isinstance(u, tuple) and isinstance(v, tuple):
                if not same([u], [v]):
                    return False
            elif isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                if not (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and torch.equal(u, v)):
                    return False
            elif u != v:
                return False
    return True
