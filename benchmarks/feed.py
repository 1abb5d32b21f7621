"""Can bertpipe keep an accelerator fed? Its own stages with the model replaced by stand-ins.

bertpipe's partition stages run as `bertpipe extract` runs them (the in-process executor:
read, tokenize and chunk, batch and pad, forward, views, aggregate, write the parts) on
distinct reviews (`run.build_input`: bertpipe encodes identical texts once), with
all-MiniLM-L6-v2's tokenizer and shapes, and the forward pass replaced through the
`encode.Forward` protocol by

    instant   returns states at once (a view of one row per sequence: no work per token)
    device    a simulated accelerator computing the batch's padded tokens at a fixed rate
              (--device-rates: 1M tokens/s, and 100k, a device this CPU can keep up
              with), using no CPU, answering as `instant` does; `queued` as a CUDA
              stream runs (a call queues the batch and returns, the host waits on a
              marker: the encoder queues the next batch before it waits), `blocking` as
              a runtime that returns when the batch is done (the encoder's turn between
              batches leaves the device idle)

The job has one `cls` view: on a GPU the views' arithmetic runs on the device, and `cls`
keeps it from costing this CPU anything here either. Each is run sequentially (as before:
a partition is tokenized, then encoded) and with the next partition prepared ahead on a
lane of its own (run/partition_pipeline.py), alternating, after the fast tokenizer alone
on the same texts (the `tokenizers` library's `encode_batch`, as the chunker calls it through
transformers, without transformers' conversion to Python lists). Figures, medians:

    tokens per CPU-second   content tokens over the CPU time of the whole process (every
                            thread: the tokenizer's own pool included) during the partition
                            stages, less the stand-in's own; target: >= 50% of the tokenizer
                            alone's
    device busy             seconds the simulated device computed over the stages' wall
                            time; target: >= 90%

Each case runs twice: on every CPU this process may use, and pinned to one CPU (a 1-thread
allotment: the preparing thread shares it with the encoder's). CPU model, flags and load
average are printed beside every figure.

    python benchmarks/feed.py [--rows 4000] [--reps 3] [--device-rates 1000000,100000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import WORK, build_input, cpu_info, input_table, load, write_job  # noqa: E402

from pipeline.extract.threads import quiet_waits  # noqa: E402

# as `bertpipe extract` does before torch loads: idle OpenMP threads sleep, not spin
quiet_waits()

TARGET_CPU_SHARE = 0.5  # of the tokenizer alone's tokens per CPU-second
TARGET_BUSY = 0.9  # of the simulated device's time


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py)."""
    return {f"{rows} rows": input_table(rows).column("text").to_pylist()}


# ---- the stand-ins (benchmark code: injected through encode.Forward) ------------------------

class InstantDevice:
    """A forward pass that answers at once: each sequence's states are one row of a small
    table (picked by its length, so outputs differ between sequences), broadcast over its
    positions without a copy. Counts its own CPU time, which the figures leave out."""

    def __init__(self, layers: frozenset[int], hidden: int):
        import torch

        self.layers = sorted(layers)
        self.rows = torch.randn(512, 1, hidden, generator=torch.Generator().manual_seed(0))
        self.cpu_s = 0.0
        self.busy_s = 0.0

    def __call__(self, ids: Any, mask: Any) -> tuple[dict[int, Any], None]:
        import torch

        start = time.thread_time()
        self.compute(ids.shape[0] * ids.shape[1])
        # why NumPy for the lengths: a torch reduction would wake torch's thread team,
        # work a device's stand-in must not bring onto the CPU
        lengths = torch.from_numpy(mask.numpy().sum(1) % len(self.rows))
        states = self.rows[lengths].expand(-1, ids.shape[1], -1)
        self.cpu_s += time.thread_time() - start
        return {layer: states for layer in self.layers}, None

    def compute(self, padded_tokens: int) -> None:
        """The device's work: none."""


