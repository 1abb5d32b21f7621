"""Running a job: plan partitions, check the store, run what is not done, commit once.

The client side lives here: it plans from Parquet metadata, decides what a rerun may
skip, hands partitions to an executor (in-process or Dask), and commits the store's
final arrays and provenance when every partition has a marker.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import InputError, JobError, PartitionError, StoreError
from ..extract.model import load_config, model_fingerprint
from ..extract.source import Partition, plan_partitions
from ..post.apply import fit_view
from ..spec import Job
from ..stores import FORMATS, Layout, Staging, format_named
from ..stores.provenance import (
    FORMAT_VERSION,
    ModelInfo,
    Provenance,
    fingerprint_of,
    is_complete,
)
from ..version import __version__
from .executors import Executor, InProcessExecutor, OnDone

log = logging.getLogger(__name__)

# on_plan(all partitions, pending partitions) once after planning: progress reporting.
OnPlan = Callable[[Sequence[Partition], Sequence[Partition]], None]


@dataclass
class RunSummary:
    path: str
    rows: int = 0
    chunks: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    skipped: int = 0
    run: int = 0
    failed: list[str] = field(default_factory=list)
    already_complete: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def line(self) -> str:
        if self.already_complete:
            return f"{self.path}: already complete for this job; nothing to do"
        return (f"{self.rows} rows, {self.chunks} chunks, {self.tokens} tokens in "
                f"{self.wall_s:.1f}s ({self.tokens_per_s:,.0f} tokens/s); partitions "
                f"skipped {self.skipped}, run {self.run}, failed {len(self.failed)}")


def run_fingerprint(job: Job, model: dict[str, Any]) -> str:
    """What must match for a rerun to reuse parts: the job's content and the weights."""
    blob = json.dumps({"job": job.fingerprint(), "weights": model["weights_sha256"]},
                      sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def run_job(job: Job, executor: Executor | None = None, on_done: OnDone | None = None,
            overwrite: bool = False, on_plan: OnPlan | None = None) -> RunSummary:
    started = time.perf_counter()
    parts = plan_partitions(job.input, job.execution.partition_rows)
    if not parts:
        raise InputError(f"input.path: {job.input.path} has no rows")
    load_config(job.model)  # fail fast, before the store is touched, on a missing model
    model = model_fingerprint(job.model.path)
    fingerprint = run_fingerprint(job, model)
    path = job.output.path
    summary = RunSummary(path)
    staging = prepare_store(job, fingerprint, overwrite or job.output.overwrite)
    if staging is None:
        summary.already_complete = True
        return summary
    done = staging.done(fingerprint)
    pending = [p for p in parts if p.index not in done]
    summary.skipped = len(parts) - len(pending)
    if on_plan:
        on_plan(parts, pending)
    if executor is None:
        executor = executor_for(job)
    failures = executor.run(job, pending, staging, fingerprint, _collect(done, on_done))
    summary.run = len(pending) - len(failures)
    summary.failed = [f"partition {p.index} (rows {p.row_start}-{p.row_stop - 1}; "
                      f"{Path(p.file).name} rows {p.file_offset}-{p.file_offset + p.n_rows - 1})"
                      f": {msg}" for p, msg in failures]
    if failures:
        raise PartitionError(f"{len(failures)} of {len(parts)} partitions failed, the others are "
                             f"kept for a rerun; first: {summary.failed[0]}")
    markers = [done[p.index] for p in parts]
    commit_store(job, staging, parts, markers, model, fingerprint)
    summary.rows = parts[-1].row_stop
    summary.chunks = sum(m["n_chunks"] for m in markers)
    summary.tokens = sum(m["n_tokens"] for m in markers)
    summary.wall_s = time.perf_counter() - started
    return summary


def _collect(done: dict[int, dict[str, Any]], on_done: OnDone | None) -> OnDone:
    def record(part: Partition, marker: dict[str, Any]) -> None:
        done[part.index] = marker
        if on_done:
            on_done(part, marker)
    return record


def prepare_store(job: Job, fingerprint: str, overwrite: bool) -> Staging | None:
    """Staging for this run, or None when the store is already complete for this job.

    A store written by a different job or model is refused unless `overwrite`; so is a
    path that holds something other than a bertpipe store.
    """
    path = Path(job.output.path)
    staging = Staging(path)
    if path.exists() and overwrite:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    elif path.exists():
        provenance = _stored_provenance(str(path))
        info = staging.run_info() or {}
        existing = fingerprint_of(provenance) or fingerprint_of(info)
        if existing is None and (path.is_file() or any(path.iterdir())):
            raise StoreError(f"output.path: {path} exists and is not a bertpipe store; "
                             "choose another path or pass --overwrite")
        if existing is not None and existing != fingerprint:
            raise StoreError(f"output.path: {path} holds output of a different job or model; "
                             "pass --overwrite to replace it or choose another output.path")
        if is_complete(provenance):
            return None
    format_named(job.output.format).create(
        str(path), {"complete": False, "run_fingerprint": fingerprint})
    staging.begin({"run_fingerprint": fingerprint, "job": job.to_dict()})
    return staging


def _stored_provenance(path: str) -> dict[str, Any]:
    for fmt in FORMATS.values():
        provenance = fmt.read_provenance(path)
        if provenance:
            return dict(provenance)
    return {}


def commit_store(job: Job, staging: Staging, parts: Sequence[Partition],
                 markers: Sequence[dict[str, Any]], model: dict[str, Any],
                 fingerprint: str) -> None:
    layout = Layout(
        indices=[p.index for p in parts],
        n_docs=parts[-1].row_stop,
        n_chunks=sum(m["n_chunks"] for m in markers),
        has_chunks="chunks" in job.output.levels,
    )
    provenance = build_provenance(job, markers, model, fingerprint)
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
        },
        complete=False,
    )


def runtime_versions(markers: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Versions of the optional runtimes that ran partitions (torch is always recorded)."""
    from importlib.metadata import version

    used = {m.get("runtime", "torch") for m in markers} - {"torch"}
    return {name: version(name) for name in sorted(used)}


def executor_for(job: Job, say: Callable[[str], None] = log.info) -> Executor:
    """In-process for `synchronous`, else Dask (imported only then: it is slow to import)."""
    scheduler = job.execution.scheduler
    if scheduler == "synchronous":
        return InProcessExecutor()
    if scheduler != "local" and "://" not in scheduler:
        raise JobError(f"execution.scheduler: {scheduler!r} is not local, synchronous or a "
                       "scheduler address like tcp://host:8786")
    from .dask_executor import DaskExecutor  # why here: importing distributed costs ~1 s

    return DaskExecutor(scheduler, job.execution.workers, job.execution.threads_per_worker, say)
