"""The recipes of docs/cluster.md ("Scheduled runs") run as they are written, as far as this
machine allows, so that they cannot drift from what works:

- the cron wrapper, against a `bertpipe` whose exit codes follow a script (and a `sleep`
  that only records), then against the real bertpipe;
- the SLURM driver: its `SLURMCluster` prints exactly the job script the doc shows, and the
  driver itself runs a job on a worker that its generated job script started (an `sbatch`
  that runs the script here, a `scancel` that stops it);
- the Airflow task, through `airflow dags test`, where an Airflow installation is named by
  BERTPIPE_TEST_AIRFLOW (the path of its `airflow` command; skipped otherwise).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import pipeline
from pipeline.cli import main
from tests.conftest import REPO, WORDS, job_dict, write_job, write_table

DOC = REPO / "docs" / "cluster.md"


def scheduled_runs() -> str:
    """The "Scheduled runs" section of docs/cluster.md."""
    text = DOC.read_text()
    start = text.find("\n## Scheduled runs\n")
    if start < 0:
        pytest.fail(f"{DOC}: no '## Scheduled runs' section")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def fenced(language: str, marker: str) -> str:
    """The one fenced block of `language` in "Scheduled runs" that contains `marker`."""
    blocks = re.findall(rf"^```{language}\n(.*?)^```$", scheduled_runs(), re.M | re.S)
    found = [block for block in blocks if marker in block]
    if len(found) != 1:
        pytest.fail(f"{DOC}: expected one ```{language} block containing {marker!r} in "
                    f"'Scheduled runs', found {len(found)}")
    return found[0]


def replaced(text: str, old: str, new: str) -> str:
    """`text` with its one occurrence of `old` replaced (a recipe that changed fails here,
    naming what is gone, rather than running something else)."""
    if text.count(old) != 1:
        pytest.fail(f"{DOC}: the recipe should contain {old!r} once, "
                    f"found {text.count(old)} times")
    return text.replace(old, new)


def executable(path: Path, body: str) -> Path:
    path.write_text(body)
    path.chmod(0o755)
    return path


def bertpipe_launcher(bin_dir: Path) -> Path:
    """A `bertpipe` command that runs this checkout with this interpreter (whatever the
    caller's PYTHONPATH)."""
    bin_dir.mkdir(exist_ok=True)
    return executable(bin_dir / "bertpipe", f'#!/bin/sh\nPYTHONPATH="{REPO}" '
                      f'exec "{sys.executable}" -m pipeline.cli "$@"\n')


def environment(*bin_dirs: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **extra}
    env["PATH"] = os.pathsep.join([*map(str, bin_dirs), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(":")
    return env


@pytest.fixture
def tiny_job(tmp_path: Path, small_texts: Path, tiny_bert: Path) -> Path:
    return write_job(tmp_path / "tiny.yaml",
                     job_dict(small_texts, tiny_bert, tmp_path / "tiny.zarr",
                              execution={"scheduler": "synchronous", "partition_rows": 4}))


def reference_store(tmp_path: Path, small_texts: Path, tiny_bert: Path) -> pipeline.Store:
    """The same job run in-process, for comparing vectors."""
    from click.testing import CliRunner

    from pipeline.cli import main

    job = write_job(tmp_path / "reference.yaml",
                    job_dict(small_texts, tiny_bert, tmp_path / "reference.zarr",
                             execution={"scheduler": "synchronous", "partition_rows": 4}))
    result = CliRunner().invoke(main, ["extract", str(job)])
    assert result.exit_code == 0, result.output
    return pipeline.open_store(tmp_path / "reference.zarr")


def assert_same_vectors(store: pipeline.Store, reference: pipeline.Store) -> None:
    for view in ("mean", "cls"):
        np.testing.assert_allclose(store.vectors(view), reference.vectors(view), atol=1e-5)
    np.testing.assert_array_equal(store.docs["id"].values, reference.docs["id"].values)


# --- Kubernetes ---------------------------------------------------------------------------

def test_kubernetes_manifests() -> None:
    """No cluster here: the manifests parse, the CronJob's command is a real `extract` call
    whose scheduler comes from the variable `--scheduler` reads, and FailJob names exactly
    the codes that retrying cannot mend."""
    import yaml

    from pipeline.cli import main

    cluster, cron = yaml.safe_load_all(fenced("yaml", "kind: CronJob"))
    assert (cluster["kind"], cron["kind"]) == ("DaskCluster", "CronJob")
    job = cron["spec"]["jobTemplate"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["bertpipe", "extract"]
    extract = main.commands["extract"]  # type: ignore[attr-defined]
    options = {opt for param in extract.params for opt in param.opts}
    assert {arg for arg in command if arg.startswith("--")} <= options
    (scheduler,) = [p for p in extract.params if "--scheduler" in p.opts]
    assert [e["name"] for e in container["env"]] == [scheduler.envvar]
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["containerName"] == "extract"
    assert rule["onExitCodes"]["values"] == [2, 3, 4]


# --- cron ---------------------------------------------------------------------------------

CRON_JOB = "/opt/jobs/reviews-s3.yaml"


def cron_wrapper(tmp_path: Path, job: str = CRON_JOB) -> Path:
    script = replaced(fenced("bash", "for attempt in"), CRON_JOB, job)
    return executable(tmp_path / "run-reviews.sh", script)


def scripted_bertpipe(bin_dir: Path) -> Path:
    """A `bertpipe` that records its arguments and exits with the next code of $CODES, and
    a `sleep` that records the seconds it was asked for and returns at once."""
    bin_dir.mkdir(exist_ok=True)
    executable(bin_dir / "sleep", '#!/bin/sh\necho "$1" >> "$SLEEPS"\n')
    return executable(bin_dir / "bertpipe", textwrap.dedent("""\
        #!/bin/sh
        echo "$*" >> "$CALLS"
        code=$(head -n 1 "$CODES"); sed -i 1d "$CODES"
        exit "$code"
        """))


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize(("codes", "final", "sleeps"), [
    ([0], 0, []),
    ([6, 0], 0, [300]),                 # failed partitions: the rerun resumes
    ([7, 8, 0], 0, [300, 600]),         # scheduler, then object store away
    ([7, 8, 8], 8, [300, 600]),         # three attempts; no wait after the last one
    ([2], 2, []), ([3], 3, []), ([4], 4, []),    # fix the job, input or model: no retry
    ([5], 5, []),                       # a lock held or a damaged store: not blindly
    ([6, 3], 3, [300]),                 # a retry that meets a fatal code stops there
    ([137, 0], 0, [300]),               # SIGKILL (out of memory): the retry takes over, resumes
    ([143, 137, 137], 137, [300, 600]),  # SIGTERM, then killed twice: three attempts
])
def test_cron_wrapper_retries_only_what_a_retry_mends(tmp_path: Path, codes: list[int],
                                                      final: int, sleeps: list[int]) -> None:
    scripted_bertpipe(tmp_path / "bin")
    (tmp_path / "codes").write_text("".join(f"{c}\n" for c in codes))
    env = environment(tmp_path / "bin", CODES=str(tmp_path / "codes"),
                      CALLS=str(tmp_path / "calls"), SLEEPS=str(tmp_path / "sleeps"))
    done = subprocess.run(["bash", str(cron_wrapper(tmp_path))], env=env, timeout=30)
    assert done.returncode == final
    assert lines(tmp_path / "calls") == [f"extract {CRON_JOB}"] * len(codes)
    assert lines(tmp_path / "sleeps") == [str(s) for s in sleeps]


@pytest.mark.slow
def test_cron_wrapper_with_the_real_bertpipe(tmp_path: Path, tiny_job: Path) -> None:
    """The happy path: one attempt, exit 0, a complete store; the next night's run finds it
    complete and exits 0 without encoding."""
    wrapper = cron_wrapper(tmp_path, str(tiny_job))
    env = environment(bertpipe_launcher(tmp_path / "bin").parent)
    for _ in range(2):
        done = subprocess.run(["bash", str(wrapper)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
    assert pipeline.open_store(tmp_path / "tiny.zarr").provenance.stats["rows"] == 10
    assert "already complete" in done.stdout + done.stderr


NO_REAPER = Path(__file__).with_name("no_reaper.py")


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat from its third field on (state, ppid, ...); [] once reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return []


@pytest.mark.slow
@pytest.mark.parametrize("killer", ["python", "timeout"])
def test_cron_wrapper_resumes_a_run_killed_by_sigkill(tmp_path: Path, tiny_bert: Path,
                                                      killer: str) -> None:
    """The OOM killer's and the time limit's case: the real bertpipe is killed with SIGKILL
    mid-run (its lock left behind), from Python or by `timeout -s KILL` around it (which
    kills itself too, orphaning its child); the wrapper's first retry, at once, takes the
    dead run's lock over and resumes, exit 0, and the store equals an uninterrupted run (50
    partitions: the first one done, the run is still far from its end when it is killed).
    Everything runs under a parent that does not reap orphans, as a container's shell PID 1:
    the run `timeout` orphaned is still a zombie when the retry starts, and after it ends."""
    texts = [f"{a} {b} {c}" for a in WORDS for b in WORDS[:8] for c in ("one", "two")][:100]
    source = write_table(tmp_path / "texts.parquet",
                         {"id": [f"r{i}" for i in range(len(texts))], "text": texts})
    execution = {"scheduler": "synchronous", "partition_rows": 2}
    job = write_job(tmp_path / "job.yaml", job_dict(source, tiny_bert, tmp_path / "o.zarr",
                                                    execution=execution))
    bin_dir = bertpipe_launcher(tmp_path / "bin").parent
    executable(bin_dir / "sleep", '#!/bin/sh\necho "$1" >> "$SLEEPS"\n')
    env = environment(bin_dir, SLEEPS=str(tmp_path / "sleeps"))
    wrapper = cron_wrapper(tmp_path, str(job))
    if killer == "timeout":  # a time limit far away: the test fires it by hand (SIGALRM)
        wrapper.write_text(replaced(wrapper.read_text(), "  bertpipe extract",
                                    "  timeout -s KILL 3600 bertpipe extract"))
    parent = subprocess.Popen([sys.executable, str(NO_REAPER), "--wait", "bash", str(wrapper)],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        lock, parts = tmp_path / "o.zarr" / "_bertpipe.lock", tmp_path / "o.zarr" / "_bertpipe"
        deadline = time.monotonic() + 120
        while not (lock.exists() and list(parts.glob("parts/*.done.json"))):
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        victim = json.loads(lock.read_text())["pid"]  # the first attempt's bertpipe
        if killer == "timeout":
            os.kill(int(_stat_fields(victim)[1]), signal.SIGALRM)  # its time limit, now
        else:
            os.kill(victim, signal.SIGKILL)
        assert parent.stdout is not None
        out = ""
        for line in parent.stdout:
            out += line
            if line.startswith("exit "):
                break
        if killer == "timeout":  # orphaned: never reaped, yet taken over (bash reaps its own)
            assert _stat_fields(victim)[:1] == ["Z"], out
    finally:
        rest, _ = parent.communicate("", timeout=300)
    assert out.splitlines()[-1] == "exit 0", out + rest
    assert lines(tmp_path / "sleeps") == ["300"]  # exactly one retry
    assert f"took over the lock of host {socket.gethostname()}, pid {victim}" in out
    assert "is no longer running on this host" in out
    reference = write_job(tmp_path / "ref.yaml", job_dict(source, tiny_bert,
                                                          tmp_path / "ref.zarr",
                                                          execution=execution))
    assert CliRunner().invoke(main, ["extract", str(reference)]).exit_code == 0
    store = pipeline.open_store(tmp_path / "o.zarr")
    assert_same_vectors(store, pipeline.open_store(tmp_path / "ref.zarr"))
    assert f"pid {victim}" in store.provenance.history[0].took_over_lock
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "o.zarr")]).exit_code == 0


# --- SLURM with dask-jobqueue -------------------------------------------------------------

ADDRESS = re.compile(r"tcp://[\w.:\[\]-]+:\d+")


def driver() -> str:
    return fenced("python", "SLURMCluster(")


@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")  # the doc's dashboard port
def test_slurm_job_script_is_the_one_the_doc_shows() -> None:
    """The doc's SLURMCluster, built by the doc's own lines, submits the job script that the
    doc prints (the scheduler's address aside)."""
    pytest.importorskip("dask_jobqueue")
    code = driver()
    namespace: dict[str, object] = {}
    exec(compile(code[:code.index("cluster.scale(")], str(DOC), "exec"), namespace)
    cluster = namespace["cluster"]
    try:
        generated = cluster.job_script()  # type: ignore[attr-defined]
    finally:
        cluster.close()  # type: ignore[attr-defined]
    shown = fenced("bash", "#SBATCH")
    assert ADDRESS.sub("ADDR", generated).strip() == ADDRESS.sub("ADDR", shown).strip()


@pytest.fixture
def slurm_here(tmp_path: Path) -> Iterator[Path]:
    """`sbatch` and `scancel` that run a job script on this machine: sbatch copies the script
    (the caller deletes it), starts it in its own process group and answers with that
    group's id as the job id; scancel stops the group. Whatever is left is killed after."""
    bin_dir, jobs = tmp_path / "slurm-bin", tmp_path / "slurm-jobs"
    bin_dir.mkdir()
    jobs.mkdir()
    executable(bin_dir / "sbatch", textwrap.dedent(f"""\
        #!/usr/bin/env bash
        cp "$1" "{jobs}/job-$$.sh"
        setsid bash "{jobs}/job-$$.sh" > "{jobs}/job-$$.log" 2>&1 < /dev/null &
        echo "$!" >> "{jobs}/submitted"
        echo "Submitted batch job $!"
        """))
    executable(bin_dir / "scancel", textwrap.dedent(f"""\
        #!/usr/bin/env bash
        for job in "$@"; do echo "$job" >> "{jobs}/cancelled"; kill -TERM -- "-$job"; done
        exit 0
        """))
    yield bin_dir
    for job in lines(jobs / "submitted"):
        try:
            os.killpg(int(job), signal.SIGKILL)
        except ProcessLookupError:
            pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.cluster
def test_slurm_driver_runs_the_job_on_its_workers(tmp_path: Path, slurm_here: Path,
                                                  tiny_job: Path, small_texts: Path,
                                                  tiny_bert: Path) -> None:
    """The doc's driver, run as a script: its cluster submits one worker job, the worker
    starts from the generated job script and joins, `bertpipe extract --scheduler` runs the
    job on it, the driver exits with bertpipe's code and cancels its job. Changed from the
    doc only where this machine differs: the interpreter, the env file, the job, one job
    instead of four, and everything on loopback."""
    pytest.importorskip("dask_jobqueue")
    env_file = tmp_path / "s3.env"
    env_file.write_text("export BERTPIPE_RECIPE_PROLOGUE=ran\n")
    code = driver()
    for old, new in [('python="/opt/bertpipe/.venv/bin/python"', f'python="{sys.executable}"'),
                     ("/etc/bertpipe/s3.env", str(env_file)),
                     ("cluster.scale(jobs=4)", "cluster.scale(jobs=1)"),
                     ('"jobs/reviews-s3.yaml"', f'"{tiny_job}"'),
                     ('scheduler_options={"dashboard_address": ":8787"}',
                      'interface="lo", scheduler_options={"dashboard_address": ":0"}')]:
        code = replaced(code, old, new)
    script = tmp_path / "run_reviews.py"
    script.write_text(code)
    env = environment(slurm_here, bertpipe_launcher(tmp_path / "bin").parent)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    jobs = tmp_path / "slurm-jobs"
    logs = "".join(p.read_text() for p in jobs.glob("job-*.log"))
    assert done.returncode == 0, done.stderr + logs
    submitted = lines(jobs / "submitted")
    assert len(submitted) == 1 and lines(jobs / "cancelled") == submitted
    assert re.search(r"Start worker at:\s+tcp://127\.0\.0\.1:", logs), logs
    assert "dask scheduler tcp://127.0.0.1:" in done.stdout + done.stderr
    deadline = time.monotonic() + 30          # the cancelled worker goes away
    while group_alive(int(submitted[0])) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(int(submitted[0]))
    store = pipeline.open_store(tmp_path / "tiny.zarr")
    assert_same_vectors(store, reference_store(tmp_path, small_texts, tiny_bert))


# --- Airflow ------------------------------------------------------------------------------

AIRFLOW_DAG_HEAD = '''\
from datetime import datetime, timedelta

from airflow.sdk import DAG

# retry_delay shortened from 5 min so that the retries happen within the test
with DAG("bertpipe_reviews", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         default_args={"retry_delay": timedelta(seconds=1)}):
'''


def airflow_command() -> Path:
    named = os.environ.get("BERTPIPE_TEST_AIRFLOW")
    if not named:
        pytest.skip("set BERTPIPE_TEST_AIRFLOW to an `airflow` command (Airflow 3.x, in a "
                    "virtual environment of its own) to run the Airflow recipe")
    return Path(named)


def airflow_dags_test(airflow: Path, home: Path, bin_dir: Path, job: Path, summary: Path,
                      scheduler: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """The doc's BashOperator in a DAG of its own, run once by `airflow dags test`."""
    snippet = fenced("python", "BashOperator(")
    for old, new in [("/opt/jobs/reviews-s3.yaml", str(job)), ("/tmp/run.json", str(summary)),
                     ("tcp://dask-scheduler:8786", scheduler)]:
        snippet = replaced(snippet, old, new)
    (home / "dags").mkdir(parents=True, exist_ok=True)
    (home / "dags" / "bertpipe_reviews.py").write_text(
        AIRFLOW_DAG_HEAD + textwrap.indent(snippet, "    "))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", **extra)
    if not (home / "airflow.db").exists():
        subprocess.run([str(airflow), "db", "migrate"], env=env, check=True, timeout=300,
                       capture_output=True)
    return subprocess.run([str(airflow), "dags", "test", "bertpipe_reviews"], env=env,
                          capture_output=True, text=True, timeout=600)


def dag_run_state(done: subprocess.CompletedProcess[str]) -> str:
    found = re.search(r"DagRun Finished: .*?state=(\w+)", done.stdout + done.stderr)
    assert found, done.stdout[-3000:] + done.stderr[-3000:]
    return found.group(1)


@pytest.mark.slow
@pytest.mark.cluster
def test_airflow_task(tmp_path: Path, tiny_job: Path) -> None:
    """The doc's BashOperator: the real bertpipe against a Dask scheduler named in `env`
    succeeds and writes its JSON summary; exit 6 is retried and the rerun succeeds; exit 2
    is retried too (Airflow retries every failure: retries=3 makes four attempts)."""
    import json

    from tests.test_cluster import dask_cluster

    airflow, home = airflow_command(), tmp_path / "airflow"
    summary = tmp_path / "run.json"
    launcher = bertpipe_launcher(tmp_path / "bin")
    with dask_cluster(tmp_path, n_workers=1) as (address, _):
        done = airflow_dags_test(airflow, home, launcher.parent, tiny_job, summary, address)
    assert done.returncode == 0 and dag_run_state(done) == "success", done.stdout[-3000:]
    log = done.stdout + done.stderr
    assert f"dask scheduler {address}" in log
    summary_line = re.search(r"10 rows, \d+ chunks, \d+ tokens encoded in .*?failed 0", log)
    assert summary_line, log[-3000:]
    print(summary_line.group(0))  # shown with -rP: bertpipe's line in the task's log
    report = json.loads(summary.read_text())
    assert (report["exit_code"], report["rows"]) == (0, 10)
    assert pipeline.open_store(tmp_path / "tiny.zarr").provenance.stats["rows"] == 10

    scripted_bertpipe(tmp_path / "scripted")
    for codes, state, attempts in [([6, 0], "success", 2), ([2, 2, 2, 2], "failed", 4)]:
        (tmp_path / "codes").write_text("".join(f"{c}\n" for c in codes))
        (tmp_path / "calls").unlink(missing_ok=True)
        done = airflow_dags_test(airflow, home, tmp_path / "scripted", tiny_job, summary,
                                 address, CODES=str(tmp_path / "codes"),
                                 CALLS=str(tmp_path / "calls"))
        assert dag_run_state(done) == state
        assert (done.returncode == 0) == (state == "success")
        assert len(lines(tmp_path / "calls")) == attempts
