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
