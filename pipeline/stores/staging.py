"""Per-partition parts inside the output store, with completion markers for resume.

Workers write each finished partition as Parquet parts under `<store>/_bertpipe/parts/`
(write to a temporary name, then rename: a part is either whole or absent), then a
`<index>.done.json` marker with the row range, the identity of the input file it was read
from (its footer digest), the run fingerprint and the checksums of the part files.
`run.json` records what the whole run must match to be resumed: the run fingerprint, the
partitioning and the input's identity. The final store is assembled from the parts once
every partition is done; until then nothing reads as complete.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..fileutil import sha256_file, write_json_atomic

STAGING_DIR = "_bertpipe"
LEVELS = ("docs", "chunks", "tokens")


class Staging:
    def __init__(self, store_path: str | Path):
        self.root = Path(store_path) / STAGING_DIR
        self.parts = self.root / "parts"

    @property
    def exists(self) -> bool:
        return (self.root / "run.json").exists()

    def begin(self, run: dict[str, Any]) -> None:
        self.parts.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.root / "run.json", run)

    def run_info(self) -> dict[str, Any] | None:
        try:
            info = json.loads((self.root / "run.json").read_text())
        except (FileNotFoundError, NotADirectoryError):
            return None
        except ValueError:
            return {}  # damaged: belongs to no run, so it matches none
        return info if isinstance(info, dict) else {}

    def markers(self) -> list[Path]:
        """Marker files present, whatever run wrote them."""
        return sorted(self.parts.glob("*.done.json"))

    def write_part(self, index: int, tables: dict[str, pa.Table | None],
                   marker: dict[str, Any]) -> dict[str, Any]:
        """Write the part files, then the marker that says they are whole."""
        checksums = {}
        for level, table in tables.items():
            if table is None:
                continue
            path = self.part_path(index, level)
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
            # why: parts are read back whole at commit; no dictionary for float vectors
            pq.write_table(table, tmp, compression="zstd", use_dictionary=False)
            os.replace(tmp, path)
            checksums[level] = sha256_file(path)
        marker = {**marker, "index": index, "sha256": checksums}
        write_json_atomic(self.marker_path(index), marker)
        return marker

    def done(self, fingerprint: str) -> dict[int, dict[str, Any]]:
        """Markers of finished partitions whose parts are intact and from this run."""
        found = {}
        for path in self.markers():
            try:
                marker = json.loads(path.read_text())
            except ValueError:
                continue  # a marker is written atomically; a damaged one is not trusted
            if marker.get("fingerprint") != fingerprint:
                continue
            intact = all(
                self.part_path(marker["index"], level).exists()
                and sha256_file(self.part_path(marker["index"], level)) == digest
                for level, digest in marker["sha256"].items())
            if intact:
                found[int(marker["index"])] = marker
        return found

    def read_parts(self, level: str, indices: list[int]) -> Iterator[pa.Table]:
        for index in indices:
            yield pq.read_table(self.part_path(index, level))

    def part_path(self, index: int, level: str) -> Path:
        return self.parts / f"{index:06d}.{level}.parquet"

    def marker_path(self, index: int) -> Path:
        return self.parts / f"{index:06d}.done.json"

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
