"""Parquet store: a directory with one folder per table, `docs/`, `chunks/` and, for token
views, `tokens/` (one part file per partition, in row order).

Each folder is a dataset on its own (`docs/part-0.parquet`), so `store/docs/*.parquet`
is what DuckDB, polars, pandas and `pyarrow.dataset` read, with one schema. Views are
`fixed_size_list<float32, D>` columns (DuckDB `FLOAT[D]`, polars `Array`; zstd,
byte-stream-split, no dictionary); the provenance JSON sits in the docs file's metadata
under `bertpipe`. The commit writes the chunks file first and the docs file last, each
whole (locally a temporary name renamed into place; on an object store one upload that
appears only when complete), so a store with a docs file is a complete store.

An incremental update writes the new version's files in the staging area, seals the
provenance with their checksums, then renames the chunks file and, last, the docs file
(the one that holds the provenance) into place: the table folders always hold the current
version, so a glob reads it. Readers map the files they open into memory, so a reader
that opened the previous version keeps reading it after the switch (the rename leaves the
old file alive while mapped); a reader opening within the switch (two renames) sees sizes
that disagree with the provenance and opens again. A killed switch is finished by the
next run (`recover`).

Integrity: every data page carries a CRC that reads verify, so altered bytes are an
error naming the file and column; a complete store's provenance records the checksum of
each file's column data (the bytes before the footer). Changing the provenance rewrites
only the footer of the docs file, never its column data.
"""

from __future__ import annotations

import io
import json
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xarray as xr
from xarray.backends import BackendArray
from xarray.core import indexing

from ..errors import StoreError
from ..io.location import Location, resolve
from .base import StagedLevel, StoreFormat, column_matrix
from .columns import has_nulls, numpy_dtype, to_numpy
from .integrity import file_sum, parquet_data_size
from .provenance import FileSum, is_complete, sealed
from .staging import STAGING_DIR

ROW_GROUP_ROWS = 32768
METADATA_KEY = b"bertpipe"
PART = "part-0.parquet"  # one file per table today; readers glob the folder
DOCS_FILE = f"docs/{PART}"
LEVEL_FILES = (DOCS_FILE, f"chunks/{PART}")
# Stores written before tables had folders: refused on open, with what to do.
OLD_LAYOUT = "docs.parquet"
# What pyarrow raises for a damaged file: a bad footer, a page CRC mismatch, a short read.
READ_ERRORS = (OSError, pa.ArrowException)


def level_file(root: Location, level: str) -> Location:
    return root.child(level, PART)
TOKENS_DIR = "tokens"
NEXT_DIR = "next"  # in the staging area: an update's new version before the switch


def _write(file: Location, parts: Iterator[pa.Table], provenance: dict[str, Any] | None) -> None:
    with file.writer() as out:
        writer: pq.ParquetWriter | None = None
        pending: list[pa.Table] = []
        held = 0
        try:
            for table in parts:
                if writer is None:
                    writer = _writer(out, table.schema, provenance)
                pending.append(table)
                held += table.num_rows
                if held >= ROW_GROUP_ROWS:
                    writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
                    pending, held = [], 0
            if writer is not None and pending:
                writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
        finally:
            if writer is not None:
                writer.close()  # the footer; `out` itself is closed (or discarded) by `writer()`


def _writer(file: IO[bytes], schema: pa.Schema,
            provenance: dict[str, Any] | None) -> pq.ParquetWriter:
    vectors = [f.name for f in schema if vector_of(f) is not None]
    others = [f.name for f in schema if f.name not in vectors]
    if provenance is not None:
        schema = schema.with_metadata({METADATA_KEY: json.dumps(provenance, default=str)})
    return pq.ParquetWriter(
        file, schema, compression="zstd",
        use_dictionary=others,  # why: dictionaries only bloat float vectors
        use_byte_stream_split=[f"{name}.list.element" for name in vectors],
        write_page_checksum=True,  # why: a read then refuses altered bytes
    )


