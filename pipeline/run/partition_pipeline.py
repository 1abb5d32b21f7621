"""One partition pipeline for every executor: prepare → encode → write, and its outcome.

Each stage has a thread of its own, a lane that takes one partition at a time in the order
the partitions were submitted:

    prepare   read, tokenize, chunk and batch (CPU work: `Extractor.prepare`); on the
              encoder's own lane when nothing is prepared ahead
    encode    the model and the views (`Extractor.finish`): the lane that loaded the model
    write     the part files, then the marker (`Staging.write_part`)

so an object store's uploads overlap the model's work, and where the encoder runs on a
device the next partition is prepared while it runs this one (`prepare_depth`). The
bounds keep memory bounded by a few partitions, not by the input:

- `submit` waits while 1 + depth partitions are between their start and their write
  (being prepared, prepared, encoding, or encoded and waiting for the writer): at most
  `depth` partitions are prepared ahead of the one the encoder holds;
- one write in flight: the write lane takes the next partition once the last is written.

An executor submits each partition from the thread that runs it (its loop in-process, a
task on a Dask worker) and gets a future of its `PartitionOutcome`: `Written` with the
marker, or `Failed` with the exception as raised. `report` turns outcomes into what a run
records, alike for every executor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from ..errors import BertpipeError, PartitionError
from ..extract.source import Partition
from ..io.location import scrub
from ..stores import Staging
from ..stores.lock import LockLostError
from ..stores.markers import PartitionMarker

if TYPE_CHECKING:  # torch and transformers load only where this process encodes
    from ..extract.partition import Extractor, PreparedPart

# on_batch(partition, batches done, batches planned) after each forward pass: progress only.
# on_done(partition, marker) once per written partition: progress and bookkeeping.
OnBatch = Callable[[Partition, int, int], None]
OnDone = Callable[[Partition, PartitionMarker], None]
Failures = list[tuple[Partition, BertpipeError]]


@dataclass(frozen=True)
class Written:
    """A partition whose parts and marker are in the store."""

    part: Partition
    marker: PartitionMarker


@dataclass(frozen=True)
class Failed:
    """A partition that could not be done; `error` as raised, so that each executor can
    tell a deterministic failure (a bertpipe error) from one worth a retry."""

    part: Partition
    error: Exception


PartitionOutcome = Written | Failed


class Stopped(Exception):
    """The pipeline was closed before this partition was done (the run stopped)."""


def report(outcome: PartitionOutcome, on_done: OnDone, failures: Failures) -> None:
    """A finished partition as every executor reports it: its marker to `on_done`, or its
    one-line failure added to `failures`. A lost lock is raised: another run holds the
    store now, so the run stops and writes nothing more."""
    if isinstance(outcome, Written):
        on_done(outcome.part, outcome.marker)
    elif isinstance(outcome.error, LockLostError):
        raise outcome.error
    else:
        failures.append((outcome.part, failure_reason(outcome.error)))


def failure_reason(exc: BaseException) -> BertpipeError:
    """A failed partition's error, the same whichever executor ran it: a domain error keeps
    its class (so the run can tell an unreadable input from a reason to retry), anything
    else becomes a PartitionError of one line; secrets scrubbed from both."""
    if isinstance(exc, BertpipeError):
        return type(exc)(scrub(str(exc)))
    first = scrub((str(exc).strip().splitlines() or [""])[0])
    return PartitionError(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)


def prepare_depth(extractor: Extractor) -> int:
    """Partitions to prepare ahead of the encoder: one where it runs on a device (its
    thread mostly waits for the device, so the CPU is free to tokenize the next one; on a
    1-thread allotment too, where the preparing thread shares that CPU with a thread that
    mostly waits: `make bench-feed` measures both). None on the CPU: there the encoder
    uses every thread it was allotted (extract/threads.py), and preparing is under 1% of
    its work (the fast tokenizer does ~300k tokens per CPU-second, a CPU encoder of
    MiniLM 1.4k-2.6k, docs/results.md), so a thread beside it would only take its cores."""
    return 0 if extractor.model.device.type == "cpu" else 1


@dataclass(frozen=True)
class Ready:
    """A partition prepared for the encoder, and the seconds that took."""

    prepared: PreparedPart
    seconds: float


@dataclass(frozen=True)
class Encoded:
    """A partition's tables and its marker, encoded but not yet in the store."""

    tables: dict[str, pa.Table | None]
    marker: PartitionMarker  # its checksums set when the parts are written


