"""The bad-input table for jobs, inputs and command-line values.

One row per way a job file, its input table, its model or a command's value can be wrong:
the command, the exit code, a fragment of the one-line message, and what must still be
there unchanged afterwards (the input, the job file, the finished stores) or must not
have been created (the job's output). Rows named `api:` call the notebook API instead and
expect the same error class (its exit code) with no other exception type.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner, Result

import pipeline
from pipeline.cli import main
from pipeline.errors import BertpipeError
from pipeline.extract.runtime_choice import gpu_device_nodes
from tests.agreement import assert_agree, run_all
from tests.conftest import job_dict, write_job, write_table

pytestmark = pytest.mark.table  # hundreds of CLI runs: make test, not make test-fast

TEXTS = ["the drug worked very well", "bad side effects, no sleep for a week", "great",
         "my doctor said it is not good for pain and sleep", "yes", "the day was good",
         "no effects with the drug in my week", "pain pain pain", "a very good drug",
         "it worked. then it did not.", "sleep was bad", "the effects were great"]
LABELS = ["pos", "neg", "pos", "neg", "pos", "pos", "neg", "neg", "pos", "neg", "neg", "pos"]
N = len(TEXTS)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> dict[str, Path]:
    """Finished stores (both formats) of twelve texts with a string and a numeric label."""
    root = tmp_path_factory.mktemp("stores")
    src = write_table(root / "in.parquet", {"id": [f"r{i}" for i in range(N)], "text": TEXTS,
                                            "label": LABELS, "stars": list(range(N))})
    out = {}
    for fmt in ("zarr", "parquet"):
        path = root / f"done.{fmt}"
        job = job_dict(src, tiny_bert, path, output={"format": fmt},
                       input={"carry_columns": ["label", "stars"]})
        result = CliRunner().invoke(main, ["extract", str(write_job(root / f"{fmt}.yaml", job))])
        assert result.exit_code == 0, result.output
        out[fmt] = path
    # a store whose every document is empty: nothing to fit a geometry fix on
    blank = write_table(root / "blank.parquet", {"id": [1, 2], "text": [None, "  "]})
    job = job_dict(blank, tiny_bert, root / "blank.zarr")
    result = CliRunner().invoke(main, ["extract", str(write_job(root / "blank.yaml", job))])
    assert result.exit_code == 0, result.output
    out["blank"] = root / "blank.zarr"
    return out


@dataclass
class World:
    """What a row can point at; everything here is checked unchanged after the row."""

    tmp: Path
    model: Path
    distilbert: Path
    stores: dict[str, Path]
    src: Path = field(init=False)
    out: Path = field(init=False)

    def __post_init__(self) -> None:
        self.src = write_table(self.tmp / "in.parquet", {
            "id": [f"r{i}" for i in range(N)], "text": TEXTS, "label": LABELS,
            "stars": list(range(N))})
        self.out = self.tmp / "out.zarr"

    def job(self, edit: Callable[[dict[str, Any]], Any] | None = None,
            src: Path | None = None, model: Path | None = None) -> str:
        """A job file: the standard small job, changed by `edit` (which mutates it)."""
        raw = job_dict(src or self.src, model or self.model, self.out,
                       input={"carry_columns": ["label"]})
        if edit is not None:
            edit(raw)
        return str(write_job(self.tmp / "job.yaml", raw))

    def job_text(self, text: str) -> str:
        path = self.tmp / "job.yaml"
        path.write_text(text)
        return str(path)

    def table(self, name: str, columns: dict[str, Any], **kwargs: Any) -> Path:
        return write_table(self.tmp / name, columns, **kwargs)


def _views(**views: Any) -> Callable[[dict[str, Any]], None]:
    return lambda raw: raw.update(views=views)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = raw
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return edit


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = raw
        for key in parents:
            node = node[key]
        del node[last]
    return edit


def _two_files(w: World, second: dict[str, Any]) -> Path:
    """A folder input: a.parquet with the standard columns, b.parquet with `second`."""
    folder = w.tmp / "parts"
    folder.mkdir(exist_ok=True)
    write_table(folder / "a.parquet", {"id": [1, 2], "text": ["good", "bad"],
                                       "label": ["x", "y"]})
    write_table(folder / "b.parquet", second)
    return folder


def _corrupt_middle(w: World) -> Path:
    """A Parquet file whose footer is intact and whose third row group is garbage."""
    path = w.table("bad.parquet", {"id": list(range(40)), "text": [f"text {i}" for i in
                                                                  range(40)],
                                   "label": ["x"] * 40},
                   row_group_size=10, compression="snappy")
    meta = pq.read_metadata(path)
    start = meta.row_group(2).column(1).data_page_offset
    data = bytearray(path.read_bytes())
    for i in range(start + 8, start + 60):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def _pickle_model(w: World) -> Path:
    """The tiny model with its weights replaced by a .bin that is not a pickle."""
    model = w.tmp / "pickled"
    shutil.copytree(w.model, model)
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"this is not a pickle" * 8)
    return model


def _staged_only(w: World) -> None:
    """open_store(require_complete=False) on a store whose run never committed: what a
    run leaves when it is stopped before its commit."""
    from pipeline.stores import Staging, store_at

    store_at(str(w.out), "zarr").create({"complete": False, "run_fingerprint": "f" * 64})
    Staging(w.out).begin({"run_fingerprint": "f" * 64})
    pipeline.open_store(w.out, require_complete=False)


def _probe_folds(folds: int) -> Callable[[World], None]:
    def call(w: World) -> None:
        import pandas as pd

        from pipeline.analysis.probe import run_probe

        store = pipeline.open_store(w.stores["zarr"])
        labels = pd.Series(np.asarray(store.docs["stars"].values), name="stars")
        run_probe(store, labels, folds=folds)
    return call


def _no_weights(w: World) -> Path:
    """The tiny model's config and tokenizer, without any weight file."""
    model = w.tmp / "no-weights"
    shutil.copytree(w.model, model)
    (model / "model.safetensors").unlink()
    return model


def _pickle_only(w: World) -> Path:
    """The tiny model with a .bin in place of its safetensors (model.allow_pickle unset)."""
    model = _no_weights(w)
    (model / "pytorch_model.bin").write_bytes(b"pickle")
    return model


def _repeated_ids(w: World) -> Path:
    """Ids that repeat: 'a' on rows 0 and 2, 'b' on rows 1 and 4 (and 'c' once)."""
    return w.table("dup.parquet", {"id": ["a", "b", "a", "c", "b"],
                                   "text": ["good", "bad", "pain", "drug", "sleep"],
                                   "label": ["x", "y", "x", "y", "x"]})


