"""One suite that every store format runs: round trips through open_store, xarray,
pandas and pyarrow; provenance; atomic completion; rerun rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xarray as xr

import pipeline
from pipeline.errors import StoreError
from pipeline.extract.partition import Extractor
from pipeline.extract.source import plan_partitions
from pipeline.run.runner import run_job
from pipeline.spec import Job
from tests.conftest import job_dict, write_table

FORMATS = list(pipeline.stores.FORMATS)  # every registered format runs this suite


def _job(tmp_path: Path, model: Path, source: Path, fmt: str, **sections) -> Job:  # type: ignore[no-untyped-def]
    out = tmp_path / f"out.{fmt}"
    defaults = {
        "output": {"path": str(out), "format": fmt},
        "input": {"carry_columns": ["label"]},
        "views": {"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"},
                  "cat": {"layers": [1, 2], "combine": "concat", "pooling": "max"}},
    }
    raw = job_dict(source, model, out, **{**defaults, **sections})
    return Job.from_dict(raw)


def _direct_vectors(job: Job) -> dict[str, np.ndarray]:
    """The same rows encoded in one go, bypassing partitions and stores."""
    ex = Extractor(job)
    texts = pq.read_table(job.input.path).column("text").to_pylist()
    ids = [ex.model.tokenizer.encode(t) for t in texts]
    return ex.encoder.encode(ids, job.batching)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_open_store(fmt: str, tmp_path: Path, tiny_bert: Path,
                               small_texts: Path) -> None:
    job = _job(tmp_path, tiny_bert, small_texts, fmt)
    summary = run_job(job)
    assert summary.rows == 10 and summary.run == 2 and not summary.failed
    store = pipeline.open_store(job.output.path)
    assert store.format == fmt
    table = pq.read_table(small_texts)
    assert list(store.docs["id"].values) == table.column("id").to_pylist()
    assert list(store.docs["label"].values) == table.column("label").to_pylist()
    assert store.docs["cat"].shape == (10, 64)
    assert store.docs.sizes["doc"] == 10
    expected = _direct_vectors(job)
    for view in ("mean", "cls", "cat"):
        np.testing.assert_allclose(store.vectors(view), expected[view], atol=1e-6)
    assert store.chunks is not None and store.chunks.sizes["chunk"] == 10
    np.testing.assert_array_equal(store.chunks["doc"].values, np.arange(10))
    prov = store.provenance
    assert prov.complete is True and prov.format_version == 1
    assert prov.job.view("cat").combine == "concat"
    assert len(next(iter(prov.model.weights_sha256.values()))) == 64
    assert set(prov.versions) == {"bertpipe", "torch", "transformers"}
    assert prov.device == ["cpu"] and prov.dtype == ["float32"]
    assert not (Path(job.output.path) / "_bertpipe").exists()


def test_zarr_reads_with_plain_xarray(tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    job = _job(tmp_path, tiny_bert, small_texts, "zarr")
    run_job(job)
    ds = xr.open_zarr(job.output.path, group="docs")
    assert ds["mean"].dims == ("id", "mean_dim")  # the ids index the rows: ds.sel(id=...)
    np.testing.assert_array_equal(ds["mean"].values,
                                  pipeline.open_store(job.output.path).vectors("mean"))
    assert list(ds["id"].values) == [f"r{i}" for i in range(10)] and "id" in ds.indexes
    # by id, in another order than stored: the rows the API finds by position
    by_position = pipeline.open_store(job.output.path).vectors("mean")
    np.testing.assert_array_equal(ds.sel(id=["r7", "r2"])["mean"].values, by_position[[7, 2]])


def test_parquet_reads_with_pandas_and_pyarrow(tmp_path: Path, tiny_bert: Path,
                                               small_texts: Path) -> None:
    job = _job(tmp_path, tiny_bert, small_texts, "parquet")
    run_job(job)
    docs = Path(job.output.path) / "docs/part-0.parquet"
    df = pd.read_parquet(docs)
    assert list(df.columns[:6]) == ["id", "n_tokens", "n_chunks", "truncated", "status", "label"]
    assert len(df["mean"].iloc[0]) == 32
    table = pq.read_table(docs)
    assert str(table.schema.field("mean").type) == "fixed_size_list<element: float>[32]"
    prov = json.loads(table.schema.metadata[b"bertpipe"])
    assert prov["complete"] is True
    np.testing.assert_allclose(np.stack(df["mean"].to_numpy()),
                               pipeline.open_store(job.output.path).vectors("mean"))
    mean_leaf = table.schema.get_field_index("mean")  # columns before it are flat: leaf = field
    encodings = pq.ParquetFile(docs).metadata.row_group(0).column(mean_leaf).encodings
    assert "BYTE_STREAM_SPLIT" in encodings


@pytest.mark.parametrize("fmt", FORMATS)
def test_float16_output_halves_size(fmt: str, tmp_path: Path, tiny_bert: Path,
                                    small_texts: Path) -> None:
    job = _job(tmp_path, tiny_bert, small_texts, fmt,
               output={"path": str(tmp_path / f"h.{fmt}"), "format": fmt, "dtype": "float16"})
    run_job(job)
    store = pipeline.open_store(job.output.path)
    assert store.docs["mean"].dtype == np.float16
    np.testing.assert_allclose(store.vectors("mean"), _direct_vectors(job)["mean"], atol=2e-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_docs_only_level(fmt: str, tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    job = _job(tmp_path, tiny_bert, small_texts, fmt,
               output={"path": str(tmp_path / f"d.{fmt}"), "format": fmt, "levels": ["docs"]})
    run_job(job)
    assert pipeline.open_store(job.output.path).chunks is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_rerun_skips_and_changed_job_is_refused(fmt: str, tmp_path: Path, tiny_bert: Path,
                                                small_texts: Path) -> None:
    job = _job(tmp_path, tiny_bert, small_texts, fmt)
    run_job(job)
    before = pipeline.open_store(job.output.path).vectors("mean")
    assert run_job(job).already_complete
    changed = _job(tmp_path, tiny_bert, small_texts, fmt,
                   views={"mean": {"pooling": "max"}})
    with pytest.raises(StoreError, match="different job or model.*--overwrite"):
        run_job(changed)
    np.testing.assert_array_equal(pipeline.open_store(job.output.path).vectors("mean"), before)
    run_job(changed, overwrite=True)
    assert pipeline.open_store(job.output.path).provenance.job.view("mean").pooling == "max"


@pytest.mark.parametrize("fmt", FORMATS)
def test_incomplete_store_does_not_open_and_resumes(fmt: str, tmp_path: Path, tiny_bert: Path,
                                                    small_texts: Path) -> None:
    """A run that dies after one partition leaves a store that is refused, then resumed."""
    job = _job(tmp_path, tiny_bert, small_texts, fmt)
    _killed_after(job, 1)
    _assert_refused_then_resumed(job, tmp_path, tiny_bert, small_texts, fmt)


def _killed_after(job: Job, first: int) -> None:
    """Run `job` until its first `first` partitions are staged, then die (as a killed run)."""
    from pipeline.run import runner

    class Dies(runner.InProcessExecutor):
        def run(self, job, parts, staging, fingerprint, on_done):  # type: ignore[no-untyped-def]
            super().run(job, parts[:first], staging, fingerprint, on_done)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_job(job, executor=Dies())


def _assert_refused_then_resumed(job: Job, tmp_path: Path, model: Path, source: Path,
                                 fmt: str) -> None:
    """The unfinished store at `job`'s path opens as incomplete; the rerun encodes one
    partition, keeps the other, and gives the store a clean run gives."""
    with pytest.raises(StoreError, match="incomplete"):
        pipeline.open_store(job.output.path)
    summary = run_job(job)
    assert summary.skipped == 1 and summary.run == 1
    clean = _job(tmp_path / "clean", model, source, fmt)
    run_job(clean)
    for view in ("mean", "cls", "cat"):
        np.testing.assert_array_equal(pipeline.open_store(job.output.path).vectors(view),
                                      pipeline.open_store(clean.output.path).vectors(view))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_resume_reads_each_staged_part_once(fmt: str, tmp_path: Path, tiny_bert: Path,
                                              small_texts: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts a killed run left are not hashed at the start of the resume and read again at
    the commit: each part file is read once."""
    from pipeline.io.location import Location

    job = _job(tmp_path, tiny_bert, small_texts, fmt)
    _killed_after(job, 1)
    reads: dict[str, int] = {}
    read_bytes = Location.read_bytes

    def counted(self: Location, *args: Any, **kwargs: Any) -> bytes:
        if "/_bertpipe/parts/" in self.path and self.path.endswith(".parquet"):
            reads[self.path] = reads.get(self.path, 0) + 1
        return read_bytes(self, *args, **kwargs)

    monkeypatch.setattr(Location, "read_bytes", counted)
    summary = run_job(job)
    assert summary.skipped == 1 and summary.run == 1
    assert any(Path(p).name == "000000.docs.parquet" for p in reads), reads
    assert all(n == 1 for n in reads.values()), reads


