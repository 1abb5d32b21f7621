"""What a store that grows costs: a full run, a nightly update (+1% new rows, 0.1% changed
at random positions), a no-op update, `verify`, and `open_store` + one view read, for each
format that grows, at several sizes, on a tiny random BERT (so that the pipeline's own
cost shows, not the model's).

    python benchmarks/scale.py [--rows 10000 100000] [--formats icechunk parquet delta] [--s3]

For each step: wall and CPU seconds, bytes written (the process's write accounting,
`wchar` in /proc/self/io: every byte it wrote, staging included), peak RSS and peak
anonymous memory (sampled every 50 ms: a Parquet or Delta reader maps the store's files,
whose pages count in RSS as page cache the kernel can drop), and the store's size on disk
after it. With `--s3` the stores live on a loopback S3 endpoint (moto, in a
thread of this process) and each step also reports the bytes its requests uploaded (every
PUT and POST body: staging, data, metadata) and its requests by method; the store's size
is then the sum of its objects. Each step is a whole `bertpipe` process; the last, `gc --keep 1`,
shows what the store occupies once the versions before the update are expired; then more
nightly updates (`--nights`, 5 in all by default), `gc --keep 1` again, and the store's size
against a fresh store of the same rows made in one run. With several sizes, each step's peak
RSS at the largest size against the smallest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "benchmarks" / "work" / "scale"
NIGHTS = 5  # nightly updates before the last gc, by default
sys.path.insert(0, str(REPO / "benchmarks"))
from texts import distinct_sentences  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Runs one bertpipe command in this process and, at exit, writes what the process cost.
DRIVER = """
import atexit, json, os, resource, sys, threading, time
start = time.perf_counter()
anon = [0]
def sample():  # anonymous memory only: mapped store files are page cache, counted in RSS
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                anon[0] = max(anon[0], int(line.split()[1]))
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
def report():
    io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # the peak RSS of this process image: ru_maxrss starts from the RSS of the process that
    # started it (the benchmark, holding a million texts), whatever this one uses
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status")
               if line.startswith("VmHWM:"))
    with open(os.environ["SCALE_REPORT"], "w") as f:
        json.dump({"wall_s": time.perf_counter() - start,
                   "cpu_s": usage.ru_utime + usage.ru_stime,
                   "written": int(io["wchar"]), "rss_mb": hwm / 1024,
                   "anon_mb": anon[0] / 1024}, f)
atexit.register(report)
if sys.argv[1] == "open":
    import numpy as np, pipeline
    store = pipeline.open_store(sys.argv[2])
    print(np.asarray(store.vectors("mean")).shape)
else:
    from pipeline.cli import main
    main(sys.argv[1:])
"""


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def make_tiny_model(root: Path) -> Path:
    """A 2-layer BERT (H=32) with random weights and a WordPiece vocabulary of the
    sample reviews' words: nothing downloaded."""
    if (root / "model.safetensors").exists():
        return root
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    texts = pq.read_table(REPO / "data" / "reviews.parquet").column("text").to_pylist()
    words = sorted({w.lower().strip(".,!?;:\"'()") for t in texts for w in t.split()} - {""})
    chars = sorted({c for t in texts for c in t.lower() if not c.isspace()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars,
             *(f"##{c}" for c in chars), *words]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(root / "vocab.txt"), do_lower_case=True)
    tokenizer.model_max_length = 128
    tokenizer.save_pretrained(root)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=128)
    BertModel(config).save_pretrained(root, safe_serialization=True)
    return root


def write_input(path: Path, ids: list[int], texts: list[str]) -> None:
    pq.write_table(pa.table({"id": ids, "text": texts}), path, row_group_size=50_000)