class SimulatedDevice(InstantDevice):
    """An accelerator at `rate` tokens/s that returns when it is done: the calling thread
    sleeps for the batch's padded tokens (a device computes the padding too) and uses no
    CPU meanwhile. The encoder cannot hand it the next batch before this one is back."""

    def __init__(self, layers: frozenset[int], hidden: int, rate: float):
        super().__init__(layers, hidden)
        self.rate = rate

    def compute(self, padded_tokens: int) -> None:
        seconds = padded_tokens / self.rate
        time.sleep(seconds)
        self.busy_s += seconds


class QueuingDevice(SimulatedDevice):
    """The same accelerator driven as a CUDA stream drives a GPU: a call queues the batch
    and returns at once; the device works through its queue in order, and `record()`
    marks the end of what is queued so far, a wait on it sleeping until the device gets
    there (a CUDA event's synchronize). The encoder queues batch k + 1 before it waits for
    batch k (`encode.queue_marker`)."""

    def __init__(self, layers: frozenset[int], hidden: int, rate: float):
        super().__init__(layers, hidden, rate)
        self.free_at = 0.0  # perf_counter time at which the device finishes its queue

    def compute(self, padded_tokens: int) -> None:
        seconds = padded_tokens / self.rate
        self.free_at = max(time.perf_counter(), self.free_at) + seconds
        self.busy_s += seconds

    def record(self) -> Callable[[], None]:
        done_at = self.free_at
        return lambda: time.sleep(max(0.0, done_at - time.perf_counter()))


# ---- one process: the measurements ---------------------------------------------------------

def tokenizer_alone(tokenizer: Any, texts: list[str]) -> tuple[int, float]:
    """(content tokens, CPU seconds) of the fast tokenizer over `texts`, in one batch as
    chunking tokenizes a partition (its own thread pool included)."""
    from tokenizers import Tokenizer

    # a copy without the padding and truncation tokenizer.json may set (transformers turns
    # them off for chunking's calls): the same tokens as chunking gets, no more
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    backend.no_truncation()
    cpu = time.process_time()
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    cpu = time.process_time() - cpu
    return sum(len(e.ids) for e in encodings), cpu


def stages(job: Any, extractor: Any, ahead: int) -> dict[str, float]:
    """Wall and CPU seconds of the partition stages of one `bertpipe extract` run, and the
    content tokens it counted."""
    from pipeline.run.executors import InProcessExecutor
    from pipeline.run.runner import run_job

    timed: dict[str, float] = {}

    class Timed(InProcessExecutor):
        def run(self, *args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return super().run(*args, **kwargs)
            finally:
                timed.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu)

    summary = run_job(job, Timed(extractor, ahead=ahead), overwrite=True)
    return {**timed, "tokens": summary.tokens}


