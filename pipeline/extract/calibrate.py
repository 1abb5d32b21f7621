"""What `model.runtime: auto` and `model.dtype: auto` mean on this CPU, decided by measurement.

Which runtime and precision is fastest depends on the CPU (bf16 is fast with AMX, slower
than float32 without it: measured 1.5x slower on AVX512 without AMX, ~4x on AVX2), on
the model and on the job's texts, so it is timed rather than guessed from CPU flags.

The candidates are what the job leaves open and this machine offers:

    torch float32                       always (the reference)
    torch bfloat16                      when the CPU has avx512_bf16 or amx_bf16
    openvino float32, openvino bfloat16 when openvino is installed and runs the model
                                        (bfloat16 again only on a CPU with bf16)

Each is loaded and run on a few real batches of the job's own texts (one warm-up batch,
then TIMED_BATCHES batches' worth of tokens, the candidates in turns, best of REPEATS),
and its vectors for every view are compared with torch float32's on the same chunks: a
candidate whose cosine falls below MIN_COSINE on any row of any view is out, however
fast. The fastest one left wins.

The decision is cached in `<BERTPIPE_CACHE_DIR or ~/.cache/bertpipe>/calibration/`, one
JSON file per key: the CPU (model name and flags), the torch, transformers and openvino
versions, the weights' SHA-256, the views' definitions and what the job left open. Another
key measures again; a damaged file (unreadable, or a field of the wrong type: it would be
recorded in the store) is measured again with a one-line warning. A run decides once on
the client and hands the decision to every worker, so a store never mixes runtimes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..errors import BertpipeError, ModelError
from ..spec import Job
from ..stores.provenance import CandidateRow, RuntimeChoice
from .chunking import chunk_partition
from .modelfiles import load_config
from .runtime_choice import (
    CACHE_ENV,
    cache_base,
    cpu_has_bf16,
    device_type,
    installed_versions,
    openvino_installed,
    openvino_supports,
)

if TYPE_CHECKING:  # the model's code loads only when candidates are measured
    from .partition import Extractor

log = logging.getLogger(__name__)

CALIBRATION_FORMAT = 1  # bump when what is measured or how changes: old entries unused
MIN_COSINE = 0.9995  # per row, against torch float32, on every view
TIMED_BATCHES = 3  # batches' worth of tokens timed, after one warm-up batch
REPEATS = 3  # timed passes per candidate, in turns; the fastest counts (shared nodes)
REFERENCE = ("torch", "float32")

# A candidate as loaded for measuring: (runtime, dtype) -> its extractor; tests inject
# candidates through it.
Loader = Callable[[Job, str, str], "Extractor"]


@dataclass(frozen=True)
class Measured:
    runtime: str
    dtype: str
    seconds: float  # the fastest timed pass
    tokens: int  # real tokens in the timed pass
    vectors: dict[str, np.ndarray]  # view -> rows


def candidates(job: Job, config: Any) -> list[tuple[str, str]]:
    """(runtime, dtype) pairs the job leaves open on this machine; [] on a GPU (auto keeps
    its rules there: torch, bf16 or f16 by what the GPU supports)."""
    spec = job.model
    if device_type(spec.device) == "cuda":
        return []
    runtimes = [spec.runtime] if spec.runtime != "auto" else \
        ["torch"] + (["openvino"] if openvino_installed() and openvino_supports(config) else [])
    dtypes = [spec.dtype] if spec.dtype != "auto" else \
        ["float32"] + (["bfloat16"] if cpu_has_bf16() else [])
    return [(r, d) for r in runtimes for d in dtypes]


def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU's model name and flags (what decides which kernels run)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        import platform

        return {"model": platform.processor() or platform.machine(), "flags": []}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())  # the first processor's
    return {"model": fields.get("model name", ""), "flags": sorted(fields.get("flags", "").split())}


def runtime_versions() -> dict[str, str]:
    return installed_versions(("torch", "transformers", "openvino"))


def calibration_key(job: Job, weights_sha256: dict[str, str], offered: Sequence[tuple[str, str]],
                    cpu: dict[str, Any] | None = None,
                    versions: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything the decision depends on."""
    return {"format": CALIBRATION_FORMAT, "cpu": cpu or cpu_identity(),
            "versions": versions or runtime_versions(), "weights_sha256": weights_sha256,
            "views": job.to_dict()["views"],
            "candidates": [list(c) for c in offered]}


