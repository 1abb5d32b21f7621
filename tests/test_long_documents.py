"""Long real documents (Python's own pydoc topics) through `bertpipe extract` with the real
model: every token covered, spans map back to the text, and the chunk aggregate equals the
mean over all of a document's token vectors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

import pipeline
from pipeline.cli import main
from tests.conftest import job_dict, write_job

pytestmark = pytest.mark.slow
CHUNK_TOKENS = 128


@pytest.fixture(scope="module")
def topics() -> list[str]:
    from pydoc_data.topics import topics as all_topics

    ranked = sorted(all_topics.values(), key=len)
    return ranked[::8]  # 10 documents from a few hundred to ~60k characters


@pytest.fixture(scope="module")
def store(topics: list[str], minilm: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> pipeline.Store:
    tmp = tmp_path_factory.mktemp("long")
    pq.write_table(pa.table({"id": list(range(len(topics))), "text": topics}),
                   tmp / "topics.parquet")
    job = job_dict(tmp / "topics.parquet", minilm, tmp / "topics.zarr",
                   chunking={"strategy": "hierarchical", "max_tokens": CHUNK_TOKENS},
                   views={"mean": {"pooling": "mean"}, "first": {"pooling": "cls"}})
    result = CliRunner().invoke(main, ["extract", str(write_job(tmp / "job.yaml", job))])
    assert result.exit_code == 0, result.output
    return pipeline.open_store(tmp / "topics.zarr")


def test_every_token_is_covered(store: pipeline.Store) -> None:
    stats = store.provenance.stats
    assert stats["tokens_covered"] == stats["tokens"] > 10_000
    assert not store.docs["truncated"].values.any()
    n_chunks = store.docs["n_chunks"].values
    assert n_chunks.max() > 50 and (n_chunks >= 1).all()
    assert store.chunks is not None
    assert (store.chunks["n_tokens"].values <= CHUNK_TOKENS).all()
    assert int(n_chunks.sum()) == store.chunks.sizes["chunk"]


def test_chunk_texts_rebuild_each_document(store: pipeline.Store, topics: list[str]) -> None:
    for row, text in enumerate(topics):
        chunks = store.chunk_texts(row)
        assert "".join(chunks["text"]) == text
        assert chunks["seq"].tolist() == list(range(len(chunks)))
        assert chunks["mean"].iloc[0].shape == (384,)


def test_weighted_mean_equals_mean_over_all_token_vectors(store: pipeline.Store, minilm: Path,
                                                          topics: list[str]) -> None:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm, local_files_only=True)
    model = AutoModel.from_pretrained(minilm, local_files_only=True).eval()
    assert store.chunks is not None
    doc_of_chunk = store.chunks["doc"].values
    chunk_tokens = store.chunks["n_tokens"].values
    for row in (0, 5, 9):
        ids = tok(topics[row], add_special_tokens=False)["input_ids"]
        windows, offset = [], 0
        for n in chunk_tokens[doc_of_chunk == row]:
            windows.append([tok.cls_token_id, *ids[offset : offset + n - 2], tok.sep_token_id])
            offset += n - 2
        assert offset == len(ids)
        token_vectors = []
        for start in range(0, len(windows), 16):  # padded batches, each window masked
            batch = windows[start : start + 16]
            longest = max(map(len, batch))
            input_ids = torch.tensor([w + [tok.pad_token_id] * (longest - len(w)) for w in batch])
            mask = torch.tensor([[1] * len(w) + [0] * (longest - len(w)) for w in batch])
            with torch.inference_mode():
                out = model(input_ids=input_ids, attention_mask=mask)
            token_vectors += [out.last_hidden_state[i, : len(w)].double().numpy()
                              for i, w in enumerate(batch)]
        expected = np.concatenate(token_vectors).mean(0)
        np.testing.assert_allclose(store.vectors("mean")[row], expected, atol=2e-5)
        # other poolings aggregate the same way: chunk vectors weighted by chunk tokens
        weights = np.array([len(v) for v in token_vectors], dtype=float)
        cls = np.stack([v[0] for v in token_vectors])
        np.testing.assert_allclose(store.vectors("first")[row],
                                   (weights[:, None] * cls).sum(0) / weights.sum(), atol=2e-5)


def test_inspect_reports_chunk_statistics(store: pipeline.Store) -> None:
    out = CliRunner().invoke(main, ["inspect", store.path]).stdout
    assert "per document min" in out and "% of documents chunked" in out
    assert "(100.0%)" in out
