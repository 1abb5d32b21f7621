"""Throughput, agreement, start-up and memory of `bertpipe extract` against
sentence-transformers' CPU backends, whole processes alternating.

Peers, from their own venv (benchmarks/setup_peers.sh made it and their exports, untimed):
sentence-transformers `encode` with PyTorch fp32 and bf16, ONNX Runtime fp32, ONNX Runtime
dynamic int8, OpenVINO at its default precision for this CPU and with the f32 precision
hint (every backend and precision a user could configure; the fastest non-quantised one is
the ratio's reference). bertpipe: runtime torch float32,
torch with dtype auto, openvino, and the auto runtime with 8 views, attention pooling and a
layer-2 view. Each round runs every case once, in alternating order; the table gives
medians: tokens/s and tokens per CPU-second of the whole process, the ratios to the fastest
non-quantised peer, start-up (process start to the first batch encoded, wall and CPU),
tokens/s and tokens per CPU-second after the first batch, the share of the cores the process
kept busy, cosine min/mean to float32, linear-probe accuracy, peak RSS and matmul
utilisation. Then the steady state: the defaults against the fastest non-quantised peer on
--steady-rows distinct rows (10,000), where start-up no longer weighs, the same figures.
The CPU is named (model, flags, cores) beside every table.

    python benchmarks/run.py [--rows 2400] [--reps 2] [--steady-rows 10000]
                             [--memory-rows 2000] [--peer-venv benchmarks/work/peer-venv]
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
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from texts import distinct_reviews, review_labels  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "benchmarks" / "work"
MODEL = REPO / "models" / "all-MiniLM-L6-v2"
BIN = Path(sys.executable).parent
# the benchmark's own export cache: warmed once before the timed rounds
os.environ["BERTPIPE_CACHE_DIR"] = str(WORK / "cache")

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

# name -> backend of benchmarks/peer_st.py
PEERS = {
    "st torch fp32": "torch",
    "st torch bf16": "torch-bf16",
    "st onnx fp32": "onnx",
    "st onnx int8": "onnx-int8",
    "st openvino": "openvino",
    "st openvino f32 hint": "openvino-f32",
}
QUANTISED = {"st onnx int8"}
REFERENCE_PEER = "st torch fp32"

# name -> (runtime, dtype, views): every case is a whole `bertpipe extract` process
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bertpipe defaults": ("auto", "auto", ONE_VIEW),  # what a job that names neither gets
    "bertpipe torch fp32": ("torch", "float32", ONE_VIEW),
    "bertpipe torch auto": ("torch", "auto", ONE_VIEW),
    "bertpipe openvino": ("openvino", "auto", ONE_VIEW),
    "bertpipe auto, 8 views": ("auto", "auto", EIGHT_VIEWS),
    "bertpipe auto, attention": ("auto", "auto", {"attn": {"pooling": "attention"}}),
    "bertpipe auto, layer 2": ("auto", "auto", {"l2": {"layers": [2], "pooling": "mean"}}),
}
# runtime -> dtype for the agreement runs (8 views each, against torch float32)
AGREEMENT = {"torch auto": ("torch", "auto"), "openvino": ("openvino", "auto")}
# steady state is read where start-up no longer weighs: the defaults against the fastest
# non-quantised peer on this many distinct rows (issue 41: "at >= 10k rows")
STEADY_ROWS = 10_000
STEADY_CASE = "bertpipe defaults"


# ---- the machine ---------------------------------------------------------------------------

def cpu_info() -> dict[str, Any]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    wanted = ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_bf16", "amx_int8"]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"model": fields.get("model name", platform.processor() or platform.machine()),
            "cores": usable or os.cpu_count(), "flags": [f for f in wanted if f in flags],
            "bf16": bool(flags & {"avx512_bf16", "amx_bf16"})}


def progress(text: str) -> None:
    """A line on how far the run has got: stderr, so the result file keeps the report only."""
    print(text, file=sys.stderr, flush=True)


def load() -> float:
    return os.getloadavg()[0]


# ---- inputs and jobs -----------------------------------------------------------------------

def input_table(rows: int) -> pa.Table:
    """`rows` distinct real reviews (texts.distinct_reviews: the 600 samples, then again with
    a copy number appended; nothing is saved by encoding duplicates once), labels, fresh ids."""
    return pa.table({"text": pa.array(distinct_reviews(rows), pa.string()),
                     "label": review_labels(rows),
                     "id": pa.array(np.arange(rows, dtype=np.int64))})


def build_input(rows: int, name: str) -> Path:
    """`input_table(rows)` as a Parquet file in the work folder (kept for the next run)."""
    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / f"{name}-distinct.parquet"
    if not path.exists() or pq.read_metadata(path).num_rows != rows:
        pq.write_table(input_table(rows), path)
    return path


def benchmark_inputs(rows: int) -> dict[str, list[str]]:
    """Every text input this benchmark encodes at `--rows rows` (tests/test_benchmarks.py):
    the timed rounds, the steady-state pair and the memory runs read `build_input`'s."""
    return {f"{n} rows": input_table(n).column("text").to_pylist()
            for n in (rows, STEADY_ROWS, rows * 10)}


