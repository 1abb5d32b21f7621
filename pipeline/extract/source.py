"""Reading the input table in bounded partitions planned from Parquet metadata alone.

Files are taken in sorted order so that row numbers (and hence output order) are
defined; a partition is a contiguous row range inside one file, read through the row
groups that cover it. The input may be local or behind an fsspec URL (a prefix of
Parquet files on S3, GCS, Azure): planning reads only the footers (ranged reads, nothing
downloaded whole) and each worker reads the row groups of its own partitions.
"""

from __future__ import annotations

import glob
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import InputError, UnreadableInputError, first_line
from ..io.location import Location, is_url, normalize_url, resolve, storage_errors
from ..spec import InputSpec
from ..stores.provenance import InputFile

Options = dict[str, Any] | None  # input.storage_options


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


def counted(n: int, noun: str) -> str:
    """'1 file', '2 files': a count as the lines that report plans say it."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def list_files(path: str, options: Options = None) -> list[str]:
    """A file, a directory of *.parquet files, or a glob; always sorted. For a URL: an
    object, a prefix (every *.parquet below it) or a glob, as URLs."""
    if is_url(path):
        with storage_errors(path, "input.path", InputError):
            return _list_remote(path, options)
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


def _list_remote(path: str, options: Options) -> list[str]:
    loc = _input(path, options)
    if any(ch in path for ch in "*?["):
        files = sorted(normalize_url(loc.fs.unstrip_protocol(p))
                       for p in loc.fs.glob(loc.path) if loc.fs.isfile(p))
        kind = "match"
    else:
        info = loc.info()
        if info is None:
            raise InputError(f"input.path: {loc} does not exist")
        if info.get("type") == "file":
            return [loc.url]
        files = [loc.child(rel).url for rel in loc.files() if rel.endswith(".parquet")]
        kind = "are under"
    if not files:
        raise InputError(f"input.path: no Parquet files {kind} {path}")
    return files


def _input(path: str, options: Options) -> Location:
    return resolve(path, options, "input.storage_options")


@dataclass(frozen=True)
class ScannedFile:
    path: str
    rows: int
    schema: pa.Schema


@dataclass(frozen=True)
class InputScan:
    """What the Parquet footers say about the input: files, rows, and the type of the id
    and each carried column (the same kind in every file; widths are unified at commit)."""

    files: tuple[ScannedFile, ...]
    types: dict[str, pa.DataType]

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)


def scan_input(spec: InputSpec) -> InputScan:
    """Check the input from Parquet metadata alone (no data read): every file has the
    columns, the text is a string, ids and carried columns have supported types of one
    kind across files, and the footer statistics show no null id."""
    files = []
    first: dict[str, tuple[str, pa.DataType]] = {}  # column -> (file, type) seen first
    for file in list_files(spec.path, spec.storage_options):
        pf = _open(file, spec.storage_options)
        schema = pf.schema_arrow
        check_columns(spec, schema, file)
        for key, column in _typed_columns(spec):
            kind_type = plain_type(schema.field(column).type)
            _check_supported(key, column, kind_type, file)
            if column in first:
                _check_compatible(key, column, first[column], (file, kind_type),
                                  exact_kind=key == "input.id_column")
            elif not pa.types.is_null(kind_type):
                first[column] = (file, kind_type)
        if spec.id_column:
            _check_no_null_ids(pf, spec.id_column, file)
        files.append(ScannedFile(file, pf.metadata.num_rows, schema))
    types = {column: first[column][1] if column in first else pa.null()
             for _, column in _typed_columns(spec)}
    return InputScan(tuple(files), types)


SHOWN_REPEATS = 3  # repeated ids named in the message, and rows named for each


def check_unique_ids(spec: InputSpec, scan: InputScan, incremental: bool = False) -> None:
    """Every id names one row, unless the job says `input.unique_ids: false`: a store's
    lookups by id would otherwise take one of its rows silently. The id column alone is
    read, file by file, and kept as one 64-bit hash per row (8 bytes a row, whatever the
    ids); only rows whose hash repeats are read again, to name them exactly."""
    if not spec.id_column or not spec.unique_ids:
        return
    hashes = [id_hashes(_read_ids(spec, f.path)) for f in scan.files]
    every = np.concatenate(hashes) if hashes else np.empty(0, np.uint64)
    order = np.argsort(every, kind="stable")  # equal hashes end up side by side, rows ascending
    ranked = every[order]
    repeats = np.flatnonzero(ranked[1:] == ranked[:-1])
    if not len(repeats):
        return
    candidates = np.unique(order[np.union1d(repeats, repeats + 1)])  # rows, ascending
    found = _repeated_ids(spec, scan, candidates)
    if not found:
        return  # hashes that collided for different ids: nothing repeats
    shown = "; ".join(f"{value!r} on rows {', '.join(map(str, rows[:SHOWN_REPEATS]))}"
                      + (", ..." if len(rows) > SHOWN_REPEATS else "")
                      for value, rows in found[:SHOWN_REPEATS])
    more = f" (and {len(found) - SHOWN_REPEATS} more repeated ids)" \
        if len(found) > SHOWN_REPEATS else ""
    fix = ("an incremental run matches rows to the store by id" if incremental else
           "set input.unique_ids: false to allow repeats; lookups by a repeated id are then "
           "refused")
    raise InputError(f"input.id_column: ids in column {spec.id_column!r} of {spec.path} "
                     f"repeat: {shown}{more}; each id must name one row ({fix})")


def _read_ids(spec: InputSpec, file: str) -> pa.Array:
    """The id column of one file (nothing else read)."""
    assert spec.id_column is not None  # callers check
    pf = _open(file, spec.storage_options)
    try:
        with storage_errors(file, "input.path", InputError):
            column = pf.read(columns=[spec.id_column]).column(0)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"input.id_column: {file} cannot be read (column "
                         f"{spec.id_column!r}): {first_line(exc)}") from None
    return plain_array(column)


def id_hashes(ids: pa.Array) -> np.ndarray:
    """One uint64 per id; equal ids hash alike across files (integers of any width)."""
    from pandas.util import hash_array

    if pa.types.is_integer(ids.type):  # unsigned past 2**63: the same bits, wrapped
        values = ids.cast(pa.int64(), safe=False).to_numpy(zero_copy_only=False)
    else:
        values = np.asarray(ids.to_numpy(zero_copy_only=False), dtype=object)
    hashed = hash_array(values)
    nulls = ids.is_null().to_numpy(zero_copy_only=False)
    if nulls.any():  # a null is no id (refused where its partition is read): never a repeat
        hashed[nulls] = np.arange(nulls.sum(), dtype=np.uint64) ^ np.uint64(0x9E3779B97F4A7C15)
    return np.asarray(hashed, dtype=np.uint64)


def _repeated_ids(spec: InputSpec, scan: InputScan, rows: np.ndarray
                  ) -> list[tuple[Any, list[int]]]:
    """The ids at global `rows` (ascending) that name more than one of them, each with
    its rows, in the order of their first row."""
    values: list[Any] = []
    start = 0
    for f in scan.files:
        inside = rows[(rows >= start) & (rows < start + f.rows)] - start
        if len(inside):
            values += _read_ids(spec, f.path).take(pa.array(inside)).to_pylist()
        start += f.rows
    by_id: dict[Any, list[int]] = {}
    for row, value in zip(rows.tolist(), values, strict=True):
        if value is not None:
            by_id.setdefault(value, []).append(row)
    return [(value, found) for value, found in by_id.items() if len(found) > 1]


def plan_partitions(spec: InputSpec, partition_rows: int,
                    scan: InputScan | None = None) -> list[Partition]:
    """Partitions of at most `partition_rows` rows; checks columns and types first."""
    scan = scan or scan_input(spec)
    parts: list[Partition] = []
    row = 0
    for f in scan.files:
        footer = file_identity(f.path, spec.storage_options).footer_sha256
        for offset in range(0, f.rows, partition_rows):
            size = min(partition_rows, f.rows - offset)
            parts.append(Partition(len(parts), f.path, row + offset, row + offset + size, offset,
                                   footer))
        row += f.rows
    return parts


def input_identity(spec: InputSpec) -> tuple[InputFile, ...]:
    """What identifies the input, file by file, from the files' footers only."""
    return tuple(file_identity(file, spec.storage_options)
                 for file in list_files(spec.path, spec.storage_options))


