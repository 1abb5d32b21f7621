"""The reader contract: the same questions asked of a store through every reader its
format's users reach for give `pipeline.open_store`'s answers (docs/store.md, "Reading
without bertpipe").

One table, format x reader x question x state. Formats: zarr, parquet, icechunk, delta.
States: `first` (a full run), `updated` (an incremental update that edits texts, changes a
label, loses ids and adds ids), `version 0` (the first version, read after the update).
Questions: how many rows, which rows carry a label (a filter on a carried column), one
id's row (a lookup), which rows are `present`. Every reader is asked in its own idiom, the
filter pushed into the reader (a Delta reader skips files by their statistics, a Parquet
reader row groups). Where a reader cannot give the right answer, docs/store.md says so and
the cell asserts that documented limit instead.

Oracle: `open_store` on the same store and version (an independent path: bertpipe's own
reader, which sorts rows by their order columns and pins a version's table versions).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import xarray as xr
from click.testing import CliRunner
from deltalake import DeltaTable, Schema

import pipeline
from pipeline.cli import main
from pipeline.run.runner import run_job
from pipeline.spec import Job
from pipeline.stores import delta_store
from pipeline.stores.verify import verify_store
from tests.conftest import job_dict

N = 40
LABELS = ("positive", "negative", "neutral")
EDITED = ("r3", "r10")  # texts changed by the update
RELABELED = "r7"  # label changed, text the same
GONE = ("r5", "r6")  # missing from the update's input (kept, flagged present=false)
ADDED = ("r40", "r41")
LOOKUP = "r3"
WANTED_LABEL = "negative"
Where = tuple[str, object] | None  # (column, value): the rows where column == value
COLUMNS = ["id", "label", "present", "mean"]  # what every reader is asked to return


def _texts() -> dict[str, str]:
    words = "the drug worked well bad pain sleep side effects doctor week good".split()
    return {f"r{i}": " ".join(words[(i * 7 + k) % len(words)] for k in range(3 + i % 9))
            + f" {i}" for i in range(N)}


def _label(i: int) -> str:
    # runs of 8 rows, as the Delta stores' files: whole files hold no row with a given
    # label, which their statistics let a filter skip
    return LABELS[(i // 8) % 3]


def _write_input(path: Path, rows: dict[str, tuple[str, str]]) -> None:
    pq.write_table(pa.table({"id": list(rows), "text": [t for t, _ in rows.values()],
                             "label": [lab for _, lab in rows.values()]}), path)


def _first_rows() -> dict[str, tuple[str, str]]:
    return {key: (text, _label(i)) for i, (key, text) in enumerate(_texts().items())}


def _updated_rows() -> dict[str, tuple[str, str]]:
    rows = {key: value for key, value in _first_rows().items() if key not in GONE}
    for key in EDITED:
        rows[key] = (f"a text edited overnight for {key}, the pain was bad", rows[key][1])
    rows[RELABELED] = (rows[RELABELED][0], WANTED_LABEL)
    rows.update({key: (f"a new review {key}: good drug", WANTED_LABEL) for key in ADDED})
    return rows


@dataclass(frozen=True)
class Built:
    """The stores of the module: per format, its `first` and `updated` copies."""

    paths: dict[tuple[str, str], Path]  # (format, "first" | "updated") -> store


@pytest.fixture(scope="module")
def built(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """Each format's store of a full run, then a copy of it updated (zarr is written once).
    Delta files of 8 rows, so a filter has several files to skip or keep by statistics."""
    root = tmp_path_factory.mktemp("contract")
    source = root / "in.parquet"
    paths: dict[tuple[str, str], Path] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(delta_store, "DELTA_ROWS_PER_FILE", 8)
        _write_input(source, _first_rows())
        for fmt in ("zarr", "parquet", "icechunk", "delta"):
            out = root / f"first.{fmt}"
            run_job(_job(source, tiny_bert, out, fmt))
            paths[fmt, "first"] = out
        _write_input(source, _updated_rows())
        for fmt in ("parquet", "icechunk", "delta"):
            out = root / f"updated.{fmt}"
            shutil.copytree(paths[fmt, "first"], out)
            summary = run_job(_job(source, tiny_bert, out, fmt), incremental=True)
            assert (summary.added, summary.replaced, summary.gone) == (2, 2, 2)
            paths[fmt, "updated"] = out
    yield Built(paths)


def _job(source: Path, model: Path, out: Path, fmt: str) -> Job:
    return Job.from_dict(job_dict(source, model, out, input={"carry_columns": ["label"]},
                                  output={"format": fmt, "incremental": fmt != "zarr"}))


# ---- the oracle ------------------------------------------------------------------------

@dataclass(frozen=True)
class Rows:
    """What a reader returned for one question: ids, labels, present flags, mean vectors."""

    ids: list[str]
    labels: list[str]
    present: list[bool]
    mean: np.ndarray  # (n, D)


def _oracle(path: Path, version: int | None, where: Where) -> Rows:
    store = pipeline.open_store(path, version=version)
    docs = store.docs
    ids = [str(i) for i in np.asarray(docs["id"].values)]
    labels = [str(v) for v in np.asarray(docs["label"].values)]
    present = np.asarray(docs["present"].values, bool).tolist()
    mean = store.vectors("mean")
    if where is None:
        keep = list(range(len(ids)))
    elif where[0] == "id":  # a lookup: the id's current row (open_store.row_of)
        keep = [store.row_of(where[1])]
    else:
        values = {"label": labels, "present": present}[where[0]]
        keep = [i for i, v in enumerate(values) if v == where[1]]
    return Rows([ids[i] for i in keep], [labels[i] for i in keep],
                [present[i] for i in keep], mean[keep])


# ---- the readers, each in its own idiom --------------------------------------------------

def _from_arrow(table: pa.Table) -> Rows:
    mean = table.column("mean").combine_chunks()
    width = mean.type.list_size if pa.types.is_fixed_size_list(mean.type) else None
    values = pc.list_flatten(mean).to_numpy(zero_copy_only=False)
    width = width or (len(values) // len(table) if len(table) else 0)
    return Rows(table.column("id").to_pylist(), table.column("label").to_pylist(),
                table.column("present").to_pylist(), values.reshape(len(table), width))


def _from_pandas(frame: pd.DataFrame) -> Rows:
    mean = np.stack(frame["mean"].to_numpy()) if len(frame) else np.zeros((0, 0), np.float32)
    return Rows(frame["id"].astype(str).tolist(), frame["label"].astype(str).tolist(),
                frame["present"].astype(bool).tolist(), mean)


def _from_xarray(ds: xr.Dataset) -> Rows:
    return Rows([str(i) for i in ds["id"].values], [str(v) for v in ds["label"].values],
                ds["present"].values.astype(bool).tolist(), ds["mean"].values)


def xarray_plain(ds: xr.Dataset, where: Where) -> Rows:
    """docs/store.md's lines: `ds.sel(id=...)`, a boolean selection on a column."""
    if where is None:
        return _from_xarray(ds)
    if where[0] == "id":  # one row, or (an id that names several) a selection of rows
        found = ds.sel(id=where[1])
        return _from_xarray(found if "id" in found.dims else found.expand_dims("id"))
    return _from_xarray(ds.isel(id=(ds[where[0]] == where[1]).values))


