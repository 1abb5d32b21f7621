"""The delta format: one Delta Lake table per level, versioned by Delta's log.

Oracles: the Parquet format's store of the same job (same encoder, so the same vectors),
Delta's own log (which files a commit added and removed), and readers that know nothing
of bertpipe: deltalake, polars, DuckDB (over the table's pyarrow dataset: its delta
extension is downloaded on first use) and pandas.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from deltalake import DeltaTable

import pipeline
from pipeline.cli import main
from pipeline.errors import StoreError
from pipeline.run.runner import run_job
from pipeline.spec import Job
from pipeline.stores import delta_store, detect_format
from pipeline.stores.delta_store import DeltaFormat
from pipeline.stores.verify import verify_store
from tests.conftest import REVIEWS, assert_same_results, job_dict, whitened_in_place


def _texts(n: int) -> list[str]:
    texts = pq.read_table(REVIEWS).column("text").to_pylist()
    return [f"{texts[i % len(texts)][:200]} ({i})" for i in range(n)]  # distinct


def _input(path: Path, texts: list[str], ids: list[str] | None = None) -> Path:
    ids = ids or [f"r{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"id": ids, "text": texts}), path)
    return path


def _job(tmp_path: Path, model: Path, source: Path, fmt: str = "delta", name: str = "o",
         **output: Any) -> Job:
    return Job.from_dict(job_dict(source, model, tmp_path / f"{name}.{fmt}",
                                  output={"format": fmt, **output},
                                  chunking={"strategy": "hierarchical", "max_tokens": 16,
                                            "overlap": 4}))


def _plain(store: str | Path, level: str = "docs") -> pa.Table:
    """A level as deltalake reads it, in the store's order (its order column)."""
    table = DeltaTable(str(Path(store) / level)).to_pyarrow_table()
    keys = [("row", "ascending")] if level == "docs" else [("doc", "ascending"),
                                                           ("seq", "ascending")]
    return table.sort_by(keys)


def _matrix(column: pa.ChunkedArray) -> np.ndarray:
    return np.stack(column.to_numpy(zero_copy_only=False))


def test_full_run_equals_the_parquet_format_and_reads_without_bertpipe(
        tmp_path: Path, tiny_bert: Path) -> None:
    pl = pytest.importorskip("polars")
    duckdb = pytest.importorskip("duckdb")
    source = _input(tmp_path / "in.parquet", _texts(40))
    delta, plain = _job(tmp_path, tiny_bert, source), _job(tmp_path, tiny_bert, source,
                                                           "parquet")
    run_job(delta)
    run_job(plain)
    a, b = pipeline.open_store(delta.output.path), pipeline.open_store(plain.output.path)
    assert a.format == "delta" and a.provenance.complete and a.provenance.version == 0
    assert_same_results(a, b)
    np.testing.assert_array_equal(a.chunks["doc"].values, b.chunks["doc"].values)
    assert verify_store(delta.output.path) == []
    want = b.vectors("mean")
    path = Path(delta.output.path)
    # deltalake and pandas
    docs = _plain(path)
    assert docs.column("id").to_pylist() == [f"r{i}" for i in range(40)]
    np.testing.assert_array_equal(_matrix(docs.column("mean")), want)
    frame = DeltaTable(str(path / "docs")).to_pandas().sort_values("row")
    np.testing.assert_array_equal(np.stack(frame["mean"].to_numpy()), want)
    # polars, eager and lazy
    got = pl.read_delta(str(path / "docs")).sort("row")
    np.testing.assert_array_equal(np.stack(got["mean"].to_list()), want)
    lazy = pl.scan_delta(str(path / "chunks")).select(pl.len()).collect().item()
    assert lazy == a.chunks.sizes["chunk"]
    # DuckDB over the table's Arrow dataset
    dataset = DeltaTable(str(path / "docs")).to_pyarrow_dataset()  # noqa: F841 (DuckDB scans it)
    ids = duckdb.sql("select id from dataset order by row").fetchall()
    assert [i for (i,) in ids] == [f"r{i}" for i in range(40)]
    # the provenance and history: in the docs table's commit metadata
    head = DeltaTable(str(path / "docs")).history(1)[0]
    assert head["bertpipe_complete"] is True and head["bertpipe_version"] == 0
    assert json.loads(head["bertpipe"])["stats"]["rows"] == 40
    facts = json.loads(CliRunner().invoke(main, ["inspect", str(path), "--json"]).stdout)
    assert facts["format"] == "delta" and facts["readable_versions"] == [0]


