"""Fitting a geometry fix on a store's view and writing the result as a view of the store.

The fitted parameters (mean, matrix) are stored beside the view (`post/<view>` in Zarr,
`post/<view>.npz` in Parquet) and described in the provenance under `post`, so queries
and other stores get exactly the same transform.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ..api import Store, open_store
from ..errors import StoreError
from ..stores import detect_format
from .geometry import PostTransform, fit


def postprocess(store_path: str, view: str, method: str, dims: int | None = None,
                d: int = 1, normalize: bool = False, name: str | None = None,
                replace: bool = False) -> str:
    """Fit `method` on the documents of `view`, write the new view at every stored level.

    Returns the new view's name. With `replace`, the view is transformed in place (used by
    the job-file `post` key before the store is marked complete).
    """
    store = open_store(store_path, require_complete=not replace)
    if view not in store.views:
        raise StoreError(f"--view: {view!r} is not a view of {store_path}; views: "
                         f"{', '.join(store.views)}")
    target = view if replace else (name or f"{view}_{method}")
    if not replace and target in store.views:
        raise StoreError(f"--name: {target!r} already exists in {store_path}")
    transform = fit(store.docs[view].data, method, dims=dims, d=d, normalize=normalize)
    module = detect_format(store_path)
    levels = ["docs"] + (["chunks"] if store.chunks is not None else [])
    module.write_params(store_path, target, _params(transform))
    module.add_view(store_path, view, target, transform.apply, levels)
    provenance = copy.deepcopy(store.provenance)
    provenance.setdefault("post", {})[target] = {
        "source": view, "method": method, "dims": dims, "d": d, "normalize": normalize,
        "width": transform.width,
        "fitted_rows": int((np.asarray(store.docs["status"].values) == "ok").sum()),
    }
    module.update_provenance(store_path, provenance)
    return target


def load_transform(store: Store, view: str) -> PostTransform | None:
    """The fitted transform of a post-processed view (None for a plain view)."""
    info = store.provenance.get("post", {}).get(view)
    if info is None:
        return None
    params = detect_format(store.path).read_params(store.path, view)
    matrix = params.get("matrix")
    return PostTransform(info["method"], params["mean"], matrix, bool(info["normalize"]))


def source_view(store: Store, view: str) -> str:
    """The extracted view a (possibly post-processed) view derives from."""
    info: dict[str, Any] | None = store.provenance.get("post", {}).get(view)
    return str(info["source"]) if info else view


def _params(transform: PostTransform) -> dict[str, np.ndarray]:
    params = {"mean": transform.mean}
    if transform.matrix is not None:
        params["matrix"] = transform.matrix
    return params
