"""Damaged stores, as a table: each row damages a fresh copy of a finished store, runs a
command that reads it, and expects an exit code, a fragment of the one-line message
naming the array or file, no crash and no traceback, and the damaged store left exactly
as it was. Truncated Zarr chunks (a crash in the codec, once) run in a process of their
own, so that a crash shows as a negative return code instead of killing the test run: a
child of a fork server that has imported bertpipe once (a fresh interpreter per row spent
seconds on imports alone), each child a process of its own that runs the driver below."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import zarr
from click.testing import CliRunner

import pipeline
from pipeline.cli import main
from pipeline.errors import BertpipeError, StoreError
from pipeline.run.runner import run_job
from pipeline.spec import Job
from pipeline.stores import detect_format
from pipeline.stores.zarr_store import ZarrFormat
from tests.conftest import job_dict, store_schema_errors, write_job, write_table

pytestmark = pytest.mark.table  # hundreds of CLI runs: make test, not make test-fast

TEXTS = ["the drug worked very well", "bad side effects, no sleep for a week", "great",
         "my doctor said it is not good for pain and sleep", "yes", "the day was good",
         "it worked. then it did not. then the pain was terrible!", "pain pain pain",
         "no effects with the drug in my week", "a very good drug for my pain"]

# ---------------------------------------------------------------- finished stores


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, tiny_bert: Path) -> dict[str, Path]:
    """One finished store per format (built once; each test damages a copy)."""
    root = tmp_path_factory.mktemp("pristine")
    source = write_table(root / "in.parquet", {"id": [f"r{i}" for i in range(len(TEXTS))],
                                                "text": TEXTS})
    stores = {}
    for fmt in ("zarr", "parquet", "delta", "icechunk"):
        out = root / f"s.{fmt}"
        # icechunk: docs only, so that each vector array's chunk file has bytes of its own
        # (a chunk's mean equals its document's when every text is one chunk)
        levels = {"levels": ["docs"]} if fmt == "icechunk" else {}
        run_job(Job.from_dict(job_dict(source, tiny_bert, out,
                                       output={"format": fmt, **levels})))
        stores[fmt] = out
    # the next night's input: one row more (what `update` runs on)
    write_table(root / "next.parquet", {"id": [f"r{i}" for i in range(len(TEXTS) + 1)],
                                        "text": [*TEXTS, "a text of the next night"]})
    return stores


def _job_into(pristine: Path, store: Path) -> Job:
    """The job that made `pristine`, writing to `store` (the same run fingerprint)."""
    job = pipeline.open_store(pristine).provenance.job
    return replace(job, output=replace(job.output, path=str(store)))


@pytest.fixture
def store(request: pytest.FixtureRequest, pristine: dict[str, Path], tmp_path: Path) -> Path:
    """A copy of the pristine store of format `request.param`, at the same path inside
    tmp_path (the provenance names its own output path)."""
    copy = tmp_path / pristine[request.param].name
    shutil.copytree(pristine[request.param], copy)
    return copy


def _fingerprint(path: Path) -> dict[str, str]:
    """Every file of a store and its SHA-256: what `unchanged` compares."""
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


# ---------------------------------------------------------------- damage


def _flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0xFF
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    with file.open("r+b") as f:
        f.truncate(file.stat().st_size // 2)


def _zarr_chunk(store: Path) -> Path:
    return store / "docs" / "mean" / "c" / "0" / "0"


def _parquet_page(file: Path, column: str) -> int:
    """An offset inside the data of `column` (its first column chunk)."""
    meta = pq.read_metadata(file).row_group(0)
    chunk = next(meta.column(i) for i in range(meta.num_columns)
                 if meta.column(i).path_in_schema == f"{column}.list.element")
    return int(chunk.data_page_offset + chunk.total_compressed_size // 2)


def _delta_docs_file(store: Path) -> Path:
    """The docs table's data file (10 rows: one file)."""
    (file,) = (store / "docs").glob("part-*.parquet")
    return file


def _repository(store: Path) -> Any:
    import icechunk

    return icechunk.Repository.open(icechunk.local_filesystem_storage(str(store / "repo")))


