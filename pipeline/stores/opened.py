"""Opening a finished store: its format, typed provenance and lazy datasets."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xarray as xr

from ..errors import OptionError, StoreError
from ..io.location import register_options, resolve, storage_errors
from . import detect_format
from .base import StoreFormat
from .provenance import Provenance, version_of
from .staging import STAGING_DIR
from .verify import check_sizes

SWITCH_RETRIES = 5  # opens retried while an update switches versions (milliseconds)


@dataclass
class StoreData:
    """An opened output store.

    `docs`: one row per input row (dim `doc`, coordinate `id`), every view as a
    (doc, <view>_dim) variable; `chunks`: one row per chunk (dim `chunk`) or None when
    the job stored documents only; `provenance`: the job, model and versions that made it;
    `token_dataset`: one row per stored token (dim `token`), or None when the job has no
    token view (pooling: tokens).
    """

    path: str
    fmt: StoreFormat
    provenance: Provenance
    docs: xr.Dataset
    chunks: xr.Dataset | None
    token_dataset: xr.Dataset | None = None
    _superseded: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def format(self) -> str:
        return self.fmt.name

    @property
    def views(self) -> list[str]:
        """Extracted views, then views added by `bertpipe postprocess`."""
        return self.provenance.views

    @property
    def token_views(self) -> list[str]:
        """Views with pooling: tokens (vectors in `token_dataset`, not in `docs`)."""
        return self.provenance.token_views

    def level(self, level: str) -> xr.Dataset:
        data = self.docs if level == "docs" else self.chunks
        if data is None:
            raise StoreError(f"{self.path}: chunk vectors were not stored (output.levels)")
        return data

    def superseded(self, level: str = "docs") -> np.ndarray:
        """(rows,) bool of `level`: rows an edit superseded (an Icechunk update appends a
        changed text and keeps the old row, `present: false`; the id's current row is its
        last). Searches and probes leave them out; a store never updated has none."""
        if self._superseded is None:
            self._superseded = superseded_in(self.docs)
        docs = self._superseded
        if level == "docs" or not docs.any():
            return docs if level == "docs" else np.zeros(self.level(level).sizes["chunk"], bool)
        return docs[np.asarray(self.level(level)["doc"].values, dtype=np.int64)]

    def vectors(self, view: str, level: str = "docs") -> np.ndarray:
        """One view as an in-memory (N, D) array."""
        data = self.docs if level == "docs" else self.chunks
        if data is None or view not in data:
            raise StoreError(f"{self.path}: no view {view!r} at level {level}; "
                             f"views: {', '.join(self.views)}")
        return np.asarray(data[view].values)

    def __repr__(self) -> str:
        n = self.docs.sizes.get("doc", 0)
        return f"Store({self.path!r}, format={self.format}, docs={n}, views={self.views})"


def superseded_in(docs: xr.Dataset) -> np.ndarray:
    """(rows,) bool: the documents an edit superseded (none in a store never updated)."""
    if "present" not in docs:
        return np.zeros(docs.sizes.get("doc", 0), bool)
    return superseded_rows(np.asarray(docs["id"].values),
                           np.asarray(docs["present"].values, dtype=bool))


def superseded_rows(ids: np.ndarray | pa.Array, present: np.ndarray) -> np.ndarray:
    """Rows flagged `present: false` that are not the last row of their id."""
    return ~present & ~last_of_each_id(ids)


def current_rows(store_ids: np.ndarray | pa.Array, ids: np.ndarray | pa.Array | pa.ChunkedArray
                 ) -> np.ndarray:
    """(N,) int64: the store row holding each of `ids` now (the last row with that id: an
    edit appended after its superseded rows comes last), -1 for an id the store lacks."""
    store_ids = pa.array(store_ids) if isinstance(store_ids, np.ndarray) else store_ids
    n = len(store_ids)
    backwards = store_ids.take(pa.array(np.arange(n - 1, -1, -1, dtype=np.int64)))
    found = pc.index_in(pa.array(ids) if isinstance(ids, np.ndarray) else ids,
                        value_set=backwards)
    at = np.asarray(pc.fill_null(found, -1).to_numpy(zero_copy_only=False), dtype=np.int64)
    return np.where(at >= 0, n - 1 - at, -1)


def last_of_each_id(ids: np.ndarray | pa.Array) -> np.ndarray:
    """(rows,) bool: the row is the last of the rows with its id."""
    return current_rows(ids, ids) == np.arange(len(ids))


def open_store_data(path: str | Path, require_complete: bool = True,
                    storage_options: dict[str, Any] | None = None,
                    version: int | str | None = None, dask: bool = True) -> StoreData:
    """Open a bertpipe store lazily; incomplete ones are refused. `path` may be an fsspec
    URL (`s3://bucket/out/reviews.zarr`); `storage_options` go over what the environment
    gives (a string `${NAME}` is read from the environment). `version`: an earlier version
    the store keeps (the icechunk and delta formats), else the current one; a number, or
    its digits as a string (`"1"`, as read from a command line or a config file)."""
    path = str(path)
    version = version_number(version)
    if storage_options is not None:
        register_options(path, storage_options)
    with storage_errors(path, "store", StoreError):
        return _open(path, require_complete, version, dask)


def version_number(version: object) -> int | None:
    """`version` as the store's version number: an int (or NumPy integer) of at least 0,
    or a string of its digits; anything else is refused naming what was given (a string
    compared with the kept numbers read "no version 1 (versions kept: 1, 0)")."""
    if version is None:
        return None
    if isinstance(version, str) and version.strip().isdigit():
        return int(version.strip())
    if isinstance(version, (int, np.integer)) and not isinstance(version, bool) \
            and version >= 0:
        return int(version)
    raise OptionError(f"version={version!r} is not a store version: give a whole number "
                      "0, 1, ... (bertpipe inspect lists the versions kept), or leave it out "
                      "for the current one")


def store_name(path: str) -> str:
    """How an opened store names itself (errors, its provenance's path): a local path as
    the user gave it, else the normalized URL."""
    location = resolve(path)
    return path if location.local else location.url


def _open(path: str, require_complete: bool, version: int | None = None,
          dask: bool = True) -> StoreData:
    location = resolve(path)
    path = store_name(path)
    if not location.exists():
        raise StoreError(f"{path}: no such store")
    fmt = detect_format(path)
    if version is not None:
        fmt = fmt.at_version(version)
    raw = fmt.record() or {}
    if require_complete and not raw.get("complete"):
        raise StoreError(f"{path}: store is incomplete (its job has not finished; rerun it "
                         "to resume)")
    if not raw.get("job"):
        raise StoreError(f"{path}: store is incomplete and has no provenance yet; rerun its "
                         "job to resume")
    for attempt in range(SWITCH_RETRIES + 1):
        try:
            check_sizes(fmt)
            docs, chunks = fmt.open_datasets(dask)
            tokens = fmt.open_tokens(dask)
        except StoreError:
            # an update switching versions (Parquet: two renames) shows files of two
            # versions for a moment: read the provenance again and retry
            before, raw = raw, fmt.reread() or {}
            if attempt == SWITCH_RETRIES or not _switched(before, raw, path):
                raise
            time.sleep(0.05)
            continue
        if fmt.atomic_switch or version_of(fmt.reread()) == version_of(raw):
            break
        raw = fmt.record() or {}  # switched while opening: open the new one
    provenance = Provenance.from_dict(raw, path)
    return StoreData(path, fmt, provenance, docs, chunks, tokens)


def _switched(before: dict[str, object], now: dict[str, object], path: str) -> bool:
    """An update is switching or has just switched the store's version."""
    return version_of(now) != version_of(before) or Path(path, STAGING_DIR, "next").exists()
