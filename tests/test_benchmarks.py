"""The benchmarks measure what they claim: no input repeats a text, and make bench's figures
after start-up are computed from the right processes.

bertpipe encodes identical texts once and copies the results, while a peer encodes every
row: an input that repeats its texts overstates bertpipe by the repeat factor. Every
module in benchmarks/ is either a benchmark, which exposes `benchmark_inputs(rows)` built
by the functions its `main` uses, or named below as something else, so a new benchmark
cannot go unchecked.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# modules of benchmarks/ that encode no input of their own, and what they are instead
NOT_BENCHMARKS = {
    "first_batch": "run.py's start-up probe, run on a benchmark's own job file",
    "peer_st": "the peer process run.py starts on run.py's own input file",
    "peer_export": "the peers' one-time model exports",
    "s3count": "a counting S3 endpoint for scale.py",
    "texts": "the helper the benchmarks build their texts with",
    "record": "writes a benchmark's result file",
    "results_page": "renders docs/results.md from the result files",
}
# more than twice the 600 sample reviews: an input that cycles through them shows it
ROWS = 1_250


def benchmark_names() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in NOT_BENCHMARKS)


@pytest.fixture(scope="module")
def load() -> Iterator[object]:
    """Imports a benchmark as its scripts import each other (by top-level name, from
    benchmarks/), then puts back what their imports change (environment, path, and the
    top-level names `run`, `scale`, ... they took in sys.modules)."""
    environ, path = dict(os.environ), list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))

    def load_one(name: str) -> ModuleType:
        return importlib.import_module(name)

    yield load_one
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    for name, module in list(sys.modules.items()):
        if Path(getattr(module, "__file__", None) or "/").parent == BENCHMARKS:
            del sys.modules[name]


def test_every_module_is_a_benchmark_or_named_as_something_else() -> None:
    stems = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert set(NOT_BENCHMARKS) <= stems, set(NOT_BENCHMARKS) - stems  # no stale names
    assert len(benchmark_names()) >= 15  # the walk finds the benchmarks at all


@pytest.mark.parametrize("name", benchmark_names())
def test_no_benchmark_input_repeats_a_text(load, name: str) -> None:
    texts = load("texts")
    module = load(name)
    assert hasattr(module, "benchmark_inputs"), (
        f"benchmarks/{name}.py: expose benchmark_inputs(rows) -> {{input: texts}}, built by the "
        f"functions main() uses, or name it in NOT_BENCHMARKS with what it is instead")
    inputs = module.benchmark_inputs(ROWS)
    assert inputs, f"benchmarks/{name}.py names no input"
    for input_name, rows in inputs.items():
        assert rows and all(isinstance(t, str) and t for t in rows), input_name
        repeats = texts.repeated(rows)
        assert not repeats, (f"benchmarks/{name}.py, {input_name}: {len(repeats)} texts "
                             f"repeat, e.g. {next(iter(repeats))[:60]!r}")


def test_a_repeating_input_is_caught(load) -> None:
    """The check finds what benchmarks/gpu.py once did: the samples concatenated."""
    texts = load("texts")
    src = pq.read_table(texts.REVIEWS, columns=["text"])
    cycled = pa.concat_tables([src] * 3).slice(0, ROWS).column("text").to_pylist()
    assert len(texts.repeated(cycled)) == 600
    assert texts.repeated(texts.distinct_reviews(ROWS)) == {}


def test_distinct_reviews_keep_the_samples_and_their_lengths(load) -> None:
    texts = load("texts")
    samples = texts.sample_reviews()
    rows = texts.distinct_reviews(20_000)  # benchmarks/gpu.py's default size
    assert len(rows) == 20_000 and not texts.repeated(rows)
    assert rows[:600] == list(samples)
    assert rows[600 * 7 + 5] == f"{samples[5]} (7)"  # copy 7 of sample 5: its length + 4
    assert texts.review_labels(1_201)[1_200] == texts.review_labels(1)[0]


def test_made_distinct_suffixes_repeats_only(load) -> None:
    texts = load("texts")
    assert texts.made_distinct(["Note:", "a", "Note:", "Note: [2]", "Note:"]) == [
        "Note:", "a", "Note: [2]", "Note: [2] [2]", "Note: [3]"]


def test_distinct_sentences_continue_where_a_shorter_run_stopped(load) -> None:
    """scale.py grows a table by the rows after it: the same draw, later row numbers."""
    texts = load("texts")
    whole = texts.distinct_sentences(300, seed=101)
    assert texts.distinct_sentences(100, seed=101, start=200) == whole[200:]
    assert whole[250].endswith("(review 250)")


# ---- make bench: start-up apart from what follows it -----------------------------------------

def proc(run: ModuleType, wall: float, cpu: float, first: float | None = None,
         first_cpu: float | None = None) -> object:
    return run.Proc(wall=wall, cpu=cpu, rss=0.0, first_batch=first, first_batch_cpu=first_cpu)


def test_a_bertpipe_case_takes_its_start_up_from_its_twin(load) -> None:
    run = load("run")
    runs = {"bertpipe defaults": [proc(run, 20, 36), proc(run, 24, 40), proc(run, 22, 38)],
            run.startup_name("bertpipe defaults"): [proc(run, 6, 6.5, 5, 6),
                                                    proc(run, 9, 9.5, 8, 9)]}
    ph = run.phases(runs, "bertpipe defaults")
    assert (ph.wall, ph.cpu, ph.startup_wall, ph.startup_cpu) == (22, 38, 6.5, 7.5)
    assert ph.steady(31_000) == pytest.approx((31_000 / 15.5, 31_000 / 30.5))
    assert ph.cores_busy(2) == pytest.approx(38 / 44)
    assert ph.cores_busy_after(2) == pytest.approx(30.5 / 31)


def test_a_peer_takes_its_start_up_from_its_own_first_batch_line(load) -> None:
    run = load("run")
    ph = run.phases({"st openvino": [proc(run, 30, 50, 8, 9)]}, "st openvino")
    assert ph.steady(44_000) == (44_000 / 22, 44_000 / 41)
    assert ph.cores_busy(2) == pytest.approx(50 / 60)


def test_the_steady_state_table_sets_the_defaults_against_the_peer(load) -> None:
    run = load("run")
    steady = {"tokens": 1_000, "peer": "st openvino", "runs": {
        "bertpipe defaults": [proc(run, 10, 18)],
        run.startup_name("bertpipe defaults"): [proc(run, 3, 3, 2, 2)],
        "st openvino": [proc(run, 14, 24, 4, 4)]}}
    rows = run.steady_rows(steady, cores=2)
    assert [r[0] for r in rows] == ["bertpipe defaults", "st openvino",
                                    "ratio (defaults / peer)"]
    assert rows[0][1:] == ["2.0 / 2.0", "10.0 / 18.0", "125", "62", "90% / 100%"]
    assert rows[1][1:] == ["4.0 / 4.0", "14.0 / 24.0", "100", "50", "86% / 100%"]
    assert rows[2][2:5] == ["1.40x / 1.33x", "1.25x", "1.25x"]


# ---- docs/results.md: rendered from the result files ----------------------------------------

PAGE = BENCHMARKS.parent / "docs" / "results.md"


def test_the_results_page_is_the_rendering_of_the_result_files(load) -> None:
    """A hand edit of docs/results.md, or a result file changed without `make results`,
    fails here."""
    page = load("results_page")
    assert PAGE.read_text() == page.render(), "docs/results.md is stale: run make results"


@pytest.mark.parametrize("name", benchmark_names())
def test_every_benchmark_has_a_result_file_naming_machine_and_date(load, name: str) -> None:
    record = load("record")
    path = record.RESULTS / f"{name}.json"
    assert path.exists(), f"benchmarks/{name}.py has no result file: seed it or run it"
    result = json.loads(path.read_text())
    assert result["benchmark"] == name and result["title"] and result["command"]
    for run in result["runs"]:
        assert set(run["machine"]) == {"cpu", "flags", "cores"}, run["machine"]
        assert all(run["machine"].values())  # a name, or "not recorded": never blank
        date = run["date"]
        assert date == record.NOT_RECORDED or datetime.date.fromisoformat(date)
        assert run["blocks"], f"{name}: a run without figures"


def test_a_rerun_replaces_the_benchmark_s_figures_on_the_page(load, tmp_path, monkeypatch,
                                                               capsys) -> None:
    record, page = load("record"), load("results_page")
    folder = tmp_path / "results"
    folder.mkdir()
    for path in record.RESULTS.glob("*.json"):
        (folder / path.name).write_text(path.read_text())
    assert "| 10,000 (1 round) | 1,141,574 | 5,408 |" in page.render(folder)
    monkeypatch.setattr(sys, "argv", ["overlap.py", "--rows", "12000"])
    with record.captured(str(BENCHMARKS / "overlap.py"), "The whole process against its "
                         "encoder", folder=folder):
        print("whole process 7,654 tokens/s")
    rendered = page.render(folder)
    section = rendered.split("## The whole process against its encoder")[1].split("\n## ")[0]
    assert "whole process 7,654 tokens/s" in section
    assert "5,408" not in rendered  # the run it replaced: in git's history only
    assert "`python benchmarks/overlap.py --rows 12000`" in section
    assert f"**Date:** {record.today()}." in section
    assert f"**Machine:** {record.machine()['cpu']}" in section
    assert "**Conditions:** load average " in section
    assert "whole process 7,654 tokens/s" in capsys.readouterr().out  # still printed


@pytest.mark.parametrize("argv", [["overlap.py", "--no-record"],
                                  ["overlap.py", "--encoder-alone", "job.yaml"]])
def test_a_trial_run_or_a_child_process_writes_no_result(load, tmp_path, monkeypatch,
                                                        argv: list[str]) -> None:
    record = load("record")
    monkeypatch.setattr(sys, "argv", argv)
    with record.captured("overlap.py", "title", children=("--encoder-alone",),
                         folder=tmp_path):
        assert "--no-record" not in sys.argv  # the benchmark's own parser never sees it
    assert not list(tmp_path.iterdir())


def test_a_failed_run_writes_no_result(load, tmp_path, monkeypatch) -> None:
    record = load("record")
    monkeypatch.setattr(sys, "argv", ["overlap.py"])
    with pytest.raises(RuntimeError), record.captured("overlap.py", "t", folder=tmp_path):
        print("half a report")
        raise RuntimeError("a case failed")
    assert not list(tmp_path.iterdir())


def test_a_table_with_a_missing_cell_is_refused(load) -> None:
    page = load("results_page")
    with pytest.raises(ValueError, match="2 cells"):
        page.table_lines({"columns": ["a", "b"], "align": "lr", "rows": [["1"]]})
