"""What ships and what is documented: the packaged schemas are the top-level ones, the
store schema describes every provenance field, and every exit code is in the help and
the docs. (tests/packaging/check_wheel.sh installs the built wheel and runs it.)"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import re
from pathlib import Path

from click.testing import CliRunner

import pipeline
from pipeline import errors
from pipeline.cli import main
from pipeline.spec import JOB_SCHEMA_PATH, job_schema
from pipeline.stores.provenance import FileSum, PostInfo, Provenance
from tests.conftest import REPO, SCHEMAS, store_schema_errors

PACKAGED = Path(pipeline.__file__).parent / "schemas"


def test_packaged_schemas_are_the_top_level_ones() -> None:
    top = sorted(p.name for p in SCHEMAS.glob("*.json"))
    assert top == sorted(p.name for p in PACKAGED.glob("*.json"))
    for name in top:
        assert (PACKAGED / name).read_bytes() == (SCHEMAS / name).read_bytes(), (
            f"pipeline/schemas/{name} differs from schemas/{name}: run `make schemas`")


def test_job_schema_is_read_from_the_package() -> None:
    assert Path(str(JOB_SCHEMA_PATH)).parent == PACKAGED
    assert job_schema()["$id"].endswith("job.schema.json")


def test_package_data_names_the_schemas() -> None:
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "pipeline.schemas" in config["packages"]
    assert config["package-data"]["pipeline.schemas"] == ["*.json"]


def _schema_properties(*path: str) -> set[str]:
    node = json.loads((SCHEMAS / "store.schema.json").read_text())["properties"]["provenance"]
    for key in path:
        node = node["properties"][key]["additionalProperties"]
    return set(node["properties"])


def test_store_schema_describes_every_provenance_field() -> None:
    assert _schema_properties() == {f.name for f in dataclasses.fields(Provenance)}
    assert _schema_properties("post") == {f.name for f in dataclasses.fields(PostInfo)}
    assert _schema_properties("checksums") == {f.name for f in dataclasses.fields(FileSum)}
    assert "autocast" not in (SCHEMAS / "store.schema.json").read_text()


def test_store_schema_refuses_an_undocumented_key() -> None:
    from tests.conftest import synthetic_provenance

    good = synthetic_provenance(Path("/tmp/x.zarr"), {"mean": {"pooling": "mean"}})
    assert store_schema_errors(good) == []
    assert any("not_documented" in e for e in store_schema_errors({**good, "not_documented": 1}))
    bad_sum = {**good, "checksums": {"docs/mean/c/0/0": {"sha256": "x", "size": 3}}}
    assert any("checksums" in e for e in store_schema_errors(bad_sum))


def _codes_in(text: str) -> dict[int, str]:
    return {int(code): line for code, line in re.findall(r"^\|?\s*(\d)\s+\|?(.*)$", text, re.M)}


def _error_classes() -> list[type[errors.BertpipeError]]:
    """Every error class of the package, wherever it is defined."""
    for module in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
        importlib.import_module(module.name)
    found, todo = [], [errors.BertpipeError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    assert len(found) >= 7
    return found


def test_every_exit_code_is_in_the_help() -> None:
    out = CliRunner().invoke(main, ["--help"])
    assert out.exit_code == 0
    codes = _codes_in(out.stdout.split("Exit codes:")[1].replace("\n     ", " "))
    assert set(codes) == set(range(9))
    for cls in _error_classes():
        assert cls.exit_code in codes
        if cls is not errors.BertpipeError:
            assert cls.__name__ in codes[cls.exit_code], (cls.__name__, codes[cls.exit_code])
    assert "scheduler unreachable" in codes[7]
    assert "object store unreachable" in codes[8]


def test_every_exit_code_is_in_the_docs() -> None:
    table = (REPO / "docs" / "exit-codes.md").read_text()
    rows = {int(m[0]): m[1] for m in re.findall(r"^\| (\d) \| ([^|]+) \|", table, re.M)}
    assert set(rows) == set(range(9))
    for cls in _error_classes():
        assert cls.__name__ in rows[cls.exit_code], (cls.__name__, rows[cls.exit_code])
    assert "SchedulerError" in rows[7]
    assert "EndpointError" in rows[8]

