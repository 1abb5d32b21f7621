"""bertpipe: batch feature extraction from BERT-family encoders."""

from __future__ import annotations

__version__ = "0.1.0"

from .load import Store, open_store  # noqa: E402

__all__ = ["Store", "__version__", "open_store"]
