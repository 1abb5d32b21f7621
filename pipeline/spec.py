"""The job: YAML in, validated against `schemas/job.schema.json`, frozen dataclasses out.

Everything downstream takes a `Job`; nothing downstream reads YAML or dicts. A job is
resolved once (defaults filled, paths made absolute) so that the same object means the
same thing on every Dask worker and in the store's provenance.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .errors import JobError

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"
JOB_SCHEMA_PATH = SCHEMA_DIR / "job.schema.json"

LayerSelection = tuple[int, ...] | str  # explicit indices, or "all"


@dataclass(frozen=True)
class InputSpec:
    path: str
    text_column: str
    id_column: str | None = None
    carry_columns: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    path: str
    dtype: str = "auto"
    device: str = "auto"
    runtime: str = "auto"  # auto | torch | openvino (pipeline/extract/runtime.py)
    max_tokens: int = 512
    allow_pickle: bool = False
    trust_remote_code: bool = False


@dataclass(frozen=True)
class ChunkingSpec:
    strategy: str = "hierarchical"
    max_tokens: int | None = None
    overlap: int = 0
    aggregate: str = "mean"


@dataclass(frozen=True)
class PostSpec:
    """A geometry fix fitted on a view's documents (`post:` in a view, or `postprocess`)."""

    method: str  # center | whiten | abtt
    dims: int | None = None  # whiten: dimensions kept
    d: int = 1  # abtt: top directions removed
    normalize: bool = False


@dataclass(frozen=True)
class ViewSpec:
    """One output array: which hidden states, how they are combined, how tokens are pooled."""

    name: str
    pooling: str
    layers: LayerSelection = (-1,)
    combine: str = "none"
    weights: tuple[float, ...] | None = None
    gamma: float = 1.0
    normalize: bool = False
    post: PostSpec | None = None  # fitted on the documents at the end of the run


@dataclass(frozen=True)
class OutputSpec:
    path: str
    format: str = "zarr"
    dtype: str = "float32"
    overwrite: bool = False
    levels: tuple[str, ...] = ("docs", "chunks")


@dataclass(frozen=True)
class BatchingSpec:
    max_tokens_per_batch: int = 2048
    max_batch_size: int = 256


@dataclass(frozen=True)
class ExecutionSpec:
    scheduler: str = "local"
    workers: int | None = None
    threads_per_worker: int | None = None
    partition_rows: int = 2048
    retries: int = 2


