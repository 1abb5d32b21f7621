"""The icechunk format: a versioned store whose updates write only what changed.

Oracles: the plain Zarr format's store of the same job (same encoder, so the same bytes of
vectors), Icechunk's own diff of two snapshots (which chunks a commit wrote), and plain
xarray on an Icechunk session (what an analyst without bertpipe opens).
"""

from __future__ import annotations

import json
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
from pipeline.errors import StoreError
from pipeline.run.runner import run_job
from pipeline.spec import Job
from pipeline.stores import detect_format, icechunk_store
from pipeline.stores.verify import verify_store
from tests.conftest import REVIEWS, assert_same_results, job_dict, plain_docs, whitened_in_place


def _texts(n: int, chars: int | None = None) -> list[str]:
    """`n` distinct sample reviews; cut to their first `chars` characters where a test's
    point is which rows and chunks a run touches (a whole review is ~10 chunks of 16
    tokens, each a row of every chunk-level array to write)."""
    texts = pq.read_table(REVIEWS).column("text").to_pylist()
    return [f"{texts[i % len(texts)][:chars]} ({i})" for i in range(n)]  # distinct


def _input(path: Path, texts: list[str]) -> Path:
    """Ids r0, r1, ..., the texts, and a label carried by jobs that ask for it."""
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(texts))], "text": texts,
                             "label": [f"label {i % 3}" for i in range(len(texts))]}), path)
    return path


def _job(tmp_path: Path, model: Path, source: Path, fmt: str = "icechunk",
         name: str = "o", carry: tuple[str, ...] = (), **output: Any) -> Job:
    return Job.from_dict(job_dict(source, model, tmp_path / f"{name}.{fmt}",
                                  input={"carry_columns": list(carry)},
                                  output={"format": fmt, **output},
                                  chunking={"strategy": "hierarchical", "max_tokens": 16,
                                            "overlap": 4}))


def _repository(store: Path) -> icechunk.Repository:
    return icechunk.Repository.open(icechunk.local_filesystem_storage(str(store / "repo")))


def test_full_run_equals_the_zarr_format_and_opens_without_bertpipe(
        tmp_path: Path, tiny_bert: Path) -> None:
    source = _input(tmp_path / "in.parquet", _texts(40))
    ice, plain = _job(tmp_path, tiny_bert, source), _job(tmp_path, tiny_bert, source, "zarr")
    run_job(ice)
    run_job(plain)
    a, b = pipeline.open_store(ice.output.path), pipeline.open_store(plain.output.path)
    assert a.format == "icechunk" and a.provenance.complete and a.provenance.version == 0
    assert_same_results(a, b)
    assert verify_store(ice.output.path) == []
    docs = plain_docs(ice.output.path)  # xarray on an Icechunk session, no bertpipe
    np.testing.assert_array_equal(docs["mean"].values, b.vectors("mean"))
    assert docs["mean"].attrs["pooling"] == "mean"
    facts = json.loads(CliRunner().invoke(main, ["inspect", ice.output.path, "--json"]).stdout)
    assert facts["format"] == "icechunk" and facts["readable_versions"] == [0]


