"""Everything a job can be checked for before any work, without loading weights or reading
texts: the model's config, tokenizer and weight files, the views against them (layer
indices, widths, post-processing dims, the pooler), the device and runtime, the chunk
budget, the input's Parquet footers, and its id column (every id names one row).

`bertpipe validate`, `bertpipe extract --dry-run` and every run call `preflight` before a
store is created, so a job that cannot work is refused with nothing written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import InputError, JobError, ModelError, StoreError
from ..io.location import is_url, references, resolve, storage_errors
from ..spec import Job
from .chunking import Specials, content_budget
from .modelfiles import (
    check_weights,
    has_pooler_weights,
    load_config,
    load_tokenizer,
    max_positions_of,
    model_shape,
)
from .runtime_choice import check_runtime
from .source import (
    InputScan,
    Partition,
    check_unique_ids,
    counted,
    plan_partitions,
    scan_input,
)
from .viewshapes import ViewShape, view_shapes


@dataclass(frozen=True)
class Plan:
    """A checked job: what the model is, what each view gives, and the partitions."""

    job: Job
    model_type: str
    n_layers: int
    hidden: int
    max_positions: int
    budget: int  # content tokens per chunk, special tokens excluded
    widths: dict[str, int]  # view -> stored width
    scan: InputScan
    partitions: list[Partition]

    def summary(self) -> str:
        """One line: what was checked."""
        return (f"model {self.model_type} ({self.n_layers} layers, hidden {self.hidden}); "
                f"input {counted(len(self.scan.files), 'file')}, {self.scan.rows} rows, "
                f"{counted(len(self.partitions), 'partition')}")

    def describe(self) -> str:
        """The plan in full, for `extract --dry-run`."""
        job = self.job
        lines = [
            f"model      {job.model.path} ({self.model_type}, {self.n_layers} layers, hidden "
            f"{self.hidden}, {self.max_positions} positions)",
            f"chunking   {job.chunking.strategy}, {self.budget} content tokens per chunk"
            + (f", overlap {job.chunking.overlap}" if job.chunking.overlap else ""),
            "views      " + ", ".join(f"{name} ({width})" for name, width in self.widths.items()),
            f"input      {counted(len(self.scan.files), 'file')}, {self.scan.rows} rows",
        ]
        lines += [f"  {f.path}  {f.rows} rows" for f in self.scan.files]
        lines.append(f"partitions {len(self.partitions)} of at most "
                     f"{job.execution.partition_rows} rows")
        exists = _output_exists(job.output.path)
        state = "exists" if exists else "does not exist yet"
        lines.append(f"output     {job.output.format} {job.output.path} ({state}), levels "
                     f"{', '.join(job.output.levels)}, {job.output.dtype}")
        if job.output.incremental and exists:
            lines.append("mode       incremental: rows with new ids or changed texts are "
                         "encoded into the existing store")
        elif job.output.incremental:  # the incremental run hands a missing store to a full run
            lines.append("mode       full: no store yet, so every row is encoded; later "
                         "incremental runs encode only new ids and changed texts")
        return "\n".join(lines)


def _output_exists(path: str) -> bool:
    if is_url(path):
        with storage_errors(path, "output.path", StoreError):
            return resolve(path).exists()
    return os.path.lexists(path)


def preflight(job: Job) -> Plan:
    """Check `job` against its model (config and tokenizer only) and its input (Parquet
    metadata only); the plan of partitions, or a JobError/ModelError/InputError."""
    config = load_config(job.model)
    n_layers, hidden = model_shape(config)
    views = view_shapes(job.views, n_layers, hidden)
    _check_post(views)
    _check_pooler(job, config.model_type)
    check_weights(job.model)
    # the model runs here on the synchronous and local schedulers; a remote cluster's
    # workers have their own devices and runtimes (checked where they load it)
    check_runtime(job.model, config, here=model_runs_here(job))
    tokenizer = load_tokenizer(job.model)
    try:
        specials = Specials.from_tokenizer(tokenizer)
    except ValueError as exc:
        raise ModelError(f"model.path: {job.model.path!r}: {exc}") from None
    positions = max_positions_of(config, tokenizer)
    budget = content_budget(job.chunking, job.model.max_tokens, positions, specials)
    for section, options in (("input", job.input.storage_options),
                             ("output", job.output.storage_options)):
        missing = references(options or {}, f"{section}.storage_options")
        if missing:  # `${NAME}` must be set here (and on every worker)
            raise JobError(missing[0])
    scan = scan_input(job.input)
    partitions = plan_partitions(job.input, job.execution.partition_rows, scan)
    if not partitions:
        raise InputError(f"input.path: {job.input.path} has no rows")
    check_unique_ids(job.input, scan, job.output.incremental)
    return Plan(job, config.model_type, n_layers, hidden, positions,
                budget, {v.name: v.width for v in views}, scan, partitions)


def model_runs_here(job: Job) -> bool:
    """The model runs in this process's machine (the synchronous and local schedulers); a
    remote cluster's workers have their own devices and runtimes."""
    return job.execution.scheduler in ("synchronous", "local")


def _check_post(views: list[ViewShape]) -> None:
    """Post-processing sizes against the view's width (known from the config)."""
    for view in views:
        post = view.spec.post
        if post is None:
            continue
        key = f"views.{view.name}.post"
        if post.dims is not None and post.dims > view.width:
            raise JobError(f"{key}.dims: {post.dims} is more than the view's width "
                           f"{view.width}")
        if post.method == "abtt" and post.d >= view.width:
            raise JobError(f"{key}.d: removing {post.d} directions of a view of width "
                           f"{view.width} leaves nothing; use fewer than {view.width}")


def _check_pooler(job: Job, model_type: str) -> None:
    """`pooling: pooler` needs trained pooler weights: told from the weight file headers."""
    users = [v.name for v in job.views if v.pooling == "pooler"]
    if not users:
        return
    if has_pooler_weights(job.model.path) is False:
        raise ModelError(f"pooling pooler: model {job.model.path!r} ({model_type}) has no "
                         f"trained pooler weights (views {', '.join(users)}); use cls or mean "
                         "instead")