@pytest.mark.parametrize("fmt", ["zarr", "parquet"])
def test_a_staged_part_altered_before_the_resume_is_encoded_again(
        fmt: str, tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    """Same size, other bytes (a flipped byte in a part a killed run left): the resume's
    commit refuses it (exit 6, nothing published, its marker removed) and the next rerun
    encodes that partition again, to a store equal to a clean run."""
    from pipeline.errors import PartitionError
    from pipeline.stores.staging import Staging

    job = _job(tmp_path, tiny_bert, small_texts, fmt)
    _killed_after(job, 1)
    staging = Staging(job.output.path)
    part = staging.part_path(0, "docs")
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside the column data, not the footer
    part.write_bytes(bytes(data))
    with pytest.raises(PartitionError, match=r"staged partition 0 changed after it was written"):
        run_job(job)
    assert not staging.marker(0).exists() and staging.marker(1).exists()
    _assert_refused_then_resumed(job, tmp_path, tiny_bert, small_texts, fmt)


@pytest.mark.parametrize("fmt", ["zarr", "icechunk"])
def test_open_without_dask_reads_the_same_values(fmt: str, tmp_path: Path,
                                                tiny_bert: Path) -> None:
    """`open_store(path, dask=False)`: no dask arrays, and every variable of every level
    (strings with their nulls, vectors, slices) equal to the dask-backed open."""
    import dask.array as da

    source = write_table(tmp_path / "in.parquet", {
        "id": [f"r{i}" for i in range(6)],
        "text": ["good drug", "", "bad side effects for a week and then some more", None,
                 "it worked", "no sleep"],
        "label": ["pos", None, "neg", "neg", None, "pos"]})
    job = _job(tmp_path, tiny_bert, source, fmt, chunking={"strategy": "hierarchical",
                                                          "max_tokens": 8})
    run_job(job)
    lazy = pipeline.open_store(job.output.path)
    plain = pipeline.open_store(job.output.path, dask=False)
    assert plain.chunks is not None and lazy.chunks is not None
    for got, want in ((plain.docs, lazy.docs), (plain.chunks, lazy.chunks)):
        assert sorted(got.variables) == sorted(want.variables)
        for name in want.variables:
            assert not isinstance(got[name].variable._data, da.Array), name
            a, b = np.asarray(got[name].values), np.asarray(want[name].values)
            assert a.dtype == b.dtype, name
            np.testing.assert_array_equal(a, b, err_msg=str(name))
    assert None in plain.docs["label"].values.tolist()  # a null carried value stays None
    np.testing.assert_array_equal(plain.docs["mean"][2:5, :3].values,
                                  lazy.docs["mean"][2:5, :3].values)


def test_partitions_follow_row_groups_and_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    write_table(src / "b.parquet", {"text": ["x"] * 5}, row_group_size=2)
    write_table(src / "a.parquet", {"text": ["y"] * 3})
    from pipeline.spec import InputSpec

    parts = plan_partitions(InputSpec(str(src), "text"), 2)
    assert [(Path(p.file).name, p.row_start, p.row_stop) for p in parts] == [
        ("a.parquet", 0, 2), ("a.parquet", 2, 3),
        ("b.parquet", 3, 5), ("b.parquet", 5, 7), ("b.parquet", 7, 8)]


def _counting_row_group_reads(monkeypatch: pytest.MonkeyPatch, rows: int) -> list[int]:
    """Row groups decoded of a file of `rows` rows, one entry per read (every reader of
    the input goes through `ParquetFile.read_row_groups`)."""
    reads: list[int] = []
    original = pq.ParquetFile.read_row_groups

    def counted(self: Any, groups: Any, *args: Any, **kwargs: Any) -> Any:
        if self.metadata.num_rows == rows:  # of the input table, not the delta an update encodes
            reads.extend(groups)
        return original(self, groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", counted)
    return reads


@pytest.mark.parametrize("incremental", [False, True])
def test_a_row_group_shared_by_partitions_is_decoded_once(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch,
        incremental: bool) -> None:
    """40 rows in two row groups (32 + 8), partitions of 4 rows: a run decodes each row
    group once, not once per partition (10 reads of 32 rows before), and an incremental
    run's comparison does too; the vectors are a run's over row groups of 4 rows."""
    texts = [f"review number {i} about {'sleep' if i % 3 else 'pain'}" for i in range(40)]
    for name, size in (("big", 32), ("small", 4)):
        write_table(tmp_path / f"{name}.parquet",
                    {"id": list(range(40)), "text": texts, "label": [i % 2 for i in range(40)]},
                    row_group_size=size)
    fmt = "icechunk" if incremental else "zarr"
    jobs = {name: _job(tmp_path / name, tiny_bert, tmp_path / f"{name}.parquet", fmt,
                       execution={"scheduler": "synchronous", "partition_rows": 4},
                       output={"format": fmt, "incremental": incremental})
            for name in ("big", "small")}
    run_job(jobs["small"])
    reads = _counting_row_group_reads(monkeypatch, 40)
    run_job(jobs["big"])
    assert sorted(reads) == [0, 1]
    got, want = pipeline.open_store(jobs["big"].output.path), \
        pipeline.open_store(jobs["small"].output.path)
    for view in ("mean", "cls", "cat"):
        np.testing.assert_array_equal(got.vectors(view), want.vectors(view))
    if incremental:  # one text edited: the update compares every row, encodes one
        texts[5] = "an edited review"
        write_table(tmp_path / "big.parquet", {"id": list(range(40)), "text": texts,
                                               "label": [i % 2 for i in range(40)]},
                    row_group_size=32)
        reads.clear()
        summary = run_job(jobs["big"], incremental=True)
        assert summary.encoded == 1 and sorted(reads) == [0, 1]


def test_an_input_written_again_during_a_run_fails_the_run_naming_it(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The input is written again (other row groups) after the run's first partition is
    read: the run stops with exit 3 naming the file, the store is not complete, and the
    rerun is refused (the input changed) until --overwrite."""
    from click.testing import CliRunner

    from pipeline.cli import main
    from tests.conftest import write_job

    texts = [f"review {i}" for i in range(24)]
    src = write_table(tmp_path / "in.parquet", {"id": list(range(24)), "text": texts},
                      row_group_size=12)
    job = write_job(tmp_path / "job.yaml", job_dict(src, tiny_bert, tmp_path / "o.zarr",
                                                    execution={"scheduler": "synchronous",
                                                               "partition_rows": 4}))
    prepare = Extractor.prepare

    def rewriting(self: Extractor, part: Any, pad: bool = False) -> Any:
        prepared = prepare(self, part, pad)
        if part.index == 0:
            write_table(src, {"id": list(range(24)), "text": texts}, row_group_size=8)
        return prepared

    monkeypatch.setattr(Extractor, "prepare", rewriting)
    failed = CliRunner().invoke(main, ["extract", str(job)])
    assert failed.exit_code == 3, failed.output
    assert f"input.path: {src} changed after the run was planned" in failed.stderr
    with pytest.raises(StoreError, match="incomplete"):
        pipeline.open_store(tmp_path / "o.zarr")
    monkeypatch.setattr(Extractor, "prepare", prepare)
    assert CliRunner().invoke(main, ["extract", str(job)]).exit_code == 5
    again = CliRunner().invoke(main, ["extract", str(job), "--overwrite"])
    assert again.exit_code == 0, again.output
    assert pipeline.open_store(tmp_path / "o.zarr").docs["id"].values.tolist() == \
        list(range(24))


def test_partitions_that_share_row_groups_decode_them_once(tmp_path: Path) -> None:
    """Row groups of 10 and 30 rows, partitions of 4: the first decodes group 0, the one
    across the boundary both groups, and every other partition is served from those."""
    from pipeline.extract.source import RowGroupCache, read_partition
    from pipeline.spec import InputSpec

    texts = [f"row {i}" for i in range(40)]
    src = tmp_path / "t.parquet"
    with pq.ParquetWriter(src, pa.schema([("text", pa.string())])) as out:
        out.write_table(pa.table({"text": texts[:10]}))
        out.write_table(pa.table({"text": texts[10:]}))
    assert [pq.read_metadata(src).row_group(g).num_rows for g in range(2)] == [10, 30]
    spec = InputSpec(str(src), "text")
    cache = RowGroupCache()
    got = [read_partition(spec, p, cache).texts for p in plan_partitions(spec, 4)]
    assert got == [texts[i : i + 4] for i in range(0, 40, 4)] and cache.reads == 2


def test_a_file_rewritten_after_planning_is_refused_not_read_at_moved_rows(
        tmp_path: Path) -> None:
    """The same rows written again in other row groups while a run reads them: the
    partitions planned on the old file are refused (they would be read at the new file's
    offsets), cached or not; planned again, the file reads right. A failed read leaves
    nothing behind."""
    from pipeline.errors import UnreadableInputError
    from pipeline.extract.source import RowGroupCache, read_partition
    from pipeline.spec import InputSpec

    texts = [f"row {i}" for i in range(40)]
    src = tmp_path / "t.parquet"
    write_table(src, {"text": texts}, row_group_size=10)
    spec = InputSpec(str(src), "text")
    cache = RowGroupCache()
    planned = plan_partitions(spec, 4)
    assert read_partition(spec, planned[0], cache).texts == texts[:4]
    write_table(src, {"text": texts}, row_group_size=20)
    for reader in (cache, None):
        with pytest.raises(UnreadableInputError, match="changed after the run was planned"):
            read_partition(spec, planned[6], reader)
    again = plan_partitions(spec, 4)
    assert read_partition(spec, again[6], cache).texts == texts[24:28]
    good = src.read_bytes()
    src.write_bytes(good[:20] + b"\0" * 40 + good[60:])  # a data page damaged
    with pytest.raises(UnreadableInputError, match="cannot be read at rows 0-3"):
        read_partition(spec, again[0], cache)
    src.write_bytes(good)
    assert read_partition(spec, again[0], cache).texts == texts[:4]


@pytest.mark.parametrize("sizes", [[200] * 6, [5, 3, 9, 1, 12], [16], [7], [], [4, 4, 4, 4],
                                   [0, 0], [8, 0]])
def test_zarr_writes_whole_chunks(sizes: list[int]) -> None:
    """Parts of any sizes regrouped so that every write covers whole chunks (a partial
    chunk write is a read-modify-write: a GET and a PUT more per part on an object store),
    the rows unchanged and in order."""
    import pyarrow as pa

    from pipeline.stores.zarr_store import chunk_aligned

    rows, start, tables = 8, 0, []
    for size in sizes:
        tables.append(pa.table({"x": np.arange(start, start + size)}))
        start += size
    blocks = list(chunk_aligned(iter(tables), rows))
    assert [b.num_rows % rows for b in blocks[:-1]] == [0] * (len(blocks) - 1)
    if start == 0:  # parts without rows: one empty block, whose columns make the arrays
        assert [b.num_rows for b in blocks] == ([0] if tables else [])
    else:
        assert all(b.num_rows > 0 for b in blocks)
    got = np.concatenate([b.column("x").to_numpy() for b in blocks]) if blocks else []
    np.testing.assert_array_equal(got, np.arange(start))


def test_opening_a_zarr_store_reads_its_provenance_once(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The provenance (the root group's attributes) is read once per open, and handed to
    what needs it (the checksums the arrays are verified against, the version to open)."""
    from pipeline.stores import zarr_store

    source = write_table(tmp_path / "in.parquet", {"id": ["a", "b", "c"],
                                                    "text": ["a drug", "no sleep", "great"]})
    job = Job.from_dict(job_dict(source, tiny_bert, tmp_path / "o.zarr"))
    run_job(job)
    reads: list[str] = []
    original = zarr_store.ZarrFormat._read_record

    def counted(self: Any) -> Any:
        reads.append(self.path)
        return original(self)

    monkeypatch.setattr(zarr_store.ZarrFormat, "_read_record", counted)
    store = pipeline.open_store(tmp_path / "o.zarr")
    assert store.vectors("mean").shape == (3, 32)
    assert len(reads) == 1, reads


def test_a_failed_commit_read_drops_only_damaged_markers_and_never_after_a_lost_lock(
        tmp_path: Path) -> None:
    """`checked_reads`: a read that fails over an altered part removes that part's marker
    (exit 6: the rerun encodes it); over intact parts it changes nothing and re-raises; a
    lost lock re-raises at once, the staging left to the run that holds the store now."""
    import pyarrow as pa

    from pipeline.errors import PartitionError
    from pipeline.stores.lock import LockLostError
    from pipeline.stores.markers import PartitionMarker
    from pipeline.stores.staging import Staging

    staging = Staging(str(tmp_path / "o.zarr"))
    staging.begin({"run_fingerprint": "f"})
    marker = PartitionMarker(index=0, fingerprint="f", rows=(0, 2), input="i", n_chunks=2,
                             n_tokens=9, n_covered=9, n_encoded=13, n_unique=2, device="cpu",
                             dtype="float32", runtime="torch", seconds=0.5)
    for index in (0, 1):
        staging.write_part(PartitionMarker(**{**marker.to_dict(), "index": index,
                                              "rows": (2 * index, 2 * index + 2)}),
                           {"docs": pa.table({"row": [0, 1], "x": [1.5, 2.5]})})
    with pytest.raises(OSError, match="boom"), staging.checked_reads([0, 1]):
        raise OSError("boom")  # nothing altered: the error is the read's own
    assert staging.marker(0).exists() and staging.marker(1).exists()
    part = staging.part_path(1, "docs")
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(LockLostError), staging.checked_reads([0, 1]):
        raise LockLostError("taken over")
    assert staging.marker(1).exists()  # another run's staging now: untouched
    with pytest.raises(PartitionError, match="staged partition 1 changed"), \
            staging.checked_reads([0, 1]):
        raise OSError("page checksum mismatch")
    assert staging.marker(0).exists() and not staging.marker(1).exists()
    assert list(staging.done("f")) == [0]
