"""GPU throughput: bertpipe (bf16) against sentence-transformers (fp16) on one NVIDIA GPU.

Needs nothing but the repository: a BERT-base is randomly initialised from its config
(weights do not travel; speed does not depend on their values) with a generated
WordPiece vocabulary of BERT-base's size, and the texts are distinct reviews derived from
the shipped samples (benchmarks/texts.py: bertpipe encodes identical texts once, the peer
encodes every row, so repeated texts would overstate bertpipe by the repeat factor).
Prints tokens/s for both, FLOP utilisation against the GPU's bf16 matmul peak measured in
the same run, the GPU's own utilisation while bertpipe runs (nvidia-smi,
sampled), and the agreement of bertpipe's bf16 vectors with its float32 ones (cosine per
row). One script; it stops starting rounds that would take it past --budget-s (8
minutes by default) and prints how long it took.

    make bench-gpu            # or: python benchmarks/gpu.py [--rows 20000]
    python benchmarks/gpu.py --dry-run   # the same steps on the CPU, small: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from texts import distinct_reviews  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_model(root: Path, small: bool = False) -> Path:
    """A random BERT-base (`small`: 2 layers of width 128, for a dry run) and its tokenizer."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    texts = pq.read_table(REPO / "data" / "reviews.parquet").column("text").to_pylist()
    words = sorted({w.lower().strip(".,!?;:\"'()") for t in texts for w in t.split()} - {""})
    chars = sorted({c for t in texts for c in t.lower() if not c.isspace()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars),
             *words]
    vocab += [f"[unused{i}]" for i in range(30522 - len(vocab))]  # BERT-base's vocab size
    (root / "vocab.txt").write_text("\n".join(vocab[:30522]) + "\n")
    tok = BertTokenizerFast(vocab=str(root / "vocab.txt"), do_lower_case=True)
    tok.model_max_length = 512
    tok.save_pretrained(root)
    config = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=512) if small else BertConfig()  # BERT-base
    BertModel(config).save_pretrained(root, safe_serialization=True)
    return root


def input_table(rows: int) -> pa.Table:
    """`rows` distinct reviews and their ids: what both sides encode."""
    return pa.table({"text": pa.array(distinct_reviews(rows), pa.string()),
                     "id": pa.array(np.arange(rows))})


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py)."""
    return {f"{rows} rows": input_table(rows).column("text").to_pylist()}


def gemm_peak() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (time.perf_counter() - start)


def peer(model: Path, source: Path, batch: int, device: str) -> float:
    """sentence-transformers fp16 (float32 on the CPU), in this process after a warm-up:
    seconds to encode."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(str(model), max_seq_length=512)
    width = getattr(transformer, "get_embedding_dimension", None) or \
        transformer.get_word_embedding_dimension  # the older name
    st = SentenceTransformer(modules=[transformer, models.Pooling(width(), pooling_mode="mean")],
                             device=device)
    if device == "cuda":
        st.half()
    texts = pq.read_table(source).column("text").to_pylist()
    st.encode(texts[:256], batch_size=batch)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    st.encode(texts, batch_size=batch)
    synchronize()
    return time.perf_counter() - start