def _open(file: Location | str | _Mapped, footer: pq.FileMetaData | None = None
          ) -> pq.ParquetFile:
    """A stored file, its page checksums verified on read; damage is a StoreError. A
    remote file is read by ranged reads of what is asked for (the footer, unless given
    already parsed: a dataset parses each file's once, not once per column and row group;
    a row group); a mapped one from its mapping."""
    if isinstance(file, _Mapped):
        loc: Any = file
        source: Any = pa.BufferReader(file.buffer)
    else:
        loc = resolve(file) if isinstance(file, str) else file
    try:
        if not isinstance(file, _Mapped):
            source = loc.path if loc.local else loc.open("rb")
        return pq.ParquetFile(source, page_checksum_verification=True, metadata=footer)
    except READ_ERRORS as exc:
        raise StoreError(f"{loc}: damaged Parquet file ({exc})") from None


class _Mapped:
    """A Parquet file mapped into memory when a dataset is opened: its blocks, read later,
    come from the file as it was then, even once an update or `postprocess` has replaced
    it by rename (the mapping keeps the old file alive), so a reader never mixes two
    versions. Its footer is read when it is mapped, from the same open file but by plain
    reads: parsed through the mapping, the reader's speculative tail read would keep tens of
    kilobytes of every file resident, which grows with the number of files."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                self.token = (path, stat.st_ino, stat.st_size, stat.st_mtime_ns)
                # zero-copy view of the mapping; the mapping outlives the handle
                self.buffer = pa.py_buffer(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
                self.metadata = pq.ParquetFile(handle).metadata
        except (*READ_ERRORS, ValueError) as exc:  # ValueError: an empty file
            raise StoreError(f"{path}: damaged Parquet file ({exc})") from None

    def __str__(self) -> str:
        return self.path

    def __reduce__(self) -> tuple[Any, ...]:  # another process maps the file anew
        return (_Mapped, (self.path,))


def _dataset(file: Location, dim: str, dask: bool = True) -> xr.Dataset:
    """Every column read lazily (see `parts_dataset`)."""
    return parts_dataset([file], dim, dask)


# A vector column stored as a variable list (a Delta table has no fixed-size list, nor
# float16): its field metadata gives the width and the dtype it is read back as.
WIDTH_KEY, DTYPE_KEY = b"bertpipe.width", b"bertpipe.dtype"


def vector_of(field: pa.Field) -> tuple[int, np.dtype] | None:
    """(width, dtype) of a vector column, None for a flat one."""
    if pa.types.is_fixed_size_list(field.type):
        return field.type.list_size, np.dtype(field.type.value_type.to_pandas_dtype())
    meta = field.metadata or {}
    if pa.types.is_list(field.type) and WIDTH_KEY in meta:
        stored = meta.get(DTYPE_KEY)
        dtype = np.dtype(stored.decode()) if stored else \
            np.dtype(field.type.value_type.to_pandas_dtype())
        return int(meta[WIDTH_KEY]), dtype
    return None


def _read_block(file: _Mapped | str, group: int, column: str, nulls: bool,
                vector: tuple[int, np.dtype] | None, footer: pq.FileMetaData,
                dtype: np.dtype) -> np.ndarray:
    """A row group's values of `column` as `dtype` (the column's across its files)."""
    try:
        col = _open(file, footer).read_row_group(group, columns=[column]).column(0)
    except READ_ERRORS as exc:
        raise StoreError(f"{file}: column {column}, row group {group}: damaged ({exc})") from None
    if pa.types.is_fixed_size_list(col.type):
        values = column_matrix(col)
    elif vector is not None:
        flat = col.combine_chunks().flatten().to_numpy(zero_copy_only=False)
        values = flat.reshape(-1, vector[0])
    else:
        try:
            values = to_numpy(col, nulls)
        except pa.ArrowInvalid as exc:  # integers beside nulls as float64: exact, or refused
            raise StoreError(f"{file}: column {column}: {exc}; a column of integers with "
                             "nulls reads as float64, exact only below 2**53 (carry such "
                             "ids as strings)") from None
    return values.astype(dtype, copy=False)


def _with_column(file: Location, source: str, name: str,
                 fn: Callable[[np.ndarray], np.ndarray]) -> Iterator[pa.Table]:
    pf = _open(file)
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


def parts_dataset(files: Sequence[Location], dim: str, dask: bool = True) -> xr.Dataset:
    """Every column of a folder of part files, the files concatenated in the given order:
    as dask arrays, one block per row group, or (`dask=False`) as arrays read on indexing,
    only the row groups the index touches (no task graph: reading a few rows of a
    thousand-file table through dask cost a tenth of a second in graph work per read)."""
    return dataset_of(parts_columns(files, dim), dask)


def dataset_of(columns: dict[str, PartsColumn], dask: bool) -> xr.Dataset:
    return xr.Dataset({name: column.variable(dask) for name, column in columns.items()})


def parts_columns(files: Sequence[Location], dim: str) -> dict[str, PartsColumn]:
    """Each column of the part files, in the given order (see `parts_dataset`)."""
    columns: dict[str, PartsColumn] = {}
    for file in files:
        # local files are mapped: a reader keeps the version it opened (see the docstring)
        source: _Mapped | str = _Mapped(file.path) if file.local else file.url
        metadata = source.metadata if isinstance(source, _Mapped) else _open(source).metadata
        groups = [(source, metadata, g, metadata.row_group(g).num_rows)
                  for g in range(metadata.num_row_groups)]
        for field in metadata.schema.to_arrow_schema():
            if field.name not in columns:
                columns[field.name] = PartsColumn(field, dim)
            columns[field.name].add(groups, field, has_nulls(metadata, field.name))
    return columns


class PartsColumn(BackendArray):
    """One column of a level's part files, read row group by row group as indexed (the
    last group read kept: a level is mostly read in runs of consecutive rows). Indexed by
    xarray (explicit indexers) or by dask (a tuple of slices, one block per row group)."""

    def __init__(self, field: pa.Field, dim: str):
        self.name = field.name
        self.vector = vector_of(field)
        self.width = self.vector[0] if self.vector is not None else 0
        self.dims: tuple[str, ...] = (dim, f"{field.name}_dim") if self.vector else (dim,)
        self.dtype = np.dtype(self.vector[1]) if self.vector else numpy_dtype(field.type, False)
        self.nulls = False
        # (file, its footer, row group, rows)
        self.groups: list[tuple[_Mapped | str, pq.FileMetaData, int, int]] = []
        self._held: tuple[int, np.ndarray] | None = None
        self._starts_of: np.ndarray | None = None

    def add(self, groups: list[tuple[_Mapped | str, pq.FileMetaData, int, int]], field: pa.Field,
            nulls: bool) -> None:
        """A file's row groups of this column; the column's dtype is the one all its files'
        values fit (a file with nulls in an integer column: float64, NaN for nulls)."""
        nulls = nulls and self.vector is None
        dtype = np.dtype(self.vector[1]) if self.vector else numpy_dtype(field.type, nulls)
        self.dtype = np.result_type(self.dtype, dtype)
        self.nulls = self.nulls or nulls
        self.groups += groups

    @property
    def shape(self) -> tuple[int, ...]:
        rows = int(self._starts[-1])
        return (rows, self.width) if self.width else (rows,)

    @property
    def _starts(self) -> np.ndarray:
        """Each row group's first row (and, last, the rows of all), computed once the
        groups are all added."""
        if self._starts_of is None or len(self._starts_of) != len(self.groups) + 1:
            self._starts_of = np.cumsum([0] + [g[3] for g in self.groups])
        return self._starts_of

    def variable(self, dask: bool) -> xr.Variable:
        if not dask:
            return xr.Variable(self.dims, indexing.LazilyIndexedArray(self))
        import dask.array as da  # why here: opening a Zarr store (no dask) imports this module

        if not self.shape[0]:
            return xr.Variable(self.dims, da.from_array(np.empty(self.shape, self.dtype)))
        # one graph layer of a block per row group, named by the files it reads (a delayed
        # read per row group and column makes a graph that grows with files x columns); a group
        # of no rows is no block (dask's indexing fails on empty blocks)
        blocks = (tuple(int(n) for *_, n in self.groups if n),
                  *((self.width,) if self.width else ()))
        array = da.from_array(self, chunks=blocks, name=f"parquet-{self.name}-{self.token()}",
                              lock=False, asarray=False, fancy=False,
                              meta=np.empty((0,) * len(self.dims), self.dtype))
        return xr.Variable(self.dims, array)

    def token(self) -> str:
        from dask.base import tokenize

        return tokenize(self.name, str(self.dtype), self.nulls,
                        [(getattr(source, "token", source), group)
                         for source, _, group, _ in self.groups])

    def __getstate__(self) -> dict[str, Any]:  # sent to a Dask worker without its cache
        return {**self.__dict__, "_held": None}

    def read_whole(self) -> np.ndarray:
        """Every row, read by plain reads of each file by its path, not through its mapping
        (mapped pages stay resident): for files never replaced in place (Delta's, whose
        names are new for new contents)."""
        blocks = [_read_block(str(source), group, self.name, self.nulls, self.vector, footer,
                              self.dtype) for source, footer, group, _ in self.groups]
        return np.concatenate(blocks) if blocks else np.empty(self.shape, self.dtype)

    def __getitem__(self, key: Any) -> np.ndarray:
        if not isinstance(key, indexing.ExplicitIndexer):  # dask: a block's slices
            return self._read(key if isinstance(key, tuple) else (key,), keep=False)
        return indexing.explicit_indexing_adapter(key, self.shape,
                                                  indexing.IndexingSupport.OUTER_1VECTOR,
                                                  self._read)

    def _read(self, key: tuple[Any, ...], keep: bool = True) -> np.ndarray:
        """The rows of `key`; `keep`: hold the last row group read for the next call (not
        for dask, which reads each block once: the group would stay in memory)."""
        first, rest = key[0], key[1:]
        rows = np.arange(*first.indices(self.shape[0])) if isinstance(first, slice) else \
            np.atleast_1d(np.asarray(first, np.int64))
        starts = self._starts
        group_of = np.searchsorted(starts, rows, side="right") - 1
        out = np.empty((len(rows), self.width) if self.width else (len(rows),), self.dtype)
        # positions by row group, in one sort (a slice's are in order already)
        order = np.argsort(group_of, kind="stable")
        for where in np.split(order, np.flatnonzero(np.diff(group_of[order])) + 1):
            if len(where):
                g = int(group_of[where[0]])
                out[where] = self._group(g, keep)[rows[where] - starts[g]]
        out = out[(slice(None), *rest)] if rest else out
        return out[0] if np.ndim(first) == 0 and not isinstance(first, slice) else out

    def _group(self, g: int, keep: bool = True) -> np.ndarray:
        held = self._held  # once: another thread may replace it meanwhile
        if held is None or held[0] != g:
            source, footer, group, _ = self.groups[g]
            held = (g, _read_block(source, group, self.name, self.nulls, self.vector, footer,
                                   self.dtype))
            if keep:
                self._held = held
        return held[1]


def _metadata(file: Location) -> dict[str, Any] | None:
    raw = (_open(file).schema_arrow.metadata or {}).get(METADATA_KEY)
    return json.loads(raw) if raw else None


def _replace_footer(file: Location, provenance: dict[str, Any]) -> None:
    """Rewrite only the footer of `file` with `provenance` in its metadata: the column data
    (and so its recorded checksum) stays byte for byte what it was. The file is replaced
    whole (an object store has no in-place edit), the data copied in large blocks."""
    pf = _open(file)
    data_size = parquet_data_size(file)
    if data_size is None:
        raise StoreError(f"{file}: damaged Parquet file (no footer)")
    schema = pf.schema_arrow
    metadata = {**(schema.metadata or {}),
                METADATA_KEY: json.dumps(provenance, default=str).encode()}
    # a metadata-only Parquet file: magic, then the footer describing pf's row groups
    footer = io.BytesIO()
    pq.write_metadata(schema.with_metadata(metadata), footer, metadata_collector=[pf.metadata])
    with file.writer() as out, file.open("rb") as data:
        for block in _blocks(data, data_size, str(file), 1 << 20 if file.local else 16 << 20):
            out.write(block)
        out.write(footer.getvalue()[4:])  # its leading magic: the data starts with one


def _blocks(stream: Any, size: int, name: str, block_size: int) -> Iterator[bytes]:
    left = size
    while left > 0:
        block = stream.read(min(left, block_size))
        if not block:
            raise StoreError(f"{name}: shorter than its footer says")
        left -= len(block)
        yield block


class ParquetFormat(StoreFormat):
    """The Parquet store format (see the module docstring for its layout)."""

    name = "parquet"
    # publishing renames the docs and chunks files one after the other: a reader checks
    # that the version it read the provenance of is still the one it opened
    atomic_switch = False

    own_entries = frozenset({"docs", "chunks", "tokens", "post", "index", STAGING_DIR})
    cannot_grow_on_object_store = ("a parquet store on an object store is not updated (its "
                                   "switch renames files, which object stores cannot do)")

    @classmethod
    def is_ours(cls, root: Location) -> bool:
        """Its first docs file carries `bertpipe` metadata in its footer."""
        file = root.child(DOCS_FILE)
        if not file.is_file():
            return False
        try:
            with file.open("rb") as f:
                metadata = pq.read_schema(f).metadata or {}
        except (OSError, pa.ArrowInvalid) as exc:
            # why refuse: a damaged footer cannot show whose file this is, so nothing may
            # replace it, and calling it "not a store" would hide the damage
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise StoreError(f"{file}: damaged Parquet file ({first}); it cannot be shown to "
                             "be a bertpipe store, so it is left alone: move it away or delete "
                             "it, then rerun") from None
        return b"bertpipe" in metadata

    @classmethod
    def holds_store(cls, path: str) -> bool:
        root = resolve(path)
        if root.child(OLD_LAYOUT).is_file() and not root.child(DOCS_FILE).exists():
            raise StoreError(f"{path}: a Parquet store in the layout before tables had folders "
                             "(docs.parquet); rerun its job with --overwrite to rewrite it")
        return root.child(DOCS_FILE).exists()

    def create(self, raw: dict[str, Any]) -> None:
        self.location.make_dirs()  # the provenance is kept in the docs file, written last

    def _read_record(self) -> dict[str, Any] | None:
        file = self.location.child(DOCS_FILE)
        return _metadata(file) if file.exists() else None

    def _write_record(self, raw: dict[str, Any]) -> None:
        _replace_footer(self.location.child(DOCS_FILE), raw)

    # ---- writing a version -----------------------------------------------------------

    def _version_target(self, version: int) -> Location:
        """The store's root for the first version; the staging area's `next/` for an
        update's (`publish` moves its files into place)."""
        if version == 0:
            return self.location
        self._next.remove_tree()  # what a killed update left
        return self._next

    def _write_level(self, target: Location, level: StagedLevel, raw: dict[str, Any] | None
                     ) -> None:
        """docs and chunks: one file each; tokens: one file per part, numbered in row order
        (parts left by an interrupted commit go first; the store is not complete until its
        provenance says so). The docs file carries `raw` in its footer."""
        if level.name == "tokens":
            folder = target.child(TOKENS_DIR)
            folder.remove_tree()
            for k, table in enumerate(level.parts):
                _write(folder.child(f"part-{k:06d}.parquet"), iter([table]), None)
            return
        parts = level.parts
        if level.name == "docs":
            parts = (t.drop_columns(["row"]) for t in parts)
        _write(level_file(target, level.name), parts, raw)

    def _after_commit(self, raw: dict[str, Any]) -> None:
        """The docs file, written last, holds the provenance already (a complete one is
        sealed by a later `write_record`)."""
        self._remember_record(raw)
        if is_complete(raw):
            self.write_record(raw)

    def _switch(self, version: int, raw: dict[str, Any], previous: int) -> None:
        staged = ParquetFormat(self._next.path)
        sums = self.checksums(LEVEL_FILES, root=staged)
        sums.update(self.checksums([rel for rel in self.data_files()
                                    if rel.startswith("post/")]))
        _replace_footer(staged.location.child(DOCS_FILE), sealed(raw, sums))
        self.recover()
        self._remember_record(sealed(raw, sums))

    def recover(self) -> None:
        """Finish a switch: a staged docs file whose provenance is complete was sealed, so
        its version is the one to publish (rename the chunks file, then the docs file)."""
        docs = self._next.child(DOCS_FILE)
        if not docs.is_file() or not is_complete(_metadata(docs)):
            return
        chunks = self._next.child(LEVEL_FILES[1])
        if chunks.is_file():
            chunks.move_to(self.location.child(LEVEL_FILES[1]))
        docs.move_to(self.location.child(DOCS_FILE))  # the switch: the provenance names it
        self._next.remove_tree()
        self._forget_record()

    def drop_retired(self) -> None:
        """Nothing stays of a retired version (its files were replaced by rename; readers
        that mapped them keep them until they close); a staged one never published goes."""
        self._next.remove_tree()

    @property
    def _next(self) -> Location:
        """Where an update's version is written before its switch (`_bertpipe/next/`)."""
        return self.location.child(STAGING_DIR, NEXT_DIR)

    # ---- reading ---------------------------------------------------------------------

    def _files_of(self, version: int) -> list[str]:
        """The level files, token parts and fitted parameters (one version is stored)."""
        root = self.location
        files = [name for name in LEVEL_FILES if root.child(name).is_file()]
        tokens = root.child(TOKENS_DIR).glob("part-*.parquet")
        files += [f"{TOKENS_DIR}/{f.name}" for f in tokens]
        return files + self._param_files()

    def _param_files(self) -> list[str]:
        """The fitted parameters of post-processed views (`post/<view>.npz`)."""
        return [f"post/{rel}" for rel in self.location.child("post").files()
                if "/" not in rel and rel.endswith(".npz") and not rel.startswith(".")]

    def checked_size(self, rel: str) -> int | None:
        file = self.location.child(rel)
        if rel.endswith(".parquet"):
            return parquet_data_size(file)
        return file.size()

    def file_sum(self, rel: str) -> FileSum | None:
        size = self.checked_size(rel)
        return None if size is None else file_sum(self.location.child(rel), size)

    def row_counts(self) -> dict[str, tuple[str, int]]:
        root = self.location
        return {name: (name.split("/")[0], _open(root.child(name)).metadata.num_rows)
                for name in LEVEL_FILES if root.child(name).is_file()}

    def open_datasets(self, dask: bool = True) -> tuple[xr.Dataset, xr.Dataset | None]:
        docs = _dataset(level_file(self.location, "docs"), "doc", dask)
        docs = docs.set_coords("id")
        chunks_file = level_file(self.location, "chunks")
        chunks = _dataset(chunks_file, "chunk", dask) if chunks_file.exists() else None
        return docs, chunks

    def open_tokens(self, dask: bool = True) -> xr.Dataset | None:
        parts = self.location.child(TOKENS_DIR).glob("part-*.parquet")
        return parts_dataset(parts, "piece", dask) if parts else None

    # ---- post-processed views --------------------------------------------------------

    def add_view(self, source: str, name: str, fn: Callable[[np.ndarray], np.ndarray],
                 levels: Sequence[str]) -> None:
        """Rewrite each level's file with column `name` = fn(`source`), row group by row group.

        The docs file's footer is rewritten last by `update_provenance`, which also records
        the view.
        """
        for level in levels:
            file = level_file(self.location, level)
            _write(file, _with_column(file, source, name, fn), _metadata(file))

    def write_params(self, name: str, params: dict[str, np.ndarray]) -> None:
        folder = self.location.child("post")
        folder.make_dirs()
        buffer = io.BytesIO()
        np.savez(buffer, **params)  # type: ignore[arg-type]  # numpy stubs miss **kwargs arrays
        folder.child(f"{name}.npz").write_bytes(buffer.getvalue())

    def read_params(self, name: str) -> dict[str, np.ndarray]:
        raw = self.location.child("post", f"{name}.npz").read_bytes()
        with np.load(io.BytesIO(raw)) as data:
            return {key: data[key] for key in data.files}

