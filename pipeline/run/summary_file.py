"""Where `extract --json-summary PATH` may write, and the writing itself.

The summary is written at the end of a run, on success and on failure; nothing is
opened before then. Refused before the run, so that a summary never replaces what the run
needs or makes: the job file, the input, a file of the model, anything inside the store,
and an existing file that is not a run summary. A device or pipe (`/dev/stdout`) is
written as it is; a missing parent folder is made, as the store's is.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any

from ..errors import OptionError
from ..extract.source import list_files
from ..io.location import is_url
from ..spec import Job

OPTION = "--json-summary"


class SummaryFile:
    """The summary's path, checked; `refused` once a check has refused it (then it is
    never written)."""

    def __init__(self, path: str, job_file: str | Path):
        self.path = path
        self.refused = False
        self.special = _is_special(path)  # /dev/stdout, a pipe: written as it is
        self.checked = self.special  # set once check_job has passed
        if not self.special:
            self._refuse_if(_same(path, job_file), "is the job file")
            self._check_parent()

    def check_job(self, job: Job) -> None:
        """Not the input, a file of the model, a path inside the store, or an existing file
        that is not a run summary."""
        if self.special:
            return
        target = Path(self.path).resolve()
        if not is_url(job.input.path):
            files = list_files(job.input.path, job.input.storage_options)
            self._refuse_if(any(_same(target, f) for f in files), "is the job's input file "
                            f"({job.input.path})")
        model = Path(job.model.path)
        if model.is_dir():
            self._refuse_if(model.resolve() in target.parents,
                            f"is inside the model folder {job.model.path}")
        if not is_url(job.output.path):
            store = Path(job.output.path).resolve()
            self._refuse_if(target == store or store in target.parents,
                            f"is inside the store (output.path {job.output.path})")
        self._check_existing()
        self.checked = True

    def may_write(self) -> bool:
        """Whether the summary of a failed run may be written: its path passed every check,
        or (the job could not be loaded to check against) replaces no file but a summary."""
        if self.refused:
            return False
        if not self.checked:
            try:
                self._check_existing()
            except OptionError:
                return False  # the run's own error is the one to report
        return True

    def write(self, doc: dict[str, Any]) -> None:
        """The summary, whole: a regular file is replaced by rename (never half written)."""
        text = json.dumps(doc, indent=1)
        try:
            if self.special:
                with open(self.path, "w") as out:
                    out.write(text)
                return
            path = Path(self.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
            try:
                tmp.write_text(text)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise OptionError(f"{OPTION}: cannot write {self.path} ({exc.strerror})") from None

    def _refuse_if(self, refused: bool, why: str) -> None:
        if refused:
            self.refused = True
            raise OptionError(f"{OPTION}: {self.path} {why}; the summary would replace it: "
                              "choose another file (e.g. run.json)")

    def _check_existing(self) -> None:
        """An existing file is replaced only when it is empty or a summary already."""
        path = Path(self.path)
        if not path.is_file() or path.stat().st_size == 0:
            return
        try:
            previous = json.loads(path.read_bytes()[:1_000_000])
        except (OSError, ValueError):
            previous = None
        self._refuse_if(not (isinstance(previous, dict) and "exit_code" in previous),
                        "exists and is not a run summary")

    def _check_parent(self) -> None:
        """The folder can hold it, or can be made: nothing is made yet."""
        path = Path(self.path).absolute()
        parent = next((p for p in path.parents if os.path.lexists(p)), None)
        if parent is None:
            return
        if not parent.is_dir():
            self.refused = True
            raise OptionError(f"{OPTION}: cannot write {self.path}: {parent} is a file, not "
                              "a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            self.refused = True
            raise OptionError(f"{OPTION}: cannot write {self.path}: no permission to write "
                              f"in {parent}")


def _is_special(path: str) -> bool:
    """A character device or a pipe (`/dev/stdout`, `/dev/stderr`, a FIFO)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _same(a: str | Path, b: str | Path) -> bool:
    """One file under two names (links and relative paths resolved)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()
