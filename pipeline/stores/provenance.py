"""The provenance a finished store carries, as one typed object.

It is the only module that reads provenance dicts: formats store and return the plain
dict (`to_dict` / `from_dict` here), everything above reads attributes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..errors import JobError, StoreError
from ..spec import Job, ViewSpec

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ModelInfo:
    """What identifies the weights: their path, SHA-256 per file, and the config."""

    path: str
    weights_sha256: dict[str, str]
    config: dict[str, Any]

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "?"))

    @property
    def n_layers(self) -> int:
        return int(self.config.get("num_hidden_layers") or self.config.get("n_layers") or 0)


@dataclass(frozen=True)
class InputFile:
    """What identifies one input file without reading its data pages: its path, size, row
    count and the SHA-256 of its Parquet footer (schema, row groups, column statistics)."""

    path: str
    size: int
    rows: int
    footer_sha256: str

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> InputFile:
        return cls(path=str(raw["path"]), size=int(raw["size"]), rows=int(raw["rows"]),
                   footer_sha256=str(raw["footer_sha256"]))


def input_change(before: Sequence[InputFile], now: Sequence[InputFile]) -> str | None:
    """How the input differs from what a store was made from, naming the first file that
    changed; None when it is the same."""
    old = {f.path: f for f in before}
    new = {f.path: f for f in now}
    for path, was in old.items():
        cur = new.get(path)
        if cur is None:
            return f"input file {path} is gone"
        if cur != was:
            what = [f"rows {was.rows} -> {cur.rows}" if cur.rows != was.rows else "",
                    f"size {was.size} -> {cur.size} bytes" if cur.size != was.size else ""]
            detail = "; ".join(w for w in what if w) or "its Parquet footer differs"
            return f"input file {path} changed ({detail})"
    added = [path for path in new if path not in old]
    if added:
        return f"input file {added[0]} is new"
    if list(old) != list(new):
        return "the input files are in a different order"
    return None


def identity_sha256(identity: Sequence[InputFile]) -> str:
    """One digest for an input's identity (what a history entry records)."""
    blob = json.dumps([asdict(f) for f in identity], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True)
class RunRecord:
    """One run that wrote the store: the first, full run or an incremental update.

    Rows of the input are `added` (new id), `replaced` (known id, changed text) or
    `unchanged`; `gone` counts the store's ids missing from the input, of which `pruned`
    were removed (`--prune`) and the rest kept with `present: false`. An Icechunk update
    appends an edited text and keeps the old row, flagged: `superseded` counts such rows in
    the store after the run, `dropped` those it removed (a prune, or past a tenth of the
    store). `encoded` texts were run through the model; `copied` rows took the vectors of an
    identical text instead (duplicates in the input, or a text the store already held).
    `carried_changed` rows of known ids took new carried values (e.g. a relabelling)."""

    kind: str  # full | incremental
    started: str  # ISO 8601, UTC
    version: int  # the store version this run made
    input_files: int
    input_rows: int
    input_sha256: str  # digest of the input identity (see `identity_sha256`)
    rows: int  # rows in the store after the run
    added: int
    replaced: int
    unchanged: int
    gone: int
    pruned: int
    encoded: int
    copied: int
    tokens: int  # tokens fed to the model, special tokens and overlap included
    wall_s: float
    took_over_lock: str = ""  # whose dead or expired lock this run took over, and why
    superseded: int = 0  # rows kept, flagged, that an edit superseded (after the run)
    dropped: int = 0  # superseded rows this run removed
    # rows of known ids whose carried values changed (a relabelling: nothing to encode)
    carried_changed: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


@dataclass(frozen=True)
class PostInfo:
    """A post-processed view: which view it was fitted on and how."""

    source: str
    method: str
    dims: int | None
    d: int
    normalize: bool
    width: int
    fitted_rows: int


@dataclass(frozen=True)
class FileSum:
    """A stored file's checksum: SHA-256 of its first `size` bytes (a Parquet file's column
    data, before the footer that holds the provenance; every other file whole)."""

    sha256: str
    size: int


@dataclass(frozen=True)
class CandidateRow:
    """One runtime and dtype as calibration measured it on this machine."""

    runtime: str
    dtype: str
    tokens_per_s: float  # the job's own chunks through the encoder (0: not run)
    min_cosine: float  # lowest over every row and view, against torch float32
    agrees: bool  # min_cosine >= the threshold: it may be chosen
    chosen: bool
    note: str = ""  # why it is out, when it is


