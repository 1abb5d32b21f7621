"""Command line: parse, call, report. Domain errors become one line and an exit code."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from .errors import BertpipeError

F = TypeVar("F", bound=Callable[..., Any])


def _user_errors(fn: F) -> F:
    """Turn a BertpipeError into `error: <message>` on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BertpipeError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper  # type: ignore[return-value]


@click.group()
@click.version_option(package_name="bertpipe")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def main(verbose: bool) -> None:
    """bertpipe: fixed-size vectors from BERT-family encoders, from Parquet text tables."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                          help="Override a job key, e.g. --set output.path=out/x.zarr.")


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@set_option
@_user_errors
def validate(job_file: str, overrides: tuple[str, ...]) -> None:
    """Check a job file without running it."""
    from .spec import load_job

    job = load_job(job_file, overrides)
    click.echo(f"{job_file}: valid ({len(job.views)} views: "
               f"{', '.join(v.name for v in job.views)}; output {job.output.format} "
               f"{job.output.path})")


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@set_option
@click.option("--overwrite", is_flag=True, help="Replace an existing store of another job.")
@click.option("--scheduler", default=None, envvar="DASK_SCHEDULER_ADDRESS",
              help="local | synchronous | tcp://host:port (overrides execution.scheduler).")
@_user_errors
def extract(job_file: str, overrides: tuple[str, ...], overwrite: bool,
            scheduler: str | None) -> None:
    """Run a job: read text, encode, pool, write the store."""
    from .progress import Progress
    from .runner import executor_for, run_job
    from .spec import load_job

    if scheduler:
        overrides = (*overrides, f"execution.scheduler={scheduler}")
    job = load_job(job_file, overrides)
    with Progress() as progress:
        summary = run_job(job, executor=executor_for(job, say=progress.message),
                          on_done=progress.partition_done, overwrite=overwrite,
                          on_plan=progress.start)
    click.echo(summary.line())
    if not summary.already_complete:
        click.echo(f"wrote {job.output.path}")


@main.command()
@click.argument("store_path", type=click.Path())
@_user_errors
def inspect(store_path: str) -> None:
    """Summarise a store: rows, views, coverage, chunks, provenance."""
    from .inspect import describe
    from .load import open_store

    click.echo(describe(open_store(store_path)))


if __name__ == "__main__":
    main()
