"""A peer: sentence-transformers `encode` over the same texts, as users run it, with one
of its CPU backends. Runs in the peer venv (benchmarks/setup_peers.sh).

    python benchmarks/peer_st.py MODEL_DIR TEXTS.parquet OUT.npy [--backend BACKEND]

BACKEND: torch (default), onnx, onnx-int8 or openvino.

Prints `first-batch CPU_SECONDS` once the first batch is encoded (the benchmark times
that line's arrival: process start to first batch), then a JSON line with the encode
seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def backend_kwargs(model: str, backend: str) -> dict:
    if backend == "onnx":
        return {"backend": "onnx", "model_kwargs": {"file_name": "onnx/model.onnx"}}
    if backend == "onnx-int8":
        int8 = json.loads((Path(model) / "peers.json").read_text())["int8_file"]
        return {"backend": "onnx", "model_kwargs": {"file_name": int8}}
    if backend == "openvino-f32":  # the precision hint a user sets where bf16 is slower
        return {"backend": "openvino",
                "model_kwargs": {"ov_config": {"INFERENCE_PRECISION_HINT": "f32"}}}
    if backend == "torch-bf16":  # PyTorch in bfloat16 (fast where the CPU has AMX)
        import torch

        return {"backend": "torch", "model_kwargs": {"torch_dtype": torch.bfloat16}}
    return {"backend": backend}  # torch; openvino at its own default precision for this CPU


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("texts")
    ap.add_argument("out")
    ap.add_argument("--backend", default="torch",
                    choices=["torch", "torch-bf16", "onnx", "onnx-int8", "openvino",
                             "openvino-f32"])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-seq-length", type=int, default=512)
    args = ap.parse_args()

    import numpy as np
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    texts = pq.read_table(args.texts, columns=["text"]).column("text").to_pylist()
    model = SentenceTransformer(args.model, device=args.device, local_files_only=True,
                                **backend_kwargs(args.model, args.backend))
    # the model card sets 256; use the encoder's full 512 so both sides see the same tokens
    model.max_seq_length = args.max_seq_length
    start = time.perf_counter()
    first = model.encode(texts[:args.batch_size], batch_size=args.batch_size)
    print(f"first-batch {time.process_time():.3f}", flush=True)  # CPU seconds so far
    rest = model.encode(texts[args.batch_size:], batch_size=args.batch_size)
    seconds = time.perf_counter() - start
    np.save(args.out, np.concatenate([first, rest]) if len(rest) else first)
    print(json.dumps({"encode_seconds": seconds}))


if __name__ == "__main__":
    main()
