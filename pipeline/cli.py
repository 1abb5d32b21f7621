"""Command line: parse, call, report. Domain errors become one line and an exit code."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from .errors import BertpipeError, JobError, OptionError, StoreError
from .io.location import is_url, storage_errors

F = TypeVar("F", bound=Callable[..., Any])


def _user_errors(fn: F) -> F:
    """Turn a BertpipeError into `error: <message>` on stderr and its exit code; for a
    command on a store (`store_path`) given as a URL, a store that cannot be reached or
    refuses the credentials too."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            store = kwargs.get("store_path")
            if isinstance(store, str) and is_url(store):

                with storage_errors(store, "store", StoreError):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        except BertpipeError as exc:
            code, message = exc.exit_code, str(exc)
        # why outside the except block: exiting inside it would keep the error's frames
        # (open stores, Icechunk sessions) alive into interpreter shutdown, where dropping
        # Icechunk's native objects can abort the process after its one line was printed
        click.echo(f"error: {_scrubbed(message)}", err=True)
        sys.exit(code)

    return wrapper  # type: ignore[return-value]


def _scrubbed(text: str) -> str:
    """A message without any secret of the storage options or the environment."""
    from .io.location import scrub

    return scrub(text)


class OneLineGroup(click.Group):
    """Click's own usage errors (a bad option value, a missing argument) as one line
    `error: <message>` with exit 2, like every other error (click prints four lines)."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        """Every command takes -q/-v after its name too, last in its --help."""
        cmd.params.extend(verbosity_options())
        super().add_command(cmd, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """As the `bertpipe` program: its exit handlers run and its output flushed, the
        process leaves without the interpreter's teardown. Icechunk's native threads outlive a
        command that ended soon after it opened a repository (a refusal on open), and the
        teardown then aborted the process now and then (SIGABRT, SIGBUS) after its one line
        was printed. (Tests call `main`, not the program, and keep the teardown.)"""
        try:
            return self.main(*args, **kwargs)
        except SystemExit as exc:
            code = exc.code
        _leave(code if isinstance(code, int) else 0 if code is None else 1)

    def main(self, args: Any = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()  # no arguments at all: the help, as click shows it
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            where = getattr(getattr(exc, "ctx", None), "command_path", None)
            hint = f" (see {where} --help)" if isinstance(exc, click.UsageError) and where \
                else ""
            click.echo(f"error: {exc.format_message()}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _leave(code: int) -> None:
    """End the program with `code` once everything it wrote is out and every exit handler
    has run (logging's, zarr's, a plugin's): only the interpreter's teardown of its
    objects is skipped (see OneLineGroup)."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing more to say there
            stream.flush()
    os._exit(code)


# Every exit code, for `bertpipe --help` (docs/exit-codes.md has the same table).
EXIT_CODES = """\b
Exit codes:
  0  success
  1  any other error
  2  job file or option invalid (JobError, OptionError: names the key or option)
  3  input table or probe labels unusable (InputError, UnreadableInputError,
     ProbeError: names the file, column or row)
  4  model cannot be loaded or lacks what a view needs (ModelError)
  5  store missing, incomplete, damaged, of another job or newer format, or locked by
     a live run (StoreError); this run's lock taken over while it was paused
     (LockLostError)
  6  partitions failed; the others are kept for a rerun (PartitionError)
  7  scheduler unreachable (SchedulerError)
  8  object store unreachable: endpoint refused, unknown or silent (EndpointError)"""


@click.group(cls=OneLineGroup, epilog=EXIT_CODES)
@click.version_option(package_name="bertpipe")
@click.option("-v", "--verbose", is_flag=True, help="Log details (model loading, Dask).")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines; errors and the result "
              "still print.")
@click.pass_context
def main(ctx: click.Context, verbose: bool, quiet: bool) -> None:
    """bertpipe: fixed-size vectors from BERT-family encoders, from Parquet text tables.

    \b
    Start with:
      bertpipe validate jobs/reviews.yaml
      bertpipe extract jobs/reviews.yaml
      bertpipe inspect out/reviews.zarr
    Shell completion (bash; zsh and fish alike):
      eval "$(_BERTPIPE_COMPLETE=bash_source bertpipe)"
    """
    ctx.obj = {"quiet": quiet}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # before any command imports torch: OpenMP reads how idle threads wait when it loads
    from .extract.threads import quiet_waits

    quiet_waits()
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for chatty in ("botocore", "boto3", "aiobotocore", "s3fs", "fsspec", "urllib3"):
        # their debug lines name access key ids and request signatures: never shown
        logging.getLogger(chatty).setLevel(logging.WARNING)