def write_job(name: str, source: Path, runtime: str, dtype: str, views: dict[str, Any],
              partition_rows: int = 2048) -> Path:
    job = {
        "input": {"path": str(source), "text_column": "text", "id_column": "id"},
        "model": {"path": str(MODEL), "dtype": dtype, "device": "cpu", "runtime": runtime},
        "chunking": {"strategy": "hierarchical"},
        "views": views,
        "output": {"path": str(WORK / f"{name}.zarr"), "format": "zarr", "overwrite": True},
        "execution": {"scheduler": "synchronous", "partition_rows": partition_rows},
    }
    path = WORK / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def count_tokens(source: Path) -> int:
    from tokenizers import Tokenizer  # not transformers: keeps torch out of this process

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    tok.enable_truncation(512)
    tok.no_padding()  # the model's tokenizer.json pads batches: count real tokens only
    texts = pq.read_table(source, columns=["text"]).column("text").to_pylist()
    return sum(len(enc.ids) for enc in tok.encode_batch(texts))


# ---- processes -----------------------------------------------------------------------------

@dataclass
class Proc:
    wall: float  # seconds, process start to exit
    cpu: float  # CPU seconds (user + system) of the whole process: steadier on a busy host
    rss: float  # peak RSS of the process, MiB
    first_batch: float | None  # seconds from process start to its `first-batch` line
    first_batch_cpu: float | None  # CPU seconds the process had used by then
    output: list[str] = field(default_factory=list)


def run_process(cmd: list[str]) -> Proc:
    """Runs `cmd` to the end, timing from outside (interpreter start included)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    first = first_cpu = None
    lines = []
    for line in proc.stdout:
        if first is None and line.startswith("first-batch"):
            first = time.perf_counter() - start
            first_cpu = float(line.split()[1])
        lines.append(line.rstrip("\n"))
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n" + "\n".join(lines[-30:]))
    return Proc(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, first,
                first_cpu, lines)


def last_json(proc: Proc) -> dict[str, Any]:
    return json.loads(next(line for line in reversed(proc.output) if line.startswith("{")))


# ---- in-process figures (a child process: torch stays out of this one) ---------------------

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


def encoder_only(source: Path, runtime: str, dtype: str) -> float:
    """tokens/s of the encoder alone (forward + pooling) on bertpipe's own batches."""
    from pipeline.extract.partition import Extractor
    from pipeline.spec import Job

    job = Job.from_dict(yaml.safe_load(write_job("encoder-only", source, runtime, dtype,
                                                 ONE_VIEW).read_text()))
    ex = Extractor(job)
    texts = pq.read_table(source, columns=["text"]).column("text").to_pylist()
    ids = [ex.model.tokenizer.encode(t, truncation=True, max_length=512) for t in texts]
    ex.encoder.encode(ids[:64], job.batching)  # warm up
    start = time.perf_counter()
    ex.encoder.encode(ids, job.batching)
    return sum(map(len, ids)) / (time.perf_counter() - start)


