"""Job files: defaults, overrides, resolution, cross-key rules, `bertpipe validate`."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import JobError
from pipeline.spec import Job, load_job
from tests.conftest import REPO, job_dict, write_job


def test_shipped_jobs_validate(minilm: Path, monkeypatch: pytest.MonkeyPatch,
                               tmp_path: Path) -> None:
    monkeypatch.chdir(REPO)  # the jobs' relative paths are relative to the repository
    for path in sorted((REPO / "jobs").glob("*.yaml")):
        result = CliRunner().invoke(main, ["validate", str(path), "--schema-only"])
        assert result.exit_code == 0, (path, result.output)
        assert "valid" in result.stdout and "checked model" not in result.stdout
        assert "the model, the input and the output were not checked" in result.stdout
        if "s3://" in path.read_text():
            continue  # checked against an S3 endpoint in test_object_store
        # the full check reads the model's config and the input's footers (the model from
        # its package, wherever `make model` has not copied it to models/)
        # into a fresh output: validate checks the store there too, and out/ may hold the
        # demo's store, made with the model from models/
        result = CliRunner().invoke(main, ["validate", str(path), "--set",
                                           f"model.path={minilm}", "--set",
                                           f"output.path={tmp_path / path.stem}"])
        assert result.exit_code == 0, (path, result.output)
        assert "checked model bert (6 layers, hidden 384); input 1 file, 600 rows" \
            in result.stdout, result.stdout


def test_defaults_and_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    job = Job.from_dict({
        "input": {"path": "data/x.parquet", "text_column": "text"},
        "model": {"path": "m"},
        "views": {"v": {"pooling": "mean"}, "all": {"layers": "all", "combine": "mean",
                                                    "pooling": "cls"}},
        "output": {"path": "out/x.zarr"},
    })
    assert job.input.path == str(tmp_path / "data/x.parquet")
    assert job.model.path == str(tmp_path / "m")
    assert job.output.path == str(tmp_path / "out/x.zarr")
    assert job.chunking.strategy == "hierarchical" and job.chunking.aggregate == "mean"
    assert job.output.levels == ("docs", "chunks") and job.output.format == "zarr"
    assert job.view("v").layers == (-1,) and job.view("all").layers == "all"
    assert job.execution.scheduler == "local" and job.execution.retries == 2


def test_overrides_are_typed_and_change_fingerprint(tmp_path: Path) -> None:
    path = write_job(tmp_path / "j.yaml", job_dict(tmp_path / "x.parquet", tmp_path,
                                                   tmp_path / "o.zarr"))
    base = load_job(path)
    job = load_job(path, ("output.path=elsewhere.zarr", "model.dtype=bfloat16",
                          "batching.max_tokens_per_batch=512", "views.cls.normalize=true"))
    assert job.output.path.endswith("elsewhere.zarr")
    assert job.model.dtype == "bfloat16" and job.batching.max_tokens_per_batch == 512
    assert job.view("cls").normalize is True
    assert job.fingerprint() != base.fingerprint()
    # where it runs and where it writes do not change what is computed
    moved = load_job(path, ("output.path=a.zarr", "execution.scheduler=tcp://h:8786"))
    assert moved.fingerprint() == base.fingerprint()


def test_round_trip_to_dict(tmp_path: Path) -> None:
    job = Job.from_dict(job_dict(tmp_path / "x.parquet", tmp_path, tmp_path / "o.zarr"))
    assert Job.from_dict(job.to_dict()) == job


@pytest.mark.parametrize("views,fragment", [
    ({"v": {"layers": [1, 2], "pooling": "mean"}}, "views.v.combine"),
    ({"v": {"layers": [1, 2], "combine": "weighted", "weights": [1], "pooling": "mean"}},
     "views.v.weights: 1 weights for 2 layers"),
    ({"v": {"layers": [1, 2], "combine": "scalar_mix", "pooling": "mean"}}, "views.v.weights"),
    ({"v": {"layers": [1], "pooling": "pooler"}}, "last layer only"),
    ({"v": {"layers": "some", "pooling": "mean"}}, "views.v.layers"),
    ({"bad-name": {"pooling": "mean"}}, "views"),
])
def test_view_rules(tmp_path: Path, views: dict, fragment: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(JobError, match=fragment):
        Job.from_dict(job_dict(tmp_path / "x.parquet", tmp_path, tmp_path / "o.zarr",
                               views=views))


def test_overlap_must_leave_room(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="chunking.overlap"):
        Job.from_dict(job_dict(tmp_path / "x.parquet", tmp_path, tmp_path / "o.zarr",
                               chunking={"strategy": "hierarchical", "max_tokens": 64,
                                         "overlap": 40}))
