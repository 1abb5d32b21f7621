"""Cutting documents into chunks that fit the encoder, on token indices.

Each document is tokenized once (fast tokenizer, offsets kept). Chunk boundaries are
chosen on token indices, coarsest structure first: paragraphs (blank lines), then
sentences, then fixed token windows for a single sentence longer than the budget.
Consecutive pieces are packed greedily into chunks of at most `budget` content
tokens (the special tokens are added on top and counted in `max_tokens`).

Character spans tile the document: chunk k's own text is `text[end_{k-1}:end_k]`, so
concatenating them gives the text back exactly. With overlap, chunk k also starts with
the `overlap` tokens before its own first token and its `start` moves back to cover them.
"""

from __future__ import annotations

import bisect
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import JobError
from ..spec import ChunkingSpec
from .modelfiles import WordTokenizer

PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*(?:\r?\n[^\S\n]*)+")  # a blank line, any line endings
SENTENCE_BREAK = re.compile(r"(?<=[.!?…])[\"'”’)\]]*\s+|(?<=[。！？])")

STATUS_OK = "ok"
STATUS_EMPTY = "empty"
FRAGMENTED_PIECES = 3  # a word cut into this many word pieces or more counts as fragmented


@dataclass(frozen=True)
class Specials:
    """Token ids wrapped around every chunk, e.g. [CLS] ... [SEP] for BERT."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.prefix) + len(self.suffix)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> Specials:
        plain = tokenizer.encode("a", add_special_tokens=False)
        wrapped = tokenizer.encode("a", add_special_tokens=True)
        for i in range(len(wrapped) - len(plain) + 1):
            if wrapped[i : i + len(plain)] == plain:
                return cls(tuple(wrapped[:i]), tuple(wrapped[i + len(plain) :]))
        raise ValueError("cannot locate content tokens among the special tokens")


@dataclass
class ChunkedPartition:
    """Documents of one partition cut into chunks (columns, chunk order = doc order)."""

    n_tokens: np.ndarray  # (N,) content tokens of the whole text
    n_covered: np.ndarray  # (N,) of those, tokens inside some chunk (all unless truncated)
    n_chunks: np.ndarray  # (N,)
    truncated: np.ndarray  # (N,) bool
    status: list[str]  # (N,)
    chunk_doc: np.ndarray  # (M,) local document index
    chunk_seq: np.ndarray  # (M,)
    chunk_start: np.ndarray  # (M,) character offsets, [start, end)
    chunk_end: np.ndarray  # (M,)
    chunk_ids: list[list[int]] = field(repr=False)  # (M,) token ids incl. special tokens
    # vocabulary fit, per document, from the same tokenization (see `word_pieces`)
    n_unk: np.ndarray  # (N,) unknown-token ids among the content tokens
    n_words: np.ndarray  # (N,) words: the tokenizer's pre-tokens
    n_fragmented: np.ndarray  # (N,) words cut into FRAGMENTED_PIECES or more pieces
    # (M,) the chunk's content tokens as a range [tok_start, tok_end) of its document's
    # tokens, overlap included
    chunk_tok_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_tok_end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # (N,) per document its content token ids (T_i,) and character offsets (T_i, 2); kept
    # only when asked (token views), else empty
    doc_token_ids: list[np.ndarray] = field(default_factory=list, repr=False)
    doc_offsets: list[np.ndarray] = field(default_factory=list, repr=False)

    @cached_property
    def chunk_n_tokens(self) -> np.ndarray:
        """(M,) tokens per chunk, special tokens included (derived once, read thrice)."""
        return np.fromiter((len(ids) for ids in self.chunk_ids), np.int64, len(self.chunk_ids))


@dataclass(frozen=True)
class Span:
    """One chunk of one document: token range [tok_start, tok_end) and character span."""

    tok_start: int  # first token, overlap included
    tok_end: int
    start: int
    end: int


def content_budget(spec: ChunkingSpec, model_max_tokens: int | None, max_positions: int,
                   specials: Specials) -> int:
    """Content tokens per chunk: the chunk limit minus the special tokens.

    The chunk limit is `chunking.max_tokens`, else `model.max_tokens`, else the model's own
    limit (`max_positions`: 512 for BERT, 8192 for ModernBERT); never more than the model's.
    """
    model_limit = min(model_max_tokens or max_positions, max_positions)
    limit = min(spec.max_tokens or model_limit, model_limit)
    budget = limit - specials.count
    if spec.overlap and 2 * spec.overlap >= budget:
        raise JobError(f"chunking.overlap: {spec.overlap} must be under half of the "
                       f"{budget} content tokens per chunk (the least of chunking.max_tokens, "
                       f"model.max_tokens and the model's {max_positions} positions, less "
                       f"{specials.count} special tokens)")
    if budget < 1:
        raise JobError(f"chunking.max_tokens: {limit} tokens leave no room for text beside "
                       f"{specials.count} special tokens")
    return budget


# per transformers tokenizer, a copy of its backend as chunking calls it (`encode_contents`)
_backends: weakref.WeakKeyDictionary[Any, WordTokenizer] = weakref.WeakKeyDictionary()
_backends_guard = threading.Lock()


def encode_contents(tokenizer: Any, texts: list[str]) -> list[Any]:
    """One encoding per text, no special tokens (`ids`, `offsets`, `word_ids`): what
    transformers' fast tokenizer gives for `tokenizer(texts, add_special_tokens=False)`,
    from its Rust backend directly where the tokenizer's class adds nothing to that call.
    Why not through transformers: it converts every encoding into Python lists and dicts,
    which costs about as much as tokenizing short texts itself. The backend is a copy
    (`modelfiles.WordTokenizer`: truncation and padding off, as transformers sets them for
    a call that asks for neither), so no other caller's settings reach it, nor ours theirs."""
    if not _calls_backend_only(tokenizer):  # its class changes the call: take the call's
        return _called(tokenizer, texts)
    with _backends_guard:
        own = _backends.get(tokenizer)
        if own is None:
            from tokenizers import Tokenizer

            own = WordTokenizer(Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()),
                                tokenizer.model_max_length, tokenizer.unk_token,
                                bool(getattr(tokenizer, "split_special_tokens", False)))
            _backends[tokenizer] = own
    return own.encode_batch(texts)


