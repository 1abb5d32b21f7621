"""The partition pipeline (run/partition_pipeline.py) and the executors that run it:
prepared ahead of the encoder, the same store as the sequential path, bit for bit, and the
same vectors as plain `transformers`; bounded, in order, one write in flight, and a
partition's failure reported as before."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import pipeline
from pipeline.errors import InputError, PartitionError
from pipeline.extract.partition import Extractor
from pipeline.extract.source import Partition
from pipeline.run.executors import InProcessExecutor
from pipeline.run.partition_pipeline import (
    Failed,
    Failures,
    PartitionOutcome,
    PartitionPipeline,
    Written,
    prepare_depth,
    report,
)
from pipeline.run.record import RunSummary
from pipeline.run.runner import run_job
from pipeline.spec import Job
from pipeline.stores import Staging
from pipeline.stores.lock import LockLostError
from pipeline.stores.markers import PartitionMarker
from tests.conftest import REVIEWS, job_dict

CHUNK_TOKENS = 64  # small enough that some reviews and the long text make several chunks


# ---- the pipeline's lanes and bounds, on a stand-in extractor ---------------------------

STATS = {"n_chunks": 1, "n_tokens": 1, "n_covered": 1, "n_encoded": 3, "n_unique": 1}


class Stand:
    """What the pipeline asks of an extractor and a staging area, logging each step with
    its thread: `prepare` fails for the indices in `bad`; `finish` runs `batches` forward
    passes of `seconds` each; `write_part` takes `write_s`."""

    def __init__(self, bad: tuple[int, ...] = (), batches: int = 1, seconds: float = 0.0,
                 write_s: float = 0.0):
        self.log: list[tuple[str, int, str]] = []
        self.bad, self.batches, self.seconds, self.write_s = bad, batches, seconds, write_s
        self.writing = 0
        self.most_writing = 0
        self.model = SimpleNamespace(device=torch.device("cpu"))
        self.runtime = SimpleNamespace(name="torch", dtype="float32")
        self.encoder = SimpleNamespace(on_batch=None)

    def _note(self, step: str, index: int) -> None:
        self.log.append((step, index, threading.current_thread().name))

    def prepare(self, part: Partition, pad: bool = False) -> Any:
        self._note("prepare", part.index)
        if part.index in self.bad:
            raise ValueError(f"partition {part.index} is unreadable")
        return SimpleNamespace(part=part)

    def finish(self, prepared: Any) -> Any:
        for k in range(self.batches):
            time.sleep(self.seconds)
            self.encoder.on_batch(k + 1, self.batches)
        self._note("encoded", prepared.part.index)
        return SimpleNamespace(docs=pa.table({"row": [prepared.part.index]}), chunks=None,
                               tokens=None, stats=STATS)

    def write_part(self, marker: Any, tables: dict[str, Any]) -> Any:
        self.writing += 1
        self.most_writing = max(self.most_writing, self.writing)
        time.sleep(self.write_s)
        self._note("written", marker.index)
        self.writing -= 1
        return marker


def _parts(n: int) -> list[Partition]:
    return [Partition(i, "in.parquet", 10 * i, 10 * i + 10, 0) for i in range(n)]


def _run(stand: Stand, depth: int, n: int) -> list[PartitionOutcome]:
    pipeline = PartitionPipeline(cast(Extractor, stand), depth)
    try:
        futures = [pipeline.submit(p, cast(Staging, stand), "fp") for p in _parts(n)]
        return [f.result() for f in futures]
    finally:
        pipeline.close()


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_partitions_are_prepared_in_order_never_more_than_depth_ahead(depth: int) -> None:
    stand = Stand(seconds=0.01)  # the encoder is the slower side: the look-ahead fills up
    outcomes = _run(stand, depth, 12)
    assert [o.marker.index for o in outcomes if isinstance(o, Written)] == list(range(12))
    assert outcomes[5].marker.rows == (50, 60) and outcomes[5].marker.fingerprint == "fp"
    steps = {step: [i for s, i, _ in stand.log if s == step]
             for step in ("prepare", "encoded", "written")}
    assert steps == {step: list(range(12)) for step in steps}
    lead, encoded = [], 0  # at each prepare: partitions ahead of the one the encoder holds
    for step, index, _ in stand.log:
        encoded += step == "encoded"
        if step == "prepare":
            lead.append(index - encoded)
    assert max(lead) == depth  # reached, never passed
    preparers = {thread for step, _, thread in stand.log if step == "prepare"}
    encoders = {thread for step, _, thread in stand.log if step == "encoded"}
    assert len(encoders) == 1 and encoders != {threading.current_thread().name}
    assert preparers == (encoders if depth == 0 else preparers - encoders)


def test_one_write_in_flight_in_submission_order() -> None:
    stand = Stand(write_s=0.02)  # the writer is the slower side
    _run(stand, 1, 6)
    assert stand.most_writing == 1
    assert [i for step, i, _ in stand.log if step == "written"] == list(range(6))


@pytest.mark.parametrize("depth", [0, 1])
def test_a_failed_partition_is_its_own_outcome_and_the_rest_go_on(depth: int) -> None:
    outcomes = _run(Stand(bad=(2,)), depth, 5)
    failed = outcomes[2]
    assert isinstance(failed, Failed) and failed.part.index == 2
    assert isinstance(failed.error, ValueError)
    assert str(failed.error) == "partition 2 is unreadable"
    assert [o.part.index for o in outcomes if isinstance(o, Written)] == [0, 1, 3, 4]


def test_closing_stops_an_encoding_at_its_next_batch_and_writes_nothing_more() -> None:
    stand = Stand(batches=50, seconds=0.01)
    pipeline = PartitionPipeline(cast(Extractor, stand), 1)
    futures = [pipeline.submit(p, cast(Staging, stand), "fp") for p in _parts(2)]
    while not stand.log:  # the first partition is on its way
        time.sleep(0.001)
    pipeline.close()
    assert not any(t.name.startswith("bertpipe-") for t in threading.enumerate())
    assert not [step for step, _, _ in stand.log if step in ("encoded", "written")]
    assert all(isinstance(f.result(), Failed) for f in futures if not f.cancelled())


def test_outcomes_are_reported_alike_for_every_executor() -> None:
    part = _parts(1)[0]
    marker = cast(PartitionMarker, "the marker")
    done: list[tuple[Partition, PartitionMarker]] = []
    failures: Failures = []
    report(Written(part, marker), lambda p, m: done.append((p, m)), failures)
    report(Failed(part, OSError("the disk went away\nwith a second line")), done.append,
           failures)
    report(Failed(part, InputError("input.path: no such file")), done.append, failures)
    assert done == [(part, marker)]
    assert [(p, type(e), str(e)) for p, e in failures] == [
        (part, PartitionError, "OSError: the disk went away"),
        (part, InputError, "input.path: no such file")]
    with pytest.raises(LockLostError):
        report(Failed(part, LockLostError("another run took the lock")), done.append, failures)


# ---- the executor, on the real model ---------------------------------------------------

@pytest.fixture(scope="module")
def mixed_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Distinct reviews, one long document, a repeated text and an empty one, in row
    groups of a partition each."""
    from pydoc_data.topics import topics

    texts: list[str | None] = pq.read_table(REVIEWS).column("text").to_pylist()[:30]
    texts[7:7] = [topics["assignment"][:4000], texts[3], "", None]
    path = tmp_path_factory.mktemp("feed") / "mixed.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path,
                   row_group_size=6)
    return path


