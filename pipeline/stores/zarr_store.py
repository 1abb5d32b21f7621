"""Zarr v3 store: `ids`, `docs/*`, `chunks/*` arrays and the `bertpipe` root attribute.

The commit is the only writer of the final arrays and walks the parts in row order, so
no two writers ever share a chunk; `complete: true` is written after every array and
metadata is consolidated last.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
import pyarrow as pa
import xarray as xr
import zarr
import zarr.codecs

from .base import Layout, column_matrix
from .staging import Staging

ROWS_PER_CHUNK = 8192
COMPRESSOR = zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle")


def create(path: str, provenance: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.open_group(path, mode="a", attributes={"bertpipe": provenance})


def is_store(path: str) -> bool:
    return (Path(path) / "zarr.json").exists()


def read_provenance(path: str) -> dict[str, Any] | None:
    try:
        group = zarr.open_group(path, mode="r")
    except (FileNotFoundError, ValueError, zarr.errors.GroupNotFoundError):
        return None
    prov = group.attrs.get("bertpipe")
    return dict(prov) if isinstance(prov, dict) else None


def commit(path: str, staging: Staging, layout: Layout, provenance: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # string arrays: zarr warns the vlen spec is young
        root = zarr.open_group(path, mode="a")
        _write_level(root, "docs", staging.read_parts("docs", layout.indices), layout.n_docs)
        if layout.has_chunks:
            _write_level(root, "chunks", staging.read_parts("chunks", layout.indices),
                         layout.n_chunks)
        root.update_attributes({"bertpipe": provenance})
        zarr.consolidate_metadata(path)


def _write_level(root: zarr.Group, level: str, parts: Iterator[pa.Table], n: int) -> None:
    dim = "doc" if level == "docs" else "chunk"
    group = root.require_group(level)
    arrays: dict[str, zarr.Array] = {}
    offset = 0
    for table in parts:
        for name in table.column_names:
            if name == "row":
                continue
            values = _numpy(table.column(name))
            if name not in arrays:
                target = root if name == "id" else group
                arrays[name] = _create(target, "ids" if name == "id" else name, values, n, dim)
            arrays[name][offset : offset + table.num_rows] = values
        offset += table.num_rows


def _create(group: zarr.Group, name: str, sample: np.ndarray, n: int, dim: str) -> zarr.Array:
    shape = (n, *sample.shape[1:])
    dims = (dim,) if sample.ndim == 1 else (dim, f"{name}_dim")
    dtype: Any = str if sample.dtype.kind in "OUT" else sample.dtype
    return group.create_array(
        name, shape=shape, dtype=dtype, chunks=(min(ROWS_PER_CHUNK, max(n, 1)), *shape[1:]),
        compressors=None if dtype is str else COMPRESSOR, dimension_names=dims, overwrite=True,
    )


def _numpy(column: pa.ChunkedArray) -> np.ndarray:
    if pa.types.is_fixed_size_list(column.type):
        return column_matrix(column)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return np.array(column.fill_null("").to_pylist(), dtype=str)
    return column.to_numpy()


def open_datasets(path: str) -> tuple[xr.Dataset, xr.Dataset | None]:
    root = zarr.open_group(path, mode="r")
    ids = root["ids"]
    docs = _dataset(root["docs"], coords={"id": ("doc", da.from_zarr(ids))})
    chunks = _dataset(root["chunks"], {}) if "chunks" in root else None
    return docs, chunks


def _dataset(group: Any, coords: dict[str, Any]) -> xr.Dataset:
    variables = {}
    for name, array in group.arrays():
        dims = tuple(array.metadata.dimension_names)
        variables[name] = (dims, da.from_zarr(array))
    return xr.Dataset(variables, coords=coords)

