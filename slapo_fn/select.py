"""Selectors: which modules (or parameters) a rewrite acts on.

Every form lowers to one value, :class:`Selection`:

* a dotted path with per-token globs — ``"model.layers.0.mlp"``, ``"layers.*.mlp"``,
  ``"layers.[0-3].mlp"``, ``"layers.[0,2,5]"``, ``"h.*.attn.c_*"``,
  ``"mlp.{gate,up}_proj"``, and ``**`` for any
  number of levels (``"**.q_proj"``); a path may end in a parameter name
  (``"h.0.attn.c_attn.weight"``) where the primitive acts on parameters;
* :func:`of_type` — modules that are instances of some classes;
* :func:`where_fn` — modules for which ``pred(path, module)`` is true;
* a list (or tuple) of any of these — the union, in tree order of first appearance.

A selection that matches nothing raises :class:`~slapo_fn.errors.SelectorError` naming
the key, the longest prefix that matched, the failing token and close matches; so does a
numeric range or list that reaches past the children there (``"layers.[0-99]"`` on four
layers), a parameter slot that is ``None`` (a ``Linear`` built with ``bias=False``), and,
when the selector is made, a malformed pattern (``"layers.[0-"``: the column is named).

Example:
    >>> import torch.nn as nn
    >>> from slapo_fn.select import select
    >>> m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    >>> select("[0-1]").modules(m)
    ('0', '1')
    >>> select(of_type(nn.Linear)).modules(m)
    ('0', '2')
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from torch import nn

from .errors import Problem, ScheduleTypeError, SelectorError
from .tree import get_module, join, split, walk

__all__ = ["Kind", "Selection", "Where", "of_type", "select", "where_fn"]


class Kind(Enum):
    """What a primitive acts on."""

    MODULE = "module"
    PARAMETER = "parameter"
    ANY = "any"


_RANGE = re.compile(r"^\[(\d+)-(\d+)\]$")
_LIST = re.compile(r"^\[(\d+(?:,\s*\d+)*)\]$")


_BRACES = re.compile(r"\{([^{}]*)\}")


def _expand(token: str) -> list[str]:
    """``"{input,post_attention}_layernorm"`` → both names (shell-style alternation)."""
    m = _BRACES.search(token)
    if m is None:
        return [token]
    return [x for alt in m.group(1).split(",") for x in _expand(token[: m.start()] + alt.strip() + token[m.end():])]


_SYNTAX_FIX = "write a range as [0-3], a list as [0,2,5], alternatives as {a,b}, globs with * and ?"


def _token_syntax(token: str) -> tuple[int, str] | None:
    """``(offset in token, what is wrong)`` for a malformed token, else ``None``."""
    if not token:
        return 0, "an empty name (two dots in a row, or a dot at an end)"
    bracket = -1  # offset of the open '[' (fnmatch classes do not nest)
    braces: list[int] = []
    for i, c in enumerate(token):
        if bracket >= 0:
            if c == "]" and i > bracket + 1:
                inner = token[bracket + 1 : i]
                numbers = re.fullmatch(r"(\d*)-(\d*)", inner)
                if numbers and not (numbers.group(1) and numbers.group(2)):
                    return bracket, f"the range [{inner}] needs a first and a last index, e.g. [0-3]"
                if numbers and int(numbers.group(1)) > int(numbers.group(2)):
                    return bracket, f"the range [{inner}] is empty (its first index is past its last)"
                bracket = -1
            continue
        if c == "[":
            if token[i + 1 : i + 2] == "]":
                return i, "'[]' selects nothing"
            bracket = i
        elif c == "]":
            return i, "']' without an opening '['"
        elif c == "{":
            braces.append(i)
        elif c == "}":
            if not braces:
                return i, "'}' without an opening '{'"
            braces.pop()
    if bracket >= 0:
        return bracket, "'[' is not closed"
    if braces:
        return braces[-1], "'{' is not closed"
    return None


def _check_syntax(pattern: str) -> None:
    """Refuse a malformed path pattern, pointing at the column (1-based) where it goes wrong."""
    if not pattern:
        return
    start = 0
    for token in pattern.split("."):
        found = _token_syntax(token)
        if found is not None:
            offset, what = found
            column = start + offset + 1
            raise SelectorError(
                pattern,
                reason=f"syntax error at column {column}: {what}\n    {pattern}\n    {' ' * (column - 1)}^",
                token=token,
                fix=_SYNTAX_FIX,
                column=column,
            )
        start += len(token) + 1


def _indices(token: str) -> list[int] | None:
    """The indices a numeric range or list token asks for (``[0-3]``, ``[0,2]``), else ``None``."""
    if m := _RANGE.match(token):
        return list(range(int(m.group(1)), int(m.group(2)) + 1))
    if m := _LIST.match(token):
        return [int(x) for x in m.group(1).split(",")]
    return None


def _spans(numbers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2, 5"``."""
    out: list[str] = []
    ordered = sorted(set(numbers))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(out)


