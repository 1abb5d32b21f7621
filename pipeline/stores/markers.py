"""Completion markers: what a finished partition says of itself, and their totals.

A worker writes `<index>.done.json` after a partition's part files (see `staging`); a
rerun reuses the partition when its marker matches the new plan, and the commit builds the
store's statistics and provenance from the markers' totals. Both are typed here, read and
written in one place: `PartitionMarker.from_dict` refuses a marker that lacks a field (a
damaged or foreign file is not trusted), and `MarkerTotals` sums them once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class PartitionMarker:
    """One encoded partition: where its rows came from, what encoding them cost, what
    ran it, and the SHA-256 and size of each part file (`sha256`, `part_bytes`, by level;
    set when written)."""

    index: int
    fingerprint: str  # the run fingerprint (job content and model weights)
    rows: tuple[int, int]  # [start, stop) of the input rows
    input: str  # SHA-256 of the input file's Parquet footer
    n_chunks: int
    n_tokens: int  # tokens of the texts, special tokens excluded
    n_covered: int  # of those, inside some chunk (the rest dropped by max_chunks)
    n_encoded: int  # tokens fed to the model: special tokens and overlap included
    n_unique: int  # distinct texts encoded; the other rows copied an identical one
    device: str
    dtype: str
    runtime: str
    seconds: float
    n_stored_tokens: int = 0  # rows of the token table, when the job has token views
    sha256: Mapping[str, str] = field(default_factory=dict)
    part_bytes: Mapping[str, int] = field(default_factory=dict)

    @property
    def n_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    def sealed(self, checksums: Mapping[str, str], sizes: Mapping[str, int]
               ) -> PartitionMarker:
        """This marker with the checksums and sizes of its written part files."""
        return replace(self, sha256=dict(checksums), part_bytes=dict(sizes))

    def to_dict(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["rows"] = list(self.rows)
        raw["sha256"] = dict(self.sha256)
        raw["part_bytes"] = dict(self.part_bytes)
        return raw

    @classmethod
    def from_dict(cls, raw: Any) -> PartitionMarker:
        """The marker in `raw`; ValueError when it is not a complete marker. Markers of an
        earlier bertpipe lack `n_unique` (every row was encoded), `runtime` (torch) and
        `part_bytes` (their parts are checked by checksum instead)."""
        if not isinstance(raw, dict):
            raise ValueError("a marker is a JSON object")
        try:
            start, stop = (int(v) for v in raw["rows"])
            sha256, sizes = raw.get("sha256", {}), raw.get("part_bytes", {})
            if not isinstance(sha256, dict) or not isinstance(sizes, dict):
                raise ValueError("sha256 or part_bytes is not an object")
            return cls(
                index=int(raw["index"]), fingerprint=str(raw["fingerprint"]),
                rows=(start, stop), input=str(raw["input"]), n_chunks=int(raw["n_chunks"]),
                n_tokens=int(raw["n_tokens"]), n_covered=int(raw["n_covered"]),
                n_encoded=int(raw["n_encoded"]), n_unique=int(raw.get("n_unique", stop - start)),
                device=str(raw["device"]), dtype=str(raw["dtype"]),
                runtime=str(raw.get("runtime", "torch")), seconds=float(raw["seconds"]),
                n_stored_tokens=int(raw.get("n_stored_tokens", 0)),
                sha256={str(k): str(v) for k, v in sha256.items()},
                part_bytes={str(k): int(v) for k, v in sizes.items()})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a partition marker ({exc})") from None


@dataclass(frozen=True)
class MarkerTotals:
    """The sums over a run's markers, computed once (`of`)."""

    partitions: int = 0
    rows: int = 0
    chunks: int = 0
    tokens: int = 0
    covered: int = 0
    encoded_tokens: int = 0
    distinct: int = 0  # texts run through the model
    stored_tokens: int = 0
    seconds: float = 0.0
    devices: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    runtimes: tuple[str, ...] = ()

    @property
    def copied(self) -> int:
        """Rows that took the results of an identical text instead of being encoded."""
        return self.rows - self.distinct

    @classmethod
    def of(cls, markers: Iterable[PartitionMarker]) -> MarkerTotals:
        ms = list(markers)
        return cls(
            partitions=len(ms),
            rows=sum(m.n_rows for m in ms),
            chunks=sum(m.n_chunks for m in ms),
            tokens=sum(m.n_tokens for m in ms),
            covered=sum(m.n_covered for m in ms),
            encoded_tokens=sum(m.n_encoded for m in ms),
            distinct=sum(m.n_unique for m in ms),
            stored_tokens=sum(m.n_stored_tokens for m in ms),
            seconds=sum(m.seconds for m in ms),
            devices=tuple(sorted({m.device for m in ms})),
            dtypes=tuple(sorted({m.dtype for m in ms})),
            runtimes=tuple(sorted({m.runtime for m in ms})),
        )
