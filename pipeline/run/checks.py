"""What `validate` and `extract --dry-run` check of a job, read only: everything a run
checks before it writes. `check_output_where` is the runner's own check of the output
path, so the two cannot drift apart."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StoreError
from ..extract.preflight import Plan as Checked
from ..extract.preflight import preflight
from ..io.location import check_reachable, register_options, resolve, storage_errors
from ..spec import Job
from .output import Plan, assess, check_output_location

if TYPE_CHECKING:  # the run's context imports the executors and torch: not for validate
    from .context import RunContext


def check_job(job: Job, job_file: str | Path | None) -> Checked:
    """The model, views, device and runtime, the input (footers and ids), and where the
    output may go (`check_output_where`)."""
    checked = preflight(job)
    check_output_where(job, job_file)
    return checked


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
