"""Store formats behind one protocol (`StoreFormat`), the staging area that workers write
into, the typed provenance, and opening a finished store (`open_store`).

The formats (and zarr, xarray and dask with them) are imported on first use: a module
that needs only `stores.lock` (or `io.location`) does not pay for them.
"""

from __future__ import annotations

from functools import cache
from importlib import import_module
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..io.location import resolve

if TYPE_CHECKING:
    from .base import Layout, StoreFormat
    from .staging import Staging


# Every store format: its `output.format` name, the module and the class that implement it,
# in the order a store is recognised. A format is one module here plus its rows in the
# reader-contract table (docs/architecture.md, "A store format").
REGISTRY: dict[str, tuple[str, str]] = {
    "zarr": ("zarr_store", "ZarrFormat"),
    "parquet": ("parquet_store", "ParquetFormat"),
    "icechunk": ("icechunk_store", "IcechunkFormat"),
    "delta": ("delta_store", "DeltaFormat"),
}


@cache
def format_named(name: str) -> type[StoreFormat]:
    """The format class of `name`, its module imported now (a format imports its own
    libraries: a command that needs one format pays for that one)."""
    try:
        module, cls = REGISTRY[name]
    except KeyError:
        raise StoreError(f"output.format: unknown {name!r}; valid: "
                         f"{', '.join(REGISTRY)}") from None
    found: type[StoreFormat] = getattr(import_module(f"{__name__}.{module}"), cls)
    return found


def formats() -> dict[str, type[StoreFormat]]:
    """Every store format by its `output.format` name, in the order they are recognised."""
    return {name: format_named(name) for name in REGISTRY}


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
