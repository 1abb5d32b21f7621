"""Delta store: one Delta Lake table per level, versioned by Delta's own log.

    <store>/docs/     a Delta table (`_delta_log/` and Parquet data files): one row per
                      input row; the commits that make a version carry the provenance
    <store>/chunks/   a Delta table: one row per chunk (when the job stores chunks)
    <store>/tokens/   a Delta table: one row per stored token (token views)
    <store>/post/     fitted parameters of post-processed views (`<view>.npz`)
    <store>/_bertpipe/  the staging area (and the lock file beside it)

Provenance and history live in Delta commit metadata, one source of truth that
`DeltaTable("<store>/docs").history()` shows: each commit bertpipe makes carries
`bertpipe_version`, and the commit that completes a version also carries
`bertpipe_complete: true`, the provenance (`bertpipe`, JSON) and the Delta versions of the
other tables that version is made of (`bertpipe_tables`). A reader opens the newest
complete commit of the docs table and those table versions, so a version is exactly what
was completed, whatever was committed after it.

Row order: a Delta table is a set of files, so a plain reader gets the rows in no set
order. Every table carries its order: docs `row` (a row's place in the store; rows
removed by `--prune` leave gaps), chunks and tokens `doc` (the docs `row` of their
document) with `seq` or `position`. bertpipe writes each data file sorted and over a range
of its own, and sorts on read.

Vectors are `list<float>` columns (Delta has no fixed-size list and no float16), their
width and dtype in the field metadata (`bertpipe.width`, `bertpipe.dtype`): a float16
store is kept as float32 values (exactly, float16 is a subset) and read back as float16.

An update (a new version) appends its new rows as new files and rewrites only the files
whose rows changed or were removed (each file is compared with its new rows; an equal one
is kept), then commits the chunks table and, last, the docs table in one commit that
completes the version. Earlier versions stay readable (`open_store(path, version=k)`, Delta
time travel) until `bertpipe gc` vacuums what only they use.

Each add action carries the per-file statistics of the Delta protocol for every column but
the vectors (`file_stats`), so readers that skip files by statistics skip only files that
cannot match.

Delta records no checksum of its data files: a complete version's provenance holds the
checksum of each of its files (the column data before the footer, as in the Parquet
format), which `bertpipe verify` checks.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xarray as xr
from deltalake import CommitProperties, DeltaTable, Schema
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import AddAction, RemoveAction, create_table_with_add_actions

from ..errors import StoreError
from ..io.location import Location, S3Access, resolve
from .base import (
    ForeignCommit,
    StagedLevel,
    StreamedVersion,
    column_matrix,
    describe_foreign,
)
from .parquet_store import (
    DTYPE_KEY,
    READ_ERRORS,
    WIDTH_KEY,
    ParquetFormat,
    PartsColumn,
    dataset_of,
    parts_columns,
)
from .parquet_store import _write as write_parquet
from .provenance import FileSum, is_complete, version_of

# Rows of a level per data file. A file is the unit an update rewrites: a changed row
# costs its whole file, so with changes at random rows a share f of rows changed rewrites
# about 1 - exp(-f * rows) of the files (as the Icechunk format's chunks); 1,024 rows of a
# 384-wide float32 view are 1.5 MB before compression, a sensible object-store request.
DELTA_ROWS_PER_FILE = 1024
LEVEL_ORDER = {"docs": ("row",), "chunks": ("doc", "seq"), "tokens": ("doc", "position")}
LEVEL_DIMS = {"docs": "doc", "chunks": "chunk", "tokens": "piece"}
LOG_DIR = "_delta_log"
RECORD_KEY = "bertpipe"  # commit metadata: the provenance (JSON text)
VERSION_KEY = "bertpipe_version"
COMPLETE_KEY = "bertpipe_complete"
TABLES_KEY = "bertpipe_tables"  # on the docs commit: the Delta version of each other table
OLDEST_KEY = "bertpipe_oldest_kept"  # on a gc's commit: versions before it are gone
DESCRIPTION = "bertpipe store: one row per input row (provenance in the commit metadata)"
# Every open of a table replays its log from the last checkpoint: a checkpoint every 10
# commits (delta-rs writes one only every 100 by default) keeps a nightly store's opens from
# reading more each night. The log itself is never expired by age: a version stays readable
# until `bertpipe gc` expires it.
TABLE_CONFIGURATION = {"delta.checkpointInterval": "10",
                       "delta.enableExpiredLogCleanup": "false"}


@dataclass(frozen=True)
class DeltaVersion:
    """One store version readers can open: the docs commit that completed it."""

    version: int
    tables: dict[str, int]  # level -> its Delta table version
    written_at: datetime


@dataclass
class _DataFile:
    """A data file of a table as its log lists it (path relative to the table)."""

    path: str
    rows: int
    first: int | None  # the smallest value of the level's first order column


@dataclass
class _Pending:
    """A level's commit-to-be: files to add and to remove (all, when `replace`)."""

    adds: list[AddAction] = field(default_factory=list)
    removes: list[_DataFile] = field(default_factory=list)
    replace: bool = False
    schema: pa.Schema | None = None

    @property
    def empty(self) -> bool:
        return not (self.adds or self.removes or self.replace)


def storage_options_of(store: Location) -> dict[str, str] | None:
    """What deltalake needs to reach the store: nothing locally; for s3:// the endpoint and
    credentials as s3fs finds them (the storage options, else the AWS variables)."""
    if store.local:
        return None
    DeltaFormat.check_location(store)
    s3 = S3Access.of(store)
    found = {
        "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_ACCESS_KEY_ID": s3.key,
        "AWS_SECRET_ACCESS_KEY": s3.secret,
        "AWS_SESSION_TOKEN": s3.token,
        "AWS_REGION": s3.region,
        "AWS_ALLOW_HTTP": "true" if s3.plain_http else None,
        # why: S3 has no atomic rename-if-absent for the log; bertpipe's lease lock lets one
        # writer commit at a time (stores/lock.py), which is what a locking provider gives
        "AWS_S3_ALLOW_UNSAFE_RENAME": "true",
    }
    return {key: str(value) for key, value in found.items() if value}


