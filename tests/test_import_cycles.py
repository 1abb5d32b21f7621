"""No import cycle among the package's modules, counting every import in a file: at the
top, inside a function, or under `if TYPE_CHECKING:`. The layer contract (lint-imports)
sees only what the modules import when loaded; a cycle closed by an import inside a
function still ties two modules into one, so it is read here from the source itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """`pipeline.run.executors` for pipeline/run/executors.py (a package: its __init__)."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.Module, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules that an import anywhere in the file names, relative ones
    resolved against `name`. `from x import y` names x.y where that is a module, else x."""
    base = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = base[: len(base) - node.level + 1] if node.level else []
            source = ".".join([*anchor, *filter(None, (node.module or "").split("."))])
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                          else source)
    return found & modules


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its file."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    return {name: imported(ast.parse(path.read_text(encoding="utf-8")), name,
                           path.name == "__init__.py", set(files)) - {name}
            for name, path in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles as [a, b, ..., a]: a depth-first search, one cycle for each import that
    reaches a module still on the search's path (every cycle has at least one)."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once left
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# ---- the finder itself, on a package written here -----------------------------------------

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pipeline"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize(("path", "back"), [
    ("b.py", "from . import a\n"),  # a sibling named in `from . import`
    ("b.py", "def late():\n    from .a import thing\n"),  # inside a function
    ("b.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import Thing\n"),
    ("b.py", "import pipeline.a\n"),  # absolute
    ("sub/b.py", "def late():\n    from ..a import thing\n"),  # two dots, from a subpackage
])
def test_a_cycle_is_found_however_its_import_is_written(tmp_path: Path, path: str,
                                                        back: str) -> None:
    b = module_name(tmp_path / "pipeline" / path, tmp_path / "pipeline")
    root = _package(tmp_path, {"a.py": f"from {b.removeprefix('pipeline')} import x\n",
                               path: back, "sub/__init__.py": "", "c.py": "from .a import y\n"})
    cycles = find_cycles(import_graph(root))
    assert len(cycles) == 1 and cycles[0][0] == cycles[0][-1]
    assert set(cycles[0]) == {"pipeline.a", b}


def test_imports_one_way_are_no_cycle(tmp_path: Path) -> None:
    root = _package(tmp_path, {"a.py": "from .b import x\nimport json\n",
                               "b.py": "def f():\n    from .c import y\n",
                               "c.py": "from . import d\n", "d.py": "import os\n"})
    graph = import_graph(root)
    assert graph["pipeline.a"] == {"pipeline.b"} and graph["pipeline.c"] == {"pipeline.d"}
    assert find_cycles(graph) == []
