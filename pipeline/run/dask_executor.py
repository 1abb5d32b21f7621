"""Running partitions as Dask tasks: a local cluster, or an existing scheduler.

Each worker loads the model once (a `WorkerPlugin`), runs it on the threads it was given
(extract/threads.py: its own threads, capped by its cgroup quota, affinity and
OMP_NUM_THREADS), and writes its partitions straight into the store's staging area; the client
only submits, watches and commits. A partition is one task with `retries`; a worker
killed mid-task has its task rerun elsewhere, which writes the same bits.

A task returns its partition's outcome (partition_pipeline's `Written` or `Failed`, or
`ModelUnusable`): a bertpipe error comes back as a value, not raised, since such errors
are deterministic (retrying cannot help), and the client reports it as the in-process
executor does (partition_pipeline.report), the model's errors as themselves and a
partition's as that partition's failure, with no worker traceback; any other error is
raised in the task, which Dask retries. A remote scheduler is reached when the executor
is entered, before the store is touched; one that cannot be reached is a `SchedulerError`
(exit 7).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

from distributed import WorkerPlugin

from ..errors import BertpipeError, JobError, SchedulerError, first_line
from ..extract.source import Partition
from ..extract.threads import WAIT_KEYS, WAIT_POLICY, allot
from ..io.location import register_options
from ..spec import Job
from ..stores import Staging
from ..stores.lock import Fence, LockLostError
from .partition_pipeline import (
    Failed,
    Failures,
    OnBatch,
    OnDone,
    PartitionOutcome,
    PartitionPipeline,
    failure_reason,
    prepare_depth,
    report,
)

log = logging.getLogger(__name__)
PROGRESS_TOPIC = "bertpipe-progress"
# What one partition's task asks of a worker's GPU. Dask holds a task's resources until
# the task ends, seceded or not: a whole GPU per task would keep the next partition from
# starting until this one is written, so neither the write nor the preparing could overlap
# the encoder. A quarter lets a worker offering GPU=1 run the tasks its plugin pipelines
# (one writing, one encoding, one prepared ahead, one waiting for room); the plugin's one
# encoder thread still runs one forward pass at a time. (A power of two: the worker's
# running sum of its free resources stays exact.)
GPU_SHARE = 0.25


class ExtractorPlugin(WorkerPlugin):
    """Holds the job's model on each worker, loaded once, and the partition pipeline that
    runs it (partition_pipeline.py); tasks find it by name.

    The model is loaded and run in one thread of the plugin's own, for the worker's life:
    not in `setup` (the worker's event-loop thread), and not in whichever pool thread runs
    a task, because OpenMP keeps one thread team per calling thread and an idle team
    spinning in another thread costs ~15% on a 2-core machine. That thread is the
    pipeline's encoder lane. A task submits its partition, which waits in the worker's
    thread until the pipeline has room (so no further task starts), then secedes from the
    worker's pool: the worker starts the next partition's task while this one is prepared,
    encoded and written, and the task returns its outcome.
    """

    def __init__(self, job: Job, name: str, torch_threads: int | None):
        self.job = job
        self.name = name
        self.torch_threads = torch_threads
        self.threads = 1
        # made in setup and by the first task: the plugin is pickled
        self.encoder: ThreadPoolExecutor | None = None
        self.pipeline: PartitionPipeline | None = None
        self._extractor: Any = None

    def setup(self, worker: Any) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # the store's options, as the client has them (`${NAME}` read from this worker's env)
        register_options(self.job.output.path, self.job.output.storage_options)
        allotment = allot(self.torch_threads or worker.state.nthreads)
        self.threads = allotment.threads
        log.debug("worker %s: %d encoder threads (%s)", worker.name, self.threads,
                  allotment.describe())
        self.encoder = ThreadPoolExecutor(1, thread_name_prefix="bertpipe-encode")

    def teardown(self, worker: Any) -> None:
        self._extractor = None
        if self.pipeline is not None:
            self.pipeline.close(wait=False)
        elif self.encoder is not None:
            self.encoder.shutdown(wait=False)

    def run(self, part: Partition, store_path: str, fingerprint: str, fence: Fence | None
            ) -> PartitionOutcome | ModelUnusable:
        """The partition's outcome, or ModelUnusable when the model cannot serve the job;
        a failure other than a bertpipe error is raised, so that Dask retries the task."""
        from distributed import get_worker, secede

        assert self.encoder is not None  # set in setup
        worker = get_worker()  # captured here: the encoder thread is not a task thread

        def publish_batches(part: Partition, done: int, total: int) -> None:
            """A batch's progress as a worker event (thread-safe); the client subscribes."""
            worker.log_event(PROGRESS_TOPIC, {"index": part.index, "done": done, "total": total})

        try:
            pipeline = self.pipeline or self.encoder.submit(self._load).result()
        except _ModelUnusable as exc:
            return ModelUnusable(exc.error)
        outcome = pipeline.submit(part, Staging(store_path, fence=fence), fingerprint,
                                  publish_batches)
        secede()  # the worker starts the next partition's task while this one runs
        done = outcome.result()
        if isinstance(done, Failed) and not isinstance(done.error, BertpipeError):
            raise done.error  # not the job's doing (a lost connection): worth a retry
        return done

    def _load(self) -> PartitionPipeline:
        """In the encoder thread: the model, once; and the pipeline around it, which
        prepares ahead as far as the model's device calls for."""
        import torch

        # Nanny workers start with OMP_NUM_THREADS=1 and OpenMP's thread count is per
        # calling thread: set it in the thread that runs the forward passes.
        torch.set_num_threads(self.threads)
        if self.pipeline is not None:  # a second task asked while the first one loaded
            return self.pipeline
        from ..extract.partition import Extractor  # on the worker: the client never encodes

        try:
            extractor = Extractor(self.job, threads=self.threads)
        except BertpipeError as exc:
            raise _ModelUnusable(exc) from None
        self._extractor = extractor
        self.pipeline = PartitionPipeline(extractor, prepare_depth(extractor), self.encoder)
        return self.pipeline


@dataclass(frozen=True)
class ModelUnusable:
    """A task's outcome when the worker cannot load the model for the job: every partition
    would fail alike, so the run raises `error` as the in-process executor does."""

    error: BertpipeError


class _ModelUnusable(Exception):
    """Raised in the encoder thread, caught by the task that asked for the model."""

    def __init__(self, error: BertpipeError):
        super().__init__(str(error))
        self.error = error


def _partition_task(part: Partition, store_path: str, fingerprint: str, plugin: str,
                    fence: Fence | None) -> PartitionOutcome | ModelUnusable:
    from distributed import get_worker

    state = cast(ExtractorPlugin, get_worker().plugins[plugin])
    return state.run(part, store_path, fingerprint, fence)


DROP_WAIT_S = 10.0  # the longest a run waits for its workers to drop its decoded input


def _let_workers_drop_input(client: Any, plugin: str) -> None:
    """Ask every worker to let the run's decoded input go, waiting at most DROP_WAIT_S: a
    worker slow to answer must not hold up the run's commit (its rows then go with the
    plugin's next run of the job, or with the worker). A lost worker or scheduler holds
    nothing, so failures are ignored."""

    def ask() -> None:
        with contextlib.suppress(Exception):
            client.run(_drop_input, plugin, on_error="ignore")

    asking = threading.Thread(target=ask, name="bertpipe-drop-input", daemon=True)
    asking.start()
    asking.join(DROP_WAIT_S)


def _drop_input(plugin: str, dask_worker: Any) -> None:
    """On a worker, after a run: the input rows its extractor decoded last are let go (the
    plugin, and the model it holds, stay for the next run of the same job)."""
    state = dask_worker.plugins.get(plugin)
    extractor = getattr(state, "_extractor", None)
    if extractor is not None:
        extractor.row_groups.clear()


class DaskExecutor:
    def __init__(self, scheduler: str, workers: int | None = None,
                 threads_per_worker: int | None = None, say: Callable[[str], None] = log.info):
        self.scheduler = scheduler
        self.workers = workers
        self.threads_per_worker = threads_per_worker  # torch threads; None: the worker's own
        self.on_batch: OnBatch | None = None  # per-batch progress, from worker events
        self.say = say
        self.dashboard: str | None = None
        self._remote: Any = None  # the client of a remote scheduler, while entered

    def __enter__(self) -> DaskExecutor:
        if self.scheduler != "local":
            self._remote = connect(self.scheduler)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        remote, self._remote = self._remote, None
        if remote is not None:
            with contextlib.suppress(Exception):  # closing a lost connection fails too
                remote.close()

    def run(self, job: Job, parts: Sequence[Partition], staging: Staging, fingerprint: str,
            on_done: OnDone) -> Failures:
        if not parts:
            return []
        with self._client(job) as (client, torch_threads):
            try:
                return self._run(client, torch_threads, job, parts, fingerprint, on_done,
                                 staging.fence)
            except OSError as exc:  # CommClosedError included: the scheduler went away
                raise SchedulerError(
                    f"execution.scheduler: lost the connection to the Dask scheduler at "
                    f"{self.scheduler} ({first_line(exc)}); finished partitions are kept, "
                    "rerun to resume") from None

    def _run(self, client: Any, torch_threads: int | None, job: Job,
             parts: Sequence[Partition], fingerprint: str, on_done: OnDone,
             fence: Fence | None) -> Failures:
        self.dashboard = dashboard_of(client)
        self.say(f"dask scheduler {client.scheduler.address}"
                 + (f", dashboard {self.dashboard}" if self.dashboard else ""))
        name = f"bertpipe-{fingerprint[:16]}"
        client.register_plugin(ExtractorPlugin(job, name, torch_threads), name=name)
        if self.on_batch is not None:
            by_index = {p.index: p for p in parts}
            on_batch = self.on_batch

            def show(event: tuple[float, dict[str, int]]) -> None:
                msg = event[1]
                if msg.get("index") in by_index:
                    on_batch(by_index[msg["index"]], int(msg["done"]), int(msg["total"]))

            client.subscribe_topic(PROGRESS_TOPIC, show)
        resources = {"GPU": GPU_SHARE} if _wants_gpu(client, job) else None
        futures = {
            client.submit(_partition_task, part, job.output.path, fingerprint, name, fence,
                          key=f"{name}-part-{part.index}", retries=job.execution.retries,
                          resources=resources, pure=False): part
            for part in parts
        }
        try:
            return self._gather(client, futures, on_done)
        finally:
            _let_workers_drop_input(client, name)

    def _gather(self, client: Any, futures: dict[Any, Partition], on_done: OnDone
                ) -> Failures:
        """Each partition's outcome as it finishes: its marker reported, or its failure."""
        from distributed import as_completed

        failures: Failures = []
        for future in as_completed(futures):
            part = futures[future]
            try:
                outcome = future.result()
            except Exception as exc:  # noqa: BLE001 - reported per partition, not raised
                failures.append((part, failure_reason(exc)))
                continue
            if isinstance(outcome, ModelUnusable):  # would fail every partition: raised,
                client.cancel(list(futures))  # as in-process, where loading it raises
                raise outcome.error
            try:
                report(outcome, on_done, failures)
            except LockLostError:  # another run holds the store now: stop
                client.cancel(list(futures))
                raise
        return failures

    @contextlib.contextmanager
    def _client(self, job: Job) -> Iterator[tuple[Any, int | None]]:
        """A client, and the torch threads each worker should use."""
        from distributed import Client

        if not log.isEnabledFor(logging.INFO):  # Dask's own INFO lines drown the progress
            logging.getLogger("distributed").setLevel(logging.ERROR)
        quiet_shutdown_timeouts()
        if self.scheduler != "local":
            if self._remote is not None:
                yield self._remote, self.threads_per_worker
                return
            with connect(self.scheduler) as client:
                yield client, self.threads_per_worker
            return
        n, threads = _local_shape(job, self.workers, self.threads_per_worker)
        with _local_cluster(job, n, threads) as cluster, Client(cluster) as client:
            yield client, threads


class _ShutdownTimeoutFilter(logging.Filter):
    """Drops asyncio's "Future exception was never retrieved" for tornado's bare
    TimeoutError('Timeout'). Distributed's batched streams wait on a tornado event with a
    timeout; when a client or cluster closes while such a wait has just timed out, the loop
    stops before the stream reads the timeout, and asyncio reports the unread future at
    garbage collection: an ERROR line after a run that succeeded. Any other exception, and
    any other asyncio error, still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Future exception was never retrieved"):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not (type(exc) is TimeoutError and exc.args == ("Timeout",))


def quiet_shutdown_timeouts() -> None:
    """Install `_ShutdownTimeoutFilter` on asyncio's logger, once per process."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _ShutdownTimeoutFilter) for f in asyncio_log.filters):
        asyncio_log.addFilter(_ShutdownTimeoutFilter())


def connect(address: str) -> Any:
    """A client of the scheduler at `address`, or a one-line error: SchedulerError when it
    cannot be reached within Dask's `distributed.comm.timeouts.connect`, JobError when the
    address is malformed."""
    import dask
    from dask.utils import parse_timedelta
    from distributed import Client

    timeout = dask.config.get("distributed.comm.timeouts.connect")
    seconds = parse_timedelta(timeout, "s") or 30
    _probe(address, seconds)
    # why a thread: a peer that accepts the connection but never answers (not a scheduler)
    # makes the client wait forever, whatever its timeout
    box: dict[str, Any] = {}

    def start() -> None:
        try:
            box["client"] = Client(address, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=start, name="bertpipe-connect", daemon=True)
    thread.start()
    thread.join(2 * seconds + 1)
    if thread.is_alive():
        raise SchedulerError(f"execution.scheduler: cannot reach the Dask scheduler at {address} "
                             f"(no answer within {seconds:g} s; is a Dask scheduler there?)")
    error = box.get("error")
    if isinstance(error, ValueError):
        raise JobError(f"execution.scheduler: {address!r} is not a scheduler address "
                       f"({first_line(error)})")
    if isinstance(error, (OSError, TimeoutError)):
        raise SchedulerError(f"execution.scheduler: cannot reach the Dask scheduler at {address} "
                             f"({first_line(error)})")
    if error is not None:
        raise error
    return box["client"]


def _probe(address: str, seconds: float) -> None:
    """Fail fast on a tcp address nothing listens on: a refused connection is certain at
    once, where the client would retry until its timeout."""
    from distributed.comm import parse_address, parse_host_port

    try:
        scheme, location = parse_address(address)
        if scheme != "tcp":
            return
        host, port = parse_host_port(location)
    except ValueError as exc:
        raise JobError(f"execution.scheduler: {address!r} is not a scheduler address "
                       f"({first_line(exc)})") from None
    try:
        with socket.create_connection((host, port), timeout=seconds) as probe:
            first = _first_bytes(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if isinstance(exc, TimeoutError):
            reason = f"no answer within {seconds:g} s"
        raise SchedulerError(f"execution.scheduler: cannot reach the Dask scheduler at "
                             f"{address} ({reason})") from None
    if first is None:
        # why refuse: a Dask scheduler greets first; a service that waits for a request (an
        # HTTP server) would answer the client's greeting with bytes Dask reads as a frame
        # length of exabytes
        raise SchedulerError(f"execution.scheduler: cannot reach the Dask scheduler at "
                             f"{address} (no answer within {seconds:g} s: something listens "
                             "there but does not greet as a Dask scheduler does; is it one?)")
    if len(first) < 8 or int.from_bytes(first[:8], "little") > MAX_GREETING:
        raise SchedulerError(f"execution.scheduler: {address} is not a Dask scheduler (it "
                             f"answered {first[:16]!r}); check the host and port")


# A Dask scheduler's greeting (its handshake) is a few hundred bytes, sent as an 8-byte
# little-endian length and the frames; anything claiming more is not a Dask greeting.
MAX_GREETING = 1 << 20


def _first_bytes(conn: socket.socket) -> bytes | None:
    """The first bytes a peer sends unasked (up to 16), b"" if it closes, or None when it
    says nothing within the socket's timeout."""
    data = b""
    try:
        while len(data) < 16:
            chunk = conn.recv(16 - len(data))
            if not chunk:
                break
            data += chunk
            if len(data) >= 8:
                break
    except TimeoutError:
        return data or None
    return data



def dashboard_of(client: Any) -> str | None:
    """The dashboard's URL, or None where the scheduler serves none. Its HTTP port answers
    even without bokeh, where the link leads only to a page asking to install bokeh; a
    scheduler started with --no-dashboard has no such service at all."""
    try:
        link = client.dashboard_link
    except (AttributeError, KeyError):  # no dashboard service
        return None
    if not link:
        return None
    try:  # a lambda travels by value: the scheduler need not have bertpipe installed
        served = client.run_on_scheduler(
            lambda: __import__("importlib.util").util.find_spec("bokeh") is not None)
    except Exception:  # cannot tell (an old or locked-down scheduler): no dead link
        return None
    return str(link) if served else None


def _local_shape(job: Job, workers: int | None, threads: int | None) -> tuple[int, int]:
    """(worker processes, torch threads each): one per GPU, else one sharing the CPUs this
    process was given (its cgroup quota and affinity, not the machine's count)."""
    gpus = _cuda_device_count() if job.model.device != "cpu" else 0
    n = workers or gpus or 1
    return n, threads or max(1, allot().threads // n)


@contextlib.contextmanager
def _local_cluster(job: Job, n: int, threads: int) -> Iterator[Any]:
    """`n` Dask workers running one partition at a time, torch using `threads` each.

    With CUDA: one worker process per GPU, pinned by CUDA_VISIBLE_DEVICES, offering GPU=1.
    On CPU, one worker is a thread of this process: measured on 2 cores, a separate worker
    process ran the same partitions 40% slower (28% slower even with the thread and
    allocator settings below), a worker thread at in-process speed. Several CPU workers
    are processes, each with its own torch thread pool.
    """
    import dask
    from distributed import LocalCluster, Nanny, Scheduler, SpecCluster

    gpus = _cuda_device_count() if job.model.device != "cpu" else 0
    # Nannies start workers with OMP/MKL threads at 1 and glibc's trim threshold at 64 KiB
    # (tuned for many small pandas tasks); a torch worker wants its threads and no trim.
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "OPENBLAS_NUM_THREADS": str(threads), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
    # idle OpenMP threads sleep rather than spin (extract/threads.py), unless the user chose
    if not any(key in os.environ for key in WAIT_KEYS):
        env.update(WAIT_POLICY)
    config = {"distributed.scheduler.allowed-failures": job.execution.retries + 1}
    with dask.config.set(config):
        if gpus:
            specs = {i: {"cls": Nanny, "options": {
                "nthreads": 1, "resources": {"GPU": 1},
                "env": {**env, "CUDA_VISIBLE_DEVICES": str(i % gpus)}}} for i in range(n)}
            cluster: Any = SpecCluster(
                workers=specs, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
                silence_logs=logging.ERROR)
        elif n == 1:
            cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                   dashboard_address=":0", silence_logs=logging.ERROR)
        else:
            cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, env=env,
                                   dashboard_address=":0", silence_logs=logging.ERROR)
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
