"""The store's lifecycle under bad input, as a table: what `--overwrite` may remove, where
the output may go, when a rerun may reuse a store, one writer at a time, and a scheduler
that cannot be reached.

Each row of TABLE is a command, its exit code, a fragment of its one-line message, and what
must hold afterwards; for a refusal that is "nothing under the test's folder changed", which
the snapshot of every file (path, SHA-256, link target) checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

import pipeline
from pipeline.cli import main
from pipeline.run import runner
from pipeline.stores.lock import LOCK_NAME, REFRESH_ENV, TAKEOVER_PREFIX
from tests.agreement import assert_agree, run_all
from tests.conftest import job_dict, write_job
from tests.s3server import served

pytestmark = pytest.mark.table  # hundreds of CLI runs: make test, not make test-fast

BIN = Path(sys.executable).parent
TEXTS = ["the drug worked very well", "bad side effects, no sleep for a week", "great",
         "my doctor said it is not good for pain and sleep", "yes", "the day was good",
         "no effects with the drug in my week", "pain pain pain", "a very good drug",
         "it worked. then it did not."]


@dataclass
class World:
    """A test's folder: an input table, a job file writer and the tiny model."""

    tmp: Path
    model: Path
    monkeypatch: pytest.MonkeyPatch

    @property
    def src(self) -> Path:
        return self.tmp / "data" / "texts.parquet"

    def write_input(self, texts: list[str] = TEXTS, path: Path | None = None) -> Path:
        path = path or self.src
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(texts))], "text": texts}),
                       path)
        return path

    def job(self, out: Path | str, source: Path | str | None = None, name: str = "job",
            folder: Path | None = None, **sections: Any) -> Path:
        raw = job_dict(Path(source or self.src), self.model, Path(out), **sections)
        raw["output"]["path"] = str(out)  # as written, relative paths included
        folder = folder or self.tmp / "jobs"
        folder.mkdir(parents=True, exist_ok=True)
        return write_job(folder / f"{name}.yaml", raw)

    def user_folder(self) -> Path:
        folder = self.tmp / "thesis"
        folder.mkdir()
        (folder / "thesis.tex").write_text("three years of work")
        (folder / "figures").mkdir()
        (folder / "figures" / "f1.pdf").write_bytes(b"%PDF")
        return folder

    def interrupted(self, job_file: Path, after: int = 1) -> None:
        """Run `job_file` in-process and stop it (as Ctrl-C would) after `after` partitions."""
        class StopsAfter(runner.InProcessExecutor):
            def run(self, job, parts, staging, fingerprint, on_done):  # type: ignore[no-untyped-def]
                super().run(job, parts[:after], staging, fingerprint, on_done)
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            runner.run_job(pipeline.spec.load_job(job_file), executor=StopsAfter(),
                           job_file=job_file)


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root`: file contents, folders, link targets."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = f"link -> {os.readlink(path)}"
            elif path.is_dir():
                found[key] = "dir"
            else:
                found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def store_arrays(path: Path) -> dict[str, np.ndarray]:
    store = pipeline.open_store(path)
    arrays = {f"docs/{k}": np.asarray(v.values) for k, v in store.docs.variables.items()}
    if store.chunks is not None:
        arrays |= {f"chunks/{k}": np.asarray(v.values) for k, v in store.chunks.variables.items()}
    return arrays


def assert_identical_stores(got: Path, want: Path) -> None:
    a, b = store_arrays(got), store_arrays(want)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def one_line_error(result: Result | subprocess.CompletedProcess[str]) -> str:
    """The one `error:` line, last on stderr (progress lines may come before it)."""
    stderr = result.stderr
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert "Traceback" not in stderr
    return errors[0]


# --- the table -------------------------------------------------------------------------------
# A setup prepares the world and returns the command's arguments.

def overwrite_user_folder(w: World) -> list[Any]:
    return ["extract", w.job(w.user_folder()), "--overwrite"]


def overwrite_key_user_folder(w: World) -> list[Any]:
    return ["extract", w.job(w.user_folder(), output={"overwrite": True})]


def overwrite_dot(w: World) -> list[Any]:
    project = w.tmp / "project"
    project.mkdir()
    (project / "README.md").write_text("my project")
    job = w.job(".", folder=project)
    w.monkeypatch.chdir(project)
    return ["extract", job, "--overwrite"]


def overwrite_symlink_to_user_folder(w: World) -> list[Any]:
    link = w.tmp / "out.zarr"
    link.symlink_to(w.user_folder(), target_is_directory=True)
    return ["extract", w.job(link), "--overwrite"]


def overwrite_input_file(w: World) -> list[Any]:
    return ["extract", w.job(w.src), "--overwrite"]


def overwrite_input_folder(w: World) -> list[Any]:
    return ["extract", w.job(w.src.parent, source=w.src.parent), "--overwrite"]


def output_inside_input_folder(w: World) -> list[Any]:
    return ["extract", w.job(w.src.parent / "out.parquet", source=w.src.parent,
                             output={"format": "parquet"})]


def output_matched_by_input_glob(w: World) -> list[Any]:
    return ["extract", w.job(w.src.parent / "out.parquet", source=w.src.parent / "*.parquet",
                             output={"format": "parquet"})]


def output_is_job_folder(w: World) -> list[Any]:
    return ["extract", w.job(w.tmp / "jobs"), "--overwrite"]


def output_holds_job_file(w: World) -> list[Any]:
    return ["extract", w.job(w.tmp / "jobs" / "job.yaml"), "--overwrite"]


def output_is_a_file(w: World) -> list[Any]:
    (w.tmp / "notes.zarr").write_text("not a store")
    return ["extract", w.job(w.tmp / "notes.zarr"), "--overwrite"]


def overwrite_foreign_zarr(w: World) -> list[Any]:
    import zarr

    zarr.open_group(w.tmp / "theirs.zarr", mode="w", attributes={"owner": "someone"})
    return ["extract", w.job(w.tmp / "theirs.zarr"), "--overwrite"]


def resume_with_other_partition_rows(w: World) -> list[Any]:
    w.interrupted(w.job(w.tmp / "o.zarr"))
    return ["extract", w.job(w.tmp / "o.zarr", execution={"partition_rows": 4})]


def resume_after_input_changed(w: World) -> list[Any]:
    job = w.job(w.tmp / "o.zarr")
    w.interrupted(job)
    w.write_input([t.upper() for t in TEXTS])  # same rows, other text
    return ["extract", job]


def resume_after_input_grew(w: World) -> list[Any]:
    job = w.job(w.tmp / "o.zarr", output={"format": "parquet"})
    w.interrupted(job)
    w.write_input(TEXTS + ["one more review"])
    return ["extract", job]


def complete_store_input_changed(w: World) -> list[Any]:
    job = w.job(w.tmp / "o.zarr")
    assert run("extract", job).exit_code == 0
    w.write_input(TEXTS[::-1])
    return ["extract", job]


def complete_store_input_file_added(w: World) -> list[Any]:
    job = w.job(w.tmp / "o.parquet", source=w.src.parent, output={"format": "parquet"})
    assert run("extract", job).exit_code == 0
    pq.write_table(pa.table({"id": ["s0"], "text": ["another file"]}),  # ids stay unique
                   w.src.parent / "more.parquet")
    return ["extract", job]


def complete_store_of_another_view(w: World) -> list[Any]:
    assert run("extract", w.job(w.tmp / "o.zarr")).exit_code == 0
    views = {"mean": {"pooling": "mean", "normalize": True}, "cls": {"pooling": "cls"}}
    return ["extract", w.job(w.tmp / "o.zarr", views=views)]


def interrupted_run_of_another_chunking(w: World) -> list[Any]:
    w.interrupted(w.job(w.tmp / "o.zarr"))
    return ["extract", w.job(w.tmp / "o.zarr", chunking={"strategy": "hierarchical"},
                             batching={"max_batch_size": 4})]


def complete_store_of_other_weights(w: World) -> list[Any]:
    w.model = w.tmp / "own-model"  # a copy whose weights change after the run, in place
    shutil.copytree(w.tmp / "tiny", w.model)
    job = w.job(w.tmp / "o.zarr")
    assert run("extract", job).exit_code == 0
    weights = w.model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b" ")
    return ["extract", job]


def moved_model(w: World) -> list[Any]:
    assert run("extract", w.job(w.tmp / "o.zarr")).exit_code == 0
    w.model = w.tmp / "moved"
    shutil.copytree(w.tmp / "tiny", w.model)
    return ["extract", w.job(w.tmp / "o.zarr")]


def live_lock(w: World) -> list[Any]:
    job = w.job(w.tmp / "o.zarr")
    _fake_lock(w.tmp / "o.zarr", pid=os.getpid())  # this process: certainly alive
    return ["extract", job]


def dead_lock_being_taken_over(w: World) -> list[Any]:
    """Another run has claimed the dead holder's lock (its claim file exists): wait."""
    job = w.job(w.tmp / "o.zarr")
    _fake_lock(w.tmp / "o.zarr", pid=_dead_pid())
    (w.tmp / "o.zarr" / f"{TAKEOVER_PREFIX}{'e' * 32}").write_text('{"pid": 1}')
    return ["extract", job]


def fresh_lock_of_another_host(w: World) -> list[Any]:
    job = w.job(w.tmp / "o.zarr")
    _fake_lock(w.tmp / "o.zarr", pid=1, host="elsewhere", age_s=30)  # refreshed 30 s ago
    return ["extract", job]


def _lock_refresh(name: str, value: str) -> Callable[[World], list[Any]]:
    """The standard job run with BERTPIPE_LOCK_REFRESH_S set to `value` (a row `name`)."""
    def setup(w: World) -> list[Any]:
        w.monkeypatch.setenv(REFRESH_ENV, value)
        return ["extract", w.job(w.tmp / "o.zarr")]

    setup.__name__ = name
    return setup


lock_refresh_not_a_number = _lock_refresh("lock_refresh_not_a_number", "soon")
lock_refresh_zero = _lock_refresh("lock_refresh_zero", "0")
# an interval that would let a healthy run's lease end between two of its beats, and one
# that would make a killed run's lease last for ever
lock_refresh_too_short = _lock_refresh("lock_refresh_too_short", "0.001")
lock_refresh_too_long = _lock_refresh("lock_refresh_too_long", "1e308")


def lock_is_a_directory(w: World) -> list[Any]:
    (w.tmp / "o.zarr" / LOCK_NAME).mkdir(parents=True)
    return ["extract", w.job(w.tmp / "o.zarr")]


def unlock_a_lock_that_is_a_directory(w: World) -> list[Any]:
    assert run("extract", w.job(w.tmp / "o.zarr")).exit_code == 0
    (w.tmp / "o.zarr" / LOCK_NAME).mkdir()
    (w.tmp / "o.zarr" / LOCK_NAME / "notes.txt").write_text("mine")
    return ["unlock", w.tmp / "o.zarr"]


def calibration_cache_is_a_file(w: World) -> list[Any]:
    """BERTPIPE_CACHE_DIR names a file: calibration cannot keep its result (refused before
    a store is made, also as root, whom permissions would not stop)."""
    w.monkeypatch.setenv("BERTPIPE_CACHE_DIR", str(w.src))
    return ["extract", _auto_job(w)]


def calibrate_cache_is_a_file(w: World) -> list[Any]:
    w.monkeypatch.setenv("BERTPIPE_CACHE_DIR", str(w.src))
    return ["calibrate", _auto_job(w)]


def _auto_job(w: World) -> Path:
    """The standard job with model.runtime and model.dtype left to calibration."""
    job = w.job(w.tmp / "o.zarr")
    job.write_text(job.read_text().replace("runtime: torch", "runtime: auto")
                   .replace("dtype: float32", "dtype: auto", 1))
    return job


def unreadable_lock(w: World) -> list[Any]:
    job = w.job(w.tmp / "o.zarr")
    (w.tmp / "o.zarr").mkdir()
    (w.tmp / "o.zarr" / LOCK_NAME).write_text("{not json")
    return ["extract", job]


def unlock_live(w: World) -> list[Any]:
    _fake_lock(w.tmp / "o.zarr", pid=os.getpid())
    return ["unlock", w.tmp / "o.zarr"]


def gc_while_a_run_writes(w: World) -> list[Any]:
    job = w.job(w.tmp / "o.icechunk", output={"format": "icechunk"})
    assert run("extract", job).exit_code == 0
    _fake_lock(w.tmp / "o.icechunk", pid=os.getpid())
    return ["gc", w.tmp / "o.icechunk"]


def gc_delta_while_a_run_writes(w: World) -> list[Any]:
    """gc has no output.path: its refusal names the store and the way on for gc."""
    assert run("extract", w.job(w.tmp / "o.delta", output={"format": "delta"})).exit_code == 0
    _fake_lock(w.tmp / "o.delta", pid=os.getpid())
    return ["gc", w.tmp / "o.delta", "--keep", "1"]


def _two_versions(w: World, fmt: str) -> Path:
    """A store of `fmt` updated once: versions 1 and 0 kept."""
    job = w.job(w.tmp / f"o.{fmt}", output={"format": fmt})
    assert run("extract", job).exit_code == 0
    w.write_input([*TEXTS, "one more"])
    assert run("extract", job, "--incremental").exit_code == 0
    return w.tmp / f"o.{fmt}"


def gc_icechunk_history_without_keep(w: World) -> list[Any]:
    """Forgetting --keep drops no history: refused, naming the versions kept."""
    return ["gc", _two_versions(w, "icechunk")]


def gc_delta_history_without_keep(w: World) -> list[Any]:
    return ["gc", _two_versions(w, "delta")]


def gc_a_folder_that_is_no_store(w: World) -> list[Any]:
    return ["gc", w.user_folder()]


def gc_a_missing_path(w: World) -> list[Any]:
    return ["gc", w.tmp / "none.icechunk"]


def gc_keep_zero(w: World) -> list[Any]:
    return ["gc", w.tmp / "none.icechunk", "--keep", "0"]


def gc_keep_not_a_number(w: World) -> list[Any]:
    return ["gc", w.tmp / "none.icechunk", "--keep", "all"]


def delta_onto_a_parquet_store(w: World) -> list[Any]:
    assert run("extract", w.job(w.tmp / "o.store", output={"format": "parquet"})
               ).exit_code == 0
    return ["extract", w.job(w.tmp / "o.store", output={"format": "delta"})]


def delta_incremental_onto_a_parquet_store(w: World) -> list[Any]:
    assert run("extract", w.job(w.tmp / "o.store", output={"format": "parquet"})
               ).exit_code == 0
    w.write_input([*TEXTS, "one more"])
    return ["extract", w.job(w.tmp / "o.store", output={"format": "delta"}), "--incremental"]


def delta_while_a_run_writes(w: World) -> list[Any]:
    job = w.job(w.tmp / "o.delta", output={"format": "delta"})
    assert run("extract", job).exit_code == 0
    w.write_input([*TEXTS, "one more"])
    _fake_lock(w.tmp / "o.delta", pid=os.getpid())
    return ["extract", job, "--incremental"]


def gc_delta_keep_zero(w: World) -> list[Any]:
    assert run("extract", w.job(w.tmp / "o.delta", output={"format": "delta"})).exit_code == 0
    return ["gc", w.tmp / "o.delta", "--keep", "0"]


def delta_store_with_a_damaged_log(w: World) -> list[Any]:
    job = w.job(w.tmp / "o.delta", output={"format": "delta"})
    assert run("extract", job).exit_code == 0
    newest = sorted((w.tmp / "o.delta" / "docs" / "_delta_log").glob("*.json"))[-1]
    newest.write_text("{not json")
    return ["extract", job]


def model_error_leaves_nothing(w: World) -> list[Any]:
    w.model = w.tmp / "no-pooler"  # a DistilBERT: no pooler weights
    return ["extract", w.job(w.tmp / "new" / "o.zarr", views={"p": {"pooling": "pooler"}})]


def dry_run_output_inside_input_folder(w: World) -> list[Any]:
    return [*output_inside_input_folder(w), "--dry-run"]


def dry_run_output_is_job_folder(w: World) -> list[Any]:
    return ["extract", w.job(w.tmp / "jobs"), "--dry-run"]


def dry_run_output_is_a_file(w: World) -> list[Any]:
    (w.tmp / "notes.zarr").write_text("not a store")
    return ["extract", w.job(w.tmp / "notes.zarr"), "--dry-run"]


def dry_run_foreign_folder_with_overwrite(w: World) -> list[Any]:
    return ["extract", w.job(w.user_folder()), "--overwrite", "--dry-run"]


def validate_output_inside_input_folder(w: World) -> list[Any]:
    return ["validate", *output_inside_input_folder(w)[1:]]


def output_parent_is_a_file(w: World) -> list[Any]:
    (w.tmp / "notes").write_text("a file where a folder would go")
    return ["extract", w.job(w.tmp / "notes" / "out" / "o.zarr")]


def validate_output_parent_is_a_file(w: World) -> list[Any]:
    return ["validate", *output_parent_is_a_file(w)[1:]]


def unlock_a_folder_that_is_no_store(w: World) -> list[Any]:
    return ["unlock", w.user_folder()]


def unlock_a_file(w: World) -> list[Any]:
    return ["unlock", w.src]


@dataclass(frozen=True)
class Row:
    setup: Callable[[World], list[Any]]
    code: int
    fragment: str


TABLE = [
    Row(overwrite_user_folder, 5, "is not a bertpipe store (it holds figures/, thesis.tex); "
        "--overwrite replaces only a bertpipe store or an empty folder"),
    Row(overwrite_key_user_folder, 5, "is not a bertpipe store"),
    Row(overwrite_dot, 5, "is the working directory"),
    Row(overwrite_symlink_to_user_folder, 5, "thesis exists and is not a bertpipe store"),
    Row(overwrite_input_file, 5, "is the input file"),
    Row(overwrite_input_folder, 5, "is the input folder"),
    Row(output_inside_input_folder, 5, "is inside the input folder"),
    Row(output_matched_by_input_glob, 5, "is matched by the input pattern"),
    Row(output_is_job_folder, 5, "is the job file's folder"),
    Row(output_holds_job_file, 5, "is the job file"),
    Row(output_is_a_file, 5, "is a file, not a bertpipe store"),
    Row(overwrite_foreign_zarr, 5, "is not a bertpipe store (it holds zarr.json)"),
    Row(resume_with_other_partition_rows, 5, "execution.partition_rows=8, this run asks for 4"),
    Row(resume_after_input_changed, 5, "holds an interrupted run, but input file"),
    Row(resume_after_input_grew, 5, "texts.parquet changed (rows 10 -> 11"),
    Row(complete_store_input_changed, 5, "is complete, but input file"),
    Row(complete_store_input_file_added, 5, "more.parquet is new"),
    # what differs from the store's job, named: a vector-defining key first
    Row(complete_store_of_another_view, 5, "holds output of a different job or model "
        "(views.mean.normalize: false → true); pass --overwrite to replace it"),
    Row(interrupted_run_of_another_chunking, 5, "(chunking.strategy: truncate → hierarchical; "
        "batching.max_batch_size: "),
    Row(complete_store_of_other_weights, 5, "(the same job keys: the model's weights differ)"),
    Row(moved_model, 5, "/moved); pass --overwrite"),
    Row(live_lock, 5, "is being written by another run (host"),
    Row(dead_lock_being_taken_over, 5, "is being taken over by another run (the lock of host"),
    Row(fresh_lock_of_another_host, 5, "is being written by another run (host elsewhere, pid 1"),
    Row(lock_refresh_not_a_number, 2, "BERTPIPE_LOCK_REFRESH_S: 'soon' is not a positive "
        "number of seconds"),
    Row(lock_refresh_zero, 2, "BERTPIPE_LOCK_REFRESH_S: '0' is not a positive number"),
    Row(unreadable_lock, 5, "is locked, but the lock file is unreadable; if no run is writing "
        "to it, clear the lock with `bertpipe unlock"),
    Row(unlock_live, 5, "still running on this host"),
    Row(model_error_leaves_nothing, 4, "pooler"),
    Row(dry_run_output_inside_input_folder, 5, "is inside the input folder"),
    Row(dry_run_output_is_job_folder, 5, "is the job file's folder"),
    Row(dry_run_output_is_a_file, 5, "is a file, not a bertpipe store"),
    Row(dry_run_foreign_folder_with_overwrite, 5, "is not a bertpipe store (it holds "
        "figures/, thesis.tex); --overwrite replaces only"),
    Row(validate_output_inside_input_folder, 5, "is inside the input folder"),
    Row(output_parent_is_a_file, 5, "output.path: cannot create"),
    Row(validate_output_parent_is_a_file, 5, "notes is a file, not a folder"),
    Row(unlock_a_folder_that_is_no_store, 5, "thesis: not a bertpipe store (it holds figures/, "
        "thesis.tex); nothing to unlock"),
    Row(unlock_a_file, 5, "texts.parquet: not a bertpipe store; nothing to unlock"),
    Row(gc_while_a_run_writes, 5, "o.icechunk is being written by another run (host"),
    Row(gc_delta_while_a_run_writes, 5, "o.delta is being written by another run (host"),
    Row(gc_delta_while_a_run_writes, 5, "; wait for it to finish, then run gc again"),
    Row(gc_icechunk_history_without_keep, 2, "--keep: "),
    Row(gc_icechunk_history_without_keep, 2, "o.icechunk keeps versions 0, 1; say how many "
        "to keep (gc --keep N keeps the newest N and deletes the others for good"),
    Row(gc_delta_history_without_keep, 2, "o.delta keeps versions 0, 1; say how many to keep"),
    Row(gc_a_folder_that_is_no_store, 5, "thesis: not a bertpipe store (it holds figures/, "
        "thesis.tex); nothing to collect"),
    Row(gc_a_missing_path, 5, "none.icechunk: no such store"),
    Row(gc_keep_zero, 2, "Invalid value for '--keep': 0 is not in the range x>=1"),
    Row(gc_keep_not_a_number, 2, "Invalid value for '--keep': 'all' is not a valid integer"),
    Row(delta_onto_a_parquet_store, 5, "holds output of a different job or model "
        "(output.format: parquet → delta)"),
    Row(delta_incremental_onto_a_parquet_store, 5, "was made with other output.format than "
        "this job"),
    Row(delta_while_a_run_writes, 5, "o.delta is being written by another run (host"),
    Row(gc_delta_keep_zero, 2, "Invalid value for '--keep': 0 is not in the range x>=1"),
    Row(delta_store_with_a_damaged_log, 5, "docs: damaged Delta table"),
    Row(lock_refresh_too_short, 2, "BERTPIPE_LOCK_REFRESH_S: '0.001' is out of range: the "
        "lock's refresh interval is 0.05 to 3600 seconds"),
    Row(lock_refresh_too_long, 2, "BERTPIPE_LOCK_REFRESH_S: '1e308' is out of range"),
    Row(lock_is_a_directory, 5, "_bertpipe.lock is a directory, not a lock file bertpipe "
        "wrote; nothing was changed"),
    Row(unlock_a_lock_that_is_a_directory, 5, "_bertpipe.lock is a directory, not a lock "
        "file bertpipe wrote; nothing was removed"),
    Row(calibration_cache_is_a_file, 4, "model.runtime: auto cannot write its calibration in "),
    Row(calibrate_cache_is_a_file, 4, "set BERTPIPE_CACHE_DIR to a writable folder"),
]