def _job(source: Path, model: Path, out: Path) -> Job:
    return Job.from_dict(job_dict(
        source, model, out, chunking={"strategy": "hierarchical", "max_tokens": CHUNK_TOKENS},
        views={"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"},
               "max2": {"layers": [2], "pooling": "max"}},
        execution={"scheduler": "synchronous", "partition_rows": 6}))


def _store(source: Path, model: Path, out: Path, ahead: int) -> pipeline.Store:
    job = _job(source, model, out)
    run_job(job, InProcessExecutor(Extractor(job), ahead=ahead))
    return pipeline.open_store(out)


@pytest.fixture(scope="module")
def stores(mixed_input: Path, minilm: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[int, pipeline.Store]:
    tmp = tmp_path_factory.mktemp("feed-stores")
    return {ahead: _store(mixed_input, minilm, tmp / f"ahead-{ahead}.zarr", ahead)
            for ahead in (0, 2)}


@pytest.mark.slow
def test_prepared_ahead_writes_the_sequential_store_bit_for_bit(
        stores: dict[int, pipeline.Store]) -> None:
    sequential, ahead = stores[0], stores[2]
    assert ahead.chunks is not None and sequential.chunks is not None
    assert ahead.chunks.sizes["chunk"] > 40  # several partitions of several chunks
    for level in ("docs", "chunks"):
        got, want = getattr(ahead, level), getattr(sequential, level)
        assert set(got.data_vars) == set(want.data_vars)
        for name in want.data_vars:
            a, b = got[name].values, want[name].values
            assert a.dtype == b.dtype and a.shape == b.shape, (level, name)
            if a.dtype.kind == "f":  # NaN rows (the empty texts) compare equal too
                assert np.array_equal(a, b, equal_nan=True), (level, name)
            else:
                assert (a == b).all(), (level, name)


@pytest.fixture(scope="module")
def oracle(mixed_input: Path, minilm: Path, stores: dict[int, pipeline.Store]
           ) -> dict[str, np.ndarray]:
    """Plain transformers, one chunk at a time (no padding): each chunk is the tokens of
    its text whose characters start inside the chunk's span, as transformers' own
    tokenizer cuts them, between [CLS] and [SEP]; a document is the token-weighted mean
    of its chunks."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm, local_files_only=True)
    model = AutoModel.from_pretrained(minilm, local_files_only=True,
                                      attn_implementation="eager").eval()
    texts = pq.read_table(mixed_input).column("text").to_pylist()
    chunks = stores[2].chunks
    assert chunks is not None
    out: dict[str, list[np.ndarray]] = {"mean": [], "cls": [], "max2": [], "n": []}
    with torch.inference_mode():
        for doc, start, end in zip(chunks["doc"].values, chunks["start"].values,
                                   chunks["end"].values, strict=True):
            enc = tok(texts[doc], add_special_tokens=False, return_offsets_mapping=True)
            own = [i for i, (s, _) in zip(enc["input_ids"], enc["offset_mapping"],
                                          strict=True) if start <= s < end]
            ids = torch.tensor([[tok.cls_token_id, *own, tok.sep_token_id]])
            o = model(input_ids=ids, output_hidden_states=True)
            out["mean"].append(o.last_hidden_state[0].double().mean(0).numpy())
            out["cls"].append(o.last_hidden_state[0, 0].double().numpy())
            out["max2"].append(o.hidden_states[2][0].double().max(0).values.numpy())
            out["n"].append(np.array(ids.shape[1]))
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.slow
def test_prepared_ahead_equals_transformers(stores: dict[int, pipeline.Store],
                                            oracle: dict[str, np.ndarray]) -> None:
    store = stores[2]
    chunks = store.chunks
    assert chunks is not None
    assert (chunks["n_tokens"].values == oracle["n"]).all()  # the same chunks
    doc_of = chunks["doc"].values
    for view in ("mean", "cls", "max2"):
        np.testing.assert_allclose(store.chunks[view].values, oracle[view], atol=2e-4,
                                   rtol=1e-3, err_msg=view)
        weights = oracle["n"].astype(np.float64)
        for doc in np.unique(doc_of):
            mine = doc_of == doc
            want = (oracle[view][mine] * weights[mine, None]).sum(0) / weights[mine].sum()
            np.testing.assert_allclose(store.vectors(view)[doc], want, atol=2e-4, rtol=1e-3,
                                       err_msg=f"{view} doc {doc}")


# ---- the executor: overlap, failures, the policy --------------------------------------------

class SlowForward:
    """The model's own forward pass after a pause per batch: time in which the next
    partition is prepared, if anything prepares it."""

    def __init__(self, forward: Any, seconds: float):
        self.forward, self.seconds = forward, seconds

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        time.sleep(self.seconds)
        return self.forward(ids, mask)


def _instrumented(job: Job, events: list[tuple[str, int]]) -> Extractor:
    """An extractor that logs when each partition's preparing starts and its encoding
    ends (list.append is atomic: both threads log into one list)."""
    ex = Extractor(job)
    prepare, finish = ex.prepare, ex.finish
    ex.encoder.forward = SlowForward(ex.encoder.forward, 0.05)

    def logged_prepare(part: Any, pad: bool = False) -> Any:
        events.append(("prepare", part.index))
        return prepare(part, pad)

    def logged_finish(prepared: Any) -> Any:
        tables = finish(prepared)
        events.append(("encoded", prepared.part.index))
        return tables

    ex.prepare = logged_prepare  # type: ignore[method-assign]
    ex.finish = logged_finish  # type: ignore[method-assign]
    return ex


@pytest.mark.parametrize("ahead", [0, 1])
def test_the_next_partition_is_prepared_while_this_one_encodes(
        ahead: int, tiny_bert: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.parquet"
    texts = [" ".join(["the drug worked"] * (i % 5 + 1)) + f" day {i}" for i in range(24)]
    pq.write_table(pa.table({"id": list(range(24)), "text": texts}), source)
    job = Job.from_dict(job_dict(source, tiny_bert, tmp_path / "o.zarr",
                                 execution={"scheduler": "synchronous", "partition_rows": 6}))
    events: list[tuple[str, int]] = []
    run_job(job, InProcessExecutor(_instrumented(job, events), ahead=ahead))
    at = {event: n for n, event in enumerate(events)}
    for k in range(3):  # preparing k + 1 starts before k is encoded only when ahead
        assert (at["prepare", k + 1] < at["encoded", k]) == bool(ahead)
    for k in range(3 - ahead):  # and never more than `ahead` partitions ahead
        assert at["prepare", k + 1 + ahead] > at["encoded", k]


def _failing_read(monkeypatch: pytest.MonkeyPatch, bad: int) -> None:
    from pipeline.extract import partition

    read = partition.read_partition

    def read_or_fail(spec: Any, part: Any, cache: Any = None) -> Any:
        if part.index == bad:
            raise OSError("the disk went away\nwith a second line nobody should see")
        return read(spec, part, cache)

    monkeypatch.setattr(partition, "read_partition", read_or_fail)


def test_a_partition_that_fails_to_prepare_is_reported_as_before(
        tiny_bert: Path, small_texts: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_read(monkeypatch, bad=0)
    reported = {}
    for ahead in (0, 1):
        job = Job.from_dict(job_dict(small_texts, tiny_bert, tmp_path / f"o{ahead}.zarr",
                                     execution={"scheduler": "synchronous",
                                                "partition_rows": 3}))
        summary = RunSummary(job.output.path)
        with pytest.raises(PartitionError) as failed:
            run_job(job, InProcessExecutor(Extractor(job), ahead=ahead), summary=summary)
        reported[ahead] = (str(failed.value), summary.failed, summary.run)
    assert reported[1] == reported[0]
    message, failed_parts, ran = reported[1]
    assert failed_parts == ["partition 0 (rows 0-2; small.parquet rows 0-2): "
                            "OSError: the disk went away"]
    assert ran == 3 and "\n" not in message  # the other partitions were written


def test_prepared_ahead_only_where_the_encoder_runs_on_a_device(tiny_bert: Path,
                                                                tmp_path: Path) -> None:
    job = Job.from_dict(job_dict(tmp_path / "x.parquet", tiny_bert, tmp_path / "o.zarr"))
    ex = Extractor(job)
    assert prepare_depth(ex) == 0
    ex.model.device = torch.device("cuda")  # what the policy reads; nothing runs here
    assert prepare_depth(ex) == 1


# ---- padding -------------------------------------------------------------------------------

def test_batches_are_padded_as_a_loop_over_rows_pads_them(tiny_bert: Path,
                                                          tmp_path: Path) -> None:
    job = Job.from_dict(job_dict(tmp_path / "x.parquet", tiny_bert, tmp_path / "o.zarr"))
    encoder = Extractor(job).encoder
    rng = np.random.default_rng(0)
    sequences = [rng.integers(5, 60, rng.integers(1, 30)).tolist() for _ in range(9)]
    plan = encoder.pad(encoder.plan(sequences, job.batching))
    for idx, (ids, mask) in zip(plan.batches, plan.padded, strict=True):
        rows = [sequences[i] for i in idx]
        assert ids.dtype == mask.dtype == torch.long and not ids.is_pinned()
        for row, seq in enumerate(rows):
            assert ids[row].tolist() == seq + [encoder.pad_id] * (ids.shape[1] - len(seq))
            assert mask[row].tolist() == [1] * len(seq) + [0] * (ids.shape[1] - len(seq))
        assert ids.shape[1] == max(len(s) for s in rows)


# ---- a device that queues its work (a CUDA stream) ------------------------------------------

class QueuingForward:
    """The model's forward pass presented as a device that queues work presents it: a call
    logs its launch, and `record()` a waiter that logs the wait for that batch."""

    def __init__(self, forward: Any, log: list[tuple[str, int]]):
        self.forward, self.log, self.launched = forward, log, 0

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        self.log.append(("launch", self.launched))
        self.launched += 1
        return self.forward(ids, mask)

    def record(self) -> Any:
        batch = self.launched - 1
        return lambda: self.log.append(("wait", batch))


def test_a_queuing_device_gets_the_next_batch_before_the_host_waits_for_this_one(
        tiny_bert: Path, tmp_path: Path) -> None:
    views = {"mean": {"pooling": "mean"}, "cls": {"pooling": "cls"},
             "per_token": {"pooling": "tokens", "layers": [-2]}}
    job = Job.from_dict(job_dict(tmp_path / "x.parquet", tiny_bert, tmp_path / "o.zarr",
                                 views=views, batching={"max_batch_size": 2}))
    encoder = Extractor(job).encoder
    rng = np.random.default_rng(1)
    sequences = [rng.integers(5, 60, rng.integers(2, 30)).tolist() for _ in range(9)]
    keep = [(1, len(s) - 1) for s in sequences]
    want = encoder.encode(sequences, job.batching, keep)  # the CPU runtime: nothing queued

    log: list[tuple[str, int]] = []
    progress: list[int] = []
    encoder.forward = QueuingForward(encoder.forward, log)
    encoder.on_batch = lambda done, total: progress.append(done)
    got = encoder.encode(sequences, job.batching, keep)

    batches = len(encoder.plan(sequences, job.batching).batches)
    assert batches == 5
    # launch 0, launch 1, wait 0, launch 2, wait 1, ...: one batch queued ahead, never two
    assert log == [("launch", 0)] + [e for k in range(1, batches)
                                     for e in (("launch", k), ("wait", k - 1))] + [
                   ("wait", batches - 1)]
    assert progress == list(range(1, batches + 1))
    assert got.keys() == want.keys()
    for view, rows in want.items():
        np.testing.assert_array_equal(got[view], rows, err_msg=view)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_are_pinned_and_agree_with_the_cpu(minilm: Path, tmp_path: Path) -> None:
    texts = pq.read_table(REVIEWS).column("text").to_pylist()[:64]
    vectors = {}
    for device in ("cpu", "cuda"):
        raw = job_dict(tmp_path / "x.parquet", minilm, tmp_path / "o.zarr")
        raw["model"]["device"] = device
        ex = Extractor(Job.from_dict(raw))
        prepared = ex.prepare_texts(texts, pad=True)
        assert all(ids.is_pinned() == (device == "cuda") for ids, _ in prepared.plan.padded)
        vectors[device] = ex.encode_prepared(prepared).docs
    for view, want in vectors["cpu"].items():
        np.testing.assert_allclose(vectors["cuda"][view], want, atol=1e-4, err_msg=view)


# ---- the Dask executor ------------------------------------------------------------------

@pytest.fixture
def gpu_labelled_cluster() -> Iterator[str]:
    """One in-process worker thread offering GPU=1, as a GPU worker does (the model still
    runs on the CPU here): the address of its scheduler."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      resources={"GPU": 1}, dashboard_address=None) as cluster:
        yield cluster.scheduler_address


@pytest.mark.cluster
def test_a_dask_gpu_worker_prepares_ahead_and_writes_the_same_store(
        gpu_labelled_cluster: str, tiny_bert: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.run import dask_executor
    from pipeline.run.dask_executor import DaskExecutor

    source = tmp_path / "in.parquet"
    texts = [" ".join(["the drug worked"] * (i % 5 + 1)) + f" day {i}" for i in range(24)]
    pq.write_table(pa.table({"id": list(range(24)), "text": texts}), source)
    events: list[tuple[str, int]] = []
    prepare, finish = Extractor.prepare, Extractor.finish

    def logged_prepare(self: Extractor, part: Any, pad: bool = False) -> Any:
        events.append(("prepare", part.index))
        return prepare(self, part, pad)

    def slow_finish(self: Extractor, prepared: Any) -> Any:
        time.sleep(0.2)  # a slow device: time in which the next partition is prepared
        tables = finish(self, prepared)
        events.append(("encoded", prepared.part.index))
        return tables

    monkeypatch.setattr(Extractor, "prepare", logged_prepare)
    monkeypatch.setattr(Extractor, "finish", slow_finish)
    stores = {}
    for ahead in (0, 1):
        # the policy as it reads a GPU worker's encoder; the model itself runs on the CPU
        monkeypatch.setattr(dask_executor, "prepare_depth", lambda extractor, d=ahead: d)
        raw = job_dict(source, tiny_bert, tmp_path / f"dask-{ahead}.zarr",
                       execution={"scheduler": gpu_labelled_cluster, "partition_rows": 6})
        raw["model"]["device"] = "auto"  # may use a GPU: the tasks ask for the resource
        events.clear()
        run_job(Job.from_dict(raw), DaskExecutor(gpu_labelled_cluster))
        stores[ahead] = pipeline.open_store(tmp_path / f"dask-{ahead}.zarr")
        # partitions started but not yet encoded, at each event: one at a time in turn;
        # with one prepared ahead, two (Dask picks the order of the partitions)
        in_flight = np.cumsum([1 if kind == "prepare" else -1 for kind, _ in events])
        assert in_flight.max() == 1 + ahead, events
        assert sorted(k for kind, k in events if kind == "encoded") == [0, 1, 2, 3]
    for view in ("mean", "cls"):
        assert np.array_equal(stores[1].vectors(view), stores[0].vectors(view))
    assert (stores[1].docs["id"].values == stores[0].docs["id"].values).all()
