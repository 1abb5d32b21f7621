"""A store format is one plugin: outside `pipeline/stores/` no code names a format (it asks
the registry), and the registry's classes each say what the rest of the code needs."""

from __future__ import annotations

import ast

from pipeline.stores import REGISTRY, formats
from pipeline.stores.base import StoreFormat
from tests.conftest import REPO

# string constants outside stores/ that equal a format's name on purpose: the job's default
# format, and the incremental run's key for its delta of changed texts (another meaning)
ALLOWED = {("pipeline/spec.py", "zarr"), ("pipeline/run/incremental.py", "delta")}


def test_no_code_outside_the_stores_names_a_format() -> None:
    named = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel.startswith("pipeline/stores/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in REGISTRY and \
                    (rel, node.value) not in ALLOWED:
                named.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not named, "ask the registry (pipeline.stores.format_named) instead:\n" + \
        "\n".join(named)


def test_every_format_says_what_the_rest_of_the_code_asks() -> None:
    for name, fmt in formats().items():
        assert issubclass(fmt, StoreFormat) and fmt.name == name
        assert fmt.own_entries and "_bertpipe" in fmt.own_entries, name
        assert not getattr(fmt.is_ours, "__isabstractmethod__", False), name
        assert fmt.url_schemes is None or all("://" not in s for s in fmt.url_schemes)
    growing = [name for name, fmt in formats().items() if not fmt.cannot_grow]
    assert growing and "zarr" not in growing
