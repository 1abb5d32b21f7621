"""Reading a level's Parquet part files lazily (`parquet_store.parts_dataset`), with and
without dask. Oracle: pyarrow's own read of the same files, as NumPy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import StoreError
from pipeline.io.location import resolve
from pipeline.stores.parquet_store import (
    DTYPE_KEY,
    WIDTH_KEY,
    dataset_of,
    parts_columns,
    parts_dataset,
)

WIDTH = 3


def _files(tmp_path: Path) -> tuple[list[Path], dict[str, np.ndarray]]:
    """Three files of 5, 0 and 7 rows in row groups of 2: an integer column with a null
    in the last file only, strings with a null, a fixed-size vector and a variable list
    vector (Delta's form) stored as float32 and read back as float16."""
    rng = np.random.default_rng(7)
    sizes, files, tables = [5, 0, 7], [], []
    start = 0
    for i, n in enumerate(sizes):
        count = list(range(start, start + n))
        if i == 2:
            count[3] = None
        vectors = rng.normal(size=(n, WIDTH)).astype(np.float32)
        flat = pa.array(vectors.reshape(-1))
        table = pa.table({
            "count": pa.array(count, pa.int64()),
            "name": pa.array([None if (start + j) % 4 == 1 else f"n{start + j}"
                              for j in range(n)], pa.string()),
            "fixed": pa.FixedSizeListArray.from_arrays(flat, WIDTH),
            "listed": pa.ListArray.from_arrays(pa.array(np.arange(n + 1) * WIDTH, pa.int32()),
                                               flat)})
        table = table.cast(table.schema.set(3, pa.field("listed", pa.list_(pa.float32()),
                                                        metadata={WIDTH_KEY: b"3",
                                                                  DTYPE_KEY: b"float16"})))
        path = tmp_path / f"part-{i}.parquet"
        pq.write_table(table, path, row_group_size=2)
        files.append(path)
        tables.append(table)
        start += n
    whole = pa.concat_tables(tables)
    want = {
        "count": np.array([np.nan if v is None else v
                           for v in whole.column("count").to_pylist()], np.float64),
        "name": np.array(whole.column("name").to_pylist(), object),
        "fixed": np.array(whole.column("fixed").to_pylist(), np.float32),
        "listed": np.array(whole.column("listed").to_pylist(), np.float32).astype(np.float16)}
    return files, want


@pytest.mark.parametrize("dask", [False, True])
def test_every_column_and_index_reads_as_pyarrow_does(tmp_path: Path, dask: bool) -> None:
    files, want = _files(tmp_path)
    data = parts_dataset([resolve(str(f)) for f in files], "doc", dask=dask)
    rows = len(want["count"])
    picks = [slice(None), slice(3, 9), slice(10, 12), slice(4, 5), slice(6, 6),
             np.array([11, 0, 5, 5, 2]), np.array([], np.int64), 7]
    for name, values in want.items():
        array = data[name]
        assert array.shape[0] == rows and array.dtype == values.dtype, name
        for pick in picks:
            got = np.asarray(array[pick].values)
            expected = values[pick]
            if values.dtype == object:
                assert got.tolist() == np.asarray(expected).tolist(), (name, pick)
            else:
                np.testing.assert_array_equal(got, expected, err_msg=f"{name} {pick}")
    np.testing.assert_array_equal(data["fixed"][2:8, 1:].values, want["fixed"][2:8, 1:])
    np.testing.assert_array_equal(data["fixed"][[9, 1], 2].values, want["fixed"][[9, 1], 2])
    order = np.random.default_rng(1).permutation(rows)
    np.testing.assert_array_equal(data.isel(doc=order)["listed"].values, want["listed"][order])


def test_no_files_and_files_of_no_rows(tmp_path: Path) -> None:
    assert dict(parts_dataset([], "doc", dask=False).sizes) == {}
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"count": pa.array([], pa.int64())}), path)
    data = parts_dataset([resolve(str(path))], "doc", dask=False)
    assert data["count"].shape == (0,) and data["count"].values.dtype == np.int64


def test_files_of_no_rows_between_others_index_with_dask(tmp_path: Path) -> None:
    """A file (or row group) of no rows is no dask block: fancy indexing across it works."""
    files = []
    for k, n in enumerate([1, 0, 1]):
        files.append(tmp_path / f"z{k}.parquet")
        pq.write_table(pa.table({"x": np.arange(n) + 10 * k}), files[-1])
    for dask in (True, False):
        data = parts_dataset([resolve(str(f)) for f in files], "piece", dask=dask)
        assert data["x"].isel(piece=[1, 0]).values.tolist() == [20, 0]


def test_integers_beyond_float64_beside_nulls_are_refused_by_name(tmp_path: Path) -> None:
    """An integer column with a null reads as float64 (NaN for the null); a value float64
    cannot hold exactly is refused, naming the column, never rounded."""
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"big": pa.array([2**60 + 1, 2**60 + 3], pa.int64())}), first)
    pq.write_table(pa.table({"big": pa.array([None, 5], pa.int64())}), second)
    for dask in (True, False):
        data = parts_dataset([resolve(str(first)), resolve(str(second))], "doc", dask=dask)
        with pytest.raises(StoreError, match="column big"):
            np.asarray(data["big"][:2].values)
    small = tmp_path / "c.parquet"
    pq.write_table(pa.table({"big": pa.array([2**52 + 1, 7], pa.int64())}), small)
    data = parts_dataset([resolve(str(small)), resolve(str(second))], "doc", dask=False)
    assert data["big"].values[0] == 2**52 + 1 and np.isnan(data["big"].values[2])


def test_dask_reads_leave_no_row_group_held_and_indexed_reads_keep_one(tmp_path: Path) -> None:
    """Dask reads each block once: a column read through dask holds none of it after; an
    indexed read keeps the last row group it read (the next run of rows is mostly in it)."""
    files, want = _files(tmp_path)
    columns = parts_columns([resolve(str(f)) for f in files], "doc")
    np.testing.assert_array_equal(dataset_of(columns, dask=True)["fixed"].values, want["fixed"])
    assert columns["fixed"]._held is None
    np.testing.assert_array_equal(dataset_of(columns, dask=False)["fixed"][9:11].values,
                                  want["fixed"][9:11])
    assert columns["fixed"]._held is not None