@dataclass(frozen=True)
class RuntimeChoice:
    """What ran the encoder and why: `by` the job (it fixed both, or left one candidate),
    a calibration measured now, or the cached one of an earlier calibration."""

    runtime: str
    dtype: str
    by: str  # job | calibration | cache
    table: tuple[CandidateRow, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RuntimeChoice:
        return cls(str(raw["runtime"]), str(raw["dtype"]), str(raw["by"]),
                   tuple(CandidateRow(**row) for row in raw.get("table") or ()))


@dataclass(frozen=True)
class Provenance:
    format_version: int
    run_fingerprint: str
    job: Job
    model: ModelInfo
    versions: dict[str, str]
    device: list[str]
    dtype: list[str]
    created: str
    stats: dict[str, float]
    complete: bool
    post: dict[str, PostInfo] = field(default_factory=dict)
    # empty in stores written before input identities were recorded
    input_identity: tuple[InputFile, ...] = ()
    # file path inside the store -> its checksum; recorded when the store is marked complete
    # (empty in stores written before checksums existed)
    checksums: dict[str, FileSum] = field(default_factory=dict)
    runtime: list[str] = field(default_factory=lambda: ["torch"])  # what ran the encoder
    # the data version readers open: 0 for the first run, one more per incremental update
    version: int = 0
    # one entry per run that wrote the store, oldest first (empty in older stores)
    history: tuple[RunRecord, ...] = ()
    # how model.runtime and model.dtype were resolved (None: stores before calibration, GPU)
    runtime_choice: RuntimeChoice | None = None

    @property
    def views(self) -> list[str]:
        """Extracted views with document vectors, then views added by post-processing
        (token views are in `token_views`)."""
        extracted = [v.name for v in self.job.views if not v.per_token]
        return extracted + [v for v in self.post if v not in extracted]

    @property
    def token_views(self) -> list[str]:
        """Views with pooling: tokens, stored in the tokens level only."""
        return [v.name for v in self.job.token_views]

    def view_spec(self, name: str) -> ViewSpec | None:
        """The job's spec of an extracted view (None for a post-processed one)."""
        return next((v for v in self.job.views if v.name == name), None)

    def source_view(self, name: str) -> str:
        """The extracted view a (possibly post-processed) view derives from."""
        info = self.post.get(name)
        return info.source if info else name

    def with_post(self, name: str, info: PostInfo) -> Provenance:
        return replace(self, post={**self.post, name: info})

    def to_dict(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["job"] = self.job.to_dict()
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> Provenance:
        version = raw.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise StoreError(f"{where}: store format version {version!r} is newer than this "
                             f"bertpipe reads ({FORMAT_VERSION}); upgrade bertpipe")
        try:
            return cls(
                format_version=version,
                run_fingerprint=str(raw["run_fingerprint"]),
                job=Job.from_dict(raw["job"]),
                model=ModelInfo(**raw["model"]),
                versions=dict(raw["versions"]),
                device=list(raw["device"]),
                dtype=list(raw["dtype"]),
                created=str(raw["created"]),
                stats=dict(raw["stats"]),
                complete=bool(raw.get("complete")),
                post={k: PostInfo(**v) for k, v in raw.get("post", {}).items()},
                input_identity=input_identity_of(raw),
                checksums=recorded_checksums(raw),
                runtime=list(raw.get("runtime", ["torch"])),  # stores before runtimes: torch
                version=version_of(raw),
                history=tuple(RunRecord.from_dict(r) for r in raw.get("history") or ()),
                runtime_choice=RuntimeChoice.from_dict(raw["runtime_choice"])
                if raw.get("runtime_choice") else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{where}: damaged provenance ({type(exc).__name__}: {exc})") from None
        except JobError as exc:  # written by a bertpipe with looser rules, or edited
            raise StoreError(f"{where}: the store's job does not validate: {exc}") from None


def is_complete(raw: dict[str, Any] | None) -> bool:
    """A store's raw provenance says it is complete (what a rerun checks first)."""
    return bool(raw and raw.get("complete"))


def fingerprint_of(raw: dict[str, Any] | None) -> str | None:
    """The run fingerprint a store (complete or not) was started with."""
    value = (raw or {}).get("run_fingerprint")
    return str(value) if value else None


def input_identity_of(raw: dict[str, Any] | None) -> tuple[InputFile, ...]:
    """The input identity a store (complete or not) recorded; () when it recorded none."""
    return tuple(InputFile.from_dict(f) for f in (raw or {}).get("input_identity") or ())


def recorded_checksums(raw: dict[str, Any] | None) -> dict[str, FileSum]:
    """The checksums a store's raw provenance records (empty when it records none)."""
    sums = (raw or {}).get("checksums") or {}
    return {str(k): FileSum(str(v["sha256"]), int(v["size"])) for k, v in sums.items()}


def sealed(raw: dict[str, Any], checksums: dict[str, FileSum]) -> dict[str, Any]:
    """`raw` with `checksums` recorded (what a format writes when a store is complete)."""
    return {**raw, "checksums": {k: asdict(v) for k, v in sorted(checksums.items())}}


def version_of(raw: dict[str, Any] | None) -> int:
    """The data version a store's provenance names (0 when it names none)."""
    value = (raw or {}).get("version", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise StoreError(f"damaged provenance: version {value!r} is not a version number")
    return value
