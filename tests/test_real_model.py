"""The real all-MiniLM-L6-v2 through `bertpipe extract`, checked against independent paths:
plain `transformers` forward passes and sentence-transformers `encode`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

import pipeline
from pipeline.cli import main
from tests.conftest import REVIEWS, job_dict, write_job

pytestmark = pytest.mark.slow
N_ROWS = 48

VIEWS = {
    "mean": {"pooling": "mean"},
    "cls": {"pooling": "cls"},
    "pooler": {"pooling": "pooler"},
    "max": {"pooling": "max"},
    "attn": {"pooling": "attention"},
    "l3": {"layers": [3], "pooling": "mean"},
    "emb": {"layers": [0], "pooling": "cls"},
    "cat2": {"layers": [-2, -1], "combine": "concat", "pooling": "cls"},
}


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return pq.read_table(REVIEWS).column("text").to_pylist()[:N_ROWS]


@pytest.fixture(scope="module")
def store(minilm: Path, tmp_path_factory: pytest.TempPathFactory) -> pipeline.Store:
    tmp = tmp_path_factory.mktemp("real")
    table = pq.read_table(REVIEWS).slice(0, N_ROWS)
    pq.write_table(table, tmp / "reviews.parquet")
    job = job_dict(tmp / "reviews.parquet", minilm, tmp / "out.zarr", views=VIEWS,
                   execution={"scheduler": "synchronous", "partition_rows": 20},
                   input={"carry_columns": ["label"]})
    result = CliRunner().invoke(main, ["extract", str(write_job(tmp / "job.yaml", job))])
    assert result.exit_code == 0, result.output
    return pipeline.open_store(tmp / "out.zarr")


@pytest.fixture(scope="module")
def oracle(minilm: Path, texts: list[str]) -> dict[str, np.ndarray]:
    """One text at a time (no padding at all) through plain transformers, eager attention."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm, local_files_only=True)
    model = AutoModel.from_pretrained(minilm, local_files_only=True,
                                      attn_implementation="eager").eval()
    out: dict[str, list[np.ndarray]] = {k: [] for k in VIEWS}
    with torch.inference_mode():
        for text in texts:
            enc = tok(text, return_tensors="pt", truncation=True, max_length=512)
            o = model(**enc, output_hidden_states=True, output_attentions=True)
            hs = [h[0].double().numpy() for h in o.hidden_states]  # (T, H) per layer
            attn = o.attentions[-1][0, :, 0, :].double().mean(0).numpy()  # (T,)
            out["mean"].append(hs[-1].mean(0))
            out["cls"].append(o.last_hidden_state[0, 0].double().numpy())
            out["pooler"].append(o.pooler_output[0].double().numpy())
            out["max"].append(hs[-1].max(0))
            out["attn"].append((attn[:, None] * hs[-1]).sum(0))
            out["l3"].append(hs[3].mean(0))
            out["emb"].append(hs[0][0])
            out["cat2"].append(np.concatenate([hs[-2][0], hs[-1][0]]))
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("view", list(VIEWS))
def test_views_equal_transformers(store: pipeline.Store, oracle: dict[str, np.ndarray],
                                  view: str) -> None:
    got = store.vectors(view)
    np.testing.assert_allclose(got, oracle[view], atol=2e-4, rtol=1e-3)
    assert cosine(got, oracle[view]).min() > 0.99999


def test_mean_equals_sentence_transformers(store: pipeline.Store, minilm: Path,
                                           texts: list[str]) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm), device="cpu", local_files_only=True)
    ref = st.encode(texts, batch_size=32, convert_to_numpy=True)
    assert cosine(store.vectors("mean"), ref).min() >= 0.9999


def test_rows_keep_input_order_and_ids(store: pipeline.Store) -> None:
    table = pq.read_table(REVIEWS).slice(0, N_ROWS)
    assert store.docs["id"].values.tolist() == table.column("id").to_pylist()
    assert store.docs["label"].values.tolist() == table.column("label").to_pylist()
    assert (store.docs["status"].values == "ok").all()
    assert not store.docs["truncated"].values.any()


def test_batch_invariance(minilm: Path, texts: list[str], tmp_path: Path) -> None:
    """A short text encoded alone equals the same text padded beside longer ones."""
    from pipeline.extract.partition import Extractor
    from pipeline.spec import Job

    job = Job.from_dict(job_dict(tmp_path / "x.parquet", minilm, tmp_path / "o.zarr",
                                 views=VIEWS))
    ex = Extractor(job)
    ids = [ex.model.tokenizer.encode(t) for t in texts[:6]]
    short = min(range(6), key=lambda i: len(ids[i]))
    alone = ex.encoder.encode_batch([ids[short]])
    together = ex.encoder.encode_batch(ids)
    for name in VIEWS:
        np.testing.assert_allclose(together[name][short], alone[name][0], atol=1e-5)


def test_bfloat16_agrees_with_float32(minilm: Path, texts: list[str], tmp_path: Path,
                                      store: pipeline.Store) -> None:
    """dtype bfloat16 (half-precision weights, float32 pooling) stays within cosine 0.999."""
    from pipeline.extract.partition import Extractor
    from pipeline.spec import Job

    raw = job_dict(tmp_path / "x.parquet", minilm, tmp_path / "o.zarr", views=VIEWS)
    raw["model"]["dtype"] = "bfloat16"
    ex = Extractor(Job.from_dict(raw))
    assert ex.model.compute_dtype == torch.bfloat16
    got = ex.encode_texts(list(texts)).docs
    for view in VIEWS:
        assert cosine(got[view], store.vectors(view)).min() > 0.999, view
