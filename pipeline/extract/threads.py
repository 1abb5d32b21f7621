"""How many threads the encoder may use, and how its idle threads wait.

Nodes are shared: a process, or a Dask worker, is given a number of CPUs, and running more
compute threads than that makes them wait for each other (a thread that holds a slice of
the matmul is descheduled while its team waits at the barrier). The allotment is the
fewest CPUs any of these grants:

    worker      the Dask worker's `nthreads` (or the job's execution.threads_per_worker)
    cgroup      the CPU quota of the process's cgroup (`cpu.max`, or cgroup v1's
                cpu.cfs_quota_us / cpu.cfs_period_us), rounded down, at least 1
    affinity    the CPUs the process may run on (`os.sched_getaffinity`)
    OMP_NUM_THREADS   when the user set it

Both runtimes take it: torch as its intra-op (and inter-op) thread counts, OpenVINO as
INFERENCE_NUM_THREADS.

Waiting. The CPU wheels of torch run their intra-op threads on GNU OpenMP, whose idle
threads spin for a while before they sleep (GOMP_SPINCOUNT, 300,000 turns by default). On
a core another process wants, that spinning is CPU time spent on nothing, and it delays
the thread that has work. `OMP_WAIT_POLICY=PASSIVE` makes them sleep at once; OpenMP reads
it when the library loads, so it is set (unless the user set a policy or a spin count)
before torch is imported: by the CLI, and by the Dask plugin in local worker processes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}
# either of these set by the user is their choice of how threads wait: left alone
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


@dataclass(frozen=True)
class Allotment:
    """The threads to use and each grant that was read (source -> CPUs)."""

    threads: int
    limits: dict[str, int]

    def describe(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.limits.items())) or "no limit"


def allot(worker: int | None = None, *, env: Mapping[str, str] | None = None,
          cgroup_root: Path = CGROUP_ROOT, affinity: int | None = None,
          proc_cgroup: Path = Path("/proc/self/cgroup")) -> Allotment:
    """The fewest CPUs granted to this process (see the module docstring)."""
    env = os.environ if env is None else env
    limits = {"worker": worker if worker and worker > 0 else None,
              "cgroup": cgroup_cpus(cgroup_root, proc_cgroup),
              "affinity": affinity if affinity is not None else affinity_cpus(),
              "OMP_NUM_THREADS": omp_threads(env)}
    found = {k: v for k, v in limits.items() if v is not None}
    return Allotment(max(1, min(found.values(), default=os.cpu_count() or 1)), found)


def affinity_cpus() -> int | None:
    """CPUs this process may run on; None where the OS does not say."""
    try:
        return len(os.sched_getaffinity(0)) or None
    except (AttributeError, OSError):  # macOS, Windows: no affinity call
        return None


def omp_threads(env: Mapping[str, str]) -> int | None:
    """OMP_NUM_THREADS's first level ("4" or "4,2"), None when unset or not a count."""
    raw = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    try:
        n = int(raw)
    except ValueError:
        return None
    return n if n > 0 else None


def cgroup_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
                ) -> int | None:
    """The CPU quota of this process's cgroup and its parents, in whole CPUs (rounded
    down: a thread beyond the quota is throttled), at least 1; None without a quota."""
    quotas = [q for q in (_quota(d) for d in _cgroup_dirs(root, proc_cgroup)) if q is not None]
    if not quotas:
        return None
    return max(1, int(min(quotas)))


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """The folders that may hold this process's CPU quota: its own cgroup and each parent
    up to the root (v2: `0::/path`; v1: the `cpu` controller's path), and the root itself
    (inside a container the namespace's root is the container's cgroup)."""
    paths: list[Path] = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        names = controllers.split(",")
        bases = [root] if controllers == "" else \
            [root / c for c in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if "cpu" in names]
        for base in bases:
            here = base / rel.strip("/") if rel.strip("/") else base
            while True:
                paths.append(here)
                if here == base:
                    break
                here = here.parent
    paths += [root, root / "cpu", root / "cpu,cpuacct"]
    return list(dict.fromkeys(paths))


def _quota(folder: Path) -> float | None:
    """CPUs allowed by one cgroup folder: v2 `cpu.max` ("max 100000" or "150000 100000"),
    or v1 cfs quota/period (-1: none); None without a quota or files."""
    try:
        fields = (folder / "cpu.max").read_text().split()
        if fields and fields[0] != "max":
            return int(fields[0]) / int(fields[1] if len(fields) > 1 else 100000)
        return None
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def quiet_waits(env: MutableMapping[str, str] | None = None) -> bool:
    """Make OpenMP's idle threads sleep instead of spin, unless the user chose how they
    wait; True when set. Takes effect only in a process that has not loaded torch yet."""
    env = os.environ if env is None else env
    if any(key in env for key in WAIT_KEYS):
        return False
    env.update(WAIT_POLICY)
    return True


def use_torch_threads(n: int) -> None:
    """torch's intra-op threads (for the calling thread's OpenMP team) and inter-op pool,
    at most `n`. The inter-op pool can be sized only before its first use; a process that
    already used it keeps its size (bertpipe runs no inter-op work itself)."""
    import torch  # why here: only a torch worker pays for it

    torch.set_num_threads(n)
    if torch.get_num_interop_threads() > n:
        try:
            torch.set_num_interop_threads(n)
        except RuntimeError:  # already started in this process
            log.debug("torch inter-op threads stay %d", torch.get_num_interop_threads())
