"""Another writer's commit on a versioned store is never undone: the nightly update, `gc`
and `verify` refuse a Delta table or an Icechunk branch whose newest commit another tool
made (exit 5, one line naming the commit and the way out), and change nothing.

Oracles: the other tool's own reads (deltalake's table, Icechunk's branch and ancestry),
taken before and after each bertpipe command, and every file of the store byte for byte.
The other tools write through their own libraries (`write_deltalake`, `DeltaTable.delete`,
an Icechunk session), as a notebook would.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import icechunk
import numpy as np
import pyarrow as pa
import pytest
import zarr
from click.testing import CliRunner
from deltalake import DeltaTable, write_deltalake

import pipeline
from pipeline.cli import main
from pipeline.run.runner import run_job
from pipeline.spec import Job
from pipeline.stores import detect_format
from pipeline.stores.verify import verify_store
from tests.conftest import job_dict, write_job, write_table

TEXTS = ["the drug worked very well", "bad side effects, no sleep for a week", "great",
         "my doctor said it is not good for pain and sleep", "yes", "the day was good",
         "it worked. then it did not. then the pain was terrible!", "pain pain pain"]
NEW = ["a text of the next night", "and one more of it"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> dict[str, Path]:
    """One complete store per versioned format (version 0, built once), and the input of
    the next night (a text edited, two new rows) at `input`."""
    root = tmp_path_factory.mktemp("foreign")
    first = write_table(root / "in.parquet", {"id": [f"r{i}" for i in range(len(TEXTS))],
                                              "text": TEXTS})
    edited = [*TEXTS[:1], "an edited text", *TEXTS[2:]]  # its old file is retired
    write_table(root / "next.parquet", {"id": [f"r{i}" for i in range(len(TEXTS) + 2)],
                                        "text": edited + NEW})
    stores = {"input": root / "next.parquet"}
    for fmt in ("delta", "icechunk"):
        out = root / f"s.{fmt}"
        run_job(Job.from_dict(job_dict(first, tiny_bert, out, output={"format": fmt})))
        stores[fmt] = out
    return stores


def _copy(built: dict[str, Path], fmt: str, tmp_path: Path, tiny_bert: Path
          ) -> tuple[Path, Path]:
    """A copy of the built store and the job file of the nightly update into it."""
    store = tmp_path / built[fmt].name
    shutil.copytree(built[fmt], store)
    job = job_dict(built["input"], tiny_bert, store,
                   output={"format": fmt, "incremental": True})
    return store, write_job(tmp_path / "job.yaml", job)


def _files(store: Path) -> dict[str, str]:
    return {str(f.relative_to(store)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(store.rglob("*")) if f.is_file()}


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout + result.stderr


def _refused_everywhere(store: Path, job: Path, fragments: list[str]) -> None:
    """The update, gc and verify each exit 5 with one line holding every fragment, and
    leave every file of the store as it was."""
    before = _files(store)
    for args in (["extract", str(job)], ["gc", str(store), "--keep", "1"],
                 ["verify", str(store)]):
        code, output = _cli(*args)
        assert code == 5, (args, output)
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in output, output
        for fragment in fragments:
            assert fragment in errors[0], (args, fragment, errors[0])
    assert _files(store) == before


# ---------------------------------------------------------------- Delta


def _docs(store: Path) -> DeltaTable:
    return DeltaTable(str(store / "docs"))


def _append_rows(store: Path) -> None:
    table = _docs(store)
    rows = table.to_pyarrow_table().sort_by("row").slice(0, 3)
    rows = rows.set_column(0, "row", pa.array([100, 101, 102], pa.int64()))
    rows = rows.set_column(1, "id", pa.array(["x1", "x2", "x3"]))
    write_deltalake(table, rows, mode="append")


def _add_column(store: Path) -> None:
    table = _docs(store)
    rows = table.to_pyarrow_table().slice(0, 1)
    rows = rows.set_column(1, "id", pa.array(["x9"])).append_column("note", pa.array(["mine"]))
    write_deltalake(table, rows, mode="append", schema_mode="merge")


def _delete(store: Path) -> None:
    _docs(store).delete("id = 'r3'")


def _append_chunks(store: Path) -> None:
    table = DeltaTable(str(store / "chunks"))
    rows = table.to_pyarrow_table().slice(0, 1)
    rows = rows.set_column(rows.column_names.index("doc"), "doc", pa.array([100], pa.int64()))
    write_deltalake(table, rows, mode="append")


DELTA: dict[str, tuple[Callable[[Path], None], str]] = {
    "append rows": (_append_rows, "docs version 2 (WRITE, by delta-rs"),
    "add a column": (_add_column, "docs version 2 (WRITE, by delta-rs"),
    "delete rows": (_delete, "docs version 2 (DELETE, by delta-rs"),
    "append chunks": (_append_chunks, "chunks version 1 (WRITE, by delta-rs"),
}


@pytest.mark.parametrize("action", list(DELTA))
def test_delta_another_writers_commit_is_refused_never_rolled_back(
        built: dict[str, Path], tmp_path: Path, tiny_bert: Path, action: str) -> None:
    """Before: the update exited 0, its RESTORE dropped the other tool's rows or column and
    gc vacuumed their files; verify said OK."""
    store, job = _copy(built, "delta", tmp_path, tiny_bert)
    damage, named = DELTA[action]
    damage(store)
    level = "chunks" if "chunks" in action else "docs"
    theirs = DeltaTable(str(store / level))
    seen = (theirs.version(), theirs.to_pyarrow_table().sort_by(
        "row" if level == "docs" else "doc"))
    back = f"DeltaTable('{store / level}').restore({1 if level == 'docs' else 0})"
    _refused_everywhere(store, job, [named, "another writer's commit", back, "--overwrite"])
    after = DeltaTable(str(store / level))
    assert after.version() == seen[0]
    assert after.to_pyarrow_table().sort_by("row" if level == "docs" else "doc"
                                            ).equals(seen[1])


def test_delta_the_way_out_given_back_then_updated(
        built: dict[str, Path], tmp_path: Path, tiny_bert: Path) -> None:
    """The message's way out: the table restored by its owner (a commit that is not
    bertpipe's, leaving the table as bertpipe left it) is bertpipe's again; a vacuum by
    another tool changes no table either. The update then publishes version 1."""
    store, job = _copy(built, "delta", tmp_path, tiny_bert)
    _append_rows(store)
    _docs(store).restore(1)
    DeltaTable(str(store / "chunks")).vacuum(retention_hours=0, dry_run=False,
                                             enforce_retention_duration=False)
    assert detect_format(str(store)).foreign_commits() == []
    code, output = _cli("extract", str(job))
    assert code == 0, output
    assert verify_store(store) == []
    assert pipeline.open_store(store).docs["id"].values.tolist() == \
        [f"r{i}" for i in range(len(TEXTS) + 2)]


def test_delta_gc_commits_carry_bertpipes_marker(
        built: dict[str, Path], tmp_path: Path, tiny_bert: Path) -> None:
    """gc's vacuum commits are bertpipe's (each carries bertpipe_version), so a store gc
    ran on is never taken for another writer's."""
    store, job = _copy(built, "delta", tmp_path, tiny_bert)
    assert _cli("extract", str(job))[0] == 0
    code, output = _cli("gc", str(store), "--keep", "1")
    assert code == 0 and "expired versions 0" in output, output
    vacuums = [c for level in ("docs", "chunks")
               for c in DeltaTable(str(store / level)).history()
               if str(c["operation"]).startswith("VACUUM")]
    assert vacuums and all(c.get("bertpipe_version") == 1 for c in vacuums)
    assert detect_format(str(store)).foreign_commits() == []


