"""What a run reports and records: its summary (line and JSON form), and the provenance
and history entry of a finished run, built from its markers' totals."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..extract.runtime_choice import installed_versions
from ..extract.source import Partition
from ..spec import Job
from ..stores.markers import MarkerTotals, PartitionMarker
from ..stores.provenance import (
    FORMAT_VERSION,
    InputFile,
    ModelInfo,
    Provenance,
    RunRecord,
    identity_sha256,
)
from ..version import __version__
from .partition_pipeline import OnDone

# on_plan(all partitions, pending partitions) once after planning: progress reporting.
OnPlan = Callable[[Sequence[Partition], Sequence[Partition]], None]


@dataclass
class RunSummary:
    """What a run did. `rows`, `chunks`, `tokens` describe the finished store (`tokens`: the
    documents' tokens); `tokens_run` and the rate count the tokens this run fed to the model
    (special tokens and chunk overlap included: what the history's `tokens` records), only
    in the partitions encoded by this run (not those a resume skipped).
    Filled as the run goes, so a failed run still reports how far it got.

    Rows by what the run did with them: a full run adds every row; an incremental run adds
    new ids, replaces changed texts, skips unchanged rows and keeps or prunes gone ids.
    `encoded` distinct texts went through the model in this run; `copied` rows took the
    results of an identical text instead (the encodings saved). A resumed run counts only
    the partitions it ran, not those an earlier run finished."""

    path: str
    rows: int = 0
    chunks: int = 0
    tokens: int = 0
    tokens_run: int = 0
    wall_s: float = 0.0
    partitions: int = 0
    skipped: int = 0
    run: int = 0
    failed: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    already_complete: bool = False
    encoded: int = 0
    copied: int = 0
    added: int = 0
    replaced: int = 0
    unchanged: int = 0
    gone: int = 0  # ids of the store missing from the input
    pruned: int = 0  # of those, removed (the others are kept, present: false)
    superseded: int = 0  # rows kept, flagged, that an edit superseded (Icechunk)
    dropped: int = 0  # superseded rows removed
    carried_changed: int = 0  # rows of known ids whose carried values changed
    incremental: bool = False
    version: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_run / self.wall_s if self.wall_s else 0.0

    def line(self) -> str:
        if self.already_complete and self.incremental:
            return (f"{self.path}: up to date with its input (version {self.version}); "
                    "nothing to encode")
        if self.already_complete:
            return f"{self.path}: already complete for this job; nothing to do"
        parts = (f"partitions skipped {self.skipped}, run {self.run}, "
                 f"failed {len(self.failed)}")
        rate = (f"{self.tokens_run} tokens encoded in {self.wall_s:.1f}s "
                f"({self.tokens_per_s:,.0f} tokens/s)")
        if self.incremental:
            kept = "" if not self.gone else \
                " (removed)" if self.pruned else " (kept with present=false)"
            return (f"version {self.version}: encoded {self.encoded} rows, skipped "
                    f"{self.unchanged} unchanged, replaced {self.replaced}, added "
                    f"{self.added}, {self.gone} gone{kept}{self._superseded()}"
                    f"{carried_phrase(self.carried_changed)}; "
                    f"{self.copied} encodings saved by identical texts; {self.rows} rows in "
                    f"the store; {rate}; {parts}")
        this_run = " this run" if self.skipped else ""  # a resume: the rest was done before
        return (f"{self.rows} rows, {self.chunks} chunks, {rate}; encoded {self.encoded} "
                f"rows{this_run}, {self.copied} encodings saved by identical texts; {parts}")

    def _superseded(self) -> str:
        return superseded_phrase(self.superseded, self.dropped)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`extract --json-summary`, schemas/run-summary.schema.json)."""
        return {"store": self.path, "rows": self.rows, "chunks": self.chunks,
                "tokens": self.tokens, "tokens_encoded_this_run": self.tokens_run,
                "wall_seconds": round(self.wall_s, 3),
                "tokens_per_second": round(self.tokens_per_s, 1),
                "partitions": {"total": self.partitions, "skipped": self.skipped,
                               "run": self.run, "failed": len(self.failed)},
                "failed_partitions": self.failed, "device": self.devices,
                "dtype": self.dtypes, "already_complete": self.already_complete,
                "mode": "incremental" if self.incremental else "full",
                "version": self.version,
                "rows_by_outcome": {"encoded": self.encoded, "deduplicated": self.copied,
                                    "added": self.added, "replaced": self.replaced,
                                    "skipped": self.unchanged, "gone": self.gone,
                                    "pruned": self.pruned, "superseded": self.superseded,
                                    "dropped": self.dropped,
                                    "carried_changed": self.carried_changed}}


def superseded_phrase(superseded: int, dropped: int) -> str:
    """", N superseded kept, M superseded dropped" for the rows edits superseded (an
    Icechunk update appends an edited text and keeps the old row), or "" when none."""
    said = [f"{superseded} superseded kept"] if superseded else []
    said += [f"{dropped} superseded dropped"] if dropped else []
    return f", {', '.join(said)}" if said else ""


def carried_phrase(changed: int) -> str:
    """", carried values changed in N rows" (a night that only relabels rows encodes,
    replaces and adds nothing: this is what it did), or "" when none."""
    return f", carried values changed in {changed} row{'s' * (changed != 1)}" if changed \
        else ""


def collect(done: dict[int, PartitionMarker], on_done: OnDone | None,
            summary: RunSummary) -> OnDone:
    def record(part: Partition, marker: PartitionMarker) -> None:
        done[part.index] = marker
        # tokens fed to the model, as the history records them: a summary that counted the
        # documents' tokens disagreed with it by the special tokens of every chunk
        summary.tokens_run += marker.n_encoded
        summary.devices = sorted({*summary.devices, marker.device})
        summary.dtypes = sorted({*summary.dtypes, marker.dtype})
        if on_done:
            on_done(part, marker)
    return record


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def build_provenance(job: Job, totals: MarkerTotals, model: dict[str, Any],
                     fingerprint: str) -> Provenance:
    """The provenance of a finished run, still marked incomplete."""
    return Provenance(
        format_version=FORMAT_VERSION,
        run_fingerprint=fingerprint,
        job=job,
        model=ModelInfo(**model),
        versions=software_versions(totals),
        device=list(totals.devices),
        dtype=list(totals.dtypes),
        runtime=list(totals.runtimes),
        created=now_iso(),
        stats={
            "rows": totals.rows,
            "chunks": totals.chunks,
            "tokens": totals.tokens,
            "tokens_covered": totals.covered,
            "tokens_encoded": totals.encoded_tokens,
            "partitions": totals.partitions,
            "partition_seconds": round(totals.seconds, 3),
            **({"tokens_stored": totals.stored_tokens} if job.token_views else {}),
        },
        complete=False,
    )


def software_versions(totals: MarkerTotals) -> dict[str, str]:
    """bertpipe, torch, transformers and the optional runtimes that ran partitions, as
    installed (`installed_versions`: read without importing them)."""
    others = [name for name in totals.runtimes if name != "torch"]
    return {"bertpipe": __version__,
            **installed_versions(("torch", "transformers", *others))}


def run_record(kind: str, version: int, started: str, identity: Sequence[InputFile],
               totals: MarkerTotals, wall_s: float, took_over_lock: str = "",
               **rows: int) -> RunRecord:
    """The history entry of a run: `rows` gives rows, added, replaced, unchanged, gone,
    pruned, encoded and copied (a full run: every row added, from the markers)."""
    if kind == "full":
        rows = {"rows": totals.rows, "added": totals.rows, "replaced": 0, "unchanged": 0,
                "gone": 0, "pruned": 0, "encoded": totals.distinct, "copied": totals.copied}
    return RunRecord(
        kind=kind, started=started, version=version, input_files=len(identity),
        input_rows=sum(f.rows for f in identity), input_sha256=identity_sha256(identity),
        tokens=totals.encoded_tokens, wall_s=round(wall_s, 3), took_over_lock=took_over_lock,
        **rows)