def _ice_manifest(store: Path) -> Path:
    """The manifest listing docs/mean's chunks, as Icechunk's own snapshot listing says."""
    repo = _repository(store)
    tree = json.loads(repo.inspect_snapshot(repo.lookup_branch("main")))
    (node,) = [n for n in tree["nodes"] if n["path"] == "/docs/mean"]
    (ref,) = node["manifest_refs"]
    return store / "repo" / "manifests" / ref["id"]


def _ice_chunk(store: Path) -> Path:
    """The chunk file of docs/mean/c/0/0: the one file holding the bytes Icechunk reads
    for that key."""
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    session = _repository(store).readonly_session(branch="main")
    raw = sync(session.store.get("docs/mean/c/0/0", default_buffer_prototype())).to_bytes()
    (file,) = [f for f in (store / "repo" / "chunks").iterdir() if f.read_bytes() == raw]
    return file


def _ice_head(store: Path) -> Path:
    ref = json.loads((store / "repo/refs/branch.main/ref.json").read_text())
    return store / "repo" / "snapshots" / ref["snapshot"]


def _newer_format(store: Path) -> None:
    fmt = detect_format(str(store))
    raw = fmt.reread() or {}
    fmt.write_record({**raw, "format_version": 2})


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated chunk": lambda s: _truncate(_zarr_chunk(s)),
    "deleted chunk": lambda s: _zarr_chunk(s).unlink(),
    "flipped chunk byte": lambda s: _flip(_zarr_chunk(s), _zarr_chunk(s).stat().st_size // 2),
    "deleted array": lambda s: shutil.rmtree(s / "docs" / "mean"),
    "newer format_version": _newer_format,
    "missing docs/part-0.parquet": lambda s: (s / "docs/part-0.parquet").unlink(),
    "truncated docs/part-0.parquet": lambda s: _truncate(s / "docs/part-0.parquet"),
    "truncated chunks/part-0.parquet": lambda s: _truncate(s / "chunks/part-0.parquet"),
    "missing chunks/part-0.parquet": lambda s: (s / "chunks/part-0.parquet").unlink(),
    "flipped docs/part-0.parquet byte": lambda s: _flip(s / "docs/part-0.parquet",
                                                 _parquet_page(s / "docs/part-0.parquet", "mean")),
    "flipped delta docs file byte": lambda s: _flip(_delta_docs_file(s), _parquet_page(
        _delta_docs_file(s), "mean")),
    "deleted delta docs file": lambda s: _delta_docs_file(s).unlink(),
    "damaged docs/_delta_log": lambda s: sorted((s / "docs" / "_delta_log").glob("*.json")
                                                )[-1].write_text("{not json"),
    "deleted icechunk manifest": lambda s: _ice_manifest(s).unlink(),
    "truncated icechunk manifest": lambda s: _truncate(_ice_manifest(s)),
    "deleted icechunk chunk": lambda s: _ice_chunk(s).unlink(),
    "truncated icechunk chunk": lambda s: _truncate(_ice_chunk(s)),
    "deleted icechunk snapshot": lambda s: _ice_head(s).unlink(),
    "garbage icechunk branch ref": lambda s: (s / "repo/refs/branch.main/ref.json"
                                              ).write_text("garbage"),
}

# ---------------------------------------------------------------- commands

COMMANDS: dict[str, list[str]] = {
    "verify": ["verify", "{store}"],
    "inspect": ["inspect", "{store}"],
    "inspect --geometry": ["inspect", "--geometry", "--sample", "50", "{store}"],
    "search --exact": ["search", "{store}", "--exact", "-k", "2", "--view", "mean", "pain"],
    "postprocess": ["postprocess", "{store}", "--view", "mean", "--method", "center"],
    "vectors()": [],  # pipeline.open_store(store).vectors("mean")
    "rerun": [],  # the store's own job run again (bertpipe extract)
    "update": [],  # the nightly update: the store's job, incremental, one row more
}

DRIVER = """
import sys
from pipeline.errors import BertpipeError
if sys.argv[1] == "vectors()":
    import pipeline
    try:
        print(pipeline.open_store(sys.argv[2]).vectors("mean").shape)
    except BertpipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
else:
    from pipeline.cli import main
    main(sys.argv[1:])
"""


# imported once by the fork server, so that each isolated row starts warm (not torch: no
# command of the table loads a model)
PRELOAD = ["pipeline", "pipeline.cli", "pipeline.errors", "pipeline.api", "pipeline.stores",
           "pipeline.stores.verify", "pipeline.stores.zarr_store", "pipeline.analysis.inspect",
           "pipeline.analysis.search", "pipeline.post.apply", "pipeline.post.geometry"]

