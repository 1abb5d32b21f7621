"""Dask scaling on this machine: the same job in-process, on a local cluster with one
worker using every core, and with one worker per core; plus the local cluster's fixed
start-up cost (the same comparison on a 10-row input).

    python benchmarks/scaling.py [--rows 2400] [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import BIN, build_input, count_tokens, input_table, run_process, write_job  # noqa: E402

CORES = os.cpu_count() or 1
SETUPS = {
    "in-process (synchronous)": {"scheduler": "synchronous"},
    f"local, 1 worker x {CORES} threads": {"scheduler": "local", "workers": 1,
                                            "threads_per_worker": CORES},
    f"local, {CORES} workers x 1 thread": {"scheduler": "local", "workers": CORES,
                                            "threads_per_worker": 1},
}


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py)."""
    return {f"{n} rows": input_table(n).column("text").to_pylist() for n in (10, rows)}


def jobs_for(rows: int) -> dict[str, Path]:
    source = build_input(rows, f"reviews-{rows}")
    out = {}
    for i, (name, execution) in enumerate(SETUPS.items()):
        path = write_job(f"scaling-{rows}-{i}", source, "auto", "auto",
                         {"mean": {"pooling": "mean"}}, partition_rows=max(10, rows // 8))
        job = yaml.safe_load(path.read_text())
        job["execution"].update(execution)
        path.write_text(yaml.safe_dump(job, sort_keys=False))
        out[name] = path
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=2400)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    for rows in (10, args.rows):
        jobs = jobs_for(rows)
        tokens = count_tokens(build_input(rows, f"reviews-{rows}"))
        walls: dict[str, list[float]] = {name: [] for name in jobs}
        for _ in range(args.reps):
            for name, job in jobs.items():
                walls[name].append(run_process([str(BIN / "bertpipe"), "extract", str(job)]).wall)
        base = statistics.median(walls["in-process (synchronous)"])
        print(f"{rows} rows, {tokens} tokens (median of {args.reps}):")
        for name, values in walls.items():
            wall = statistics.median(values)
            print(f"  {name:<32} {wall:6.1f}s  {tokens / wall:>8,.0f} tokens/s  "
                  f"{wall - base:+5.1f}s vs in-process")


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'Dask: local cluster against in-process'):
        main()