def delta_form(table: pa.Table) -> pa.Table:
    """A level's table as Delta stores it: each vector (fixed_size_list<float16|float32>)
    a list<float32> whose field metadata holds its width and dtype; an all-null column
    (type null, no Delta type) a string column."""
    fields, columns = [], []
    for f, column in zip(table.schema, table.columns, strict=True):
        if pa.types.is_fixed_size_list(f.type):
            dtype = np.dtype(f.type.value_type.to_pandas_dtype())
            flat = pc.list_flatten(column).cast(pa.float32())
            offsets = pa.array(np.arange(len(column) + 1, dtype=np.int32) * f.type.list_size)
            column = pa.ListArray.from_arrays(offsets, flat.combine_chunks()
                                              if isinstance(flat, pa.ChunkedArray) else flat)
            f = pa.field(f.name, pa.list_(pa.float32()), metadata={
                WIDTH_KEY: str(f.type.list_size).encode(), DTYPE_KEY: dtype.name.encode()})
        elif pa.types.is_null(f.type):
            column, f = column.cast(pa.string()), pa.field(f.name, pa.string())
        fields.append(f)
        columns.append(column)
    return pa.table(columns, schema=pa.schema(fields))


def file_stats(table: pa.Table) -> dict[str, Any]:
    """A data file's statistics as its add action carries them (the Delta protocol's
    per-file statistics): numRecords, and for every column but the vectors its nullCount,
    minValues and maxValues.

    Why every column: deltalake (1.6) builds each file's pruning expression from the
    columns the table indexes (the first 32), and a bound missing from the statistics
    becomes `column >= null`, which no row satisfies: a filter on that column through its
    Arrow dataset or `to_pandas(filters=...)` skipped every file. Vectors (lists) and
    binary columns are not indexed (no bounds), as in deltalake's own writer."""
    low: dict[str, Any] = {}
    high: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for f, column in zip(table.schema, table.columns, strict=True):
        if pa.types.is_nested(f.type):
            continue
        nulls[f.name] = column.null_count
        bounds = _bounds(column, f.type)
        if bounds is not None:
            low[f.name], high[f.name] = bounds
    return {"numRecords": table.num_rows, "minValues": low, "maxValues": high,
            "nullCount": nulls}


def stats_json(stats: dict[str, Any]) -> str:
    """Statistics as JSON, with the numbers Python's json module cannot write: an infinite
    bound as 1e999 (a JSON number that parsers, deltalake's among them, read as infinity;
    json writes `Infinity`, which is not JSON), a decimal as its exact digits."""
    if isinstance(stats, dict):
        return "{" + ",".join(f"{json.dumps(key)}:{stats_json(value)}"
                              for key, value in stats.items()) + "}"
    if isinstance(stats, float) and math.isinf(stats):
        return "1e999" if stats > 0 else "-1e999"
    if isinstance(stats, Decimal):
        return str(stats)  # "1.50", "-3.25", "1E+5": JSON numbers
    return json.dumps(stats)


def _bounds(column: pa.ChunkedArray, type_: pa.DataType) -> tuple[Any, Any] | None:
    """A column's smallest and largest value as Delta's statistics write them; None for no
    value, or for a type Delta keeps no bounds of (binary)."""
    if pa.types.is_dictionary(type_):  # Delta stores the values, not the dictionary
        return _bounds(column.cast(type_.value_type), type_.value_type)
    if pa.types.is_timestamp(type_):
        return _time_bounds(column, type_)
    if not (pa.types.is_integer(type_) or pa.types.is_floating(type_)
            or pa.types.is_boolean(type_) or pa.types.is_string(type_)
            or pa.types.is_large_string(type_) or pa.types.is_date(type_)
            or pa.types.is_decimal(type_)):
        return None
    if pa.types.is_float16(type_):  # no min_max kernel for half floats; exact in float32
        column = column.cast(pa.float32())
    found = pc.min_max(column).as_py()  # NaN is left out, as Parquet's statistics leave it
    low, high = found["min"], found["max"]
    if low is None or high is None:
        return None
    if isinstance(low, float) and math.isnan(low):  # every value NaN: no bound excludes it
        return -math.inf, math.inf
    if pa.types.is_date(type_):
        return low.isoformat(), high.isoformat()
    return low, high


def _time_bounds(column: pa.ChunkedArray, type_: pa.TimestampType) -> tuple[str, str] | None:
    """Timestamp bounds in milliseconds, the precision Delta's statistics keep: the minimum
    rounded down and the maximum up, so that no row falls outside its file's bounds."""
    found = pc.min_max(column.cast(pa.int64())).as_py()
    if found["min"] is None:
        return None
    per_ms = {"s": 0.001, "ms": 1, "us": 1000, "ns": 1_000_000}[type_.unit]
    if per_ms < 1:
        low_ms, high_ms = found["min"] * 1000, found["max"] * 1000
    else:
        low_ms, high_ms = found["min"] // int(per_ms), -(-found["max"] // int(per_ms))
    zone = "Z" if type_.tz is not None else ""  # timestamp (UTC) or timestamp_ntz
    return _iso_ms(low_ms, zone), _iso_ms(high_ms, zone)


def _iso_ms(ms: int, zone: str) -> str:
    at = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)
    return f"{at:%Y-%m-%dT%H:%M:%S}.{at.microsecond // 1000:03d}{zone}"


def sorted_by_order(table: pa.Table, level: str) -> pa.Table:
    return table.sort_by([(name, "ascending") for name in LEVEL_ORDER[level]])


def _cuts(keys: np.ndarray, rows: int) -> Iterator[tuple[int, int]]:
    """Slices of about `rows` rows of a table sorted by `keys`, never splitting equal keys
    (a document's chunks stay in one file)."""
    start, n = 0, len(keys)
    while start < n:
        end = min(start + rows, n)
        if end < n:
            end = int(np.searchsorted(keys, keys[end - 1], side="right"))
        yield start, end
        start = end


