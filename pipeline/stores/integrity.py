"""Checksums of a finished store's files, and Zarr reads that check them before decoding.

When a store is marked complete its format records the SHA-256 of every data file in
the provenance (Zarr: each chunk file and array metadata; Parquet: each file's column
data, the bytes before the footer that holds the provenance itself; fitted parameters
whole). `bertpipe verify` recomputes them all. Zarr reads go through `VerifiedStore`,
which checks each chunk against its checksum before the codec sees the bytes, so a
truncated, missing or altered chunk is an error naming the array: never zeros, never
silently different values, never bytes a decompressor may choke on.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from ..errors import StoreError
from ..io.location import Location, resolve
from .provenance import FileSum

CHUNK_DIR = "/c/"  # Zarr v3's default chunk key encoding: <array>/c/<i>/<j>


def file_sum(file: Path | Location, size: int | None = None) -> FileSum | None:
    """SHA-256 of the first `size` bytes of `file` (all of it when None); None if absent.
    A remote file is streamed in large ranged reads, never held whole."""
    loc = _location(file)
    actual = loc.size()
    if actual is None:
        return None
    total = actual if size is None else size
    h = hashlib.sha256()
    left = total
    block_size = 1 << 20 if loc.local else 16 << 20  # why: one GET per block remotely
    with loc.open("rb") as f:
        while left > 0:
            block = f.read(min(left, block_size))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return FileSum(h.hexdigest(), total - left)


def parquet_data_size(file: Path | Location) -> int | None:
    """Bytes of a Parquet file before its footer (magic, then column data); None when the
    file is absent."""
    loc = _location(file)
    size = loc.size()
    if size is None:
        return None
    if size < 12:
        return size
    tail = loc.read_bytes(size - 8, size)
    footer = struct.unpack("<I", tail[:4])[0]
    start = size - 8 - footer
    # no footer to be found (truncated, overwritten): the whole file is what is there
    return start if tail[4:] == b"PAR1" and start >= 4 else size


def _location(file: Path | Location) -> Location:
    return file if isinstance(file, Location) else resolve(file)


def array_of(rel: str) -> str | None:
    """The Zarr array a stored file belongs to (None for a file that is no array's)."""
    for marker in (CHUNK_DIR, "/zarr.json"):
        if marker in rel:
            return rel.split(marker, 1)[0]
    return None


def where(rel: str) -> str:
    """How a message names a stored file: `docs/mean: chunk c/0/0`, or the file itself."""
    if CHUNK_DIR in rel:
        array, key = rel.split(CHUNK_DIR, 1)
        return f"{array}: chunk c/{key}"
    if rel.endswith("/zarr.json"):
        return f"{rel[: -len('/zarr.json')]}: metadata zarr.json"
    return rel


def files_by_array(recorded: Iterable[str]) -> dict[str, list[str]]:
    """Stored files grouped by the Zarr array they belong to (files of no array left out;
    a group's zarr.json is grouped under the group's name)."""
    files_of: dict[str, list[str]] = {}
    for rel in recorded:
        array = array_of(rel)
        if array:
            files_of.setdefault(array, []).append(rel)
    return files_of


def describe(problems: dict[str, str], missing: set[str], recorded: Iterable[str]) -> list[str]:
    """Problems per file as lines, one line for an array none of whose files is there."""
    files_of = files_by_array(recorded)
    gone = {array for array, files in files_of.items()
            if len(files) > 1 and all(f in missing for f in files)}
    lines = [f"{array}: the array is missing (none of its {len(files_of[array])} files is "
             "there)" for array in sorted(gone)]
    return lines + [text for rel, text in problems.items() if array_of(rel) not in gone]


def size_problem(rel: str, size: int | None, recorded: FileSum) -> str | None:
    """What is wrong with a stored file judged by its size alone (cheap: no reading)."""
    if size is None:
        return f"{where(rel)} is missing"
    if size != recorded.size:
        return (f"{where(rel)} is damaged ({size} bytes where {recorded.size} were "
                "recorded)")
    return None


def sum_problem(rel: str, actual: FileSum | None, recorded: FileSum) -> str | None:
    """What is wrong with a stored file judged by its checksum."""
    problem = size_problem(rel, actual.size if actual else None, recorded)
    if problem or actual is None:
        return problem
    if actual.sha256 != recorded.sha256:
        return f"{where(rel)} is damaged (its bytes do not match the recorded checksum)"
    return None


def _sum_of(buffer: Buffer) -> FileSum:
    data = memoryview(buffer.as_buffer_like())
    return FileSum(hashlib.sha256(data).hexdigest(), data.nbytes)


class VerifiedStore(WrapperStore[Store]):
    """A Zarr store (local or fsspec) whose reads of recorded files are checked against their
    checksum first; a file that is missing, truncated or altered raises a StoreError naming
    it."""

    def __init__(self, store: Store, checksums: Mapping[str, FileSum], label: str):
        super().__init__(store)
        self._checksums = dict(checksums)
        self._label = label

    def _with_store(self, store: Store) -> VerifiedStore:
        return VerifiedStore(store, self._checksums, self._label)

    def __reduce__(self) -> tuple[Any, ...]:  # Dask workers get a copy of the graph
        return (VerifiedStore, (self._store, self._checksums, self._label))

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        recorded = self._checksums.get(key)
        if recorded is None:
            return await self._store.get(key, prototype, byte_range)
        whole = await self._store.get(key, prototype, None)
        # hashed in a thread (hashlib releases the GIL): chunks are checked in parallel
        actual = None if whole is None else await asyncio.to_thread(_sum_of, whole)
        problem = sum_problem(key, actual, recorded)
        if problem:
            raise StoreError(f"{self._label}: {problem}; `bertpipe verify` checks the whole "
                             "store")
        if byte_range is not None:
            return await self._store.get(key, prototype, byte_range)
        return whole
