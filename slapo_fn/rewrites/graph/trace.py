"""``trace``: turn one module into an equivalent ``GraphModule`` (trace by need)."""

from __future__ import annotations

import functools
import inspect
import operator
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from ...combinators import primitive
from ...errors import Problem, ScheduleError, ScheduleTypeError
from ...hf import is_transformers_module, linear_features
from ...schedule import Schedule
from ...select import Selection, select
from ...tree import get_module, join, set_at, split, walk
from .._common import contains
from ._graph import has_hooks, rebuild, resolve_attr

__all__ = ["ExampleInputs", "TraceFallbackWarning", "trace"]

ExampleInputs: TypeAlias = "tuple[Any, ...] | Mapping[str, Any] | tuple[tuple[Any, ...], Mapping[str, Any]]"
Tracer: TypeAlias = "Literal['fx', 'export'] | fx.Tracer | None"


def _split_inputs(example: ExampleInputs | None) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if example is None:
        return None
    if isinstance(example, Mapping):
        return (), dict(example)
    if (
        isinstance(example, tuple)
        and len(example) == 2
        and isinstance(example[0], tuple)
        and isinstance(example[1], Mapping)
    ):
        return tuple(example[0]), dict(example[1])
    if isinstance(example, tuple):
        return example, {}
    return (example,), {}


# -- torch.fx ---------------------------------------------------------------------------
class _FxTracer(fx.Tracer):
    def __init__(self, leaves: set[str], flatten: bool) -> None:
        super().__init__()
        self.leaves = leaves
        self.flatten = flatten

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaves or not self.flatten:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _builtin(module: nn.Module) -> bool:
    return fx.Tracer().is_leaf_module(module, "x")


def _fx_trace(
    module: nn.Module, path: str, leaves: set[str], flatten: bool, tracer: fx.Tracer | None
) -> fx.GraphModule:
    t = tracer if tracer is not None else _FxTracer(leaves, flatten)
    try:
        graph = t.trace(module)
    except Exception as e:
        raise _untraceable(path, "torch.fx", e) from None
    gm = rebuild(module, graph)
    if flatten or tracer is not None:
        return gm
    for node in list(graph.nodes):
        target = str(node.target)
        if node.op != "call_module" or target in leaves:
            continue
        child = get_module(module, target)
        if _builtin(child) or linear_features(child) is not None:  # a layer (Conv1D too) stays one
            continue
        inner = {leaf[len(target) + 1 :] for leaf in leaves if leaf.startswith(target + ".")}
        traced = _fx_trace(child, join(path, target), inner, False, None)
        first, *rest = split(target)
        gm._modules[first] = traced if not rest else set_at(gm._modules[first], ".".join(rest), traced)  # type: ignore[index,arg-type]
    return gm


def _untraceable(path: str, tracer: str, e: Exception) -> ScheduleError:
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ScheduleError(
        "trace",
        [
            Problem(
                path,
                f"{tracer} cannot trace it: {type(e).__name__}: {reason}",
                "trace a smaller module, list the offending child in leaves=..., or pass tracer='export' "
                "with example_inputs",
            )
        ],
    )


