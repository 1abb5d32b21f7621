"""Carried columns round-trip in both formats: values, nulls and types, read back through
open_store, plain xarray (Zarr) and pandas (Parquet), against the input read by pandas."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xarray as xr
from click.testing import CliRunner

import pipeline
from pipeline.cli import main
from tests.conftest import job_dict, write_job

CARRY = ["s", "i", "whole", "f", "b", "day", "when", "cat", "blank"]


def _inputs(folder: Path) -> list[Path]:
    """Two files whose carried columns disagree on width (int32/int64, float32/float64),
    on string flavour (string/large_string, dictionary) and where one is all null."""
    folder.mkdir()
    a = pa.table({
        "id": pa.array([1, 2, 3, 4], pa.int32()),
        "text": ["good drug", None, "   ", "bad pain"],
        "s": ["x", None, "", "nan"],
        "i": pa.array([1, None, -3, 4], pa.int32()),
        "whole": pa.array([10, 20, 30, 40], pa.int16()),
        "f": pa.array([0.5, None, float("nan"), 2.0], pa.float32()),
        "b": [True, None, False, True],
        "day": pa.array([dt.date(2020, 1, 1), None, dt.date(2021, 5, 6), dt.date(1999, 12, 31)]),
        "when": pa.array([0, None, 10**6, 2 * 10**6], pa.timestamp("us")),
        "cat": pa.array(["p", "q", None, "p"]).dictionary_encode(),
        "blank": pa.nulls(4),  # all null: typed `null` in this file
    })
    b = pa.table({
        "id": pa.array([5, 6], pa.int64()),
        "text": pa.array(["the day", "sleep was good"], pa.large_string()),
        "s": pa.array(["y", None], pa.large_string()),
        "i": pa.array([2**40, 7], pa.int64()),
        "whole": pa.array([50, 60], pa.int64()),
        "f": pa.array([1.25, None], pa.float64()),
        "b": [False, False],
        "day": pa.array([dt.date(2022, 2, 2), None]),
        "when": pa.array([None, 5], pa.timestamp("us")),
        "cat": pa.array(["q", "r"]),
        "blank": pa.array([None, "z"], pa.string()),
    })
    paths = [folder / "a.parquet", folder / "b.parquet"]
    pq.write_table(a, paths[0])
    pq.write_table(b, paths[1])
    return paths


def _expected(paths: list[Path]) -> pd.DataFrame:
    """The oracle: pandas reading each file on its own, concatenated."""
    return pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True)


def _same(actual: np.ndarray, expected: pd.Series, column: str) -> None:
    missing = pd.isna(expected).to_numpy()
    np.testing.assert_array_equal(pd.isna(actual), missing, err_msg=column)
    got = [v.item() if isinstance(v, np.generic) else v for v in actual[~missing]]
    want = list(expected[~missing])
    if column in ("day", "when"):
        got = [pd.Timestamp(v) for v in got]
        want = [pd.Timestamp(v) for v in want]
    assert got == want, column


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("carry")
    _inputs(root / "in")
    out = {}
    for fmt in ("zarr", "parquet"):
        path = root / f"o.{fmt}"
        job = job_dict(root / "in", tiny_bert, path, output={"format": fmt},
                       input={"carry_columns": CARRY},
                       execution={"scheduler": "synchronous", "partition_rows": 3})
        result = CliRunner().invoke(main, ["extract", str(write_job(root / f"{fmt}.yaml", job))])
        assert result.exit_code == 0, result.output
        out[fmt] = path
    out["input"] = root / "in"
    return out


@pytest.mark.parametrize("fmt", ["zarr", "parquet"])
def test_values_and_nulls_round_trip(fmt: str, runs: dict[str, Path]) -> None:
    expected = _expected(sorted(runs["input"].glob("*.parquet")))
    store = pipeline.open_store(runs[fmt])
    for column in CARRY:
        _same(np.asarray(store.docs[column].values), expected[column], column)
    # one type per column, whatever each file had; nulls decide only int/bool -> float64
    dtypes = {c: str(store.docs[c].dtype) for c in CARRY}
    assert dtypes == {"s": "object", "i": "float64", "whole": "int64", "f": "float64",
                      "b": "float64", "day": "datetime64[D]", "when": "datetime64[us]",
                      "cat": "object", "blank": "object"}
    assert np.asarray(store.docs["i"].values)[4] == 2**40  # exact below 2**53
    assert list(store.docs["id"].values) == [1, 2, 3, 4, 5, 6]


def test_zarr_nulls_read_as_missing_with_plain_xarray(runs: dict[str, Path]) -> None:
    expected = _expected(sorted(runs["input"].glob("*.parquet")))
    docs = xr.open_zarr(runs["zarr"], group="docs")
    for column in CARRY:
        _same(np.asarray(docs[column].values), expected[column], column)
    # the marker is in the array (U+2400) and named by the CF attribute xarray decodes
    raw = xr.open_zarr(runs["zarr"], group="docs", mask_and_scale=False)
    assert raw["s"].attrs["missing_value"] == "\u2400"
    assert list(np.asarray(raw["s"].values)) == ["x", "\u2400", "", "nan", "y", "\u2400"]
    assert "missing_value" not in raw["status"].attrs  # no nulls, no marker


def test_parquet_keeps_arrow_nulls(runs: dict[str, Path]) -> None:
    table = pq.read_table(runs["parquet"] / "docs/part-0.parquet")
    assert table.column("s").null_count == 2 and table.column("i").null_count == 1
    assert table.schema.field("i").type == pa.int64()  # int32 + int64 files, nulls kept
    assert table.schema.field("blank").type == pa.string()
    assert table.column("s").to_pylist() == ["x", None, "", "nan", "y", None]


@pytest.mark.parametrize("fmt", ["zarr", "parquet"])
def test_null_and_blank_text_flagged_per_row(fmt: str, runs: dict[str, Path]) -> None:
    store = pipeline.open_store(runs[fmt])
    assert list(store.docs["status"].values) == ["ok", "empty", "empty", "ok", "ok", "ok"]
    assert list(store.docs["n_chunks"].values) == [1, 0, 0, 1, 1, 1]
    for view in ("mean", "cls"):
        vectors = store.vectors(view)
        assert np.isnan(vectors[[1, 2]]).all()  # never zeros
        assert np.isfinite(vectors[[0, 3, 4, 5]]).all()
    assert store.chunks is not None
    assert 1 not in set(store.chunks["doc"].values) and 2 not in set(store.chunks["doc"].values)


@pytest.mark.parametrize("fmt", ["zarr", "parquet"])
def test_probe_skips_rows_with_a_null_label(fmt: str, tmp_path: Path, tiny_bert: Path) -> None:
    labels = ["pos", "neg", None, "pos", "neg", "pos", "neg", "pos", "neg", None]
    texts = ["good", "bad", "the drug", "great", "terrible", "very good", "not good", "yes",
             "no", "pain"]
    pq.write_table(pa.table({"id": list(range(10)), "text": texts, "label": labels}),
                   tmp_path / "in.parquet")
    out = tmp_path / f"o.{fmt}"
    job = job_dict(tmp_path / "in.parquet", tiny_bert, out, output={"format": fmt},
                   input={"carry_columns": ["label"]})
    assert CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "j.yaml", job))]
                              ).exit_code == 0
    result = CliRunner().invoke(main, ["probe", str(out), "--label", "label", "--folds", "2",
                                       "--out", str(tmp_path / "probe")])
    assert result.exit_code == 0, result.output
    assert "classification probe of 'label': 8 rows, 2-fold CV" in result.stdout
