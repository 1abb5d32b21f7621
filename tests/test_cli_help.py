"""Every command shows examples in its --help and every option says what it does; the
commands that only read (--help, validate, inspect) import no heavy library they do not use."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests.conftest import job_dict, write_job, write_table


@pytest.mark.parametrize("name", sorted(main.commands))
def test_command_help_has_examples_and_every_option_is_explained(name: str) -> None:
    command = main.commands[name]
    undocumented = [p.opts for p in command.params if isinstance(p, click.Option) and not p.help]
    assert undocumented == [], f"{name}: options without help: {undocumented}"
    result = CliRunner().invoke(main, [name, "--help"])
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("Example"))
    example = lines[start + 1].strip()
    assert example.startswith(f"bertpipe {name} "), example  # kept on one line (\b)


def test_top_level_help_lists_exit_codes_and_completion() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert "_BERTPIPE_COMPLETE=bash_source bertpipe" in result.stdout
    assert "7  scheduler unreachable" in result.stdout


def test_help_imports_no_heavy_library() -> None:
    """`bertpipe --help` (and `import pipeline`) start in a fraction of a second: torch,
    transformers, xarray, dask, zarr and pyarrow are imported by the commands that use
    them, never by the package or the CLI module."""
    import subprocess
    import sys

    heavy = ["torch", "transformers", "xarray", "dask", "zarr", "pyarrow", "numpy"]
    code = ("import sys; from click.testing import CliRunner; import pipeline; "
            "from pipeline.cli import main; "
            "assert CliRunner().invoke(main, ['--help']).exit_code == 0; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _modules_after(args: list[str], cwd: Path) -> tuple[list[str], str]:
    """Run `bertpipe ARGS` in a fresh interpreter: the heavy libraries it imported, and
    what it printed."""
    import json
    import subprocess
    import sys

    heavy = ["torch", "transformers", "sklearn", "dask.array", "distributed"]
    code = ("import json, sys; from click.testing import CliRunner; "
            "from pipeline.cli import main; "
            f"r = CliRunner().invoke(main, {args!r}); "
            "assert r.exit_code == 0, r.output; "
            f"print(json.dumps([[m for m in {heavy!r} if m in sys.modules], r.output]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr
    imported, output = json.loads(done.stdout.strip().splitlines()[-1])
    return imported, output


def test_validate_imports_no_torch(tmp_path: Path, tiny_bert: Path) -> None:
    """`bertpipe validate` reads the model's config, tokenizer and weight headers as files
    (extract/modelfiles.py) and starts in about a second: torch and transformers would
    add seconds."""
    src = write_table(tmp_path / "in.parquet", {"id": [1, 2], "text": ["good", "bad"]})
    job = write_job(tmp_path / "job.yaml", job_dict(src, tiny_bert, tmp_path / "o.zarr"))
    imported, output = _modules_after(["validate", str(job)], tmp_path)
    assert "valid (" in output and "checked model bert (2 layers, hidden 32)" in output
    assert imported == []


@pytest.mark.parametrize("fmt", ["zarr", "icechunk"])
def test_a_run_with_nothing_to_encode_imports_no_torch(tmp_path: Path, tiny_bert: Path,
                                                       fmt: str) -> None:
    """A rerun of a complete store and a nightly update whose input has not changed encode
    nothing: they compare, say so and stop, without loading torch, transformers or the
    model (each would add seconds to every such scheduled run)."""
    src = write_table(tmp_path / "in.parquet", {"id": [1, 2], "text": ["good", "bad drug"]})
    output = {"format": fmt, **({"incremental": True} if fmt == "icechunk" else {})}
    job = write_job(tmp_path / "job.yaml", job_dict(src, tiny_bert, tmp_path / f"o.{fmt}",
                                                    output=output))
    assert CliRunner().invoke(main, ["extract", str(job)]).exit_code == 0
    imported, said = _modules_after(["extract", str(job)], tmp_path)
    assert ("already complete" if fmt == "zarr" else "nothing to encode") in said
    assert [m for m in imported if m in ("torch", "transformers")] == []


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_the_runtime_of_a_job_that_fixes_it_is_decided_without_torch(
        tmp_path: Path, tiny_bert: Path, device: str) -> None:
    """The client of a cluster run decides the workers' runtime and encodes nothing: for a
    job on the CPU that names its runtime and dtype, that costs no torch import (nor on
    `device: auto` where no GPU device node exists)."""
    import json
    import subprocess
    import sys

    from pipeline.extract.runtime_choice import gpu_device_nodes

    if device == "auto" and (sys.platform != "linux" or gpu_device_nodes()):
        pytest.skip("a GPU device node is here: torch must be asked")
    raw = job_dict(tmp_path / "in.parquet", tiny_bert, tmp_path / "o.zarr")
    job = write_job(tmp_path / "job.yaml", {**raw, "model": {**raw["model"], "device": device}})
    code = ("import json, sys, yaml; from pipeline.spec import Job; "
            "from pipeline.extract.calibrate import decide; "
            f"job = Job.from_dict(yaml.safe_load(open({str(job)!r}))); "
            "c = decide(job, {}, lambda: []); "
            "print(json.dumps([c.runtime, c.dtype, c.by, 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == ["torch", "float32", "job", False]


def test_inspect_imports_no_torch(tmp_path: Path, tiny_bert: Path) -> None:
    """`bertpipe inspect` reads the store and, for the vocabulary fit, the tokenizer's file:
    no torch, no transformers, no model, no Dask client to look for, and (a Zarr store's
    columns read by xarray's own lazy indexing) no dask.array."""
    src = write_table(tmp_path / "in.parquet", {"id": [1, 2], "text": ["good", "bad drug"]})
    job = write_job(tmp_path / "job.yaml", job_dict(src, tiny_bert, tmp_path / "o.zarr"))
    assert CliRunner().invoke(main, ["extract", str(job)]).exit_code == 0
    imported, output = _modules_after(["inspect", str(tmp_path / "o.zarr")], tmp_path)
    assert "vocabulary fit" in output and "most fragmented frequent words" in output
    assert imported == []


def test_device_auto_asks_torch_only_where_a_gpu_device_node_exists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import torch

    from pipeline.extract import runtime_choice

    assert runtime_choice.gpu_device_nodes(tmp_path) == []
    for name in ("nvidiactl", "dxg", "kfd"):
        (tmp_path / name).touch()
    assert runtime_choice.gpu_device_nodes(tmp_path) == ["nvidiactl", "dxg", "kfd"]
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(runtime_choice, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(runtime_choice, "gpu_device_nodes", lambda: ["nvidiactl"])
    assert runtime_choice.device_type("auto") == "cuda"  # torch was asked
    monkeypatch.setattr(runtime_choice, "gpu_device_nodes", lambda: [])
    assert runtime_choice.device_type("auto") == "cpu"
    assert runtime_choice.device_type("cuda") == "cuda"  # named: always torch's answer
    monkeypatch.setattr(sys, "platform", "win32")  # no /dev to look in: torch is asked
    assert runtime_choice.device_type("auto") == "cuda"
