"""Running a job: plan partitions, check the store, run what is not done, commit once.

The client side lives here: it plans from Parquet metadata, checks everything it can
before the store is touched, decides (in `output`) what a rerun may skip, hands
partitions to an executor (in-process or Dask) while holding the store's lock, and
commits the store's final arrays and provenance when every partition has a marker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import StoreError
from ..extract.source import Partition
from ..io.location import (
    disk_full_errors,
    register_options,
    storage_errors,
)
from ..post.apply import fit_view
from ..spec import Job
from ..stores import Layout, Staging, store_at
from ..stores.markers import MarkerTotals
from ..stores.provenance import InputFile, RunRecord, RuntimeChoice
from .checks import Asked, before_writing, resumed_choice
from .context import (
    PartitionWork,
    RunContext,
    decide_runtime,
    run_fingerprint,
    run_partitions,
    with_choice,
)
from .executors import Executor, InProcessExecutor, executor_for
from .incremental import run_incremental
from .output import OutputSession, Plan, assess
from .partition_pipeline import OnDone
from .record import OnPlan, RunSummary, build_provenance, run_record

log = logging.getLogger(__name__)

__all__ = ["InProcessExecutor", "OnPlan", "RunSummary", "commit_store", "executor_for",
           "run_fingerprint",
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
    with storage_errors(job.output.path, "output.path", StoreError), \
            disk_full_errors(job.output.path, "output.path", StoreError):
        return _run_job(job, executor, on_done, overwrite, on_plan, job_file, summary,
                        incremental, prune, say)


def _run_job(job: Job, executor: Executor | None, on_done: OnDone | None, overwrite: bool,
             on_plan: OnPlan | None, job_file: str | Path | None, summary: RunSummary | None,
             incremental: bool, prune: bool, say: Callable[[str], None]) -> RunSummary:
    # everything checkable is checked before the store is touched (nothing is created on
    # a job that cannot work): the list `validate` and `--dry-run` run too
    ready = before_writing(Asked(job, job_file, overwrite, incremental, prune))
    ctx = ready.context
    if ready.job.output.incremental:
        updated = run_incremental(ctx, executor, on_done, on_plan, prune, say, summary)
        if updated is not None:
            return updated
    # what the checks found the store allows: a complete one was verified there, once
    found = ready.action if ready.store is None else None
    return full_run(ctx, executor, on_done, overwrite, on_plan, summary, say, found)


def full_run(ctx: RunContext, executor: Executor | None, on_done: OnDone | None = None,
             overwrite: bool = False, on_plan: OnPlan | None = None,
             summary: RunSummary | None = None, say: Callable[[str], None] = log.info,
             action: str | None = None) -> RunSummary:
    """A run over the whole input into a new, replaced or resumed store. `action`: what
    the checks found the store allows (`output.assess`), when they have just asked."""
    job, parts = ctx.job, ctx.parts
    plan = Plan(ctx.fingerprint, ctx.identity, job.execution.partition_rows)
    overwrite = overwrite or job.output.overwrite
    output = OutputSession(job.output.path, ctx.fingerprint, say)
    output.refuse_if_locked()
    summary = summary or RunSummary(job.output.path)
    summary.partitions = len(parts)
    # refuse early, before the folder or lock is made; a complete store is only read
    action = action or assess(job, plan, overwrite)[0]
    if action == "complete":
        summary.already_complete = True
        return summary
    # a resume encodes as the run it finishes did (its parts must not mix runtimes, and a
    # retry on a fresh node must not measure again); else measured (or read from the cache)
    # before anything is created: a cache that cannot be written is refused, store untouched
    begun = resumed_choice(output.location, ctx) if action == "resume" else None
    if begun is not None:
        say(f"resuming with the runtime the run began with: {begun.runtime} {begun.dtype}")
    choice = begun or decide_runtime(ctx, say=say)
    executor = executor or executor_for(job, say)
    with executor, output:
        staging = output.prepare(job, plan, overwrite, choice)
        if staging is None:
            summary.already_complete = True
            return summary
        work = PartitionWork(with_choice(job, choice), parts, staging, ctx.fingerprint,
                             describe=_partition_named)
        try:
            markers, ran = run_partitions(work, executor, output, summary, on_done, on_plan)
        finally:
            summary.wall_s = ctx.elapsed()
        totals = MarkerTotals.of(markers)
        record = run_record("full", 0, ctx.started_at, ctx.identity, totals, ctx.elapsed(),
                            output.took_over)
        commit_store(job, staging, parts, totals, ctx.model, ctx.fingerprint, ctx.identity,
                     record, choice)
    summary.rows = summary.added = parts[-1].row_stop
    summary.chunks = totals.chunks
    summary.tokens = totals.tokens
    this_run = MarkerTotals.of(ran)  # not the partitions a resume found done
    summary.encoded = this_run.distinct
    summary.copied = this_run.copied
    summary.wall_s = ctx.elapsed()
    return summary


def _partition_named(p: Partition) -> str:
    return (f"partition {p.index} (rows {p.row_start}-{p.row_stop - 1}; {Path(p.file).name} "
            f"rows {p.file_offset}-{p.file_offset + p.n_rows - 1})")


def commit_store(job: Job, staging: Staging, parts: Sequence[Partition], totals: MarkerTotals,
                 model: dict[str, Any], fingerprint: str,
                 identity: tuple[InputFile, ...] = (), record: RunRecord | None = None,
                 choice: RuntimeChoice | None = None) -> None:
    layout = Layout(
        indices=[p.index for p in parts],
        n_docs=parts[-1].row_stop,
        n_chunks=totals.chunks,
        has_chunks="chunks" in job.output.levels,
        n_tokens=totals.stored_tokens,
        has_tokens=bool(job.token_views),
    )
    provenance = replace(build_provenance(job, totals, model, fingerprint),
                         input_identity=identity, history=(record,) if record else (),
                         runtime_choice=choice)
    fmt = store_at(job.output.path, job.output.format)
    staging.confirm("commit")
    fmt.fence_writes(lambda: staging.confirm("commit"))
    with staging.checked_reads(layout.indices):  # each staged part is read here, once
        fmt.commit(staging, layout, provenance)
    post_views = [v for v in job.views if v.post is not None]
    if post_views:
        docs, _ = fmt.open_datasets()
        for view in post_views:
            assert view.post is not None  # narrowed by the filter above
            staging.confirm(f"fit the post-processed view {view.name}")
            provenance = fit_view(fmt, docs, layout.has_chunks, provenance, view.name,
                                  view.name, view.post)
    # why last: a reader that sees `complete` sees every array and post view
    staging.confirm("mark the store complete")
    fmt.update_provenance(replace(provenance, complete=True))
    staging.remove()
