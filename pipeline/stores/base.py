"""What every store format shares: the layout of a finished run, vector columns, and the
`StoreFormat` protocol that each format class implements (mypy checks it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:  # typing only: staging imports nothing from here at run time
    import xarray as xr

    from .provenance import FileSum
    from .staging import Staging


@dataclass(frozen=True)
class Layout:
    """Sizes known once every partition is done; parts are committed in `indices` order."""

    indices: list[int]
    n_docs: int
    n_chunks: int
    has_chunks: bool
    n_tokens: int = 0  # rows of the tokens level (stored tokens)
    has_tokens: bool = False  # the job has a token view (pooling: tokens)


class StoreFormat(Protocol):
    """One on-disk format. Provenance crosses this boundary as the plain dict that is
    stored; `stores.provenance` is the one place that turns it into a typed object."""

    name: str
    # True when publishing a version never moves the files a reader of the previous one
    # reads (the reader need not read the provenance again to know what it opened)
    atomic_switch: bool

    def create(self, path: str, provenance: dict[str, Any]) -> None: ...

    def is_store(self, path: str) -> bool: ...

    def read_provenance(self, path: str) -> dict[str, Any] | None: ...

    def commit(self, path: str, staging: Staging, layout: Layout,
               provenance: dict[str, Any]) -> None: ...

    def open_datasets(self, path: str, provenance: dict[str, Any] | None = None
                      ) -> tuple[xr.Dataset, xr.Dataset | None]:
        """The docs and chunks levels, lazily; `provenance` when the caller has read it."""

    def open_tokens(self, path: str, provenance: dict[str, Any] | None = None
                    ) -> xr.Dataset | None: ...

    def add_view(self, path: str, source: str, name: str,
                 fn: Callable[[np.ndarray], np.ndarray], levels: Sequence[str]) -> None: ...

    def write_params(self, path: str, name: str, params: dict[str, np.ndarray]) -> None: ...

    def read_params(self, path: str, name: str) -> dict[str, np.ndarray]: ...

    def update_provenance(self, path: str, provenance: dict[str, Any]) -> None:
        """Write `provenance`; a complete one is sealed first: the checksum of every file
        in `data_files` is recorded in it (what `bertpipe verify` checks)."""

    # integrity: what the checksums cover and how each file is measured

    def data_files(self, path: str) -> list[str]:
        """The store's data files (store-relative POSIX paths) that checksums cover."""

    def checked_size(self, path: str, rel: str) -> int | None:
        """Bytes of `rel` that its checksum covers, from file sizes alone; None if absent."""

    def file_sum(self, path: str, rel: str) -> FileSum | None: ...

    def row_counts(self, path: str) -> dict[str, tuple[str, int]]:
        """Rows of every stored array (Zarr) or file (Parquet): name -> (level, rows)."""

    # Growing a store (incremental runs): a new version is written beside the current one,
    # then published in one step; readers see the previous version until then.

    def write_version(self, path: str, version: int, staging: Staging, layout: Layout,
                      params: dict[str, dict[str, np.ndarray]]) -> None:
        """Write a new version's data (and the fitted parameters of its post-processed
        views) from staged parts beside the current one; readers do not see it yet."""

    def publish(self, path: str, version: int, provenance: dict[str, Any]) -> None:
        """Make `version` current: seal `provenance` (complete, naming the version) with the
        checksums of the new version's files and switch to it. Readers that opened the
        previous version keep reading it; new readers open the new one."""

    def recover(self, path: str) -> None:
        """Finish a switch a killed update began (a no-op where the switch is one step)."""

    def drop_retired(self, path: str) -> None:
        """Remove what is left of versions before the current one (kept for the readers
        that opened them), and of a version a killed update wrote and never published."""


def column_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """fixed_size_list<float, D> column as an (N, D) array, zero-copy where possible."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    width = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)


def with_store_token_offsets(parts: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """Docs parts (in row order) with `token_offset` moved from the partition's first
    token to the store's: each part's offsets plus the tokens of the parts before it."""
    before = 0
    for table in parts:
        if "token_offset" in table.column_names:
            local = table.column("token_offset").to_numpy()
            table = table.set_column(table.column_names.index("token_offset"), "token_offset",
                                     pa.array(local + before))
            before += int(pc.sum(table.column("token_count")).as_py() or 0)
        yield table
