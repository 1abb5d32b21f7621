"""Token views (`pooling: tokens`): stored vectors against plain transformers, offsets
against the text, each token of a chunked document stored once from the chunk where it
has the most context, and the tokens level read back by xarray, pandas and pyarrow."""

from __future__ import annotations

import bisect
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import xarray as xr
from click.testing import CliRunner

import pipeline
from pipeline.cli import main
from pipeline.errors import JobError, StoreError
from pipeline.extract.tokens import owned_ranges
from pipeline.spec import Job, job_schema
from tests.conftest import REVIEWS, job_dict, write_job, write_table

FORMATS = ("zarr", "parquet", "delta")
# rows 3-5 (the second partition of 3 rows) hold no text at all: a zero-row tokens part
TEXTS: list[str | None] = [
    "the drug worked very well", "bad side effects, no sleep for a week", "",
    "   ", "", None,
    "my doctor said it is not good for pain and sleep",
    "it worked. then it did not. then the pain was terrible!", "Great DAY, GREAT drug",
]
MIX_WEIGHTS, MIX_GAMMA = [0.2, -0.4, 1.1], 1.7
TOKEN_VIEWS = {
    "tok": {"pooling": "tokens"},
    "mix": {"layers": [0, 1, 2], "combine": "scalar_mix", "weights": MIX_WEIGHTS,
            "gamma": MIX_GAMMA, "pooling": "tokens"},
    "unit": {"layers": [1], "pooling": "tokens", "normalize": True},
}


def extract(tmp: Path, texts: list[str | None], model: Path, fmt: str, **sections: Any
            ) -> pipeline.Store:
    tmp.mkdir(parents=True, exist_ok=True)
    source = write_table(tmp / "in.parquet", {"id": [f"r{i}" for i in range(len(texts))],
                                              "text": texts})
    out = tmp / f"out.{fmt}"
    job = job_dict(source, model, out, output={"format": fmt}, **sections)
    result = CliRunner().invoke(main, ["extract", str(write_job(tmp / "job.yaml", job))])
    assert result.exit_code == 0, result.output
    return pipeline.open_store(out)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


class Oracle:
    """Plain transformers, one sequence at a time (no padding), eager attention, float64
    combines in NumPy."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModel.from_pretrained(model_dir, local_files_only=True,
                                               attn_implementation="eager").eval()

    def hidden_states(self, ids: list[int]) -> np.ndarray:
        """(L + 1, T, H) float64 for one sequence of ids (special tokens included)."""
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        return np.stack([h[0].double().numpy() for h in out.hidden_states])

    def text_states(self, text: str) -> np.ndarray:
        """(L + 1, T - 2, H): the text's content tokens, [CLS] and [SEP] dropped."""
        return self.hidden_states(self.tokenizer(text)["input_ids"])[:, 1:-1]


def expected_views(hs: np.ndarray) -> dict[str, np.ndarray]:
    """TOKEN_VIEWS from hidden states (L + 1, T, H), written out by hand."""
    mix = np.exp(MIX_WEIGHTS) / np.exp(MIX_WEIGHTS).sum()
    unit = hs[1] / np.linalg.norm(hs[1], axis=-1, keepdims=True)
    return {"tok": hs[-1], "mix": MIX_GAMMA * np.einsum("k,kth->th", mix, hs), "unit": unit}


def surface(piece: str) -> str:
    """A word piece as the text spells it, compared without case or accents."""
    text = unicodedata.normalize("NFD", piece.removeprefix("##").lower())
    return "".join(c for c in text if not unicodedata.combining(c))


# ---- short documents: the oracle, offsets, layout, both formats ------------------------

@pytest.fixture(scope="module")
def oracle(tiny_bert: Path) -> Oracle:
    return Oracle(tiny_bert)


@pytest.fixture(scope="module", params=FORMATS)
def store(request: pytest.FixtureRequest, tiny_bert: Path,
          tmp_path_factory: pytest.TempPathFactory) -> pipeline.Store:
    views = {"mean": {"pooling": "mean"}, **TOKEN_VIEWS}
    return extract(tmp_path_factory.mktemp(f"tokens-{request.param}"), TEXTS, tiny_bert,
                   request.param, views=views,
                   execution={"scheduler": "synchronous", "partition_rows": 3},
                   batching={"max_tokens_per_batch": 64})