def read_zarr(path: Path, _: None, where: Where) -> Rows:
    return xarray_plain(xr.open_zarr(path, group="docs"), where)


def read_icechunk(path: Path, snapshot: str | None, where: Where) -> Rows:
    import icechunk

    repo = icechunk.Repository.open(icechunk.local_filesystem_storage(str(path / "repo")))
    session = repo.readonly_session(snapshot_id=snapshot) if snapshot else \
        repo.readonly_session(branch="main")
    return xarray_plain(xr.open_zarr(session.store, group="docs", consolidated=False), where)


def _expression(where: Where) -> pc.Expression | None:
    return None if where is None else pc.field(where[0]) == where[1]


def _sql(where: Where) -> str:
    if where is None:
        return ""
    value = where[1] if isinstance(where[1], bool) else f"'{where[1]}'"
    return f" where {where[0]} = {value}"


def _polars_filter(where: Where) -> Any:
    import polars as pl

    return pl.lit(True) if where is None else pl.col(where[0]) == where[1]


def _polars_rows(frame: Any) -> Rows:
    return Rows(frame["id"].to_list(), frame["label"].to_list(), frame["present"].to_list(),
                np.asarray(frame["mean"].to_list(), np.float32).reshape(frame.height, -1))


def parquet_pyarrow(path: Path, _: None, where: Where) -> Rows:
    dataset = pads.dataset(path / "docs", format="parquet")
    return _from_arrow(dataset.to_table(columns=COLUMNS, filter=_expression(where)))


