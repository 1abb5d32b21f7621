"""Running partitions as Dask tasks: a local cluster, or an existing scheduler.

Each worker loads the model once (a `WorkerPlugin`), runs it on the threads it was given
(extract/threads.py: its own threads, capped by its cgroup quota, affinity and
OMP_NUM_THREADS), and writes its partitions straight into the store's staging area; the client
only submits, watches and commits. A partition is one task with `retries`; a worker
killed mid-task has its task rerun elsewhere, which writes the same bits.

A task reports a bertpipe error as a value, not by raising: such errors are deterministic
(retrying cannot help) and are reported like the in-process executor does, the model's
errors as themselves and a partition's as that partition's failure, with no worker
traceback. A remote scheduler is reached when the executor is entered, before the store is
touched; one that cannot be reached is a `SchedulerError` (exit 7).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
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
from .executors import (
    Encoded,
    Failures,
    OnBatch,
    OnDone,
    Ready,
    encode_partition,
    encode_prepared,
    failure_reason,
    prepare_depth,
    prepare_partition,
    stage_partition,
)

log = logging.getLogger(__name__)
PROGRESS_TOPIC = "bertpipe-progress"
# What one partition's task asks of a worker's GPU. Dask holds a task's resources until
# the task ends, seceded or not: a whole GPU per task would keep the next partition from
# starting until this one is written, so neither the write nor the preparing could overlap
# the encoder. A quarter lets a worker offering GPU=1 run the tasks its plugin pipelines
# (one writing, one encoding, one prepared ahead, one waiting for a slot); the plugin's one
# encoder thread still runs one forward pass at a time. (A power of two: the worker's
# running sum of its free resources stays exact.)
GPU_SHARE = 0.25


class ExtractorPlugin(WorkerPlugin):
    """Holds the job's model on each worker, loaded once; tasks find it by name.

    The model is loaded and run in one thread of the plugin's own, for the worker's life,
    one partition at a time: not in `setup` (the worker's event-loop thread), and not in
    whichever pool thread runs a task, because OpenMP keeps one thread team per calling
    thread and an idle team spinning in another thread costs ~15% on a 2-core machine.
    Once a partition is encoded its task secedes from the worker's pool and writes it to
    the store, so the next partition encodes while this one uploads (one write in flight
    per worker: memory stays bounded by two partitions).

    Where the encoder runs on a device (executors.prepare_depth), a task secedes as soon
    as it starts instead, and a third thread of the plugin's reads, tokenizes and batches
    its partition while the encoder runs the previous one: the worker then holds at most
    one partition writing, one encoding and one prepared ahead (the slots below; a task
    waiting for a slot holds the worker's thread, so no further task starts).
    """

    def __init__(self, job: Job, name: str, torch_threads: int | None):
        self.job = job
        self.name = name
        self.torch_threads = torch_threads
        self.threads = 1
        # made in setup and on first use: the plugin is pickled
        self.encoder: ThreadPoolExecutor | None = None
        self.preparer: ThreadPoolExecutor | None = None
        self.writing: threading.Semaphore | None = None
        self.slots: threading.Semaphore | None = None  # encoding + prepared ahead
        self.depth = 0  # partitions prepared ahead of the encoder's (set with the model)
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
        self.preparer = ThreadPoolExecutor(1, thread_name_prefix="bertpipe-prepare")
        self.writing = threading.Semaphore(1)

    def teardown(self, worker: Any) -> None:
        self._extractor = None
        for pool in (self.encoder, self.preparer):
            if pool is not None:
                pool.shutdown(wait=False)

    def run(self, part: Partition, store_path: str, fingerprint: str, fence: Fence | None
            ) -> dict[str, Any]:
        """{"marker": ...}, or {"setup_error": exc} when the model cannot serve the job, or
        {"error": exc} when this partition cannot be done (see the module docstring)."""
        from distributed import get_worker

        assert self.encoder is not None and self.writing is not None  # set in setup
        worker = get_worker()  # captured here: the encoder thread is not a task thread

        def publish_batches(part: Partition, done: int, total: int) -> None:
            """A batch's progress as a worker event (thread-safe); the client subscribes."""
            worker.log_event(PROGRESS_TOPIC, {"index": part.index, "done": done, "total": total})

        try:
            if self._extractor is None:  # the first task: the model, in the encoder thread
                self.encoder.submit(self._load).result()
        except _ModelUnusable as exc:
            return {"setup_error": exc.error}
        if self.depth:
            return self._run_ahead(part, Staging(store_path, fence=fence), fingerprint,
                                   publish_batches)
        return self._run_in_turn(part, Staging(store_path, fence=fence), fingerprint,
                                 publish_batches)

    def _run_in_turn(self, part: Partition, staging: Staging, fingerprint: str,
                     on_batch: OnBatch) -> dict[str, Any]:
        """Read, tokenize, encode in the encoder thread; then secede and write."""
        from distributed import secede

        assert self.encoder is not None and self.writing is not None
        try:
            encoded = self.encoder.submit(self._encode, part, fingerprint, on_batch).result()
        except BertpipeError as exc:
            return {"error": exc}
        with self.writing:  # the previous partition's write first: one in flight
            secede()  # this task leaves the pool: the next partition starts encoding
            try:
                return {"marker": stage_partition(staging, encoded)}
            except BertpipeError as exc:
                return {"error": exc}

    def _run_ahead(self, part: Partition, staging: Staging, fingerprint: str,
                   on_batch: OnBatch) -> dict[str, Any]:
        """Secede at once, prepare in the preparing thread (while the encoder runs the
        previous partition), encode in the encoder thread, then write."""
        from distributed import secede

        assert self.encoder is not None and self.preparer is not None
        assert self.writing is not None and self.slots is not None
        self.slots.acquire()  # waits in the worker's thread: no further task starts
        secede()  # the worker starts the next partition's task, which prepares it meanwhile
        try:
            try:
                ready = self.preparer.submit(prepare_partition, self._extractor, part,
                                             True).result()
                encoded = self.encoder.submit(self._encode_ready, ready, fingerprint,
                                              on_batch).result()
            except BertpipeError as exc:
                return {"error": exc}
            # the previous write first, before the slot goes: an encoded partition
            # waiting to be written still counts against the bound
            self.writing.acquire()
        finally:
            self.slots.release()
        try:
            return {"marker": stage_partition(staging, encoded)}
        except BertpipeError as exc:
            return {"error": exc}
        finally:
            self.writing.release()

    def _load(self) -> None:
        """In the encoder thread: the model, once; and how far ahead to prepare for it."""
        import torch

        # Nanny workers start with OMP_NUM_THREADS=1 and OpenMP's thread count is per
        # calling thread: set it in the thread that runs the forward passes.
        torch.set_num_threads(self.threads)
        if self._extractor is not None:
            return
        from ..extract.partition import Extractor  # on the worker: the client never encodes

        try:
            extractor = Extractor(self.job, threads=self.threads)
        except BertpipeError as exc:
            raise _ModelUnusable(exc) from None
        self.depth = prepare_depth(extractor)
        self.slots = threading.Semaphore(1 + self.depth)
        self._extractor = extractor

    def _encode(self, part: Partition, fingerprint: str, on_batch: OnBatch) -> Encoded:
        """In the encoder thread: the loaded model on `part`, read and prepared here."""
        import torch

        torch.set_num_threads(self.threads)
        return encode_partition(self._extractor, part, fingerprint, on_batch)

    def _encode_ready(self, ready: Ready, fingerprint: str, on_batch: OnBatch) -> Encoded:
        """In the encoder thread: the loaded model on a partition prepared ahead."""
        import torch

        torch.set_num_threads(self.threads)
        return encode_prepared(self._extractor, ready, fingerprint, on_batch)


class _ModelUnusable(Exception):
    """The model cannot serve the job: every partition would fail alike."""

    def __init__(self, error: BertpipeError):
        super().__init__(str(error))
        self.error = error


def _partition_task(part: Partition, store_path: str, fingerprint: str, plugin: str,
                    fence: Fence | None) -> dict[str, Any]:
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
            if "setup_error" in outcome:  # would fail every partition: as in-process
                client.cancel(list(futures))
                raise outcome["setup_error"]
            if isinstance(outcome.get("error"), LockLostError):
                client.cancel(list(futures))  # another run holds the store now: stop
                raise outcome["error"]
            if "error" in outcome:
                failures.append((part, failure_reason(outcome["error"])))
                continue
            on_done(part, outcome["marker"])
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