def _rows_with_text() -> list[int]:
    return [i for i, t in enumerate(TEXTS) if t and t.strip()]


def test_vectors_equal_plain_transformers(store: pipeline.Store, oracle: Oracle) -> None:
    for row in _rows_with_text():
        text = TEXTS[row]
        assert text is not None
        hs = oracle.text_states(text)
        ids = oracle.tokenizer(text, add_special_tokens=False)["input_ids"]
        for view, want in expected_views(hs).items():
            got = store.tokens(view, row=row)
            assert got.frame["token_id"].tolist() == ids
            assert got.vectors.shape == want.shape and got.vectors.dtype == np.float32
            assert cosine(got.vectors, want).min() >= 0.9999, (view, row)
            np.testing.assert_allclose(got.vectors, want, atol=1e-5, rtol=1e-4)


def test_offsets_slice_the_text_to_each_piece(store: pipeline.Store) -> None:
    pieces = 0
    for row in _rows_with_text():
        text = TEXTS[row]
        assert text is not None
        frame = store.tokens("tok", row=row).frame
        assert frame["position"].tolist() == list(range(len(frame)))
        for piece, start, end in zip(frame["token"], frame["start"], frame["end"], strict=True):
            assert surface(text[start:end]) == surface(piece), (row, piece, start, end)
            pieces += piece.startswith("##")
    assert pieces >= 5  # words cut into pieces were checked, not only whole words


def test_special_tokens_are_not_stored(store: pipeline.Store, oracle: Oracle) -> None:
    assert store.token_dataset is not None
    ids = set(np.asarray(store.token_dataset["token_id"].values).tolist())
    assert not ids & set(oracle.tokenizer.all_special_ids)
    assert store.token_dataset.sizes["piece"] == int(store.docs["n_tokens"].sum())
    assert store.provenance.stats["tokens_stored"] == store.token_dataset.sizes["piece"]


def test_rows_index_the_tokens_level(store: pipeline.Store) -> None:
    assert store.token_dataset is not None
    count = np.asarray(store.docs["token_count"].values)
    offset = np.asarray(store.docs["token_offset"].values)
    np.testing.assert_array_equal(count, np.asarray(store.docs["n_tokens"].values))
    np.testing.assert_array_equal(offset, np.concatenate([[0], np.cumsum(count)[:-1]]))
    assert (count[[2, 3, 4, 5]] == 0).all()
    doc = np.asarray(store.token_dataset["doc"].values)
    np.testing.assert_array_equal(doc, np.repeat(np.arange(len(TEXTS)), count))
    by_id = store.tokens("mix", "r7")
    np.testing.assert_array_equal(by_id.vectors, store.tokens("mix", row=7).vectors)
    assert store.row_of("r7") == 7 and store.tokens("tok", row=4).vectors.shape == (0, 32)


def test_token_views_live_only_in_the_tokens_level(store: pipeline.Store) -> None:
    assert store.views == ["mean"] and store.token_views == list(TOKEN_VIEWS)
    assert store.chunks is not None
    for view in TOKEN_VIEWS:
        assert view not in store.docs and view not in store.chunks
    assert np.isfinite(store.vectors("mean")[0]).all()


def test_span_helper_returns_the_overlapping_tokens(store: pipeline.Store) -> None:
    text = TEXTS[6]
    assert text is not None
    start = text.index("doctor") + 2  # inside "doctor": the whole piece overlaps
    end = text.index("said") + 4
    span = store.token_span_vectors("tok", row=6, start=start, end=end)
    every = store.tokens("tok", row=6)
    inside = (every.frame["start"] < end) & (every.frame["end"] > start)
    assert "".join(surface(t) for t in span.frame["token"]) == "doctorsaid"
    np.testing.assert_array_equal(span.vectors, every.vectors[inside.to_numpy()])
    np.testing.assert_allclose(span.mean(), every.vectors[inside.to_numpy()].mean(0))
    assert len(store.token_span_vectors("tok", row=6, start=0, end=0)) == 0


