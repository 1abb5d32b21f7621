"""Every command shows examples in its --help and every option says what it does."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from pipeline.cli import main


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