class DeltaFormat(ParquetFormat):
    """The Delta store format (see the module docstring). Parquet data files are written
    by the Parquet format's writer; Delta commits them."""

    name = "delta"
    url_schemes = ("s3",)  # its Rust storage reaches object stores through S3 only
    atomic_switch = True  # a reader stays on the table versions it opened
    writes_in_place = True  # an update writes only what differs, nothing is staged

    def __init__(self, path: str, version: int | None = None) -> None:
        super().__init__(path)
        self.version_wanted = version
        self._history: list[dict[str, Any]] | None = None
        self._pins: dict[str, int] = {}  # level -> Delta version this handle reads
        # while this handle writes: the Delta version of each table its next commit builds
        # on (what it reads too); a commit that meets another writer's is refused
        self._heads: dict[str, int] | None = None
        self._pending: dict[str, _Pending] = {}
        self._written: dict[str, FileSum] = {}
        self._snapshots: dict[tuple[str, int], DeltaTable | None] = {}
        self._docs_keys: np.ndarray | None = None  # docs `row` keys as opened, in order
        self._restore_to: dict[str, int | None] = {}  # level -> bertpipe's newest commit

    cannot_grow_on_object_store = ""  # a commit is a new log entry: no file is renamed

    @classmethod
    def holds_store(cls, path: str) -> bool:
        return resolve(path).child("docs", LOG_DIR).is_dir()

    @classmethod
    def is_ours(cls, root: Location) -> bool:
        """A Delta table at docs/ whose commits carry bertpipe's provenance."""
        return cls.holds_store(root.address) and cls(root.address).record() is not None

    # ---- the tables ---------------------------------------------------------------

    def _uri(self, level: str) -> str:
        table = self.location.child(level)
        return table.address

    def _table(self, level: str, version: int | None = None) -> DeltaTable | None:
        """The level's table (at `version`, else its head); None when there is none."""
        if not self.location.child(level, LOG_DIR).is_dir():
            return None
        try:
            return DeltaTable(self._uri(level), version=version,
                              storage_options=storage_options_of(self.location))
        except TableNotFoundError:
            return None
        except DeltaError as exc:
            raise StoreError(f"{self.path}: {level}: damaged Delta table ({_first_line(exc)})"
                             ) from None

    def _read_version(self, level: str) -> int | None:
        """The Delta version of `level` this handle reads (None: the table's head)."""
        if self._heads is not None:
            return self._heads.get(level)
        self.record()
        return self._pins.get(level)

    def _state(self, level: str) -> DeltaTable | None:
        """The level's table as this handle reads it, for reading only. A version once
        committed never changes, so a pinned one is loaded once per handle (each load
        replays the table's log: on an object store a request per commit since the last
        checkpoint, and an update asked for it some thirty times)."""
        version = self._read_version(level)
        if version is None:
            return self._table(level)
        if (level, version) not in self._snapshots:
            self._snapshots[level, version] = self._table(level, version)
        return self._snapshots[level, version]

    def _files(self, level: str) -> list[_DataFile]:
        """The level's data files as this handle reads them, pending changes applied, in
        the order of their first row."""
        table = self._state(level)
        files: list[_DataFile] = []
        if table is not None:
            actions = pa.table(table.get_add_actions(flatten=True))
            first = f"min.{LEVEL_ORDER[level][0]}"
            mins = actions.column(first).to_pylist() if first in actions.column_names \
                else [None] * actions.num_rows
            files = [_DataFile(path, int(rows), low) for path, rows, low in zip(
                actions.column("path").to_pylist(), actions.column("num_records").to_pylist(),
                mins, strict=True)]
        pending = self._pending.get(level)
        if pending is not None:
            gone = {f.path for f in pending.removes}
            files = [] if pending.replace else [f for f in files if f.path not in gone]
            files += [_DataFile(a.path, json.loads(a.stats)["numRecords"],
                                json.loads(a.stats)["minValues"].get(LEVEL_ORDER[level][0]))
                      for a in pending.adds]
        return sorted(files, key=lambda f: (f.first is None, f.first or 0))

    def _levels(self) -> list[str]:
        return [level for level in LEVEL_ORDER if self._state(level) is not None
                or level in self._pending]

    # ---- the provenance, in the docs table's commits --------------------------------

    def _commits(self) -> list[dict[str, Any]]:
        """The docs table's commits, newest first (read once per handle)."""
        if self._history is None:
            table = self._table("docs")
            self._history = table.history() if table is not None else []
        return self._history

    def versions(self) -> list[DeltaVersion]:
        """The complete versions still kept, newest first (a version's newest completing
        commit: post-processing completes a version again)."""
        commits = self._commits()
        oldest = max((int(c.get(OLDEST_KEY) or 0) for c in commits), default=0)
        seen: dict[int, DeltaVersion] = {}
        for commit in commits:
            version = commit.get(VERSION_KEY)
            if commit.get(COMPLETE_KEY) is True and isinstance(version, int) and \
                    version >= oldest and version not in seen:
                seen[version] = DeltaVersion(version, _pins_of(commit), datetime.fromtimestamp(
                    commit["timestamp"] / 1000, UTC))
        return sorted(seen.values(), key=lambda v: -v.version)

    def _marker(self) -> dict[str, Any] | None:
        """The commit whose provenance this handle reads: the newest complete one (of the
        version asked for), else the newest that carries one (a run not finished)."""
        commits = [c for c in self._commits() if RECORD_KEY in c]
        if self.version_wanted is None:
            complete = [c for c in commits if c.get(COMPLETE_KEY) is True]
            newest = complete or commits
            return newest[0] if newest else None
        for info in self.versions():
            if info.version == self.version_wanted:
                return next(c for c in commits if c.get("version") == info.tables["docs"])
        held = ", ".join(str(v.version) for v in self.versions()) or "none"
        raise StoreError(f"{self.path}: no version {self.version_wanted} (versions kept: "
                         f"{held})")

    def _read_record(self) -> dict[str, Any] | None:
        marker = self._marker()
        if marker is None:
            return None
        self._pins = _pins_of(marker)
        try:
            raw = json.loads(marker[RECORD_KEY])
        except (TypeError, ValueError):
            raise StoreError(f"{self.path}: damaged provenance in the docs table's commit "
                             f"{marker.get('version')}") from None
        return raw if isinstance(raw, dict) else None

    def reread(self) -> dict[str, Any] | None:
        self._history = None
        return super().reread()

    def _write_record(self, raw: dict[str, Any]) -> None:
        """A commit of the docs table that changes no data and carries `raw` (and, when
        it is complete, the table versions it describes)."""
        self._begin_write()
        docs = self._writer_table("docs")
        if docs is None:
            raise StoreError(f"{self.path}: no docs table to record the provenance in")
        self._try_commit(lambda: docs.alter.set_table_description(
            DESCRIPTION, commit_properties=self._properties(raw)))
        self._committed("docs")

    def _properties(self, raw: dict[str, Any] | None, version: int | None = None,
                     **more: Any) -> CommitProperties:
        """Commit metadata: the version; with `raw`, the provenance and the other tables'
        versions (every table but docs is committed before the docs commit that names
        it)."""
        meta: dict[str, Any] = {VERSION_KEY: version_of(raw) if raw else version,
                                COMPLETE_KEY: is_complete(raw), **more}
        if raw is not None:
            meta[RECORD_KEY] = json.dumps(raw, default=str)
            heads = self._heads or {}
            meta[TABLES_KEY] = {level: heads[level] for level in ("chunks", "tokens")
                                if level in heads}
        # no retries: a commit that meets another writer's is refused, never rebased
        return CommitProperties(custom_metadata=meta, max_commit_retries=0)

    def _try_commit(self, commit: Callable[[], object]) -> None:
        try:
            commit()
        except CommitFailedError as exc:
            raise StoreError(f"{self.path}: another run committed to the store meanwhile "
                             f"({_first_line(exc)}); nothing of this run was committed"
                             ) from None

    def _committed(self, level: str) -> None:
        """This handle's commit of `level` landed: its next one builds on it."""
        assert self._heads is not None  # every write begins with _begin_write
        self._heads[level] = self._heads.get(level, -1) + 1
        self._history = None
        self._forget_record()

    def _writer_table(self, level: str) -> DeltaTable | None:
        """The table as this handle's next commit builds on it (None: not made yet)."""
        assert self._heads is not None
        return self._table(level, self._heads[level]) if level in self._heads else None

    def _begin_write(self) -> None:
        """Before this handle writes: a version never completed (an update killed between
        its commits) is rolled back, so that what is written builds on the current one."""
        if self.version_wanted is not None:
            raise StoreError(f"{self.path}: version {self.version_wanted} is read only")
        if self._heads is not None:
            return
        self.refuse_foreign_commits()  # never rolled back (the restore below) nor built on
        if is_complete(self.record()):
            for level, pinned in self._pins.items():
                table = self._table(level)
                if table is not None and table.version() > pinned:
                    self._roll_back(table, pinned)
            self._history = None
        self._heads = {level: table.version() for level in LEVEL_ORDER
                       if (table := self._table(level)) is not None}

    def _roll_back(self, table: DeltaTable, version: int) -> None:
        """A table back at `version` (Delta's restore: one more commit; the files of the
        commits undone stay until `gc`)."""
        meta = {VERSION_KEY: version_of(self.record()), COMPLETE_KEY: False}
        self._try_commit(lambda: table.restore(version, commit_properties=CommitProperties(
            custom_metadata=meta, max_commit_retries=0)))

    # ---- another writer's commits ---------------------------------------------------

    def foreign_commits(self) -> list[ForeignCommit]:
        """Per table, the commits after bertpipe's newest one (each bertpipe commit carries
        `bertpipe_version`; Delta's commit info names any other's engine), unless they leave
        the table as that commit left it (the same data files and schema: a vacuum, a
        property set, a restore that undid them). Oldest first."""
        found: list[ForeignCommit] = []
        for level in LEVEL_ORDER:
            table = self._table(level)
            if table is None:
                continue
            newer, ours = _since_ours(table)
            if not newer or (ours is not None and _same_state(self._table(level, ours), table)):
                continue
            self._restore_to[level] = ours
            found += [ForeignCommit(level, f"version {c['version']}",
                                    str(c.get("operation") or "a commit"), _writer(c))
                      for c in reversed(newer)]
        return found

    def _foreign_line(self, foreign: list[ForeignCommit]) -> str:
        tables = sorted({c.table for c in foreign}, key=list(LEVEL_ORDER).index)
        restores = [f"DeltaTable('{self._uri(t)}').restore({self._restore_to[t]})"
                    for t in tables if self._restore_to.get(t) is not None]
        back = (f"copy what it wrote elsewhere if it is to be kept, give the table back to "
                f"bertpipe with {' and '.join(restores)}, and rerun; or " if restores else "")
        return describe_foreign(foreign, f"{back}rebuild the store with --overwrite "
                                "(which drops it)")

    # ---- writing data files -------------------------------------------------------

    def _write_file(self, level: str, table: pa.Table) -> AddAction:
        """One data file (sorted, Delta's types), written whole; its Delta add action."""
        name = f"part-{uuid.uuid4().hex}.parquet"
        file = self.location.child(level, name)
        write_parquet(file, iter([table]), None)
        rel = f"{level}/{name}"
        sum_ = self.file_sum(rel)
        if sum_ is not None:
            self._written[rel] = sum_
        return AddAction(name, file.size() or 0, {}, int(time.time() * 1000), True,
                         stats_json(file_stats(table)))

    def _write_files(self, level: str, table: pa.Table) -> list[AddAction]:
        keys = table.column(LEVEL_ORDER[level][0]).to_numpy()
        return [self._write_file(level, table.slice(a, b - a))
                for a, b in _cuts(keys, DELTA_ROWS_PER_FILE)]

    def _commit_level(self, level: str, pending: _Pending, properties: CommitProperties
                      ) -> None:
        """One Delta commit of a level: a new table, all its files replaced, or files added
        and removed."""
        schema = pending.schema
        table = self._writer_table(level)
        now = int(time.time() * 1000)
        if table is None:
            assert schema is not None  # a new table is always given its schema
            try:
                self._try_commit(lambda: create_table_with_add_actions(
                    self._uri(level), _delta_schema(schema, level), pending.adds,
                    storage_options=storage_options_of(self.location),
                    description=DESCRIPTION if level == "docs" else None,
                    configuration=TABLE_CONFIGURATION, commit_properties=properties))
            except DeltaError as exc:
                if self._table(level) is None:
                    raise StoreError(f"{self.path}: {level}: {_first_line(exc)}") from None
                raise StoreError(f"{self.path}: another run made the {level} table meanwhile; "
                                 "nothing of this run was committed") from None
        elif pending.replace:
            self._try_commit(lambda: table.create_write_transaction(
                list(pending.adds), mode="overwrite",
                schema=_delta_schema(schema, level) if schema else table.schema(),
                commit_properties=properties))
        elif not pending.empty:
            actions: list[AddAction | RemoveAction] = [*pending.adds, *(
                RemoveAction(f.path, True, now) for f in pending.removes)]
            self._try_commit(lambda: table.create_write_transaction(
                actions, mode="append", schema=table.schema(), commit_properties=properties))
        else:
            return
        self._committed(level)

    # ---- the first version ----------------------------------------------------------

    def _version_target(self, version: int) -> Location:
        self._begin_write()
        return self.location

    def _write_level(self, target: Location, level: StagedLevel, raw: dict[str, Any] | None
                     ) -> None:
        """A level's staged parts as files of about DELTA_ROWS_PER_FILE rows, committed in
        one step (replacing whatever an interrupted run committed); the docs commit
        carries `raw`."""
        pending = _Pending(replace=True)
        held: list[pa.Table] = []
        for part in level.parts:
            table = delta_form(part)
            pending.schema = pending.schema or table.schema
            held.append(table)
            if sum(t.num_rows for t in held) >= 4 * DELTA_ROWS_PER_FILE:
                pending.adds += self._flush(level.name, held, final=False)
        pending.adds += self._flush(level.name, held, final=True)
        properties = self._properties(raw, version=0)
        self._commit_level(level.name, pending, properties)

    def _flush(self, level: str, held: list[pa.Table], final: bool) -> list[AddAction]:
        """Write the rows held as files; unless `final`, keep back the last file's rows
        (more rows, or more of that document's chunks, may follow)."""
        if not held:
            return []
        table = pa.concat_tables(held)
        held.clear()
        cuts = list(_cuts(table.column(LEVEL_ORDER[level][0]).to_numpy(), DELTA_ROWS_PER_FILE))
        if not final and cuts:
            start, _ = cuts.pop()
            held.append(table.slice(start))
        return [self._write_file(level, table.slice(a, b - a)) for a, b in cuts]

    # ---- an update ------------------------------------------------------------------

    def write_streamed_version(self, version: int, streamed: StreamedVersion) -> None:
        """The new version's blocks compared file by file with the current version: new
        rows become new files, a file whose rows changed (or were removed) is rewritten,
        a file whose rows are all kept (`StreamedVersion.kept`) stays as it is, unread
        but for the columns carried from the input. Nothing is committed before
        `publish`."""
        self._begin_write()
        keys = _RowKeys(self._opened_keys(), streamed.store_row)
        kept = streamed.kept
        patches = {level: _LevelPatch(self, level, keys.next, set(streamed.same[level]))
                   for level in streamed.rows}
        # a kept row's results are not read: the file that holds them is kept, or read
        # whole to be rewritten (the results then come from it)
        unwritten = {level: dict.fromkeys(patch.fillable, kept if level == "docs"
                                          else np.repeat(kept, streamed.chunk_counts))
                     for level, patch in patches.items()}
        for block in streamed.blocks(unwritten):
            docs = block["docs"]
            assert docs is not None  # every block has its documents
            docs = streamed.columns["docs"].conform(docs)
            positions = docs.column("row").to_numpy()
            row_keys = keys.assign(positions)
            docs = docs.set_column(docs.column_names.index("row"), "row", pa.array(row_keys))
            patches["docs"].add(delta_form(docs), kept[positions])
            chunks = block.get("chunks")
            if "chunks" in patches and chunks is not None:
                chunks = streamed.columns["chunks"].conform(chunks)
                doc = chunks.column("doc").to_numpy()
                at = doc - (positions[0] if len(positions) else 0)
                chunks = chunks.set_column(chunks.column_names.index("doc"), "doc",
                                           pa.array(row_keys[at] if len(at) else at))
                patches["chunks"].add(delta_form(chunks), kept[doc])
        self._pending = {level: patch.close() for level, patch in patches.items()}

    def _switch(self, version: int, raw: dict[str, Any], previous: int) -> None:
        """Commit the chunks table, then the docs table with the sealed provenance: the
        commit that completes the version."""
        sealed_raw = self._sealed(raw, version)
        for level in ("chunks", "tokens"):
            if level in self._pending:
                self._commit_level(level, self._pending.pop(level),
                                   self._properties(None, version=version))
        docs = self._pending.pop("docs", _Pending())
        if docs.empty:
            self._write_record(sealed_raw)
        else:
            self._commit_level("docs", docs, self._properties(sealed_raw))
        self._remember_record(sealed_raw)
        self._history = None

    def _sealed(self, raw: dict[str, Any], version: int) -> dict[str, Any]:
        """Sums of the files this handle wrote, the recorded sums of the files it kept,
        and (a store sealed without them) a read of any other."""
        return self._sealed_with(raw, version, self._written)

    def recover(self) -> None:
        """Nothing to finish: a version is completed by one commit (what a killed update
        committed before it is rolled back under the lock, `drop_retired`)."""

    def drop_retired(self) -> None:
        """Roll back what an update killed between its commits left (under the lock);
        earlier versions stay readable until `gc` vacuums them."""
        self._begin_write()

    # ---- post-processed views --------------------------------------------------------

    def add_view(self, source: str, name: str, fn: Callable[[np.ndarray], np.ndarray],
                 levels: Sequence[str]) -> None:
        """Each level's files rewritten with column `name` = fn(`source`), in one commit
        per level; the provenance that names the view follows (`update_provenance`)."""
        self._begin_write()
        version = version_of(self.record())
        for level in levels:
            pending = _Pending(replace=True)
            for data_file in self._files(level):
                table = self._read_file(level, data_file.path)
                values = fn(_vectors(table.column(source)).astype(np.float64))
                dtype = np.dtype(table.schema.field(source).metadata[DTYPE_KEY].decode())
                column = pa.FixedSizeListArray.from_arrays(
                    pa.array(values.astype(dtype).reshape(-1)), values.shape[1])
                extra = delta_form(pa.table({name: column}))
                if name in table.column_names:
                    table = table.drop_columns([name])
                table = table.append_column(extra.schema.field(0), extra.column(0))
                pending.schema = table.schema
                pending.adds.append(self._write_file(level, table))
            self._commit_level(level, pending, self._properties(None, version=version))

    def _read_file(self, level: str, path: str, columns: list[str] | None = None
                   ) -> pa.Table:
        file = self.location.child(level, path)
        try:
            with file.open("rb") as f:
                return pq.read_table(f, columns=columns)
        except READ_ERRORS as exc:
            raise StoreError(f"{file}: damaged Parquet file ({exc})") from None

    def _file_schema(self, level: str, path: str) -> pa.Schema:
        file = self.location.child(level, path)
        try:
            with file.open("rb") as f:
                return pq.read_schema(f)
        except READ_ERRORS as exc:
            raise StoreError(f"{file}: damaged Parquet file ({exc})") from None

    # ---- reading ---------------------------------------------------------------------

    def _files_of(self, version: int) -> list[str]:
        return [f"{level}/{f.path}" for level in self._levels() for f in self._files(level)] \
            + self._param_files()

    def row_counts(self) -> dict[str, tuple[str, int]]:
        return {level: (level, sum(f.rows for f in self._files(level)))
                for level in self._levels() if level != "tokens"}

    def _dataset(self, level: str, dask: bool = True
                 ) -> tuple[xr.Dataset, dict[str, np.ndarray]] | None:
        """A level lazily, in its order (see the module docstring), and its order columns
        read; None without it."""
        if level not in self._levels():
            return None
        files = [self.location.child(level, f.path) for f in self._files(level)]
        columns = parts_columns(files, LEVEL_DIMS[level]) if files else self._no_rows(level)
        data = dataset_of(columns, dask)
        if not data.data_vars:
            return data, {}
        keys = {name: columns[name].read_whole() for name in LEVEL_ORDER[level]}
        rank = np.lexsort([keys[name] for name in LEVEL_ORDER[level]][::-1])
        if not np.array_equal(rank, np.arange(len(rank))):  # written by another tool
            data = data.isel({LEVEL_DIMS[level]: rank})
            keys = {name: values[rank] for name, values in keys.items()}
        if level == "docs":
            self._docs_keys = keys["row"]
        return data, keys

    def _opened_keys(self) -> np.ndarray:
        """The docs `row` keys of the version this handle opened, in its order: the order
        an update compared its rows in (`StreamedVersion.store_row` counts in it)."""
        if self._docs_keys is None:
            self._dataset("docs", dask=False)
        return self._docs_keys if self._docs_keys is not None else np.zeros(0, np.int64)

    def _no_rows(self, level: str) -> dict[str, PartsColumn]:
        """A table of no files (a level none of whose rows has any: every text empty) as
        its columns of no rows, typed by the table's schema."""
        table = self._state(level)
        schema = pa.schema(table.schema()) if table is not None else pa.schema([])
        return {f.name: PartsColumn(f, LEVEL_DIMS[level]) for f in schema}

    def open_datasets(self, dask: bool = True) -> tuple[xr.Dataset, xr.Dataset | None]:
        found = self._dataset("docs", dask)
        if found is None:
            raise StoreError(f"{self.path}: no docs table")
        docs, keys = found
        rows = keys.get("row", np.zeros(0, np.int64))
        docs = docs.drop_vars("row", errors="ignore").set_coords("id")
        found = self._dataset("chunks", dask)
        chunks, chunk_keys = found if found is not None else (None, {})
        if chunks is not None and "doc" in chunks:
            # `doc` names a docs `row`; readers of a store count documents by position
            chunks["doc"] = (("chunk",), np.searchsorted(rows, chunk_keys["doc"]))
        return docs, chunks

    def open_tokens(self, dask: bool = True) -> xr.Dataset | None:
        found = self._dataset("tokens", dask)
        return found[0] if found is not None else None

    # ---- versions --------------------------------------------------------------------

    def version_numbers(self) -> list[int]:
        return [v.version for v in self.versions()]

    def reader_versions(self) -> list[dict[str, Any]]:
        """Each kept version's Delta table versions (`DeltaTable(path, version=n)`,
        `pl.read_delta(path, version=n)`): a bertpipe version is several commits of each
        table, so its number is not theirs."""
        return [{"version": v.version, "tables": dict(sorted(v.tables.items()))}
                for v in self.versions()]

    def at_version(self, version: int) -> DeltaFormat:
        at = DeltaFormat(self.path, version)
        at.record()  # refused here when the version is not kept
        return at

    def gc(self, keep: int) -> tuple[list[int], int]:
        """Keep the newest `keep` versions; vacuum every data file none of them uses (and
        the files of writes never committed); the versions expired and the bytes freed."""
        if keep < 1:
            raise StoreError("--keep: at least 1 (the current version)")
        self._begin_write()
        held = self.versions()
        if len(held) <= keep:
            return [], 0
        kept = held[:keep]
        freed = 0
        for level in self._levels():
            table = self._writer_table(level)
            assert table is not None  # listed by _levels
            versions = sorted({v.tables[level] for v in kept if level in v.tables})
            freed += self._vacuum(level, table, versions)
            self._heads = {**(self._heads or {}), level: table.version()}  # vacuum commits
        raw = self.record()
        assert raw is not None  # a store with versions has a provenance
        docs = self._writer_table("docs")
        assert docs is not None
        self._try_commit(lambda: docs.alter.set_table_description(
            DESCRIPTION, commit_properties=self._properties(
                raw, **{OLDEST_KEY: kept[-1].version})))
        self._committed("docs")
        return [v.version for v in held[keep:]], freed

    def _vacuum(self, level: str, table: DeltaTable, keep_versions: list[int]) -> int:
        """Delete the level's files that no kept version uses; the bytes freed."""
        # vacuum's own commits carry the version too: every commit bertpipe makes does
        tagged = self._properties(None, version=version_of(self.record()))

        def vacuum(dry_run: bool) -> list[str]:
            # retention 0: the versions to keep are named; full: also files of writes
            # that never committed (a killed run's)
            return table.vacuum(retention_hours=0, dry_run=dry_run,
                                enforce_retention_duration=False, full=True,
                                keep_versions=keep_versions, commit_properties=tagged)

        doomed = vacuum(dry_run=True)
        sizes = sum(self.location.child(level, rel).size() or 0
                    for rel in (_relative(uri, self._uri(level)) for uri in doomed))
        vacuum(dry_run=False)
        return sizes


