"""A new store version, assembled in store order from the current version and the delta.

Each row of the new version takes its results (counts, status, vectors, chunks) from its
source (`compare.Changes`): a row of the store's current version, or a row of the delta
this run encoded; its id, carried columns and text digest from its input row (or, for a
kept row whose id is gone, from the store). Rows come in blocks: written as staged parts,
which the format then writes as the new version's files (`assemble`), or, for a format that
updates its arrays in place, handed to it block by block (`streamed_version`), so that
nothing but what the format writes is written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xarray as xr

from ..spec import Job
from ..stores import Layout, Staging
from ..stores.base import StreamedVersion, Unwritten
from ..stores.columns import StoredColumns, string_width, vector_array
from ..stores.parquet_store import parts_dataset
from .compare import Changes, take_rows, to_hex

BLOCK_ROWS = 32768  # rows per staged part of the new version (a Parquet row group)
# gathered from the source row (a row's n_chunks is `Assembly.counts`)
DOC_FIELDS = ("n_tokens", "truncated", "status", "n_unk", "n_words",
              "n_fragmented")
CHUNK_FIELDS = ("seq", "start", "end", "n_tokens")
NEAR_ROWS = 512  # rows between two asked for that are read rather than skipped (rows_of)
MAX_RUNS = 256  # ranges read for one column of a block before gathering row by row

# A post-processed view: (the view it derives from, its fitted transform).
Derived = dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]]


@dataclass
class Source:
    """Stored results to copy rows from: documents, their chunks, and where each
    document's chunks start."""

    docs: xr.Dataset
    chunks: xr.Dataset | None
    n_chunks: np.ndarray  # (rows,)
    first_chunk: np.ndarray  # (rows,)

    @classmethod
    def of(cls, docs: xr.Dataset, chunks: xr.Dataset | None) -> Source:
        n_chunks = np.asarray(docs["n_chunks"].values, np.int64)
        return cls(docs, chunks, n_chunks, np.cumsum(n_chunks) - n_chunks)

    @classmethod
    def staged(cls, staging: Staging, indices: Sequence[int], has_chunks: bool) -> Source:
        """The delta's staged parts, in partition order (local or on an object store)."""
        docs = parts_dataset([staging.part(i, "docs") for i in indices], "doc", dask=False)
        chunks = None
        if has_chunks:
            chunks = parts_dataset([staging.part(i, "chunks") for i in indices], "chunk",
                                   dask=False)
        return cls.of(docs, chunks)


@dataclass
class Assembly:
    """Everything the new version is made of."""

    job: Job
    changes: Changes
    store: Source
    delta: Source | None
    views: list[str]  # every view the store holds, post-processed ones included
    derived: Derived  # post-processed views: made from the delta's raw vectors

    @cached_property
    def counts(self) -> np.ndarray:
        """Each row's chunk count in the new version (its source's): the stored counts are
        held whole (`Source.of`), so no block reads them again."""
        c = self.changes
        counts = np.zeros(c.rows, np.int64)
        counts[c.from_store] = self.store.n_chunks[c.source[c.from_store]]
        if self.delta is not None:
            counts[~c.from_store] = self.delta.n_chunks[c.source[~c.from_store]]
        return counts


def assemble(a: Assembly, out: Staging, budget: int) -> tuple[Layout, dict[str, int]]:
    """Write the new version as staged parts; its layout and its stats (rows, chunks,
    tokens, tokens covered: a truncated row covers `budget` tokens)."""
    out.parts.make_dirs()
    has_chunks = "chunks" in a.job.output.levels
    indices: list[int] = []
    stats = _Stats(a.changes.rows)
    for index, (docs, chunks) in enumerate(_blocks(a, with_views=True)):
        out.write_tables(index, {"docs": docs, "chunks": chunks})
        indices.append(index)
        stats.add(docs, budget)
    return Layout(indices, a.changes.rows, stats.counts["chunks"], has_chunks), stats.counts


