"""Every code block of the README and of docs/ runs as written.

* ``python`` blocks: the blocks of one page, in order, are one script (each line at its
  own line number, so a traceback points into the page). A page whose first block says
  ``torchrun --nproc-per-node N`` runs on N local processes, as it tells its reader to.
* ``sh`` blocks: each ``slapo-fn`` line parses with the real command line (its flags and
  values exist), ``make`` names a target of the Makefile, and a script it runs exists.
* ``text`` blocks show output; the error messages among them are the library's own,
  produced again here.

A block without a language is refused, so that a new block cannot escape the suite.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "sh", "text"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the line number of the block's first code line
    language: str
    code: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found: list[Block] = []
    lines = page.read_text().splitlines()
    start: int | None = None
    language = ""
    for i, line in enumerate(lines, start=1):
        if not line.startswith("```"):
            continue
        if start is None:
            start, language = i + 1, line[3:].strip()
        else:
            found.append(Block(page, start, language, "\n".join(lines[start - 1 : i - 1])))
            start = None
    assert start is None, f"{page}: a code block opened at line {start - 1} is never closed"
    return found


def every_block() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


def test_every_block_says_its_language() -> None:
    untagged = [str(b) for b in every_block() if b.language not in LANGUAGES]
    assert not untagged, f"blocks without a language in {sorted(LANGUAGES)}: {untagged}"


# ----------------------------------------------------------------------------- python blocks


def script(page: Path) -> tuple[str, int]:
    """The page's python blocks as one script, each line at its line number in the page,
    and the number of processes its first block asks for (1 without ``torchrun``)."""
    lines = [""] * len(page.read_text().splitlines())
    python = [b for b in blocks(page) if b.language == "python"]
    for b in python:
        for offset, line in enumerate(b.code.splitlines()):
            lines[b.line - 1 + offset] = line
    ranks = re.search(r"torchrun --nproc-per-node (\d+)", python[0].code) if python else None
    return "\n".join(lines) + "\n", int(ranks.group(1)) if ranks else 1


PYTHON_PAGES = [p for p in PAGES if any(b.language == "python" for b in blocks(p))]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", [pytest.param(p, id=p.name, marks=() if p.name == "README.md" else pytest.mark.slow)
                                  for p in PYTHON_PAGES])
def test_the_python_blocks_of_a_page_run_as_one_script(page: Path, tmp_path: Path) -> None:
    code, ranks = script(page)
    path = tmp_path / page.name.replace(".md", ".py")
    path.write_text(code)
    command = [sys.executable, str(path)]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   str(path)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=580)
    # tracebacks name the page's file with the page's own line numbers
    assert result.returncode == 0, (result.stdout[-3000:] + result.stderr[-6000:]).replace(str(path), str(page))


def test_a_python_block_that_fails_points_at_its_line_in_the_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\ntext\n\n```python\nassert x == 2, 'wrong'\n```\n")
    code, ranks = script(page)
    assert ranks == 1 and code.splitlines()[9] == "assert x == 2, 'wrong'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and 'line 10' in result.stderr


# ----------------------------------------------------------------------------- sh blocks


def commands(block: Block) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block.code)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _cli_argv(command: str) -> list[str]:
    """``slapo-fn ...`` as argv for the parser: optional ``[--flag]`` parts included,
    placeholders in capitals given a value of the right kind."""
    command = re.sub(r"\[([^\]]*)\]", r"\1", command)
    argv = shlex.split(command)[1:]
    return ["0" if a in {"R", "N", "P"} else a for a in argv]


SH_COMMANDS = [(b, c) for b in every_block() if b.language == "sh" for c in commands(b)]


@pytest.mark.parametrize(("block", "command"), SH_COMMANDS, ids=[f"{b}:{c[:40]}" for b, c in SH_COMMANDS])
def test_each_shell_command_of_the_docs_is_real(block: Block, command: str) -> None:
    from slapo_fn.cli import _parsers

    words = shlex.split(re.sub(r"\[([^\]]*)\]", r"\1", command))
    program = Path(words[0]).name
    if program == "slapo-fn":
        try:
            _parsers()[0].parse_args(_cli_argv(command))
        except SystemExit as e:
            pytest.fail(f"{block}: '{command}' does not parse (exit {e.code})")
    elif program == "make":
        targets = re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        assert all(w in targets for w in words[1:]), f"{block}: '{command}': no such Makefile target"
    elif program in {"python", "python3"}:
        scripts = [w for w in words if w.endswith(".py")]
        assert scripts and all((ROOT / s).is_file() for s in scripts), f"{block}: '{command}': no such script"
    else:
        pytest.fail(f"{block}: '{command}': this test does not know how to check '{program}'")


@pytest.mark.timeout(120)
def test_the_explain_commands_of_the_docs_run() -> None:
    explains = sorted({c for _, c in SH_COMMANDS if shlex.split(c)[1:2] == ["explain"]})
    assert explains
    for command in explains:
        argv = shlex.split(command)[1:]
        result = subprocess.run([sys.executable, "-m", "slapo_fn.cli", *argv], cwd=ROOT, capture_output=True,
                                text=True, timeout=100)
        assert result.returncode == 0, f"'{command}': {result.stderr[-2000:]}"
        assert "collectives" in result.stdout


# ----------------------------------------------------------------------------- output blocks


def _output_block(page: str, first_line: str) -> str:
    (block,) = [b for b in blocks(ROOT / page) if b.language == "text" and b.code.startswith(first_line)]
    return block.code


def _words(text: str) -> list[str]:
    return text.split()


def test_the_readme_selector_error_is_the_librarys() -> None:
    import slapo_fn as sf
    from slapo_fn.presets import build_model

    shown = _output_block("README.md", "SelectorError:")
    sch = sf.create_schedule(build_model("llama-7b", meta=True))
    with pytest.raises(sf.SelectorError) as e:
        sf.shard(sch, "model.layers.*.mpl", axis=0)
    assert _words(f"SelectorError: {e.value}") == _words(shown)


def test_the_functional_docs_shard_error_is_the_librarys() -> None:
    import torch

    import slapo_fn as sf
    from slapo_fn.dtensor.testing import fake_mesh

    shown = _output_block("docs/functional.md", "shard: 2 problems")
    tp = fake_mesh(2)  # the conftest tears the fake process group down
    with pytest.raises(sf.LayoutError) as e:
        sf.func.shard({"w": torch.randn(4, 5)}, {"w": sf.P("pp", "tp")}, tp)
    assert _words(str(e.value)) == _words(shown)