def test_sizes_and_sums_of_every_key_at_once_equal_those_recorded_at_write(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks on open and in verify ask for all keys in one call: each answer is the
    size and sum the commit recorded from the bytes it wrote, and an absent key is None
    (not the 0 Icechunk gives for an unwritten chunk), as when asked one at a time."""
    monkeypatch.setattr(icechunk_store, "ICECHUNK_ROWS_PER_CHUNK", 4)  # many chunk keys
    monkeypatch.setattr(icechunk_store, "ICECHUNK_FLAT_FACTOR", 1)  # one grid for all
    job = _job(tmp_path, tiny_bert, _input(tmp_path / "in.parquet", _texts(40)))
    run_job(job)
    fmt = detect_format(job.output.path)
    recorded = fmt.recorded_checksums()
    absent = "docs/mean/c/99/0"  # inside the key grammar, never written
    keys = [*recorded, absent]
    sizes, sums = fmt.checked_sizes(keys), fmt.file_sums(keys)
    assert len([rel for rel in recorded if rel.startswith("docs/mean/c/")]) == 10
    assert sizes[absent] is None and sums[absent] is None and fmt.checked_size(absent) is None
    for rel, want in recorded.items():
        assert sizes[rel] == want.size == fmt.checked_size(rel), rel
        assert sums[rel] == want == fmt.file_sum(rel), rel


@pytest.mark.parametrize("damage", ["deleted", "rewritten"])
def test_an_open_checks_each_array_by_its_total_and_names_a_damaged_chunk(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    """The check on open asks Icechunk for each array's total size (one call per array,
    not per key); a chunk deleted or rewritten with other bytes by another writer, through
    Icechunk itself, changes its array's total, and the open refuses, naming that chunk."""
    monkeypatch.setattr(icechunk_store, "ICECHUNK_ROWS_PER_CHUNK", 4)  # many chunk keys
    monkeypatch.setattr(icechunk_store, "ICECHUNK_FLAT_FACTOR", 1)  # one grid for all
    job = _job(tmp_path, tiny_bert, _input(tmp_path / "in.parquet", _texts(40)))
    run_job(job)
    fmt = detect_format(job.output.path)
    recorded = fmt.recorded_checksums()
    whole = fmt.whole_by_total(recorded)
    assert {rel for rel in recorded if "/c/" in rel} <= whole  # every chunk key
    looked_up: list[str] = []
    original = icechunk_store.IcechunkFormat.checked_sizes

    def counted(self: Any, rels: Any) -> Any:
        rels = list(rels)
        looked_up.extend(rels)
        return original(self, rels)

    monkeypatch.setattr(icechunk_store.IcechunkFormat, "checked_sizes", counted)
    pipeline.open_store(job.output.path)
    # the rest, one by one: metadata of groups and of arrays holding no chunk
    assert sorted(looked_up) == sorted(set(recorded) - whole)
    assert looked_up and all(rel.endswith("zarr.json") for rel in looked_up)
    session = _repository(Path(job.output.path)).writable_session("main")
    victim = "docs/mean/c/3/0"
    if damage == "deleted":
        icechunk_store.sync(session.store.delete(victim))
    else:
        from zarr.core.buffer import default_buffer_prototype

        icechunk_store.sync(session.store.set(
            victim, default_buffer_prototype().buffer.from_bytes(b"other bytes")))
    session.commit("another writer")
    with pytest.raises(StoreError, match=r"damaged store: .*docs/mean.*3") as raised:
        pipeline.open_store(job.output.path)
    assert ("missing" if damage == "deleted" else "11 bytes where") in str(raised.value)


def test_an_array_deleted_by_another_writer_is_named_missing(
        tmp_path: Path, tiny_bert: Path) -> None:
    """Icechunk refuses a total for a path that is no node: the array's keys are then
    looked up one by one, and the open names the array."""
    import zarr

    job = _job(tmp_path, tiny_bert, _input(tmp_path / "in.parquet", _texts(12)))
    run_job(job)
    session = _repository(Path(job.output.path)).writable_session("main")
    del zarr.open_group(session.store, mode="a", use_consolidated=False)["docs"]["cls"]
    session.commit("another writer")
    with pytest.raises(StoreError, match=r"damaged store: .*docs/cls"):
        pipeline.open_store(job.output.path)


def test_keys_are_asked_in_one_call_a_bounded_number_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """However many keys, at most KEYS_IN_FLIGHT lookups (chunk reads, for sums) are
    pending at once, and every key gets its own answer."""
    import asyncio

    monkeypatch.setattr(icechunk_store, "KEYS_IN_FLIGHT", 3)
    pending, most = 0, 0

    async def ask(key: str) -> str:
        nonlocal pending, most
        pending += 1
        most = max(most, pending)
        await asyncio.sleep(0.001)
        pending -= 1
        return key.upper()

    keys = [f"docs/mean/c/{i}/0" for i in range(50)]
    assert icechunk_store._each_key(ask, keys) == {k: k.upper() for k in keys}
    assert most == 3


