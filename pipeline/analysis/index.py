"""An approximate nearest-neighbour index beside a store, for stores too large to scan.

`bertpipe index STORE --view V` builds a FAISS inverted-file index (inner product on unit
vectors = cosine) from the view, streaming it in blocks, and saves it as
`<store>/index/<level>-<view>.faiss` with a JSON sidecar naming the view, level, row
count and the store's run fingerprint. Search uses it when present and still matching
the store; `exact=True` scans instead. FAISS is an optional dependency (`pip install
bertpipe[index]`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BertpipeError, OptionError, StoreError
from ..fileutil import write_json_atomic
from ..io.location import is_url
from ..post.geometry import unit_rows
from ..stores.opened import StoreData as Store

BLOCK_ROWS = 65536
log = logging.getLogger(__name__)


def _faiss() -> Any:
    try:
        import faiss
    except ImportError:
        raise BertpipeError("bertpipe index needs FAISS: pip install 'bertpipe[index]' "
                            "(faiss-cpu)") from None
    return faiss


def index_paths(store: Store, view: str, level: str) -> tuple[Path, Path]:
    base = Path(store.path) / "index" / f"{level}-{view}"
    return base.with_suffix(".faiss"), base.with_suffix(".json")


def build_index(store: Store, view: str, level: str = "docs", nprobe: int = 16,
                seed: int = 0) -> Path:
    """Train on a sample, then add every finite row in blocks under its row number (empty
    documents, whose vectors are NaN, are left out and so never returned)."""
    if nprobe < 1:
        raise OptionError(f"--nprobe: {nprobe}; scan at least 1 list per query")
    if is_url(store.path):
        raise StoreError(f"{store.path}: an index is a local FAISS file beside the store; copy "
                         "the store to a local folder to index it (search on a remote store "
                         "scans it exactly)")
    faiss = _faiss()
    data = store.docs if level == "docs" else store.chunks
    if data is None or view not in data:
        raise StoreError(f"--view: {view!r} is not stored at level {level} in {store.path}")
    array = data[view].data
    n, dim = array.shape
    nlist = max(1, min(int(4 * math.sqrt(n)), n // 39))  # FAISS wants >= 39 points a list
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(n, size=min(n, max(nlist * 64, 10000)), replace=False))
    train = unit_rows(np.asarray(array[sample], dtype=np.float32))
    index.train(train[np.isfinite(train).all(axis=1)])
    for start in range(0, n, BLOCK_ROWS):
        block = unit_rows(np.asarray(array[start : start + BLOCK_ROWS], dtype=np.float32))
        finite = np.isfinite(block).all(axis=1)
        rows = np.arange(start, start + len(block), dtype=np.int64)
        index.add_with_ids(block[finite], rows[finite])
    index.nprobe = min(nprobe, nlist)
    path, meta = index_paths(store, view, level)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    faiss.write_index(index, str(tmp))
    tmp.replace(path)
    write_json_atomic(meta, {"view": view, "level": level, "rows": n, "nlist": nlist,
                             "nprobe": index.nprobe, "kind": "faiss IVF-flat, inner product",
                             "run_fingerprint": store.provenance.run_fingerprint,
                             "version": store.provenance.version})
    return path


def load_index(store: Store, view: str, level: str) -> Any | None:
    """The saved index for this view, or None when absent or built from other data."""
    if is_url(store.path):
        return None  # indexes are built on local stores only
    path, meta = index_paths(store, view, level)
    if not path.exists() or not meta.exists():
        return None
    info = json.loads(meta.read_text())
    data = store.docs if level == "docs" else store.chunks
    size = data.sizes["doc" if level == "docs" else "chunk"] if data is not None else -1
    if info.get("run_fingerprint") != store.provenance.run_fingerprint or \
            info.get("rows") != size or info.get("version", 0) != store.provenance.version:
        return None  # built from other data: an incremental update changes rows in place
    if importlib.util.find_spec("faiss") is None:
        # why not an error: the exact scan gives the same (or better) answer, only slower
        log.warning("%s has an index but FAISS is not installed; searching exactly "
                    "(pip install 'bertpipe[index]' to use the index)", path)
        return None
    return _read_index(str(path), path.stat().st_mtime_ns, int(info.get("nprobe", 16)))


@functools.lru_cache(maxsize=4)
def _read_index(path: str, mtime_ns: int, nprobe: int) -> Any:
    """Loaded once per process (an index of 1M x 384 is 1.5 GB to read)."""
    index = _faiss().read_index(path)
    index.nprobe = nprobe
    return index


def index_search(index: Any, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows), each (Q, k); a row of -1 means fewer than k candidates were found."""
    scores, rows = index.search(unit_rows(np.asarray(queries, dtype=np.float32)), k)
    return scores, rows

