"""Incremental update against a full run: a store of N distinct reviews, then the table
grows by 1%.

    python benchmarks/incremental.py [--rows 10000] [--grow 0.01] [--format icechunk]

Each step is a whole `bertpipe extract` process, as a scheduled job runs it:

  1. full run over N rows (makes the store)
  2. the table grows by 1%: `--incremental` (encodes the new rows, copies the rest)
  3. the same again with nothing new (start-up and the input's identity only)
  4. full run over the grown table into a new store (what the job costs without it)

Prints the wall times, full / incremental, and the largest difference between the two
stores' vectors, matched by id. Texts are distinct reviews (benchmarks/texts.py: the 600
samples, then each again with a copy number appended), so that no two rows share a text
(identical texts are encoded once).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import BIN, MODEL, WORK, run_process  # noqa: E402
from texts import distinct_reviews, review_labels  # noqa: E402


def input_table(rows: int) -> pa.Table:
    """The grown table: `rows` distinct reviews, their labels, fresh ids."""
    return pa.table({"id": pa.array(np.arange(rows, dtype=np.int64)),
                     "text": distinct_reviews(rows), "label": review_labels(rows)})


def added_rows(rows: int, grow: float) -> int:
    return max(1, round(rows * grow))


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py)."""
    table = input_table(rows + added_rows(rows, 0.01))
    return {"store": table.slice(0, rows).column("text").to_pylist(),
            "grown": table.column("text").to_pylist()}


def write_job(name: str, source: Path, fmt: str) -> Path:
    job = {
        "input": {"path": str(source), "text_column": "text", "id_column": "id",
                  "carry_columns": ["label"]},
        "model": {"path": str(MODEL), "dtype": "auto", "device": "cpu"},
        "chunking": {"strategy": "hierarchical"},
        "views": {"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"}},
        "output": {"path": str(WORK / f"{name}.{fmt}"), "format": fmt},
        "execution": {"scheduler": "synchronous", "partition_rows": 2048},
    }
    path = WORK / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def extract(job: Path, *flags: str) -> tuple[float, str]:
    proc = run_process([str(BIN / "bertpipe"), "--quiet", "extract", str(job), *flags])
    lines = [ln for ln in proc.output if ln.strip() and not ln.startswith("wrote ")]
    return proc.wall, lines[-1]  # the summary line


def largest_difference(a: Path, b: Path) -> float:
    import pipeline  # imports torch: only after every timed run

    got, want = pipeline.open_store(a), pipeline.open_store(b)
    rows = {key: i for i, key in enumerate(np.asarray(got.docs["id"].values).tolist())}
    at = np.array([rows[key] for key in np.asarray(want.docs["id"].values).tolist()])
    return max(float(np.nanmax(np.abs(got.vectors(v)[at] - want.vectors(v))))
               for v in ("mean", "cls"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--grow", type=float, default=0.01)
    ap.add_argument("--format", default="icechunk", choices=["icechunk", "parquet"])
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    added = added_rows(args.rows, args.grow)
    table = input_table(args.rows + added)
    source = WORK / "incremental-input.parquet"
    grown_source = WORK / "incremental-grown.parquet"
    pq.write_table(table.slice(0, args.rows), source)
    pq.write_table(table, grown_source)
    store_job = write_job("incremental-store", source, args.format)
    full_job = write_job("incremental-full", grown_source, args.format)
    for name in ("incremental-store", "incremental-full"):
        shutil.rmtree(WORK / f"{name}.{args.format}", ignore_errors=True)

    first, _ = extract(store_job)
    print(f"1. full run, {args.rows} rows: {first:.1f}s")
    shutil.copyfile(grown_source, source)  # the table grows in place
    update, line = extract(store_job, "--incremental")
    print(f"2. incremental, +{added} rows: {update:.1f}s\n   {line}")
    noop, line = extract(store_job, "--incremental")
    print(f"3. incremental, nothing new: {noop:.1f}s\n   {line}")
    full, _ = extract(full_job)
    print(f"4. full run, {args.rows + added} rows: {full:.1f}s")
    print(f"full / incremental: {full / update:.1f}x; full / nothing new: {full / noop:.1f}x")
    diff = largest_difference(WORK / f"incremental-store.{args.format}",
                              WORK / f"incremental-full.{args.format}")
    print(f"largest |difference| between the stores' vectors, by id: {diff:.2e}")


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'Incremental runs'):
        main()
