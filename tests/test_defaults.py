"""One truth for a job's defaults: the schema's. docs/jobs.md states the same defaults in
its key table, and the job's dataclasses (pipeline/spec.py) use them."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
import yaml

from pipeline import spec
from tests.conftest import REPO

SECTIONS = {"input": spec.InputSpec, "model": spec.ModelSpec, "chunking": spec.ChunkingSpec,
            "output": spec.OutputSpec, "batching": spec.BatchingSpec,
            "execution": spec.ExecutionSpec}
ROW = re.compile(r"^\| `([a-z_]+\.[a-z_]+)` \| ([^|]*) \|")


def schema_defaults() -> dict[str, Any]:
    """`section.key` -> default, for every key of the job schema that has one."""
    schema = json.loads((REPO / "schemas" / "job.schema.json").read_text())
    return {f"{section}.{key}": body["default"]
            for section, part in schema["properties"].items()
            for key, body in part.get("properties", {}).items() if "default" in body}


def documented_defaults() -> dict[str, str]:
    """`section.key` -> the default cell of the key table in docs/jobs.md."""
    rows = [ROW.match(line) for line in (REPO / "docs" / "jobs.md").read_text().splitlines()]
    return {m.group(1): m.group(2).strip() for m in rows if m}


def test_the_tables_are_found() -> None:
    assert len(schema_defaults()) >= 20
    assert "batching.max_tokens_per_batch" in documented_defaults()


@pytest.mark.parametrize("key", sorted(schema_defaults()))
def test_docs_state_the_schema_default(key: str) -> None:
    documented = documented_defaults()
    assert key in documented, f"docs/jobs.md has no row for {key}"
    cell = documented[key].strip("`")
    assert yaml.safe_load(cell) == schema_defaults()[key], \
        f"docs/jobs.md says {key} defaults to {documented[key]}, the schema says " \
        f"{schema_defaults()[key]!r}"


@pytest.mark.parametrize("key", sorted(schema_defaults()))
def test_the_job_uses_the_schema_default(key: str) -> None:
    section, name = key.split(".")
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
    field = fields[name]
    default = field.default_factory() if field.default is dataclasses.MISSING \
        else field.default  # type: ignore[misc]
    want = schema_defaults()[key]
    assert (list(default) if isinstance(default, tuple) else default) == want, key
