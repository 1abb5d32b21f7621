"""Vocabulary fit: how well the model's word pieces cover a store's text (domain mismatch).

Over the rows with text, from the per-row counts recorded at extraction (`docs/n_tokens`,
`n_unk`, `n_words`, `n_fragmented`; a word is a pre-token of the model's own tokenizer,
see `extract.chunking.word_pieces`):

    unk_rate          Σ n_unk / Σ n_tokens           share of word pieces that are [UNK]
    fertility         Σ n_tokens / Σ n_words         word pieces per word
    fragmented_share  Σ n_fragmented / Σ n_words     share of words cut into ≥ 3 pieces
    chunked_share     rows with n_chunks > 1 / rows  share of rows longer than one chunk

Which words cost most needs a word-level pass: a fixed-seed sample of the input texts is
tokenized again with the store's tokenizer, and words seen at least twice are ranked by the
tokens they cost beyond one per word, occurrences × (pieces − 1). Words that contain an
[UNK] piece are listed by frequency. A store made before the per-row counts existed gets
all its figures from that sample instead (and says so).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BertpipeError
from ..extract.chunking import FRAGMENTED_PIECES, word_pieces
from ..extract.modelfiles import WordTokenizer, load_tokenizer
from ..stores.opened import StoreData as Store
from .rows import count_rows, read_texts, sample_rows

COUNT_COLUMNS = ("n_unk", "n_words", "n_fragmented")
MIN_OCCURRENCES = 2  # a "frequent" word for the top list


@dataclass
class WordCounts:
    """Counts from tokenizing texts: totals, and per word (keyed by its pieces)."""

    tokens: int = 0
    unk: int = 0
    words: int = 0
    fragmented: int = 0
    occurrences: Counter[tuple[str, ...]] = field(default_factory=Counter)
    surface: dict[tuple[str, ...], str] = field(default_factory=dict)

    def add(self, texts: Sequence[str], tokenizer: WordTokenizer) -> None:
        texts = [t for t in texts if t and t.strip()]
        if not texts:
            return
        unk_id = tokenizer.unk_token_id
        for text, enc in zip(texts, tokenizer.encode_batch(texts), strict=True):
            ids = enc.ids
            pieces = word_pieces(enc.word_ids)
            self.tokens += len(ids)
            self.unk += ids.count(unk_id) if unk_id is not None else 0
            self.words += len(pieces)
            self.fragmented += int((pieces >= FRAGMENTED_PIECES).sum())
            self._add_words(text, enc.tokens, enc.word_ids, enc.offsets)

    def _add_words(self, text: str, tokens: Sequence[str], word_ids: Sequence[int | None],
                   offsets: Sequence[tuple[int, int]]) -> None:
        words: dict[int, list[int]] = {}
        for t, w in enumerate(word_ids):
            if w is not None:
                words.setdefault(w, []).append(t)
        for positions in words.values():
            key = tuple(tokens[t] for t in positions)
            self.occurrences[key] += 1
            if key not in self.surface:
                self.surface[key] = text[offsets[positions[0]][0]:offsets[positions[-1]][1]]

    def top_fragmented(self, top: int) -> list[dict[str, Any]]:
        rows = [(n * (len(key) - 1), n, key) for key, n in self.occurrences.items()
                if len(key) > 1 and n >= MIN_OCCURRENCES]
        rows.sort(key=lambda r: (-r[0], -r[1], r[2]))
        return [{"word": self.surface[key], "pieces": list(key), "count": n,
                 "extra_tokens": cost} for cost, n, key in rows[:top]]

    def top_unknown(self, unk_token: str | None, top: int) -> list[dict[str, Any]]:
        rows = [(n, key) for key, n in self.occurrences.items() if unk_token in key]
        rows.sort(key=lambda r: (-r[0], r[1]))
        return [{"word": self.surface[key], "pieces": list(key), "count": n}
                for n, key in rows[:top]]


def vocabulary_fit(store: Store, sample: int = 2000, top: int = 10, seed: int = 0
                   ) -> dict[str, Any]:
    """The vocabulary-fit figures of a store as a plain dict (for text and JSON output)."""
    docs = store.docs
    # rows an edit superseded hold old texts: not the input's vocabulary any more
    ok = (np.asarray(docs["status"].values) == "ok") & ~store.superseded()
    n_chunks = np.asarray(docs["n_chunks"].values)[ok]
    fit: dict[str, Any] = {
        "store": store.path, "model": store.provenance.job.model.path,
        "rows": int(ok.sum()),
        "chunked_share": float((n_chunks > 1).mean()) if ok.any() else 0.0,
        "recorded": all(c in docs for c in COUNT_COLUMNS),
        "fragmented_pieces": FRAGMENTED_PIECES,
    }
    if fit["recorded"]:
        totals = {c: int(np.asarray(docs[c].values)[ok].sum())
                  for c in ("n_tokens", *COUNT_COLUMNS)}
        fit.update(_ratios(totals["n_tokens"], totals["n_unk"], totals["n_words"],
                           totals["n_fragmented"]))
    fit["sample_rows"] = 0
    try:
        tokenizer = load_tokenizer(store.provenance.job.model)
        spec = store.provenance.job.input
        if store.provenance.version == 0:  # the store's rows are the input's, in order
            rows = sample_rows(np.flatnonzero(ok).tolist(), sample, seed)
        else:  # an updated store's rows are not in input order: sample the input's own
            rows = sample_rows(count_rows(spec), sample, seed)
        fit["sample_rows"] = len(rows)
        texts = read_texts(spec, rows)
    except (BertpipeError, OSError, ValueError) as exc:
        fit["word_pass"] = f"unavailable: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        return fit
    counts = WordCounts()
    counts.add([t for t in texts if t is not None], tokenizer)
    fit["word_pass"] = "ok"
    if not fit["recorded"]:  # an older store: every figure from the sample
        fit.update(_ratios(counts.tokens, counts.unk, counts.words, counts.fragmented))
    fit["top_fragmented"] = counts.top_fragmented(top)
    fit["top_unknown"] = counts.top_unknown(tokenizer.unk_token, top)
    return fit


def _ratios(tokens: int, unk: int, words: int, fragmented: int) -> dict[str, Any]:
    return {"tokens": tokens, "unk": unk, "words": words, "fragmented": fragmented,
            "unk_rate": unk / tokens if tokens else 0.0,
            "fertility": tokens / words if words else 0.0,
            "fragmented_share": fragmented / words if words else 0.0}


def describe_vocabulary(fits: Sequence[dict[str, Any]]) -> str:
    """The "vocabulary fit" section of `bertpipe inspect`: one column per store."""
    width = max(14, *(len(_name(f)) + 2 for f in fits))
    head = "vocabulary fit" + "".join(f"{_name(f):>{width}}" for f in fits)
    lines = [head]

    def row(label: str, fmt: str, key: str) -> None:
        cells = [fmt.format(f[key]) if key in f else "n/a" for f in fits]
        lines.append(f"  {label:<12}" + "".join(f"{c:>{width}}" for c in cells))

    row("rows", "{:d}", "rows")
    row("[UNK] rate", "{:.3%}", "unk_rate")
    row("fertility", "{:.3f}", "fertility")
    row(f"≥{FRAGMENTED_PIECES} pieces", "{:.2%}", "fragmented_share")
    row("chunked", "{:.1%}", "chunked_share")
    lines.append("  (fertility: word pieces per word, a word being a pre-token of the model's "
                 f"tokenizer; ≥{FRAGMENTED_PIECES} pieces: share of words cut that finely; "
                 "chunked: share of rows longer than one chunk)")
    for f in fits:
        source = ("per-row counts" if f["recorded"] else
                  f"a sample of {f['sample_rows']} rows (the store predates per-row counts)")
        prefix = f"  {_name(f)}: " if len(fits) > 1 else "  "
        lines.append(f"{prefix}figures from {source}")
        if f.get("word_pass") != "ok":
            lines.append(f"{prefix}word list {f.get('word_pass')}")
            continue
        words = ", ".join(f"{w['word']} ({'·'.join(w['pieces'])}) ×{w['count']}"
                          for w in f["top_fragmented"]) or "none seen twice"
        lines.append(f"{prefix}most fragmented frequent words (sample of {f['sample_rows']} "
                     f"rows, by tokens beyond one per word): {words}")
        if f["top_unknown"]:
            unknown = ", ".join(f"{w['word']} ×{w['count']}" for w in f["top_unknown"])
            lines.append(f"{prefix}words with [UNK] pieces: {unknown}")
    return "\n".join(lines)


def _name(fit: dict[str, Any]) -> str:
    return str(fit["store"]).rstrip("/").rsplit("/", 1)[-1]