def parquet_duckdb(path: Path, _: None, where: Where) -> Rows:
    import duckdb

    glob = f"{path}/docs/*.parquet"
    table = duckdb.sql(f"select id, label, present, mean from '{glob}'{_sql(where)}").arrow()
    return _from_arrow(table if isinstance(table, pa.Table) else table.read_all())


def parquet_polars(path: Path, _: None, where: Where) -> Rows:
    import polars as pl

    frame = pl.scan_parquet(f"{path}/docs/*.parquet").filter(_polars_filter(where))
    return _polars_rows(frame.select(COLUMNS).collect())


def parquet_pandas(path: Path, _: None, where: Where) -> Rows:
    filters = None if where is None else [(where[0], "==", where[1])]
    return _from_pandas(pd.read_parquet(path / "docs", columns=COLUMNS, filters=filters))


def delta_dataset(path: Path, version: int | None, where: Where) -> Rows:
    """docs/store.md's offline route: deltalake's Arrow dataset, a filter pushed down."""
    dataset = DeltaTable(str(path / "docs"), version=version).to_pyarrow_dataset()
    return _from_arrow(dataset.to_table(columns=COLUMNS, filter=_expression(where)))


def delta_duckdb(path: Path, version: int | None, where: Where) -> Rows:
    import duckdb

    docs = DeltaTable(str(path / "docs"), version=version).to_pyarrow_dataset()  # noqa: F841
    table = duckdb.sql(f"select id, label, present, mean from docs{_sql(where)}").arrow()
    return _from_arrow(table if isinstance(table, pa.Table) else table.read_all())


def delta_polars(path: Path, version: int | None, where: Where) -> Rows:
    import polars as pl

    frame = pl.scan_delta(str(path / "docs"), version=version).filter(_polars_filter(where))
    return _polars_rows(frame.select(COLUMNS).collect())


def delta_pandas(path: Path, version: int | None, where: Where) -> Rows:
    filters = None if where is None else [(where[0], "=", where[1])]
    table = DeltaTable(str(path / "docs"), version=version)
    return _from_pandas(table.to_pandas(columns=COLUMNS, filters=filters))


def delta_parquet_glob(path: Path, _: int | None, where: Where) -> Rows:
    """A Parquet glob over a Delta table's folder: it knows nothing of the log."""
    return parquet_polars(path, None, where)


Reader = Callable[[Path, Any, Where], Rows]
READERS: dict[str, dict[str, Reader]] = {
    "zarr": {"xarray": read_zarr},
    "parquet": {"pyarrow": parquet_pyarrow, "duckdb": parquet_duckdb,
                "polars": parquet_polars, "pandas": parquet_pandas},
    "icechunk": {"xarray": read_icechunk},
    "delta": {"deltalake": delta_dataset, "duckdb": delta_duckdb, "polars": delta_polars,
              "pandas": delta_pandas, "parquet glob": delta_parquet_glob},
}
STATES = {"zarr": ("first",), "parquet": ("first", "updated"),
          "icechunk": ("first", "updated", "version 0"),
          "delta": ("first", "updated", "version 0")}
QUESTIONS: dict[str, Where] = {"count": None, "label": ("label", WANTED_LABEL),
                               "lookup": ("id", LOOKUP), "present": ("present", True)}
# Documented limits (docs/store.md): the cells where a reader cannot give open_store's
# answer, and what it gives instead.
LIMITS = {
    # a Parquet glob sees the files an update retired (until gc), and no version
    ("delta", "parquet glob", "updated"): "retired files",
    ("delta", "parquet glob", "version 0"): "no versions",
    # plain xarray sees the row an edit superseded, flagged present=false, beside the
    # current one: `sel(id=...)` gives both, the current one last
    ("icechunk", "xarray", "updated"): "superseded rows",
}


