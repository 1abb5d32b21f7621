"""Executors run partitions and report each one's marker or failure.

The unit of work is one partition, taken through the one partition pipeline
(`partition_pipeline`: prepare, encode, write, with a bounded look-ahead and one write in
flight); an executor decides where that runs. The Dask executor lives in `dask_executor`
(slow to import).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from ..errors import JobError
from ..extract.source import Partition
from ..spec import Job
from ..stores import Staging
from .partition_pipeline import (
    Failures,
    OnBatch,
    OnDone,
    PartitionOutcome,
    PartitionPipeline,
    prepare_depth,
    report,
)

if TYPE_CHECKING:  # torch and transformers load only where this process encodes
    from ..extract.partition import Extractor

log = logging.getLogger(__name__)


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


class InProcessExecutor:
    """Everything in this process (`scheduler: synchronous`): the partitions, in order,
    through one partition pipeline, whose lanes are threads of this process (a partition
    is written while the next one encodes, and prepared ahead where the encoder runs on a
    device: `prepare_depth`). This thread submits them and reports each outcome, in
    partition order, as it comes."""

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
        depth = self.ahead if self.ahead is not None else prepare_depth(extractor)
        pipeline = PartitionPipeline(extractor, depth)
        failures: Failures = []
        try:
            pending: deque[Future[PartitionOutcome]] = deque()
            for part in parts:
                pending.append(pipeline.submit(part, staging, fingerprint, self.on_batch))
                while pending and pending[0].done():  # what finished meanwhile, in partition order
                    report(pending.popleft().result(), on_done, failures)
            for outcome in pending:
                report(outcome.result(), on_done, failures)
        finally:
            pipeline.close()  # at once on an error: an encoding stops at its next batch
        return failures


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
