"""Zarr v3 store: `ids`, `docs/*`, `chunks/*`, `tokens/*` arrays and the `bertpipe` root
attribute.

The commit is the only writer of the final arrays and walks the parts in row order, so
no two writers ever share a chunk; `complete: true` is written after every array, with
the checksum of every array file, and metadata is consolidated last. Vector arrays have
NaN as their fill value, and reads check each chunk against its checksum before
decoding (`integrity.VerifiedStore`), so a damaged chunk is an error naming the array.

A Zarr store is written once: incremental runs are refused (`spec.check_incremental`),
because after an update a plain reader would have to find the current version's folder.
`output.format: icechunk` (icechunk_store.py) is the Zarr store that grows. Stores an
earlier bertpipe updated keep each version in `versions/<n>/`, named by the provenance's
`version`: they are read as they are, and `bertpipe gc` removes what is left of retired
versions.

A store path may be an fsspec URL: the arrays are then read and written through zarr's
`FsspecStore` with the storage options registered for the URL (`fs.resolve`). Object
stores have no rename, so a view replaced in place is written under a temporary name and
its keys copied (server side) to the final name; the provenance, written last, is what
makes any of it part of the store.
"""

from __future__ import annotations

import atexit
import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import xarray as xr
import zarr
import zarr.codecs
from xarray.backends import BackendArray
from xarray.core import indexing
from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore

from ..errors import StoreError
from ..io.location import Location, filesystem, protocol_of, resolve
from .base import StagedLevel, StoreFormat, column_matrix
from .columns import MISSING_ATTRIBUTE, StoredColumns, strings_as_objects
from .integrity import VerifiedStore, file_sum
from .provenance import FileSum, version_of
from .staging import STAGING_DIR

ROWS_PER_CHUNK = 8192
# xarray makes a 1-D array named like its dimension an index, read whole on open. The docs
# level's dimension is `id` on disk for that reason: `xr.open_zarr(p, group="docs")
# .sel(id=...)` works as it comes (the package renames it to `doc` when it opens a store).
# The tokens level's is `piece`, not `token`: the word-piece strings should not be read
# whole on every open.
LEVEL_DIMS = {"docs": "id", "chunks": "chunk", "tokens": "piece"}
# the tokens level's fields that Zarr does not repeat: a token's document id is ids[doc]
TOKEN_FIELDS_NOT_STORED = ["id"]
# Writers open with use_consolidated=False: the consolidated metadata is rewritten once, last,
# and a writer must see the groups added since.
COMPRESSOR = zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle")
# Folders holding the arrays that checksums cover (not the root zarr.json: it holds the
# provenance itself; not index/ or the staging area: they are rebuilt, never read as data).
DATA_DIRS = ("ids", "docs", "chunks", "tokens", "post")
# What a damaged chunk can make a codec raise when no checksum caught it first (a store
# written before checksums existed): blosc RuntimeError, vlen-utf8/reshape ValueError.
CODEC_ERRORS = (RuntimeError, ValueError, OSError)
VERSIONS_DIR = "versions"  # versions after the first: versions/<n>/{docs,chunks,post}


def version_prefix(version: int) -> str:
    """Where a version's arrays live inside the store: its root for the first run (version
    0), `versions/<n>/` for the version the n-th incremental update made."""
    return "" if version == 0 else f"{VERSIONS_DIR}/{version}/"


def _version_group(root: Any, version: int) -> Any:
    return root[version_prefix(version).rstrip("/")] if version else root