def file_identity(file: str, options: Options = None) -> InputFile:
    """Path, size, rows and the SHA-256 of the Parquet footer (schema, row groups and their
    column statistics): a changed table changes it, and no data page is read (on an object
    store: ranged reads of the file's tail)."""
    size, footer_sha256 = _footer(file, options)
    return InputFile(path=file, size=size, rows=_open(file, options).metadata.num_rows,
                     footer_sha256=footer_sha256)


def _footer(file: str, options: Options = None) -> tuple[int, str]:
    """The file's size and the SHA-256 of its Parquet footer, read from its tail alone."""
    with storage_errors(file, "input.path", InputError), _binary(file, options) as f:
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
    return size, hashlib.sha256(footer).hexdigest()


def _binary(file: str, options: Options) -> BinaryIO:
    """The file for ranged reads: local, or remote with no read-ahead (each read is one
    ranged GET of exactly the bytes asked for)."""
    if is_url(file):
        return _input(file, options).open("rb")  # type: ignore[return-value]
    return open(file, "rb")


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
        if schema.names.count(column) > 1:
            raise InputError(f"{key}: {file} has {schema.names.count(column)} columns named "
                             f"{column!r}")
    text_type = plain_type(schema.field(spec.text_column).type)
    if not (pa.types.is_string(text_type) or pa.types.is_null(text_type)):
        raise InputError(f"input.text_column: column {spec.text_column!r} in {file} has type "
                         f"{schema.field(spec.text_column).type}, expected string")


