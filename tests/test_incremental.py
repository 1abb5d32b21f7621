"""Incremental runs on the sample reviews: only new and changed rows are encoded, and the
store that results equals a run from scratch over the new table, row by row (by id).

The scenario: a store of 400 reviews; then the table gains 150 reviews, 20 texts are
edited and 10 reviews are deleted. An incremental run must encode exactly the 170 new and
edited texts, say so in its summary and its history, and leave a store whose rows match
a full run over the new table (vectors to 1e-5, flags and counts exactly); the 10 deleted
ids stay, flagged `present: false`, or are gone with `prune`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeline
import pipeline.post.apply
from pipeline.cli import main
from pipeline.errors import InputError, JobError, PartitionError, StoreError
from pipeline.run.executors import InProcessExecutor
from pipeline.run.runner import run_job
from pipeline.spec import Job, PostSpec
from pipeline.stores.verify import verify_store
from tests.conftest import REPO, REVIEWS, job_dict, plain_docs, write_job

FORMATS = ["parquet", "icechunk", "delta"]  # the formats a store grows in (zarr: once)
# make test-fast runs each scenario on the first (the cheapest); make test on every one (the
# versioned formats' own fast tests are in tests/test_icechunk.py and tests/test_delta.py)
EACH_FORMAT = [pytest.param(fmt, marks=[pytest.mark.slow] if fmt != FORMATS[0] else [])
               for fmt in FORMATS]
BASE_ROWS, NEW_ROWS, EDITED, DELETED = 400, 150, 20, 10
EDITED_AT = list(range(3, 400, 20))  # 20 positions of the base table
DELETED_AT = list(range(11, 400, 40))  # 10 other positions
RELABELLED_AT = [7, 47, 87]  # carried values change, texts do not


def _reviews() -> pa.Table:
    """Ids, texts (the first 300 characters, to keep the tiny model quick) and labels."""
    table = pq.read_table(REVIEWS, columns=["id", "text", "label"])
    short = pc.utf8_slice_codeunits(table.column("text"), 0, 300)
    return table.set_column(1, "text", short)


def _base() -> pa.Table:
    return _reviews().slice(0, BASE_ROWS)


def _updated() -> pa.Table:
    """The base table with 20 texts edited, 3 labels changed (texts unchanged) and 10 rows
    deleted, then 150 new rows."""
    base = _base()
    texts = base.column("text").to_pylist()
    for i in EDITED_AT:
        texts[i] = f"{texts[i]} edited: it worked."
    labels = base.column("label").to_pylist()
    for i in RELABELLED_AT:
        labels[i] = "relabelled"
    edited = base.set_column(1, "text", pa.array(texts, pa.string()))
    edited = edited.set_column(2, "label", pa.array(labels, pa.string()))
    keep = np.ones(BASE_ROWS, bool)
    keep[DELETED_AT] = False
    return pa.concat_tables([edited.filter(pa.array(keep)),
                             _reviews().slice(BASE_ROWS, NEW_ROWS)])


def _relabelled(before: pa.Table, after: pa.Table) -> int:
    """Ids in both tables whose label differs (the oracle of `carried_changed`)."""
    old = dict(zip(before.column("id").to_pylist(), before.column("label").to_pylist(),
                   strict=True))
    return sum(1 for i, label in zip(after.column("id").to_pylist(),
                                     after.column("label").to_pylist(), strict=True)
               if i in old and old[i] != label)


def _job(model_dir: Path, source: Path, out: Path, fmt: str, **sections: Any) -> Job:
    sections = {"input": {"carry_columns": ["label"]},
                "output": {"path": str(out), "format": fmt},
                "chunking": {"strategy": "hierarchical", "max_tokens": 48},
                "execution": {"scheduler": "synchronous", "partition_rows": 64},
                **sections}
    return Job.from_dict(job_dict(source, model_dir, out, **sections))


def _appended(fmt: str) -> int:
    """Rows an update adds for the edits beyond the new ids: Icechunk appends each edit
    and keeps its old row, flagged; the other formats replace the row in place."""
    return EDITED if fmt == "icechunk" else 0


def _by_id(store: pipeline.Store) -> dict[Any, int]:
    return {key: i for i, key in enumerate(np.asarray(store.docs["id"].values).tolist())}


def _chunks_of(store: pipeline.Store) -> tuple[np.ndarray, np.ndarray]:
    n_chunks = np.asarray(store.docs["n_chunks"].values)
    return np.cumsum(n_chunks) - n_chunks, n_chunks


def assert_same_rows(got: pipeline.Store, want: pipeline.Store, views: list[str]) -> None:
    """Every row of `want` is in `got` under its id with the same flags, counts, carried
    values and digests, vectors within 1e-5; chunks likewise, document by document."""
    rows = _by_id(got)
    want_ids = np.asarray(want.docs["id"].values).tolist()
    at = np.array([rows[key] for key in want_ids])
    for name in ("n_tokens", "n_chunks", "truncated", "status", "label", "text_sha256",
                 "present"):
        if name == "label" and name not in want.docs:
            continue  # a job that carries no label
        np.testing.assert_array_equal(np.asarray(got.docs[name].values)[at],
                                      np.asarray(want.docs[name].values), err_msg=name)
    for view in views:
        np.testing.assert_allclose(got.vectors(view)[at], want.vectors(view), atol=1e-5,
                                   rtol=0, err_msg=view)
    if want.chunks is None:
        assert got.chunks is None
        return
    assert got.chunks is not None
    got_first, counts = _chunks_of(got)
    want_first, _ = _chunks_of(want)
    take = np.concatenate([np.arange(got_first[r], got_first[r] + counts[r]) for r in at])
    np.testing.assert_array_equal(np.asarray(got.chunks["doc"].values)[take],
                                  np.repeat(at, counts[at]))
    for name in ("seq", "start", "end", "n_tokens"):
        np.testing.assert_array_equal(np.asarray(got.chunks[name].values)[take],
                                      np.asarray(want.chunks[name].values), err_msg=name)
    for view in views:
        np.testing.assert_allclose(got.vectors(view, "chunks")[take],
                                   want.vectors(view, "chunks"), atol=1e-5, rtol=0)


@pytest.fixture(scope="module", autouse=True)
def torch_one_thread() -> Iterator[None]:
    """One torch thread: on a busy 2-core machine the tiny model runs ~7x faster so."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class PerFormat(dict):  # type: ignore[type-arg]
    """A store per format, made when a test first asks for it (a run of `make test-fast`
    asks for one format only)."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, fmt: str) -> Any:
        self[fmt] = made = self.make(fmt)
        return made


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path,
            torch_one_thread: None) -> dict[str, Path]:
    """The oracle: a from-scratch store over the updated table, made when first asked for
    and then answering for every format (results do not depend on the format they are
    kept in; the formats' own round trips are tested in test_stores.py)."""
    root = tmp_path_factory.mktemp("scratch")
    source = root / "updated.parquet"
    pq.write_table(_updated(), source)

    @functools.cache
    def made() -> Path:
        job = _job(tiny_bert, source, root / "scratch.parquet", "parquet")
        run_job(job)
        return Path(job.output.path)

    return PerFormat(lambda fmt: made())


@pytest.fixture(scope="module")
def base_stores(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path,
                torch_one_thread: None) -> dict[str, Job]:
    """A full run over the first 400 reviews, one store per format (tests update copies)."""

    def make(fmt: str) -> Job:
        root = tmp_path_factory.mktemp(f"base-{fmt}")
        source = root / "reviews.parquet"
        pq.write_table(_base(), source)
        job = _job(tiny_bert, source, root / f"store.{fmt}", fmt)
        summary = run_job(job)
        assert summary.rows == BASE_ROWS and summary.encoded == BASE_ROWS
        return job

    return PerFormat(make)


def _base_store(tmp_path: Path, base_stores: dict[str, Job], fmt: str) -> Job:
    """A copy of the base store, its job, and its input grown in place (a store does not
    depend on its folder: paths in its provenance only describe the run that made it)."""
    base = base_stores[fmt]
    source = tmp_path / "reviews.parquet"
    shutil.copytree(base.output.path, tmp_path / f"store.{fmt}")
    pq.write_table(_updated(), source)  # the table has grown
    return _job(Path(base.model.path), source, tmp_path / f"store.{fmt}", fmt)


@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_update_encodes_only_new_and_changed_rows(fmt: str, tmp_path: Path,
                                                  base_stores: dict[str, Job],
                                                  scratch: dict[str, Path]) -> None:
    job = _base_store(tmp_path, base_stores, fmt)
    summary = run_job(job, incremental=True)
    assert summary.encoded == NEW_ROWS + EDITED
    assert (summary.added, summary.replaced, summary.gone, summary.pruned) == \
        (NEW_ROWS, EDITED, DELETED, 0)
    assert summary.unchanged == BASE_ROWS - EDITED - DELETED
    assert "encoded 170 rows" in summary.line() and "replaced 20" in summary.line()
    relabelled = _relabelled(_base(), _updated())  # carried values of known ids that changed
    assert relabelled == len(RELABELLED_AT)
    assert summary.carried_changed == relabelled
    assert f"carried values changed in {relabelled} rows" in summary.line()
    store = pipeline.open_store(job.output.path)
    appended = _appended(fmt)
    rows = BASE_ROWS + NEW_ROWS + appended
    history = store.provenance.history
    assert [h.kind for h in history] == ["full", "incremental"]
    assert (history[1].encoded, history[1].added, history[1].replaced, history[1].gone,
            history[1].rows) == (170, 150, 20, 10, rows)
    # every row of the new version accounted for: unchanged, replaced, added, gone, superseded
    assert (history[1].superseded, summary.superseded) == (appended, appended)
    assert history[1].carried_changed == relabelled and history[0].carried_changed == 0
    assert summary.unchanged + summary.replaced + summary.added + summary.gone + \
        summary.superseded == summary.rows == rows
    assert summary.to_dict()["rows_by_outcome"]["superseded"] == appended
    assert (f"{appended} superseded kept" in summary.line()) == bool(appended)
    assert history[0].encoded == BASE_ROWS and store.provenance.version == 1
    # the store's rows kept their places, the edits (Icechunk) and new ones follow
    ids = np.asarray(store.docs["id"].values)
    base_ids = _base().column("id").to_numpy()
    new_ids = _reviews().slice(BASE_ROWS, NEW_ROWS).column("id").to_numpy()
    np.testing.assert_array_equal(ids[:BASE_ROWS], base_ids)
    np.testing.assert_array_equal(ids[BASE_ROWS:], np.concatenate(
        [base_ids[EDITED_AT[:appended]], new_ids]))
    present = np.asarray(store.docs["present"].values)
    flagged = sorted(DELETED_AT + EDITED_AT[:appended])
    assert np.flatnonzero(~present).tolist() == flagged
    current = store.docs.isel(doc=store.docs.present.values)  # as docs/incremental.md shows
    assert int(current.sizes["doc"]) == BASE_ROWS + NEW_ROWS - DELETED
    assert sorted(np.asarray(current["id"].values).tolist()) == \
        sorted(_updated().column("id").to_pylist())
    oracle = pipeline.open_store(scratch[fmt])
    assert_same_rows(store, oracle, ["mean", "cls"])
    assert int(store.docs.sizes["doc"]) == rows
    # a row's text is found by id once rows are no longer in input order
    updated = _updated().column("text").to_pylist()
    edited_row = BASE_ROWS + 1 if appended else EDITED_AT[1]
    for row, want in ((BASE_ROWS + appended, updated[BASE_ROWS - DELETED]),
                      (edited_row, updated[EDITED_AT[1] - 1])):
        frame = store.chunk_texts(row)
        assert "".join(frame["text"]) == want
    if appended:  # the superseded row's text is not the input's any more
        with pytest.raises(StoreError, match=f"row {EDITED_AT[1]} holds a text an edit "
                           f"superseded .its id's current row is {edited_row}"):
            store.chunk_texts(EDITED_AT[1])
    with pytest.raises(InputError, match="not in .* any more"):
        store.chunk_texts(DELETED_AT[0])
    # nothing new: nothing encoded, nothing written
    again = run_job(job, incremental=True)
    assert again.already_complete and again.encoded == 0
    assert len(pipeline.open_store(job.output.path).provenance.history) == 2
    # once the input changes, a plain rerun says so and that an update would do
    pq.write_table(_reviews().slice(0, 10), job.input.path)
    with pytest.raises(StoreError, match="changed .*--overwrite.*or --incremental"):
        run_job(job)


@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_prune_removes_gone_rows(fmt: str, tmp_path: Path, base_stores: dict[str, Job],
                                 scratch: dict[str, Path]) -> None:
    job = _base_store(tmp_path, base_stores, fmt)
    summary = run_job(job, incremental=True, prune=True)
    assert (summary.encoded, summary.gone, summary.pruned) == (170, DELETED, DELETED)
    store = pipeline.open_store(job.output.path)
    oracle = pipeline.open_store(scratch[fmt])
    assert int(store.docs.sizes["doc"]) == int(oracle.docs.sizes["doc"])
    assert_same_rows(store, oracle, ["mean", "cls"])
    assert store.provenance.history[-1].pruned == DELETED
    # the whole store's stats, as a full run counts them (its run's own figures aside)
    whole = ("rows", "chunks", "tokens", "tokens_covered")
    assert {k: store.provenance.stats[k] for k in whole} == \
        {k: oracle.provenance.stats[k] for k in whole}


@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_update_compared_in_buckets_on_disk_equals_a_run_from_scratch(
        fmt: str, tmp_path: Path, base_stores: dict[str, Job], scratch: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The 400-row update with the comparison split into buckets of 128 rows (the store's
    and the input's 950 rows: 8 buckets) and passes of 64 rows: the same counts, the same
    rows as a run from scratch, the texts to encode read again from the input; the scratch
    folder was used and is gone after the run."""
    from pipeline.run import compare

    monkeypatch.setattr(compare, "BUCKET_ROWS", 128)
    monkeypatch.setattr(compare, "STEP_ROWS", 64)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    used: list[list[str]] = []
    close = compare.Scratch.close

    def seen(self: Any) -> None:
        used.append(sorted(p.name for p in Path(self.path(".")).iterdir()))
        close(self)

    monkeypatch.setattr(compare.Scratch, "close", seen)
    job = _base_store(tmp_path, base_stores, fmt)
    summary = run_job(job, incremental=True)
    assert summary.encoded == NEW_ROWS + EDITED
    assert (summary.added, summary.replaced, summary.gone) == (NEW_ROWS, EDITED, DELETED)
    assert summary.superseded == _appended(fmt)
    assert_same_rows(pipeline.open_store(job.output.path), pipeline.open_store(scratch[fmt]),
                     ["mean", "cls"])
    assert len(used) == 1 and "store-by-id-7.arrow" in used[0] and "input-0.arrow" in used[0]
    assert list(temp.iterdir()) == []


class DiesAfter(InProcessExecutor):
    """Runs the first `n` partitions, then dies as a killed process would."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def run(self, job, parts, staging, fingerprint, on_done):  # type: ignore[no-untyped-def]
        super().run(job, parts[: self.n], staging, fingerprint, on_done)
        raise KeyboardInterrupt


def _snapshot(path: str) -> dict[str, Any]:
    store = pipeline.open_store(path)
    return {"version": store.provenance.version, "rows": int(store.docs.sizes["doc"]),
            "ids": np.asarray(store.docs["id"].values), "mean": store.vectors("mean"),
            "chunks": store.vectors("mean", "chunks")}


def _snapshot_rows(job: Job) -> int:
    """Chunks in a job's store (what a half-done switch changes first)."""
    return int(pipeline.open_store(job.output.path).chunks.sizes["chunk"])


def _assert_snapshot(path: str, before: dict[str, Any]) -> None:
    now = _snapshot(path)
    assert (now["version"], now["rows"]) == (before["version"], before["rows"])
    for key in ("ids", "mean", "chunks"):
        np.testing.assert_array_equal(now[key], before[key])


@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_killed_update_leaves_the_previous_version_then_resumes(
        fmt: str, tmp_path: Path, base_stores: dict[str, Job],
        scratch: dict[str, Path]) -> None:
    job = _base_store(tmp_path, base_stores, fmt)
    before = _snapshot(job.output.path)
    with pytest.raises(KeyboardInterrupt):
        run_job(job, executor=DiesAfter(1), incremental=True)
    _assert_snapshot(job.output.path, before)
    summary = run_job(job, incremental=True)
    assert summary.skipped == 1 and summary.encoded == 170
    assert_same_rows(pipeline.open_store(job.output.path), pipeline.open_store(scratch[fmt]),
                     ["mean", "cls"])


@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_a_staged_part_altered_before_the_resume_is_encoded_again(
        fmt: str, tmp_path: Path, base_stores: dict[str, Job],
        scratch: dict[str, Path]) -> None:
    """A part the killed update staged, altered (same size, other bytes): the resume's one
    read of it fails, the update stops with exit 6 (the store still at its version, the
    part's marker removed), and the next rerun encodes that partition again."""
    from pipeline.stores.staging import Staging

    job = _base_store(tmp_path, base_stores, fmt)
    before = _snapshot(job.output.path)
    with pytest.raises(KeyboardInterrupt):
        run_job(job, executor=DiesAfter(1), incremental=True)
    staging = Staging(job.output.path)
    part = staging.part_path(0, "docs")
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(PartitionError, match="staged partition 0 changed after it was written"):
        run_job(job, incremental=True)
    _assert_snapshot(job.output.path, before)
    assert not staging.marker(0).exists()
    summary = run_job(job, incremental=True)
    assert summary.run == 1 and summary.encoded == 170  # the other partitions are kept
    assert_same_rows(pipeline.open_store(job.output.path), pipeline.open_store(scratch[fmt]),
                     ["mean", "cls"])


@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_failed_partition_and_failed_switch_leave_the_previous_version(
        fmt: str, tmp_path: Path, base_stores: dict[str, Job], scratch: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A partition that fails, then a commit killed after the new version is written but
    before it is published: the store opens as before each time; the rerun finishes."""
    job = _base_store(tmp_path, base_stores, fmt)
    before = _snapshot(job.output.path)

    class FailsThird(InProcessExecutor):
        def run(self, job, parts, staging, fingerprint, on_done):  # type: ignore[no-untyped-def]
            failures = super().run(job, parts[:2], staging, fingerprint, on_done)
            return failures + [(part, PartitionError("RuntimeError: out of memory"))
                               for part in parts[2:]]

    with pytest.raises(PartitionError, match="store is unchanged \\(version 0\\)"):
        run_job(job, executor=FailsThird(), incremental=True)
    _assert_snapshot(job.output.path, before)

    def killed(self, version, provenance):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.stores.format_named(fmt), "publish", killed)
    with pytest.raises(KeyboardInterrupt):
        run_job(job, incremental=True)
    if fmt in ("icechunk", "delta"):  # no commit completes version 1: version 0 is current
        versions = pipeline.stores.detect_format(job.output.path).versions()
        assert [v.version for v in versions] == [0]
    else:
        written = Path(job.output.path) / "_bertpipe" / "next" / "docs" / "part-0.parquet"
        assert written.exists()  # written, not published
    _assert_snapshot(job.output.path, before)
    assert verify_store(job.output.path) == []  # the previous version still proves itself
    if fmt == "icechunk":  # plain xarray, too, still reads the first version
        plain = plain_docs(job.output.path)
        np.testing.assert_array_equal(plain["mean"].values, before["mean"])
    elif fmt == "delta":  # its tables' heads, too: the new files were never committed
        from deltalake import DeltaTable

        assert DeltaTable(str(Path(job.output.path) / "docs")).to_pyarrow_table().num_rows \
            == BASE_ROWS
    else:
        assert len(pd.read_parquet(Path(job.output.path) / "docs")) == BASE_ROWS
    monkeypatch.undo()
    summary = run_job(job, incremental=True)
    assert summary.run == 0 and summary.skipped >= 3 and summary.encoded == 170
    assert_same_rows(pipeline.open_store(job.output.path), pipeline.open_store(scratch[fmt]),
                     ["mean", "cls"])
    assert verify_store(job.output.path) == []


def test_parquet_switch_killed_between_its_renames_is_finished_by_the_next_run(
        tmp_path: Path, base_stores: dict[str, Job], scratch: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Parquet switch is two renames (chunks, then docs): killed between them, the next
    run finishes it from the sealed staged docs file, encoding nothing."""
    job = _base_store(tmp_path, base_stores, "parquet")
    real_replace = os.replace

    def dies_on_docs(src: Any, dst: Any) -> None:
        if str(src).endswith("_bertpipe/next/docs/part-0.parquet"):
            raise KeyboardInterrupt  # the docs file's rename, after the chunks file's
        real_replace(src, dst)

    monkeypatch.setattr(pipeline.stores.parquet_store.os, "replace", dies_on_docs)
    with pytest.raises(KeyboardInterrupt):
        run_job(job, incremental=True)
    monkeypatch.undo()
    chunks = pq.ParquetFile(Path(job.output.path) / "chunks" / "part-0.parquet")
    assert chunks.metadata.num_rows != _snapshot_rows(base_stores["parquet"])  # switched
    summary = run_job(job, incremental=True)
    assert summary.already_complete and summary.encoded == 0 and summary.version == 1
    store = pipeline.open_store(job.output.path)
    assert store.provenance.version == 1
    assert_same_rows(store, pipeline.open_store(scratch["parquet"]), ["mean", "cls"])
    assert verify_store(job.output.path) == []


@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_readers_see_one_version(fmt: str, tmp_path: Path,
                                 base_stores: dict[str, Job]) -> None:
    """Opened during the update: the previous version, also when read after the switch.
    Opened after: the new one. The previous version cannot be opened any more."""
    job = _base_store(tmp_path, base_stores, fmt)
    path = job.output.path
    before = _snapshot(path)
    seen: dict[str, Any] = {}

    class OpensMidway(InProcessExecutor):
        def run(self, job, parts, staging, fingerprint, on_done):  # type: ignore[no-untyped-def]
            failures = super().run(job, parts[:1], staging, fingerprint, on_done)
            seen["store"] = pipeline.open_store(path)  # lazily: read after the switch
            seen["snapshot"] = _snapshot(path)
            return failures + super().run(job, parts[1:], staging, fingerprint, on_done)

    run_job(job, executor=OpensMidway(), incremental=True)
    for key in ("ids", "mean", "chunks"):
        np.testing.assert_array_equal(seen["snapshot"][key], before[key])
    old = seen["store"]
    np.testing.assert_array_equal(old.vectors("mean"), before["mean"])
    np.testing.assert_array_equal(old.vectors("mean", "chunks"), before["chunks"])
    np.testing.assert_array_equal(np.asarray(old.docs["id"].values), before["ids"])
    new = pipeline.open_store(path)
    assert new.provenance.version == 1
    assert int(new.docs.sizes["doc"]) == BASE_ROWS + NEW_ROWS + _appended(fmt)
    if fmt == "delta":  # the tables' heads are the new version; the first stays readable
        from deltalake import DeltaTable

        frame = DeltaTable(str(Path(path) / "docs")).to_pandas().sort_values("row")
        assert len(frame) == BASE_ROWS + NEW_ROWS
        np.testing.assert_allclose(np.stack(frame["mean"].to_numpy()), new.vectors("mean"))
        first = pipeline.open_store(path, version=0)
        np.testing.assert_array_equal(first.vectors("mean"), before["mean"])
    elif fmt == "icechunk":  # the branch's head is the new version; the first stays readable
        plain = plain_docs(path)
        np.testing.assert_array_equal(plain["mean"].values, new.vectors("mean"))
        assert plain["mean"].attrs["pooling"] == "mean" and "id" in plain.coords
        first = pipeline.open_store(path, version=0)
        np.testing.assert_array_equal(first.vectors("mean"), before["mean"])
    else:  # the table folders hold the current version: a plain glob reads it
        frame = pd.read_parquet(Path(path) / "docs")
        assert len(frame) == BASE_ROWS + NEW_ROWS
        np.testing.assert_allclose(np.stack(frame["mean"].to_numpy()), new.vectors("mean"))
        assert pads.dataset(Path(path) / "chunks").count_rows() == new.chunks.sizes["chunk"]
    assert verify_store(path) == []
    # the next update: Parquet keeps the current version only, Icechunk every version
    pq.write_table(pa.concat_tables([_updated(), _reviews().slice(550, 5)]),
                   job.input.path)
    assert run_job(job, incremental=True).encoded == 5
    if fmt in ("icechunk", "delta"):  # every version stays until `bertpipe gc` expires it
        versions = pipeline.stores.detect_format(path).versions()
        assert [v.version for v in versions] == [2, 1, 0]
    else:
        assert sorted(p.name for p in Path(path).iterdir()) == ["chunks", "docs"]
        assert [p.name for p in (Path(path) / "docs").iterdir()] == ["part-0.parquet"]
    assert verify_store(path) == []


# --- refusals: nothing is written ---------------------------------------------------------

@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path,
                torch_one_thread: None) -> Job:
    """A 40-row Icechunk store that the refusal cases leave as they found it."""
    root = tmp_path_factory.mktemp("small")
    source = root / "base.parquet"
    pq.write_table(_reviews().slice(0, 40), source)
    job = _job(tiny_bert, source, root / "store.icechunk", "icechunk",
               execution={"scheduler": "synchronous", "partition_rows": 16})
    run_job(job)
    return job


def _grown(job: Job, tmp_path: Path, rows: pa.Table | None = None) -> Path:
    """A new input beside the store's (input.path may change between runs)."""
    source = tmp_path / "grown.parquet"
    pq.write_table(rows if rows is not None else _reviews().slice(0, 45), source)
    return source


def _with(job: Job, tmp_path: Path, **sections: Any) -> Job:
    raw = job.to_dict()
    raw["input"]["path"] = str(_grown(job, tmp_path))
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if key != "views" else value
    return Job.from_dict(raw)


REFUSALS: list[tuple[str, Any, type[Exception], str]] = [
    ("other pooling", lambda j, t, m: _with(j, t, views={"mean": {"pooling": "max"},
                                                         "cls": {"pooling": "cls"}}),
     StoreError, "other views than this job.*a full run is needed \\(--overwrite\\)"),
    ("other chunking", lambda j, t, m: _with(j, t, chunking={"max_tokens": 32}),
     StoreError, "other chunking"),
    ("other dtype", lambda j, t, m: _with(j, t, output={"dtype": "float16"}),
     StoreError, "other output.dtype"),
    ("other weights", lambda j, t, m: _with(j, t, model={"path": str(m)}),
     StoreError, "other model weights"),
    ("no id column", lambda j, t, m: _with(j, t, input={"id_column": None}),
     JobError, "output.incremental: needs input.id_column"),
    ("repeated id", lambda j, t, m: Job.from_dict({**j.to_dict(), "input": {
        **j.to_dict()["input"], "path": str(_grown(j, t, pa.concat_tables(
            [_reviews().slice(0, 45), _reviews().slice(30, 1)])))}}),
     InputError, "repeat: [0-9]+ on rows 30, 45; each id must name one row \\(an "
                 "incremental run matches rows to the store by id"),
]


@pytest.mark.parametrize(("case", "make", "error", "message"), REFUSALS,
                         ids=[c[0] for c in REFUSALS])
def test_refusals_leave_the_store(case: str, make: Any, error: type[Exception], message: str,
                                  small_store: Job, tmp_path: Path,
                                  tiny_roberta: Path) -> None:
    before = _snapshot(small_store.output.path)
    job = make(small_store, tmp_path, tiny_roberta)
    with pytest.raises(error, match=message):
        run_job(job, incremental=True)
    _assert_snapshot(small_store.output.path, before)
    assert not (Path(small_store.output.path) / "_bertpipe").exists()


def test_prune_and_overwrite_need_the_right_mode(small_store: Job) -> None:
    with pytest.raises(JobError, match="--prune: only with --incremental"):
        run_job(small_store, prune=True)
    with pytest.raises(JobError, match="--overwrite replaces it; choose one"):
        run_job(small_store, incremental=True, overwrite=True)


def test_store_without_digests_is_refused(tmp_path: Path, tiny_bert: Path) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(_reviews().slice(0, 10), source)
    job = _job(tiny_bert, source, tmp_path / "old.icechunk", "icechunk")
    run_job(job)
    # as an older bertpipe wrote it: no text digests (checksums sealed again without them)
    fmt = pipeline.stores.detect_format(job.output.path)
    del fmt._root()["docs"]["text_sha256"]
    fmt.write_record(fmt.record() or {})
    pq.write_table(_reviews().slice(0, 12), source)
    with pytest.raises(StoreError, match="without text digests.*--overwrite"):
        run_job(job, incremental=True)


# --- the first run, duplicates, carried and post-processed views ------------------------------

def test_first_incremental_run_is_a_full_run(tmp_path: Path, tiny_bert: Path) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(_reviews().slice(0, 20), source)
    job = _job(tiny_bert, source, tmp_path / "new.parquet", "parquet",
               output={"path": str(tmp_path / "new.parquet"), "format": "parquet",
                       "incremental": True})
    summary = run_job(job)
    assert not summary.incremental and summary.encoded == 20
    store = pipeline.open_store(job.output.path)
    assert [h.kind for h in store.provenance.history] == ["full"]
    assert store.provenance.version == 0
    again = run_job(job)
    assert again.already_complete and again.incremental and again.encoded == 0


def test_the_fall_back_to_a_full_run_hashes_the_weights_once(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An incremental run that finds no store runs the job in full: the run's context
    (plan, input identity, weights digest) is computed once for both."""
    from pipeline import fileutil
    from pipeline.extract import modelfiles as model_module

    hashed: list[str] = []
    original = fileutil.sha256_file

    def counting(path: Any) -> str:
        hashed.append(str(path))
        return original(path)

    monkeypatch.setattr(model_module, "sha256_file", counting)
    source = tmp_path / "in.parquet"
    pq.write_table(_reviews().slice(0, 8), source)
    job = _job(tiny_bert, source, tmp_path / "new.icechunk", "icechunk")
    summary = run_job(job, incremental=True)
    assert not summary.incremental and summary.encoded == 8
    weights = sorted(p.name for p in tiny_bert.iterdir() if p.suffix == ".safetensors")
    assert sorted(Path(p).name for p in hashed) == weights  # each weight file once


@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_identical_texts_are_encoded_once(fmt: str, tmp_path: Path, tiny_bert: Path) -> None:
    """Within a partition and against the store: duplicates take copies of one encoding."""
    texts = ["the drug worked", "bad side effects", "the drug worked", None, "",
             "bad side effects", "the drug worked", "great"]
    source = tmp_path / "dups-input.parquet"
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(8)], "text": texts,
                             "label": ["x"] * 8}), source)
    job = _job(tiny_bert, source, tmp_path / f"dups.{fmt}", fmt)
    summary = run_job(job)
    assert (summary.rows, summary.encoded, summary.copied) == (8, 5, 3)  # None and "" too
    assert "3 encodings saved" in summary.line()
    store = pipeline.open_store(job.output.path)
    mean = store.vectors("mean")
    np.testing.assert_array_equal(mean[0], mean[2])
    np.testing.assert_array_equal(mean[0], mean[6])
    # one text encoded alone gives the same vector (batch composition aside)
    alone = tmp_path / "alone-input.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": ["the drug worked"], "label": ["x"]}), alone)
    single = _job(tiny_bert, alone, tmp_path / f"alone.{fmt}", fmt)
    run_job(single)
    np.testing.assert_allclose(pipeline.open_store(single.output.path).vectors("mean")[0],
                               mean[0], atol=1e-5)
    chunks = np.asarray(store.chunks["doc"].values) if store.chunks is not None else None
    assert chunks is not None and sorted(set(chunks.tolist())) == [0, 1, 2, 5, 6, 7]
    # a new id whose text the store holds: copied, nothing encoded
    pq.write_table(pa.table({"id": [*(f"d{i}" for i in range(8)), "d8"],
                             "text": [*texts, "great"], "label": ["x"] * 9}), source)
    update = run_job(job, incremental=True)
    assert (update.added, update.encoded, update.copied) == (1, 0, 1)
    grown = pipeline.open_store(job.output.path)
    np.testing.assert_array_equal(grown.vectors("mean")[8], mean[7])
    assert int(np.asarray(grown.docs["n_chunks"].values)[8]) == \
        int(np.asarray(store.docs["n_chunks"].values)[7])


@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_post_processed_views_keep_their_fit(fmt: str, tmp_path: Path, tiny_bert: Path) -> None:
    """New rows are transformed with the parameters fitted on the first run, so the values
    of rows already in the store never move."""
    source = tmp_path / "in.parquet"
    pq.write_table(_reviews().slice(0, 30), source)
    job = _job(tiny_bert, source, tmp_path / f"post.{fmt}", fmt,
               views={"mean": {"pooling": "mean"}, "cls": {"pooling": "cls", "post": "center"}})
    run_job(job)
    pipeline.post.apply.postprocess(job.output.path, "mean", PostSpec(method="center"))
    before = pipeline.open_store(job.output.path)
    before_fit = before.fmt.read_params("mean_center")["mean"]
    pq.write_table(_reviews().slice(0, 36), source)
    assert run_job(job, incremental=True).encoded == 6
    after = pipeline.open_store(job.output.path)
    assert after.views == before.views == ["mean", "cls", "mean_center"]
    for view in after.views:
        np.testing.assert_array_equal(after.vectors(view)[:30], before.vectors(view))
        np.testing.assert_array_equal(after.vectors(view, "chunks")[: before.chunks.sizes[
            "chunk"]], before.vectors(view, "chunks"))
    mean_fit = after.fmt.read_params("mean_center")["mean"]
    np.testing.assert_allclose(mean_fit, before_fit)
    np.testing.assert_allclose(after.vectors("mean_center")[30:],
                               after.vectors("mean")[30:] - mean_fit, atol=1e-6)
    # cls was centred in place: the new rows are raw cls minus the first run's mean
    scratch_job = _job(tiny_bert, source, tmp_path / f"raw.{fmt}", fmt,
                       views={"cls": {"pooling": "cls"}})
    run_job(scratch_job)
    raw = pipeline.open_store(scratch_job.output.path).vectors("cls")
    cls_fit = after.fmt.read_params("cls")["mean"]
    np.testing.assert_allclose(after.vectors("cls")[30:], raw[30:] - cls_fit, atol=1e-5)
    # post-processing an updated store writes into its current version
    pipeline.post.apply.postprocess(job.output.path, "mean", PostSpec(method="whiten", dims=4))
    whitened = pipeline.open_store(job.output.path)
    assert whitened.provenance.version == 1
    assert whitened.vectors("mean_whiten").shape == (36, 4)
    assert whitened.vectors("mean_whiten", "chunks").shape[1] == 4
    np.testing.assert_array_equal(whitened.vectors("mean"), after.vectors("mean"))


# --- the command line ---------------------------------------------------------------------

def test_command_line_update_and_inspect(tmp_path: Path, tiny_bert: Path) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(_reviews().slice(0, 30), source)
    job = job_dict(source, tiny_bert, tmp_path / "cli.icechunk",
                   input={"carry_columns": ["label"]}, output={"format": "icechunk"},
                   chunking={"strategy": "hierarchical", "max_tokens": 48})
    job_file = write_job(tmp_path / "job.yaml", job)
    assert CliRunner().invoke(main, ["extract", str(job_file)]).exit_code == 0
    pq.write_table(_reviews().slice(2, 33), source)
    result = CliRunner().invoke(main, ["extract", str(job_file), "--incremental", "--prune"])
    assert result.exit_code == 0, result.stderr
    assert "version 1: encoded 5 rows, skipped 28 unchanged, replaced 0, added 5, 2 gone " \
           "(removed)" in result.stdout
    assert "incremental: 5 new, 0 changed, 28 unchanged, 2 gone; 5 texts to encode" \
        in result.stderr
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "cli.icechunk")]).stdout
    assert "version    1" in shown
    assert "full        v0  30 rows: 30 added; encoded 30 (0 copied)" in shown
    assert "incremental v1  33 rows: 5 added, 0 replaced, 28 unchanged, 2 gone (pruned)" \
        in shown
    again = CliRunner().invoke(main, ["extract", str(job_file), "--incremental"])
    assert "up to date with its input (version 1); nothing to encode" in again.stdout
    wrong = CliRunner().invoke(main, ["extract", str(job_file), "--prune"])
    assert wrong.exit_code == 2
    assert wrong.stderr.strip().splitlines() == [
        "error: Invalid value for '--prune': only with --incremental (or output.incremental: "
        "true) (see main extract --help)"]
    no_ids = write_job(tmp_path / "no-ids.yaml", {**job, "input": {**job["input"],
                                                                    "id_column": None}})
    for args in (["extract", str(no_ids), "--incremental"],
                 ["validate", str(no_ids), "--set", "output.incremental=true"]):
        refused = CliRunner().invoke(main, args)
        assert refused.exit_code == 2
        assert refused.stderr.strip().splitlines() == [
            f"error: {no_ids}: output.incremental: needs input.id_column (rows are matched to "
            "the store by id)"]
    plan = CliRunner().invoke(main, ["extract", str(job_file), "--incremental", "--dry-run"])
    assert "mode       incremental" in plan.stdout


@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_a_night_that_only_relabels_says_how_many_carried_values_changed(
        fmt: str, tmp_path: Path, base_stores: dict[str, Job]) -> None:
    """21 labels changed, no text: nothing encoded, added or replaced, and the summary line,
    the JSON summary, the history and inspect say what did change."""
    base = base_stores[fmt]
    shutil.copytree(base.output.path, tmp_path / f"store.{fmt}")
    labels = _base().column("label").to_pylist()
    for i in range(0, 21 * 19, 19):  # 21 rows, every 19th
        labels[i] = "negative" if labels[i] != "negative" else "positive"
    relabelled = _base().set_column(2, "label", pa.array(labels, pa.string()))
    source = tmp_path / "reviews.parquet"
    pq.write_table(relabelled, source)
    job = _job(Path(base.model.path), source, tmp_path / f"store.{fmt}", fmt)
    job_file = write_job(tmp_path / "job.yaml", job.to_dict())
    summary_file = tmp_path / "run.json"
    result = CliRunner().invoke(main, ["extract", str(job_file), "--incremental",
                                       "--json-summary", str(summary_file)])
    assert result.exit_code == 0, result.output
    changed = _relabelled(_base(), relabelled)
    assert changed == 21
    line = result.stdout.splitlines()[0]
    assert "encoded 0 rows" in line and "replaced 0, added 0" in line
    assert "carried values changed in 21 rows" in line
    doc = json.loads(summary_file.read_text())
    jsonschema.validate(doc, json.loads((REPO / "schemas" / "run-summary.schema.json")
                                        .read_text()))
    assert doc["rows_by_outcome"]["carried_changed"] == 21
    store = pipeline.open_store(job.output.path)
    assert store.provenance.history[-1].carried_changed == 21
    by_id = dict(zip(np.asarray(store.docs["id"].values).tolist(),
                     np.asarray(store.docs["label"].values).tolist(), strict=True))
    assert [by_id[i] for i in relabelled.column("id").to_pylist()] == labels
    shown = CliRunner().invoke(main, ["inspect", job.output.path])
    history = [ln for ln in shown.stdout.splitlines() if " incremental " in ln]
    assert len(history) == 1 and "carried values changed in 21 rows" in history[0], history
    facts = json.loads(CliRunner().invoke(main, ["inspect", job.output.path, "--json"]).stdout)
    jsonschema.validate(facts, json.loads((REPO / "schemas" / "inspect.schema.json")
                                          .read_text()))
    assert facts["history"][-1]["carried_changed"] == 21


# --- a killed process, and the real model ---------------------------------------------------

@pytest.mark.slow
def test_sigkill_during_update(tmp_path: Path, base_stores: dict[str, Job],
                               scratch: dict[str, Path]) -> None:
    """SIGKILL while the delta is being encoded: the store opens as before; the rerun
    takes over the dead run's lock on its own and resumes to the right store."""
    job = _base_store(tmp_path, base_stores, "icechunk")
    before = _snapshot(job.output.path)
    raw = job.to_dict()
    raw["execution"]["partition_rows"] = 4  # many small partitions: time to kill mid-way
    job_file = write_job(tmp_path / "job.yaml", raw)
    env = {**os.environ, "PYTHONPATH": str(Path(pipeline.__file__).parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "extract", str(job_file),
                             "--incremental"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    parts = Path(job.output.path) / "_bertpipe" / "parts"
    deadline = time.monotonic() + 180
    while not list(parts.glob("*.done.json")) and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    _assert_snapshot(job.output.path, before)
    resumed = Job.from_dict(raw)
    said: list[str] = []
    summary = run_job(resumed, incremental=True, say=said.append)
    assert any(f"took over the lock of host {socket.gethostname()}, pid {proc.pid}" in line
               for line in said), said
    assert "no longer running" in pipeline.open_store(job.output.path).provenance.history[-1] \
        .took_over_lock
    assert summary.skipped >= 1 and summary.encoded == NEW_ROWS + EDITED
    assert_same_rows(pipeline.open_store(job.output.path),
                     pipeline.open_store(scratch["icechunk"]), ["mean", "cls"])


# OpenVINO in float32: torch's float32 at 1e-5 (test_runtime_openvino.py), twice as fast here
REAL_MODEL = {"model": {"runtime": "openvino", "dtype": "float32"},
              "chunking": {"strategy": "hierarchical", "max_tokens": 128},
              "execution": {"scheduler": "synchronous", "partition_rows": 64}}


def _encoded_by_the_update() -> pa.Table:
    """The rows of the updated table an update must encode: the edited and the new."""
    base_ids = _base().column("id").to_pylist()
    wanted = {base_ids[i] for i in EDITED_AT} | set(_reviews().slice(BASE_ROWS, NEW_ROWS)
                                                     .column("id").to_pylist())
    updated = _updated()
    return updated.filter(pc.is_in(updated.column("id"), pa.array(sorted(wanted))))


@pytest.fixture(scope="module")
def real_model_scratch(tmp_path_factory: pytest.TempPathFactory, minilm: Path) -> Path:
    """The oracle of the real-model scenario: a full run over the rows an update must
    encode, made once (results do not depend on the format; every format's update is
    compared with it). Its other rows must be the base run's, compared with that."""
    root = tmp_path_factory.mktemp("real-model-scratch")
    source = root / "encoded.parquet"
    pq.write_table(_encoded_by_the_update(), source)
    full = _job(minilm, source, root / "full.parquet", "parquet", **REAL_MODEL)
    run_job(full)
    return Path(full.output.path)


@pytest.mark.slow
# the versioned formats (the plain format's update is this scenario on the tiny model:
# test_update_encodes_only_new_and_changed_rows); the model's part is format-independent
@pytest.mark.parametrize("fmt", ["icechunk", "delta"])
def test_update_with_the_real_model(fmt: str, tmp_path: Path, minilm: Path,
                                    real_model_scratch: Path) -> None:
    """all-MiniLM-L6-v2 on the sample reviews, the issue's scenario: 400 rows, then 150
    new, 20 edited, 10 deleted: exactly 170 encoded (summary and history), equal by id to
    a from-scratch run over those 170, every other row as the base run wrote it; a killed
    update leaves the previous version, the rerun gives the same store; nothing new
    encodes nothing."""
    sections = REAL_MODEL
    source = tmp_path / "reviews.parquet"
    pq.write_table(_base(), source)
    job = _job(minilm, source, tmp_path / f"store.{fmt}", fmt, **sections)
    run_job(job)
    before = _snapshot(job.output.path)
    pq.write_table(_updated(), source)
    with pytest.raises(KeyboardInterrupt):
        run_job(job, executor=DiesAfter(1), incremental=True)
    _assert_snapshot(job.output.path, before)
    summary = run_job(job, incremental=True)
    assert (summary.encoded, summary.added, summary.replaced, summary.gone) == \
        (NEW_ROWS + EDITED, NEW_ROWS, EDITED, DELETED)
    store = pipeline.open_store(job.output.path)
    assert store.provenance.history[-1].encoded == NEW_ROWS + EDITED
    assert_same_rows(store, pipeline.open_store(real_model_scratch), ["mean", "cls"])
    encoded = set(_encoded_by_the_update().column("id").to_pylist())
    kept = [i for i, key in enumerate(before["ids"].tolist())
            if key not in encoded and i not in DELETED_AT]
    assert len(kept) == BASE_ROWS - EDITED - DELETED
    rows = _by_id(store)
    np.testing.assert_array_equal(
        store.vectors("mean")[[rows[key] for key in before["ids"][kept].tolist()]],
        before["mean"][kept])
    assert verify_store(job.output.path) == []
    started = time.perf_counter()
    again = run_job(job, incremental=True)
    assert again.already_complete and again.encoded == 0
    assert time.perf_counter() - started < 30  # start-up time: no model is loaded


@pytest.mark.cluster
@pytest.mark.slow
def test_update_on_a_local_dask_cluster(tmp_path: Path, tiny_bert: Path) -> None:
    """The delta runs through the Dask executor like any partitions (one local worker)."""
    source = tmp_path / "in.parquet"
    pq.write_table(_reviews().slice(0, 40), source)
    execution = {"scheduler": "local", "workers": 1, "threads_per_worker": 1,
                 "partition_rows": 16}
    job = _job(tiny_bert, source, tmp_path / "dask.icechunk", "icechunk", execution=execution)
    run_job(job)
    pq.write_table(_reviews().slice(0, 60), source)
    summary = run_job(job, incremental=True)
    assert (summary.encoded, summary.run) == (20, 2)
    full_source = tmp_path / "full.parquet"
    pq.write_table(_reviews().slice(0, 60), full_source)
    full = _job(tiny_bert, full_source, tmp_path / "full.icechunk", "icechunk")
    run_job(full)
    assert_same_rows(pipeline.open_store(job.output.path), pipeline.open_store(full.output.path),
                     ["mean", "cls"])


@pytest.mark.parametrize("split", [False, True], ids=["in-memory", "in-buckets"])
@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_carried_columns_with_nulls_and_documents_only(fmt: str, split: bool, tmp_path: Path,
                                                       tiny_bert: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Carried values come from the input for every present row and from the store for a
    kept gone row, nulls included; a store of documents only updates too; the same with
    the comparison split into buckets of 5 rows over partitions of 4. (The tags are carried
    as `digest`: a carried column may have the name of one the comparison uses.)"""
    from pipeline.run import compare

    if split:
        monkeypatch.setattr(compare, "BUCKET_ROWS", 5)
    ids = list(range(12))
    texts = [f"the drug worked {'very ' * i}well" for i in ids]
    scores = [None if i % 5 == 0 else i for i in ids]
    tags = [None if i % 4 == 1 else f"t{i}" for i in ids]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ids, "text": texts, "score": scores, "digest": tags}), source)
    job = _job(tiny_bert, source, tmp_path / f"carry.{fmt}", fmt,
               input={"carry_columns": ["score", "digest"]},
               output={"path": str(tmp_path / f"carry.{fmt}"), "format": fmt,
                       "levels": ["docs"]},
               execution={"scheduler": "synchronous", "partition_rows": 4 if split else 64})
    run_job(job)
    keep = [i for i in ids if i not in (5, 9)]  # gone: id 5 has a null score, 9 a null tag
    new_ids = keep + [12, 13]
    new_scores = [scores[i] if i != 3 else 33 for i in keep] + [None, 13]
    new_tags = [tags[i] for i in keep] + ["t12", None]
    pq.write_table(pa.table({"id": new_ids, "text": [texts[i] for i in keep] + ["great", "bad"],
                             "score": pa.array(new_scores, pa.int32()), "digest": new_tags}),
                   source)
    summary = run_job(job, incremental=True)
    assert (summary.encoded, summary.added, summary.gone) == (2, 2, 2)
    store = pipeline.open_store(job.output.path)
    assert store.chunks is None
    got_ids = np.asarray(store.docs["id"].values).tolist()
    assert got_ids == ids + [12, 13]
    want_scores = {**dict(zip(ids, scores, strict=True)),
                   **dict(zip(new_ids, new_scores, strict=True))}
    want_tags = {**dict(zip(ids, tags, strict=True)), **dict(zip(new_ids, new_tags, strict=True))}
    got_scores = np.asarray(store.docs["score"].values, dtype=np.float64)
    for key, value in zip(got_ids, got_scores, strict=True):
        assert (np.isnan(value) if want_scores[key] is None else value == want_scores[key]), key
    assert np.asarray(store.docs["digest"].values).tolist() == [want_tags[k] for k in got_ids]
    assert np.asarray(store.docs["present"].values).tolist() == [k not in (5, 9)
                                                                 for k in got_ids]
    # id 5 comes back with its old text: unflagged, nothing encoded
    back = pa.table({"id": [*new_ids, 5], "text": [*[texts[i] for i in keep], "great", "bad",
                                                  texts[5]],
                     "score": pa.array([*new_scores, 50], pa.int32()),
                     "digest": [*new_tags, "back"]})
    pq.write_table(back, source)
    returned = run_job(job, incremental=True)
    assert (returned.encoded, returned.added, returned.unchanged, returned.gone) == \
        (0, 0, len(new_ids) + 1, 1)
    store = pipeline.open_store(job.output.path)
    assert np.asarray(store.docs["present"].values).tolist() == [k != 9 for k in got_ids]
    assert np.asarray(store.docs["digest"].values)[5] == "back"


# --- integrity, machine-readable output, token views -----------------------------------

def _damage(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt", EACH_FORMAT)
def test_verify_after_an_update_and_a_damaged_chunk_of_the_new_version(
        fmt: str, tmp_path: Path, base_stores: dict[str, Job]) -> None:
    """An updated store carries the checksums of its new version's files, as a store run
    from scratch does: `bertpipe verify` passes, and a damaged chunk is named."""
    job = _base_store(tmp_path, base_stores, fmt)
    run_job(job, incremental=True)
    path = Path(job.output.path)
    result = CliRunner().invoke(main, ["verify", str(path)])
    assert result.exit_code == 0, result.output
    assert f"{BASE_ROWS + NEW_ROWS + _appended(fmt)} rows" in result.stdout
    store = pipeline.open_store(path)
    recorded = store.provenance.checksums
    if fmt == "icechunk":  # chunk objects have random names: damage each one
        assert "chunks/mean/c/0/0" in recorded
        for obj in (path / "repo" / "chunks").iterdir():
            _damage(obj, obj.stat().st_size // 2)
        problems = verify_store(path)
        assert any(p.startswith("chunks/mean: chunk c/0/0 is damaged (its bytes do not match "
                                "the recorded checksum) (file repo/chunks/") for p in problems)
    elif fmt == "delta":  # every data file of the current version, by its table path
        from deltalake import DeltaTable

        current = {f"{level}/{Path(uri).name}" for level in ("docs", "chunks")
                   for uri in DeltaTable(str(path / level)).file_uris()}
        assert set(recorded) == current
        rel = sorted(r for r in recorded if r.startswith("chunks/"))[0]
        _damage(path / rel, recorded[rel].size // 2)
        problems = verify_store(path)
        assert problems == [f"{rel} is damaged (its bytes do not match the recorded checksum)"]
    else:
        assert set(recorded) == {"docs/part-0.parquet", "chunks/part-0.parquet"}
        chunk = path / "chunks" / "part-0.parquet"
        _damage(chunk, recorded["chunks/part-0.parquet"].size // 2)
        problems = verify_store(path)
        assert problems == ["chunks/part-0.parquet is damaged (its bytes do not match the "
                            "recorded checksum)"]
    with pytest.raises(StoreError, match="chunks" if fmt != "icechunk" else "is damaged"):
        pipeline.open_store(path).vectors("mean", "chunks")
    refused = CliRunner().invoke(main, ["verify", str(path)])
    assert refused.exit_code == 5 and "damaged" in refused.stderr


def _schema(name: str) -> dict[str, Any]:
    return json.loads((REPO / "schemas" / name).read_text())


def test_json_summary_and_inspect_json_report_the_update(tmp_path: Path,
                                                         tiny_bert: Path) -> None:
    source = tmp_path / "in.parquet"
    table = _reviews().slice(0, 30)
    pq.write_table(pa.concat_tables([table, table.slice(0, 2).set_column(
        0, "id", pa.array([9001, 9002], table.schema.field("id").type))]), source)
    job = job_dict(source, tiny_bert, tmp_path / "j.icechunk", output={"format": "icechunk"},
                   input={"carry_columns": ["label"]},
                   chunking={"strategy": "hierarchical", "max_tokens": 48},
                   execution={"scheduler": "synchronous", "partition_rows": 64})
    job_file = write_job(tmp_path / "job.yaml", job)
    out = tmp_path / "summary.json"
    first = CliRunner().invoke(main, ["extract", str(job_file), "--json-summary", str(out)])
    assert first.exit_code == 0, first.output
    full = json.loads(out.read_text())
    jsonschema.validate(full, _schema("run-summary.schema.json"))
    assert full["mode"] == "full" and full["version"] == 0
    assert full["rows_by_outcome"] == {"encoded": 30, "deduplicated": 2, "added": 32,
                                       "replaced": 0, "skipped": 0, "gone": 0, "pruned": 0,
                                       "superseded": 0, "dropped": 0, "carried_changed": 0}
    texts = _reviews().slice(0, 40).column("text").to_pylist()
    texts[4] = "changed"
    grown = _reviews().slice(0, 40).set_column(1, "text", pa.array(texts))
    pq.write_table(grown.filter(pa.array([i != 7 for i in range(40)])), source)
    update = CliRunner().invoke(main, ["extract", str(job_file), "--incremental", "--prune",
                                       "--json-summary", str(out)])
    assert update.exit_code == 0, update.output
    summary = json.loads(out.read_text())
    jsonschema.validate(summary, _schema("run-summary.schema.json"))
    assert summary["mode"] == "incremental" and summary["version"] == 1
    assert summary["rows_by_outcome"] == {"encoded": 11, "deduplicated": 0, "added": 10,
                                          "replaced": 1, "skipped": 28, "gone": 3,
                                          "pruned": 3, "superseded": 0, "dropped": 0,
                                          "carried_changed": 0}  # no known id relabelled
    assert summary["rows"] == 39 and summary["partitions"]["failed"] == 0
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "j.icechunk"), "--json"])
    assert shown.exit_code == 0, shown.output
    facts = json.loads(shown.stdout)
    jsonschema.validate(facts, _schema("inspect.schema.json"))
    assert facts["version"] == 1 and facts["flagged_gone"] == 0 and facts["rows"] == 39
    assert [(h["kind"], h["encoded"], h["copied"], h["pruned"]) for h in facts["history"]] == \
        [("full", 30, 2, 0), ("incremental", 11, 0, 3)]


def test_token_views_are_refused_up_front(tmp_path: Path, tiny_bert: Path) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(_reviews().slice(0, 5), source)
    job = job_dict(source, tiny_bert, tmp_path / "t.parquet", output={"format": "parquet"},
                   views={"mean": {"pooling": "mean"}, "tok": {"pooling": "tokens"}})
    job_file = write_job(tmp_path / "job.yaml", job)
    for args in (["validate", str(job_file), "--set", "output.incremental=true"],
                 ["extract", str(job_file), "--incremental"]):
        refused = CliRunner().invoke(main, args)
        assert refused.exit_code == 2
        assert refused.stderr.strip().splitlines() == [
            f"error: {job_file}: output.incremental: views.tok has pooling: tokens, which "
            "incremental runs do not support; drop the token view or run the job in full "
            "(--overwrite)"]
    assert not (tmp_path / "t.parquet").exists()


def test_updated_parquet_store_globs_in_duckdb_and_polars(tmp_path: Path,
                                                          base_stores: dict[str, Job]) -> None:
    duckdb = pytest.importorskip("duckdb")
    pl = pytest.importorskip("polars")
    job = _base_store(tmp_path, base_stores, "parquet")
    run_job(job, incremental=True, prune=True)
    store = pipeline.open_store(job.output.path)
    con = duckdb.connect()
    for table, rows in (("docs", BASE_ROWS + NEW_ROWS - DELETED),
                        ("chunks", int(store.chunks.sizes["chunk"]))):
        glob = str(Path(job.output.path) / table / "*.parquet")
        assert con.execute(f"select count(*) from '{glob}'").fetchall() == [(rows,)]
        assert pl.scan_parquet(glob).select(pl.len()).collect().item() == rows
    glob = str(Path(job.output.path) / "docs" / "*.parquet")
    ids = [row[0] for row in con.execute(f"select id from '{glob}'").fetchall()]
    assert ids == np.asarray(store.docs["id"].values).tolist()
    assert con.execute(f"select count(*) from '{glob}' where not present").fetchall() == [(0,)]


def test_a_zarr_store_is_written_once(tmp_path: Path, tiny_bert: Path) -> None:
    """After an update a plain Zarr reader would need the version's folder: the zarr format
    refuses incremental runs up front and names the formats that grow."""
    source = tmp_path / "in.parquet"
    pq.write_table(_reviews().slice(0, 5), source)
    job_file = write_job(tmp_path / "job.yaml", job_dict(source, tiny_bert, tmp_path / "o.zarr"))
    for args in (["validate", str(job_file), "--set", "output.incremental=true"],
                 ["extract", str(job_file), "--incremental"]):
        refused = CliRunner().invoke(main, args)
        assert refused.exit_code == 2
        assert refused.stderr.strip().splitlines() == [
            "error: output.incremental: a zarr store is written once (after an update, plain "
            "readers would have to find the current version's folder); for a store that grows "
            "use output.format: parquet, icechunk or delta"]
    assert not (tmp_path / "o.zarr").exists()


def test_parquet_on_an_object_store_is_refused_up_front(tmp_path: Path, tiny_bert: Path) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(_reviews().slice(0, 5), source)
    job_file = write_job(tmp_path / "job.yaml", job_dict(source, tiny_bert, tmp_path / "o.zarr"))
    refused = CliRunner().invoke(main, ["validate", str(job_file), "--set",
                                        "output.path=memory://bucket/out.parquet", "--set",
                                        "output.format=parquet", "--set",
                                        "output.incremental=true"])
    assert refused.exit_code == 2
    assert refused.stderr.strip().splitlines() == [
        "error: output.incremental: a parquet store on an object store is not "
        "updated (its switch renames files, which object stores cannot do); use "
        "output.format: icechunk or delta, or run the job in full (--overwrite)"]


@pytest.mark.parametrize(("near", "runs"), [(0, 1), (0, 256), (4096, 256)])
@pytest.mark.parametrize("lazy", ["dask", "numpy"])
def test_rows_of_a_stored_array_by_range_or_row_by_row(near: int, runs: int, lazy: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows the new version copies from the store, read by ranges (near rows: one) or
    row by row (in too many runs), are those rows, in the order asked, repeats included."""
    import dask.array as da
    import xarray as xr

    from pipeline.run import assemble

    monkeypatch.setattr(assemble, "NEAR_ROWS", near)
    monkeypatch.setattr(assemble, "MAX_RUNS", runs)
    values = np.arange(3000 * 4, dtype=np.float32).reshape(3000, 4)
    data = da.from_array(values, chunks=(256, 4)) if lazy == "dask" else values
    array = xr.DataArray(data, dims=("doc", "dim"))
    rng = np.random.default_rng(0)
    for rows in (rng.integers(0, 3000, 50), np.arange(100, 400), np.array([7, 7, 2999, 0]),
                 np.r_[np.arange(2000, 2300), np.arange(10, 40)], np.array([], np.int64),
                 np.sort(rng.integers(0, 3000, 80)), np.array([3, 3, 3, 900, 900, 2999])):
        np.testing.assert_array_equal(assemble.rows_of(array, rows), values[rows])


def test_digests_compared_as_32_bytes_read_back_as_the_stored_hex() -> None:
    """The comparison's binary digests are the texts' SHA-256 (hashlib, an independent
    oracle), and convert back to exactly the hex a store keeps, sliced or chunked."""
    import hashlib

    from pipeline.extract.texthash import text_sha256, text_sha256_bytes
    from pipeline.run.compare import DIGEST, from_hex, to_hex

    texts = ["a review", "", None, "naïve café ☕", "a review"]
    oracle = [hashlib.sha256((t or "").encode()).hexdigest() for t in texts]
    assert text_sha256(texts) == oracle
    binary = pa.array(text_sha256_bytes(texts), DIGEST)
    assert from_hex(pa.array(oracle)).equals(binary)
    assert to_hex(binary).to_pylist() == oracle
    assert to_hex(binary.slice(1, 3)).to_pylist() == oracle[1:4]
    assert to_hex(pa.chunked_array([binary.slice(0, 2), binary.slice(2)])).to_pylist() == oracle
    assert to_hex(binary.slice(0, 0)).to_pylist() == []


def test_digest_lookup_finds_each_digests_first_stored_row_as_a_dictionary_does() -> None:
    """The comparison's sorted lookup against a plain dict of first occurrences (the
    oracle): repeated digests, digests differing only in their last byte or holding zero
    bytes, digests sharing their first 8 bytes, sliced arrays, and an empty store."""
    from pipeline.run.compare import DIGEST, DigestLookup

    rng = np.random.default_rng(3)
    pool = [rng.bytes(32) for _ in range(40)]
    pool += [pool[0][:31] + bytes([pool[0][31] ^ 1]), bytes(32), bytes(31) + b"\x01",
             b"\x00" * 16 + b"\xff" * 16]
    # digests sharing their first 8 bytes (the lookup's sort key) with stored ones
    pool += [pool[i][:8] + rng.bytes(24) for i in (1, 1, 2, 3)] + [pool[3][:8] + bytes(24)]
    stored = [pool[i] for i in rng.integers(0, 30, 200)] + pool[40:42] + pool[44:46] + \
        [pool[3], pool[46], pool[44]]
    asked = pool + [pool[3]] * 3
    first: dict[bytes, int] = {}
    for row, digest in enumerate(stored):
        first.setdefault(digest, row)
    for store in (pa.array(stored, DIGEST), pa.array([b"\x07" * 32] * 5 + stored,
                                                     DIGEST).slice(5)):
        lookup = DigestLookup(store)
        for ask in (pa.array(asked, DIGEST), pa.array(pool + asked, DIGEST).slice(len(pool))):
            assert lookup.index_in(ask).tolist() == [first.get(d, -1) for d in asked]
    empty = DigestLookup(pa.array([], DIGEST))
    assert empty.index_in(pa.array(pool[:3], DIGEST)).tolist() == [-1, -1, -1]
    assert DigestLookup(pa.array(stored, DIGEST)).index_in(pa.array([], DIGEST)).tolist() == []


@dataclasses.dataclass
class _Toy:
    """A store as the comparison sees it, and the digest each row's results were made from."""

    ids: pa.Array
    digests: pa.Array
    present: np.ndarray
    made_from: list[bytes]


PLAN_FIELDS = ("from_store", "source", "input_row", "store_row", "was_present")
PLAN_COUNTS = ("added", "replaced", "unchanged", "gone", "pruned", "superseded", "dropped",
               "appended_edits", "delta_digests")


def _plan_night(store: _Toy, table: dict[int, str], prune: bool, append_edits: bool) -> Any:
    """One update planned by `compare.plan` against `store`, the input given in
    partitions of 5 rows as the real comparison reads them."""
    from pipeline.extract.texthash import text_sha256_bytes
    from pipeline.run.compare import DIGEST, StoreRows, plan

    ids, texts = pa.array(list(table), pa.int64()), list(table.values())
    digests = pa.array(text_sha256_bytes(texts), DIGEST)

    def batches(id_type: Any) -> Iterator[Any]:
        for start in range(0, len(ids), 5):
            yield (ids[start : start + 5], digests[start : start + 5], pa.table({}),
                   texts[start : start + 5])

    return plan(StoreRows.of_arrays(store.ids, store.digests, store.present), batches,
                len(ids), prune, append_edits)


def test_rows_taken_from_a_chunked_column_as_from_one_array() -> None:
    """`take_rows` against a plain take of the joined column: rows in any order, repeated,
    none; chunks of any length, empty ones included."""
    from pipeline.run.compare import take_rows

    rng = np.random.default_rng(5)
    values = [f"v{i}" for i in range(50)]
    column = pa.chunked_array([values[:7], [], values[7:8], values[8:40], values[40:]])
    for rows in (rng.integers(0, 50, 200), np.arange(50)[::-1], np.array([3, 3, 49, 0]),
                 np.array([], np.int64)):
        assert take_rows(column, rows).to_pylist() == [values[r] for r in rows]


def test_a_text_on_many_rows_goes_to_its_digest_bucket_once_a_batch(tmp_path: Path) -> None:
    """Split into buckets, a batch's rows all go to the id buckets but only the first row
    of each distinct text to the digest buckets (an empty text on most rows would make one
    bucket of them all); every row learns where its text first is in its batch."""
    from pipeline.extract.texthash import text_sha256_bytes
    from pipeline.run import compare

    scratch = compare.Scratch(on_disk=True)
    keyed, by_id, by_digest = compare._buckets(scratch, "input", 4, pa.int64())
    first_of = np.full(40, -1, np.int64)
    texts = ["" if i % 4 else f"text {i}" for i in range(40)]
    for start in range(0, 40, 10):
        compare._add(by_id, by_digest, keyed, start, pa.array(range(start, start + 10)),
                     pa.array(text_sha256_bytes(texts[start : start + 10]), compare.DIGEST),
                     first_of)
    by_ids = sorted(r for b in range(4) for r in by_id.get(b).column("row").to_pylist())
    by_digests = sorted(r for b in range(4) for r in by_digest.get(b).column("row").to_pylist())
    assert by_ids == list(range(40))
    firsts = [start + next(i for i in range(10) if texts[start + i] == "")
              for start in range(0, 40, 10)]
    assert by_digests == sorted([i for i in range(40) if texts[i]] + firsts)
    assert first_of.tolist() == [i if texts[i] else firsts[i // 10] for i in range(40)]
    scratch.close()


def test_texts_changed_between_the_comparisons_two_reads_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Split into buckets, the texts to encode are read again: a text that is no longer
    the one compared fails the run, naming the file and row, and the scratch folder is
    removed."""
    from pipeline.errors import UnreadableInputError
    from pipeline.extract.source import plan_partitions
    from pipeline.extract.texthash import text_sha256_bytes
    from pipeline.run import compare
    from pipeline.spec import InputSpec

    monkeypatch.setattr(compare, "BUCKET_ROWS", 8)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    texts = [f"text {i}" for i in range(20)]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(20)), "text": texts}), source)
    spec = InputSpec(str(source), "text", "id")
    store = compare.StoreRows.of_arrays(
        pa.array(range(10), pa.int64()),
        pa.array(text_sha256_bytes(texts[:10]), compare.DIGEST), np.ones(10, bool))
    reads = []
    read_partition = compare.read_partition

    def second_read_differs(spec: Any, part: Any, cache: Any = None) -> Any:
        rows = read_partition(spec, part, cache)
        reads.append(part.index)
        if len(reads) > 3:  # the partitions of the second read
            rows.texts = [f"{t} rewritten" for t in rows.texts]
        return rows

    monkeypatch.setattr(compare, "read_partition", second_read_differs)
    with pytest.raises(UnreadableInputError, match=r"in.parquet changed while it was "
                       r"compared \(row 10 holds another text\)"):
        compare.compare(spec, plan_partitions(spec, 8), store, prune=False)
    assert list(temp.iterdir()) == []


def _night(store: _Toy, table: dict[int, str], prune: bool, append_edits: bool
           ) -> tuple[_Toy, Any, list[bytes]]:
    """One update planned in memory, and again split into buckets of 4 rows on a scratch
    disk in steps of 3 rows (the same plan, exactly); the next store as `assemble` writes
    it, and the plan."""
    from unittest import mock

    from pipeline.extract.texthash import text_sha256_bytes
    from pipeline.run import compare

    changes = _plan_night(store, table, prune, append_edits)
    with mock.patch.object(compare, "BUCKET_ROWS", 4), mock.patch.object(compare, "STEP_ROWS", 3):
        split = _plan_night(store, table, prune, append_edits)
    assert (split.scratch is not None and split.scratch.on_disk) == \
        (len(store.ids) + len(table) > 4)
    for name in PLAN_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(split, name)),
                                      np.asarray(getattr(changes, name)), err_msg=name)
    for name in PLAN_COUNTS:
        assert getattr(split, name) == getattr(changes, name), name
    np.testing.assert_array_equal(split.delta_rows, changes.delta_rows)
    assert split.inputs.ids.equals(changes.inputs.ids)
    split.close()
    ids, digests = list(table), text_sha256_bytes(list(table.values()))
    old_ids, old_digests = store.ids.to_pylist(), store.digests.to_pylist()
    new_ids = [ids[i] if i >= 0 else old_ids[r]
               for i, r in zip(changes.input_row, changes.store_row, strict=True)]
    new_digests = [digests[i] if i >= 0 else old_digests[r]
                   for i, r in zip(changes.input_row, changes.store_row, strict=True)]
    delta = list(changes.delta_digests)
    assert text_sha256_bytes(changes.delta_texts) == delta  # kept on the way, in one bucket
    assert split.delta_texts == [None] * len(delta) or not split.scratch.on_disk
    # the delta's first rows hold its texts, in input order
    assert [digests[r] for r in changes.delta_rows] == delta
    assert list(changes.delta_rows) == sorted(changes.delta_rows)
    made_from = [store.made_from[s] if f else delta[s]
                 for f, s in zip(changes.from_store, changes.source, strict=True)]
    after = _Toy(pa.array(new_ids, pa.int64()), pa.array(new_digests, compare.DIGEST),
                 np.asarray(changes.input_row) >= 0, made_from)
    changes.close()
    return after, changes, delta


@given(nights=st.lists(st.tuples(st.dictionaries(st.integers(0, 15),
                                                 st.sampled_from(["a", "b", "c", "d", "e"]),
                                                 max_size=12),
                                 st.booleans()), min_size=1, max_size=6),
       append_edits=st.booleans())
@settings(max_examples=300, deadline=None)
def test_plans_over_many_nights_keep_one_current_row_per_id(
        nights: list[tuple[dict[int, str], bool]], append_edits: bool) -> None:
    """Random nights of edits, reverts, deletions, returns and prunes, planned with edits
    appended (Icechunk) or in place: after each night every row's results are those of its
    recorded text; the present rows are exactly the input (one per id, its last row);
    texts the store held anywhere are copied, never encoded; with nothing dropped, the old
    rows keep their places, and with edits appended none of them takes new results (no
    chunk of the old rows is rewritten); superseded rows never pass their share. Each
    night is also planned split into buckets on disk: the same plan."""
    from pipeline.extract.texthash import text_sha256_bytes
    from pipeline.run.compare import DIGEST, SUPERSEDED_SHARE

    store = _Toy(pa.array([], pa.int64()), pa.array([], DIGEST), np.zeros(0, bool), [])
    for table, prune in nights:
        before = store
        store, changes, encoded = _night(before, table, prune, append_edits)
        ids = np.asarray(store.ids)
        digests = store.digests.to_pylist()
        assert store.made_from == digests  # every row's vectors are its text's
        want = dict(zip(table, text_sha256_bytes(list(table.values())), strict=True))
        present = np.flatnonzero(store.present)
        assert sorted(ids[present].tolist()) == sorted(want)  # one present row per id
        for row in present:
            assert digests[row] == want[ids[row]]
            assert row == np.flatnonzero(ids == ids[row])[-1]  # the id's last row
        held = set(before.digests.to_pylist())
        assert set(encoded) == set(want.values()) - held
        n_old = len(before.ids)
        if not changes.pruned and not changes.dropped and \
                len(ids) >= n_old and n_old == len(before.made_from):
            np.testing.assert_array_equal(ids[:n_old], np.asarray(before.ids))
            if changes.appended_edits:
                assert (changes.from_store[:n_old] & (changes.source[:n_old]
                                                      == np.arange(n_old))).all()
        stale = [r for r in range(len(ids)) if r != np.flatnonzero(ids == ids[r])[-1]]
        if append_edits or prune:  # superseded rows within their share, none after a prune
            assert len(stale) <= SUPERSEDED_SHARE * len(ids) and not (prune and stale)
        else:  # edits in place: an id never has two rows
            assert not stale and not changes.appended_edits
        if prune:
            assert store.present.all()
