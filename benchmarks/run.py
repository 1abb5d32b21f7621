"""Throughput, agreement and memory of `bertpipe extract` against sentence-transformers.

Builds its inputs from the shipped sample reviews, runs whole processes alternately
(peer, then each bertpipe case, repeated), and prints a table of medians: tokens/s,
ratio to the peer, cosine agreement, peak RSS, and model FLOP utilisation against the
GEMM peak measured in the same run.

    python benchmarks/run.py [--rows 1200] [--reps 3] [--memory-rows 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "benchmarks" / "work"
MODEL = REPO / "models" / "all-MiniLM-L6-v2"
BIN = Path(sys.executable).parent

ONE_VIEW = {"mean": {"pooling": "mean"}}
FOUR_VIEWS = {"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"},
              "pooler": {"pooling": "pooler"}, "max": {"pooling": "max"}}
EIGHT_VIEWS = {
    **FOUR_VIEWS,
    "attn": {"pooling": "attention"},
    "mid4": {"layers": [-4, -3, -2, -1], "combine": "mean", "pooling": "mean"},
    "cat2": {"layers": [-2, -1], "combine": "concat", "pooling": "cls"},
    "mix": {"layers": "all", "combine": "scalar_mix", "weights": [0, 0, 0, 0, 1, 1, 1],
            "pooling": "mean"},
}

# name -> (dtype, views): every case is a whole `bertpipe extract` process
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32, mean": ("float32", ONE_VIEW),
    "auto, mean": ("auto", ONE_VIEW),
    "auto, 8 views": ("auto", EIGHT_VIEWS),
    "auto, attention": ("auto", {"attn": {"pooling": "attention"}}),
    "auto, layer 2 only": ("auto", {"l2": {"layers": [2], "pooling": "mean"}}),
}


def build_input(rows: int, name: str) -> Path:
    """`rows` real reviews, the 600 samples repeated with fresh ids."""
    path = WORK / f"{name}.parquet"
    if path.exists() and pq.read_metadata(path).num_rows == rows:
        return path
    src = pq.read_table(REPO / "data" / "reviews.parquet", columns=["text", "label"])
    reps = -(-rows // src.num_rows)
    table = pa.concat_tables([src] * reps).slice(0, rows)
    table = table.append_column("id", pa.array(np.arange(rows, dtype=np.int64)))
    pq.write_table(table, path)
    return path


def write_job(name: str, source: Path, dtype: str, views: dict[str, Any],
              partition_rows: int = 2048) -> Path:
    job = {
        "input": {"path": str(source), "text_column": "text", "id_column": "id"},
        "model": {"path": str(MODEL), "dtype": dtype, "device": "cpu"},
        "chunking": {"strategy": "hierarchical"},
        "views": views,
        "output": {"path": str(WORK / f"{name}.zarr"), "format": "zarr", "overwrite": True},
        "execution": {"scheduler": "synchronous", "partition_rows": partition_rows},
    }
    path = WORK / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_process(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MiB of the process, its output)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{output}")
    return wall, usage.ru_maxrss / 1024, output


def count_tokens(source: Path) -> int:
    from tokenizers import Tokenizer  # not transformers: keeps torch out of this process

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    tok.enable_truncation(512)
    tok.no_padding()  # the model's tokenizer.json pads batches: count real tokens only
    texts = pq.read_table(source, columns=["text"]).column("text").to_pylist()
    return sum(len(enc.ids) for enc in tok.encode_batch(texts))


def gemm_peak(dtype: str, n: int = 2048, reps: int = 10) -> float:
    """FLOP/s of a square matmul in this process (the ceiling a model can approach)."""
    import torch

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    a = torch.randn(n, n, dtype=torch_dtype)
    b = torch.randn(n, n, dtype=torch_dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start)


def flop_per_token(avg_len: float) -> float:
    """Forward FLOPs per token: 2 per block weight + attention's 4·T·H per layer."""
    config = json.loads((MODEL / "config.json").read_text())
    h, i, n_layers = config["hidden_size"], config["intermediate_size"], config[
        "num_hidden_layers"]
    weights = 4 * h * h + 2 * h * i
    return n_layers * (2 * weights + 4 * avg_len * h)


