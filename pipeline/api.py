"""The notebook API: `pipeline.open_store(path)` for either store format.

`Store` is the stores-level `StoreData` plus what needs the layers above it: the text of
a document's chunks (read from the job's input), similarity search (the model), and one
document's token vectors (token views).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .analysis.search import Hit, document_text, search
from .errors import StoreError
from .stores.opened import StoreData, open_store_data

TOKEN_FIELDS = ("position", "token_id", "token", "start", "end")


@dataclass
class TokenVectors:
    """Stored tokens of one document for one token view.

    `frame`: one row per token in document order, columns position (index among the
    document's word pieces, special tokens not counted), token_id, token (the word piece,
    e.g. `##ing`), start and end (character offsets: `text[start:end]` is the token's
    surface form in the row's original text). `vectors`: (n, D) float array, row i for
    frame row i.
    """

    row: int
    view: str
    frame: pd.DataFrame
    vectors: np.ndarray

    def __len__(self) -> int:
        return len(self.frame)

    def mean(self) -> np.ndarray:
        """(D,) the tokens' mean vector (e.g. one vector for a span); NaN when empty."""
        if not len(self.vectors):
            return np.full(self.vectors.shape[1], np.nan, self.vectors.dtype)
        return self.vectors.mean(0)


class Store(StoreData):
    def row_of(self, id_value: object) -> int:
        """The row of the document whose id is `id_value` (its current row: an edit
        appended after a superseded one is). An id that names several rows (a job with
        `input.unique_ids: false`) is refused as ambiguous, never guessed."""
        ids = np.asarray(self.docs["id"].values)
        found = np.flatnonzero(ids == id_value)
        if not len(found):
            raise StoreError(f"{self.path}: no document with id {id_value!r}"
                             f"{_id_hint(ids, id_value)}")
        if len(found) > 1 and self.superseded()[found[:-1]].all():
            found = found[-1:]  # earlier rows of the id were superseded by an edit
        if len(found) > 1:
            rows = ", ".join(str(r) for r in found[:5]) + (", ..." if len(found) > 5 else "")
            raise StoreError(f"{self.path}: id {id_value!r} is ambiguous: it names "
                             f"{len(found)} rows ({rows}); select by row number instead")
        return int(found[0])

    def tokens(self, view: str, id: object = None, *, row: int | None = None) -> TokenVectors:
        """One document's tokens, offsets and (n, D) vectors of token view `view`, by its id
        (`store.tokens("tok", 48134)`: the value of the job's id column, whatever its type)
        or by its row number, named (`store.tokens("tok", row=0)`): an integer id is never
        taken for a row. Special tokens are not stored; tokens cut off by
        `chunking.strategy: truncate` are not either.
        """
        if self.token_dataset is None or view not in self.token_views:
            raise StoreError(f"{self.path}: no token view {view!r}; token views: "
                             f"{', '.join(self.token_views) or 'none (pooling: tokens)'}")
        at = self._document(id, row)
        start = int(self.docs["token_offset"][at])  # reads one block, not the column
        count = int(self.docs["token_count"][at])
        part = self.token_dataset.isel(piece=slice(start, start + count))
        frame = pd.DataFrame({k: np.asarray(part[k].values) for k in TOKEN_FIELDS})
        return TokenVectors(at, view, frame, np.asarray(part[view].values))

    def token_span_vectors(self, view: str, id: object = None, *, start: int, end: int,
                           row: int | None = None) -> TokenVectors:
        """The tokens of one document (by id, or `row=`) that overlap the character span
        [start, end) (a token overlaps when token.start < end and token.end > start)."""
        if end < start:
            raise StoreError(f"span: end {end} is before start {start}")
        every = self.tokens(view, id, row=row)
        inside = ((every.frame["start"] < end) & (every.frame["end"] > start)).to_numpy()
        return TokenVectors(every.row, view, every.frame[inside].reset_index(drop=True),
                            every.vectors[inside])

    def _document(self, id_value: object, row: int | None) -> int:
        """The row meant: by id, or by the row number given as `row=` (never both)."""
        if id_value is None and row is None:
            raise StoreError("give a document's id (store.tokens(view, 48134)) or its row "
                             "number as row= (store.tokens(view, row=0))")
        if id_value is not None and row is not None:
            raise StoreError(f"give the document's id ({id_value!r}) or row={row}, not both")
        if row is None:
            return self.row_of(id_value)
        n = int(self.docs.sizes["doc"])
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) \
                or not 0 <= row < n:
            raise StoreError(f"{self.path}: row={row!r} is not a row number of this store "
                             f"(0..{n - 1}); for a document by its id, pass the id itself "
                             "(without row=)")
        return int(row)

    def chunk_texts(self, row: int, text: str | None = None) -> pd.DataFrame:
        """One document's chunks with their text and vectors, in document order.

        Columns: seq, start, end, n_tokens, text, and one column per view (a vector per
        cell). The document text is `text` when given, else read from the job's input.
        """
        chunks = self.level("chunks")
        doc = np.asarray(chunks["doc"].values)
        lo, hi = np.searchsorted(doc, [row, row + 1])  # chunks are stored in row order
        if text is None:
            text = document_text(self, row)
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


def _id_hint(ids: np.ndarray, wanted: object) -> str:
    """Why an id was not found when it is there as another type, and that row= exists."""
    hint = ""
    if len(ids) and str(wanted) in {str(v) for v in ids}:  # the id, as another type
        sample = ids[0].item() if isinstance(ids[0], np.generic) else ids[0]
        text = isinstance(sample, str)
        hint = (f"; this store's ids are {'text' if text else 'numbers'} (e.g. {sample!r}): "
                f"pass {str(wanted)!r}" if text else f"; this store's ids are numbers "
                f"(e.g. {sample!r}): pass {wanted}")
    if isinstance(wanted, (int, np.integer)) and not isinstance(wanted, bool):
        hint += f" (looked up as an id; for the document at row {wanted}, pass row={wanted})"
    return hint


def open_store(path: str | Path, require_complete: bool = True,
               storage_options: dict[str, Any] | None = None,
               version: int | str | None = None, dask: bool = True) -> Store:
    """Open a complete bertpipe store (Zarr, Parquet, Icechunk or Delta) lazily, from a
    local folder or an fsspec URL (`s3://bucket/out/reviews.zarr`: credentials from the
    environment, or `storage_options`, e.g. {"endpoint_url": ..., "key":
    "${AWS_ACCESS_KEY_ID}"}). `version`: an earlier version an Icechunk or Delta store keeps
    (`bertpipe inspect` lists them; `"1"` reads as 1); the current one when not given.
    Arrays are dask arrays; `dask=False` reads a Zarr or Icechunk store's arrays with
    xarray's own lazy indexing instead (no dask import: quicker for a script that reads a
    few columns once)."""
    data = open_store_data(path, require_complete, storage_options, version, dask)
    return Store(data.path, data.fmt, data.provenance, data.docs, data.chunks,
                 data.token_dataset)
