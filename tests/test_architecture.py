"""The package's import structure: one direction of imports, no cycles, no imports hidden
in functions to dodge them (issue: "One direction of imports").

The layers are written down once, as the import-linter contract in ``pyproject.toml``
(``make lint`` runs it); these tests check that the contract holds, that it would catch
an upward import, and what import-linter cannot see: function-local imports.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "slapo_fn"

#: Third-party modules that may be imported inside a function, each for a reason:
#: optional extras a user may not have installed, or costly imports paid only on use.
OPTIONAL = {
    "flash_attn": "the gpu extra; CUDA only",
    "torchao": "the float8 extra (float8 linears, CUDA sm_89+)",
    "transformers": "the hf extra",
    "optuna": "the tune extra",
    "matplotlib": "the tune extra",
    "rich": "pretty tables where installed",
    "pyarrow": "costly to import (comes with datasets): read where a corpus has parquet files",
    "datasets": "costly to import (about 1 s): data/ streams and reads datasets on use",
    "tokenizers": "comes with transformers (the hf extra): BPE trained on the fly and prepare's workers (data/)",
    "torch.utils.tensorboard": "the tensorboard extra (it imports the tensorboard package)",
    "wandb": "the wandb extra",
    "einops": "a user's model written with it: taught to run on traced values where the user imported it",
}
#: Modules allowed to import lazily, with why.
LAZY_MODULES = {
    "slapo_fn/cli.py": "the command line answers --help and refuses bad arguments before torch loads (~4 s)",
}


def _function_local_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def test_no_module_imports_inside_a_function_except_optional_dependencies() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in LAZY_MODULES:
            continue
        for line, name in _function_local_imports(path):
            if not any(name == o or name.startswith(o + ".") for o in OPTIONAL):  # a module of an extra
                offenders.append(f"{rel}:{line} imports {name} inside a function")
    assert not offenders, "\n".join(offenders)


def test_the_package_has_no_import_cycle() -> None:
    graph = grimp.build_graph("slapo_fn", exclude_type_checking_imports=True)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            # a package importing its own submodules (``__init__`` re-exports) is not a cycle
            if imported.startswith(module + "."):
                continue
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None and not module.startswith(imported + "."):
                cycles.append(" -> ".join((module, *back)))
    assert not cycles, "\n".join(cycles)


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe)], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PATH": str(exe.parent), "PYTHONPATH": str(root)})


def test_the_layer_contract_holds() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    # the package's layers, slapo_fn.data's own and the tensor-parallel planner's
    assert "3 kept, 0 broken" in result.stdout


@pytest.mark.slow
def test_an_upward_import_breaks_the_layer_contract(tmp_path: Path) -> None:
    shutil.copytree(PACKAGE, tmp_path / "slapo_fn", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    tree = tmp_path / "slapo_fn" / "tree.py"
    tree.write_text(tree.read_text().replace("import torch\n", "import torch\n\nfrom .explain import explain\n", 1))
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "slapo_fn.tree is not allowed to import slapo_fn.explain" in result.stdout


def test_the_command_line_answers_help_before_torch_loads() -> None:
    """``import slapo_fn`` imports nothing heavy (its names load on first use), so the
    command line's parser and --help run without torch."""
    code = ("import sys, slapo_fn, slapo_fn.cli\n"
            "from slapo_fn.cli import _parsers\n"
            "_parsers()[0].format_help()\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_every_public_name_is_the_object_its_module_defines() -> None:
    """Names load lazily; where a function has its submodule's name (build, explain,
    verify, select) it stays the function after the submodule is imported."""
    import importlib

    import slapo_fn as sf
    from slapo_fn import _EXPORTS

    sf.shard  # noqa: B018  (imports most submodules)
    for name in sf.__all__:
        value = getattr(sf, name)
        if name in _EXPORTS:
            assert value is getattr(importlib.import_module(_EXPORTS[name], "slapo_fn"), name), name
        else:
            assert value is importlib.import_module(f"slapo_fn.{name}"), name
    assert callable(sf.build) and callable(sf.verify) and callable(sf.explain) and callable(sf.select)
    assert sf.dtensor.plan is importlib.import_module("slapo_fn.dtensor").plan
    with pytest.raises(AttributeError, match="has no attribute 'nosuch'"):
        sf.nosuch  # noqa: B018