def _repeated_ids_in_two_files(w: World) -> Path:
    """Integer ids, 32-bit in one file and 64-bit in the other: 3 is on rows 2 and 4."""
    folder = w.tmp / "dups"
    folder.mkdir()
    write_table(folder / "a.parquet", {"id": pa.array([1, 2, 3], pa.int32()),
                                       "text": ["a", "b", "c"], "label": ["x", "y", "x"]})
    write_table(folder / "b.parquet", {"id": pa.array([4, 3], pa.int64()),
                                       "text": ["d", "e"], "label": ["y", "x"]})
    return folder


def _row_of_a_repeated_id(w: World) -> None:
    """A store made with input.unique_ids: false, then a lookup by a repeated id."""
    job = w.job(_set("input.unique_ids", False), src=_repeated_ids(w))
    result = CliRunner().invoke(main, ["extract", job])
    assert result.exit_code == 0, result.output
    pipeline.open_store(w.out).row_of("a")


def _labels(w: World, columns: dict[str, Any]) -> str:
    return str(w.table("labels.parquet", columns))


def _probe_labels(columns: dict[str, Any], label: str = "y") -> Callable[[World], list[str]]:
    return lambda w: ["probe", str(w.stores["zarr"]), "--label", label, "--labels",
                      _labels(w, columns)]


@dataclass(frozen=True)
class Row:
    id: str
    run: Callable[[World], list[str] | None]  # CLI args, or None after calling the API
    code: int
    fragment: str
    output_may_exist: bool = False  # a failure after the run started (partition, weights)


@dataclass(frozen=True)
class _Cli:
    """A row's command line, its parts filled in from the row's World."""

    args: tuple[str | Callable[[World], str], ...]

    def __call__(self, w: World) -> list[str]:
        return [a(w) if callable(a) else a for a in self.args]

    @property
    def checks_a_job(self) -> bool:
        """`validate` or `extract` of a job (not `validate --schema-only`, the file alone)."""
        return self.args[0] in ("validate", "extract") and "--schema-only" not in self.args


def _cli(*args: str | Callable[[World], str]) -> _Cli:
    return _Cli(args)


def _api(call: Callable[[World], None]) -> Callable[[World], None]:
    return lambda w: call(w)  # type: ignore[func-returns-value]


def _job(edit: Callable[[dict[str, Any]], Any] | None = None,
         **kw: Callable[[World], Path]) -> Callable[[World], str]:
    return lambda w: w.job(edit, **{k: f(w) for k, f in kw.items()})


def _store(fmt: str) -> Callable[[World], str]:
    return lambda w: str(w.stores[fmt])


ZARR, PARQUET = _store("zarr"), _store("parquet")

