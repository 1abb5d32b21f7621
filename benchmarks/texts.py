"""Distinct benchmark texts, derived deterministically from the shipped sample reviews.

Why every benchmark input must be distinct: bertpipe encodes identical texts once and copies
the results (`extract/texthash.py`), while a peer such as sentence-transformers encodes every
row. An input that repeats its texts therefore measures bertpipe on a fraction of the work
the peer does, and overstates it by the repeat factor. Every benchmark builds its texts with
these helpers (tests/test_benchmarks.py checks each benchmark's input by construction).

    distinct_reviews(n)     n real reviews of realistic length: the 600 samples, then each
                            again with a copy number appended ("... (1)", "... (2)", ...)
    distinct_sentences(n)   n short texts: a sample sentence and the row number
    made_distinct(texts)    the same texts with every repeat suffixed by its occurrence
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pyarrow.parquet as pq

REVIEWS = Path(__file__).resolve().parent.parent / "data" / "reviews.parquet"


@cache
def sample_reviews() -> tuple[str, ...]:
    """The 600 shipped reviews (distinct: checked here, since everything below relies on it)."""
    texts = tuple(pq.read_table(REVIEWS, columns=["text"]).column("text").to_pylist())
    if len(set(texts)) != len(texts):
        raise ValueError(f"{REVIEWS} repeats a text: the copies below would repeat it too")
    return texts


@cache
def sample_sentences() -> tuple[str, ...]:
    """Sentences of more than three words from the sample reviews (some repeat: callers
    make each text distinct with a row number)."""
    return tuple(s.strip() for t in sample_reviews() for s in t.split(".")
                 if len(s.split()) > 3)


def distinct_reviews(n: int) -> list[str]:
    """`n` distinct reviews: copy 0 is the samples as they are, copy k >= 1 appends " (k)".

    The suffix keeps each text's length (1-3 tokens more) and its language, so token counts,
    padding and chunking stay those of real reviews; it is the scheme the CPU figures in
    docs/results.md were measured with."""
    samples = sample_reviews()
    return [text if k == 0 else f"{text} ({k})"
            for k in range(-(-n // len(samples))) for text in samples][:n]


def review_labels(n: int) -> list[str]:
    """The label of each of `distinct_reviews(n)`'s rows (copy k keeps its sample's label)."""
    labels = pq.read_table(REVIEWS, columns=["label"]).column("label").to_pylist()
    return [labels[i % len(labels)] for i in range(n)]


def distinct_sentences(n: int, seed: int = 0, start: int = 0) -> list[str]:
    """Short distinct texts, rows `start` to `start + n`: a sample sentence drawn at random
    (seeded) and the row number, which is what makes each one distinct."""
    rng = random.Random(seed)
    sentences = sample_sentences()
    picks = [rng.choice(sentences) for _ in range(start + n)][start:]
    return [f"{s} (review {start + i})" for i, s in enumerate(picks)]


def made_distinct(texts: Iterable[str]) -> list[str]:
    """`texts` with the second and later occurrences of a text suffixed " [k]" (k its
    occurrence), so a real corpus with repeats (Python's own docs repeat "Note:" 42 times)
    becomes distinct at a cost of a few tokens."""
    seen: set[str] = set()
    out = []
    for text in texts:
        candidate, k = text, 1
        while candidate in seen:  # a suffixed text may itself be in the corpus: try the next
            k += 1
            candidate = f"{text} [{k}]"
        seen.add(candidate)
        out.append(candidate)
    return out


def repeated(texts: Iterable[str]) -> dict[str, int]:
    """Texts that occur more than once, with their counts (empty: all distinct)."""
    counts: dict[str, int] = {}
    for text in texts:
        counts[text] = counts.get(text, 0) + 1
    return {text: c for text, c in counts.items() if c > 1}