def _cells() -> Iterator[Any]:
    for fmt, readers in READERS.items():
        for reader in readers:
            for state in STATES[fmt]:
                for question in QUESTIONS:
                    name = f"{fmt}-{reader}-{question}-{state}".replace(" ", "_")
                    yield pytest.param(fmt, reader, question, state, id=name)


# ---- versions: bertpipe's, and what a reader opens ---------------------------------------

def delta_versions_from_history(store: Path) -> dict[int, dict[str, int]]:
    """docs/store.md's lines: each bertpipe version's table versions, from its newest
    completing commit of the docs table (history() is newest first)."""
    done = {c["bertpipe_version"]: c for c in reversed(DeltaTable(str(store / "docs"))
            .history()) if c.get("bertpipe_complete")}
    return {k: {"docs": c["version"], "chunks": c["bertpipe_tables"]["chunks"]}
            for k, c in done.items()}


def _inspect_json(path: Path) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    facts: dict[str, Any] = json.loads(result.stdout)
    return facts


def _where_to_read(built: Built, fmt: str, state: str) -> tuple[Path, int | None, Any]:
    """The store, the bertpipe version open_store is asked for, and what the plain reader
    is given for it (a Delta table version, an Icechunk snapshot; None: the head)."""
    if state != "version 0":
        return built.paths[fmt, state], None, None
    path = built.paths[fmt, "updated"]
    if fmt == "delta":
        return path, 0, delta_versions_from_history(path)[0]["docs"]
    snapshots = {v["version"]: v["snapshot"] for v in _inspect_json(path)["reader_versions"]}
    return path, 0, snapshots[0]


@pytest.mark.parametrize(("fmt", "reader", "question", "state"), list(_cells()))
def test_reader_answers_as_open_store(built: Built, fmt: str, reader: str, question: str,
                                      state: str) -> None:
    path, version, handle = _where_to_read(built, fmt, state)
    where = QUESTIONS[question]
    got = READERS[fmt][reader](path, handle, where)
    want = _oracle(path, version, where)
    limit = LIMITS.get((fmt, reader, state))
    if limit is None:
        _assert_same(question, got, want)
    else:
        _assert_limit(limit, question, got, want)


def _assert_same(question: str, got: Rows, want: Rows) -> None:
    if question == "count":
        assert len(got.ids) == len(want.ids)
    elif question == "lookup":
        assert got.ids == want.ids and got.labels == want.labels
        np.testing.assert_array_equal(got.mean, want.mean)
    else:  # which rows: the same ids, as often (a superseded row is a row of its own)
        assert sorted(got.ids) == sorted(want.ids)
        assert sorted(zip(got.ids, got.labels, strict=True)) == \
            sorted(zip(want.ids, want.labels, strict=True))


def _assert_limit(limit: str, question: str, got: Rows, want: Rows) -> None:
    if limit == "superseded rows":
        if question == "lookup":  # the edited id: its superseded row, then its current one
            assert got.ids == [LOOKUP, LOOKUP] and got.present == [False, True]
            np.testing.assert_array_equal(got.mean[-1:], want.mean)
        else:  # every other answer counts the superseded rows, as open_store's docs do
            _assert_same(question, got, want)
        return
    # a glob over a Delta folder: every data file still on disk, the retired ones too
    if question == "lookup":
        assert got.ids == [LOOKUP, LOOKUP]  # in a retired file, and in its rewrite
    elif question == "count":
        assert len(got.ids) > len(want.ids)
    else:
        assert sorted(got.ids) != sorted(want.ids)


def test_a_delta_version_is_not_bertpipes_and_inspect_maps_them(built: Built) -> None:
    """bertpipe version k is not Delta table version k (two commits per version at
    least); `inspect --json` and the history one-liner name the same table versions, and
    polars and deltalake read exactly open_store's version there."""
    import polars as pl

    path = built.paths["delta", "updated"]
    facts = _inspect_json(path)
    mapped = {v["version"]: v["tables"] for v in facts["reader_versions"]}
    assert sorted(mapped) == [0, 1]
    assert mapped == delta_versions_from_history(path)
    assert mapped[1]["docs"] != 1 and mapped[0]["chunks"] >= 0
    for k, tables in mapped.items():
        want = pipeline.open_store(path, version=k)
        docs = pl.read_delta(str(path / "docs"), version=tables["docs"]).sort("row")
        assert docs["id"].to_list() == [str(i) for i in want.docs["id"].values]
        chunks = DeltaTable(str(path / "chunks"), version=tables["chunks"]).to_pyarrow_table()
        assert chunks.num_rows == want.chunks.sizes["chunk"]
    shown = CliRunner().invoke(main, ["inspect", str(path)]).stdout
    assert f"v0: Delta table versions chunks {mapped[0]['chunks']}, docs " \
        f"{mapped[0]['docs']}" in shown


