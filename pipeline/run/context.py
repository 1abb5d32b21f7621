"""What every run computes once before it touches a store, and the one loop over partitions.

A full run and an incremental run differ only in what they plan (the whole input, or the
texts that changed) and how they commit (a new store, or a new version). Everything else
is here: `RunContext` (the checked plan, the input's identity, the model's fingerprint and
the run fingerprint reused markers must carry, each computed once), and `run_partitions`
(reuse what a killed run left, run the rest on an executor, stop if another run took the
lock over, and say which partitions failed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import BertpipeError, PartitionError, UnreadableInputError
from ..extract.modelfiles import model_fingerprint
from ..extract.preflight import Plan as CheckedPlan
from ..extract.preflight import preflight
from ..extract.source import Partition, RowGroupCache, input_identity, read_partition
from ..spec import Job
from ..stores import Staging
from ..stores.markers import PartitionMarker
from ..stores.provenance import InputFile, RuntimeChoice
from .executors import Executor
from .output import OutputSession
from .partition_pipeline import Failures, OnDone
from .record import OnPlan, RunSummary, collect, now_iso

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunContext:
    """A run's job and what was computed of it once: the checked plan (model config,
    views, partitions), the input's identity, the model's weights digest and the run
    fingerprint, with when the run started."""

    job: Job
    plan: CheckedPlan
    identity: tuple[InputFile, ...]
    model: dict[str, Any]
    fingerprint: str
    started: float = field(default_factory=time.perf_counter)  # for wall times
    started_at: str = field(default_factory=now_iso)  # for the history

    @classmethod
    def of(cls, job: Job) -> RunContext:
        """Check the job (nothing is written) and fingerprint its input and model."""
        started = time.perf_counter()
        plan = preflight(job)
        model = model_fingerprint(job.model.path)  # the weights are hashed here only
        return cls(job, plan, input_identity(job.input), model, run_fingerprint(job, model),
                   started)

    @property
    def parts(self) -> list[Partition]:
        return self.plan.partitions

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def decide_runtime(ctx: RunContext, force: bool = False,
                   say: Callable[[str], None] = log.info) -> RuntimeChoice | None:
    """The runtime and dtype this run's workers use (extract/calibrate.py): decided once,
    here on the client, so every worker runs the same and a store never mixes them. `say`:
    what a measurement does and how long it takes (so a first run is not silent there)."""
    from ..extract.calibrate import decide  # why here: dry runs and validate never measure

    return decide(ctx.job, ctx.model["weights_sha256"], lambda: sample_texts(ctx), force,
                  say=say)


def sample_texts(ctx: RunContext, chars: int = 200_000) -> list[str | None]:
    """The input's first texts, partition by partition, up to about `chars` characters
    (more than calibration's few batches need, at ~4 characters a token)."""
    texts: list[str | None] = []
    row_groups = RowGroupCache()
    for part in ctx.parts:
        texts += read_partition(ctx.job.input, part, row_groups).texts
        if sum(len(t or "") for t in texts) >= chars:
            break
    return texts


def with_choice(job: Job, choice: RuntimeChoice | None) -> Job:
    """The job as the workers run it: runtime and dtype as decided (unchanged if None)."""
    if choice is None:
        return job
    return replace(job, model=replace(job.model, runtime=choice.runtime, dtype=choice.dtype))


def run_fingerprint(job: Job, model: dict[str, Any]) -> str:
    """What must match for a rerun to reuse parts: the job's content and the weights."""
    blob = json.dumps({"job": job.fingerprint(), "weights": model["weights_sha256"]},
                      sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def reusable(marker: PartitionMarker, parts: Sequence[Partition]) -> bool:
    """A marker stands for a planned partition: same index, row range and input file."""
    if not 0 <= marker.index < len(parts):
        return False
    part = parts[marker.index]
    return marker.rows == (part.row_start, part.row_stop) and \
        marker.input == part.footer_sha256


@dataclass(frozen=True)
class PartitionWork:
    """Partitions to run for one staging area: `job` is what the executor encodes (the
    run's job, or an incremental run's delta), `fingerprint` what markers carry, `label`
    how the partitions are named in messages and `describe` names one of them."""

    job: Job
    parts: Sequence[Partition]
    staging: Staging
    fingerprint: str
    label: str = "partitions"
    describe: Callable[[Partition], str] = lambda p: f"partition {p.index}"
    unchanged: str = ""  # what a failure leaves as it was, said in its message


def run_partitions(work: PartitionWork, executor: Executor, output: OutputSession,
                   summary: RunSummary, on_done: OnDone | None = None,
                   on_plan: OnPlan | None = None
                   ) -> tuple[list[PartitionMarker], list[PartitionMarker]]:
    """Every partition's marker, in order, and those encoded by this run: a marker is
    reused when a killed run left it intact and it matches the plan, else encoded now.
    PartitionError (exit 6) names the failed ones, the others are kept for a rerun;
    LockLostError (exit 5) when another run took over."""
    parts = work.parts
    done = {i: m for i, m in work.staging.done(work.fingerprint).items()
            if reusable(m, parts)}
    pending = [p for p in parts if p.index not in done]
    summary.partitions = len(parts)
    summary.skipped = len(parts) - len(pending)
    if on_plan:
        on_plan(parts, pending)
    failures = executor.run(work.job, pending, work.staging, work.fingerprint,
                            collect(done, on_done, summary))
    output.confirm("commit")  # fencing: a run taken over while paused stops here
    summary.run = len(pending) - len(failures)
    summary.failed = [f"{work.describe(p)}: {msg}" for p, msg in failures]
    if failures:
        raise _failed(work, failures, summary.failed[0])
    return [done[p.index] for p in parts], [done[p.index] for p in pending]


def _failed(work: PartitionWork, failures: Failures, first: str) -> BertpipeError:
    """The run's error for its failed partitions (`first`: the first, as described): the
    input's (exit 3) when part of the input cannot be read, since a rerun would fail alike
    until the file is replaced; else a PartitionError (exit 6: worth a rerun)."""
    total = len(work.parts)
    unreadable = [error for _, error in failures if isinstance(error, UnreadableInputError)]
    if unreadable:
        return UnreadableInputError(
            f"{unreadable[0]}; {len(failures)} of {total} {work.label} failed, the others are "
            "kept: replace or repair the file, then rerun (finished partitions are skipped)")
    return PartitionError(f"{len(failures)} of {total} {work.label} failed, the others are "
                          f"kept for a rerun{work.unchanged}; first: {first}")
