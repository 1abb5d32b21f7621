"""Comparing the input with a store's current version, row by row, by id and text digest.

Every row of the new version gets a source for its results (the store's current version,
or the delta of texts this run encodes) and, for its id and carried columns, the input row
it comes from (or, for a row whose id is gone from the input and is kept, its store row).

Order of the new version: the store's rows keep their positions (a pruned row is
dropped), then the rows with new ids, in input order. A changed text either replaces its
row in place or, for a format that updates its arrays in place (Icechunk), is added at the
end with the new ids while its old row stays where it was, flagged `present: false` and
superseded: the id's current row is always its last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xarray as xr

from ..errors import InputError, StoreError
from ..extract.source import Partition, RowGroupCache, read_partition
from ..extract.texthash import text_sha256_bytes
from ..spec import InputSpec
from ..stores.opened import current_rows, last_of_each_id

DIGEST = pa.binary(32)  # a text's SHA-256 while comparing (stored as hex)
READ_ROWS = 65536  # the store's digests are read and converted this many at a time
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


@dataclass
class StoreRows:
    """What the comparison needs of the store's current version, in store order."""

    ids: pa.Array
    digests: pa.Array  # SHA-256 of each row's text, binary(32)
    present: np.ndarray  # bool

    @classmethod
    def of(cls, docs: xr.Dataset, path: str) -> StoreRows:
        if "text_sha256" not in docs or "present" not in docs:
            raise StoreError(f"output.path: {path} was written without text digests (by an "
                             "older bertpipe), so an incremental run cannot tell which rows "
                             "changed; rebuild it once with --overwrite")
        ids = pa.array(np.asarray(docs["id"].values))
        stored = docs["text_sha256"]
        n = stored.sizes["doc"]
        # read block by block: a block's hex strings as Python objects are 4x their size
        digests = pa.chunked_array([
            from_hex(pa.array(np.asarray(stored[i : i + READ_ROWS].values), pa.string()))
            for i in range(0, n, READ_ROWS)], DIGEST).combine_chunks()
        return cls(ids, digests, np.asarray(docs["present"].values, dtype=bool))

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class InputRows:
    """The input as the new version needs it: ids, text digests and carried columns."""

    ids: pa.ChunkedArray
    digests: pa.ChunkedArray  # binary(32)
    carry: pa.Table


@dataclass
class Changes:
    """The new version, row by row, and the texts this run must encode for it."""

    from_store: np.ndarray  # (R,) bool: results come from the store's current version
    source: np.ndarray  # (R,) int64: row of the store, or of the delta
    input_row: np.ndarray  # (R,) int64: row of the input, -1 for a kept row whose id is gone
    store_row: np.ndarray  # (R,) int64: row of the store it was, -1 for a new id
    was_present: np.ndarray  # (R,) bool: its store row's `present` flag (False: a new id)
    inputs: InputRows
    # the store rows kept without an input row (gone, superseded), ascending, and their ids
    # and digests as compared: the new version takes them from here, not from the store
    alone: np.ndarray
    alone_ids: pa.Array
    alone_digests: pa.Array
    delta_digests: list[bytes] = field(default_factory=list)  # distinct texts to encode
    delta_texts: list[str | None] = field(default_factory=list)
    added: int = 0
    replaced: int = 0
    unchanged: int = 0
    gone: int = 0
    pruned: int = 0
    superseded: int = 0  # rows the new version keeps, flagged, whose id has a later row
    dropped: int = 0  # superseded rows removed (a prune, or past SUPERSEDED_SHARE)
    appended_edits: bool = False  # changed texts were added at the end, not made in place

    @property
    def rows(self) -> int:
        return len(self.source)

    def alone_at(self, store_rows: np.ndarray) -> tuple[pa.Array, pa.Array]:
        """Ids and digests of store rows kept without an input row."""
        at = pa.array(np.searchsorted(self.alone, store_rows))
        return self.alone_ids.take(at), self.alone_digests.take(at)

    @property
    def encoded(self) -> int:
        return len(self.delta_digests)

    @property
    def copied(self) -> int:
        """Rows needing new results that take those of an identical text instead."""
        return self.added + self.replaced - self.encoded


