"""Similarity search over a store: queries encoded exactly as the store's rows were.

The query goes through the same model, chunking, view and post-processing recorded in
the store's provenance. Exact search streams the store in row blocks (bounded memory) and
keeps a running top-k per query; cosine similarity throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import OptionError, StoreError
from ..extract.modelfiles import model_fingerprint
from ..extract.source import find_row, read_text
from ..extract.texthash import text_sha256
from ..post.apply import load_transform
from ..post.geometry import unit_rows
from ..stores.opened import StoreData as Store
from ..stores.opened import current_rows

BLOCK_ROWS = 65536


@dataclass(frozen=True)
class Hit:
    row: int  # document row
    id: object
    score: float
    chunk: int | None = None  # chunk index when searching chunks
    span: tuple[int, int] | None = None  # character span of the chunk


class QueryEncoder:
    """Encodes texts into a store's view: its job, model and post-processing."""

    def __init__(self, store: Store, view: str):
        if view in store.token_views:
            raise StoreError(f"--view: {view!r} is a token view (pooling: tokens): it has no "
                             f"document vectors to search; views: {', '.join(store.views)}")
        if view not in store.views:
            raise StoreError(f"--view: {view!r} is not a view of {store.path}; views: "
                             f"{', '.join(store.views)}")
        job = store.provenance.job
        source = store.provenance.source_view(view)
        recorded = store.provenance.model.weights_sha256
        if model_fingerprint(job.model.path)["weights_sha256"] != recorded:
            raise StoreError(f"model.path: the weights at {job.model.path} differ from those "
                             f"that made {store.path}; queries would not be comparable")
        job = replace(job, views=(job.view(source),),
                      execution=replace(job.execution, scheduler="synchronous"))
        self.source = source
        self.transform = load_transform(store, view)
        from ..extract.partition import Extractor  # why here: it imports torch (seconds);
        # `import pipeline` and the commands that never encode a query do not need it

        self.extractor = Extractor(job)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        vectors = self.extractor.encode_texts(list(texts)).docs[self.source]
        return self.transform.apply(vectors) if self.transform else vectors


def top_k(store: Store, queries: np.ndarray, view: str, k: int = 10, level: str = "docs",
          exact: bool = False) -> list[list[Hit]]:
    """Cosine top-k for each query row over `view` at `level`: through the view's saved
    index when there is one (and `exact` is false), else an exact streamed scan."""
    if k < 1:
        raise OptionError(f"-k: {k} hits asked for; ask for at least 1")
    if not exact:
        from .index import load_index

        index = load_index(store, view, level)
        if index is not None:
            return _indexed_top_k(store, index, queries, k, level)
    return exact_top_k(store, queries, view, k, level)


def _indexed_top_k(store: Store, index: Any, queries: np.ndarray, k: int,
                   level: str) -> list[list[Hit]]:
    """Top-k through a saved index, leaving out rows an edit superseded: the index is
    asked for k hits, then twice as many while superseded ones leave a query short (they
    may be a tenth of the store: asking for all of them at once would cost every query)."""
    from .index import index_search

    left_out = store.superseded(level)
    most = k + int(left_out.sum())
    ask = k
    while True:
        scores, rows = index_search(index, queries, ask)
        kept = [(r >= 0) & ~left_out[np.maximum(r, 0)] for r in rows]
        if ask >= most or all(int(keep.sum()) >= k for keep in kept):
            return [_hits(store, r[keep][:k], s[keep][:k], level)
                    for r, s, keep in zip(rows, scores, kept, strict=True)]
        ask = min(2 * ask, most)


def exact_top_k(store: Store, queries: np.ndarray, view: str, k: int = 10,
                level: str = "docs") -> list[list[Hit]]:
    """Exact cosine top-k, streaming the store in row blocks (bounded memory); rows an
    edit superseded are left out."""
    data = store.docs if level == "docs" else store.chunks
    if data is None:
        raise StoreError(f"{store.path}: chunk vectors were not stored (output.levels)")
    array = data[view].data
    left_out = store.superseded(level)
    q = unit_rows(np.asarray(queries, dtype=np.float64))  # (Q, D)
    best_scores = np.full((len(q), 0), -np.inf)
    best_rows = np.zeros((len(q), 0), dtype=np.int64)
    for start in range(0, array.shape[0], BLOCK_ROWS):
        block = unit_rows(np.asarray(array[start : start + BLOCK_ROWS], dtype=np.float64))
        scores = np.nan_to_num(q @ block.T, nan=-np.inf)  # (Q, B): empty rows never match
        scores[:, left_out[start : start + len(block)]] = -np.inf
        rows = np.broadcast_to(np.arange(start, start + len(block)), scores.shape)
        best_scores = np.concatenate([best_scores, scores], axis=1)
        best_rows = np.concatenate([best_rows, rows], axis=1)
        if best_scores.shape[1] > k:
            keep = np.argpartition(-best_scores, k - 1, axis=1)[:, :k]
            best_scores = np.take_along_axis(best_scores, keep, axis=1)
            best_rows = np.take_along_axis(best_rows, keep, axis=1)
    order = np.argsort(-best_scores, axis=1, kind="stable")
    best_scores = np.take_along_axis(best_scores, order, axis=1)
    best_rows = np.take_along_axis(best_rows, order, axis=1)
    return [_hits(store, rows, scores, level) for rows, scores in zip(best_rows, best_scores,
                                                                       strict=True)]


