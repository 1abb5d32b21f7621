"""docs/architecture.md names modules and functions; each must exist, so the diagrams
cannot drift from the code unnoticed (`stores/<format>.NAME`: every format has NAME)."""

from __future__ import annotations

import importlib
import re

import pytest

from pipeline.stores import formats
from tests.conftest import REPO

DOC = REPO / "docs" / "architecture.md"
LAYERS = ("analysis", "run", "post", "extract", "stores", "io", "tests", "pipeline")
REFERENCE = re.compile(r"(?<![\w<./-])((?:" + "|".join(LAYERS) + r")/[\w<>]+)(\.\w+)?")


def references() -> list[tuple[str, str]]:
    """(module path, attribute or "") for each reference the page makes, once each."""
    found = {(m[1], (m[2] or "").lstrip(".")) for m in REFERENCE.finditer(DOC.read_text())}
    return sorted((path, "" if attr == "py" else attr) for path, attr in found
                  if "<name>" not in path and not path.endswith("_"))


def _file(path: str) -> str:
    if path.startswith(("tests/", "pipeline/")):
        return path
    return f"pipeline/{path}"


@pytest.mark.parametrize(("path", "attr"), references(), ids=lambda v: v or "-")
def test_every_module_and_name_the_architecture_page_gives_exists(path: str, attr: str) -> None:
    if path == "stores/<format>":
        for fmt in formats().values():
            assert hasattr(fmt, attr), f"{fmt.__name__} has no {attr}"
        return
    file = REPO / _file(path)
    assert file.with_suffix(".py").exists() or (file / "__init__.py").exists() or \
        file.exists(), f"{path} is named in docs/architecture.md but does not exist"
    if attr:
        module = importlib.import_module(_file(path).replace("/", "."))
        assert hasattr(module, attr), f"{path}.{attr} is named but {path} has no {attr}"


def test_the_page_names_enough_to_be_checked() -> None:
    assert len(references()) > 30