def key_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def calibration_dir() -> Path:
    return cache_base() / "calibration"


def decide(job: Job, weights_sha256: dict[str, str], texts: Callable[[], list[str | None]],
           force: bool = False, load: Loader | None = None,
           key: dict[str, Any] | None = None,
           say: Callable[[str], None] = log.info) -> RuntimeChoice | None:
    """The runtime and dtype for `job` on this machine: the job's own when it fixes both,
    else the cached decision for this key, else measured (`force`: measured whatever the
    cache holds, and cached). `texts()` gives the job's texts to measure on; `say` tells
    the operator what a measurement does and how long it will take. None on a GPU."""
    config = load_config(job.model)
    offered = candidates(job, config)
    if not offered:
        return None
    if len(offered) == 1 and not force:
        return RuntimeChoice(*offered[0], by="job")
    key = key or calibration_key(job, weights_sha256, offered)
    path = cache_file(key)
    if not force:
        cached = read_cached(path, key, offered)
        if cached is not None:
            return cached
    writable(path.parent)  # before measuring: a cache that cannot be kept fails first
    say(f"calibrating model.runtime/dtype auto: timing {len(offered)} candidates "
        f"({', '.join(' '.join(c) for c in offered)}) on the job's own texts, once for this "
        f"machine, model and views (cached in {path.parent})")
    choice = measure(job, offered, texts(), load or load_candidate, say)
    write_cached(path, key, choice)
    return choice


def cache_file(key: dict[str, Any]) -> Path:
    return calibration_dir() / f"{key_id(key)}.json"


def check_cache(job: Job, weights_sha256: dict[str, str]) -> None:
    """What `decide` refuses before it measures, read only: a job it would measure for
    (more than one candidate, nothing cached) needs a cache folder it can write, or one it
    can make (nothing is made here)."""
    offered = candidates(job, load_config(job.model))
    if len(offered) <= 1:
        return
    key = calibration_key(job, weights_sha256, offered)
    path = cache_file(key)
    if read_cached(path, key, offered) is not None:
        return
    folder = path.parent
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise _unwritable(folder, NotADirectoryError(20, f"{existing} is not a folder"))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _unwritable(folder, PermissionError(13, "Permission denied"))