def _token_matches(token: str, name: str) -> bool:
    if token == name or token == "*":
        return True
    if "{" in token:
        return any(_token_matches(alt, name) for alt in _expand(token))
    if m := _RANGE.match(token):
        return name.isdigit() and int(m.group(1)) <= int(name) <= int(m.group(2))
    if m := _LIST.match(token):
        return name.isdigit() and int(name) in {int(x) for x in m.group(1).split(",")}
    if any(c in token for c in "*?["):
        return fnmatch.fnmatchcase(name, token)
    return False


@dataclass(frozen=True)
class _Path:
    pattern: str

    def describe(self) -> str:
        return repr(self.pattern)


@dataclass(frozen=True)
class _Type:
    classes: tuple[type, ...]

    def describe(self) -> str:
        return f"of_type({', '.join(c.__name__ for c in self.classes)})"


@dataclass(frozen=True)
class _Pred:
    fn: Callable[[str, nn.Module], bool]

    def describe(self) -> str:
        return f"where_fn({getattr(self.fn, '__name__', repr(self.fn))})"


_Atom: TypeAlias = _Path | _Type | _Pred


@dataclass(frozen=True)
class Selection:
    """A value naming a set of paths in a module tree, relative to ``base``.

    Build one with :func:`select` (or pass any selector form where a ``where`` is
    expected). ``modules(root)``/``parameters(root)``/``paths(root)`` resolve it.
    """

    atoms: tuple[_Atom, ...]
    base: str = ""

    def under(self, base: str) -> Selection:
        """The same selection, its paths read relative to the module at ``base``."""
        return Selection(self.atoms, join(base, self.base))

    def __str__(self) -> str:
        text = " | ".join(a.describe() for a in self.atoms)
        return f"{text} under {self.base!r}" if self.base else text

    # -- resolution -------------------------------------------------------------
    def modules(self, root: nn.Module) -> tuple[str, ...]:
        """Absolute paths of the selected modules (error if none / if a parameter is named)."""
        return self.resolve(root, Kind.MODULE)

    def parameters(self, root: nn.Module) -> tuple[str, ...]:
        """Absolute paths of selected parameters; a selected module stands for its own
        (non-recursive) parameters."""
        return self.resolve(root, Kind.PARAMETER)

    def paths(self, root: nn.Module) -> tuple[str, ...]:
        """Absolute paths of selected modules and parameters."""
        return self.resolve(root, Kind.ANY)

    def resolve(self, root: nn.Module, kind: Kind) -> tuple[str, ...]:
        try:
            scope = get_module(root, self.base)
        except KeyError:
            raise _path_error(root, self.base, self.base) from None
        found: dict[str, None] = {}
        for atom in self.atoms:
            for path in _resolve_atom(atom, scope, self.base, kind):
                found.setdefault(join(self.base, path) if path or self.base else "", None)
        return tuple(found)


Where: TypeAlias = "str | Selection | _Atom | Sequence[str | Selection | _Atom]"


def of_type(*classes: type) -> Selection:
    """Select every module that is an instance of one of ``classes``.

    >>> import torch.nn as nn
    >>> of_type(nn.Linear).modules(nn.Sequential(nn.Linear(1, 1)))
    ('0',)
    """
    if not classes or not all(isinstance(c, type) for c in classes):
        raise ScheduleTypeError("of_type", [Problem(repr(classes), f"of_type takes classes; got {classes!r}",
                                                    "of_type(nn.Linear, nn.Embedding)")])
    return Selection((_Type(tuple(classes)),))


