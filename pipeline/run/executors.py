"""Executors run partitions and report each one's marker or failure.

The unit of work is one partition, encoded and staged; an executor decides where it
runs. Encoding and staging are two steps (`encode_partition`, `stage_partition`) so that
an executor can write one partition to the store while it encodes the next: an object
store's uploads then overlap the model's work. The Dask executor lives in
`dask_executor` (slow to import).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import pyarrow as pa

from ..errors import BertpipeError, JobError, PartitionError
from ..extract.source import Partition
from ..io.location import scrub
from ..spec import Job
from ..stores import Staging
from ..stores.lock import LockLostError
from ..stores.markers import PartitionMarker
from .ahead import prepared_ahead

if TYPE_CHECKING:  # torch and transformers load only where this process encodes
    from ..extract.partition import Extractor, PreparedPart

log = logging.getLogger(__name__)

# on_done(partition, marker) once per finished partition: progress and bookkeeping.
# on_batch(partition, batches done, batches planned) after each forward pass: progress only.
OnBatch = Callable[[Partition, int, int], None]
OnDone = Callable[[Partition, PartitionMarker], None]
Failures = list[tuple[Partition, BertpipeError]]


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
    marker: PartitionMarker  # its checksums set when the parts are written


def encode_partition(extractor: Extractor, part: Partition, fingerprint: str,
                     on_batch: OnBatch | None = None) -> Encoded:
    """Read, chunk, encode and pool one partition (nothing written)."""
    return encode_prepared(extractor, prepare_partition(extractor, part), fingerprint,
                           on_batch)


@dataclass
class Ready:
    """A partition prepared for the encoder, and the seconds that took."""

    prepared: PreparedPart
    seconds: float


def prepare_partition(extractor: Extractor, part: Partition, pad: bool = False) -> Ready:
    """Read, tokenize, chunk and batch one partition (padded too when `pad`): the CPU work
    before the model, which may run on another thread (see `ahead`)."""
    start = time.perf_counter()
    prepared = extractor.prepare(part, pad)
    return Ready(prepared, time.perf_counter() - start)


def encode_prepared(extractor: Extractor, ready: Ready, fingerprint: str,
                    on_batch: OnBatch | None = None) -> Encoded:
    """Encode and pool a prepared partition (nothing written)."""
    start = time.perf_counter()
    part = ready.prepared.part
    extractor.encoder.on_batch = (lambda done, total: on_batch(part, done, total)) \
        if on_batch else None
    tables = extractor.finish(ready.prepared)
    stats = tables.stats
    marker = PartitionMarker(
        index=part.index, fingerprint=fingerprint, rows=(part.row_start, part.row_stop),
        input=part.footer_sha256, n_chunks=stats["n_chunks"], n_tokens=stats["n_tokens"],
        n_covered=stats["n_covered"], n_encoded=stats["n_encoded"], n_unique=stats["n_unique"],
        n_stored_tokens=stats.get("n_stored_tokens", 0), device=str(extractor.model.device),
        dtype=extractor.runtime.dtype, runtime=extractor.runtime.name,
        # the partition's own work, preparing included wherever it ran
        seconds=ready.seconds + time.perf_counter() - start)
    return Encoded(part, {"docs": tables.docs, "chunks": tables.chunks,
                                  "tokens": tables.tokens}, marker)


def stage_partition(staging: Staging, encoded: Encoded) -> PartitionMarker:
    """Write an encoded partition's parts, then its marker, into the store."""
    return staging.write_part(encoded.marker, encoded.tables)


def failure_reason(exc: BaseException) -> BertpipeError:
    """A failed partition's error, the same whichever executor ran it: a domain error keeps
    its class (so the run can tell an unreadable input from a reason to retry), anything
    else becomes a PartitionError of one line; secrets scrubbed from both."""
    if isinstance(exc, BertpipeError):
        return type(exc)(scrub(str(exc)))
    first = scrub((str(exc).strip().splitlines() or [""])[0])
    return PartitionError(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)


