"""`auto` decided by measurement: the cache is keyed on the CPU, the runtime versions, the
weights and the views (a change of any measures again), a damaged cache file is measured
again, a candidate that disagrees with torch float32 is never chosen however fast, the run
records the choice in the provenance, and `bertpipe calibrate` prints the table."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import pipeline
from pipeline.cli import main
from pipeline.extract import calibrate
from pipeline.extract.calibrate import MIN_COSINE, decide, load_candidate, min_cosine
from pipeline.extract.partition import Extractor
from pipeline.spec import Job
from tests.conftest import REVIEWS, job_dict, write_job

TEXTS = [f"review {i}: the drug worked well for my pain, but I slept badly for a week"
         for i in range(60)]
OFFERED = [("torch", "float32"), ("openvino", "float32"), ("torch", "bfloat16")]
WEIGHTS = {"model.safetensors": "a" * 64}


class Copy:
    """Stands in for a candidate's encoder: the reference's vectors, returned at once (so
    it is the fastest), plus `noise` times a random unit vector per row."""

    def __init__(self, reference: Any, noise: float):
        self.reference, self.noise = reference, noise
        self.rng = np.random.default_rng(0)

    def encode(self, sequences: Any, batching: Any) -> dict[str, np.ndarray]:
        out = {}
        for name, v in self.reference.encode(sequences, batching).items():
            if self.noise:
                jitter = self.rng.standard_normal(v.shape).astype(np.float32)
                v = v + self.noise * np.linalg.norm(v, axis=1, keepdims=True) * jitter / \
                    np.linalg.norm(jitter, axis=1, keepdims=True)
            out[name] = v
        return out


class Fake:
    """A loaded candidate: the reference extractor's facts, a `Copy` encoder."""

    def __init__(self, reference: Extractor, runtime: str, dtype: str, noise: float):
        self.model, self.budget, self.specials = (reference.model, reference.budget,
                                                  reference.specials)
        self.runtime = replace(reference.runtime, name=runtime, dtype=dtype)
        self.encoder = Copy(_Cached(reference.encoder), noise)


class _Cached:
    """The reference encoder's results kept per input, so a Copy costs nothing to run."""

    def __init__(self, encoder: Any):
        self.encoder, self.seen = encoder, {}

    def encode(self, sequences: Any, batching: Any) -> dict[str, np.ndarray]:
        key = tuple(map(tuple, sequences))
        if key not in self.seen:
            self.seen[key] = self.encoder.encode(sequences, batching)
        return self.seen[key]


