"""Start-up of bertpipe: process start to the first batch encoded, the way `bertpipe
extract` gets there (the CLI's imports, the job, the model loaded or its export compiled,
the first partition read and chunked, one batch).

    python benchmarks/first_batch.py JOB.yaml

Prints `first-batch CPU_SECONDS` when the batch is encoded (the benchmark times that line's arrival
from outside, interpreter start included), then a JSON line of phase times measured here.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import json  # noqa: E402
import sys  # noqa: E402

import pipeline.cli  # noqa: E402,F401 - what the console script imports first


def main() -> None:
    from pipeline.extract.batching import plan_batches
    from pipeline.extract.chunking import chunk_partition
    from pipeline.extract.partition import Extractor
    from pipeline.extract.source import plan_partitions, read_partition
    from pipeline.spec import load_job

    phases = {"imports": time.perf_counter() - START}
    job = load_job(sys.argv[1])
    extractor = Extractor(job)
    phases["model_ready"] = time.perf_counter() - START
    part = plan_partitions(job.input, job.execution.partition_rows)[0]
    texts = read_partition(job.input, part).texts[:256]
    chunked = chunk_partition(texts, extractor.model.tokenizer, job.chunking,
                              extractor.budget, extractor.specials)
    lengths = [len(ids) for ids in chunked.chunk_ids]
    batch = plan_batches(lengths, job.batching.max_tokens_per_batch,
                         job.batching.max_batch_size)[0]  # the longest texts come first
    extractor.encoder.encode_batch([chunked.chunk_ids[i] for i in batch])
    phases["first_batch"] = time.perf_counter() - START
    print(f"first-batch {time.process_time():.3f}", flush=True)  # CPU seconds so far
    print(json.dumps({"phases": phases, "runtime": extractor.runtime.name,
                      "dtype": extractor.runtime.dtype}))


if __name__ == "__main__":
    main()
