"""A token view against a pooled view on the same runtime, in one process: the encoder's
cost per CPU-second, nothing else (no store is written).

The 600 sample reviews (data/, distinct texts, so the pooled view saves nothing by
encoding duplicates once), all-MiniLM-L6-v2, chunking hierarchical, batching as the job
default. Two extractors on the same runtime and dtype: a pooled `mean` view and a
`tokens` view of the same layer (one forward graph, the same hidden states). Each is run
once untimed (export, compile, first-call costs), then every round runs both on all the
texts, the order reversed every other round. Reported: medians over the rounds of wall
time, CPU time of the process (user + system, all threads: steadier on a shared machine)
and tokens encoded per CPU-second, and the token view's CPU time over the pooled view's
(median of the per-round ratios).

    python benchmarks/encoder_views.py [--runtime openvino] [--dtype auto] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from texts import sample_reviews  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "all-MiniLM-L6-v2"
REVIEWS = REPO / "data" / "reviews.parquet"
# the benchmark's own export cache (made by the untimed first run)
os.environ.setdefault("BERTPIPE_CACHE_DIR", str(REPO / "benchmarks" / "work" / "cache"))

CASES: dict[str, dict[str, Any]] = {
    "pooled mean": {"mean": {"pooling": "mean"}},
    "tokens": {"tok": {"pooling": "tokens"}},
}


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py)."""
    return {"the 600 sample reviews": list(sample_reviews())}  # the job's input file itself


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def extractor(views: dict[str, Any], runtime: str, dtype: str) -> Any:
    from pipeline.extract.partition import Extractor
    from pipeline.spec import Job

    return Extractor(Job.from_dict({
        "input": {"path": str(REVIEWS), "text_column": "text", "id_column": "id"},
        "model": {"path": str(MODEL), "dtype": dtype, "device": "cpu", "runtime": runtime},
        "chunking": {"strategy": "hierarchical"},
        "views": views,
        "output": {"path": "unused.zarr", "format": "zarr"},
    }))


def timed(ex: Any, texts: list[str | None]) -> tuple[float, float, int]:
    """(wall s, CPU s, tokens encoded) of encoding every text once."""
    wall, cpu = time.perf_counter(), time.process_time()
    encoded = ex.encode_texts(texts)
    return time.perf_counter() - wall, time.process_time() - cpu, encoded.tokens_encoded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runtime", default="openvino", choices=["openvino", "torch"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    texts: list[str | None] = list(sample_reviews())  # distinct (texts.py checks)
    extractors = {name: extractor(views, args.runtime, args.dtype)
                  for name, views in CASES.items()}
    runtimes = {str(ex.runtime) for ex in extractors.values()}
    assert len(runtimes) == 1, runtimes  # both on the same runtime, or no comparison
    for ex in extractors.values():  # untimed: first calls, allocations
        ex.encode_texts(texts)
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in CASES}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = list(CASES) if r % 2 == 0 else list(CASES)[::-1]
        for name in order:
            runs[name].append(timed(extractors[name], texts))
        loads.append(os.getloadavg()[0])
    tokens = {name: runs[name][0][2] for name in CASES}
    assert len(set(tokens.values())) == 1, tokens  # the same tokens through the encoder
    n_tokens = tokens["tokens"]
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, load average "
          f"{min(loads):.1f}-{max(loads):.1f}; {runtimes.pop()}")
    print(f"{len(texts)} reviews, {n_tokens:,} tokens encoded per run; medians of "
          f"{args.rounds} rounds")
    print(f"{'case':<13}{'wall s':>8}{'CPU s':>8}{'tok/CPU-s':>11}")
    for name, rows in runs.items():
        wall = statistics.median(w for w, _, _ in rows)
        cpu = statistics.median(c for _, c, _ in rows)
        print(f"{name:<13}{wall:>8.2f}{cpu:>8.2f}{n_tokens / cpu:>11,.0f}")
    pairs = list(zip(runs["tokens"], runs["pooled mean"], strict=True))
    print("per round, tokens / pooled mean CPU: "
          + " ".join(f"{t[1] / p[1]:.3f}" for t, p in pairs))
    cpu_ratio = statistics.median(t[1] / p[1] for t, p in pairs)
    wall_ratio = statistics.median(t[0] / p[0] for t, p in pairs)
    print(f"tokens / pooled mean, median of per-round ratios: CPU {cpu_ratio:.3f}x, "
          f"wall {wall_ratio:.3f}x (tokens per CPU-second {1 / cpu_ratio:.3f}x)")


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'A token view against a pooled view: the encoder alone'):
        main()
