"""Batch planning: sort sequences by length, pack by a padded-token budget.

Pure function of the lengths, so the plan (and hence the output bits) depends only on
the partition, never on timing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def plan_batches(lengths: Sequence[int], max_tokens: int, max_batch_size: int) -> list[np.ndarray]:
    """Index arrays, one per batch, longest sequences first.

    A batch's cost is `len(batch) * longest` padded tokens; it stays within `max_tokens`
    (a single sequence longer than the budget gets a batch of its own). Sorting makes
    neighbours similar in length, so padding waste stays small.
    """
    arr = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-arr, kind="stable")  # stable: ties keep input order
    batches: list[np.ndarray] = []
    start = 0
    while start < len(order):
        longest = int(arr[order[start]])  # sorted descending: the first is the longest
        size = max(1, min(max_batch_size, max_tokens // max(longest, 1)))
        batches.append(order[start : start + size])
        start += size
    return batches


def padding_efficiency(lengths: Sequence[int], batches: Sequence[np.ndarray]) -> float:
    """Real tokens over padded tokens across a plan (1.0 means no padding)."""
    arr = np.asarray(lengths, dtype=np.int64)
    real = int(arr.sum())
    padded = sum(len(b) * int(arr[b].max()) for b in batches if len(b))
    return real / padded if padded else 1.0
