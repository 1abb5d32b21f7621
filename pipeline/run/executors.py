"""Executors run partitions and report each one's marker or failure.

`run_partition` is the unit of work (one partition, encoded and staged); an executor
decides where it runs. The Dask executor lives in `dask_executor` (slow to import).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Protocol

from ..errors import BertpipeError
from ..extract.partition import Extractor
from ..extract.source import Partition
from ..spec import Job
from ..stores import Staging
from ..stores.fs import scrub

# on_done(partition, marker) once per finished partition: progress and bookkeeping.
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


def run_partition(extractor: Extractor, staging: Staging, part: Partition,
                  fingerprint: str) -> dict[str, Any]:
    """Encode one partition and leave its parts and marker in the store."""
    start = time.perf_counter()
    tables = extractor.run(part)
    marker = {
        "fingerprint": fingerprint,
        "rows": [part.row_start, part.row_stop],
        "input": part.footer_sha256,
        **tables.stats,
        "device": str(extractor.model.device),
        "dtype": str(extractor.model.compute_dtype).removeprefix("torch."),
        "seconds": time.perf_counter() - start,
    }
    return staging.write_part(part.index, {"docs": tables.docs, "chunks": tables.chunks}, marker)


def failure_reason(exc: BaseException) -> str:
    """One line for a failed partition, the same whichever executor ran it."""
    if isinstance(exc, BertpipeError):
        return scrub(str(exc))
    first = scrub((str(exc).strip().splitlines() or [""])[0])
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class InProcessExecutor:
    """Everything in this process, one partition after another (`scheduler: synchronous`)."""

    def __init__(self, extractor: Extractor | None = None):
        self.extractor = extractor

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
        failures = []
        for part in parts:
            try:
                marker = run_partition(extractor, staging, part, fingerprint)
            except Exception as exc:  # noqa: BLE001 - reported per partition, as Dask does
                failures.append((part, failure_reason(exc)))
                continue
            on_done(part, marker)
        return failures