def in_process(source: Path, bf16: bool) -> None:
    peaks = {d: gemm_peak(d) for d in (["float32", "bfloat16"] if bf16 else ["float32"])}
    enc = {"torch fp32": encoder_only(source, "torch", "float32"),
           "openvino": encoder_only(source, "openvino", "auto")}
    if bf16:
        enc["torch auto"] = encoder_only(source, "torch", "auto")
    print(json.dumps({"peaks": peaks, "encoder_only": enc}))


# ---- agreement and probes ------------------------------------------------------------------

def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def store_vectors(name: str, view: str) -> np.ndarray:
    import pipeline  # imports torch: only after every timed run

    return pipeline.open_store(WORK / f"{name}.zarr").vectors(view)


def store_facts(name: str) -> dict[str, Any]:
    """What the run recorded: runtime, dtype, seconds spent in partitions."""
    import pipeline

    prov = pipeline.open_store(WORK / f"{name}.zarr").provenance
    return {"runtime": ",".join(prov.runtime), "dtype": ",".join(prov.dtype),
            "partition_seconds": float(prov.stats["partition_seconds"])}


def probe_accuracy(vectors: np.ndarray, labels: np.ndarray) -> float:
    """5-fold logistic-regression accuracy on the 600 distinct reviews."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import cross_val_score

    n = min(600, len(labels))
    clf = LogisticRegression(max_iter=2000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small --rows: a class with fewer rows than folds
        return float(cross_val_score(clf, vectors[:n], labels[:n], cv=5).mean())


# ---- the run ----------------------------------------------------------------------------

def main() -> None:
    if sys.argv[1:2] == ["--in-process"]:
        return in_process(Path(sys.argv[2]), sys.argv[3] == "bf16")
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2400)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steady-rows", type=int, default=STEADY_ROWS,
                    help="the defaults against the fastest peer on this many rows (0: skip)")
    ap.add_argument("--memory-rows", type=int, default=2000,
                    help="peak RSS is compared at this many rows and 10x as many (0: skip)")
    ap.add_argument("--peer-venv", type=Path, default=WORK / "peer-venv")
    ap.add_argument("--peer-model", type=Path, default=WORK / "peer-model")
    args = ap.parse_args()
    peer_python = args.peer_venv / "bin" / "python"
    if not peer_python.exists() or not (args.peer_model / "peers.json").exists():
        sys.exit(f"no peer venv/exports at {args.peer_venv}, {args.peer_model}: run "
                 f"benchmarks/setup_peers.sh {MODEL} (make bench does)")
    WORK.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    source = build_input(args.rows, f"reviews-{args.rows}")
    tokens = count_tokens(source)
    progress(f"machine: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags'])}; "
             f"load average {load():.1f}")
    progress(f"input: {args.rows} reviews, {tokens} tokens (mean {tokens / args.rows:.0f})")

    measured = last_json(run_process([sys.executable, __file__, "--in-process", str(source),
                                      "bf16" if cpu["bf16"] else "fp32"]))
    progress(f"encoder alone: {measured['encoder_only']}")
    jobs = {name: write_job(f"case-{i}", source, runtime, dtype, views)
            for i, (name, (runtime, dtype, views)) in enumerate(CASES.items())}
    prepare(jobs)
    commands = peer_commands(peer_python, args.peer_model, source)
    commands.update(bertpipe_commands(jobs))
    runs, loads = alternate(commands, args.reps)

    cold = cold_startup(jobs["bertpipe openvino"])
    steady = steady_pair(args, peer_python, fastest_peer(runs)) if args.steady_rows else None
    memory = memory_scaling(args.memory_rows) if args.memory_rows else {}
    facts = {name: store_facts(f"case-{i}") for i, name in enumerate(CASES)}
    agreement, per_view = agree(source, facts)
    probes = peer_agreement(source, agreement)
    report(runs, tokens, cpu, measured, agreement, per_view, probes, facts, memory, cold,
           loads, args)
    if steady:
        report_steady(steady, cpu)


def prepare(jobs: dict[str, Path]) -> None:
    """Untimed: each job's exports (a start-up run) and, for `auto`, its calibration."""
    for job in jobs.values():
        run_process([sys.executable, str(REPO / "benchmarks" / "first_batch.py"), str(job)])
    # `auto` measures once per machine (and views) and caches the choice: made here, not
    # timed, else the first timed run of each auto case alone would pay its calibration
    for name, (runtime, dtype, _) in CASES.items():
        if "auto" in (runtime, dtype) and name in jobs:
            calibration = run_process([str(BIN / "bertpipe"), "calibrate", str(jobs[name])])
            progress(f"calibration of {name!r} (once per machine, untimed): "
                     f"{calibration.wall:.1f} s")


