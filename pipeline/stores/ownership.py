"""What in an output folder is bertpipe's, so that replacing a store removes only that.

A folder (or an object-store prefix) is a bertpipe store, complete or not, when a format of
the registry recognises its own marker there (`StoreFormat.is_ours`: a `bertpipe`
attribute, footer metadata or commit metadata, as the format keeps its provenance), or it
holds the staging area `_bertpipe/run.json` of a run. Its own entries are the format's
(`StoreFormat.own_entries`); any other entry is the user's and is never removed (on an
object store: no key outside `<store>/<own entry>/` is ever deleted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..io.location import Location, resolve
from ..spec import OutputSpec
from . import REGISTRY, format_named, formats
from .lock import LOCK_NAME
from .staging import STAGING_DIR

DEFAULT_FORMAT = OutputSpec.format

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
    own_entries = format_named(fmt).own_entries
    own = [e for e in entries if e.name in own_entries or TEMPORARY.match(e.name)]
    return Contents(root, "store", fmt, own, [e for e in entries if e not in own])


def store_format(root: str | Path | Location) -> str | None:
    """The format of the bertpipe store at `root` (complete or not), or None."""
    root = root if isinstance(root, Location) else resolve(root)
    for name, fmt in formats().items():
        if fmt.is_ours(root):
            return name
    run = root.child(STAGING_DIR, "run.json").read_json()
    if run and run.get("run_fingerprint"):
        name = (run.get("job") or {}).get("output", {}).get("format")
        if name in REGISTRY:
            return str(name)
        # a run staged before the job recorded its format: the first format whose files
        # are there, else the default
        found = [n for n, fmt in formats().items() if fmt.holds_store(root.address)]
        return found[0] if found else DEFAULT_FORMAT
    return None


def remove_store(contents: Contents) -> None:
    """Remove a store's own entries; the user's entries (and the lock) stay."""
    for entry in contents.own:
        entry.location.remove_tree()  # never follows a link; on an object store, <entry>/ only