class _RowKeys:
    """Each row of the new version keeps the `row` of its id's row in the current version
    (`StreamedVersion.store_row`); a new row gets the next free one, so rows stay in the
    store's order."""

    def __init__(self, keys: np.ndarray, store_row: np.ndarray):
        self.keys, self.store_row = keys, store_row
        self.next = int(keys[-1]) + 1 if len(keys) else 0
        self.last = -1

    def assign(self, positions: np.ndarray) -> np.ndarray:
        """The keys of the new version's rows at `positions` (a block, in order)."""
        was = self.store_row[positions]
        known = was >= 0
        keys = np.empty(len(positions), np.int64)
        keys[known] = self.keys[was[known]]
        fresh = int((~known).sum())
        keys[~known] = self.next + np.arange(fresh)
        self.next += fresh
        if len(keys) and (keys[0] <= self.last or np.any(np.diff(keys) <= 0)):
            raise StoreError("delta: the new version's rows are not in the store's order "
                             "(kept rows first, in place, then new ones); nothing was "
                             "committed")
        self.last = int(keys[-1]) if len(keys) else self.last
        return keys


class _LevelPatch:
    """A level's new rows (Delta's types, in order) against its current files: a file is
    kept when its rows are the same, else rewritten; rows past the current ones are new
    files. Each current file covers the keys from its first row to the next file's.

    Rows come with a `kept` flag (StreamedVersion.kept: the row is its store row, by key);
    their `fillable` columns (all but the keys and the carried columns) hold zeros, not
    read. A file whose rows are all kept is kept without reading more than its carried
    columns; a file rewritten is read whole and gives its kept rows' cells."""

    def __init__(self, fmt: DeltaFormat, level: str, boundary: int, same: set[str]):
        self.fmt, self.level = fmt, level
        self.key = LEVEL_ORDER[level][0]
        self.fillable = sorted(same - set(LEVEL_ORDER[level]))
        self.files = [f for f in fmt._files(level) if f.first is not None]
        self.starts = np.array([f.first for f in self.files], np.int64)
        self.boundary = boundary  # the first docs `row` of a new document
        self.pending = _Pending()
        self.bucket: int = 0  # the file whose rows are being gathered
        self.gathered: list[tuple[pa.Table, np.ndarray]] = []
        self.fresh: list[pa.Table] = []
        self.replace_all: bool | None = None  # the schema changed: every file rewritten

    def add(self, table: pa.Table, kept: np.ndarray) -> None:
        table = self._aligned(table)
        keys = table.column(self.key).to_numpy()
        # rows of current documents go to the file covering their key; with no file at
        # all (a level that had no rows: every text empty), every row is new to the level
        old = int(np.searchsorted(keys, self.boundary, side="left")) if self.files else 0
        if old:
            buckets = np.maximum(np.searchsorted(self.starts, keys[:old], side="right") - 1, 0)
            for b in np.unique(buckets):
                lo, hi = np.searchsorted(buckets, b, "left"), np.searchsorted(buckets, b, "right")
                while self.bucket < b:
                    self._close_bucket()
                self.gathered.append((table.slice(lo, hi - lo), kept[lo:hi]))
        if old < len(table):
            if kept[old:].any():
                raise StoreError("internal: a new row of the delta store is marked kept")
            self.fresh.append(table.slice(old))
            if sum(t.num_rows for t in self.fresh) >= 4 * DELTA_ROWS_PER_FILE:
                self.pending.adds += self.fmt._flush(self.level, self.fresh, final=False)

    def _aligned(self, table: pa.Table) -> pa.Table:
        """`table`'s columns in the current files' order; whether the schema changed is
        decided on the first table."""
        if self.replace_all is None:
            self.pending.schema = table.schema
            current = self.fmt._file_schema(self.level, self.files[0].path) \
                if self.files else None
            same = current is not None and set(current.names) == set(table.column_names)
            if same:
                assert current is not None
                table = table.select(current.names)
                same = _comparable(table.schema) == _comparable(current)
            self.replace_all = not same
            self.pending.replace = not same
            if same:
                self.pending.schema = table.schema
        if self.pending.schema is not None and not self.replace_all:
            table = table.select(self.pending.schema.names)
        return table

    def _close_bucket(self) -> None:
        """Compare the rows gathered for the current file with it; rewrite it if they
        differ (no rows: it goes)."""
        if self.bucket >= len(self.files):
            return
        current = self.files[self.bucket]
        new, kept = self._gathered()
        self.bucket += 1
        if new is None:  # none of its rows is in the new version
            self.pending.removes.append(current)
            return
        if not self.replace_all and new.num_rows == current.rows and kept.all() and \
                self._carried_same(current, new):
            return  # its rows, each kept by key: the file is what the new version holds
        if not self.replace_all or kept.any():  # to compare, or the kept rows' cells
            old = sorted_by_order(self.fmt._read_file(self.level, current.path), self.level)
            new = self._filled(new, kept, old)
            if not self.replace_all and old.num_rows == new.num_rows and \
                    old.select(new.column_names).equals(new):
                return
        self.pending.removes.append(current)
        if new.num_rows:
            self.pending.adds += self.fmt._write_files(self.level, new)

    def close(self) -> _Pending:
        while self.bucket < len(self.files):
            self._close_bucket()
        self.pending.adds += self.fmt._flush(self.level, self.fresh, final=True)
        if self.replace_all:
            self.pending.removes = []
        return self.pending

    def _gathered(self) -> tuple[pa.Table | None, np.ndarray]:
        tables, flags = [t for t, _ in self.gathered], [k for _, k in self.gathered]
        self.gathered = []
        if not tables:
            return None, np.zeros(0, bool)
        return pa.concat_tables(tables), np.concatenate(flags)

    def _carried_same(self, current: _DataFile, new: pa.Table) -> bool:
        """The carried columns of a file whose rows are all kept, against the new rows'."""
        order = list(LEVEL_ORDER[self.level])
        carried = [n for n in new.column_names if n not in self.fillable and n not in order]
        if not carried:
            return True
        old = sorted_by_order(self.fmt._read_file(self.level, current.path, order + carried),
                              self.level)
        return old.select(carried).equals(new.select(carried))

    def _filled(self, new: pa.Table, kept: np.ndarray, old: pa.Table) -> pa.Table:
        """`new` with its kept rows' unread cells taken from `old` (the sorted file that
        holds those rows, matched by key)."""
        if not kept.any():
            return new
        at = _rows_by_key(old, new.filter(pa.array(kept)), self.level)
        take = np.arange(new.num_rows)
        take[kept] = new.num_rows + at
        indices = pa.array(take)
        for name in self.fillable:
            if name not in new.column_names or name not in old.column_names:
                continue
            column = new.column(name).combine_chunks()
            stored = old.column(name).cast(column.type).combine_chunks()
            merged = pa.concat_arrays([column, stored]).take(indices)
            i = new.column_names.index(name)
            new = new.set_column(i, new.schema.field(i), merged)
        return new