class Loader:
    """Loads the real torch float32 reference, and fakes for the other candidates; counts
    the loads (a cache hit loads nothing)."""

    def __init__(self, noise: dict[tuple[str, str], float]):
        self.noise = noise
        self.loads: list[tuple[str, str]] = []
        self.reference: Extractor | None = None

    def __call__(self, job: Job, runtime: str, dtype: str) -> Any:
        self.loads.append((runtime, dtype))
        if (runtime, dtype) == ("torch", "float32"):
            self.reference = load_candidate(job, runtime, dtype)
            return self.reference
        assert self.reference is not None  # the reference loads first
        return Fake(self.reference, runtime, dtype, self.noise.get((runtime, dtype), 0.0))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BERTPIPE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "calibration"


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The CPU and versions calibration sees, and the candidates it offers: set by a test."""
    facts: dict[str, Any] = {"cpu": {"model": "Test CPU", "flags": ["avx2", "amx_bf16"]},
                             "versions": {"torch": "2.0", "transformers": "5.0",
                                          "openvino": "2026.0"}}
    monkeypatch.setattr(calibrate, "cpu_identity", lambda: facts["cpu"])
    monkeypatch.setattr(calibrate, "runtime_versions", lambda: facts["versions"])
    monkeypatch.setattr(calibrate, "candidates", lambda job, config: list(OFFERED))
    return facts


def auto_job(model: Path, tmp_path: Path, views: dict[str, Any] | None = None) -> Job:
    raw = job_dict(REVIEWS, model, tmp_path / "o.zarr",
                   views=views or {"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"}},
                   chunking={"strategy": "hierarchical"}, batching={"max_tokens_per_batch": 256})
    raw["model"].update(runtime="auto", dtype="auto")
    return Job.from_dict(raw)


def test_the_fastest_agreeing_candidate_wins_and_a_noisy_one_never(
        tiny_bert: Path, tmp_path: Path, cache: Path, machine: dict[str, Any]) -> None:
    # openvino float32 agrees (an exact copy), torch bfloat16 is as fast but noisy: cosine
    # about 1 - 0.02^2 / 2 = 0.9998 per row would pass; 0.05 gives ~0.9988 < 0.9995
    load = Loader({("torch", "bfloat16"): 0.05})
    choice = decide(auto_job(tiny_bert, tmp_path), WEIGHTS, lambda: TEXTS, load=load)
    assert choice is not None and choice.by == "calibration"
    rows = {(r.runtime, r.dtype): r for r in choice.table}
    assert set(rows) == set(OFFERED)
    assert not rows[("torch", "bfloat16")].agrees
    assert rows[("torch", "bfloat16")].min_cosine < MIN_COSINE
    assert rows[("torch", "float32")].min_cosine == pytest.approx(1.0, abs=1e-9)
    assert rows[("openvino", "float32")].agrees
    # the copies return at once: far faster than the reference's real forward passes
    assert rows[("openvino", "float32")].tokens_per_s > rows[("torch", "float32")].tokens_per_s
    assert (choice.runtime, choice.dtype) == ("openvino", "float32")
    assert [r.chosen for r in choice.table].count(True) == 1 and rows[("openvino",
                                                                         "float32")].chosen


def test_a_noisy_candidate_is_out_even_alone_beside_the_reference(
        tiny_bert: Path, tmp_path: Path, cache: Path, machine: dict[str, Any]) -> None:
    load = Loader({("openvino", "float32"): 0.05, ("torch", "bfloat16"): 0.1})
    choice = decide(auto_job(tiny_bert, tmp_path), WEIGHTS, lambda: TEXTS, load=load)
    assert choice is not None and (choice.runtime, choice.dtype) == ("torch", "float32")


def test_min_cosine_by_hand() -> None:
    ref = {"v": np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]], np.float32)}
    # row 0 turned by 60 degrees: cosine 0.5; row 1 scaled only: 1; zero rows agree
    other = {"v": np.array([[0.5, np.sqrt(3) / 2], [0.0, 5.0], [0.0, 0.0]], np.float32)}
    assert min_cosine(ref, other) == pytest.approx(0.5, abs=1e-6)
    assert min_cosine(ref, ref) == pytest.approx(1.0)
    assert min_cosine(ref, {"v": np.full((3, 2), np.nan, np.float32)}) == -1.0
    assert min_cosine(ref, {}) == -1.0


def test_the_cache_is_keyed_and_invalidated(tiny_bert: Path, tmp_path: Path, cache: Path,
                                            machine: dict[str, Any]) -> None:
    job = auto_job(tiny_bert, tmp_path)

    def run(job: Job = job, weights: dict[str, str] = WEIGHTS) -> tuple[str, int]:
        load = Loader({})
        choice = decide(job, weights, lambda: TEXTS, load=load)
        assert choice is not None
        return choice.by, len(load.loads)

    assert run() == ("calibration", 3)
    assert run() == ("cache", 0)  # the same machine, versions, weights and views
    assert len(list(cache.glob("*.json"))) == 1
    machine["cpu"] = {**machine["cpu"], "flags": ["avx2"]}  # another CPU's flags
    assert run()[0] == "calibration"
    assert run()[0] == "cache"
    machine["versions"] = {**machine["versions"], "openvino": "2026.1"}
    assert run()[0] == "calibration"
    assert run(weights={"model.safetensors": "b" * 64})[0] == "calibration"
    other_views = auto_job(tiny_bert, tmp_path, {"mean": {"pooling": "max"}})
    assert run(other_views)[0] == "calibration"
    assert run(other_views)[0] == "cache"
    assert run()[0] == "cache"  # each key kept its own entry


def test_a_damaged_cache_is_measured_again(tiny_bert: Path, tmp_path: Path, cache: Path,
                                           machine: dict[str, Any],
                                           caplog: pytest.LogCaptureFixture) -> None:
    job = auto_job(tiny_bert, tmp_path)
    assert decide(job, WEIGHTS, lambda: TEXTS, load=Loader({})).by == "calibration"
    (entry,) = cache.glob("*.json")
    for damage in ["{not json", json.dumps({"key": "x"}),  # truncated; another key: a miss
                   entry.read_text().replace('"runtime": "openvino"', '"runtime": "onnx"')
                   .replace('"runtime": "torch"', '"runtime": "onnx"')]:  # not offered
        entry.write_text(damage)
        with caplog.at_level(logging.WARNING, logger="pipeline.extract.calibrate"):
            caplog.clear()
            load = Loader({})
            choice = decide(job, WEIGHTS, lambda: TEXTS, load=load)
        assert choice.by == "calibration" and len(load.loads) == 3
        if damage.startswith("{not"):
            assert "unreadable" in caplog.text and str(entry) in caplog.text
        json.loads(entry.read_text())  # rewritten whole
    assert decide(job, WEIGHTS, lambda: TEXTS, load=Loader({})).by == "cache"


def _edited(text: str, edit: Any) -> str:
    raw = json.loads(text)
    edit(raw["choice"])
    return json.dumps(raw)


def _row(choice: dict[str, Any], **fields: Any) -> None:
    choice["table"][1].update(fields)


# (what is wrong, the edit, the words the warning says it with)
WRONG_TYPES = [
    ("speed a string", lambda c: _row(c, tokens_per_s="fast"), "tokens_per_s is 'fast'"),
    ("speed a bool", lambda c: _row(c, tokens_per_s=True), "tokens_per_s is True"),
    ("speed NaN", lambda c: _row(c, tokens_per_s=float("nan")), "tokens_per_s is nan"),
    ("speed negative", lambda c: _row(c, tokens_per_s=-3.0), "tokens_per_s is negative"),
    ("cosine null", lambda c: _row(c, min_cosine=None), "min_cosine is None"),
    ("agrees a string", lambda c: _row(c, agrees="yes"), "agrees is 'yes', not bool"),
    ("chosen a number", lambda c: _row(c, chosen=1), "chosen is 1, not bool"),
    ("runtime a number", lambda c: _row(c, runtime=5), "runtime is 5, not str"),
    ("note a list", lambda c: _row(c, note=["x"]), "note is ['x'], not str"),
    ("a row missing", lambda c: c["table"].pop(), "not of the candidates offered"),
    ("a row not an object", lambda c: c["table"].__setitem__(0, "torch"), "row 0 is not"),
    ("table not a list", lambda c: c.update(table={"a": 1}), "no choice with a table"),
    ("two rows chosen", lambda c: [r.update(chosen=True) for r in c["table"]],
     "does not mark the choice as the one chosen row"),
]


@pytest.mark.parametrize("edit,said", [w[1:] for w in WRONG_TYPES],
                         ids=[w[0] for w in WRONG_TYPES])
def test_a_cached_choice_of_wrong_types_is_measured_again(
        edit: Any, said: str, tiny_bert: Path, tmp_path: Path, cache: Path,
        machine: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """A record that parses but holds the wrong types was accepted, recorded in the store,
    and broke `inspect` there."""
    job = auto_job(tiny_bert, tmp_path)
    assert decide(job, WEIGHTS, lambda: TEXTS, load=Loader({})).by == "calibration"
    (entry,) = cache.glob("*.json")
    entry.write_text(_edited(entry.read_text(), edit))
    with caplog.at_level(logging.WARNING, logger="pipeline.extract.calibrate"):
        load = Loader({})
        choice = decide(job, WEIGHTS, lambda: TEXTS, load=load)
    assert choice is not None and choice.by == "calibration" and len(load.loads) == 3
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and said in warned[0], warned
    assert warned[0].startswith(f"calibration cache {entry} is damaged (")
    assert warned[0].endswith("); measuring again")
    for row in choice.table:  # what the store records: every field of its type
        assert type(row.tokens_per_s) is float and type(row.min_cosine) is float
        assert type(row.agrees) is bool and type(row.chosen) is bool
    assert decide(job, WEIGHTS, lambda: TEXTS, load=Loader({})).by == "cache"  # rewritten


def test_a_wrong_typed_cache_never_reaches_the_store(tiny_bert: Path, tmp_path: Path,
                                                     cache: Path, machine: dict[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The operator's sequence: a run, a damaged cache, a run, `inspect`."""
    loader = Loader({("torch", "bfloat16"): 0.5})  # out: openvino float32 (a copy) wins
    monkeypatch.setattr(calibrate, "load_candidate", loader)
    raw = job_dict(REVIEWS, tiny_bert, tmp_path / "o.zarr", execution={"partition_rows": 600})
    raw["model"].update(runtime="auto", dtype="auto")
    job_file = write_job(tmp_path / "job.yaml", raw)
    assert CliRunner().invoke(main, ["-q", "extract", str(job_file)]).exit_code == 0
    (entry,) = cache.glob("*.json")
    entry.write_text(_edited(entry.read_text(),
                             lambda c: [r.update(tokens_per_s="fast") for r in c["table"]]))
    with caplog.at_level(logging.WARNING, logger="pipeline.extract.calibrate"):
        again = CliRunner().invoke(main, ["-q", "extract", str(job_file), "--overwrite"])
    assert again.exit_code == 0, again.output
    assert "is damaged (table row 0: tokens_per_s is 'fast'" in caplog.text
    choice = pipeline.open_store(tmp_path / "o.zarr").provenance.runtime_choice
    assert choice is not None and choice.by == "calibration"
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "o.zarr")])
    assert shown.exit_code == 0, shown.output
    assert "runtime    openvino float32 (measured by calibration)" in shown.stdout


