"""Chunking cost: the tokenizer + chunker alone on long real documents (Python's pydoc
topics), and a long-document job against the same tokens presented as short texts.

Both inputs are made distinct (benchmarks/texts.py `made_distinct`): the topics hold one
document twice and their paragraphs repeat ("Note:", "See also:"), and bertpipe encodes
identical texts once, which would make the short version look cheaper than its tokens.

    python benchmarks/chunking.py [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import BIN, MODEL, WORK, run_process, write_job  # noqa: E402
from texts import made_distinct  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def long_texts() -> list[str]:
    from pydoc_data.topics import topics

    return made_distinct(topics.values())


def chunker_throughput(texts: list[str], reps: int) -> tuple[float, float, int]:
    """(documents/s, tokens/s, chunks) for tokenize-once + hierarchical chunking."""
    from transformers import AutoTokenizer

    from pipeline.extract.chunking import Specials, chunk_partition, content_budget
    from pipeline.spec import ChunkingSpec

    tok = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
    specials = Specials.from_tokenizer(tok)
    spec = ChunkingSpec()
    budget = content_budget(spec, 512, 512, specials)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        part = chunk_partition(texts, tok, spec, budget, specials)
        times.append(time.perf_counter() - start)
    t = statistics.median(times)
    return len(texts) / t, float(part.n_tokens.sum()) / t, len(part.chunk_ids)


def short_version(texts: list[str]) -> list[str]:
    """The same text cut into short paragraphs (what a corpus of short reviews looks like)."""
    pieces = []
    for text in texts:
        pieces.extend(p.strip() for p in text.split("\n\n") if p.strip())
    return made_distinct(pieces)


def inputs() -> dict[str, list[str]]:
    texts = long_texts()
    return {"long documents": texts, "same text as short paragraphs": short_version(texts)}


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes (a fixed corpus: `rows` does not apply)."""
    return inputs()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    texts = inputs()
    docs_s, tokens_s, chunks = chunker_throughput(texts["long documents"], args.reps)
    print(f"tokenizer + hierarchical chunker: {len(texts['long documents'])} documents, "
          f"{chunks} chunks; {docs_s:,.1f} documents/s, {tokens_s:,.0f} tokens/s")
    walls: dict[str, list[float]] = {name: [] for name in texts}
    jobs = {}
    for i, (name, rows) in enumerate(texts.items()):
        path = WORK / f"chunking-{i}.parquet"
        pq.write_table(pa.table({"id": list(range(len(rows))), "text": rows}), path)
        jobs[name] = write_job(f"chunking-{i}", path, "auto", "auto",
                               {"mean": {"pooling": "mean"}})
    for _ in range(args.reps):
        for name, job in jobs.items():
            walls[name].append(run_process([str(BIN / "bertpipe"), "extract", str(job)]).wall)
    import pipeline

    for i, name in enumerate(texts):
        stats = pipeline.open_store(WORK / f"chunking-{i}.zarr").provenance.stats
        wall = statistics.median(walls[name])
        print(f"{name:<32} {stats['rows']:>5} rows {stats['chunks']:>5} chunks "
              f"{stats['tokens']:>8} tokens  {wall:6.1f}s  {stats['tokens'] / wall:,.0f} tokens/s"
              f"  (coverage {stats['tokens_covered'] / stats['tokens']:.1%})")


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'Long documents'):
        main()
