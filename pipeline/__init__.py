"""bertpipe: batch feature extraction from BERT-family encoders.

`open_store` and `Store` are imported on first use (PEP 562): importing the package, or
running `bertpipe --help`, does not load torch, xarray, dask or zarr.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:
    from .api import Store, open_store

__all__ = ["Store", "__version__", "open_store"]


def __getattr__(name: str) -> Any:
    if name in ("Store", "open_store"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