# -- torch.export -----------------------------------------------------------------------
@dataclass(frozen=True)
class _Binder:
    """Binds a call to the original ``forward`` signature and flattens it into the
    exported graph's inputs; arguments absent at trace time must be ``None``/default."""

    signature: inspect.Signature
    positional: int
    keywords: tuple[str, ...]
    in_spec: pytree.TreeSpec

    @functools.cached_property
    def _names(self) -> list[str]:
        return list(self.signature.parameters)

    @functools.cached_property
    def _used(self) -> frozenset[str]:
        """Parameters the exported graph takes."""
        return frozenset(self._names[: self.positional]) | frozenset(self.keywords)

    @functools.cached_property
    def _var_keyword(self) -> str | None:
        """The name of the ``**kwargs`` parameter, if ``forward`` has one."""
        return next((n for n, p in self.signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)

    def _flat(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """``arguments`` with the ``**kwargs`` parameter's entries spread out."""
        values = dict(arguments)
        if self._var_keyword is not None:
            values.update(values.pop(self._var_keyword, {}))
        return values

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        bound = self.signature.bind(*args, **kwargs)
        for name, value in self._flat(bound.arguments).items():
            if name in self._used:
                continue
            default = self.signature.parameters[name].default if name in self.signature.parameters else None
            if value is not None and value is not False and value is not default:
                raise TypeError(
                    f"traced module called with {name}={type(value).__name__}, which it was not traced with; "
                    "trace it again with example_inputs that include it"
                )
        bound.apply_defaults()
        values = self._flat(bound.arguments)
        call = (tuple(values[n] for n in self._names[: self.positional]), {k: values.get(k) for k in self.keywords})
        return fx._pytree.tree_flatten_spec(call, self.in_spec)  # type: ignore[attr-defined,no-any-return]


class _BoundCodeGen(fx.graph.CodeGen):
    """``forward(self, *args, **kwargs)`` bound to the original signature by ``self._slapo_inputs``."""

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, *, expanded_def: bool = False) -> str:
        names = [v for v in free_vars if v != "self"]
        head = "def forward(self, *args, **kwargs):"
        if not names:
            return head
        return f"{head}\n    {', '.join(names)}, = self._slapo_inputs(args, kwargs)"


def _simplify(graph: fx.Graph, root: nn.Module) -> None:
    """Remove the pytree packing that ``torch.export.unflatten`` puts around preserved
    module calls, so modules and ops connect directly (in place; ``graph`` is ours)."""
    static: dict[fx.Node, Any] = {}

    def value(arg: Any) -> Any:
        return pytree.tree_map(lambda a: static.get(a, a) if isinstance(a, fx.Node) else a, arg)

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is pytree.tree_unflatten:
            spec = getattr(root, str(node.args[1].target))  # type: ignore[union-attr]
            static[node] = pytree.tree_unflatten(list(value(node.args[0])), spec)  # type: ignore[arg-type]
        elif node.target is fx._pytree.tree_flatten_spec:  # type: ignore[attr-defined]
            spec = getattr(root, str(node.args[1].target))  # type: ignore[union-attr]
            src = node.args[0]
            if spec.is_leaf():
                static[node] = [src]
            else:
                paths = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))[0]
                leaves: list[Any] = []
                with graph.inserting_after(node):
                    for keypath, _ in paths:
                        cur: Any = src
                        for key in keypath:
                            k = getattr(key, "idx", getattr(key, "key", None))
                            cur = graph.call_function(operator.getitem, (cur, k))
                        leaves.append(cur)
                static[node] = leaves
        elif node.target is operator.getitem and (
            node.args[0] in static or isinstance(node.args[0], list | tuple | dict)
        ):
            base = static[node.args[0]] if isinstance(node.args[0], fx.Node) else node.args[0]
            got = base[node.args[1]]  # type: ignore[index]
            if isinstance(got, list | tuple | dict):
                static[node] = got
            for user in list(node.users):
                user.args = fx.node.map_arg(user.args, lambda a, n=node, g=got: g if a is n else a)  # type: ignore[misc]
                user.kwargs = fx.node.map_arg(user.kwargs, lambda a, n=node, g=got: g if a is n else a)  # type: ignore[misc]
    for node in reversed(list(graph.nodes)):
        if (
            node.op in ("call_function", "get_attr")
            and not node.users
            and (
                node.target in (operator.getitem, pytree.tree_unflatten, fx._pytree.tree_flatten_spec)  # type: ignore[attr-defined]
                or node.op == "get_attr"
            )
        ):
            graph.erase_node(node)