ROWS = [
    # ---- names: views, carried columns, post-processed views (item 4) -------------------
    Row("view named status", _cli("validate", _job(_views(status={"pooling": "mean"}))), 2,
        "views.status: 'status' is a field the store writes itself"),
    Row("view named n_chunks", _cli("validate", _job(_views(n_chunks={"pooling": "mean"}))),
        2, "'n_chunks' is a field the store writes itself"),
    Row("view named doc", _cli("validate", _job(_views(doc={"pooling": "mean"}))), 2,
        "'doc' is a field the store writes itself"),
    Row("view named Ids (case ignored)", _cli("validate", _job(_views(Ids={"pooling": "cls"}))),
        2, "'Ids' is a field the store writes itself"),
    Row("view named like a carried column", _cli("validate", _job(_views(
        label={"pooling": "mean"}))), 2, "views.label: 'label' collides with carried column"),
    Row("view differing from a carried column in case only", _cli("validate", _job(_views(
        LABEL={"pooling": "mean"}))), 2, "collides with carried column 'label'"),
    Row("view named like the text column", _cli("validate", _job(_views(
        text={"pooling": "mean"}))), 2, "collides with input.text_column"),
    Row("view name ending in _dim", _cli("validate", _job(_views(
        mean_dim={"pooling": "mean"}))), 2, "ends in '_dim'"),
    Row("view name with a path", _cli("validate", _job(_views(
        **{"../x": {"pooling": "mean"}}))), 2, "views: '../x' is not a valid name"),
    Row("view name with a dot", _cli("validate", _job(_views(
        **{"a.b": {"pooling": "mean"}}))), 2, "'a.b' is not a valid name"),
    Row("view name of 65 characters", _cli("validate", _job(_views(
        **{"v" * 65: {"pooling": "mean"}}))), 2, "is not a valid name"),
    Row("carried column named id", _cli("validate", _job(_set("input.carry_columns",
                                                              ["id"]))), 2,
        "input.carry_columns.0: 'id' is a field the store writes itself"),
    Row("carried column named row", _cli("validate", _job(_set("input.carry_columns",
                                                               ["row"]))), 2,
        "'row' is a field the store writes itself"),
    Row("carried column name with a space", _cli("validate", _job(_set(
        "input.carry_columns", ["star rating"]))), 2, "'star rating' is not a valid name"),
    Row("carried column twice", _cli("validate", _job(_set("input.carry_columns",
                                                           ["label", "label"]))), 2,
        "input.carry_columns"),
    Row("carry_columns not a list", _cli("validate", _job(_set("input.carry_columns",
                                                               "label"))), 2,
        "input.carry_columns: 'label' is not of type 'array'"),
    Row("duplicate view key in YAML", _cli("validate", lambda w: w.job_text(
        yaml.safe_dump(job_dict(w.src, w.model, w.out), sort_keys=False)
        .replace("views:\n", "views:\n  cls:\n    pooling: max\n"))), 2,
        "duplicate key 'cls' (first at line"),
    Row("duplicate top-level key in YAML", _cli("validate", lambda w: w.job_text(
        yaml.safe_dump(job_dict(w.src, w.model, w.out), sort_keys=False)
        + "output:\n  path: elsewhere.zarr\n")), 2, "duplicate key 'output'"),
    Row("duplicate key in a --set value", _cli(
        "validate", _job(), "--set", "views={a: {pooling: mean}, a: {pooling: cls}}"), 2,
        "--set views: value"),
    Row("postprocess --name status (zarr)", _cli("postprocess", ZARR, "--view", "mean",
                                                 "--method", "center", "--name", "status"), 2,
        "--name: 'status' is a field the store writes itself"),
    Row("postprocess --name /../../x (zarr)", _cli("postprocess", ZARR, "--view", "mean",
                                                   "--method", "center", "--name",
                                                   "/../../x"), 2,
        "--name: '/../../x' is not a valid name"),
    Row("postprocess --name /../../x (parquet)", _cli("postprocess", PARQUET, "--view",
                                                      "mean", "--method", "center", "--name",
                                                      "/../../x"), 2,
        "--name: '/../../x' is not a valid name"),
    Row("postprocess --name of a carried column", _cli("postprocess", PARQUET, "--view",
                                                       "mean", "--method", "center",
                                                       "--name", "stars"), 2,
        "'stars' collides with carried column"),
    Row("postprocess --name MEAN (a view, case ignored)", _cli(
        "postprocess", ZARR, "--view", "cls", "--method", "center", "--name", "MEAN"), 2,
        "'MEAN' collides with view 'mean'"),
    Row("postprocess --name of an existing view", _cli(
        "postprocess", ZARR, "--view", "cls", "--method", "center", "--name", "mean"), 5,
        "--name: 'mean' already exists"),
    Row("postprocess --name empty", _cli("postprocess", ZARR, "--view", "mean", "--method",
                                         "center", "--name", ""), 2,
        "'' is not a valid name"),
    # ---- checked before work: the model's config, the views, the budget (item 5) --------
    Row("layer 5 of a 2-layer model: validate", _cli("validate", _job(_views(
        deep={"layers": [5], "pooling": "mean"}))), 2,
        "views.deep.layers: 5 is out of range for a model with 2 layers"),
    Row("layer 5 of a 2-layer model: extract creates nothing", _cli("extract", _job(_views(
        deep={"layers": [5], "pooling": "mean"}))), 2, "views.deep.layers"),
    Row("layer -4 of a 2-layer model", _cli("validate", _job(_views(
        low={"layers": [-1, -4], "combine": "mean", "pooling": "mean"}))), 2,
        "views.low.layers: -4 is out of range"),
    Row("layers not a list", _cli("validate", _job(_views(v={"layers": "x",
                                                             "pooling": "mean"}))), 2,
        "views.v.layers: 'x' is not valid"),
    Row("scalar-mix weight NaN", _cli("validate", _job(_views(mix={
        "layers": "all", "combine": "scalar_mix", "weights": [0, float("nan"), 1],
        "pooling": "mean"}))), 2, "views.mix.weights: [0.0, nan, 1.0] must be finite"),
    Row("weighted weight infinite", _cli("validate", _job(_views(w={
        "layers": [1, 2], "combine": "weighted", "weights": [1, float("inf")],
        "pooling": "mean"}))), 2, "views.w.weights"),
    Row("weights not numbers", _cli("validate", _job(_views(w={
        "layers": [1, 2], "combine": "weighted", "weights": ["a", 1], "pooling": "mean"}))), 2,
        "views.w.weights.0: 'a' is not of type 'number'"),
    Row("weights for a plain view", _cli("validate", _job(_views(w={
        "layers": [1], "weights": [1.0], "pooling": "mean"}))), 2,
        "views.w.weights: only used with combine weighted or scalar_mix"),
    Row("weights missing for scalar_mix", _cli("validate", _job(_views(w={
        "layers": [1, 2], "combine": "scalar_mix", "pooling": "mean"}))), 2,
        "views.w.weights: combine scalar_mix needs one weight per layer"),
    Row("weights for 3 of all 3 hidden states short", _cli("validate", _job(_views(w={
        "layers": "all", "combine": "scalar_mix", "weights": [1, 1], "pooling": "mean"}))), 2,
        "views.w.weights: 2 weights for 3 layers"),
    Row("gamma infinite", _cli("validate", _job(_views(mix={
        "layers": "all", "combine": "scalar_mix", "weights": [0, 0, 1],
        "gamma": float("inf"), "pooling": "mean"}))), 2, "views.mix.gamma: inf must be"),
    Row("gamma NaN", _cli("validate", _job(_views(mix={
        "layers": "all", "combine": "scalar_mix", "weights": [0, 0, 1],
        "gamma": float("nan"), "pooling": "mean"}))), 2, "views.mix.gamma: nan must be"),
    Row("gamma not a number", _cli("validate", _job(_views(mix={
        "layers": "all", "combine": "scalar_mix", "weights": [0, 0, 1], "gamma": "big",
        "pooling": "mean"}))), 2, "views.mix.gamma: 'big' is not of type 'number'"),
    Row("gamma without scalar_mix", _cli("validate", _job(_views(m={
        "layers": [1, 2], "combine": "mean", "gamma": 2.0, "pooling": "mean"}))), 2,
        "views.m.gamma: only used with combine scalar_mix"),
    Row("overlap over half the model's budget", _cli("validate", _job(lambda raw: raw.update(
        chunking={"strategy": "hierarchical", "overlap": 100}))), 2,
        "chunking.overlap: 100 must be under half of the 62 content tokens"),
    Row("overlap over half of chunking.max_tokens", _cli("validate", _job(lambda raw: raw.update(
        chunking={"strategy": "hierarchical", "max_tokens": 16, "overlap": 8}))), 2,
        "chunking.overlap: 8 must be under half"),
    Row("overlap negative", _cli("validate", _job(lambda raw: raw.update(
        chunking={"strategy": "hierarchical", "overlap": -1}))), 2,
        "chunking.overlap: -1 is less than the minimum of 0"),
    Row("overlap with truncate", _cli("validate", _job(lambda raw: raw.update(
        chunking={"strategy": "truncate", "overlap": 2}))), 2,
        "chunking.overlap: only used with strategy hierarchical"),
    Row("post whiten dims over the width", _cli("validate", _job(_views(m={
        "pooling": "mean", "post": {"method": "whiten", "dims": 500}}))), 2,
        "views.m.post.dims: 500 is more than the view's width 32"),
    Row("post dims zero", _cli("validate", _job(_views(m={
        "pooling": "mean", "post": {"method": "whiten", "dims": 0}}))), 2,
        "views.m.post"),
    Row("post dims with center", _cli("validate", _job(_views(m={
        "pooling": "mean", "post": {"method": "center", "dims": 4}}))), 2,
        "views.m.post.dims: only used with method whiten"),
    Row("post abtt d equal to the width", _cli("validate", _job(_views(m={
        "pooling": "mean", "post": {"method": "abtt", "d": 32}}))), 2,
        "views.m.post.d: removing 32 directions of a view of width 32"),
    Row("post d with whiten", _cli("validate", _job(_views(m={
        "pooling": "mean", "post": {"method": "whiten", "d": 3}}))), 2,
        "views.m.post.d: only used with method abtt"),
    Row("pooler of a model without one: validate", _cli("validate", _job(
        _views(p={"pooling": "pooler"}), model=lambda w: w.distilbert)), 4,
        "pooling pooler: model"),
    Row("model folder missing", _cli("validate", _job(model=lambda w: w.tmp / "nothing")), 4,
        "model.path"),
    Row("model folder without config.json", _cli("validate", _job(
        model=lambda w: Path(w.tmp / "empty-model").mkdir() or w.tmp / "empty-model")), 4,
        "model.path: cannot load"),
    Row("model path missing", _cli("validate", _job(_drop("model.path"))), 2,
        "model: 'path' is a required property"),
    # ---- checked before work: the input's Parquet metadata (item 5) -------------------
    Row("text column missing", _cli("validate", _job(_set("input.text_column", "body"))), 3,
        "input.text_column: column 'body' not in"),
    Row("text column key missing", _cli("validate", _job(_drop("input.text_column"))), 2,
        "input: 'text_column' is a required property"),
    Row("text column not a string", _cli("validate", _job(src=lambda w: w.table(
        "n.parquet", {"id": [1, 2], "text": [3, 4], "label": ["a", "b"]}))), 3,
        "input.text_column: column 'text' in"),
    Row("carried column missing", _cli("validate", _job(_set("input.carry_columns",
                                                             ["label", "score"]))), 3,
        "input.carry_columns: column 'score' not in"),
    Row("carried list column", _cli("validate", _job(src=lambda w: w.table("l.parquet", {
        "id": [1, 2], "text": ["a", "b"], "label": [[1, 2], [3]]}))), 3,
        "list, struct and map columns are not carried"),
    Row("carried struct column", _cli("validate", _job(src=lambda w: w.table("s.parquet", {
        "id": [1, 2], "text": ["a", "b"], "label": [{"x": 1}, {"x": 2}]}))), 3,
        "input.carry_columns: column 'label'"),
    Row("carried timestamp with a time zone", _cli("validate", _job(src=lambda w: w.table(
        "t.parquet", {"id": [1, 2], "text": ["a", "b"], "label": pa.array(
            [0, 1], pa.timestamp("s", tz="Europe/Paris"))}))), 3, "without a time zone"),
    Row("carried binary column", _cli("validate", _job(src=lambda w: w.table("b.parquet", {
        "id": [1, 2], "text": ["a", "b"], "label": [b"x", b"y"]}))), 3,
        "has type binary; carried columns may be"),
    Row("id column of floats", _cli("validate", _job(src=lambda w: w.table("f.parquet", {
        "id": [1.5, 2.5], "text": ["a", "b"], "label": ["x", "y"]}))), 3,
        "ids must be integers or strings"),
    Row("null id seen in the footer", _cli("validate", _job(src=lambda w: w.table(
        "ni.parquet", {"id": [1, None], "text": ["a", "b"], "label": ["x", "y"]}))), 3,
        "input.id_column: 1 null ids in column 'id'"),
    Row("ids of different types across files: validate", _cli("validate", _job(
        src=lambda w: _two_files(w, {"id": ["a", "b"], "text": ["x", "y"],
                                     "label": ["p", "q"]}))), 3,
        "input.id_column: column 'id' is int64 in"),
    Row("ids of different types across files: extract, before encoding", _cli(
        "extract", _job(src=lambda w: _two_files(w, {"id": ["a", "b"], "text": ["x", "y"],
                                                     "label": ["p", "q"]}))), 3,
        "b.parquet; it must have one type in every file"),
    Row("carried column of different kinds across files", _cli("validate", _job(
        src=lambda w: _two_files(w, {"id": [3, 4], "text": ["x", "y"], "label": [1, 2]}))), 3,
        "input.carry_columns: column 'label' is string in"),
    Row("input path missing", _cli("validate", _job(_set("input.path", "/no/such.parquet"))),
        3, "input.path: /no/such.parquet does not exist"),
    Row("input without rows", _cli("extract", _job(src=lambda w: w.table("e.parquet", {
        "id": pa.array([], pa.int64()), "text": pa.array([], pa.string()),
        "label": pa.array([], pa.string())}))), 3, "has no rows"),
    Row("input not Parquet", _cli("validate", _job(src=lambda w: Path(
        w.tmp / "x.parquet").write_text("id,text\n1,a\n") and w.tmp / "x.parquet")), 3,
        "is not a readable Parquet file"),
    Row("Parquet corrupted in the middle", _cli("extract", _job(
        _set("execution.partition_rows", 10), src=_corrupt_middle)), 3,
        "bad.parquet cannot be read at rows 20-29", output_may_exist=True),
    Row("unpicklable .bin with allow_pickle", _cli("extract", _job(
        _set("model.allow_pickle", True), model=_pickle_model)), 4,
        "cannot load weights of", output_may_exist=True),
    # ---- the job file itself (item 7) --------------------------------------------------
    Row("binary job file", _cli("validate", lambda w: str(
        Path(w.tmp / "job.yaml").write_bytes(bytes(range(128, 256))) and w.tmp / "job.yaml")),
        2, "not a text file (byte 0 is not UTF-8)"),
    Row("job file is a directory", _cli("validate", lambda w: str(w.tmp)), 2,
        "is a directory"),
    Row("job file missing", _cli("validate", lambda w: str(w.tmp / "none.yaml")), 2,
        "cannot read job file"),
    Row("job file not a mapping", _cli("validate", lambda w: w.job_text("- a\n- b\n")), 2,
        "a job file must be a mapping"),
    Row("views missing", _cli("validate", _job(_drop("views"))), 2,
        "'views' is a required property"),
    # ---- calibrate: the job file, its keys, the --set option -----------------------------
    Row("calibrate: job file missing", _cli("calibrate", lambda w: str(w.tmp / "none.yaml")),
        2, "cannot read job file"),
    Row("calibrate: job file not a mapping", _cli("calibrate", lambda w: w.job_text("- a\n")),
        2, "a job file must be a mapping"),
    Row("calibrate: job file is a directory", _cli("calibrate", lambda w: str(w.tmp)), 2,
        "is a directory"),
    Row("calibrate: model.runtime of the wrong type", _cli("calibrate", _job(_set(
        "model.runtime", 5))), 2, "model.runtime: 5 is not one of"),
    Row("calibrate: model.dtype not a dtype", _cli("calibrate", _job(_set(
        "model.dtype", "int4"))), 2, "model.dtype: 'int4' is not one of"),
    Row("calibrate --set of an unknown key", _cli("calibrate", _job(), "--set",
                                                   "model.speed=fast"), 2,
        "'speed' was unexpected"),
    Row("calibrate: model path missing", _cli("calibrate", _job(_set(
        "model.path", "/nonexistent/model"))), 4, "model.path: /nonexistent/model does not exist"),
    # ---- command-line values (item 5) --------------------------------------------------
    Row("search -k 0", _cli("search", ZARR, "good", "-k", "0"), 2,
        "Invalid value for '-k': 0 is not in the range x>=1"),
    Row("search -k -1", _cli("search", ZARR, "good", "-k", "-1"), 2,
        "'-k': -1 is not in the range x>=1"),
    Row("search -k not a number", _cli("search", ZARR, "good", "-k", "ten"), 2,
        "'ten' is not a valid integer"),
    Row("search empty query", _cli("search", ZARR, ""), 2, "QUERY': the query is empty"),
    Row("search blank query", _cli("search", PARQUET, "  ", " "), 2, "the query is empty"),
    Row("search without a query", _cli("search", ZARR), 2, "Missing argument 'QUERY...'"),
    # a store version: a number (its digits as a string read as it), or refused naming it
    Row("api: open_store version not a number", _api(lambda w: pipeline.open_store(
        w.stores["zarr"], version="latest")), 2, "version='latest' is not a store version: "
        "give a whole number 0, 1, ..."),
    Row("api: open_store version negative", _api(lambda w: pipeline.open_store(
        w.stores["zarr"], version=-1)), 2, "version=-1 is not a store version"),
    Row("api: open_store version True", _api(lambda w: pipeline.open_store(
        w.stores["parquet"], version=True)), 2, "version=True is not a store version"),
    Row("api: open_store version 1.0", _api(lambda w: pipeline.open_store(
        w.stores["zarr"], version=1.0)), 2, "version=1.0 is not a store version"),
    Row("api: open_store version '1' of a store that keeps version 0 only", _api(
        lambda w: pipeline.open_store(w.stores["zarr"], version="1")), 5,
        "no version 1: a zarr store keeps its current version (0) only"),
    Row("api: search k=0", _api(lambda w: pipeline.open_store(w.stores["zarr"]).search(
        "good", k=0)), 2, "-k: 0 hits asked for"),
    Row("api: search of an empty text", _api(lambda w: pipeline.open_store(
        w.stores["zarr"]).search([" "])), 2, "the query text is empty"),
    Row("probe --folds 0", _cli("probe", ZARR, "--label", "label", "--folds", "0"), 2,
        "'--folds': 0 is not in the range x>=2"),
    Row("probe --folds 1", _cli("probe", ZARR, "--label", "stars", "--folds", "1"), 2,
        "'--folds': 1 is not in the range x>=2"),
    Row("probe --folds not a number", _cli("probe", ZARR, "--label", "stars", "--folds",
                                           "two"), 2, "'two' is not a valid integer"),
    Row("api: probe folds=1 on a numeric label", _api(_probe_folds(1)), 2,
        "--folds: 1; cross-validation needs at least 2 folds"),
    Row("api: probe more folds than rows", _api(_probe_folds(50)), 3,
        "--folds: 50 folds for 12 labelled rows"),
    Row("probe --labels missing file", _cli("probe", ZARR, "--label", "y", "--labels",
                                            lambda w: str(w.tmp / "none.parquet")), 2,
        "'--labels': File"),
    Row("probe --labels a directory", _cli("probe", ZARR, "--label", "y", "--labels",
                                           lambda w: str(w.tmp)), 2, "is a directory"),
    Row("probe --labels not Parquet", _cli("probe", ZARR, "--label", "y", "--labels", lambda w: (
        Path(w.tmp / "l.txt").write_text("id,y\n") and str(w.tmp / "l.txt"))), 3,
        "--labels: cannot read"),
    Row("postprocess --dims 0", _cli("postprocess", ZARR, "--view", "mean", "--method",
                                     "whiten", "--dims", "0"), 2,
        "'--dims': 0 is not in the range x>=1"),
    Row("postprocess --dims -3", _cli("postprocess", ZARR, "--view", "mean", "--method",
                                      "whiten", "--dims", "-3"), 2, "'--dims': -3 is not"),
    Row("postprocess --dims 5000 (zarr)", _cli("postprocess", ZARR, "--view", "mean",
                                               "--method", "whiten", "--dims", "5000"), 2,
        "--dims: 5000 is out of range for view 'mean' of width 32 (1..32)"),
    Row("postprocess --dims 33 (parquet)", _cli("postprocess", PARQUET, "--view", "cls",
                                                "--method", "whiten", "--dims", "33"), 2,
        "--dims: 33 is out of range for view 'cls'"),
    Row("postprocess --dims with center", _cli("postprocess", ZARR, "--view", "mean",
                                               "--method", "center", "--dims", "4"), 2,
        "'--dims': only used with --method whiten"),
    Row("postprocess -d 0", _cli("postprocess", ZARR, "--view", "mean", "--method", "abtt",
                                 "-d", "0"), 2, "'-d': 0 is not in the range x>=1"),
    Row("postprocess -d 32 of width 32", _cli("postprocess", ZARR, "--view", "mean",
                                              "--method", "abtt", "-d", "32"), 2,
        "-d: removing 32 directions of view 'mean' of width 32 is out of range (1..31)"),
    Row("postprocess -d with whiten", _cli("postprocess", ZARR, "--view", "mean", "--method",
                                           "whiten", "-d", "2"), 2,
        "'-d': only used with --method abtt"),
    Row("postprocess --view missing", _cli("postprocess", ZARR, "--method", "center"), 2,
        "Missing option '--view'"),
    Row("postprocess of a view whose documents are all empty", _cli(
        "postprocess", _store("blank"), "--view", "mean", "--method", "center"), 3,
        "post: no finite rows to fit on"),
    Row("job post on an input whose texts are all empty", _cli("extract", _job(
        _views(m={"pooling": "mean", "post": "whiten"}),
        src=lambda w: w.table("blank.parquet", {"id": [1], "text": [""], "label": ["a"]}))),
        3, "post: no finite rows to fit on", output_may_exist=True),
    Row("inspect --sample 0", _cli("inspect", ZARR, "--geometry", "--sample", "0"), 2,
        "'--sample': 0 is not in the range x>=1"),
    Row("inspect --sample not a number", _cli("inspect", ZARR, "--sample", "many"), 2,
        "'many' is not a valid integer"),
    Row("index --nprobe 0", _cli("index", ZARR, "--view", "mean", "--nprobe", "0"), 2,
        "'--nprobe': 0 is not in the range x>=1"),
    Row("api: index nprobe=0", _api(lambda w: __import__(
        "pipeline.analysis.index", fromlist=["build_index"]).build_index(
        pipeline.open_store(w.stores["zarr"]), "mean", nprobe=0)), 2,
        "--nprobe: 0; scan at least 1 list"),
    # ---- keys and options added with runtimes, object stores, incremental runs ----------
    Row("model.runtime not a runtime", _cli("validate", _job(_set("model.runtime", "onnx"))),
        2, "model.runtime: 'onnx' is not one of"),
    Row("input.storage_options not a mapping", _cli("validate", _job(_set(
        "input.storage_options", "key=x"))), 2,
        "input.storage_options: 'key=x' is not of type 'object'"),
    Row("input.storage_options on a local path", _cli("validate", _job(_set(
        "input.storage_options", {"key": "k"}))), 2,
        "input.storage_options: only used with a URL input.path"),
    Row("output.storage_options not a mapping", _cli("validate", _job(_set(
        "output.storage_options", ["k"]))), 2,
        "output.storage_options: ['k'] is not of type 'object'"),
    Row("output.incremental not a boolean", _cli("validate", _job(_set(
        "output.incremental", "y"))), 2, "output.incremental: 'y' is not of type 'boolean'"),
    Row("output.incremental without an id column", _cli("validate", _job(lambda raw: (
        _drop("input.id_column")(raw), _set("output.incremental", True)(raw)))), 2,
        "output.incremental: needs input.id_column"),
    Row("output.incremental with a token view", _cli("validate", _job(lambda raw: (
        _views(t={"pooling": "tokens"})(raw), _set("output.format", "parquet")(raw),
        _set("output.incremental", True)(raw)))), 2,
        "output.incremental: views.t has pooling: tokens"),
    Row("output.incremental with output.format zarr", _cli("validate", _job(_set(
        "output.incremental", True))), 2,
        "output.incremental: a zarr store is written once"),
    Row("output.incremental with a parquet store on an object store", _cli(
        "validate", _job(lambda raw: (_set("output.format", "parquet")(raw),
                                      _set("output.path", "s3://bucket/out.parquet")(raw),
                                      _set("output.incremental", True)(raw)))), 2,
        "output.incremental: a parquet store on an object store is not updated"),
    Row("output.format unknown", _cli("validate", _job(_set("output.format", "lance"))), 2,
        "output.format: 'lance' is not one of ['zarr', 'parquet', 'icechunk', 'delta']"),
    Row("output.format delta on an object store it cannot commit to", _cli(
        "extract", _job(lambda raw: (_set("output.format", "delta")(raw),
                                     _set("output.path", "memory://bucket/out.delta")(raw)))),
        5, "the delta format is written to a local folder or an s3:// URL"),
    Row("output.incremental with output.overwrite", _cli("validate", _job(lambda raw: (
        _set("output.overwrite", True)(raw), _set("output.incremental", True)(raw)))), 2,
        "output.incremental"),
    Row("view named like the text digest column", _cli("validate", _job(_views(
        text_sha256={"pooling": "mean"}))), 2, "'text_sha256' is a field the store writes"),
    Row("carried column named present", _cli("validate", _job(_set(
        "input.carry_columns", ["present"]))), 2, "'present' is a field the store writes"),
    Row("extract --prune without --incremental", _cli("extract", _job(), "--prune"), 2,
        "--prune"),
    # validate takes extract's options, so a scheduled command can be checked as it will run
    Row("validate --prune without --incremental", _cli("validate", _job(), "--prune"), 2,
        "Invalid value for '--prune': only with --incremental"),
    Row("validate --scheduler not an address", _cli("validate", _job(), "--scheduler",
                                                    "somewhere"), 2,
        "execution.scheduler: 'somewhere' is not local, synchronous or a scheduler address"),
    Row("validate --incremental into a zarr store", _cli("validate", _job(), "--incremental"),
        2, "output.incremental: a zarr store is written once"),
    Row("validate --incremental with --overwrite", _cli("validate", _job(_set(
        "output.format", "parquet")), "--incremental", "--overwrite"), 2,
        "output.incremental: an incremental run adds to the store, --overwrite replaces it"),
    Row("extract --json-summary a folder", _cli("extract", _job(), "--json-summary",
                                                lambda w: str(w.tmp)), 2, "is a directory"),
    Row("probe --curve-repeats not a number", _cli("probe", ZARR, "--label", "label",
                                                   "--learning-curve", "--curve-repeats",
                                                   "x"), 2, "'x' is not a valid integer"),
    Row("attention without --out", _cli("attention", _job(), "--id", "r0"), 2,
        "Missing option '--out'"),
    Row("attention --heads out of range", _cli("attention", _job(), "--id", "r0", "--heads",
                                               "99", "--out", lambda w: str(w.tmp / "a")), 2,
        "--heads: 99 is out of range"),
    Row("inspect --against a missing store", _cli("inspect", ZARR, "--against",
                                                  lambda w: str(w.tmp / "none.zarr")), 5,
        "none.zarr"),
    Row("unlock a path that is no store", _cli("unlock", lambda w: str(w.tmp / "none.zarr")),
        5, "none.zarr: no such store"),
    # ---- unattended runs: summaries, integer keys, checks validate must make too -------
    Row("extract --json-summary the input file", _cli("extract", _job(), "--json-summary",
                                                      lambda w: str(w.src)), 2,
        "in.parquet is the job's input file"),
    Row("extract --json-summary the job file", _cli("extract", _job(), "--json-summary",
                                                    lambda w: str(w.tmp / "job.yaml")), 2,
        "job.yaml is the job file"),
    Row("extract --json-summary a file of the model", _cli(
        "extract", _job(), "--json-summary", lambda w: str(w.model / "config.json")), 2,
        "config.json is inside the model folder"),
    Row("extract --json-summary inside the store", _cli(
        "extract", _job(), "--json-summary", lambda w: str(w.out / "run.json")), 2,
        "run.json is inside the store (output.path"),
    Row("extract --json-summary a file that is no summary", _cli(
        "extract", _job(), "--json-summary", lambda w: str(w.stores["zarr"] / "zarr.json")), 2,
        "zarr.json exists and is not a run summary"),
    Row("execution.partition_rows 8.0", _cli("extract", _job(_set(
        "execution.partition_rows", 8.0))), 2,
        "execution.partition_rows: 8.0 is not an integer (write 8, without a decimal point)"),
    Row("execution.partition_rows 1.0e+30", _cli("extract", _job(), "--set",
                                                 "execution.partition_rows=1.0e+30"), 2,
        "execution.partition_rows: 1e+30 is not an integer"),
    Row("execution.partition_rows 10**30", _cli("extract", _job(_set(
        "execution.partition_rows", 10**30))), 2,
        f"execution.partition_rows: {10**30} is out of range (at most {2**63 - 1})"),
    Row("view layer 1.0", _cli("validate", _job(_views(m={"layers": [1.0],
                                                          "pooling": "mean"}))), 2,
        "views.m.layers: [1.0] is not valid"),
    Row("execution.scheduler not an address", _cli("validate", _job(_set(
        "execution.scheduler", "localhost"))), 2,
        "execution.scheduler: 'localhost' is not local, synchronous or a scheduler address"),
    Row("execution.scheduler without a port", _cli("validate", _job(_set(
        "execution.scheduler", "tcp://scheduler"))), 2, "(host:port after tcp://)"),
    Row("execution.scheduler port out of range", _cli("validate", _job(_set(
        "execution.scheduler", "tcp://scheduler:99999"))), 2, "port 99999 of"),
    Row("model without weights: validate", _cli("validate", _job(model=_no_weights)), 4,
        "has no weights (no *.safetensors file)"),
    Row("model with pickle weights only: validate", _cli("validate", _job(
        model=_pickle_only)), 4, "has only pickle weights (pytorch_model.bin)"),
    Row("relative model.path that does not exist", _cli("validate", _job(_set(
        "model.path", "no-such-folder/model"))), 4,
        "model.path: 'no-such-folder/model' does not exist: no folder /"),
    # ---- ids that repeat ------------------------------------------------------------------
    Row("ids repeat: validate", _cli("validate", _job(src=_repeated_ids)), 3,
        "repeat: 'a' on rows 0, 2; 'b' on rows 1, 4; each id must name one row"),
    Row("ids repeat: extract creates nothing", _cli("extract", _job(src=_repeated_ids)), 3,
        "input.id_column: ids in column 'id' of"),
    Row("ids repeat: extract --dry-run", _cli("extract", _job(src=_repeated_ids),
                                              "--dry-run"), 3, "'a' on rows 0, 2"),
    Row("ids repeat across files (int32 and int64)", _cli("validate", _job(
        src=_repeated_ids_in_two_files)), 3, "repeat: 3 on rows 2, 4;"),
    Row("input.unique_ids not a boolean", _cli("validate", _job(_set(
        "input.unique_ids", "no"))), 2, "input.unique_ids: 'no' is not of type 'boolean'"),
    Row("input.unique_ids false without an id column", _cli("validate", _job(lambda raw: (
        _drop("input.id_column")(raw), _set("input.unique_ids", False)(raw)))), 2,
        "input.unique_ids: only used with input.id_column"),
    Row("input.unique_ids false with output.incremental", _cli("validate", _job(lambda raw: (
        _set("input.unique_ids", False)(raw), _set("output.incremental", True)(raw)))), 2,
        "output.incremental: needs unique ids"),
    Row("api: row_of an id on two rows (input.unique_ids: false)",
        _api(_row_of_a_repeated_id), 5, "id 'a' is ambiguous: it names 2 rows (0, 2)",
        output_may_exist=True),
    Row("attention --id of an id on two rows", _cli("attention", _job(
        _set("input.unique_ids", False), src=_repeated_ids), "--id", "b", "--out",
        lambda w: str(w.tmp / "att")), 3, "--id: 'b' is ambiguous: 2 rows have id == 'b' "
        "(rows 1, 4)"),
    # ---- probe labels ---------------------------------------------------------------------
    Row("probe --labels whose label column is all null", _probe_labels(
        {"id": [f"r{i}" for i in range(N)], "y": pa.nulls(N, pa.string())}), 3,
        "labels.parquet: label column 'y' is empty (all 12 values are null)"),
    Row("probe --labels with no matching id (plain values shown)", _probe_labels(
        {"id": list(range(N)), "y": LABELS}), 3,
        "store ids look like 'r0', file ids like 0)"),
    Row("probe --labels of one class (plain value shown)", _probe_labels(
        {"id": [f"r{i}" for i in range(N)], "y": ["pos"] * N}), 3,
        "label is constant ('pos' for every row)"),
    Row("probe --labels with a class of one row (plain value shown)", _probe_labels(
        {"id": [f"r{i}" for i in range(N)], "y": ["pos"] * (N - 1) + ["neg"]}), 3,
        "label class 'neg' has 1 example"),
    # ---- option order: -q/-v after the command, as before it -----------------------------
    Row("extract -q after the command: the job's error, not an option error", _cli(
        "extract", "-q", _job(_views(deep={"layers": [5], "pooling": "mean"}))), 2,
        "views.deep.layers: 5 is out of range for a model with 2 layers"),
    Row("extract --quiet after the job file", _cli(
        "extract", _job(_views(deep={"layers": [5], "pooling": "mean"})), "--quiet"), 2,
        "views.deep.layers"),
    Row("-q before and -v after the command", _cli(
        "-q", "validate", _job(_views(deep={"layers": [5], "pooling": "mean"})), "-v"), 2,
        "views.deep.layers"),
    Row("probe -v after the store, bad --folds", _cli("probe", ZARR, "-v", "--label", "stars",
                                                      "--folds", "1"), 2,
        "'--folds': 1 is not in the range x>=2"),
    Row("search -q between query words", _cli("search", ZARR, "good", "-q", "drug", "-k", "0"),
        2, "'-k': 0 is not in the range x>=1"),
    Row("attention -q, --layers 0", _cli("attention", _job(), "-q", "--id", "r0", "--layers",
                                         "0", "--out", lambda w: str(w.tmp / "a")), 2,
        "--layers: 0 is the embeddings (hidden state 0), which have no attention"),
    Row("an unknown short option after the command", _cli("extract", "-x", _job()), 2,
        "No such option '-x'"),
    # ---- a store that never finished (item 7) ------------------------------------------
    Row("api: open_store(require_complete=False) on a store that never committed",
        _api(_staged_only), 5, "store is incomplete and has no provenance yet",
        output_may_exist=True),
]
if not gpu_device_nodes():  # a machine with no GPU: asking for one is refused by all three
    ROWS.append(Row("model.device cuda with runtime torch, no GPU", _cli("validate", _job(
        _set("model.device", "cuda"))), 4, "model.device: cuda requested but no CUDA device "
        "is available"))


