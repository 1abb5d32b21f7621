"""How close the whole `bertpipe extract` process comes to its encoder alone.

The encoder alone: a child process that tokenizes every text first (untimed), then runs
bertpipe's encoder (forward passes and pooling, token-budget batches) over all of them.
The whole process: `bertpipe extract` on the same rows, timed from outside (interpreter
start, imports, model load, reading, tokenizing, chunking, writing and sealing the store
included). Both with the job's runtime (`auto`: OpenVINO on a CPU where it is installed).
Rounds alternate the two; medians of tokens/s by wall clock and per CPU-second (user +
system of the whole process: steadier on a shared machine, and on a machine whose cores
the encoder already fills, work beside the encoder costs CPU whether it overlaps or not).

    python benchmarks/overlap.py [--rows 10000] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import (  # noqa: E402
    BIN,
    ONE_VIEW,
    build_input,
    count_tokens,
    input_table,
    load,
    run_process,
    write_job,
)

WARM_ROWS = 64  # the export cache is keyed by weights and outputs, not rows: a small job warms it


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py)."""
    return {f"{n} rows": input_table(n).column("text").to_pylist() for n in (WARM_ROWS, rows)}


def encoder_alone(job_file: Path) -> None:
    """Child process: prints {"tokens", "wall", "cpu"} of the encoder over every text."""
    from pipeline.extract.partition import Extractor
    from pipeline.spec import Job

    job = Job.from_dict(yaml.safe_load(job_file.read_text()))
    ex = Extractor(job)
    texts = pq.read_table(job.input.path, columns=["text"]).column("text").to_pylist()
    # MiniLM's limit; the reviews fit in one chunk, so these are the rows' own sequences
    ids = [ex.model.tokenizer.encode(t, truncation=True, max_length=512) for t in texts]
    ex.encoder.encode(ids[:64], job.batching)  # warm-up: the first batch compiles
    wall, cpu = time.perf_counter(), time.process_time()
    ex.encoder.encode(ids, job.batching)
    print(json.dumps({"tokens": sum(map(len, ids)), "wall": time.perf_counter() - wall,
                      "cpu": time.process_time() - cpu}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--encoder-alone", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.encoder_alone:
        encoder_alone(args.encoder_alone)
        return
    source = build_input(args.rows, f"reviews-{args.rows}")
    # one partition per 2,048 rows, as a scheduled job would run it
    job = write_job(f"overlap-{args.rows}", source, "auto", "auto", ONE_VIEW)
    tokens = count_tokens(source)
    warm = write_job("overlap-warm", build_input(WARM_ROWS, f"reviews-{WARM_ROWS}"), "auto",
                     "auto", ONE_VIEW)
    run_process([str(BIN / "bertpipe"), "extract", str(warm)])
    whole: dict[str, list[float]] = {"wall": [], "cpu": []}
    alone: dict[str, list[float]] = {"wall": [], "cpu": []}
    loads = []
    for _ in range(args.reps):
        loads.append(load())
        proc = run_process([str(BIN / "bertpipe"), "extract", str(job)])
        whole["wall"].append(tokens / proc.wall)
        whole["cpu"].append(tokens / proc.cpu)
        out = subprocess.run([sys.executable, __file__, "--encoder-alone", str(job)],
                             capture_output=True, text=True, check=True).stdout
        enc = json.loads(out.strip().splitlines()[-1])
        alone["wall"].append(enc["tokens"] / enc["wall"])
        alone["cpu"].append(enc["tokens"] / enc["cpu"])
    print(f"{args.rows} rows, {tokens:,} tokens, {args.reps} rounds alternating, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    for unit in ("wall", "cpu"):
        w, a = statistics.median(whole[unit]), statistics.median(alone[unit])
        label = "tokens/s (wall)" if unit == "wall" else "tokens per CPU-s"
        print(f"  {label:<17} whole process {w:>8,.0f}   encoder alone {a:>8,.0f}   "
              f"whole / encoder {w / a:.2f}")


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'The whole process against its encoder', children=("--encoder-alone",)):
        main()
