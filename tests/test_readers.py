"""The stores as analysts open them, without bertpipe: xarray on Zarr, DuckDB, polars,
pandas and pyarrow on Parquet; strings and labels ready for scikit-learn."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pytest
import xarray as xr
from click.testing import CliRunner

import pipeline
from pipeline.cli import main
from tests.conftest import job_dict, write_job, write_table

TEXTS = ["the drug worked very well", "bad side effects, no sleep for a week", "great",
         "my doctor said it is not good for pain", "pain pain pain", "yes"]
LABELS = ["pos", "neg", None, "neg", "neg", "pos"]


def _store(tmp_path: Path, tiny_bert: Path, fmt: str) -> Path:
    source = write_table(tmp_path / "in.parquet", {
        "id": [f"r{i}" for i in range(len(TEXTS))], "text": TEXTS, "label": LABELS})
    out = tmp_path / f"o.{fmt}"
    job = job_dict(source, tiny_bert, out, input={"carry_columns": ["label"]},
                   output={"path": str(out), "format": fmt})
    result = CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "j.yaml", job))])
    assert result.exit_code == 0, result.output
    return out


def test_zarr_docs_group_is_enough_on_its_own(tmp_path: Path, tiny_bert: Path) -> None:
    out = _store(tmp_path, tiny_bert, "zarr")
    ds = xr.open_zarr(out, group="docs")
    assert "id" in ds.indexes and ds["mean"].dims == ("id", "mean_dim")
    row = ds.sel(id="r3")
    expected = pipeline.open_store(out).vectors("mean")[3]
    np.testing.assert_array_equal(row["mean"].values, expected)
    assert ds["mean"].attrs["pooling"] == "mean" and ds["cls"].attrs["pooling"] == "cls"
    assert ds.attrs["model"] == str(tiny_bert) and "one row per input row" in ds.attrs[
        "description"]
    # each group's description names the dimension plain xarray shows for it
    for group, data in (("docs", ds), ("chunks", xr.open_zarr(out, group="chunks"))):
        named = re.search(r"\(dimension (\w+)", data.attrs["description"])
        assert named and data.sizes.get(named.group(1), 0) > 0, group
    assert "(dimension id: the row's id, also its coordinate)" in ds.attrs["description"]
    labels = ds["label"].values  # fixed-width strings; the null is missing (NaN)
    assert labels[0] == "pos" and labels[1] == "neg" and labels[2] != labels[2]
    tree = xr.open_datatree(out, engine="zarr")
    assert {"docs", "chunks"} <= set(tree.children)


def test_zarr_labels_go_straight_into_scikit_learn(tmp_path: Path, tiny_bert: Path) -> None:
    from sklearn.linear_model import LogisticRegression

    ds = xr.open_zarr(_store(tmp_path, tiny_bert, "zarr"), group="docs")
    keep = ds["label"].notnull().values
    model = LogisticRegression().fit(ds["mean"].values[keep], ds["label"].values[keep])
    assert set(model.classes_) == {"pos", "neg"}


def test_parquet_tables_glob_in_duckdb_polars_pandas_pyarrow(tmp_path: Path,
                                                             tiny_bert: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    pl = pytest.importorskip("polars")
    import pandas as pd

    out = _store(tmp_path, tiny_bert, "parquet")
    n_chunks = int(np.asarray(pipeline.open_store(out).docs["n_chunks"].values).sum())
    con = duckdb.connect()
    for table, rows in (("docs", len(TEXTS)), ("chunks", n_chunks)):
        glob = str(out / table / "*.parquet")
        assert con.execute(f"select count(*) from '{glob}'").fetchall() == [(rows,)]
        assert pl.scan_parquet(glob).select(pl.len()).collect().item() == rows
        assert len(pd.read_parquet(out / table)) == rows
        assert pads.dataset(out / table).count_rows() == rows
    described = con.execute(f"describe select * from '{out / 'docs' / '*.parquet'}'").fetchall()
    kinds = {row[0]: row[1] for row in described}
    # Parquet has no fixed-size list: DuckDB reads FLOAT[], and a cast gives its ARRAY type
    assert kinds["mean"] in ("FLOAT[]", "FLOAT[32]")
    cast = con.execute(f"select typeof(mean::FLOAT[32]) from '{out / 'docs' / '*.parquet'}' "
                       "limit 1").fetchall()
    assert cast == [("FLOAT[32]",)]
    frame = pl.read_parquet(out / "docs" / "*.parquet")
    assert frame.schema["mean"] == pl.Array(pl.Float32, 32)
    assert frame["label"].to_list() == LABELS