def grown(rows: int, texts: list[str], night: int = 1) -> tuple[list[int], list[str]]:
    """+1% new rows and 0.1% of the old ones changed, at random positions (other ones
    each `night`)."""
    changed = random.Random(night).sample(range(rows), max(1, rows // 1000))
    new = [*texts]
    for i in changed:
        new[i] = f"{new[i]} (edited {night})"
    added = max(1, rows // 100)
    extra = distinct_sentences(added, seed=100 + night, start=rows)
    return list(range(rows + added)), new + extra


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at one of its `--rows` (tests/test_benchmarks.py)."""
    texts = distinct_sentences(rows)
    inputs = {"full run": texts}
    for night in range(1, NIGHTS + 1):  # each night grows the table the last one left
        texts = grown(len(texts), texts, night)[1]
        inputs[f"night {night}"] = texts
    return inputs


def job_file(root: Path, fmt: str, source: Path, model: Path, rows: int,
             name: str = "store") -> Path:
    job = {"input": {"path": str(source), "text_column": "text", "id_column": "id"},
           "model": {"path": str(model), "dtype": "float32", "device": "cpu",
                     "runtime": "torch"},
           "chunking": {"strategy": "hierarchical", "max_tokens": 64},
           "views": {"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"},
                     "max": {"pooling": "max"}},
           "output": {"path": str(store_at(root, fmt, name)), "format": fmt},
           "execution": {"scheduler": "synchronous",
                         # at most 12,500 rows: peak memory follows the partition's size,
                         # which a job chooses whatever its table's size
                         "partition_rows": max(1000, min(rows // 8, 12_500))}}
    path = root / f"job-{name}-{fmt}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def measure(*args: str) -> dict[str, Any]:
    report = WORK / "report.json"
    report.unlink(missing_ok=True)
    env = {**os.environ, "SCALE_REPORT": str(report), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", DRIVER, *args], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(report.read_text())


def disk_mb(folder: Path | str) -> float:
    """MB of every file of a local store, or every object of one on S3."""
    if isinstance(folder, str):
        import fsspec

        fs, path = fsspec.core.url_to_fs(folder)
        fs.invalidate_cache()  # the steps' processes changed it
        return sum(fs.du(path, total=False).values()) / 1e6 if fs.exists(path) else 0.0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


S3_BUCKET = "scale"
S3: Any = None  # the counting endpoint's counter, with --s3


def store_at(root: Path, fmt: str, name: str) -> Path | str:
    """Where a store of this size and format lives: beside its input, or on S3."""
    if S3 is None:
        return root / f"{name}.{fmt}"
    return f"s3://{S3_BUCKET}/{root.name}/{name}.{fmt}"


def one_size(fmt: str, rows: int, model: Path, nights: int) -> list[dict[str, Any]]:
    root = WORK / f"{fmt}-{rows}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    source = root / "input.parquet"
    texts = distinct_sentences(rows)
    write_input(source, list(range(rows)), texts)
    job = job_file(root, fmt, source, model, rows)
    store = store_at(root, fmt, "store")
    steps = []

    def step(name: str, *args: str) -> None:
        figures = measure(*args)
        if S3 is not None:
            figures.update(S3.take())
        steps.append({"format": fmt, "rows": rows, "step": name, **figures,
                      "store_mb": disk_mb(store)})
        uploaded = f"  uploaded {figures['uploaded'] / 1e6:6.1f} MB (staged " \
            f"{figures['staged'] / 1e6:.1f}) in " + ", ".join(
            f"{n} {m}" for m, n in sorted(figures["requests"].items())) if S3 else ""
        print(f"  {fmt:<8} {rows:>8} {name:<16} wall {figures['wall_s']:7.1f}s  cpu "
              f"{figures['cpu_s']:7.1f}s  written {figures['written'] / 1e6:8.1f} MB  rss "
              f"{figures['rss_mb']:6.0f} MB (anon {figures['anon_mb']:5.0f})  store "
              f"{disk_mb(store):7.1f} MB{uploaded}",
              flush=True)

    step("full run", "extract", str(job), "-q")
    ids, texts = grown(rows, texts)
    write_input(source, ids, texts)
    step("update", "extract", str(job), "--incremental", "-q")
    step("no-op update", "extract", str(job), "--incremental", "-q")
    if S3 is not None:
        S3.take()  # the store's size was listed: not the steps' requests
    step("verify", "verify", str(store))
    step("open + read", "open", str(store))
    step("gc --keep 1", "gc", str(store), "--keep", "1")
    if nights < 2:
        return steps
    for night in range(2, nights + 1):  # `nights` nightly updates in all, then gc
        ids, texts = grown(len(texts), texts, night)
        write_input(source, ids, texts)
        step(f"update {night}", "extract", str(job), "--incremental", "-q")
    step("gc after nights", "gc", str(store), "--keep", "1")
    fresh = store_at(root, fmt, "fresh")  # a store of the same rows, made in one run
    figures = measure("extract", str(job_file(root, fmt, source, model, rows, "fresh")), "-q")
    if S3 is not None:  # counted apart, or the next format's first step would get them
        figures.update(S3.take())
    steps.append({"format": fmt, "rows": rows, "step": "fresh store", **figures,
                  "store_mb": disk_mb(fresh)})
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--formats", nargs="+", default=["icechunk", "parquet", "delta"])
    parser.add_argument("--nights", type=int, default=NIGHTS,
                        help="nightly updates before the last gc and the fresh store "
                        "(1: the first update, no-op, verify, open and gc only)")
    parser.add_argument("--s3", action="store_true",
                        help="stores on a loopback S3 endpoint; bytes uploaded per step")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if args.s3:
        return with_s3(args)
    run(args)


def with_s3(args: argparse.Namespace) -> None:
    global S3
    sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]
    from s3count import counting_s3

    from tests.s3server import environment, make_bucket

    with counting_s3() as (url, counter):
        os.environ.update(environment(url))  # the steps' processes find it so
        make_bucket(url, S3_BUCKET)
        S3 = counter
        S3.take()
        run(args)


def _after_nights(by: dict[str, dict[str, Any]], nights: int) -> str:
    if nights < 2:
        return ""
    after, fresh = by["gc after nights"]["store_mb"], by["fresh store"]["store_mb"]
    return (f"; after {nights} updates and gc {after:.1f} MB, {after / fresh:.2f}x a fresh "
            "store of the same rows")


def run(args: argparse.Namespace) -> None:
    model = make_tiny_model(WORK / "tiny-bert")
    flags = sorted({f for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags") for f in line.split()[2:]}
                   & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"{cpu_name()} ({', '.join(flags)}), {os.cpu_count()} cores; load "
          f"{os.getloadavg()[0]:.1f} at start; {time.strftime('%Y-%m-%d %H:%M')}; stores "
          + ("on a loopback S3 endpoint" if S3 is not None else "on local disk"))
    results = []
    for rows in args.rows:
        for fmt in args.formats:
            results += one_size(fmt, rows, model, args.nights)
    for fmt in args.formats:
        for rows in args.rows:
            by = {r["step"]: r for r in results if r["format"] == fmt and r["rows"] == rows}
            full, update = by["full run"], by["update"]
            uploaded = (f"; uploaded {update['uploaded'] / full['uploaded']:.1%} of the "
                        "full run's bytes to S3") if S3 is not None else ""
            print(f"{fmt} {rows} rows: the update wrote {update['written'] / full['written']:.1%}"
                  f" of the full run's bytes{uploaded} in "
                  f"{update['wall_s'] / full['wall_s']:.1%} of its wall time; no-op update "
                  f"{by['no-op update']['wall_s']:.1f}s; store after "
                  f"gc {by['gc --keep 1']['store_mb'] / full['store_mb']:.2f}x the full run's;"
                  f" peak RSS: full run {full['rss_mb']:.0f} MB, update "
                  f"{update['rss_mb']:.0f} MB" + _after_nights(by, args.nights))
    if len(args.rows) > 1:
        small, large = min(args.rows), max(args.rows)
        for fmt in args.formats:
            for key in ("rss_mb", "anon_mb"):
                got = {(r["rows"], r["step"]): r[key] for r in results if r["format"] == fmt}
                print(f"{fmt} peak {'RSS' if key == 'rss_mb' else 'anonymous memory'} at "
                      f"{large:,} rows against {small:,}: " + ", ".join(
                          f"{step} {got[large, step] / got[small, step]:.2f}x" for step in
                          ("full run", "update", "no-op update", "verify", "open + read")))
    name = "results-s3.json" if S3 is not None else "results.json"
    (WORK / name).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'Stores that grow: Icechunk, Parquet and Delta'):
        main()