class GpuSampler:
    """The GPU's utilisation (percent of time a kernel ran, as nvidia-smi reports it),
    sampled every `every` seconds while entered; no samples without nvidia-smi."""

    def __init__(self, every: float = 0.2):
        self.every = every
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu",
                                  "--format=csv,noheader,nounits", "--id=0"],
                                 capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip():
                self.samples.append(float(out.stdout.split()[0]))

    def mean(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def write_job(path: Path, source: Path, model: Path, out: Path, dtype: str, device: str
              ) -> Path:
    job = {"input": {"path": str(source), "text_column": "text", "id_column": "id"},
           "model": {"path": str(model), "dtype": dtype, "device": device,
                     "runtime": "torch"},
           "views": {"mean": {"pooling": "mean"}},
           "output": {"path": str(out), "overwrite": True, "levels": ["docs"]},
           "batching": {"max_tokens_per_batch": 65536, "max_batch_size": 512},
           "execution": {"scheduler": "synchronous", "partition_rows": 8192}}
    path.write_text(yaml.safe_dump(job))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--st-batch", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=480,
                    help="start no round that would end the script after this many seconds")
    ap.add_argument("--dry-run", action="store_true",
                    help="every step on the CPU with a small model and 64 rows: checks the "
                         "script where there is no GPU (its figures mean nothing)")
    args = ap.parse_args()
    began = time.perf_counter()
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.rows, args.reps = 64, 1
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs one NVIDIA GPU (--dry-run: the "
                 "same steps on the CPU)")
    work = Path(tempfile.mkdtemp(prefix="bertpipe-gpu-"))
    model = make_model(work / "bert-base-random", small=args.dry_run)
    table = input_table(args.rows)
    source = work / "texts.parquet"
    pq.write_table(table, source)
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    config = AutoConfig.from_pretrained(model)
    texts = table.column("text").to_pylist()
    tokens = sum(len(i) for i in tok(texts, truncation=True, max_length=512)["input_ids"])
    # bf16 on the GPU; the dry run's CPU may lack it, and only checks the steps
    fast_dtype = "float32" if args.dry_run else "bfloat16"
    job_path = write_job(work / "job.yaml", source, model, work / "out.zarr", fast_dtype,
                         device)
    reference_job = write_job(work / "job-fp32.yaml", source, model, work / "fp32.zarr",
                              "float32", device)
    peak = None if args.dry_run else gemm_peak()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    flop_per_token = layers * (2 * (4 * hidden**2 + 2 * hidden * config.intermediate_size)) \
        + layers * 4 * hidden * tokens / args.rows
    ours, theirs = f"bertpipe {fast_dtype} (whole process)", "sentence-transformers (encode only)"
    runs: dict[str, list[float]] = {ours: [], theirs: []}
    busy: list[float] = []
    round_s = 0.0
    for rep in range(args.reps):
        # a round, then the float32 run, must fit: the script stays within its budget
        if rep and time.perf_counter() - began + 2.5 * round_s > args.budget_s:
            print(f"  {rep} of {args.reps} rounds: another would pass {args.budget_s:.0f} s")
            break
        start = time.perf_counter()
        with GpuSampler() as sampler:
            subprocess.run([str(BIN / "bertpipe"), "extract", str(job_path)], check=True,
                           capture_output=True)
        runs[ours].append(time.perf_counter() - start)
        if sampler.mean() is not None:
            busy.append(sampler.mean())  # type: ignore[arg-type]
        runs[theirs].append(peer(model, source, args.st_batch, device))
        round_s = time.perf_counter() - start
    subprocess.run([str(BIN / "bertpipe"), "extract", str(reference_job)], check=True,
                   capture_output=True)  # untimed: the float32 vectors to agree with
    import pipeline

    store = pipeline.open_store(work / "out.zarr")
    agreement = cosines(store.vectors("mean"),
                        pipeline.open_store(work / "fp32.zarr").vectors("mean"))
    encode_only = tokens / store.provenance.stats["partition_seconds"]
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    peak_text = f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s" if peak else "no peak measured"
    print(f"{name}: {peak_text}; {args.rows} texts, {tokens} tokens; "
          f"{flop_per_token / 1e6:.0f} MFLOP/token")
    results = {}
    for label, walls in [*runs.items(), ("bertpipe (partitions only)", [])]:
        tps = tokens / statistics.median(walls) if walls else encode_only
        results[label] = tps
        util = f"FLOP util {100 * tps * flop_per_token / peak:5.1f}%" if peak else ""
        print(f"  {label:<44} {tps:>10,.0f} tokens/s  {util}")
    gpu_busy = statistics.median(busy) if busy else None
    print(f"  GPU utilisation while bertpipe ran (nvidia-smi): "
          f"{f'{gpu_busy:.0f}%' if gpu_busy is not None else 'not sampled'}")
    print(f"  bertpipe {fast_dtype} against its float32, cosine per row: min "
          f"{agreement.min():.5f}, mean {agreement.mean():.5f}")
    print(f"  {time.perf_counter() - began:.0f} s in all")
    print(json.dumps({"device": name, "peak": peak, "tokens": tokens, "tokens_per_s": results,
                      "gpu_utilisation": gpu_busy,
                      "cosine_to_float32": {"min": float(agreement.min()),
                                            "mean": float(agreement.mean())},
                      "seconds": time.perf_counter() - began}))


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'GPU throughput', children=("--dry-run",)):
        main()
