"""Fitting a geometry fix on a store's view and writing the result as a view of the store.

The fitted parameters (mean, matrix) are stored beside the view (`post/<view>` in Zarr,
`post/<view>.npz` in Parquet) and described in the provenance under `post`, so queries
and other stores get exactly the same transform. The commit step of a run calls
`fit_view` directly on the store it is writing; `postprocess` is the same on a finished
store (`bertpipe postprocess`).
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from ..errors import JobError, OptionError, StoreError
from ..spec import PostSpec, check_new_name, job_names
from ..stores.base import StoreFormat
from ..stores.opened import StoreData, open_store_data, superseded_in
from ..stores.provenance import PostInfo, Provenance
from ..stores.verify import summarize, verify_store
from .geometry import PostTransform, fit


def fit_view(fmt: StoreFormat, docs: xr.Dataset, has_chunks: bool,
             provenance: Provenance, source: str, target: str, spec: PostSpec) -> Provenance:
    """Fit `spec` on the documents of view `source` (not the rows an edit superseded:
    their texts are no longer the input's), write view `target` at every stored level with
    its parameters; returns the provenance that records it (not yet written)."""
    superseded = superseded_in(docs)
    fitted = docs[source] if not superseded.any() else \
        docs[source].isel(doc=np.flatnonzero(~superseded))
    transform = fit(fitted.data, spec.method, dims=spec.dims, d=spec.d,
                    normalize=spec.normalize)
    levels = ["docs"] + (["chunks"] if has_chunks else [])
    fmt.write_params(target, _params(transform))
    fmt.add_view(source, target, transform.apply, levels)
    ok = (np.asarray(docs["status"].values) == "ok") & ~superseded
    info = PostInfo(source=source, method=spec.method, dims=spec.dims, d=spec.d,
                    normalize=spec.normalize, width=transform.width, fitted_rows=int(ok.sum()))
    return provenance.with_post(target, info)


def postprocess(store_path: str, view: str, spec: PostSpec, name: str | None = None) -> str:
    """Add view `name` (default VIEW_METHOD) = `spec` fitted on `view` to a complete store."""
    store = open_store_data(store_path)
    if view in store.token_views:
        raise StoreError(f"--view: {view!r} is a token view (pooling: tokens); geometry fixes "
                         "are fitted on document vectors")
    if view not in store.views:
        raise StoreError(f"--view: {view!r} is not a view of {store_path}; views: "
                         f"{', '.join(store.views)}")
    target = name if name is not None else f"{view}_{spec.method}"
    if target in store.views:
        raise StoreError(f"--name: {target!r} already exists in {store_path}")
    problems = verify_store(store_path)  # why: the new seal must never cover damaged files
    if problems:
        raise StoreError(f"{store_path}: fails verification, left unchanged: "
                         f"{summarize(problems)}")
    taken = {**job_names(store.provenance.job), **{v: "view" for v in store.views}}
    try:
        check_new_name(target, "--name", taken)
    except JobError as exc:
        raise OptionError(str(exc)) from None
    _check_sizes(spec, view, int(store.docs[view].shape[1]))
    provenance = fit_view(store.fmt, store.docs, store.chunks is not None,
                          store.provenance, view, target, spec)
    store.fmt.update_provenance(provenance)
    return target


def _check_sizes(spec: PostSpec, view: str, width: int) -> None:
    """Dimensions kept or removed must fit the view (checked before anything is written)."""
    if spec.dims is not None and not 1 <= spec.dims <= width:
        raise OptionError(f"--dims: {spec.dims} is out of range for view {view!r} of width "
                          f"{width} (1..{width})")
    if spec.method == "abtt" and not 1 <= spec.d < width:
        raise OptionError(f"-d: removing {spec.d} directions of view {view!r} of width {width} "
                          f"is out of range (1..{width - 1})")


def load_transform(store: StoreData, view: str) -> PostTransform | None:
    """The fitted transform of a post-processed view (None for a plain view)."""
    info = store.provenance.post.get(view)
    if info is None:
        return None
    params = store.fmt.read_params(view)
    return PostTransform(info.method, params["mean"], params.get("matrix"), info.normalize)


def _params(transform: PostTransform) -> dict[str, np.ndarray]:
    params = {"mean": transform.mean}
    if transform.matrix is not None:
        params["matrix"] = transform.matrix
    return params