# Run first in the child: its output to the files STDOUT and STDERR (file descriptors 1 and
# 2 too, so that whatever a crash prints is kept), then the driver with ARGV.
PROLOGUE = """
import os, sys
for fd, name in ((1, STDOUT), (2, STDERR)):
    target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(target, fd)
    os.close(target)
sys.stdout = open(1, "w", buffering=1, closefd=False)
sys.stderr = open(2, "w", buffering=1, closefd=False)
sys.argv = ["-c", *ARGV]
"""


def _isolated(argv: list[str], folder: Path, code: str = DRIVER) -> tuple[int, str]:
    """(exit code, stdout + stderr) of the driver `code` run with `argv` in a process of
    its own: a crash there is a negative exit code (the signal), as a subprocess's return
    code is. The child runs `exec` on the code alone, so it imports nothing of the tests."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    stdout, stderr = folder / "driver.stdout", folder / "driver.stderr"
    names = {"__name__": "__main__", "ARGV": argv, "STDOUT": str(stdout),
             "STDERR": str(stderr)}
    child = context.Process(target=exec, args=(PROLOGUE + code, names))
    child.start()
    child.join(600)
    if child.exitcode is None:
        child.kill()
        child.join()
        raise TimeoutError(f"the driver ran for 600 s: {argv}")
    output = [f.read_text() if f.exists() else "" for f in (stdout, stderr)]
    return child.exitcode, "".join(output)


def run_command(command: str, store: Path, isolated: bool,
                job: Job | None = None) -> tuple[int, str]:
    """(exit code, stdout + stderr) of one command against `store`; `isolated` runs it in
    a process of its own, where a crash is a negative return code; `job` is what `rerun`
    runs (and `update`, incremental, on the next night's input beside the input)."""
    args = [a.format(store=store) for a in COMMANDS[command]]
    if isolated:
        return _isolated(args or [command, str(store)], store.parent)
    if command == "vectors()":
        return _in_process(lambda: pipeline.open_store(store).vectors("mean"))
    if command == "rerun":
        assert job is not None
        return _in_process(lambda: run_job(job))
    if command == "update":
        assert job is not None
        return _in_process(lambda: run_job(_next_night(job), incremental=True))
    result = CliRunner().invoke(main, args)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback: the test fails showing it
    return result.exit_code, result.stdout + result.stderr


def _next_night(job: Job) -> Job:
    """`job` reading the next night's input (one row more), as an incremental update."""
    source = Path(job.input.path).with_name("next.parquet")
    return replace(job, input=replace(job.input, path=str(source)),
                   output=replace(job.output, incremental=True))


def _in_process(call: Callable[[], Any]) -> tuple[int, str]:
    try:
        call()
    except BertpipeError as exc:
        return exc.exit_code, f"error: {exc}"
    return 0, ""


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class Case:
    fmt: str
    damage: str
    command: str
    code: int
    fragment: str  # in the message; names the array or file
    isolated: bool = False  # in a subprocess: the codec once crashed the process here
    also: str = ""  # a second fragment the message holds


def _row(fmt: str, damage: str, expect: dict[str, tuple[int, str]],
         isolated: bool = False) -> list[Case]:
    return [Case(fmt, damage, command, code, fragment, isolated)
            for command, (code, fragment) in expect.items()]


def _all(code: int, fragment: str, commands: tuple[str, ...] = (
        "verify", "inspect", "inspect --geometry", "search --exact", "vectors()")
         ) -> dict[str, tuple[int, str]]:
    return {command: (code, fragment) for command in commands}


NEWER = "format version 2 is newer than this bertpipe reads"


def _ice_rows(damage: str, fragment: str, also: str = "") -> list[Case]:
    """An Icechunk damage: every command exit 5 naming the file; the reading commands also
    in a process of their own (an abort there is a negative exit code)."""
    expect = _all(5, fragment, ("verify", "inspect", "search --exact", "vectors()",
                                "postprocess", "rerun", "update"))
    rows = _row("icechunk", damage, expect, isolated=False)
    rows += _row("icechunk", damage, _all(5, fragment, ("verify", "inspect", "vectors()")),
                 isolated=True)
    return [replace(c, also=also) for c in rows]
TABLE: list[Case] = [
    # Zarr: the chunk of docs/mean (all 10 rows) damaged three ways, or the array gone
    *_row("zarr", "truncated chunk", _all(5, "docs/mean: chunk c/0/0 is damaged"),
          isolated=True),
    *_row("zarr", "truncated chunk", {"rerun": (5, "docs/mean: chunk c/0/0 is damaged")}),
    *_row("zarr", "deleted chunk", _all(5, "docs/mean: chunk c/0/0 is missing")),
    *_row("zarr", "deleted chunk", {"rerun": (5, "fails verification: docs/mean: chunk")}),
    *_row("zarr", "flipped chunk byte", {
        **_all(5, "docs/mean: chunk c/0/0 is damaged (its bytes do not match"),
        "inspect": (0, "coverage"),  # reads no vector: nothing to notice (verify does)
        "postprocess": (5, "fails verification, left unchanged: docs/mean: chunk c/0/0"),
        "rerun": (5, "complete but fails verification: docs/mean: chunk c/0/0 is damaged")}),
    *_row("zarr", "deleted array", {
        **_all(5, "docs/mean: the array is missing"),
        "rerun": (5, "fails verification: docs/mean: the array is missing")}),
    *_row("zarr", "newer format_version", {**_all(5, NEWER), "rerun": (5, NEWER)}),
    # Parquet: a file gone, cut short, or a byte of the mean column's data flipped
    *_row("parquet", "missing docs/part-0.parquet", _all(5, "docs/part-0.parquet is missing")),
    *_row("parquet", "truncated docs/part-0.parquet", {
        **_all(5, "docs/part-0.parquet: damaged Parquet file"),
        "rerun": (5, "docs/part-0.parquet: damaged Parquet file")}),
    *_row("parquet", "truncated chunks/part-0.parquet", {
        **_all(5, "chunks/part-0.parquet is damaged"),
        "rerun": (5, "fails verification: chunks/part-0.parquet is damaged")}),
    *_row("parquet", "missing chunks/part-0.parquet", _all(5, "chunks/part-0.parquet is missing")),
    *_row("parquet", "flipped docs/part-0.parquet byte", {
        "verify": (5, "docs/part-0.parquet is damaged (its bytes do not match"),
        "inspect": (0, "coverage"),  # reads no vector column: nothing to notice
        "inspect --geometry": (5, "docs/part-0.parquet: column mean, row group 0: damaged"),
        "search --exact": (5, "docs/part-0.parquet: column mean, row group 0: damaged"),
        "vectors()": (5, "docs/part-0.parquet: column mean, row group 0: damaged"),
        "postprocess": (5, "fails verification, left unchanged: docs/part-0.parquet is damaged"),
        "rerun": (5, "complete but fails verification: docs/part-0.parquet is damaged")}),
    *_row("parquet", "newer format_version", {**_all(5, NEWER), "rerun": (5, NEWER)}),
    # Delta: a data file of the current version altered or gone, the log damaged
    *_row("delta", "flipped delta docs file byte", {
        "verify": (5, "is damaged (its bytes do not match the recorded checksum)"),
        "inspect": (0, "coverage"),  # reads no vector column: nothing to notice
        "inspect --geometry": (5, "column mean, row group 0: damaged"),
        "search --exact": (5, "column mean, row group 0: damaged"),
        "vectors()": (5, "column mean, row group 0: damaged"),
        "postprocess": (5, "fails verification, left unchanged: docs/part-"),
        "rerun": (5, "complete but fails verification: docs/part-")}),
    *_row("delta", "deleted delta docs file", {**_all(5, ".parquet is missing"),
                                               "rerun": (5, ".parquet is missing")}),
    *_row("delta", "damaged docs/_delta_log", {**_all(5, "docs: damaged Delta table"),
                                               "rerun": (5, "docs: damaged Delta table")}),
    *_row("delta", "newer format_version", {**_all(5, NEWER), "rerun": (5, NEWER)}),
    *_row("delta", "deleted delta docs file", {"update": (5, ".parquet is missing")}),
    # Icechunk: a file of the repository gone or cut short. Before, a deleted manifest or
    # chunk traced back (or aborted: exit 134), a truncated chunk went unseen by inspect
    # and open_store, an update carried it forward into a version failing verify, and a
    # lost snapshot or ref read as "incomplete, rerun it" (then "not a bertpipe store")
    *_ice_rows("deleted icechunk manifest", "is missing (it lists the chunks of docs/mean)"),
    *_ice_rows("truncated icechunk manifest", "is damaged (", "it lists the chunks of docs/mean"),
    *_ice_rows("deleted icechunk chunk", "docs/mean: chunk c/0/0 is missing (file repo/chunks/"),
    *_ice_rows("truncated icechunk chunk", "docs/mean: chunk c/0/0 is damaged ("),
    *_ice_rows("deleted icechunk snapshot", "is missing; restore it from a backup, or move "
               "the store aside and rerun its job", "repo/snapshots/"),
    *_ice_rows("garbage icechunk branch ref", "repo/refs/branch.main/ref.json is damaged",
               "move the store aside"),
]


def _param(case: Case) -> Any:
    marks = [pytest.mark.no_store_schema] if case.damage == "newer format_version" else []
    where = "-isolated" if case.isolated and case.fmt == "icechunk" else ""
    return pytest.param(case, id=f"{case.fmt}-{case.damage}-{case.command}{where}",
                        marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in TABLE])