def test_a_calibration_says_what_it_does_and_how_long_it_will_take(
        tiny_bert: Path, tmp_path: Path, cache: Path, machine: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A first run spent ~47 s silent between "no store yet" and "plan" measuring."""
    said: list[str] = []
    job = auto_job(tiny_bert, tmp_path)
    decide(job, WEIGHTS, lambda: TEXTS, load=Loader({}), say=said.append)
    assert len(said) == 3, said
    assert said[0] == ("calibrating model.runtime/dtype auto: timing 3 candidates (torch "
                       "float32, openvino float32, torch bfloat16) on the job's own texts, "
                       f"once for this machine, model and views (cached in {cache})")
    assert said[1].startswith("calibration: 3 candidates loaded and warmed up; timing them "
                              f"{calibrate.REPEATS} times, about ")
    assert said[1].endswith(" s more")
    assert said[2].startswith("calibrated in ") and ": model.runtime " in said[2]
    said.clear()
    decide(job, WEIGHTS, lambda: TEXTS, load=Loader({}), say=said.append)
    assert said == []  # read from the cache: nothing to wait for, nothing said
    # a run says it where the operator reads its progress, before the plan
    monkeypatch.setattr(calibrate, "load_candidate", Loader({}))
    raw = job_dict(REVIEWS, tiny_bert, tmp_path / "o.zarr", execution={"partition_rows": 600})
    raw["model"].update(runtime="auto", dtype="auto")
    for entry in cache.glob("*.json"):
        entry.unlink()
    result = CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "job.yaml", raw))])
    assert result.exit_code == 0, result.output
    lines = [line.split(" ", 1)[-1] for line in result.stderr.splitlines()]
    at = [i for i, line in enumerate(lines) if line.startswith(("calibrat", "plan: "))]
    assert [lines[i].split(" ", 1)[0] for i in at] == ["calibrating", "calibration:",
                                                       "calibrated", "plan:"], lines


def test_an_explicit_runtime_and_dtype_are_never_measured(tiny_bert: Path, tmp_path: Path,
                                                         cache: Path) -> None:
    job = Job.from_dict(job_dict(REVIEWS, tiny_bert, tmp_path / "o.zarr"))  # torch float32
    load = Loader({})
    choice = decide(job, WEIGHTS, lambda: TEXTS, load=load)
    assert choice is not None and (choice.runtime, choice.dtype, choice.by) == \
        ("torch", "float32", "job")
    assert load.loads == [] and not cache.exists()


def test_a_run_records_the_choice_and_the_next_reads_the_cache(
        tiny_bert: Path, tmp_path: Path, cache: Path) -> None:
    """Real candidates of this machine (torch, and openvino and bfloat16 where offered)."""
    raw = job_dict(REVIEWS, tiny_bert, tmp_path / "o.zarr",
                   execution={"partition_rows": 300})
    raw["model"].update(runtime="auto", dtype="auto")
    job_file = write_job(tmp_path / "job.yaml", raw)
    first = CliRunner().invoke(main, ["-q", "extract", str(job_file)])
    assert first.exit_code == 0, first.output
    store = pipeline.open_store(tmp_path / "o.zarr")
    choice = store.provenance.runtime_choice
    assert choice is not None and choice.by in ("calibration", "job")
    assert store.provenance.runtime == [choice.runtime]
    assert store.provenance.dtype == [choice.dtype]
    assert store.provenance.job.model.runtime == "auto"  # the job as written
    if choice.by == "calibration":
        assert [r.chosen for r in choice.table].count(True) == 1
        again = CliRunner().invoke(main, ["-q", "extract", str(job_file), "--overwrite"])
        assert again.exit_code == 0, again.output
        second = pipeline.open_store(tmp_path / "o.zarr").provenance.runtime_choice
        assert second is not None and second.by == "cache"
        assert (second.runtime, second.dtype) == (choice.runtime, choice.dtype)
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "o.zarr")])
    assert f"runtime    {choice.runtime} {choice.dtype}" in shown.stdout
    facts = json.loads(CliRunner().invoke(main, ["inspect", str(tmp_path / "o.zarr"),
                                                 "--json"]).stdout)
    assert facts["runtime_choice"]["runtime"] == choice.runtime


def test_calibrate_prints_the_table(tiny_bert: Path, tmp_path: Path, cache: Path) -> None:
    raw = job_dict(REVIEWS, tiny_bert, tmp_path / "o.zarr")
    raw["model"].update(runtime="auto", dtype="auto")
    job_file = write_job(tmp_path / "job.yaml", raw)
    result = CliRunner().invoke(main, ["calibrate", str(job_file)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["candidate", "tokens/s", "min", "cosine", "chosen"]
    assert lines[1].startswith("torch float32 ")
    assert sum(line.rstrip().endswith("*") for line in lines[1:-1]) == 1
    assert lines[-1].startswith("chosen: runtime ")
    assert not (tmp_path / "o.zarr").exists()  # no store written
    as_json = CliRunner().invoke(main, ["calibrate", str(job_file), "--json"])
    assert as_json.exit_code == 0, as_json.output
    doc = json.loads(as_json.stdout)
    assert doc["by"] == "calibration"  # --json measures again, whatever the cache holds
    assert [r["chosen"] for r in doc["table"]].count(True) == 1
    chosen = next(r for r in doc["table"] if r["chosen"])
    assert (chosen["runtime"], chosen["dtype"]) == (doc["runtime"], doc["dtype"])
    assert chosen["min_cosine"] >= MIN_COSINE


def test_recorded_versions_are_those_the_libraries_report_when_imported() -> None:
    """A run records the versions from package metadata, without importing the libraries:
    they are the ones the imported libraries report (the oracle), openvino only when it
    ran partitions, and a runtime that is not installed reads as ""."""
    import transformers

    from pipeline.extract.runtime_choice import installed_versions
    from pipeline.run.record import software_versions
    from pipeline.stores.markers import MarkerTotals
    from pipeline.version import __version__

    assert software_versions(MarkerTotals(runtimes=("torch",))) == {
        "bertpipe": __version__, "torch": torch.__version__,
        "transformers": transformers.__version__}
    with_openvino = software_versions(MarkerTotals(runtimes=("torch", "openvino")))
    openvino = pytest.importorskip("openvino")
    assert with_openvino["openvino"] == openvino.get_version().split("-")[0]
    assert installed_versions(("no-such-package-bertpipe",)) == {"no-such-package-bertpipe": ""}


def test_a_resume_encodes_with_the_runtime_its_run_began_with(
        tmp_path: Path, tiny_bert: Path, small_texts: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime a run began with is kept in its staging area; the run that resumes it
    (a retry on a fresh node, whose cache is empty or another CPU's) encodes the rest with
    it and decides nothing, so a store never mixes runtimes."""
    from pipeline.run import runner
    from pipeline.stores.provenance import RuntimeChoice

    out = tmp_path / "o.zarr"
    job = Job.from_dict(job_dict(small_texts, tiny_bert, out, execution={
        "scheduler": "synchronous", "partition_rows": 2}))

    class Stop(Exception):
        pass

    def stop(part: object, marker: object) -> None:
        raise Stop  # the run dies once its first partition is done

    with pytest.raises(Stop):
        runner.run_job(job, on_done=stop)
    run_file = out / "_bertpipe" / "run.json"
    run = json.loads(run_file.read_text())
    assert (run["runtime_choice"]["runtime"], run["runtime_choice"]["dtype"]) == \
        ("torch", "float32")
    # as a calibration on the first node recorded it (a decision on this one would say "job")
    run["runtime_choice"]["by"] = "calibration"
    run_file.write_text(json.dumps(run))

    def decided_again(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the resume decided its runtime again")

    monkeypatch.setattr(runner, "decide_runtime", decided_again)
    said: list[str] = []
    runner.run_job(job, say=said.append)
    assert "resuming with the runtime the run began with: torch float32" in said
    recorded = pipeline.open_store(out).provenance.runtime_choice
    assert recorded == RuntimeChoice.from_dict(run["runtime_choice"])
    assert recorded is not None and recorded.by == "calibration"


def test_a_resume_whose_recorded_runtime_cannot_run_here_is_refused(
        tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    """A recorded runtime this machine does not offer (or a record of the wrong types) is
    refused, nothing changed: finishing the parts with another would mix runtimes."""
    from pipeline.errors import StoreError
    from pipeline.run import runner

    out = tmp_path / "o.zarr"
    job = Job.from_dict(job_dict(small_texts, tiny_bert, out, execution={
        "scheduler": "synchronous", "partition_rows": 2}))

    class Stop(Exception):
        pass

    def stop(part: object, marker: object) -> None:
        raise Stop

    with pytest.raises(Stop):
        runner.run_job(job, on_done=stop)
    run_file = out / "_bertpipe" / "run.json"
    run = json.loads(run_file.read_text())
    for recorded in ({**run["runtime_choice"], "dtype": "int4"},
                     {**run["runtime_choice"], "table": [{"runtime": "torch", "dtype": 1}]}):
        run_file.write_text(json.dumps({**run, "runtime_choice": recorded}))
        before = sorted(p.name for p in (out / "_bertpipe" / "parts").iterdir())
        with pytest.raises(StoreError, match="the interrupted run recorded the runtime it "
                           "encodes with, and it cannot be used here"):
            runner.run_job(job)
        assert sorted(p.name for p in (out / "_bertpipe" / "parts").iterdir()) == before
