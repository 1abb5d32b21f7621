"""Token views against pooled views on the sample reviews: speed and bytes stored.

Whole `bertpipe extract` processes on the same reviews (data/, the real model, dtype auto,
the job's default partitioning): a pooled `mean` view and a `tokens` view, each into a
Zarr and into a Parquet store. Runtime auto runs both views on OpenVINO (where it is
installed); the pooled view on torch is a case too. Every
job runs once, untimed, before the rounds (exports made, caches warm). Each round runs
every case once, the order reversed every other round; the table gives medians of wall
time, tokens/s (wall) and tokens per CPU-second (user + system time of the process,
steadier on a shared machine), then each token case against its format's pooled cases.

Sizes are read from the finished stores: bytes on disk of the vectors alone (the view's
array in Zarr, its column chunks in Parquet) and of the whole store folder, divided by the
tokens stored (token view) or by the rows (pooled view).

    python benchmarks/tokens.py [--rows 600] [--reps 3] [--cases CASE ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import (  # noqa: E402
    BIN,
    WORK,
    Proc,
    build_input,
    input_table,
    load,
    progress,
    run_process,
    write_job,
)

POOLED = {"mean": {"pooling": "mean"}}
TOKENS = {"tok": {"pooling": "tokens"}}
# name -> (format, runtime, views). Runtime auto picks OpenVINO for both views where it is
# installed: token against pooled on the same runtime is the cost of the tokens themselves;
# the pooled view on torch gives the runtime's share. Ratios are against BASELINES.
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "zarr, pooled": ("zarr", "auto", POOLED),
    "zarr, pooled torch": ("zarr", "torch", POOLED),
    "zarr, tokens": ("zarr", "auto", TOKENS),
    "parquet, pooled": ("parquet", "auto", POOLED),
    "parquet, pooled torch": ("parquet", "torch", POOLED),
    "parquet, tokens": ("parquet", "auto", TOKENS),
}
BASELINES = {"zarr, tokens": ["zarr, pooled", "zarr, pooled torch"],
             "parquet, tokens": ["parquet, pooled", "parquet, pooled torch"]}


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py)."""
    return {f"{rows} rows": input_table(rows).column("text").to_pylist()}


@dataclass
class Sizes:
    units: int  # tokens stored (token view) or rows (pooled view)
    width: int  # D, the view's vector length
    vector_bytes: int  # the view's vectors on disk
    store_bytes: int  # the whole store folder on disk
    tokens_encoded: int  # tokens through the model (special tokens and overlap included)


def job_for(name: str, source: Path, fmt: str, runtime: str, views: dict[str, Any]) -> Path:
    slug = "tokens-" + "".join(c if c.isalnum() else "-" for c in name).replace("--", "-")
    path = write_job(slug, source, runtime, "auto", views)
    job = yaml.safe_load(path.read_text())
    job["output"].update({"format": fmt, "path": str(WORK / f"{slug}.{fmt}")})
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def output_of(job: Path) -> Path:
    return Path(yaml.safe_load(job.read_text())["output"]["path"])


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def parquet_column_bytes(folder: Path, column: str) -> int:
    """Compressed bytes of `column`'s chunks (a list column: its leaf) in every part file."""
    total = 0
    for part in sorted(folder.glob("*.parquet")):
        meta = pq.read_metadata(part)
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for c in range(group.num_columns):
                chunk = group.column(c)
                if chunk.path_in_schema.split(".")[0] == column:
                    total += chunk.total_compressed_size
    return total


def store_sizes(job: Path, fmt: str, view: str) -> Sizes:
    import pipeline

    out = output_of(job)
    store = pipeline.open_store(out)
    level = "tokens" if view in store.token_views else "docs"
    data = store.token_dataset if level == "tokens" else store.docs
    assert data is not None  # the job has this view: the store has its level
    units = int(data.sizes["piece" if level == "tokens" else "doc"])
    width = int(data[view].shape[1])
    if fmt == "zarr":
        vectors = folder_bytes(out / level / view)
    else:
        vectors = parquet_column_bytes(out / level, view)
    return Sizes(units, width, vectors, folder_bytes(out),
                 int(store.provenance.stats["tokens_encoded"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                    metavar="CASE", help=f"a subset of: {'; '.join(CASES)}")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    source = build_input(args.rows, f"reviews-{args.rows}")
    jobs = {name: job_for(name, source, *CASES[name]) for name in args.cases}
    progress(f"{args.rows} reviews, {len(jobs)} cases, {args.reps} rounds "
             f"(load average {load():.1f})")
    for job in jobs.values():  # exports made once and the caches warm, not timed
        run_process([sys.executable, str(Path(__file__).parent / "first_batch.py"),
                     str(job)])
    runs: dict[str, list[Proc]] = {name: [] for name in jobs}
    loads = [load()]
    for rep in range(args.reps):
        order = list(jobs) if rep % 2 == 0 else list(jobs)[::-1]
        for name in order:
            cmd = [str(BIN / "bertpipe"), "extract", "--overwrite", str(jobs[name])]
            runs[name].append(run_process(cmd))
        loads.append(load())
        progress(f"round {rep + 1}/{args.reps} done (load average {loads[-1]:.1f})")

    sizes = {name: store_sizes(job, CASES[name][0], next(iter(CASES[name][2])))
             for name, job in jobs.items()}
    wall = {name: statistics.median(p.wall for p in procs) for name, procs in runs.items()}
    cpu = {name: statistics.median(p.cpu for p in procs) for name, procs in runs.items()}
    rss = {name: statistics.median(p.rss for p in procs) for name, procs in runs.items()}
    encoded = next(iter(sizes.values())).tokens_encoded
    print(f"\n{args.rows} reviews, {encoded:,} tokens encoded (special tokens included); "
          f"medians of {args.reps} whole processes; load average "
          f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs")
    print(f"{'case':<23}{'wall s':>8}{'tok/s':>8}{'tok/CPU-s':>10}{'RSS MiB':>9}{'stored':>8}"
          f"{'D':>5}{'vector B':>9}{'store B':>9}{'store MiB':>10}")
    for name, size in sizes.items():
        unit = "token" if CASES[name][2] is TOKENS else "row"
        print(f"{name:<23}{wall[name]:>8.1f}{size.tokens_encoded / wall[name]:>8,.0f}"
              f"{size.tokens_encoded / cpu[name]:>10,.0f}{rss[name]:>9,.0f}{size.units:>8,}"
              f"{size.width:>5}{size.vector_bytes / size.units:>9,.0f}"
              f"{size.store_bytes / size.units:>9,.0f}{size.store_bytes / 2**20:>10.1f}"
              f"  (bytes per {unit}; raw float32 vector {size.width * 4:,})")
    print("token view against pooled, medians: time (wall, CPU), peak RSS, store size")
    for name, baselines in BASELINES.items():
        for base in (b for b in baselines if name in jobs and b in jobs):
            print(f"  {name} / {base}: wall {wall[name] / wall[base]:.2f}x, "
                  f"CPU {cpu[name] / cpu[base]:.2f}x, RSS {rss[name] - rss[base]:+,.0f} MiB, "
                  f"store {sizes[name].store_bytes / sizes[base].store_bytes:,.0f}x")

if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'Token views against pooled views'):
        main()