def streamed_version(a: Assembly, budget: int) -> tuple[StreamedVersion, dict[str, int]]:
    """The new version as blocks for a format that updates its arrays in place, with what
    the format must know before the first block: each level's rows, column types (which
    columns hold nulls) and longest strings. These come from a first pass over the blocks
    without their vectors (the cheap columns only); the blocks are then made again, whole,
    as the format reads them."""
    has_chunks = "chunks" in a.job.output.levels
    stats = _Stats(a.changes.rows)
    found = {level: _Found() for level in ("docs", "chunks")}
    # the first pass needs the counts the stats sum and the strings' widths; the integer
    # fields below are never null and their type does not depend on their values, so the
    # store's are not read for it (zeros stand in)
    every_doc, every_chunk = np.ones(a.changes.rows, bool), np.ones(int(a.counts.sum()), bool)
    typed_only: Unwritten = {
        "docs": dict.fromkeys(("n_unk", "n_words", "n_fragmented"), every_doc),
        "chunks": dict.fromkeys(CHUNK_FIELDS, every_chunk)}
    for docs, chunks in _blocks(a, False, typed_only):
        stats.add(docs, budget)
        found["docs"].add(docs)
        if chunks is not None:
            found["chunks"].add(chunks)
    vector_fields = [pa.field(view, _vector_type(a, view)) for view in a.views]
    levels = ["docs"] + (["chunks"] if has_chunks else [])
    rows = {"docs": a.changes.rows, "chunks": stats.counts["chunks"]}
    same = _same(a)

    def blocks(unwritten: Unwritten) -> Iterator[dict[str, pa.Table | None]]:
        return ({"docs": docs, "chunks": chunks}
                for docs, chunks in _blocks(a, True, unwritten))

    streamed = StreamedVersion(
        rows={level: rows[level] for level in levels},
        columns={level: found[level].columns(vector_fields) for level in levels},
        widths={level: found[level].widths for level in levels},
        same={level: same[level] for level in levels}, kept=_kept(a.changes),
        store_row=a.changes.store_row,
        chunk_counts=a.counts, blocks=blocks)
    return streamed, stats.counts


def _kept(c: Changes) -> np.ndarray:
    """Per row, whether it keeps everything of its id's store row: results from that row
    (so the same text) and the same `present` flag (StreamedVersion)."""
    return c.from_store & (c.source == c.store_row) & (c.was_present == (c.input_row >= 0))


def carried_changed(a: Assembly) -> int:
    """Rows of the new version whose carried values differ from those of the store row they
    were (a known id, its text changed or not): a night that only relabels rows encodes,
    adds and replaces nothing, and this is what it changed. A carried column the store does
    not have yet changes no row (it is new, not changed)."""
    c = a.changes
    names = [n for n in a.job.input.carry_columns if n in a.store.docs.variables]
    known = np.flatnonzero((c.input_row >= 0) & (c.store_row >= 0))
    changed = 0
    for start in range(0, len(known) if names else 0, BLOCK_ROWS):
        rows = known[start : start + BLOCK_ROWS]
        differs = np.zeros(len(rows), bool)
        for name in names:
            now = take_rows(c.inputs.carry.column(name), c.input_row[rows])
            before = _stored(a.store.docs, name, c.store_row[rows])
            if before is not None:  # None only for no rows
                differs |= _differ(now, before)
        changed += int(differs.sum())
    return changed