def plain_type(dtype: pa.DataType) -> pa.DataType:
    """The type a column is read as: dictionaries decoded, every string flavour `string`."""
    if pa.types.is_dictionary(dtype):
        return plain_type(dtype.value_type)
    if pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype):
        return pa.string()
    return dtype


def carry_kind(dtype: pa.DataType) -> str | None:
    """The kind of a plain column type that can be carried and used as an id, else None."""
    checks = (("integer", pa.types.is_integer), ("float", pa.types.is_floating),
              ("bool", pa.types.is_boolean), ("string", pa.types.is_string),
              ("date", pa.types.is_date), ("null", pa.types.is_null))
    for kind, check in checks:
        if check(dtype):
            return kind
    if pa.types.is_timestamp(dtype) and dtype.tz is None:
        return "timestamp"
    return None


CARRY_KINDS = "integers, floats, booleans, strings, dates and timestamps without a time zone"


def _typed_columns(spec: InputSpec) -> list[tuple[str, str]]:
    keyed = [("input.id_column", spec.id_column)] if spec.id_column else []
    keyed += [("input.carry_columns", c) for c in spec.carry_columns if c != spec.id_column]
    return keyed


def _check_supported(key: str, column: str, dtype: pa.DataType, file: str) -> None:
    kind = carry_kind(dtype)
    if key == "input.id_column":
        if kind not in ("integer", "string", "null"):
            raise InputError(f"input.id_column: column {column!r} in {file} has type {dtype}; "
                             "ids must be integers or strings")
        if kind == "null":
            raise InputError(f"input.id_column: column {column!r} in {file} holds only nulls; "
                             "every row needs an id")
        return
    if kind is not None:
        return
    if pa.types.is_timestamp(dtype):
        hint = "store it in UTC without a time zone (cast to timestamp) or as a string"
    elif pa.types.is_nested(dtype):
        hint = "list, struct and map columns are not carried; flatten it or serialise it " \
               "to a string column"
    else:
        hint = "convert it to one of these first"
    raise InputError(f"{key}: column {column!r} in {file} has type {dtype}; carried columns "
                     f"may be {CARRY_KINDS}: {hint}")


