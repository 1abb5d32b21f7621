"""What a scheduler keeps of a run: timestamped lines, the plan first."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

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


def test_quiet_prints_no_progress(tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr")
    result = CliRunner().invoke(main, ["-q", "extract",
                                       str(write_job(tmp_path / "j.yaml", job))])
    assert result.exit_code == 0, result.output
    assert result.stderr == "" and "10 rows" in result.stdout
