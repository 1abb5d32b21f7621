"""What in an output folder is bertpipe's, so that replacing a store removes only that.

A folder is a bertpipe store, complete or not, when its `zarr.json` carries a `bertpipe`
attribute, its `docs/part-0.parquet` carries `bertpipe` metadata, or it holds the staging area
`_bertpipe/run.json` of a run. Its own entries are the format's files and folders; any
other entry is the user's and is never removed.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import StoreError
from .lock import LOCK_NAME
from .staging import STAGING_DIR

OWN_ENTRIES = {
    "zarr": {"zarr.json", "ids", "docs", "chunks", "tokens", "post", "index", STAGING_DIR},
    "parquet": {"docs", "chunks", "tokens", "post", "index", STAGING_DIR},
}
# files a run leaves while it writes: parquet parts before their rename (the tokens folder
# too), lock temporaries
TEMPORARY = re.compile(r"^\.((docs|chunks)\.parquet|tokens)\.[0-9a-f]{32}$")
LOCK_FILES = re.compile(rf"^\.?{re.escape(LOCK_NAME)}(\.[0-9a-f]{{32}})?$")


@dataclass(frozen=True)
class Contents:
    """An output path as found: `state` is absent, file, empty, store or foreign."""

    path: Path
    state: str
    format: str | None = None
    own: list[Path] = field(default_factory=list)
    foreign: list[Path] = field(default_factory=list)

    def describe_foreign(self) -> str:
        names = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "")
                       for p in self.foreign)
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        return ", ".join(names[:4]) + more


def inspect_output(path: str | Path) -> Contents:
    """What `path` holds, read only (the lock file of a run does not count)."""
    root = Path(path)
    if not root.exists() and not root.is_symlink():
        return Contents(root, "absent")
    if not root.is_dir():
        return Contents(root, "file")
    entries = [e for e in root.iterdir() if not LOCK_FILES.match(e.name)]
    if not entries:
        return Contents(root, "empty")
    fmt = store_format(root)
    if fmt is None:
        return Contents(root, "foreign", foreign=entries)
    own = [e for e in entries if e.name in OWN_ENTRIES[fmt] or TEMPORARY.match(e.name)]
    return Contents(root, "store", fmt, own, [e for e in entries if e not in own])


def store_format(root: Path) -> str | None:
    """The format of the bertpipe store at `root` (complete or not), or None."""
    if _zarr_is_ours(root / "zarr.json"):
        return "zarr"
    if _parquet_is_ours(root / "docs" / "part-0.parquet"):
        return "parquet"
    run = _read_json(root / STAGING_DIR / "run.json")
    if run and run.get("run_fingerprint"):
        fmt = (run.get("job") or {}).get("output", {}).get("format")
        if fmt in OWN_ENTRIES:
            return str(fmt)
        return "zarr" if (root / "zarr.json").exists() else "parquet"
    return None


def remove_store(contents: Contents) -> None:
    """Remove a store's own entries; the user's entries (and the lock) stay."""
    for entry in contents.own:
        if entry.is_symlink() or not entry.is_dir():
            entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(entry)  # does not follow symlinks inside


def _zarr_is_ours(file: Path) -> bool:
    raw = _read_json(file) or {}
    return isinstance((raw.get("attributes") or {}).get("bertpipe"), dict)


def _parquet_is_ours(file: Path) -> bool:
    if not file.is_file():
        return False
    try:
        metadata = pq.read_schema(file).metadata or {}
    except (OSError, pa.ArrowInvalid) as exc:
        # why refuse: a damaged footer cannot show whose file this is, so nothing may
        # replace it, and calling it "not a store" would hide the damage
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise StoreError(f"{file}: damaged Parquet file ({first}); it cannot be shown to be a "
                         "bertpipe store, so it is left alone: move it away or delete it, "
                         "then rerun") from None
    return b"bertpipe" in metadata


def _read_json(file: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None
