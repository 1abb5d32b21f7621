"""The test package. Python imports it before conftest.py and every test module, so what
is set here holds before torch and its OpenMP runtime are loaded."""

import os


def _share_the_cores_between_test_workers() -> None:
    """Under pytest-xdist (`make test` runs two workers on two cores), each worker's encoder
    gets its share of the cores and idle OpenMP threads sleep, as the CLI sets them: with
    two threads each, spinning against the other worker, the real-model update tests took
    1.6x the CPU seconds. A user's own OMP_* settings win."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
        share = max(1, cores // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


_share_the_cores_between_test_workers()
