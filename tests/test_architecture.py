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
    "transformers": "the hf extra",
    "optuna": "the tune extra",
    "matplotlib": "the tune extra",
    "rich": "pretty tables where installed",
    "datasets": "the hf extra: Hugging Face datasets saved on disk (data.py)",
    "tokenizers": "comes with transformers (the hf extra): BPE trained on the fly (data.py)",
    "torch.utils.tensorboard": "the tensorboard extra (it imports the tensorboard package)",
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
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.slow
def test_an_upward_import_breaks_the_layer_contract(tmp_path: Path) -> None:
    shutil.copytree(PACKAGE, tmp_path / "slapo_fn", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    tree = tmp_path / "slapo_fn" / "tree.py"
    tree.write_text(tree.read_text().replace("import torch\n", "import torch\n\nfrom .explain import explain\n", 1))
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "slapo_fn.tree is not allowed to import slapo_fn.explain" in result.stdout
