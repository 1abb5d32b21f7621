"""CPU seconds of the same `bertpipe extract` quiet and on cores shared with busy processes.

A shared node runs other work beside bertpipe. Competing processes (pure-Python spin loops,
one or three per core) take their share of the cores; what must not grow is the CPU time
bertpipe itself spends on the same job: threads that spin while waiting for a core held by
another process burn it without doing work. Each round runs every (runtime, load) case once,
in alternating order; the table gives medians of the bertpipe process's CPU seconds (user +
system, from wait4) and the ratio to the quiet run of the same runtime.

    python benchmarks/contention.py [--reps 3] [--rows 600] [--runtimes torch openvino]
                                    [--loads 0 1 3] [--code DIR ...] [--env NAME=VALUE ...]

`--code DIR` runs the bertpipe found in DIR (another checkout; several alternate within
each round, for before/after figures), and `--env` adds to its environment (e.g.
OMP_WAIT_POLICY=ACTIVE).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REPO, WORK, Proc, cpu_info, load, write_job  # noqa: E402
from run import run_process as run_until_done  # noqa: E402
from texts import distinct_reviews  # noqa: E402

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
SPIN = "while True: pass"


def run_process(cmd: list[str], code: str) -> Proc:
    """`cmd` with the bertpipe of checkout `code` first on the path."""
    os.environ["PYTHONPATH"] = code  # run.run_process passes this environment on
    return run_until_done(cmd)


@contextmanager
def busy(per_core: int) -> Iterator[None]:
    """`per_core` spinning processes per core, for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(per_core * CORES)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py)."""
    return {f"{rows} rows": distinct_reviews(rows)}


def jobs(runtimes: list[str], rows: int) -> dict[str, Path]:
    """One job per runtime: `rows` distinct reviews (the first `rows` samples, up to 600),
    float32, one view, in-process."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = WORK / f"contention-{rows}.parquet"
    pq.write_table(pa.table({"id": list(range(rows)), "text": distinct_reviews(rows)}), source)
    return {rt: write_job(f"contention-{rt}", source, rt, "float32", {"mean": {"pooling": "mean"}},
                          partition_rows=200) for rt in runtimes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtimes", nargs="+", default=["torch", "openvino"])
    ap.add_argument("--loads", nargs="+", type=int, default=[0, 1, 3],
                    help="busy processes per core")
    ap.add_argument("--rows", type=int, default=600, help="distinct texts")
    ap.add_argument("--code", type=Path, nargs="+", default=[REPO],
                    help="the bertpipe checkouts to run")
    ap.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for the bertpipe process")
    args = ap.parse_args()
    os.environ.update(dict(item.split("=", 1) for item in args.env))
    # -P: the working directory is not put first on the path, so PYTHONPATH picks the checkout
    cmd = [sys.executable, "-P", "-m", "pipeline.cli", "-q", "extract"]
    paths = jobs(args.runtimes, args.rows)
    codes = [str(c.resolve()) for c in args.code]
    for code in codes:
        for path in paths.values():  # untimed: the OpenVINO export cache, the page cache
            run_process([*cmd, str(path)], code)
    cpu = cpu_info()
    print(f"cpu: {cpu['model']}, {CORES} cores, flags {' '.join(cpu['flags'])}")
    print(f"env: {' '.join(args.env) or '-'}  load average before: {load():.2f}")
    seconds: dict[tuple[str, str, int], list[float]] = {}
    walls: dict[tuple[str, str, int], list[float]] = {}
    for rep in range(args.reps):
        order = [(c, rt, n) for n in args.loads for rt in args.runtimes for c in codes]
        if rep % 2:
            order.reverse()  # alternate: drift in the machine's other load evens out
        for case in order:
            with busy(case[2]):
                proc = run_process([*cmd, str(paths[case[1]])], case[0])
            seconds.setdefault(case, []).append(proc.cpu)
            walls.setdefault(case, []).append(proc.wall)
    print(f"\nmedians of {args.reps} rounds ({args.rows} texts, float32, one view, in-process):")
    print(f"{'code':<28} {'runtime':<9} {'busy/core':>9} {'cpu s':>6} {'wall s':>7} {'ratio':>6}"
          "  cpu s each")
    for code in codes:
        for rt in args.runtimes:
            quiet = statistics.median(seconds[(code, rt, args.loads[0])])
            for n in args.loads:
                cpu_s = statistics.median(seconds[(code, rt, n)])
                print(f"{code[-28:]:<28} {rt:<9} {n:>9} {cpu_s:>6.1f} "
                      f"{statistics.median(walls[(code, rt, n)]):>7.1f} {cpu_s / quiet:>5.2f}x  "
                      + " ".join(f"{s:.1f}" for s in seconds[(code, rt, n)]))
    print(f"load average after: {load():.2f}")


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'Shared cores: CPU seconds beside busy processes'):
        WORK.mkdir(parents=True, exist_ok=True)
        main()
