"""What every store format shares: the layout of a finished run, the one order in which a
version's data is written, and `StoreFormat`, the base class each format subclasses.

A `StoreFormat` is a handle bound to one store location, like zarr's `Store`: it reads
the store's provenance once (`record`) and keeps it, so opening a store, checking its
files and reading its datasets read the provenance one time. The base class owns the
steps every format takes in the same order (`commit`, `write_version`, `publish`); a
format supplies only how it writes a level, where a version lives, and how it switches.
Provenance comes in typed (`Provenance`); the raw dict is what is stored, and
`stores.provenance` is the one place that turns one into the other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import StoreError
from ..io.location import Location, resolve
from .columns import StoredColumns
from .provenance import FileSum, Provenance, is_complete, recorded_checksums, sealed, version_of

if TYPE_CHECKING:  # typing only: staging imports nothing from here at run time
    import xarray as xr

    from .staging import Staging

LEVELS_IN_WRITE_ORDER = ("tokens", "chunks", "docs")  # docs last: it names what is done


@dataclass(frozen=True)
class Layout:
    """Sizes known once every partition is done; parts are committed in `indices` order."""

    indices: list[int]
    n_docs: int
    n_chunks: int
    has_chunks: bool
    n_tokens: int = 0  # rows of the tokens level (stored tokens)
    has_tokens: bool = False  # the job has a token view (pooling: tokens)

    def levels(self) -> list[tuple[str, int]]:
        """The levels this run stores and their rows, in the order they are written."""
        rows = {"tokens": self.n_tokens, "chunks": self.n_chunks, "docs": self.n_docs}
        held = {"tokens": self.has_tokens, "chunks": self.has_chunks, "docs": True}
        return [(level, rows[level]) for level in LEVELS_IN_WRITE_ORDER if held[level]]


@dataclass
class StagedLevel:
    """One level of a version as the staged parts give it: every part cast to the one
    schema the parts unify to, in row order (docs with the store's token offsets)."""

    name: str  # docs | chunks | tokens
    rows: int
    columns: StoredColumns
    files: list[Location]  # the staged part files, in row order
    parts: Iterator[pa.Table]

    @classmethod
    def of(cls, staging: Staging, level: str, rows: int, indices: Sequence[int]) -> StagedLevel:
        columns = StoredColumns.from_metadata(staging.part_schemas(level, indices))
        parts: Iterator[pa.Table] = (columns.conform(t)
                                     for t in staging.read_parts(level, indices))
        if level == "docs":
            parts = with_store_token_offsets(parts)
        return cls(level, rows, columns, [staging.part(i, level) for i in indices], parts)


# level -> column -> the rows whose cells a writer leaves as they are (see StreamedVersion)
Unwritten = dict[str, dict[str, np.ndarray]]


@dataclass
class StreamedVersion:
    """A new version given block by block (for a format that updates its arrays in place,
    so that nothing is staged): each level's rows, column types and longest strings, known
    before the first block, then the blocks in row order (level -> table).

    `same[level][column]` marks the rows whose value in that column is by construction the
    current version's at the same position: a row kept in place keeps its results (vectors,
    counts, status), its id and its text's digest, and its `present` flag unless its id
    left the input or an edit superseded it in this update. A writer that leaves some of
    those cells untouched (its chunks holding nothing but such rows) says so when it asks
    for the blocks: `blocks(unwritten)`; those cells of the blocks may then hold zeros, not
    read from the current version, so that an update reads and writes what changed.

    `kept` says the same by id rather than by position, for a format whose rows are keyed
    (Delta: a row keeps its key wherever it moves): per docs row of the new version,
    whether it keeps the results, id, digest and `present` flag (and so the chunks) of its
    id's row in the current version, `store_row`. Carried columns come from the input and
    are compared as they come."""

    rows: dict[str, int]
    columns: dict[str, StoredColumns]
    widths: dict[str, dict[str, int]]
    same: dict[str, dict[str, np.ndarray]]
    kept: np.ndarray  # bool
    store_row: np.ndarray  # per docs row of the new version, its id's current row, or -1
    chunk_counts: np.ndarray  # per docs row of the new version, its rows of the chunks level
    blocks: Callable[[Unwritten], Iterator[dict[str, pa.Table | None]]]


@dataclass(frozen=True)
class ForeignCommit:
    """A commit bertpipe did not make (its commit info lacks bertpipe's marker), as its
    format's log names it."""

    table: str  # a Delta table (docs, chunks, tokens) or an Icechunk branch
    version: str  # the Delta table version, or the Icechunk snapshot id
    operation: str  # what it did (Delta's operation), or its commit message
    writer: str  # who wrote it, as its commit info says

    def line(self) -> str:
        return f"{self.table} {self.version} ({self.operation}, by {self.writer})"


def describe_foreign(foreign: list[ForeignCommit], way_out: str) -> str:
    """One line: the first commits another writer made, how many more, and `way_out`."""
    shown = ", ".join(c.line() for c in foreign[:3])
    more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
    return (f"{shown}{more}: another writer's {'commit' if len(foreign) == 1 else 'commits'}"
            ", not bertpipe's (bertpipe neither rolls back nor builds on what it did not "
            "write)" + (f"; {way_out}" if way_out else ""))


class StoreFormat(ABC):
    """One on-disk format, bound to the store at `path` (local or an fsspec URL)."""

    name: ClassVar[str]
    # True when publishing a version never moves the files a reader of the previous one
    # reads (the reader need not read the provenance again to know what it opened)
    atomic_switch: ClassVar[bool]
    # True when a new version is written into the current arrays (only what differs):
    # `write_streamed_version` instead of `write_version` from staged parts
    writes_in_place: ClassVar[bool] = False
    # True when an update adds a changed text as a new row at the end and leaves its old
    # row in place, flagged (compare.py): where a write costs whole chunks of rows, an edit
    # in place would rewrite its neighbours' chunks too
    appends_edits: ClassVar[bool] = False
    # The URL schemes the format writes to (None: any fsspec URL); a local folder always
    url_schemes: ClassVar[tuple[str, ...] | None] = None
    # The entries of a store folder that are the format's (what `--overwrite` may remove,
    # with the staging area); every other entry is the user's
    own_entries: ClassVar[frozenset[str]]
    # Why the format's stores cannot be updated by an incremental run ("" where they can),
    # and why not on an object store ("" where they can there too)
    cannot_grow: ClassVar[str] = ""
    cannot_grow_on_object_store: ClassVar[str] = ""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self.location = resolve(self.path)
        self._record: dict[str, Any] | None = None
        self._record_read = False
        # the run's fencing check, made before each block of data a format writes where
        # nothing is staged (a run taken over while paused writes nothing more)
        self._fence: Callable[[], None] = _unfenced

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def fence_writes(self, check: Callable[[], None]) -> None:
        """Make `check` (LockLostError when the run no longer holds the lock) before each
        block of data this handle writes."""
        self._fence = check

    @classmethod
    @abstractmethod
    def holds_store(cls, path: str) -> bool:
        """Whether `path` holds a store of this format."""

    @classmethod
    @abstractmethod
    def is_ours(cls, root: Location) -> bool:
        """Whether `root` holds a bertpipe store of this format, complete or not (its own
        marker is there: a folder that merely looks like the format is not ours)."""

    @classmethod
    def check_location(cls, location: Location) -> None:
        """Refuse a place this format cannot write to (before anything is made)."""
        if location.local or cls.url_schemes is None:
            return
        if location.url.split("://", 1)[0] not in cls.url_schemes:
            places = " or ".join(f"an {scheme}:// URL" for scheme in cls.url_schemes)
            raise StoreError(f"output.path: {location.url}: the {cls.name} format is written "
                             f"to a local folder or {places}")

    # ---- the provenance, read once per handle ----------------------------------------

    def record(self) -> dict[str, Any] | None:
        """The provenance as stored (complete or not; None before a run starts), read
        from the store once and kept."""
        if not self._record_read:
            self._record, self._record_read = self._read_record(), True
        return self._record

    def reread(self) -> dict[str, Any] | None:
        """The provenance as stored now (another process may have switched the version)."""
        self._forget_record()
        return self.record()

    def _remember_record(self, raw: dict[str, Any]) -> None:
        """What a subclass just wrote is the record: no read needed to know it."""
        self._record, self._record_read = raw, True

    def _forget_record(self) -> None:
        """The record changed where this handle cannot see it: read it again when asked."""
        self._record_read = False

    def provenance(self) -> Provenance:
        return Provenance.from_dict(self.record() or {}, self.path)

    # ---- versions ----------------------------------------------------------------------

    def version_numbers(self) -> list[int]:
        """The versions a reader can open, newest first: the current one only, in a format
        that keeps one version (a retired one stays only for the readers that opened it)."""
        return [version_of(self.record())]

    def reader_versions(self) -> list[dict[str, Any]]:
        """What a reader without bertpipe opens for each version kept, newest first:
        `{"version": k, ...}` and the format's own name for it (a format that keeps one
        version: none, its files are the current version)."""
        return []

    def at_version(self, version: int) -> StoreFormat:
        """A handle on `version` of this store, read only."""
        if version in self.version_numbers():
            return self
        raise StoreError(f"{self.path}: no version {version}: a {self.name} store keeps its "
                         f"current version ({version_of(self.record())}) only; the icechunk "
                         "and delta formats keep earlier versions")

    def foreign_commits(self) -> list[ForeignCommit]:
        """Commits another writer made on top of bertpipe's newest one that change what it
        left (none in a format with no commit log of its own)."""
        return []

    def foreign_problem(self) -> str | None:
        """One line naming the commits of `foreign_commits` and the way out; None without
        any."""
        foreign = self.foreign_commits()
        return self._foreign_line(foreign) if foreign else None

    def refuse_foreign_commits(self) -> None:
        """Refuse (StoreError) to write over another writer's commit: bertpipe never rolls
        one back nor builds on what it did not write."""
        problem = self.foreign_problem()
        if problem:
            raise StoreError(f"{self.path}: {problem}; nothing was changed")

    def _foreign_line(self, foreign: list[ForeignCommit]) -> str:
        return describe_foreign(foreign, "")

    def gc(self, keep: int) -> tuple[list[int], int]:
        """Keep the newest `keep` versions and reclaim what only the others use; the
        versions expired and the bytes freed. A format that keeps one version removes
        what is left of retired ones (kept for the readers that opened them)."""
        self.drop_retired()
        return [], 0

    def write_record(self, raw: dict[str, Any]) -> None:
        """Store `raw` as the provenance; a complete one is sealed first with the checksum
        of every file of `data_files` (what `bertpipe verify` checks)."""
        if is_complete(raw):
            raw = self._sealed(raw, version_of(raw))
        self._write_record(raw)
        self._record, self._record_read = raw, True

    def update_provenance(self, provenance: Provenance) -> None:
        self.write_record(provenance.to_dict())

    def _sealed(self, raw: dict[str, Any], version: int) -> dict[str, Any]:
        """`raw` with the checksum of every data file of `version` recorded in it."""
        return sealed(raw, self.checksums(self._files_of(version)))

    def _sealed_with(self, raw: dict[str, Any], version: int,
                     written: dict[str, FileSum]) -> dict[str, Any]:
        """`raw` sealed with the sums of `version`'s files without reading what is known:
        the sums of the files this handle wrote (`written`), those recorded for files it
        kept, and (a store sealed before sums were kept this way) a read of any other."""
        before = recorded_checksums(self.record())
        files = self._files_of(version)
        sums = {rel: known for rel in files if (known := written.get(rel) or before.get(rel))}
        sums.update(self.checksums([rel for rel in files if rel not in sums]))
        return sealed(raw, sums)

    def checksums(self, files: Sequence[str], root: StoreFormat | None = None
                  ) -> dict[str, FileSum]:
        """The sums of those of `files` that exist."""
        sums = (root or self).file_sums(files)
        return {rel: sum_ for rel, sum_ in sums.items() if sum_ is not None}

    def file_sums(self, rels: Iterable[str]) -> dict[str, FileSum | None]:
        """`file_sum` of each of `rels` (see `checked_sizes`)."""
        return {rel: self.file_sum(rel) for rel in rels}

    def recorded_checksums(self) -> dict[str, FileSum]:
        return recorded_checksums(self.record())

    # ---- writing: the one order every format follows --------------------------------

    @abstractmethod
    def create(self, raw: dict[str, Any]) -> None:
        """Make the (empty) store, recording `raw` where the format keeps it before data."""

    def commit(self, staging: Staging, layout: Layout, provenance: Provenance) -> None:
        """Write the staged parts as the store's first version, then `provenance`."""
        target = self._version_target(0)
        self._write_data(target, staging, layout, provenance.to_dict())
        self._after_commit(provenance.to_dict())

    def write_version(self, version: int, staging: Staging, layout: Layout) -> None:
        """Write a new version's data from staged parts beside the current one; readers do
        not see it yet. Fitted parameters of post-processed views never change in an
        update, so they stay where they are."""
        self._write_data(self._version_target(version), staging, layout, None)

    def write_streamed_version(self, version: int, streamed: StreamedVersion) -> None:
        """Write a new version's data from blocks (formats that write in place); readers
        do not see it before `publish`."""
        raise NotImplementedError(f"the {self.name} format writes versions from staged parts")

    def publish(self, version: int, provenance: Provenance) -> None:
        """Make `version` current: seal `provenance` (complete, naming the version) with
        the checksums of the new version's files and switch to it. Readers that opened
        the previous version keep reading it; new readers open the new one."""
        if provenance.version != version or not provenance.complete:
            raise ValueError(f"publish: the provenance must be complete and name version "
                             f"{version}")
        previous = version_of(self.record())
        self._switch(version, provenance.to_dict(), previous)

    def _write_data(self, target: Any, staging: Staging, layout: Layout,
                    raw: dict[str, Any] | None) -> None:
        """Every level of a version, in `LEVELS_IN_WRITE_ORDER`; `raw` is the provenance
        to keep with the data where the format keeps it there (None: not yet)."""
        for level, rows in layout.levels():
            self._write_level(target, StagedLevel.of(staging, level, rows, layout.indices),
                              raw if level == "docs" else None)

    # ---- what each format supplies ---------------------------------------------------

    @abstractmethod
    def _read_record(self) -> dict[str, Any] | None: ...

    @abstractmethod
    def _write_record(self, raw: dict[str, Any]) -> None: ...

    @abstractmethod
    def _version_target(self, version: int) -> Any:
        """Where `version`'s data is written (what a killed write left there removed)."""

    @abstractmethod
    def _write_level(self, target: Any, level: StagedLevel, raw: dict[str, Any] | None
                     ) -> None: ...

    def _after_commit(self, raw: dict[str, Any]) -> None:
        """What follows the first version's data (the provenance, where not written yet)."""
        self.write_record(raw)

    @abstractmethod
    def _switch(self, version: int, raw: dict[str, Any], previous: int) -> None:
        """Seal `raw` with the new version's checksums and make it current."""

    @abstractmethod
    def _files_of(self, version: int) -> list[str]:
        """`version`'s data files (store-relative POSIX paths) that checksums cover."""

    def data_files(self) -> list[str]:
        """The current version's data files that checksums cover."""
        return self._files_of(version_of(self.record()))

    @abstractmethod
    def file_sum(self, rel: str) -> FileSum | None: ...

    @abstractmethod
    def checked_size(self, rel: str) -> int | None:
        """Bytes of `rel` that its checksum covers, from file sizes alone; None if absent."""

    def checked_sizes(self, rels: Iterable[str]) -> dict[str, int | None]:
        """`checked_size` of each of `rels` (a format whose every lookup is a round trip
        asks for them all at once)."""
        return {rel: self.checked_size(rel) for rel in rels}

    def stored_as(self, rel: str) -> str | None:
        """The file that holds `rel` where it is not `rel` itself (an Icechunk chunk key's
        chunk file), for messages; None otherwise."""
        return None

    def whole_by_total(self, recorded: Mapping[str, FileSum]) -> set[str]:
        """Recorded files shown present with their sizes by a total over many of them,
        without a lookup each (none here: every file is looked up)."""
        return set()

    @abstractmethod
    def row_counts(self) -> dict[str, tuple[str, int]]:
        """Rows of every stored array (Zarr) or file (Parquet): name -> (level, rows)."""

    @abstractmethod
    def open_datasets(self, dask: bool = True) -> tuple[xr.Dataset, xr.Dataset | None]:
        """The current version's docs and chunks levels, lazily: as dask arrays, or with
        `dask=False` read by xarray's own lazy indexing where the format can (for a command
        that reads a few whole columns once and need not import dask.array)."""

    @abstractmethod
    def open_tokens(self, dask: bool = True) -> xr.Dataset | None: ...

    @abstractmethod
    def add_view(self, source: str, name: str, fn: Callable[[np.ndarray], np.ndarray],
                 levels: Sequence[str]) -> None: ...

    @abstractmethod
    def write_params(self, name: str, params: dict[str, np.ndarray]) -> None: ...

    @abstractmethod
    def read_params(self, name: str) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def recover(self) -> None:
        """Finish a switch a killed update began (nothing where the switch is one step)."""

    @abstractmethod
    def drop_retired(self) -> None:
        """Remove what is left of versions before the current one (kept for the readers
        that opened them), and of a version a killed update wrote and never published."""


def _unfenced() -> None:
    """No fencing: a handle written outside a run (tests, notebooks)."""


def column_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """fixed_size_list<float, D> column as an (N, D) array, zero-copy where possible."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    width = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)


def with_store_token_offsets(parts: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """Docs parts (in row order) with `token_offset` moved from the partition's first
    token to the store's: each part's offsets plus the tokens of the parts before it."""
    before = 0
    for table in parts:
        if "token_offset" in table.column_names:
            local = table.column("token_offset").to_numpy()
            table = table.set_column(table.column_names.index("token_offset"), "token_offset",
                                     pa.array(local + before))
            before += int(pc.sum(table.column("token_count")).as_py() or 0)
        yield table
