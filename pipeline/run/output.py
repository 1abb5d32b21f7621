"""Where a run may write, what a rerun may reuse or replace, and the lock it writes under.

The rules (docs/store.md): the output may not be, contain or feed the input, and may not be
or contain the job file's folder or the working directory; `--overwrite` replaces only a
bertpipe store or an empty folder, removing only the store's own entries; a rerun reuses an
incomplete store only when the job, the model, the input's identity and the partitioning
all match, and calls a complete store done only when the job, model and input match; one
run writes at a time. Every refusal happens before anything is written.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from ..errors import StoreError
from ..extract.source import list_files
from ..spec import Job
from ..stores import Staging, format_named
from ..stores.lock import StoreLock
from ..stores.ownership import Contents, inspect_output, remove_store
from ..stores.provenance import InputFile, fingerprint_of, input_change, input_identity_of
from ..stores.verify import summarize, verify_store

log = logging.getLogger(__name__)

MAGIC = ("*", "?", "[")


def check_output_location(job: Job, job_file: str | Path | None = None) -> None:
    """Refuse an output path that is, holds or feeds the input, the job file's folder or
    the working directory (before anything is touched)."""
    out = Path(job.output.path).resolve()
    guarded: list[tuple[str, Path]] = [("the working directory", Path.cwd().resolve())]
    if job_file is not None:
        job_path = Path(job_file).resolve()
        guarded += [("the job file", job_path), ("the job file's folder", job_path.parent)]
    source = job.input.path
    if os.path.isdir(source):
        guarded.append(("the input folder", Path(source).resolve()))
    guarded += [("the input file", Path(f).resolve()) for f in list_files(source)]
    for what, path in guarded:
        if out == path:
            raise StoreError(f"output.path: {out} is {what}; choose a new folder for the store "
                             "(e.g. out/name.zarr)")
    for what, path in guarded:
        if out in path.parents:
            raise StoreError(f"output.path: {out} contains {what} ({path}); choose a new "
                             "folder for the store")
    if os.path.isdir(source) and Path(source).resolve() in out.parents:
        raise StoreError(f"output.path: {out} is inside the input folder {source}: its files "
                         "would be read as input; choose a folder outside it")
    if any(ch in source for ch in MAGIC) and _glob_reaches(source, out):
        raise StoreError(f"output.path: {out} is matched by the input pattern {source}: its "
                         "files would be read as input; choose a folder outside it")


def _glob_reaches(pattern: str, out: Path) -> bool:
    """`out`, or a file inside it, could be matched by the glob `pattern`."""
    pat, parts = Path(pattern).parts, out.parts
    if "**" in pat:  # recursive: anything under the folder before the first wildcard
        root = []
        for p in pat:
            if any(ch in p for ch in MAGIC):
                break
            root.append(p)
        return Path(*root) == out or Path(*root) in out.parents
    if len(parts) > len(pat):
        return False
    return all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pat, strict=False))


@dataclass(frozen=True)
class Plan:
    """What a run expects of an existing store: the digest of its job and model, the
    input's identity and the partitioning its markers were made with."""

    fingerprint: str
    identity: tuple[InputFile, ...]
    partition_rows: int


