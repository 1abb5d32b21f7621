"""Every check a run makes before it writes, in one list: `extract` runs it, and `validate`
and `extract --dry-run` run the very same list and stop, so a job they accept is a job the
run accepts (up to what changes between the two: the input, the store, another run).

The list, in the order a run makes it (`CHECKS`):

1. options    the command's options against the job (--incremental with --overwrite,
              --prune without --incremental, the incremental key's own needs)
2. job        the model's config, tokenizer and weight files, the views against them, the
              device and runtime where the model runs here, the chunk budget, the input's
              Parquet footers and ids (`extract/preflight.py`), and the fingerprints
3. output     where the output may go: not the input, the job's folder or the working
              directory; a folder that can be made; a bucket that answers; a place the
              format writes to
4. lock       no live run holds the store
5. store      what the store at output.path allows: create, resume, replace (--overwrite),
              complete already, or (incremental) update a store made with the same model,
              views, chunking, dtype, levels and format
6. runtime    where `model.runtime: auto` keeps its decision: a cached one, or a folder it
              can write (measuring itself is the run's first work, not a check)

On a remote cluster the model runs on the workers, so the device and runtime are checked
there, when they load it: `Ready.left_to_workers` names what was left.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import JobError, StoreError
from ..extract.preflight import model_runs_here
from ..io.location import (
    Location,
    check_reachable,
    is_url,
    register_options,
    resolve,
    storage_errors,
)
from ..spec import Job, check_incremental
from ..stores.lock import StoreLock
from ..stores.ownership import inspect_output
from ..stores.provenance import Provenance, RuntimeChoice, is_complete
from ..stores.staging import Staging
from .output import Plan, assess, check_output_location

if TYPE_CHECKING:  # the run's context imports the executors: loaded when a check needs it
    from .context import RunContext


@dataclass(frozen=True)
class Asked:
    """A run as a command asks for it: the job and the options that change its checks."""

    job: Job
    job_file: str | Path | None = None
    overwrite: bool = False
    incremental: bool = False  # --incremental: as the job key output.incremental
    prune: bool = False


@dataclass
class Ready:
    """What the checks found: the job as it will run, its context, and what the run will
    do with the store (`create`, `resume`, `replace`, `complete`, `update` or `current`)."""

    job: Job
    ctx: RunContext | None = None
    action: str = ""
    store: tuple[str, Provenance] | None = None  # the complete store an update builds on
    left_to_workers: tuple[str, ...] = ()

    @property
    def context(self) -> RunContext:
        if self.ctx is None:  # the list's order: `job` comes before every check that asks
            raise RuntimeError("the job check has not run")
        return self.ctx


Check = Callable[[Asked, Ready], None]


def check_options(asked: Asked, ready: Ready) -> None:
    job = ready.job
    if asked.incremental or job.output.incremental:
        if asked.overwrite or job.output.overwrite:
            raise JobError("output.incremental: an incremental run adds to the store, "
                           "--overwrite replaces it; choose one")
        if not job.output.incremental:
            # why not through to_dict: that form is redacted (literal credentials -> ***)
            ready.job = replace(job, output=replace(job.output, incremental=True))
            check_incremental(ready.job)  # the job key's own checks (id column, token views)
        if not ready.job.input.id_column:
            raise JobError("output.incremental: needs input.id_column (rows are matched to "
                           "the store by id)")
        check_format_grows(ready.job)
    elif asked.prune:
        raise JobError("--prune: only with --incremental (or output.incremental: true)")


def resumed_choice(location: Location, ctx: RunContext) -> RuntimeChoice | None:
    """The runtime and dtype the interrupted run of this job began with, as it recorded
    them in its staging area, checked as a cached decision is (None when it recorded none,
    as an earlier bertpipe's run did). One that cannot run here is refused: the parts
    already written must not be finished with another runtime."""
    from ..extract.calibrate import candidates, checked_recorded  # why here: runtimes' table
    from ..extract.modelfiles import load_config

    info = Staging(location).run_info() or {}
    if info.get("run_fingerprint") != ctx.fingerprint or info.get("runtime_choice") is None:
        return None
    try:
        return checked_recorded(info["runtime_choice"],
                                candidates(ctx.job, load_config(ctx.job.model)))
    except ValueError as exc:
        raise StoreError(f"output.path: {location}: the interrupted run recorded the "
                         f"runtime it encodes with, and it cannot be used here ({exc}); its "
                         "parts must not be finished with another: resume where it runs, or "
                         "start again with --overwrite") from None


def check_format_grows(job: Job) -> None:
    """The job's format can be updated, there (the format says: `cannot_grow`,
    `cannot_grow_on_object_store`), else the formats that can are named."""
    from ..stores import formats  # why here: the formats import their libraries

    fmt, every = formats()[job.output.format], formats().items()
    if fmt.cannot_grow:
        growing = [name for name, other in every if not other.cannot_grow]
        raise JobError(f"output.incremental: {fmt.cannot_grow}; for a store that grows use "
                       f"output.format: {_either(growing)}")
    if is_url(job.output.path) and fmt.cannot_grow_on_object_store:
        there = [name for name, other in every
                 if not other.cannot_grow and not other.cannot_grow_on_object_store]
        raise JobError(f"output.incremental: {fmt.cannot_grow_on_object_store}; use "
                       f"output.format: {_either(there)}, or run the job in full (--overwrite)")


def _either(names: list[str]) -> str:
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def check_job(asked: Asked, ready: Ready) -> None:
    from .context import RunContext  # why here: it imports the executors (Dask)

    ready.ctx = RunContext.of(ready.job)
    if not model_runs_here(ready.job):
        ready.left_to_workers = ("model.device", "model.runtime")


def check_output(asked: Asked, ready: Ready) -> None:
    check_output_where(ready.job, asked.job_file)
    if is_url(ready.job.output.path):  # every format writes to a local folder
        from ..stores import format_named  # why here: a format imports its libraries

        format_named(ready.job.output.format).check_location(resolve(ready.job.output.path))


def check_lock(asked: Asked, ready: Ready) -> None:
    """The interval this run would refresh its lock at; a live run's lock, or a dead one
    another run is taking over (a dead one is taken over when the run takes the lock)."""
    lock = StoreLock(ready.job.output.path)  # reads BERTPIPE_LOCK_REFRESH_S
    if resolve(ready.job.output.path).exists():
        lock.check_free_to_take()


def check_store(asked: Asked, ready: Ready) -> None:
    ctx = ready.context
    if ready.job.output.incremental:
        ready.store = complete_store(ready.job)
        if ready.store is not None:
            path, current = ready.store
            check_compatible(ready.job, ctx.model, current, path)
            same = (current.input_identity == ctx.identity
                    and current.run_fingerprint == ctx.fingerprint)
            ready.action = "current" if same else "update"
            return
    ready.action = output_action(ctx, asked.overwrite or ready.job.output.overwrite)


def check_runtime_cache(asked: Asked, ready: Ready) -> None:
    """A run that will measure its runtime must be able to keep the decision (the store
    keeps what the cache cannot: refused before anything is made); a resume encodes with the
    runtime its run began with, which must run here."""
    if ready.action in ("complete", "current"):
        return  # nothing will be encoded
    if ready.action == "resume" and \
            resumed_choice(resolve(ready.job.output.path), ready.context) is not None:
        return
    from ..extract.calibrate import check_cache  # why here: it imports the runtimes' table

    ctx = ready.context
    job = ready.job if ready.store is None else _as_stored(ready.job, ready.store[1])
    check_cache(job, ctx.model["weights_sha256"])


CHECKS: tuple[Check, ...] = (check_options, check_job, check_output, check_lock, check_store,
                             check_runtime_cache)


def before_writing(asked: Asked) -> Ready:
    """Run every check of `CHECKS`, in order: the first that fails raises (a JobError,
    ModelError, InputError or StoreError naming the key, file or column); nothing is
    written. What the run would do is in the answer."""
    ready = Ready(asked.job)
    register_options(asked.job.output.path, asked.job.output.storage_options)
    with storage_errors(asked.job.output.path, "output.path", StoreError):
        for check in CHECKS:
            check(asked, ready)
    return ready


def check_output_where(job: Job, job_file: str | Path | None) -> None:
    """Not the input, the job's folder or the working directory; a folder that can be made;
    a bucket that exists and credentials it takes (before anything is made)."""
    register_options(job.output.path, job.output.storage_options)
    check_output_location(job, job_file)
    check_reachable(resolve(job.output.path), "output.path", StoreError)


def output_action(ctx: RunContext, overwrite: bool) -> str:
    """What a full run would do with `output.path`: create, replace, resume or complete;
    a StoreError where the run would refuse it (a file, a folder that is not a store, a
    store of another job or input)."""
    job = ctx.job
    plan = Plan(ctx.fingerprint, ctx.identity, job.execution.partition_rows)
    with storage_errors(job.output.path, "output.path", StoreError):
        return assess(job, plan, overwrite or job.output.overwrite)[0]


def complete_store(job: Job) -> tuple[str, Provenance] | None:
    """The complete store at output.path (as it is opened) and its provenance, or None when
    the job must run in full (no store, or one the full run resumes, refuses or replaces by
    its own rules). Read only: only the provenance is read."""
    from ..stores import store_at  # why here: the formats import zarr and the stores' kit
    from ..stores.opened import store_name

    path = job.output.path
    contents = inspect_output(path)
    if contents.state != "store":
        return None
    fmt = store_at(path, contents.format or job.output.format)
    raw = fmt.record()
    if raw is None or not is_complete(raw) or not raw.get("job"):
        return None
    fmt.refuse_foreign_commits()  # another tool's commit is never built on (nor undone)
    opened = store_name(path)
    return opened, Provenance.from_dict(raw, opened)


def check_compatible(job: Job, model: dict[str, Any], current: Provenance, path: str) -> None:
    """The store's vectors are what this job would compute: same model weights, views,
    chunking, dtype, levels and format."""
    before, now = current.job.vector_parts(), job.vector_parts()
    changed = [key for key in now if before.get(key) != now[key]]
    if changed:
        raise StoreError(f"output.path: {path} was made with other {', '.join(changed)} than "
                         "this job; its vectors would not match new ones, so it cannot be "
                         "updated incrementally: a full run is needed (--overwrite)")
    if current.model.weights_sha256 != model["weights_sha256"]:
        raise StoreError(f"output.path: {path} was made with other model weights than "
                         f"{job.model.path}; its vectors would not match new ones, so it "
                         "cannot be updated incrementally: a full run is needed (--overwrite)")


def _as_stored(job: Job, current: Provenance) -> Job:
    """An update encodes with the runtime and dtype its store was made with: no decision."""
    choice = current.runtime_choice
    if choice is None:
        return job
    return replace(job, model=replace(job.model, runtime=choice.runtime, dtype=choice.dtype))
