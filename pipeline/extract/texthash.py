"""Telling texts apart without keeping them: a digest per text, and the distinct texts of a
batch (identical texts are encoded once and their results copied).

The digest is what an incremental run compares to decide whether a known id's text
changed, so it is stored with every row (`text_sha256`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

# A null text and an empty one give the same row (status empty, NaN vectors): one digest.
NULL_TEXT = ""


def text_sha256(texts: Sequence[str | None]) -> list[str]:
    """Hex SHA-256 of each text's UTF-8 bytes (a null text as the empty string)."""
    return [digest.hex() for digest in text_sha256_bytes(texts)]


def text_sha256_bytes(texts: Sequence[str | None]) -> list[bytes]:
    """SHA-256 of each text's UTF-8 bytes, 32 bytes each (half the memory of hex)."""
    return [hashlib.sha256((t if t is not None else NULL_TEXT).encode("utf-8",
                                                                      "surrogatepass"))
            .digest() for t in texts]


def unique_texts(texts: Sequence[str | None]) -> tuple[list[str | None], np.ndarray]:
    """The distinct texts in first-seen order, and for each text its index among them."""
    first: dict[str | None, int] = {}
    inverse = np.fromiter((first.setdefault(t, len(first)) for t in texts), np.int64,
                          len(texts))
    return list(first), inverse
