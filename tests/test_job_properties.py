"""Property: any job document, valid or wrong in any one value, goes through `validate`
and `extract --dry-run` without a traceback, with exit 0 when valid and the documented
code of its error class when not (2 job file, 3 input, 4 model), one `error:` line, the
same answer from both commands, and nothing created."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cli import main
from tests.conftest import REPO, write_table

pytestmark = pytest.mark.table  # hundreds of CLI runs: make test, not make test-fast

N_LAYERS = 2  # the tiny BERT: hidden states 0..2, hidden size 32, 64 positions
SAFE_NAMES = st.from_regex(r"\A[a-z][a-z0-9_]{0,10}\Z").filter(
    lambda n: n not in {"id", "ids", "row", "doc", "docs", "chunk", "chunks", "seq", "start",
                        "end", "n_tokens", "n_chunks", "truncated", "status", "post", "index",
                        "label", "stars", "text"} and not n.endswith("_dim"))
POOLINGS = ["cls", "mean", "max", "attention", "last"]


@st.composite
def valid_view(draw: st.DrawFn) -> dict[str, Any]:
    """A view the tiny model can compute (layers in range, weights finite and matching)."""
    layer = st.integers(-(N_LAYERS + 1), N_LAYERS)
    kind = draw(st.sampled_from(["single", "combine", "weights", "pooler"]))
    if kind == "pooler":
        return {"pooling": "pooler"}
    view: dict[str, Any] = {"pooling": draw(st.sampled_from(POOLINGS))}
    if kind == "single":
        view["layers"] = draw(st.one_of(layer, st.lists(layer, min_size=1, max_size=1)))
    else:
        layers = draw(st.one_of(st.just("all"), st.lists(layer, min_size=2, max_size=3)))
        view["layers"] = layers
        n = N_LAYERS + 1 if layers == "all" else len(layers)
        if kind == "combine":
            view["combine"] = draw(st.sampled_from(["mean", "sum", "concat"]))
        else:
            view["combine"] = draw(st.sampled_from(["weighted", "scalar_mix"]))
            view["weights"] = draw(st.lists(st.floats(-3, 3), min_size=n, max_size=n))
            if view["combine"] == "scalar_mix" and draw(st.booleans()):
                view["gamma"] = draw(st.floats(0.1, 4))
    if draw(st.booleans()):
        view["normalize"] = draw(st.booleans())
    if draw(st.booleans()):
        view["post"] = draw(st.one_of(
            st.sampled_from(["center", "whiten", "abtt"]),
            st.fixed_dictionaries({"method": st.just("whiten"),
                                   "dims": st.integers(1, 32)}),
            st.fixed_dictionaries({"method": st.just("abtt"), "d": st.integers(1, 31)})))
    return view


@st.composite
def valid_job(draw: st.DrawFn, src: Path, model: Path, out: Path) -> dict[str, Any]:
    names = draw(st.lists(SAFE_NAMES, min_size=1, max_size=3, unique_by=str.casefold))
    max_tokens = draw(st.one_of(st.none(), st.integers(8, 600)))
    model_max = draw(st.integers(8, 512))
    strategy = draw(st.sampled_from(["hierarchical", "truncate"]))
    # content tokens per chunk on the tiny model (64 positions, [CLS] and [SEP])
    budget = min(max_tokens or model_max, model_max, 64) - 2
    overlap = draw(st.integers(0, (budget - 1) // 2)) if strategy == "hierarchical" else 0
    return {
        "input": {"path": str(src), "text_column": "text",
                  "id_column": draw(st.sampled_from(["id", None])),
                  "carry_columns": draw(st.lists(st.sampled_from(["label", "stars", "text"]),
                                                 unique=True, max_size=3))},
        "model": {"path": str(model), "dtype": draw(st.sampled_from(["auto", "float32"])),
                  "device": "cpu", "max_tokens": model_max},
        "chunking": {"strategy": strategy, "max_tokens": max_tokens, "overlap": overlap,
                     "aggregate": draw(st.sampled_from(["mean", "mean_unweighted", "max",
                                                        "first"]))},
        "views": {name: draw(valid_view()) for name in names},
        "output": {"path": str(out), "format": draw(st.sampled_from(["zarr", "parquet"])),
                   "dtype": draw(st.sampled_from(["float32", "float16"])),
                   "levels": draw(st.sampled_from([["docs"], ["docs", "chunks"]]))},
        "batching": {"max_tokens_per_batch": draw(st.integers(16, 8192)),
                     "max_batch_size": draw(st.integers(1, 512))},
        "execution": {"scheduler": "synchronous", "partition_rows": draw(st.integers(1, 50)),
                      "retries": draw(st.integers(0, 3))},
    }


# One wrong value at a time: (key path, value, exit code, fragment of the message). A key
# path starting with `view.` is applied to the job's first view.
NAN, INF = float("nan"), float("inf")
WRONG: list[tuple[str, Any, int, str]] = [
    ("input.path", 3, 2, "input.path: 3 is not of type 'string'"),
    ("input.path", "/no/such.parquet", 3, "input.path: /no/such.parquet does not exist"),
    ("input.path", "", 2, "input.path"),
    ("input.text_column", "body", 3, "input.text_column: column 'body' not in"),
    ("input.text_column", "stars", 3, "expected string"),
    ("input.text_column", None, 2, "input.text_column: None is not of type 'string'"),
    ("input.id_column", "nope", 3, "input.id_column: column 'nope' not in"),
    ("input.id_column", "score", 3, "ids must be integers or strings"),
    ("input.id_column", 5, 2, "input.id_column: 5 is not of type"),
    ("input.carry_columns", ["nope"], 3, "input.carry_columns: column 'nope' not in"),
    ("input.carry_columns", ["id"], 2, "'id' is a field the store writes itself"),
    ("input.carry_columns", ["status"], 2, "'status' is a field the store writes itself"),
    ("input.carry_columns", ["a b"], 2, "'a b' is not a valid name"),
    ("input.carry_columns", "label", 2, "input.carry_columns: 'label' is not of type 'array'"),
    ("input.carry_columns", ["tags"], 3, "list, struct and map columns are not carried"),
    ("input.extra", 1, 2, "'extra' was unexpected"),
    ("model.path", "/no/such/model", 4, "model.path: /no/such/model does not exist"),
    ("model.path", 7, 2, "model.path: 7 is not of type 'string'"),
    ("model.dtype", "int8", 2, "model.dtype: 'int8' is not one of"),
    ("model.device", "tpu", 2, "model.device"),
    ("model.max_tokens", 4, 2, "model.max_tokens: 4 is less than the minimum of 8"),
    ("model.max_tokens", "x", 2, "model.max_tokens: 'x' is not of type 'integer'"),
    ("model.max_tokens", NAN, 2, "model.max_tokens: nan is not an integer"),
    ("model.allow_pickle", "yes", 2, "model.allow_pickle: 'yes' is not of type 'boolean'"),
    ("chunking.strategy", "sentences", 2, "chunking.strategy"),
    ("chunking.max_tokens", 2, 2, "chunking.max_tokens: 2 is less than the minimum of 8"),
    ("chunking.max_tokens", INF, 2, "chunking.max_tokens: inf is not an integer"),
    ("chunking.overlap", -1, 2, "chunking.overlap: -1 is less than the minimum of 0"),
    ("chunking.overlap", 40, 2, "chunking.overlap: 40 must be under half"),
    ("chunking.aggregate", "median", 2, "chunking.aggregate"),
    ("view.layers", [9], 2, "layers: 9 is out of range for a model with 2 layers"),
    ("view.layers", [-9], 2, "layers: -9 is out of range"),
    ("view.layers", "some", 2, "layers: 'some' is not valid"),
    ("view.layers", [], 2, "layers: [] is not valid"),
    ("view.layers", [1.5], 2, "layers: [1.5] is not valid"),
    ("view.pooling", "median", 2, "pooling: 'median' is not one of"),
    ("view.pooling", None, 2, "pooling: None is not one of"),
    ("view.combine", "product", 2, "combine: 'product' is not one of"),
    ("view.weights", [0.0, NAN, 1.0], 2, "weights: [0.0, nan, 1.0] must be finite numbers"),
    ("view.weights", [INF, 0.0, 1.0], 2, "weights: [inf, 0.0, 1.0] must be finite numbers"),
    ("view.weights", [0.0, 1.0], 2, "weights: 2 weights for 3 layers"),
    ("view.weights", ["a", 0, 1], 2, "weights.0: 'a' is not of type 'number'"),
    ("view.gamma", INF, 2, "gamma: inf must be a finite number"),
    ("view.gamma", NAN, 2, "gamma: nan must be a finite number"),
    ("view.normalize", "no", 2, "normalize: 'no' is not of type 'boolean'"),
    ("view.post", "pca", 2, "post"),
    ("view.post", {"method": "whiten", "dims": 0}, 2, "post"),
    ("view.post", {"method": "whiten", "dims": 33}, 2, "post.dims: 33 is more than the "
                                                        "view's width 32"),
    ("view.post", {"method": "abtt", "d": 32}, 2, "post.d: removing 32 directions"),
    ("view.post", {"method": "center", "dims": 3}, 2, "post.dims: only used with method "
                                                        "whiten"),
    ("view.extra", 1, 2, "'extra' was unexpected"),
    ("views", {}, 2, "views: {} should be non-empty"),
    ("views", [], 2, "views: [] is not of type 'object'"),
    ("views", {"status": {"pooling": "mean"}}, 2, "'status' is a field the store writes"),
    ("views", {"label": {"pooling": "mean"}}, 2, "'label' collides with carried column"),
    ("views", {"a/b": {"pooling": "mean"}}, 2, "'a/b' is not a valid name"),
    ("views", {"x_dim": {"pooling": "mean"}}, 2, "'x_dim' ends in '_dim'"),
    ("output.format", "csv", 2, "output.format: 'csv' is not one of"),
    ("output.dtype", "int8", 2, "output.dtype: 'int8' is not one of"),
    ("output.levels", [], 2, "output.levels: [] should be non-empty"),
    ("output.levels", ["rows"], 2, "output.levels.0: 'rows' is not one of"),
    ("output.storage_options", {"key": "k"}, 2, "output.storage_options: only used with a URL"),
    ("output.overwrite", "y", 2, "output.overwrite: 'y' is not of type 'boolean'"),
    ("batching.max_tokens_per_batch", 0, 2, "batching.max_tokens_per_batch: 0 is less than"),
    ("batching.max_batch_size", 0, 2, "batching.max_batch_size: 0 is less than"),
    ("execution.partition_rows", 0, 2, "execution.partition_rows: 0 is less than"),
    ("execution.partition_rows", "many", 2, "execution.partition_rows: 'many' is not of type"),
    ("execution.retries", -1, 2, "execution.retries: -1 is less than the minimum of 0"),
    ("execution.workers", 0, 2, "execution.workers: 0 is less than the minimum of 1"),
    ("extra", {}, 2, "'extra' was unexpected"),
    ("input.unique_ids", "y", 2, "input.unique_ids: 'y' is not of type 'boolean'"),
    ("input.storage_options", {"key": "k"}, 2, "input.storage_options: only used with a URL"),
    ("model.runtime", "tvm", 2, "model.runtime: 'tvm' is not one of"),
    ("model.trust_remote_code", "yes", 2, "model.trust_remote_code: 'yes' is not of type "
                                          "'boolean'"),
    ("output.path", 3, 2, "output.path: 3 is not of type 'string'"),
    ("output.incremental", "y", 2, "output.incremental: 'y' is not of type 'boolean'"),
    ("execution.scheduler", "somewhere", 2, "execution.scheduler: 'somewhere' is not"),
    ("execution.threads_per_worker", 0, 2, "execution.threads_per_worker: 0 is less than the "
                                           "minimum of 1"),
]


def _apply(raw: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(raw)
    *parents, last = key.split(".")
    node = doc
    for part in parents:
        node = next(iter(node["views"].values())) if part == "view" else node[part]
    node[last] = value
    return doc


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("props")
    write_table(root / "in.parquet", {"id": list(range(6)), "text": ["good", None, "bad drug",
                                                                     "", "pain", "sleep"],
                                      "label": ["a", "b", None, "a", "b", "a"],
                                      "stars": [1, 2, 3, 4, 5, None],
                                      "score": [0.5, 1.0, 1.5, 2.0, 2.5, 3.0],
                                      "tags": [["x"], [], ["y", "z"], None, ["x"], ["y"]]})
    return root


def _both(place: Path, doc: dict[str, Any]) -> tuple[Result, Result]:
    job = place / "job.yaml"
    job.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    runner = CliRunner()
    return (runner.invoke(main, ["validate", str(job)]),
            runner.invoke(main, ["extract", str(job), "--dry-run"]))


def _check(place: Path, doc: dict[str, Any], expected: int, fragment: str = "") -> None:
    output = doc.get("output")
    out = Path(output["path"]) if isinstance(output, dict) and \
        isinstance(output.get("path"), str) else None
    results = _both(place, doc)
    for result in results:
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            repr(result.exception)
        assert "Traceback" not in result.output
        assert result.exit_code == expected, (result.output, doc)
        if expected:
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
            assert fragment in lines[0], lines[0]
    if not expected:
        assert "valid" in results[0].stdout and "nothing was created" in results[1].stdout
    assert results[0].stderr == results[1].stderr  # the same checks, the same answer
    if out is not None:
        assert not out.exists()


SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@SETTINGS
@given(data=st.data())
def test_valid_jobs_pass(place: Path, tiny_bert: Path, data: st.DataObject) -> None:
    doc = data.draw(valid_job(place / "in.parquet", tiny_bert, place / "out.zarr"))
    _check(place, doc, 0)


@pytest.mark.parametrize("wrong", WRONG, ids=[f"{k}={v!r}" for k, v, _, _ in WRONG])
@settings(SETTINGS, max_examples=3)  # every wrong value, each in a few random valid jobs
@given(data=st.data())
def test_one_wrong_value_is_refused_with_its_code(place: Path, tiny_bert: Path,
                                                  data: st.DataObject,
                                                  wrong: tuple[str, Any, int, str]) -> None:
    doc = data.draw(valid_job(place / "in.parquet", tiny_bert, place / "out.zarr"))
    key, value, code, fragment = wrong
    first = next(iter(doc["views"]))
    # what makes the one value wrong: a context in which nothing else is
    if key.startswith(("view.weights", "view.gamma", "view.post")):
        doc["views"][first] = {"layers": "all", "combine": "scalar_mix",
                               "weights": [0.0, 0.0, 1.0], "pooling": "mean"}
    elif key.startswith("view."):
        doc["views"][first] = {"pooling": "mean"}
    if key == "chunking.overlap" and value == 40:
        doc["chunking"]["strategy"] = "hierarchical"
    if key == "input.carry_columns" and value == ["id"]:
        doc["input"]["id_column"] = "id"
    if key == "views" and "label" in value:
        doc["input"]["carry_columns"] = ["label"]
    _check(place, _apply(doc, key, value), code, fragment)


def _schema_keys(node: dict[str, Any], prefix: str, defs: dict[str, Any]) -> list[str]:
    """Every key of the job schema, dotted (`input.path`), a view's keys as `view.KEY`."""
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    if prefix == "views":  # a mapping of names to views: the view's own keys, and itself
        view = node["additionalProperties"]
        return ["views", *_schema_keys(view, "view", defs)]
    if "properties" not in node:
        return [prefix]
    return [key for name, child in node["properties"].items()
            for key in _schema_keys(child, f"{prefix}.{name}" if prefix else name, defs)]


def test_wrong_values_cover_every_key_of_the_schema() -> None:
    """Read from the schema, not from this table: a key added to the job has no wrong value
    here until someone writes one."""
    schema = json.loads((REPO / "schemas" / "job.schema.json").read_text())
    keys = _schema_keys(schema, "", schema.get("$defs", schema.get("definitions", {})))
    assert len(keys) > 30 and "view.pooling" in keys, keys
    covered = {key for key, _, _, _ in WRONG}
    assert not [key for key in keys if key not in covered]
    sections = {key.split(".")[0] for key in covered}
    assert "extra" in sections and {"view.extra", "input.extra"} <= covered
    assert any(isinstance(v, float) and math.isnan(v) for _, v, _, _ in WRONG)
