"""Store formats behind one protocol (`StoreFormat`), the staging area that workers write
into, the typed provenance, and opening a finished store (`open_store`)."""

from __future__ import annotations

from ..errors import StoreError
from .base import Layout, StoreFormat
from .fs import resolve
from .parquet_store import ParquetFormat
from .staging import Staging
from .zarr_store import ZarrFormat

FORMATS: dict[str, StoreFormat] = {"zarr": ZarrFormat(), "parquet": ParquetFormat()}


def format_named(name: str) -> StoreFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise StoreError(f"output.format: unknown {name!r}; valid: {', '.join(FORMATS)}") from None


def detect_format(path: str) -> StoreFormat:
    for fmt in FORMATS.values():
        if fmt.is_store(path):
            return fmt
    if resolve(path).child("chunks").is_dir():
        raise StoreError(f"{path}: docs/part-0.parquet is missing (chunks/ is there): a "
                         "damaged Parquet store")
    raise StoreError(f"{path}: not a bertpipe store (no zarr.json or docs/part-0.parquet)")


__all__ = ["FORMATS", "Layout", "Staging", "StoreFormat", "detect_format", "format_named"]
