"""What a scheduler keeps of a run: timestamped lines, the plan first."""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests.conftest import job_dict, write_job

ISO = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d) ")


def test_non_tty_lines_are_timestamped_and_the_plan_comes_first(
        tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr")
    before = datetime.now().astimezone().replace(microsecond=0)
    result = CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "j.yaml", job))])
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].endswith("plan: 1 file, 10 rows, 2 partitions, 2 to run")
    for line in lines:
        stamp = ISO.match(line)
        assert stamp, line
        assert datetime.fromisoformat(stamp.group(1)) >= before


def _batches_seen(tmp_path: Path, tiny_bert: Path, small_texts: Path, scheduler: str
                  ) -> tuple[list[tuple[int, int, int]], list[int]]:
    from pipeline.run.runner import executor_for, run_job
    from pipeline.spec import Job

    job = Job.from_dict(job_dict(
        small_texts, tiny_bert, tmp_path / f"{scheduler}.zarr",
        batching={"max_tokens_per_batch": 16, "max_batch_size": 2},
        execution={"scheduler": scheduler, "partition_rows": 10, "workers": 1}))
    batches: list[tuple[int, int, int]] = []
    finished: list[int] = []
    executor = executor_for(job, on_batch=lambda p, d, n: batches.append((p.index, d, n)))
    run_job(job, executor=executor, on_done=lambda p, m: finished.append(len(batches)))
    return batches, finished


def test_progress_moves_per_batch_in_process(tmp_path: Path, tiny_bert: Path,
                                             small_texts: Path) -> None:
    batches, finished = _batches_seen(tmp_path, tiny_bert, small_texts, "synchronous")
    total = batches[0][2]
    assert total >= 5 and batches == [(0, d, total) for d in range(1, total + 1)]
    assert finished == [total]  # every batch was reported before the partition finished


def test_progress_moves_per_batch_on_the_local_cluster(tmp_path: Path, tiny_bert: Path,
                                                       small_texts: Path) -> None:
    batches, _ = _batches_seen(tmp_path, tiny_bert, small_texts, "local")
    total = batches[-1][2]
    assert total >= 5 and sorted(d for _, d, _ in batches) == list(range(1, total + 1))


