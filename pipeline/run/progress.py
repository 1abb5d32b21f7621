"""Progress for `bertpipe extract`: a bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import datetime
from types import TracebackType
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress

from ..extract.source import Partition

LOG_EVERY_S = 10.0


class Progress:
    def __init__(self, interactive: bool | None = None):
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.rows = 0
        self.tokens = 0
        self.total_rows = 0
        self.started = time.perf_counter()
        self._last_log = 0.0
        self._bar: RichProgress | None = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()

    def message(self, text: str) -> None:
        """One line on stderr; off a terminal it starts with an ISO timestamp, so a
        scheduler's log keeps when each step happened."""
        if not self.interactive:
            text = f"{datetime.now().astimezone().isoformat(timespec='seconds')} {text}"
        print(text, file=sys.stderr, flush=True)

    def start(self, parts: Sequence[Partition], pending: Sequence[Partition]) -> None:
        self.total_rows = sum(p.n_rows for p in pending)
        skipped = len(parts) - len(pending)
        files = len({p.file for p in parts})
        self.message(f"plan: {files} file{'s' * (files != 1)}, {parts[-1].row_stop if parts else 0}"
                     f" rows, {len(parts)} partitions, {len(pending)} to run")
        if skipped:
            self.message(f"resuming: {skipped} of {len(parts)} partitions already done")
        if self.interactive and pending:
            self._bar = RichProgress(
                TextColumn("encoding"), BarColumn(), MofNCompleteColumn(),
                TextColumn("rows {task.fields[rate]}"), TimeElapsedColumn(),
                TimeRemainingColumn(), transient=True)
            self._task = self._bar.add_task("rows", total=self.total_rows, rate="")
            self._bar.start()
        self.started = time.perf_counter()

    def partition_done(self, part: Partition, marker: dict[str, Any]) -> None:
        self.rows += part.n_rows
        self.tokens += int(marker["n_tokens"])
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rate = f"{self.tokens / elapsed:,.0f} tokens/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=self.rows, rate=rate)
        elif elapsed - self._last_log >= LOG_EVERY_S or self.rows == self.total_rows:
            self._last_log = elapsed
            self.message(f"{self.rows}/{self.total_rows} rows, {rate}, {elapsed:.0f}s")
