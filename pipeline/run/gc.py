"""`bertpipe gc`: reclaim what only expired store versions use, under the store's lock.

An Icechunk store keeps every version readable (`open_store(path, version=k)`) until it is
expired here: the snapshots before the `keep` newest versions are expired and the chunks,
manifests and snapshots that no kept version uses are deleted (Icechunk's own expiry and
garbage collection). A Delta store likewise: Delta's vacuum deletes every data file that
no kept version uses (and files of writes never committed). A plain Zarr or Parquet store
keeps its current version only; what is left of a retired one (kept for the readers that
opened it) is removed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import OptionError, StoreError
from ..io.location import resolve
from ..stores import detect_format
from ..stores.ownership import inspect_output
from .output import OutputSession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Collected:
    """What `gc` did: the versions expired and kept, the bytes freed (versioned formats)."""

    path: str
    expired: list[int]
    kept: list[int]
    bytes_freed: int

    def line(self) -> str:
        if not self.expired:
            orphans = (f"; freed {self.bytes_freed / 1e6:.1f} MB no version used"
                       if self.bytes_freed else "")
            return (f"{self.path}: nothing to expire{orphans} (versions kept: "
                    f"{_listed(self.kept)})")
        return (f"{self.path}: expired versions {_listed(self.expired)}, freed "
                f"{self.bytes_freed / 1e6:.1f} MB; versions kept: {_listed(self.kept)}")


def collect_garbage(path: str, keep: int | None, say: Callable[[str], None] = log.warning
                    ) -> Collected:
    """Keep the `keep` newest versions of the store at `path`; reclaim the rest. `keep`
    None: a store that keeps one version has what is left of retired ones removed; one that
    keeps several is refused (how much history to drop is never guessed)."""
    if keep is not None and keep < 1:
        raise OptionError(f"--keep: {keep} is out of range (at least 1: the current version)")
    if not resolve(path).exists():
        raise StoreError(f"{path}: no such store")
    contents = inspect_output(path)
    if contents.state != "store":
        held = f" (it holds {contents.describe_foreign()})" if contents.foreign else ""
        raise StoreError(f"{path}: not a bertpipe store{held}; nothing to collect")
    kept_now(path, detect_format(path).version_numbers(), keep)  # refused before the lock
    with OutputSession(path, "gc", say, command="gc") as output:
        fmt = detect_format(path)
        # again under the lock: an update may have added a version since
        wanted = kept_now(path, fmt.version_numbers(), keep)
        output.confirm("expire versions")
        expired, freed = fmt.gc(wanted)
        return Collected(path, expired, fmt.version_numbers(), freed)


def kept_now(path: str, versions: list[int], keep: int | None) -> int:
    """How many versions to keep: `keep`, or without it all of them when there is one; a
    store keeping several needs --keep (a default would drop history nobody chose to)."""
    if keep is not None:
        return keep
    if len(versions) > 1:
        raise OptionError(f"--keep: {path} keeps versions {_listed(versions)}; say how many "
                          "to keep (gc --keep N keeps the newest N and deletes the others for "
                          "good; --keep 1 keeps the current version only)")
    return 1


def _listed(versions: list[int]) -> str:
    return ", ".join(str(v) for v in sorted(versions)) or "none"