def compare(spec: InputSpec, parts: Sequence[Partition], store: StoreRows,
            prune: bool, append_edits: bool = False) -> Changes:
    """Read the input partition by partition (ids, texts, carried columns) and decide, row
    by row, what the new version holds and what must be encoded. `append_edits`: a changed
    text is added at the end and its old row kept, flagged (for a format that writes only
    the chunks that differ: an edit then rewrites none of its neighbours), unless the
    update drops rows anyway (`prune`, or superseded rows past SUPERSEDED_SHARE); else it
    replaces the old row in place."""
    ids, digests, carry = [], [], []
    copies: list[np.ndarray] = []  # per partition: each row's first store row of its text
    delta: dict[bytes, int] = {}  # digest -> row of the delta
    delta_texts: list[str | None] = []
    store_ids = store.ids
    stored = DigestLookup(store.digests)
    row_groups = RowGroupCache()
    for part in parts:
        rows = read_partition(spec, part, row_groups)
        part_ids = _ids_like(rows.ids, store_ids, spec)
        part_digests = pa.array(text_sha256_bytes(rows.texts), DIGEST)
        # encoded unless its text is stored (at its id's row, or an identical text anywhere)
        copies.append(stored.index_in(part_digests))
        wanted = np.flatnonzero(copies[-1] < 0)
        for i in wanted:
            digest = part_digests[i].as_py()
            if digest not in delta:
                delta[digest] = len(delta_texts)
                delta_texts.append(rows.texts[i])
        ids.append(part_ids)
        digests.append(part_digests)
        carry.append(pa.table(rows.carry) if rows.carry else pa.table({}))
    inputs = InputRows(pa.chunked_array(ids, store_ids.type),
                       pa.chunked_array(digests, DIGEST),
                       _concat(carry, sum(p.n_rows for p in parts)))
    _check_unique(inputs.ids, spec, parts)
    copy_of = np.concatenate(copies) if copies else np.zeros(0, np.int64)
    return _plan(store, inputs, copy_of, delta, delta_texts, prune, append_edits)


@dataclass
class _Placement:
    """Where each row goes: the input row each store row keeps (-1: none), the store's
    rows the new version keeps, the input rows appended, and what the counts need."""

    input_of: np.ndarray  # (rows,) int64
    old_rows: np.ndarray  # store rows kept, ascending
    new_rows: np.ndarray  # input rows appended, in input order
    edited: np.ndarray  # input rows whose id's stored text changed
    appended_edits: bool
    found: int  # input ids the store holds
    gone: int  # store rows whose id left the input
    superseded: int  # kept rows an edit superseded
    dropped: int  # superseded rows dropped


def _place(store: StoreRows, inputs: InputRows, prune: bool, append_edits: bool
           ) -> _Placement:
    """Match each input id to the store row holding it now, decide whether edits are
    appended, and which store rows the new version keeps."""
    at = current_rows(store.ids, inputs.ids)  # (N,) the store row holding the id now, or -1
    found = np.flatnonzero(at >= 0)
    edited = found[~_np(pc.equal(store.digests.take(pa.array(at[found])),
                                 inputs.digests.take(pa.array(found))))]  # input rows
    superseded = ~last_of_each_id(store.ids)  # by an edit an earlier update appended
    # edits are appended unless this update drops rows anyway (a prune, or superseded rows
    # past their share): rows then move from the first dropped one on, so edits are made in
    # place and every superseded row is dropped
    compact = prune or (append_edits and _compaction_due(
        int(superseded.sum()) + len(edited), len(store) + len(at) - len(found) + len(edited)))
    append = append_edits and not compact
    edited_store = np.zeros(len(store), bool)
    edited_store[at[edited]] = append
    if append:  # the old row keeps its place (and its chunks), flagged; the edit follows
        at[edited] = -1
    input_of = np.full(len(store), -1, np.int64)  # store row -> input row
    input_of[at[at >= 0]] = np.flatnonzero(at >= 0)
    stale = (input_of < 0) & (superseded | edited_store)
    gone = (input_of < 0) & ~stale  # ids no longer in the input
    kept = (input_of >= 0) | (gone & (not prune)) | (stale & (not compact))
    return _Placement(input_of, np.flatnonzero(kept), np.flatnonzero(at < 0), edited, append,
                      len(found), int(gone.sum()), int((stale & kept).sum()),
                      int((stale & ~kept).sum()))


