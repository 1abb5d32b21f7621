"""The same job with its input and store on an S3 endpoint on loopback (moto in server mode)
and on local disk: tokens/s of each (the run's own figure, commit included) and the ratio.

    python benchmarks/object_store.py [--rows 1200] [--partition-rows 200] [--reps 2]

Each round runs every case once, alternating remote and local (the machine is shared:
compare best-of). The loopback endpoint measures what bertpipe adds for an object store
(requests, whole-object writes, the commit reading parts back), not a network.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from run import BIN, MODEL, WORK, build_input, input_table  # noqa: E402

from tests.s3server import environment, make_bucket, moto_server  # noqa: E402

VIEWS = {"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"}}


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py)."""
    return {f"{rows} rows": input_table(rows).column("text").to_pylist()}


def job_file(name: str, source: str, output: str, fmt: str, partition_rows: int) -> Path:
    job = {
        "input": {"path": source, "text_column": "text", "id_column": "id"},
        "model": {"path": str(MODEL), "dtype": "auto", "device": "cpu"},
        "views": VIEWS,
        "output": {"path": output, "format": fmt, "overwrite": True},
        "execution": {"scheduler": "local", "partition_rows": partition_rows},
    }
    path = WORK / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def extract(job: Path, env: dict[str, str]) -> dict[str, float]:
    summary = WORK / f"{job.stem}.summary.json"
    started = time.perf_counter()
    done = subprocess.run([str(BIN / "bertpipe"), "extract", str(job), "--json-summary",
                           str(summary)], capture_output=True, text=True,
                          env={**os.environ, **env})
    if done.returncode != 0:
        raise RuntimeError(f"{job} failed:\n{done.stderr}")
    result = json.loads(summary.read_text())
    return {"tokens_per_s": float(result["tokens_per_second"]),
            "wall_s": time.perf_counter() - started}


def upload(local: Path, url: str) -> None:
    from pipeline.io.location import resolve

    resolve(url).write_bytes(local.read_bytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1200)
    ap.add_argument("--partition-rows", type=int, default=200)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    source = build_input(args.rows, f"reviews-{args.rows}")
    with moto_server() as endpoint:
        env = environment(endpoint)
        os.environ.update(env)
        make_bucket(endpoint, "bench")
        upload(source, f"s3://bench/in/{source.name}")
        cases = {}
        for fmt in ("zarr", "parquet"):
            cases[f"{fmt} local disk"] = job_file(
                f"os-{fmt}-local", str(source), str(WORK / f"os-{fmt}.{fmt}"), fmt,
                args.partition_rows)
            cases[f"{fmt} S3 loopback"] = job_file(
                f"os-{fmt}-s3", "s3://bench/in", f"s3://bench/out/os.{fmt}", fmt,
                args.partition_rows)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
        for _ in range(args.reps):
            for name, job in cases.items():
                results[name].append(extract(job, env))
    print(f"{args.rows} rows, partitions of {args.partition_rows}, MiniLM, views "
          f"{', '.join(VIEWS)}; best of {args.reps} (tokens/s of the run, commit included)")
    best = {name: max(r["tokens_per_s"] for r in runs) for name, runs in results.items()}
    for name, runs in results.items():
        walls = ", ".join(f"{r['wall_s']:.1f}s" for r in runs)
        print(f"  {name:<20} {best[name]:>8,.0f} tokens/s   (process wall {walls})")
    for fmt in ("zarr", "parquet"):
        ratio = best[f"{fmt} S3 loopback"] / best[f"{fmt} local disk"]
        print(f"  {fmt}: S3 / local = {ratio:.3f}")


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'Object store on loopback against local disk'):
        main()
