"""Incremental runs: encode only what is new or changed, then publish a new store version.

The input is compared with the store's current version by id and by each text's digest
(`compare`). Rows whose id is known and whose text is the same keep their stored results;
new ids and changed texts need results, which are copied from an identical stored text
when there is one, else encoded, each distinct text once. Ids gone from the input stay
with `present: false`, or are removed with `prune`. On a format that updates its arrays in
place, a changed text is appended and its old row kept, flagged, until superseded rows pass
a tenth of the store (`compare.SUPERSEDED_SHARE`) or a prune drops them.

The distinct texts to encode (the delta) are written to the staging area as a Parquet
table and run through the ordinary partition machinery (markers, lock, resume, either
executor). The new version is then assembled in store order (`assemble`), written beside
the current one and published in one atomic step: until then, readers see the previous
version, and a killed run leaves it as it was (a rerun resumes from the delta's markers).

Refused, before anything is written: a job without `input.id_column`, and a store made
with other model weights, views, chunking, dtype or levels (its vectors would not match;
a full run with --overwrite is needed). An absent or empty output path, or a store whose
first run is unfinished, is left to the full run (returns None).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import pyarrow as pa
import pyarrow.parquet as pq

from ..extract.source import Partition, plan_partitions
from ..io.location import Location
from ..post.apply import load_transform
from ..spec import InputSpec, Job
from ..stores import Staging, store_at
from ..stores.base import StoreFormat
from ..stores.lock import Fence
from ..stores.markers import MarkerTotals
from ..stores.opened import StoreData, open_store_data, store_name
from ..stores.ownership import inspect_output
from ..stores.provenance import ModelInfo, Provenance, is_complete
from .assemble import (
    Assembly,
    Derived,
    Source,
    assemble,
    carried_changed,
    streamed_version,
)
from .checks import check_compatible
from .compare import Changes, StoreRows, compare
from .context import PartitionWork, RunContext, run_partitions, with_choice
from .executors import Executor, executor_for
from .output import OutputSession
from .partition_pipeline import OnDone
from .record import (
    OnPlan,
    RunSummary,
    now_iso,
    run_record,
    software_versions,
    superseded_phrase,
)

log = logging.getLogger(__name__)

DELTA_FILE = "delta.parquet"  # in the staging area
ASSEMBLED = "assembled"  # staging folder of the new version's parts


def run_incremental(ctx: RunContext, executor: Executor | None, on_done: OnDone | None,
                    on_plan: OnPlan | None, prune: bool,
                    say: Callable[[str], None] = log.info,
                    summary: RunSummary | None = None) -> RunSummary | None:
    """Update the complete store at `output.path` with the input's new and changed rows;
    None when there is no complete store yet (the caller runs the job in full).
    `summary`, when given, is filled in place (the caller keeps it if the run fails)."""
    job = ctx.job
    output = OutputSession(job.output.path, ctx.fingerprint, say)
    output.refuse_if_locked()
    found = _complete_store(job, say)
    if found is None:
        return None
    path, current = found
    check_compatible(job, ctx.model, current, path)
    summary = summary or RunSummary(path)
    summary.incremental, summary.version = True, current.version
    if current.input_identity == ctx.identity and current.run_fingerprint == ctx.fingerprint:
        summary.already_complete = True
        summary.rows = int(current.stats["rows"])
        _clear_published(output, current)
        return summary
    executor = executor or executor_for(job, say)
    with executor, output:
        # under the lock: the version this run builds on; read by ranges, without dask
        store = open_store_data(path, dask=False)
        changes = compare(job.input, ctx.parts, StoreRows.of(store.docs, store.path), prune,
                          append_edits=store.fmt.appends_edits)
        try:
            say(f"incremental: {changes.added} new, {changes.replaced} changed, "
                f"{changes.unchanged} unchanged, {changes.gone} gone; {changes.encoded} texts "
                f"to encode ({changes.copied} rows copy an identical text)"
                + superseded_phrase(changes.superseded, changes.dropped))
            staging, delta_job, parts, delta_fp = _stage_delta(ctx, store, changes,
                                                               output.lock.fence())
            # the runtime and dtype the store was made with: its versions never mix them
            work = PartitionWork(with_choice(delta_job, current.runtime_choice), parts, staging,
                                 delta_fp,
                                 label="partitions of the texts to encode",
                                 describe=lambda p: f"partition {p.index} of the texts to encode",
                                 unchanged=f"; the store is unchanged (version {current.version})")
            markers, _ = run_partitions(work, executor, output, summary, on_done, on_plan)
            totals = MarkerTotals.of(markers)
            provenance = _commit(ctx, store, changes, staging, parts, totals,
                                 output.took_over)
        finally:
            changes.close()
    return _summarised(summary, provenance, changes, ctx.started)


def _complete_store(job: Job, say: Callable[[str], None]) -> tuple[str, Provenance] | None:
    """The complete store at output.path (as it is opened) and its provenance, or None
    when the job must run in full. Only the provenance is read: a run with nothing to do
    opens no data (at a million rows, opening it took half a minute)."""
    path = job.output.path
    contents = inspect_output(path)
    if contents.state in ("absent", "empty"):
        say(f"{path}: no store yet; running the job in full")
        return None
    fmt = store_at(path, contents.format or job.output.format)
    if contents.state == "store":
        fmt.recover()  # an update killed in its switch: finish publishing it
    raw = fmt.record()
    if raw is None or contents.state != "store" or not is_complete(raw) or not raw.get("job"):
        return None  # the full run refuses, resumes or replaces it by its own rules
    opened = store_name(path)
    return opened, Provenance.from_dict(raw, opened)


def _summarised(summary: RunSummary, provenance: Provenance, changes: Changes,
                started: float) -> RunSummary:
    summary.version = provenance.version
    summary.rows = changes.rows
    summary.chunks = int(provenance.stats["chunks"])
    summary.tokens = int(provenance.stats["tokens"])
    for name in ("added", "replaced", "unchanged", "gone", "pruned", "encoded", "copied",
                 "superseded", "dropped"):
        setattr(summary, name, getattr(changes, name))
    summary.carried_changed = provenance.history[-1].carried_changed  # counted at the commit
    summary.wall_s = time.perf_counter() - started
    return summary


def _clear_published(output: OutputSession, current: Provenance) -> None:
    """Remove the staging area of an update that was published before its run could clean
    up (killed right after the switch)."""
    staging = Staging(output.location)
    run = staging.run_info()
    if run is None or run.get("mode") != "incremental" or \
            run.get("base_version", -1) >= current.version:
        return
    with output:
        output.confirm("clear the staging area")
        staging.remove()


def _stage_delta(run: RunContext, store: StoreData, changes: Changes, fence: Fence | None
                 ) -> tuple[Staging, Job, list[Partition], str]:
    """The staging area holding the delta table: reused when an interrupted run left the
    same delta on the same version, else started afresh."""
    job, fingerprint = run.job, run.fingerprint
    staging = Staging(store.path, fence=fence)
    delta_file = staging.root.child(DELTA_FILE)  # local, or beside the store on S3
    partition_rows = job.execution.partition_rows
    key = hashlib.sha256(json.dumps({
        "base_version": store.provenance.version, "fingerprint": fingerprint,
        "partition_rows": partition_rows,
        "delta": [d.hex() for d in changes.delta_digests]}).encode()).hexdigest()
    left = staging.run_info() or {}  # what an interrupted run left
    if not (left.get("mode") == "incremental" and left.get("delta") == key
            and delta_file.exists()):
        staging.remove()
        staging.begin({"mode": "incremental", "run_fingerprint": fingerprint,
                       "job": job.to_dict(), "partition_rows": partition_rows,
                       "input_identity": [asdict(f) for f in run.identity],
                       "base_version": store.provenance.version, "delta": key})
        _write_delta(delta_file, changes, partition_rows)
    delta_job = replace(job, input=InputSpec(
        path=delta_file.address, text_column="text",
        id_column="digest", storage_options=job.output.storage_options))
    parts = plan_partitions(delta_job.input, partition_rows) if changes.encoded else []
    delta_fp = hashlib.sha256(f"{fingerprint}:{key}".encode()).hexdigest()
    return staging, delta_job, parts, delta_fp


def _write_delta(file: Location, changes: Changes, partition_rows: int) -> None:
    table = pa.table({"digest": pa.array([d.hex() for d in changes.delta_digests], pa.string()),
                      "text": pa.array(changes.delta_texts, pa.string())})
    with file.writer() as out:  # appears whole or not at all
        pq.write_table(table, out, row_group_size=max(partition_rows, 1), compression="zstd")


def _write_version(fmt: StoreFormat, version: int, assembly: Assembly, budget: int,
                   staging: Staging, path: str) -> dict[str, int]:
    """The new version written beside the current one (not yet published); its stats."""
    if fmt.writes_in_place:  # straight into the current arrays: nothing staged
        streamed, stats = streamed_version(assembly, budget)
        staging.confirm("write the new version")
        fmt.fence_writes(lambda: staging.confirm("write the new version"))
        fmt.write_streamed_version(version, streamed)
        return stats
    assembled = Staging(path, ASSEMBLED)
    assembled.remove_parts()
    layout, stats = assemble(assembly, assembled, budget)
    staging.confirm("write the new version")
    fmt.write_version(version, assembled, layout)
    return stats


def _commit(ctx: RunContext, store: StoreData, changes: Changes, staging: Staging,
            parts: list[Partition], totals: MarkerTotals, took_over_lock: str) -> Provenance:
    """Assemble and write the new version beside the current one, then publish it."""
    job = ctx.job
    fmt, path, current = store.fmt, store.path, store.provenance
    staging.confirm("commit")
    fmt.drop_retired()  # versions before the current one: their readers had a run's time
    version = current.version + 1
    has_chunks = "chunks" in job.output.levels
    indices = [p.index for p in parts]
    with staging.checked_reads(indices):  # the delta's parts are read here, once
        delta = Source.staged(staging, indices, has_chunks) if parts else None
        derived: Derived = {}
        for name, info in current.post.items():
            transform = load_transform(store, name)
            if transform is not None:
                derived[name] = (info.source, transform.apply)
        assembly = Assembly(job, changes, Source.of(store.docs, store.chunks), delta,
                            store.views, derived)
        relabelled = carried_changed(assembly)  # read before the version is written over
        stats = _write_version(fmt, version, assembly, ctx.plan.budget, staging, path)
    # the history entry of this run (its wall time up to the switch)
    record = run_record("incremental", version, ctx.started_at, ctx.identity, totals,
                        ctx.elapsed(), took_over_lock, rows=changes.rows, added=changes.added,
                        replaced=changes.replaced, unchanged=changes.unchanged,
                        gone=changes.gone, pruned=changes.pruned, encoded=changes.encoded,
                        copied=changes.copied, superseded=changes.superseded,
                        dropped=changes.dropped, carried_changed=relabelled)
    provenance = replace(
        current, run_fingerprint=ctx.fingerprint, job=job, model=ModelInfo(**ctx.model),
        versions=software_versions(totals),
        device=sorted(set(current.device) | set(totals.devices)),
        dtype=sorted(set(current.dtype) | set(totals.dtypes)),
        runtime=sorted(set(current.runtime) | set(totals.runtimes)),
        created=now_iso(), stats=dict(stats), complete=True, input_identity=ctx.identity,
        version=version, history=(*current.history, record))
    staging.confirm("publish the new version")
    fmt.publish(version, provenance)
    staging.remove()
    return provenance