def peer_commands(peer_python: Path, peer_model: Path, source: Path,
                  peers: dict[str, str] = PEERS) -> dict[str, list[str]]:
    return {name: [str(peer_python), str(REPO / "benchmarks" / "peer_st.py"), str(peer_model),
                   str(source), str(WORK / f"peer-{i}.npy"), "--backend", backend]
            for i, (name, backend) in enumerate(peers.items())}


def bertpipe_commands(jobs: dict[str, Path]) -> dict[str, list[str]]:
    """Each case as `bertpipe extract`, and its start-up twin: `first_batch.py` on the same
    job, process start to the first batch encoded (`bertpipe extract` prints no such line)."""
    commands = {name: [str(BIN / "bertpipe"), "extract", str(job)] for name, job in jobs.items()}
    commands.update({startup_name(name): [sys.executable,
                                          str(REPO / "benchmarks" / "first_batch.py"), str(job)]
                     for name, job in jobs.items()})
    return commands


def startup_name(case: str) -> str:
    return f"start-up {case}"


def alternate(commands: dict[str, list[str]], reps: int
              ) -> tuple[dict[str, list[Proc]], tuple[float, float]]:
    """Every command once a round, the order reversed every other round (drift in the
    machine's other load evens out); the runs, and the load average before and after."""
    runs: dict[str, list[Proc]] = {name: [] for name in commands}
    before = load()
    for rep in range(reps):
        order = list(commands) if rep % 2 == 0 else list(commands)[::-1]
        for name in order:
            runs[name].append(run_process(commands[name]))
        progress(f"round {rep + 1}/{reps} done (load average {load():.1f})")
    return runs, (before, load())


def fastest_peer(runs: dict[str, list[Proc]]) -> str:
    """The non-quantised peer with the shortest median wall time in the rounds."""
    return min((n for n in PEERS if n not in QUANTISED),
               key=lambda n: statistics.median(p.wall for p in runs[n]))


def steady_pair(args: argparse.Namespace, peer_python: Path, peer: str
                ) -> dict[str, Any]:
    """The defaults against `peer` on `--steady-rows` distinct rows, alternating, `--reps`
    rounds: whole processes and their start-ups, for the figures after the first batch."""
    source = build_input(args.steady_rows, f"reviews-{args.steady_rows}")
    runtime, dtype, views = CASES[STEADY_CASE]
    jobs = {STEADY_CASE: write_job("steady", source, runtime, dtype, views)}
    prepare(jobs)
    commands = peer_commands(peer_python, args.peer_model, source, {peer: PEERS[peer]})
    commands.update(bertpipe_commands(jobs))
    progress(f"steady state: {STEADY_CASE} against {peer} on {args.steady_rows} rows")
    runs, loads = alternate(commands, args.reps)
    return {"rows": args.steady_rows, "tokens": count_tokens(source), "peer": peer,
            "loads": loads, "runs": runs}


def peer_agreement(source: Path, agreement: dict[str, tuple[float, float]]
                   ) -> dict[str, float]:
    """Every peer's cosine to the reference peer (added to `agreement`) and the probe
    accuracy of every set of `mean` vectors."""
    labels = pq.read_table(source, columns=["label"]).column("label").to_numpy()
    vectors = {name: np.load(WORK / f"peer-{i}.npy") for i, name in enumerate(PEERS)}
    vectors.update({name: store_vectors(f"case-{i}", "mean")
                    for i, name in enumerate(CASES) if "mean" in CASES[name][2]})
    reference = vectors[REFERENCE_PEER]
    for name in [*PEERS, "bertpipe torch fp32"]:
        c = cosines(vectors[name], reference)
        agreement[name] = (float(c.min()), float(c.mean()))
    return {name: probe_accuracy(v, labels) for name, v in vectors.items()}