@pytest.mark.slow  # several runs: in make test, not make test-fast
def test_an_update_rewrites_only_the_files_that_changed(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """160 rows in docs files of 16; one text changed (row 37: the file of rows 32-47) and
    4 rows added. The docs commit removes that one file and adds its rewrite and one file
    of new rows, nothing else; the result equals a run from scratch."""
    monkeypatch.setattr(delta_store, "DELTA_ROWS_PER_FILE", 16)
    texts = _texts(164)
    source = _input(tmp_path / "in.parquet", texts[:160])
    job = _job(tmp_path, tiny_bert, source, incremental=True)
    run_job(job)
    path = Path(job.output.path)
    before = {p.name for p in (path / "docs").glob("*.parquet")}
    files_before = DeltaTable(str(path / "docs")).file_uris()
    assert len(files_before) == 10
    texts[37] = "a text that changed overnight"
    _input(source, texts)
    summary = run_job(job, incremental=True)
    assert (summary.added, summary.replaced, summary.encoded) == (4, 1, 5)
    docs = DeltaTable(str(path / "docs"))
    removed = [Path(u).name for u in files_before if u not in docs.file_uris()]
    added = [Path(u).name for u in docs.file_uris() if u not in files_before]
    assert len(removed) == 1 and len(added) == 2
    covered = pq.read_table(path / "docs" / removed[0]).column("row").to_pylist()
    assert covered == list(range(32, 48))
    rows = sorted(len(pq.read_table(path / "docs" / name)) for name in added)
    assert rows == [4, 16]
    written = {p.name for p in (path / "docs").glob("*.parquet")} - before
    assert written == set(added)  # nothing else was written
    scratch = _job(tmp_path, tiny_bert, source, name="scratch")
    run_job(scratch)
    now, fresh = pipeline.open_store(path), pipeline.open_store(scratch.output.path)
    np.testing.assert_array_equal(now.docs["id"].values, fresh.docs["id"].values)
    for view in ("mean", "cls"):
        np.testing.assert_allclose(now.vectors(view), fresh.vectors(view), atol=1e-5)
        np.testing.assert_allclose(now.vectors(view, "chunks"), fresh.vectors(view, "chunks"),
                                   atol=1e-5)
    np.testing.assert_array_equal(now.chunks["doc"].values, fresh.chunks["doc"].values)
    assert verify_store(path) == []


def test_an_update_reads_of_a_kept_file_only_its_carried_columns(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """24 rows in docs files of 4, a label carried. Night one: row 2's text changed (its
    file rewritten, its three kept rows' results taken from the old file), row 9's label
    changed, text kept (its file rewritten for the label alone), row 17 gone from the
    input (its `present` flag flips), two rows added. The three files of nothing but kept
    rows are kept, and of them only the row keys and labels are read: not one vector.
    Every row's vectors and chunks equal a run from scratch of the same input."""
    monkeypatch.setattr(delta_store, "DELTA_ROWS_PER_FILE", 4)
    texts, labels = _texts(26), [f"l{i}" for i in range(26)]
    source = tmp_path / "in.parquet"

    def write(rows: list[int], text: dict[int, str], label: dict[int, str]) -> None:
        pq.write_table(pa.table({"id": [f"r{i}" for i in rows],
                                 "text": [text.get(i, texts[i]) for i in rows],
                                 "label": [label.get(i, labels[i]) for i in rows]}), source)

    def carrying(name: str) -> Job:
        job = job_dict(source, tiny_bert, tmp_path / f"{name}.delta",
                       input={"carry_columns": ["label"]}, output={"format": "delta"},
                       chunking={"strategy": "hierarchical", "max_tokens": 16, "overlap": 4})
        return Job.from_dict(job)

    write(list(range(24)), {}, {})
    job = carrying("o")
    run_job(job)
    path = Path(job.output.path)
    files_before = DeltaTable(str(path / "docs")).file_uris()
    assert len(files_before) == 6
    reads: list[tuple[str, str, tuple[str, ...] | None]] = []
    original = DeltaFormat._read_file

    def recorded(self: DeltaFormat, level: str, file: str,
                 columns: list[str] | None = None) -> pa.Table:
        reads.append((level, Path(file).name, None if columns is None else tuple(columns)))
        return original(self, level, file, columns)

    monkeypatch.setattr(DeltaFormat, "_read_file", recorded)
    night = [i for i in range(26) if i != 17]
    write(night, {2: "a text that changed overnight"}, {9: "relabelled"})
    summary = run_job(job, incremental=True)
    assert (summary.added, summary.replaced, summary.encoded, summary.gone) == (2, 1, 3, 1)
    docs_now = DeltaTable(str(path / "docs")).file_uris()
    first_row = {Path(u).name: pq.read_table(u).column("row")[0].as_py() for u in files_before}
    removed = {Path(u).name for u in files_before if u not in docs_now}
    assert sorted(first_row[name] for name in removed) == [0, 8, 16]
    kept_reads = [columns for level, name, columns in reads
                  if level == "docs" and name in first_row and name not in removed]
    assert kept_reads and all(columns == ("row", "label") for columns in kept_reads), \
        kept_reads
    store = pipeline.open_store(path)
    scratch = carrying("scratch")
    run_job(scratch)
    fresh = pipeline.open_store(scratch.output.path)
    here = {key: i for i, key in enumerate(np.asarray(store.docs["id"].values))}
    assert not bool(store.docs["present"].values[here["r17"]])
    assert store.docs["label"].values[here["r9"]] == "relabelled"
    ids = list(np.asarray(fresh.docs["id"].values))
    assert sorted(ids) == sorted(k for k in here if k != "r17")
    at = [here[key] for key in ids]
    for view in ("mean", "cls"):
        np.testing.assert_allclose(store.vectors(view)[at], fresh.vectors(view), atol=1e-5)
        mine, theirs = _chunks_by_id(store, view), _chunks_by_id(fresh, view)
        for key in ids:
            np.testing.assert_allclose(mine[key], theirs[key], atol=1e-5, err_msg=key)
    assert np.asarray(store.docs["label"].values)[at].tolist() == \
        np.asarray(fresh.docs["label"].values).tolist()
    assert verify_store(path) == []


def _chunks_by_id(store: Any, view: str) -> dict[str, np.ndarray]:
    """Each document's chunk vectors of `view`, in order, by the document's id."""
    ids = np.asarray(store.docs["id"].values)[np.asarray(store.chunks["doc"].values)]
    vectors = store.vectors(view, "chunks")
    return {key: vectors[ids == key] for key in np.unique(ids)}


def test_an_update_after_a_night_of_empty_texts_only(tmp_path: Path, tiny_bert: Path) -> None:
    """Night one's texts are all empty (no chunk at all: a chunks table of no files); on
    night two one gets a text. Its chunks are written (none was kept back for a file that
    does not exist) and the store equals a run from scratch."""
    source = _input(tmp_path / "in.parquet", ["", ""])
    job = _job(tmp_path, tiny_bert, source)
    run_job(job)
    assert pipeline.open_store(job.output.path).chunks.sizes.get("chunk", 0) == 0
    _input(source, ["the drug worked very well for my pain, and quickly", ""])
    summary = run_job(job, incremental=True)
    assert (summary.replaced, summary.encoded) == (1, 1)
    assert verify_store(job.output.path) == []
    scratch = _job(tmp_path, tiny_bert, source, name="scratch")
    run_job(scratch)
    now, fresh = pipeline.open_store(job.output.path), pipeline.open_store(scratch.output.path)
    assert now.chunks.sizes["chunk"] == fresh.chunks.sizes["chunk"] > 0
    assert_same_results(now, fresh)


@pytest.mark.slow  # a dozen updates
def test_checkpoints_bound_the_log_and_every_version_stays_readable(
        tmp_path: Path, tiny_bert: Path) -> None:
    """A table's log gets a checkpoint every 10 commits (an open then reads the checkpoint
    and the commits after it, not the whole log), and no commit is expired with it: the
    first version opens exactly as it was after the checkpoint."""
    from deltalake import DeltaTable

    texts = _texts(24)
    source = _input(tmp_path / "in.parquet", texts[:10])
    job = _job(tmp_path, tiny_bert, source, incremental=True)
    run_job(job)
    path = Path(job.output.path)
    first = pipeline.open_store(str(path)).vectors("mean")
    log = path / "docs" / "_delta_log"
    rows = 10
    while DeltaTable(str(path / "docs")).version() < 10 and rows < len(texts):
        rows += 1
        _input(source, texts[:rows])
        run_job(job, incremental=True)
    table = DeltaTable(str(path / "docs"))
    assert table.version() >= 10
    assert table.metadata().configuration == delta_store.TABLE_CONFIGURATION
    checkpoint = json.loads((log / "_last_checkpoint").read_text())["version"]
    assert checkpoint == 9  # the 10th commit's
    assert (log / f"{checkpoint:020d}.checkpoint.parquet").is_file()
    # the commits before the checkpoint are kept (expiry by age is off, as the
    # configuration above says: a test cannot wait out delta-rs's 30 days to see it)
    assert (log / f"{0:020d}.json").is_file()
    np.testing.assert_array_equal(pipeline.open_store(str(path), version=0).vectors("mean"),
                                  first)
    assert int(pipeline.open_store(str(path)).docs.sizes["doc"]) == rows
    assert verify_store(str(path)) == []
    # a damaged checkpoint is one line naming the table, not a traceback or a wrong read
    checkpoint_file = log / f"{checkpoint:020d}.checkpoint.parquet"
    checkpoint_file.write_bytes(checkpoint_file.read_bytes()[:100])
    with pytest.raises(StoreError, match="docs: damaged Delta table"):
        pipeline.open_store(str(path))


@pytest.mark.slow  # several runs: in make test, not make test-fast
def test_time_travel_a_reader_of_an_old_version_and_gc(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each update (rows added, one edited) is a version open_store can still open, exactly
    as it was; a reader that opened version k keeps reading it while k+1 commits; gc keeps
    the newest N and frees what only the others use; pruned rows leave their files."""
    monkeypatch.setattr(delta_store, "DELTA_ROWS_PER_FILE", 8)
    texts = _texts(60)
    source = _input(tmp_path / "in.parquet", texts[:30])
    job = _job(tmp_path, tiny_bert, source, incremental=True)
    run_job(job)
    path = job.output.path
    seen = {0: pipeline.open_store(path).vectors("mean")}
    for version, rows in ((1, 40), (2, 50), (3, 60)):
        holder = pipeline.open_store(path)  # lazily: read after the next commit
        texts[version] = f"the text of row {version}, edited for version {version}"
        _input(source, texts[:rows])
        assert run_job(job, incremental=True).version == version
        np.testing.assert_array_equal(holder.vectors("mean"), seen[version - 1])
        seen[version] = pipeline.open_store(path).vectors("mean")
    for version, vectors in seen.items():
        np.testing.assert_array_equal(
            pipeline.open_store(path, version=version).vectors("mean"), vectors)
    result = CliRunner().invoke(main, ["inspect", path])
    assert "versions kept: 3, 2, 1, 0" in result.stdout
    size = _disk_bytes(Path(path))
    result = CliRunner().invoke(main, ["gc", path, "--keep", "2"])
    assert result.exit_code == 0, result.output
    assert "expired versions 0, 1" in result.stdout and "versions kept: 2, 3" in result.stdout
    assert _disk_bytes(Path(path)) < size
    assert detect_format(path).version_numbers() == [3, 2]
    with pytest.raises(StoreError, match="no version 1 \\(versions kept: 3, 2\\)"):
        pipeline.open_store(path, version=1)
    np.testing.assert_array_equal(pipeline.open_store(path, version=2).vectors("mean"),
                                  seen[2])
    np.testing.assert_array_equal(pipeline.open_store(path).vectors("mean"), seen[3])
    assert verify_store(path) == []
    again = CliRunner().invoke(main, ["gc", path, "--keep", "2"])
    assert "nothing to expire" in again.stdout
    # prune: the ids gone leave the store, their files rewritten without them
    _input(source, texts[:60], ids=[f"r{i}" for i in range(60)])
    pq.write_table(pq.read_table(source).slice(0, 50), source)
    summary = run_job(job, incremental=True, prune=True)
    assert summary.pruned == 10 and summary.version == 4
    store = pipeline.open_store(path)
    np.testing.assert_array_equal(store.vectors("mean"), seen[3][:50])
    assert int(store.chunks["doc"].values.max()) == 49
    assert verify_store(path) == []


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_a_killed_publish_leaves_the_previous_version_and_a_rerun_completes(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after the chunks table's commit, before the docs commit that completes the
    version: readers (bertpipe's and Delta's of the docs table) see the previous version;
    the next run rolls the chunks table back and publishes."""
    texts = _texts(24)
    source = _input(tmp_path / "in.parquet", texts[:20])
    job = _job(tmp_path, tiny_bert, source, incremental=True)
    run_job(job)
    before = pipeline.open_store(job.output.path).vectors("mean", "chunks")
    original = DeltaTable.create_write_transaction

    def killed(self: DeltaTable, actions: Any, *args: Any, **kwargs: Any) -> None:
        if self.table_uri.rstrip("/").endswith("docs"):
            raise KeyboardInterrupt
        original(self, actions, *args, **kwargs)

    _input(source, texts)
    monkeypatch.setattr(DeltaTable, "create_write_transaction", killed)
    with pytest.raises(KeyboardInterrupt):
        run_job(job, incremental=True)
    monkeypatch.undo()
    store = pipeline.open_store(job.output.path)
    assert store.provenance.version == 0
    np.testing.assert_array_equal(store.vectors("mean", "chunks"), before)
    assert _plain(job.output.path).num_rows == 20
    assert verify_store(job.output.path) == []
    summary = run_job(job, incremental=True)
    assert summary.version == 1 and summary.encoded == 4
    assert verify_store(job.output.path) == []
    store = pipeline.open_store(job.output.path)
    np.testing.assert_array_equal(store.vectors("mean", "chunks")[:len(before)], before)
    assert _plain(job.output.path, "chunks").num_rows == store.chunks.sizes["chunk"]


def test_a_commit_that_meets_another_writers_commit_is_refused(
        tmp_path: Path, tiny_bert: Path) -> None:
    """Two handles write the same store (bertpipe's lock normally prevents it): the first
    commit lands, the second is refused (exit 5) and nothing of it is committed."""
    source = _input(tmp_path / "in.parquet", _texts(10))
    job = _job(tmp_path, tiny_bert, source)
    run_job(job)
    first, second = DeltaFormat(job.output.path), DeltaFormat(job.output.path)
    first._begin_write()
    second._begin_write()
    raw = first.record() or {}
    first.write_record({**raw, "created": "first"})
    with pytest.raises(StoreError, match="another run committed to the store meanwhile") as err:
        second.write_record({**raw, "created": "second"})
    assert err.value.exit_code == 5
    assert (DeltaFormat(job.output.path).record() or {})["created"] == "first"
    assert verify_store(job.output.path) == []


def test_float16_vectors_read_back_as_float16(tmp_path: Path, tiny_bert: Path) -> None:
    """Delta has no float16: the values are kept as float32 (exactly) and read back."""
    source = _input(tmp_path / "in.parquet", _texts(6))
    job = _job(tmp_path, tiny_bert, source, dtype="float16")
    run_job(job)
    store = pipeline.open_store(job.output.path)
    assert store.docs["mean"].dtype == np.float16
    field = DeltaTable(str(Path(job.output.path) / "docs")).schema().to_arrow().field("mean")
    assert dict(field.metadata or {})[b"bertpipe.dtype"] == b"float16"
    stored = _matrix(_plain(job.output.path).column("mean"))
    np.testing.assert_array_equal(stored.astype(np.float16), store.vectors("mean"))


def test_a_view_whitened_in_place_to_fewer_dimensions(tmp_path: Path, tiny_bert: Path) -> None:
    source = _input(tmp_path / "in.parquet", _texts(30))
    got, want = whitened_in_place(source, tiny_bert, tmp_path, "delta", "parquet")
    assert got.shape == want.shape == (30, 8)
    np.testing.assert_array_equal(got, want)
    assert verify_store(str(tmp_path / "w.delta")) == []
    assert _matrix(_plain(tmp_path / "w.delta").column("mean")).shape == (30, 8)


# --- on an object store: the loopback S3 endpoint of tests/test_object_store.py ------------

@pytest.mark.slow  # a 400-row store, its update and a run from scratch
def test_update_on_s3_encodes_only_new_and_changed_rows(
        s3_endpoint: str, tmp_path: Path, tiny_bert: Path) -> None:
    """The scenario of tests/test_incremental.py on a store in a bucket: 400 rows, then 150
    new, 20 edited, 10 deleted: exactly 170 encoded, the store equals a run from scratch by
    id, version 0 stays readable, verify passes and catches a damaged data file."""
    import s3fs

    from tests.s3server import make_bucket
    from tests.test_incremental import (
        BASE_ROWS,
        EDITED,
        NEW_ROWS,
        _base,
        _updated,
        assert_same_rows,
    )
    from tests.test_incremental import (
        _job as scenario_job,
    )

    bucket = f"delta-{uuid.uuid4().hex[:10]}"
    make_bucket(s3_endpoint, bucket)
    out = f"s3://{bucket}/nightly/reviews.delta"
    source = tmp_path / "reviews.parquet"
    pq.write_table(_base(), source)
    job = scenario_job(tiny_bert, source, tmp_path / "unused", "delta",
                       output={"path": out, "format": "delta"})
    run_job(job)
    first = pipeline.open_store(out).vectors("mean")
    pq.write_table(_updated(), source)
    summary = run_job(job, incremental=True)
    assert (summary.encoded, summary.added, summary.replaced) == (NEW_ROWS + EDITED, NEW_ROWS,
                                                                 EDITED)
    full_source = tmp_path / "updated.parquet"
    pq.write_table(_updated(), full_source)
    scratch = scenario_job(tiny_bert, full_source, tmp_path / "scratch.delta", "delta")
    run_job(scratch)
    store = pipeline.open_store(out)
    assert store.provenance.version == 1 and int(store.docs.sizes["doc"]) == \
        BASE_ROWS + NEW_ROWS
    assert_same_rows(store, pipeline.open_store(scratch.output.path), ["mean", "cls"])
    np.testing.assert_array_equal(pipeline.open_store(out, version=0).vectors("mean"), first)
    assert verify_store(out) == []
    fs = s3fs.S3FileSystem()
    (data,) = [f for f in fs.ls(f"{bucket}/nightly/reviews.delta/docs")
               if f.endswith(".parquet") and f.rsplit("/", 1)[-1] in {
                   Path(u).name for u in DeltaTable(f"{out}/docs", storage_options={
                       "AWS_ALLOW_HTTP": "true"}).file_uris()}][:1] or [None]
    assert data is not None
    raw = bytearray(fs.cat_file(data))
    raw[len(raw) // 3] ^= 0xFF
    fs.pipe_file(data, bytes(raw))
    problems = verify_store(out)
    assert problems and "is damaged (its bytes do not match the recorded checksum)" in \
        problems[0]


def test_an_open_parses_each_footer_once_and_loads_each_table_version_once(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 rows in files of 8 (5 files a level): opening the store and reading every column
    of both levels parses each file's footer once (not once per column and row group) and
    loads each table's version once (each load replays the table's log)."""
    from pipeline.stores import parquet_store

    monkeypatch.setattr(delta_store, "DELTA_ROWS_PER_FILE", 8)
    source = _input(tmp_path / "in.parquet", _texts(40))
    job = _job(tmp_path, tiny_bert, source)
    run_job(job)
    footers: list[bool] = []
    loads: list[tuple[str, int | None]] = []
    parquet_file, table = parquet_store.pq.ParquetFile, delta_store.DeltaTable

    def counted_file(*args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        footers.append(metadata is None)  # None: the footer is read and parsed
        return parquet_file(*args, metadata=metadata, **kwargs)

    def counted_table(uri: str, version: int | None = None, **kwargs: Any) -> Any:
        loads.append((Path(uri).name, version))
        return table(uri, version=version, **kwargs)

    monkeypatch.setattr(parquet_store.pq, "ParquetFile", counted_file)
    monkeypatch.setattr(delta_store, "DeltaTable", counted_table)
    store = pipeline.open_store(job.output.path)
    for level in (store.docs, store.chunks):
        for name in level.variables:
            np.asarray(level[name].values)
    files = sum(len(DeltaTable(str(Path(job.output.path) / level)).file_uris())
                for level in ("docs", "chunks"))
    assert files >= 10
    assert sum(footers) == files, (sum(footers), files)  # blocks read: footers given
    assert len(footers) > sum(footers)
    pinned = [load for load in loads if load[1] is not None]
    assert len(pinned) == len(set(pinned)), loads
