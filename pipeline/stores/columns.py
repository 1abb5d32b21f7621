"""Carried columns and ids between Arrow and the stores: one type per column across all
parts, and missing values that read back as missing in both formats.

Parts from different input files may disagree on width (int32 in one file, int64 in
another, an all-null column typed `null`); `StoredColumns` promotes them to one schema
(the input scan has already refused columns whose kinds differ). Parquet keeps Arrow's
own nulls. Zarr has none, so a column with nulls is stored as:

    integers, booleans  float64, NaN for null (as pandas reads them)
    floats              NaN for null
    strings             "␀" (U+2400) for null, array attribute missing_value: "␀", which
                        xarray decodes to NaN; open_store gives None
    dates, timestamps   NaT

Columns without nulls keep their type. Both formats read back through `to_numpy`, so
`open_store` gives the same dtypes and missing markers for either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import StoreError
from ..io.location import Location, resolve

MISSING_STRING = "\u2400"  # ␀, SYMBOL FOR NULL
MISSING_ATTRIBUTE = "missing_value"  # the CF attribute xarray masks on


def has_nulls(meta: pq.FileMetaData, column: str) -> bool:
    """Whether a flat column holds a null, from the row-group statistics (True when the
    writer recorded none, to stay on the safe side)."""
    index = next((j for j in range(meta.num_columns) if meta.schema.column(j).path == column),
                 None)
    if index is None:
        return False
    for g in range(meta.num_row_groups):
        if meta.row_group(g).num_rows == 0:  # an empty part (no text): nothing to be null
            continue
        stats = meta.row_group(g).column(index).statistics
        if stats is None or not stats.has_null_count or stats.null_count:
            return True
    return False


def numpy_dtype(dtype: pa.DataType, nulls: bool) -> np.dtype:
    """The NumPy dtype a flat column reads as (see the module docstring)."""
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return np.dtype(object)
    if pa.types.is_null(dtype) or (nulls and (pa.types.is_integer(dtype)
                                              or pa.types.is_boolean(dtype))):
        return np.dtype(np.float64)
    if pa.types.is_date32(dtype):
        return np.dtype("datetime64[D]")
    if pa.types.is_date64(dtype):
        return np.dtype("datetime64[ms]")
    if pa.types.is_timestamp(dtype):
        return np.dtype(f"datetime64[{dtype.unit}]")
    return np.dtype(dtype.to_pandas_dtype())


def to_numpy(column: pa.Array | pa.ChunkedArray, nulls: bool) -> np.ndarray:
    """A flat column as NumPy: NaN/NaT/None for nulls, dtype `numpy_dtype(type, nulls)`."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    target = numpy_dtype(column.type, nulls)
    if target == np.float64 and not pa.types.is_floating(column.type):
        column = column.cast(pa.float64())  # integers, booleans or all-null with nulls
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype=target)


def strings_as_objects(block: np.ndarray, missing: str | None) -> np.ndarray:
    """Zarr strings (NumPy StringDType) as an object array, None where `missing` marks a
    null: the same representation the Parquet store reads as."""
    out = np.asarray(block, dtype=object)
    if missing is not None:
        out[block == missing] = None
    return out


def string_width(column: pa.Array | pa.ChunkedArray) -> int:
    """The longest value of a string column, in characters (0 when all are null)."""
    import pyarrow.compute as pc

    if pa.types.is_null(column.type):
        return 0
    return int(pc.max(pc.utf8_length(column)).as_py() or 0)


class StoredColumns:
    """The unified type of every column of a level, and which ones hold nulls."""

    def __init__(self, schema: pa.Schema, nulls: dict[str, bool]):
        self.schema = schema
        self.nulls = nulls

    @classmethod
    def from_parts(cls, files: Sequence[Path]) -> StoredColumns:
        """From the staged parts' footers only (no data read)."""
        return cls.from_metadata(pq.read_metadata(file) for file in files)

    @classmethod
    def from_metadata(cls, footers: Iterable[pq.FileMetaData]) -> StoredColumns:
        """From the footers of the staged parts."""
        schemas: list[pa.Schema] = []
        nulls: dict[str, bool] = {}
        for meta in footers:
            schema = meta.schema.to_arrow_schema()
            schemas.append(schema)
            for field in schema:
                if not pa.types.is_nested(field.type):
                    nulls[field.name] = nulls.get(field.name, False) or has_nulls(meta,
                                                                                   field.name)
        try:
            unified = pa.unify_schemas(schemas, promote_options="permissive") if schemas \
                else pa.schema([])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise StoreError(f"the partitions disagree on a column's type: {exc}") from None
        return cls(unified, nulls)

    def string_widths(self, files: Sequence[Path | Location]) -> dict[str, int]:
        """Longest value (in characters, at least 1) of each string column over all parts:
        Zarr stores strings at a fixed width, which NumPy, pandas and scikit-learn take as
        they come (Zarr's variable-length strings read as NumPy's StringDType, which
        scikit-learn refuses)."""
        names = [f.name for f in self.schema
                 if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
        widths = dict.fromkeys(names, len(MISSING_STRING))
        for file in files:
            source = resolve(file) if isinstance(file, Path) else file
            with source.open("rb") as f:
                parquet = pq.ParquetFile(f)
                present = [n for n in names if n in parquet.schema_arrow.names]
                if not present:
                    continue
                table = parquet.read(columns=present)
            for name in present:
                column = table.column(name)
                if pa.types.is_null(column.type):  # an all-null part: nothing to measure
                    continue
                widths[name] = max(widths[name], string_width(column))
        return widths

    def conform(self, table: pa.Table) -> pa.Table:
        """`table` with every column cast to its unified type."""
        columns = []
        for name, column in zip(table.column_names, table.columns, strict=True):
            target = self.schema.field(name).type
            columns.append(column if column.type == target else column.cast(target))
        return pa.Table.from_arrays(columns, names=table.column_names)

    def zarr_values(self, name: str, column: pa.ChunkedArray) -> np.ndarray:
        """A flat column as Zarr stores it: like `to_numpy`, strings with their nulls
        marked `MISSING_STRING` (a real value equal to the marker is refused)."""
        nulls = self.nulls.get(name, True)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            return to_numpy(column, nulls)
        values = to_numpy(column, nulls)
        if nulls:
            present = column.is_valid().to_numpy(zero_copy_only=False)
            if (values[present] == MISSING_STRING).any():
                raise StoreError(f"column {name!r}: a value is exactly {MISSING_STRING!r}, "
                                 "the marker this store uses for a missing string")
            values[~present] = MISSING_STRING
        return values

    def zarr_attributes(self, name: str) -> dict[str, Any]:
        """Attributes that tell readers how a column marks its nulls."""
        field = self.schema.field(name)
        if pa.types.is_string(field.type) and self.nulls.get(name, True):
            return {MISSING_ATTRIBUTE: MISSING_STRING}
        return {}


def vector_array(vectors: np.ndarray, dtype: str) -> pa.FixedSizeListArray:
    """(N, D) matrix as fixed_size_list<float, D>, zero-copy from the contiguous buffer."""
    flat = np.ascontiguousarray(vectors, dtype=np.dtype(dtype)).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), vectors.shape[1])
