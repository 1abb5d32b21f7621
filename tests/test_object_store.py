"""Inputs and stores on an object store: a real S3 endpoint (moto in server mode on
loopback), spoken to by botocore/s3fs over HTTP as a cloud endpoint is.

What holds on local disk must hold there: parts and markers written straight into the
store, the lock taken by a conditional create, nothing deleted outside the store's own
keys, `complete` written last, resume after a killed client, secrets never written, and a
wrong credential or an unreachable endpoint is one line with its exit code."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

from pipeline.cli import main
from pipeline.errors import InputError, StoreError
from pipeline.io import location as storefs
from tests.conftest import REPO, REVIEWS, job_dict, write_job
from tests.s3server import environment, make_bucket, moto_server


def new_bucket(endpoint: str) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    make_bucket(endpoint, name)
    return f"s3://{name}"


@pytest.fixture
def s3(s3_endpoint: str) -> str:
    """A new, empty bucket: its URL."""
    return new_bucket(s3_endpoint)


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner(env=env).invoke(main, [str(a) for a in args])


def one_error_line(result: Result) -> str:
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.output
    assert "Traceback" not in result.output
    return errors[0]


def keys(prefix: str) -> list[str]:
    """Every key under `prefix` (an s3:// URL), relative to it."""
    return storefs.resolve(prefix).files()


# ---- the filesystem layer ---------------------------------------------------------------


def test_location_writes_whole_objects_and_removes_only_its_own_keys(s3: str) -> None:
    store = storefs.resolve(f"{s3}/out/x.zarr/")
    assert store.url == f"{s3}/out/x.zarr" and not store.exists()
    store.child("docs", "mean", "zarr.json").write_json({"a": 1})
    store.child("docs/mean/c/0/0").write_bytes(b"\x00" * 10)
    neighbour = storefs.resolve(f"{s3}/out/x.zarr2/keep.txt")  # shares the prefix
    neighbour.write_bytes(b"mine")
    storefs.resolve(f"{s3}/out/x.zarr.txt").write_bytes(b"mine too")
    assert store.is_dir() and [e.name for e in store.entries()] == ["docs"]
    assert store.files() == ["docs/mean/c/0/0", "docs/mean/zarr.json"]
    assert json.loads(store.child("docs/mean/zarr.json").read_bytes()) == {"a": 1}
    assert store.child("docs/mean/c/0/0").read_bytes(2, 5) == b"\x00" * 3
    store.remove_tree()
    assert not store.exists()
    assert keys(f"{s3}/out") == ["x.zarr.txt", "x.zarr2/keep.txt"]


def test_conditional_create_has_exactly_one_winner(s3: str) -> None:
    lock = storefs.resolve(f"{s3}/out/x.zarr/_bertpipe.lock")
    results: list[bool] = []
    barrier = threading.Barrier(16)

    def take(i: int) -> None:
        barrier.wait()
        results.append(lock.create_exclusive(f"writer {i}".encode()))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 15 + [True]
    winner = lock.read_text()
    assert winner.startswith("writer ") and not lock.create_exclusive(b"late")
    assert lock.read_text() == winner
    with pytest.raises(ValueError, match="non-empty"):
        lock.create_exclusive(b"")  # an empty body may skip the condition


def test_store_lock_on_s3_refuses_a_second_writer_and_spares_anothers(s3: str) -> None:
    from pipeline.stores.lock import StoreLock

    first, second = StoreLock(f"{s3}/o.zarr"), StoreLock(f"{s3}/o.zarr")
    first.acquire("a" * 64)
    with pytest.raises(StoreError, match=f"{s3}/o.zarr is being written by another run "
                                         f".*pid {os.getpid()}.*job aaaaaaaaaaaa"):
        second.acquire("b" * 64)
    second.release()  # never acquired: must not remove the first's lock
    assert (first.holder() or {}).get("fingerprint") == "a" * 64
    first.release()
    assert first.holder() is None and keys(f"{s3}/o.zarr") == []


def test_lease_on_s3_is_refreshed_taken_over_when_expired_and_fenced(
        s3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No mtime to touch on an object store: the holder rewrites its own record. A record
    of another host that stopped refreshing is taken over after its lease (conditional
    create of the claim), and the old holder's fence then refuses."""
    import json
    import time

    from pipeline.stores import lock as lock_module
    from pipeline.stores.lock import Fence, LockLostError, StoreLock

    # long enough that a loaded machine still refreshes within the two beats "live" allows
    monkeypatch.setenv(lock_module.REFRESH_ENV, "1")
    url = f"{s3}/o.zarr"
    held = StoreLock(url)
    held.acquire("a" * 64)
    record = held.holder() or {}
    deadline = time.monotonic() + 20
    while (held.holder() or {}).get("refreshed_unix", 0) <= record["refreshed_unix"]:
        assert time.monotonic() < deadline, "the holder did not refresh its lock"
        time.sleep(0.05)
    assert held.state().kind == "live"
    assert (held.holder() or {}).get("token") == record["token"]
    held.release()
    assert held.holder() is None
    dead = {**record, "host": "elsewhere", "token": "d" * 32, "refresh_s": 30,
            "refreshed_unix": time.time() - 3600}
    storefs.resolve(f"{url}/_bertpipe.lock").write_bytes(json.dumps(dead).encode())
    taker = StoreLock(url)
    taker.acquire("b" * 64)
    assert "host elsewhere" in taker.took_over and "its lease expired" in taker.took_over
    assert (taker.holder() or {}).get("generation") == 2
    with pytest.raises(LockLostError, match="now held by host "):
        Fence(taker.file, "d" * 32).check("commit")  # the dead holder, had it woken up
    taker.release()
    assert keys(url) == []  # the lock and the claim


def test_staging_on_s3_writes_parts_then_markers(s3: str) -> None:
    from pipeline.stores.markers import PartitionMarker
    from pipeline.stores.staging import Staging

    staging = Staging(f"{s3}/o.zarr")
    staging.begin({"run_fingerprint": "f"})
    table = pa.table({"row": [0, 1], "x": [1.5, 2.5]})
    marker = PartitionMarker(index=0, fingerprint="f", rows=(0, 2), input="i", n_chunks=2,
                             n_tokens=9, n_covered=9, n_encoded=13, n_unique=2, device="cpu",
                             dtype="float32", runtime="torch", seconds=0.5)
    written = staging.write_part(marker, {"docs": table, "chunks": None})
    staging.write_part(replace(marker, index=1, fingerprint="other job"), {"docs": table})
    assert staging.done("f") == {0: written}  # read back as written, checksums included
    assert set(written.sha256) == {"docs"}
    assert next(iter(staging.read_parts("docs", [0]))).equals(table)
    # a part altered after its marker was written is not reused
    staging.part(0, "docs").write_bytes(b"PAR1 damaged PAR1")
    assert staging.done("f") == {}
    assert staging.run_info() == {"run_fingerprint": "f"}
    staging.remove()
    assert keys(f"{s3}/o.zarr") == []


# ---- the input: a prefix of Parquet files, planned from footers --------------------------


def upload(local: Path, url: str) -> None:
    storefs.resolve(url).write_bytes(local.read_bytes())


@pytest.fixture
def reviews_on_s3(s3: str, tmp_path: Path) -> tuple[str, Path]:
    """The first 96 sample reviews as three files under s3://bucket/in/ (and locally)."""
    table = pq.read_table(REVIEWS).slice(0, 96)
    local = tmp_path / "in"
    local.mkdir()
    for i, start in enumerate((0, 40, 72)):
        stop = (40, 72, 96)[i]
        pq.write_table(table.slice(start, stop - start), local / f"part-{i}.parquet",
                       row_group_size=16)
        upload(local / f"part-{i}.parquet", f"{s3}/in/part-{i}.parquet")
    storefs.resolve(f"{s3}/in/README.txt").write_bytes(b"not parquet")
    return f"{s3}/in", local


def test_shipped_s3_job_validates_against_its_buckets(s3_endpoint: str, minilm: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """jobs/reviews-s3.yaml as written: the input prefix listed and its footers read from
    the bucket the job names, the store's bucket checked, the model read."""
    make_bucket(s3_endpoint, "reviews-raw")
    make_bucket(s3_endpoint, "reviews-vectors")
    upload(REVIEWS, "s3://reviews-raw/reviews/part-0.parquet")
    monkeypatch.chdir(REPO)
    result = run("validate", "jobs/reviews-s3.yaml", "--set", f"model.path={minilm}")
    assert result.exit_code == 0, result.output
    assert "checked model bert (6 layers, hidden 384); input 1 file, 600 rows" \
        in result.stdout, result.stdout
    assert keys("s3://reviews-vectors") == []  # validate writes nothing


def test_input_prefix_is_listed_and_planned_like_the_local_folder(
        reviews_on_s3: tuple[str, Path]) -> None:
    from pipeline.extract.source import (
        input_identity,
        list_files,
        plan_partitions,
        read_partition,
    )
    from pipeline.spec import InputSpec

    url, local = reviews_on_s3
    assert list_files(url) == [f"{url}/part-{i}.parquet" for i in range(3)]
    assert list_files(url + "/part-[12].parquet") == [f"{url}/part-{i}.parquet" for i in (1, 2)]
    remote = InputSpec(url, "text", "id", ("label",))
    here = InputSpec(str(local), "text", "id", ("label",))
    plan, local_plan = plan_partitions(remote, 24), plan_partitions(here, 24)
    assert [(p.row_start, p.row_stop, p.file_offset, p.footer_sha256) for p in plan] == \
        [(p.row_start, p.row_stop, p.file_offset, p.footer_sha256) for p in local_plan]
    assert [i.footer_sha256 for i in input_identity(remote)] == \
        [i.footer_sha256 for i in input_identity(here)]
    for part, twin in zip(plan, local_plan, strict=True):
        got, want = read_partition(remote, part), read_partition(here, twin)
        assert got.texts == want.texts and got.ids.equals(want.ids)
        assert got.carry["label"].equals(want.carry["label"])


def test_planning_reads_footers_only(s3: str, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3 MB file is planned from its footer: a few KiB fetched, never the data pages;
    a partition then fetches its own row groups, not the file."""
    import s3fs.core

    from pipeline.extract.source import plan_partitions, read_partition
    from pipeline.spec import InputSpec

    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("abcdefgh "), 300)) for _ in range(10_000)]
    local = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": texts}), local, row_group_size=1000, compression="none")
    upload(local, f"{s3}/big.parquet")
    size = local.stat().st_size
    fetched: list[int] = []
    original_file, original_cat = s3fs.core.S3File._fetch_range, s3fs.core.S3FileSystem._cat_file

    def counted_range(self: Any, start: int, end: int) -> bytes:
        fetched.append(end - start)
        return original_file(self, start, end)  # type: ignore[no-any-return]

    async def counted_cat(self: Any, path: str, *args: Any, **kwargs: Any) -> bytes:
        data = await original_cat(self, path, *args, **kwargs)
        fetched.append(len(data))
        return data  # type: ignore[no-any-return]

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", counted_range)
    monkeypatch.setattr(s3fs.core.S3FileSystem, "_cat_file", counted_cat)
    spec = InputSpec(f"{s3}/big.parquet", "text")
    parts = plan_partitions(spec, 1000)
    assert len(parts) == 10 and size > 3_000_000
    assert 0 < sum(fetched) < 200_000, (sum(fetched), size)
    fetched.clear()
    assert read_partition(spec, parts[3]).texts == texts[3000:4000]
    assert sum(fetched) < size / 5, (sum(fetched), size)


# ---- where a store may go ----------------------------------------------------------------


@pytest.mark.parametrize(("output", "why"), [
    ("{s3}/in", "is the input folder"),
    ("{s3}", "contains the input folder"),
    ("{s3a}/in/out.zarr", "inside the input folder"),
    ("{s3}/in/part-0.parquet", "is the input file"),
])
def test_store_may_not_be_hold_or_feed_the_input(
        s3: str, reviews_on_s3: tuple[str, Path], tiny_bert: Path, tmp_path: Path,
        output: str, why: str) -> None:
    url, _ = reviews_on_s3
    output = output.format(s3=s3, s3a=s3.replace("s3://", "s3a://"))
    job = write_job(tmp_path / "job.yaml", job_dict(url, tiny_bert, output))
    result = run("extract", job)
    assert result.exit_code == 5 and why in one_error_line(result)
    assert keys(f"{s3}") == ["in/README.txt"] + [f"in/part-{i}.parquet" for i in range(3)]


def test_store_may_not_be_matched_by_the_input_glob(
        s3: str, reviews_on_s3: tuple[str, Path], tiny_bert: Path, tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml",
                    job_dict(f"{s3}/*/part-*.parquet", tiny_bert,
                             f"{s3}/x/part-9.parquet"))
    result = run("extract", job)
    assert result.exit_code == 5 and "matched by the input pattern" in one_error_line(result)


# ---- secrets -----------------------------------------------------------------------------


def test_storage_options_are_recorded_without_secrets(tmp_path: Path, tiny_bert: Path) -> None:
    from pipeline.spec import Job

    options = {"key": "AKIAPLAINTEXTKEY", "secret": "${MY_SECRET}", "use_ssl": False,
               "client_kwargs": {"endpoint_url": "http://minio:9000", "region_name": "x"},
               "config_kwargs": {"connect_timeout": 3}}
    job = Job.from_dict(job_dict(tmp_path / "in.parquet", tiny_bert, "s3://b/o.zarr",
                                 output={"storage_options": options}))
    recorded = job.to_dict()["output"]["storage_options"]
    assert recorded == {"key": "***", "secret": "${MY_SECRET}", "use_ssl": False,
                        "client_kwargs": {"endpoint_url": "***", "region_name": "***"},
                        "config_kwargs": {"connect_timeout": 3}}
    same = Job.from_dict(job_dict(tmp_path / "in.parquet", tiny_bert, "s3://b/o.zarr"))
    assert job.fingerprint() == same.fingerprint()  # how a store is reached is not its content


def test_missing_environment_reference_names_the_key(
        s3: str, reviews_on_s3: tuple[str, Path], tiny_bert: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BERTPIPE_TEST_UNSET", raising=False)
    url, _ = reviews_on_s3
    job = write_job(tmp_path / "job.yaml", job_dict(
        url, tiny_bert, f"{s3}/o.zarr",
        input={"storage_options": {"secret": "${BERTPIPE_TEST_UNSET}"}}))
    result = run("extract", job)
    assert result.exit_code == 2
    assert "input.storage_options.secret: environment variable BERTPIPE_TEST_UNSET is not " \
        "set" in one_error_line(result)


# ---- wrong credentials, unreachable endpoints --------------------------------------------


@pytest.fixture(scope="module")
def auth_endpoint() -> Iterator[tuple[str, str, str]]:
    """A second server that checks signatures (IAM on): its URL and a valid key pair."""
    from tests.s3server import iam_credentials

    with moto_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as url:
        key, secret = iam_credentials(url)
        yield url, key, secret


def test_wrong_credential_is_one_line_and_nothing_is_written(
        auth_endpoint: tuple[str, str, str], tiny_bert: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    url, key, secret = auth_endpoint
    for name, value in {**environment(url), "AWS_ACCESS_KEY_ID": key,
                        "AWS_SECRET_ACCESS_KEY": secret}.items():
        monkeypatch.setenv(name, value)
    import boto3

    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    s3.create_bucket(Bucket="auth")
    local = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(REVIEWS).slice(0, 8), local)
    s3.put_object(Bucket="auth", Key="in/reviews.parquet", Body=local.read_bytes())
    wrong = "wrong-secret-0123456789abcdef"
    # the store's credential wrong: exit 5; the input's: exit 3; before anything is made
    for side, url_of_side, code in (("output", "s3://auth/out.zarr", 5),
                                    ("input", "s3://auth/in", 3)):
        job = write_job(tmp_path / "job.yaml", job_dict(
            "s3://auth/in", tiny_bert, "s3://auth/out.zarr",
            **{side: {"storage_options": {"key": "${AWS_ACCESS_KEY_ID}", "secret": wrong}}}))
        result = run("extract", job)
        line = one_error_line(result)
        assert result.exit_code == code and f"{side}.path: {url_of_side}: access denied" in line
        assert wrong not in result.output and secret not in result.output
        listed = s3.list_objects_v2(Bucket="auth").get("Contents", [])
        assert [o["Key"] for o in listed] == ["in/reviews.parquet"]


@pytest.mark.slow  # end to end (real processes, servers or a browser): not in make test-fast
def test_unreachable_endpoint_is_one_line_exit_8(tmp_path: Path, tiny_bert: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from tests.s3server import free_port

    local = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(REVIEWS).slice(0, 8), local)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for name, value in environment(dead).items():
        monkeypatch.setenv(name, value)
    job = write_job(tmp_path / "job.yaml", job_dict(local, tiny_bert, "s3://bucket/out.zarr"))
    started = time.monotonic()
    result = run("extract", job)
    line = one_error_line(result)
    assert result.exit_code == 8, result.output
    assert "output.path: cannot reach the store at s3://bucket/out.zarr" in line
    assert time.monotonic() - started < 30
    job = write_job(tmp_path / "job.yaml", job_dict("s3://bucket/in", tiny_bert,
                                                    tmp_path / "o.zarr"))
    result = run("extract", job)
    assert result.exit_code == 8 and "input.path: cannot reach" in one_error_line(result)
    assert not (tmp_path / "o.zarr").exists()


def test_incremental_run_job_keeps_literal_credentials(
        auth_endpoint: tuple[str, str, str], tiny_bert: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_job(job, incremental=True)` from Python with the input's credentials written
    literally in its storage options (no environment to fall back on): the endpoint checks
    signatures, so a job rebuilt from its redacted form (`***`) would be refused."""
    from pipeline.run.runner import run_job
    from pipeline.spec import Job

    url, key, secret = auth_endpoint
    for name, value in environment(url).items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    import boto3

    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                      aws_access_key_id=key, aws_secret_access_key=secret)
    s3.create_bucket(Bucket="literal")
    local = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(REVIEWS).slice(0, 12), local)
    s3.put_object(Bucket="literal", Key="in/reviews.parquet", Body=local.read_bytes())
    raw = job_dict("s3://literal/in", tiny_bert, tmp_path / "out.icechunk",
                   input={"id_column": "id", "storage_options": {"key": key, "secret": secret}},
                   output={"format": "icechunk"})
    job = Job.from_dict(raw)
    first = run_job(job, incremental=True)  # no store yet: the full run
    again = run_job(job, incremental=True)  # a complete store: the update path reads S3 too
    assert first.rows == 12 and again.already_complete
    import pipeline

    assert pipeline.open_store(tmp_path / "out.icechunk").provenance.job.input.storage_options \
        == {"key": "***", "secret": "***"}  # recorded redacted, used literally


def test_store_in_a_bucket_that_does_not_exist_is_refused_before_anything(
        s3_endpoint: str, tiny_bert: Path, tmp_path: Path) -> None:
    import boto3

    local = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(REVIEWS).slice(0, 8), local)
    bucket = f"no-such-{uuid.uuid4().hex[:8]}"
    job = write_job(tmp_path / "job.yaml", job_dict(local, tiny_bert, f"s3://{bucket}/o.zarr"))
    for command in ("validate", "extract"):
        result = run(command, str(job))
        assert result.exit_code == 5, result.output
        assert one_error_line(result) == (f"error: output.path: s3://{bucket}/o.zarr: bucket "
                                          f"{bucket!r} does not exist; create it first, or fix "
                                          "the path (nothing was written)")
    names = [b["Name"] for b in boto3.client("s3", endpoint_url=s3_endpoint, region_name=
                                             "us-east-1").list_buckets()["Buckets"]]
    assert bucket not in names


def test_errors_are_scrubbed_of_known_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret-abcdef")
    storefs.remember_secrets({"secret": "job-secret-123456", "token": "${SOME_VAR}"})
    text = "failed with env-secret-abcdef and job-secret-123456 at ${SOME_VAR}"
    assert storefs.scrub(text) == "failed with *** and *** at ${SOME_VAR}"


def test_input_errors_keep_their_class(s3: str) -> None:
    from pipeline.extract.source import list_files

    with pytest.raises(InputError, match="s3://bucket/nothing does not exist"):
        list_files("s3://bucket/nothing")
    with pytest.raises(InputError, match="no Parquet files match"):
        list_files("s3://bucket/*.parquet")


# ---- end to end: input on S3, store on S3 ------------------------------------------------

E2E_VIEWS = {"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"},
             "l1": {"layers": [1], "pooling": "max"},
             "centered": {"pooling": "mean", "post": {"method": "center"}}}


