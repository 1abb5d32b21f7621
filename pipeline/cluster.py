"""Running partitions as Dask tasks: a local cluster, or an existing scheduler.

Each worker loads the model once (a `WorkerPlugin`), sets torch's thread count to its own
threads, and writes its partitions straight into the store's staging area; the client
only submits, watches and commits. A partition is one task with `retries`; a worker
killed mid-task has its task rerun elsewhere, which writes the same bits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from distributed import WorkerPlugin

from .errors import BertpipeError, JobError
from .runner import Executor, OnDone, run_partition
from .source import Partition
from .spec import Job
from .stores import Staging

log = logging.getLogger(__name__)


class ExtractorPlugin(WorkerPlugin):
    """Loads the job's model on each worker once; tasks find it by name."""

    def __init__(self, job: Job, name: str, torch_threads: int | None):
        self.job = job
        self.name = name
        self.torch_threads = torch_threads
        self.extractor: Any = None
        self.lock: threading.Lock | None = None
        self.threads = 1

    def setup(self, worker: Any) -> None:
        from .partition import Extractor

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.threads = self.torch_threads or worker.state.nthreads
        # one partition at a time per worker: each uses all of the worker's torch threads
        self.lock = threading.Lock()
        self.extractor = Extractor(self.job)

    def teardown(self, worker: Any) -> None:
        self.extractor = None


def _partition_task(part: Partition, store_path: str, fingerprint: str, plugin: str
                    ) -> dict[str, Any]:
    import torch
    from distributed import get_worker

    state = cast(ExtractorPlugin, get_worker().plugins[plugin])
    assert state.lock is not None  # set in setup
    with state.lock:
        # Nanny workers start with OMP_NUM_THREADS=1, and OpenMP's thread count is per
        # calling thread: set it here, in the thread that runs the forward passes.
        torch.set_num_threads(state.threads)
        return run_partition(state.extractor, Staging(store_path), part, fingerprint)


class DaskExecutor(Executor):
    def __init__(self, scheduler: str, workers: int | None = None,
                 threads_per_worker: int | None = None, say: Callable[[str], None] = log.info):
        self.scheduler = scheduler
        self.say = say
        self.workers = workers
        self.threads_per_worker = threads_per_worker
        self.dashboard: str | None = None

    def run(self, job: Job, parts: Sequence[Partition], staging: Staging, fingerprint: str,
            on_done: OnDone) -> list[tuple[Partition, str]]:
        from distributed import as_completed

        if not parts:
            return []
        with self._client(job) as client:
            self.dashboard = getattr(client, "dashboard_link", None)
            self.say(f"dask scheduler {client.scheduler.address}"
                     + (f", dashboard {self.dashboard}" if self.dashboard else ""))
            name = f"bertpipe-{fingerprint[:16]}"
            client.register_plugin(ExtractorPlugin(job, name, job.execution.threads_per_worker),
                                   name=name)
            resources = {"GPU": 1} if _wants_gpu(client, job) else None
            futures = {
                client.submit(_partition_task, part, job.output.path, fingerprint, name,
                              key=f"{name}-part-{part.index}", retries=job.execution.retries,
                              resources=resources, pure=False): part
                for part in parts
            }
            failures = []
            for future in as_completed(futures):
                part = futures[future]
                try:
                    marker = future.result()
                except BertpipeError as exc:
                    failures.append((part, str(exc)))
                    continue
                except Exception as exc:  # noqa: BLE001 - reported per partition, not raised
                    failures.append((part, f"{type(exc).__name__}: {exc}"))
                    continue
                on_done(part, marker)
            return failures

    @contextlib.contextmanager
    def _client(self, job: Job) -> Iterator[Any]:
        from distributed import Client

        if not log.isEnabledFor(logging.INFO):  # Dask's own INFO lines drown the progress
            logging.getLogger("distributed").setLevel(logging.ERROR)
        if self.scheduler != "local":
            with Client(self.scheduler, timeout="20s") as client:
                yield client
            return
        with _local_cluster(job, self.workers, self.threads_per_worker) as cluster, \
                Client(cluster) as client:
            yield client


@contextlib.contextmanager
def _local_cluster(job: Job, workers: int | None, threads: int | None) -> Iterator[Any]:
    """One worker per GPU (pinned with CUDA_VISIBLE_DEVICES) when CUDA is present and the
    job may use it; else `workers` processes sharing the cores."""
    import dask
    from distributed import LocalCluster, Nanny, Scheduler, SpecCluster

    cores = os.cpu_count() or 1
    gpus = _cuda_device_count() if job.model.device != "cpu" else 0
    config = {"distributed.scheduler.allowed-failures": job.execution.retries + 1,
              "distributed.worker.daemon": False}
    with dask.config.set(config):
        if gpus:
            n = workers or gpus
            per = threads or max(1, cores // n)
            specs = {i: {"cls": Nanny, "options": {
                "nthreads": per, "resources": {"GPU": 1},
                "env": {"CUDA_VISIBLE_DEVICES": str(i % gpus)}}} for i in range(n)}
            cluster: Any = SpecCluster(
                workers=specs, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
                silence_logs=logging.ERROR)
        else:
            n = workers or 1
            cluster = LocalCluster(n_workers=n, threads_per_worker=threads or max(1, cores // n),
                                   processes=True, dashboard_address=":0",
                                   silence_logs=logging.ERROR)
        with cluster:
            yield cluster


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _wants_gpu(client: Any, job: Job) -> bool:
    """Ask for a GPU slot only when the job may use one and some worker offers one."""
    if job.model.device == "cpu":
        return False
    workers = client.scheduler_info(n_workers=-1)["workers"].values()
    has_gpu = any(w.get("resources", {}).get("GPU") for w in workers)
    if job.model.device == "cuda" and not has_gpu:
        raise JobError("model.device: cuda, but no worker of the cluster offers a GPU "
                       "resource (start workers with --resources GPU=1)")
    return has_gpu


def executor_for(job: Job, say: Callable[[str], None] = log.info) -> Executor:
    from .runner import InProcessExecutor

    scheduler = job.execution.scheduler
    if scheduler == "synchronous":
        return InProcessExecutor()
    if scheduler != "local" and "://" not in scheduler:
        raise JobError(f"execution.scheduler: {scheduler!r} is not local, synchronous or a "
                       "scheduler address like tcp://host:8786")
    return DaskExecutor(scheduler, job.execution.workers, job.execution.threads_per_worker, say)
