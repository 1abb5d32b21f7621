"""An Icechunk update taken over while paused writes no chunk object, and `gc` clears the
orphans of runs that never committed.

Icechunk stores a chunk object as soon as a session sets it, long before the commit: a run
that goes on writing after another took its lock over leaves objects no snapshot refers
to. Oracles: the repository's own folder of chunk objects, listed before and after, and
Icechunk's reads of every kept version.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import icechunk
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr
from click.testing import CliRunner

import pipeline
from pipeline.cli import main
from pipeline.run.runner import run_job
from pipeline.spec import Job
from pipeline.stores import icechunk_store
from pipeline.stores import lock as lock_module
from pipeline.stores.lock import LOCK_NAME, LockLostError, StoreLock
from pipeline.stores.verify import verify_store
from tests.conftest import REVIEWS, job_dict


def _input(path: Path, n: int) -> Path:
    texts = pq.read_table(REVIEWS).column("text").to_pylist()
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)],
                             "text": [f"{texts[i][:150]} ({i})" for i in range(n)]}), path)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> Path:
    """A complete Icechunk store of 40 rows (version 0), built once."""
    root = tmp_path_factory.mktemp("orphans")
    store = root / "s.icechunk"
    run_job(Job.from_dict(job_dict(_input(root / "in.parquet", 40), tiny_bert, store,
                                   output={"format": "icechunk"})))
    return store


def _job(store: Path, tiny_bert: Path, rows: int) -> Job:
    """The nightly update into `store`: `rows` rows (40 of them already stored)."""
    source = _input(store.parent / "next.parquet", rows)
    return Job.from_dict(job_dict(source, tiny_bert, store,
                                  output={"format": "icechunk", "incremental": True}))


def _objects(store: Path) -> set[str]:
    """Every object of the repository: chunks, manifests, snapshots, transactions."""
    return {p.relative_to(store / "repo").as_posix() for p in (store / "repo").rglob("*")
            if p.is_file()}


def _take_over(store: Path, monkeypatch: pytest.MonkeyPatch) -> StoreLock:
    """Another run takes the store's lock over, as after this one's lease expired."""
    old = time.time() - 6 * 3600
    os.utime(store / LOCK_NAME, (old, old))
    monkeypatch.setenv(lock_module.REFRESH_ENV, "0.05")
    other = StoreLock(store)
    other.acquire("b" * 64)
    assert "its lease expired" in other.took_over
    return other


def test_a_run_taken_over_before_it_writes_its_chunks_writes_none(
        built: Path, tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """The update is taken over between its last check before writing and its first
    chunk (a pause there): it stops, exit 5, before any chunk object is stored. Before,
    it wrote the new version's chunks (orphans: nothing commits them) and only then
    stopped at the commit."""
    store = tmp_path / built.name
    shutil.copytree(built, store)
    before = _objects(store)
    others: list[StoreLock] = []
    original = icechunk_store.IcechunkFormat.write_streamed_version

    def paused(self: Any, version: int, streamed: Any) -> None:
        others.append(_take_over(store, monkeypatch))
        original(self, version, streamed)

    monkeypatch.setattr(icechunk_store.IcechunkFormat, "write_streamed_version", paused)
    with pytest.raises(LockLostError, match="will not write the new version") as raised:
        run_job(_job(store, tiny_bert, 90), incremental=True)
    assert raised.value.exit_code == 5
    assert _objects(store) == before
    (other,) = others
    assert (other.holder() or {}).get("token") == other.token  # its lock left alone
    other.release()
    assert verify_store(store) == []


def _orphans(store: Path) -> set[str]:
    """What a run killed before its commit leaves: chunk objects of a session that never
    committed (new rows of a view, written through Icechunk itself)."""
    before = _objects(store)
    repo = icechunk.Repository.open(icechunk.local_filesystem_storage(str(store / "repo")))
    session = repo.writable_session("main")
    mean = zarr.open_group(session.store, mode="a", use_consolidated=False)["docs"]["mean"]
    mean.resize((mean.shape[0] + 600, mean.shape[1]))
    mean[-600:] = np.random.default_rng(0).random((600, mean.shape[1]), np.float32)
    del session  # killed: never committed
    orphans = _objects(store) - before
    assert len([o for o in orphans if o.startswith("chunks/")]) >= 2
    return orphans


def test_gc_clears_orphan_chunks_old_enough_and_keeps_younger_ones(
        built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing to expire, gc still deletes the objects no snapshot refers to, once
    they are ORPHAN_AGE_S old (younger ones may be another process's session not yet
    committed); every version stays readable and verified."""
    store = tmp_path / built.name
    shutil.copytree(built, store)
    kept = _objects(store)
    vectors = pipeline.open_store(store).vectors("mean")
    orphans = _orphans(store)
    result = CliRunner().invoke(main, ["gc", str(store), "--keep", "1"])
    assert result.exit_code == 0, result.output
    assert _objects(store) == kept | orphans  # young: left alone
    assert "nothing to expire (versions kept: 0)" in result.stdout
    monkeypatch.setattr(icechunk_store, "ORPHAN_AGE_S", 0.0)
    result = CliRunner().invoke(main, ["gc", str(store), "--keep", "1"])
    assert result.exit_code == 0, result.output
    assert _objects(store) == kept
    assert "nothing to expire; freed" in result.stdout and "versions kept: 0" in result.stdout
    assert verify_store(store) == []
    np.testing.assert_array_equal(pipeline.open_store(store).vectors("mean"), vectors)
