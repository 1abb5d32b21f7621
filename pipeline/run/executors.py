"""Executors run partitions and report each one's marker or failure.

The unit of work is one partition, encoded and staged; an executor decides where it
runs. Encoding and staging are two steps (`encode_partition`, `stage_partition`) so that
an executor can write one partition to the store while it encodes the next: an object
store's uploads then overlap the model's work. The Dask executor lives in
`dask_executor` (slow to import).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import pyarrow as pa

from ..errors import BertpipeError, PartitionError, UnreadableInputError
from ..extract.partition import Extractor
from ..extract.source import Partition
from ..spec import Job
from ..stores import Staging
from ..stores.fs import scrub

# on_done(partition, marker) once per finished partition: progress and bookkeeping.
# on_batch(partition, batches done, batches planned) after each forward pass: progress only.
OnBatch = Callable[[Partition, int, int], None]
OnDone = Callable[[Partition, dict[str, Any]], None]
Failures = list[tuple[Partition, str]]


class Executor(Protocol):
    """Runs partitions; returns the ones that failed with a one-line reason each.

    Entered before the store is touched: that is where it reaches what it runs on (a
    scheduler), so an unreachable one leaves nothing behind. An error that would fail every
    partition (the model cannot be loaded) is raised as itself, by every executor alike.
    """

    def __enter__(self) -> Executor: ...

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...

    def run(self, job: Job, parts: Sequence[Partition], staging: Staging, fingerprint: str,
            on_done: OnDone) -> Failures: ...


@dataclass
class Encoded:
    """A partition's tables and its marker, encoded but not yet in the store."""

    part: Partition
    tables: dict[str, pa.Table | None]
    marker: dict[str, Any]


def encode_partition(extractor: Extractor, part: Partition, fingerprint: str,
                     on_batch: OnBatch | None = None) -> Encoded:
    """Read, chunk, encode and pool one partition (nothing written)."""
    start = time.perf_counter()
    extractor.encoder.on_batch = (lambda done, total: on_batch(part, done, total)) \
        if on_batch else None
    tables = extractor.run(part)
    marker = {
        "fingerprint": fingerprint,
        "rows": [part.row_start, part.row_stop],
        "input": part.footer_sha256,
        **tables.stats,
        "device": str(extractor.model.device),
        "dtype": extractor.runtime.dtype,
        "runtime": extractor.runtime.name,
        "seconds": time.perf_counter() - start,
    }
    return Encoded(part, {"docs": tables.docs, "chunks": tables.chunks,
                                  "tokens": tables.tokens}, marker)


def stage_partition(staging: Staging, encoded: Encoded) -> dict[str, Any]:
    """Write an encoded partition's parts, then its marker, into the store."""
    return staging.write_part(encoded.part.index, encoded.tables, encoded.marker)


class Reason(str):
    """A failed partition's one line; `unreadable_input` when the input's own bytes could
    not be read (a damaged page), which a rerun cannot cure."""

    unreadable_input = False


def failure_reason(exc: BaseException) -> Reason:
    """One line for a failed partition, the same whichever executor ran it."""
    if isinstance(exc, BertpipeError):
        reason = Reason(scrub(str(exc)))
        reason.unreadable_input = isinstance(exc, UnreadableInputError)
        return reason
    first = scrub((str(exc).strip().splitlines() or [""])[0])
    return Reason(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)


def failed(failures: Failures, total: int, first: str) -> BertpipeError:
    """The run's error for its failed partitions (`first`: the first, as described): the
    input's (exit 3) when part of the input cannot be read, since a rerun would fail alike
    until the file is replaced; else a PartitionError (exit 6: worth a rerun)."""
    unreadable = [reason for _, reason in failures if getattr(reason, "unreadable_input", False)]
    if unreadable:
        return UnreadableInputError(
            f"{unreadable[0]}; {len(failures)} of {total} partitions failed, the others are "
            "kept: replace or repair the file, then rerun (finished partitions are skipped)")
    return PartitionError(f"{len(failures)} of {total} partitions failed, the others are "
                          f"kept for a rerun; first: {first}")


class InProcessExecutor:
    """Everything in this process, one partition after another (`scheduler: synchronous`);
    a partition is written to the store by a second thread while the next one encodes
    (one write in flight: memory stays bounded by two partitions)."""

    def __init__(self, extractor: Extractor | None = None, on_batch: OnBatch | None = None):
        self.extractor = extractor
        self.on_batch = on_batch

    def __enter__(self) -> InProcessExecutor:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        return None

    def run(self, job: Job, parts: Sequence[Partition], staging: Staging, fingerprint: str,
            on_done: OnDone) -> Failures:
        if not parts:
            return []
        extractor = self.extractor or Extractor(job)
        failures: Failures = []
        writing: tuple[Partition, Future[dict[str, Any]]] | None = None

        def finish() -> None:
            if writing is None:
                return
            part, future = writing
            try:
                marker = future.result()
            except Exception as exc:  # noqa: BLE001 - reported per partition, as Dask does
                failures.append((part, failure_reason(exc)))
                return
            on_done(part, marker)

        with ThreadPoolExecutor(1, thread_name_prefix="bertpipe-write") as writer:
            for part in parts:
                try:
                    encoded = encode_partition(extractor, part, fingerprint, self.on_batch)
                except Exception as exc:  # noqa: BLE001 - reported per partition
                    failures.append((part, failure_reason(exc)))
                    continue
                finish()  # the previous write: at most one in flight
                writing = (part, writer.submit(stage_partition, staging, encoded))
            finish()
        return failures