@pytest.mark.parametrize("row", TABLE, ids=[r.setup.__name__ for r in TABLE])
def test_table(row: Row, tmp_path: Path, tiny_bert: Path, tiny_distilbert: Path,
               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "no-pooler").symlink_to(tiny_distilbert, target_is_directory=True)
    (tmp_path / "tiny").symlink_to(tiny_bert, target_is_directory=True)
    world = World(tmp_path, tiny_bert, monkeypatch)
    world.write_input()
    args = row.setup(world)
    before = snapshot(tmp_path)
    result = run(*args)
    assert result.exit_code == row.code, result.output
    assert row.fragment in one_line_error(result)
    assert snapshot(tmp_path) == before  # refused means nothing changed


NOT_JOB_COMMANDS = ("gc_", "unlock_", "calibrate_")  # rows of a store command, not a job
JOB_ROWS = [r for r in TABLE if not r.setup.__name__.startswith(NOT_JOB_COMMANDS)]


@pytest.mark.parametrize("row", JOB_ROWS, ids=[r.setup.__name__ for r in JOB_ROWS])
def test_validate_dry_run_and_extract_agree(row: Row, tmp_path: Path, tiny_bert: Path,
                                            tiny_distilbert: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The row through `validate`, `extract --dry-run` and `extract`: every row here is
    refused before anything is written, so all three give its code and first words."""
    (tmp_path / "no-pooler").symlink_to(tiny_distilbert, target_is_directory=True)
    (tmp_path / "tiny").symlink_to(tiny_bert, target_is_directory=True)
    world = World(tmp_path, tiny_bert, monkeypatch)
    world.write_input()
    args = [str(a) for a in row.setup(world)]
    assert args[0] in ("validate", "extract"), args  # NOT_JOB_COMMANDS names the others
    before = snapshot(tmp_path)
    assert_agree(run_all(args), row.code, row.fragment, fails_while_running=False)
    assert snapshot(tmp_path) == before


def test_a_refused_gc_speaks_of_gc_not_of_a_job(tmp_path: Path, tiny_bert: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    args = gc_delta_while_a_run_writes(w)
    line = one_line_error(run(*args))
    assert line.startswith(f"error: {tmp_path / 'o.delta'} is being written by another run")
    assert "output.path" not in line  # gc has none


def _fake_lock(store: Path, pid: int, host: str | None = None, age_s: float = 0,
               refresh_s: float = 30.0) -> None:
    """A lock as a run leaves it, last refreshed `age_s` ago."""
    store.mkdir(parents=True, exist_ok=True)
    started = time.time() - age_s
    lock = store / LOCK_NAME
    lock.write_text(json.dumps({
        "host": host or socket.gethostname(), "pid": pid, "started_unix": started,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started)),
        "refreshed_unix": started, "refresh_s": refresh_s, "fingerprint": "f" * 64,
        "token": "e" * 32, "generation": 1, "process_start": _start_of(pid)}))
    os.utime(lock, (started, started))


def _start_of(pid: int) -> str | None:
    """The start time a run records of itself (None for a process that is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[19]
    except OSError:
        return None


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --- what follows a refusal: the way out the message names works ----------------------------

def test_resume_with_the_original_partitioning_is_identical_to_a_clean_run(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    job = w.job(tmp_path / "o.zarr")
    w.interrupted(job)
    refused = run("extract", job, "--set", "execution.partition_rows=4")
    assert refused.exit_code == 5, refused.output
    resumed = run("extract", job)
    assert resumed.exit_code == 0, resumed.output
    assert "skipped 1, run 1" in resumed.stdout
    assert run("extract", w.job(tmp_path / "clean.zarr", name="clean")).exit_code == 0
    assert_identical_stores(tmp_path / "o.zarr", tmp_path / "clean.zarr")


def test_overwrite_after_input_changed_rebuilds_from_the_new_input(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    job = w.job(tmp_path / "o.zarr")
    assert run("extract", job).exit_code == 0
    w.write_input(TEXTS + ["one more review"])
    assert run("extract", job).exit_code == 5
    result = run("extract", job, "--overwrite")
    assert result.exit_code == 0, result.output
    store = pipeline.open_store(tmp_path / "o.zarr")
    assert store.docs.sizes["doc"] == 11
    assert [f.rows for f in store.provenance.input_identity] == [11]
    before = snapshot(tmp_path)
    assert run("extract", job).stdout.startswith(f"{tmp_path / 'o.zarr'}: already complete")
    assert snapshot(tmp_path) == before  # a complete store is only read: not even locked


@pytest.mark.parametrize("fmt", ["zarr", "parquet"])
def test_overwrite_removes_only_the_stores_own_entries(fmt: str, tmp_path: Path,
                                                       tiny_bert: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    out = tmp_path / f"o.{fmt}"
    assert run("extract", w.job(out, output={"format": fmt})).exit_code == 0
    (out / "README.txt").write_text("my notes about this store")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    (out / "post").mkdir(exist_ok=True)
    (out / "post" / "link").symlink_to(elsewhere, target_is_directory=True)
    changed = w.job(out, output={"format": fmt}, views={"max": {"pooling": "max"}})
    result = run("extract", changed, "--overwrite")
    assert result.exit_code == 0, result.output
    assert (out / "README.txt").read_text() == "my notes about this store"
    assert (elsewhere / "keep.txt").read_text() == "keep"  # a link inside is not followed
    assert pipeline.open_store(out).views == ["max"]


def test_overwrite_through_a_symlink_to_a_store_replaces_the_store_and_keeps_the_link(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    real = tmp_path / "real.zarr"
    assert run("extract", w.job(real)).exit_code == 0
    link = tmp_path / "link.zarr"
    link.symlink_to(real, target_is_directory=True)
    result = run("extract", w.job(link, views={"max": {"pooling": "max"}}), "--overwrite")
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and pipeline.open_store(real).views == ["max"]


def test_empty_folder_is_used_and_lock_released_on_success_error_and_interrupt(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    out = tmp_path / "empty"
    out.mkdir()
    job = w.job(out)
    w.interrupted(job)
    assert not (out / LOCK_NAME).exists()
    assert run("extract", job, "--set", "execution.partition_rows=4").exit_code == 5
    assert not (out / LOCK_NAME).exists()
    assert run("extract", job).exit_code == 0
    assert not (out / LOCK_NAME).exists()
    assert sorted(p.name for p in out.iterdir()) == ["chunks", "docs", "zarr.json"]


def test_dead_holders_lock_is_taken_over_by_the_rerun_and_recorded(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run killed with SIGKILL leaves its lock; the same command, run again as a
    scheduler's retry would, takes it over (one log line, a line in the history) and
    resumes: no `bertpipe unlock` needed."""
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    job = w.job(tmp_path / "o.zarr")
    w.interrupted(job)
    _fake_lock(tmp_path / "o.zarr", pid=_dead_pid())  # as a killed run leaves it
    resumed = run("extract", job)
    assert resumed.exit_code == 0, resumed.output
    assert "skipped 1, run 1" in resumed.stdout
    took = [line for line in resumed.stderr.splitlines() if "took over" in line]
    assert len(took) == 1 and "is no longer running on this host" in took[0], resumed.stderr
    assert not (tmp_path / "o.zarr" / LOCK_NAME).exists()
    assert not list((tmp_path / "o.zarr").glob(f"{TAKEOVER_PREFIX}*"))  # claims go too
    history = pipeline.open_store(tmp_path / "o.zarr").provenance.history
    assert len(history) == 1 and "is no longer running on this host" in \
        history[0].took_over_lock
    assert "took over the lock of host" in run("inspect", tmp_path / "o.zarr").stdout
    clean = run("extract", w.job(tmp_path / "clean.zarr", name="clean"))
    assert clean.exit_code == 0, clean.output
    assert_identical_stores(tmp_path / "o.zarr", tmp_path / "clean.zarr")


def _process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat ("" once the process is reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return ""


NO_REAPER = Path(__file__).with_name("no_reaper.py")


def test_a_killed_run_left_a_zombie_by_a_parent_that_does_not_reap_is_taken_over_at_once(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container whose PID 1 does not reap: the real `bertpipe extract`, killed with
    SIGKILL mid-run, stays a zombie holding its pid. The rerun, at once, takes its lock over
    (a zombie runs nothing), resumes, and the store equals an uninterrupted run's (every run
    on one thread, as the killed one was: two threads differ in the last bit on some CPUs)."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    request_threads = torch.get_num_threads()
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input(TEXTS * 8)
    out = tmp_path / "o.zarr"
    job = w.job(out, execution={"scheduler": "synchronous", "partition_rows": 2})
    parent = subprocess.Popen([sys.executable, str(NO_REAPER), str(BIN / "bertpipe"),
                               "extract", str(job)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert parent.stdout is not None
        victim = int(parent.stdout.readline().split()[1])
        deadline = time.monotonic() + 120
        while not list(out.glob("_bertpipe/parts/*.done.json")):
            assert _process_state(victim) not in ("", "Z") and time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)
        while _process_state(victim) != "Z":
            time.sleep(0.01)
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == victim
        resumed = run("extract", job)
        assert _process_state(victim) == "Z"  # still unreaped all through the retry
    finally:
        parent.communicate("")  # the parent reaps and exits
    assert resumed.exit_code == 0, resumed.output
    assert f"took over the lock of host {socket.gethostname()}, pid {victim}" in \
        resumed.stderr and "is no longer running on this host" in resumed.stderr
    assert "skipped" in resumed.stdout and "skipped 0" not in resumed.stdout
    assert run("verify", out).exit_code == 0
    try:
        clean = run("extract", w.job(tmp_path / "clean.zarr", name="clean", execution={
            "scheduler": "synchronous", "partition_rows": 2}))
    finally:
        torch.set_num_threads(request_threads)
    assert clean.exit_code == 0, clean.output
    assert_identical_stores(out, tmp_path / "clean.zarr")


def test_lock_judging_zombies_and_exiting_processes_from_proc(tmp_path: Path) -> None:
    """What `alive` reads: a zombie is dead, a running process alive, a reused pid dead,
    and a lock without a start time is believed only for a Python or bertpipe process."""
    from pipeline.stores.lock import StoreLock

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen(["sleep", "60"])  # a program that is not a run of bertpipe's
    try:
        start = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[-1].split()[19]
        lock = StoreLock(tmp_path)
        for pid, process_start, alive in [(child.pid, start, True),
                                          (child.pid, str(int(start) + 1), False),
                                          (child.pid, None, True),
                                          (other.pid, None, False)]:
            record = {"host": socket.gethostname(), "pid": pid}
            if process_start is not None:
                record["process_start"] = process_start
            assert lock.live_here(record) is alive, (pid, process_start)
        child.kill()
        while _process_state(child.pid) != "Z":  # killed, not yet reaped
            time.sleep(0.01)
        assert not lock.live_here({"host": socket.gethostname(), "pid": child.pid,
                                   "process_start": start})
    finally:
        for process in (child, other):
            process.kill()
            process.wait()


def test_leases_are_judged_within_bounds_whatever_the_record_says(tmp_path: Path) -> None:
    """A record claiming a 1 ms interval does not make a run refreshed 0.1 s ago dead; one
    claiming 1e308 s does not make a day-old lock live for ever."""
    from pipeline.stores.lock import StoreLock

    _fake_lock(tmp_path, pid=1, host="elsewhere", age_s=0.1, refresh_s=0.001)
    assert StoreLock(tmp_path).state().kind == "live"
    _fake_lock(tmp_path, pid=1, host="elsewhere", age_s=86400, refresh_s=1e308)
    assert StoreLock(tmp_path).state().kind == "dead"


def test_unlock_clears_a_lock_naming_pid_1_without_a_start_time(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pid 1 of this host, recorded without a start time, is not a run of ours: `unlock`
    removes the lock instead of asking the user to stop their init process."""
    if any(name in Path("/proc/1/comm").read_text().lower() for name in ("python", "bertpipe")):
        pytest.skip("this machine's pid 1 is a Python program: it could be a run of ours")
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    assert run("extract", w.job(tmp_path / "o.zarr")).exit_code == 0
    _fake_lock(tmp_path / "o.zarr", pid=1)
    record = json.loads((tmp_path / "o.zarr" / LOCK_NAME).read_text())
    record.pop("process_start")
    (tmp_path / "o.zarr" / LOCK_NAME).write_text(json.dumps(record))
    done = run("unlock", tmp_path / "o.zarr")
    assert done.exit_code == 0 and "removed the lock of pid 1" in done.stdout, done.output
    assert not (tmp_path / "o.zarr" / LOCK_NAME).exists()


def test_expired_lease_of_another_host_is_taken_over_a_fresh_one_is_not(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another host's holder cannot be asked whether it lives: its lease decides. Fresh:
    refused, nothing changed. Past two missed refreshes: the run waits for the lease to
    end, then takes over. Past the lease: taken over at once."""
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    job = w.job(tmp_path / "o.zarr")
    _fake_lock(tmp_path / "o.zarr", pid=1, host="elsewhere", age_s=0.1, refresh_s=1.0)
    before = snapshot(tmp_path)
    assert run("extract", job).exit_code == 5
    assert snapshot(tmp_path) == before
    _fake_lock(tmp_path / "o.zarr", pid=1, host="elsewhere", age_s=2.5, refresh_s=1.0)
    waited = run("extract", job)
    assert waited.exit_code == 0, waited.output
    assert "waiting up to 2" in waited.stderr and "its lease expired" in waited.stderr
    history = pipeline.open_store(tmp_path / "o.zarr").provenance.history
    assert "host elsewhere, pid 1" in history[0].took_over_lock
    # taken over only once the lease (5 s) had ended, by the lock's own clock
    idle = re.search(r"not refreshed for (\d+) s, lease 5 s", history[0].took_over_lock)
    assert idle and int(idle[1]) >= 5, history[0].took_over_lock
    _fake_lock(tmp_path / "o.zarr", pid=1, host="elsewhere", age_s=3600, refresh_s=30)
    before = snapshot(tmp_path)
    done = run("extract", job)  # a complete store is only read: its dead lock stays
    assert done.exit_code == 0 and "already complete" in done.stdout, done.output
    assert snapshot(tmp_path) == before


def test_store_lock_is_atomic_and_release_spares_anothers(tmp_path: Path) -> None:
    from pipeline.errors import StoreError
    from pipeline.stores.lock import StoreLock

    first, second = StoreLock(tmp_path), StoreLock(tmp_path)
    first.acquire("a" * 64)
    with pytest.raises(StoreError, match=f"pid {os.getpid()}.*job aaaaaaaaaaaa"):
        second.acquire("b" * 64)
    second.release()  # never acquired: must not remove the first's lock
    assert first.holder() is not None
    first.release()
    assert first.holder() is None
    second.acquire("b" * 64)
    first.release()  # released already: must not remove the second's lock
    assert (second.holder() or {}).get("fingerprint") == "b" * 64
    second.release()
    assert sorted(tmp_path.iterdir()) == []


def test_held_lock_is_refreshed_so_a_long_run_never_looks_stale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.stores import lock as lock_module

    monkeypatch.setenv(lock_module.REFRESH_ENV, "0.05")
    held = lock_module.StoreLock(tmp_path)
    held.acquire("a" * 64)
    assert (held.holder() or {}).get("refresh_s") == 0.05  # readers judge by the holder's
    old = time.time() - 3600
    os.utime(held.path, (old, old))  # as if the run had stopped refreshing long ago
    assert held.state().kind == "dead"
    deadline = time.monotonic() + 10
    while held.path.stat().st_mtime < time.time() - 60:
        assert time.monotonic() < deadline, "the holder did not refresh its lock"
        time.sleep(0.02)
    assert held.state().kind == "live"
    held.release()
    assert not held.path.exists()


def test_runs_racing_for_one_dead_lock_exactly_one_takes_it(tmp_path: Path) -> None:
    import threading

    from pipeline.errors import StoreError
    from pipeline.stores.lock import StoreLock

    for _ in range(5):
        _fake_lock(tmp_path, pid=_dead_pid())
        locks = [StoreLock(tmp_path) for _ in range(6)]
        start = threading.Barrier(len(locks))
        outcomes: list[str] = []

        def take(lock: StoreLock, start: threading.Barrier = start,
                 outcomes: list[str] = outcomes) -> None:
            start.wait()
            try:
                lock.acquire("b" * 64)
                outcomes.append("held")
            except StoreError as exc:
                outcomes.append(str(exc))

        threads = [threading.Thread(target=take, args=(lock,)) for lock in locks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        holders = [lock for lock in locks if lock.token is not None]
        assert len(holders) == 1 and outcomes.count("held") == 1, outcomes
        assert (holders[0].holder() or {}).get("token") == holders[0].token
        assert (holders[0].holder() or {}).get("generation") == 2
        holders[0].release()
        assert sorted(tmp_path.iterdir()) == []  # lock and claim gone


def test_a_holder_taken_over_while_paused_writes_and_removes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fencing in one process: the first holder stops refreshing (paused), the second takes
    over after the lease; the first's checks then refuse, and its release spares the
    second's lock."""
    from pipeline.stores import lock as lock_module
    from pipeline.stores.lock import LockLostError, StoreLock
    from pipeline.stores.staging import Staging

    monkeypatch.setenv(lock_module.REFRESH_ENV, "3600")  # the first never refreshes here
    first = StoreLock(tmp_path)
    first.acquire("a" * 64)
    staging = Staging(tmp_path, fence=first.fence())
    staging.confirm("commit")  # held: no error
    monkeypatch.setenv(lock_module.REFRESH_ENV, "0.05")
    old = time.time() - 6 * 3600
    os.utime(first.path, (old, old))  # past its lease
    second = StoreLock(tmp_path)
    second.acquire("b" * 64)
    assert "its lease expired" in second.took_over
    with pytest.raises(LockLostError, match="taken over by another run after its lease "
                       "expired .now held by host .*; this run will not commit"):
        staging.confirm("commit")
    with pytest.raises(LockLostError):
        first.confirm("replace the store")
    with pytest.raises(LockLostError, match="will not write partition 0"):
        staging.write_tables(0, {})
    with pytest.raises(LockLostError, match="will not commit partition 0"):  # the commit's
        next(Staging(tmp_path, fence=first.fence()).read_parts("docs", [0]))  # loop too
    assert not list(tmp_path.glob("_bertpipe/parts/*"))
    first.release()
    assert (second.holder() or {}).get("token") == second.token
    second.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_older_store_without_input_identity_is_not_called_complete(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    job = w.job(tmp_path / "o.zarr")
    assert run("extract", job).exit_code == 0
    from pipeline.stores import detect_format

    fmt = detect_format(str(tmp_path / "o.zarr"))
    raw = dict(fmt.record() or {})
    raw.pop("input_identity")
    fmt.write_record(raw)
    assert pipeline.open_store(tmp_path / "o.zarr").provenance.input_identity == ()
    assert "does not record the identity of its input" in one_line_error(run("extract", job))


def test_input_identity_is_the_footer(tmp_path: Path) -> None:
    from pipeline.extract.source import file_identity

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["apple", "bread", "cider"]}), path)
    first = file_identity(str(path))
    data = path.read_bytes()
    footer = pq.ParquetFile(path).metadata.serialized_size  # the footer's length, by pyarrow
    assert first.rows == 3 and first.size == len(data)
    assert first.footer_sha256 == hashlib.sha256(data[-8 - footer:-8]).hexdigest()
    pq.write_table(pa.table({"text": ["apple", "bread", "cidex"]}), path)  # same size
    assert path.stat().st_size == len(data) and file_identity(str(path)) != first


# --- two writers, a scheduler that is not there, the same codes on every executor -------------

def _cli(*args: str | Path, env: dict[str, str] | None = None, **kw: Any
         ) -> subprocess.Popen[str]:
    return subprocess.Popen([str(BIN / "bertpipe"), *map(str, args)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, **kw)


def test_two_concurrent_runs_one_proceeds_and_its_store_is_exact(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real `bertpipe extract` process holds the store (paused mid-run); a second run,
    from this process, is refused naming it; the first then finishes as a clean run would."""
    import torch

    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input(TEXTS * 4)
    out = tmp_path / "o.zarr"
    job = w.job(out)
    first = _cli("extract", job)
    try:
        deadline = time.monotonic() + 120
        while not (out / LOCK_NAME).exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)  # hold the first mid-run, lock taken
        before = snapshot(tmp_path)
        second = run("extract", job)
        assert second.exit_code == 5, second.output
        assert f"is being written by another run (host {socket.gethostname()}, pid " \
               f"{first.pid}," in one_line_error(second)
        assert snapshot(tmp_path) == before
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert not (out / LOCK_NAME).exists()
    # the clean run sums in the same order as the first: one thread, as the first process
    # was given (the encoder sizes its threads to the allotment, OMP_NUM_THREADS included;
    # two threads differ in the last bit on some CPUs)
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        assert run("extract", w.job(tmp_path / "clean.zarr", name="clean")).exit_code == 0
    finally:
        torch.set_num_threads(threads)
    assert_identical_stores(out, tmp_path / "clean.zarr")


def test_holder_paused_past_its_lease_is_fenced_off(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The classic lease failure: a real `bertpipe extract` is paused (SIGSTOP) past its
    lease; a second run takes the store over and finishes; the first, continued (SIGCONT),
    must exit 5 without writing or removing anything, and the store is the second run's."""
    from pipeline.stores.lock import REFRESH_ENV

    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input(TEXTS * 4)
    out = tmp_path / "o.zarr"
    job = w.job(out, execution={"scheduler": "synchronous", "partition_rows": 4})
    first = _cli("extract", job, env={REFRESH_ENV: "0.2"})  # lease: 5 x 0.2 s
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("_bertpipe/parts/*.done.json")):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)  # mid-run: the lock held, a partition written
        time.sleep(1.5)  # past its lease
        monkeypatch.setenv(REFRESH_ENV, "0.2")
        second = run("extract", job)
        assert second.exit_code == 0, second.output
        assert f"took over the lock of host {socket.gethostname()}, pid {first.pid}" in \
            second.stderr and "its lease expired" in second.stderr
        after_second = snapshot(tmp_path)
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 5, err
    assert "lock was taken over by another run after its lease expired" in err
    # the first removed nothing and changed nothing of the store. What it may have left in
    # the staging folder is the one partition it was on when paused: its part files, and its
    # marker too if the pause fell between its last fencing check and that write (a check
    # then a write, on a file system that has no conditional write); then the next check
    # stops it
    after_first = snapshot(tmp_path)
    assert {k: v for k, v in after_first.items() if "/_bertpipe" not in k} == after_second
    assert len(list(out.glob("_bertpipe/parts/*.done.json"))) <= 1
    assert run("verify", out).exit_code == 0
    assert f"pid {first.pid}" in pipeline.open_store(out).provenance.history[0].took_over_lock
    clean = run("extract", w.job(tmp_path / "clean.zarr", name="clean",
                                 execution={"scheduler": "synchronous", "partition_rows": 4}))
    assert clean.exit_code == 0, clean.output
    assert_identical_stores(out, tmp_path / "clean.zarr")
    # such a leftover is harmless: a rerun over the store (which may resume from it, being
    # of the same job) gives the store a clean run gives
    again = run("extract", job, "--overwrite")
    assert again.exit_code == 0, again.output
    assert_identical_stores(out, tmp_path / "clean.zarr")


def test_unreachable_scheduler_is_one_line_exit_7_and_leaves_nothing(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a free port that nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    job = w.job(tmp_path / "out" / "o.zarr")
    before = snapshot(tmp_path)
    proc = _cli("extract", job, "--scheduler", address)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 7, err
    line = one_line_error(subprocess.CompletedProcess([], 7, "", err))
    assert line == (f"error: execution.scheduler: cannot reach the Dask scheduler at {address} "
                    "(Connection refused)")
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_silent_scheduler_times_out_as_one_line_exit_7(tmp_path: Path, tiny_bert: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Something listens but never speaks Dask: the client's timeout, then the same line."""
    import dask
    import distributed  # noqa: F401 - its config defaults in place before the set() below

    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    job = w.job(tmp_path / "o.zarr")
    with socket.socket() as silent, dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        result = run("extract", job, "--scheduler", address)
    assert result.exit_code == 7, result.output
    assert f"cannot reach the Dask scheduler at {address} (no answer within 1 s" \
        in one_line_error(result)
    assert not (tmp_path / "o.zarr").exists()


@pytest.mark.parametrize("views,model,code,fragment", [
    ({"deep": {"layers": [5], "pooling": "mean"}}, "bert", 2, "views.deep.layers"),
    ({"p": {"pooling": "pooler"}}, "distilbert", 4, "pooling pooler"),
])
def test_model_errors_have_the_same_code_in_process_and_on_the_local_cluster(
        views: dict[str, Any], model: str, code: int, fragment: str, tmp_path: Path,
        tiny_bert: Path, tiny_distilbert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, tiny_bert if model == "bert" else tiny_distilbert, monkeypatch)
    w.write_input()
    for scheduler in ("synchronous", "local"):
        job = w.job(tmp_path / f"{scheduler}.zarr", views=views, name=scheduler,
                    execution={"scheduler": scheduler, "workers": 1, "threads_per_worker": 1})
        result = run("extract", job)
        assert result.exit_code == code, (scheduler, result.output)
        assert fragment in one_line_error(result)
        assert not (tmp_path / f"{scheduler}.zarr").exists()


def test_partition_errors_are_reported_alike_in_process_and_on_the_local_cluster(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, tiny_bert, monkeypatch)
    ids: list[int | None] = list(range(20))
    ids[13] = None
    source = tmp_path / "ids.parquet"
    # no footer statistics: the null id is found only when its partition reads its rows
    pq.write_table(pa.table({"id": ids, "text": ["good drug"] * 20}), source,
                   write_statistics=False)
    lines = {}
    for scheduler in ("synchronous", "local"):
        job = w.job(tmp_path / f"{scheduler}.zarr", source=source, name=scheduler,
                    execution={"scheduler": scheduler, "workers": 1, "threads_per_worker": 1})
        result = run("extract", job)
        assert result.exit_code == 6, (scheduler, result.output)
        lines[scheduler] = one_line_error(result)
    assert lines["synchronous"] == lines["local"]
    assert "partition 1 (rows 8-15" in lines["local"] and "null id" in lines["local"]


# --- unattended runs: what the environment refuses is one line with its code ----------------

def test_output_folder_without_permission_is_refused_before_anything(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    locked = tmp_path / "locked"
    locked.mkdir()
    job = w.job(locked / "new" / "o.zarr")
    if os.geteuid() == 0:  # root may write anywhere: the folder's refusal, as the OS says it
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != locked
                            and real_access(path, mode, **kw))
    else:
        locked.chmod(0o555)
    try:
        before = snapshot(tmp_path)
        result = run("extract", job)
    finally:
        locked.chmod(0o755)
    assert result.exit_code == 5, result.output
    assert one_line_error(result) == (f"error: output.path: cannot create {locked}/new/o.zarr: "
                                      f"no permission to write in {locked}")
    assert snapshot(tmp_path) == before


def _limited_file_size(limit: int) -> Callable[[], None]:
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(
            resource.RLIMIT_FSIZE)[1]))
    return apply


def test_full_disk_during_the_commit_is_one_line_and_a_rerun_completes(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file-size limit that lets every 500-row partition be staged but not the commit's
    whole arrays (3,000 x 32 floats): what a disk that fills up during the commit does."""
    w = World(tmp_path, tiny_bert, monkeypatch)
    texts = [f"the drug worked very well and the pain was gone {i}" for i in range(3000)]
    w.write_input(texts)
    out = tmp_path / "o.zarr"
    job = w.job(out, views={"mean": {"pooling": "mean"}},
                execution={"partition_rows": 500})
    proc = subprocess.Popen([str(BIN / "bertpipe"), "-q", "extract", str(job)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=_limited_file_size(128 * 1024))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 5, err
    line = one_line_error(subprocess.CompletedProcess([], 5, "", err))
    assert line == (f"error: output.path: {out}: the disk is full or the file is too large "
                    "(File too large); the store is left incomplete: free space (or raise the "
                    "file size limit) and rerun, the rerun resumes")
    from pipeline.errors import StoreError

    with pytest.raises(StoreError, match="store is incomplete"):
        pipeline.open_store(out)
    rerun = run("extract", job)
    assert rerun.exit_code == 0, rerun.output
    assert "partitions skipped 6, run 0" in rerun.stdout  # every staged partition kept
    assert run("verify", out).exit_code == 0
    assert pipeline.open_store(out).docs.sizes["doc"] == 3000


@pytest.fixture
def http_server() -> Any:
    """An HTTP server on loopback (as `python -m http.server`), and the requests it got."""
    import http.server

    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def handle_one_request(self) -> None:
            super().handle_one_request()
            if self.raw_requestline:  # bytes sent (a probe that only connects sends none)
                requests.append(self.raw_requestline.decode(errors="replace"))

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with served(server) as port:
        yield f"tcp://127.0.0.1:{port}", requests


def test_a_port_that_speaks_http_is_no_scheduler(http_server: Any, tmp_path: Path,
                                                  tiny_bert: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An HTTP server waits for a request; Dask's client would send its greeting and read
    the HTTP answer as a frame length of exabytes. The greeting is never sent."""
    import dask
    import distributed  # noqa: F401 - its config defaults in place before the set() below

    address, requests = http_server
    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    job = w.job(tmp_path / "o.zarr")
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        result = run("extract", job, "--scheduler", address)
    assert result.exit_code == 7, result.output
    assert f"cannot reach the Dask scheduler at {address} (no answer within 1 s: something " \
           "listens there but does not greet as a Dask scheduler does" in one_line_error(result)
    assert requests == []  # nothing was sent to it: no Dask client talked to it
    assert not (tmp_path / "o.zarr").exists()


def test_a_port_that_greets_otherwise_is_no_scheduler(tmp_path: Path, tiny_bert: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    job = w.job(tmp_path / "o.zarr")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"

        def greet() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                conn.recv(1)  # until the client closes

        threading.Thread(target=greet, daemon=True).start()
        result = run("extract", job, "--scheduler", address)
    assert result.exit_code == 7, result.output
    assert one_line_error(result) == (f"error: execution.scheduler: {address} is not a Dask "
                                      "scheduler (it answered b'SSH-2.0-OpenSSH_'); check the "
                                      "host and port")
    assert not (tmp_path / "o.zarr").exists()


def test_a_rerun_of_a_complete_store_verifies_it_once(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks verify a complete store before the run says "already complete"; the run
    takes their answer, not a second read of every checksum."""
    from pipeline.stores import verify

    w = World(tmp_path, tiny_bert, monkeypatch)
    w.write_input()
    job = w.job(tmp_path / "o.zarr")
    assert run("extract", job).exit_code == 0
    calls: list[str] = []
    real = verify.verify_store

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(str(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(verify, "verify_store", counted)
    again = run("extract", job)
    assert again.exit_code == 0 and "already complete" in again.stdout, again.output
    assert len(calls) == 1, calls