def cold_startup(job: Path) -> float | None:
    """Start-up of the openvino runtime with an empty export cache (export + compile)."""
    import shutil
    import tempfile

    cache = Path(tempfile.mkdtemp(prefix="bertpipe-cold-"))
    saved = os.environ["BERTPIPE_CACHE_DIR"]
    os.environ["BERTPIPE_CACHE_DIR"] = str(cache)
    try:
        return run_process([sys.executable, str(REPO / "benchmarks" / "first_batch.py"),
                            str(job)]).first_batch
    finally:
        os.environ["BERTPIPE_CACHE_DIR"] = saved
        shutil.rmtree(cache, ignore_errors=True)


def agree(source: Path, facts: dict[str, dict[str, Any]]
          ) -> tuple[dict[str, tuple[float, float]], dict[str, dict[str, float]]]:
    """Every runtime's 8 views against torch float32 (cosine min and mean over rows, worst
    view), untimed runs of their own; each case gets the figure of what it actually ran."""
    reference = write_job("agree-torch-fp32", source, "torch", "float32", EIGHT_VIEWS)
    run_process([str(BIN / "bertpipe"), "extract", str(reference)])
    agreement: dict[str, tuple[float, float]] = {}
    per_view: dict[str, dict[str, float]] = {}
    for label, (runtime, dtype) in AGREEMENT.items():
        name = f"agree-{runtime}-{dtype}"
        run_process([str(BIN / "bertpipe"), "extract",
                     str(write_job(name, source, runtime, dtype, EIGHT_VIEWS))])
        per_view[label] = {}
        worst, means = 1.0, []
        for view in EIGHT_VIEWS:
            c = cosines(store_vectors(name, view), store_vectors("agree-torch-fp32", view))
            per_view[label][view] = float(c.min())
            worst, means = min(worst, float(c.min())), [*means, float(c.mean())]
        agreement[label] = (worst, float(np.mean(means)))
    ran = {(facts_of["runtime"], facts_of["dtype"]): label
           for label, facts_of in ((label, store_facts(f"agree-{r}-{d}"))
                                   for label, (r, d) in AGREEMENT.items())}
    for case, facts_of in facts.items():
        label = ran.get((facts_of["runtime"], facts_of["dtype"]))
        if label and case != "bertpipe torch fp32":
            agreement[case] = agreement[label]
    return agreement, per_view


def memory_scaling(rows: int) -> dict[int, float]:
    """Peak RSS of the whole process at `rows` and 10x `rows` (one cheap view, so the
    run is about data flow rather than compute)."""
    out = {}
    for n in (rows, rows * 10):
        source = build_input(n, f"reviews-{n}")
        job = write_job(f"memory-{n}", source, "auto", "auto",
                        {"l1": {"layers": [1], "pooling": "mean"}}, partition_rows=1024)
        out[n] = run_process([str(BIN / "bertpipe"), "extract", str(job)]).rss
    return out


def flop_per_token(avg_len: float) -> float:
    """Forward FLOPs per token: 2 per block weight + attention's 4·T·H per layer."""
    config = json.loads((MODEL / "config.json").read_text())
    h, i, n_layers = config["hidden_size"], config["intermediate_size"], config[
        "num_hidden_layers"]
    weights = 4 * h * h + 2 * h * i
    return n_layers * (2 * weights + 4 * avg_len * h)


# ---- the report ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Phases:
    """One case's medians (seconds): the whole process and its start-up to the first batch
    encoded, wall and CPU; what follows the first batch is the steady state."""
    wall: float
    cpu: float
    startup_wall: float
    startup_cpu: float

    def steady(self, tokens: int) -> tuple[float, float]:
        """(tokens/s, tokens per CPU-second) after the first batch. The first batch's own
        tokens are counted in: at least 32 texts of thousands, under 1% at 10,000 rows."""
        return (tokens / (self.wall - self.startup_wall),
                tokens / (self.cpu - self.startup_cpu))

    def cores_busy(self, cores: int) -> float:
        """The share of `cores` the whole process kept busy (CPU seconds over wall x cores):
        the rest is time a core waited for this process or served another one."""
        return self.cpu / (self.wall * cores)

    def cores_busy_after(self, cores: int) -> float:
        """The same after the first batch: start-up is mostly one thread importing."""
        return (self.cpu - self.startup_cpu) / ((self.wall - self.startup_wall) * cores)


