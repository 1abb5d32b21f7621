"""Store formats behind one interface: create, is_store, read_provenance, commit,
open_datasets. The runner and the notebook API pick a module from `FORMATS`."""

from __future__ import annotations

from types import ModuleType

from ..errors import StoreError
from . import parquet_store, zarr_store
from .base import Layout
from .staging import Staging

FORMATS: dict[str, ModuleType] = {"zarr": zarr_store, "parquet": parquet_store}


def format_module(name: str) -> ModuleType:
    try:
        return FORMATS[name]
    except KeyError:
        raise StoreError(f"output.format: unknown {name!r}; valid: {', '.join(FORMATS)}") from None


def detect_format(path: str) -> ModuleType:
    for module in FORMATS.values():
        if module.is_store(path):
            return module
    raise StoreError(f"{path}: not a bertpipe store (no zarr.json or docs.parquet)")


__all__ = ["FORMATS", "Layout", "Staging", "detect_format", "format_module"]