def search(store: Store, texts: Sequence[str], view: str | None = None, k: int = 10,
           level: str = "docs", exact: bool = False) -> list[list[Hit]]:
    if k < 1:
        raise OptionError(f"-k: {k} hits asked for; ask for at least 1")
    blank = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
    if blank:
        raise OptionError(f"query {blank[0]}: the query text is empty")
    if view is None and not store.views:
        raise StoreError(f"{store.path}: no document vectors to search (token views only: "
                         f"{', '.join(store.token_views)}); add a pooled view to the job")
    view = view or store.views[0]
    return top_k(store, QueryEncoder(store, view).encode(texts), view, k, level, exact)


def snippet(store: Store, hit: Hit, width: int = 120) -> str:
    """The hit's text (its chunk's span, for chunk hits) from a carried text column or
    the job's input table; empty when neither is available."""
    spec = store.provenance.job.input
    try:
        if spec.text_column in store.docs:
            value = np.asarray(store.docs[spec.text_column][hit.row].values).item()
            text = "" if value is None else str(value)  # a null text is carried as None
        else:
            text = document_text(store, hit.row)
    except Exception:  # noqa: BLE001 - the input may have moved; the hit stands without it
        return ""
    if hit.span is not None:
        text = text[hit.span[0] : hit.span[1]]
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def document_text(store: Store, row: int) -> str:
    """The text a store row was made from, read from the job's input: by row number in a
    store never updated (its rows are in input order), else by id. Refused when the input's
    text is no longer the one the row was encoded from."""
    spec = store.provenance.job.input
    if store.provenance.version == 0:
        text = read_text(spec, row)
    else:  # an update keeps rows where they were and appends new ones: find it by id
        key = np.asarray(store.docs["id"][row].values).item()
        text = read_text(spec, find_row(spec, key))
    if "text_sha256" in store.docs:
        stored = np.asarray(store.docs["text_sha256"][row].values).item()
        if text_sha256([text])[0] == stored:
            return text
        if store.superseded()[row]:
            ids = np.asarray(store.docs["id"].values)
            current = int(current_rows(ids, ids[row : row + 1])[0])
            raise StoreError(f"{store.path}: row {row} holds a text an edit superseded (its "
                             f"id's current row is {current}); that text is no longer in "
                             "the input")
        raise StoreError(f"{store.path}: the input's text of row {row} is not the one it "
                         "was encoded from (the input changed since); rerun the job, e.g. "
                         "with --incremental")
    return text


def _hits(store: Store, rows: np.ndarray, scores: np.ndarray, level: str) -> list[Hit]:
    keep = np.isfinite(scores)
    rows, scores = rows[keep], scores[keep]
    if level == "docs":
        ids = _take(store.docs["id"], rows)
        return [Hit(int(r), _py(i), float(s)) for r, i, s in zip(rows, ids, scores, strict=True)]
    assert store.chunks is not None
    docs, starts, ends = (_take(store.chunks[k], rows) for k in ("doc", "start", "end"))
    ids = _take(store.docs["id"], docs.astype(np.int64))
    return [Hit(int(d), _py(i), float(s), int(r), (int(a), int(b)))
            for r, d, i, s, a, b in zip(rows, docs, ids, scores, starts, ends, strict=True)]


def _py(value: Any) -> Any:
    """numpy scalar -> Python value (ids print and compare like the input's)."""
    return value.item() if isinstance(value, np.generic) else value


def _take(variable: Any, rows: np.ndarray) -> np.ndarray:
    """Values at `rows` in one read (rows sorted for the read, then put back in order)."""
    if len(rows) == 0:
        return np.asarray([])
    order = np.argsort(rows)
    values = np.asarray(variable.isel({variable.dims[0]: rows[order]}).values)
    out = np.empty_like(values)
    out[order] = values
    return out
