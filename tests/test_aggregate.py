"""Chunk vectors → document vectors, against hand-worked numbers, and batch planning."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.extract.aggregate import aggregate_chunks
from pipeline.extract.batching import padding_efficiency, plan_batches

V = np.array([[1.0, 4.0], [3.0, 0.0], [10.0, -2.0], [5.0, 5.0]], dtype=np.float32)
DOC = np.array([0, 0, 0, 2])
TOKENS = np.array([2, 6, 2, 7])


@pytest.mark.parametrize("method,doc0", [
    ("mean", [(2 * 1 + 6 * 3 + 2 * 10) / 10, (2 * 4 + 0 - 2 * 2) / 10]),  # [4.0, 0.4]
    ("mean_unweighted", [14 / 3, 2 / 3]),
    ("max", [10.0, 4.0]),
    ("first", [1.0, 4.0]),
])
def test_aggregates(method: str, doc0: list[float]) -> None:
    out = aggregate_chunks(V, DOC, TOKENS, 3, method)
    np.testing.assert_allclose(out[0], doc0, rtol=1e-6)
    assert np.isnan(out[1]).all()  # a document without chunks is NaN, never zeros
    np.testing.assert_array_equal(out[2], [5.0, 5.0])


def test_unknown_aggregate() -> None:
    with pytest.raises(ValueError, match="valid: mean, mean_unweighted, max, first"):
        aggregate_chunks(V, DOC, TOKENS, 3, "median")


@given(st.lists(st.integers(1, 600), min_size=1, max_size=300), st.integers(512, 20000),
       st.integers(1, 64))
def test_plan_covers_each_sequence_once_within_budget(lengths: list[int], budget: int,
                                                      max_batch: int) -> None:
    batches = plan_batches(lengths, budget, max_batch)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= max_batch
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
    assert 0 < padding_efficiency(lengths, batches) <= 1


def test_sorting_keeps_padding_small() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 400, size=2000).tolist()
    assert padding_efficiency(lengths, plan_batches(lengths, 16384, 256)) > 0.95
