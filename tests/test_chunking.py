"""The hierarchical chunker: properties over arbitrary text, plus hand-made structure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipeline.errors import JobError
from pipeline.extract.chunking import (
    Specials,
    chunk_partition,
    content_budget,
    hierarchical_spans,
    truncate_span,
)
from pipeline.spec import ChunkingSpec

PIECES = st.sampled_from([
    "the", "drug", "worked", "Side", "effects", "were", "terrible", "sleep", "antidisestablish",
    ".", "!", "?", ",", " ", "  ", "\n", "\n\n", "\r\n", "\r\n\r\n", "\t", "...",
    "日本語の文章です。", "中文句子！", "😀", "👍🏽", "e\u0301", "n\u0303o", "\u200b", "\u200d",
    "Ünïcödé", "ß", "مرحبا", "12345", "x" * 40, "«quoted»", "\u00a0",
])
TEXTS = st.lists(PIECES, min_size=0, max_size=120).map(lambda parts: " ".join(parts))


@pytest.fixture(scope="module")
def tokenizer(minilm: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm, local_files_only=True)


def offsets_of(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(text=TEXTS, budget=st.integers(3, 40), overlap=st.integers(0, 10))
def test_chunks_tile_text_and_cover_every_token(tokenizer: Any, text: str, budget: int,
                                                overlap: int) -> None:
    overlap = min(overlap, (budget - 1) // 2)
    ids, offsets = offsets_of(tokenizer, text)
    assume(ids)  # text the tokenizer drops entirely has nothing to chunk
    spans = hierarchical_spans(text, offsets, budget, overlap)
    # within budget, in order, first chunk at 0
    assert all(0 < s.tok_end - s.tok_start <= budget for s in spans)
    assert spans[0].tok_start == 0 and spans[0].start == 0
    # own token ranges (after the overlap) partition the tokens: nothing dropped or repeated
    own_starts = [0] + [s.tok_end for s in spans[:-1]]
    assert spans[-1].tok_end == len(ids)
    for s, own in zip(spans, own_starts, strict=True):
        assert own < s.tok_end
        assert s.tok_start == max(0, own - overlap)  # overlap is exact
    # character spans tile the text: text[end_{k-1}:end_k] concatenated is the text
    ends = [s.end for s in spans]
    assert ends == sorted(ends) and ends[-1] == len(text)
    assert "".join(text[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)) == text
    # every token of a chunk lies inside the chunk's character span
    for s in spans:
        assert s.start <= offsets[s.tok_start][0] and offsets[s.tok_end - 1][1] <= s.end
    # the same input gives the same chunks
    assert hierarchical_spans(text, offsets, budget, overlap) == spans


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_text_that_fits_is_one_chunk_of_all_tokens(tokenizer: Any, text: str) -> None:
    ids, offsets = offsets_of(tokenizer, text)
    assume(ids)  # text the tokenizer drops entirely has nothing to chunk
    (span,) = hierarchical_spans(text, offsets, len(ids) + 5)
    assert (span.tok_start, span.tok_end, span.start, span.end) == (0, len(ids), 0, len(text))


def test_paragraphs_before_sentences_before_windows(tokenizer: Any) -> None:
    para1 = "One two three. Four five six."
    para2 = "Seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    text = f"{para1}\r\n\r\n{para2}"
    ids, offsets = offsets_of(tokenizer, text)
    spans = hierarchical_spans(text, offsets, 8)
    chunks = [text[s.start : s.end].strip() for s in spans]
    # para1 is 8 tokens: it stays whole; para2 (one long sentence) falls back to windows
    assert chunks[0] == para1
    assert all(len(offsets_of(tokenizer, c)[0]) <= 8 for c in chunks)
    assert chunks[1].startswith("Seven") and len(chunks) == 3


def test_sentences_are_kept_whole_when_they_fit(tokenizer: Any) -> None:
    text = "Alpha beta gamma. Delta epsilon zeta! Eta theta iota? Kappa lambda mu."
    ids, offsets = offsets_of(tokenizer, text)
    spans = hierarchical_spans(text, offsets, 9)
    for s in spans:
        chunk = text[s.start : s.end].strip()
        assert chunk[-1] in ".!?", chunk  # cut only at sentence ends


def test_truncate_records_what_it_dropped(tokenizer: Any) -> None:
    text = "one two three four five six"
    ids, offsets = offsets_of(tokenizer, text)
    span = truncate_span(text, offsets, 4)
    assert (span.tok_end, text[span.start : span.end].strip()) == (4, "one two three four")


def test_partition_counts_special_tokens_and_flags(tokenizer: Any) -> None:
    specials = Specials.from_tokenizer(tokenizer)
    assert specials == Specials((101,), (102,))
    spec = ChunkingSpec(strategy="hierarchical", max_tokens=10)
    budget = content_budget(spec, 512, 512, specials)
    assert budget == 8
    long = " ".join(["word"] * 20)
    part = chunk_partition(["short text", None, long, ""], tokenizer, spec, budget, specials)
    assert part.status == ["ok", "empty", "ok", "empty"]
    assert part.n_tokens.tolist() == [2, 0, 20, 0]
    assert part.n_chunks.tolist() == [1, 0, 3, 0]
    assert not part.truncated.any()
    assert part.chunk_doc.tolist() == [0, 2, 2, 2]
    assert part.chunk_seq.tolist() == [0, 0, 1, 2]
    assert part.chunk_n_tokens.tolist() == [4, 10, 10, 6]
    assert all(ids[0] == 101 and ids[-1] == 102 for ids in part.chunk_ids)
    truncated = chunk_partition([long], tokenizer, ChunkingSpec(strategy="truncate",
                                                                max_tokens=10), budget, specials)
    assert truncated.truncated.tolist() == [True] and truncated.n_chunks.tolist() == [1]


def test_one_megabyte_document(tokenizer: Any) -> None:
    """A single 1 MB document is tokenized once and chunked in one pass, every token kept."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics.values())
    text = (text * (1_000_000 // len(text) + 1))[:1_000_000]
    specials = Specials.from_tokenizer(tokenizer)
    spec = ChunkingSpec()
    part = chunk_partition([text], tokenizer, spec, content_budget(spec, 512, 512, specials),
                           specials)
    content = part.chunk_n_tokens - specials.count
    assert int(content.sum()) == int(part.n_tokens[0]) > 200_000
    assert part.chunk_end[-1] == len(text) and part.chunk_start[0] == 0
    assert (part.chunk_n_tokens <= 512).all()


def test_budget_defaults_to_the_models_own_limit() -> None:
    specials = Specials((1,), (2,))
    assert content_budget(ChunkingSpec(), None, 8192, specials) == 8190  # e.g. ModernBERT
    assert content_budget(ChunkingSpec(), 512, 8192, specials) == 510  # model.max_tokens
    assert content_budget(ChunkingSpec(max_tokens=128), None, 512, specials) == 126
    assert content_budget(ChunkingSpec(max_tokens=4096), None, 512, specials) == 510  # capped
    # an overlap the job could not check without the model is refused at load, naming the key
    with pytest.raises(JobError, match=r"chunking.overlap: 300 must be under half of the "
                                       r"510 content tokens"):
        content_budget(ChunkingSpec(overlap=300), None, 512, specials)
