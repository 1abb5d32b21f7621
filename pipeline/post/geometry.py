"""Vector geometry: anisotropy diagnostics and post-processing fitted on a corpus.

Raw BERT vectors crowd into a narrow cone. The fixes, all fitted on the store's own rows
(float64 statistics, streamed in blocks so memory stays bounded):

    center   x' = x - μ
    whiten   x' = (x - μ) W,  W = U Λ^{-1/2} (first `dims` columns)   with Σ = U Λ Uᵀ
    abtt     x' = (x - μ)(I - U_d U_dᵀ)   all-but-the-top: drop the top `d` directions

each optionally followed by L2 normalisation. A fitted `PostTransform` is stored beside
its view so the same transform applies to queries and to other stores.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError, JobError

METHODS = ("center", "whiten", "abtt")
BLOCK_ROWS = 65536


@dataclass(frozen=True)
class PostTransform:
    method: str
    mean: np.ndarray  # (D,)
    matrix: np.ndarray | None  # (D, K), None for center
    normalize: bool = False

    def apply(self, x: np.ndarray) -> np.ndarray:
        out = x.astype(np.float64) - self.mean
        if self.matrix is not None:
            out = out @ self.matrix
        if self.normalize:
            out = unit_rows(out)
        return out.astype(np.float32)

    @property
    def width(self) -> int:
        return len(self.mean) if self.matrix is None else self.matrix.shape[1]


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1; zero rows stay zero, NaN rows (empty documents) stay NaN."""
    return x / np.linalg.norm(x, axis=1, keepdims=True).clip(min=1e-12)


def blocks(array: Any, rows: int = BLOCK_ROWS) -> Iterator[np.ndarray]:
    """Row blocks of an (N, D) array-like (xarray/dask/zarr/numpy) as float64, NaN rows
    (empty documents) dropped."""
    n = array.shape[0]
    for start in range(0, n, rows):
        block = np.asarray(array[start : start + rows], dtype=np.float64)
        yield block[np.isfinite(block).all(axis=1)]


def moments(array: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """Mean and covariance over all finite rows, in one streamed pass."""
    total = None
    outer = None
    n = 0
    for block in blocks(array):
        if total is None:
            total = np.zeros(block.shape[1])
            outer = np.zeros((block.shape[1], block.shape[1]))
        total += block.sum(0)
        outer += block.T @ block
        n += len(block)
    if not n or total is None or outer is None:
        raise InputError("post: no finite rows to fit on (every document of the view is "
                         "empty)")
    mean = total / n
    cov = outer / n - np.outer(mean, mean)
    return mean, cov, n


def fit(array: Any, method: str, dims: int | None = None, d: int = 1,
        normalize: bool = False) -> PostTransform:
    if method not in METHODS:
        raise JobError(f"post: unknown method {method!r}; valid: {', '.join(METHODS)}")
    mean, cov, _ = moments(array)
    if method == "center":
        return PostTransform(method, mean, None, normalize)
    eigval, eigvec = np.linalg.eigh(cov)  # ascending
    order = np.argsort(eigval)[::-1]
    eigval, eigvec = eigval[order], eigvec[:, order]
    if method == "whiten":
        k = dims or len(mean)
        if not 0 < k <= len(mean):
            raise JobError(f"post dims: {k} must be between 1 and the view width {len(mean)}")
        # directions with (numerically) zero variance cannot be whitened; keep them at 0
        scale = np.where(eigval[:k] > 1e-12 * eigval[0], eigval[:k], np.inf) ** -0.5
        return PostTransform(method, mean, eigvec[:, :k] * scale, normalize)
    top = eigvec[:, :d]
    return PostTransform(method, mean, np.eye(len(mean)) - top @ top.T, normalize)


def stats(x: np.ndarray, pairs: int = 2000, seed: int = 0) -> dict[str, float]:
    """Mean cosine of random distinct pairs, top-PC variance share, mean norm."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x).all(axis=1)]
    rng = np.random.default_rng(seed)
    n = len(x)
    i = rng.integers(0, n, pairs)
    j = (i + rng.integers(1, n, pairs)) % n  # j != i
    norms = np.linalg.norm(x, axis=1)
    cos = (x[i] * x[j]).sum(1) / (norms[i] * norms[j]).clip(min=1e-12)
    centered = x - x.mean(0)
    sv = np.linalg.svd(centered, compute_uv=False)
    var = sv**2
    return {"mean_cosine": float(cos.mean()), "top_pc_share": float(var[0] / var.sum()),
            "mean_norm": float(norms.mean()), "pairs": pairs, "rows": n}
