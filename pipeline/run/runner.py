"""Running a job: plan partitions, check the store, run what is not done, commit once.

The client side lives here: it plans from Parquet metadata, checks everything it can
before the store is touched, decides (in `output`) what a rerun may skip, hands
partitions to an executor (in-process or Dask) while holding the store's lock, and
commits the store's final arrays and provenance when every partition has a marker.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
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
from ..stores.provenance import FORMAT_VERSION, InputFile, ModelInfo, Provenance
from ..version import __version__
from .executors import Executor, InProcessExecutor, OnBatch, OnDone
from .output import OutputSession, Plan, assess, check_output_location

log = logging.getLogger(__name__)

# on_plan(all partitions, pending partitions) once after planning: progress reporting.
OnPlan = Callable[[Sequence[Partition], Sequence[Partition]], None]


@dataclass
class RunSummary:
    """What a run did. `rows`, `chunks`, `tokens` describe the finished store; `tokens_run`
    and the rate count only the partitions encoded by this run (not those a resume skipped).
    Filled as the run goes, so a failed run still reports how far it got."""

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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_run / self.wall_s if self.wall_s else 0.0

    def line(self) -> str:
        if self.already_complete:
            return f"{self.path}: already complete for this job; nothing to do"
        return (f"{self.rows} rows, {self.chunks} chunks, {self.tokens_run} tokens encoded in "
                f"{self.wall_s:.1f}s ({self.tokens_per_s:,.0f} tokens/s); partitions "
                f"skipped {self.skipped}, run {self.run}, failed {len(self.failed)}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`extract --json-summary`, schemas/run-summary.schema.json)."""
        return {"store": self.path, "rows": self.rows, "chunks": self.chunks,
                "tokens": self.tokens, "tokens_encoded_this_run": self.tokens_run,
                "wall_seconds": round(self.wall_s, 3),
                "tokens_per_second": round(self.tokens_per_s, 1),
                "partitions": {"total": self.partitions, "skipped": self.skipped,
                               "run": self.run, "failed": len(self.failed)},
                "failed_partitions": self.failed, "device": self.devices,
                "dtype": self.dtypes, "already_complete": self.already_complete}