def test_log_lines_count_rows_with_percentage_and_eta(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Rows throughout (never tokens/s), a percentage and an ETA, as a log keeps them."""
    from pipeline.extract.source import Partition
    from pipeline.run import progress as progress_module

    clock = iter([100.0, 100.0, 112.0, 124.0, 130.0])  # start, then one reading per line
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    parts = [Partition(i, "f.parquet", 100 * i, 100 * (i + 1), 100 * i) for i in range(4)]
    with progress_module.Progress(interactive=False) as progress:
        progress.start(parts, parts[1:])  # a resume: partition 0 was done before
        progress.batch_done(parts[1], 1, 2)  # 50 rows after 12 s
        progress.partition_done(parts[1], {"n_tokens": 12_345})  # 100 rows after 24 s
        progress.partition_done(parts[2], {"n_tokens": 12_345})  # 200 rows after 30 s
    lines = [line.split(" ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert lines[:2] == ["plan: 1 file, 400 rows, 4 partitions, 3 to run",
                         "resuming: 1 of 4 partitions already done"]
    assert lines[2:] == [
        "50/300 rows (17%), 4.2 rows/s, 12s elapsed, ETA 1m 00s",
        "100/300 rows (33%), 4.2 rows/s, 24s elapsed, ETA 48s",
    ]  # the third reading came 6 s after the second: too soon for another line
    assert not any("tokens" in line for line in lines)


def test_duration_reads_like_a_clock() -> None:
    from pipeline.run.progress import duration

    assert [duration(s) for s in (0, 59.4, 65, 3599, 7620)] == \
        ["0s", "59s", "1m 05s", "59m 59s", "2h 07m"]


def test_resumed_run_counts_only_what_it_encoded(tmp_path: Path, tiny_bert: Path,
                                                 small_texts: Path) -> None:
    from pipeline.run import runner
    from pipeline.spec import load_job

    job = write_job(tmp_path / "j.yaml", job_dict(
        small_texts, tiny_bert, tmp_path / "o.zarr", execution={"partition_rows": 4}))

    class StopsAfterTwo(runner.InProcessExecutor):
        def run(self, job, parts, staging, fingerprint, on_done):  # type: ignore[no-untyped-def]
            super().run(job, parts[:2], staging, fingerprint, on_done)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.run_job(load_job(job), executor=StopsAfterTwo())
    result = CliRunner().invoke(main, ["extract", str(job), "--json-summary",
                                       str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    assert "resuming: 2 of 3 partitions already done" in result.stderr
    assert "2/2 rows (100%)" in result.stderr  # only the last partition's rows are to do
    assert "10 rows," in result.stdout and "encoded 2 rows this run" in result.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["rows"] == 10 and summary["rows_by_outcome"]["encoded"] == 2


@pytest.mark.parametrize("args", [
    ["-q", "extract", "JOB"], ["extract", "-q", "JOB"], ["extract", "JOB", "--quiet"]])
def test_quiet_anywhere_prints_no_progress(tmp_path: Path, tiny_bert: Path, small_texts: Path,
                                           args: list[str]) -> None:
    job = str(write_job(tmp_path / "j.yaml", job_dict(small_texts, tiny_bert,
                                                      tmp_path / "o.zarr")))
    result = CliRunner().invoke(main, [job if a == "JOB" else a for a in args])
    assert result.exit_code == 0, result.output
    assert result.stderr == "" and "10 rows" in result.stdout


@pytest.mark.parametrize("args", [["validate", "JOB", "-v"], ["validate", "--verbose", "JOB"]])
def test_verbose_after_the_command_logs_details(tmp_path: Path, tiny_bert: Path,
                                                small_texts: Path, args: list[str]) -> None:
    """As `bertpipe -v validate` (whose level logging.basicConfig sets in a fresh process;
    in-process it is pytest's logging that is configured)."""
    job = str(write_job(tmp_path / "j.yaml", job_dict(small_texts, tiny_bert,
                                                      tmp_path / "o.zarr")))
    root = logging.getLogger()
    level = root.level
    try:
        root.setLevel(logging.WARNING)
        assert CliRunner().invoke(main, ["validate", job]).exit_code == 0
        assert root.level == logging.WARNING
        result = CliRunner().invoke(main, [job if a == "JOB" else a for a in args])
        assert result.exit_code == 0, result.output
        assert root.level == logging.INFO
    finally:
        root.setLevel(level)


def test_dashboard_only_where_the_scheduler_serves_one() -> None:
    from pipeline.run.dask_executor import dashboard_of

    class Client:
        def __init__(self, link: object, bokeh: object) -> None:
            self.link, self.bokeh = link, bokeh

        @property
        def dashboard_link(self) -> str:
            if isinstance(self.link, Exception):
                raise self.link
            return str(self.link)

        def run_on_scheduler(self, fn: object) -> object:
            if isinstance(self.bokeh, Exception):
                raise self.bokeh
            return self.bokeh

    url = "http://127.0.0.1:8787/status"
    assert dashboard_of(Client(url, True)) == url
    assert dashboard_of(Client(url, False)) is None  # the port answers, no dashboard on it
    assert dashboard_of(Client(KeyError("dashboard"), True)) is None  # --no-dashboard
    assert dashboard_of(Client("", True)) is None
    assert dashboard_of(Client(url, OSError("refused"))) is None


def test_a_shutdown_timeout_nobody_read_is_not_an_error_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """asyncio's report of an unread tornado timeout (what Dask's batched streams leave when
    a cluster closes mid-wait) is dropped; an unread error of any other kind still shows."""
    import asyncio
    import gc

    from tornado import gen

    from pipeline.run.dask_executor import quiet_shutdown_timeouts

    quiet_shutdown_timeouts()
    quiet_shutdown_timeouts()  # once per process, however often asked
    assert sum(type(f).__name__ == "_ShutdownTimeoutFilter"
               for f in logging.getLogger("asyncio").filters) == 1

    async def leave_unread() -> None:
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError, match="^Timeout$"):  # how tornado words it
            await gen.with_timeout(0.01, asyncio.shield(never))
        timed_out = asyncio.get_running_loop().create_future()
        timed_out.set_exception(TimeoutError("Timeout"))
        failed = asyncio.get_running_loop().create_future()
        failed.set_exception(ValueError("a real failure"))
        other_timeout = asyncio.get_running_loop().create_future()
        other_timeout.set_exception(TimeoutError("the store took too long"))
        del timed_out, failed, other_timeout
        gc.collect()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(leave_unread())
    unread = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert len(unread) == 2, unread
    assert any("ValueError('a real failure')" in line for line in unread)
    assert any("the store took too long" in line for line in unread)
    assert not any("TimeoutError('Timeout')" in line for line in unread)


def test_workers_slow_to_drop_a_runs_input_do_not_hold_up_the_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a Dask run the client asks the workers to let its decoded input go; a worker
    that does not answer (or a lost scheduler) delays the run by DROP_WAIT_S at most."""
    import time

    from pipeline.run import dask_executor

    monkeypatch.setattr(dask_executor, "DROP_WAIT_S", 0.2)
    asked: list[tuple[object, ...]] = []

    class Client:
        def __init__(self, answer_after: float, fails: bool = False) -> None:
            self.answer_after, self.fails = answer_after, fails

        def run(self, fn: object, *args: object, **kwargs: object) -> None:
            asked.append((fn, *args, kwargs.get("on_error")))
            time.sleep(self.answer_after)
            if self.fails:
                raise OSError("the scheduler went away")

    for client in (Client(0.0), Client(5.0), Client(0.0, fails=True)):
        started = time.monotonic()
        dask_executor._let_workers_drop_input(client, "bertpipe-abc")
        assert time.monotonic() - started < 1.0
    assert asked[0] == (dask_executor._drop_input, "bertpipe-abc", "ignore") and len(asked) == 3