def read_cached(path: Path, key: dict[str, Any], offered: Sequence[tuple[str, str]]
                ) -> RuntimeChoice | None:
    """The decision cached for `key`, or None (absent, another key, or damaged: warned)."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("calibration cache %s is unreadable (%s); measuring again", path,
                    type(exc).__name__)
        return None
    try:
        if not isinstance(raw, dict) or raw.get("key") != key:
            return None
        return checked_choice(raw.get("choice"), offered)
    except ValueError as exc:
        log.warning("calibration cache %s is damaged (%s); measuring again", path, exc)
        return None


# A cached table row's fields and the types they must have: a row read as given would be
# recorded in the store and break `inspect` there (a speed of "fast" cannot be printed).
ROW_TYPES: dict[str, tuple[type, ...]] = {
    "runtime": (str,), "dtype": (str,), "tokens_per_s": (int, float),
    "min_cosine": (int, float), "agrees": (bool,), "chosen": (bool,), "note": (str,)}


def checked_choice(choice: Any, offered: Sequence[tuple[str, str]]) -> RuntimeChoice:
    """The cached decision, every field of the type it is written with, its table the
    candidates offered now with the decision the one row chosen; else a ValueError saying
    what is wrong (the cache is then measured again)."""
    if not isinstance(choice, dict) or not isinstance(choice.get("table"), list):
        raise ValueError("no choice with a table of candidates")
    picked = (choice.get("runtime"), choice.get("dtype"))
    if picked not in offered:
        raise ValueError(f"chose {picked[0]!r} {picked[1]!r}, not a candidate offered")
    table = tuple(checked_row(row, i) for i, row in enumerate(choice["table"]))
    if sorted((r.runtime, r.dtype) for r in table) != sorted(offered):
        raise ValueError("its table is not of the candidates offered")
    if [(r.runtime, r.dtype) for r in table if r.chosen] != [picked]:
        raise ValueError("its table does not mark the choice as the one chosen row")
    return RuntimeChoice(str(picked[0]), str(picked[1]), "cache", table)


# why each kind of decision was made (`RuntimeChoice.by`)
DECIDED_BY = ("job", "calibration", "cache")


def checked_recorded(raw: Any, offered: Sequence[tuple[str, str]]) -> RuntimeChoice:
    """A decision a run recorded for its resume (`_bertpipe/run.json`), checked as a cached
    one is: one of the candidates offered here, every table row of its types; else a
    ValueError saying what is wrong (it is then decided again, never recorded as read)."""
    if not isinstance(raw, dict) or raw.get("by") not in DECIDED_BY:
        raise ValueError("no decision with a known reason")
    picked = (raw.get("runtime"), raw.get("dtype"))
    if picked not in offered:
        raise ValueError(f"{picked[0]!r} {picked[1]!r} is not a candidate here")
    table = raw.get("table") or []
    if not isinstance(table, list):
        raise ValueError("its table is not a list")
    return RuntimeChoice(str(picked[0]), str(picked[1]), str(raw["by"]),
                         tuple(checked_row(row, i) for i, row in enumerate(table)))


def checked_row(row: Any, index: int) -> CandidateRow:
    if not isinstance(row, dict):
        raise ValueError(f"table row {index} is not an object")
    for name, types in ROW_TYPES.items():
        value = row.get(name, "" if name == "note" else None)
        # bool is an int in Python: a speed of true is no speed
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise ValueError(f"table row {index}: {name} is {value!r}, not "
                             f"{' or '.join(t.__name__ for t in types)}")
        # a number here (checked above): NaN and infinity are numbers no measurement gives
        if name in ("tokens_per_s", "min_cosine") and not math.isfinite(cast(float, value)):
            raise ValueError(f"table row {index}: {name} is {value!r}")
    if row["tokens_per_s"] < 0:
        raise ValueError(f"table row {index}: tokens_per_s is negative")
    return CandidateRow(row["runtime"], row["dtype"], float(row["tokens_per_s"]),
                        float(row["min_cosine"]), row["agrees"], row["chosen"],
                        row.get("note", ""))


def writable(folder: Path) -> None:
    """Make the cache folder, or a one-line error saying which setting to change."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise _unwritable(folder, exc) from None


def _unwritable(folder: Path, exc: OSError) -> ModelError:
    return ModelError(f"model.runtime: auto cannot write its calibration in {folder} "
                      f"({exc.strerror or type(exc).__name__}); set {CACHE_ENV} to a "
                      "writable folder")


def write_cached(path: Path, key: dict[str, Any], choice: RuntimeChoice) -> None:
    """Write the decision whole or not at all (a temporary file renamed into place)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".calibration-", dir=path.parent)
        with os.fdopen(fd, "w") as out:
            json.dump({"key": key, "choice": asdict(choice)}, out, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may serve several users
        os.replace(tmp, path)
    except OSError as exc:
        raise _unwritable(path.parent, exc) from None


def load_candidate(job: Job, runtime: str, dtype: str) -> Extractor:
    from .partition import Extractor

    return Extractor(replace(job, model=replace(job.model, runtime=runtime, dtype=dtype)))


def measure(job: Job, offered: Sequence[tuple[str, str]], texts: Sequence[str | None],
            load: Loader, say: Callable[[str], None] = log.info) -> RuntimeChoice:
    """Time every candidate on the same chunks and check it against torch float32.

    All candidates are loaded, then timed in turns (REPEATS rounds, each candidate once per
    round, the fastest pass counting): other work on a shared node then slows them alike,
    where timing one after the other would favour whichever ran in a quiet moment."""
    start = time.perf_counter()
    reference = load(job, *REFERENCE)
    warm, timed = sample(reference, job, texts)
    loaded: dict[tuple[str, str], Extractor] = {REFERENCE: reference}
    errors: dict[tuple[str, str], str] = {}
    for runtime, dtype in offered:
        if (runtime, dtype) == REFERENCE:
            continue
        try:
            extractor = load(job, runtime, dtype)
        except BertpipeError as exc:  # e.g. the export fails: out, with why
            errors[(runtime, dtype)] = str(exc)
            continue
        if extractor.runtime.dtype != dtype:  # OpenVINO without bf16 runs float32
            errors[(runtime, dtype)] = f"runs {extractor.runtime.dtype} on this CPU"
            continue
        loaded[(runtime, dtype)] = extractor
    results = timed_in_turns(loaded, job, warm, timed, say)
    table = [row_of(results[REFERENCE], results[c]) if c in results else
             CandidateRow(c[0], c[1], 0.0, 0.0, False, False, errors.get(c, ""))
             for c in offered]
    agreeing = [r for r in table if r.agrees]
    if not agreeing:
        raise ModelError(f"model.runtime: auto: no candidate agrees with torch float32 "
                         f"(cosine >= {MIN_COSINE}); set model.runtime and model.dtype")
    best = max(agreeing, key=lambda r: r.tokens_per_s)
    table = [replace(r, chosen=r is best) for r in table]
    say(f"calibrated in {time.perf_counter() - start:.1f} s: model.runtime {best.runtime}, "
        f"model.dtype {best.dtype} ({best.tokens_per_s:,.0f} tokens/s)")
    return RuntimeChoice(best.runtime, best.dtype, "calibration", tuple(table))


def sample(extractor: Extractor, job: Job, texts: Sequence[str | None]
           ) -> tuple[list[list[int]], list[list[int]]]:
    """(one warm-up batch, TIMED_BATCHES batches) of the texts' chunks, by token budget."""
    distinct = list(dict.fromkeys(t for t in texts if t and t.strip()))
    chunked = chunk_partition(distinct, extractor.model.tokenizer, job.chunking,
                              extractor.budget, extractor.specials)
    per_batch = job.batching.max_tokens_per_batch
    warm: list[list[int]] = []
    timed: list[list[int]] = []
    used = 0
    for ids in chunked.chunk_ids:
        target = warm if used < per_batch else timed
        target.append(list(ids))
        used += len(ids)
        if used >= per_batch * (1 + TIMED_BATCHES):
            break
    if not timed:  # a tiny input: time what there is
        timed = warm
    if not timed:
        raise ModelError("model.runtime: auto: the input has no text to calibrate on; set "
                         "model.runtime and model.dtype")
    return warm, timed