class InProcessExecutor:
    """Everything in this process, one partition after another (`scheduler: synchronous`);
    a partition is written to the store by a second thread while the next one encodes
    (one write in flight), and, where the encoder runs on a device, the partition after it
    is read, tokenized and batched by a third (`prepare_depth`). Memory stays bounded by
    the partitions in those three stages."""

    def __init__(self, extractor: Extractor | None = None, on_batch: OnBatch | None = None,
                 ahead: int | None = None):
        """`ahead`: partitions to prepare ahead of the encoder (0: none); None lets
        `prepare_depth` decide from the encoder's device and threads."""
        self.extractor = extractor
        self.on_batch = on_batch
        self.ahead = ahead

    def __enter__(self) -> InProcessExecutor:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        return None

    def run(self, job: Job, parts: Sequence[Partition], staging: Staging, fingerprint: str,
            on_done: OnDone) -> Failures:
        if not parts:
            return []
        from ..extract.partition import Extractor

        extractor = self.extractor or Extractor(job)
        failures: Failures = []
        writing: tuple[Partition, Future[PartitionMarker]] | None = None

        def finish() -> None:
            if writing is None:
                return
            part, future = writing
            try:
                marker = future.result()
            except LockLostError:
                raise  # another run holds the store now: stop, write nothing more
            except Exception as exc:  # noqa: BLE001 - reported per partition, as Dask does
                failures.append((part, failure_reason(exc)))
                return
            on_done(part, marker)

        depth = self.ahead if self.ahead is not None else prepare_depth(extractor)
        # padded ahead too when prepared ahead: the encoder's thread only copies and runs
        prepared = prepared_ahead(parts, lambda p: prepare_partition(extractor, p, depth > 0),
                                  depth)
        with ThreadPoolExecutor(1, thread_name_prefix="bertpipe-write") as writer, \
                closing(prepared):
            for ready in prepared:
                part = ready.item
                try:
                    encoded = encode_prepared(extractor, ready.get(), fingerprint,
                                              self.on_batch)
                except Exception as exc:  # noqa: BLE001 - reported per partition
                    failures.append((part, failure_reason(exc)))
                    continue
                finish()  # the previous write: at most one in flight
                writing = (part, writer.submit(stage_partition, staging, encoded))
            finish()
        return failures


def prepare_depth(extractor: Extractor) -> int:
    """Partitions to prepare ahead of the encoder: one where it runs on a device (its
    thread mostly waits for the device, so the CPU is free to tokenize the next one; on a
    1-thread allotment too, where the preparing thread shares that CPU with a thread that
    mostly waits: `make bench-feed` measures both). None on the CPU: there the encoder
    uses every thread it was allotted (extract/threads.py), and preparing is under 1% of
    its work (the fast tokenizer does ~300k tokens per CPU-second, a CPU encoder of
    MiniLM 1.4k-2.6k, docs/results.md), so a thread beside it would only take its cores."""
    return 0 if extractor.model.device.type == "cpu" else 1


def executor_for(job: Job, say: Callable[[str], None] = log.info,
                 on_batch: OnBatch | None = None) -> Executor:
    """In-process for `synchronous`, else Dask (imported only then: it is slow to import)."""
    scheduler = job.execution.scheduler
    if scheduler == "synchronous":
        return InProcessExecutor(on_batch=on_batch)
    if scheduler != "local" and "://" not in scheduler:  # a scheduler address, not a path
        raise JobError(f"execution.scheduler: {scheduler!r} is not local, synchronous or a "
                       "scheduler address like tcp://host:8786")
    from .dask_executor import DaskExecutor  # why here: importing distributed costs ~1 s

    executor = DaskExecutor(scheduler, job.execution.workers, job.execution.threads_per_worker,
                            say)
    executor.on_batch = on_batch
    return executor
