"""The OpenVINO runtime against the torch float32 reference and plain transformers: every
view kind, token views included, on real text (a chunked long document included),
block-cut jobs, the runtime recorded in the store, and the export cache (reused,
invalidated, written atomically)."""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import pipeline
from pipeline.errors import ModelError
from pipeline.extract import runtime as runtime_mod
from pipeline.extract import runtime_choice as choice
from pipeline.extract.partition import Extractor
from pipeline.run.runner import run_job
from pipeline.spec import Job
from tests.conftest import REVIEWS, job_dict

if importlib.util.find_spec("openvino") is None:  # not importorskip: see import_openvino
    pytest.skip("the openvino runtime is optional (pip install 'bertpipe[openvino]')",
                allow_module_level=True)

from pipeline.extract import runtime_openvino as rov  # noqa: E402 - needs openvino

# Float32 on both sides: OpenVINO's fused kernels reorder sums, nothing else differs.
# Measured: max |difference| ~4e-7, cosine 1 - 1e-15 on the tiny model.
COSINE_MIN = 0.9999
ATOL = 1e-4

EVERY_VIEW: dict[str, Any] = {
    "mean": {"pooling": "mean"},
    "cls": {"pooling": "cls"},
    "pooler": {"pooling": "pooler"},
    "max": {"pooling": "max"},
    "attn": {"pooling": "attention"},
    "last": {"pooling": "last"},
    "emb": {"layers": [0], "pooling": "mean"},
    "mid": {"layers": [1], "pooling": "max"},
    "avg12": {"layers": [1, 2], "combine": "mean", "pooling": "mean"},
    "cat": {"layers": [-2, -1], "combine": "concat", "pooling": "cls"},
    "mix": {"layers": "all", "combine": "scalar_mix", "weights": [0.2, -1.0, 1.5],
            "gamma": 0.7, "pooling": "mean"},
    "wsum": {"layers": [0, 2], "combine": "weighted", "weights": [0.25, 0.75],
             "pooling": "attention", "normalize": True},
}


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Real reviews and one long real document that the tiny model (64 positions) chunks."""
    from pydoc_data.topics import topics

    reviews = pq.read_table(REVIEWS).column("text").to_pylist()[:12]
    return reviews + [topics["assert"]]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty export cache for this test."""
    monkeypatch.setenv("BERTPIPE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "openvino"


def extractor(model: Path, views: dict[str, Any], runtime: str, **model_keys: Any
              ) -> Extractor:
    raw = job_dict(Path("unused.parquet"), model, Path("unused.zarr"), views=views,
                   chunking={"strategy": "hierarchical"})
    raw["model"].update(runtime=runtime, **model_keys)
    return Extractor(Job.from_dict(raw))


def assert_same_vectors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for view, vectors in want.items():
        assert got[view].shape == vectors.shape, view
        np.testing.assert_allclose(got[view], vectors, atol=ATOL, err_msg=view)
        assert cosine(got[view], vectors).min() >= COSINE_MIN, view


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir()) if cache.exists() else []


# ---- agreement -------------------------------------------------------------------------

def test_every_view_equals_torch_float32(tiny_bert: Path, texts: list[str], cache: Path
                                         ) -> None:
    reference = extractor(tiny_bert, EVERY_VIEW, "torch").encode_texts(texts)
    ex = extractor(tiny_bert, EVERY_VIEW, "openvino")
    assert ex.runtime == runtime_mod.Runtime("openvino", "float32")
    got = ex.encode_texts(texts)
    assert got.chunked.n_chunks[-1] > 10  # the long document really is chunked
    assert_same_vectors(got.chunks, reference.chunks)
    assert_same_vectors(got.docs, reference.docs)
    # the graph returns exactly what the views need: every hidden state, the [CLS] row
    outputs = [o.get_any_name() for o in ex.encoder.forward.compiled.outputs]
    assert outputs == ["hidden_0", "hidden_1", "hidden_2", "cls_attention"]
    # a cache hit builds no torch model: tokenizer and pooler come from the files
    again = extractor(tiny_bert, EVERY_VIEW, "openvino")
    assert again.model.module is rov.WEIGHTLESS
    assert again.model.max_positions == ex.model.max_positions == 64
    for view, vectors in again.encode_texts(texts).docs.items():
        np.testing.assert_array_equal(vectors, got.docs[view], err_msg=view)


