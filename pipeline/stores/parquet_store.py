"""Parquet store: a directory with `docs.parquet`, `chunks.parquet` and, for token views,
a `tokens/` folder of part files (one per partition, in row order).

Views are `fixed_size_list<float, D>` columns (zstd, byte-stream-split, no dictionary);
the provenance JSON sits in `docs.parquet`'s file metadata under `bertpipe`. The
commit writes `tokens/` and `chunks.parquet` first and `docs.parquet` last, each to a
temporary name renamed into place, so a store with a `docs.parquet` is a complete store.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xarray as xr

from .base import Layout, column_matrix, with_store_token_offsets
from .columns import StoredColumns, has_nulls, numpy_dtype, to_numpy
from .staging import Staging

ROW_GROUP_ROWS = 32768
METADATA_KEY = b"bertpipe"
TOKENS_DIR = "tokens"


def _write(file: Path, parts: Iterator[pa.Table], provenance: dict[str, Any] | None) -> None:
    tmp = file.with_name(f".{file.name}.{uuid.uuid4().hex}")
    writer: pq.ParquetWriter | None = None
    pending: list[pa.Table] = []
    try:
        for table in parts:
            if writer is None:
                writer = _writer(tmp, table.schema, provenance)
            pending.append(table)
            if sum(t.num_rows for t in pending) >= ROW_GROUP_ROWS:
                writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
                pending = []
        if writer is not None and pending:
            writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
    finally:
        if writer is not None:
            writer.close()
    os.replace(tmp, file)


def _writer(file: Path, schema: pa.Schema, provenance: dict[str, Any] | None) -> pq.ParquetWriter:
    vectors = [f.name for f in schema if pa.types.is_fixed_size_list(f.type)]
    others = [f.name for f in schema if f.name not in vectors]
    if provenance is not None:
        schema = schema.with_metadata({METADATA_KEY: json.dumps(provenance, default=str)})
    return pq.ParquetWriter(
        file, schema, compression="zstd",
        use_dictionary=others,  # why: dictionaries only bloat float vectors
        use_byte_stream_split=[f"{name}.list.element" for name in vectors],
    )


def _dataset(file: Path, dim: str) -> xr.Dataset:
    """Every column as a dask array read lazily, one block per row group."""
    pf = pq.ParquetFile(file)
    group_rows = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
    variables = {}
    for field in pf.schema_arrow:
        nulls = False
        if pa.types.is_fixed_size_list(field.type):
            width = field.type.list_size
            dtype = np.dtype(field.type.value_type.to_pandas_dtype())
            dims: tuple[str, ...] = (dim, f"{field.name}_dim")
        else:
            width, dims = 0, (dim,)
            nulls = has_nulls(pf.metadata, field.name)
            dtype = numpy_dtype(field.type, nulls)
        blocks = [
            da.from_delayed(dask.delayed(_read_block)(str(file), g, field.name, nulls),
                            shape=(rows, width) if width else (rows,), dtype=dtype)
            for g, rows in enumerate(group_rows)
        ]
        empty = np.empty((0, width) if width else (0,), dtype)
        variables[field.name] = (dims, da.concatenate(blocks) if blocks else da.from_array(empty))
    return xr.Dataset(variables)


def _read_block(file: str, group: int, column: str, nulls: bool) -> np.ndarray:
    col = pq.ParquetFile(file).read_row_group(group, columns=[column]).column(0)
    if pa.types.is_fixed_size_list(col.type):
        return column_matrix(col)
    return to_numpy(col, nulls)


def _with_column(file: Path, source: str, name: str,
                 fn: Callable[[np.ndarray], np.ndarray]) -> Iterator[pa.Table]:
    pf = pq.ParquetFile(file)
    for g in range(pf.num_row_groups):
        table = pf.read_row_group(g)
        src = table.column(source)
        dtype = np.dtype(src.type.value_type.to_pandas_dtype())
        values = fn(column_matrix(src).astype(np.float64)).astype(dtype)
        column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)),
                                                   values.shape[1])
        if name in table.column_names:
            table = table.set_column(table.column_names.index(name), name, column)
        else:
            table = table.append_column(name, column)
        yield table


def _conformed(staging: Staging, level: str, layout: Layout) -> Iterator[pa.Table]:
    """The staged parts of a level, each cast to the one schema they unify to."""
    columns = StoredColumns.from_parts([staging.part_path(i, level) for i in layout.indices])
    for table in staging.read_parts(level, layout.indices):
        yield columns.conform(table)


def _write_tokens(root: Path, staging: Staging, layout: Layout) -> None:
    """`tokens/part-NNNNNN.parquet`, numbered in row order, written into a temporary folder
    that replaces `tokens/` whole."""
    tmp = root / f".{TOKENS_DIR}.{uuid.uuid4().hex}"
    tmp.mkdir()
    for k, table in enumerate(_conformed(staging, "tokens", layout)):
        _write(tmp / f"part-{k:06d}.parquet", iter([table]), None)
    shutil.rmtree(root / TOKENS_DIR, ignore_errors=True)  # a commit interrupted after it
    os.replace(tmp, root / TOKENS_DIR)


def _parts_dataset(files: Sequence[Path], dim: str) -> xr.Dataset:
    """Every column of a folder of part files as dask arrays, one block per row group,
    the files concatenated in the given order."""
    blocks: dict[str, list[da.Array]] = {}
    empty: dict[str, tuple[tuple[str, ...], np.ndarray]] = {}
    for file in files:
        pf = pq.ParquetFile(file)
        group_rows = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
        for field in pf.schema_arrow:
            nulls = False
            if pa.types.is_fixed_size_list(field.type):
                width = field.type.list_size
                dtype = np.dtype(field.type.value_type.to_pandas_dtype())
                dims: tuple[str, ...] = (dim, f"{field.name}_dim")
            else:
                width, dims = 0, (dim,)
                nulls = has_nulls(pf.metadata, field.name)
                dtype = numpy_dtype(field.type, nulls)
            empty.setdefault(field.name, (dims, np.empty((0, width) if width else (0,), dtype)))
            blocks.setdefault(field.name, []).extend(
                da.from_delayed(dask.delayed(_read_block)(str(file), g, field.name, nulls),
                                shape=(rows, width) if width else (rows,), dtype=dtype)
                for g, rows in enumerate(group_rows))
    return xr.Dataset({
        name: (dims, da.concatenate(blocks[name]) if blocks[name] else da.from_array(zero))
        for name, (dims, zero) in empty.items()})


def _metadata(file: Path) -> dict[str, Any] | None:
    raw = (pq.read_schema(file).metadata or {}).get(METADATA_KEY)
    return json.loads(raw) if raw else None


class ParquetFormat:
    """The Parquet store format (see the module docstring for its layout)."""

    name = "parquet"

    def create(self, path: str, provenance: dict[str, Any]) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def is_store(self, path: str) -> bool:
        return (Path(path) / "docs.parquet").exists()

    def read_provenance(self, path: str) -> dict[str, Any] | None:
        file = Path(path) / "docs.parquet"
        return _metadata(file) if file.exists() else None

    def commit(self, path: str, staging: Staging, layout: Layout,
               provenance: dict[str, Any]) -> None:
        root = Path(path)
        if layout.has_tokens:
            _write_tokens(root, staging, layout)
        if layout.has_chunks:
            _write(root / "chunks.parquet", _conformed(staging, "chunks", layout), None)
        docs = (t.drop_columns(["row"]) for t in
                with_store_token_offsets(_conformed(staging, "docs", layout)))
        _write(root / "docs.parquet", docs, provenance)

    def open_datasets(self, path: str) -> tuple[xr.Dataset, xr.Dataset | None]:
        root = Path(path)
        docs = _dataset(root / "docs.parquet", "doc")
        docs = docs.set_coords("id")
        chunks_file = root / "chunks.parquet"
        chunks = _dataset(chunks_file, "chunk") if chunks_file.exists() else None
        return docs, chunks

    def open_tokens(self, path: str) -> xr.Dataset | None:
        folder = Path(path) / TOKENS_DIR
        if not folder.is_dir():
            return None
        return _parts_dataset(sorted(folder.glob("part-*.parquet")), "piece")

    def add_view(self, path: str, source: str, name: str, fn: Callable[[np.ndarray], np.ndarray],
                 levels: Sequence[str]) -> None:
        """Rewrite each level's file with column `name` = fn(`source`), row group by row group.

        `docs.parquet` is rewritten last by `update_provenance`, which also records the view.
        """
        for level in levels:
            file = Path(path) / f"{level}.parquet"
            _write(file, _with_column(file, source, name, fn), _metadata(file))

    def write_params(self, path: str, name: str, params: dict[str, np.ndarray]) -> None:
        folder = Path(path) / "post"
        folder.mkdir(exist_ok=True)
        tmp = folder / f".{name}.{uuid.uuid4().hex}.npz"
        np.savez(tmp, **params)  # type: ignore[arg-type]  # numpy stubs miss **kwargs arrays
        os.replace(tmp, folder / f"{name}.npz")

    def read_params(self, path: str, name: str) -> dict[str, np.ndarray]:
        with np.load(Path(path) / "post" / f"{name}.npz") as data:
            return {key: data[key] for key in data.files}

    def update_provenance(self, path: str, provenance: dict[str, Any]) -> None:
        file = Path(path) / "docs.parquet"
        pf = pq.ParquetFile(file)
        _write(file, (pf.read_row_group(g) for g in range(pf.num_row_groups)), provenance)
