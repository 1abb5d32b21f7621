"""Where a run may write, what a rerun may reuse or replace, and the lock it writes under.

The rules (docs/store.md): the output may not be, contain or feed the input, and may not be
or contain the job file's folder or the working directory (for URLs: the same rules on
the keys of one filesystem); `--overwrite` replaces only a
bertpipe store or an empty folder, removing only the store's own entries; a rerun reuses an
incomplete store only when the job, the model, the input's identity and the partitioning
all match, and calls a complete store done only when the job, model and input match; one
run writes at a time. Every refusal happens before anything is written.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

from ..errors import StoreError
from ..extract.source import list_files
from ..io.location import Location, is_url, local_path, normalize_url, resolve
from ..spec import Job
from ..stores import Staging, store_at
from ..stores.lock import StoreLock
from ..stores.ownership import Contents, inspect_output, remove_store
from ..stores.provenance import (
    InputFile,
    RuntimeChoice,
    fingerprint_of,
    input_change,
    input_identity_of,
)

log = logging.getLogger(__name__)

MAGIC = ("*", "?", "[")


# One object store under several names: the same keys, the same rules.
SCHEME_ALIASES = {"s3a": "s3", "gcs": "gs", "az": "abfs", "abfss": "abfs", "local": "file"}


def place(path: str) -> tuple[str, PurePosixPath]:
    """Where `path` is, comparable across spellings: (filesystem scheme, absolute key)."""
    if is_url(path):
        scheme, key = normalize_url(path).split("://", 1)
        return SCHEME_ALIASES.get(scheme, scheme), PurePosixPath("/" + key)
    return "file", PurePosixPath(Path(local_path(path)).resolve())


def check_output_location(job: Job, job_file: str | Path | None = None) -> None:
    """Refuse an output path that is, holds or feeds the input, the job file's folder or
    the working directory (before anything is touched). A URL is compared with paths of
    its own filesystem: its keys are what could be deleted or read back as input."""
    out_scheme, out = place(job.output.path)
    shown = job.output.path if is_url(job.output.path) else str(out)
    guarded: list[tuple[str, tuple[str, PurePosixPath]]] = [
        ("the working directory", place(str(Path.cwd())))]
    if job_file is not None:
        job_path = place(str(job_file))
        guarded += [("the job file", job_path),
                    ("the job file's folder", (job_path[0], job_path[1].parent))]
    source = job.input.path
    options = job.input.storage_options
    files = list_files(source, options)
    folder = _input_folder(source, options)
    if folder is not None:
        guarded.append(("the input folder", folder))
    guarded += [("the input file", place(f)) for f in files]
    mine = [(what, path) for what, (scheme, path) in guarded if scheme == out_scheme]
    for what, path in mine:
        if out == path:
            raise StoreError(f"output.path: {shown} is {what}; choose a new folder for the "
                             "store (e.g. out/name.zarr)")
    for what, path in mine:
        if out in path.parents:
            raise StoreError(f"output.path: {shown} contains {what} ({_show(out_scheme, path)}); "
                             "choose a new folder for the store")
    if folder is not None and folder[0] == out_scheme and folder[1] in out.parents:
        raise StoreError(f"output.path: {shown} is inside the input folder {source}: its files "
                         "would be read as input; choose a folder outside it")
    source_scheme, pattern = place(source)
    if any(ch in source for ch in MAGIC) and source_scheme == out_scheme \
            and _glob_reaches(pattern, out):
        raise StoreError(f"output.path: {shown} is matched by the input pattern {source}: its "
                         "files would be read as input; choose a folder outside it")


def _input_folder(source: str, options: dict[str, Any] | None) -> tuple[str, PurePosixPath] | None:
    """The input as a folder (local directory or object-store prefix), else None."""
    if any(ch in source for ch in MAGIC):
        return None
    if is_url(source):
        return place(source) if resolve(source, options, "input.storage_options").is_dir() \
            else None
    return place(source) if os.path.isdir(source) else None


def _show(scheme: str, path: PurePosixPath) -> str:
    return str(path) if scheme == "file" else f"{scheme}://{str(path).lstrip('/')}"


def _glob_reaches(pattern: PurePosixPath, out: PurePosixPath) -> bool:
    """`out`, or a file inside it, could be matched by the glob `pattern`."""
    pat, parts = pattern.parts, out.parts
    if "**" in pat:  # recursive: anything under the folder before the first wildcard
        root = []
        for p in pat:
            if any(ch in p for ch in MAGIC):
                break
            root.append(p)
        return PurePosixPath(*root) == out or PurePosixPath(*root) in out.parents
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
    provenance = store_at(str(path), contents.format or job.output.format).record() or {}
    run = Staging(path).run_info() or {}
    existing = fingerprint_of(provenance) or fingerprint_of(run)
    if existing != plan.fingerprint:
        stored = provenance.get("job") or run.get("job")
        raise StoreError(f"output.path: {path} holds output of a different job or model"
                         f"{job_changes(stored, job)}; pass --overwrite to replace it or "
                         "choose another output.path")
    if provenance.get("complete"):
        _check_input(path, provenance, plan, "is complete, but")
        # why here: verification imports zarr (the formats), which a new store's checks
        # (validate) never need
        from ..stores.verify import summarize, verify_store

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


# Job keys that say where or how a run goes, not what it writes (as Job.fingerprint).
NOT_OUTPUT = ("execution", "output.path", "output.overwrite", "output.incremental",
              "output.storage_options", "input.storage_options")
SHOWN_CHANGES = 4


def job_changes(stored: Any, job: Job) -> str:
    """What differs between the job a store was made with and this one, vector-defining
    keys first: ' (views.mean.normalize: false → true)'; the weights when no key differs;
    '' when the store does not say."""
    if not isinstance(stored, dict):
        return ""
    before, now = _flat(stored), _flat(job.to_dict())
    keys = [k for k in sorted(before.keys() | now.keys()) if before.get(k, _ABSENT) !=
            now.get(k, _ABSENT) and not k.startswith(NOT_OUTPUT)]
    if not keys:
        return " (the same job keys: the model's weights differ)"
    defining = tuple(job.vector_parts())
    keys.sort(key=lambda k: not k.startswith(defining))
    shown = [f"{k}: {_shown(before.get(k, _ABSENT))} → {_shown(now.get(k, _ABSENT))}"
             for k in keys[:SHOWN_CHANGES]]
    more = f"; and {len(keys) - SHOWN_CHANGES} more" if len(keys) > SHOWN_CHANGES else ""
    return f" ({'; '.join(shown)}{more})"


_ABSENT = object()


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'views': {'mean': {'normalize': True}}} → {'views.mean.normalize': True}"""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flat(value, name + "."))
        else:
            flat[name] = value
    return flat


