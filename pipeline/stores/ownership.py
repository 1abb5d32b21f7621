"""What in an output folder is bertpipe's, so that replacing a store removes only that.

A folder (or an object-store prefix) is a bertpipe store, complete or not, when its
`zarr.json` carries a `bertpipe` attribute, its `docs/part-0.parquet` carries `bertpipe`
metadata, its Icechunk repository's head carries `bertpipe` attributes, its Delta table
`docs/` has a commit that carries `bertpipe` metadata, or it holds the
staging area `_bertpipe/run.json` of a run. Its own entries are the format's files and
folders; any other entry is the user's and is never removed (on an object store: no key
outside `<store>/<own entry>/` is ever deleted).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import StoreError
from ..io.location import Location, resolve
from .lock import LOCK_NAME
from .staging import STAGING_DIR

OWN_ENTRIES = {
    "zarr": {"zarr.json", "ids", "docs", "chunks", "tokens", "post", "index", "versions",
             STAGING_DIR},
    "parquet": {"docs", "chunks", "tokens", "post", "index", STAGING_DIR},
    "icechunk": {"repo", "index", STAGING_DIR},
    "delta": {"docs", "chunks", "tokens", "post", "index", STAGING_DIR},
}
# files a run leaves while it writes: parquet parts before their rename (the tokens folder
# too), the lock, its take-over claims and their temporaries
TEMPORARY = re.compile(r"^\.((docs|chunks)\.parquet|tokens)\.[0-9a-f]{32}$")
LOCK_FILES = re.compile(
    rf"^\.?{re.escape(LOCK_NAME)}(\.takeover-[0-9a-f]{{32}})?(\.[0-9a-f]{{32}})?$")


@dataclass(frozen=True)
class Entry:
    """One entry directly inside an output folder."""

    location: Location
    is_dir: bool

    @property
    def name(self) -> str:
        return self.location.name


@dataclass(frozen=True)
class Contents:
    """An output path as found: `state` is absent, file, empty, store or foreign."""

    location: Location
    state: str
    format: str | None = None
    own: list[Entry] = field(default_factory=list)
    foreign: list[Entry] = field(default_factory=list)

    @property
    def path(self) -> str:
        """How messages name the output: its local path or URL."""
        return self.location.url

    def describe_foreign(self) -> str:
        names = sorted(e.name + ("/" if e.is_dir else "") for e in self.foreign)
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        return ", ".join(names[:4]) + more


def inspect_output(path: str | Path | Location) -> Contents:
    """What `path` holds, read only (the lock file of a run does not count)."""
    root = path if isinstance(path, Location) else resolve(path)
    if root.local:
        local = Path(root.path)
        if not local.exists() and not local.is_symlink():
            return Contents(root, "absent")
        if not local.is_dir():
            return Contents(root, "file")
        entries = [Entry(root.child(e.name), e.is_dir() and not e.is_symlink())
                   for e in sorted(local.iterdir())]
    else:
        info = root.info()
        if info is None:
            return Contents(root, "absent")
        if info.get("type") == "file":
            return Contents(root, "file")
        entries = [Entry(e, e.is_dir()) for e in root.entries()]
    entries = [e for e in entries if not LOCK_FILES.match(e.name)]
    if not entries:
        return Contents(root, "empty")
    fmt = store_format(root)
    if fmt is None:
        return Contents(root, "foreign", foreign=entries)
    own = [e for e in entries if e.name in OWN_ENTRIES[fmt] or TEMPORARY.match(e.name)]
    return Contents(root, "store", fmt, own, [e for e in entries if e not in own])


def store_format(root: str | Path | Location) -> str | None:
    """The format of the bertpipe store at `root` (complete or not), or None."""
    root = root if isinstance(root, Location) else resolve(root)
    if _zarr_is_ours(root.child("zarr.json")):
        return "zarr"
    if _parquet_is_ours(root.child("docs", "part-0.parquet")):
        return "parquet"
    if _icechunk_is_ours(root):
        return "icechunk"
    if _delta_is_ours(root):
        return "delta"
    run = _read_json(root.child(STAGING_DIR, "run.json"))
    if run and run.get("run_fingerprint"):
        fmt = (run.get("job") or {}).get("output", {}).get("format")
        if fmt in OWN_ENTRIES:
            return str(fmt)
        return "zarr" if root.child("zarr.json").exists() else "parquet"
    return None


def remove_store(contents: Contents) -> None:
    """Remove a store's own entries; the user's entries (and the lock) stay."""
    for entry in contents.own:
        entry.location.remove_tree()  # never follows a link; on an object store, <entry>/ only


def _zarr_is_ours(file: Location) -> bool:
    raw = _read_json(file) or {}
    return isinstance((raw.get("attributes") or {}).get("bertpipe"), dict)


def _icechunk_is_ours(root: Location) -> bool:
    """An Icechunk repository whose branch head carries bertpipe's provenance."""
    from .icechunk_store import IcechunkFormat, is_repository  # why here: only if met

    if not is_repository(root):
        return False
    return IcechunkFormat(root.url if not root.local else root.path).record() is not None


def _delta_is_ours(root: Location) -> bool:
    """A Delta table at docs/ whose commits carry bertpipe's provenance."""
    from .delta_store import DeltaFormat  # why here: only if met (imports deltalake)

    if not DeltaFormat.holds_store(root.address):
        return False
    return DeltaFormat(root.address).record() is not None


def _parquet_is_ours(file: Location) -> bool:
    if not file.is_file():
        return False
    try:
        with file.open("rb") as f:
            metadata = pq.read_schema(f).metadata or {}
    except (OSError, pa.ArrowInvalid) as exc:
        # why refuse: a damaged footer cannot show whose file this is, so nothing may
        # replace it, and calling it "not a store" would hide the damage
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise StoreError(f"{file}: damaged Parquet file ({first}); it cannot be shown to be a "
                         "bertpipe store, so it is left alone: move it away or delete it, "
                         "then rerun") from None
    return b"bertpipe" in metadata


def _read_json(file: Location) -> dict[str, Any] | None:
    try:
        raw = json.loads(file.read_bytes())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None