def _digest(path: Path) -> str | None:
    """SHA-256 over a file or every file under a folder (names and bytes); None if absent."""
    if not path.exists():
        return None
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        h.update(str(file.relative_to(path.parent)).encode())
        h.update(file.read_bytes())
    return h.hexdigest()


def _run(w: World, row: Row) -> tuple[int, str, Result | None, list[str]]:
    try:
        args = row.run(w)
    except BertpipeError as exc:  # an api row: the error class gives the exit code
        return exc.exit_code, f"error: {exc}", None, []
    if args is None:
        return 0, "", None, []
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.stderr, result, args


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(row: Row, tmp_path: Path, tiny_bert: Path, tiny_distilbert: Path,
                   stores: dict[str, Path]) -> None:
    w = World(tmp_path, tiny_bert, tiny_distilbert, stores)
    kept = {p: _digest(p) for p in (w.src, *stores.values(), tiny_bert)}
    outside = [Path("/x"), Path("/x.npz"), tmp_path.parent / "x", tmp_path.parent / "x.npz"]
    assert not any(p.exists() for p in outside)
    code, stderr, result, args = _run(w, row)
    if result is not None:
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            result.exception
        assert "Traceback" not in result.output
    assert code == row.code, stderr
    # one error line, last (a run that got as far as encoding prints its progress first)
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1 and lines[-1] == errors[0] and errors[0].startswith("error: "), \
        stderr
    assert row.fragment in errors[0], errors[0]
    if result is not None and args[0] == "validate":
        assert "valid" not in result.stdout, result.stdout  # said only once all checks pass
    for path, digest in kept.items():
        assert _digest(path) == digest, f"{path} changed"
    if not row.output_may_exist:
        assert not w.out.exists(), "a refused job created its output"
    assert not any(p.exists() for p in outside), "a name wrote outside the store"


