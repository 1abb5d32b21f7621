"""The notebook API: `pipeline.open_store(path)` for either store format.

`Store` is the stores-level `StoreData` plus what needs the layers above it: the text of
a document's chunks (read from the job's input) and similarity search (the model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .analysis.search import Hit, search
from .extract.source import read_text
from .stores.opened import StoreData, open_store_data


class Store(StoreData):
    def chunk_texts(self, row: int, text: str | None = None) -> pd.DataFrame:
        """One document's chunks with their text and vectors, in document order.

        Columns: seq, start, end, n_tokens, text, and one column per view (a vector per
        cell). The document text is `text` when given, else read from the job's input.
        """
        chunks = self.level("chunks")
        doc = np.asarray(chunks["doc"].values)
        lo, hi = np.searchsorted(doc, [row, row + 1])  # chunks are stored in row order
        if text is None:
            text = read_text(self.provenance.job.input, row)
        part = chunks.isel(chunk=slice(int(lo), int(hi)))
        frame = pd.DataFrame({k: np.asarray(part[k].values) for k in
                              ("seq", "start", "end", "n_tokens")})
        frame["text"] = [text[a:b] for a, b in zip(frame["start"], frame["end"], strict=True)]
        for view in self.views:
            frame[view] = list(np.asarray(part[view].values))
        return frame

    def search(self, texts: str | list[str], k: int = 10, view: str | None = None,
               level: str = "docs", exact: bool = False) -> list[Hit] | list[list[Hit]]:
        """Top-k rows for each query text (a list of `Hit` per query; one list for a str),
        encoded with this store's model, view and post-processing."""
        if isinstance(texts, str):
            return search(self, [texts], view, k, level, exact)[0]
        return search(self, texts, view, k, level, exact)


def open_store(path: str | Path, require_complete: bool = True,
               storage_options: dict[str, Any] | None = None) -> Store:
    """Open a complete bertpipe store (Zarr or Parquet) lazily, from a local folder or an
    fsspec URL (`s3://bucket/out/reviews.zarr`: credentials from the environment, or
    `storage_options`, e.g. {"endpoint_url": ..., "key": "${AWS_ACCESS_KEY_ID}"})."""
    data = open_store_data(path, require_complete, storage_options)
    return Store(data.path, data.fmt, data.provenance, data.docs, data.chunks)
