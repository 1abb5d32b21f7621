"""Running a job: plan partitions, check the store, run what is not done, commit once.

The client side lives here: it plans from Parquet metadata, checks everything it can
before the store is touched, decides (in `output`) what a rerun may skip, hands
partitions to an executor (in-process or Dask) while holding the store's lock, and
commits the store's final arrays and provenance when every partition has a marker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import JobError, PartitionError, StoreError
from ..extract.model import model_fingerprint
from ..extract.preflight import preflight
from ..extract.source import Partition, input_identity
from ..post.apply import fit_view
from ..spec import Job
from ..stores import Layout, Staging, format_named
from ..stores.fs import check_reachable, register_options, resolve, storage_errors
from ..stores.provenance import InputFile, RunRecord
from .executors import Executor, InProcessExecutor, OnBatch, OnDone
from .incremental import run_incremental
from .output import OutputSession, Plan, assess, check_output_location
from .record import (
    OnPlan,
    RunSummary,
    build_provenance,
    collect,
    encoded_rows,
    full_run_record,
    now_iso,
    reusable,
    run_fingerprint,
)

log = logging.getLogger(__name__)

__all__ = ["OnPlan", "RunSummary", "commit_store", "executor_for", "run_fingerprint",
           "run_job"]


def run_job(job: Job, executor: Executor | None = None, on_done: OnDone | None = None,
            overwrite: bool = False, on_plan: OnPlan | None = None,
            job_file: str | Path | None = None, summary: RunSummary | None = None,
            incremental: bool = False, prune: bool = False,
            say: Callable[[str], None] = log.info) -> RunSummary:
    """Plan, check everything that can be checked, then (and only then) lock the store and
    run what is not done. `job_file` guards the job's folder against `output.path`;
    `summary`, when given, is filled in place (the caller keeps it if the run fails).

    `incremental` (or `output.incremental`) updates an existing complete store with what
    is new or changed in the input (see `incremental`); `prune` then removes the rows whose
    ids are gone from the input instead of flagging them.

    An object store that cannot be reached, or refuses the credentials, is one line (exit
    8, or 3 for the input and 5 for the store), wherever in the run it happens."""
    # the formats and verify get only the store's path: they find its options by it
    register_options(job.output.path, job.output.storage_options)
    with storage_errors(job.output.path, "output.path", StoreError):
        return _run_job(job, executor, on_done, overwrite, on_plan, job_file, summary,
                        incremental, prune, say)


def _run_job(job: Job, executor: Executor | None, on_done: OnDone | None, overwrite: bool,
             on_plan: OnPlan | None, job_file: str | Path | None, summary: RunSummary | None,
             incremental: bool, prune: bool, say: Callable[[str], None]) -> RunSummary:
    if incremental or job.output.incremental:
        if overwrite or job.output.overwrite:
            raise JobError("output.incremental: an incremental run adds to the store, "
                           "--overwrite replaces it; choose one")
        if not job.output.incremental:  # the job key's checks (id column, token views)
            job = Job.from_dict({**job.to_dict(), "output": {**job.to_dict()["output"],
                                                             "incremental": True}})
        updated = run_incremental(job, executor or executor_for(job, say), on_done, on_plan,
                                  job_file, prune, say, summary)
        if updated is not None:
            return updated
        return full_run(job, executor, on_done, False, on_plan, job_file, summary)
    if prune:
        raise JobError("--prune: only with --incremental (or output.incremental: true)")
    return full_run(job, executor, on_done, overwrite, on_plan, job_file, summary)


def full_run(job: Job, executor: Executor | None = None, on_done: OnDone | None = None,
             overwrite: bool = False, on_plan: OnPlan | None = None,
             job_file: str | Path | None = None, summary: RunSummary | None = None
             ) -> RunSummary:
    """A run over the whole input into a new, replaced or resumed store."""
    started = time.perf_counter()
    started_at = now_iso()
    # everything checkable is checked before the store is touched (nothing is created on
    # a job that cannot work)
    parts = preflight(job).partitions
    identity = input_identity(job.input)
    model = model_fingerprint(job.model.path)
    fingerprint = run_fingerprint(job, model)
    check_output_location(job, job_file)
    # a wrong credential or an unreachable endpoint fails here, before anything is made
    check_reachable(resolve(job.output.path), "output.path", StoreError)
    plan = Plan(fingerprint, identity, job.execution.partition_rows)
    overwrite = overwrite or job.output.overwrite
    output = OutputSession(job.output.path, fingerprint)
    output.refuse_if_locked()
    summary = summary or RunSummary(job.output.path)
    summary.partitions = len(parts)
    # refuse early, before the folder or lock is made; a complete store is only read
    if assess(job, plan, overwrite)[0] == "complete":
        summary.already_complete = True
        return summary
    if executor is None:
        executor = executor_for(job)
    with executor, output:
        staging = output.prepare(job, plan, overwrite)
        if staging is None:
            summary.already_complete = True
            return summary
        done = {i: m for i, m in staging.done(fingerprint).items() if reusable(m, parts)}
        pending = [p for p in parts if p.index not in done]
        summary.skipped = len(parts) - len(pending)
        if on_plan:
            on_plan(parts, pending)
        failures = executor.run(job, pending, staging, fingerprint,
                                collect(done, on_done, summary))
        summary.wall_s = time.perf_counter() - started
        summary.run = len(pending) - len(failures)
        summary.failed = [f"partition {p.index} (rows {p.row_start}-{p.row_stop - 1}; "
                          f"{Path(p.file).name} rows {p.file_offset}-"
                          f"{p.file_offset + p.n_rows - 1}): {msg}" for p, msg in failures]
        if failures:
            raise PartitionError(f"{len(failures)} of {len(parts)} partitions failed, the "
                                 f"others are kept for a rerun; first: {summary.failed[0]}")
        markers = [done[p.index] for p in parts]
        record = full_run_record(started_at, markers, identity, time.perf_counter() - started)
        commit_store(job, staging, parts, markers, model, fingerprint, identity, record)
    summary.rows = summary.added = parts[-1].row_stop
    summary.chunks = sum(m["n_chunks"] for m in markers)
    summary.tokens = sum(m["n_tokens"] for m in markers)
    ran = [done[p.index] for p in pending]  # not the partitions a resume found done
    summary.encoded = encoded_rows(ran)
    summary.copied = sum(m["rows"][1] - m["rows"][0] for m in ran) - summary.encoded
    summary.wall_s = time.perf_counter() - started
    return summary


def commit_store(job: Job, staging: Staging, parts: Sequence[Partition],
                 markers: Sequence[dict[str, Any]], model: dict[str, Any],
                 fingerprint: str, identity: tuple[InputFile, ...] = (),
                 record: RunRecord | None = None) -> None:
    layout = Layout(
        indices=[p.index for p in parts],
        n_docs=parts[-1].row_stop,
        n_chunks=sum(m["n_chunks"] for m in markers),
        has_chunks="chunks" in job.output.levels,
        n_tokens=sum(m.get("n_stored_tokens", 0) for m in markers),
        has_tokens=bool(job.token_views),
    )
    provenance = replace(build_provenance(job, markers, model, fingerprint),
                         input_identity=identity, history=(record,) if record else ())
    fmt = format_named(job.output.format)
    path = job.output.path
    fmt.commit(path, staging, layout, provenance.to_dict())
    post_views = [v for v in job.views if v.post is not None]
    if post_views:
        docs, _ = fmt.open_datasets(path)
        for view in post_views:
            assert view.post is not None  # narrowed by the filter above
            provenance = fit_view(fmt, path, docs, layout.has_chunks, provenance, view.name,
                                  view.name, view.post)
    # why last: a reader that sees `complete` sees every array and post view
    fmt.update_provenance(path, replace(provenance, complete=True).to_dict())
    staging.remove()


def executor_for(job: Job, say: Callable[[str], None] = log.info,
                 on_batch: OnBatch | None = None) -> Executor:
    """In-process for `synchronous`, else Dask (imported only then: it is slow to import)."""
    scheduler = job.execution.scheduler
    if scheduler == "synchronous":
        return InProcessExecutor(on_batch=on_batch)
    if scheduler != "local" and "://" not in scheduler:
        raise JobError(f"execution.scheduler: {scheduler!r} is not local, synchronous or a "
                       "scheduler address like tcp://host:8786")
    from .dask_executor import DaskExecutor  # why here: importing distributed costs ~1 s

    executor = DaskExecutor(scheduler, job.execution.workers, job.execution.threads_per_worker,
                            say)
    executor.on_batch = on_batch
    return executor