def _calls_backend_only(tokenizer: Any) -> bool:
    """The tokenizer's class calls its backend as transformers' fast tokenizer does: it
    overrides neither the call nor the encoding step (a model's own tokenizer code, with
    trust_remote_code, may change the text or the ids in Python)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    return isinstance(tokenizer, PreTrainedTokenizerFast) and \
        cls.__call__ is PreTrainedTokenizerBase.__call__ and \
        cls._encode_plus is PreTrainedTokenizerFast._encode_plus


@dataclass(frozen=True)
class _Encoded:
    """What chunking reads of an encoding, taken from transformers' call."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    word_ids: list[int | None]


def _called(tokenizer: Any, texts: list[str]) -> list[_Encoded]:
    if not texts:
        return []
    out = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True,
                    return_attention_mask=False, return_token_type_ids=False)
    return [_Encoded(list(ids), [tuple(o) for o in offsets], out.word_ids(k))
            for k, (ids, offsets) in enumerate(zip(out["input_ids"], out["offset_mapping"],
                                                   strict=True))]


def chunk_partition(texts: Sequence[str | None], tokenizer: Any, spec: ChunkingSpec,
                    budget: int, specials: Specials, keep_tokens: bool = False
                    ) -> ChunkedPartition:
    """Tokenize every text once and cut it into chunks according to `spec.strategy`;
    `keep_tokens` also keeps each document's token ids and offsets (token views)."""
    present = [i for i, t in enumerate(texts) if isinstance(t, str) and t.strip()]
    encodings = encode_contents(tokenizer, [str(texts[i]) for i in present])
    n = len(texts)
    n_tokens = np.zeros(n, np.int64)
    n_covered = np.zeros(n, np.int64)
    n_chunks = np.zeros(n, np.int64)
    truncated = np.zeros(n, bool)
    status = [STATUS_EMPTY] * n
    docs, seqs, starts, ends, ids_out = [], [], [], [], []
    tok_starts, tok_ends = [], []
    no_tokens = np.zeros(0, np.int64)
    doc_ids = [no_tokens] * n if keep_tokens else []
    doc_offsets = [no_tokens.reshape(0, 2)] * n if keep_tokens else []
    n_unk, n_words, n_fragmented = (np.zeros(n, np.int64) for _ in range(3))
    unk_id = getattr(tokenizer, "unk_token_id", None)
    for i, encoding in zip(present, encodings, strict=True):
        ids, offsets = encoding.ids, encoding.offsets
        if not ids:  # only characters the tokenizer drops: nothing to encode
            continue
        # vocabulary fit, read off the same encoding
        pieces = word_pieces(encoding.word_ids)
        n_unk[i] = ids.count(unk_id) if unk_id is not None else 0
        n_words[i] = len(pieces)
        n_fragmented[i] = int((pieces >= FRAGMENTED_PIECES).sum())
        text = texts[i]
        assert text is not None
        spans = _spans_for(text, offsets, spec, budget)
        status[i] = STATUS_OK
        n_tokens[i] = len(ids)
        n_chunks[i] = len(spans)
        n_covered[i] = spans[-1].tok_end  # own token ranges tile [0, last end)
        truncated[i] = n_covered[i] < len(ids)
        if keep_tokens:
            doc_ids[i] = np.asarray(ids, np.int64)
            doc_offsets[i] = np.asarray(offsets, np.int64).reshape(-1, 2)
        for seq, s in enumerate(spans):
            docs.append(i)
            seqs.append(seq)
            starts.append(s.start)
            ends.append(s.end)
            tok_starts.append(s.tok_start)
            tok_ends.append(s.tok_end)
            ids_out.append([*specials.prefix, *ids[s.tok_start : s.tok_end], *specials.suffix])
    return ChunkedPartition(
        n_tokens=n_tokens, n_covered=n_covered, n_chunks=n_chunks, truncated=truncated,
        status=status,
        chunk_doc=np.asarray(docs, np.int64), chunk_seq=np.asarray(seqs, np.int64),
        chunk_start=np.asarray(starts, np.int64), chunk_end=np.asarray(ends, np.int64),
        chunk_ids=ids_out, n_unk=n_unk, n_words=n_words, n_fragmented=n_fragmented,
        chunk_tok_start=np.asarray(tok_starts, np.int64),
        chunk_tok_end=np.asarray(tok_ends, np.int64),
        doc_token_ids=doc_ids, doc_offsets=doc_offsets,
    )


