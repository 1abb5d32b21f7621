"""Vocabulary fit: per-row [UNK], word and fragment counts recorded at extraction equal a
direct count with the tokenizer, and mixed-script/emoji text fits the vocabulary worse
than English reviews."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import pipeline
from pipeline.analysis.vocabulary import vocabulary_fit
from pipeline.cli import main
from pipeline.run.runner import run_job
from pipeline.spec import Job
from tests.conftest import REVIEWS, job_dict, write_table

MIXED = [
    "Το φάρμακο με βοήθησε πολύ 😊👍",
    "Лекарство помогло, но болит голова 🤕",
    "الدواء ساعدني كثيرا 💊💊",
    "दवा से बहुत मदद मिली 🙏",
    "ยานี้ช่วยได้มาก 😀",
    "这个药很有效，但是我头疼 😷",
    "この薬はよく効きました🎉",
    "이 약은 정말 효과가 있었어요 ❤️",
    "Le médicament a aidé, mais j'ai eu des nausées 🤢",
    "Das Medikament hat geholfen 👌🏽 aber Kopfschmerzen",
    "İlaç çok işe yaradı 🙂 ama baş ağrısı yaptı",
    "Thuốc này rất tốt 👍 nhưng tôi bị đau đầu",
    "Το φάρμακο με βοήθησε πολύ 😊👍",  # repeated: a frequent fragmented word
    None,  # a null row counts nothing
]


@pytest.fixture(scope="module")
def real_vocab_bert(minilm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT (H=32) with MiniLM's real 30k WordPiece vocabulary: realistic
    tokenization at the cost of a toy forward pass."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("real-vocab-bert")
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=512)
    BertModel(config).save_pretrained(root, safe_serialization=True)
    tokenizer.save_pretrained(root)
    return root


def extract(tmp_path: Path, model: Path, texts: list[str | None], name: str) -> pipeline.Store:
    src = write_table(tmp_path / f"{name}.parquet", {"text": texts})
    raw = job_dict(src, model, tmp_path / f"{name}.zarr", views={"mean": {"pooling": "mean"}},
                   chunking={"strategy": "hierarchical", "max_tokens": 48})
    del raw["input"]["id_column"]
    run_job(Job.from_dict(raw))
    return pipeline.open_store(tmp_path / f"{name}.zarr")


def direct_counts(tokenizer: Any, text: str) -> dict[str, Any]:
    """Independent of the pipeline: normalise, pre-tokenize into words, word-piece each
    word on its own."""
    backend = tokenizer.backend_tokenizer
    words = [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(
        backend.normalizer.normalize_str(text))]
    pieces = [tokenizer.tokenize(w) for w in words]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert sum(map(len, pieces)) == len(ids)
    return {"n_tokens": len(ids), "n_unk": ids.count(tokenizer.unk_token_id),
            "n_words": len(words), "n_fragmented": sum(len(p) >= 3 for p in pieces),
            "words": [tuple(p) for p in pieces]}


def test_counts_equal_a_direct_count_and_mixed_text_fits_worse(
        tmp_path: Path, real_vocab_bert: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_vocab_bert)
    english = pq.read_table(REVIEWS).column("text").to_pylist()[:30]
    fits = {}
    for name, texts in (("english", english), ("mixed", MIXED)):
        store = extract(tmp_path, real_vocab_bert, texts, name)
        expected = [direct_counts(tokenizer, t) if t else None for t in texts]
        for column in ("n_tokens", "n_unk", "n_words", "n_fragmented"):
            got = np.asarray(store.docs[column].values).tolist()
            assert got == [e[column] if e else 0 for e in expected], column
        fit = vocabulary_fit(store)
        present = [e for e in expected if e]
        tokens = sum(e["n_tokens"] for e in present)
        words = sum(e["n_words"] for e in present)
        assert fit["recorded"] and fit["word_pass"] == "ok"
        assert fit["unk_rate"] == sum(e["n_unk"] for e in present) / tokens
        assert fit["fertility"] == tokens / words
        assert fit["fragmented_share"] == sum(e["n_fragmented"] for e in present) / words
        chunked = np.asarray(store.docs["n_chunks"].values)[[t is not None for t in texts]]
        assert fit["chunked_share"] == float((chunked > 1).mean())
        seen: dict[tuple[str, ...], int] = {}
        for e in present:
            for w in e["words"]:
                seen[w] = seen.get(w, 0) + 1
        for w in fit["top_fragmented"]:
            assert seen[tuple(w["pieces"])] == w["count"] >= 2
            assert w["extra_tokens"] == w["count"] * (len(w["pieces"]) - 1)
        fits[name] = fit
    assert fits["mixed"]["unk_rate"] > 0.05 > fits["english"]["unk_rate"]
    assert fits["mixed"]["fertility"] > 1.5 * fits["english"]["fertility"]
    assert fits["mixed"]["fragmented_share"] > fits["english"]["fragmented_share"]
    assert any(w["word"] == "😊👍" for w in fits["mixed"]["top_unknown"])
    assert fits["mixed"]["chunked_share"] == 0.0 and fits["english"]["chunked_share"] > 0

    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "english.zarr"),
                                       "--against", str(tmp_path / "mixed.zarr")])
    assert result.exit_code == 0, result.output
    section = result.stdout[result.stdout.index("vocabulary fit"):]
    header = section.splitlines()[0].split()
    assert header[-2:] == ["english.zarr", "mixed.zarr"]
    fertility = next(line for line in section.splitlines() if "fertility " in line).split()
    assert fertility[1:] == [f"{fits['english']['fertility']:.3f}",
                             f"{fits['mixed']['fertility']:.3f}"]
    assert "mixed.zarr: words with [UNK] pieces: 😊👍 ×2" in section


def test_store_without_counts_or_input(tmp_path: Path) -> None:
    """A store made before per-row counts, whose input is gone: figures say n/a, no crash."""
    from tests.test_probe import synthetic_store

    store = synthetic_store(tmp_path / "old.zarr")
    fit = vocabulary_fit(store)
    assert not fit["recorded"] and fit["word_pass"].startswith("unavailable")
    result = CliRunner().invoke(main, ["inspect", store.path])
    assert result.exit_code == 0, result.output
    assert "n/a" in result.stdout and "word list unavailable" in result.stdout
