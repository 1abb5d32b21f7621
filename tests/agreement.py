"""`validate`, `extract --dry-run` and `extract` asked the same thing: each bad-input table
runs its job rows through all three and expects the same exit code and the same first words
wherever the row fails before anything is written (run/checks.py is the one list of checks
the three share)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from click.testing import CliRunner, Result

from pipeline.cli import main

COMMANDS = ("validate", "dry-run", "extract")
# options only `extract` takes (how many values follow each), dropped from `validate`
EXTRACT_ONLY = {"--json-summary": 1, "--dry-run": 0}
# where the three differ on purpose: a row refused for an option `validate` does not take
# gets "valid" from it, and the reason is this
VALIDATE_HAS_NO = {"--json-summary": "validate writes no run summary, so it has no "
                                     "--json-summary to check"}
FIRST_WORDS = 4


@dataclass(frozen=True)
class Outcome:
    code: int
    error: str  # the one error line ("" when the command succeeded)
    stdout: str

    @property
    def first_words(self) -> str:
        return " ".join(self.error.split()[:FIRST_WORDS])


def variants(args: Sequence[str]) -> dict[str, list[str]] | None:
    """The row's job and options as each of the three commands; None for a row that is not
    a job command (or checks the job file alone: `validate --schema-only`)."""
    command, rest = args[0], [str(a) for a in args[1:]]
    if command not in ("validate", "extract") or "--schema-only" in rest:
        return None
    common = _without(rest, {"--dry-run": 0})
    return {"validate": ["validate", *_without(common, EXTRACT_ONLY)],
            "dry-run": ["extract", "--dry-run", *common],
            "extract": ["extract", *common]}


def _without(args: list[str], options: dict[str, int]) -> list[str]:
    out, skip = [], 0
    for arg in args:
        if skip:
            skip -= 1
        elif arg in options:
            skip = options[arg]
        else:
            out.append(arg)
    return out


def outcome(result: Result) -> Outcome:
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback: the test fails showing it
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    return Outcome(result.exit_code, errors[-1] if errors else "", result.stdout)


def run_all(args: Sequence[str], invoke: Callable[[list[str]], Result] | None = None
            ) -> dict[str, Outcome]:
    """Each of the three commands' outcome, in the order a user would run them (validate
    and the dry run write nothing, so the same setup serves all three)."""
    call = invoke or (lambda argv: CliRunner().invoke(main, argv))
    found = variants(args)
    assert found is not None
    return {name: outcome(call(argv)) for name, argv in found.items()}


def assert_agree(outcomes: dict[str, Outcome], code: int, fragment: str,
                 fails_while_running: bool) -> None:
    """Refused before writing: the same code and first words from all three, the row's
    fragment in each. Refused while running (`fails_while_running`: a row's rows or weights
    are read only by the run): the two that only check pass and say "valid" / the plan."""
    run = outcomes["extract"]
    assert run.code == code and fragment in run.error, run
    if fails_while_running:
        for name in ("validate", "dry-run"):
            assert outcomes[name].code == 0, (name, outcomes[name])
        assert "valid (" in outcomes["validate"].stdout
        return
    compared = ["validate", "dry-run"]
    if any(option in run.error.split(":")[1] for option in VALIDATE_HAS_NO):  # its subject
        assert outcomes["validate"].code == 0, outcomes["validate"]
        compared.remove("validate")
    for name in compared:
        got = outcomes[name]
        assert (got.code, got.first_words) == (run.code, run.first_words), (name, got, run)
        assert fragment in got.error, (name, got)
        assert "valid" not in got.stdout and "would" not in got.stdout, (name, got)
