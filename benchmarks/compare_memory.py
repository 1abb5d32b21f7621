"""The incremental comparison's memory against the table's size.

An update compares the input's ids and text digests with the store's. In one bucket
(`compare.BUCKET_ROWS` rows of both sides together) that is done in memory; past it, both
sides are split by hash into buckets on a scratch disk and the plan's row-length arrays are
memory-mapped files. This runs `compare` alone, in a fresh process per case, on a store of
S distinct short texts and an input that grew by 1% and changed 0.1% of them:

    split      the comparison as shipped (buckets past BUCKET_ROWS)
    whole      one bucket whatever the size (BUCKET_ROWS set past the table: everything
               in memory, as before buckets existed)

and prints, per case, the wall time, the peak resident memory and the peak anonymous
memory (what the process holds that the OS cannot page out) above the process's memory
before the comparison started, that per row (of the store and the input together), and the
scratch folder's size. The store side is made on the fly
(ids and digests of texts computed per block) so that only the comparison's own memory
is measured; the input is a real Parquet file (benchmarks/work/compare-memory-S.parquet).

    python benchmarks/compare_memory.py [--rows 1000000 4000000 10000000] [--modes split whole]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REPO, WORK, cpu_info, load  # noqa: E402
from texts import sample_sentences  # noqa: E402

SENTENCES = sample_sentences()
PARTITION_ROWS = 8192


def text(i: int, night: int = 0) -> str:
    """Row i's text: a sample sentence and the row number (distinct for every row)."""
    base = f"{SENTENCES[(i * 2654435761) % len(SENTENCES)]} (review {i})"
    return f"{base} (edited {night})" if night else base


def changed(rows: int) -> set[int]:
    """0.1% of the rows, spread over the table."""
    return set(range(0, rows, 1000))


def grown_texts(rows: int, start: int, stop: int) -> list[str]:
    """Rows `start` to `stop` of the grown input: the store's texts, 0.1% of them edited,
    and 1% new rows after them (distinct: each names its row)."""
    edits = changed(rows)
    return [text(i, 1 if i in edits else 0) for i in range(start, stop)]


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py)."""
    return {"store": [text(i) for i in range(rows)],
            "grown input": grown_texts(rows, 0, rows + rows // 100)}


def build(rows: int) -> Path:
    """The grown input: the store's rows (0.1% edited) and 1% new ones."""
    path = WORK / f"compare-memory-{rows}.parquet"
    total = rows + rows // 100
    if path.exists() and pq.read_metadata(path).num_rows == total:
        return path
    WORK.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    with pq.ParquetWriter(path, schema) as out:
        for start in range(0, total, 1_000_000):
            ids = range(start, min(start + 1_000_000, total))
            out.write_table(pa.table({"id": list(ids), "text": grown_texts(
                rows, ids.start, ids.stop)}, schema),
                row_group_size=50_000)
    return path


def measure(rows: int, mode: str) -> dict[str, float]:
    """In this process: compare the input with the on-the-fly store; memory and time."""
    from pipeline.extract.source import plan_partitions
    from pipeline.extract.texthash import text_sha256_bytes
    from pipeline.run import compare
    from pipeline.spec import InputSpec

    if mode == "whole":
        compare.BUCKET_ROWS = 1 << 62

    def read(a: int, b: int) -> tuple[pa.Array, pa.Array, np.ndarray]:
        return (pa.array(np.arange(a, b, dtype=np.int64)),
                pa.array(text_sha256_bytes([text(i) for i in range(a, b)]), compare.DIGEST),
                np.ones(b - a, bool))

    spec = InputSpec(str(build(rows)), "text", "id")
    parts = plan_partitions(spec, PARTITION_ROWS)
    peak = {"rss": 0, "anon": 0}
    before = _memory()
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = _memory()
            for key in peak:
                peak[key] = max(peak[key], now[key])
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    changes = compare.compare(spec, parts, compare.StoreRows(rows, read), prune=False,
                              append_edits=True)
    wall = time.perf_counter() - start
    done.set()
    assert changes.encoded == len(changed(rows)) + rows // 100, changes.encoded
    buckets = compare.bucket_count(rows + sum(p.n_rows for p in parts))
    scratch = changes.scratch
    disk = sum(f.stat().st_size for f in scratch.path(".").iterdir()) \
        if scratch is not None and scratch.on_disk else 0
    changes.close()
    return {"rows": rows, "buckets": buckets, "wall_s": wall, "disk_mb": disk / 2**20,
            "rss_mb": (peak["rss"] - before["rss"]) / 2**20,
            "anon_mb": (peak["anon"] - before["anon"]) / 2**20}


def _memory() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text()
                  .splitlines() if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024,
            "anon": int(fields["RssAnon"].split()[0]) * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 4_000_000,
                                                                   10_000_000])
    parser.add_argument("--modes", nargs="+", default=["split", "whole"],
                        choices=["split", "whole"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # rows mode: in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1])))
        return
    cpu = cpu_info()
    print(f"{cpu['model']} ({', '.join(cpu['flags'])}), {cpu['cores']} CPUs, load "
          f"{load():.1f}; the comparison alone, memory above the process's before it")
    for rows in args.rows:
        build(rows)
        for mode in args.modes:
            out = subprocess.run([sys.executable, __file__, "--one", str(rows), mode],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
            r = json.loads(out.stdout.splitlines()[-1])
            print(f"  {mode:5s} store {rows:>10,} rows, input {rows + rows // 100:>10,}: "
                  f"{r['buckets']:2d} bucket(s)  wall {r['wall_s']:6.1f} s  peak RSS "
                  f"+{r['rss_mb']:6.0f} MB  peak anonymous +{r['anon_mb']:6.0f} MB "
                  f"({r['anon_mb'] * 2**20 / (2 * rows):5.0f} bytes a row); scratch disk "
                  f"{r['disk_mb']:6.0f} MB", flush=True)


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, "An update's comparison at ten million rows", children=("--one",)):
        main()