def timed_in_turns(loaded: dict[tuple[str, str], Extractor], job: Job,
                   warm: list[list[int]], timed: list[list[int]],
                   say: Callable[[str], None] = log.info
                   ) -> dict[tuple[str, str], Measured]:
    """Each candidate warmed once (kernels chosen, caches filled: not timed), then timed
    REPEATS times in turns; its fastest pass and its vectors. How long the timing will take
    is said once the warm-up pass (a known share of the tokens) has taken its time."""
    start = time.perf_counter()
    for extractor in loaded.values():
        extractor.encoder.encode(warm, job.batching)
    warmed = time.perf_counter() - start
    share = sum(len(s) for s in timed) / max(sum(len(s) for s in warm), 1)
    say(f"calibration: {len(loaded)} candidates loaded and warmed up; timing them "
        f"{REPEATS} times, about {warmed * share * REPEATS:.0f} s more")
    best = {c: float("inf") for c in loaded}
    vectors: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for _ in range(REPEATS):
        for c, extractor in loaded.items():
            start = time.perf_counter()
            vectors[c] = extractor.encoder.encode(timed, job.batching)
            best[c] = min(best[c], time.perf_counter() - start)
    tokens = sum(len(s) for s in timed)
    return {c: Measured(c[0], c[1], best[c], tokens, vectors[c]) for c in loaded}


def min_cosine(reference: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> float:
    """The lowest cosine over every row of every view (NaN or a missing view: -1)."""
    lowest = 1.0
    for name, ref in reference.items():
        got = other.get(name)
        if got is None or got.shape != ref.shape:
            return -1.0
        a, b = ref.astype(np.float64), got.astype(np.float64)
        na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
        both_zero = (na == 0) & (nb == 0)  # an all-zero row agrees with itself
        with np.errstate(invalid="ignore", divide="ignore"):
            cos = np.where(both_zero, 1.0, (a * b).sum(1) / (na * nb))
        if np.isnan(cos).any():
            return -1.0
        lowest = min(lowest, float(cos.min()))
    return lowest


def row_of(reference: Measured, m: Measured) -> CandidateRow:
    cosine = min_cosine(reference.vectors, m.vectors)
    return CandidateRow(m.runtime, m.dtype, round(m.tokens / m.seconds, 1), round(cosine, 7),
                        cosine >= MIN_COSINE, False,
                        "" if cosine >= MIN_COSINE else f"disagrees with {' '.join(REFERENCE)}")
