"""The notebook API: `pipeline.open_store(path)` for either store format."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from .errors import StoreError
from .stores import detect_format

DOC_FIELDS = ("n_tokens", "n_chunks", "truncated", "status")


@dataclass
class Store:
    """An opened output store.

    `docs`: one row per input row (dim `doc`, coordinate `id`), every view as a
    (doc, <view>_dim) variable; `chunks`: one row per chunk (dim `chunk`) or None when
    the job stored documents only; `provenance`: the job, model and versions that made it.
    """

    path: str
    format: str
    provenance: dict[str, Any]
    docs: xr.Dataset
    chunks: xr.Dataset | None

    @property
    def views(self) -> list[str]:
        return list(self.provenance["job"]["views"])

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


def open_store(path: str | Path) -> Store:
    """Open a complete bertpipe store (Zarr or Parquet) lazily."""
    path = str(path)
    if not Path(path).exists():
        raise StoreError(f"{path}: no such store")
    module = detect_format(path)
    provenance = module.read_provenance(path) or {}
    if not provenance.get("complete"):
        raise StoreError(f"{path}: store is incomplete (its job has not finished; rerun it "
                         "to resume)")
    docs, chunks = module.open_datasets(path)
    fmt = module.__name__.rsplit(".", 1)[-1].removesuffix("_store")
    return Store(path, fmt, provenance, docs, chunks)
