"""The provenance a finished store carries, as one typed object.

It is the only module that reads provenance dicts: formats store and return the plain
dict (`to_dict` / `from_dict` here), everything above reads attributes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import StoreError
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
    runtime: list[str] = field(default_factory=lambda: ["torch"])  # what ran the encoder

    @property
    def views(self) -> list[str]:
        """Extracted views, then views added by post-processing."""
        extracted = [v.name for v in self.job.views]
        return extracted + [v for v in self.post if v not in extracted]

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
                runtime=list(raw.get("runtime", ["torch"])),  # stores before runtimes: torch
            )
        except (KeyError, TypeError) as exc:
            raise StoreError(f"{where}: damaged provenance ({type(exc).__name__}: {exc})") from None


def is_complete(raw: dict[str, Any] | None) -> bool:
    """A store's raw provenance says it is complete (what a rerun checks first)."""
    return bool(raw and raw.get("complete"))


def fingerprint_of(raw: dict[str, Any] | None) -> str | None:
    """The run fingerprint a store (complete or not) was started with."""
    value = (raw or {}).get("run_fingerprint")
    return str(value) if value else None