def _quiet_after(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_root().ensure_object(dict)["quiet"] = True


def _verbose_after(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:  # the group's callback has run by now: raise the level it set
        logging.getLogger().setLevel(logging.INFO)


def verbosity_options() -> list[click.Option]:
    """-q/-v after the command too (`bertpipe extract -q job.yaml`), as before it."""
    return [click.Option(["-q", "--quiet"], is_flag=True, expose_value=False,
                         callback=_quiet_after, help="As bertpipe -q: no progress lines."),
            click.Option(["-v", "--verbose"], is_flag=True, expose_value=False,
                         callback=_verbose_after, help="As bertpipe -v: log details.")]


def _quiet() -> bool:
    return bool((click.get_current_context().find_root().obj or {}).get("quiet"))


set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                          help="Override a job key, e.g. --set output.path=out/x.zarr.")


overwrite_option = click.option(
    "--overwrite", is_flag=True, help="Replace the bertpipe store at output.path (never "
    "anything that is not a bertpipe store).")
scheduler_option = click.option(
    "--scheduler", default=None, envvar="DASK_SCHEDULER_ADDRESS",
    help="local | synchronous | tcp://host:port (overrides execution.scheduler).")
incremental_option = click.option(
    "--incremental", is_flag=True, help="Update the existing store: encode only rows with new "
    "ids or changed texts (as output.incremental: true).")
prune_option = click.option(
    "--prune", is_flag=True, help="With --incremental: remove rows whose ids are gone from "
    "the input (by default they are kept, present=false).")


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@set_option
@overwrite_option
@scheduler_option
@incremental_option
@prune_option
@click.option("--schema-only", is_flag=True, help="Check the file alone: skip the model "
              "config and the input's Parquet metadata (e.g. where they are not mounted).")
@_user_errors
def validate(job_file: str, overrides: tuple[str, ...], overwrite: bool, scheduler: str | None,
             incremental: bool, prune: bool, schema_only: bool) -> None:
    """Check a job without running it: every check `extract` makes before it writes (the
    file, the model's config, tokenizer and weight files, the device and runtime, the
    input's Parquet metadata, the output path, the store's lock and state, the runtime
    cache), with the same options. Loads no weights, reads no rows, writes nothing.

    \b
    Examples:
      bertpipe validate jobs/reviews.yaml
      bertpipe validate jobs/nightly.yaml --incremental
      bertpipe validate jobs/reviews.yaml --set model.path=models/other
      bertpipe validate jobs/cluster.yaml --schema-only   # where model and data are not mounted
    """
    from .spec import load_job

    job = load_job(job_file, _with_options(overrides, scheduler, incremental))
    _check_prune(prune, job)
    ready = None if schema_only else _ready(job, job_file, overwrite, prune)
    # "valid" only once every check has passed: a script may stop reading at that word
    click.echo(f"{job_file}: valid ({len(job.views)} views: "
               f"{', '.join(v.name for v in job.views)}; output {job.output.format} "
               f"{job.output.path})")
    if ready is None:
        click.echo("checked the job file alone (--schema-only): the model, the input and the "
                   "output were not checked")
        return
    click.echo(f"checked {ready.context.plan.summary()}; would {_action(ready)}")
    if ready.left_to_workers:
        click.echo(f"left to the workers (the model runs there): "
                   f"{', '.join(ready.left_to_workers)}")


def _with_options(overrides: tuple[str, ...], scheduler: str | None,
                  incremental: bool) -> tuple[str, ...]:
    """The command's options as job keys, so that the job's own checks see them too."""
    if scheduler:
        overrides = (*overrides, f"execution.scheduler={scheduler}")
    return (*overrides, "output.incremental=true") if incremental else overrides


def _check_prune(prune: bool, job: Any) -> None:
    if prune and not job.output.incremental:
        raise click.BadParameter("only with --incremental (or output.incremental: true)",
                                 param_hint="'--prune'")


def _ready(job: Any, job_file: str, overwrite: bool, prune: bool) -> Any:
    """Every check `extract` makes before it writes (run/checks.py), read only."""
    from .run.checks import Asked, before_writing

    return before_writing(Asked(job, job_file, overwrite, prune=prune))


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@set_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the "
              "table (runtime, dtype, by, table, cache).")