# Token views of every layer kind beside a pooled view that needs the [CLS] row: the graph
# must return each hidden state, and the rows kept per chunk come from the shared Encoder.
TOKEN_VIEWS: dict[str, Any] = {
    "tok": {"pooling": "tokens"},
    "emb": {"layers": [0], "pooling": "tokens"},
    "mix": {"layers": "all", "combine": "scalar_mix", "weights": [0.2, -1.0, 1.5],
            "gamma": 0.7, "pooling": "tokens"},
    "cat": {"layers": [-2, -1], "combine": "concat", "pooling": "tokens", "normalize": True},
    "attn": {"pooling": "attention"},
}


@pytest.mark.parametrize("runtime", ["openvino", "auto"])
def test_token_views_equal_torch_float32(tiny_bert: Path, texts: list[str], cache: Path,
                                         runtime: str) -> None:
    """Token views run on OpenVINO (neither refused nor sent to torch), and every stored
    token vector equals torch float32's within the pooled views' tolerance."""
    reference = extractor(tiny_bert, TOKEN_VIEWS, "torch").encode_texts(texts)
    ex = extractor(tiny_bert, TOKEN_VIEWS, runtime)
    assert ex.runtime == runtime_mod.Runtime("openvino", "float32")
    assert isinstance(ex.encoder.forward, rov.OpenVINOForward)
    got = ex.encode_texts(texts)
    assert got.chunked.n_chunks[-1] > 10  # the long document's tokens come from many chunks
    n_tokens = int(got.chunked.n_covered.sum())
    assert {name: len(v) for name, v in got.tokens.items()} == dict.fromkeys(
        ("tok", "emb", "mix", "cat"), n_tokens)
    assert_same_vectors(got.tokens, reference.tokens)
    assert_same_vectors(got.docs, reference.docs)
    outputs = [o.get_any_name() for o in ex.encoder.forward.compiled.outputs]
    assert outputs == ["hidden_0", "hidden_1", "hidden_2", "cls_attention"]


def test_token_view_job_runs_on_openvino(tiny_bert: Path, tmp_path: Path, small_texts: Path,
                                         cache: Path) -> None:
    """A whole run (the checks before it included) of a token view on runtime openvino:
    recorded as an OpenVINO store, the tokens level equal to a torch run's."""
    views = {"tok": {"pooling": "tokens"}, "mean": {"pooling": "mean"}}
    raw = job_dict(small_texts, tiny_bert, tmp_path / "ov.zarr", views=views)
    raw["model"]["runtime"] = "openvino"
    run_job(Job.from_dict(raw))
    run_job(Job.from_dict(job_dict(small_texts, tiny_bert, tmp_path / "ref.zarr",
                                   views=views)))
    store = pipeline.open_store(tmp_path / "ov.zarr")
    reference = pipeline.open_store(tmp_path / "ref.zarr")
    assert store.provenance.runtime == ["openvino"]
    assert reference.provenance.runtime == ["torch"]
    assert store.token_dataset is not None and reference.token_dataset is not None
    got, want = store.token_dataset["tok"].values, reference.token_dataset["tok"].values
    assert got.shape == want.shape and len(got) > 10  # one row per token of 10 texts
    assert_same_vectors({"tok": got}, {"tok": want})


@pytest.mark.slow  # two fresh interpreters importing the runtime
def test_worker_processes_cold_then_warm(tiny_bert: Path, tmp_path: Path, cache: Path
                                        ) -> None:
    """Two fresh worker processes: the first exports, the second starts from the cache
    without transformers' modelling code (the largest import of a cold start) or the torch
    weights. Neither reports telemetry: openvino would create files in the home folder."""
    import os
    import subprocess
    import sys

    views = {"p": {"pooling": "pooler"}, "a": {"pooling": "attention"}}
    raw = job_dict(Path("unused.parquet"), tiny_bert, Path("unused.zarr"), views=views)
    raw["model"]["runtime"] = "openvino"
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(raw))
    probe = ("import json, sys; from pipeline.spec import Job; "
             "from pipeline.extract.partition import Extractor; "
             f"ex = Extractor(Job.from_dict(json.load(open({str(job_file)!r})))); "
             "ex.encode_texts(['the drug worked']); "
             "print(sorted(m for m in sys.modules if m.startswith('transformers.models.bert')))")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    runs = [subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           check=True, env=env).stdout.strip().splitlines()[-1]
            for _ in range(2)]
    assert "modeling_bert" in runs[0]  # the export needed the torch model
    assert "configuration_bert" in runs[1] and "modeling_bert" not in runs[1], runs[1]
    assert len(entries(cache)) == 1
    assert list(home.iterdir()) == []  # no ~/intel client id or usage counter