def test_lookup_errors_name_what_is_wrong(store: pipeline.Store) -> None:
    with pytest.raises(StoreError, match="no token view 'mean'; token views: tok, mix, unit"):
        store.tokens("mean", row=0)
    with pytest.raises(StoreError, match=r"row=9 is not a row number of this store \(0\.\.8\); "
                       "for a document by its id, pass the id itself"):
        store.tokens("tok", row=9)
    with pytest.raises(StoreError, match="no document with id 'nope'"):
        store.tokens("tok", "nope")
    # an int is an id too, never a row: these ids are text, and the error says both ways
    with pytest.raises(StoreError, match=r"no document with id 7 \(looked up as an id; for "
                       r"the document at row 7, pass row=7\)"):
        store.tokens("tok", 7)
    with pytest.raises(StoreError, match="not both"):
        store.tokens("tok", "r7", row=7)
    with pytest.raises(StoreError, match=r"give a document's id .* or its row number as row="):
        store.tokens("tok")
    with pytest.raises(StoreError, match="end 1 is before start 4"):
        store.token_span_vectors("tok", row=0, start=4, end=1)


def test_integer_ids_are_ids_and_rows_are_named(tmp_path: Path, tiny_bert: Path) -> None:
    """Small integer ids, in another order than the rows: id 2 is row 6, never row 2."""
    ids = [8 - i for i in range(len(TEXTS))]
    source = write_table(tmp_path / "in.parquet", {"id": ids, "text": TEXTS})
    job = job_dict(source, tiny_bert, tmp_path / "out.zarr",
                   views={"mean": {"pooling": "mean"}, **TOKEN_VIEWS})
    result = CliRunner().invoke(main, ["extract", str(write_job(tmp_path / "job.yaml", job))])
    assert result.exit_code == 0, result.output
    store = pipeline.open_store(tmp_path / "out.zarr")
    by_id, by_row = store.tokens("tok", 2), store.tokens("tok", row=2)
    assert by_id.row == 6 and by_row.row == 2 and len(by_row) == 0  # row 2 has no text
    assert "".join(surface(t) for t in by_id.frame["token"]).startswith("mydoctor")
    span = store.token_span_vectors("tok", 2, start=3, end=9)  # "doctor" of row 6
    assert "".join(surface(t) for t in span.frame["token"]) == "doctor"
    with pytest.raises(StoreError, match=r"this store's ids are numbers \(e\.g\. 8\): pass 2"):
        store.tokens("tok", "2")


def test_plain_readers_open_the_tokens_level(store: pipeline.Store) -> None:
    want = store.tokens("tok", row=7)
    lo = int(store.docs["token_offset"][7])
    rows = slice(lo, lo + len(want))
    if store.format == "zarr":
        plain = xr.open_zarr(store.path, group="tokens")
        assert plain["tok"].dims == ("piece", "tok_dim")
        np.testing.assert_array_equal(plain["tok"].values[rows], want.vectors)
        assert list(plain["token"].values[rows]) == want.frame["token"].tolist()
        docs = xr.open_zarr(store.path, group="docs")
        np.testing.assert_array_equal(docs["token_count"].values,
                                      store.docs["token_count"].values)
        return
    if store.format == "delta":  # one Delta table, in order by doc and position
        from deltalake import DeltaTable

        frame = DeltaTable(str(Path(store.path) / "tokens")).to_pandas()
        part = frame[frame["doc"] == 7].sort_values("position")
        assert part["token"].tolist() == want.frame["token"].tolist()
        np.testing.assert_array_equal(np.stack(part["tok"].to_numpy()), want.vectors)
        assert len(frame) == store.token_dataset.sizes["piece"]  # type: ignore[union-attr]
        return
    folder = Path(store.path) / "tokens"
    frame = pd.read_parquet(folder)
    part = frame[frame["doc"] == 7]
    assert part["id"].unique().tolist() == ["r7"]
    assert part["token"].tolist() == want.frame["token"].tolist()
    np.testing.assert_array_equal(np.stack(part["tok"].to_numpy()), want.vectors)
    table = ds.dataset(folder, format="parquet").to_table()
    assert table.num_rows == store.token_dataset.sizes["piece"]  # type: ignore[union-attr]
    assert str(table.schema.field("tok").type) == "fixed_size_list<element: float>[32]"
    assert sorted(p.name for p in folder.iterdir()) == [f"part-{k:06d}.parquet"
                                                        for k in range(3)]
    assert pq.ParquetFile(folder / "part-000001.parquet").metadata.num_rows == 0


