"""The job: YAML in, validated against `schemas/job.schema.json`, frozen dataclasses out.

Everything downstream takes a `Job`; nothing downstream reads YAML or dicts. A job is
resolved once (defaults filled, paths made absolute) so that the same object means the
same thing on every Dask worker and in the store's provenance.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .errors import JobError
from .io.location import is_url, local_path, redacted_options

# The schemas ship inside the package (an installed wheel has no source tree); the
# top-level schemas/ is their source, and a test keeps the two copies identical.
SCHEMA_DIR = resources.files("pipeline") / "schemas"
JOB_SCHEMA_PATH = SCHEMA_DIR / "job.schema.json"

LayerSelection = tuple[int, ...] | str  # explicit indices, or "all"

# Names a user gives (views, post-processed views, carried columns) become array names,
# Parquet columns and file names: letters, digits and _ only, so never a path component.
NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
NAME_RULE = "use letters, digits and _, starting with a letter or _, at most 64 characters"
# What the stores write themselves (arrays, columns, dimensions, folders); compared without
# case, because a case-insensitive filesystem would put `Status` and `status` in one folder.
STORE_FIELDS = frozenset({
    "id", "ids", "row", "doc", "docs", "chunk", "chunks", "seq", "start", "end", "n_tokens",
    "n_chunks", "truncated", "status", "post", "index", "_bertpipe", "text_sha256", "present",
    "versions",  # incremental runs: text digests, rows gone from the input, store versions
    "n_unk", "n_words", "n_fragmented",  # vocabulary fit, per row
    # the token level (views with pooling: tokens)
    "tokens", "token", "token_id", "token_offset", "token_count", "position", "piece",
})
TOKEN_POOLING = "tokens"  # a view that keeps one vector per token instead of pooling
DIM_SUFFIX = "_dim"  # a view's second dimension is `<view>_dim`


@dataclass(frozen=True)
class InputSpec:
    path: str
    text_column: str
    id_column: str | None = None
    carry_columns: tuple[str, ...] = ()
    # every id names one row (checked before a run); false lets ids repeat, and a lookup by
    # an id that names several rows is then refused as ambiguous
    unique_ids: bool = True
    # fsspec options for a URL path; a string value `${NAME}` is read from the environment
    # where the file is opened (client or worker). Never written down (see `to_dict`).
    storage_options: dict[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ModelSpec:
    path: str
    dtype: str = "auto"
    device: str = "auto"
    runtime: str = "auto"  # auto | torch | openvino (pipeline/extract/runtime.py)
    max_tokens: int | None = None  # None: the model's own limit
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

    @property
    def per_token(self) -> bool:
        """A token view: one vector per word piece, stored in the tokens level only."""
        return self.pooling == TOKEN_POOLING


@dataclass(frozen=True)
class OutputSpec:
    path: str
    format: str = "zarr"
    dtype: str = "float32"
    overwrite: bool = False
    levels: tuple[str, ...] = ("docs", "chunks")
    incremental: bool = False  # encode only new and changed rows into the existing store
    storage_options: dict[str, Any] | None = field(default=None, compare=False)


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
        """The job as a plain dict in the job-file shape (views keyed by name). It is what
        provenance and the staging area record, so storage options keep only what is no
        secret: `${NAME}` references, numbers and booleans; other strings become `***`."""
        raw = asdict(self)
        raw["views"] = {v.pop("name"): _without_none(v) for v in raw["views"]}
        for section in ("input", "output"):
            options = raw[section].pop("storage_options")
            if options:
                raw[section]["storage_options"] = redacted_options(options)
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
        for key in ("overwrite", "path", "incremental"):
            content["output"].pop(key)
        # how the files are reached (credentials, endpoints), not what they hold; whether
        # ids may repeat is a check on the input, not part of what is computed (and stores
        # written before the key existed keep their fingerprint)
        content["input"].pop("storage_options", None)
        content["input"].pop("unique_ids", None)
        content["output"].pop("storage_options", None)
        blob = json.dumps(content, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def vector_parts(self) -> dict[str, Any]:
        """What defines a stored row's vectors and fields, by job key: an incremental run
        may add to a store only when these are unchanged. Not here: where the input is
        (`input.path`, a new snapshot of a table may have a new name), carried columns
        (read from the input for every row), batching (moves values by ~5e-7 only, as any
        batch composition does) and where or how the run executes. `model.path` is left
        to the weights' digests, compared beside this."""
        raw = self.to_dict()
        model = {k: v for k, v in raw["model"].items() if k != "path"}
        parts: dict[str, Any] = {
            "input.text_column": raw["input"]["text_column"],
            "input.id_column": raw["input"].get("id_column"),
            "views": raw["views"],
            "chunking": raw["chunking"],
            "output.format": raw["output"]["format"],
            "output.dtype": raw["output"]["dtype"],
            "output.levels": raw["output"]["levels"],
        }
        parts.update({f"model.{k}": v for k, v in model.items()})
        return parts

    @property
    def token_views(self) -> tuple[ViewSpec, ...]:
        """Views with pooling: tokens (their vectors go to the tokens level only)."""
        return tuple(v for v in self.views if v.per_token)

    def view(self, name: str) -> ViewSpec:
        for v in self.views:
            if v.name == name:
                return v
        raise JobError(f"views: no view named {name!r}; views are {[v.name for v in self.views]}")