def where_fn(pred: Callable[[str, nn.Module], bool]) -> Selection:
    """Select every module for which ``pred(path, module)`` is true.

    >>> import torch.nn as nn
    >>> where_fn(lambda path, m: path.endswith("1")).modules(nn.Sequential(nn.ReLU(), nn.ReLU()))
    ('1',)
    """
    if not callable(pred):
        raise ScheduleTypeError("where_fn", [Problem(repr(pred), f"where_fn takes a callable; got {pred!r}",
                                                     "where_fn(lambda path, module: path.endswith('mlp'))")])
    return Selection((_Pred(pred),))


def select(where: object) -> Selection:
    """Lower any selector form to a :class:`Selection`.

    >>> import torch.nn as nn
    >>> str(select(["a.*", of_type(nn.Linear)]))
    "'a.*' | of_type(Linear)"
    """
    if isinstance(where, Selection):
        return where
    if isinstance(where, str):
        _check_syntax(where.strip())
        return Selection((_Path(where.strip()),))
    if isinstance(where, _Path | _Type | _Pred):
        return Selection((where,))
    if isinstance(where, list | tuple) and where:
        parts = [select(w) for w in where]
        atoms: list[_Atom] = []
        for part in parts:
            if part.base:
                raise ScheduleTypeError("select", [Problem(str(part), "a list of selectors cannot mix relative "
                                                                      "(scoped) selections",
                                                           "scope the whole list: select([...]).under(base)")])
            atoms.extend(part.atoms)
        return Selection(tuple(atoms))
    raise ScheduleTypeError("select", [Problem(
        repr(where), f"a selector is a path string, of_type(...), where_fn(...), or a non-empty list of them; "
                     f"got {type(where).__name__}",
        "e.g. 'model.layers.*.mlp', of_type(nn.Linear) or ['model.norm', 'lm_head']")])


# -- resolution helpers ---------------------------------------------------------------
def _resolve_atom(atom: _Atom, scope: nn.Module, base: str, kind: Kind) -> list[str]:
    if isinstance(atom, _Path):
        return _resolve_pattern(atom.pattern, scope, base, kind)
    hits = [
        path
        for path, module in walk(scope)
        if (isinstance(module, atom.classes) if isinstance(atom, _Type) else atom.fn(join(base, path), module))
    ]
    if not hits:
        raise SelectorError(
            atom.describe(),
            reason=f"matches no module{f' under {base!r}' if base else ''}",
            fix="check the class / predicate, or print(sch) to see the tree",
        )
    if kind is Kind.PARAMETER:
        return _own_parameters(scope, hits, atom.describe())
    return hits


def _own_parameters(scope: nn.Module, module_paths: Iterable[str], key: str) -> list[str]:
    out = []
    for path in module_paths:
        module = get_module(scope, path)
        out += [join(path, n) for n, p in module._parameters.items() if p is not None]
    if not out:
        raise SelectorError(
            key,
            reason="the selected modules have no parameters of their own",
            fix="select a module with parameters (e.g. a Linear) or a parameter path",
        )
    return out


def _resolve_pattern(pattern: str, scope: nn.Module, base: str, kind: Kind) -> list[str]:
    tokens = split(pattern)
    frontier: list[tuple[str, nn.Module]] = [("", scope)]
    params: list[str] = []
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        nxt: list[tuple[str, nn.Module]] = []
        if token == "**":
            for path, module in frontier:
                nxt.extend(walk(module, path))
            frontier = _dedup(nxt)
            continue
        literal = not any(c in token for c in "*?[{")
        for path, module in frontier:
            if literal:  # O(1) per level: the common case of an exact path
                child = module._modules.get(token)
                if child is not None:
                    nxt.append((join(path, token), child))
                if last and kind is not Kind.MODULE and module._parameters.get(token) is not None:
                    params.append(join(path, token))
                continue
            for name, child in module._modules.items():
                if child is not None and _token_matches(token, name):
                    nxt.append((join(path, name), child))
            if last and kind is not Kind.MODULE:
                params += [
                    join(path, n) for n, p in module._parameters.items() if p is not None and _token_matches(token, n)
                ]
        if not nxt and not params:
            if last and kind is not Kind.MODULE and literal:
                empty = next((p for p, m in frontier if token in m._parameters), None)
                if empty is not None:
                    raise _empty_slot_error(join(base, pattern), join(base, empty), token, scope, empty)
            if last and kind is Kind.MODULE and _names_parameter(frontier, token):
                raise SelectorError(
                    join(base, pattern),
                    reason=f"{token!r} is a parameter, and this primitive acts on modules",
                    prefix=join(base, *tokens[:i]),
                    token=token,
                    fix=f"select the module that owns it: {join(base, *tokens[:i])!r}",
                )
            raise _token_error(frontier, base, tokens, i)
        wanted = _indices(token)
        if wanted is not None:
            _check_indices(frontier, base, tokens, i, wanted)
        frontier = _dedup(nxt)
    if kind is Kind.PARAMETER:
        modules = [p for p, _ in frontier]
        return params + (_own_parameters(scope, modules, join(base, pattern)) if modules else [])
    return [p for p, _ in frontier] + params


