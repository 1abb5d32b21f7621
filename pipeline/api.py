"""The notebook API: `pipeline.open_store(path)` for either store format."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from .errors import StoreError
from .extract.source import read_text
from .spec import InputSpec
from .stores import detect_format


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
        """Extracted views, then views added by `bertpipe postprocess`."""
        extracted = list(self.provenance["job"]["views"])
        added = [v for v in self.provenance.get("post", {}) if v not in extracted]
        return extracted + added

    def vectors(self, view: str, level: str = "docs") -> np.ndarray:
        """One view as an in-memory (N, D) array."""
        data = self.docs if level == "docs" else self.chunks
        if data is None or view not in data:
            raise StoreError(f"{self.path}: no view {view!r} at level {level}; "
                             f"views: {', '.join(self.views)}")
        return np.asarray(data[view].values)

    def chunk_texts(self, row: int, text: str | None = None) -> pd.DataFrame:
        """One document's chunks with their text and vectors, in document order.

        Columns: seq, start, end, n_tokens, text, and one column per view (a vector per
        cell). The document text is `text` when given, else read from the job's input.
        """
        if self.chunks is None:
            raise StoreError(f"{self.path}: chunk vectors were not stored (output.levels)")
        doc = np.asarray(self.chunks["doc"].values)
        lo, hi = np.searchsorted(doc, [row, row + 1])  # chunks are stored in row order
        if text is None:
            text = read_text(InputSpec(**_input_spec(self.provenance)), row)
        part = self.chunks.isel(chunk=slice(int(lo), int(hi)))
        frame = pd.DataFrame({k: np.asarray(part[k].values) for k in
                              ("seq", "start", "end", "n_tokens")})
        frame["text"] = [text[a:b] for a, b in zip(frame["start"], frame["end"], strict=True)]
        for view in self.views:
            frame[view] = list(np.asarray(part[view].values))
        return frame

    def search(self, texts: str | list[str], k: int = 10, view: str | None = None,
               level: str = "docs", exact: bool = False) -> list[Any]:
        """Top-k rows for each query text (a list of `Hit` per query; one list for a str),
        encoded with this store's model, view and post-processing."""
        from .analysis.search import search

        if isinstance(texts, str):
            return search(self, [texts], view, k, level, exact)[0]
        return search(self, texts, view, k, level, exact)

    def __repr__(self) -> str:
        n = self.docs.sizes.get("doc", 0)
        return f"Store({self.path!r}, format={self.format}, docs={n}, views={self.views})"


def _input_spec(provenance: dict[str, Any]) -> dict[str, Any]:
    raw = dict(provenance["job"]["input"])
    raw["carry_columns"] = tuple(raw.get("carry_columns", ()))
    return raw


def open_store(path: str | Path, require_complete: bool = True) -> Store:
    """Open a complete bertpipe store (Zarr or Parquet) lazily."""
    path = str(path)
    if not Path(path).exists():
        raise StoreError(f"{path}: no such store")
    module = detect_format(path)
    provenance = module.read_provenance(path) or {}
    if require_complete and not provenance.get("complete"):
        raise StoreError(f"{path}: store is incomplete (its job has not finished; rerun it "
                         "to resume)")
    docs, chunks = module.open_datasets(path)
    fmt = module.__name__.rsplit(".", 1)[-1].removesuffix("_store")
    return Store(path, fmt, provenance, docs, chunks)
