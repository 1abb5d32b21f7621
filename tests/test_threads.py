"""The encoder's thread allotment: each grant read from its source (a cgroup tree under a
fake root, affinity, OMP_NUM_THREADS, the Dask worker's nthreads), the fewest wins; how
idle OpenMP threads wait; and the thread counts a real Dask worker's runtimes use."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.extract import threads
from pipeline.extract.threads import allot, cgroup_cpus, omp_threads, quiet_waits
from tests.conftest import REVIEWS, job_dict


def cgroup_v2(tmp_path: Path, quotas: dict[str, str], own: str = "/") -> tuple[Path, Path]:
    """A cgroup v2 tree: `quotas` maps a group's path to its cpu.max; the process is in
    `own`. Returns (root, the /proc/self/cgroup file)."""
    root = tmp_path / "cgroup"
    for rel, text in quotas.items():
        folder = root / rel.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cpu.max").write_text(text + "\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{own}\n")
    return root, proc


@pytest.mark.parametrize(("text", "cpus"), [
    ("max 100000", None),  # no quota
    ("200000 100000", 2),
    ("150000 100000", 1),  # 1.5 CPUs: a second thread would be throttled half the time
    ("50000 100000", 1),  # under one CPU: still one thread
    ("800000 200000", 4),  # another period
    ("garbage", None),  # unreadable: no limit rather than a crash
])
def test_cgroup_v2_quota_of_the_root(tmp_path: Path, text: str, cpus: int | None) -> None:
    root, proc = cgroup_v2(tmp_path, {"/": text})
    assert cgroup_cpus(root, proc) == cpus


def test_cgroup_v2_the_tightest_quota_on_the_path_wins(tmp_path: Path) -> None:
    root, proc = cgroup_v2(tmp_path, {"/": "max 100000", "/jobs": "300000 100000",
                                      "/jobs/42": "max 100000", "/other": "100000 100000"},
                           own="/jobs/42")
    assert cgroup_cpus(root, proc) == 3  # the parent's 3, not a sibling's 1


def test_cgroup_v1_cfs_quota(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    cpu = root / "cpu,cpuacct" / "slurm" / "job7"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text("250000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:memory:/slurm/job7\n3:cpu,cpuacct:/slurm/job7\n0::/\n")
    assert cgroup_cpus(root, proc) == 2
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert cgroup_cpus(root, proc) is None


def test_no_cgroup_files_is_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpus(tmp_path / "absent", tmp_path / "absent-proc") is None


@pytest.mark.parametrize(("value", "n"), [("3", 3), ("4,2", 4), (" 2 ", 2), ("0", None),
                                          ("-1", None), ("four", None), ("", None)])
def test_omp_num_threads(value: str, n: int | None) -> None:
    assert omp_threads({"OMP_NUM_THREADS": value}) == n
    assert omp_threads({}) is None


def test_the_fewest_grant_wins(tmp_path: Path) -> None:
    root, proc = cgroup_v2(tmp_path, {"/": "200000 100000"})
    kw = {"cgroup_root": root, "proc_cgroup": proc}
    full = allot(4, env={"OMP_NUM_THREADS": "3"}, affinity=8, **kw)
    assert full.threads == 2  # the cgroup's 2
    assert full.limits == {"worker": 4, "cgroup": 2, "affinity": 8, "OMP_NUM_THREADS": 3}
    assert allot(1, env={"OMP_NUM_THREADS": "3"}, affinity=8, **kw).threads == 1  # worker
    assert allot(None, env={"OMP_NUM_THREADS": "3"}, affinity=1, **kw).threads == 1
    assert allot(None, env={}, affinity=8, **kw).threads == 2
    root4, proc4 = cgroup_v2(tmp_path / "b", {"/": "max 100000"})
    assert allot(None, env={"OMP_NUM_THREADS": "3"}, affinity=8, cgroup_root=root4,
                 proc_cgroup=proc4).threads == 3
    assert allot(6, env={}, affinity=8, cgroup_root=root4, proc_cgroup=proc4).threads == 6
    assert allot(0, env={}, affinity=8, cgroup_root=root4, proc_cgroup=proc4).limits == \
        {"affinity": 8}  # a worker with no count is no grant


def test_this_process_affinity_is_read() -> None:
    import os

    assert threads.affinity_cpus() == len(os.sched_getaffinity(0))


def test_idle_threads_sleep_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert quiet_waits(env) and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for key, value in [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "10000"),
                       ("KMP_BLOCKTIME", "200")]:
        chosen = {key: value}
        assert not quiet_waits(chosen) and chosen == {key: value}


def test_the_cli_sets_the_wait_policy_before_torch_loads(tmp_path: Path) -> None:
    """In a fresh `bertpipe` process: the policy is in the environment when OpenMP loads,
    and a user's own setting is kept."""
    import os
    import subprocess
    import sys

    probe = ("import os, sys; from pipeline.cli import main; "
             "sys.argv=['bertpipe','validate','--schema-only','absent.yaml']; "
             "import atexit; atexit.register(lambda: print('policy', "
             "os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)); main()")
    base = {k: v for k, v in os.environ.items() if k not in threads.WAIT_KEYS}
    repo = str(Path(__file__).resolve().parent.parent)
    for extra, want in [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE")]:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             env={**base, **extra, "PYTHONPATH": repo}, timeout=120)
        assert f"policy {want} False" in out.stdout, out.stdout + out.stderr


# ---- a real Dask worker ------------------------------------------------------------------

@pytest.mark.cluster
@pytest.mark.parametrize("runtime", ["torch", "openvino"])
def test_a_one_thread_dask_worker_runs_one_encoder_thread(
        runtime: str, tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A LocalCluster worker with nthreads=1, on a machine with more CPUs: torch in the
    worker's encode thread, and OpenVINO's compiled model, use one thread."""
    if runtime == "openvino" and importlib.util.find_spec("openvino") is None:
        pytest.skip("the openvino runtime is optional")
    # the worker's nthreads alone must bound it (the test workers' own share is unset here)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if threads.allot().threads < 2:
        pytest.skip("needs a process allowed two CPUs, else one thread proves nothing")
    import torch
    from distributed import LocalCluster

    from pipeline.run.runner import run_job
    from pipeline.spec import Job

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster:
        raw = job_dict(REVIEWS, tiny_bert, tmp_path / "o.zarr",
                       execution={"partition_rows": 300, "scheduler": cluster.scheduler_address})
        raw["model"]["runtime"] = runtime
        run_job(Job.from_dict(raw))
        (worker,) = cluster.workers.values()
        assert worker.state.nthreads == 1
        (plugin,) = [p for name, p in worker.plugins.items() if name.startswith("bertpipe-")]
        assert plugin.encoder.submit(torch.get_num_threads).result() == 1
        extractor = plugin._extractor
        assert extractor.runtime.name == runtime
        if runtime == "openvino":
            compiled = extractor.encoder.forward.compiled
            assert int(compiled.get_property("INFERENCE_NUM_THREADS")) == 1


# ---- the test workers' own share -----------------------------------------------------------

def test_test_workers_take_their_share_of_the_allotment_and_wait_quietly() -> None:
    """tests/__init__.py under pytest-xdist: each of N workers gets allotted // N threads (at
    least one) and the quiet wait policy; outside xdist, or with the user's own settings,
    nothing changes."""
    repo = str(Path(__file__).resolve().parent.parent)
    probe = ("import os, tests; from pipeline.extract import threads; "
             "print(os.environ.get('OMP_NUM_THREADS'), os.environ.get('OMP_WAIT_POLICY'), "
             "threads.allot(env={}).threads)")
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "PYTEST_XDIST_WORKER_COUNT", *threads.WAIT_KEYS)}

    def seen(**env: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             env={**base, **env, "PYTHONPATH": repo}, cwd=repo, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    omp, policy, allotted = seen(PYTEST_XDIST_WORKER_COUNT="2")
    assert (omp, policy) == (str(max(1, int(allotted) // 2)), "PASSIVE")
    assert seen(PYTEST_XDIST_WORKER_COUNT="64")[:2] == ["1", "PASSIVE"]
    assert seen()[:2] == ["None", "None"]
    assert seen(PYTEST_XDIST_WORKER_COUNT="2", OMP_NUM_THREADS="3",
                OMP_WAIT_POLICY="ACTIVE")[:2] == ["3", "ACTIVE"]