def _plan(store: StoreRows, inputs: InputRows, copy_of: np.ndarray, delta: dict[bytes, int],
          delta_texts: list[str | None], prune: bool, append_edits: bool) -> Changes:
    """`copy_of`: (N,) each input row's first store row holding its text, or -1."""
    place = _place(store, inputs, prune, append_edits)
    input_of, old_rows, new_rows = place.input_of, place.old_rows, place.new_rows
    delta_row = _indices(pc.index_in(inputs.digests,
                                     value_set=pa.array(list(delta), DIGEST)))
    input_row = np.concatenate([input_of[old_rows], new_rows])
    store_row = np.concatenate([old_rows, np.full(len(new_rows), -1, np.int64)])
    same = np.zeros(len(input_row), bool)
    in_old = np.flatnonzero(store_row >= 0)
    has_input = input_row[in_old] >= 0
    matched = in_old[has_input]  # store rows whose id is in the input
    same[matched] = _np(pc.equal(store.digests.take(pa.array(store_row[matched])),
                                 inputs.digests.take(pa.array(input_row[matched]))))
    same[in_old[~has_input]] = True  # a gone or superseded row keeps what it had
    alone = store_row[in_old[~has_input]]  # ascending, as old_rows
    # results: the row's own (unchanged or gone), an identical stored text, or the delta
    from_store = same.copy()
    source = np.where(same, store_row, -1)
    need = np.flatnonzero(~same)
    copies = copy_of[input_row[need]]
    from_store[need] = copies >= 0
    source[need] = np.where(copies >= 0, copies, delta_row[input_row[need]])
    if (source < 0).any():  # every needed text is stored or in the delta, by construction
        raise StoreError("internal: a row of the new version has no source")
    was_present = np.zeros(len(store_row), bool)
    was_present[in_old] = store.present[store_row[in_old]]
    edits = len(place.edited)
    return Changes(
        from_store=from_store, source=source, input_row=input_row, store_row=store_row,
        was_present=was_present, inputs=inputs, alone=alone,
        alone_ids=store.ids.take(pa.array(alone)),
        alone_digests=store.digests.take(pa.array(alone)),
        delta_digests=list(delta), delta_texts=delta_texts,
        added=len(new_rows) - (edits if place.appended_edits else 0), replaced=edits,
        unchanged=place.found - edits, gone=place.gone, pruned=place.gone if prune else 0,
        superseded=place.superseded, dropped=place.dropped,
        appended_edits=place.appended_edits)


def _compaction_due(superseded: int, rows: int) -> bool:
    """Superseded rows would pass their share of the new version's rows."""
    return superseded > SUPERSEDED_SHARE * rows


class DigestLookup:
    """Where digests first occur among a store's, asked partition by partition: the
    store's are sorted once and each ask is a binary search (`pc.index_in` hashes the
    whole value set on every call: against a million stored rows, 82 partitions spent
    27 s in it)."""

    def __init__(self, digests: pa.Array):
        keys = _as_bytes(digests)
        self.order = np.argsort(keys, kind="stable")  # equal digests: the first row first
        self.sorted = keys[self.order]

    def index_in(self, digests: pa.Array) -> np.ndarray:
        """(n,) int64: the first stored row holding each digest; -1 where none does."""
        keys = _as_bytes(digests)
        if not len(self.sorted):
            return np.full(len(keys), -1, np.int64)
        at = np.minimum(np.searchsorted(self.sorted, keys), len(self.sorted) - 1)
        return np.where(self.sorted[at] == keys, self.order[at], -1).astype(np.int64)


def _as_bytes(digests: pa.Array) -> np.ndarray:
    """binary(32) digests as NumPy 32-byte strings, ordered and compared byte by byte (a
    null, which no digest is, would read as the bytes beneath it)."""
    if not len(digests):
        return np.empty(0, "S32")
    return np.frombuffer(digests.buffers()[1], "S32", count=len(digests),
                         offset=digests.offset * 32)


def _ids_like(ids: pa.Array, store_ids: pa.Array, spec: InputSpec) -> pa.Array:
    """The input's ids in the store's id type (integers of any width compare as int64)."""
    if ids.type == store_ids.type:
        return ids
    same_kind = (pa.types.is_integer(ids.type) and pa.types.is_integer(store_ids.type)) or \
        (pa.types.is_string(ids.type) and pa.types.is_string(store_ids.type))
    if len(store_ids) and not same_kind:
        raise StoreError(f"input.id_column: the input's ids ({spec.id_column!r}) are "
                         f"{ids.type}, the store's are {store_ids.type}; rows cannot be "
                         "matched: a full run (--overwrite) is needed")
    try:
        return ids.cast(store_ids.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise StoreError(f"input.id_column: ids of type {ids.type} do not fit the store's "
                         f"{store_ids.type}; a full run (--overwrite) is needed") from None


def _check_unique(ids: pa.ChunkedArray, spec: InputSpec, parts: Sequence[Partition]) -> None:
    counts = pc.value_counts(ids)
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(repeated) == 0:
        return
    dup = repeated[0]["values"].as_py()
    rows = np.flatnonzero(_np(pc.equal(ids, pa.scalar(dup, ids.type))))
    shown = ", ".join(str(r) for r in rows[:3]) + (" ..." if len(rows) > 3 else "")
    raise InputError(f"input.id_column: id {dup!r} is on {len(rows)} rows of the input (rows "
                     f"{shown}); an incremental run matches rows to the store by id, so ids "
                     "must be unique")


def _concat(tables: list[pa.Table], n: int) -> pa.Table:
    if not tables or tables[0].num_columns == 0:
        return pa.table({"_": pa.nulls(n)}).drop_columns(["_"])
    return pa.concat_tables(tables, promote_options="permissive")


def _indices(found: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """index_in results as int64, -1 where not found."""
    return np.asarray(pc.fill_null(found, -1).to_numpy(zero_copy_only=False), dtype=np.int64)


def _np(mask: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool)