def test_block_cut_job_exports_only_what_its_view_needs(tiny_bert: Path, texts: list[str],
                                                        cache: Path) -> None:
    views = {"mid": {"layers": [1], "pooling": "mean"}, "mid_max": {"layers": [1],
                                                                     "pooling": "max"}}
    reference = extractor(tiny_bert, views, "torch").encode_texts(texts)
    ex = extractor(tiny_bert, views, "openvino")
    assert ex.needs.blocks_to_run == 1
    assert [o.get_any_name() for o in ex.encoder.forward.compiled.outputs] == ["hidden_1"]
    # one block of two in the graph: half the matmuls of the whole model
    full = extractor(tiny_bert, {"m": {"pooling": "mean"}}, "openvino")
    assert 0 < 2 * count_ops(ex, "MatMul") <= count_ops(full, "MatMul")
    assert_same_vectors(ex.encode_texts(texts).docs, reference.docs)


def count_ops(ex: Extractor, kind: str) -> int:
    """Operations of one type in the exported IR."""
    model = rov.import_openvino().Core().read_model(ex.encoder.forward.entry / "model.xml")
    return sum(op.get_type_name() == kind for op in model.get_ops())


def test_exported_graph_equals_plain_transformers(tiny_bert: Path, cache: Path) -> None:
    """The wrapper against an independent path: transformers' own forward with
    output_hidden_states, and its eager attention probabilities for the [CLS] row."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    batch = tok(["the drug worked", "no sleep for a week, bad side effects and pain",
                 "yes"], padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    model = AutoModel.from_pretrained(tiny_bert, attn_implementation="eager").eval()
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                     output_attentions=True)
    entry = rov.cached_export(rov.export_key({"w": "x"}, {}, (0, 2), True),
                              lambda dest: rov.export(model, (0, 2), True, dest))
    forward = rov.OpenVINOForward(entry, (0, 2), True, "float32", threads=1)
    states, cls_row = forward(ids, mask)
    keep = mask.bool()
    for layer in (0, 2):
        np.testing.assert_allclose(states[layer][keep], want.hidden_states[layer][keep],
                                   atol=1e-5)
    assert cls_row is not None
    cls_want = want.attentions[-1][:, :, 0, :].mean(1)  # (B, T), mean over heads
    np.testing.assert_allclose(cls_row, cls_want, atol=1e-6)
    np.testing.assert_allclose(cls_row.sum(1), np.ones(3), atol=1e-6)


def test_auto_runtime_is_recorded_in_markers_and_provenance(tiny_bert: Path, tmp_path: Path,
                                                             small_texts: Path, cache: Path
                                                             ) -> None:
    raw = job_dict(small_texts, tiny_bert, tmp_path / "out.zarr")
    raw["model"]["runtime"] = "auto"
    run_job(Job.from_dict(raw))
    store = pipeline.open_store(tmp_path / "out.zarr")
    # auto is measured (extract/calibrate.py): either may win on the tiny model, but the
    # winner is what ran every partition, and openvino was a candidate
    choice = store.provenance.runtime_choice
    assert choice is not None and choice.by in ("calibration", "cache")
    assert {(r.runtime, r.dtype) for r in choice.table} == {("torch", "float32"),
                                                           ("openvino", "float32")}
    assert store.provenance.runtime == [choice.runtime]
    assert store.provenance.dtype == ["float32"]
    assert ("openvino" in store.provenance.versions) == (choice.runtime == "openvino")
    torch_raw = job_dict(small_texts, tiny_bert, tmp_path / "ref.zarr")  # runtime: torch
    run_job(Job.from_dict(torch_raw))
    reference = pipeline.open_store(tmp_path / "ref.zarr")
    assert reference.provenance.runtime == ["torch"]
    assert "openvino" not in reference.provenance.versions
    for view in ("mean", "cls"):
        np.testing.assert_allclose(store.vectors(view), reference.vectors(view), atol=ATOL)


def test_float32_job_runs_float32_whatever_the_cpu(tiny_bert: Path, cache: Path) -> None:
    """OpenVINO's own default on a CPU with bf16 is bf16: a float32 job must not get it."""
    ex = extractor(tiny_bert, {"m": {"pooling": "mean"}}, "openvino", dtype="float32")
    hint = ex.encoder.forward.compiled.get_property("INFERENCE_PRECISION_HINT")
    assert hint.get_type_name() == "f32"