def _export_trace(
    module: nn.Module, path: str, leaves: set[str], flatten: bool, example: tuple[tuple[Any, ...], dict[str, Any]]
) -> fx.GraphModule:
    args, kwargs = example
    sig = inspect.signature(module.forward)
    if "use_cache" in sig.parameters and "use_cache" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}
    try:
        ep = torch.export.export(
            module, args, kwargs, strict=False, preserve_module_call_signature=tuple(sorted(leaves))
        )
        unflat = torch.export.unflatten(ep)
    except Exception as e:
        raise _untraceable(path, "torch.export", e) from None
    for leaf in leaves:  # the original modules stand where their calls were preserved
        first, *rest = split(leaf)
        unflat._modules[first] = (
            get_module(module, first)
            if not rest
            else set_at(unflat._modules[first], ".".join(rest), get_module(module, leaf))  # type: ignore[arg-type]
        )
    originals = {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }
    for name, owner in walk(unflat):
        if any(name == leaf or name.startswith(leaf + ".") for leaf in leaves):
            continue
        for table in (owner._parameters, owner._buffers):
            for key in list(table):
                if join(name, key) in originals:
                    table[key] = originals[join(name, key)]  # type: ignore[assignment]
    graph = unflat.graph
    _simplify(graph, unflat)
    if flatten:
        _inline_interpreters(graph, unflat, leaves)
    out = next(n for n in graph.nodes if n.op == "output")
    structured = pytree.tree_unflatten(list(out.args[0]), ep.call_spec.out_spec)  # type: ignore[arg-type]
    out.args = (structured,)
    _rename_reserved(graph)
    graph._codegen = _BoundCodeGen()
    graph.lint()
    like = _Like(module, unflat, graph)
    gm = rebuild(like, graph, class_name=type(module).__name__)
    gm.__dict__["_slapo_inputs"] = _Binder(sig, len(args), tuple(kwargs), ep.call_spec.in_spec)
    gm.recompile()
    return gm


#: Names a node of a generated ``forward`` must not take: ``self`` is the module itself
#: (a child named ``self``, as ``BertAttention.self``, would shadow it).
_RESERVED = frozenset({"self", "args", "kwargs"})


def _rename_reserved(graph: fx.Graph) -> None:
    """Rename nodes whose names would shadow ``self``/``args``/``kwargs`` in the generated
    ``forward`` (in place; ``graph`` is ours). Targets are kept: only the local name changes."""
    for node in graph.nodes:
        if node.name in _RESERVED and node.op != "placeholder":
            node._rename(f"{node.name}_out")


def _Like(module: nn.Module, unflat: nn.Module, graph: fx.Graph) -> nn.Module:
    """A stand-in carrying ``module``'s attributes and hooks with ``unflat``'s children,
    and the tensor constants that ``torch.export`` lifted out of the forward
    (``lifted_tensor_0``…), which ``module`` does not have."""
    like = object.__new__(type(module))
    like.__dict__.update(module.__dict__)
    like.__dict__["_modules"] = {**module._modules, **unflat._modules}
    like.__dict__["_parameters"] = dict(module._parameters)
    like.__dict__["_buffers"] = dict(module._buffers)
    like.__dict__.update({k: v for k, v in unflat.__dict__.items() if k.startswith("_spec")})
    for node in graph.nodes:
        target = str(node.target)
        if node.op != "get_attr" or "." in target or target in like.__dict__["_modules"]:
            continue
        if target in like._parameters or target in like._buffers or target in like.__dict__:
            continue
        like.__dict__[target] = resolve_attr(unflat, target)
    return like


def _inline_interpreters(graph: fx.Graph, root: nn.Module, leaves: set[str]) -> None:
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_module" or str(node.target) in leaves:
                continue
            sub = get_module(root, str(node.target))
            body = getattr(sub, "graph", None)
            if not isinstance(body, fx.Graph):
                continue
            env: dict[fx.Node, Any] = {}
            placeholders = [n for n in body.nodes if n.op == "placeholder"]
            for ph, arg in zip(placeholders, node.args, strict=False):
                env[ph] = arg
            with graph.inserting_before(node):
                for b in body.nodes:
                    if b.op == "placeholder":
                        continue
                    if b.op == "output":
                        result = fx.node.map_arg(b.args[0], env.__getitem__)
                        break
                    copied = graph.node_copy(b, env.__getitem__)
                    if b.op in ("get_attr", "call_module"):
                        copied.target = f"{node.target}.{b.target}"
                    env[b] = copied
            node.replace_all_uses_with(result)  # type: ignore[arg-type]
            graph.erase_node(node)
            changed = True


