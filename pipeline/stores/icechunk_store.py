"""Icechunk store: the Zarr layout of `zarr_store` inside an Icechunk repository, where
every write is a transaction and every version a snapshot.

    <store>/repo/         an Icechunk repository, branch `main`, holding
      docs/ chunks/ tokens/ post/   the same groups and arrays as the Zarr format
      (root attribute `bertpipe`)   the provenance, inside the snapshot it describes
    <store>/_bertpipe/    the staging area (and the lock file beside it), outside the
                          repository: Icechunk makes a repository only in a clean folder

A handle reads the branch's head once and stays on that snapshot: what it opens is one
committed version, whatever commits after (snapshot isolation). Writes go to one session
and become visible in one commit, the provenance with them: a killed run leaves the branch
where it was. An update (a new version) writes into the current arrays only the chunks
whose values changed, appends the new rows, and commits; earlier versions stay readable
(`open_store(path, version=k)`) until `bertpipe gc` expires them.

Arrays have a fixed number of rows per chunk (`ICECHUNK_ROWS_PER_CHUNK` for vectors, a
multiple of it for flat arrays; not grown with the store as in the plain Zarr format), so a
store that grows keeps its chunk grid and an update rewrites only the chunks holding
changed rows. Checksums are kept as in the Zarr format
(Icechunk records no checksum of its own chunks): the SHA-256 of every chunk as stored,
by Zarr key; a commit hashes the chunks it writes and keeps the recorded sums of the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import warnings
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import icechunk
import numpy as np
import pyarrow as pa
import zarr
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import WrapperStore

from ..errors import StoreError
from ..io.location import Location, S3Access, resolve
from .base import ForeignCommit, StreamedVersion, describe_foreign
from .columns import MISSING_ATTRIBUTE, StoredColumns
from .icechunk_files import RepoFile, chunk_files, damage_error, sizes_in
from .integrity import CHUNK_DIR, VerifiedStore, array_of, files_by_array
from .provenance import FileSum, is_complete, version_of
from .staging import STAGING_DIR
from .zarr_store import (
    DATA_DIRS,
    LEVEL_DIMS,
    ZarrFormat,
    column_values,
    create_array,
    describe_arrays,
    write_params_group,
    write_view,
)

# Icechunk warns on every open of a repository on local disk that concurrent commits are
# unsafe there; bertpipe's lease lock lets one writer at a time commit (stores/lock.py), so
# the warning says nothing to a user. Its own ICECHUNK_LOG setting, when given, wins.
if "ICECHUNK_LOG" not in os.environ:
    icechunk.set_logs_filter("icechunk=error")

BRANCH = "main"
# Rows per chunk of every array, whatever the store's size: a fixed grid is what lets an
# update append rows and rewrite only the chunks that changed. Copy-on-write is per chunk,
# so a changed row costs its whole chunk: with changes at random rows, a share f of rows
# changed rewrites about 1 - exp(-f * rows) of the chunks (f = 0.1%: 22% at 256 rows, 64% at
# 1,024). 256 rows of a 384-wide float32 view are 393 KB
# before compression, still a sensible object-store request; readers see blocks of
# ROWS_PER_CHUNK rows (zarr_store._lazy), not one task per chunk.
ICECHUNK_ROWS_PER_CHUNK = 256
# A flat array (ids, digests, counts, flags, carried values: one value a row) has this many
# times as many rows per chunk: at 256 rows its chunks are 256 bytes to 16 KB, and zarr's
# cost per chunk read does not shrink with the chunk, so reading such an array whole (an
# update reads seven) would cost thousands of tiny reads at a million rows. Its chunks are
# small whatever edits rewrite: a million rows of `present` compress to kilobytes. Stores
# made with flat arrays of 256 rows a chunk keep them (the factor divides every writer's
# block).
ICECHUNK_FLAT_FACTOR = 32
# `gc` deletes objects no snapshot refers to once they are this old: chunks a run killed or
# fenced off wrote and never committed. Younger ones are left: another process's session
# may still commit them (Icechunk's garbage collection cannot tell an orphan from those).
ORPHAN_AGE_S = 3600.0
VERSION_KEY = "bertpipe_version"  # in each commit's metadata: the store version it holds
COMPLETE_KEY = "bertpipe_complete"
REPOSITORY = "repo"  # the repository's folder inside the store


@dataclass(frozen=True)
class VersionInfo:
    """One store version readers can open: the newest snapshot holding it."""

    version: int
    snapshot: str
    written_at: datetime
    message: str


def storage_of(store: Location) -> icechunk.Storage:
    """The Icechunk storage of the store at a local folder or an s3:// URL (with its
    storage options)."""
    location = store.child(REPOSITORY)
    if location.local:
        return icechunk.local_filesystem_storage(location.path)
    IcechunkFormat.check_location(store)
    s3 = S3Access.of(location)
    return icechunk.s3_storage(
        bucket=s3.bucket, prefix=s3.prefix, endpoint_url=s3.endpoint, region=s3.region,
        allow_http=s3.plain_http, force_path_style=bool(s3.endpoint),
        access_key_id=s3.key, secret_access_key=s3.secret, session_token=s3.token,
        from_env=None if s3.key else True)


def is_repository(store: Location) -> bool:
    return store.child(REPOSITORY, "refs", f"branch.{BRANCH}", "ref.json").exists()


def _is_panic(exc: BaseException) -> bool:
    """A Rust panic inside Icechunk, raised by pyo3 as a BaseException."""
    return type(exc).__name__ == "PanicException"


@contextlib.contextmanager
def icechunk_errors(path: str) -> Iterator[None]:
    """Icechunk's errors and panics reading or writing the repository, as a StoreError
    naming the file (a damaged repository), never a traceback or an abort."""
    try:
        yield
    except StoreError:
        raise
    except icechunk.ConflictError:
        raise
    except icechunk.IcechunkError as exc:
        raise damage_error(path, REPOSITORY, exc) from None
    except BaseException as exc:
        if _is_panic(exc):
            raise damage_error(path, REPOSITORY, exc) from None
        raise


class _GuardedStore(WrapperStore[Store]):
    """An Icechunk session's store whose errors and panics are StoreErrors naming the
    file (reads happen late, in zarr's loop: dask tasks, lazy arrays)."""

    def __init__(self, store: Store, label: str):
        super().__init__(store)
        self._label = label

    def _with_store(self, store: Store) -> _GuardedStore:
        return _GuardedStore(store, self._label)

    def __reduce__(self) -> tuple[Any, ...]:  # Dask workers get a copy of the graph
        return (_GuardedStore, (self._store, self._label))

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        with icechunk_errors(self._label):
            return await self._store.get(key, prototype, byte_range)

    async def exists(self, key: str) -> bool:
        with icechunk_errors(self._label):
            return await self._store.exists(key)

    async def getsize(self, key: str) -> int:
        with icechunk_errors(self._label):
            return await self._store.getsize(key)

    async def getsize_prefix(self, prefix: str) -> int:
        with icechunk_errors(self._label):
            return await self._store.getsize_prefix(prefix)

    async def set(self, key: str, value: Buffer) -> None:
        with icechunk_errors(self._label):
            await self._store.set(key, value)

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        return self._guarded(self._store.list_dir(prefix))

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        return self._guarded(self._store.list_prefix(prefix))

    def list(self) -> AsyncIterator[str]:
        return self._guarded(self._store.list())

    async def _guarded(self, keys: AsyncIterator[str]) -> AsyncIterator[str]:
        with icechunk_errors(self._label):
            async for key in keys:
                yield key


class _HashingStore(WrapperStore[Store]):
    """A store that records the checksum of every value written through it (what a commit
    seals, without reading back what it wrote)."""

    def __init__(self, store: Store, written: dict[str, FileSum]):
        super().__init__(store)
        self.written = written

    def _with_store(self, store: Store) -> _HashingStore:
        return _HashingStore(store, self.written)

    async def set(self, key: str, value: Buffer) -> None:
        raw = value.to_bytes()
        self.written[key] = FileSum(hashlib.sha256(raw).hexdigest(), len(raw))
        await self._store.set(key, value)

    async def delete(self, key: str) -> None:
        self.written.pop(key, None)
        await self._store.delete(key)


class IcechunkFormat(ZarrFormat):
    """The Icechunk store format (see the module docstring)."""

    name = "icechunk"
    url_schemes = ("s3",)  # its Rust storage reaches object stores through S3 only
    # a snapshot never changes: a reader stays on the one it opened
    atomic_switch = True
    writes_in_place = True
    appends_edits = True

    def __init__(self, path: str, version: int | None = None) -> None:
        super().__init__(path)
        self.version_wanted = version
        self._repo: icechunk.Repository | None = None
        self._reader: icechunk.Session | None = None
        self._writer: icechunk.Session | None = None
        self._written: dict[str, FileSum] = {}
        self._ours_snapshot = ""  # bertpipe's newest snapshot (set by foreign_commits)
        self._chunk_map: dict[str, RepoFile] | None = None  # chunk key -> its file
        self._file_sizes: dict[str, int] | None = None  # chunk file name -> bytes there

    own_entries = frozenset({REPOSITORY, "index", STAGING_DIR})
    cannot_grow = ""  # a commit is a new snapshot: readers of the last one keep it

    @classmethod
    def holds_store(cls, path: str) -> bool:
        return is_repository(resolve(path))

    @classmethod
    def is_ours(cls, root: Location) -> bool:
        """An Icechunk repository whose branch head carries bertpipe's provenance."""
        return is_repository(root) and \
            cls(root.url if not root.local else root.path).record() is not None

    # ---- the repository and its sessions -----------------------------------------

    def repository(self) -> icechunk.Repository:
        if self._repo is None:
            with warnings.catch_warnings(), icechunk_errors(self.path):
                warnings.simplefilter("ignore")
                self._repo = icechunk.Repository.open(storage_of(self.location))
        return self._repo

    def _store(self) -> Store:
        """The store of the session this handle reads or writes, its errors StoreErrors."""
        return _GuardedStore(self._session().store, self.path)

    def _session(self) -> icechunk.Session:
        """The session this handle writes in, or else the snapshot it reads."""
        if self._writer is not None:
            return self._writer
        if self._reader is None:
            self._reader = self._open_reader()
        return self._reader

    def _open_reader(self) -> icechunk.Session:
        repo = self.repository()
        if self.version_wanted is None:
            with icechunk_errors(self.path):
                session = repo.readonly_session(branch=BRANCH)
                # the branch's snapshot read now: a snapshot file gone is named here, not
                # taken for a store with no provenance yet
                repo.lookup_snapshot(session.snapshot_id)
            return session
        for info in self.versions():
            if info.version == self.version_wanted:
                return repo.readonly_session(snapshot_id=info.snapshot)
        held = ", ".join(str(v.version) for v in self.versions()) or "none"
        raise StoreError(f"{self.path}: no version {self.version_wanted} (versions kept: "
                         f"{held})")

    def _begin(self) -> icechunk.Session:
        if self._writer is None:
            if self.version_wanted is not None:
                raise StoreError(f"{self.path}: version {self.version_wanted} is read only")
            self.refuse_foreign_commits()  # never built on (nor reset over)
            with icechunk_errors(self.path):
                self._writer = self.repository().writable_session(BRANCH)
            self._written = {}
        return self._writer

    def _commit(self, raw: dict[str, Any]) -> None:
        """Commit what this handle wrote, with `raw` as the provenance, in one step."""
        session = self._begin()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zarr.open_group(_GuardedStore(session.store, self.path), mode="a",
                            use_consolidated=False).update_attributes({"bertpipe": raw})
        message = f"bertpipe: version {version_of(raw)}" + \
            (" (complete)" if is_complete(raw) else "")
        try:
            with icechunk_errors(self.path):
                session.commit(message, metadata={VERSION_KEY: version_of(raw),
                                                  COMPLETE_KEY: is_complete(raw)})
        except icechunk.ConflictError as exc:
            raise StoreError(f"{self.path}: another run committed to the store meanwhile "
                             f"({exc}); nothing of this run was committed") from None
        self._writer, self._reader = None, None
        self._chunk_map, self._file_sizes = None, None  # of the snapshot read before
        self._remember_record(raw)

    # ---- another writer's commits --------------------------------------------------

    def foreign_commits(self) -> list[ForeignCommit]:
        """The commits on the branch after bertpipe's newest one (each of bertpipe's carries
        `bertpipe_version` in its metadata), unless together they change nothing of what it
        left (Icechunk's diff is empty). Oldest first."""
        with icechunk_errors(self.path):
            return self._foreign_commits()

    def _foreign_commits(self) -> list[ForeignCommit]:
        newer: list[icechunk.SnapshotInfo] = []
        ours = None
        for info in self.repository().ancestry(branch=BRANCH):
            if isinstance((info.metadata or {}).get(VERSION_KEY), int):
                ours = info
                break
            if info.parent_id is not None:  # the repository's empty first snapshot is none
                newer.append(info)
        if not newer or ours is None or _unchanged(self.repository().diff(
                from_snapshot_id=ours.id, to_branch=BRANCH)):
            return []
        self._ours_snapshot = ours.id
        return [ForeignCommit(f"branch {BRANCH}", f"snapshot {info.id}", repr(info.message),
                              _author(info)) for info in reversed(newer)]

    def _foreign_line(self, foreign: list[ForeignCommit]) -> str:
        head = foreign[-1].version.split()[-1]
        return describe_foreign(foreign, (
            f"keep it on a branch of its own with repo.create_branch('kept', '{head}'), give "
            f"the branch back to bertpipe with repo.reset_branch('{BRANCH}', "
            f"'{self._ours_snapshot}'), and rerun; or rebuild the store with --overwrite "
            "(which drops it)"))

    # ---- the provenance ----------------------------------------------------------

    def create(self, raw: dict[str, Any]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            storage = storage_of(self.location)
            if icechunk.Repository.exists(storage):
                self._repo = icechunk.Repository.open(storage)
            else:
                self._repo = icechunk.Repository.create(storage)
        self._commit(raw)

    def _read_record(self) -> dict[str, Any] | None:
        store = self._store()  # a damaged repository is named, not taken for an empty one
        try:
            group = zarr.open_group(store, mode="r")
        except (FileNotFoundError, ValueError, zarr.errors.GroupNotFoundError):
            return None
        prov = group.attrs.get("bertpipe")
        return dict(prov) if isinstance(prov, dict) else None

    def _write_record(self, raw: dict[str, Any]) -> None:
        self._commit(raw)

    def _sealed(self, raw: dict[str, Any], version: int) -> dict[str, Any]:
        """Arrays described, then sealed: the sums of what this session wrote, the sums
        recorded before for chunks it left alone, and (stores begun before sums were
        kept this way) a read of any other."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            describe_arrays(self._root(), raw)
        return self._sealed_with(raw, version, self._written)

    # ---- writing -----------------------------------------------------------------

    def _root(self) -> Any:
        session = self._begin()
        return zarr.open_group(_HashingStore(_GuardedStore(session.store, self.path),
                                             self._written), mode="a", use_consolidated=False)

    def _group(self, writable: bool = False) -> Any:
        if writable:
            return self._root()
        store = VerifiedStore(self._store(), self.recorded_checksums(), self.path)
        return zarr.open_group(store, mode="r", use_consolidated=False)

    def _prefix(self) -> str:
        return ""

    def _version_target(self, version: int) -> Any:
        return self._root()  # a version's arrays are the current ones, updated in place

    def _write_arrays(self, target: Any, level: str, parts: Iterator[pa.Table], rows: int,
                      columns: StoredColumns, widths: dict[str, int]) -> None:
        """A level's arrays made equal to its parts, writing only the chunks that differ."""
        updater = _LevelUpdater(target, level, rows, columns, widths, self._fence)
        for table in parts:
            updater.add(table)
        updater.close()

    def write_streamed_version(self, version: int, streamed: StreamedVersion) -> None:
        """The new version's blocks written into the current arrays (only the chunks whose
        values differ; chunks of kept rows neither read nor written), in this handle's
        session; `publish` commits them."""
        root = self._root()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            updaters = {level: _LevelUpdater(root, level, rows, streamed.columns[level],
                                             streamed.widths[level], self._fence)
                        for level, rows in streamed.rows.items()}
            unwritten = {level: updater.leave_same(streamed.same[level])
                         for level, updater in updaters.items()}
            for block in streamed.blocks(unwritten):
                for level, table in block.items():
                    if table is not None and level in updaters:
                        updaters[level].add(table)
            for updater in updaters.values():
                updater.close()

    def _after_commit(self, raw: dict[str, Any]) -> None:
        self.write_record(raw)

    def _switch(self, version: int, raw: dict[str, Any], previous: int) -> None:
        self._commit(self._sealed(raw, version))

    def recover(self) -> None:
        """Nothing to finish: a commit is one step."""

    def drop_retired(self) -> None:
        """Earlier versions stay readable until `gc` expires them; an update that never
        committed left nothing in the repository (its session is gone with it)."""

    def write_params(self, name: str, params: dict[str, np.ndarray]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            write_params_group(self._root(), name, params)

    def add_view(self, source: str, name: str, fn: Callable[[np.ndarray], np.ndarray],
                 levels: Sequence[str]) -> None:
        """Write `name` = fn(`source`) block by block at each level, in this handle's
        session (nobody sees it before the commit). A view replaced in place is written
        under a temporary name, then copied over the source (Icechunk 1 has no rename; the
        width may change, as whitening to fewer dimensions does)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root = self._root()
            for level in levels:
                group = root[level]
                target = f".{name}.tmp" if name == source else name
                write_view(group, source, target, name, fn, ICECHUNK_ROWS_PER_CHUNK)
                if target != name:
                    write_view(group, target, name, name, lambda block: block,
                               ICECHUNK_ROWS_PER_CHUNK)
                    del group[target]

    # ---- reading -----------------------------------------------------------------

    def _files_of(self, version: int) -> list[str]:
        """Every key of the arrays (chunks and array metadata) in the session's snapshot."""
        with icechunk_errors(self.path):
            keys = _session_keys(self._session())
        return sorted(key for key in keys if key.split("/", 1)[0] in DATA_DIRS
                      and not any(p.startswith(".") for p in key.split("/")))

    def file_sum(self, rel: str) -> FileSum | None:
        return self.file_sums([rel])[rel]

    def file_sums(self, rels: Iterable[str]) -> dict[str, FileSum | None]:
        store = self._store()
        gone = self._files_gone()  # not asked of Icechunk: it would fail on them

        async def read(rel: str) -> FileSum | None:
            if rel in gone:
                return None
            value = await store.get(rel, default_buffer_prototype())
            if value is None:
                return None
            raw = value.to_bytes()
            return FileSum(hashlib.sha256(raw).hexdigest(), len(raw))

        return _each_key(read, rels)

    def checked_size(self, rel: str) -> int | None:
        return self.checked_sizes([rel])[rel]

    def checked_sizes(self, rels: Iterable[str]) -> dict[str, int | None]:
        session = self._session()
        store = self._store()
        keys = list(rels)
        files, there = self._chunk_files(), self._sizes_there()
        # which keys exist (an unwritten chunk key has size 0 too): for many keys, from the
        # snapshot's listing rather than one more call each
        with icechunk_errors(self.path):
            held = set(_session_keys(session)) if len(keys) > KEYS_IN_FLIGHT else None

        async def size(rel: str) -> int | None:
            if rel in files and there.get(files[rel].name) != files[rel].size:
                return there.get(files[rel].name)  # its file is gone or not whole
            exists = rel in held if held is not None else await store.exists(rel)
            return int(await store.getsize(rel)) if exists else None

        return _each_key(size, keys)

    def whole_by_total(self, recorded: Mapping[str, FileSum]) -> set[str]:
        """The files of each array whose sizes, as Icechunk's manifests give them, add up
        to what was recorded (one call per array, not one per key: a store holds as many
        keys as chunks). A missing or truncated chunk changes its
        array's total, whose files are then looked up one by one, so the damaged one is
        named, as is an array that is gone; a group's metadata is always looked up (its total
        counts its arrays'). Two changes that cancel within one array pass this check; each
        chunk's checksum is still checked when it is read."""
        by_array = {array: rels for array, rels in files_by_array(recorded).items()
                    if any(CHUNK_DIR in rel for rel in rels)}  # a group holds no chunk
        store = self._session().store
        files, there = self._chunk_files(), self._sizes_there()
        # a chunk file gone or cut short: its array's keys are looked up one by one
        short = {array_of(rel) for rel, f in files.items() if rel in recorded
                 and there.get(f.name) != f.size}
        by_array = {array: rels for array, rels in by_array.items() if array not in short}

        async def total(array: str) -> int | None:
            try:
                return int(await store.getsize_prefix(array))
            except icechunk.IcechunkError:  # no such node: its keys are looked up
                return None

        totals = _each_key(total, by_array)
        return {rel for array, rels in by_array.items()
                if totals[array] == sum(recorded[rel].size for rel in rels) for rel in rels}

    def _plain_root(self) -> Any:
        return zarr.open_group(self._store(), mode="r", use_consolidated=False)

    # ---- the repository's files ----------------------------------------------------

    def _chunk_files(self) -> dict[str, RepoFile]:
        """Chunk key -> the file holding it, in the snapshot this handle reads; every
        manifest checked whole first (icechunk_files)."""
        if self._chunk_map is None:
            session = self._session()
            with icechunk_errors(self.path):
                self._chunk_map = chunk_files(self.repository(), session.snapshot_id,
                                              self.location, REPOSITORY, self.path)
        return self._chunk_map

    def _sizes_there(self) -> dict[str, int]:
        """Each chunk file's size as the repository's folder lists it (one listing)."""
        if self._file_sizes is None:
            self._file_sizes = sizes_in(self.location.child(REPOSITORY, "chunks"))
        return self._file_sizes

    def _files_gone(self) -> set[str]:
        files, there = self._chunk_files(), self._sizes_there()
        return {rel for rel, f in files.items() if f.name not in there}

    def stored_as(self, rel: str) -> str | None:
        found = self._chunk_files().get(rel)
        return found.rel if found else None

    def version_numbers(self) -> list[int]:
        return [v.version for v in self.versions()]

    def reader_versions(self) -> list[dict[str, Any]]:
        """Each kept version's snapshot (`repo.readonly_session(snapshot_id=...)`)."""
        return [{"version": v.version, "snapshot": v.snapshot} for v in self.versions()]

    def at_version(self, version: int) -> IcechunkFormat:
        at = IcechunkFormat(self.path, version)
        at._repo = self._repo
        at._open_reader_now()
        return at

    def _open_reader_now(self) -> None:
        self._reader = self._open_reader()

    def versions(self) -> list[VersionInfo]:
        """The complete versions the branch's history holds, newest first (a version's
        newest snapshot: post-processing commits a version again)."""
        seen: dict[int, VersionInfo] = {}
        with icechunk_errors(self.path):
            history = list(self.repository().ancestry(branch=BRANCH))
        for info in history:
            meta = info.metadata or {}
            version = meta.get(VERSION_KEY)
            if isinstance(version, int) and meta.get(COMPLETE_KEY) and version not in seen:
                seen[version] = VersionInfo(version, info.id, info.written_at, info.message)
        return sorted(seen.values(), key=lambda v: -v.version)

    def gc(self, keep: int) -> tuple[list[int], int]:
        """Expire every version but the newest `keep` and delete what only they used, and
        the orphans of runs that never committed (killed, or fenced off after a pause:
        objects no snapshot refers to, older than ORPHAN_AGE_S); the versions expired and
        the bytes freed."""
        held = self.versions()
        if keep < 1:
            raise StoreError("--keep: at least 1 (the current version)")
        self.refuse_foreign_commits()  # an expiry would rewrite the history it is in
        repo = self.repository()
        # an object younger than this may belong to another process's session that has
        # not committed yet (bertpipe's own writers are held off by the lock gc holds)
        cutoff = datetime.now(UTC) - timedelta(seconds=ORPHAN_AGE_S)
        with icechunk_errors(self.path):
            if len(held) > keep:
                oldest_kept = held[keep - 1].written_at
                repo.expire_snapshots(older_than=oldest_kept)
                cutoff = max(cutoff, oldest_kept)
            summary = repo.garbage_collect(cutoff)
        return [v.version for v in held[keep:]], int(summary.bytes_deleted)


def _unchanged(diff: icechunk.Diff) -> bool:
    return not any(getattr(diff, name) for name in (
        "new_groups", "new_arrays", "deleted_groups", "deleted_arrays", "updated_groups",
        "updated_arrays", "updated_chunks"))


def _author(info: icechunk.SnapshotInfo) -> str:
    """Who made a commit, as far as its metadata says."""
    meta = info.metadata or {}
    for key in ("author", "user", "writer", "tool"):
        if meta.get(key):
            return str(meta[key])
    return f"a writer that did not name itself, metadata {meta}" if meta else \
        "a writer that did not name itself"


def _session_keys(session: icechunk.Session) -> list[str]:
    """Every key of a session's snapshot: each group's and array's metadata and each
    written chunk, from Icechunk's chunk coordinates in batches (its store's `list()` hands
    keys to Python one at a time, which grows with the chunks of the store)."""
    root = zarr.open_group(session.store, mode="r", use_consolidated=False)
    keys = ["zarr.json"]
    arrays: list[tuple[str, Any]] = []

    def walk(group: Any, prefix: str) -> None:
        for name, member in group.members():
            path = f"{prefix}{name}"
            keys.append(f"{path}/zarr.json")
            if isinstance(member, zarr.Array):
                arrays.append((path, member.metadata))
            else:
                walk(member, f"{path}/")

    async def chunks() -> list[str]:
        return [f"{path}/{metadata.encode_chunk_key(coords)}" for path, metadata in arrays
                async for coords in session.chunk_coordinates(f"/{path}", batch_size=10_000)]

    walk(root, "")
    return keys + sync(chunks())


class _LevelUpdater:
    """A level's arrays made equal to the tables added (n rows, in row order), writing only
    the chunks whose values differ from what the arrays hold: an array that exists with
    the same type and width is resized (rows appended or cut), else created anew. Tables
    are regrouped into blocks of whole chunks (a chunk is compared and written once)."""

    def __init__(self, root: Any, level: str, n: int, columns: StoredColumns,
                 widths: dict[str, int], fence: Callable[[], None]):
        self.fence = fence  # made before each block: Icechunk stores a chunk as it is set
        self.group = root.require_group(level)
        self.level, self.n, self.columns, self.widths = level, n, columns, widths
        self.arrays: dict[str, tuple[Any, bool]] = {}
        self.pending: list[pa.Table] = []
        self.held = 0
        self.offset = 0
        self.written = False
        self.left: dict[str, np.ndarray] = {}  # column -> rows of chunks left alone

    def leave_same(self, same: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per column whose array is kept (same type, width and chunking), the rows of its
        chunks holding nothing but rows whose values are the same (`StreamedVersion`):
        those cells are equal by construction, so they are neither read nor written."""
        empty = self.columns.schema.empty_table()
        for name in sorted(set(same) & set(empty.column_names)):
            sample = column_values(self.columns, name, empty.column(name))
            if name in self.widths:  # a string: its width decides whether the array fits
                sample = sample.astype(f"<U{self.widths[name]}")
            if sample.dtype.kind not in "biufU":
                continue  # no fixed width: compared as it comes
            self.arrays[name] = _array_for(self.group, name, sample, self.n,
                                           LEVEL_DIMS[self.level], self.columns)
            array, fresh = self.arrays[name]
            if not fresh:
                self.left[name] = _whole_chunks(same[name], array.chunks[0])
        return dict(self.left)

    def add(self, table: pa.Table) -> None:
        self.pending.append(self.columns.conform(table))
        self.held += table.num_rows
        rows = _block_rows()
        if self.held < rows:
            return
        block = pa.concat_tables(self.pending)
        whole = self.held - self.held % rows
        self._write(block.slice(0, whole))
        self.pending, self.held = [block.slice(whole)], self.held - whole

    def close(self) -> None:
        """Write what is left (a level of no rows still gets its empty arrays)."""
        if self.held or (self.pending and not self.written):
            self._write(pa.concat_tables(self.pending))
        self.pending, self.held = [], 0

    def _write(self, table: pa.Table) -> None:
        # a run taken over while paused writes no chunk (each would be an orphan object)
        self.fence()
        dim = LEVEL_DIMS[self.level]
        for name in table.column_names:
            if name == "row":
                continue
            values = column_values(self.columns, name, table.column(name))
            if name in self.widths:
                values = values.astype(f"<U{self.widths[name]}")
            if name not in self.arrays:
                self.arrays[name] = _array_for(self.group, name, values, self.n, dim,
                                               self.columns)
            array, fresh = self.arrays[name]
            if values.dtype.kind == "U" and array.dtype != values.dtype:
                values = values.astype(array.dtype)  # a wider stored width is kept
            if fresh:  # nothing to compare with
                array[self.offset : self.offset + len(values)] = values
            else:
                left = self.left[name][self.offset : self.offset + len(values)] \
                    if name in self.left else None
                _write_changed(array, self.offset, values, left)
        self.offset += table.num_rows
        self.written = True


def _block_rows() -> int:
    """Rows a level's writer holds before it writes: a multiple of every array's chunk."""
    return ICECHUNK_ROWS_PER_CHUNK * ICECHUNK_FLAT_FACTOR


def _chunk_rows(sample: np.ndarray) -> int:
    """Rows per chunk of a new array holding values like `sample`'s."""
    return ICECHUNK_ROWS_PER_CHUNK * (ICECHUNK_FLAT_FACTOR if sample.ndim == 1 else 1)


def _whole_chunks(kept: np.ndarray, rows: int) -> np.ndarray:
    """`kept` where a chunk of `rows` rows holds only kept rows, False elsewhere."""
    starts = np.arange(0, len(kept), rows)
    if not len(starts):
        return np.zeros(0, bool)
    whole = np.logical_and.reduceat(kept, starts)
    return np.repeat(whole, np.diff(np.append(starts, len(kept))))


def _array_for(group: Any, name: str, sample: np.ndarray, n: int, dim: str,
               columns: StoredColumns) -> tuple[Any, bool]:
    """The existing array `name` resized to `n` rows when it can hold `sample`'s values
    and marks nulls as the new version does, else a new one (True: new, nothing in it
    yet). A string column that gains or loses nulls is made anew: kept, its stored marker
    would not say which cells are nulls."""
    if name in group:
        array = group[name]
        wider = sample.dtype.kind == "U" and array.dtype.kind == "U" and \
            array.dtype.itemsize >= sample.dtype.itemsize
        same = (array.dtype == sample.dtype or wider or (sample.dtype.kind in "OT"
                                                         and array.dtype.kind in "OT")) \
            and array.shape[1:] == sample.shape[1:] \
            and _block_rows() % array.chunks[0] == 0 \
            and array.attrs.get(MISSING_ATTRIBUTE) == \
            columns.zarr_attributes(name).get(MISSING_ATTRIBUTE)
        if same:
            if array.shape[0] != n:
                array.resize((n, *array.shape[1:]))
            return array, False
    array = create_array(group, name, sample, n, dim, _chunk_rows(sample))
    if attributes := columns.zarr_attributes(name):
        array.update_attributes(attributes)
    return array, True


def _write_changed(array: Any, offset: int, values: np.ndarray,
                   left: np.ndarray | None = None) -> None:
    """Write `values` at rows offset.. (a chunk boundary), only the chunks that change.
    For a column with `left` given that is known without reading: a chunk `left` marks
    whole is equal by construction (skipped), any other holds a row whose value is new,
    moved or changed (written). Any other column is compared with what is stored. Chunks
    are read, then written, each set in one call into zarr's loop, concurrently (a call per
    chunk would pay a hand-off between threads for every chunk)."""
    rows = array.chunks[0]
    starts = range(0, len(values), rows)

    async def held(start: int) -> np.ndarray | None:
        try:
            at = offset + start
            return np.asarray(await array.async_array.getitem(
                slice(at, at + len(values[start : start + rows]))))
        except (ValueError, KeyError):
            return None

    async def write(start: int) -> None:
        block = values[start : start + rows]
        await array.async_array.setitem(slice(offset + start, offset + start + len(block)), block)

    if left is not None:
        changed = [start for start in starts if not left[start]]
    else:
        stored = _each_key(held, starts)
        changed = [start for start, was in stored.items()
                   if was is None or not _equal(was, values[start : start + rows])]
    _each_key(write, changed)


def _equal(held: np.ndarray, new: np.ndarray) -> bool:
    if held.shape != new.shape:
        return False
    if held.dtype.kind == "f" and new.dtype.kind == "f":
        return bool(np.array_equal(held, new, equal_nan=True))
    return bool(np.array_equal(held.astype(object), new.astype(object)))


# keys asked of the store at once: enough to hide each lookup's latency (a round trip on an
# object store), few enough that reading chunks for their sums holds only this many at a time
KEYS_IN_FLIGHT = 64
K = TypeVar("K")
T = TypeVar("T")


def _each_key(ask: Callable[[K], Awaitable[T]], rels: Iterable[K]) -> dict[K, T]:
    """`ask` of every key in one call into zarr's event loop (a hand-off to it per key
    costs more than Icechunk's own lookup), at most KEYS_IN_FLIGHT at a time."""
    keys = list(rels)
    if not keys:
        return {}

    async def each() -> list[T]:
        gate = asyncio.Semaphore(KEYS_IN_FLIGHT)

        async def one(rel: K) -> T:
            async with gate:
                return await ask(rel)

        return list(await asyncio.gather(*(one(rel) for rel in keys)))

    return dict(zip(keys, sync(each()), strict=True))