def test_a_store_without_full_statistics_and_the_documented_remedy(
        tiny_bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Delta store written before every column had statistics (add actions with the
    order columns' only): deltalake's filtered reads skip every file; declaring the
    indexed columns (docs/store.md's one-liner) makes them right without a rewrite."""
    def order_only(table: pa.Table) -> dict[str, Any]:
        keys = [k for k in ("row", "doc", "seq", "position") if k in table.column_names]
        return {"numRecords": table.num_rows,
                "minValues": {k: pc.min(table.column(k)).as_py() for k in keys},
                "maxValues": {k: pc.max(table.column(k)).as_py() for k in keys},
                "nullCount": {k: 0 for k in keys}}

    monkeypatch.setattr(delta_store, "file_stats", order_only)
    source = tmp_path / "in.parquet"
    _write_input(source, _first_rows())
    out = tmp_path / "old.delta"
    run_job(_job(source, tiny_bert, out, "delta"))
    negative = len(_oracle(out, None, ("label", WANTED_LABEL)).ids)
    assert negative == sum(_label(i) == WANTED_LABEL for i in range(N)) > 0
    assert len(delta_dataset(out, None, ("label", WANTED_LABEL)).ids) == 0  # the bug
    assert len(delta_pandas(out, None, ("label", WANTED_LABEL)).ids) == 0
    for table, columns in {"docs": "row", "chunks": "doc,seq"}.items():  # docs/store.md
        DeltaTable(str(out / table)).alter.set_table_properties(
            {"delta.dataSkippingStatsColumns": columns})
    assert len(delta_dataset(out, None, ("label", WANTED_LABEL)).ids) == negative
    assert len(delta_pandas(out, None, ("label", WANTED_LABEL)).ids) == negative
    # bertpipe updates the remedied store as any other, and readers stay right
    monkeypatch.undo()
    _write_input(source, _updated_rows())
    run_job(_job(source, tiny_bert, out, "delta"), incremental=True)
    for where in (("label", WANTED_LABEL), ("present", True), ("id", RELABELED)):
        want = _oracle(out, None, where)
        for read in (delta_dataset, delta_pandas, delta_polars):
            _assert_same("label", read(out, None, where), want)
    assert verify_store(str(out)) == []


def test_file_statistics_are_deltalakes_own_and_every_filter_keeps_its_rows(
        tmp_path: Path) -> None:
    """A table of every kind of column a store may carry, in three files with bertpipe's
    statistics: they are those deltalake's own writer gives the same rows (a timestamp's
    maximum rounded up to the millisecond, not down), and a filter on any column through
    deltalake's readers gives the rows pyarrow's filter of the whole table gives
    (infinities, a file of NaN only and decimals included)."""
    from deltalake import write_deltalake
    from deltalake.transaction import AddAction, create_table_with_add_actions

    stamp = pa.timestamp("us", tz="UTC")
    table = pa.table({
        "row": pa.array(range(9), pa.int64()),
        "id": ["b", "a", "c", "é", "z", "y", "m", "n", "o"],
        "flag": [True, False, None, True, True, True, False, False, None],
        "label": ["x", None, "y", None, None, None, "x", "x", "x"],
        "score": pa.array([1.5, float("nan"), 2.0, 0.0, -1.0, 3.0, 1.0, 1.0, 1.0],
                          pa.float32()),
        "day": pa.array([date(2024, 1, d) for d in range(1, 10)]),
        "at": pa.array([1_001, 2_500, 3_999, 10, 20, 30, 5, 6, 7], stamp),
        "nothing": pa.array([None] * 9, pa.string()),
        "mean": pa.array([[float(i), 1.0] for i in range(9)], pa.list_(pa.float32())),
    })
    nan, inf = float("nan"), float("inf")
    wide = {"wide": pa.array([1.0, inf, -inf, nan, nan, nan, 2.0, nan, 3.0]),
            "cents": pa.array([Decimal(v) for v in ("1.50", "-3.25", "0.00", "9.99", "1.50",
                                                    "2.00", "0.10", "0.20", "0.30")],
                              pa.decimal128(6, 2))}
    parts = [table.slice(0, 3), table.slice(3, 3), table.slice(6, 3)]
    write_deltalake(str(tmp_path / "theirs"), parts[0])
    log = (tmp_path / "theirs" / "_delta_log" / f"{0:020d}.json").read_text().splitlines()
    theirs = next(json.loads(entry["add"]["stats"]) for entry in map(json.loads, log)
                  if "add" in entry)
    ours = delta_store.file_stats(parts[0])
    assert ours["numRecords"] == theirs["numRecords"] == 3
    assert ours["nullCount"] == theirs["nullCount"]
    assert ours["minValues"] == theirs["minValues"]
    assert ours["maxValues"] == {**theirs["maxValues"], "at": "1970-01-01T00:00:00.004Z"}
    assert theirs["maxValues"]["at"] == "1970-01-01T00:00:00.003Z"  # 3,999 us, rounded down
    for name, column in wide.items():
        table = table.append_column(name, column)
    parts = [table.slice(0, 3), table.slice(3, 3), table.slice(6, 3)]

    (tmp_path / "ours").mkdir()
    adds = []
    for i, part in enumerate(parts):
        file = tmp_path / "ours" / f"part-{i}.parquet"
        pq.write_table(part, file)
        adds.append(AddAction(file.name, file.stat().st_size, {}, 0, True,
                              delta_store.stats_json(delta_store.file_stats(part))))
    create_table_with_add_actions(str(tmp_path / "ours"), Schema.from_arrow(table.schema),
                                  adds)
    delta = DeltaTable(str(tmp_path / "ours"))
    # the statistics are what decides: a filter keeps only the files that may match
    kept = delta.to_pyarrow_dataset().get_fragments(filter=pc.field("id") == "é")
    assert [Path(f.path).name for f in kept] == ["part-1.parquet"]
    for name, value in (("id", "é"), ("flag", True), ("label", "x"), ("score", 1.0),
                        ("day", date(2024, 1, 5)), ("at", pa.scalar(3_999, stamp)),
                        ("nothing", "x"), ("wide", inf), ("wide", -inf), ("wide", 2.0),
                        ("cents", Decimal("1.50"))):
        expression = pc.field(name) == value
        want = sorted(table.filter(expression).column("row").to_pylist())
        got = delta.to_pyarrow_dataset().to_table(filter=expression).column("row")
        assert sorted(got.to_pylist()) == want, name
        if name != "at":  # deltalake's filters= take plain values
            frame = delta.to_pandas(filters=[(name, "=", value)])
            assert sorted(frame["row"].tolist()) == want, name
    nans = delta.to_pyarrow_dataset().to_table(filter=pc.field("wide").is_nan())
    assert sorted(nans.column("row").to_pylist()) == [3, 4, 5, 7]


def test_plain_xarray_looks_an_edited_id_up_among_the_present_rows(built: Built) -> None:
    """docs/store.md's lines for an Icechunk head after an edit: a list selection of the
    edited id is refused by pandas (the id index is not unique); among the `present` rows
    the id names one row, open_store's."""
    import icechunk

    path = built.paths["icechunk", "updated"]
    repo = icechunk.Repository.open(icechunk.local_filesystem_storage(str(path / "repo")))
    docs = xr.open_zarr(repo.readonly_session(branch="main").store, group="docs",
                        consolidated=False)
    with pytest.raises(pd.errors.InvalidIndexError):
        docs.sel(id=[LOOKUP])
    current = docs.isel(id=docs.present.values)
    want = _oracle(path, None, ("id", LOOKUP))
    np.testing.assert_array_equal(current.sel(id=LOOKUP)["mean"].values, want.mean[0])
    assert current.sizes["id"] == len(_oracle(path, None, ("present", True)).ids)