def encoder_only(source: Path, dtype: str) -> float:
    """tokens/s of the encoder alone (forward + pooling) on bertpipe's own batches."""
    from pipeline.extract.partition import Extractor
    from pipeline.spec import Job

    job = Job.from_dict(yaml.safe_load(write_job("encoder-only", source, dtype,
                                                 ONE_VIEW).read_text()))
    ex = Extractor(job)
    texts = pq.read_table(source, columns=["text"]).column("text").to_pylist()
    ids = [ex.model.tokenizer.encode(t, truncation=True, max_length=512) for t in texts]
    ex.encoder.encode(ids[:64], job.batching)  # warm up
    start = time.perf_counter()
    ex.encoder.encode(ids, job.batching)
    return sum(map(len, ids)) / (time.perf_counter() - start)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    c = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(c.min())


def store_vectors(name: str, view: str) -> np.ndarray:
    import pipeline  # imports torch: only after every timed run

    return pipeline.open_store(WORK / f"{name}.zarr").vectors(view)


def in_process(source: Path) -> None:
    print(json.dumps({"peaks": {d: gemm_peak(d) for d in ("float32", "bfloat16")},
                      "encoder_only": {d: encoder_only(source, d)
                                       for d in ("float32", "bfloat16")}}))


def main() -> None:
    if sys.argv[1:2] == ["--in-process"]:
        return in_process(Path(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=2400)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--memory-rows", type=int, default=2000,
                    help="peak RSS is compared at this many rows and 10x as many")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    source = build_input(args.rows, f"reviews-{args.rows}")
    tokens = count_tokens(source)
    avg_len = tokens / args.rows
    print(f"input: {args.rows} reviews, {tokens} tokens (mean {avg_len:.0f}); "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", flush=True)

    # torch work runs in a child process: a forked child starts with its parent's peak
    # RSS, so the parent stays small for the RSS figures to mean anything
    _, _, out = run_process([sys.executable, __file__, "--in-process", str(source)])
    measured = json.loads(out.strip().splitlines()[-1])
    peaks, enc = measured["peaks"], measured["encoder_only"]
    jobs = {name: write_job(f"case-{i}", source, dtype, views)
            for i, (name, (dtype, views)) in enumerate(CASES.items())}
    peer_out = WORK / "peer.npy"
    peer_cmd = [sys.executable, str(REPO / "benchmarks" / "peer_st.py"), str(MODEL),
                str(source), str(peer_out)]
    results: dict[str, list[tuple[float, float]]] = {"sentence-transformers fp32": []}
    results.update({name: [] for name in CASES})
    for rep in range(args.reps):
        wall, rss, _ = run_process(peer_cmd)
        results["sentence-transformers fp32"].append((wall, rss))
        for name, job in jobs.items():
            wall, rss, _ = run_process([str(BIN / "bertpipe"), "extract", str(job)])
            results[name].append((wall, rss))
        print(f"rep {rep + 1}/{args.reps} done", flush=True)

    memory = memory_scaling(args.memory_rows)  # before anything imports torch here

    # agreement: fp32 mean vs the peer; bf16 vs fp32 for every view of the 8-view job
    reference = write_job("reference-fp32", source, "float32", EIGHT_VIEWS)
    run_process([str(BIN / "bertpipe"), "extract", str(reference)])
    peer = np.load(peer_out)
    fp32_case = f"case-{list(CASES).index('fp32, mean')}"
    auto_case = f"case-{list(CASES).index('auto, 8 views')}"
    agreement = {"fp32, mean": cosine(store_vectors(fp32_case, "mean"), peer)}
    agreement["auto, 8 views"] = min(
        cosine(store_vectors(auto_case, v), store_vectors("reference-fp32", v))
        for v in EIGHT_VIEWS)
    per_view = {v: cosine(store_vectors(auto_case, v), store_vectors("reference-fp32", v))
                for v in EIGHT_VIEWS}
    agreement["auto, mean"] = cosine(
        store_vectors(f"case-{list(CASES).index('auto, mean')}", "mean"), peer)
    report(results, tokens, avg_len, peaks, enc, agreement, per_view, memory)


def memory_scaling(rows: int) -> dict[int, float]:
    """Peak RSS of the whole process at `rows` and 10x `rows` (one cheap view, so the
    run is about data flow rather than compute)."""
    out = {}
    for n in (rows, rows * 10):
        source = build_input(n, f"reviews-{n}")
        job = write_job(f"memory-{n}", source, "auto",
                        {"l1": {"layers": [1], "pooling": "mean"}}, partition_rows=1024)
        _, rss, _ = run_process([str(BIN / "bertpipe"), "extract", str(job)])
        out[n] = rss
    return out


def report(results: dict[str, list[tuple[float, float]]], tokens: int, avg_len: float,
           peaks: dict[str, float], enc: dict[str, float], agreement: dict[str, float],
           per_view: dict[str, float], memory: dict[int, float]) -> None:
    fpt = flop_per_token(avg_len)
    peer_name = "sentence-transformers fp32"
    peer_tps = tokens / statistics.median(w for w, _ in results[peer_name])
    print()
    print(f"GEMM peak in this run: fp32 {peaks['float32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks['bfloat16'] / 1e9:.0f} GFLOP/s; model {fpt / 1e6:.1f} MFLOP/token")
    print(f"{'case (whole process)':<28}{'tokens/s':>10}{'vs peer':>9}{'cosine':>9}"
          f"{'peak RSS':>10}{'FLOP util':>11}")
    for name, runs in results.items():
        tps = tokens / statistics.median(w for w, _ in runs)
        rss = statistics.median(r for _, r in runs)
        dtype = "float32" if "fp32" in name or "auto" not in name else "bfloat16"
        util = tps * fpt / peaks[dtype]
        cos = f"{agreement[name]:.5f}" if name in agreement else ""
        print(f"{name:<28}{tps:>10,.0f}{tps / peer_tps:>8.2f}x{cos:>9}{rss:>8.0f}Mi"
              f"{100 * util:>10.0f}%")
    print()
    print("bf16 vs fp32 cosine (min over rows), per view: "
          + ", ".join(f"{k} {v:.5f}" for k, v in per_view.items()))
    one = tokens / statistics.median(w for w, _ in results["auto, mean"])
    eight = tokens / statistics.median(w for w, _ in results["auto, 8 views"])
    attn = tokens / statistics.median(w for w, _ in results["auto, attention"])
    print(f"8 views cost {100 * (one / eight - 1):+.0f}% vs 1 view; "
          f"attention pooling {100 * (one / attn - 1):+.0f}% vs mean")
    fp32 = tokens / statistics.median(w for w, _ in results["fp32, mean"])
    print(f"encoder alone (in-process, same batches): fp32 {enc['float32']:,.0f} tokens/s, "
          f"bf16 {enc['bfloat16']:,.0f} tokens/s; whole process / encoder: "
          f"fp32 {fp32 / enc['float32']:.0%}, bf16 {one / enc['bfloat16']:.0%}")
    small, big = sorted(memory)
    print(f"peak RSS: {small} rows {memory[small]:.0f} MiB, {big} rows {memory[big]:.0f} MiB "
          f"({100 * (memory[big] / memory[small] - 1):+.0f}%)")
    (WORK / "results.json").write_text(json.dumps({
        "tokens": tokens, "peaks": peaks, "encoder_only": enc, "agreement": agreement,
        "per_view": per_view, "memory": memory,
        "runs": {k: v for k, v in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
