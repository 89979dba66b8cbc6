"""Module-tree utilities: dotted paths, path copy-on-write, and private copies.

These are the mechanics behind the schedule's purity contract:

* :func:`shallow_clone` makes a new instance of a module whose ``_modules``,
  ``_parameters``, ``_buffers``, hook dicts and every other container in its
  ``__dict__`` are *fresh* (``copy.copy`` would share them with the original);
  parameters, buffers and children are shared.
* :func:`set_at` returns a new root in which only the modules on the path from the
  root to the edited slot are cloned — O(depth × fan-out), every other subtree shared.
* :func:`private_copy` clones the whole tree (sharing parameter storage or not), for
  ``build``: PyTorch APIs that act in place then never touch a schedule's modules.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import torch
from torch import nn

__all__ = [
    "adds_bias",
    "caller_path",
    "child_names",
    "get_module",
    "join",
    "parent_path",
    "private_copy",
    "relative",
    "set_at",
    "shallow_clone",
    "split",
    "tensor_at",
    "uncalled",
    "walk",
]

_CONTAINERS = (dict, OrderedDict, set, list)


def split(path: str) -> list[str]:
    """``"a.b.c"`` → ``["a", "b", "c"]``; the root path ``""`` → ``[]``."""
    return path.split(".") if path else []


def parent_path(path: str) -> str:
    """The path of the module holding the one at ``path``: ``"a.b.c"`` → ``"a.b"``,
    ``"a"`` → ``""`` (the root), and the root ``""`` → ``""``."""
    return ".".join(split(path)[:-1])


def join(*parts: str) -> str:
    """Join path parts, skipping empty ones: ``join("", "a", "b.c") == "a.b.c"``."""
    return ".".join(p for p in parts if p)


def relative(parent: str, path: str) -> str:
    """``path`` (inside ``parent``) as ``parent``'s modules name it.

    >>> relative("a", "a.b.c"), relative("", "a.b")
    ('b.c', 'a.b')
    """
    return path[len(parent) + 1:] if parent else path


def tensor_at(root: nn.Module, name: str) -> torch.Tensor:
    """The tensor ``root`` holds at the dotted ``name`` (a parameter or buffer of it or of
    a submodule), read as an attribute: what ``torch.func.functional_call`` or an FSDP2
    block put there counts, a plain tensor too, where ``get_parameter`` refuses anything but
    an ``nn.Parameter``."""
    owner, _, leaf = name.rpartition(".")
    value = getattr(root.get_submodule(owner) if owner else root, leaf)
    assert isinstance(value, torch.Tensor), name
    return value


def child_names(module: nn.Module) -> list[str]:
    """Names of the (non-``None``) children of ``module``, in registration order."""
    return [name for name, child in module._modules.items() if child is not None]


def uncalled(module: nn.Module) -> bool:
    """Whether ``module`` has no ``forward`` of its own (``nn.ModuleList``,
    ``nn.ModuleDict``): its parent's code calls its items, never it, so its hooks and a
    forward set on it never run."""
    return type(module).forward is nn.Module.forward


def adds_bias(module: nn.Module) -> bool:
    """Whether ``module``'s forward adds its own ``bias``: a layer whose class says
    ``adds_bias = False`` leaves it to its caller (what :func:`~slapo_fn.decompose` makes
    of a called Linear or ``Conv1D``).

    >>> adds_bias(nn.Linear(2, 2))
    True
    """
    return bool(getattr(type(module), "adds_bias", True))


def caller_path(root: nn.Module, path: str) -> str:
    """The path of the module whose code calls the one at ``path``: its parent, past
    containers without a ``forward`` of their own (a ``ModuleDict`` of an MLP's layers is
    called by the block holding it). ``""`` for the root and its children.

    >>> block = nn.Module(); block.mlp = nn.ModuleDict({"fc": nn.Linear(2, 2)})
    >>> caller_path(block, "mlp.fc"), caller_path(block, "mlp")
    ('', '')
    """
    parent = parent_path(path)
    while parent and uncalled(get_module(root, parent)):
        parent = parent_path(parent)
    return parent


def get_module(root: nn.Module, path: str) -> nn.Module:
    """The module at ``path`` (``KeyError`` if there is none)."""
    module = root
    for token in split(path):
        child = module._modules.get(token)
        if child is None:
            raise KeyError(path)
        module = child
    return module


def walk(root: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Every (path, module) below ``root`` in pre-order, shared modules at each path."""
    yield prefix, root
    for name, child in root._modules.items():
        if child is not None:
            yield from walk(child, join(prefix, name))


def shallow_clone(module: nn.Module) -> nn.Module:
    """A new instance of ``module``'s class with fresh containers and shared leaves.

    ``_modules``, ``_parameters``, ``_buffers``, the hook dicts, the non-persistent
    buffer set and any other dict/list/set attribute are copied one level deep; the
    children, parameters and buffers in them are the same objects.
    """
    new = object.__new__(type(module))
    state = {k: (type(v)(v) if type(v) in _CONTAINERS else v) for k, v in module.__dict__.items()}
    new.__dict__.update(state)
    return new


def set_at(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """A new root whose module at ``path`` is ``new``; ``root`` is not modified.

    Only the ancestors of ``path`` are cloned (:func:`shallow_clone`); every other
    subtree, parameter and buffer is shared with ``root``.
    """
    tokens = split(path)
    if not tokens:
        return new
    chain = [root]
    for token in tokens[:-1]:
        chain.append(chain[-1]._modules[token])  # type: ignore[arg-type]
    replacement = new
    for parent, token in zip(reversed(chain), reversed(tokens), strict=True):
        clone = shallow_clone(parent)
        clone._modules[token] = replacement
        replacement = clone
    return replacement


def _clone_tensor(tensor: torch.Tensor, copy_data: bool) -> torch.Tensor:
    data = tensor.detach()
    if copy_data and data.device.type != "meta":
        data = data.clone()
    return data


def private_copy(root: nn.Module, *, copy_data: bool) -> nn.Module:
    """A structural copy of the whole tree that nothing else owns.

    Every module is a :func:`shallow_clone`; every parameter is a new ``Parameter``
    (its Python attributes copied, ``requires_grad`` kept) whose data is a copy
    (``copy_data=True``) or a view of the same storage; buffers likewise. Objects
    shared in ``root`` (tied parameters, a module at two paths) stay shared in the copy.
    """
    memo: dict[int, object] = {}

    def tensor(t: torch.Tensor) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)]  # type: ignore[return-value]
        if isinstance(t, nn.Parameter):
            new: torch.Tensor = nn.Parameter(_clone_tensor(t, copy_data), requires_grad=t.requires_grad)
            new.__dict__.update({k: v for k, v in t.__dict__.items() if k != "grad"})
        else:
            new = _clone_tensor(t, copy_data)
            new.requires_grad_(t.requires_grad)
        memo[id(t)] = new
        return new

    def module(m: nn.Module) -> nn.Module:
        if id(m) in memo:
            return memo[id(m)]  # type: ignore[return-value]
        clone = shallow_clone(m)
        memo[id(m)] = clone
        for name, p in m._parameters.items():
            clone._parameters[name] = None if p is None else tensor(p)  # type: ignore[assignment]
        for name, b in m._buffers.items():
            clone._buffers[name] = None if b is None else tensor(b)
        for name, child in m._modules.items():
            clone._modules[name] = None if child is None else module(child)
        return clone

    return module(root)