# ---------------------------------------------------------------- Icechunk


def _repository(store: Path) -> icechunk.Repository:
    return icechunk.Repository.open(icechunk.local_filesystem_storage(str(store / "repo")))


def _ice_commit(store: Path, change: Callable[[Any], None]) -> str:
    """A commit by another process through Icechunk itself, naming its author."""
    session = _repository(store).writable_session("main")
    change(zarr.open_group(session.store, mode="a", use_consolidated=False))
    return session.commit("a notebook's edit", metadata={"author": "ana"})


def _new_array(root: Any) -> None:
    root.create_array("theirs", shape=(3,), dtype="int64")[...] = np.arange(3)


ICECHUNK: dict[str, Callable[[Any], None]] = {
    "an attribute": lambda root: root["docs"].update_attributes({"note": "mine"}),
    "a new array": _new_array,
    "changed values": lambda root: root["docs"]["n_tokens"].__setitem__(0, 999),
}


@pytest.mark.parametrize("action", list(ICECHUNK))
def test_icechunk_another_writers_commit_is_refused_never_built_on(
        built: dict[str, Path], tmp_path: Path, tiny_bert: Path, action: str) -> None:
    """Before: the update built on the other process's snapshot (exit 0 over an attribute
    change; a new array left unrecorded; changed values named as damage) and gc expired
    history around it."""
    store, job = _copy(built, "icechunk", tmp_path, tiny_bert)
    ours = _repository(store).lookup_branch("main")
    theirs = _ice_commit(store, ICECHUNK[action])
    ancestry = [s.id for s in _repository(store).ancestry(branch="main")]
    _refused_everywhere(store, job, [
        f"branch main snapshot {theirs} (\"a notebook's edit\", by ana)",
        f"repo.create_branch('kept', '{theirs}')", f"repo.reset_branch('main', '{ours}')"])
    assert [s.id for s in _repository(store).ancestry(branch="main")] == ancestry


def test_icechunk_the_way_out_kept_on_a_branch_then_updated(
        built: dict[str, Path], tmp_path: Path, tiny_bert: Path) -> None:
    store, job = _copy(built, "icechunk", tmp_path, tiny_bert)
    ours = _repository(store).lookup_branch("main")
    theirs = _ice_commit(store, _new_array)
    repo = _repository(store)
    repo.create_branch("kept", theirs)
    repo.reset_branch("main", ours)
    code, output = _cli("extract", str(job))
    assert code == 0, output
    assert verify_store(store) == []
    code, output = _cli("gc", str(store), "--keep", "1")
    assert code == 0, output
    kept = zarr.open_group(_repository(store).readonly_session(branch="kept").store,
                           mode="r", use_consolidated=False)
    np.testing.assert_array_equal(kept["theirs"][...], np.arange(3))  # gc kept theirs