def _dedup(items: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    seen: dict[str, nn.Module] = {}
    for path, module in items:
        seen.setdefault(path, module)
    return list(seen.items())


def _names_parameter(frontier: list[tuple[str, nn.Module]], token: str) -> bool:
    return any(_token_matches(token, n) for _, m in frontier for n, p in m._parameters.items() if p is not None)


def _empty_slot_error(key: str, owner: str, name: str, scope: nn.Module, local: str) -> SelectorError:
    """``owner.name`` is a parameter slot holding ``None`` (``Linear(..., bias=False)``)."""
    module = get_module(scope, local)
    existing = [join(owner, n) for n, p in module._parameters.items() if p is not None]
    fix = (f"select {owner!r} (its parameters: {', '.join(repr(e) for e in existing)})" if existing
           else f"{owner!r} has no parameters at all: select a module that has some")
    return SelectorError(
        key,
        reason=f"{owner!r} ({type(module).__name__}) has no {name!r}: it was built without one ({name}=None)",
        prefix=owner,
        token=name,
        fix=fix,
    )


def _check_indices(frontier: list[tuple[str, nn.Module]], base: str, tokens: list[str], i: int,
                   wanted: list[int]) -> None:
    """A numeric range or list must not reach past the numbered children there: ``[0-99]``
    on four layers is refused, not read as ``[0-3]``."""
    present = {int(n) for _, m in frontier for n, c in m._modules.items() if c is not None and n.isdigit()}
    missing = [w for w in wanted if w not in present]
    if not missing:
        return
    prefix = join(base, *tokens[:i])
    where = repr(prefix) if prefix else "the root"
    kept = sorted(w for w in set(wanted) if w in present) or sorted(present)
    if len(kept) == 1:
        shown = str(kept[0])
    elif kept[-1] - kept[0] + 1 == len(kept):
        shown = f"[{kept[0]}-{kept[-1]}]"
    else:
        shown = f"[{','.join(map(str, kept))}]"
    suggestion = join(prefix, shown, ".".join(tokens[i + 1 :]))
    raise SelectorError(
        join(base, *tokens),
        reason=f"{where} has children {_spans(present)}; {tokens[i]!r} also asks for {_spans(missing)}, "
               "which do not exist",
        prefix=prefix,
        token=tokens[i],
        fix=f"select only existing indices, e.g. {suggestion!r} (or '*' for all)",
    )


def _token_error(frontier: list[tuple[str, nn.Module]], base: str, tokens: list[str], i: int) -> SelectorError:
    token = tokens[i]
    names: list[str] = []
    for _, module in frontier:
        present = [n for n, c in module._modules.items() if c is not None]
        present += [n for n, p in module._parameters.items() if p is not None]
        for name in present:
            if name not in names:
                names.append(name)
    prefix = join(base, *tokens[:i])
    close = difflib.get_close_matches(token, names, n=3, cutoff=0.5)
    shown = ", ".join(names[:8]) + (", …" if len(names) > 8 else "")
    where = f"{prefix!r}" if prefix else "the root"
    count = f" ({len(frontier)} modules)" if len(frontier) > 1 else ""
    return SelectorError(
        join(base, *tokens),
        reason=f"{where}{count} matched, but nothing under it matches {token!r} (children: {shown or 'none'})",
        prefix=prefix,
        token=token,
        candidates=close,
        fix=f"use one of the children's names, e.g. {join(prefix, close[0] if close else (names or ['?'])[0])!r}",
    )


def _path_error(root: nn.Module, path: str, key: str) -> SelectorError:
    tokens = split(path)
    module = root
    for i, token in enumerate(tokens):
        child = module._modules.get(token)
        if child is None:
            return _token_error([("", module)], "", tokens, i)
        module = child
    return SelectorError(key, reason="no such path")
