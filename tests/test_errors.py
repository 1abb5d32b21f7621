"""Bad input through the CLI: one clear line naming the key/column/row, a non-zero exit,
no traceback, and nothing already written lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import pipeline
from pipeline.cli import main
from tests.conftest import job_dict, write_job, write_table


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def extract(tmp_path: Path, job: dict[str, Any], *extra: str) -> Result:
    return run("extract", str(write_job(tmp_path / "job.yaml", job)), *extra)


def assert_user_error(result: Result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, result.output
    # progress lines (timestamped) may come first; the error is one line, and the last
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert all(line[:4].isdigit() for line in lines[:-1]), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_missing_column(tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr", input={"text_column": "body"})
    assert_user_error(extract(tmp_path, job), 3, "input.text_column", "'body'",
                      "columns: id, text, label")


def test_missing_carry_column(tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr",
                   input={"carry_columns": ["label", "stars"]})
    assert_user_error(extract(tmp_path, job), 3, "input.carry_columns", "'stars'")


def test_non_string_text_column(tmp_path: Path, tiny_bert: Path) -> None:
    src = write_table(tmp_path / "n.parquet", {"id": [1, 2], "text": [3, 4]})
    job = job_dict(src, tiny_bert, tmp_path / "o.zarr")
    assert_user_error(extract(tmp_path, job), 3, "input.text_column", "int64", "expected string")


def test_null_and_blank_text_are_flagged_never_zero(tmp_path: Path, tiny_bert: Path) -> None:
    src = write_table(tmp_path / "e.parquet", {"id": [1, 2, 3, 4],
                                               "text": ["good drug", None, "   \n", "bad"]})
    job = job_dict(src, tiny_bert, tmp_path / "o.zarr")
    result = extract(tmp_path, job)
    assert result.exit_code == 0, result.output
    store = pipeline.open_store(tmp_path / "o.zarr")
    assert list(store.docs["status"].values) == ["ok", "empty", "empty", "ok"]
    mean = store.vectors("mean")
    assert np.isnan(mean[[1, 2]]).all() and np.isfinite(mean[[0, 3]]).all()
    assert list(store.docs["n_chunks"].values) == [1, 0, 0, 1]
    inspect = run("inspect", str(tmp_path / "o.zarr"))
    assert "2 ok, 2 empty, 0 truncated" in inspect.stdout


def test_unknown_pooling_lists_valid(tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr",
                   views={"v": {"pooling": "median"}})
    assert_user_error(extract(tmp_path, job), 2, "views.v.pooling", "'median'", "'attention'")


def test_malformed_yaml_names_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("input:\n  path: [unclosed\nmodel: x\n")
    assert_user_error(run("extract", str(bad)), 2, "bad.yaml", "malformed YAML", "line")


def test_unknown_key_lists_allowed(tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr", output={"fromat": "zarr"})
    assert_user_error(extract(tmp_path, job), 2, "output", "'fromat'", "allowed keys")


def test_missing_model(tmp_path: Path, small_texts: Path) -> None:
    job = job_dict(small_texts, tmp_path / "no-such-model", tmp_path / "o.zarr")
    assert_user_error(extract(tmp_path, job), 4, "model.path", "no-such-model")


def test_pooler_on_model_without_one(tmp_path: Path, tiny_distilbert: Path,
                                     small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_distilbert, tmp_path / "o.zarr",
                   views={"p": {"pooling": "pooler"}})
    assert_user_error(extract(tmp_path, job), 4, "pooling pooler", "distilbert", "no trained "
                      "pooler")


def test_distilbert_views_work_without_pooler(tmp_path: Path, tiny_distilbert: Path,
                                              small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_distilbert, tmp_path / "o.zarr",
                   views={"m": {"pooling": "mean"}, "a": {"pooling": "attention"},
                          "l1": {"layers": [1], "pooling": "cls"}})
    assert extract(tmp_path, job).exit_code == 0
    assert pipeline.open_store(tmp_path / "o.zarr").docs["a"].shape == (10, 32)


def test_layer_out_of_range(tmp_path: Path, tiny_bert: Path, small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr",
                   views={"deep": {"layers": [5], "pooling": "mean"}})
    assert_user_error(extract(tmp_path, job), 2, "views.deep.layers", "out of range")


def test_refused_rerun_keeps_existing_store(tmp_path: Path, tiny_bert: Path,
                                           small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr")
    assert extract(tmp_path, job).exit_code == 0
    before = pipeline.open_store(tmp_path / "o.zarr").vectors("mean")
    changed = {**job, "views": {"mean": {"pooling": "max"}}}
    assert_user_error(extract(tmp_path, changed), 5, "different job")
    np.testing.assert_array_equal(pipeline.open_store(tmp_path / "o.zarr").vectors("mean"), before)
    assert extract(tmp_path, changed, "--overwrite").exit_code == 0


def test_output_path_holding_other_files_is_refused(tmp_path: Path, tiny_bert: Path,
                                                    small_texts: Path) -> None:
    (tmp_path / "o.zarr").mkdir()
    (tmp_path / "o.zarr" / "notes.txt").write_text("precious")
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr")
    assert_user_error(extract(tmp_path, job), 5, "not a bertpipe store")
    assert (tmp_path / "o.zarr" / "notes.txt").read_text() == "precious"


def test_open_store_on_missing_path(tmp_path: Path) -> None:
    assert_user_error(run("inspect", str(tmp_path / "nothing")), 5, "no such store")


@pytest.mark.parametrize("override,fragment", [
    ("output.format=csv", "output.format"),
    ("model.dtype=int8", "model.dtype"),
    ("model.runtime=onnx", "model.runtime"),
    ("nonsense", "KEY=VALUE"),
])
def test_bad_overrides(tmp_path: Path, tiny_bert: Path, small_texts: Path, override: str,
                       fragment: str) -> None:
    path = write_job(tmp_path / "job.yaml", job_dict(small_texts, tiny_bert, tmp_path / "o.zarr"))
    assert_user_error(run("validate", str(path), "--set", override), 2, fragment)


def test_failed_partition_is_reported_and_others_kept(tmp_path: Path, tiny_bert: Path) -> None:
    ids = list(range(20))
    ids[13] = None  # type: ignore[call-overload]
    # without statistics the plan cannot see the null id, so only its partition fails
    src = write_table(tmp_path / "ids.parquet", {"id": ids, "text": ["good drug"] * 20},
                      write_statistics=False)
    job = job_dict(src, tiny_bert, tmp_path / "o.zarr")  # partitions of 8 rows
    result = extract(tmp_path, job)
    assert_user_error(result, 6, "1 of 3 partitions failed", "partition 1 (rows 8-15",
                      "null id", "row 13")
    parts = sorted(p.name for p in (tmp_path / "o.zarr" / "_bertpipe" / "parts").glob("*.json"))
    assert parts == ["000000.done.json", "000002.done.json"]


def test_storage_options_need_a_url(tmp_path: Path, tiny_bert: Path,
                                    small_texts: Path) -> None:
    job = job_dict(small_texts, tiny_bert, tmp_path / "o.zarr")
    job["output"]["storage_options"] = {"anon": True}
    assert_user_error(extract(tmp_path, job), 2, "output.storage_options", "URL")
    assert not (tmp_path / "o.zarr").exists()


def test_roberta_pooler_warns_untrained(tmp_path: Path, tiny_roberta: Path, small_texts: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    from pipeline.extract.partition import Extractor
    from pipeline.spec import Job

    job = Job.from_dict(job_dict(small_texts, tiny_roberta, tmp_path / "o.zarr",
                                 views={"p": {"pooling": "pooler"}, "m": {"pooling": "mean"}}))
    with caplog.at_level("WARNING"):
        ex = Extractor(job)
    assert "roberta checkpoints are trained without next-sentence prediction" in caplog.text
    assert ex.model.max_positions == 64  # RoBERTa reserves padding_idx + 1 positions
    vectors = ex.encode_texts(["good drug", "bad"]).docs
    assert vectors["p"].shape == (2, 32) and (abs(vectors["p"]) <= 1).all()  # tanh range
