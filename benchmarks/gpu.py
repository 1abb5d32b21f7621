"""GPU throughput: bertpipe (bf16) against sentence-transformers (fp16) on one NVIDIA GPU.

Needs nothing but the repository: a BERT-base is randomly initialised from its config
(weights do not travel; speed does not depend on their values) with a generated
WordPiece vocabulary of BERT-base's size, and the texts are the shipped sample reviews
repeated. Prints tokens/s for both and FLOP utilisation against the GPU's bf16 matmul
peak measured in the same run.

    make bench-gpu            # or: python benchmarks/gpu.py [--rows 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_model(root: Path) -> Path:
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    torch.manual_seed(0)
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
    BertModel(BertConfig()).save_pretrained(root, safe_serialization=True)  # BERT-base
    return root


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


def peer(model: Path, source: Path, batch: int) -> float:
    """sentence-transformers fp16, in this process after a warm-up: seconds to encode."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    st = SentenceTransformer(modules=[models.Transformer(str(model), max_seq_length=512),
                                      models.Pooling(768, pooling_mode="mean")], device="cuda")
    st.half()
    texts = pq.read_table(source).column("text").to_pylist()
    st.encode(texts[:256], batch_size=batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    st.encode(texts, batch_size=batch)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--st-batch", type=int, default=128)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs one NVIDIA GPU")
    work = Path(tempfile.mkdtemp(prefix="bertpipe-gpu-"))
    model = make_model(work / "bert-base-random")
    src = pq.read_table(REPO / "data" / "reviews.parquet", columns=["text"])
    table = pa.concat_tables([src] * (-(-args.rows // src.num_rows))).slice(0, args.rows)
    source = work / "texts.parquet"
    pq.write_table(table.append_column("id", pa.array(np.arange(args.rows))), source)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = table.column("text").to_pylist()
    tokens = sum(len(i) for i in tok(texts, truncation=True, max_length=512)["input_ids"])
    job = {"input": {"path": str(source), "text_column": "text", "id_column": "id"},
           "model": {"path": str(model), "dtype": "bfloat16", "device": "cuda"},
           "views": {"mean": {"pooling": "mean"}},
           "output": {"path": str(work / "out.zarr"), "overwrite": True, "levels": ["docs"]},
           "batching": {"max_tokens_per_batch": 65536, "max_batch_size": 512},
           "execution": {"scheduler": "synchronous", "partition_rows": 8192}}
    job_path = work / "job.yaml"
    job_path.write_text(yaml.safe_dump(job))
    peak = gemm_peak()
    flop_per_token = 12 * (2 * (4 * 768**2 + 2 * 768 * 3072)) + 12 * 4 * 768 * tokens / args.rows
    runs = {"bertpipe bf16 (whole process)": [], "sentence-transformers fp16 (encode only)": []}
    for _ in range(args.reps):
        start = time.perf_counter()
        subprocess.run([str(BIN / "bertpipe"), "extract", str(job_path)], check=True,
                       capture_output=True)
        runs["bertpipe bf16 (whole process)"].append(time.perf_counter() - start)
        runs["sentence-transformers fp16 (encode only)"].append(peer(model, source,
                                                                    args.st_batch))
    import pipeline

    stats = pipeline.open_store(work / "out.zarr").provenance.stats
    encode_only = tokens / stats["partition_seconds"]
    print(f"{torch.cuda.get_device_name()}: bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; "
          f"{args.rows} texts, {tokens} tokens; BERT-base {flop_per_token / 1e6:.0f} MFLOP/token")
    results = {}
    for name, walls in runs.items():
        tps = tokens / statistics.median(walls)
        results[name] = tps
        print(f"  {name:<44} {tps:>10,.0f} tokens/s  FLOP util "
              f"{100 * tps * flop_per_token / peak:5.1f}%")
    print(f"  {'bertpipe bf16 (partitions only)':<44} {encode_only:>10,.0f} tokens/s  FLOP util "
          f"{100 * encode_only * flop_per_token / peak:5.1f}%")
    print(json.dumps({"peak": peak, "tokens": tokens, "tokens_per_s": results,
                      "bertpipe_partitions_tokens_per_s": encode_only}))


if __name__ == "__main__":
    main()
