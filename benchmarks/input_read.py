"""Reading the input in partitions against reading the table once.

A Parquet reader decodes whole row groups, and writers make them large (pyarrow and pandas
put up to 1Mi rows in one), while bertpipe reads the input in partitions of
`execution.partition_rows` rows. This times, on distinct short texts (benchmarks/texts.py)
written as one row group per file:

    table once        pyarrow's `read_table` of the columns a run reads (the peer: what
                      reading the input cannot beat)
    partitions        every partition through `read_partition` with the reader's row-group
                      cache, as `bertpipe extract` and an incremental run's comparison read
    no cache          the first partitions without the cache (as every partition was read
                      before), extrapolated to all of them

    python benchmarks/input_read.py [--rows 1000000] [--partition-rows 2048] [--reps 3]

CPU model, flags and load average are printed beside the figures; medians of `--reps`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import WORK, cpu_info, load  # noqa: E402
from texts import distinct_sentences  # noqa: E402

from pipeline.extract.source import (  # noqa: E402
    Partition,
    RowGroupCache,
    plan_partitions,
    read_partition,
)
from pipeline.spec import InputSpec  # noqa: E402

SAMPLED = 10  # partitions read without the cache (each decodes the whole row group)


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py)."""
    return {f"{rows} rows": distinct_sentences(rows)}


def build(rows: int) -> Path:
    path = WORK / f"input-read-{rows}.parquet"
    if not path.exists() or pq.read_metadata(path).num_rows != rows:
        WORK.mkdir(parents=True, exist_ok=True)
        texts = distinct_sentences(rows)
        pq.write_table(pa.table({"id": list(range(rows)), "text": texts}), path,
                       row_group_size=rows)
    return path


def seconds(read: Callable[[], object]) -> float:
    start = time.perf_counter()
    read()
    return time.perf_counter() - start


def read_all(spec: InputSpec, parts: list[Partition], cache: RowGroupCache | None) -> None:
    for part in parts:
        read_partition(spec, part, cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--partition-rows", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    path = build(args.rows)
    spec = InputSpec(str(path), "text", id_column="id")
    parts = plan_partitions(spec, args.partition_rows)
    cpu = cpu_info()
    print(f"{cpu['model']} ({', '.join(cpu['flags'])}), {cpu['cores']} cores; load "
          f"{load():.1f}; {args.rows:,} rows in {pq.read_metadata(path).num_row_groups} row "
          f"group(s), {len(parts)} partitions of {args.partition_rows} rows")
    sample = parts[:SAMPLED]
    once, cached, uncached = [], [], []
    for _ in range(args.reps):
        once.append(seconds(lambda: pq.read_table(path, columns=["text", "id"])))
        cached.append(seconds(lambda: read_all(spec, parts, RowGroupCache())))
        uncached.append(seconds(lambda: read_all(spec, sample, None)) * len(parts) / len(sample))
    peer, ours, before = (statistics.median(x) for x in (once, cached, uncached))
    print(f"  table once (pyarrow)      {peer:8.2f} s")
    print(f"  partitions, cached        {ours:8.2f} s   {ours / peer:6.2f}x the table once")
    print(f"  partitions, no cache      {before:8.2f} s   {before / peer:6.1f}x the table once "
          f"(extrapolated from {SAMPLED} partitions)")
    print(f"  load {load():.1f} at the end")


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'Reading the input: one decode per row group'):
        main()
