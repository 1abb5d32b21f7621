"""The files of an Icechunk repository behind a snapshot, and Icechunk's errors about them
as one line naming the file.

Icechunk gives the size of a chunk key from its manifest: what was written, not what is
there. So that an open checks each file by its size, as the Zarr and Delta formats do, the
manifests of the snapshot are read here from Icechunk's own on-disk format (spec 1: a
39-byte header - magic, writer, spec version, file type, compression - then a zstd-compressed
flatbuffer, `icechunk/flatbuffers/manifest.fbs`): each native chunk ref names its chunk file
(`repo/chunks/<id>`, the id in Crockford base32) and length. A manifest missing or cut
short is named before Icechunk reads it (where it raised a Rust error, once a panic).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import StoreError
from ..io.location import Location

MAGIC = "ICE🧊CHUNK".encode()
HEADER = 39  # magic 12, writer 24, spec version, file type, compression
MANIFEST_FILE = 2
SPEC = 1
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
# ChunkRef fields (manifest.fbs): index, inline, offset, length, chunk_id
REF_INDEX, REF_INLINE, REF_LENGTH, REF_CHUNK = 0, 1, 3, 4


@dataclass(frozen=True)
class RepoFile:
    """A file of the repository (relative to the store) and the bytes it must hold."""

    rel: str
    size: int

    @property
    def name(self) -> str:
        return self.rel.rsplit("/", 1)[-1]


def crockford(raw: bytes) -> str:
    """An Icechunk object id as its file is named (Crockford base32, no padding)."""
    bits = len(raw) * 8
    chars = -(-bits // 5)
    value = int.from_bytes(raw, "big") << (chars * 5 - bits)
    return "".join(CROCKFORD[(value >> (5 * (chars - 1 - i))) & 31] for i in range(chars))


def chunk_files(repo: Any, snapshot: str, root: Location, repository: str, label: str
                ) -> dict[str, RepoFile]:
    """Zarr chunk key -> the chunk file that holds it, for every native chunk of the
    snapshot (inline chunks live in their manifest). Every manifest is checked first: one
    missing or of another size than the snapshot records is a StoreError naming it."""
    try:
        return _chunk_files(repo, snapshot, root, repository)
    except StoreError as exc:
        raise StoreError(f"{label}: damaged store: {exc}; restore it from a backup, or "
                         "rebuild the store: rerun its job with --overwrite") from None


def _chunk_files(repo: Any, snapshot: str, root: Location, repository: str
                 ) -> dict[str, RepoFile]:
    import json

    tree = json.loads(repo.inspect_snapshot(snapshot))
    sizes = {m["id"]: int(m["size_bytes"]) for m in tree.get("manifests", [])}
    arrays: dict[str, list[tuple[str, str]]] = {}  # manifest id -> (node id, array path)
    for node in tree.get("nodes", []):
        for ref in node.get("manifest_refs") or []:
            arrays.setdefault(ref["id"], []).append((node["id"], node["path"].strip("/")))
    files: dict[str, RepoFile] = {}
    for manifest, nodes in sorted(arrays.items()):
        rel = f"{repository}/manifests/{manifest}"
        raw = _whole(root.child(rel), sizes.get(manifest), rel, [p for _, p in nodes])
        if raw[:12] == MAGIC and raw[36] != SPEC:
            continue  # a later Icechunk's format: its chunks are checked when read
        refs = _manifest_refs(raw, rel)
        for node, path in nodes:
            for coords, chunk, length in refs.get(node, []):
                key = f"{path}/c/{'/'.join(str(c) for c in coords)}" if coords else \
                    f"{path}/c"
                if chunk:
                    files[key] = RepoFile(f"{repository}/chunks/{chunk}", length)
    return files


def _whole(file: Location, size: int | None, rel: str, arrays: list[str]) -> bytes:
    """A manifest's bytes, refused (naming it and the arrays it lists) when it is missing or
    not the size the snapshot records."""
    found = file.size()
    lists = f"it lists the chunks of {', '.join(sorted(arrays))}"
    if found is None:
        raise StoreError(f"{rel} is missing ({lists})")
    if size is not None and found != size:
        raise StoreError(f"{rel} is damaged ({found} bytes where the snapshot records {size}; "
                         f"{lists})")
    return file.read_bytes()


def _manifest_refs(raw: bytes, rel: str) -> dict[str, list[tuple[list[int], str, int]]]:
    """node id -> its chunk refs (coordinates, chunk file id or '' for an inline chunk,
    length) of one manifest file."""
    if raw[:12] != MAGIC or raw[36] != SPEC or raw[37] != MANIFEST_FILE:
        raise StoreError(f"{rel} is damaged (not an Icechunk spec {SPEC} manifest)")
    try:
        body = _decompressed(raw[HEADER:], raw[38])
        return _read_refs(body)
    except (ValueError, RuntimeError, struct.error, IndexError) as exc:
        raise StoreError(f"{rel} is damaged (cannot be decoded: {exc})") from None


def _decompressed(data: bytes, compression: int) -> bytes:
    if compression == 0:
        return data
    if compression != 1:
        raise ValueError(f"compression {compression} is not zstd")
    from numcodecs import Zstd

    return bytes(Zstd().decode(data))


def _read_refs(buf: bytes) -> dict[str, list[tuple[list[int], str, int]]]:
    """The flatbuffer of a Manifest {id, arrays: [ArrayManifest {node_id, refs}]}."""
    root = _u32(buf, 0)
    found: dict[str, list[tuple[list[int], str, int]]] = {}
    for array in _tables(buf, _field(buf, root, 1)):
        at = _field(buf, array, 0)
        node = crockford(buf[at : at + 8])
        refs = []
        for ref in _tables(buf, _field(buf, array, 1)):
            start, n = _vector(buf, _field(buf, ref, REF_INDEX))
            coords = [_u32(buf, start + 4 * i) for i in range(n)]
            length_at = _field(buf, ref, REF_LENGTH, required=False)
            chunk_at = _field(buf, ref, REF_CHUNK, required=False)
            inline = _field(buf, ref, REF_INLINE, required=False)
            length = struct.unpack_from("<Q", buf, length_at)[0] if length_at else 0
            chunk = crockford(buf[chunk_at : chunk_at + 12]) if chunk_at and not inline else ""
            refs.append((coords, chunk, int(length)))
        found[node] = refs
    return found


def _u32(buf: bytes, at: int) -> int:
    return int(struct.unpack_from("<I", buf, at)[0])


def _field(buf: bytes, table: int, index: int, required: bool = True) -> int:
    """Where field `index` of the table at `table` is (0 when absent)."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    slot = 4 + 2 * index
    offset = struct.unpack_from("<H", buf, vtable + slot)[0] \
        if slot < struct.unpack_from("<H", buf, vtable)[0] else 0
    if not offset and required:
        raise ValueError(f"a required field ({index}) is absent")
    return table + offset if offset else 0