def test_damaged_store(case: Case, pristine: dict[str, Path], tmp_path: Path) -> None:
    store = tmp_path / pristine[case.fmt].name
    shutil.copytree(pristine[case.fmt], store)
    DAMAGE[case.damage](store)
    before = _fingerprint(store)
    job = _job_into(pristine[case.fmt], store)
    code, output = run_command(case.command, store, case.isolated, job)
    assert code >= 0, f"crashed (signal {-code}): {output[-2000:]}"
    assert "Traceback" not in output, output
    assert code == case.code, output
    assert case.fragment in output, output
    assert case.also in output, output
    if code:
        assert len([line for line in output.splitlines() if line.startswith("error:")]) == 1
    assert _fingerprint(store) == before  # a refused command changed nothing


RERUNS = [c for c in TABLE if c.command == "rerun"]


@pytest.mark.parametrize("case", [_param(c) for c in RERUNS])
def test_the_checks_refuse_a_damaged_store_as_the_rerun_does(
        case: Case, pristine: dict[str, Path], tmp_path: Path) -> None:
    """`validate` and `extract --dry-run` run `before_writing`, the rerun's own checks: over
    a damaged store they refuse with the rerun's code and first words, changing nothing."""
    from pipeline.run.checks import Asked, before_writing

    store = tmp_path / pristine[case.fmt].name
    shutil.copytree(pristine[case.fmt], store)
    DAMAGE[case.damage](store)
    before = _fingerprint(store)
    job = _job_into(pristine[case.fmt], store)
    checked = _in_process(lambda: before_writing(Asked(job)))
    rerun = _in_process(lambda: run_job(job))
    assert checked[0] == rerun[0] == case.code, (checked, rerun)
    assert checked[1].split()[:4] == rerun[1].split()[:4] and case.fragment in checked[1]
    assert _fingerprint(store) == before