class PartitionPipeline:
    """One worker's partitions through prepare → encode → write (see the module
    docstring). `encoder`: the lane the model was loaded on, where it has one (a Dask
    worker loads it there); the pipeline owns its lanes and `close` ends them."""

    def __init__(self, extractor: Extractor, depth: int,
                 encoder: ThreadPoolExecutor | None = None):
        self.extractor = extractor
        self.depth = depth
        self.encoder = encoder or ThreadPoolExecutor(1, thread_name_prefix="bertpipe-encode")
        # padded too when prepared ahead: the encoder's thread then only copies and runs
        self.preparer = ThreadPoolExecutor(1, thread_name_prefix="bertpipe-prepare") \
            if depth > 0 else self.encoder
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="bertpipe-write")
        self.room = threading.Semaphore(1 + depth)  # partitions started, not yet writing
        self.stopped = threading.Event()

    def submit(self, part: Partition, staging: Staging, fingerprint: str,
               on_batch: OnBatch | None = None) -> Future[PartitionOutcome]:
        """Start `part` on its way, once there is room (this waits in the caller's thread,
        so a Dask worker starts no further task meanwhile). Each lane takes its work in
        the order of the calls, so partitions are encoded and written in that order."""
        self.room.acquire()
        ready = self.preparer.submit(self._prepare, part)
        encoded = self.encoder.submit(self._encode, ready, fingerprint, on_batch)
        return self.writer.submit(self._write, part, encoded, staging)

    def close(self, wait: bool = True) -> None:
        """Stop: what waits in a lane is dropped, an encoding stops at its next batch, a
        write in flight ends (it is whole or absent either way); with `wait`, until then."""
        self.stopped.set()
        lanes = (self.preparer, self.encoder, self.writer)
        for lane in lanes:
            lane.shutdown(wait=False, cancel_futures=True)
        if wait:
            for lane in lanes:
                lane.shutdown(wait=True)

    # ---- the stages, each in its own lane ----------------------------------------------

    def _prepare(self, part: Partition) -> Ready:
        self._go_on()
        start = time.perf_counter()
        prepared = self.extractor.prepare(part, self.depth > 0)
        return Ready(prepared, time.perf_counter() - start)

    def _encode(self, ready: Future[Ready], fingerprint: str, on_batch: OnBatch | None
                ) -> Encoded:
        got = ready.result()
        self._go_on()
        start = time.perf_counter()
        part = got.prepared.part
        encoder = self.extractor.encoder
        encoder.on_batch = lambda done, total: self._batch_done(part, done, total, on_batch)
        try:
            tables = self.extractor.finish(got.prepared)
        finally:
            encoder.on_batch = None  # the extractor may outlive this pipeline (a later run)
        # the partition's own work, preparing included wherever it ran
        marker = self._marker(part, fingerprint, tables.stats,
                              got.seconds + time.perf_counter() - start)
        return Encoded({"docs": tables.docs, "chunks": tables.chunks, "tokens": tables.tokens},
                       marker)

    def _write(self, part: Partition, encoded: Future[Encoded], staging: Staging
               ) -> PartitionOutcome:
        try:
            done = encoded.result()
        except Exception as exc:  # noqa: BLE001 - this partition's outcome, not the lane's
            return Failed(part, exc)
        finally:
            self.room.release()  # written next (the last write is done): the next may start
        try:
            self._go_on()
            return Written(part, staging.write_part(done.marker, done.tables))
        except Exception as exc:  # noqa: BLE001 - this partition's outcome, not the lane's
            return Failed(part, exc)

    def _batch_done(self, part: Partition, done: int, total: int,
                    on_batch: OnBatch | None) -> None:
        self._go_on()  # why: a stopped run (an error, Ctrl-C) waits for one batch, not a partition
        if on_batch is not None:
            on_batch(part, done, total)

    def _go_on(self) -> None:
        if self.stopped.is_set():
            raise Stopped("the run stopped")

    def _marker(self, part: Partition, fingerprint: str, stats: dict[str, int],
                seconds: float) -> PartitionMarker:
        extractor = self.extractor
        return PartitionMarker(
            index=part.index, fingerprint=fingerprint, rows=(part.row_start, part.row_stop),
            input=part.footer_sha256, n_chunks=stats["n_chunks"], n_tokens=stats["n_tokens"],
            n_covered=stats["n_covered"], n_encoded=stats["n_encoded"],
            n_unique=stats["n_unique"], n_stored_tokens=stats.get("n_stored_tokens", 0),
            device=str(extractor.model.device), dtype=extractor.runtime.dtype,
            runtime=extractor.runtime.name, seconds=seconds)