def _chunks_compared(monkeypatch: pytest.MonkeyPatch, rows: int) -> dict[str, set[int]]:
    """Per array, the chunks an update's writer reads back to compare with the new values
    (its reads go through zarr's AsyncArray.getitem, the store's readers' through Array)."""
    from zarr.core.array import AsyncArray

    compared: dict[str, set[int]] = {}
    original = AsyncArray.getitem

    async def getitem(self: Any, selection: Any, *args: Any, **kwargs: Any) -> Any:
        compared.setdefault(self.path, set()).add(selection.start // rows)
        return await original(self, selection, *args, **kwargs)

    monkeypatch.setattr(AsyncArray, "getitem", getitem)
    return compared


@pytest.mark.slow  # several runs each: in make test, not make test-fast
def test_an_update_writes_only_the_chunks_that_changed(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """160 rows in chunks of 16; one text changed (row 37: chunk 2) and 4 rows added. The
    edit is appended after the old rows, before the new ones (rows 160-164: chunk 10); row
    37 is kept, flagged: the commit writes chunk 10 of every docs array and chunk 2 of
    `present` only, nothing of the chunks level before its first appended chunk (the
    edited text has fewer chunks: in place, every chunk after it would have moved), and
    the current rows equal a run from scratch. It reads back, to compare, only what may
    have changed without its knowing: the carried label."""
    from tests.test_incremental import assert_same_rows

    monkeypatch.setattr(icechunk_store, "ICECHUNK_ROWS_PER_CHUNK", 16)
    monkeypatch.setattr(icechunk_store, "ICECHUNK_FLAT_FACTOR", 1)  # one grid for all
    texts = _texts(164, chars=120)
    source = _input(tmp_path / "in.parquet", texts[:160])
    job = _job(tmp_path, tiny_bert, source, carry=("label",), incremental=True)
    run_job(job)
    chunk_rows = int(pipeline.open_store(job.output.path).chunks.sizes["chunk"])
    texts[37] = "a text that changed overnight"
    _input(source, texts)
    compared = _chunks_compared(monkeypatch, 16)
    summary = run_job(job, incremental=True)
    assert (summary.added, summary.replaced, summary.encoded) == (4, 1, 5)
    # what the writer read back to compare: a carried value, which may change on any row,
    # everywhere; nothing known by construction (an unchanged row's results, id, digest,
    # status and chunk count; a flag: chunk 2 of `present` is written without reading)
    assert compared.pop("docs/label") == set(range(11))
    assert all(found <= {10} for found in compared.values()), compared
    v1, v0 = detect_format(job.output.path).versions()
    diff = _repository(Path(job.output.path)).diff(from_snapshot_id=v0.snapshot,
                                                   to_snapshot_id=v1.snapshot)
    touched = {path: {coords[0] for coords in chunks}
               for path, chunks in diff.updated_chunks.items()}
    docs = {path: found for path, found in touched.items() if path.startswith("/docs/")}
    assert docs["/docs/mean"] == {10} and docs["/docs/cls"] == {10}
    assert docs["/docs/present"] == {2, 10}
    assert all(found <= {2, 10} for found in docs.values()), docs
    assert all(found <= {10} for path, found in docs.items() if path != "/docs/present")
    first_appended = chunk_rows // 16
    chunks = {path: found for path, found in touched.items() if path.startswith("/chunks/")}
    assert chunks["/chunks/mean"] and min(chunks["/chunks/mean"]) == first_appended
    assert all(min(found) >= first_appended for found in chunks.values()), chunks
    now = pipeline.open_store(job.output.path)
    assert np.asarray(now.docs["id"].values)[[37, 160]].tolist() == ["r37", "r37"]
    assert np.asarray(now.docs["present"].values)[[37, 160]].tolist() == [False, True]
    scratch = _job(tmp_path, tiny_bert, source, name="scratch")
    run_job(scratch)
    assert_same_rows(now, pipeline.open_store(scratch.output.path), ["mean", "cls"])
    assert verify_store(job.output.path) == []


def test_rows_that_move_onto_their_own_text_get_their_own_ids(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 rows in chunks of 4; r1 pruned and r2-r7 each given the text of the row before
    it: every row from 1 on moves up one, onto a row that held its new text. Its results
    are the stored ones (the same text, the same row), but its id is not: the ids of
    chunk 1 (rows 4-6, all such rows) are written, and the store equals a run from
    scratch by id."""
    from tests.test_incremental import assert_same_rows

    monkeypatch.setattr(icechunk_store, "ICECHUNK_ROWS_PER_CHUNK", 4)
    monkeypatch.setattr(icechunk_store, "ICECHUNK_FLAT_FACTOR", 1)  # one grid for all
    texts = _texts(8, chars=60)
    source = _input(tmp_path / "in.parquet", texts)
    job = _job(tmp_path, tiny_bert, source, incremental=True)
    run_job(job)
    moved = pa.table({"id": [f"r{i}" for i in (0, *range(2, 8))],
                      "text": [texts[0], *texts[1:7]]})
    pq.write_table(moved, source)
    summary = run_job(job, incremental=True, prune=True)
    assert (summary.pruned, summary.replaced, summary.encoded) == (1, 6, 0)
    now = pipeline.open_store(job.output.path)
    assert list(now.docs["id"].values) == moved.column("id").to_pylist()
    pq.write_table(moved, tmp_path / "scratch.parquet")
    scratch = _job(tmp_path, tiny_bert, tmp_path / "scratch.parquet", name="scratch")
    run_job(scratch)
    assert_same_rows(now, pipeline.open_store(scratch.output.path), ["mean", "cls"])
    assert verify_store(job.output.path) == []


@pytest.mark.slow  # several runs each: in make test, not make test-fast
def test_an_update_reads_only_the_chunks_it_may_change(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """96 rows in chunks of 8: row 37 (chunk 4) changed, row 60 gone and pruned (every
    row after it moves up one), 4 rows added. The update reads from the store the result
    columns of chunk 4 and of the rows from 56 on (the chunk of the pruned row and
    after), nothing of chunks 0-3 and 5-6 (kept whole: left as they are), and the store
    equals a run from scratch of the same input, both levels, every view and count."""
    from pipeline.run import assemble

    monkeypatch.setattr(icechunk_store, "ICECHUNK_ROWS_PER_CHUNK", 8)
    monkeypatch.setattr(icechunk_store, "ICECHUNK_FLAT_FACTOR", 1)  # one grid for all
    texts = _texts(100, chars=120)
    source = _input(tmp_path / "in.parquet", texts[:96])
    job = _job(tmp_path, tiny_bert, source, incremental=True)
    run_job(job)
    ids = [f"r{i}" for i in range(100) if i != 60]
    texts[37] = "a text that changed overnight"
    pq.write_table(pa.table({"id": ids, "text": [t for i, t in enumerate(texts) if i != 60]}),
                   source)
    read: list[np.ndarray] = []
    rows_of = assemble.rows_of

    def recorded(array: Any, rows: np.ndarray) -> np.ndarray:
        if array.name == "mean" and array.sizes.get("doc") == 96:  # the store's, not the delta's
            read.append(np.asarray(rows))
        return rows_of(array, rows)

    monkeypatch.setattr(assemble, "rows_of", recorded)
    summary = run_job(job, incremental=True, prune=True)
    assert (summary.added, summary.replaced, summary.pruned, summary.encoded) == (4, 1, 1, 5)
    chunks_read = {int(r) // 8 for rows in read for r in rows}
    assert chunks_read == {4} | set(range(7, 12)), chunks_read
    scratch = _job(tmp_path, tiny_bert, source, name="scratch")
    run_job(scratch)
    now, fresh = pipeline.open_store(job.output.path), pipeline.open_store(scratch.output.path)
    assert list(now.docs["id"].values) == list(fresh.docs["id"].values)
    for level in ("docs", "chunks"):
        for view in ("mean", "cls"):
            np.testing.assert_allclose(now.vectors(view, level), fresh.vectors(view, level),
                                       atol=1e-5)
    for name in ("n_tokens", "n_chunks", "truncated", "n_words"):
        np.testing.assert_array_equal(now.docs[name].values, fresh.docs[name].values)
    for name in ("doc", "seq", "start", "end", "n_tokens"):
        np.testing.assert_array_equal(now.chunks[name].values, fresh.chunks[name].values)
    assert verify_store(job.output.path) == []


@pytest.mark.slow  # several runs each: in make test, not make test-fast
def test_time_travel_and_gc(tmp_path: Path, tiny_bert: Path) -> None:
    """Each update is a version open_store can still open, exactly as it was; gc keeps
    the newest N and frees what only the others used."""
    texts = _texts(60)
    source = _input(tmp_path / "in.parquet", texts[:30])
    job = _job(tmp_path, tiny_bert, source, incremental=True)
    run_job(job)
    seen = {0: pipeline.open_store(job.output.path).vectors("mean")}
    for version, rows in ((1, 40), (2, 50), (3, 60)):
        _input(source, texts[:rows])
        assert run_job(job, incremental=True).version == version
        seen[version] = pipeline.open_store(job.output.path).vectors("mean")
    for version, vectors in seen.items():
        np.testing.assert_array_equal(
            pipeline.open_store(job.output.path, version=version).vectors("mean"), vectors)
    result = CliRunner().invoke(main, ["inspect", job.output.path])
    assert "versions kept: 3, 2, 1, 0" in result.stdout
    size = _disk_bytes(Path(job.output.path))
    result = CliRunner().invoke(main, ["gc", job.output.path, "--keep", "2"])
    assert result.exit_code == 0, result.output
    assert "expired versions 0, 1" in result.stdout and "versions kept: 2, 3" in result.stdout
    assert _disk_bytes(Path(job.output.path)) < size
    assert detect_format(job.output.path).version_numbers() == [3, 2]
    with pytest.raises(StoreError, match="no version 1 \\(versions kept: 3, 2\\)"):
        pipeline.open_store(job.output.path, version=1)
    np.testing.assert_array_equal(pipeline.open_store(job.output.path, version=2)
                                  .vectors("mean"), seen[2])
    np.testing.assert_array_equal(pipeline.open_store(job.output.path, version="2")
                                  .vectors("mean"), seen[2])  # as a command line gives it
    assert verify_store(job.output.path) == []
    again = CliRunner().invoke(main, ["gc", job.output.path, "--keep", "2"])
    assert "nothing to expire" in again.stdout


def test_plain_formats_keep_one_version(tmp_path: Path, tiny_bert: Path) -> None:
    source = _input(tmp_path / "in.parquet", _texts(10))
    job = _job(tmp_path, tiny_bert, source, "zarr")
    run_job(job)
    with pytest.raises(StoreError, match="keeps its current version \\(0\\) only"):
        pipeline.open_store(job.output.path, version=1)
    assert pipeline.open_store(job.output.path, version=0).provenance.version == 0
    result = CliRunner().invoke(main, ["gc", job.output.path])
    assert result.exit_code == 0 and "nothing to expire" in result.stdout


def test_a_killed_commit_leaves_the_branch_and_a_rerun_completes(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run killed at its final commit: nothing of it is visible (the branch holds
    the start record only) and the same command completes the store."""
    source = _input(tmp_path / "in.parquet", _texts(20))
    job = _job(tmp_path, tiny_bert, source)
    original = icechunk.Session.commit

    def killed(self: icechunk.Session, message: str, **kwargs: Any) -> str:
        if "(complete)" in message:
            raise KeyboardInterrupt
        return original(self, message, **kwargs)

    monkeypatch.setattr(icechunk.Session, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        run_job(job)
    monkeypatch.undo()
    assert not (detect_format(job.output.path).record() or {}).get("complete")
    assert detect_format(job.output.path).versions() == []
    run_job(job)
    assert verify_store(job.output.path) == []
    assert pipeline.open_store(job.output.path).vectors("mean").shape[0] == 20


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_a_commit_that_meets_another_writers_commit_is_refused(
        tmp_path: Path, tiny_bert: Path) -> None:
    """Two handles write the same store (bertpipe's lock normally prevents it): the first
    commit lands, the second is refused (exit 5) and nothing of it is committed."""
    from pipeline.stores.icechunk_store import IcechunkFormat

    source = _input(tmp_path / "in.parquet", _texts(10))
    job = _job(tmp_path, tiny_bert, source)
    run_job(job)
    first, second = IcechunkFormat(job.output.path), IcechunkFormat(job.output.path)
    first.write_params("a", {"mean": np.zeros(3)})
    second.write_params("b", {"mean": np.ones(3)})
    first.write_record(first.record() or {})
    with pytest.raises(StoreError, match="another run committed to the store meanwhile") as err:
        second.write_record(second.record() or {})
    assert err.value.exit_code == 5
    fresh = IcechunkFormat(job.output.path)
    np.testing.assert_array_equal(fresh.read_params("a")["mean"], np.zeros(3))
    with pytest.raises(KeyError):
        fresh.read_params("b")
    assert verify_store(job.output.path) == []


@pytest.mark.slow  # several runs each: in make test, not make test-fast
def test_the_plain_reader_lines_of_the_docs_run(tmp_path: Path, tiny_bert: Path) -> None:
    """The Python block of docs/store.md's Icechunk section, as written (the store's path
    aside), on a store updated once (two rows added, one text edited): it opens the
    current version without bertpipe, its `present` filter gives one row per input id,
    and it lists both versions."""
    import re

    from tests.conftest import REPO

    texts = _texts(12)
    source = _input(tmp_path / "in.parquet", texts[:10])
    job = _job(tmp_path, tiny_bert, source, incremental=True)
    run_job(job)
    texts[3] = "a text that changed overnight"
    _input(source, texts)
    run_job(job, incremental=True)
    section = (REPO / "docs" / "store.md").read_text().split("## Icechunk (versioned Zarr)")[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None
    *statements, last = block.group(1).replace("out/reviews.icechunk",
                                               job.output.path).strip().splitlines()
    scope: dict[str, Any] = {}
    exec("\n".join(statements), scope)  # noqa: S102
    versions = eval(last.split("#")[0], scope)  # the block's last line lists the versions
    store = pipeline.open_store(job.output.path)
    np.testing.assert_array_equal(scope["docs"]["mean"].values, store.vectors("mean"))
    assert scope["chunks"].sizes["chunk"] == store.chunks.sizes["chunk"]
    assert scope["docs"].sizes["id"] == 13  # the edit appended, its old row kept
    assert sorted(scope["current"]["id"].values.tolist()) == sorted(f"r{i}" for i in range(12))
    messages = [message for message, _ in versions]
    assert messages[:1] == ["bertpipe: version 1 (complete)"]
    assert "bertpipe: version 0 (complete)" in messages


def test_a_view_whitened_in_place_to_fewer_dimensions(tmp_path: Path, tiny_bert: Path) -> None:
    """`post:` on a view replaces it in place, here with a narrower one: the same values as
    the Zarr format's store (which moves a temporary array into place)."""
    source = _input(tmp_path / "in.parquet", _texts(30))
    got, want = whitened_in_place(source, tiny_bert, tmp_path, "icechunk", "zarr")
    assert got.shape == want.shape == (30, 8)
    np.testing.assert_array_equal(got, want)
    assert verify_store(str(tmp_path / "w.icechunk")) == []
    assert ".mean.tmp" not in plain_docs(tmp_path / "w.icechunk").variables


def test_rows_an_edit_superseded_are_left_out_of_lookups_searches_and_probes(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After an update that edits row 5 (its old row kept, flagged; the edit appended as
    row 40): `row_of` gives the current row, a search by the old text never returns the
    superseded row or its chunks (exact scan and saved index, every row asked for: each
    current id once), a probe and a geometry fix's fit leave it out, and `inspect` tells
    it from a gone row."""
    from pipeline.analysis.index import build_index
    from pipeline.analysis.probe import load_labels, run_probe

    texts = _texts(40, chars=120)
    source = tmp_path / "in.parquet"
    labels = ["pos" if i % 2 else "neg" for i in range(40)]

    def write(rows: list[str]) -> None:
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(rows))], "text": rows,
                                 "label": labels[: len(rows)]}), source)

    write(texts)
    raw = job_dict(source, tiny_bert, tmp_path / "o.icechunk", input={"carry_columns": ["label"]},
                   output={"format": "icechunk", "incremental": True})
    job = Job.from_dict(raw)
    run_job(job)
    old_text, texts[5] = texts[5], "a text that changed overnight"
    write(texts[:39])  # r39 gone: kept, flagged, and still searched
    run_job(job, incremental=True)
    store = pipeline.open_store(job.output.path)
    assert store.superseded().tolist() == [i == 5 for i in range(41)]
    assert store.row_of("r5") == 40
    for exact in (True, False):
        if not exact:
            build_index(store, "mean", "docs")
            build_index(store, "mean", "chunks")
        hits = store.search(old_text, k=41, exact=exact)
        assert 5 not in [h.row for h in hits] and len(hits) == 40
        assert sorted(h.id for h in hits) == sorted(f"r{i}" for i in range(40))
        chunk_hits = store.search(old_text, k=10, level="chunks", exact=exact)
        assert chunk_hits and all(h.row != 5 for h in chunk_hits)
    # through the index, the ask grows from k only while superseded rows leave it short:
    # the old text's nearest row is the superseded one, so k=1 asks for 1, then 2
    from pipeline.analysis import index as index_module

    asked: list[int] = []
    real_search = index_module.index_search

    def counted(index: Any, queries: np.ndarray, k: int) -> Any:
        asked.append(k)
        return real_search(index, queries, k)

    monkeypatch.setattr(index_module, "index_search", counted)
    top = store.search(old_text, k=1)
    assert asked == [1, 2] and top[0].row != 5
    report = run_probe(store, load_labels(store, "label"), ["mean"], folds=2)
    assert report.dropped["superseded"] == 1 and report.n_rows == 40
    shown = CliRunner().invoke(main, ["inspect", str(job.output.path)])
    assert "1 rows flagged present=false (ids gone" in shown.output
    assert "1 rows superseded by an edit" in shown.output
    assert "rows       41 (of which 1 superseded by an edit" in shown.output
    from pipeline.analysis.inspect import geometry_rows
    from pipeline.analysis.vocabulary import vocabulary_fit

    assert geometry_rows(store, pairs=10)[0] == 40 and vocabulary_fit(store)["rows"] == 40
    assert "1 superseded kept" in shown.output  # the update's history line
    as_json = json.loads(CliRunner().invoke(main, ["inspect", str(job.output.path),
                                                   "--json"]).output)
    assert (as_json["flagged_gone"], as_json["superseded"]) == (1, 1)
    # a geometry fix is fitted on the current rows: centred, they average to zero
    from pipeline.post.apply import postprocess
    from pipeline.spec import PostSpec

    postprocess(str(job.output.path), "mean", PostSpec(method="center"))
    store = pipeline.open_store(job.output.path)
    current = ~store.superseded()
    centred = store.vectors("mean_center").astype(np.float64)
    np.testing.assert_allclose(centred[current].mean(0), 0, atol=1e-5)
    assert store.provenance.post["mean_center"].fitted_rows == 40


def test_the_keys_listed_in_batches_are_the_stores_own_listing(tmp_path: Path,
                                                              tiny_bert: Path) -> None:
    """The keys of a snapshot built from groups and Icechunk's chunk coordinates (what a
    commit seals and an open checks) equal Icechunk's own key listing, on a store with both
    levels, an update's appended rows and a post-processed view's parameter group."""
    from zarr.core.sync import sync

    source = _input(tmp_path / "in.parquet", _texts(30, chars=120))
    raw = job_dict(source, tiny_bert, tmp_path / "o.icechunk",
                   views={"mean": {"pooling": "mean", "post": {"method": "center"}},
                          "cls": {"pooling": "cls"}},
                   output={"format": "icechunk", "incremental": True},
                   chunking={"strategy": "hierarchical", "max_tokens": 16, "overlap": 4})
    run_job(Job.from_dict(raw))
    _input(source, _texts(34, chars=120))
    run_job(Job.from_dict(raw), incremental=True)
    session = _repository(tmp_path / "o.icechunk").readonly_session(branch="main")

    async def listed() -> list[str]:
        return [key async for key in session.store.list()]

    keys = icechunk_store._session_keys(session)
    assert sorted(keys) == sorted(sync(listed()))
    assert any(key.startswith("post/") for key in keys) and len(keys) == len(set(keys))


def test_superseded_rows_past_a_tenth_are_dropped_and_edits_made_in_place(
        tmp_path: Path, tiny_bert: Path) -> None:
    """40 rows; night 1 edits 2 (appended: 2 superseded of 42 rows is under a tenth);
    night 2 edits 3 more (5 of 45 would pass it): that update drops the 2 superseded rows
    and makes its edits in place, so the store is back to 40 rows, one per id, equal to a
    run from scratch, and the history says what happened each night."""
    from tests.test_incremental import assert_same_rows

    texts = _texts(40, chars=120)
    source = _input(tmp_path / "in.parquet", texts)
    job = _job(tmp_path, tiny_bert, source, incremental=True)
    run_job(job)
    for i in (3, 17):
        texts[i] = f"night one changed text {i}"
    _input(source, texts)
    first = run_job(job, incremental=True)
    assert (first.rows, first.superseded, first.dropped) == (42, 2, 0)
    for i in (5, 20, 33):
        texts[i] = f"night two changed text {i}"
    _input(source, texts)
    second = run_job(job, incremental=True)
    assert (second.rows, second.replaced, second.superseded, second.dropped) == (40, 3, 0, 2)
    store = pipeline.open_store(job.output.path)
    # the superseded rows 3 and 17 dropped (the rows after them moved up); their current
    # rows stay where night 1 appended them
    assert list(store.docs["id"].values) == \
        [f"r{i}" for i in range(40) if i not in (3, 17)] + ["r3", "r17"]
    assert not store.superseded().any() and bool(store.docs["present"].values.all())
    history = store.provenance.history
    assert [(h.superseded, h.dropped) for h in history] == [(0, 0), (2, 0), (0, 2)]
    scratch = _job(tmp_path, tiny_bert, source, name="scratch")
    run_job(scratch)
    assert_same_rows(store, pipeline.open_store(scratch.output.path), ["mean", "cls"])


# ---- cells known by construction: against an update that compares every column ----------


def _table(ids: list[str], texts: list[str], labels: list[str | None] | None = None
           ) -> pa.Table:
    labels = labels if labels is not None else [f"label {i % 3}" for i in range(len(ids))]
    return pa.table({"id": ids, "text": pa.array(texts, pa.string()),
                     "label": pa.array(labels, pa.string())})


def _arrays(path: str) -> dict[str, np.ndarray]:
    """Every array of both levels as Icechunk holds it, every row (superseded and gone
    rows included, which a comparison by id never sees)."""
    import zarr

    session = _repository(Path(path)).readonly_session(branch="main")
    root = zarr.open_group(session.store, mode="r", use_consolidated=False)
    return {f"{level}/{name}": np.asarray(array[:]) for level in ("docs", "chunks")
            if level in root for name, array in root[level].arrays()}


def _assert_same_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray],
                        step: int) -> None:
    assert sorted(got) == sorted(want), step
    for name, b in want.items():
        a = got[name]
        assert a.shape == b.shape, (step, name)
        if a.dtype.kind == "f":
            assert np.array_equal(a, b, equal_nan=True), (step, name)
        else:
            assert a.astype(object).tolist() == b.astype(object).tolist(), (step, name)


def _grid(path: str) -> dict[str, int]:
    """Rows per chunk of each array of a store's levels."""
    root = zarr.open_group(detect_format(path)._session().store, mode="r")
    return {f"{level}/{name}": array.chunks[0] for level in ("docs", "chunks")
            if level in root for name, array in root[level].arrays()}


def _updates_equal_comparing_every_column(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch,
        steps: list[tuple[pa.Table, bool]], flat: tuple[int, int] = (1, 1)) -> list[Any]:
    """steps[0]: the full run's input; each later (input, prune): an update. Two stores take
    the same runs, one with the writer comparing every column (nothing left as known): after
    each update they are equal array by array, every row, and the first verifies; after the
    last it equals a run from scratch by id. Vectors in chunks of 4 rows, flat arrays of
    4 x flat[0] made by the full run, flat[1] the factor the updates run with (a store
    made before keeps its grid)."""
    from tests.test_incremental import assert_same_rows

    monkeypatch.setattr(icechunk_store, "ICECHUNK_ROWS_PER_CHUNK", 4)
    monkeypatch.setattr(icechunk_store, "ICECHUNK_FLAT_FACTOR", flat[0])
    jobs = {}
    for variant in ("leaves", "compares"):
        source = tmp_path / f"{variant}.parquet"
        pq.write_table(steps[0][0], source)
        jobs[variant] = _job(tmp_path, model, source, name=variant, carry=("label",),
                             incremental=True)
        run_job(jobs[variant])
    grid = _grid(jobs["leaves"].output.path)
    assert grid["docs/mean"] == 4 and grid["docs/id"] == grid["chunks/seq"] == 4 * flat[0]
    monkeypatch.setattr(icechunk_store, "ICECHUNK_FLAT_FACTOR", flat[1])
    summaries = []
    for step, (table, prune) in enumerate(steps[1:], 1):
        for variant, job in jobs.items():
            pq.write_table(table, Path(job.input.path))
            with monkeypatch.context() as patch:
                if variant == "compares":
                    patch.setattr(icechunk_store._LevelUpdater, "leave_same",
                                  lambda self, same: {})
                summary = run_job(job, incremental=True, prune=prune)
            if variant == "leaves":
                summaries.append(summary)
        _assert_same_arrays(_arrays(jobs["leaves"].output.path),
                            _arrays(jobs["compares"].output.path), step)
        assert verify_store(jobs["leaves"].output.path) == [], step
        grown = _grid(jobs["leaves"].output.path)  # the same grid (new arrays: the new one)
        assert all(grown[name] in (grid.get(name), 4 * flat[1]) for name in grown), grown
    scratch = _job(tmp_path, model, Path(jobs["leaves"].input.path), name="scratch",
                   carry=("label",))
    run_job(scratch)
    assert_same_rows(pipeline.open_store(jobs["leaves"].output.path),
                     pipeline.open_store(scratch.output.path), ["mean", "cls"])
    return summaries


@pytest.mark.slow  # several runs each: in make test, not make test-fast
def test_gone_ids_that_come_back_keep_their_flags_right(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids gone (not pruned) come back, one with its text and one with another; it goes
    again, then comes back with its first text: the `present` flags and ids that an update
    leaves as known are those of an update that compares them."""
    texts, ids = _texts(16, chars=60), [f"r{i}" for i in range(16)]
    keep = [i for i in range(16) if i not in (3, 9)]
    other = list(texts)
    other[9] = "r9 has come back with another text entirely"
    again = [i for i in range(16) if i != 9]
    _updates_equal_comparing_every_column(tmp_path, tiny_bert, monkeypatch, [
        (_table(ids, texts), False),
        (_table([ids[i] for i in keep], [texts[i] for i in keep]), False),
        (_table(ids, other), False),
        (_table([ids[i] for i in again], [other[i] for i in again]), False),
        (_table(ids, texts), False)])


@pytest.mark.slow  # several runs each: in make test, not make test-fast
@pytest.mark.parametrize("flat", [(1, 1), (3, 3), (1, 3)],
                         ids=["one-grid", "flat-3x", "store-before-flat"])
def test_chains_of_edits_then_compaction_and_a_wider_status(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch,
        flat: tuple[int, int]) -> None:
    """r5 edited three times (a chain of superseded rows), three edits at once past the
    superseded share (compaction: rows dropped and moved), an empty text appended (a status
    wider than the stored one), then pruned (narrower again); flat arrays on the vectors'
    grid, on one 3x as long (12 rows: a block of the writer holds 3 vector chunks), and a
    store made on the first updated with the second."""
    texts, ids = _texts(20, chars=60), [f"r{i}" for i in range(20)]
    steps, now = [(_table(ids, texts), False)], list(texts)
    for k in range(3):
        now = list(now)
        now[5] = f"edit number {k} of r5 " * (k + 1)
        steps.append((_table(ids, now), False))
    now = list(now)
    for i in (1, 7, 12):
        now[i] = f"compacting edit of r{i}" + " more" * i
    steps.append((_table(ids, now), False))
    steps.append((_table([*ids, "e"], [*now, "  "]), False))
    steps.append((_table(ids, now), True))
    summaries = _updates_equal_comparing_every_column(tmp_path, tiny_bert, monkeypatch, steps,
                                                      flat)
    assert any(s.dropped for s in summaries)


@pytest.mark.parametrize("gains", [True, False], ids=["gains-nulls", "loses-nulls"])
def test_a_carried_string_column_that_gains_or_loses_nulls(
        tmp_path: Path, tiny_bert: Path, gains: bool) -> None:
    """A carried string column without nulls in the store gains some in an update (and the
    other way round): the nulls read back as nulls, not as the stored marker string, and
    the store equals a run from scratch (the kept array did not say which cells are
    nulls: "\u2400" came back where None was written)."""
    texts, ids = _texts(6, chars=40), [f"r{i}" for i in range(6)]
    plain = ["label a"] * 6
    holed = ["label a", None, "b", "label a", "x", None]
    source = tmp_path / "in.parquet"
    first, then = (plain, holed) if gains else (holed, plain)
    pq.write_table(pa.table({"id": ids, "text": texts, "label": first}), source)
    job = _job(tmp_path, tiny_bert, source, carry=("label",), incremental=True)
    run_job(job)
    pq.write_table(pa.table({"id": ids, "text": texts, "label": pa.array(then, pa.string())}),
                   source)
    run_job(job, incremental=True)
    got = pipeline.open_store(job.output.path).docs["label"].values.tolist()
    assert got == then
    assert verify_store(job.output.path) == []