# ---- the owning chunk: worked examples --------------------------------------------------

@pytest.mark.parametrize("ranges,owned", [
    # no overlap: every chunk owns its own range
    ([(0, 5), (5, 9)], [(0, 5), (5, 9)]),
    # t=7: chunk 0 has min(7, 2) = 2, chunk 1 min(2, 7) = 2: the tie stays with chunk 0;
    # t=8: 1 against 3, chunk 1
    ([(0, 10), (5, 15)], [(0, 8), (8, 15)]),
    # t=7: 2 vs 1 -> chunk 0, t=8: 1 vs 2 -> chunk 1; t=13: 2 vs 1 -> chunk 1,
    # t=14: 1 vs 2 -> chunk 2
    ([(0, 10), (6, 16), (12, 20)], [(0, 8), (8, 14), (14, 20)]),
    # a short chunk inside the next one: t=0, 1 tie (0 vs 0, 1 vs 1), t=2: 0 vs 2
    ([(0, 4), (0, 12)], [(0, 2), (2, 12)]),
])
def test_owned_ranges_worked_examples(ranges: list[tuple[int, int]],
                                      owned: list[tuple[int, int]]) -> None:
    doc = np.zeros(len(ranges), np.int64)
    start, end = (np.array(x, np.int64) for x in zip(*ranges, strict=True))
    got = owned_ranges(doc, start, end)
    assert list(zip(got[0].tolist(), got[1].tolist(), strict=True)) == owned


def test_owned_ranges_keep_documents_apart() -> None:
    doc = np.array([0, 0, 1, 2, 2])
    start = np.array([0, 6, 0, 0, 3])
    end = np.array([8, 12, 4, 5, 9])
    got = owned_ranges(doc, start, end)
    assert list(zip(got[0].tolist(), got[1].tolist(), strict=True)) == [
        (0, 7), (7, 12), (0, 4), (0, 4), (4, 9)]


# ---- a chunked document: every token once, from the chunk with the most context -------

LONG = (" ".join(["the drug worked very well for my pain and sleep."] * 3) + "\n\n"
        + "it was not good, then it was great, then it was bad for a week with no sleep "
        "and my doctor said yes to the drug. " * 3 + "terrible pain in my day.")
CHUNK_TOKENS, OVERLAP = 24, 6


