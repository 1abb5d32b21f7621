"""bertpipe: batch feature extraction from BERT-family encoders."""

from __future__ import annotations

from .api import Store, open_store  # noqa: E402
from .version import __version__

__all__ = ["Store", "__version__", "open_store"]