def measure(rows: int, reps: int, rates: list[float], partition_rows: int) -> dict[str, Any]:
    """Every case `reps` times, alternating; per case the medians (see the docstring)."""
    from pipeline.extract.partition import Extractor
    from pipeline.spec import Job

    source = build_input(rows, f"reviews-{rows}")
    job_file = write_job(f"feed-{rows}", source, "torch", "float32",
                         {"cls": {"pooling": "cls"}}, partition_rows)
    job = Job.from_dict(yaml.safe_load(job_file.read_text()))
    extractor = Extractor(job)  # the real tokenizer and shapes; its weights never run
    texts = pq.read_table(source, columns=["text"]).column("text").to_pylist()
    hidden, layers = extractor.model.hidden_size, extractor.needs.layers
    devices: dict[str, Callable[[], InstantDevice]] = {
        "instant": lambda: InstantDevice(layers, hidden)}
    for rate in rates:
        devices[f"device {rate:,.0f}/s, queued"] = (
            lambda rate=rate: QueuingDevice(layers, hidden, rate))
        devices[f"device {rate:,.0f}/s, blocking"] = (
            lambda rate=rate: SimulatedDevice(layers, hidden, rate))
    samples: dict[str, list[dict[str, float]]] = {}
    loads = []
    tokens = 0
    for _ in range(reps):
        loads.append(load())
        tokens, cpu = tokenizer_alone(extractor.model.tokenizer, texts)
        samples.setdefault("tokenizer alone", []).append({"cpu_rate": tokens / cpu})
        for device_name, make in devices.items():
            for ahead in (0, 1):
                device = make()
                extractor.encoder.forward = device
                took = stages(job, extractor, ahead)
                assert took["tokens"] == tokens, "the pipeline and the reference differ"
                own_cpu = took["cpu"] - device.cpu_s
                samples.setdefault(f"{device_name}, {'ahead' if ahead else 'sequential'}",
                                   []).append({"cpu_rate": tokens / own_cpu,
                                               "wall_rate": tokens / took["wall"],
                                               "busy": device.busy_s / took["wall"]})
        loads.append(load())
    cases = {name: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
             for name, runs in samples.items()}
    return {"cpus": len(os.sched_getaffinity(0)), "rows": rows, "tokens": tokens,
            "partitions": -(-rows // partition_rows), "load": [min(loads), max(loads)],
            "cases": cases}


# ---- the report ----------------------------------------------------------------------------

def report(result: dict[str, Any], cpu: dict[str, Any]) -> None:
    tag = (f"[{cpu['model']}, {','.join(cpu['flags']) or 'no avx2'}, "
           f"load {result['load'][0]:.1f}-{result['load'][1]:.1f}]")
    cases = result["cases"]
    reference = cases["tokenizer alone"]["cpu_rate"]
    print(f"\n{result['cpus']} CPU(s): {result['rows']} distinct rows, {result['tokens']:,} "
          f"tokens, {result['partitions']} partitions  {tag}")
    print(f"  {'tokenizer alone':<42} {reference:>9,.0f} tokens per CPU-s; on "
          f"{result['cpus']} CPU(s) it feeds at most {reference * result['cpus']:,.0f} "
          f"tokens/s  {tag}")
    for name, figures in cases.items():
        if name == "tokenizer alone":
            continue
        share = figures["cpu_rate"] / reference
        line = (f"  {name:<42} {figures['cpu_rate']:>9,.0f} tokens per CPU-s = {share:4.0%} "
                f"of the tokenizer's ({verdict(share, TARGET_CPU_SHARE)}), "
                f"{figures['wall_rate']:>9,.0f} tokens/s wall")
        if name.startswith("device"):
            busy = figures["busy"]
            line += f", device busy {busy:4.0%} ({verdict(busy, TARGET_BUSY)})"
        print(f"{line}  {tag}")


def verdict(figure: float, target: float) -> str:
    return f"target {target:.0%} {'met' if figure >= target else 'not met'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--partition-rows", type=int, default=500)
    ap.add_argument("--device-rates", default="1000000,100000",
                    help="the simulated devices' speeds, padded tokens per second")
    ap.add_argument("--one-cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rates = [float(r) for r in args.device_rates.split(",")]
    if args.one_cpu:  # the child: before torch or the tokenizer starts a thread pool
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        print(json.dumps(measure(args.rows, args.reps, rates, args.partition_rows)))
        return
    cpu = cpu_info()
    # the 1-CPU case first, in a child process: pools sized by affinity are sized at start
    child = subprocess.run([sys.executable, __file__, "--one-cpu", "--rows", str(args.rows),
                            "--reps", str(args.reps), "--device-rates", args.device_rates,
                            "--partition-rows", str(args.partition_rows)],
                           capture_output=True, text=True, check=True)
    one_cpu = json.loads(child.stdout.strip().splitlines()[-1])
    every_cpu = measure(args.rows, args.reps, rates, args.partition_rows)
    for result in (every_cpu, one_cpu):
        report(result, cpu)
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "feed.json").write_text(json.dumps({"cpu": cpu, "device_rates": rates,
                                                "results": [every_cpu, one_cpu]}, indent=1))


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, 'Keeping an accelerator fed', children=("--one-cpu",)):
        main()