# -- the primitive ----------------------------------------------------------------------
class TraceFallbackWarning(UserWarning):
    """``trace`` used ``torch.export`` because ``torch.fx`` could not trace the module."""


def _needs_example(
    path: str, example: tuple[tuple[Any, ...], dict[str, Any]] | None, fx_error: ScheduleError | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``example``, or a :class:`ScheduleError` saying that export needs it (and why fx failed)."""
    if example is not None:
        return example
    why = f"{fx_error.problems[0].reason}; " if fx_error is not None else ""
    raise ScheduleError(
        "trace",
        [
            Problem(
                path,
                f"{why}tracing with torch.export needs example inputs",
                "pass example_inputs=(hidden_states,) or ((args...), {'kw': value})",
            )
        ],
    )


def _hf_trace(
    module: nn.Module,
    path: str,
    leaves: set[str],
    flatten: bool,
    example: tuple[tuple[Any, ...], dict[str, Any]] | None,
) -> fx.GraphModule:
    """A Hugging Face module: ``torch.fx`` first; ``torch.export`` (with the example
    inputs) only where fx fails, with a :class:`TraceFallbackWarning` saying so."""
    try:
        gm = _fx_trace(module, path, leaves, flatten, None)
    except ScheduleError as e:
        exported = _export_trace(module, path, leaves, flatten, _needs_example(path, example, e))
        warnings.warn(
            f"trace {path!r}: {e.problems[0].reason}; traced with torch.export on the example inputs instead",
            TraceFallbackWarning,
            stacklevel=4,
        )
        return exported
    if example is not None:
        _shape_prop(gm, example, path)
    return gm


def _leaf_paths(
    module: nn.Module, path: str, leaves: Sequence[str | type], sch: Schedule, hf: bool, flatten: bool = False
) -> set[str]:
    found: set[str] = set()
    names = [x for x in leaves if isinstance(x, str)]
    types = tuple(x for x in leaves if isinstance(x, type))
    if names:
        found.update(p for p in select(list(names)).modules(module) if p)
    if types:
        found.update(p for p, m in walk(module) if p and isinstance(m, types))
    if hf and not leaves:
        if flatten:  # one graph: only PyTorch's own layers stay modules (FQNs, regex finds)
            found.update(
                p for p, m in walk(module) if p and _builtin(m) and not isinstance(m, nn.ModuleList | nn.ModuleDict)
            )
        else:
            found.update(n for n, c in module._modules.items() if c is not None)
    for p, m in walk(module):  # annotated or hooked children keep their module (and so their annotations)
        if not p:
            continue
        absolute = join(path, p)
        if has_hooks(m) or any(
            a == absolute or (a.startswith(absolute + ".") and a[len(absolute) + 1 :] in m._parameters)
            for a in sch.annotations
        ):
            found.add(p)
    return {p for p in found if not any(p.startswith(q + ".") for q in found)}


@primitive
def trace(
    sch: Schedule,
    where: Selection,
    *,
    leaves: Sequence[str | type] = (),
    flatten: bool = False,
    tracer: Tracer = None,
    example_inputs: ExampleInputs | None = None,
) -> Schedule:
    """Replace each selected module by an equivalent ``torch.fx.GraphModule``.

    Only that module becomes a graph; the rest of the model stays eager. Children named
    in ``leaves`` (paths relative to the module, or classes) stay the same module
    objects, called by ``call_module`` nodes that keep their paths; so do children that
    carry hooks or schedule annotations, and PyTorch's own layers (``nn.Linear``…). With
    ``flatten=False`` other children are traced into graphs of their own (the hierarchy
    is kept), but for linear layers (Hugging Face's ``Conv1D``), which stay modules; with
    ``flatten=True`` they are inlined into one graph.
    Parameter FQNs, hooks and annotations of the module are kept.

    ``tracer`` is ``"fx"`` (``torch.fx.symbolic_trace``), ``"export"`` (``torch.export``
    non-strict with ``use_cache=False``; needs ``example_inputs``), or a
    ``torch.fx.Tracer`` instance. By default plain modules use fx, and Hugging Face
    modules try fx first and use export only where fx fails (most HF modules), with a
    :class:`TraceFallbackWarning` giving fx's reason; without ``example_inputs`` that
    case is a :class:`ScheduleError` saying both. A Hugging Face module's direct children
    are its default leaves; with ``flatten=True`` only PyTorch's own layers are, so the
    children's graphs are inlined. ``example_inputs`` — a tuple of positional arguments,
    a dict of keyword arguments, or ``(args, kwargs)`` — also records shapes in the graph
    (``node.meta``). A module the tracer cannot trace raises :class:`ScheduleError` with
    the tracer's reason. Returns a new schedule; the input is unchanged.

    Example:
        >>> import torch, torch.nn as nn, slapo_fn as sf
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 4)))
        >>> sch = sf.trace(sf.create_schedule(model), "")
        >>> type(sch.module).__name__, type(sch["1"].module).__name__, sch["1.1"].module is model[1][1]
        ('Sequential', 'Sequential', True)
        >>> print(sch.module.code.strip().splitlines()[-1].strip())
        return _1
    """
    paths = where.modules(sch.module)
    if tracer is not None and tracer not in ("fx", "export") and not isinstance(tracer, fx.Tracer):
        raise ScheduleTypeError(
            "trace",
            [
                Problem(p, f"tracer must be 'fx', 'export' or a torch.fx.Tracer, got {tracer!r}", "tracer='fx'")
                for p in paths
            ],
        )
    nested = [p for p in paths if any(contains(q, p) for q in paths)]
    if nested:
        raise ScheduleError(
            "trace", [Problem(p, "is inside another selected module", "trace the outer module only") for p in nested]
        )
    example = _split_inputs(example_inputs)
    problems: list[Problem] = []
    traced: list[tuple[str, nn.Module]] = []
    gm: nn.Module
    for path in paths:
        module = get_module(sch.module, path)
        hf = is_transformers_module(module)
        kind = tracer if tracer is not None else "fx"
        try:
            leaf_set = _leaf_paths(module, path, leaves, sch, hf, flatten)
            if kind == "export":
                gm = _export_trace(module, path, leaf_set, flatten, _needs_example(path, example, None))
            elif tracer is None and hf:
                gm = _hf_trace(module, path, leaf_set, flatten, example)
            else:
                gm = _fx_trace(module, path, leaf_set, flatten, tracer if isinstance(tracer, fx.Tracer) else None)
                if example is not None:
                    _shape_prop(gm, example, path)
        except ScheduleError as e:
            problems.extend(e.problems)
            continue
        traced.append((path, gm))
    if problems:
        raise ScheduleError("trace", problems)
    root = sch.module
    for path, gm in traced:
        root = set_at(root, path, gm)
    return sch.with_module(root, replaced=paths)


def _shape_prop(gm: fx.GraphModule, example: tuple[tuple[Any, ...], dict[str, Any]], path: str) -> None:
    args, kwargs = example
    if kwargs:
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        args = (*args, *(kwargs[n] for n in names[len(args) :] if n in kwargs))
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*args)
    except Exception as e:
        raise ScheduleError(
            "trace",
            [
                Problem(
                    path, f"the example inputs do not run through it: {type(e).__name__}: {e}", "check example_inputs"
                )
            ],
        ) from None
