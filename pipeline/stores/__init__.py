"""Store formats behind one protocol (`StoreFormat`), the staging area that workers write
into, the typed provenance, and opening a finished store (`open_store`).

The formats (and zarr, xarray and dask with them) are imported on first use: a module
that needs only `stores.lock` (or `io.location`) does not pay for them.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..io.location import resolve

if TYPE_CHECKING:
    from .base import Layout, StoreFormat
    from .staging import Staging


@cache
def formats() -> dict[str, type[StoreFormat]]:
    """Every store format by its `output.format` name."""
    from .delta_store import DeltaFormat
    from .icechunk_store import IcechunkFormat
    from .parquet_store import ParquetFormat
    from .zarr_store import ZarrFormat

    return {"zarr": ZarrFormat, "parquet": ParquetFormat, "icechunk": IcechunkFormat,
            "delta": DeltaFormat}


def format_named(name: str) -> type[StoreFormat]:
    try:
        return formats()[name]
    except KeyError:
        raise StoreError(f"output.format: unknown {name!r}; valid: "
                         f"{', '.join(formats())}") from None


def store_at(path: str, name: str) -> StoreFormat:
    """A handle on the store (or the place for one) at `path` in format `name`."""
    return format_named(name)(path)


def detect_format(path: str) -> StoreFormat:
    """A handle on the store at `path`, in the format it is written in."""
    for fmt in formats().values():
        if fmt.holds_store(path):
            return fmt(path)
    from .staging import STAGING_DIR

    root = resolve(path)
    if root.child(STAGING_DIR).child("run.json").exists():  # a first commit was cut short
        raise StoreError(f"{path}: store is incomplete (its job has not finished; rerun it "
                         "to resume)")
    if root.child("chunks").is_dir():
        raise StoreError(f"{path}: docs/part-0.parquet is missing (chunks/ is there): a "
                         "damaged Parquet store")
    raise StoreError(f"{path}: not a bertpipe store (no zarr.json, docs/part-0.parquet, "
                     "Icechunk repository or Delta table docs/_delta_log)")


def __getattr__(name: str) -> Any:
    if name == "FORMATS":
        return formats()
    if name in ("Layout", "StoreFormat"):
        from . import base

        return getattr(base, name)
    if name == "Staging":
        from .staging import Staging

        return Staging
    raise AttributeError(f"module 'pipeline.stores' has no attribute {name!r}")


__all__ = ["FORMATS", "Layout", "Staging", "StoreFormat", "detect_format", "format_named",
           "formats", "store_at"]