JOB_ROWS = [r for r in ROWS if isinstance(r.run, _Cli) and r.run.checks_a_job]


@pytest.mark.parametrize("row", JOB_ROWS, ids=[r.id for r in JOB_ROWS])
def test_validate_dry_run_and_extract_agree(row: Row, tmp_path: Path, tiny_bert: Path,
                                            tiny_distilbert: Path,
                                            stores: dict[str, Path]) -> None:
    """The row's job through `validate`, `extract --dry-run` and `extract`: refused before
    writing, all three give its exit code and the same first words; refused only while
    running (the row's texts or weights are read by the run alone), the checks pass."""
    w = World(tmp_path, tiny_bert, tiny_distilbert, stores)
    outcomes = run_all(row.run(w) or [])
    assert_agree(outcomes, row.code, row.fragment, row.output_may_exist)


def test_a_store_version_given_as_its_digits_opens_that_version(stores: dict[str, Path]
                                                                 ) -> None:
    """A version read from a command line or a config file is a string: "0" is version 0
    (it was refused as "no version 0 ... keeps its current version (0) only")."""
    import numpy as np

    for fmt in ("zarr", "parquet"):
        current = pipeline.open_store(stores[fmt])
        for version in ("0", " 0", np.int64(0)):
            opened = pipeline.open_store(stores[fmt], version=version)
            assert opened.provenance.version == 0
            np.testing.assert_array_equal(opened.vectors("mean"), current.vectors("mean"))


