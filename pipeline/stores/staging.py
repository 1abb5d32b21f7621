"""Per-partition parts inside the output store, with completion markers for resume.

Workers write each finished partition as Parquet parts under `<store>/_bertpipe/parts/`,
straight into the store wherever it lives (a local folder or an object store: no path the
client alone can see), then a `<index>.done.json` marker with the row range, the identity
of the input file it was read from (its footer digest), the run fingerprint and the
checksums of the part files. A part is written whole (locally a temporary name renamed
into place, on an object store one PUT), so it is either whole or absent, and its marker
comes after it. `run.json` records what the whole run must match to be resumed: the run
fingerprint, the partitioning and the input's identity. The final store is assembled from
the parts once every partition is done; until then nothing reads as complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import PartitionError, StoreError
from ..io.location import Location, resolve
from .lock import Fence, LockLostError
from .markers import PartitionMarker

STAGING_DIR = "_bertpipe"
LEVELS = ("docs", "chunks", "tokens")


class Staging:
    """The staging area of a store; `area` names the folder of parts (`parts` for the
    partitions a run encodes, another name for parts assembled from them)."""

    def __init__(self, store_path: str | Path | Location, area: str = "parts",
                 fence: Fence | None = None):
        self.store = store_path if isinstance(store_path, Location) else resolve(store_path)
        self.root = self.store.child(STAGING_DIR)
        self.parts = self.root.child(area)
        # the run's hold on the store's lock, checked before a part is published: a run
        # taken over while it was paused writes nothing more
        self.fence = fence
        self._confirmed_at = -float("inf")  # time.monotonic() of the last passed check

    def confirm(self, action: str, unless_within_s: float = 0.0) -> None:
        """Fencing before a step that publishes: the run still holds the store's lock
        (LockLostError otherwise); a no-op for staging opened without a run's fence.
        `unless_within_s`: skip the read when a check passed that recently (a loop over
        thousands of parts need not read the lock for each)."""
        if self.fence is None:
            return
        if time.monotonic() - self._confirmed_at < unless_within_s:
            return
        self.fence.check(action)
        self._confirmed_at = time.monotonic()

    @property
    def exists(self) -> bool:
        return self.root.child("run.json").exists()

    def begin(self, run: dict[str, Any]) -> None:
        self.parts.make_dirs()
        self.root.child("run.json").write_json(run)

    def run_info(self) -> dict[str, Any] | None:
        try:
            info = json.loads(self.root.child("run.json").read_bytes())
        except (FileNotFoundError, NotADirectoryError):
            return None
        except ValueError:
            return {}  # damaged: belongs to no run, so it matches none
        return info if isinstance(info, dict) else {}

    def markers(self) -> list[Location]:
        """Marker files present, whatever run wrote them."""
        return self.parts.glob("*.done.json")

    def write_tables(self, index: int, tables: Mapping[str, pa.Table | None]
                     ) -> tuple[dict[str, str], dict[str, int]]:
        """Write a partition's part files (each whole); their SHA-256 and sizes by level."""
        encoded = {}
        for level, table in tables.items():
            if table is None:
                continue
            buffer = io.BytesIO()
            # why: parts are read back whole at commit; no dictionary for float vectors;
            # page checksums so that the one read at commit refuses altered bytes
            pq.write_table(table, buffer, compression="zstd", use_dictionary=False,
                           write_page_checksum=True)
            encoded[level] = buffer.getvalue()
        # encoded first, checked last: what separates the fencing check from the writes is
        # only the writes themselves
        self.confirm(f"write partition {index}")
        for level, data in encoded.items():
            self.part(index, level).write_bytes(data)
        return ({level: hashlib.sha256(data).hexdigest() for level, data in encoded.items()},
                {level: len(data) for level, data in encoded.items()})

    def write_part(self, marker: PartitionMarker, tables: Mapping[str, pa.Table | None]
                   ) -> PartitionMarker:
        """Write the part files, then the marker that says they are whole."""
        sealed = marker.sealed(*self.write_tables(marker.index, tables))
        self.confirm(f"mark partition {marker.index} done")  # again: writing takes time
        self.marker(marker.index).write_json(sealed.to_dict())
        return sealed

    def done(self, fingerprint: str) -> dict[int, PartitionMarker]:
        """Markers of finished partitions whose parts are whole and from this run. A part
        is whole when its size is the one its marker recorded: its bytes are checked where
        they are read anyway, at the commit (page checksums; see `checked_reads`), so a
        resume reads each part once, not once to hash it and again to copy it."""
        found = {}
        for path in self.markers():
            marker = _marker_in(path)
            if marker is None or marker.fingerprint != fingerprint:
                continue
            if all(self._whole(marker, level) for level in marker.sha256):
                found[marker.index] = marker
        return found

    def _whole(self, marker: PartitionMarker, level: str) -> bool:
        size = marker.part_bytes.get(level)
        if size is None:  # a marker of an earlier bertpipe: no size, so hash the part
            return self._intact(marker.index, level, marker.sha256[level])
        return self.part(marker.index, level).size() == size

    def _intact(self, index: int, level: str, digest: str) -> bool:
        try:
            data = self.part(index, level).read_bytes()
        except FileNotFoundError:
            return False
        return hashlib.sha256(data).hexdigest() == digest

    @contextlib.contextmanager
    def checked_reads(self, indices: Sequence[int]) -> Iterator[None]:
        """Reading the parts of `indices` (a commit): when a read fails, the parts are
        hashed against their markers, and a damaged part's marker is removed so that a
        rerun encodes that partition again (PartitionError, exit 6: worth a rerun). Only a
        failed read pays for the second read."""
        try:
            yield
        except LockLostError:
            raise  # the store is another run's now: nothing of its staging is touched
        except (OSError, ValueError, pa.ArrowException, StoreError) as exc:
            damaged = self.drop_damaged(indices)
            if not damaged:
                raise
            shown = ", ".join(str(i) for i in damaged[:5]) + (" ..." if len(damaged) > 5 else "")
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise PartitionError(
                f"staged partition{'s' if len(damaged) > 1 else ''} {shown} changed after "
                f"{'they were' if len(damaged) > 1 else 'it was'} written (its bytes no longer "
                f"match its marker: {first}); nothing is published and the marker is removed, "
                "so a rerun encodes it again") from None

    def drop_damaged(self, indices: Sequence[int]) -> list[int]:
        """The partitions among `indices` whose parts no longer match their markers (their
        markers removed)."""
        damaged = []
        for index in indices:
            marker = _marker_in(self.marker(index))
            if marker is None or all(self._intact(index, level, digest)
                                     for level, digest in marker.sha256.items()):
                continue
            damaged.append(index)
            self.confirm(f"remove the marker of damaged partition {index}")  # fencing
            with contextlib.suppress(FileNotFoundError):
                self.marker(index).remove()
        return damaged

    def read_parts(self, level: str, indices: Sequence[int]) -> Iterator[pa.Table]:
        for index in indices:
            # a commit reads every part: fencing between parts (at most once a second, far
            # inside any lease) keeps a run taken over while paused mid-commit from going on
            self.confirm(f"commit partition {index}", unless_within_s=1.0)
            yield pq.read_table(io.BytesIO(self.part(index, level).read_bytes()),
                                page_checksum_verification=True)

    def part_schemas(self, level: str, indices: Sequence[int]) -> Iterator[pq.FileMetaData]:
        """The footers of the parts of `level` (no column data read)."""
        for index in indices:
            with self.part(index, level).open("rb") as f:
                yield pq.read_metadata(f)

    def part(self, index: int, level: str) -> Location:
        return self.parts.child(f"{index:06d}.{level}.parquet")

    def part_path(self, index: int, level: str) -> Path:
        """A local part's path (local stores only; `part` works everywhere)."""
        return Path(self.part(index, level).path)

    def marker(self, index: int) -> Location:
        return self.parts.child(f"{index:06d}.done.json")

    def remove(self) -> None:
        with contextlib.suppress(OSError):  # what is left is removed with the next store
            self.root.remove_tree()

    def remove_parts(self) -> None:
        """Empty this area's folder of parts (the rest of the staging area stays)."""
        with contextlib.suppress(OSError):
            self.parts.remove_tree()


def _marker_in(path: Location) -> PartitionMarker | None:
    """The marker at `path`; None when absent or damaged (a marker is written whole, so a
    damaged one is not trusted)."""
    try:
        return PartitionMarker.from_dict(json.loads(path.read_bytes()))
    except (ValueError, FileNotFoundError):
        return None