def phases(runs: dict[str, list[Proc]], name: str) -> Phases:
    """A peer prints its own first-batch line; a bertpipe case's start-up comes from its
    twin process (`startup_name`), the same job stopped at the first batch."""
    own = runs[name]
    twin = runs.get(startup_name(name), own)
    med = statistics.median
    return Phases(med(p.wall for p in own), med(p.cpu for p in own),
                  med(p.first_batch for p in twin if p.first_batch is not None),
                  med(p.first_batch_cpu for p in twin if p.first_batch_cpu is not None))


def report(runs: dict[str, list[Proc]], tokens: int, cpu: dict[str, Any],
           measured: dict[str, Any], agreement: dict[str, tuple[float, float]],
           per_view: dict[str, dict[str, float]], probes: dict[str, float],
           facts: dict[str, dict[str, Any]], memory: dict[int, float], cold: float | None,
           loads: tuple[float, float], args: argparse.Namespace) -> None:
    peaks, enc = measured["peaks"], measured["encoder_only"]
    fpt = flop_per_token(tokens / args.rows)
    cases = {name: phases(runs, name) for name in [*PEERS, *CASES]}

    def med(name: str, attr: str) -> float:
        return statistics.median(getattr(p, attr) for p in runs[name])

    whole = {name: tokens / ph.wall for name, ph in cases.items()}
    per_cpu = {name: tokens / ph.cpu for name, ph in cases.items()}
    fastest = max((n for n in PEERS if n not in QUANTISED), key=lambda n: whole[n])
    fastest_cpu = max((n for n in PEERS if n not in QUANTISED), key=lambda n: per_cpu[n])

    print()
    print(f"machine: {cpu['model']}, {cpu['cores']} cores, {' '.join(cpu['flags'])}; "
          f"load average {loads[0]:.1f} before, {loads[1]:.1f} after the rounds")
    print("GEMM peak in this run: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s"
                                                 for k, v in peaks.items())
          + f"; model {fpt / 1e6:.1f} MFLOP/token; {args.rows} rows, {tokens} tokens, "
          f"{args.reps} rounds, medians")
    print(f"ratios: whole-process tokens/s to {fastest}, tokens per CPU-second to "
          f"{fastest_cpu} (the fastest non-quantised peers); start-up: process start to the "
          f"first batch, wall / CPU s; after: tokens/s and per CPU-s after the first batch; "
          f"cores: CPU-s over wall x {cpu['cores']} cores; matmul: FLOP/s over the GEMM peak")
    if args.rows < STEADY_ROWS:
        print(f"(at {args.rows} rows start-up still weighs: the steady state is the "
              f"{STEADY_ROWS:,}-row pair below)")
    header = (f"{'case (whole process)':<26}{'tokens/s':>9}{'tok/CPU-s':>10}{'ratio':>7}"
              f"{'CPU ratio':>10}{'start-up':>12}{'after':>8}{'after/CPU':>10}{'cores':>6}"
              f"{'cos min / mean':>18}{'probe':>7}{'peak RSS':>10}{'matmul':>7}")
    print(header)
    for name, ph in cases.items():
        cos = agreement.get(name)
        cos_text = f"{cos[0]:.5f} / {cos[1]:.5f}" if cos else ""
        probe = f"{probes[name]:.3f}" if name in probes else ""
        after, after_cpu = ph.steady(tokens)
        dtype = "bfloat16" if ("bfloat16" in facts.get(name, {}).get("dtype", "")
                               or (name == "st openvino" and cpu["bf16"])) else "float32"
        util = whole[name] * fpt / peaks.get(dtype, peaks["float32"])
        print(f"{name:<26}{whole[name]:>9,.0f}{per_cpu[name]:>10,.0f}"
              f"{whole[name] / whole[fastest]:>6.2f}x"
              f"{per_cpu[name] / per_cpu[fastest_cpu]:>9.2f}x"
              f"{f'{ph.startup_wall:.1f} / {ph.startup_cpu:.1f}':>12}{after:>8,.0f}"
              f"{after_cpu:>10,.0f}{ph.cores_busy(cpu['cores']):>6.0%}{cos_text:>18}{probe:>7}"
              f"{med(name, 'rss'):>8.0f}Mi{util:>7.0%}")
    print()
    if cold:
        print(f"openvino start-up with an empty export cache (export + compile): {cold:.1f} s")
    for label, views in per_view.items():
        print(f"{label} vs torch float32, cosine min over rows per view: "
              + ", ".join(f"{k} {v:.5f}" for k, v in views.items()))
    one = whole["bertpipe openvino"]
    print(f"auto: 8 views cost {100 * (one / whole['bertpipe auto, 8 views'] - 1):+.0f}% vs "
          f"1 view; attention pooling {100 * (one / whole['bertpipe auto, attention'] - 1):+.0f}%"
          f" vs mean; layer-2 view {whole['bertpipe auto, layer 2'] / one:.2f}x the full model")
    print("encoder alone (in-process, same batches): " + ", ".join(
        f"{k} {v:,.0f} tokens/s" for k, v in enc.items()) + "; whole process / encoder: "
        + ", ".join(f"{k} {whole['bertpipe ' + k] / v:.0%}" for k, v in enc.items()))
    if memory:
        small, big = sorted(memory)
        print(f"peak RSS: {small} rows {memory[small]:.0f} MiB, {big} rows "
              f"{memory[big]:.0f} MiB ({100 * (memory[big] / memory[small] - 1):+.0f}%)")
    (WORK / "results.json").write_text(json.dumps({
        "machine": cpu, "loads": loads, "rows": args.rows, "tokens": tokens,
        "measured": measured, "agreement": agreement, "per_view": per_view,
        "probes": probes, "facts": facts, "memory": memory, "cold_startup": cold,
        "runs": {k: [p.__dict__ | {"output": []} for p in v] for k, v in runs.items()}},
        indent=1))


