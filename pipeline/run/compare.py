"""Comparing the input with a store's current version, row by row, by id and text digest.

Every row of the new version gets a source for its results (the store's current version,
or the delta of texts this run encodes) and, for its id and carried columns, the input row
it comes from (or, for a row whose id is gone from the input and is kept, its store row).

Order of the new version: the store's rows keep their positions (a pruned row is
dropped), then the rows with new ids, in input order. A changed text either replaces its
row in place or, for a format that updates its arrays in place (Icechunk), is added at the
end with the new ids while its old row stays where it was, flagged `present: false` and
superseded: the id's current row is always its last.

Memory does not grow with the table. The store's ids and digests and the input's are split
by a hash of the id (to match ids) and of the digest (to find identical texts) into buckets
of about BUCKET_ROWS rows, compared one bucket at a time; past one bucket, the buckets, both
sides in row order and the plan's row-length arrays are files in a scratch folder, memory-
mapped (the operating system pages them in and out), and every pass over a row-length
array goes STEP_ROWS at a time. The texts to encode are read again, from the partitions
that hold them, once the comparison knows which they are.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xarray as xr

from ..errors import StoreError, UnreadableInputError
from ..extract.source import Partition, RowGroupCache, id_hashes, read_partition
from ..extract.texthash import text_sha256_bytes
from ..spec import InputSpec
from ..stores.opened import current_rows, last_of_each_id

DIGEST = pa.binary(32)  # a text's SHA-256 while comparing (stored as hex)
CARRIED = "carried:"  # a carried column's name beside the input's ids and digests (any
# name may be carried, `id` and `digest` too)
READ_ROWS = 65536  # the store's digests are read and converted this many at a time
# store and input rows compared in memory at once (ids, digests, rows and the hash tables
# over them: about 200 bytes a row); more are split into buckets on a scratch disk
BUCKET_ROWS = 4_000_000
STEP_ROWS = 1 << 20  # rows per step of a pass over a row-length array
# Superseded rows (edits appended) are kept until they would pass this share of the new
# version's rows; that update then drops them all and makes its edits in place (rows move
# from the first dropped one on, as in a prune)
SUPERSEDED_SHARE = 0.10


def from_hex(hexes: pa.Array) -> pa.Array:
    """Hex digests as binary(32) (a null, which no stored row has, as 32 zero bytes)."""
    joined = "".join(pc.fill_null(hexes, "0" * 64).to_pylist())
    return pa.FixedSizeBinaryArray.from_buffers(DIGEST, len(hexes),
                                                [None, pa.py_buffer(bytes.fromhex(joined))])


def to_hex(digests: pa.Array | pa.ChunkedArray) -> pa.Array:
    """binary(32) digests as the hex strings a store keeps."""
    if isinstance(digests, pa.ChunkedArray):
        digests = digests.combine_chunks()
    n = len(digests)
    raw = digests.buffers()[1].to_pybytes()[digests.offset * 32 : (digests.offset + n) * 32]
    offsets = pa.py_buffer(np.arange(0, 64 * n + 1, 64, dtype=np.int32).tobytes())
    return pa.StringArray.from_buffers(n, offsets, pa.py_buffer(raw.hex().encode()))


# the store's rows [start, stop): ids, digests (binary(32)) and `present` flags
ReadRows = Callable[[int, int], tuple[pa.Array, pa.Array, np.ndarray]]


@dataclass
class StoreRows:
    """The store's current version as the comparison reads it: its ids, text digests and
    `present` flags, READ_ROWS rows at a time, in store order."""

    rows: int
    read: ReadRows

    @classmethod
    def of(cls, docs: xr.Dataset, path: str) -> StoreRows:
        if "text_sha256" not in docs or "present" not in docs:
            raise StoreError(f"output.path: {path} was written without text digests (by an "
                             "older bertpipe), so an incremental run cannot tell which rows "
                             "changed; rebuild it once with --overwrite")

        def read(start: int, stop: int) -> tuple[pa.Array, pa.Array, np.ndarray]:
            # a block's hex strings as Python objects are 4x their size: never all at once
            hexes = np.asarray(docs["text_sha256"][start:stop].values)
            return (pa.array(np.asarray(docs["id"][start:stop].values)),
                    from_hex(pa.array(hexes, pa.string())),
                    np.asarray(docs["present"][start:stop].values, dtype=bool))

        return cls(int(docs.sizes["doc"]), read)

    @classmethod
    def of_arrays(cls, ids: pa.Array, digests: pa.Array, present: np.ndarray) -> StoreRows:
        return cls(len(ids), lambda a, b: (ids[a:b], digests[a:b], present[a:b]))

    def __len__(self) -> int:
        return self.rows

    def blocks(self) -> Iterator[tuple[int, pa.Array, pa.Array, np.ndarray]]:
        for start in range(0, self.rows, READ_ROWS):
            yield start, *self.read(start, min(start + READ_ROWS, self.rows))


@dataclass
class InputRows:
    """The input as the new version needs it: ids, text digests and carried columns."""

    ids: pa.ChunkedArray
    digests: pa.ChunkedArray  # binary(32)
    carry: pa.Table


# One partition of the input as the comparison needs it: ids, digests, carried columns, texts
InputBatch = tuple[pa.Array, pa.Array, pa.Table, Sequence[str | None]]


@dataclass
class Changes:
    """The new version, row by row, and the texts this run must encode for it."""

    from_store: np.ndarray  # (R,) bool: results come from the store's current version
    source: np.ndarray  # (R,) int64: row of the store, or of the delta
    input_row: np.ndarray  # (R,) int64: row of the input, -1 for a kept row whose id is gone
    store_row: np.ndarray  # (R,) int64: row of the store it was, -1 for a new id
    was_present: np.ndarray  # (R,) bool: its store row's `present` flag (False: a new id)
    inputs: InputRows
    # the store's ids and digests as compared, in store order: a kept row without an input
    # row (gone, superseded) takes them from here, not from the store
    stored: pa.Table
    delta_digests: list[bytes] = field(default_factory=list)  # distinct texts to encode
    delta_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # 1st row
    delta_texts: list[str | None] = field(default_factory=list)
    added: int = 0
    replaced: int = 0
    unchanged: int = 0
    gone: int = 0
    pruned: int = 0
    superseded: int = 0  # rows the new version keeps, flagged, whose id has a later row
    dropped: int = 0  # superseded rows removed (a prune, or past SUPERSEDED_SHARE)
    appended_edits: bool = False  # changed texts were added at the end, not made in place
    scratch: Scratch | None = None  # holds the files the arrays above may be mapped from

    @property
    def rows(self) -> int:
        return len(self.source)

    def close(self) -> None:
        """Remove the scratch files (the arrays above must not be used after)."""
        if self.scratch is not None:
            self.scratch.close()

    def stored_at(self, store_rows: np.ndarray) -> tuple[pa.Array, pa.Array]:
        """Ids and digests of store rows, as the comparison read them."""
        return (take_rows(self.stored.column("id"), store_rows),
                take_rows(self.stored.column("digest"), store_rows))

    @property
    def encoded(self) -> int:
        return len(self.delta_digests)

    @property
    def copied(self) -> int:
        """Rows needing new results that take those of an identical text instead."""
        return self.added + self.replaced - self.encoded


class Scratch:
    """Where the comparison keeps what grows with the table: in memory, or, past one
    bucket, in files of a temporary folder, memory-mapped (removed with this object)."""

    def __init__(self, on_disk: bool):
        self._folder = tempfile.TemporaryDirectory(prefix="bertpipe-compare-") \
            if on_disk else None
        self.buckets: list[Buckets] = []  # their files are written here

    @property
    def on_disk(self) -> bool:
        return self._folder is not None

    def path(self, name: str) -> Path:
        assert self._folder is not None
        return Path(self._folder.name) / name

    def array(self, name: str, n: int, dtype: type | np.dtype, fill: int | bool = 0
              ) -> np.ndarray:
        if self._folder is None:
            return np.full(n, fill, dtype)
        out = np.lib.format.open_memmap(self.path(f"{name}.npy"), "w+", np.dtype(dtype), (n,))
        if fill:  # a new file reads as zeros
            for step in steps(n):
                out[step] = fill
        return out

    def table(self, name: str, batches: Iterable[pa.RecordBatch], empty: pa.Schema
              ) -> pa.Table:
        """The batches as one table (their column types promoted to one, as a column of
        nulls only to the type of the others): in memory, or written as they come to Arrow
        files (one per run of batches of one schema) mapped back."""
        if self._folder is None:
            runs = [pa.Table.from_batches([batch]) for batch in batches]
        else:
            runs = [pa.ipc.open_file(pa.memory_map(str(file))).read_all()
                    for file in self._write_runs(name, batches)]
        if not runs:
            return empty.empty_table()
        return pa.concat_tables(runs, promote_options="permissive")

    def _write_runs(self, name: str, batches: Iterable[pa.RecordBatch]) -> list[Path]:
        files: list[Path] = []
        sink, writer, schema = None, None, None
        for batch in batches:
            if writer is None or batch.schema != schema:
                if writer is not None and sink is not None:
                    writer.close()
                    sink.close()
                files.append(self.path(f"{name}-{len(files)}.arrow"))
                schema = batch.schema
                sink = pa.OSFile(str(files[-1]), "wb")
                writer = pa.ipc.new_file(sink, schema)
            writer.write_batch(batch)
        if writer is not None and sink is not None:
            writer.close()
            sink.close()
        return files

    def close(self) -> None:
        for buckets in self.buckets:
            buckets.close()
        if self._folder is not None:
            self._folder.cleanup()


def take_rows(column: pa.ChunkedArray, rows: np.ndarray) -> pa.Array:
    """`column[rows]` as one array, each row taken from the chunk holding it (a chunked
    array's own `take` joins every chunk first: a copy of the whole column per call)."""
    rows = np.asarray(rows, np.int64)
    lengths = np.array([len(chunk) for chunk in column.chunks], np.int64)
    starts = np.cumsum(lengths) - lengths
    order, bounds = _grouped(np.searchsorted(starts, rows, side="right") - 1, len(lengths))
    pieces = [column.chunk(c).take(pa.array(rows[order[bounds[c] : bounds[c + 1]]] - starts[c]))
              for c in range(len(lengths)) if bounds[c + 1] > bounds[c]]
    if not pieces:
        return pa.array([], column.type)
    back = np.empty(len(rows), np.int64)
    back[order] = np.arange(len(rows))
    return pa.concat_arrays(pieces).take(pa.array(back))


def _grouped(which: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions ordered by group (0..k-1, each group's in their order) and each group's
    bounds in that order: group g is order[bounds[g]:bounds[g + 1]]."""
    order = np.argsort(which, kind="stable")
    return order, np.searchsorted(which[order], np.arange(k + 1))


def steps(n: int) -> Iterator[slice]:
    """[0, n) in slices of STEP_ROWS."""
    for start in range(0, n, STEP_ROWS):
        yield slice(start, min(start + STEP_ROWS, n))


class Buckets:
    """Rows split by a hash into `k` buckets, each read back whole, its rows in the order
    they were added (ascending)."""

    def __init__(self, scratch: Scratch, name: str, k: int, schema: pa.Schema):
        scratch.buckets.append(self)
        self.k, self.schema = k, schema
        self.held: list[list[pa.RecordBatch]] = [[] for _ in range(k)]
        self.files = [scratch.path(f"{name}-{b}.arrow") for b in range(k)] \
            if scratch.on_disk else []
        self.writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}

    def add(self, batch: pa.RecordBatch, hashes: np.ndarray | None) -> None:
        if self.k == 1 or hashes is None:
            self._put(0, batch)
            return
        order, bounds = _grouped((hashes % np.uint64(self.k)).astype(np.int64), self.k)
        ordered = batch.take(pa.array(order))
        for b in range(self.k):
            if bounds[b + 1] > bounds[b]:
                self._put(b, ordered.slice(bounds[b], bounds[b + 1] - bounds[b]))

    def _put(self, b: int, batch: pa.RecordBatch) -> None:
        if not self.files:
            self.held[b].append(batch)
            return
        if b not in self.writers:
            self.writers[b] = pa.ipc.new_stream(str(self.files[b]), self.schema)
        self.writers[b].write_batch(batch)

    def close(self) -> None:
        """Every file written (nothing more is added)."""
        for writer in self.writers.values():
            writer.close()
        self.writers = {}

    def get(self, b: int) -> pa.Table:
        self.close()
        if not self.files:
            return pa.Table.from_batches(self.held[b], self.schema)
        if not self.files[b].exists():
            return self.schema.empty_table()
        return pa.ipc.open_stream(pa.memory_map(str(self.files[b]))).read_all()


def bucket_count(rows: int) -> int:
    return max(1, -(-rows // BUCKET_ROWS))


def compare(spec: InputSpec, parts: Sequence[Partition], store: StoreRows,
            prune: bool, append_edits: bool = False) -> Changes:
    """Read the input partition by partition (ids, digests, carried columns) and decide,
    row by row, what the new version holds and what must be encoded; then read the texts
    to encode. `append_edits`: a changed text is added at the end and its old row kept,
    flagged (for a format that writes only the chunks that differ: an edit then rewrites
    none of its neighbours), unless the update drops rows anyway (`prune`, or superseded
    rows past SUPERSEDED_SHARE); else it replaces the old row in place."""
    row_groups = RowGroupCache()

    def batches(id_type: pa.DataType | None) -> Iterator[InputBatch]:
        for part in parts:
            rows = read_partition(spec, part, row_groups)
            carry = pa.table(rows.carry) if rows.carry else pa.table({})
            yield (_ids_like(rows.ids, id_type, spec),
                   pa.array(text_sha256_bytes(rows.texts), DIGEST), carry, rows.texts)

    changes = plan(store, batches, sum(p.n_rows for p in parts), prune, append_edits)
    if changes.scratch is not None and changes.scratch.on_disk:  # texts not kept on the way
        try:
            changes.delta_texts = _delta_texts(spec, parts, changes, row_groups)
        except BaseException:
            changes.close()
            raise
    return changes


def plan(store: StoreRows, batches: Callable[[pa.DataType | None], Iterable[InputBatch]],
         n_input: int, prune: bool, append_edits: bool) -> Changes:
    """The new version against `store`, for the input in `batches` (given the store's id
    type, or None for an empty store). In one bucket, the store's digests are looked up as
    the input is read and the texts to encode kept on the way; split into buckets, the
    delta's texts are left as None (its first rows say where they are)."""
    k = bucket_count(len(store) + n_input)
    scratch = Scratch(on_disk=k > 1)
    try:
        stored = _Side.of_store(store, scratch, k)
        copy_of = scratch.array("copy_of", n_input, np.int64, -1)
        inline = _InlineDigests(stored.by_digest.get(0), copy_of) if k == 1 else None
        # split: each input row's first row of its text in its partition (only those go
        # to the digest buckets: a text on many rows, an empty one, is one row a batch)
        first_of = scratch.array("first_of", n_input, np.int64) if k > 1 else None
        given = _Side.of_input(batches(stored.id_type), scratch, k, n_input, inline,
                               stored.id_type, first_of)
        found = _Found.of(stored, given, scratch, k, copy_of, inline, first_of)
        changes = _plan(found, stored, given, prune, append_edits, scratch)
    except BaseException:
        scratch.close()
        raise
    changes.scratch = scratch
    return changes


@dataclass
class _Side:
    """One side of the comparison: its rows in order (ids, digests, and the store's
    `present` flags or the input's carried columns), and by bucket: rows by id and rows
    by digest (the same buckets when there is one)."""

    rows: int
    ordered: pa.Table
    by_id: Buckets
    by_digest: Buckets
    id_type: pa.DataType | None

    @classmethod
    def of_store(cls, store: StoreRows, scratch: Scratch, k: int) -> _Side:
        first_ids = store.read(0, min(len(store), 1))[0]
        id_type = first_ids.type if len(store) else None
        keyed, by_id, by_digest = _buckets(scratch, "store", k, first_ids.type)
        schema = pa.schema([("id", first_ids.type), ("digest", DIGEST), ("present", pa.bool_())])

        def ordered() -> Iterator[pa.RecordBatch]:
            for start, ids, digests, present in store.blocks():
                _add(by_id, by_digest, keyed, start, ids, digests)
                yield pa.record_batch([ids, digests, pa.array(present)], schema=schema)

        table = scratch.table("store", ordered(), schema)
        by_id.close()
        by_digest.close()
        return cls(len(store), table, by_id, by_digest, id_type)

    @classmethod
    def of_input(cls, batches: Iterable[InputBatch], scratch: Scratch, k: int,
                 n_input: int, inline: _InlineDigests | None, id_type: pa.DataType | None,
                 first_of: np.ndarray | None) -> _Side:
        buckets: list[tuple[pa.Schema, Buckets, Buckets]] = []
        read = [0]

        def ordered() -> Iterator[pa.RecordBatch]:
            for ids, digests, carry, texts in batches:
                start = read[0]
                if inline is not None:
                    inline.add(start, digests, texts)
                if not buckets:
                    buckets.append(_buckets(scratch, "input", k, ids.type))
                _add(buckets[0][1], buckets[0][2], buckets[0][0], start, ids, digests,
                     first_of)
                read[0] += len(ids)
                yield pa.record_batch({"id": ids, "digest": digests, **{
                    CARRIED + name: carry.column(name).combine_chunks()
                    for name in carry.column_names}})

        table = scratch.table("input", ordered(),
                              pa.schema([("id", id_type or pa.int64()), ("digest", DIGEST)]))
        if read[0] != n_input:
            raise StoreError(f"internal: {read[0]} input rows read, {n_input} planned")
        _, by_id, by_digest = buckets[0] if buckets else _buckets(scratch, "input", k,
                                                                  id_type or pa.int64())
        return cls(n_input, table, by_id, by_digest, None)

    def inputs(self) -> InputRows:
        carry = [n for n in self.ordered.column_names if n.startswith(CARRIED)]
        return InputRows(self.ordered.column("id"), self.ordered.column("digest"),
                         self.ordered.select(carry).rename_columns(
                             [n[len(CARRIED):] for n in carry]))


def _buckets(scratch: Scratch, side: str, k: int, id_type: pa.DataType
             ) -> tuple[pa.Schema, Buckets, Buckets]:
    keyed = pa.schema([("id", id_type), ("digest", DIGEST), ("row", pa.int64())])
    by_id = Buckets(scratch, f"{side}-by-id", k, keyed)
    return keyed, by_id, by_id if k == 1 else Buckets(scratch, f"{side}-by-digest", k, keyed)


def _add(by_id: Buckets, by_digest: Buckets, keyed: pa.Schema, start: int, ids: pa.Array,
         digests: pa.Array, first_of: np.ndarray | None = None) -> None:
    """A batch's rows to the id buckets, and the first row of each of its distinct texts
    to the digest buckets (`first_of`, for the input: where each row's first row is)."""
    batch = pa.record_batch([ids, digests, pa.array(np.arange(start, start + len(ids)))],
                            schema=keyed)
    if by_id is by_digest:
        by_id.add(batch, None)
        return
    by_id.add(batch, id_hashes(ids))
    _, first, inverse = np.unique(_as_bytes(digests), return_index=True, return_inverse=True)
    if first_of is not None:
        first_of[start : start + len(ids)] = first[inverse.reshape(-1)] + start
    distinct = batch.take(pa.array(np.sort(first)))
    by_digest.add(distinct, _prefixes(_as_bytes(distinct.column(1))))  # SHA-256: spread


@dataclass
class _Found:
    """What matching the two sides found, per input row: the store row holding its id now
    (-1: none), whether that row's text differs, the first store row holding its text (-1:
    none), its row of the delta (-1: not encoded); per store row: superseded (its id has a
    later row). The delta: its distinct digests, each at its first input row."""

    at: np.ndarray
    edited: np.ndarray
    copy_of: np.ndarray
    delta_of: np.ndarray
    superseded: np.ndarray
    delta_digests: list[bytes]
    delta_rows: np.ndarray
    delta_texts: list[str | None]

    @classmethod
    def of(cls, stored: _Side, given: _Side, scratch: Scratch, k: int, copy_of: np.ndarray,
           inline: _InlineDigests | None, first_of: np.ndarray | None) -> _Found:
        n, s = given.rows, stored.rows
        at = scratch.array("at", n, np.int64, -1)
        edited = scratch.array("edited", n, bool)
        superseded = scratch.array("superseded", s, bool)
        # the input's ids are unique: preflight refuses repeats for every incremental run
        # (`source.check_unique_ids`), and a file written since is refused when read
        for b in range(k):
            _match_ids(stored.by_id.get(b), given.by_id.get(b), at, edited, superseded)
        wanted_rows, wanted_digests = [np.zeros(0, np.int64)], [np.empty(0, "S32")]
        if inline is not None:  # looked up as the input was read
            wanted_rows += inline.rows
            wanted_digests += inline.digests
        else:
            for b in range(k):
                rows, digests = _match_digests(stored.by_digest.get(b),
                                               given.by_digest.get(b), copy_of)
                wanted_rows.append(rows)
                wanted_digests.append(digests)
        delta_of = scratch.array("delta_of", n, np.int64, -1)
        delta, first = _delta(np.concatenate(wanted_rows), np.concatenate(wanted_digests),
                              delta_of)
        if first_of is not None:  # a repeated text takes its first row's lookup
            for step in steps(n):
                at_first = first_of[step]
                copy_of[step] = copy_of[at_first]
                delta_of[step] = delta_of[at_first]
        texts: list[str | None] = [None] * len(delta)  # split: read again by `compare`
        if inline is not None:
            texts = [inline.texts[d] for d in delta]
        return cls(at, edited, copy_of, delta_of, superseded, delta, first, texts)


def _match_ids(store: pa.Table, given: pa.Table, at: np.ndarray, edited: np.ndarray,
               superseded: np.ndarray) -> None:
    """One bucket's ids: each input row's store row (the id's last), whether its text
    changed; each store row's superseded flag."""
    store_ids = store.column("id").combine_chunks()
    store_rows = store.column("row").to_numpy()
    ids, rows = given.column("id").combine_chunks(), given.column("row").to_numpy()
    if len(store_ids) == 0:
        return
    superseded[store_rows] = ~last_of_each_id(store_ids)
    local = current_rows(store_ids, ids)
    hit = np.flatnonzero(local >= 0)
    at[rows[hit]] = store_rows[local[hit]]
    same = pc.equal(store.column("digest").take(pa.array(local[hit])),
                    given.column("digest").take(pa.array(hit)))
    edited[rows[hit[~_np(same)]]] = True


class _InlineDigests:
    """The store's digests looked up as the input is read (one bucket): each input row's
    first store row with its text, and the rows, digests and texts the store lacks."""

    def __init__(self, store: pa.Table, copy_of: np.ndarray):
        self.lookup = DigestLookup(store.column("digest").combine_chunks())
        self.copy_of = copy_of
        self.rows: list[np.ndarray] = []
        self.digests: list[np.ndarray] = []
        self.texts: dict[bytes, str | None] = {}  # the first text of each lacking digest

    def add(self, start: int, digests: pa.Array, texts: Sequence[str | None]) -> None:
        local = self.lookup.index_in(digests)  # one bucket: its rows are the store's
        self.copy_of[start : start + len(local)] = local
        lacking = np.flatnonzero(local < 0)
        self.rows.append(lacking + start)
        keys = _as_bytes(digests)[lacking]
        self.digests.append(keys)
        raw = keys.tobytes()
        for j, i in enumerate(lacking.tolist()):
            self.texts.setdefault(raw[32 * j : 32 * j + 32], texts[i])


def _match_digests(store: pa.Table, given: pa.Table, copy_of: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """One bucket's digests: each input row's first store row with its text; the input
    rows whose text the store lacks and their digests (as 32-byte strings)."""
    lookup = DigestLookup(store.column("digest").combine_chunks())
    digests = given.column("digest").combine_chunks()
    rows = given.column("row").to_numpy()
    local = lookup.index_in(digests)
    store_rows = store.column("row").to_numpy()
    hit = local >= 0
    copy_of[rows[hit]] = store_rows[local[hit]]
    return rows[~hit], _as_bytes(digests)[~hit]


def _delta(rows: np.ndarray, digests: np.ndarray, delta_of: np.ndarray
           ) -> tuple[list[bytes], np.ndarray]:
    """The distinct digests of `rows` (input rows whose text the store lacks) in the order
    of their first row, that row, and each row's place among them (into `delta_of`)."""
    order = np.argsort(rows, kind="stable")
    rows, digests = rows[order], digests[order]
    distinct, first, inverse = np.unique(digests, return_index=True, return_inverse=True)
    by_first = np.argsort(first, kind="stable")
    rank = np.empty(len(by_first), np.int64)
    rank[by_first] = np.arange(len(by_first))
    delta_of[rows] = rank[inverse.reshape(-1)]
    raw = np.ascontiguousarray(distinct[by_first]).tobytes()  # bytes(d) drops trailing NULs
    return [raw[i : i + 32] for i in range(0, len(raw), 32)], rows[first[by_first]]


@dataclass
class _Placement:
    """Where each row goes: the input row each store row keeps (-1: none), the store's
    rows the new version keeps, the input rows appended, and what the counts need."""

    input_of: np.ndarray  # (store rows,) int64
    old_rows: np.ndarray  # store rows kept, ascending
    new_rows: np.ndarray  # input rows appended, in input order
    edited: int  # input rows whose id's stored text changed
    appended_edits: bool
    found: int  # input ids the store holds
    gone: int  # store rows whose id left the input
    superseded: int  # kept rows an edit superseded
    dropped: int  # superseded rows dropped


def _place(found: _Found, store_rows: int, prune: bool, append_edits: bool, scratch: Scratch
           ) -> _Placement:
    """Decide whether edits are appended, and which store rows the new version keeps."""
    at, n = found.at, len(found.at)
    held = sum(int((at[step] >= 0).sum()) for step in steps(n))
    edited = np.concatenate([np.flatnonzero(found.edited[step]) + step.start
                             for step in steps(n)] or [np.zeros(0, np.int64)])
    superseded = sum(int(found.superseded[step].sum()) for step in steps(store_rows))
    # edits are appended unless this update drops rows anyway (a prune, or superseded rows
    # past their share): rows then move from the first dropped one on, so edits are made in
    # place and every superseded row is dropped
    compact = prune or (append_edits and _compaction_due(
        superseded + len(edited), store_rows + n - held + len(edited)))
    append = append_edits and not compact
    edited_store = np.sort(at[edited]) if append else np.zeros(0, np.int64)
    if append:  # the old row keeps its place (and its chunks), flagged; the edit follows
        at[edited] = -1
    input_of = scratch.array("input_of", store_rows, np.int64, -1)  # store row -> input row
    new_rows = scratch.array("new_rows", n, np.int64)
    n_new = 0
    for step in steps(n):
        block = at[step]
        sel = block >= 0
        input_of[block[sel]] = np.flatnonzero(sel) + step.start
        new = np.flatnonzero(~sel) + step.start
        new_rows[n_new : n_new + len(new)] = new
        n_new += len(new)
    old_rows = scratch.array("old_rows", store_rows, np.int64)
    kept_n = gone = kept_stale = dropped = 0
    for step in steps(store_rows):
        without = input_of[step] < 0
        flagged = found.superseded[step].copy()
        lo, hi = np.searchsorted(edited_store, [step.start, step.stop])
        flagged[edited_store[lo:hi] - step.start] = True
        stale = without & flagged
        is_gone = without & ~stale
        kept = ~without | (is_gone & (not prune)) | (stale & (not compact))
        rows = np.flatnonzero(kept) + step.start
        old_rows[kept_n : kept_n + len(rows)] = rows
        kept_n += len(rows)
        gone += int(is_gone.sum())
        kept_stale += int((stale & kept).sum())
        dropped += int((stale & ~kept).sum())
    return _Placement(input_of, old_rows[:kept_n], new_rows[:n_new], len(edited), append,
                      held, gone, kept_stale, dropped)


def _plan(found: _Found, stored: _Side, given: _Side, prune: bool, append_edits: bool,
          scratch: Scratch) -> Changes:
    place = _place(found, stored.rows, prune, append_edits, scratch)
    n_old, n_new = len(place.old_rows), len(place.new_rows)
    rows = n_old + n_new
    input_row = scratch.array("input_row", rows, np.int64)
    store_row = scratch.array("store_row", rows, np.int64, -1)
    from_store = scratch.array("from_store", rows, bool)
    source = scratch.array("source", rows, np.int64)
    was_present = scratch.array("was_present", rows, bool)
    present = stored.ordered.column("present")
    for step in steps(n_old):
        old = place.old_rows[step]
        inputs = place.input_of[old]
        store_row[step], input_row[step] = old, inputs
        was_present[step] = _np(present.take(pa.array(old)))
        # a gone or superseded row keeps what it had; a matched row, unless its text changed
        # (an edit appended left its old row unmatched)
        has = inputs >= 0
        same = ~has
        same[has] = ~found.edited[inputs[has]]
        from_store[step], source[step] = _sources(found, inputs, same, old)
    for step in steps(n_new):
        at = slice(n_old + step.start, n_old + step.stop)
        inputs = place.new_rows[step]
        input_row[at] = inputs
        from_store[at], source[at] = _sources(found, inputs, np.zeros(len(inputs), bool),
                                              np.full(len(inputs), -1, np.int64))
    edits = place.edited
    return Changes(
        from_store=from_store, source=source, input_row=input_row, store_row=store_row,
        was_present=was_present, inputs=given.inputs(),
        stored=stored.ordered.select(["id", "digest"]),
        delta_digests=found.delta_digests, delta_rows=found.delta_rows,
        delta_texts=found.delta_texts,
        added=n_new - (edits if place.appended_edits else 0), replaced=edits,
        unchanged=place.found - edits, gone=place.gone, pruned=place.gone if prune else 0,
        superseded=place.superseded, dropped=place.dropped,
        appended_edits=place.appended_edits)


def _sources(found: _Found, inputs: np.ndarray, same: np.ndarray, store_rows: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """Where rows take their results: their own store row (`same`), an identical stored
    text, or the delta."""
    from_store, source = same.copy(), np.where(same, store_rows, -1)
    need = np.flatnonzero(~same)
    copies = found.copy_of[inputs[need]]
    from_store[need] = copies >= 0
    source[need] = np.where(copies >= 0, copies, found.delta_of[inputs[need]])
    if (source < 0).any():  # every needed text is stored or in the delta, by construction
        raise StoreError("internal: a row of the new version has no source")
    return from_store, source


def _delta_texts(spec: InputSpec, parts: Sequence[Partition], changes: Changes,
                 row_groups: RowGroupCache) -> list[str | None]:
    """The texts to encode, read again from the partitions holding their first rows; a
    text whose digest is no longer the compared one (its file written since) is refused."""
    texts: list[str | None] = [None] * changes.encoded
    rows = changes.delta_rows
    order = np.argsort(rows, kind="stable")
    for part in parts:
        lo, hi = np.searchsorted(rows[order], [part.row_start, part.row_stop])
        if lo == hi:
            continue
        read = read_partition(spec, part, row_groups)
        for i in order[lo:hi]:
            text = read.texts[int(rows[i]) - part.row_start]
            if text_sha256_bytes([text])[0] != changes.delta_digests[i]:
                raise UnreadableInputError(f"input.path: {part.file} changed while it was "
                                           f"compared (row {int(rows[i])} holds another "
                                           "text); rerun once nothing writes it")
            texts[i] = text
    return texts


def _compaction_due(superseded: int, rows: int) -> bool:
    """Superseded rows would pass their share of the new version's rows."""
    return superseded > SUPERSEDED_SHARE * rows


class DigestLookup:
    """Where digests first occur among a store's, asked partition by partition: the
    store's are sorted once by their first 8 bytes (as integers: a binary search over them
    is several times faster than over 32-byte strings) and each ask is a binary search, then
    a check of the whole digest (`pc.index_in` hashes the whole value set on every call,
    so asking partition by partition would cost the store's size each time)."""

    def __init__(self, digests: pa.Array):
        self.keys = _as_bytes(digests)
        prefixes = _prefixes(self.keys)
        self.order = np.argsort(prefixes, kind="stable")  # equal prefixes: rows ascending
        self.prefixes = prefixes[self.order]

    def index_in(self, digests: pa.Array) -> np.ndarray:
        """(n,) int64: the first stored row holding each digest; -1 where none does."""
        keys = _as_bytes(digests)
        if not len(self.prefixes):
            return np.full(len(keys), -1, np.int64)
        wanted = _prefixes(keys)
        at = np.searchsorted(self.prefixes, wanted)
        first = np.minimum(at, len(self.prefixes) - 1)
        rows = self.order[first]
        same_prefix = self.prefixes[first] == wanted
        found = same_prefix & (self.keys[rows] == keys)
        out = np.where(found, rows, -1).astype(np.int64)
        # two digests sharing their first 8 bytes (about one pair in 2**64 / n**2): the
        # asked one may be further along the run of that prefix (rows ascending in it)
        for i in np.flatnonzero(same_prefix & ~found).tolist():
            j = int(at[i])
            while j < len(self.prefixes) and self.prefixes[j] == wanted[i]:
                if self.keys[self.order[j]] == keys[i]:
                    out[i] = self.order[j]
                    break
                j += 1
        return out


def _prefixes(keys: np.ndarray) -> np.ndarray:
    """Each 32-byte digest's first 8 bytes as an unsigned integer, ordered as the bytes."""
    return np.ascontiguousarray(keys).view(np.uint8).reshape(-1, 32)[:, :8].copy() \
        .view(">u8").reshape(-1).astype(np.uint64)


def _as_bytes(digests: pa.Array) -> np.ndarray:
    """binary(32) digests as NumPy 32-byte strings, ordered and compared byte by byte (a
    null, which no digest is, would read as the bytes beneath it)."""
    if not len(digests):
        return np.empty(0, "S32")
    return np.frombuffer(digests.buffers()[1], "S32", count=len(digests),
                         offset=digests.offset * 32)


def _ids_like(ids: pa.Array, store_type: pa.DataType | None, spec: InputSpec) -> pa.Array:
    """The input's ids in the store's id type (integers of any width compare as int64);
    against an empty store, integers as int64."""
    if store_type is None:
        return ids.cast(pa.int64()) if pa.types.is_integer(ids.type) else ids
    if ids.type == store_type:
        return ids
    same_kind = (pa.types.is_integer(ids.type) and pa.types.is_integer(store_type)) or \
        (pa.types.is_string(ids.type) and pa.types.is_string(store_type))
    if not same_kind:
        raise StoreError(f"input.id_column: the input's ids ({spec.id_column!r}) are "
                         f"{ids.type}, the store's are {store_type}; rows cannot be "
                         "matched: a full run (--overwrite) is needed")
    try:
        return ids.cast(store_type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise StoreError(f"input.id_column: ids of type {ids.type} do not fit the store's "
                         f"{store_type}; a full run (--overwrite) is needed") from None


def _np(mask: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool)