# ---- the cache -------------------------------------------------------------------------

def test_cache_is_reused_and_follows_the_needed_outputs(tiny_bert: Path, cache: Path,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    before = rov.exports_made
    with caplog.at_level(logging.INFO, logger="pipeline.extract.runtime_openvino"):
        extractor(tiny_bert, {"m": {"pooling": "mean"}}, "openvino")
        assert rov.exports_made == before + 1 and len(entries(cache)) == 1
        # same outputs (the last layer), other poolings: the same export
        extractor(tiny_bert, {"c": {"pooling": "cls"}, "x": {"pooling": "max"}}, "openvino")
        assert rov.exports_made == before + 1
        # the [CLS] attention row is one more output: a new entry
        extractor(tiny_bert, {"a": {"pooling": "attention"}}, "openvino")
        assert rov.exports_made == before + 2 and len(entries(cache)) == 2
        # another layer: a new entry; asked again: reused
        extractor(tiny_bert, {"l1": {"layers": [1], "pooling": "mean"}}, "openvino")
        extractor(tiny_bert, {"l1": {"layers": [1], "pooling": "cls"}}, "openvino")
    assert rov.exports_made == before + 3
    exported = [r for r in caplog.records if "exported the encoder" in r.getMessage()]
    assert len(exported) == 3
    keys = [json.loads((e / "key.json").read_text()) for e in entries(cache)]
    assert sorted((k["layers"], k["cls_attention"]) for k in keys) == [
        ([1], False), ([2], False), ([2], True)]
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp folders


def test_changed_weights_get_a_new_export(tiny_bert: Path, tmp_path: Path, cache: Path,
                                          texts: list[str]) -> None:
    import shutil

    from transformers import AutoModel

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_bert, model_dir)
    views = {"m": {"pooling": "mean"}}
    first = extractor(model_dir, views, "openvino").encode_texts(texts[:3]).docs["m"]
    before = rov.exports_made
    model = AutoModel.from_pretrained(model_dir)
    with torch.no_grad():
        model.encoder.layer[-1].output.LayerNorm.bias.add_(0.5)  # same files, new weights
    model.save_pretrained(model_dir, safe_serialization=True)
    second = extractor(model_dir, views, "openvino").encode_texts(texts[:3]).docs["m"]
    assert rov.exports_made == before + 1 and len(entries(cache)) == 2
    want = extractor(model_dir, views, "torch").encode_texts(texts[:3]).docs["m"]
    np.testing.assert_allclose(second, want, atol=ATOL)  # not the stale graph
    np.testing.assert_allclose(second - first, 0.5, atol=ATOL)  # every mean moved by 0.5