def load_job(path: str | Path, overrides: tuple[str, ...] = ()) -> Job:
    """Read a YAML job file, apply `key.sub=value` overrides, validate, resolve."""
    path = Path(path)
    if path.is_dir():
        raise JobError(f"{path}: is a directory, not a job file")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise JobError(f"{path}: cannot read job file ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise JobError(f"{path}: not a text file (byte {exc.start} is not UTF-8); a job file "
                       "is YAML text") from None
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise JobError(f"{path}: malformed YAML{_yaml_problem(exc)}") from None
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
        node[parts[-1]] = parse_yaml(value)
    except yaml.YAMLError as exc:
        raise JobError(f"--set {key}: value {value!r} is not valid YAML"
                       f"{_yaml_problem(exc)}") from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, list | dict):
                continue  # unhashable keys: the schema refuses them with their path
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]})",
                    key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str) -> Any:
    """YAML as the job loader reads it: safe types only, duplicate keys refused."""
    return yaml.load(text, Loader=_StrictLoader)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or "invalid YAML"
    return f"{where}: {problem}"


def _is_integer(checker: Any, instance: Any) -> bool:
    """An integer is an int: JSON Schema also counts 8.0 and 1e30 as integers, which then
    reach `range()` and array sizes as floats."""
    return isinstance(instance, int) and not isinstance(instance, bool)


# Draft 2020-12, with integers that are ints (see `_is_integer`)
JobValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer))
# The largest integer a job may hold: what NumPy, Arrow and the store's JSON readers take.
INT_MAX = 2**63 - 1


def validate_job_dict(raw: dict[str, Any]) -> None:
    """Schema validation; the first error becomes one line naming the key path."""
    validator = JobValidator(job_schema())
    errors = sorted(validator.iter_errors(raw), key=lambda e: (len(e.path), list(e.path)))
    if errors:
        err = errors[0]
        key = ".".join(str(p) for p in err.path) or "(top level)"
        raise JobError(f"{key}: {_short_message(err)}")
    huge = _first_huge_integer(raw)
    if huge is not None:
        key, value = huge
        raise JobError(f"{key}: {value} is out of range (at most {INT_MAX})")