@pytest.mark.slow  # a long chunked document through both formats
@pytest.mark.parametrize("fmt", FORMATS)
def test_chunked_document_stores_each_token_once(fmt: str, tiny_bert: Path, oracle: Oracle,
                                                 tmp_path: Path) -> None:
    store = extract(tmp_path, ["the drug worked", LONG], tiny_bert, fmt, views=TOKEN_VIEWS,
                    chunking={"strategy": "hierarchical", "max_tokens": CHUNK_TOKENS,
                              "overlap": OVERLAP})
    enc = oracle.tokenizer(LONG, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    got = store.tokens("tok", row=1)
    assert got.frame["position"].tolist() == list(range(len(ids)))  # each exactly once
    assert got.frame["token_id"].tolist() == ids
    assert list(zip(got.frame["start"], got.frame["end"], strict=True)) == \
        [tuple(o) for o in offsets]

    # the chunks' token ranges, from their stored character spans (chunk k begins at its
    # first token; its own text ends where the next chunk's own tokens begin)
    chunks = store.chunk_texts(1, LONG)
    assert len(chunks) >= 5
    token_starts = [o[0] for o in offsets]
    ranges = [(bisect.bisect_left(token_starts, s), bisect.bisect_left(token_starts, e))
              for s, e in zip(chunks["start"], chunks["end"], strict=True)]
    assert ranges[-1][1] == len(ids)
    cls, sep = oracle.tokenizer.cls_token_id, oracle.tokenizer.sep_token_id
    states = [oracle.hidden_states([cls, *ids[a:b], sep])[:, 1:-1] for a, b in ranges]
    expected = [expected_views(chunk_states) for chunk_states in states]
    stored = {view: store.tokens(view, row=1).vectors for view in TOKEN_VIEWS}  # read once

    shared = discriminated = 0
    for t in range(len(ids)):
        holders = [k for k, (a, b) in enumerate(ranges) if a <= t < b]
        context = [min(t - ranges[k][0], ranges[k][1] - 1 - t) for k in holders]
        owner = holders[context.index(max(context))]  # the first best: earlier on a tie
        for view, want in expected[owner].items():
            row = want[t - ranges[owner][0]]
            np.testing.assert_allclose(stored[view][t], row, atol=1e-5, rtol=1e-4)
        shared += len(holders) > 1
        for k in holders:
            other = states[k][-1][t - ranges[k][0]]
            discriminated += k != owner and np.abs(other - got.vectors[t]).max() > 1e-3
    assert shared >= 2 * OVERLAP and discriminated >= OVERLAP  # the rule was exercised


def test_truncated_documents_store_the_tokens_encoded(tiny_bert: Path, oracle: Oracle,
                                                      tmp_path: Path) -> None:
    store = extract(tmp_path, [LONG], tiny_bert, "zarr", views={"tok": {"pooling": "tokens"}},
                    chunking={"strategy": "truncate", "max_tokens": CHUNK_TOKENS})
    got = store.tokens("tok", row=0)
    assert bool(store.docs["truncated"][0]) and len(got) == CHUNK_TOKENS - 2
    ids = oracle.tokenizer(LONG, add_special_tokens=False)["input_ids"][: CHUNK_TOKENS - 2]
    want = oracle.hidden_states([oracle.tokenizer.cls_token_id, *ids,
                                 oracle.tokenizer.sep_token_id])[-1, 1:-1]
    np.testing.assert_allclose(got.vectors, want, atol=1e-5, rtol=1e-4)


# ---- the job ---------------------------------------------------------------------------

def _job(tmp_path: Path, views: dict[str, Any]) -> dict[str, Any]:
    return job_dict(tmp_path / "in.parquet", tmp_path / "model", tmp_path / "out.zarr",
                    views=views)


def test_schema_lists_tokens_pooling() -> None:
    pooling = job_schema()["$defs"]["view"]["properties"]["pooling"]
    assert "tokens" in pooling["enum"]


def test_post_on_a_token_view_is_refused(tmp_path: Path) -> None:
    raw = _job(tmp_path, {"t": {"pooling": "tokens", "post": "center"}})
    with pytest.raises(JobError, match="views.t.post: .*drop post"):
        Job.from_dict(raw, tmp_path)


@pytest.mark.parametrize("name", ["token", "position", "token_offset", "Token_ID", "piece"])
def test_token_level_fields_are_not_view_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(JobError, match="is a field the store writes itself"):
        Job.from_dict(_job(tmp_path, {name: {"pooling": "tokens"}}), tmp_path)


def test_token_views_take_any_layers_and_combine(tmp_path: Path) -> None:
    job = Job.from_dict(_job(tmp_path, {"t": {"layers": "all", "combine": "concat",
                                              "pooling": "tokens"},
                                        "m": {"pooling": "mean"}}), tmp_path)
    assert [v.name for v in job.token_views] == ["t"]


# ---- the real model ---------------------------------------------------------------------

@pytest.mark.slow
def test_minilm_token_vectors_equal_plain_transformers(minilm: Path, tmp_path: Path) -> None:
    texts = pq.read_table(REVIEWS).column("text").to_pylist()[:12]
    views = {"tok": {"pooling": "tokens"},
             "top2": {"layers": [-2, -1], "combine": "mean", "pooling": "tokens"}}
    store = extract(tmp_path, texts, minilm, "parquet", views=views,
                    execution={"scheduler": "synchronous", "partition_rows": 5})
    oracle = Oracle(minilm)
    for row, text in enumerate(texts):
        hs = oracle.text_states(text)
        tok, top2 = store.tokens("tok", row=row), store.tokens("top2", row=row)
        assert not store.docs["truncated"][row] and len(tok) == hs.shape[1]
        assert cosine(tok.vectors, hs[-1]).min() >= 0.9999
        assert cosine(top2.vectors, (hs[-2] + hs[-1]) / 2).min() >= 0.9999
        for piece, start, end in zip(tok.frame["token"], tok.frame["start"], tok.frame["end"],
                                     strict=True):
            if piece != oracle.tokenizer.unk_token:
                assert surface(text[start:end]) == surface(piece), (row, piece)


# ---- the commands around a store of token views only ----------------------------------

@pytest.fixture(scope="module")
def tokens_only(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> pipeline.Store:
    tmp = tmp_path_factory.mktemp("tokens-only")
    texts = [t for t in TEXTS if t and t.strip()] * 3
    return extract(tmp, texts, tiny_bert, "parquet", views={"tok": {"pooling": "tokens"}},
                   input={"carry_columns": ["text"]})


@pytest.mark.parametrize("args,code,message", [
    (["search", "{store}", "drug"], 5, "no document vectors to search (token views only: tok)"),
    (["search", "{store}", "drug", "--view", "tok"], 5, "'tok' is a token view"),
    (["postprocess", "{store}", "--view", "tok", "--method", "center"], 5,
     "'tok' is a token view (pooling: tokens); geometry fixes are fitted on document"),
    (["probe", "{store}", "--label", "text", "--folds", "2"], 3,
     "no document vectors to probe (token views only: tok)"),
])
def test_commands_refuse_token_views_in_one_line(tokens_only: pipeline.Store, args: list[str],
                                                 code: int, message: str) -> None:
    result = CliRunner().invoke(main, [a.format(store=tokens_only.path) for a in args])
    assert result.exit_code == code, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_inspect_shows_the_tokens_level(tokens_only: pipeline.Store) -> None:
    result = CliRunner().invoke(main, ["inspect", tokens_only.path])
    assert result.exit_code == 0, result.output
    n = int(tokens_only.docs["n_tokens"].sum())
    assert "pooling tokens, layers [-1]" in result.stdout
    assert f"tokens     {n} stored" in result.stdout


def test_overwrite_replaces_the_tokens_level(tiny_bert: Path, tmp_path: Path) -> None:
    first = extract(tmp_path / "a", ["the drug worked"], tiny_bert, "parquet",
                    views={"tok": {"pooling": "tokens"}})
    out = Path(first.path)
    assert (out / "tokens").is_dir()
    source = write_table(tmp_path / "one.parquet", {"id": ["a"], "text": ["the drug"]})
    job = job_dict(source, tiny_bert, out, output={"format": "parquet"},
                   views={"m": {"pooling": "mean"}})
    result = CliRunner().invoke(main, ["extract", "--overwrite",
                                       str(write_job(tmp_path / "job.yaml", job))])
    assert result.exit_code == 0, result.output
    assert not (out / "tokens").exists() and "warning" not in result.output.lower()
    assert pipeline.open_store(out).token_dataset is None


def test_a_resumed_run_stores_the_same_tokens(tiny_bert: Path, tmp_path: Path) -> None:
    from pipeline.run import runner
    from pipeline.spec import load_job

    class StopsAfterOne(runner.InProcessExecutor):
        def run(self, job, parts, staging, fingerprint, on_done):  # type: ignore[no-untyped-def]
            super().run(job, parts[:1], staging, fingerprint, on_done)
            raise KeyboardInterrupt

    clean = extract(tmp_path / "clean", TEXTS, tiny_bert, "zarr", views=TOKEN_VIEWS,
                    execution={"scheduler": "synchronous", "partition_rows": 3})
    job_file = Path(clean.path).parent / "job.yaml"
    job = load_job(job_file, ("output.path=" + str(tmp_path / "resumed.zarr"),))
    with pytest.raises(KeyboardInterrupt):
        runner.run_job(job, executor=StopsAfterOne())
    summary = runner.run_job(job)
    assert summary.skipped == 1 and summary.run == 2
    resumed = pipeline.open_store(tmp_path / "resumed.zarr")
    assert clean.token_dataset is not None and resumed.token_dataset is not None
    for name in clean.token_dataset.variables:
        np.testing.assert_array_equal(resumed.token_dataset[name].values,
                                      clean.token_dataset[name].values)
    np.testing.assert_array_equal(resumed.docs["token_offset"].values,
                                  clean.docs["token_offset"].values)