def test_concurrent_exports_leave_one_whole_entry(tmp_path: Path) -> None:
    """Two workers exporting the same key at once: both get the same complete entry."""
    key = {"format": 0, "weights_sha256": {"w": "1"}}

    def slow_export(dest: Path) -> None:
        (dest / "model.xml").write_text("<net/>")
        time.sleep(0.2)  # both workers are mid-export here
        (dest / "model.bin").write_bytes(b"\0" * 16)

    results: list[Path] = []
    workers = [threading.Thread(target=lambda: results.append(
        rov.cached_export(key, slow_export, tmp_path))) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert results[0] == results[1]
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # temp folders gone
    assert sorted(p.name for p in results[0].iterdir()) == ["compiled", "files.json",
                                                            "key.json", "model.bin",
                                                            "model.xml"]
    assert json.loads((results[0] / "key.json").read_text()) == key


def test_damaged_compiled_blob_is_recompiled(tiny_bert: Path, cache: Path,
                                             texts: list[str]) -> None:
    views = {"m": {"pooling": "mean"}}
    want = extractor(tiny_bert, views, "openvino").encode_texts(texts[:3]).docs["m"]
    blobs = list(cache.glob("*/compiled/*.blob"))
    assert blobs
    for blob in blobs:
        blob.chmod(0o644)
        blob.write_bytes(blob.read_bytes()[:1000])  # a half-written blob
    got = extractor(tiny_bert, views, "openvino").encode_texts(texts[:3]).docs["m"]
    np.testing.assert_array_equal(got, want)
    # the compile that found it damaged wrote a whole blob in its place
    assert all(blob.stat().st_size > 1000 for blob in cache.glob("*/compiled/*.blob"))
    assert not list(cache.glob("*/.compiling-*"))


def _truncate_weights(entry: Path) -> None:
    weights = entry / "model.bin"
    weights.write_bytes(weights.read_bytes()[:1000])  # a copy cut short (disk full, killed)


def _junk_graph(entry: Path) -> None:
    (entry / "model.xml").write_text("<net")


def _junk_graph_of_the_same_size(entry: Path) -> None:
    graph = entry / "model.xml"
    graph.write_bytes(b"x" * graph.stat().st_size)


def _junk_graph_in_an_older_entry(entry: Path) -> None:
    """An entry exported before files.json: OpenVINO's own read finds the damage."""
    (entry / "files.json").unlink(missing_ok=True)
    _junk_graph(entry)
    for blob in (entry / "compiled").iterdir():  # else the compiled blob would still serve
        blob.unlink()


def _truncated_weights_in_an_older_entry(entry: Path) -> None:
    (entry / "files.json").unlink(missing_ok=True)
    _truncate_weights(entry)
    for blob in (entry / "compiled").iterdir():
        blob.unlink()


@pytest.mark.parametrize("damage", [_truncate_weights, _junk_graph, _junk_graph_of_the_same_size,
                                    _junk_graph_in_an_older_entry,
                                    _truncated_weights_in_an_older_entry],
                         ids=lambda f: f.__name__.strip("_"))
def test_damaged_export_is_set_aside_with_one_warning_and_exported_again(
        damage: Any, tiny_bert: Path, cache: Path, texts: list[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """It failed every later run with a traceback until a person cleared the cache."""
    views = {"m": {"pooling": "mean"}, "a": {"pooling": "attention"}}
    want = extractor(tiny_bert, views, "torch").encode_texts(texts[:3]).docs
    extractor(tiny_bert, views, "openvino")
    [entry] = entries(cache)
    damage(entry)
    before = rov.exports_made
    with caplog.at_level(logging.WARNING, logger="pipeline.extract.runtime_openvino"):
        got = extractor(tiny_bert, views, "openvino").encode_texts(texts[:3]).docs
    assert_same_vectors(got, want)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert warned[0].startswith(f"openvino: the cached export {entry} is damaged (")
    assert warned[0].endswith("); exporting it again")
    assert rov.exports_made == before + 1
    assert entries(cache) == [entry]  # exported again in its place, nothing set aside left
    assert not rov.damage(entry)
    again = extractor(tiny_bert, views, "openvino").encode_texts(texts[:3]).docs
    assert rov.exports_made == before + 1  # and reused from then on
    assert_same_vectors(again, want)


def test_openvino_compiles_into_a_private_folder_and_publishes_whole_blobs(
        tiny_bert: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenVINO never writes or removes blobs in the shared compiled/ folder itself (two
    runs on a fresh cache read each other's half-written blob, removed it and failed with
    'cannot set permissions ... compiled/....blob'); each blob it writes is renamed in."""
    import openvino

    cache_dirs: list[str] = []
    real = openvino.Core

    class Recording(real):  # type: ignore[misc, valid-type]
        def set_property(self, *args: Any) -> None:
            cache_dirs.append(dict(args[-1]).get("CACHE_DIR", ""))
            super().set_property(*args)

    monkeypatch.setattr(openvino, "Core", Recording)
    extractor(tiny_bert, {"m": {"pooling": "mean"}}, "openvino")
    [entry] = entries(cache)
    shared = entry / "compiled"
    assert cache_dirs and all(Path(d).parent == entry and Path(d) != shared
                              for d in cache_dirs), cache_dirs
    blobs = {p.name: p.read_bytes() for p in shared.iterdir()}
    assert blobs and not [p for p in entry.iterdir() if p.name.startswith(".")]
    # a second writer of the same blob (another process compiling at the same time)
    # replaces it whole: both succeed, and a reader sees one whole blob or the other
    for blob in shared.iterdir():
        blob.chmod(0o444)
    extractor(tiny_bert, {"m": {"pooling": "mean"}}, "openvino")
    assert {p.name: p.read_bytes() for p in shared.iterdir()} == blobs


def test_what_a_killed_compile_left_is_removed_once_a_day_old(tiny_bert: Path, cache: Path
                                                              ) -> None:
    """A process killed while compiling leaves its private folder (a blob in it): removed
    by a later compile once it is a day old; a younger one may be another process's."""
    import os

    extractor(tiny_bert, {"m": {"pooling": "mean"}}, "openvino")
    [entry] = entries(cache)
    old, young = entry / ".compiling-1-dead", entry / ".compiling-2-busy"
    for folder in (old, young):
        folder.mkdir()
        (folder / "1234.blob").write_bytes(b"half")
    day_ago = time.time() - rov.STALE_S - 60
    os.utime(old, (day_ago, day_ago))
    extractor(tiny_bert, {"m": {"pooling": "mean"}}, "openvino")
    assert not old.exists() and (young / "1234.blob").read_bytes() == b"half"


def test_two_processes_on_a_fresh_cache_both_succeed(tiny_bert: Path, tmp_path: Path,
                                                     cache: Path) -> None:
    import os
    import subprocess
    import sys

    raw = job_dict(Path("unused.parquet"), tiny_bert, Path("unused.zarr"),
                   views={"m": {"pooling": "mean"}, "a": {"pooling": "attention"}})
    raw["model"]["runtime"] = "openvino"
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(raw))
    start = tmp_path / "go"
    probe = ("import json, os, time; from pipeline.spec import Job; "
             "from pipeline.extract.partition import Extractor\n"
             f"while not os.path.exists({str(start)!r}): time.sleep(0.005)\n"
             f"ex = Extractor(Job.from_dict(json.load(open({str(job_file)!r}))))\n"
             "print(ex.encode_texts(['the drug worked']).docs['m'].tolist())")
    procs = [subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ))
             for _ in range(3)]
    time.sleep(2)  # all three imported and waiting: then they start together
    start.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-500:] for _, err in outs]
    assert len({out for out, _ in outs}) == 1  # the same vectors
    [entry] = entries(cache)
    assert not rov.damage(entry) and list((entry / "compiled").glob("*.blob"))
    assert not [p for p in entry.iterdir() if p.name.startswith(".")]