def _rows_by_key(old: pa.Table, rows: pa.Table, level: str) -> np.ndarray:
    """Where each of `rows` is in `old` (sorted by the level's order), by key; every one
    must be there."""
    names = LEVEL_ORDER[level]
    old_keys = [old.column(n).to_numpy() for n in names]
    keys = [rows.column(n).to_numpy() for n in names]
    at = np.searchsorted(old_keys[0], keys[0], side="left")
    if len(names) > 1:  # a document's rows are consecutive, its second key from 0
        at = at + keys[1]
    inside = at < len(old_keys[0])
    found = inside.all() and all(np.array_equal(o[at], k) for o, k in zip(old_keys, keys,
                                                                             strict=True))
    if not found:
        raise StoreError(f"delta: a kept {level} row is not in the file that covers its "
                         "key; nothing was committed")
    return at


def _delta_schema(schema: pa.Schema, level: str) -> Schema:
    """The Delta schema of a level's files; a column Delta has no type for is refused,
    named."""
    for f in schema:
        try:
            Schema.from_arrow(pa.schema([f]))
        except Exception as exc:  # why so wide: deltalake raises a bare Exception here
            raise StoreError(f"output.format: delta cannot store {level} column {f.name!r} of "
                             f"type {f.type} ({_first_line(exc)}); carry it as another type or "
                             "use output.format: parquet") from None
    return Schema.from_arrow(schema)


