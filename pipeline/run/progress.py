"""Progress for `bertpipe extract`: a bar on a terminal, periodic log lines otherwise.

One unit throughout, rows: a row's cost is known from the start (tokens only once its
partition ends), so the rate and the ETA never change meaning mid-run. Only the rows this
run encodes count: a resumed run's finished partitions are neither done nor to do."""

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
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress

from ..extract.source import Partition, counted
from ..stores.markers import PartitionMarker

LOG_EVERY_S = 10.0


class Progress:
    """Rows done (finished partitions, plus the share of batches done in running ones) of
    the rows to encode, their percentage, rows/s, elapsed time and ETA; `quiet` keeps only
    warnings and errors (printed elsewhere)."""

    def __init__(self, interactive: bool | None = None, quiet: bool = False):
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.quiet = quiet
        self.running: dict[int, float] = {}  # partition index -> rows done in it (estimated)
        self.rows = 0
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
        if self.quiet:
            return
        if not self.interactive:
            text = f"{datetime.now().astimezone().isoformat(timespec='seconds')} {text}"
        print(text, file=sys.stderr, flush=True)

    def start(self, parts: Sequence[Partition], pending: Sequence[Partition]) -> None:
        self.total_rows = sum(p.n_rows for p in pending)
        skipped = len(parts) - len(pending)
        files = len({p.file for p in parts})
        self.message(f"plan: {counted(files, 'file')}, {parts[-1].row_stop if parts else 0}"
                     f" rows, {counted(len(parts), 'partition')}, {len(pending)} to run")
        if skipped:
            self.message(f"resuming: {skipped} of {len(parts)} partitions already done")
        if self.interactive and pending and not self.quiet:
            self._bar = RichProgress(
                TextColumn("encoding"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                TaskProgressColumn(), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                TextColumn("ETA"), TimeRemainingColumn(), transient=True)
            self._task = self._bar.add_task("rows", total=self.total_rows, rate="")
            self._bar.start()
        self.started = time.perf_counter()

    def batch_done(self, part: Partition, done: int, total: int) -> None:
        """A forward pass of a running partition: its rows count in proportion to its
        batches, so the bar and its ETA move long before the first partition ends."""
        self.running[part.index] = part.n_rows * done / max(total, 1)
        self._show(final=False)

    def partition_done(self, part: Partition, marker: PartitionMarker) -> None:
        self.running.pop(part.index, None)
        self.rows += part.n_rows
        self._show(final=self.rows == self.total_rows)

    def _show(self, final: bool) -> None:
        rows = self.rows + int(sum(self.running.values()))
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rate = f"{rows / elapsed:,.1f} rows/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=rows, rate=rate)
        elif elapsed - self._last_log >= LOG_EVERY_S or final:
            self._last_log = elapsed
            self.message(progress_line(rows, self.total_rows, elapsed))


def progress_line(rows: int, total: int, elapsed: float) -> str:
    """'300/1,000 rows (30%), 12.5 rows/s, 24s elapsed, ETA 56s' (for logs, no bar)."""
    share = rows / total if total else 1.0
    rate = rows / elapsed if elapsed > 0 else 0.0
    eta = "unknown" if rate <= 0 else duration((total - rows) / rate)
    return (f"{rows:,}/{total:,} rows ({100 * share:.0f}%), {rate:,.1f} rows/s, "
            f"{duration(elapsed)} elapsed, ETA {eta}")


def duration(seconds: float) -> str:
    """'45s', '3m 05s', '2h 07m'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"
