"""Post-processing fitted on a corpus, and search, against NumPy float64 oracles."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import pipeline
from pipeline.analysis.search import QueryEncoder, top_k
from pipeline.cli import main
from pipeline.errors import StoreError
from pipeline.post.apply import load_transform, postprocess
from pipeline.post.geometry import fit, stats
from pipeline.spec import PostSpec
from tests.conftest import job_dict, synthetic_store, write_job, write_table

RNG = np.random.default_rng(11)


def anisotropic(n: int = 500, d: int = 12) -> np.ndarray:
    """Vectors in a narrow cone: a large shared offset plus correlated noise."""
    mix = RNG.normal(size=(d, d))
    return RNG.normal(size=(n, d)) @ mix * 0.3 + 5.0


def test_center_removes_the_mean() -> None:
    x = anisotropic()
    y = fit(x, "center").apply(x)
    np.testing.assert_allclose(y.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(y, x - x.mean(0), atol=1e-5)


@pytest.mark.parametrize("dims", [None, 5])
def test_whitening_gives_identity_covariance(dims: int | None) -> None:
    x = anisotropic()
    t = fit(x, "whiten", dims=dims)
    y = t.apply(x).astype(np.float64)
    k = dims or x.shape[1]
    assert y.shape == (len(x), k)
    np.testing.assert_allclose(y.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(np.cov(y, rowvar=False, bias=True), np.eye(k), atol=1e-4)


def test_abtt_removes_the_top_direction() -> None:
    x = anisotropic()
    y = fit(x, "abtt", d=1).apply(x).astype(np.float64)
    centered = x - x.mean(0)
    top = np.linalg.svd(centered, full_matrices=False)[2][0]
    np.testing.assert_allclose(y @ top, 0, atol=1e-4)
    # what is left is the rest of the centered data, untouched
    np.testing.assert_allclose(y, centered - np.outer(centered @ top, top), atol=1e-4)


def test_fixes_lower_anisotropy() -> None:
    x = anisotropic()
    raw = stats(x)
    assert raw["mean_cosine"] > 0.9
    for method in ("center", "whiten"):
        assert abs(stats(fit(x, method).apply(x))["mean_cosine"]) < 0.05
    normed = fit(x, "whiten", normalize=True).apply(x)
    np.testing.assert_allclose(np.linalg.norm(normed, axis=1), 1, atol=1e-5)


def brute_force(store_vectors: np.ndarray, queries: np.ndarray, k: int) -> list[list[int]]:
    a = store_vectors.astype(np.float64)
    q = queries.astype(np.float64)
    scores = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ (
        a / np.linalg.norm(a, axis=1, keepdims=True)).T
    return [list(np.argsort(-s, kind="stable")[:k]) for s in scores]


@pytest.fixture
def built(tmp_path: Path, tiny_bert: Path, small_texts: Path) -> pipeline.Store:
    job = job_dict(small_texts, tiny_bert, tmp_path / "g.zarr",
                   input={"carry_columns": ["label"]},
                   chunking={"strategy": "hierarchical"},
                   views={"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"}})
    result = CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "g.yaml", job))])
    assert result.exit_code == 0, result.output
    return pipeline.open_store(tmp_path / "g.zarr")


def test_exact_search_matches_brute_force(built: pipeline.Store, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import pipeline.analysis.search as search_module

    monkeypatch.setattr(search_module, "BLOCK_ROWS", 3)  # several blocks: exercise merging
    vectors = built.vectors("mean")
    queries = RNG.normal(size=(4, vectors.shape[1]))
    hits = top_k(built, queries, "mean", k=5)
    assert [[h.row for h in q] for q in hits] == brute_force(vectors, queries, 5)
    scores = [h.score for h in hits[0]]
    assert scores == sorted(scores, reverse=True)


def test_query_of_a_stored_text_finds_itself(built: pipeline.Store, small_texts: Path) -> None:
    import pyarrow.parquet as pq

    texts = pq.read_table(small_texts).column("text").to_pylist()
    encoder = QueryEncoder(built, "mean")
    np.testing.assert_allclose(encoder.encode(texts[3:4])[0], built.vectors("mean")[3],
                               atol=1e-5)
    hits = built.search(texts[3], k=3, view="mean")
    assert hits[0].row == 3 and hits[0].id == "r3" and hits[0].score == pytest.approx(1, abs=1e-5)


@pytest.mark.parametrize("fmt", ["zarr", "parquet"])
def test_postprocess_writes_view_with_its_transform(tmp_path: Path, tiny_bert: Path,
                                                    small_texts: Path, fmt: str) -> None:
    out = tmp_path / f"p.{fmt}"
    job = job_dict(small_texts, tiny_bert, out, output={"path": str(out), "format": fmt},
                   views={"mean": {"pooling": "mean"}})
    assert CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "p.yaml", job))]
                              ).exit_code == 0
    result = CliRunner().invoke(main, ["postprocess", str(out), "--view", "mean", "--method",
                                       "whiten", "--dims", "4"])
    assert result.exit_code == 0, result.output
    store = pipeline.open_store(out)
    assert store.views == ["mean", "mean_whiten"]
    raw = store.vectors("mean").astype(np.float64)
    white = store.vectors("mean_whiten").astype(np.float64)
    assert white.shape == (10, 4)
    np.testing.assert_allclose(np.cov(white, rowvar=False, bias=True), np.eye(4), atol=1e-3)
    # the stored parameters reproduce the stored view, for queries and other stores
    transform = load_transform(store, "mean_whiten")
    assert transform is not None
    np.testing.assert_allclose(transform.apply(raw), white, atol=1e-5)
    assert store.chunks is not None and store.chunks["mean_whiten"].shape == (10, 4)
    again = CliRunner().invoke(main, ["postprocess", str(out), "--view", "mean", "--method",
                                      "whiten", "--dims", "4"])
    assert again.exit_code == StoreError.exit_code and "already exists" in again.stderr
    searched = CliRunner().invoke(main, ["search", str(out), "pain", "--view", "mean_whiten",
                                         "-k", "3"])
    assert searched.exit_code == 0, searched.output
    assert len(searched.stdout.strip().splitlines()) == 3


GEOMETRY_ROW = re.compile(r"^  (\S+)\s+(raw|center|whiten|abtt d=1)\s+(\S+)\s+(\S+)\s+(\S+)$")


def geometry_figures(x: np.ndarray, pairs: int, seed: int) -> tuple[float, float, float]:
    """Mean cosine of the seeded random pairs, top-PC variance share, mean norm (float64)."""
    rng = np.random.default_rng(seed)  # the pairs the report names: distinct, seeded
    i = rng.integers(0, len(x), pairs)
    j = (i + rng.integers(1, len(x), pairs)) % len(x)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    eigvals = np.linalg.eigvalsh(np.cov(x, rowvar=False, bias=True))
    return (float(np.mean(np.sum(unit[i] * unit[j], axis=1))),
            float(eigvals[-1] / eigvals.sum()), float(np.linalg.norm(x, axis=1).mean()))


def fixed(x: np.ndarray, fix: str) -> np.ndarray:
    """Each fix by a different route than the project's: ZCA whitening (a rotation of
    PCA whitening, so cosines, norms and variance shares are the same), SVD for abtt."""
    c = x - x.mean(0)
    if fix == "center":
        return c
    if fix == "whiten":
        eigval, eigvec = np.linalg.eigh(np.cov(c, rowvar=False, bias=True))
        return c @ eigvec @ np.diag(eigval ** -0.5) @ eigvec.T
    top = np.linalg.svd(c, full_matrices=False)[2][0]
    return c - np.outer(c @ top, top)


def test_inspect_geometry_figures_match_numpy(tmp_path: Path) -> None:
    store = synthetic_store(tmp_path / "geo.zarr")  # 240 rows x 16: full-rank covariance
    result = CliRunner().invoke(main, ["inspect", store.path, "--geometry", "--sample", "500"])
    assert result.exit_code == 0, result.output
    assert "240 rows, mean cosine over 500 random pairs (seed 0)" in result.stdout
    rows = [m.groups() for m in map(GEOMETRY_ROW.match, result.stdout.splitlines()) if m]
    assert len(rows) == 4 * len(store.views)
    for view, fix, cos, top_pc, norm in rows:
        x = store.vectors(view).astype(np.float64)
        y = x if fix == "raw" else fixed(x, fix.split()[0])
        want = geometry_figures(y, 500, 0)
        np.testing.assert_allclose([float(cos), float(top_pc), float(norm)], want, atol=1.5e-3,
                                   err_msg=f"{view} {fix}")
    # whitened: identity covariance, so each of the 16 directions holds 1/16 of the variance
    whitened = [float(pc) for _, fix, _, pc, _ in rows if fix == "whiten"]
    assert whitened == pytest.approx([1 / 16] * len(store.views), abs=1e-3)


def test_search_shows_snippets(built: pipeline.Store, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["search", built.path, "bad", "side", "effects", "-k", "2",
                                       "--chunks"])
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert "chunk" in first and "id r" in first and len(first.split("  ")[-1]) > 0


def test_empty_rows_never_match(tmp_path: Path, tiny_bert: Path) -> None:
    src = write_table(tmp_path / "e.parquet", {"id": [1, 2, 3], "text": ["good", None, "bad"]})
    job = job_dict(src, tiny_bert, tmp_path / "e.zarr")
    assert CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "e.yaml", job))]
                              ).exit_code == 0
    store = pipeline.open_store(tmp_path / "e.zarr")
    hits = top_k(store, np.ones((1, 32)), "mean", k=3)[0]
    assert sorted(h.row for h in hits) == [0, 2]
    if importlib.util.find_spec("faiss") is not None:  # the index leaves empty rows out too
        from pipeline.analysis.index import build_index

        build_index(store, "mean")
        indexed = top_k(store, np.ones((1, 32)), "mean", k=3)[0]
        assert sorted(h.row for h in indexed) == [0, 2]


@pytest.mark.parametrize("fmt", ["zarr", "parquet"])
def test_job_file_post_is_fitted_at_the_end(tmp_path: Path, tiny_bert: Path,
                                            small_texts: Path, fmt: str) -> None:
    import pyarrow.parquet as pq

    out = tmp_path / f"j.{fmt}"
    views = {"raw": {"pooling": "mean"},
             "white": {"pooling": "mean", "post": {"method": "whiten", "dims": 3}},
             "centered": {"pooling": "mean", "post": "center"}}
    job = job_dict(small_texts, tiny_bert, out, views=views,
                   output={"path": str(out), "format": fmt})
    result = CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "j.yaml", job))])
    assert result.exit_code == 0, result.output
    store = pipeline.open_store(out)
    assert store.provenance.complete is True and store.views == ["raw", "white", "centered"]
    raw = store.vectors("raw").astype(np.float64)
    np.testing.assert_allclose(store.vectors("centered"), raw - raw.mean(0), atol=1e-5)
    white = store.vectors("white").astype(np.float64)
    np.testing.assert_allclose(np.cov(white, rowvar=False, bias=True), np.eye(3), atol=1e-3)
    # a query goes through the same fitted transform
    text = pq.read_table(small_texts).column("text")[6].as_py()
    hit = store.search(text, k=1, view="white")[0]
    assert hit.row == 6 and hit.score == pytest.approx(1, abs=1e-4)


def test_index_agrees_with_exact_search(tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    from pipeline.analysis.index import build_index
    store = synthetic_store(tmp_path / "i.zarr")
    queries = RNG.normal(size=(20, 16))
    exact = top_k(store, queries, "l2_mean", k=10, exact=True)
    path = build_index(store, "l2_mean")
    assert path.exists()
    approx = top_k(store, queries, "l2_mean", k=10)
    recall = np.mean([len({h.row for h in a} & {h.row for h in e}) / 10
                      for a, e in zip(approx, exact, strict=True)])
    assert recall >= 0.9
    for a, e in zip(approx, exact, strict=True):  # scores are the same cosines
        common = {h.row: h.score for h in e}
        for h in a:
            if h.row in common:
                assert h.score == pytest.approx(common[h.row], abs=1e-5)


def test_postprocessed_view_in_inspect_and_probe(built: pipeline.Store, one_thread: None
                                                 ) -> None:
    from pipeline.analysis.probe import load_labels, run_probe

    postprocess(built.path, "mean", PostSpec("center"))
    store = pipeline.open_store(built.path)
    out = CliRunner().invoke(main, ["inspect", store.path])
    assert out.exit_code == 0, out.output
    assert "mean_center" in out.stdout and "post center (fitted on 10 rows)" in out.stdout
    report = run_probe(store, load_labels(store, "label"), folds=2)
    cell = next(r for r in report.results if r.view == "mean_center")
    assert (cell.layer, cell.pooling) == (None, "mean+center")
