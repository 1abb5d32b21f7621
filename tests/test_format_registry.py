"""A store format is one plugin: outside `pipeline/stores/` no code names a format (it asks
the registry), and the registry's classes each say what the rest of the code needs."""

from __future__ import annotations

import ast

import pytest

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


def test_s3_access_is_read_once_from_the_options_else_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One reading of where an s3:// store is and how to reach it, which the Delta format's
    options are made from (as the Icechunk format's storage is)."""
    from pipeline.io.location import S3Access, resolve
    from pipeline.stores.delta_store import storage_options_of

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    plain = resolve("s3://bucket/team/store.delta/")
    access = S3Access.of(plain)
    assert (access.bucket, access.prefix, access.endpoint, access.region, access.key) == \
        ("bucket", "team/store.delta", "http://127.0.0.1:9", "eu-west-3", None)
    assert access.plain_http
    given = resolve("s3://bucket/x.delta", {"key": "k", "secret": "s", "client_kwargs": {
        "endpoint_url": "https://s3.example", "region_name": "ap-south-1"}})
    options = storage_options_of(given)
    assert options is not None
    assert (options["AWS_ENDPOINT_URL"], options["AWS_REGION"], options["AWS_ACCESS_KEY_ID"],
            options["AWS_SECRET_ACCESS_KEY"]) == ("https://s3.example", "ap-south-1", "k", "s")
    assert "AWS_ALLOW_HTTP" not in options
    with pytest.raises(ValueError):
        S3Access.of(resolve("memory://bucket/x"))