def test_table_covers_every_finding() -> None:
    """The findings of the integrity review that this table answers, each with a row."""
    findings = ["view named status", "view named n_chunks", "view named doc",
                "view named like a carried column", "postprocess --name status (zarr)",
                "duplicate view key in YAML", "postprocess --name /../../x (parquet)",
                "layer 5 of a 2-layer model: extract creates nothing", "scalar-mix weight NaN",
                "search -k -1", "search -k 0", "search empty query", "probe --folds 0",
                "postprocess --dims -3", "postprocess --dims 5000 (zarr)",
                "carried list column", "carried struct column", "binary job file",
                "job file is a directory", "probe --labels missing file", "probe --folds 1",
                "api: probe folds=1 on a numeric label",
                "api: open_store(require_complete=False) on a store that never committed",
                "unpicklable .bin with allow_pickle", "Parquet corrupted in the middle",
                "ids of different types across files: extract, before encoding"]
    ids = {r.id for r in ROWS}
    assert not [f for f in findings if f not in ids]
    assert len(ids) == len(ROWS)


def test_dry_run_prints_the_plan_and_creates_nothing(tmp_path: Path, tiny_bert: Path,
                                                     tiny_distilbert: Path,
                                                     stores: dict[str, Path]) -> None:
    w = World(tmp_path, tiny_bert, tiny_distilbert, stores)
    job = w.job(lambda raw: raw["execution"].update(partition_rows=4))
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(main, ["extract", job, "--dry-run"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "bert, 2 layers, hidden 32, 64 positions" in out
    assert "views      mean (32), cls (32)" in out
    assert f"{w.src}  12 rows" in out and "input      1 file, 12 rows" in out
    assert "partitions 3 of at most 4 rows" in out
    assert "does not exist yet" in out and "nothing was created or written" in out
    # an incremental run onto no store runs in full: the plan says so
    incremental = CliRunner().invoke(main, ["extract", job, "--dry-run", "--incremental",
                                            "--set", "output.format=parquet"])
    assert incremental.exit_code == 0, incremental.output
    assert "mode       full: no store yet, so every row is encoded" in incremental.stdout
    assert "mode       incremental" not in incremental.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    validate = CliRunner().invoke(main, ["validate", job])
    assert validate.exit_code == 0 and "input 1 file, 12 rows, 3 partitions" in validate.stdout
    one = CliRunner().invoke(main, ["validate", job, "--set", "execution.partition_rows=64"])
    assert one.exit_code == 0 and "input 1 file, 12 rows, 1 partition" in one.stdout
    assert "1 partitions" not in one.stdout


def test_usage_errors_are_one_line_and_help_still_shows() -> None:
    bare = CliRunner().invoke(main, [], prog_name="bertpipe")
    assert bare.exit_code == 2 and "Usage: bertpipe [OPTIONS] COMMAND" in bare.output
    unknown = CliRunner().invoke(main, ["extrct"], prog_name="bertpipe")
    assert unknown.exit_code == 2
    assert unknown.stderr.strip() == ("error: No such command 'extrct'. Did you mean 'extract'? "
                                      "(see bertpipe --help)")
    helped = CliRunner().invoke(main, ["search", "--help"])
    assert helped.exit_code == 0 and "-k INTEGER RANGE" in helped.stdout
