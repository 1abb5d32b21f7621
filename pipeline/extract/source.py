"""Reading the input table in bounded partitions planned from Parquet metadata alone.

Files are taken in sorted order so that row numbers (and hence output order) are
defined; a partition is a contiguous row range inside one file, read through the row
groups that cover it.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InputError
from ..spec import InputSpec
from ..stores.provenance import InputFile


@dataclass(frozen=True)
class Partition:
    index: int
    file: str
    row_start: int  # global row number of the first row
    row_stop: int
    file_offset: int  # row number inside `file` of the first row
    footer_sha256: str = ""  # identity of `file` when planned (see `file_identity`)

    @property
    def n_rows(self) -> int:
        return self.row_stop - self.row_start


@dataclass
class PartitionRows:
    ids: pa.Array  # (N,)
    texts: list[str | None]  # (N,)
    carry: dict[str, pa.Array]  # column -> (N,)


def list_files(path: str) -> list[str]:
    """A file, a directory of *.parquet files, or a glob; always sorted."""
    if os.path.isdir(path):
        files = sorted(str(p) for p in Path(path).rglob("*.parquet") if p.is_file())
    elif any(ch in path for ch in "*?["):
        files = sorted(glob.glob(path, recursive=True))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise InputError(f"input.path: {path} does not exist")
    if not files:
        raise InputError(f"input.path: no Parquet files match {path}")
    return files


def plan_partitions(spec: InputSpec, partition_rows: int) -> list[Partition]:
    """Partitions of at most `partition_rows` rows; checks columns and types first."""
    parts: list[Partition] = []
    row = 0
    for file in list_files(spec.path):
        meta = _open(file)
        check_columns(spec, meta.schema_arrow, file)
        footer = file_identity(file).footer_sha256
        n = meta.metadata.num_rows
        for offset in range(0, n, partition_rows):
            size = min(partition_rows, n - offset)
            parts.append(Partition(len(parts), file, row + offset, row + offset + size, offset,
                                   footer))
        row += n
    return parts


def input_identity(spec: InputSpec) -> tuple[InputFile, ...]:
    """What identifies the input, file by file, from the files' footers only."""
    return tuple(file_identity(file) for file in list_files(spec.path))


def file_identity(file: str) -> InputFile:
    """Path, size, rows and the SHA-256 of the Parquet footer (schema, row groups and their
    column statistics): a changed table changes it, and no data page is read."""
    with open(file, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < 12:
            raise InputError(f"input.path: {file} is not a readable Parquet file (too short)")
        f.seek(size - 8)
        tail = f.read(8)
        length = int.from_bytes(tail[:4], "little")
        if tail[4:] not in (b"PAR1", b"PARE") or length > size - 12:
            raise InputError(f"input.path: {file} is not a readable Parquet file (no footer)")
        f.seek(size - 8 - length)
        footer = f.read(length)
    return InputFile(path=file, size=size, rows=_open(file).metadata.num_rows,
                     footer_sha256=hashlib.sha256(footer).hexdigest())


def check_columns(spec: InputSpec, schema: pa.Schema, file: str) -> None:
    wanted = [("input.text_column", spec.text_column)]
    if spec.id_column:
        wanted.append(("input.id_column", spec.id_column))
    wanted += [("input.carry_columns", c) for c in spec.carry_columns]
    names = set(schema.names)
    for key, column in wanted:
        if column not in names:
            raise InputError(f"{key}: column {column!r} not in {file} "
                             f"(columns: {', '.join(schema.names)})")
    text_type = schema.field(spec.text_column).type
    if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)
            or pa.types.is_string_view(text_type)):
        raise InputError(f"input.text_column: column {spec.text_column!r} in {file} has type "
                         f"{text_type}, expected string")


def read_partition(spec: InputSpec, part: Partition) -> PartitionRows:
    """Rows [row_start, row_stop) of the table, reading only the row groups that hold them."""
    pf = _open(part.file)
    columns = list(dict.fromkeys(
        [spec.text_column, *([spec.id_column] if spec.id_column else []), *spec.carry_columns]))
    groups, first_row = _row_groups_covering(pf.metadata, part.file_offset, part.n_rows)
    table = pf.read_row_groups(groups, columns=columns)
    table = table.slice(part.file_offset - first_row, part.n_rows)
    if spec.id_column:
        ids = table.column(spec.id_column).combine_chunks()
        if ids.null_count:
            bad = part.row_start + int(np.flatnonzero(ids.is_null().to_numpy(False))[0])
            raise InputError(f"input.id_column: null id in column {spec.id_column!r} at row {bad}")
    else:
        ids = pa.array(np.arange(part.row_start, part.row_stop, dtype=np.int64))
    return PartitionRows(
        ids=ids,
        texts=table.column(spec.text_column).to_pylist(),
        carry={c: table.column(c).combine_chunks() for c in spec.carry_columns},
    )


def read_text(spec: InputSpec, row: int) -> str:
    """The text of one global row (for showing chunks next to their source)."""
    start = 0
    for file in list_files(spec.path):
        n = _open(file).metadata.num_rows
        if row < start + n:
            part = Partition(-1, file, row, row + 1, row - start)
            return read_partition(spec, part).texts[0] or ""
        start += n
    raise InputError(f"row {row} is beyond the end of {spec.path}")


def _row_groups_covering(meta: Any, offset: int, n_rows: int) -> tuple[list[int], int]:
    groups, first_row, start = [], None, 0
    for g in range(meta.num_row_groups):
        size = meta.row_group(g).num_rows
        if start + size > offset and start < offset + n_rows:
            groups.append(g)
            first_row = start if first_row is None else first_row
        start += size
    return groups, first_row or 0


def _open(file: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(file)
    except (OSError, pa.ArrowInvalid) as exc:
        raise InputError(f"input.path: {file} is not a readable Parquet file ({exc})") from None
