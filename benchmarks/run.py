"""Throughput, agreement, start-up and memory of `bertpipe extract` against
sentence-transformers' CPU backends, whole processes alternating.

Peers, from their own venv (benchmarks/setup_peers.sh made it and their exports, untimed):
sentence-transformers `encode` with PyTorch fp32 and bf16, ONNX Runtime fp32, ONNX Runtime
dynamic int8, OpenVINO at its default precision for this CPU and with the f32 precision
hint (every backend and precision a user could configure; the fastest non-quantised one is
the ratio's reference). bertpipe: runtime torch float32,
torch with dtype auto, openvino, and the auto runtime with 8 views, attention pooling and a
layer-2 view. Each round runs every case once, in alternating order; the table gives
medians: tokens/s of the whole process and of its work after start-up, the ratio to the
fastest non-quantised peer, cosine min/mean to float32, linear-probe accuracy, start-up
(process start to the first batch encoded), peak RSS and matmul utilisation.

    python benchmarks/run.py [--rows 2400] [--reps 2] [--memory-rows 2000]
                             [--peer-venv benchmarks/work/peer-venv]
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
STARTUP = {"torch fp32": ("torch", "float32"), "openvino": ("openvino", "auto")}


# ---- the machine ---------------------------------------------------------------------------

def cpu_info() -> dict[str, Any]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    wanted = ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_bf16", "amx_int8"]
    return {"model": fields.get("model name", platform.processor() or platform.machine()),
            "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags],
            "bf16": bool(flags & {"avx512_bf16", "amx_bf16"})}


def load() -> float:
    return os.getloadavg()[0]


# ---- inputs and jobs -----------------------------------------------------------------------

def build_input(rows: int, name: str) -> Path:
    """`rows` real reviews: the 600 samples, then again with a copy number appended to each
    text (every row is a distinct text, so nothing is saved by encoding duplicates once),
    fresh ids."""
    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / f"{name}-distinct.parquet"
    if path.exists() and pq.read_metadata(path).num_rows == rows:
        return path
    src = pq.read_table(REPO / "data" / "reviews.parquet", columns=["text", "label"])
    copies = []
    for k in range(-(-rows // src.num_rows)):
        texts = [t if k == 0 else f"{t} ({k})" for t in src.column("text").to_pylist()]
        copies.append(src.set_column(0, "text", pa.array(texts, pa.string())))
    table = pa.concat_tables(copies).slice(0, rows)
    table = table.append_column("id", pa.array(np.arange(rows, dtype=np.int64)))
    pq.write_table(table, path)
    return path


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


# ---- the run -------------------------------------------------------------------------------

def main() -> None:
    if sys.argv[1:2] == ["--in-process"]:
        return in_process(Path(sys.argv[2]), sys.argv[3] == "bf16")
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2400)
    ap.add_argument("--reps", type=int, default=2)
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
    print(f"machine: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags'])}; "
          f"load average {load():.1f}", flush=True)
    print(f"input: {args.rows} reviews, {tokens} tokens (mean {tokens / args.rows:.0f})",
          flush=True)

    measured = last_json(run_process([sys.executable, __file__, "--in-process", str(source),
                                      "bf16" if cpu["bf16"] else "fp32"]))
    print(f"encoder alone: {measured['encoder_only']}", flush=True)
    jobs = {name: write_job(f"case-{i}", source, runtime, dtype, views)
            for i, (name, (runtime, dtype, views)) in enumerate(CASES.items())}
    startup_jobs = {name: write_job(f"startup-{i}", source, runtime, dtype, ONE_VIEW)
                    for i, (name, (runtime, dtype)) in enumerate(STARTUP.items())}
    for job in [*jobs.values(), *startup_jobs.values()]:  # exports made once, not timed
        run_process([sys.executable, str(REPO / "benchmarks" / "first_batch.py"), str(job)])
    # `auto` measures once per machine (and views) and caches the choice: made here, not
    # timed, else the first timed run of each auto case alone would pay its calibration
    for name, (runtime, dtype, _) in CASES.items():
        if "auto" in (runtime, dtype):
            calibration = run_process([str(BIN / "bertpipe"), "calibrate", str(jobs[name])])
            print(f"calibration of {name!r} (once per machine, untimed): "
                  f"{calibration.wall:.1f} s", flush=True)

    commands = {name: [str(peer_python), str(REPO / "benchmarks" / "peer_st.py"),
                       str(args.peer_model), str(source), str(WORK / f"peer-{i}.npy"),
                       "--backend", backend]
                for i, (name, backend) in enumerate(PEERS.items())}
    commands.update({name: [str(BIN / "bertpipe"), "extract", str(job)]
                     for name, job in jobs.items()})
    commands.update({f"start-up {name}": [sys.executable,
                                          str(REPO / "benchmarks" / "first_batch.py"), str(job)]
                     for name, job in startup_jobs.items()})
    runs: dict[str, list[Proc]] = {name: [] for name in commands}
    load_before = load()
    for rep in range(args.reps):
        order = list(commands) if rep % 2 == 0 else list(commands)[::-1]
        for name in order:
            runs[name].append(run_process(commands[name]))
        print(f"round {rep + 1}/{args.reps} done (load average {load():.1f})", flush=True)
    load_after = load()

    cold = cold_startup(startup_jobs["openvino"])
    memory = memory_scaling(args.memory_rows) if args.memory_rows else {}
    facts = {name: store_facts(f"case-{i}") for i, name in enumerate(CASES)}
    agreement, per_view = agree(source, facts)
    labels = pq.read_table(source, columns=["label"]).column("label").to_numpy()
    vectors = {name: np.load(WORK / f"peer-{i}.npy") for i, name in enumerate(PEERS)}
    vectors.update({name: store_vectors(f"case-{i}", "mean")
                    for i, name in enumerate(CASES) if "mean" in CASES[name][2]})
    reference = vectors[REFERENCE_PEER]
    for name in PEERS:
        c = cosines(vectors[name], reference)
        agreement[name] = (float(c.min()), float(c.mean()))
    c = cosines(vectors["bertpipe torch fp32"], reference)
    agreement["bertpipe torch fp32"] = (float(c.min()), float(c.mean()))
    probes = {name: probe_accuracy(v, labels) for name, v in vectors.items()}
    report(runs, tokens, cpu, measured, agreement, per_view, probes, facts, memory, cold,
           (load_before, load_after), args)


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

def report(runs: dict[str, list[Proc]], tokens: int, cpu: dict[str, Any],
           measured: dict[str, Any], agreement: dict[str, tuple[float, float]],
           per_view: dict[str, dict[str, float]], probes: dict[str, float],
           facts: dict[str, dict[str, Any]], memory: dict[int, float], cold: float | None,
           loads: tuple[float, float], args: argparse.Namespace) -> None:
    peaks, enc = measured["peaks"], measured["encoder_only"]
    fpt = flop_per_token(tokens / args.rows)

    def med(name: str, attr: str) -> float:
        return statistics.median(getattr(p, attr) for p in runs[name])

    whole = {name: tokens / med(name, "wall") for name in [*PEERS, *CASES]}
    per_cpu = {name: tokens / med(name, "cpu") for name in [*PEERS, *CASES]}
    # after start-up: the peers' encode() calls; bertpipe's time in partitions (read,
    # chunk, encode, write) as its last run recorded it
    work = {name: tokens / statistics.median(last_json(p)["encode_seconds"]
                                             for p in runs[name]) for name in PEERS}
    work.update({name: tokens / facts[name]["partition_seconds"] for name in CASES})
    fastest = max((n for n in PEERS if n not in QUANTISED), key=lambda n: whole[n])
    fastest_cpu = max((n for n in PEERS if n not in QUANTISED), key=lambda n: per_cpu[n])
    startup = {name: (med(name, "first_batch"), med(name, "first_batch_cpu")) for name in PEERS}
    startup.update({f"bertpipe {k}": (med(f"start-up {k}", "first_batch"),
                                      med(f"start-up {k}", "first_batch_cpu"))
                    for k in STARTUP})

    print()
    print(f"machine: {cpu['model']}, {cpu['cores']} cores, {' '.join(cpu['flags'])}; "
          f"load average {loads[0]:.1f} before, {loads[1]:.1f} after the rounds")
    print("GEMM peak in this run: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s"
                                                 for k, v in peaks.items())
          + f"; model {fpt / 1e6:.1f} MFLOP/token; {args.rows} rows, {tokens} tokens, "
          f"{args.reps} rounds, medians")
    print(f"ratios: whole-process tokens/s to {fastest}, tokens per CPU-second to "
          f"{fastest_cpu} (the fastest non-quantised peers); start-up: wall / CPU seconds")
    header = (f"{'case (whole process)':<26}{'tokens/s':>9}{'tok/CPU-s':>10}{'encode':>8}"
              f"{'ratio':>7}{'CPU ratio':>10}{'cos min / mean':>18}{'probe':>7}"
              f"{'start-up':>12}{'peak RSS':>10}{'util':>6}")
    print(header)
    for name in [*PEERS, *CASES]:
        cos = agreement.get(name)
        cos_text = f"{cos[0]:.5f} / {cos[1]:.5f}" if cos else ""
        probe = f"{probes[name]:.3f}" if name in probes else ""
        start = startup.get(name)
        start_text = f"{start[0]:.1f} / {start[1]:.1f}" if start else ""
        dtype = "bfloat16" if ("bfloat16" in facts.get(name, {}).get("dtype", "")
                               or (name == "st openvino" and cpu["bf16"])) else "float32"
        util = whole[name] * fpt / peaks.get(dtype, peaks["float32"])
        enc_text = f"{work[name]:,.0f}" if name in work else ""
        print(f"{name:<26}{whole[name]:>9,.0f}{per_cpu[name]:>10,.0f}{enc_text:>8}"
              f"{whole[name] / whole[fastest]:>6.2f}x"
              f"{per_cpu[name] / per_cpu[fastest_cpu]:>9.2f}x{cos_text:>18}{probe:>7}"
              f"{start_text:>12}{med(name, 'rss'):>8.0f}Mi{100 * util:>5.0f}%")
    print()
    print("start-up, process start to the first batch encoded (wall / CPU s): " + ", ".join(
        f"{k} {v[0]:.1f} / {v[1]:.1f}" for k, v in startup.items())
        + (f"; openvino with an empty cache (export + compile) {cold:.1f} s" if cold else ""))
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
        "runs": {k: [{"wall": p.wall, "cpu": p.cpu, "rss": p.rss, "first_batch": p.first_batch,
                      "first_batch_cpu": p.first_batch_cpu} for p in v]
                 for k, v in runs.items()}},
        indent=1))


if __name__ == "__main__":
    main()
