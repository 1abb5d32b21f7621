"""Reading a sample of input rows: fixed-seed row numbers, texts read a partition at a time."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..extract.source import RowGroupCache, plan_partitions, read_partition
from ..spec import InputSpec

READ_ROWS = 2048  # rows read at once; only the sampled texts are kept


def sample_rows(candidates: Sequence[int] | int, sample: int, seed: int) -> list[int]:
    """A fixed-seed sample of row numbers, sorted; all of them when sample >= their count.
    `candidates`: the eligible row numbers, or a row count meaning range(count)."""
    pool = np.arange(candidates) if isinstance(candidates, int) else np.asarray(candidates)
    if sample >= len(pool):
        return sorted(int(r) for r in pool)
    rng = np.random.default_rng(seed)
    return sorted(int(r) for r in rng.choice(pool, size=sample, replace=False))


def count_rows(spec: InputSpec) -> int:
    parts = plan_partitions(spec, READ_ROWS)
    return parts[-1].row_stop if parts else 0


def read_texts(spec: InputSpec, rows: Sequence[int]) -> list[str | None]:
    """The texts of `rows` (global row numbers, sorted), in that order."""
    wanted = list(rows)
    texts: list[str | None] = []
    row_groups = RowGroupCache()
    for part in plan_partitions(spec, READ_ROWS):
        inside = [r for r in wanted if part.row_start <= r < part.row_stop]
        if inside:
            batch = read_partition(spec, part, row_groups).texts
            texts.extend(batch[r - part.row_start] for r in inside)
    return texts