@dataclass(frozen=True)
class Job:
    input: InputSpec
    model: ModelSpec
    views: tuple[ViewSpec, ...]
    output: OutputSpec
    chunking: ChunkingSpec = field(default_factory=ChunkingSpec)
    batching: BatchingSpec = field(default_factory=BatchingSpec)
    execution: ExecutionSpec = field(default_factory=ExecutionSpec)

    def to_dict(self) -> dict[str, Any]:
        """The job as a plain dict in the job-file shape (views keyed by name)."""
        raw = asdict(self)
        raw["views"] = {v.pop("name"): _without_none(v) for v in raw["views"]}
        return _lists_for_tuples(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], base_dir: Path | None = None) -> Job:
        """Validate `raw` against the schema and build a resolved job.

        Relative input/output/model paths are resolved against `base_dir` (the working
        directory by default) so workers elsewhere see the same files.
        """
        validate_job_dict(raw)
        base = Path(base_dir or Path.cwd())
        inp = dict(raw["input"])
        inp["path"] = _absolute(inp["path"], base)
        inp["carry_columns"] = tuple(inp.get("carry_columns", ()))
        model = dict(raw["model"])
        model["path"] = _model_path(model["path"], base)
        out = dict(raw["output"])
        out["path"] = _absolute(out["path"], base)
        if "levels" in out:
            out["levels"] = tuple(out["levels"])
        views = tuple(_view_from_dict(name, body) for name, body in raw["views"].items())
        job = cls(
            input=InputSpec(**inp),
            model=ModelSpec(**model),
            views=views,
            output=OutputSpec(**out),
            chunking=ChunkingSpec(**raw.get("chunking", {})),
            batching=BatchingSpec(**raw.get("batching", {})),
            execution=ExecutionSpec(**raw.get("execution", {})),
        )
        _check_consistency(job)
        return job

    def fingerprint(self) -> str:
        """SHA-256 of everything that changes the output (not where or how it runs)."""
        content = self.to_dict()
        content.pop("execution")
        content["output"].pop("overwrite")
        content["output"].pop("path")
        blob = json.dumps(content, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def view(self, name: str) -> ViewSpec:
        for v in self.views:
            if v.name == name:
                return v
        raise JobError(f"views: no view named {name!r}; views are {[v.name for v in self.views]}")


def load_job(path: str | Path, overrides: tuple[str, ...] = ()) -> Job:
    """Read a YAML job file, apply `key.sub=value` overrides, validate, resolve."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobError(f"{path}: cannot read job file ({exc.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise JobError(f"{path}: malformed YAML{where}: {problem}") from None
    if not isinstance(raw, dict):
        raise JobError(f"{path}: a job file must be a mapping with input, model, views, output")
    for item in overrides:
        apply_override(raw, item)
    try:
        return Job.from_dict(raw)
    except JobError as exc:
        raise JobError(f"{path}: {exc}") from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `--set a.b.c=value` in place; the value is parsed as YAML (so 1, true, [..])."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise JobError(f"--set {item!r}: expected KEY=VALUE, e.g. output.path=out/x.zarr")
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise JobError(f"--set {key}: {part!r} is not a mapping")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError:
        raise JobError(f"--set {key}: value {value!r} is not valid YAML") from None


def validate_job_dict(raw: dict[str, Any]) -> None:
    """Schema validation; the first error becomes one line naming the key path."""
    validator = jsonschema.Draft202012Validator(job_schema())
    errors = sorted(validator.iter_errors(raw), key=lambda e: (len(e.path), list(e.path)))
    if errors:
        err = errors[0]
        key = ".".join(str(p) for p in err.path) or "(top level)"
        raise JobError(f"{key}: {_short_message(err)}")


def job_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(JOB_SCHEMA_PATH.read_text())
    return schema


def _short_message(err: jsonschema.ValidationError) -> str:
    if err.validator == "additionalProperties":
        schema = err.schema if isinstance(err.schema, dict) else {}
        allowed = sorted(schema.get("properties", {}))
        return f"{err.message}; allowed keys: {', '.join(allowed)}"
    if err.validator == "oneOf" and err.path and err.path[-1] == "layers":
        return f"{err.instance!r} is not valid: use 'all', an integer, or a list of integers"
    return err.message


def _view_from_dict(name: str, body: dict[str, Any]) -> ViewSpec:
    layers = body.get("layers", [-1])
    if isinstance(layers, int):
        layers = [layers]
    weights = body.get("weights")
    return ViewSpec(
        name=name,
        pooling=body["pooling"],
        layers="all" if layers == "all" else tuple(layers),
        combine=body.get("combine", "none"),
        weights=tuple(float(w) for w in weights) if weights is not None else None,
        gamma=float(body.get("gamma", 1.0)),
        normalize=bool(body.get("normalize", False)),
        post=_post_from(body.get("post")),
    )


def _post_from(raw: str | dict[str, Any] | None) -> PostSpec | None:
    if raw is None:
        return None
    body: dict[str, Any] = {"method": raw} if isinstance(raw, str) else dict(raw)
    return PostSpec(method=body["method"], dims=body.get("dims"), d=int(body.get("d", 1)),
                    normalize=bool(body.get("normalize", False)))


def _check_consistency(job: Job) -> None:
    """Rules that span keys, which the schema cannot say."""
    for v in job.views:
        key = f"views.{v.name}"
        n = None if v.layers == "all" else len(v.layers)
        if v.combine == "none" and n != 1:
            raise JobError(f"{key}.combine: several layers need a combine (mean, sum, concat, "
                           "weighted, scalar_mix)")
        if v.combine in ("weighted", "scalar_mix"):
            if v.weights is None:
                raise JobError(f"{key}.weights: combine {v.combine} needs one weight per layer")
            if n is not None and len(v.weights) != n:
                raise JobError(f"{key}.weights: {len(v.weights)} weights for {n} layers")
        elif v.weights is not None:
            raise JobError(f"{key}.weights: only used with combine weighted or scalar_mix")
        if v.pooling == "pooler" and (v.layers != (-1,) or v.combine != "none"):
            raise JobError(f"{key}.layers: the pooler is defined on the last layer only; "
                           "drop layers/combine for pooling: pooler")
    if "://" in job.output.path:
        raise JobError("output.path: object-store URLs are not supported; use a local or "
                       "shared-filesystem path that every worker can reach")
    c = job.chunking
    budget = c.max_tokens or job.model.max_tokens
    if c.overlap and c.overlap >= budget // 2:
        raise JobError(f"chunking.overlap: {c.overlap} must be under half of the chunk budget "
                       f"({budget} tokens)")
    if c.overlap and c.strategy != "hierarchical":
        raise JobError("chunking.overlap: only used with strategy hierarchical")


def _absolute(path: str, base: Path) -> str:
    if "://" in path:  # fsspec URL: leave as is
        return path
    return str((base / Path(path).expanduser()).resolve())


def _model_path(path: str, base: Path) -> str:
    """Local directories become absolute; anything else is a hub id for the offline cache."""
    candidate = base / Path(path).expanduser()
    if candidate.exists() or path.startswith((".", "/", "~")) or path.count("/") > 1:
        return str(candidate.resolve())
    return path


def _without_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _without_none(v) for k, v in obj.items() if v is not None}
    return obj


def _lists_for_tuples(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _lists_for_tuples(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_lists_for_tuples(v) for v in obj]
    return obj
