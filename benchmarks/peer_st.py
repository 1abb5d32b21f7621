"""The peer: sentence-transformers `encode` over the same texts, as users run it.

Usage: python benchmarks/peer_st.py MODEL_DIR TEXTS.parquet OUT.npy [--batch-size 32]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("texts")
    ap.add_argument("out")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-seq-length", type=int, default=512)
    args = ap.parse_args()

    import numpy as np
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    texts = pq.read_table(args.texts, columns=["text"]).column("text").to_pylist()
    model = SentenceTransformer(args.model, device=args.device, local_files_only=True)
    # the model card sets 256; use the encoder's full 512 so both sides see the same tokens
    model.max_seq_length = args.max_seq_length
    start = time.perf_counter()
    vectors = model.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
    print(f"encode_seconds={time.perf_counter() - start:.3f}")
    np.save(args.out, vectors)


if __name__ == "__main__":
    main()