def _shown(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _check_input(path: str, recorded: dict[str, Any], plan: Plan, state: str) -> None:
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
        update = (", or --incremental to encode only its new and changed rows"
                  if state.startswith("is complete") else "")
        raise StoreError(f"output.path: {path} {state} {change} since it was written; pass "
                         f"--overwrite to rebuild it from the current input{update}")


class OutputSession:
    """The output folder for one run: made if absent, locked while the run writes, and on a
    failure before any partition was staged, left as it was found (what this run created is
    removed; a store that existed before is never removed). On an object store there are no
    folders to make or remove: only the store's own keys are written and removed."""

    def __init__(self, path: str | Path, fingerprint: str,
                 say: Callable[[str], None] = log.warning, command: str | None = None):
        self.location: Location = resolve(path)
        self.path = Path(self.location.path) if self.location.local else None
        self.fingerprint = fingerprint
        # `command`: a command on a store (gc), not a job's run: refusals say so
        self.lock = StoreLock(self.location, say, command)
        self.made_dirs: list[Path] = []  # local folders this run created, deepest first
        self.made_store = False  # the store's entries are this run's (set by `prepare`)

    def refuse_if_locked(self) -> None:
        """Name the holder of a live lock before anything else is said or done (a dead
        holder's lock is taken over, a suspect one's waited on, when the run takes it)."""
        state = self.lock.state()
        if state.kind in ("live", "unknown"):
            raise StoreError(self.lock.refusal(state))

    @property
    def took_over(self) -> str:
        """Whose lock this run took over, and why ("" when it found none)."""
        return self.lock.took_over

    def confirm(self, action: str) -> None:
        """Fencing: raise StoreError unless this run still holds the store's lock."""
        self.lock.confirm(action)

    def __enter__(self) -> OutputSession:
        self.refuse_if_locked()
        if self.path is not None:
            self.made_dirs = [p for p in (self.path, *self.path.parents) if not p.exists()]
        self.location.make_dirs()
        try:
            self.lock.acquire(self.fingerprint)
        except BaseException:
            self._remove_made_dirs()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        undo = exc is not None and self.made_store and not Staging(self.location).markers() \
            and self._still_held()
        try:
            if undo:
                remove_store(inspect_output(self.location))
        finally:
            self.lock.release()
            if undo or (exc is not None and not self.made_store):
                self._remove_made_dirs()

    def _still_held(self) -> bool:
        """This run still holds the lock: only then may it undo what it made."""
        try:
            self.lock.confirm("remove what it made")
        except StoreError:
            return False
        return True

    def prepare(self, job: Job, plan: Plan, overwrite: bool,
                choice: RuntimeChoice | None = None) -> Staging | None:
        """Staging for this run (a new, replaced or resumed store), or None when the store is
        already complete for this job and input. `choice`, the runtime the run encodes
        with, is recorded for a resume to encode with too."""
        action, contents = assess(job, plan, overwrite)
        staging = Staging(self.location, fence=self.lock.fence())
        if action == "complete":
            return None
        if action == "replace":
            self.confirm("replace the store")
            remove_store(contents)
            if contents.foreign:
                log.warning("%s: kept entries that are not the store's: %s", self.location,
                            contents.describe_foreign())
        self.made_store = self.made_store or action in ("create", "replace")
        if action in ("create", "replace"):
            # first (an Icechunk repository is made only in a clean folder); its record
            # names the fingerprint a resume must match, so the store is never seen
            # without it
            store_at(self.location.url, job.output.format).create(
                {"complete": False, "run_fingerprint": plan.fingerprint})
        staging.begin({"run_fingerprint": plan.fingerprint, "job": job.to_dict(),
                       "partition_rows": plan.partition_rows,
                       "input_identity": [asdict(f) for f in plan.identity],
                       "runtime_choice": asdict(choice) if choice else None})
        return staging

    def _remove_made_dirs(self) -> None:
        for folder in self.made_dirs:  # deepest first; only while empty
            try:
                folder.rmdir()
            except OSError:
                break