def assess(job: Job, plan: Plan, overwrite: bool) -> tuple[str, Contents]:
    """What to do with the output path, read only: `create` (absent or empty), `replace`
    (a store to overwrite), `resume` (an incomplete store of this job) or `complete`;
    anything else is refused."""
    contents = inspect_output(job.output.path)
    path = contents.path
    if contents.state in ("absent", "empty"):
        return "create", contents
    if contents.state == "file":
        raise StoreError(f"output.path: {path} is a file, not a bertpipe store; choose "
                         "another output.path")
    if contents.state == "foreign":
        why = ("--overwrite replaces only a bertpipe store or an empty folder; "
               if overwrite else "")
        raise StoreError(f"output.path: {path} exists and is not a bertpipe store (it holds "
                         f"{contents.describe_foreign()}); {why}choose another output.path")
    if overwrite:
        return "replace", contents
    fmt = format_named(contents.format or job.output.format)
    provenance = fmt.read_provenance(str(path)) or {}
    run = Staging(path).run_info() or {}
    existing = fingerprint_of(provenance) or fingerprint_of(run)
    if existing != plan.fingerprint:
        raise StoreError(f"output.path: {path} holds output of a different job or model; "
                         "pass --overwrite to replace it or choose another output.path")
    if provenance.get("complete"):
        _check_input(path, provenance, plan, "is complete, but")
        problems = verify_store(str(path))
        if problems:
            raise StoreError(f"output.path: {path} is complete but fails verification: "
                             f"{summarize(problems)}; pass --overwrite to rewrite it")
        return "complete", contents
    _check_input(path, run, plan, "holds an interrupted run, but")
    if run.get("partition_rows") != plan.partition_rows:
        raise StoreError(f"output.path: {path} holds an interrupted run made with "
                         f"execution.partition_rows={run.get('partition_rows')}, this run asks "
                         f"for {plan.partition_rows}; rerun with --set execution.partition_rows="
                         f"{run.get('partition_rows')} to resume, or pass --overwrite to start "
                         "again")
    return "resume", contents


def _check_input(path: Path, recorded: dict[str, Any], plan: Plan, state: str) -> None:
    try:
        before = input_identity_of(recorded)
    except (KeyError, TypeError, ValueError):
        raise StoreError(f"output.path: {path}: damaged input identity; pass --overwrite to "
                         "rebuild the store") from None
    if not before:
        raise StoreError(f"output.path: {path} {state.split(',')[0]} and does not record the "
                         "identity of its input (an older bertpipe wrote it), so a rerun cannot "
                         "tell whether it is up to date; pass --overwrite to rebuild it")
    change = input_change(before, plan.identity)
    if change:
        raise StoreError(f"output.path: {path} {state} {change} since it was written; pass "
                         "--overwrite to rebuild it from the current input")


class OutputSession:
    """The output folder for one run: made if absent, locked while the run writes, and on a
    failure before any partition was staged, left as it was found (what this run created is
    removed; a store that existed before is never removed)."""

    def __init__(self, path: str | Path, fingerprint: str):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.lock = StoreLock(self.path)
        self.made_dirs: list[Path] = []  # folders this run created, deepest first
        self.made_store = False  # the store's entries are this run's (set by `prepare`)

    def refuse_if_locked(self) -> None:
        """Name the holder of the lock, if any, before anything else is said or done."""
        if self.path.is_dir() and self.lock.holder() is not None:
            raise StoreError(self.lock.refusal())

    def __enter__(self) -> OutputSession:
        self.refuse_if_locked()
        self.made_dirs = [p for p in (self.path, *self.path.parents) if not p.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            self.lock.acquire(self.fingerprint)
        except BaseException:
            self._remove_made_dirs()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        undo = exc is not None and self.made_store and not Staging(self.path).markers()
        try:
            if undo:
                remove_store(inspect_output(self.path))
        finally:
            self.lock.release()
            if undo or (exc is not None and not self.made_store):
                self._remove_made_dirs()

    def prepare(self, job: Job, plan: Plan, overwrite: bool) -> Staging | None:
        """Staging for this run (a new, replaced or resumed store), or None when the store is
        already complete for this job and input."""
        action, contents = assess(job, plan, overwrite)
        staging = Staging(self.path)
        if action == "complete":
            return None
        if action == "replace":
            remove_store(contents)
            if contents.foreign:
                log.warning("%s: kept entries that are not the store's: %s", self.path,
                            contents.describe_foreign())
        self.made_store = self.made_store or action in ("create", "replace")
        # run.json first: a store is never seen without what a resume must match
        staging.begin({"run_fingerprint": plan.fingerprint, "job": job.to_dict(),
                       "partition_rows": plan.partition_rows,
                       "input_identity": [asdict(f) for f in plan.identity]})
        if action in ("create", "replace"):
            format_named(job.output.format).create(
                str(self.path), {"complete": False, "run_fingerprint": plan.fingerprint})
        return staging

    def _remove_made_dirs(self) -> None:
        for folder in self.made_dirs:  # deepest first; only while empty
            try:
                folder.rmdir()
            except OSError:
                break
