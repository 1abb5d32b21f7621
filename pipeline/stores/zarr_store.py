"""Zarr v3 store: `ids`, `docs/*`, `chunks/*`, `tokens/*` arrays and the `bertpipe` root
attribute.

The commit is the only writer of the final arrays and walks the parts in row order, so
no two writers ever share a chunk; `complete: true` is written after every array and
metadata is consolidated last.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
import pyarrow as pa
import xarray as xr
import zarr
import zarr.codecs

from .base import Layout, column_matrix, with_store_token_offsets
from .columns import MISSING_ATTRIBUTE, StoredColumns, strings_as_objects
from .staging import Staging

ROWS_PER_CHUNK = 8192
# The tokens level's dimension is `piece`, not `token`: xarray makes a 1-D array named
# like its dimension (here the word piece strings) an index, read whole on open.
LEVEL_DIMS = {"docs": "doc", "chunks": "chunk", "tokens": "piece"}
# the tokens level's fields that Zarr does not repeat: a token's document id is ids[doc]
TOKEN_FIELDS_NOT_STORED = ["id"]
# Writers open with use_consolidated=False: the consolidated metadata is rewritten once, last,
# and a writer must see the groups added since.
COMPRESSOR = zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle")


def _write_level(root: zarr.Group, level: str, parts: Iterator[pa.Table], n: int,
                 columns: StoredColumns) -> None:
    dim = LEVEL_DIMS[level]
    group = root.require_group(level)
    arrays: dict[str, zarr.Array] = {}
    offset = 0
    for table in parts:
        table = columns.conform(table)
        for name in table.column_names:
            if name == "row":
                continue
            values = _numpy(columns, name, table.column(name))
            if name not in arrays:
                target = root if name == "id" else group
                arrays[name] = _create(target, "ids" if name == "id" else name, values, n, dim)
                if attributes := columns.zarr_attributes(name):
                    arrays[name].update_attributes(attributes)
            arrays[name][offset : offset + table.num_rows] = values
        offset += table.num_rows


def _write_tokens(root: zarr.Group, staging: Staging, layout: Layout) -> None:
    """The tokens level: one row per stored token, in row then position order."""
    files = [staging.part_path(i, "tokens") for i in layout.indices]
    columns = StoredColumns.from_parts(files)
    parts = (t.drop_columns(TOKEN_FIELDS_NOT_STORED)
             for t in staging.read_parts("tokens", layout.indices))
    _write_level(root, "tokens", parts, layout.n_tokens, columns)


def _create(group: zarr.Group, name: str, sample: np.ndarray, n: int, dim: str) -> zarr.Array:
    shape = (n, *sample.shape[1:])
    dims = (dim,) if sample.ndim == 1 else (dim, f"{name}_dim")
    dtype: Any = str if sample.dtype.kind in "OUT" else sample.dtype
    return group.create_array(
        name, shape=shape, dtype=dtype, chunks=(min(ROWS_PER_CHUNK, max(n, 1)), *shape[1:]),
        compressors=None if dtype is str else COMPRESSOR, dimension_names=dims, overwrite=True,
    )


def _numpy(columns: StoredColumns, name: str, column: pa.ChunkedArray) -> np.ndarray:
    if pa.types.is_fixed_size_list(column.type):
        return column_matrix(column)
    return columns.zarr_values(name, column)


def _dataset(group: Any, coords: dict[str, Any]) -> xr.Dataset:
    variables = {}
    for name, array in group.arrays():
        dims = tuple(array.metadata.dimension_names)
        variables[name] = (dims, _lazy(array))
    return xr.Dataset(variables, coords=coords)


def _lazy(array: Any) -> da.Array:
    """A Zarr array as dask; strings as objects with None for nulls (as Parquet reads)."""
    data = da.from_zarr(array)
    if data.dtype.kind not in "OTU":
        return data
    missing = array.attrs.get(MISSING_ATTRIBUTE)
    return data.map_blocks(strings_as_objects, missing=missing, dtype=object)


class ZarrFormat:
    """The Zarr v3 store format (see the module docstring for its layout)."""

    name = "zarr"

    def create(self, path: str, provenance: dict[str, Any]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zarr.open_group(path, mode="a", attributes={"bertpipe": provenance})

    def is_store(self, path: str) -> bool:
        return (Path(path) / "zarr.json").exists()

    def read_provenance(self, path: str) -> dict[str, Any] | None:
        try:
            group = zarr.open_group(path, mode="r")
        except (FileNotFoundError, ValueError, zarr.errors.GroupNotFoundError):
            return None
        prov = group.attrs.get("bertpipe")
        return dict(prov) if isinstance(prov, dict) else None

    def commit(self, path: str, staging: Staging, layout: Layout,
               provenance: dict[str, Any]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # string arrays: zarr warns the vlen spec is young
            root = zarr.open_group(path, mode="a", use_consolidated=False)
            for level, n in (("docs", layout.n_docs), ("chunks", layout.n_chunks)):
                if level == "chunks" and not layout.has_chunks:
                    continue
                columns = StoredColumns.from_parts(
                    [staging.part_path(i, level) for i in layout.indices])
                parts = staging.read_parts(level, layout.indices)
                if level == "docs":
                    parts = with_store_token_offsets(parts)
                _write_level(root, level, parts, n, columns)
            if layout.has_tokens:
                _write_tokens(root, staging, layout)
        self.update_provenance(path, provenance)

    def open_datasets(self, path: str) -> tuple[xr.Dataset, xr.Dataset | None]:
        root = zarr.open_group(path, mode="r")
        ids = root["ids"]
        docs = _dataset(root["docs"], coords={"id": ("doc", _lazy(ids))})
        # views being written by postprocess live under a temporary dot-name until done
        docs = docs.drop_vars([v for v in docs.data_vars if str(v).startswith(".")])
        chunks = _dataset(root["chunks"], {}) if "chunks" in root else None
        return docs, chunks

    def open_tokens(self, path: str) -> xr.Dataset | None:
        root = zarr.open_group(path, mode="r")
        return _dataset(root["tokens"], {}) if "tokens" in root else None

    def add_view(self, path: str, source: str, name: str, fn: Callable[[np.ndarray], np.ndarray],
                 levels: Sequence[str]) -> None:
        """Write `name` = fn(`source`) block by block at each level, beside the source.

        Written under a temporary name and moved into place, so replacing a view in place
        never reads and writes the same array; the caller updates the provenance last.
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root: Any = zarr.open_group(path, mode="a", use_consolidated=False)
            for level in levels:
                group = root[level]
                src = group[source]
                n = src.shape[0]
                tmp_name = f".{name}.tmp"
                out: Any = None
                for start in range(0, n, ROWS_PER_CHUNK):
                    block = fn(np.asarray(src[start : start + ROWS_PER_CHUNK], dtype=np.float64))
                    block = block.astype(src.dtype)
                    if out is None:
                        out = group.create_array(
                            tmp_name, shape=(n, block.shape[1]), dtype=src.dtype,
                            chunks=(min(ROWS_PER_CHUNK, max(n, 1)), block.shape[1]),
                            compressors=COMPRESSOR,
                            dimension_names=(src.metadata.dimension_names[0], f"{name}_dim"),
                            overwrite=True)
                    out[start : start + len(block)] = block
                level_dir = Path(path) / level
                shutil.rmtree(level_dir / name, ignore_errors=True)
                os.replace(level_dir / tmp_name, level_dir / name)

    def write_params(self, path: str, name: str, params: dict[str, np.ndarray]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root: Any = zarr.open_group(path, mode="a", use_consolidated=False)
            group = root.require_group("post").require_group(name)
            for key, value in params.items():
                dims = tuple(f"{name}_{key}_{i}" for i in range(value.ndim))
                group.create_array(key, shape=value.shape, dtype=value.dtype, overwrite=True,
                                   dimension_names=dims)[...] = value

    def read_params(self, path: str, name: str) -> dict[str, np.ndarray]:
        root: Any = zarr.open_group(path, mode="r")
        group = root["post"][name]
        return {key: np.asarray(array[...]) for key, array in group.arrays()}

    def update_provenance(self, path: str, provenance: dict[str, Any]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root = zarr.open_group(path, mode="a", use_consolidated=False)
            root.update_attributes({"bertpipe": provenance})
            zarr.consolidate_metadata(path)
