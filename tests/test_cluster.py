"""The cluster path against a real `dask scheduler` and `dask worker` processes on loopback:
same output as a clean run after a worker is killed mid-job, after the client is killed
and the job is resumed, and with the scheduler taken from the environment."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import pipeline
from pipeline.cli import main
from tests.conftest import REVIEWS, job_dict, write_job

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
VIEWS = {"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"},
         "l2": {"layers": [2], "pooling": "max"}}


def command(script: str, subcommand: tuple[str, ...], module: str) -> list[str]:
    """A console script of this interpreter's environment, else the same entry point run by
    this interpreter (`python -m ...`). A script found elsewhere on PATH may belong to
    another environment, so it is not used."""
    beside = shutil.which(script, path=str(Path(sys.executable).parent))
    return [beside, *subcommand] if beside else [sys.executable, "-m", module]


DASK_SCHEDULER = command("dask", ("scheduler",), "distributed.cli.dask_scheduler")
DASK_WORKER = command("dask", ("worker",), "distributed.cli.dask_worker")
BERTPIPE = command("bertpipe", (), "pipeline.cli")


@contextlib.contextmanager
def dask_cluster(tmp: Path, n_workers: int = 2) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """A scheduler and `n_workers` single-threaded worker processes (no nanny, so a
    killed worker stays dead)."""
    sched_file = tmp / "scheduler.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*DASK_SCHEDULER, "--host", "127.0.0.1", "--port", "0",
                               "--no-dashboard", "--scheduler-file", str(sched_file)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_for(sched_file.exists, 30)
        address = json.loads(sched_file.read_text())["address"]
        for i in range(n_workers):
            procs.append(subprocess.Popen(
                [*DASK_WORKER, address, "--nthreads", "1", "--no-nanny",
                 "--no-dashboard", "--name", f"w{i}"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        from distributed import Client

        with Client(address, timeout="30s") as client:
            client.wait_for_workers(n_workers, timeout=60)
        yield address, procs
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()


def _wait_for(predicate, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("src") / "reviews.parquet"
    pq.write_table(pq.read_table(REVIEWS).slice(0, 48), path)
    return path


def make_job(tmp: Path, source: Path, model: Path, name: str, **execution: object) -> Path:
    job = job_dict(source, model, tmp / f"{name}.zarr", views=VIEWS,
                   execution={"scheduler": "synchronous", "partition_rows": 8, **execution})
    return write_job(tmp / f"{name}.yaml", job)


def extract(job: Path, *args: str, env: dict[str, str] | None = None) -> str:
    result = CliRunner(env=env).invoke(main, ["extract", str(job), *args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A cluster for the runs that kill no worker (started once): its address."""
    with dask_cluster(tmp_path_factory.mktemp("cluster")) as (address, _):
        yield address


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, source: Path, minilm: Path, cluster: str
          ) -> dict[str, pipeline.Store]:
    """Reference stores: an uninterrupted cluster run and an in-process run."""
    tmp = tmp_path_factory.mktemp("clean")
    extract(make_job(tmp, source, minilm, "cluster"), "--scheduler", cluster)
    extract(make_job(tmp, source, minilm, "inproc", threads_per_worker=1))
    return {"cluster": pipeline.open_store(tmp / "cluster.zarr"),
            "inproc": pipeline.open_store(tmp / "inproc.zarr")}


def assert_same(store: pipeline.Store, reference: pipeline.Store, exact: bool = True) -> None:
    for view in VIEWS:
        got, want = store.vectors(view), reference.vectors(view)
        if exact:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_array_equal(store.docs["id"].values, reference.docs["id"].values)


def test_cluster_run_matches_in_process(clean: dict[str, pipeline.Store]) -> None:
    assert clean["cluster"].provenance.stats["partitions"] == 6
    assert_same(clean["cluster"], clean["inproc"], exact=False)


def test_killed_worker_mid_job_gives_identical_store(tmp_path: Path, source: Path,
                                                     minilm: Path,
                                                     clean: dict[str, pipeline.Store]) -> None:
    job = make_job(tmp_path, source, minilm, "killed")
    parts = tmp_path / "killed.zarr" / "_bertpipe" / "parts"
    with dask_cluster(tmp_path) as (address, procs):
        runner = subprocess.Popen([*BERTPIPE, "extract", str(job), "--scheduler", address],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        from distributed import Client

        with Client(address, timeout="30s") as observer:
            victim = next(a for a, w in observer.scheduler_info()["workers"].items()
                          if w["name"] == "w0")  # procs[1]
            held: list[str] = []

            def victim_is_busy() -> bool:
                held[:] = observer.processing([victim]).get(victim, ())
                return len(list(parts.glob("*.done.json"))) >= 2 and bool(held)

            _wait_for(victim_is_busy, 120)
            procs[1].send_signal(signal.SIGKILL)  # the worker dies holding a partition
        assert held and all("-part-" in str(key) for key in held), held
        out, _ = runner.communicate(timeout=180)
        assert runner.returncode == 0, out
    assert_same(pipeline.open_store(tmp_path / "killed.zarr"), clean["cluster"])


def test_killed_client_resumes_to_identical_store(tmp_path: Path, source: Path, minilm: Path,
                                                  clean: dict[str, pipeline.Store],
                                                  cluster: str) -> None:
    """The client dies; the cluster it ran on lives on, and the retry runs there."""
    job = make_job(tmp_path, source, minilm, "resumed")
    parts = tmp_path / "resumed.zarr" / "_bertpipe" / "parts"
    runner = subprocess.Popen([*BERTPIPE, "extract", str(job), "--scheduler", cluster],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(lambda: len(list(parts.glob("*.done.json"))) >= 3, 120)
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    with pytest.raises(pipeline.errors.StoreError, match="incomplete"):
        pipeline.open_store(tmp_path / "resumed.zarr")
    env = {"DASK_SCHEDULER_ADDRESS": cluster}
    # another partitioning cannot reuse the parts: refused before it takes the lock
    other = CliRunner(env=env).invoke(main, ["extract", str(job), "--set",
                                             "execution.partition_rows=16"])
    assert other.exit_code == 5 and "execution.partition_rows=8" in other.stderr
    # a killed run cannot release its lock: the scheduler's plain retry takes it over
    # (the address from the environment, as a scheduled job has it) and resumes
    out = extract(job, env=env)
    assert f"took over the lock of host {socket.gethostname()}, pid {runner.pid}" in out
    assert "resuming:" in out and "skipped 0," not in out
    assert_same(pipeline.open_store(tmp_path / "resumed.zarr"), clean["cluster"])


@pytest.mark.parametrize("workers", [None, 2])  # one in-process worker thread; processes
def test_local_cluster(tmp_path: Path, source: Path, minilm: Path,
                       clean: dict[str, pipeline.Store], workers: int | None) -> None:
    job = make_job(tmp_path, source, minilm, "local", scheduler="local", workers=workers,
                   threads_per_worker=1)
    out = extract(job)
    # the dashboard's URL only where one is served (the scheduler's port answers without
    # bokeh too, with a page asking to install it)
    served = importlib.util.find_spec("bokeh") is not None
    assert "dask scheduler " in out and ("dashboard http" in out) == served
    assert_same(pipeline.open_store(tmp_path / "local.zarr"), clean["cluster"])