@_user_errors
def calibrate(job_file: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Measure which runtime and dtype run this job fastest on this machine while agreeing
    with torch float32 (what model.runtime/dtype: auto choose), and cache the choice.

    Times each candidate the job leaves open (torch and openvino, float32 and bfloat16 where
    the CPU has it) on a few batches of the job's own texts, ignoring and refreshing the
    cache ($BERTPIPE_CACHE_DIR, default ~/.cache/bertpipe). Writes no store.

    \b
    Examples:
      bertpipe calibrate jobs/reviews.yaml
      bertpipe calibrate jobs/reviews.yaml --json | jq .table
    """
    from .extract.calibrate import calibration_dir
    from .run.context import RunContext, decide_runtime
    from .spec import load_job

    ctx = RunContext.of(load_job(job_file, overrides))
    quiet = _quiet()
    choice = decide_runtime(ctx, force=True,
                            say=lambda text: None if quiet else click.echo(text, err=True))
    if choice is None:
        raise JobError("model.device: the job runs on a GPU here; calibration chooses "
                       "between CPU runtimes")
    if as_json:
        from dataclasses import asdict

        click.echo(json.dumps({**asdict(choice), "cache": str(calibration_dir())}, indent=1))
        return
    click.echo(f"{'candidate':<18} {'tokens/s':>9}  {'min cosine':>10}  chosen")
    for row in choice.table:
        speed = f"{row.tokens_per_s:9,.0f}" if row.tokens_per_s else f"{'-':>9}"
        cosine = f"{row.min_cosine:10.6f}" if row.tokens_per_s else f"{'-':>10}"
        mark = "*" if row.chosen else (f"out: {row.note}" if not row.agrees else "")
        click.echo(f"{row.runtime + ' ' + row.dtype:<18} {speed}  {cosine}  {mark}")
    click.echo(f"chosen: runtime {choice.runtime}, dtype {choice.dtype} (cached in "
               f"{calibration_dir()})")


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@set_option
@overwrite_option
@scheduler_option
@click.option("--dry-run", is_flag=True, help="Check the job and print the plan (model, "
              "views, files, rows, partitions, output); create and write nothing.")
@click.option("--json-summary", "summary_file", default=None, type=click.Path(dir_okay=False),
              help="Also write the run's summary as JSON to this file, at the end, on "
              "success and on failure (schemas/run-summary.schema.json); never the job "
              "file, the input, the model or a path inside the store.")
@incremental_option
@prune_option
@_user_errors
def extract(job_file: str, overrides: tuple[str, ...], overwrite: bool,
            scheduler: str | None, dry_run: bool, summary_file: str | None,
            incremental: bool, prune: bool) -> None:
    """Run a job: read text, encode, pool, write the store.

    \b
    Examples:
      bertpipe extract jobs/reviews.yaml
      bertpipe extract jobs/reviews.yaml --set output.path=out/x.zarr --set model.dtype=float32
      bertpipe extract jobs/reviews.yaml --dry-run
      bertpipe extract jobs/cluster.yaml --scheduler tcp://scheduler:8786 --json-summary run.json
      bertpipe extract jobs/reviews.yaml --incremental --prune
    """
    if summary_file is None:
        _extract(job_file, overrides, overwrite, scheduler, dry_run, None, incremental, prune)
        return
    from .run.runner import RunSummary
    from .run.summary_file import SummaryFile

    target = SummaryFile(summary_file, job_file)  # refused now, before the run, if unsafe
    summary = RunSummary("")
    try:
        _extract(job_file, overrides, overwrite, scheduler, dry_run, summary, incremental,
                 prune, target)
    except BertpipeError as exc:
        if target.may_write():
            target.write(_summary_doc(summary, exc))
        raise
    target.write(_summary_doc(summary, None))


ACTIONS = {"create": "create the store", "replace": "replace the store (--overwrite)",
           "resume": "resume the interrupted run in the store",
           "complete": "do nothing: the store is complete for this job and input",
           "update": "update the store with the input's new and changed rows",
           "current": "do nothing: the store is up to date with this input"}


def _action(ready: Any) -> str:
    return ACTIONS[ready.action]


def _summary_doc(summary: Any, error: BertpipeError | None) -> dict[str, Any]:
    """The run's JSON summary with its exit code and what that code means."""
    return {**summary.to_dict(), "exit_code": error.exit_code if error else 0,
            "meaning": (type(error).__doc__ or "").strip().splitlines()[0] if error else "ok",
            "error": _scrubbed(str(error)) if error else None}


def _extract(job_file: str, overrides: tuple[str, ...], overwrite: bool, scheduler: str | None,
             dry_run: bool, summary: Any, incremental: bool, prune: bool = False,
             target: Any = None) -> None:
    from .spec import load_job

    job = load_job(job_file, _with_options(overrides, scheduler, incremental))
    if target is not None:
        target.check_job(job)
    _check_prune(prune, job)
    if dry_run:
        ready = _ready(job, job_file, overwrite, prune)  # as the run checks
        click.echo(ready.context.plan.describe())
        click.echo(f"would      {_action(ready)}")
        if ready.left_to_workers:
            click.echo(f"left to    the workers (the model runs there): "
                       f"{', '.join(ready.left_to_workers)}")
        click.echo("dry run: nothing was created or written")
        return
    from .run.progress import Progress
    from .run.runner import executor_for, run_job

    with Progress(quiet=_quiet()) as progress, _terminate_as_exit():
        if summary is not None:
            summary.path = job.output.path
        executor = executor_for(job, say=progress.message, on_batch=progress.batch_done)
        summary = run_job(job, executor=executor,
                          on_done=progress.partition_done, overwrite=overwrite,
                          on_plan=progress.start, job_file=job_file, summary=summary,
                          prune=prune, say=progress.message)
    click.echo(summary.line())
    if not summary.already_complete:
        click.echo(f"wrote {job.output.path}")


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM (a scheduler stopping the job) unwinds like Ctrl-C, so the store's lock is
    released and finished partitions are kept for a rerun."""
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@main.command()
@click.argument("store_path", type=click.Path())
@_user_errors
def unlock(store_path: str) -> None:
    """Remove a stale lock left by a run that died (never the lock of a running process).

    \b
    Example:
      bertpipe unlock out/reviews.zarr
    """
    from .io.location import resolve
    from .stores.lock import StoreLock
    from .stores.ownership import inspect_output

    if not resolve(store_path).exists():  # a mistyped path must not read as "not locked"
        raise StoreError(f"{store_path}: no such store")
    contents = inspect_output(store_path)
    if contents.state == "file" or contents.state == "foreign":  # nor a wrong folder
        held = f" (it holds {contents.describe_foreign()})" if contents.foreign else ""
        raise StoreError(f"{store_path}: not a bertpipe store{held}; nothing to unlock")
    lock = StoreLock(store_path if is_url(store_path) else os.path.realpath(store_path))
    holder = lock.holder()
    if holder is None:
        click.echo(f"{store_path}: not locked")
        return
    if lock.live_here(holder):
        raise StoreError(f"{store_path}: locked by pid {holder.get('pid')}, which is still "
                         "running on this host; stop that run first")
    lock.force_remove()
    click.echo(f"{store_path}: removed the lock of pid {holder.get('pid', '?')} on host "
               f"{holder.get('host', '?')} (since {holder.get('started', '?')})")


@main.command()
@click.argument("store_path", type=click.Path())
@click.option("--geometry", is_flag=True, help="Anisotropy per view, before and after each "
              "fix (center, whiten, all-but-the-top).")
@click.option("--sample", default=2000, show_default=True, type=click.IntRange(min=1),
              help="Random pairs for the mean cosine (fixed seed).")
@click.option("--against", "other_path", default=None, type=click.Path(),
              help="Another store whose vocabulary fit is shown side by side.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text "
              "(schemas/inspect.schema.json).")
@_user_errors
def inspect(store_path: str, geometry: bool, sample: int, other_path: str | None,
            as_json: bool) -> None:
    """Summarise a store: rows, views, coverage, chunks, vocabulary fit, provenance.

    \b
    Examples:
      bertpipe inspect out/reviews.zarr
      bertpipe inspect out/reviews.zarr --geometry
      bertpipe inspect out/reviews.zarr --against out/general.zarr
      bertpipe inspect out/reviews.zarr --json | jq .coverage
    """
    import dask
    import dask.threaded

    # this process has no Dask client: say so, rather than let the first read import
    # distributed to look for one (0.3-0.6 s of a command meant to answer at once)
    with dask.config.set(scheduler=dask.threaded.get):
        _inspect(store_path, geometry, sample, other_path, as_json)


def _inspect(store_path: str, geometry: bool, sample: int, other_path: str | None,
             as_json: bool) -> None:
    from .analysis.inspect import describe, describe_geometry, geometry_rows, store_facts
    from .analysis.vocabulary import describe_vocabulary, vocabulary_fit
    from .api import open_store

    # whole columns read once: xarray's own lazy reads, without importing dask.array
    store = open_store(store_path, dask=False)
    other = open_store(other_path, dask=False) if other_path else None
    fits = [vocabulary_fit(s) for s in (store, other) if s is not None]
    if as_json:
        facts = {**store_facts(store), "vocabulary": fits}
        if geometry:
            facts["geometry"] = geometry_rows(store, pairs=sample)[1]
        click.echo(json.dumps(facts, indent=1, default=str))
        return
    click.echo(describe(store))
    click.echo(describe_vocabulary(fits))
    if geometry:
        click.echo(describe_geometry(store, pairs=sample))


@main.command()
@click.argument("store_path", type=click.Path())
@_user_errors
def verify(store_path: str) -> None:
    """Check a store: checksums, rows, views.

    Recomputes the checksum of every file the store recorded when it was completed, and
    checks the complete flag, the rows of every array or file, and that every view is
    stored. Prints one OK line, or exits 5 naming each array or file that is wrong.

    \b
    Example:
      bertpipe verify out/reviews.zarr && echo "safe to publish"
    """
    from .stores.verify import verified

    click.echo(verified(store_path).line())


@main.command()
@click.argument("store_path", type=click.Path())
@click.option("--keep", default=None, type=click.IntRange(min=1), metavar="N",
              help="Versions to keep readable, the newest N (the current one included); "
              "the others are deleted for good. Required when the store keeps more than one "
              "version: there is no default, so a forgotten flag drops no history.")
@_user_errors
def gc(store_path: str, keep: int | None) -> None:
    """Reclaim the space of store versions no longer kept.

    An Icechunk or Delta store keeps every version readable until this expires it
    (`inspect` lists them); what no kept version uses is deleted (Delta: its vacuum). Such
    a store with several versions needs --keep N: without it gc refuses and changes
    nothing. A Zarr or Parquet store keeps its current version only: what is left of a
    retired one is removed (no --keep needed). Takes the store's lock (refused while a run
    writes it).

    \b
    Examples:
      bertpipe gc out/reviews.icechunk --keep 7
      bertpipe gc out/reviews.delta --keep 2
      bertpipe gc out/reviews.zarr
    """
    from .run.gc import collect_garbage

    click.echo(collect_garbage(store_path, keep).line())


@main.command()
@click.argument("store_path", type=click.Path())
@click.option("--view", required=True, help="The view to fit on.")
@click.option("--method", required=True, type=click.Choice(["center", "whiten", "abtt"]),
              help="center: subtract the mean; whiten: decorrelate to unit variance; abtt: "
              "remove the top principal directions (all-but-the-top).")
@click.option("--dims", type=click.IntRange(min=1), default=None,
              help="whiten: keep this many dimensions (1 to the view's width).")
@click.option("-d", "top", type=click.IntRange(min=1), default=None,
              help="abtt: principal directions to remove (default 1; fewer than the width).")
@click.option("--normalize", is_flag=True, help="L2-normalise after the transform.")
@click.option("--name", default=None, help="Name of the new view (default VIEW_METHOD): "
              "letters, digits and _, not a name the store already has.")
@_user_errors
def postprocess(store_path: str, view: str, method: str, dims: int | None, top: int | None,
                normalize: bool, name: str | None) -> None:
    """Fit a geometry fix on a view and write the result as a new view of the store.

    \b
    Examples:
      bertpipe postprocess out/reviews.zarr --view mean --method center
      bertpipe postprocess out/reviews.zarr --view mean --method whiten --dims 128 --normalize
      bertpipe postprocess out/reviews.zarr --view cls --method abtt -d 2 --name cls_abtt2
    """
    from .post.apply import postprocess as run
    from .spec import PostSpec

    if dims is not None and method != "whiten":
        raise click.BadParameter("only used with --method whiten", param_hint="'--dims'")
    if top is not None and method != "abtt":
        raise click.BadParameter("only used with --method abtt", param_hint="'-d'")
    spec = PostSpec(method=method, dims=dims, d=top or 1, normalize=normalize)
    target = run(store_path, view, spec, name=name)
    click.echo(f"wrote view {target!r} ({method} of {view!r}) to {store_path}")


@main.command()
@click.argument("store_path", type=click.Path())
@click.argument("query", nargs=-1, required=True)
@click.option("--view", default=None, help="View to search (default: the first).")
@click.option("-k", default=10, show_default=True, type=click.IntRange(min=1),
              help="Hits to show.")
@click.option("--chunks", "level", flag_value="chunks", default="docs",
              help="Search chunk vectors instead of documents.")
@click.option("--exact", is_flag=True, help="Scan the store even when an index exists.")
@_user_errors
def search(store_path: str, query: tuple[str, ...], view: str | None, k: int,
           level: str, exact: bool) -> None:
    """Top-k rows of a store for a query text (exact cosine search, or the store's FAISS
    index when there is one).

    \b
    Examples:
      bertpipe search out/reviews.zarr "made me dizzy" --view mean -k 5
      bertpipe search out/reviews.zarr "weight gain" --chunks --exact
    """
    from .analysis.search import search as run
    from .analysis.search import snippet
    from .api import open_store

    text = " ".join(query)
    if not text.strip():
        raise click.BadParameter("the query is empty", param_hint="'QUERY'")
    store = open_store(store_path)
    for rank, hit in enumerate(run(store, [text], view, k, level, exact)[0], 1):
        where = f" chunk {hit.chunk} [{hit.span[0]}:{hit.span[1]}]" if hit.span else ""
        click.echo(f"{rank:>3}. {hit.score:.4f}  id {hit.id}{where}  {snippet(store, hit)}")


@main.command()
@click.argument("store_path", type=click.Path())
@click.option("--label", required=True, help="Label column: a carried column of the store, "
              "or a column of --labels.")
@click.option("--labels", "labels_file", type=click.Path(exists=True, dir_okay=False),
              default=None,
              help="A Parquet file of labels, joined to the store on ids.")
@click.option("--label-column", default=None, help="Label column in --labels (default --label).")
@click.option("--id-column", default="id", show_default=True, help="Id column in --labels.")
@click.option("--views", "view_names", default=None,
              help="Comma-separated views to probe (default: all).")
@click.option("--layers", is_flag=True, help="Report single-layer views as a layer x pooling "
              "grid (a sweep store, e.g. from jobs/sweep.yaml).")
@click.option("--scalar-mix", "scalar_mix", default=None, metavar="POOLING",
              help="Also learn an ELMo scalar mix over the single-layer views with this pooling.")
@click.option("--folds", default=5, show_default=True, type=click.IntRange(min=2),
              help="Cross-validation folds (at least 2).")
@click.option("--seed", default=0, show_default=True, help="Seed of the folds and subsamples: "
              "the same seed gives the same report.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Where probe.json, probe.html and probe.png go (default STORE-probe/).")
@click.option("--learning-curve", "learning_curve", is_flag=True, help="Also refit each view "
              "on 50, 100, 200, ... labelled rows: frozen features enough, or more labels?")
@click.option("--curve-sizes", default=None, metavar="N,N,...",
              help="--learning-curve: these sizes instead of 50, 100, 200, ...")
@click.option("--curve-repeats", default=3, show_default=True,
              help="--learning-curve: subsamples (seeds) per fold and size.")
@_user_errors
def probe(store_path: str, label: str, labels_file: str | None, label_column: str | None,
          id_column: str, view_names: str | None, layers: bool, scalar_mix: str | None,
          folds: int, seed: int, out_dir: str | None, learning_curve: bool,
          curve_sizes: str | None, curve_repeats: int) -> None:
    """Linear probes of every view: which layer and pooling carry the label?

    \b
    Examples:
      bertpipe probe out/reviews.zarr --label label
      bertpipe probe out/sweep.zarr --label label --layers --scalar-mix mean
      bertpipe probe out/reviews.zarr --label y --labels labels.parquet --id-column doc_id
      bertpipe probe out/sweep.zarr --label label --views l3_mean --learning-curve
    """
    from .analysis.probe import load_labels, run_probe
    from .analysis.report import table, write_outputs
    from .api import open_store

    store = open_store(store_path)
    labels = load_labels(store, label_column or label, labels_file, id_column).rename(label)
    views = view_names.split(",") if view_names else None
    if layers:
        from .analysis.probe import single_layer_views

        views = single_layer_views(store, views)
    sizes = _int_list(curve_sizes, "--curve-sizes") if curve_sizes else None
    from .run.progress import Progress

    report = run_probe(store, labels, views, folds=folds, seed=seed, scalar_mix=scalar_mix,
                       learning_curve=learning_curve, curve_sizes=sizes,
                       curve_repeats=curve_repeats, on_view=Progress(quiet=_quiet()).message)
    click.echo(table(report))
    paths = write_outputs(report, out_dir or _beside(store_path, "-probe"))
    click.echo(f"wrote {paths['json']}, {paths['html']}")


def _beside(store_path: str, suffix: str) -> str:
    """A local folder named after the store: beside it, or for a URL in the working
    directory (reports are local files)."""
    path = store_path.rstrip("/")
    return (path.rsplit("/", 1)[-1] if is_url(path) else path) + suffix


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise OptionError(f"{option}: {text!r} is not a comma-separated list of integers "
                         "(e.g. 50,100,200)") from None


@main.command()
@click.argument("store_path", type=click.Path())
@click.option("--view", required=True, help="The view to index.")
@click.option("--chunks", "level", flag_value="chunks", default="docs",
              help="Index chunk vectors instead of documents.")
@click.option("--nprobe", default=16, show_default=True, type=click.IntRange(min=1),
              help="Lists scanned per query.")
@_user_errors
def index(store_path: str, view: str, level: str, nprobe: int) -> None:
    """Build an approximate nearest-neighbour index (FAISS) beside the store.

    \b
    Example:
      bertpipe index out/reviews.zarr --view mean --nprobe 32
    """
    from .analysis.index import build_index
    from .api import open_store

    path = build_index(open_store(store_path), view, level, nprobe=nprobe)
    click.echo(f"wrote {path}; bertpipe search uses it (--exact to scan instead)")


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@set_option
@click.option("--id", "row_id", default=None, help="The row: its id (input.id_column), or its "
              "row number when the job has no id column.")
@click.option("--chunk", default=0, show_default=True, help="Which chunk of the row.")
@click.option("--layers", default=None, help="Comma-separated layers 1..L (layer k is the "
              "attention inside transformer block k, whose output is hidden state k), "
              "negative from the end (default: all).")
@click.option("--heads", default=None, help="Comma-separated heads (default: all).")
@click.option("--summary", is_flag=True, help="Per-head statistics over --sample rows "
              "instead of one row's maps.")
@click.option("--sample", default=100, show_default=True, help="--summary: rows sampled "
              "(fixed seed).")
@click.option("--seed", default=0, show_default=True, help="Seed of the row sample for "
              "--summary.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder for attention.html + attention.npz (or the summary's files).")
@_user_errors
def attention(job_file: str, overrides: tuple[str, ...], row_id: str | None, chunk: int,
              layers: str | None, heads: str | None, summary: bool, sample: int, seed: int,
              out_dir: str) -> None:
    """Attention maps of one row, or what every head does over a sample (a diagnostic).

    \b
    Examples:
      bertpipe attention jobs/reviews.yaml --id 48134 --layers 1,-1 --out out/att
      bertpipe attention jobs/reviews.yaml --summary --sample 200 --out out/att
    """
    from .analysis.attention import attention_for_row, summarize_heads
    from .spec import load_job

    if summary == (row_id is not None):
        raise OptionError("give either --id ID (one row's maps) or --summary (statistics "
                             "over --sample rows)")
    if summary and chunk:
        raise OptionError("--chunk: applies to one row (--id); --summary uses each "
                             "sampled row's first chunk")
    job = load_job(job_file, overrides)
    if summary:
        result = summarize_heads(job, sample=sample, seed=seed, layers=layers, heads=heads)
        click.echo(result.table())
        paths = result.save(out_dir)
        click.echo(f"wrote {paths['json']}, {paths['html']}")
        return
    assert row_id is not None  # checked above: exactly one of --id / --summary
    row = attention_for_row(job, row_id, layers=layers, heads=heads, chunk=chunk)
    paths = row.save(out_dir)
    click.echo(f"row {row.row} (id {row_id}), chunk {row.chunk} of {row.n_chunks}: "
               f"{len(row.tokens)} tokens, {len(row.layers)} layers x {len(row.heads)} heads")
    click.echo(f"wrote {paths['html']}, {paths['npz']}")


if __name__ == "__main__":
    main()
