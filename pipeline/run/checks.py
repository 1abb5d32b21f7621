"""What `validate` and `extract --dry-run` check of a job, read only: everything a run
checks before it writes (`runner.full_run` applies the same rules, in the same order)."""

from __future__ import annotations

from pathlib import Path

from ..errors import StoreError
from ..extract.model import model_fingerprint
from ..extract.preflight import Plan as Checked
from ..extract.preflight import preflight
from ..extract.source import input_identity
from ..io.location import check_reachable, register_options, resolve, storage_errors
from ..spec import Job
from .context import run_fingerprint
from .output import Plan, assess, check_output_location


def check_job(job: Job, job_file: str | Path | None) -> Checked:
    """The model, views, device and runtime, the input (footers and ids), and where the
    output may go (not the input, the job's folder or the working directory; a folder
    that can be made; a bucket that exists)."""
    checked = preflight(job)
    register_options(job.output.path, job.output.storage_options)
    check_output_location(job, job_file)
    check_reachable(resolve(job.output.path), "output.path", StoreError)
    return checked


def output_action(job: Job, overwrite: bool) -> str:
    """What a full run would do with `output.path`: create, replace, resume or complete;
    a StoreError where the run would refuse it (a file, a folder that is not a store, a
    store of another job or input)."""
    identity = input_identity(job.input)
    fingerprint = run_fingerprint(job, model_fingerprint(job.model.path))
    plan = Plan(fingerprint, identity, job.execution.partition_rows)
    with storage_errors(job.output.path, "output.path", StoreError):
        return assess(job, plan, overwrite or job.output.overwrite)[0]