def test_the_table_covers_every_damage_and_command() -> None:
    assert {c.damage for c in TABLE} == set(DAMAGE)
    assert {c.command for c in TABLE} == set(COMMANDS)
    assert len({(c.fmt, c.damage, c.command, c.isolated) for c in TABLE}) == len(TABLE)


# ---------------------------------------------------------------- stores that prove themselves


@pytest.mark.parametrize("store", ["zarr", "parquet"], indirect=True)
def test_fresh_store_verifies_ok(store: Path) -> None:
    code, output = run_command("verify", store, isolated=False)
    assert code == 0, output
    fmt = "zarr" if store.suffix == ".zarr" else "parquet"
    assert output.strip().startswith(f"{store}: OK ({fmt}; 10 rows, 10 chunks, 2 views; ")
    assert len(output.strip().splitlines()) == 1
    provenance = detect_format(str(store)).record() or {}
    assert store_schema_errors(provenance) == []


@pytest.mark.parametrize("store", ["zarr", "parquet"], indirect=True)
def test_checksums_cover_every_data_file(store: Path) -> None:
    """Recorded: every chunk and array metadata file (Zarr), the column data before the
    footer (Parquet); each checksum is the SHA-256 of exactly those bytes."""
    data = pipeline.open_store(store)
    sums = data.provenance.checksums
    if data.format == "zarr":  # every file but the root zarr.json (it holds the provenance)
        files = {f.relative_to(store).as_posix() for f in store.rglob("*") if f.is_file()}
        assert set(sums) == files - {"zarr.json"}
        assert {"docs/mean/c/0/0", "docs/id/zarr.json", "chunks/cls/c/0/0"} <= set(sums)
    else:
        assert set(sums) == {"docs/part-0.parquet", "chunks/part-0.parquet"}
    for rel, recorded in sums.items():
        raw = (store / rel).read_bytes()
        if rel.endswith(".parquet"):  # up to the footer: 4-byte length, then magic, at the end
            footer = int.from_bytes(raw[-8:-4], "little")
            raw = raw[: len(raw) - 8 - footer]
            assert raw[:4] == b"PAR1"
        assert (recorded.size, recorded.sha256) == (len(raw), hashlib.sha256(raw).hexdigest())