def test_unwritable_cache_is_one_clear_error(tiny_bert: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("BERTPIPE_CACHE_DIR", str(blocker))
    with pytest.raises(ModelError, match="BERTPIPE_CACHE_DIR"):
        extractor(tiny_bert, {"m": {"pooling": "mean"}}, "openvino")


# ---- choosing the runtime ----------------------------------------------------------------

def test_auto_picks_openvino_for_bert_and_torch_for_others(
        tiny_bert: Path, tiny_distilbert: Path, cache: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    assert extractor(tiny_bert, {"m": {"pooling": "mean"}}, "auto").runtime.name == "openvino"
    with caplog.at_level(logging.INFO, logger="pipeline.extract.runtime_choice"):
        ex = extractor(tiny_distilbert, {"m": {"pooling": "mean"}}, "auto")
    assert ex.runtime.name == "torch"
    assert any("distilbert runs on torch" in r.getMessage() for r in caplog.records)
    with pytest.raises(ModelError, match="openvino supports BERT encoders, not distilbert"):
        extractor(tiny_distilbert, {"m": {"pooling": "mean"}}, "openvino")


def test_openvino_for_another_family_is_one_clear_error(tmp_path: Path, tiny_distilbert: Path,
                                                        small_texts: Path) -> None:
    from tests.test_errors import assert_user_error, extract

    job = job_dict(small_texts, tiny_distilbert, tmp_path / "o.zarr")
    job["model"]["runtime"] = "openvino"
    assert_user_error(extract(tmp_path, job), 4, "model.runtime", "not distilbert")


BERT = SimpleNamespace(model_type="bert", is_decoder=False)


def test_cuda_and_missing_openvino(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = Job.from_dict(job_dict(Path("x.parquet"), tiny_bert, Path("o.zarr"))).model
    from dataclasses import replace

    monkeypatch.setattr(choice, "device_type", lambda name: "cuda")
    assert choice.choose_runtime(replace(spec, runtime="auto"), BERT) == "torch"
    with pytest.raises(ModelError, match="openvino runs on the CPU"):
        choice.choose_runtime(replace(spec, runtime="openvino"), BERT)
    monkeypatch.setattr(choice, "device_type", lambda name: "cpu")
    monkeypatch.setattr(choice, "openvino_installed", lambda: False)
    assert choice.choose_runtime(replace(spec, runtime="auto"), BERT) == "torch"
    with pytest.raises(ModelError, match="openvino is not installed"):
        choice.choose_runtime(replace(spec, runtime="openvino"), BERT)
    # a BERT configured as a causal decoder: the export's padding-only mask would be wrong
    decoder = SimpleNamespace(model_type="bert", is_decoder=True)
    monkeypatch.setattr(choice, "openvino_installed", lambda: True)
    assert choice.choose_runtime(replace(spec, runtime="auto"), decoder) == "torch"
    with pytest.raises(ModelError, match=r"not bert \(decoder\)"):
        choice.choose_runtime(replace(spec, runtime="openvino"), decoder)


# ---- the real model ----------------------------------------------------------------------

REAL_VIEWS: dict[str, Any] = {
    "mean": {"pooling": "mean"}, "cls": {"pooling": "cls"}, "pooler": {"pooling": "pooler"},
    "max": {"pooling": "max"}, "attn": {"pooling": "attention"}, "last": {"pooling": "last"},
    "l3": {"layers": [3], "pooling": "mean"},
    "mid4": {"layers": [-4, -3, -2, -1], "combine": "mean", "pooling": "mean"},
    "cat2": {"layers": [-2, -1], "combine": "concat", "pooling": "cls"},
    "mix": {"layers": "all", "combine": "scalar_mix", "weights": [0, 0, 0, 0, 1, 1, 1],
            "pooling": "mean"},
}


REAL_TOKEN_VIEWS: dict[str, Any] = {
    "tok": {"pooling": "tokens"},
    "top2": {"layers": [-2, -1], "combine": "mean", "pooling": "tokens"},
}


@pytest.fixture(scope="module")
def real_docs(texts: list[str]) -> list[str]:
    from pydoc_data.topics import topics

    return texts + [topics["try"]]  # ~1,700 tokens: 4 chunks of 512


@pytest.fixture(scope="module")
def real_reference(minilm: Path, real_docs: list[str]) -> Any:
    """MiniLM's torch float32 encoding of `real_docs`, every view (made once, for each
    dtype the test below compares)."""
    return extractor(minilm, {**REAL_VIEWS, **REAL_TOKEN_VIEWS}, "torch").encode_texts(real_docs)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, cosine_min", [("float32", 0.9999), ("auto", 0.999)])
def test_real_model_every_view(minilm: Path, real_docs: list[str], real_reference: Any,
                               dtype: str, cosine_min: float) -> None:
    """MiniLM on real reviews and a long document (512-token chunks), every view kind,
    token views included, against torch float32. `auto` is bf16 on a CPU with native bf16
    (documented 0.999; each token vector is held to it as well)."""
    docs, reference = real_docs, real_reference
    views = {**REAL_VIEWS, **REAL_TOKEN_VIEWS}
    ex = extractor(minilm, views, "openvino", dtype=dtype)
    got = ex.encode_texts(docs)
    assert got.chunked.n_chunks[-1] > 1
    for level in ("chunks", "docs"):
        for view in REAL_VIEWS:
            a, b = getattr(got, level)[view], getattr(reference, level)[view]
            assert cosine(a, b).min() >= cosine_min, (level, view)
    assert len(got.tokens["tok"]) == int(got.chunked.n_covered.sum())
    for view in REAL_TOKEN_VIEWS:
        assert cosine(got.tokens[view], reference.tokens[view]).min() >= cosine_min, view
    if ex.runtime.dtype == "float32":
        assert_same_vectors(got.docs, reference.docs)
        assert_same_vectors(got.tokens, reference.tokens)
    # a block-cut job on the real model: layer 3 only runs 3 of 6 blocks
    cut = extractor(minilm, {"l3": REAL_VIEWS["l3"]}, "openvino", dtype=dtype)
    assert cut.needs.blocks_to_run == 3
    l3 = cut.encode_texts(docs).docs["l3"]
    assert cosine(l3, reference.docs["l3"]).min() >= cosine_min