def _differ(now: pa.Array, before: pa.Array) -> np.ndarray:
    """(n,) bool: the values differ; two nulls are equal, and so are two NaNs (a store may
    read a missing float back as either)."""
    try:
        before = before.cast(now.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        try:
            now = now.cast(before.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # e.g. text beside numbers
            return np.array([x != y for x, y in zip(now.to_pylist(), before.to_pylist(),
                                                     strict=True)], bool)
    now, before = _nan_as_null(now), _nan_as_null(before)
    equal = pc.fill_null(pc.equal(now, before), False).to_numpy(zero_copy_only=False)
    both_null = pc.and_(pc.is_null(now), pc.is_null(before)).to_numpy(zero_copy_only=False)
    return ~(equal | both_null)


def _nan_as_null(values: pa.Array) -> pa.Array:
    if pa.types.is_floating(values.type):
        return pc.if_else(pc.is_nan(values), pa.scalar(None, values.type), values)
    return values


def _same(a: Assembly) -> dict[str, dict[str, np.ndarray]]:
    """Per level and column, the rows of the new version whose value is the current
    version's at the same position (see StreamedVersion). Results are a function of the
    text: a document taken from the store row it is at keeps them, and a chunk of such a
    document where its chunks start where they started (no document before it gained or
    lost chunks). A row that is the store's row at its own position keeps its id, its
    digest where its text is the one stored there, and its `present` flag where that did
    not change (its id still in the input, or still not)."""
    c = a.changes
    at = np.arange(c.rows)
    docs = c.from_store & (c.source == at)
    home = c.store_row == at
    first = np.cumsum(a.counts) - a.counts
    in_place = docs.copy()
    in_place[docs] = first[docs] == a.store.first_chunk[at[docs]]
    chunks = np.repeat(in_place, a.counts)
    return {"docs": {**dict.fromkeys((*DOC_FIELDS, "n_chunks", *a.views), docs), "id": home,
                     "text_sha256": home & docs,
                     "present": home & (c.was_present == (c.input_row >= 0))},
            "chunks": dict.fromkeys(("doc", *CHUNK_FIELDS, *a.views), chunks)}


class _Stats:
    """The new version's stats, block by block (what the provenance's `stats` says)."""

    def __init__(self, rows: int):
        self.counts = {"rows": rows, "chunks": 0, "tokens": 0, "tokens_covered": 0}

    def add(self, docs: pa.Table, budget: int) -> None:
        n_tokens = docs.column("n_tokens").to_numpy()
        truncated = docs.column("truncated").to_numpy(zero_copy_only=False)
        self.counts["chunks"] += int(docs.column("n_chunks").to_numpy().sum())
        self.counts["tokens"] += int(n_tokens.sum())
        self.counts["tokens_covered"] += int(np.where(truncated, np.minimum(n_tokens, budget),
                                                      n_tokens).sum())


class _Found:
    """What a pass over a level's blocks found: their schemas, the columns with a null,
    the longest value of each string column."""

    def __init__(self) -> None:
        self.schemas: list[pa.Schema] = []
        self.nulls: dict[str, bool] = {}
        self.widths: dict[str, int] = {}

    def add(self, table: pa.Table) -> None:
        self.schemas.append(table.schema)
        for name, column in zip(table.column_names, table.columns, strict=True):
            self.nulls[name] = self.nulls.get(name, False) or column.null_count > 0
            if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                self.widths[name] = max(self.widths.get(name, 1), string_width(column))

    def columns(self, vector_fields: list[pa.Field]) -> StoredColumns:
        schema = pa.unify_schemas(self.schemas, promote_options="permissive")
        for field in vector_fields:
            schema = schema.append(field)
        return StoredColumns(schema, self.nulls)


def _vector_type(a: Assembly, view: str) -> pa.DataType:
    width = int(a.store.docs[view].shape[1])
    return vector_array(np.zeros((0, width)), a.job.output.dtype).type


def _blocks(a: Assembly, with_views: bool, unwritten: Unwritten | None = None
            ) -> Iterator[tuple[pa.Table, pa.Table | None]]:
    """The new version's docs and chunks, BLOCK_ROWS documents at a time, in row order;
    `unwritten` cells hold zeros, unread (see StreamedVersion)."""
    has_chunks = "chunks" in a.job.output.levels
    n = a.changes.rows
    chunk_at = 0  # the new version's first chunk row of the block
    for start in range(0, max(n, 1), BLOCK_ROWS):
        rows = np.arange(start, min(start + BLOCK_ROWS, n))
        docs = _docs_block(a, rows, with_views, _Unread(unwritten, "docs", start))
        chunks = None
        if has_chunks:
            chunks = _chunks_block(a, rows, docs, with_views,
                                   _Unread(unwritten, "chunks", chunk_at))
            chunk_at += chunks.num_rows
        yield docs, chunks


class _Unread:
    """Which cells of one level's block are not read (left to zeros): those of the
    `unwritten` columns on the rows its writer leaves as they are."""

    def __init__(self, unwritten: Unwritten | None, level: str, first_row: int):
        self.rows = (unwritten or {}).get(level, {})
        self.first_row = first_row

    def of(self, name: str, n: int) -> np.ndarray | None:
        """The block's rows of column `name` left unread (None: all are read)."""
        rows = self.rows.get(name)
        return None if rows is None else rows[self.first_row : self.first_row + n]


def _docs_block(a: Assembly, rows: np.ndarray, with_views: bool = True,
                unread: _Unread | None = None) -> pa.Table:
    c = a.changes
    unread = unread or _Unread(None, "docs", 0)
    from_store, source = c.from_store[rows], c.source[rows]
    input_row, store_row = c.input_row[rows], c.store_row[rows]
    has_input = input_row >= 0
    gone_rows = store_row[~has_input]
    take = input_row[has_input]
    columns: dict[str, pa.Array] = {"row": pa.array(rows.astype(np.int64))}
    # a kept row's id and digest as the comparison read them (gone and superseded rows lie
    # all over the store: reading them again cost a chunk each)
    kept_ids, kept_digests = c.stored_at(gone_rows) if len(gone_rows) else (None, None)
    columns["id"] = _combine(has_input, take_rows(c.inputs.ids, take), kept_ids)
    fields = {name: _gather(a, "docs", name, from_store, source, unread.of(name, len(rows)))
              for name in DOC_FIELDS}
    columns["n_tokens"] = pa.array(fields["n_tokens"].astype(np.int64))
    columns["n_chunks"] = pa.array(a.counts[rows])
    columns["truncated"] = pa.array(fields["truncated"].astype(bool))
    columns["status"] = pa.array(list(fields["status"]), pa.string())
    for name in a.job.input.carry_columns:
        columns[name] = _combine(has_input, take_rows(c.inputs.carry.column(name), take),
                                 _stored(a.store.docs, name, gone_rows))
    for name in ("n_unk", "n_words", "n_fragmented"):  # vocabulary fit, as a full run
        columns[name] = pa.array(fields[name].astype(np.int64))
    columns["text_sha256"] = _combine(has_input, to_hex(take_rows(c.inputs.digests, take)),
                                      to_hex(kept_digests) if kept_digests is not None
                                      else None)
    columns["present"] = pa.array(has_input)
    dtype = a.job.output.dtype
    for view in a.views if with_views else ():
        columns[view] = vector_array(_gather(a, "docs", view, from_store, source,
                                             unread.of(view, len(rows))), dtype)
    return pa.table(columns)


def _chunks_block(a: Assembly, rows: np.ndarray, docs: pa.Table,
                  with_views: bool = True, unread: _Unread | None = None) -> pa.Table:
    """The chunks of `rows`, in row order, each document's copied from its source."""
    unread = unread or _Unread(None, "chunks", 0)
    from_store, source = a.changes.from_store[rows], a.changes.source[rows]
    counts = docs.column("n_chunks").to_numpy()
    first = np.zeros(len(rows), np.int64)
    first[from_store] = a.store.first_chunk[source[from_store]]
    if a.delta is not None:
        first[~from_store] = a.delta.first_chunk[source[~from_store]]
    row_of = np.repeat(np.arange(len(rows)), counts)  # (M,) block row of each chunk
    within = np.arange(len(row_of)) - np.repeat(np.cumsum(counts) - counts, counts)
    chunk_source = first[row_of] + within
    chunk_from_store = from_store[row_of]
    columns: dict[str, pa.Array] = {"doc": pa.array(rows[row_of].astype(np.int64))}
    n = len(chunk_source)
    for name in CHUNK_FIELDS:
        values = _gather(a, "chunks", name, chunk_from_store, chunk_source, unread.of(name, n))
        columns[name] = pa.array(values.astype(np.int64))
    for view in a.views if with_views else ():
        values = _gather(a, "chunks", view, chunk_from_store, chunk_source, unread.of(view, n))
        columns[view] = vector_array(values, a.job.output.dtype)
    return pa.table(columns)


def _gather(a: Assembly, level: str, name: str, from_store: np.ndarray,
            source: np.ndarray, unread: np.ndarray | None = None) -> np.ndarray:
    """Values of `name` for rows taken from the store (`from_store`) or the delta; zeros
    on `unread` rows (store rows whose writer leaves them as they are)."""
    stored = _level(a.store, level)[name]
    read = from_store if unread is None else from_store & ~unread
    parts = [(read, rows_of(stored, source[read]))]
    if a.delta is not None and (~from_store).any():
        parts.append((~from_store, _delta_values(a, level, name, source[~from_store])))
    shape = (len(source), *stored.shape[1:])
    dtype = parts[0][1].dtype if from_store.any() else parts[-1][1].dtype
    if unread is None:
        out = np.empty(shape, dtype)
    else:  # unread cells: zeros, or empty strings in a column of strings
        out = np.full(shape, "" if dtype.kind == "O" else 0, dtype)
    for mask, values in parts:
        out[mask] = values
    return out


def _delta_values(a: Assembly, level: str, name: str, rows: np.ndarray) -> np.ndarray:
    """A field of delta rows; a post-processed view is its source view, transformed with
    the store's fitted parameters (so unchanged rows and new ones share one transform)."""
    assert a.delta is not None
    if name not in a.derived:
        return rows_of(_level(a.delta, level)[name], rows)
    source, transform = a.derived[name]
    base = (rows_of(_level(a.delta, level)[source], rows) if source == name
            else _delta_values(a, level, source, rows))
    stored = _level(a.store, level)[name]
    return transform(base.astype(np.float64)).astype(stored.dtype)


def rows_of(array: xr.DataArray, rows: np.ndarray) -> np.ndarray:
    """`array`'s values at `rows` of its first dimension. The rows a block takes from one
    source lie in runs (consecutive store rows, less those a writer leaves alone): each
    run is read as one range, runs less than NEAR_ROWS apart as one (a range read costs
    a quarter of a gather of the same rows); rows in more than MAX_RUNS runs (copies of
    identical texts all over the store) are gathered."""
    if len(rows) == 0:
        return np.asarray(array[:0].values)
    steps = np.diff(rows)
    # rows mostly come ascending (a block's store rows in store order): no sort needed then
    distinct = rows[np.r_[True, steps != 0]] if (steps >= 0).all() else np.unique(rows)
    starts = distinct[np.r_[0, np.flatnonzero(np.diff(distinct) > NEAR_ROWS) + 1]]
    if len(starts) > MAX_RUNS:
        return np.asarray(array[rows].values)
    ends = distinct[np.r_[np.flatnonzero(np.diff(distinct) > NEAR_ROWS), len(distinct) - 1]] + 1
    values = np.concatenate([np.asarray(array[int(a) : int(b)].values)
                             for a, b in zip(starts, ends, strict=True)])
    run = np.searchsorted(starts, rows, side="right") - 1
    before = np.r_[0, np.cumsum(ends - starts)[:-1]]
    return values[before[run] + rows - starts[run]]


def _level(source: Source, level: str) -> xr.Dataset:
    data = source.docs if level == "docs" else source.chunks
    assert data is not None  # chunks are asked for only when the job stores them
    return data


def _stored(docs: xr.Dataset, name: str, rows: np.ndarray) -> pa.Array | None:
    """A flat column of store rows as Arrow (NaN, NaT and None read back as nulls); None
    when the store has no such column (a carried column added since)."""
    if len(rows) == 0:
        return None
    if name not in docs.variables:
        return pa.nulls(len(rows))
    return pa.array(rows_of(docs[name], rows), from_pandas=True)


def _combine(has_input: np.ndarray, from_input: pa.Array | pa.ChunkedArray,
             from_store: pa.Array | None) -> pa.Array:
    """One column in block order: input rows where `has_input`, store rows elsewhere."""
    if isinstance(from_input, pa.ChunkedArray):
        from_input = from_input.combine_chunks()
    if from_store is None:
        return from_input
    try:
        from_store = from_store.cast(from_input.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        from_input = from_input.cast(from_store.type)  # e.g. integers beside NaN floats
    k = len(from_input)
    order = np.empty(len(has_input), np.int64)
    order[has_input] = np.arange(k)
    order[~has_input] = k + np.arange(len(has_input) - k)
    return pa.concat_arrays([from_input, from_store]).take(pa.array(order))
