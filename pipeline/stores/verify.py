"""Whether a finished store is what its provenance says: `bertpipe verify`, the check a
rerun makes before calling a store complete, and the cheap check made on every open."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import StoreError
from ..io.location import resolve
from . import detect_format
from .base import StoreFormat
from .integrity import describe, size_problem, sum_problem, where
from .provenance import Provenance, is_complete

LEVEL_STATS = {"docs": "rows", "chunks": "chunks"}  # level -> its row count in stats
MAX_LISTED = 5  # problems named in a one-line error; the count says how many more


@dataclass(frozen=True)
class Verified:
    """What a successful verification checked (the OK line of `bertpipe verify`)."""

    path: str
    format: str
    rows: int
    chunks: int
    views: int
    files: int

    def line(self) -> str:
        return (f"{self.path}: OK ({self.format}; {self.rows} rows, {self.chunks} chunks, "
                f"{self.views} views; {self.files} files match their checksums)")


def verify_store(path: str | Path) -> list[str]:
    """Everything wrong with a store, one line each (empty when it proves itself).

    Checks the `complete` flag, that no other writer committed over bertpipe's newest
    commit (Delta, Icechunk), every recorded checksum (file present, size, SHA-256),
    files no checksum covers, the rows of every array or file against the provenance's
    stats, and that every view is stored. A path that is no store, or a store of a newer
    format version, raises StoreError.
    """
    path = str(path)
    if not resolve(path).exists():
        raise StoreError(f"{path}: no such store")
    fmt = detect_format(path)
    if not is_complete(fmt.record()):
        return ["the store is incomplete (its job has not finished; rerun it to resume)"]
    foreign = fmt.foreign_problem()
    if foreign:  # what bertpipe checks is its own commit; the store's head is another's
        return [foreign]
    provenance = fmt.provenance()
    return _checksum_problems(fmt, provenance) + _row_problems(fmt, provenance)


def verified(path: str | Path) -> Verified:
    """The summary of a store that proves itself; StoreError naming what is wrong if not."""
    path = str(path)
    problems = verify_store(path)
    if problems:
        raise StoreError(f"{path}: fails verification: {summarize(problems)}")
    fmt = detect_format(path)
    provenance = fmt.provenance()
    stats = provenance.stats
    return Verified(path, fmt.name, int(stats.get("rows", 0)), int(stats.get("chunks", 0)),
                    len(provenance.views), len(provenance.checksums))


def summarize(problems: list[str]) -> str:
    """Problems as one line: the first few, then how many more."""
    text = "; ".join(problems[:MAX_LISTED])
    more = len(problems) - MAX_LISTED
    return text + (f"; and {more} more" if more > 0 else "")


def check_sizes(fmt: StoreFormat) -> None:
    """The cheap check made on every open: each recorded file is present with its size
    (no reading), so a missing or truncated file is refused before anything decodes it."""
    recorded = fmt.recorded_checksums()
    whole = fmt.whole_by_total(recorded)
    sizes = fmt.checked_sizes(rel for rel in recorded if rel not in whole)
    found = {rel: problem + _file_note(fmt, rel) for rel, size in sizes.items()
             if (problem := size_problem(rel, size, recorded[rel]))}
    problems = describe(found, {rel for rel, size in sizes.items() if size is None}, recorded)
    if problems:
        raise StoreError(f"{fmt.path}: damaged store: {summarize(problems)}; `bertpipe "
                         f"verify {fmt.path}` lists what is wrong")


def _checksum_problems(fmt: StoreFormat, provenance: Provenance) -> list[str]:
    recorded = provenance.checksums
    if not recorded:
        return ["no checksums recorded (written before bertpipe recorded them); rerun its "
                "job with --overwrite to rewrite it"]
    sums = fmt.file_sums(recorded)
    found = {rel: problem + _file_note(fmt, rel) for rel, expected in recorded.items()
             if (problem := sum_problem(rel, sums[rel], expected))}
    problems = describe(found, {rel for rel, sum_ in sums.items() if sum_ is None}, recorded)
    problems += [f"{where(rel)} is not recorded in the provenance (written after the store "
                 "was finished)" for rel in fmt.data_files() if rel not in recorded]
    return problems


def _row_problems(fmt: StoreFormat, provenance: Provenance) -> list[str]:
    expected = {level: provenance.stats.get(key) for level, key in LEVEL_STATS.items()}
    try:
        counts = fmt.row_counts()
        docs, chunks = fmt.open_datasets()  # lazy: metadata only
    except StoreError as exc:
        return [str(exc)]
    except ValueError as exc:  # xarray: the arrays of one level disagree on their length
        return [f"the arrays cannot be opened together ({exc})"]
    problems = [f"the provenance records no {LEVEL_STATS[level]} count (stats)"
                for level in sorted({level for level, _ in counts.values()})
                if expected[level] is None]
    for name, (level, rows) in counts.items():
        want = expected[level]
        if want is not None and rows != want:
            problems.append(f"{name} has {rows} rows where the provenance says {int(want)}")
    stored = {"docs": set(docs.data_vars), "chunks": set(chunks.data_vars if chunks else ())}
    for level in ["docs"] + (["chunks"] if "chunks" in provenance.job.output.levels else []):
        missing = [v for v in provenance.views if v not in stored[level]]
        if missing:
            problems.append(f"{level}: views {', '.join(missing)} are not stored")
    return problems


def _file_note(fmt: StoreFormat, rel: str) -> str:
    """` (file <name>)` where another file than `rel` holds it (an Icechunk chunk)."""
    stored = fmt.stored_as(rel)
    return f" (file {stored})" if stored else ""