def steady_rows(steady: dict[str, Any], cores: int) -> list[list[str]]:
    """The steady-state table: start-up, whole process and after the first batch, for the
    defaults and the peer, then the defaults' ratio to the peer."""
    tokens, runs = steady["tokens"], steady["runs"]
    figures = {name: phases(runs, name) for name in (STEADY_CASE, steady["peer"])}
    rows = []
    for name, ph in figures.items():
        after, after_cpu = ph.steady(tokens)
        rows.append([name, f"{ph.startup_wall:.1f} / {ph.startup_cpu:.1f}",
                     f"{ph.wall:.1f} / {ph.cpu:.1f}", f"{after:,.0f}", f"{after_cpu:,.0f}",
                     f"{ph.cores_busy(cores):.0%} / {ph.cores_busy_after(cores):.0%}"])
    ours, peer = figures[STEADY_CASE], figures[steady["peer"]]
    (a, a_cpu), (b, b_cpu) = ours.steady(tokens), peer.steady(tokens)
    rows.append(["ratio (defaults / peer)", "", f"{peer.wall / ours.wall:.2f}x / "
                 f"{peer.cpu / ours.cpu:.2f}x", f"{a / b:.2f}x", f"{a_cpu / b_cpu:.2f}x", ""])
    return rows


STEADY_COLUMNS = ["case", "start-up to first batch, wall / CPU s", "whole process, wall / CPU s",
                  "tokens/s after the first batch", "tokens per CPU-s after it",
                  "cores busy, whole / after the first batch"]


def report_steady(steady: dict[str, Any], cpu: dict[str, Any]) -> None:
    loads = steady["loads"]
    print(f"\nsteady state: {steady['rows']:,} distinct rows, {steady['tokens']:,} tokens, "
          f"{len(steady['runs'][STEADY_CASE])} rounds alternating, medians; load average "
          f"{loads[0]:.1f} before, {loads[1]:.1f} after; {cpu['model']}")
    for row in [STEADY_COLUMNS, *steady_rows(steady, cpu["cores"])]:
        print("  " + " | ".join(row))


if __name__ == "__main__":
    from record import captured  # the result file docs/results.md is rendered from

    with captured(__file__, "CPU runtimes against sentence-transformers' backends",
                  children=("--in-process",)):
        main()