def run_fingerprint(job: Job, model: dict[str, Any]) -> str:
    """What must match for a rerun to reuse parts: the job's content and the weights."""
    blob = json.dumps({"job": job.fingerprint(), "weights": model["weights_sha256"]},
                      sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def run_job(job: Job, executor: Executor | None = None, on_done: OnDone | None = None,
            overwrite: bool = False, on_plan: OnPlan | None = None,
            job_file: str | Path | None = None, summary: RunSummary | None = None
            ) -> RunSummary:
    """Plan, check everything that can be checked, then (and only then) lock the store and
    run what is not done. `job_file` guards the job's folder against `output.path`;
    `summary`, when given, is filled in place (the caller keeps it if the run fails).

    An object store that cannot be reached, or refuses the credentials, is one line (exit
    8, or 3 for the input and 5 for the store), wherever in the run it happens."""
    # the formats and verify get only the store's path: they find its options by it
    register_options(job.output.path, job.output.storage_options)
    with storage_errors(job.output.path, "output.path", StoreError):
        return _run_job(job, executor, on_done, overwrite, on_plan, job_file, summary)


def _run_job(job: Job, executor: Executor | None, on_done: OnDone | None, overwrite: bool,
             on_plan: OnPlan | None, job_file: str | Path | None, summary: RunSummary | None
             ) -> RunSummary:
    started = time.perf_counter()
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
        done = {i: m for i, m in staging.done(fingerprint).items() if _reusable(m, parts)}
        pending = [p for p in parts if p.index not in done]
        summary.skipped = len(parts) - len(pending)
        if on_plan:
            on_plan(parts, pending)
        failures = executor.run(job, pending, staging, fingerprint,
                                _collect(done, on_done, summary))
        summary.wall_s = time.perf_counter() - started
        summary.run = len(pending) - len(failures)
        summary.failed = [f"partition {p.index} (rows {p.row_start}-{p.row_stop - 1}; "
                          f"{Path(p.file).name} rows {p.file_offset}-"
                          f"{p.file_offset + p.n_rows - 1}): {msg}" for p, msg in failures]
        if failures:
            raise PartitionError(f"{len(failures)} of {len(parts)} partitions failed, the "
                                 f"others are kept for a rerun; first: {summary.failed[0]}")
        markers = [done[p.index] for p in parts]
        commit_store(job, staging, parts, markers, model, fingerprint, identity)
    summary.rows = parts[-1].row_stop
    summary.chunks = sum(m["n_chunks"] for m in markers)
    summary.tokens = sum(m["n_tokens"] for m in markers)
    summary.wall_s = time.perf_counter() - started
    return summary


def _reusable(marker: dict[str, Any], parts: Sequence[Partition]) -> bool:
    """A marker stands for a planned partition: same index, row range and input file."""
    index = marker.get("index")
    if not isinstance(index, int) or not 0 <= index < len(parts):
        return False
    part = parts[index]
    return (marker.get("rows") == [part.row_start, part.row_stop]
            and marker.get("input") == part.footer_sha256)


def _collect(done: dict[int, dict[str, Any]], on_done: OnDone | None,
             summary: RunSummary) -> OnDone:
    def record(part: Partition, marker: dict[str, Any]) -> None:
        done[part.index] = marker
        summary.tokens_run += int(marker["n_tokens"])
        summary.devices = sorted({*summary.devices, str(marker.get("device", "?"))})
        summary.dtypes = sorted({*summary.dtypes, str(marker.get("dtype", "?"))})
        if on_done:
            on_done(part, marker)
    return record


def commit_store(job: Job, staging: Staging, parts: Sequence[Partition],
                 markers: Sequence[dict[str, Any]], model: dict[str, Any],
                 fingerprint: str, identity: tuple[InputFile, ...] = ()) -> None:
    layout = Layout(
        indices=[p.index for p in parts],
        n_docs=parts[-1].row_stop,
        n_chunks=sum(m["n_chunks"] for m in markers),
        has_chunks="chunks" in job.output.levels,
        n_tokens=sum(m.get("n_stored_tokens", 0) for m in markers),
        has_tokens=bool(job.token_views),
    )
    provenance = replace(build_provenance(job, markers, model, fingerprint),
                         input_identity=identity)
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


def build_provenance(job: Job, markers: Sequence[dict[str, Any]], model: dict[str, Any],
                     fingerprint: str) -> Provenance:
    """The provenance of a finished run, still marked incomplete."""
    import torch
    import transformers

    return Provenance(
        format_version=FORMAT_VERSION,
        run_fingerprint=fingerprint,
        job=job,
        model=ModelInfo(**model),
        versions={"bertpipe": __version__, "torch": torch.__version__,
                  "transformers": transformers.__version__, **runtime_versions(markers)},
        device=sorted({m["device"] for m in markers}),
        dtype=sorted({m["dtype"] for m in markers}),
        runtime=sorted({m.get("runtime", "torch") for m in markers}),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        stats={
            "rows": sum(m["rows"][1] - m["rows"][0] for m in markers),
            "chunks": sum(m["n_chunks"] for m in markers),
            "tokens": sum(m["n_tokens"] for m in markers),
            "tokens_covered": sum(m["n_covered"] for m in markers),
            "tokens_encoded": sum(m["n_encoded"] for m in markers),
            "partitions": len(markers),
            "partition_seconds": round(sum(m["seconds"] for m in markers), 3),
            **({"tokens_stored": sum(m["n_stored_tokens"] for m in markers)}
               if job.token_views else {}),
        },
        complete=False,
    )


def runtime_versions(markers: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Versions of the optional runtimes that ran partitions (torch is always recorded)."""
    from importlib.metadata import version

    used = {m.get("runtime", "torch") for m in markers} - {"torch"}
    return {name: version(name) for name in sorted(used)}


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
