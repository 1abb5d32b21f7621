"""A benchmark's result file: benchmarks/results/<name>.json, which benchmarks/results_page.py
renders into docs/results.md (`make results`). A rerun replaces the file; git keeps the
figures it replaced.

    {"benchmark": "overlap",                  the script, benchmarks/overlap.py
     "title": "...",                          the page's section heading
     "command": "make bench-overlap ...",     what was run
     "runs": [                                the current figures: one run, or several where
       {"heading": "...",                       each still holds the latest figure of a case
        "machine": {"cpu": ..., "flags": ..., "cores": ...},   "not recorded" where unknown
        "date": "2026-12-03",                   or "not recorded"
        "conditions": "load average 1.0",
        "blocks": [{"text": "..."}, {"table": {"columns": [...], "align": "lrr",
                    "rows": [[...]]}}, {"list": ["..."]}, {"output": ["..."]}]}]}

A benchmark records itself by running its `main` inside `captured`: what it prints to
stdout becomes the run's output block, with the machine and the date it ran on. Progress
lines go to stderr, so they stay off the page.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import platform
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
NOT_RECORDED = "not recorded"
NO_RECORD = "--no-record"  # a trial run (e.g. a smoke test at a few rows): nothing written
FLAGS = ["avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
         "amx_bf16", "amx_int8"]


def machine() -> dict[str, Any]:
    """This machine as the page names it: the CPU model, the flags that decide the kernels
    (the rest do not move these figures), the cores this process may use."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = {k.strip(): v.strip() for k, v in
              (line.split(":", 1) for line in text.splitlines() if ":" in line)}
    flags = set(fields.get("flags", "").split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": fields.get("model name", platform.processor() or NOT_RECORDED),
            "flags": ", ".join(f for f in FLAGS if f in flags) or NOT_RECORDED,
            "cores": cores or NOT_RECORDED}


def today() -> str:
    return datetime.datetime.now(datetime.UTC).date().isoformat()


def save(name: str, title: str, command: str, runs: list[dict[str, Any]],
         folder: Path = RESULTS) -> Path:
    """Writes benchmarks/results/<name>.json (sorted keys, so a rerun's diff is its figures)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    result = {"benchmark": name, "title": title, "command": command, "runs": runs}
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    return path


class _Tee(io.TextIOBase):
    """Writes through to the real stdout and keeps a copy."""

    def __init__(self, out: Any):
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.out.write(text)
        return self.kept.write(text)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def captured(script: str, title: str, children: tuple[str, ...] = (),
             folder: Path = RESULTS) -> Iterator[None]:
    """Runs the block (`script`'s `main`) and, if it ends without an error, records what it
    printed as the benchmark's current result. Not for `--no-record` (taken out of sys.argv
    here), nor for a child process the benchmark starts with one of `children`'s flags (it
    prints figures for its parent, not for the page)."""
    name = Path(script).stem
    trial = NO_RECORD in sys.argv
    sys.argv = [a for a in sys.argv if a != NO_RECORD]
    if trial or any(flag in sys.argv for flag in children):
        yield
        return
    command = "python " + shlex.join([f"benchmarks/{name}.py", *sys.argv[1:]])
    before = os.getloadavg()[0]  # other work on the machine moves every figure: say how much
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    lines = tee.kept.getvalue().rstrip("\n").splitlines()
    conditions = f"load average {before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    save(name, title, command, [{"machine": machine(), "date": today(),
                                 "conditions": conditions, "blocks": [{"output": lines}]}],
         folder)
