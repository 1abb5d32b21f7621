"""Search falls back to the exact scan, with one warning, when an index cannot be used."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import pipeline
from pipeline.analysis import index as index_module
from pipeline.analysis.search import top_k
from pipeline.extract.partition import vector_array
from pipeline.stores import Layout, Staging, store_at
from pipeline.stores.provenance import Provenance
from tests.conftest import synthetic_provenance

N, H = 400, 8


def _store(path: Path) -> pipeline.Store:
    rng = np.random.default_rng(0)
    table = pa.table({
        "row": pa.array(np.arange(N)), "id": pa.array(np.arange(N)),
        "n_tokens": pa.array(np.ones(N, np.int64)), "n_chunks": pa.array(np.ones(N, np.int64)),
        "truncated": pa.array(np.zeros(N, bool)), "status": pa.array(["ok"] * N),
        "v": vector_array(rng.normal(size=(N, H)), "float32")})
    staging = Staging(path)
    staging.begin({"run_fingerprint": "synthetic"})
    staging.write_tables(0, {"docs": table})
    fmt = store_at(str(path), "zarr")
    fmt.create({"complete": False})
    raw = synthetic_provenance(path, {"v": {"pooling": "mean"}})
    fmt.commit(staging, Layout([0], N, 0, False), Provenance.from_dict(raw, str(path)))
    return pipeline.open_store(path)


def test_index_without_faiss_falls_back_to_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("faiss")
    store = _store(tmp_path / "s.zarr")
    index_module.build_index(store, "v")
    queries = np.random.default_rng(1).normal(size=(3, H))
    exact = top_k(store, queries, "v", k=5, exact=True)
    real_find_spec = index_module.importlib.util.find_spec
    monkeypatch.setattr(index_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "faiss" else real_find_spec(name, *a))
    with caplog.at_level(logging.WARNING):
        found = top_k(store, queries, "v", k=5)
    assert [[h.row for h in q] for q in found] == [[h.row for h in q] for q in exact]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "FAISS is not installed; searching exactly" in warnings[0]