@pytest.mark.parametrize("store", ["zarr", "parquet"], indirect=True)
def test_postprocess_records_its_files_and_still_verifies(store: Path) -> None:
    before = pipeline.open_store(store).provenance.checksums
    code, output = run_command("postprocess", store, isolated=False)
    assert code == 0, output
    after = pipeline.open_store(store).provenance.checksums
    if store.suffix == ".zarr":  # new arrays and parameters; the old files untouched
        assert {k: v for k, v in after.items() if k in before} == before
        assert {"docs/mean_center/c/0/0", "chunks/mean_center/c/0/0",
                "post/mean_center/mean/c/0"} <= set(after) - set(before)
    else:  # the rewritten files, and the fitted parameters
        assert set(after) == set(before) | {"post/mean_center.npz"}
        assert after["docs/part-0.parquet"] != before["docs/part-0.parquet"]
    code, output = run_command("verify", store, isolated=False)
    assert code == 0 and "3 views" in output, output


@pytest.mark.parametrize("store", ["parquet"], indirect=True)
def test_parquet_provenance_update_rewrites_only_the_footer(store: Path) -> None:
    file = store / "docs/part-0.parquet"
    fmt = detect_format(str(store))
    raw = fmt.reread() or {}
    data_before = file.read_bytes()[: raw["checksums"]["docs/part-0.parquet"]["size"]]
    table_before = pq.read_table(file)
    fmt.write_record({**raw, "created": "2030-01-01T00:00:00+00:00"})
    assert file.read_bytes()[: len(data_before)] == data_before
    assert pq.read_table(file).equals(table_before)
    assert fmt.reread()["created"].startswith("2030")  # type: ignore[index]
    assert run_command("verify", store, isolated=False)[0] == 0


def test_vector_fill_value_is_nan(pristine: dict[str, Path]) -> None:
    root: Any = zarr.open_group(str(pristine["zarr"]), mode="r")
    for level in ("docs", "chunks"):
        for view in ("mean", "cls"):
            assert np.isnan(root[level][view].metadata.fill_value)


@pytest.mark.parametrize("store", ["zarr"], indirect=True)
def test_store_without_checksums_reads_a_missing_chunk_as_nan(store: Path) -> None:
    """A store written before checksums existed: nothing vouches for it, so `verify` says
    so; a chunk that is missing reads as NaN (the fill value), never as zero vectors."""
    _strip_checksums(store)
    code, output = run_command("verify", store, isolated=False)
    assert code == 5 and "no checksums recorded" in output, output
    _zarr_chunk(store).unlink()
    vectors = pipeline.open_store(store).vectors("mean")
    assert vectors.shape == (10, 32) and np.isnan(vectors).all()


@pytest.mark.parametrize("store", ["zarr"], indirect=True)
def test_store_without_checksums_truncated_chunk_is_an_error_not_a_crash(store: Path) -> None:
    """With no checksum to refuse the bytes first, the codec sees them: its error becomes
    a StoreError naming the array (in a subprocess: a crash would be a negative code)."""
    _strip_checksums(store)
    _truncate(_zarr_chunk(store))
    code, output = run_command("vectors()", store, isolated=True)
    assert code == 5, output
    assert "docs/mean: cannot be decoded" in output and "Traceback" not in output