def _first_huge_integer(node: Any, key: str = "") -> tuple[str, int] | None:
    """The first integer beyond INT_MAX (either sign) and its key path, if any."""
    items = node.items() if isinstance(node, dict) else \
        enumerate(node) if isinstance(node, list) else ()
    for name, value in items:
        where = f"{key}.{name}" if key else str(name)
        if _is_integer(None, value) and abs(value) > INT_MAX:
            return where, value
        found = _first_huge_integer(value, where)
        if found is not None:
            return found
    return None


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
    if err.validator == "pattern" and isinstance(err.instance, str):
        return f"{err.instance!r} is not a valid name: {NAME_RULE}"
    if err.validator in ("minimum", "maximum") and isinstance(err.instance, float) \
            and not math.isfinite(err.instance):
        return f"{err.instance!r} is not a finite number"
    if err.validator == "type" and "integer" in _types(err.validator_value) \
            and isinstance(err.instance, float):
        whole = math.isfinite(err.instance) and err.instance.is_integer() \
            and abs(err.instance) < 2**53
        hint = f" (write {int(err.instance)}, without a decimal point)" if whole else ""
        return f"{err.instance!r} is not an integer{hint}"
    return err.message


def _types(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _view_from_dict(name: str, body: dict[str, Any]) -> ViewSpec:
    layers = body.get("layers", [-1])
    if isinstance(layers, int):
        layers = [layers]
    weights = body.get("weights")
    # (a value equal to the default is what `to_dict` writes back, so it is not refused)
    if body.get("gamma", 1.0) != 1.0 and body.get("combine") != "scalar_mix":
        raise JobError(f"views.{name}.gamma: only used with combine scalar_mix")
    return ViewSpec(
        name=name,
        pooling=body["pooling"],
        layers="all" if layers == "all" else tuple(layers),
        combine=body.get("combine", "none"),
        weights=tuple(float(w) for w in weights) if weights is not None else None,
        gamma=float(body.get("gamma", 1.0)),
        normalize=bool(body.get("normalize", False)),
        post=_post_from(body.get("post"), f"views.{name}.post"),
    )


def _post_from(raw: str | dict[str, Any] | None, key: str) -> PostSpec | None:
    if raw is None:
        return None
    body: dict[str, Any] = {"method": raw} if isinstance(raw, str) else dict(raw)
    if body.get("dims") is not None and body["method"] != "whiten":
        raise JobError(f"{key}.dims: only used with method whiten")
    if body.get("d", 1) != 1 and body["method"] != "abtt":
        raise JobError(f"{key}.d: only used with method abtt")
    return PostSpec(method=body["method"], dims=body.get("dims"), d=int(body.get("d", 1)),
                    normalize=bool(body.get("normalize", False)))


def check_name(name: str, key: str) -> None:
    """A user-given name is safe as an array, column and file name."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise JobError(f"{key}: {name!r} is not a valid name: {NAME_RULE}")
    if name.endswith(DIM_SUFFIX):
        raise JobError(f"{key}: {name!r} ends in {DIM_SUFFIX!r}, which the store uses for a "
                       "view's second dimension; choose another name")


def check_new_name(name: str, key: str, taken: dict[str, str]) -> None:
    """`name` is safe and shadows neither a store field nor a name in `taken` (name -> what
    it is), compared without case."""
    check_name(name, key)
    folded = name.casefold()
    if folded in STORE_FIELDS:
        raise JobError(f"{key}: {name!r} is a field the store writes itself "
                       f"({', '.join(sorted(STORE_FIELDS))}); choose another name")
    for other, what in taken.items():
        if other.casefold() == folded:
            raise JobError(f"{key}: {name!r} collides with {what} {other!r}; names must differ "
                           "(case is ignored)")


def job_names(job: Job) -> dict[str, str]:
    """The names a job's store holds beside its own fields: name -> what it is."""
    names = {c: "carried column" for c in job.input.carry_columns}
    names.update({v.name: "view" for v in job.views})
    if job.input.text_column not in names:
        names[job.input.text_column] = "input.text_column (search shows it)"
    return names


def _check_names(job: Job) -> None:
    taken: dict[str, str] = {}
    if job.input.text_column not in job.input.carry_columns:
        taken[job.input.text_column] = "input.text_column (search shows it)"
    for i, column in enumerate(job.input.carry_columns):
        check_new_name(column, f"input.carry_columns.{i}", taken)
        taken[column] = "carried column"
    for view in job.views:
        check_new_name(view.name, f"views.{view.name}", taken)
        taken[view.name] = "view"


def _check_consistency(job: Job) -> None:
    """Rules that span keys, which the schema cannot say."""
    _check_names(job)
    for v in job.views:
        key = f"views.{v.name}"
        n = None if v.layers == "all" else len(v.layers)
        if v.weights is not None and not all(math.isfinite(w) for w in v.weights):
            raise JobError(f"{key}.weights: {list(v.weights)} must be finite numbers "
                           "(no NaN or infinity)")
        if not math.isfinite(v.gamma):
            raise JobError(f"{key}.gamma: {v.gamma} must be a finite number")
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
        if v.pooling == TOKEN_POOLING and v.post is not None:
            raise JobError(f"{key}.post: post-processing is fitted on document vectors and a "
                           "pooling: tokens view stores token vectors only; drop post")
    check_incremental(job)
    _check_scheduler(job.execution.scheduler)
    if not job.input.unique_ids and not job.input.id_column:
        raise JobError("input.unique_ids: only used with input.id_column (row numbers are "
                       "unique)")
    for section, spec in (("input", job.input), ("output", job.output)):
        if spec.storage_options and not is_url(spec.path):
            raise JobError(f"{section}.storage_options: only used with a URL {section}.path "
                           "(s3://, gs://, abfs://, ...)")
    c = job.chunking
    budget = c.max_tokens or job.model.max_tokens  # None: the model's limit, checked at load
    if c.overlap and budget and c.overlap >= budget // 2:
        raise JobError(f"chunking.overlap: {c.overlap} must be under half of the chunk budget "
                       f"({budget} tokens)")
    if c.overlap and c.strategy != "hierarchical":
        raise JobError("chunking.overlap: only used with strategy hierarchical")


# Dask's comm schemes; those that reach a host by TCP need host:port.
SCHEDULER_SCHEMES = {"tcp": True, "tls": True, "ws": True, "wss": True, "ucx": False,
                     "inproc": False}
SCHEDULER_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def _check_scheduler(value: str) -> None:
    """`local`, `synchronous` or a Dask address (`tcp://host:8786`): checked on load, so that
    `validate` refuses what the run would refuse."""
    if value in ("local", "synchronous"):
        return
    why = f"execution.scheduler: {value!r} is not local, synchronous or a scheduler address " \
          "like tcp://host:8786"
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in SCHEDULER_SCHEMES or not rest:
        raise JobError(why)
    if SCHEDULER_SCHEMES[scheme]:
        found = SCHEDULER_HOST_PORT.match(rest.rstrip("/"))
        if found is None:
            raise JobError(f"{why} (host:port after {scheme}://)")
        if not 0 < int(found.group(2)) < 65536:
            raise JobError(f"execution.scheduler: port {found.group(2)} of {value!r} is out "
                           "of range (1-65535)")


def check_incremental(job: Job) -> None:
    """What an incremental run needs of the job (checked on load, so `validate` says so)."""
    if not job.output.incremental:
        return
    if not job.input.id_column:
        raise JobError("output.incremental: needs input.id_column (rows are matched to the "
                       "store by id)")
    if not job.input.unique_ids:
        raise JobError("output.incremental: needs unique ids (rows are matched to the store "
                       "by id), but input.unique_ids is false")
    if job.output.overwrite:
        raise JobError("output.incremental: an incremental run adds to the store, "
                       "output.overwrite replaces it; choose one")
    if job.token_views:
        raise JobError(f"output.incremental: views.{job.token_views[0].name} has pooling: "
                       "tokens, which incremental runs do not support; drop the token view "
                       "or run the job in full (--overwrite)")


def _absolute(path: str, base: Path) -> str:
    if is_url(path):  # fsspec URL: leave as is
        return path
    return str((base / Path(local_path(path)).expanduser()).resolve())


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