def _check_compatible(key: str, column: str, first: tuple[str, pa.DataType],
                      this: tuple[str, pa.DataType], exact_kind: bool) -> None:
    """Columns of one name must have one kind in every file: they become one array."""
    (file_a, type_a), (file_b, type_b) = first, this
    kinds = {carry_kind(type_a), carry_kind(type_b)}
    if "null" in kinds and not exact_kind:
        return
    unsigned_64 = pa.uint64() in (type_a, type_b)
    signed = any(pa.types.is_signed_integer(t) for t in (type_a, type_b))
    same = len(kinds) == 1 and not (unsigned_64 and signed)
    if same and "timestamp" not in kinds and "date" not in kinds:
        return
    if same and type_a == type_b:
        return
    if not exact_kind and kinds == {"integer", "float"}:
        return  # carried numbers: integers and floats become float64
    raise InputError(f"{key}: column {column!r} is {type_a} in {file_a} but {type_b} in "
                     f"{file_b}; it must have one type in every file")


def _check_no_null_ids(pf: pq.ParquetFile, column: str, file: str) -> None:
    """Null ids from the row-group statistics, where the writer recorded them."""
    meta = pf.metadata
    index = next((j for j in range(meta.num_columns)
                  if meta.schema.column(j).path == column), None)
    if index is None:
        return
    start = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        stats = group.column(index).statistics
        if stats is not None and stats.has_null_count and stats.null_count:
            raise InputError(f"input.id_column: {stats.null_count} null ids in column "
                             f"{column!r} of {file} (row group {g}, rows {start}-"
                             f"{start + group.num_rows - 1}); every row needs an id")
        start += group.num_rows


@dataclass(frozen=True)
class _Decoded:
    """Row groups of one file decoded: the file's rows [first_row, first_row + rows)."""

    key: tuple[str, str, tuple[str, ...]]  # file, its footer's digest, the columns read
    first_row: int
    table: pa.Table

    def holds(self, key: tuple[str, str, tuple[str, ...]], offset: int, n_rows: int) -> bool:
        return key == self.key and self.first_row <= offset and \
            offset + n_rows <= self.first_row + self.table.num_rows


class RowGroupCache:
    """The row groups a partition read last, decoded, for the partitions after it.

    A row group is the smallest unit a Parquet reader decodes, and writers make them large
    (pyarrow and pandas put up to 1Mi rows in one): a partition of 256 rows inside a
    100,000-row group would decode all 100,000 rows, and every partition of that group
    again, so reading a table would grow with the square of its rows. Partitions
    are planned in file order and read in that order by each reader, so keeping the last
    row groups read makes each decoded about once per reader (twice where a partition
    spans two: it decodes both).

    One entry: the last one is dropped before the next is decoded, so memory holds at most
    the row groups one partition needs (what reading them took anyway). A reader's threads
    share it under a lock. An entry is the file as planned: a decode first checks the
    file's footer against the digest the partition was planned with (see `read_partition`)."""

    def __init__(self) -> None:
        self._last: _Decoded | None = None
        self._lock = threading.Lock()
        self.reads = 0  # decodes made (tests count them)

    def rows(self, key: tuple[str, str, tuple[str, ...]], offset: int, n_rows: int,
             decode: Callable[[], _Decoded]) -> pa.Table:
        """The file's rows [offset, offset + n_rows), from the last decode when it holds
        them, else from `decode()`."""
        with self._lock:
            if self._last is None or not self._last.holds(key, offset, n_rows):
                self._last = None  # freed before the next decode, not after it
                self._last = decode()
                self.reads += 1
            return self._last.table.slice(offset - self._last.first_row, n_rows)

    def clear(self) -> None:
        with self._lock:
            self._last = None

    @property
    def empty(self) -> bool:
        return self._last is None