def _strip_checksums(store: Path) -> None:
    meta = json.loads((store / "zarr.json").read_text())
    del meta["attributes"]["bertpipe"]["checksums"]
    # the consolidated copy lives in the same file: only the root attributes change
    (store / "zarr.json").write_text(json.dumps(meta))
    assert ZarrFormat(str(store)).record().get("checksums") is None  # type: ignore[union-attr]


@pytest.mark.parametrize("store", ["zarr"], indirect=True)
def test_verify_names_an_array_the_provenance_does_not_record(store: Path) -> None:
    root: Any = zarr.open_group(str(store), mode="a", use_consolidated=False)
    root["docs"].create_array("stray", shape=(10,), dtype="int64")[...] = np.arange(10)
    code, output = run_command("verify", store, isolated=False)
    assert code == 5, output
    assert "docs/stray: chunk c/0 is not recorded in the provenance" in output


@pytest.mark.parametrize("store", ["zarr", "parquet"], indirect=True)
def test_verify_checks_rows_against_the_provenance(store: Path) -> None:
    fmt = detect_format(str(store))
    raw = fmt.reread() or {}
    fmt.write_record({**raw, "stats": {**raw["stats"], "rows": 11}})
    code, output = run_command("verify", store, isolated=False)
    assert code == 5, output
    name = "docs/mean" if store.suffix == ".zarr" else "docs/part-0.parquet"
    assert f"{name} has 10 rows where the provenance says 11" in output


@pytest.mark.parametrize("store", ["zarr", "parquet"], indirect=True)
def test_verify_refuses_an_incomplete_store(store: Path) -> None:
    fmt = detect_format(str(store))
    raw = fmt.reread() or {}
    fmt.write_record({**raw, "complete": False})
    code, output = run_command("verify", store, isolated=False)
    assert code == 5 and "incomplete" in output, output


@pytest.mark.no_store_schema
@pytest.mark.parametrize("store", ["zarr", "parquet"], indirect=True)
def test_newer_format_version_is_refused_on_open(store: Path) -> None:
    _newer_format(store)
    with pytest.raises(StoreError, match=f"{NEWER} \\(1\\); upgrade bertpipe"):
        pipeline.open_store(store)


def test_verify_of_a_path_that_is_no_store(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    code, output = run_command("verify", tmp_path, isolated=False)
    assert code == 5 and "not a bertpipe store" in output, output
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- the real CLI, whole


ICECHUNK_DAMAGE = [name for name in DAMAGE if "icechunk" in name]


def test_no_command_over_a_damaged_icechunk_store_ends_in_a_signal_or_a_traceback(
        pristine: dict[str, Path], tmp_path: Path) -> None:
    """Each Icechunk damage, and `verify`, `inspect` and the nightly `extract` over it, as
    the real `bertpipe` program in a process of its own, interpreter exit included (where a
    Rust panic once aborted it: exit 134): exit 5, one `error:` line, no traceback."""
    import os
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    repo = Path(__file__).resolve().parents[1]
    # a crash prints where it happened (Python's stacks of every thread)
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONFAULTHANDLER": "1"}
    runs: list[tuple[str, list[str]]] = []
    for damage in ICECHUNK_DAMAGE:
        folder = tmp_path / damage.replace(" ", "-")
        store = folder / pristine["icechunk"].name
        shutil.copytree(pristine["icechunk"], store)
        DAMAGE[damage](store)
        job = _next_night(_job_into(pristine["icechunk"], store))
        job_file = write_job(folder / "job.yaml", job.to_dict())
        for args in (["verify", str(store)], ["inspect", str(store)],
                     ["extract", str(job_file)]):
            runs.append((damage, [sys.executable, "-m", "pipeline.cli", *args]))

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)

    with ThreadPoolExecutor(max_workers=3) as pool:
        done = list(pool.map(run, [argv for _, argv in runs]))
    for (damage, argv), result in zip(runs, done, strict=True):
        output = result.stdout + result.stderr
        where = f"{damage}: bertpipe {argv[3]}: exit {result.returncode}: {output[-6000:]}"
        assert result.returncode == 5, where  # not a signal (negative), not 134 (abort)
        assert "Traceback" not in output and "panicked" not in output, where
        assert len([line for line in output.splitlines() if line.startswith("error:")]) == 1
