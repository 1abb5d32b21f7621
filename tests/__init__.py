"""The test package. Python imports it before conftest.py and every test module, so what
is set here holds before torch and its OpenMP runtime are loaded."""

import os

from pipeline.extract import threads  # no torch: only the allotment and the wait policy


def _share_the_cores_between_test_workers() -> None:
    """Under pytest-xdist (`make test` runs two workers on two cores), each worker's encoder
    gets its share of the CPUs this process is allotted, and idle OpenMP threads sleep as
    the CLI makes them (`threads.quiet_waits`): with two threads each, spinning against the
    other worker, the real-model update tests took 1.5-1.6x the CPU seconds. A user's own
    OMP_* settings win."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        share = max(1, threads.allot().threads // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        threads.quiet_waits()


_share_the_cores_between_test_workers()