def word_pieces(word_ids: Sequence[int | None]) -> np.ndarray:
    """Pieces per word of one text, from the fast tokenizer's `word_ids()` of the same
    encoding (no second pass). A word is a pre-token of the model's own tokenizer: for
    BERT's WordPiece a run of non-space characters split at every punctuation character,
    each CJK ideograph a word of its own; for SentencePiece models a whitespace-separated
    run; for byte-level BPE a run of letters, digits or symbols with its leading space."""
    w = np.fromiter((-1 if x is None else x for x in word_ids), np.int64, len(word_ids))
    counts = np.bincount(w[w >= 0])
    return counts[counts > 0]


def _spans_for(text: str, offsets: Sequence[tuple[int, int]], spec: ChunkingSpec,
               budget: int) -> list[Span]:
    if spec.strategy == "truncate":
        return [truncate_span(text, offsets, budget)]
    return hierarchical_spans(text, offsets, budget, spec.overlap)


def truncate_span(text: str, offsets: Sequence[tuple[int, int]], budget: int) -> Span:
    """The first `budget` tokens; the span ends where the first dropped token starts."""
    n = len(offsets)
    if n <= budget:
        return Span(0, n, 0, len(text))
    return Span(0, budget, 0, offsets[budget][0])


def hierarchical_spans(text: str, offsets: Sequence[tuple[int, int]], budget: int,
                       overlap: int = 0) -> list[Span]:
    """Chunks along paragraphs, then sentences, then token windows, packed greedily."""
    n = len(offsets)
    step = budget - overlap  # own tokens per chunk; overlap tokens are prepended
    token_starts = [o[0] for o in offsets]
    paragraphs = _token_breaks(PARAGRAPH_BREAK, text, token_starts, 0, len(text))
    pieces: list[tuple[int, int]] = []
    for p0, p1 in _ranges(paragraphs, n):
        if p1 - p0 <= step:
            pieces.append((p0, p1))
            continue
        char0, char1 = offsets[p0][0], offsets[p1 - 1][1]
        sentences = _token_breaks(SENTENCE_BREAK, text, token_starts, char0, char1)
        for s0, s1 in _ranges([b for b in sentences if p0 < b < p1], p1, p0):
            pieces.extend((w, min(w + step, s1)) for w in range(s0, s1, step))
    own = _pack(pieces, step)
    spans = []
    for k, (t0, t1) in enumerate(own):
        start_tok = max(0, t0 - overlap) if k else 0
        char_start = 0 if start_tok == 0 else offsets[start_tok][0]
        char_end = len(text) if k == len(own) - 1 else offsets[own[k + 1][0]][0]
        spans.append(Span(start_tok, t1, char_start, char_end))
    return spans


def _token_breaks(pattern: re.Pattern[str], text: str, token_starts: Sequence[int],
                  char0: int, char1: int) -> list[int]:
    """Token indices where a new piece begins, from pattern matches in text[char0:char1]."""
    breaks = []
    for m in pattern.finditer(text, char0, char1):
        breaks.append(bisect.bisect_left(token_starts, m.end()))
    return breaks


def _ranges(breaks: Sequence[int], end: int, begin: int = 0) -> list[tuple[int, int]]:
    """Consecutive non-empty token ranges split at `breaks` within [begin, end)."""
    bounds = [begin, *sorted(b for b in set(breaks) if begin < b < end), end]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _pack(pieces: Sequence[tuple[int, int]], step: int) -> list[tuple[int, int]]:
    """Greedily merge consecutive token ranges into ranges of at most `step` tokens."""
    chunks: list[tuple[int, int]] = []
    for a, b in pieces:
        if chunks and b - chunks[-1][0] <= step:
            chunks[-1] = (chunks[-1][0], b)
        else:
            chunks.append((a, b))
    return chunks
