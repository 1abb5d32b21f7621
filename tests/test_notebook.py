"""docs/notebook.ipynb runs top to bottom against a real store, so it never rots."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests.conftest import REPO


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path: Path, minilm: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    store = tmp_path / "reviews.zarr"
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(main, [
        "extract", "jobs/reviews.yaml", "--set", f"output.path={store}",
        "--set", f"model.path={minilm}", "--set", "execution.scheduler=synchronous",
        "--set", "views={mean: {pooling: mean}, cls: {pooling: cls}, "
                 "mid4: {layers: [-4, -3, -2, -1], combine: mean, pooling: mean}}"])
    assert result.exit_code == 0, result.output
    notebook = nbformat.read(REPO / "docs" / "notebook.ipynb", as_version=4)
    monkeypatch.setenv("BERTPIPE_STORE", str(store))
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO / "docs")}})
    client.execute()  # raises CellExecutionError, naming the cell, on any failure
    outputs = [o for cell in notebook.cells if cell.cell_type == "code"
               for o in cell.get("outputs", [])]
    text = "\n".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "mean view: accuracy" in text
