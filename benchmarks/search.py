"""Search latency: exact streamed scan against the FAISS index, on the sample store and on
a synthetic store of 1M x 384 vectors (written through the real staging + commit path).

    python benchmarks/search.py [--store out/reviews.zarr] [--rows 1000000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REPO, WORK  # noqa: E402

PART_ROWS = 65536
SAMPLE_JOB = REPO / "jobs" / "reviews.yaml"  # `make demo` makes the sample store from it


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input behind this benchmark's stores: the sample store's (the demo job's
    input; the synthetic store has vectors and no texts)."""
    spec = yaml.safe_load(SAMPLE_JOB.read_text())["input"]
    path = REPO / spec["path"]
    return {"sample store": pq.read_table(path, columns=[spec["text_column"]])
            .column(spec["text_column"]).to_pylist()}


def synthetic_store(path: Path, rows: int, dim: int = 384, seed: int = 0) -> Path:
    """Clustered random vectors (so neighbours exist), committed part by part."""
    import pipeline
    from pipeline.extract.partition import vector_array
    from pipeline.stores import Layout, Staging, store_at
    from pipeline.stores.provenance import Provenance

    if path.exists():
        try:
            if pipeline.open_store(path).docs.sizes["doc"] == rows:
                return path
        except pipeline.errors.StoreError:
            pass
        import shutil

        shutil.rmtree(path)
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(1000, dim)).astype(np.float32)
    staging = Staging(path)
    staging.begin({"run_fingerprint": "synthetic"})
    indices = []
    for i, start in enumerate(range(0, rows, PART_ROWS)):
        n = min(PART_ROWS, rows - start)
        x = centers[rng.integers(0, len(centers), n)] + rng.normal(size=(n, dim)) * 0.5
        table = pa.table({
            "row": pa.array(np.arange(start, start + n)), "id": pa.array(np.arange(start,
                                                                                   start + n)),
            "n_tokens": pa.array(np.ones(n, np.int64)), "n_chunks": pa.array(np.ones(n,
                                                                                     np.int64)),
            "truncated": pa.array(np.zeros(n, bool)), "status": pa.array(["ok"] * n),
            "v": vector_array(x.astype(np.float32), "float32")})
        staging.write_tables(i, {"docs": table})
        indices.append(i)
    provenance = {"complete": True, "format_version": 1, "run_fingerprint": "synthetic",
                  "job": {"input": {"path": str(path.parent / "none.parquet"),
                                    "text_column": "text"},
                          "model": {"path": "synthetic/none"},
                          "views": {"v": {"pooling": "mean"}}, "output": {"path": str(path)}},
                  "model": {"path": "synthetic/none", "weights_sha256": {}, "config": {}},
                  "versions": {}, "device": ["cpu"], "dtype": ["float32"],
                  "created": "2026-01-01T00:00:00+00:00", "stats": {}}
    fmt = store_at(str(path), "zarr")
    fmt.create({"complete": False})
    fmt.commit(staging, Layout(indices, rows, 0, False),
               Provenance.from_dict(provenance, str(path)))
    staging.remove()
    return path


def latency(store_path: Path, view: str, queries: np.ndarray, k: int = 10) -> dict[str, float]:
    import pipeline
    from pipeline.analysis.index import build_index, index_paths
    from pipeline.analysis.search import top_k

    store = pipeline.open_store(store_path)
    for p in index_paths(store, view, "docs"):
        p.unlink(missing_ok=True)
    times, truths = [], []
    for q in queries:
        start = time.perf_counter()
        exact = top_k(store, q[None], view, k, exact=True)[0]
        times.append(time.perf_counter() - start)
        truths.append({h.row for h in exact})
    start = time.perf_counter()
    build_index(store, view)
    build = time.perf_counter() - start
    index_times, recalls = [], []
    for q, truth in zip(queries, truths, strict=True):
        start = time.perf_counter()
        approx = top_k(store, q[None], view, k)[0]
        index_times.append(time.perf_counter() - start)
        recalls.append(len(truth & {h.row for h in approx}) / k)
    return {"rows": store.docs.sizes["doc"], "exact_ms": 1000 * statistics.median(times),
            "index_ms": 1000 * statistics.median(index_times), "build_s": build,
            "recall": float(np.mean(recalls))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--store", default="out/reviews.zarr")
    ap.add_argument("--view", default="mean")
    ap.add_argument("--rows", type=int, default=1_000_000)
    args = ap.parse_args()
    import pipeline

    rng = np.random.default_rng(1)
    sample = pipeline.open_store(args.store)
    vectors = sample.vectors(args.view)
    queries = vectors[rng.choice(len(vectors), 5, replace=False)] + rng.normal(
        size=(5, vectors.shape[1])) * 0.01
    print(f"{'store':<34}{'rows':>10}{'exact':>10}{'index':>10}{'build':>9}{'recall@10':>11}")
    for name, path, view, q in [
        (args.store, Path(args.store), args.view, queries),
        (f"synthetic {args.rows}x384", synthetic_store(WORK / "synthetic.zarr", args.rows),
         "v", rng.normal(size=(5, 384))),
    ]:
        r = latency(path, view, q)
        print(f"{name:<34}{r['rows']:>10}{r['exact_ms']:>8.1f}ms{r['index_ms']:>8.1f}ms"
              f"{r['build_s']:>8.1f}s{r['recall']:>11.2f}")


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'Search latency: exact scan against the FAISS index'):
        main()
