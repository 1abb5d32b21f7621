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


# Every exit code, for `bertpipe --help` (docs/exit-codes.md has the same table).
EXIT_CODES = """\b
Exit codes:
  0  success
  1  any other error
  2  job file invalid (JobError: the message names the key)
  3  input table or probe labels unusable (InputError, ProbeError: names the file,
     column or row)
  4  model cannot be loaded or lacks what a view needs (ModelError)
  5  store missing, incomplete, damaged, of another job or newer format (StoreError)
  6  partitions failed; the others are kept for a rerun (PartitionError)
  7  scheduler unreachable (SchedulerError)"""


@click.group(epilog=EXIT_CODES)
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
    from .run.progress import Progress
    from .run.runner import executor_for, run_job
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
@click.option("--geometry", is_flag=True, help="Anisotropy per view, before and after each "
              "fix (center, whiten, all-but-the-top).")
@click.option("--sample", default=2000, show_default=True, help="Random pairs for the mean "
              "cosine (fixed seed).")
@_user_errors
def inspect(store_path: str, geometry: bool, sample: int) -> None:
    """Summarise a store: rows, views, coverage, chunks, provenance."""
    from .analysis.inspect import describe, describe_geometry
    from .api import open_store

    store = open_store(store_path)
    click.echo(describe(store))
    if geometry:
        click.echo(describe_geometry(store, pairs=sample))


@main.command()
@click.argument("store_path", type=click.Path())
@_user_errors
def verify(store_path: str) -> None:
    """Check a store: checksums, rows, views.

    Recomputes the checksum of every file the store recorded when it was completed, and
    checks the complete flag, the rows of every array or file, and that every view is
    stored. Prints one OK line, or exits 5 naming each array or file that is wrong."""
    from .stores.verify import verified

    click.echo(verified(store_path).line())


@main.command()
@click.argument("store_path", type=click.Path())
@click.option("--view", required=True, help="The view to fit on.")
@click.option("--method", required=True, type=click.Choice(["center", "whiten", "abtt"]))
@click.option("--dims", type=int, default=None, help="whiten: keep this many dimensions.")
@click.option("-d", "top", type=int, default=1, show_default=True,
              help="abtt: principal directions to remove.")
@click.option("--normalize", is_flag=True, help="L2-normalise after the transform.")
@click.option("--name", default=None, help="Name of the new view (default VIEW_METHOD).")
@_user_errors
def postprocess(store_path: str, view: str, method: str, dims: int | None, top: int,
                normalize: bool, name: str | None) -> None:
    """Fit a geometry fix on a view and write the result as a new view of the store."""
    from .post.apply import postprocess as run
    from .spec import PostSpec

    spec = PostSpec(method=method, dims=dims, d=top, normalize=normalize)
    target = run(store_path, view, spec, name=name)
    click.echo(f"wrote view {target!r} ({method} of {view!r}) to {store_path}")


@main.command()
@click.argument("store_path", type=click.Path())
@click.argument("query", nargs=-1, required=True)
@click.option("--view", default=None, help="View to search (default: the first).")
@click.option("-k", default=10, show_default=True)
@click.option("--chunks", "level", flag_value="chunks", default="docs",
              help="Search chunk vectors instead of documents.")
@click.option("--exact", is_flag=True, help="Scan the store even when an index exists.")
@_user_errors
def search(store_path: str, query: tuple[str, ...], view: str | None, k: int,
           level: str, exact: bool) -> None:
    """Top-k rows of a store for a query text (exact cosine search)."""
    from .analysis.search import search as run
    from .analysis.search import snippet
    from .api import open_store

    store = open_store(store_path)
    text = " ".join(query)
    for rank, hit in enumerate(run(store, [text], view, k, level, exact)[0], 1):
        where = f" chunk {hit.chunk} [{hit.span[0]}:{hit.span[1]}]" if hit.span else ""
        click.echo(f"{rank:>3}. {hit.score:.4f}  id {hit.id}{where}  {snippet(store, hit)}")


@main.command()
@click.argument("store_path", type=click.Path())
@click.option("--label", required=True, help="Label column: a carried column of the store, "
              "or a column of --labels.")
@click.option("--labels", "labels_file", type=click.Path(dir_okay=False), default=None,
              help="A Parquet file of labels, joined to the store on ids.")
@click.option("--label-column", default=None, help="Label column in --labels (default --label).")
@click.option("--id-column", default="id", show_default=True, help="Id column in --labels.")
@click.option("--views", "view_names", default=None,
              help="Comma-separated views to probe (default: all).")
@click.option("--layers", is_flag=True, help="Report single-layer views as a layer x pooling "
              "grid (a sweep store, e.g. from jobs/sweep.yaml).")
@click.option("--scalar-mix", "scalar_mix", default=None, metavar="POOLING",
              help="Also learn an ELMo scalar mix over the single-layer views with this pooling.")
@click.option("--folds", default=5, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Where probe.json, probe.html and probe.png go (default STORE-probe/).")
@_user_errors
def probe(store_path: str, label: str, labels_file: str | None, label_column: str | None,
          id_column: str, view_names: str | None, layers: bool, scalar_mix: str | None,
          folds: int, seed: int, out_dir: str | None) -> None:
    """Linear probes of every view: which layer and pooling carry the label?"""
    from .analysis.probe import load_labels, run_probe
    from .analysis.report import table, write_outputs
    from .api import open_store

    store = open_store(store_path)
    labels = load_labels(store, label_column or label, labels_file, id_column).rename(label)
    views = view_names.split(",") if view_names else None
    if layers:
        from .analysis.probe import single_layer_views

        views = single_layer_views(store, views)
    report = run_probe(store, labels, views, folds=folds, seed=seed, scalar_mix=scalar_mix)
    click.echo(table(report))
    paths = write_outputs(report, out_dir or f"{store_path.rstrip('/')}-probe")
    click.echo(f"wrote {paths['json']}, {paths['html']}")


@main.command()
@click.argument("store_path", type=click.Path())
@click.option("--view", required=True, help="The view to index.")
@click.option("--chunks", "level", flag_value="chunks", default="docs",
              help="Index chunk vectors instead of documents.")
@click.option("--nprobe", default=16, show_default=True, help="Lists scanned per query.")
@_user_errors
def index(store_path: str, view: str, level: str, nprobe: int) -> None:
    """Build an approximate nearest-neighbour index (FAISS) beside the store."""
    from .analysis.index import build_index
    from .api import open_store

    path = build_index(open_store(store_path), view, level, nprobe=nprobe)
    click.echo(f"wrote {path}; bertpipe search uses it (--exact to scan instead)")


if __name__ == "__main__":
    main()
