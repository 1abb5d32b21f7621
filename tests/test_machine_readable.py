"""Machine-readable runs: `extract --json-summary` and `inspect --json`, against their
schemas and against the store they describe."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner

import pipeline
from pipeline.cli import main
from tests.conftest import REPO, job_dict, write_job


def _schema(name: str) -> dict:
    return json.loads((REPO / "schemas" / name).read_text())


def _extract(tmp_path: Path, job: dict, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "summary.json"
    result = CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "j.yaml", job)),
                                       "--json-summary", str(out), *extra])
    summary = json.loads(out.read_text())
    jsonschema.validate(summary, _schema("run-summary.schema.json"))
    assert summary["exit_code"] == result.exit_code, result.output
    return result.exit_code, summary


def test_summary_counts_match_the_store(tmp_path: Path, tiny_bert: Path,
                                        small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr")
    code, summary = _extract(tmp_path, job)
    store = pipeline.open_store(tmp_path / "o.zarr")
    assert code == 0 and summary["meaning"] == "ok" and summary["error"] is None
    assert summary["rows"] == store.docs.sizes["doc"] == 10
    assert summary["tokens"] == int(np.asarray(store.docs["n_tokens"].values).sum())
    # tokens fed to the model: each distinct text with its [CLS] and [SEP] (no text here is
    # long enough to be cut), counted by the tokenizer itself; the history says the same
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_bert))
    texts = set(pipeline.open_store(tmp_path / "o.zarr").docs["text_sha256"].values)
    fed = sum(len(tokenizer(t)["input_ids"]) for t in _texts(small_texts))
    assert len(texts) == 10
    assert summary["tokens_encoded_this_run"] == fed == store.provenance.history[-1].tokens
    assert summary["tokens_encoded_this_run"] == summary["tokens"] + 2 * 10
    assert summary["chunks"] == int(np.asarray(store.docs["n_chunks"].values).sum())
    assert summary["partitions"] == {"total": 2, "skipped": 0, "run": 2, "failed": 0}
    assert summary["device"] == ["cpu"] and summary["dtype"] == ["float32"]


def _texts(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(path).column("text").to_pylist()


def test_the_summary_line_and_the_history_count_the_same_tokens(
        tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr")
    result = CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "j.yaml", job))])
    assert result.exit_code == 0, result.output
    history = pipeline.open_store(tmp_path / "o.zarr").provenance.history[-1]
    assert f" {history.tokens} tokens encoded in " in result.stdout
    inspected = CliRunner().invoke(main, ["inspect", str(tmp_path / "o.zarr")])
    assert f", {history.tokens} tokens, " in inspected.stdout


def test_a_resume_counts_only_what_it_encoded(tmp_path: Path, tiny_bert: Path,
                                              small_texts: Path) -> None:
    from pipeline.run import runner
    from pipeline.spec import Job

    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr",
                   execution={"scheduler": "synchronous", "partition_rows": 2})
    first = Job.from_dict(job)

    class Stop(Exception):
        pass

    def stop_after_first(part: object, marker: object) -> None:
        raise Stop  # the first partition's marker is written; the run dies soon after

    try:
        runner.run_job(first, on_done=stop_after_first)
    except Stop:
        pass
    # a partition already on its way when the run died (its write in flight) may be done too
    done = len(list((tmp_path / "o.zarr").glob("_bertpipe/parts/*.done.json")))
    code, summary = _extract(tmp_path, job)
    parts = summary["partitions"]
    assert code == 0 and parts["skipped"] == done and 1 <= done < parts["total"], summary
    assert parts["run"] == parts["total"] - done
    assert 0 < summary["tokens_encoded_this_run"] < summary["tokens"]


def test_a_failed_run_still_writes_its_summary(tmp_path: Path, tiny_bert: Path,
                                               small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr",
                   input={"text_column": "missing"})
    code, summary = _extract(tmp_path, job)
    assert code == 3 and summary["exit_code"] == 3
    assert "input table" in summary["meaning"].lower() and "missing" in summary["error"]


def test_inspect_json_matches_the_store(tmp_path: Path, tiny_bert: Path,
                                       small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr")
    assert CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "j.yaml", job))]
                              ).exit_code == 0
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "o.zarr"), "--json",
                                       "--geometry", "--sample", "50"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    jsonschema.validate(facts, _schema("inspect.schema.json"))
    store = pipeline.open_store(tmp_path / "o.zarr")
    assert facts["rows"] == 10 and facts["complete"] is True
    assert [v["name"] for v in facts["views"]] == store.views
    assert {v["name"]: v["width"] for v in facts["views"]} == {"mean": 32, "cls": 32}
    assert facts["coverage"]["tokens"] == int(np.asarray(store.docs["n_tokens"].values).sum())
    assert {(g["view"], g["fix"]) for g in facts["geometry"]} >= {("mean", "raw"),
                                                                  ("cls", "whiten")}


def test_inspect_names_software_versions_and_store_versions_apart(
        tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    import importlib.metadata as md

    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr")
    assert CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "j.yaml", job))]
                              ).exit_code == 0
    facts = json.loads(CliRunner().invoke(main, ["inspect", str(tmp_path / "o.zarr"),
                                                 "--json"]).stdout)
    jsonschema.validate(facts, _schema("inspect.schema.json"))
    assert facts["software_versions"]["torch"] == md.version("torch")
    assert facts["version"] == 0 and facts["versions_kept"] == [0]
    # the names of earlier releases, kept for the scripts that read them
    assert facts["versions"] == facts["software_versions"]
    assert facts["readable_versions"] == facts["versions_kept"]
    text = CliRunner().invoke(main, ["inspect", str(tmp_path / "o.zarr")]).stdout
    assert f"software   bertpipe {pipeline.__version__}, torch {md.version('torch')}" in text
    assert "\nversions   " not in text


@pytest.mark.no_store_schema  # the provenance below is what an older bertpipe could record
def test_inspect_shows_a_recorded_calibration_of_wrong_types(tmp_path: Path, tiny_bert: Path,
                                                            small_texts: Path) -> None:
    """A store that recorded a calibration cache's wrong types (before such a cache was
    measured again) still inspects: the values shown as recorded, not a traceback."""
    from pipeline.stores import detect_format

    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr")
    assert CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "j.yaml", job))]
                              ).exit_code == 0
    fmt = detect_format(str(tmp_path / "o.zarr"))
    raw = fmt.record()
    raw["runtime_choice"] = {"runtime": "torch", "dtype": "float32", "by": "cache", "table": [
        {"runtime": "torch", "dtype": "float32", "tokens_per_s": "fast", "min_cosine": None,
         "agrees": True, "chosen": True, "note": ""}]}
    fmt.write_record(raw)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "o.zarr")])
    assert result.exit_code == 0, result.output
    assert "torch float32      'fast' tokens/s  min cosine None  chosen" in result.stdout