def read_partition(spec: InputSpec, part: Partition,
                   cache: RowGroupCache | None = None) -> PartitionRows:
    """Rows [row_start, row_stop) of the table, reading only the row groups that hold them
    (decoded once for the partitions that share them when a `cache` is given). A file
    whose footer is no longer the one the partition was planned with (rewritten since) is
    refused: its rows may have moved."""
    columns = tuple(dict.fromkeys(
        [spec.text_column, *([spec.id_column] if spec.id_column else []), *spec.carry_columns]))
    key = (part.file, part.footer_sha256, columns)

    def decode() -> _Decoded:
        pf = _open(part.file, spec.storage_options)
        if part.footer_sha256 and _footer(part.file, spec.storage_options)[1] != \
                part.footer_sha256:
            raise UnreadableInputError(f"input.path: {part.file} changed after the run was "
                                       "planned (its Parquet footer differs): its rows may "
                                       "have moved, so it is not read; rerun once nothing "
                                       "writes it")
        groups, first_row = _row_groups_covering(pf.metadata, part.file_offset, part.n_rows)
        try:
            with storage_errors(part.file, "input.path", InputError):
                table = pf.read_row_groups(groups, columns=list(columns))
        except (OSError, pa.ArrowException) as exc:
            last = part.file_offset + part.n_rows - 1
            raise UnreadableInputError(f"input.path: {part.file} cannot be read at rows "
                                       f"{part.file_offset}-{last} (row groups {groups[0]}-"
                                       f"{groups[-1]}): {first_line(exc)}") from None
        return _Decoded(key, first_row, table)

    if cache is None or not part.footer_sha256:  # nothing kept: a file unknown as planned
        cache = RowGroupCache()
    table = cache.rows(key, part.file_offset, part.n_rows, decode)
    if spec.id_column:
        ids = plain_array(table.column(spec.id_column))
        if ids.null_count:
            bad = part.row_start + int(np.flatnonzero(ids.is_null().to_numpy(False))[0])
            raise InputError(f"input.id_column: null id in column {spec.id_column!r} at row {bad}")
    else:
        ids = pa.array(np.arange(part.row_start, part.row_stop, dtype=np.int64))
    return PartitionRows(
        ids=ids,
        texts=table.column(spec.text_column).to_pylist(),
        carry={c: plain_array(table.column(c)) for c in spec.carry_columns},
    )


def plain_array(column: pa.ChunkedArray) -> pa.Array:
    """One array of the column's `plain_type` (dictionaries decoded, strings `string`)."""
    array = column.combine_chunks()
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    target = plain_type(array.type)
    return array if array.type == target else array.cast(target)


def read_text(spec: InputSpec, row: int) -> str:
    """The text of one global row (for showing chunks next to their source)."""
    start = 0
    for file in list_files(spec.path, spec.storage_options):
        n = _open(file, spec.storage_options).metadata.num_rows
        if row < start + n:
            part = Partition(-1, file, row, row + 1, row - start)
            return read_partition(spec, part).texts[0] or ""
        start += n
    raise InputError(f"row {row} is beyond the end of {spec.path}")


def find_row(spec: InputSpec, key: Any) -> int:
    """The global row of the input whose id is `key` (the id column, file by file)."""
    if not spec.id_column:
        raise InputError("input.id_column: the job has none, so rows cannot be found by id")
    start = 0
    for file in list_files(spec.path, spec.storage_options):
        ids = plain_array(_open(file, spec.storage_options).read(columns=[spec.id_column])
                          .column(0))
        try:
            at = pc.index(ids, pa.scalar(key, ids.type)).as_py()
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
            at = -1  # an id of another type is in no row
        if at >= 0:
            return start + int(at)
        start += len(ids)
    raise InputError(f"input.id_column: id {key!r} is not in {spec.path} any more")


def _row_groups_covering(meta: Any, offset: int, n_rows: int) -> tuple[list[int], int]:
    groups, first_row, start = [], None, 0
    for g in range(meta.num_row_groups):
        size = meta.row_group(g).num_rows
        if start + size > offset and start < offset + n_rows:
            groups.append(g)
            first_row = start if first_row is None else first_row
        start += size
    return groups, first_row or 0


def _open(file: str, options: Options = None) -> pq.ParquetFile:
    """A Parquet file, its footer read; on an object store through ranged reads only."""
    try:
        with storage_errors(file, "input.path", InputError):
            return pq.ParquetFile(_binary(file, options) if is_url(file) else file)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"input.path: {file} is not a readable Parquet file "
                         f"({first_line(exc)})") from None


def open_input(file: str, options: Options = None) -> pq.ParquetFile:
    """An input file (local or remote) as a ParquetFile; InputError when unreadable."""
    return _open(file, options)

