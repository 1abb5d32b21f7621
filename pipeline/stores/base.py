"""What every store format shares: the layout of a finished run and vector columns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Layout:
    """Sizes known once every partition is done; parts are committed in `indices` order."""

    indices: list[int]
    n_docs: int
    n_chunks: int
    has_chunks: bool


def column_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """fixed_size_list<float, D> column as an (N, D) array, zero-copy where possible."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    width = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