def _consolidate(path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(path)


def write_view(group: Any, source: str, target: str, name: str,
               fn: Callable[[np.ndarray], np.ndarray], rows_per_chunk: int) -> None:
    """Array `target` of `group` = fn(array `source`), block by block (`name`: the view's
    name, which its width dimension is named after). A target that is the source itself is
    written over in place (each block is read before it is written); any other is made
    anew, whatever a killed run left under its name."""
    src = group[source]
    n = src.shape[0]
    out: Any = src if target == source else None
    for start in range(0, n, ROWS_PER_CHUNK):
        block = fn(np.asarray(src[start : start + ROWS_PER_CHUNK], dtype=np.float64))
        block = block.astype(src.dtype)
        if out is None:
            out = group.create_array(
                target, shape=(n, block.shape[1]), dtype=src.dtype,
                chunks=(rows_per_chunk, block.shape[1]), compressors=COMPRESSOR,
                fill_value=np.nan, overwrite=True,
                dimension_names=(src.metadata.dimension_names[0], f"{name}_dim"))
        out[start : start + len(block)] = block


def _write_level(root: zarr.Group, level: str, parts: Iterator[pa.Table], n: int,
                 columns: StoredColumns, widths: dict[str, int]) -> None:
    """Every column of a level's parts as one array of the level's group, in row order.
    The ids go to `docs/id`, the dimension coordinate of every docs array."""
    dim = LEVEL_DIMS[level]
    group = root.require_group(level)
    arrays: dict[str, zarr.Array] = {}
    offset = 0
    for table in chunk_aligned((columns.conform(t) for t in parts), _chunk_rows(n)):
        for name in table.column_names:
            if name == "row":
                continue
            values = column_values(columns, name, table.column(name))
            if name in widths:
                values = values.astype(f"<U{widths[name]}")
            if name not in arrays:
                arrays[name] = create_array(group, name, values, n, dim)
                if attributes := columns.zarr_attributes(name):
                    arrays[name].update_attributes(attributes)
            arrays[name][offset : offset + table.num_rows] = values
        offset += table.num_rows


def _chunk_rows(n: int) -> int:
    """Rows per chunk of a level's arrays of `n` rows (see `create_array`)."""
    return min(ROWS_PER_CHUNK, max(n, 1))


def chunk_aligned(tables: Iterator[pa.Table], rows: int) -> Iterator[pa.Table]:
    """The same rows in blocks that start and end on chunk boundaries (the last may end
    short). Why: a write that covers part of a chunk makes Zarr read the chunk back,
    merge and write it again; on an object store that is a GET and a PUT per partition
    and array, where whole chunks need one PUT each. At most a chunk and a part in memory.
    Parts with no rows at all still come out as one empty block (its columns make the
    level's arrays)."""
    pending: list[pa.Table] = []
    held, given = 0, False
    for table in tables:
        pending.append(table)
        held += table.num_rows
        if held < rows:
            continue
        block = pa.concat_tables(pending)
        whole = held - held % rows
        yield block.slice(0, whole)
        pending, held, given = [block.slice(whole)], held - whole, True
    if held or (pending and not given):  # a level of no rows still gets its (empty) arrays
        yield pa.concat_tables(pending)


def create_array(group: zarr.Group, name: str, sample: np.ndarray, n: int, dim: str,
            rows_per_chunk: int | None = None) -> zarr.Array:
    shape = (n, *sample.shape[1:])
    dims = (dim,) if sample.ndim == 1 else (dim, f"{name}_dim")
    dtype: Any = str if sample.dtype.kind in "OT" else sample.dtype
    # why NaN: a chunk that is missing must never read as zero vectors
    fill = np.nan if sample.dtype.kind == "f" else None
    return group.create_array(
        name, shape=shape, dtype=dtype, chunks=(rows_per_chunk or _chunk_rows(n), *shape[1:]),
        compressors=None if dtype is str else COMPRESSOR, dimension_names=dims, overwrite=True,
        fill_value=fill,
    )


def column_values(columns: StoredColumns, name: str, column: pa.ChunkedArray) -> np.ndarray:
    if pa.types.is_fixed_size_list(column.type):
        return column_matrix(column)
    return columns.zarr_values(name, column)


def _dataset(group: Any, coords: dict[str, Any], label: str, dask: bool = True
             ) -> xr.Dataset:
    variables: dict[str, Any] = {}
    for name, array in group.arrays():
        dims = tuple(array.metadata.dimension_names)
        if dims == (name,) and dask:  # a dimension coordinate: xarray reads it whole for
            # its index, and dask would start a scheduler to read it (xarray's own lazy
            # indexing reads it as it does every other array)
            values = _Guarded(array, f"{label}/{name}")[...]
            variables[name] = (dims, strings_as_objects(values, array.attrs.get(
                MISSING_ATTRIBUTE)) if values.dtype.kind in "OTU" else values)
        else:
            variables[name] = (dims, _lazy(array, f"{label}/{name}", dask))
    return xr.Dataset(variables, coords=coords)


def _lazy(array: Any, label: str, dask: bool = True) -> Any:
    """A Zarr array read lazily, its reads guarded; strings as objects with None for nulls
    (as Parquet reads). As dask, a block spans whole Zarr chunks, ROWS_PER_CHUNK rows or
    more (an Icechunk store's small chunks would otherwise make one task each); else
    indexed lazily by xarray itself."""
    missing = array.attrs.get(MISSING_ATTRIBUTE)
    if not dask:
        return indexing.LazilyIndexedArray(_IndexedArray(_Guarded(array, label), missing))
    import dask.array as da  # why here: a reader that asks for no dask does not import it

    rows = array.chunks[0] if array.ndim else 1
    blocks = (rows * max(1, ROWS_PER_CHUNK // max(rows, 1)), *array.chunks[1:])
    data = da.from_array(_Guarded(array, label), chunks=blocks, name=False)
    if data.dtype.kind not in "OTU":
        return data
    return data.map_blocks(strings_as_objects, missing=missing, dtype=object)


class _IndexedArray(BackendArray):
    """A guarded Zarr array as xarray's lazy indexing reads it (basic indexing; strings as
    objects with None for nulls)."""

    def __init__(self, guarded: _Guarded, missing: str | None):
        self.guarded, self.missing = guarded, missing
        self.strings = guarded.dtype.kind in "OTU"
        self.shape = guarded.shape
        self.dtype = np.dtype(object) if self.strings else guarded.dtype

    def __getitem__(self, key: Any) -> np.ndarray:
        return indexing.explicit_indexing_adapter(key, self.shape,
                                                  indexing.IndexingSupport.BASIC, self._read)

    def _read(self, key: Any) -> np.ndarray:
        block = self.guarded[key]
        return strings_as_objects(block, self.missing) if self.strings else block


def describe_arrays(root: Any, provenance: dict[str, Any]) -> None:
    """Attributes that make each group readable on its own (`xr.open_zarr(p, group="docs")`):
    the group's description, and on each view what it is (layers, combine, pooling, model,
    dtype; a post-processed view's method and source)."""
    job, model = provenance.get("job", {}), provenance.get("model", {})
    views, post = job.get("views", {}), provenance.get("post", {})
    common = {"model": model.get("path"), "model_type": model.get("config", {}).get(
        "model_type"), "dtype": job.get("output", {}).get("dtype")}
    for level in ("docs", "chunks"):
        if level not in root:
            continue
        group = root[level]
        group.update_attributes({"description": LEVEL_TEXT[level], **common})
        for name, array in group.arrays():
            attrs: dict[str, Any] = {}
            if name in views:
                attrs.update(kind="view", **{k: v for k, v in views[name].items()
                                             if k != "post"})
            elif name in post:
                attrs.update(kind="post-processed view", **post[name])
            if attrs:
                array.update_attributes(attrs)


def _move_array(group: Location, source: str, target: str) -> None:
    """Array `source` of a group becomes `target` (replacing it): a rename of its folder
    locally, a copy of its keys on an object store (`Location.move_to`)."""
    group.child(source).move_to(group.child(target))


# As plain xarray shows a group (`xr.open_zarr(path, group="docs")`), which is when a
# reader needs them; pipeline.open_store renames the docs dimension `doc` (id a coordinate).
LEVEL_TEXT = {"docs": "one row per input row, in input order (dimension id: the row's id, "
                      "also its coordinate); a variable per view (VIEW_dim its width) and "
                      "per carried column; bertpipe provenance at the store's root",
              "chunks": "one row per chunk (dimension chunk); doc is the row number of its "
                        "document in docs"}


class _Guarded:
    """A Zarr array whose reads turn a codec's error into a StoreError naming the array."""

    def __init__(self, array: Any, label: str):
        self.array, self.label = array, label
        self.shape, self.dtype, self.ndim = array.shape, array.dtype, array.ndim

    def __getitem__(self, key: Any) -> np.ndarray:
        try:
            return np.asarray(self.array[key])
        except CODEC_ERRORS as exc:
            raise StoreError(f"{self.label}: cannot be decoded ({type(exc).__name__}: {exc}); "
                             "the store is damaged") from None


def zarr_store(path: str, read_only: bool = False) -> Store:
    """The Zarr store at `path`: a LocalStore, or an FsspecStore for a URL (with the
    storage options registered for it)."""
    loc = resolve(path)
    if loc.local:
        return LocalStore(loc.path, read_only=read_only)
    return FsspecStore(_async_fs(loc), path=loc.path, read_only=read_only)


def _async_fs(loc: Location) -> Any:
    """The asynchronous twin of a location's filesystem (what FsspecStore needs), cached
    like every filesystem (zarr runs all its IO on one event loop, so one is enough)."""
    protocol = protocol_of(loc.url)
    opened = filesystem(protocol, {**loc.options, "asynchronous": True}) \
        if protocol != "memory" else loc.fs
    if opened.async_impl:
        _close_at_exit(opened)
        return opened
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

    return AsyncFileSystemWrapper(opened, asynchronous=True)


_closing: set[int] = set()


def _close_at_exit(opened: Any) -> None:
    """Close an asynchronous filesystem's connections when the process ends (s3fs does it
    only for its synchronous instances; aiohttp would complain of an unclosed session)."""
    if id(opened) in _closing:
        return
    _closing.add(id(opened))

    def close() -> None:
        creator = getattr(opened, "_s3creator", None)
        if creator is None:
            return
        from zarr.core.sync import sync

        with contextlib.suppress(Exception):
            # on zarr's event loop, where the session was opened (it still runs at exit)
            sync(creator.__aexit__(None, None, None), timeout=2)

    atexit.register(close)


def _open_group(path: str, **kwargs: Any) -> Any:
    """zarr.open_group on the store at `path` (local or URL)."""
    return zarr.open_group(zarr_store(path, read_only=kwargs.get("mode") == "r"), **kwargs)


class ZarrFormat(StoreFormat):
    """The Zarr v3 store format (see the module docstring for its layout)."""

    name = "zarr"
    # a version's arrays are never moved once written (versions/<n>/ beside the current):
    # a reader that read the provenance keeps a consistent view without reading it again
    atomic_switch = True

    own_entries = frozenset({"zarr.json", "ids", "docs", "chunks", "tokens", "post", "index",
                             "versions", STAGING_DIR})
    cannot_grow = ("a zarr store is written once (after an update, plain readers would have "
                   "to find the current version's folder)")

    @classmethod
    def holds_store(cls, path: str) -> bool:
        return resolve(path).child("zarr.json").exists()

    @classmethod
    def is_ours(cls, root: Location) -> bool:
        """Its `zarr.json` carries a `bertpipe` attribute (read as JSON: no zarr needed)."""
        raw = root.child("zarr.json").read_json() or {}
        return isinstance((raw.get("attributes") or {}).get("bertpipe"), dict)

    def create(self, raw: dict[str, Any]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _open_group(self.path, mode="a", attributes={"bertpipe": raw})
        self._remember_record(raw)

    def _read_record(self) -> dict[str, Any] | None:
        try:
            group = _open_group(self.path, mode="r")
        except (FileNotFoundError, ValueError, zarr.errors.GroupNotFoundError):
            return None
        prov = group.attrs.get("bertpipe")
        return dict(prov) if isinstance(prov, dict) else None

    def _write_record(self, raw: dict[str, Any]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root = self._root()
            root.update_attributes({"bertpipe": raw})
            zarr.consolidate_metadata(root.store)

    def _sealed(self, raw: dict[str, Any], version: int) -> dict[str, Any]:
        """The arrays are described first (that changes their zarr.json), then sealed."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            describe_arrays(_version_group(self._root(), version), raw)
        return super()._sealed(raw, version)

    def _root(self) -> Any:
        """The root group, writable (writers see groups added since the last consolidation)."""
        return _open_group(self.path, mode="a", use_consolidated=False)

    def _group(self, writable: bool = False) -> Any:
        """The current version's group (the root for version 0), opened so that every
        recorded file is checked as it is read."""
        store = VerifiedStore(zarr_store(self.path, read_only=not writable),
                              self.recorded_checksums(), self.path)
        if writable:
            root = zarr.open_group(store, mode="a", use_consolidated=False)
        else:
            root = zarr.open_group(store, mode="r")
        return _version_group(root, version_of(self.record()))

    def _prefix(self) -> str:
        return version_prefix(version_of(self.record()))

    # ---- writing a version -----------------------------------------------------------

    def _version_target(self, version: int) -> Any:
        if version:
            raise StoreError(f"{self.path}: a zarr store is written once; output.format: "
                             "icechunk is the Zarr store that grows")
        return self._root()

    def _write_level(self, target: Any, level: StagedLevel, raw: dict[str, Any] | None
                     ) -> None:
        parts = level.parts
        if level.name == "tokens":
            parts = (t.drop_columns(TOKEN_FIELDS_NOT_STORED) for t in parts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # string arrays: zarr warns the vlen spec is young
            self._write_arrays(target, level.name, parts, level.rows, level.columns,
                               level.columns.string_widths(level.files))

    def _write_arrays(self, target: Any, level: str, parts: Iterator[pa.Table], rows: int,
                      columns: StoredColumns, widths: dict[str, int]) -> None:
        """A level's arrays from its parts (a new store: every chunk written once)."""
        _write_level(target, level, parts, rows, columns, widths)

    def _switch(self, version: int, raw: dict[str, Any], previous: int) -> None:
        raise StoreError(f"{self.path}: a zarr store is written once")

    def recover(self) -> None:
        """Nothing to finish: no version is ever switched to."""

    def drop_retired(self) -> None:
        """What is left of versions before the current one in a store an earlier bertpipe
        updated (`versions/<n>/`; kept for the readers that opened them)."""
        current = version_of(self.record())
        doomed = [self.location.child(name) for name in DATA_DIRS] if current else []
        versions = self.location.child(VERSIONS_DIR)
        if versions.is_dir():
            doomed += [p for p in versions.entries() if p.is_dir() and p.name != str(current)]
        removed = False
        for folder in doomed:
            if folder.is_dir():
                folder.remove_tree()
                removed = True
        if removed:
            # why: consolidated metadata naming a removed array would read as fill values
            _consolidate(self.path)

    # ---- reading ---------------------------------------------------------------------

    def open_datasets(self, dask: bool = True) -> tuple[xr.Dataset, xr.Dataset | None]:
        root = self._group()
        docs = _dataset(root["docs"], {}, f"{self.path}: docs", dask)
        if "ids" in root:  # stores written before the ids moved into docs/
            docs = docs.assign_coords(id=("doc", _lazy(root["ids"], f"{self.path}: ids",
                                                       dask)))
        if "id" in docs.dims:  # on disk the ids are the dimension; in the package it is `doc`
            docs = docs.rename_dims(id="doc")
        docs = docs.set_coords("id")
        # views being written by postprocess live under a temporary dot-name until done
        docs = docs.drop_vars([v for v in docs.data_vars if str(v).startswith(".")])
        chunks = _dataset(root["chunks"], {}, f"{self.path}: chunks", dask) \
            if "chunks" in root else None
        return docs, chunks

    def open_tokens(self, dask: bool = True) -> xr.Dataset | None:
        root = self._group()
        return _dataset(root["tokens"], {}, f"{self.path}: tokens", dask) \
            if "tokens" in root else None

    def read_params(self, name: str) -> dict[str, np.ndarray]:
        group = self._group()["post"][name]
        return {key: np.asarray(array[...]) for key, array in group.arrays()}

    def _files_of(self, version: int) -> list[str]:
        """Every file of the arrays (chunks and array metadata), as store-relative keys;
        dot-names (a view still being written) are not data yet."""
        prefix = version_prefix(version)
        files = []
        for top in DATA_DIRS:
            for rel in self.location.child(prefix + top).files():
                if not any(p.startswith(".") for p in rel.split("/")):
                    files.append(f"{prefix}{top}/{rel}")
        return files

    def file_sum(self, rel: str) -> FileSum | None:
        return file_sum(self.location.child(rel))

    def checked_size(self, rel: str) -> int | None:
        return self.location.child(rel).size()

    def _plain_root(self) -> Any:
        """The current version's group, read without checksum checks (row counts only)."""
        return _version_group(_open_group(self.path, mode="r"), version_of(self.record()))

    def row_counts(self) -> dict[str, tuple[str, int]]:
        root = self._plain_root()
        counts = {"ids": ("docs", int(root["ids"].shape[0]))} if "ids" in root else {}
        for level in ("docs", "chunks"):
            if level in root:
                for name, array in root[level].arrays():
                    if not name.startswith("."):
                        counts[f"{level}/{name}"] = (level, int(array.shape[0]))
        return counts

    # ---- post-processed views --------------------------------------------------------

    def add_view(self, source: str, name: str, fn: Callable[[np.ndarray], np.ndarray],
                 levels: Sequence[str]) -> None:
        """Write `name` = fn(`source`) block by block at each level, beside the source.

        Written under a temporary name and moved into place, so replacing a view in place
        never reads and writes the same array; the caller updates the provenance last.
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root = self._group(writable=True)
            for level in levels:
                group, tmp_name = root[level], f".{name}.tmp"
                write_view(group, source, tmp_name, name, fn,
                           _chunk_rows(group[source].shape[0]))
                _move_array(self.location.child(self._prefix() + level), tmp_name, name)

    def write_params(self, name: str, params: dict[str, np.ndarray]) -> None:
        prefix = self._prefix()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root = self._root()
            write_params_group(root[prefix.rstrip("/")] if prefix else root, name, params)


def write_params_group(group: Any, name: str, params: dict[str, np.ndarray]) -> None:
    post = group.require_group("post").require_group(name)
    for key, value in params.items():
        dims = tuple(f"{name}_{key}_{i}" for i in range(value.ndim))
        post.create_array(key, shape=value.shape, dtype=value.dtype, overwrite=True,
                          dimension_names=dims)[...] = value
