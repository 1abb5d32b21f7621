"""docs/notebook.ipynb runs top to bottom against a real store, so it never rots."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests.conftest import REPO


def _versioned_store(root: Path, model: Path) -> Path:
    """An Icechunk store with two versions: 20 reviews, then 25 (the notebook's last
    section)."""
    import pyarrow.parquet as pq

    from pipeline.run.runner import run_job
    from pipeline.spec import Job
    from tests.conftest import REVIEWS, job_dict

    source = root / "growing.parquet"
    job = Job.from_dict(job_dict(source, model, root / "reviews.icechunk",
                                 output={"format": "icechunk", "incremental": True}))
    for rows in (20, 25):
        pq.write_table(pq.read_table(REVIEWS).slice(0, rows), source)
        run_job(job)
    return root / "reviews.icechunk"


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path: Path, minilm: Path, tiny_bert: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    store = tmp_path / "reviews.zarr"
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(main, [
        "extract", "jobs/reviews.yaml", "--set", f"output.path={store}",
        "--set", f"model.path={minilm}", "--set", "execution.scheduler=synchronous",
        # OpenVINO in float32 (equal to torch's float32 at 1e-5, test_runtime_openvino.py,
        # and twice its speed here): `auto` would calibrate, which is a test of its own
        # (test_calibrate.py)
        "--set", "model.runtime=openvino", "--set", "model.dtype=float32",
        "--set", "views={mean: {pooling: mean}, cls: {pooling: cls}, "
                 "mid4: {layers: [-4, -3, -2, -1], combine: mean, pooling: mean}}"])
    assert result.exit_code == 0, result.output
    notebook = nbformat.read(REPO / "docs" / "notebook.ipynb", as_version=4)
    monkeypatch.setenv("BERTPIPE_STORE", str(store))
    # the kernel's probes fit hundreds of rows: one BLAS thread each beside the other test
    # worker (thread hand-offs on 2 shared cores cost more than they save)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("BERTPIPE_VERSIONED_STORE", str(_versioned_store(tmp_path, tiny_bert)))
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO / "docs")}})
    client.execute()  # raises CellExecutionError, naming the cell, on any failure
    text = _printed(notebook)
    assert "mean view: accuracy" in text and "over the majority class" in text
    assert "version 1: 25 rows; version 0: 20 rows" in text
    assert "rows of version 0 unchanged in the current version: True" in text
    # nothing on stderr: no warnings (an ipywidgets/IProgress one included), no tracebacks
    assert not [o for o in _outputs(notebook) if o.get("name") == "stderr"], text
    # the shipped notebook has its outputs, and they are what a run prints now
    shipped = nbformat.read(REPO / "docs" / "notebook.ipynb", as_version=4)
    assert all(cell.get("outputs") for cell in shipped.cells if cell.cell_type == "code")
    assert not [o for o in _outputs(shipped) if o.get("name") == "stderr"]
    for line in ("mean view: accuracy", "mid4 view: accuracy", "majority class: accuracy"):
        assert _score(_printed(shipped), line) == pytest.approx(_score(text, line), abs=0.01)


def _outputs(notebook: Any) -> list[Any]:
    return [o for cell in notebook.cells if cell.cell_type == "code"
            for o in cell.get("outputs", [])]


def _printed(notebook: Any) -> str:
    return "\n".join(o.get("text", "") for o in _outputs(notebook)
                     if o.get("output_type") == "stream")


def _score(text: str, start: str) -> float:
    """The first number after `start` on its line."""
    found = re.search(re.escape(start) + r" (\d\.\d+)", text)
    assert found, (start, text)
    return float(found.group(1))