def _comparable(schema: pa.Schema) -> list[tuple[str, pa.DataType, bytes | None]]:
    return [(f.name, f.type, (f.metadata or {}).get(WIDTH_KEY)) for f in schema]


def _vectors(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A stored vector column (list<float32> or fixed-size) as an (N, D) array."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        return column_matrix(column)
    values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
    return values.reshape(len(column), -1)


def _pins_of(commit: dict[str, Any]) -> dict[str, int]:
    tables = commit.get(TABLES_KEY) or {}
    return {"docs": int(commit["version"]),
            **{str(level): int(v) for level, v in tables.items()}}


def _relative(uri: str, table_uri: str) -> str:
    """A file of a table, as vacuum names it (a URI or a path), relative to the table."""
    for prefix in (table_uri.rstrip("/") + "/", "file://" + table_uri.rstrip("/") + "/"):
        if uri.startswith(prefix):
            return uri[len(prefix):]
    return uri


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _ours(commit: dict[str, Any]) -> bool:
    """A commit bertpipe made: every one carries the store version it belongs to."""
    return isinstance(commit.get(VERSION_KEY), int)


def _since_ours(table: DeltaTable) -> tuple[list[dict[str, Any]], int | None]:
    """The table's commits newer than bertpipe's newest (newest first) and that one's
    version (None: bertpipe made none). The log is read back only as far as needed."""
    limit = 8
    while True:
        commits = table.history(limit)
        for i, commit in enumerate(commits):
            if _ours(commit):
                return commits[:i], int(commit["version"])
        if len(commits) < limit:
            return commits, None
        limit *= 8


def _same_state(ours: DeltaTable | None, head: DeltaTable) -> bool:
    """Two versions of a table hold the same data files and schema."""
    # the schemas as JSON values: a field's metadata keys come in no set order
    return ours is not None and sorted(ours.file_uris()) == sorted(head.file_uris()) and \
        json.loads(ours.schema().to_json()) == json.loads(head.schema().to_json())


def _writer(commit: dict[str, Any]) -> str:
    """Who made a commit, as its commit info says."""
    for key in ("engineInfo", "clientVersion", "userName"):
        if commit.get(key):
            return str(commit[key])
    return "a writer that did not name itself"