def _vector(buf: bytes, at: int) -> tuple[int, int]:
    start = at + _u32(buf, at)
    return start + 4, _u32(buf, start)


def _tables(buf: bytes, at: int) -> list[int]:
    start, n = _vector(buf, at)
    return [start + 4 * i + _u32(buf, start + 4 * i) for i in range(n)]


def sizes_in(folder: Location) -> dict[str, int]:
    """File name -> size of every file directly in `folder` (one listing)."""
    if folder.local:
        try:
            with os.scandir(folder.path) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file()}
        except FileNotFoundError:
            return {}
    folder.fs.invalidate_cache(folder.path)
    try:
        listed = folder.fs.ls(folder.path, detail=True)
    except FileNotFoundError:
        return {}
    return {str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in listed if e.get("type") == "file"}


# ---- Icechunk's errors, as one line -----------------------------------------------

OBJECT = re.compile(r"\b(snapshots|manifests|chunks|transactions)/([0-9A-Z]{20})\b")
NAMED_ID = re.compile(r"\b(manifest|chunk|snapshot)_id=([0-9A-Z]{20})\b")
BRANCH = re.compile(r'fetch_branch[\s|]+with name="([^"]+)"')
KEY = re.compile(r'with key="([^"]+)"')
HISTORY = ("snapshots", "refs")  # without them no version can be read: --overwrite cannot
                                 # prove the folder is a bertpipe store


def damage_error(path: str, repository: str, exc: BaseException) -> StoreError:
    """Icechunk's error (or panic) reading the repository as one line: the file, what is
    wrong with it, what was being read, and what to do."""
    text = str(exc)
    rel = _file_named(text, repository)
    missing = "not found" in text or "No such file" in text
    causes = [line.split("->", 1)[1].strip() for line in text.splitlines() if "->" in line]
    state = "is missing" if missing else f"is damaged ({causes[-1] if causes else _first(text)})"
    key = KEY.search(text)
    reading = f" (reading {key.group(1)})" if key else ""
    if rel is None:
        rel, state = f"the Icechunk repository {repository}/", \
            f"cannot be read ({causes[-1] if causes else _first(text)})"
    fix = ("move the store aside and rerun its job" if any(
        rel.startswith(f"{repository}/{part}") for part in HISTORY)
        else "rebuild the store: rerun its job with --overwrite")
    return StoreError(f"{path}: damaged store: {rel} {state}{reading}; restore it from a "
                      f"backup, or {fix}")


def _file_named(text: str, repository: str) -> str | None:
    """The repository file an error is about: the object it failed on, else the id of
    the innermost object it names, else the branch ref it read."""
    found = OBJECT.search(text)
    if found:
        return f"{repository}/{found.group(1)}/{found.group(2)}"
    named = NAMED_ID.search(text)
    if named:
        return f"{repository}/{named.group(1)}s/{named.group(2)}"
    branch = BRANCH.search(text)
    if branch:
        return f"{repository}/refs/branch.{branch.group(1)}/ref.json"
    return None


def _first(text: str) -> str:
    lines = [line.strip(" x|") for line in text.strip().splitlines() if line.strip(" x|")]
    return lines[0] if lines else "an Icechunk error"