@pytest.fixture(scope="module")
def sample(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The first 96 sample reviews as three Parquet files, on S3 and in a local folder."""
    bucket = new_bucket(s3_endpoint)
    local = tmp_path_factory.mktemp("sample") / "in"
    local.mkdir()
    table = pq.read_table(REVIEWS).slice(0, 96)
    for i, (start, stop) in enumerate(((0, 40), (40, 72), (72, 96))):
        pq.write_table(table.slice(start, stop - start), local / f"part-{i}.parquet",
                       row_group_size=16)
        upload(local / f"part-{i}.parquet", f"{bucket}/in/part-{i}.parquet")
    return f"{bucket}/in", local


def e2e_job(source: str | Path, model: Path, output: str | Path, fmt: str,
            **execution: Any) -> dict[str, Any]:
    return job_dict(source, model, output, views=E2E_VIEWS,
                    input={"carry_columns": ["label"]}, output={"format": fmt},
                    execution={"partition_rows": 16, **execution})


@pytest.fixture(scope="module")
def e2e(sample: tuple[str, Path], tiny_bert: Path,
        tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The same job six ways: {zarr, parquet, icechunk} x {local input and store, S3 input
    and store}, through the command line."""
    url, local = sample
    tmp = tmp_path_factory.mktemp("e2e")
    stores = {}
    for fmt in ("zarr", "parquet", "icechunk"):
        for where in ("local", "s3"):
            out = str(tmp / f"r.{fmt}") if where == "local" else \
                f"{url.rsplit('/', 1)[0]}/out/reviews.{fmt}"
            job = e2e_job(local if where == "local" else url, tiny_bert, out, fmt)
            result = run("extract", write_job(tmp / f"{fmt}-{where}.yaml", job))
            assert result.exit_code == 0, result.output
            stores[f"{fmt}-{where}"] = out
    return stores


def assert_same_arrays(got: Any, want: Any) -> None:
    """Every variable and coordinate of two datasets, value for value (bit for bit)."""
    assert set(got.variables) == set(want.variables)
    for name in want.variables:
        a, b = np.asarray(got[name].values), np.asarray(want[name].values)
        if a.dtype.kind in "fc":
            np.testing.assert_array_equal(a, b, err_msg=str(name))
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
        else:
            assert a.tolist() == b.tolist(), name


@pytest.mark.slow  # end to end (real processes, servers or a browser): not in make test-fast
@pytest.mark.parametrize("fmt", ["zarr", "parquet", "icechunk"])
def test_store_on_s3_is_identical_to_the_local_store(e2e: dict[str, str], fmt: str) -> None:
    import pipeline

    remote = pipeline.open_store(e2e[f"{fmt}-s3"])
    local = pipeline.open_store(e2e[f"{fmt}-local"])
    assert remote.path == e2e[f"{fmt}-s3"] and remote.views == local.views
    assert_same_arrays(remote.docs, local.docs)
    assert remote.chunks is not None and local.chunks is not None
    assert_same_arrays(remote.chunks, local.chunks)
    # the same bytes: every data file's checksum is the same on S3 and on disk
    assert remote.provenance.checksums == local.provenance.checksums
    timing = "partition_seconds"
    assert {k: v for k, v in remote.provenance.stats.items() if k != timing} == \
        {k: v for k, v in local.provenance.stats.items() if k != timing}
    assert remote.provenance.complete and len(remote.provenance.checksums) >= 3
    # staging and lock are gone; only the format's own entries remain
    top = {rel.split("/")[0] for rel in keys(e2e[f"{fmt}-s3"])}
    assert top == {"zarr": {"zarr.json", "docs", "chunks", "post"}, "icechunk": {"repo"},
                   "parquet": {"docs", "chunks", "post"}}[fmt]


@pytest.mark.slow  # end to end (real processes, servers or a browser): not in make test-fast
@pytest.mark.parametrize("fmt", ["zarr", "parquet", "icechunk"])
def test_commands_on_a_store_on_s3(e2e: dict[str, str], fmt: str, tmp_path: Path) -> None:
    store = e2e[f"{fmt}-s3"]
    verified = run("verify", store)
    assert verified.exit_code == 0 and verified.stdout.startswith(f"{store}: OK ({fmt}; 96 rows")
    inspected = run("inspect", store, "--json")
    assert inspected.exit_code == 0, inspected.output
    assert json.loads(inspected.stdout)["rows"] == 96
    found = run("search", store, "the drug worked", "--view", "mean", "-k", "3")
    assert found.exit_code == 0 and len(found.stdout.strip().splitlines()) == 3, found.output
    probed = run("probe", store, "--label", "label", "--views", "mean,cls", "--folds", "2",
                 "--out", tmp_path / "probe")
    assert probed.exit_code == 0 and (tmp_path / "probe" / "probe.json").exists(), probed.output
    added = run("postprocess", store, "--view", "cls", "--method", "whiten", "--dims", "8")
    assert added.exit_code == 0, added.output
    import pipeline

    whitened = pipeline.open_store(store).vectors("cls_whiten")
    assert whitened.shape == (96, 8) and np.isfinite(whitened).all()
    assert run("verify", store).exit_code == 0  # the new view is sealed too
    # a damaged object is named, as on disk (Icechunk's chunk objects have random names:
    # each one is damaged)
    victims = {"zarr": ["docs/mean/c/0/0"], "parquet": ["docs/part-0.parquet"],
               "icechunk": [f"repo/chunks/{rel}" for rel in
                            storefs.resolve(f"{store}/repo/chunks").files()]}[fmt]
    kept = {victim: storefs.resolve(f"{store}/{victim}").read_bytes() for victim in victims}
    for victim, data in kept.items():
        middle = len(data) // 3
        storefs.resolve(f"{store}/{victim}").write_bytes(
            data[:middle] + b"garbage" + data[middle + 7:])
    broken = run("verify", store)
    assert broken.exit_code == 5 and "damaged" in one_error_line(broken)
    named = {"zarr": "docs/mean", "parquet": "docs/part-0.parquet", "icechunk": "chunks/mean"}
    assert named[fmt] in broken.stderr
    for victim, data in kept.items():
        storefs.resolve(f"{store}/{victim}").write_bytes(data)


@pytest.mark.slow  # end to end (real processes, servers or a browser): not in make test-fast
def test_readers_of_the_zarr_store_on_s3(e2e: dict[str, str], s3_endpoint: str) -> None:
    """What docs/cluster.md shows: xarray straight from S3, credentials from the environment
    or given as storage options."""
    import xarray as xr

    import pipeline

    store = e2e["zarr-s3"]
    reference = pipeline.open_store(store).docs
    docs = xr.open_zarr(store, group="docs")
    np.testing.assert_array_equal(docs["mean"].values, reference["mean"].values)
    assert docs["id"].values.tolist() == reference["id"].values.tolist()
    options = {"endpoint_url": s3_endpoint, "key": os.environ["AWS_ACCESS_KEY_ID"],
               "secret": os.environ["AWS_SECRET_ACCESS_KEY"]}
    chunks = xr.open_zarr(store, group="chunks", storage_options=options)
    assert chunks.sizes["chunk"] == pipeline.open_store(store).chunks.sizes["chunk"]
    again = pipeline.open_store(store, storage_options={"endpoint_url": s3_endpoint})
    np.testing.assert_array_equal(again.vectors("cls"), pipeline.open_store(store).vectors("cls"))


@pytest.mark.slow  # end to end (real processes, servers or a browser): not in make test-fast
def test_the_readers_snippet_of_the_docs_runs(e2e: dict[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/cluster.md's snippet as written, its bucket swapped for the test's."""
    import re

    text = (Path(__file__).resolve().parent.parent / "docs" / "cluster.md").read_text()
    block = re.search(r"<!-- snippet: readers.*?-->\n```python\n(.*?)```", text, re.S)
    assert block is not None
    bucket = e2e["zarr-s3"].split("/out/")[0]
    assert e2e["parquet-s3"] == f"{bucket}/out/reviews.parquet"
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")  # polars: the loopback endpoint is http
    code = block.group(1).replace("s3://my-bucket", bucket)
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/cluster.md", "exec"), namespace)
    assert namespace["store"].vectors("mean").shape == (96, 32)
    assert namespace["docs"].sizes["id"] == 96


@pytest.mark.slow  # end to end (real processes, servers or a browser): not in make test-fast
def test_duckdb_and_polars_read_the_parquet_store_on_s3(e2e: dict[str, str],
                                                         s3_endpoint: str) -> None:
    import duckdb
    import polars as pl
    import s3fs

    import pipeline

    store = e2e["parquet-s3"]
    reference = pipeline.open_store(store)
    con = duckdb.connect()
    con.register_filesystem(s3fs.S3FileSystem())  # credentials and endpoint: environment
    rows = con.sql(f"select id, label, mean from read_parquet('{store}/docs/*.parquet')"
                   ).fetchall()
    assert [r[0] for r in rows] == reference.docs["id"].values.tolist()
    np.testing.assert_array_equal(np.array([r[2] for r in rows], dtype=np.float32),
                                  reference.vectors("mean"))
    frame = pl.scan_parquet(f"{store}/chunks/*.parquet", storage_options={
        "aws_endpoint_url": s3_endpoint, "aws_region": "us-east-1", "aws_allow_http": "true",
        "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"]}).collect()
    assert frame.height == reference.chunks.sizes["chunk"]
    np.testing.assert_array_equal(np.stack(frame["cls"].to_numpy()),
                                  reference.vectors("cls", "chunks"))


# ---- secrets: written nowhere -------------------------------------------------------------

ENV_SECRET = "ENVSECRET-7f3a9c1e5b2d4068"
JOB_SECRET = "JOBSECRET-2c8e6a4f0b1d3957"
JOB_KEY = "AKIAJOBKEY7F3A9C1E5B"
SECRETS = (ENV_SECRET, JOB_SECRET, JOB_KEY)


def secrets_in(blob: bytes) -> list[str]:
    return [s for s in SECRETS if s.encode() in blob]


def every_object(prefix: str) -> dict[str, bytes]:
    root = storefs.resolve(prefix)
    return {rel: root.child(rel).read_bytes() for rel in root.files()}


def every_file(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def secret_job(source: str, model: Path, output: str, fmt: str = "zarr",
               **execution: Any) -> dict[str, Any]:
    """A job whose store credential is written in it, and whose input credential is a
    reference to the environment (which holds a secret too)."""
    job = e2e_job(source, model, output, fmt, **execution)
    job["input"]["storage_options"] = {"key": "${AWS_ACCESS_KEY_ID}",
                                       "secret": "${AWS_SECRET_ACCESS_KEY}"}
    job["output"]["storage_options"] = {"key": JOB_KEY, "secret": JOB_SECRET}
    return job


def bertpipe(*args: str | Path, cwd: Path, env: dict[str, str] | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess[str]:
    from tests.test_cluster import BERTPIPE

    return subprocess.run([*BERTPIPE, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.mark.slow  # end to end (real processes, servers or a browser): not in make test-fast
# Dask's scratch space is searched once (a LocalCluster's worker processes cost ~10 s)
@pytest.mark.parametrize(("fmt", "scheduler"), [("zarr", "local"), ("parquet", "synchronous")])
def test_secrets_are_never_written(sample: tuple[str, Path], tiny_bert: Path, tmp_path: Path,
                                   fmt: str, scheduler: str) -> None:
    """A recognisable secret in the environment and in the job's storage options: not in
    the store (provenance included), the output, the logs, the JSON summary, or any file
    the run made (its working directory and TMPDIR, Dask's scratch space included)."""
    url, _ = sample
    out = f"{url.rsplit('/', 1)[0]}/secret/r.{fmt}"
    job = write_job(tmp_path / "job.yaml", secret_job(url, tiny_bert, out, fmt,
                                                      scheduler=scheduler))
    work, scratch = tmp_path / "work", tmp_path / "scratch"
    work.mkdir()
    scratch.mkdir()
    env = {"AWS_SECRET_ACCESS_KEY": ENV_SECRET, "TMPDIR": str(scratch)}
    done = bertpipe("-v", "extract", job, "--json-summary", work / "summary.json", cwd=work,
                    env=env)
    assert done.returncode == 0, done.stderr
    assert "INFO" in done.stderr  # the logs were on
    shown = bertpipe("inspect", out, "--json", cwd=work, env=env)
    assert shown.returncode == 0, shown.stderr
    for run in (done, shown):  # connections closed at exit: no error line in a clean run
        assert "Unclosed" not in run.stderr and "ERROR" not in run.stderr, run.stderr
    written = {**every_object(out), **every_file(work), **every_file(scratch)}
    assert any(name.endswith(("zarr.json", ".parquet")) for name in written)
    leaks = {name: secrets_in(blob) for name, blob in written.items() if secrets_in(blob)}
    assert leaks == {}
    for text in (done.stdout, done.stderr, shown.stdout, shown.stderr):
        assert secrets_in(text.encode()) == []
    import pipeline

    recorded = pipeline.open_store(out).provenance.job
    assert recorded.output.storage_options == {"key": "***", "secret": "***"}
    assert recorded.input.storage_options == {"key": "${AWS_ACCESS_KEY_ID}",
                                              "secret": "${AWS_SECRET_ACCESS_KEY}"}


# ---- a killed client, a concurrent run ----------------------------------------------------


@pytest.mark.slow  # end to end (real processes, servers or a browser): not in make test-fast
def test_killed_client_resumes_to_an_identical_store(
        sample: tuple[str, Path], tiny_bert: Path, tmp_path: Path) -> None:
    """SIGKILL mid-run: nothing reads as complete; a second run meanwhile is refused; the
    rerun (a scheduler's plain retry: no `bertpipe unlock`) takes over the dead client's
    lock, skips the finished parts and gives the store a clean run gives. The client is
    paused (SIGSTOP) once two partitions are staged, so it is mid-run when the second run
    tries and when it is killed, however fast or loaded the machine."""
    url, local = sample
    out = f"{url.rsplit('/', 1)[0]}/killed/r.zarr"
    job = secret_job(url, tiny_bert, out, partition_rows=8)
    job_file = write_job(tmp_path / "job.yaml", job)
    reference = write_job(tmp_path / "ref.yaml", e2e_job(local, tiny_bert, tmp_path / "ref.zarr",
                                                          "zarr", partition_rows=8))
    assert run("extract", reference).exit_code == 0
    import pipeline

    total = pipeline.open_store(tmp_path / "ref.zarr").provenance.stats["partitions"]
    assert total == 12  # 96 rows in three files, 8 rows a partition
    env = {"AWS_SECRET_ACCESS_KEY": ENV_SECRET}
    from tests.test_cluster import BERTPIPE, _wait_for

    client = subprocess.Popen([*BERTPIPE, "extract", str(job_file)], cwd=tmp_path,
                              env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    markers = storefs.resolve(f"{out}/_bertpipe/parts")
    try:
        _wait_for(lambda: len(markers.glob("*.done.json")) >= 2, 120)
        client.send_signal(signal.SIGSTOP)  # held mid-run, its lock live
        # one writer at a time: a second run is refused, naming the holder
        second = run("extract", job_file, env=env)
        assert second.exit_code == 5, second.output
        assert f"{out} is being written by another run (host " in one_error_line(second)
        assert f"pid {client.pid}" in second.stderr
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()
    staged = len(markers.glob("*.done.json"))
    assert 2 <= staged < total, staged  # killed mid-run
    from pipeline.errors import StoreError as Refused

    with pytest.raises(Refused, match="incomplete"):
        pipeline.open_store(out)
    leaks = {n: secrets_in(b) for n, b in every_object(out).items() if secrets_in(b)}
    assert leaks == {}  # run.json, the lock and the parts hold no secret either
    assert storefs.resolve(f"{out}/_bertpipe.lock").exists()  # a killed run cannot release
    resumed = run("extract", job_file, env=env)
    assert resumed.exit_code == 0, resumed.output
    assert f"took over the lock of host {socket.gethostname()}, pid {client.pid}" in \
        resumed.stderr and "is no longer running on this host" in resumed.stderr
    assert f"skipped {staged}, run {total - staged}" in resumed.stdout
    got, want = pipeline.open_store(out), pipeline.open_store(tmp_path / "ref.zarr")
    assert_same_arrays(got.docs, want.docs)
    assert got.chunks is not None and want.chunks is not None
    assert_same_arrays(got.chunks, want.chunks)
    assert got.provenance.checksums == want.provenance.checksums
    assert not storefs.resolve(f"{out}/_bertpipe").exists()
    assert not storefs.resolve(f"{out}/_bertpipe.lock").exists()
    assert not storefs.resolve(out).glob("_bertpipe.lock.takeover-*")
    assert f"pid {client.pid}" in got.provenance.history[0].took_over_lock


# ---- a real Dask cluster whose workers share no folder with the client -------------------


@contextlib.contextmanager
def isolated_cluster(tmp: Path, n_workers: int = 2) -> Iterator[str]:
    """`dask scheduler` and `n_workers` `dask worker` processes, each worker started in its
    own working directory with its own TMPDIR (so a path only the client can see, or a
    relative one, fails): the scheduler's address."""
    from distributed import Client

    from tests.test_cluster import DASK_SCHEDULER, DASK_WORKER, _wait_for

    tmp.mkdir(parents=True, exist_ok=True)
    sched_file = tmp / "scheduler.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*DASK_SCHEDULER, "--host", "127.0.0.1", "--port", "0",
                               "--no-dashboard", "--scheduler-file", str(sched_file)],
                              cwd=tmp, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    try:
        _wait_for(sched_file.exists, 60)
        address = json.loads(sched_file.read_text())["address"]
        for i in range(n_workers):
            home = tmp / f"worker-{i}"
            (home / "tmp").mkdir(parents=True)
            procs.append(subprocess.Popen(
                [*DASK_WORKER, address, "--nthreads", "1", "--no-nanny", "--no-dashboard",
                 "--name", f"w{i}", "--local-directory", str(home / "tmp")],
                cwd=home, env={**env, "TMPDIR": str(home / "tmp")},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(n_workers, timeout=120)
            homes = set(client.run(os.getcwd).values())
            assert homes == {str(tmp / f"worker-{i}") for i in range(n_workers)}
        yield address
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()


def worked(address: str) -> dict[str, list[str]]:
    """Per worker: the runs whose model it loaded, i.e. for which it ran partitions (each
    run's plugin is named after the run)."""
    from distributed import Client

    def loaded(dask_worker: Any) -> list[str]:
        return sorted(name for name, p in dask_worker.plugins.items()
                      if getattr(p, "_extractor", None) is not None)

    with Client(address, timeout="60s") as client:
        return {str(k): list(v) for k, v in client.run(loaded).items()}


def holding_input(address: str) -> dict[str, list[str]]:
    """Per worker: the runs whose extractor still holds decoded input rows."""
    from distributed import Client

    def holding(dask_worker: Any) -> list[str]:
        caches = {name: getattr(getattr(p, "_extractor", None), "row_groups", None)
                  for name, p in dask_worker.plugins.items()}
        return sorted(name for name, c in caches.items() if c is not None and not c.empty)

    with Client(address, timeout="60s") as client:
        return {str(k): list(v) for k, v in client.run(holding).items()}


@contextlib.contextmanager
def runs_during(address: str) -> Iterator[dict[str, set[str]]]:
    """Per worker, the runs it ran partitions of during the block (filled in after it)."""
    before = worked(address)
    new: dict[str, set[str]] = {}
    yield new
    new.update({w: set(names) - set(before.get(w, ())) for w, names in worked(address).items()})


@pytest.fixture(scope="module")
def cluster_apart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """One isolated cluster for the runs of this module (started once): its address and
    its folder, which holds each worker's."""
    tmp = tmp_path_factory.mktemp("cluster")
    with isolated_cluster(tmp) as address:
        yield address, tmp


@pytest.mark.cluster
@pytest.mark.parametrize("fmt", ["zarr", "parquet"])
def test_cluster_workers_in_their_own_folders_read_and_write_s3(
        sample: tuple[str, Path], e2e: dict[str, str], tiny_bert: Path, tmp_path: Path,
        cluster_apart: tuple[str, Path], fmt: str) -> None:
    url, _ = sample
    address, cluster = cluster_apart
    out = f"{url.rsplit('/', 1)[0]}/cluster/r.{fmt}"
    client_dir = tmp_path / "client"
    client_dir.mkdir()
    # a relative job path and a client-only TMPDIR: what the workers must never need
    write_job(client_dir / "job.yaml", e2e_job(url, tiny_bert, out, fmt, partition_rows=8,
                                               threads_per_worker=1))
    with runs_during(address) as this_run:
        done = bertpipe("extract", "job.yaml", "--scheduler", address, cwd=client_dir,
                        env={"TMPDIR": str(client_dir)})
    assert done.returncode == 0, done.stderr
    # both ran partitions of this run, and let its input rows go when it ended
    assert len(this_run) == 2 and all(len(new) == 1 for new in this_run.values()), this_run
    assert holding_input(address) == {worker: [] for worker in this_run}
    import pipeline

    got, want = pipeline.open_store(out), pipeline.open_store(e2e[f"{fmt}-local"])
    assert got.provenance.stats["partitions"] == 12
    for level in ("docs", "chunks"):
        a, b = got.level(level), want.level(level)
        for name in E2E_VIEWS:
            # other partition sizes and threads than the reference: batch composition moves
            # values by ~1e-7 (docs/store.md)
            np.testing.assert_allclose(a[name].values, b[name].values, atol=1e-5)
    assert got.docs["id"].values.tolist() == want.docs["id"].values.tolist()
    assert run("verify", out).exit_code == 0
    # nothing was written beside the workers (their scratch folder aside) or the client
    for i in range(2):
        assert [p.name for p in (cluster / f"worker-{i}").iterdir()] == ["tmp"]
    assert [p.name for p in client_dir.iterdir()] == ["job.yaml"]


# ---- writing overlaps encoding ------------------------------------------------------------


@pytest.mark.slow  # end to end (real processes, servers or a browser): not in make test-fast
@pytest.mark.parametrize("scheduler", ["synchronous", "local"])
def test_a_partition_is_written_while_the_next_one_encodes(
        tiny_bert: Path, small_texts: Path, tmp_path: Path, scheduler: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow store (each write takes 0.4 s): the next partition's encoding starts before
    the previous partition's write ends, in process and on a Dask worker alike."""
    import time

    from pipeline.extract.partition import Extractor
    from pipeline.stores.staging import Staging

    spans: dict[str, list[tuple[int, float, float]]] = {"encode": [], "write": []}
    original_finish, original_write = Extractor.finish, Staging.write_part

    def timed_encode(self: Any, prepared: Any) -> Any:  # the model's part of a partition
        start = time.monotonic()
        try:
            return original_finish(self, prepared)
        finally:
            spans["encode"].append((prepared.part.index, start, time.monotonic()))

    def slow_write(self: Any, marker: Any, tables: Any) -> Any:
        start = time.monotonic()
        time.sleep(0.4)
        try:
            return original_write(self, marker, tables)
        finally:
            spans["write"].append((marker.index, start, time.monotonic()))

    monkeypatch.setattr(Extractor, "finish", timed_encode)
    monkeypatch.setattr(Staging, "write_part", slow_write)
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr",
                   execution={"scheduler": scheduler, "workers": 1, "partition_rows": 2})
    if scheduler == "synchronous":
        job["execution"].pop("workers")
    assert run("extract", write_job(tmp_path / "job.yaml", job)).exit_code == 0
    encodes = {i: (a, b) for i, a, b in spans["encode"]}
    writes = {i: (a, b) for i, a, b in spans["write"]}
    assert sorted(writes) == list(range(5))
    overlapped = [(i, j) for i, (w0, w1) in writes.items() for j, (e0, e1) in encodes.items()
                  if j != i and e0 < w1 and w0 < e1]
    assert overlapped, (encodes, writes)
    # one write at a time (memory stays bounded)
    ordered = sorted(writes.values())
    assert all(a[1] <= b[0] + 1e-3 for a, b in zip(ordered, ordered[1:], strict=False))


# ---- any fsspec filesystem: memory:// ------------------------------------------------------


@pytest.mark.parametrize("fmt", ["zarr", "parquet"])
def test_store_in_memory_filesystem_matches_the_local_store(
        tiny_bert: Path, small_texts: Path, tmp_path: Path, fmt: str) -> None:
    """The fsspec layer is not S3-specific: the in-memory filesystem (no rename either)."""
    import pipeline

    out = f"memory://bertpipe-{uuid.uuid4().hex[:8]}/o.{fmt}"
    views = {"mean": {"pooling": "mean"}, "c": {"pooling": "cls", "post": {"method": "center"}}}
    for target, name in ((out, "mem"), (tmp_path / f"o.{fmt}", "disk")):
        job = job_dict(small_texts, tiny_bert, target, views=views, output={"format": fmt},
                       input={"carry_columns": ["label"]})
        result = run("extract", write_job(tmp_path / f"{name}.yaml", job), "--dry-run")
        assert result.exit_code == 0 and "does not exist yet" in result.stdout
        result = run("extract", write_job(tmp_path / f"{name}.yaml", job))
        assert result.exit_code == 0, result.output
    assert run("verify", out).exit_code == 0
    got, want = pipeline.open_store(out), pipeline.open_store(tmp_path / f"o.{fmt}")
    assert_same_arrays(got.docs, want.docs)
    assert got.provenance.checksums == want.provenance.checksums
    again = run("extract", write_job(tmp_path / "mem.yaml", job_dict(
        small_texts, tiny_bert, out, views=views, output={"format": fmt},
        input={"carry_columns": ["label"]})))
    assert again.exit_code == 0 and "already complete" in again.stdout
    storefs.resolve(out).remove_tree()


@pytest.mark.cluster
def test_nightly_update_of_an_icechunk_store_on_s3_by_shared_nothing_workers(
        s3: str, tiny_bert: Path, tmp_path: Path, cluster_apart: tuple[str, Path]) -> None:
    """The incremental scenario (400 rows; then 150 new, 20 edited, 10 deleted) with the
    input and an Icechunk store on S3 and two workers that share no disk with the client
    or each other: the update encodes exactly 170 texts and the store equals a run from
    scratch over the new table, by id."""
    import pipeline
    from pipeline.run.runner import run_job
    from pipeline.spec import Job
    from tests.test_incremental import _base, _updated, assert_same_rows

    source, out = f"{s3}/in/reviews.parquet", f"{s3}/nightly/reviews.icechunk"
    client_dir = tmp_path / "client"
    client_dir.mkdir()
    job = job_dict(source, tiny_bert, out, views={"mean": {"pooling": "mean"},
                                                  "cls": {"pooling": "cls"}},
                   input={"carry_columns": ["label"]},
                   chunking={"strategy": "hierarchical", "max_tokens": 48},
                   output={"format": "icechunk", "incremental": True},
                   execution={"partition_rows": 64, "threads_per_worker": 1})
    write_job(client_dir / "job.yaml", job)
    address, _ = cluster_apart
    for table, expected in ((_base(), 400), (_updated(), 170)):
        with storefs.resolve(source).writer() as f:
            pq.write_table(table, f)
        with runs_during(address) as this_run:
            done = bertpipe("extract", "job.yaml", "--scheduler", address, "--json-summary",
                            "summary.json", cwd=client_dir, env={"TMPDIR": str(client_dir)})
        assert done.returncode == 0, done.stderr
        summary = json.loads((client_dir / "summary.json").read_text())
        assert summary["rows_by_outcome"]["encoded"] == expected, summary
        # both workers ran partitions of this run
        assert len(this_run) == 2 and all(len(new) == 1 for new in this_run.values()), this_run
    local = tmp_path / "updated.parquet"
    pq.write_table(_updated(), local)
    scratch = {**job, "input": {**job["input"], "path": str(local)},
               "output": {"path": str(tmp_path / "scratch.icechunk"), "format": "icechunk"},
               "execution": {"scheduler": "synchronous", "partition_rows": 64}}
    run_job(Job.from_dict(scratch))
    store = pipeline.open_store(out)
    assert store.provenance.version == 1 and [v for v in store.fmt.version_numbers()] == [1, 0]
    assert_same_rows(store, pipeline.open_store(tmp_path / "scratch.icechunk"), ["mean", "cls"])
    assert run("verify", out).exit_code == 0
    assert {rel.split("/")[0] for rel in keys(out)} == {"repo"}  # staging and lock gone
