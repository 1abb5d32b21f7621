"""The OpenVINO runtime: the encoder exported once per (weights, outputs), cached, run on CPU.

Export. `EncoderOutputs` runs the BertModel's own submodules (embeddings, then the blocks
with a 4-D additive padding mask) and returns exactly what the job's views need:

    hidden_states[l] for l in needs.layers     each (B, T, H); 0 = the embedding output
    cls_attention (only for attention pooling) (B, T): the last block's [CLS] row,
        softmax(q_0 · K^T / sqrt(d_head) + mask), averaged over heads, traced from
        `encode.ClsAttention` (the torch runtime's formula)

`openvino.convert_model` turns it into a graph with dynamic B and T. `OpenVINOForward`
runs it as an `encode.Forward`: the pooler, the combines, the poolings and the token rows
stay in `encode.Encoder` and `views.py` and run on these outputs as torch tensors, so
every view, token views included, works the same as on the torch runtime.

Cache. One folder per export key (weights SHA-256, config, needed layers, [CLS] row,
OpenVINO/torch/transformers versions, this module's format number):

    <BERTPIPE_CACHE_DIR or ~/.cache/bertpipe>/openvino/<key>/
        model.xml, model.bin   the IR (float32 weights)
        files.json             the IR files' sizes and model.xml's SHA-256
        key.json               what the key was made of (written last)
        compiled/              compiled blobs per CPU and config (OpenVINO's CACHE_DIR format)

An entry is exported into a temporary folder and renamed into place, so a reader sees a
whole entry or none, and two workers exporting at once both end with the same entry.
Compiled blobs likewise: OpenVINO compiles with a private CACHE_DIR beside compiled/ (the
blobs already there linked in), and each blob it wrote is renamed into compiled/ whole, so
no process reads a half-written blob or has one removed under it while it writes.

A damaged entry (IR files that are not the sizes recorded, or that OpenVINO cannot read or
compile) is set aside with a one-line warning and exported again: a cache is never a
reason for a run to fail.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelError
from ..spec import ModelSpec
from .encode import ClsAttention, find_query_key
from .model import (
    LoadedModel,
    check_pooler,
    load_model,
    max_positions,
)
from .modelfiles import ModelConfig, auto_tokenizer, model_fingerprint, model_shape
from .runtime_choice import CACHE_ENV, cache_base
from .views import ForwardNeeds

log = logging.getLogger(__name__)

# Bump when EncoderOutputs or the export settings change: old entries are then not reused.
# 2: the [CLS] row is encode.ClsAttention (the key projection folded into the query)
EXPORT_FORMAT = 2
INPUTS = ("input_ids", "attention_mask")

# OpenVINO's element type names -> the dtype names the provenance uses
PRECISIONS = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
HINTS = {v: k for k, v in PRECISIONS.items()}

# Exports made by this process (a cache hit makes none): what tests and logs count on.
exports_made = 0


def cache_root() -> Path:
    """Where exported models live: `$BERTPIPE_CACHE_DIR/openvino`, default
    `~/.cache/bertpipe/openvino`."""
    return cache_base() / "openvino"


# ---- the exported graph ---------------------------------------------------------------

class EncoderOutputs(torch.nn.Module):
    """(input_ids (B, T) i64, attention_mask (B, T) i64) -> the hidden states of `layers`
    in ascending order, then the last block's [CLS] attention row when `cls_attention`."""

    def __init__(self, bert: torch.nn.Module, layers: Sequence[int], cls_attention: bool):
        super().__init__()
        model: Any = bert  # a BertModel: attributes as transformers defines them
        blocks = model.encoder.layer  # already cut to the blocks the views need
        self.embeddings = model.embeddings
        self.blocks: Any = blocks
        self.layers = tuple(sorted(layers))
        self.depth = len(blocks) if cls_attention else max(self.layers)
        self.cls_row: ClsAttention | None = None
        if cls_attention:
            _, query, key = find_query_key(blocks[-1])
            self.cls_row = ClsAttention(query, key, int(model.config.num_attention_heads))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        h = self.embeddings(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids))
        keep = attention_mask.bool()  # (B, T)
        padding = ~keep[:, None, None, :]  # (B, 1, 1, T)
        additive = torch.zeros(padding.shape, dtype=h.dtype).masked_fill(
            padding, torch.finfo(h.dtype).min)
        outputs = [h] if 0 in self.layers else []
        cls_row = None
        for i in range(self.depth):
            if self.cls_row is not None and i == len(self.blocks) - 1:
                cls_row = self.cls_row(h, keep)  # (B, T), from the last block's input
            h = self.blocks[i](h, additive)  # BertLayer(hidden, 4-D additive mask)
            if i + 1 in self.layers:
                outputs.append(h)
        if cls_row is not None:
            outputs.append(cls_row)
        return tuple(outputs)


def output_names(layers: Sequence[int], cls_attention: bool) -> list[str]:
    return [f"hidden_{i}" for i in sorted(layers)] + (["cls_attention"] if cls_attention else [])


def export(module: torch.nn.Module, layers: Sequence[int], cls_attention: bool,
           dest: Path) -> None:
    """Convert the float32 torch encoder to an IR in `dest` (model.xml + model.bin)."""
    ov = import_openvino()
    from openvino.frontend.pytorch.ts_decoder import TorchScriptPythonDecoder

    wrapper = EncoderOutputs(module, layers, cls_attention).eval()
    ids = torch.ones((2, 8), dtype=torch.long)  # shapes stay dynamic: any (B, T) runs
    mask = torch.ones((2, 8), dtype=torch.long)
    mask[1, 5:] = 0
    # check_trace off: the wrapper has no data-dependent control flow, and the re-trace
    # that checks it costs more than the conversion (1 s of ~2 s on MiniLM)
    with torch.no_grad(), _telemetry_off(), warnings.catch_warnings():
        # why: transformers' SDPA code turns a shape into a bool while tracing; the value
        # it freezes (not causal) holds for every shape
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        decoder = TorchScriptPythonDecoder(wrapper, example_input=(ids, mask),
                                           trace_kwargs={"check_trace": False})
        graph = ov.convert_model(decoder)
    for port, name in zip(graph.inputs, INPUTS, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(graph.outputs, output_names(layers, cls_attention), strict=True):
        port.get_tensor().set_names({name})
    ov.save_model(graph, str(dest / "model.xml"), compress_to_fp16=False)


def import_openvino() -> Any:
    """`import openvino` with its usage telemetry off.

    openvino reports events to Intel when it is imported and on each conversion unless the
    user opted out in a file in their home (and creates client-id files there); a batch
    job runs on its own and reports nothing. openvino falls back to its own no-op stub
    when its telemetry package cannot be imported, so that package is hidden during the
    first import (nothing else is changed; an openvino the process already imported is
    used as it is)."""
    if "openvino" in sys.modules:
        return sys.modules["openvino"]
    hide = "openvino_telemetry" not in sys.modules
    if hide:
        sys.modules["openvino_telemetry"] = None  # type: ignore[assignment]  # import fails
    try:
        import openvino
    finally:
        if hide and sys.modules.get("openvino_telemetry", False) is None:
            del sys.modules["openvino_telemetry"]
    return openvino


@contextlib.contextmanager
def _telemetry_off() -> Iterator[None]:
    """The converter's telemetry off as well, for an openvino imported before bertpipe's
    (it sends an event per conversion; off also skips ~1.4 s of network attempts):
    openvino's own no-op stub stands in while converting."""
    try:
        stub = importlib.import_module("openvino.tools.ovc.telemetry_stub")
        users: list[Any] = [importlib.import_module(f"openvino.tools.ovc.{name}")
                            for name in ("convert_impl", "telemetry_utils", "utils")]
    except ImportError:
        yield
        return
    saved = [(module, module.tm) for module in users if hasattr(module, "tm")]
    for module, _ in saved:
        module.tm = stub
    try:
        yield
    finally:
        for module, original in saved:
            module.tm = original


# ---- the cache ------------------------------------------------------------------------

def export_key(weights_sha256: dict[str, str], config: dict[str, Any], layers: Sequence[int],
               cls_attention: bool) -> dict[str, Any]:
    """Everything the exported graph depends on."""
    import transformers

    ov = import_openvino()

    return {"format": EXPORT_FORMAT, "weights_sha256": weights_sha256, "config": config,
            "layers": sorted(layers), "cls_attention": cls_attention,
            "openvino": ov.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def key_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def cached_entry(key: dict[str, Any], root: Path | None = None) -> Path | None:
    """The complete cache entry for `key`, or None."""
    entry = (root or cache_root()) / key_id(key)
    return entry if (entry / "key.json").is_file() else None


def cached_export(key: dict[str, Any], export_to: Callable[[Path], None],
                  root: Path | None = None) -> Path:
    """The cache entry for `key`, exported with `export_to(folder)` if it is not there yet."""
    global exports_made
    root = root or cache_root()
    entry = root / key_id(key)
    if (entry / "key.json").is_file():
        log.debug("openvino: cached export %s", entry)
        return entry
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=root))
    except OSError as exc:
        raise ModelError(f"model.runtime: openvino cannot write its cache in {root} "
                         f"({exc.strerror}); set {CACHE_ENV} to a writable folder") from None
    try:
        start = time.perf_counter()
        export_to(tmp)
        (tmp / "compiled").mkdir()
        (tmp / FILES).write_text(json.dumps(file_facts(tmp), indent=1, sort_keys=True))
        (tmp / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may serve several users
        try:
            os.rename(tmp, entry)  # atomic: readers see a whole entry or none
        except OSError:
            if not (entry / "key.json").is_file():
                raise
            # another worker exported the same key meanwhile: theirs is as good as ours
        exports_made += 1
        log.info("openvino: exported the encoder in %.1f s to %s",
                 time.perf_counter() - start, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry


FILES = "files.json"  # the IR files as exported (an entry without it predates the check)
IR_FILES = ("model.xml", "model.bin")


def file_facts(entry: Path) -> dict[str, dict[str, Any]]:
    """What a damaged IR file differs in: every file's size, and the (small) graph's
    SHA-256 (the weights file is not hashed: reading it whole would cost every start)."""
    facts: dict[str, dict[str, Any]] = {name: {"size": (entry / name).stat().st_size}
                                        for name in IR_FILES}
    facts["model.xml"]["sha256"] = hashlib.sha256((entry / "model.xml").read_bytes()
                                                  ).hexdigest()
    return facts


def damage(entry: Path) -> str:
    """Why a complete entry's IR files are not as exported ("" when they are, or when the
    entry predates files.json: OpenVINO's own read then finds what is wrong)."""
    try:
        recorded = json.loads((entry / FILES).read_text())
    except FileNotFoundError:
        return ""
    except (OSError, ValueError):
        return f"{FILES} is unreadable"
    try:
        now = file_facts(entry)
    except OSError as exc:
        return f"{Path(exc.filename or '').name or 'a file'} is missing"
    for name in IR_FILES:
        want, got = recorded.get(name) or {}, now[name]
        if want.get("size") != got["size"]:
            return f"{name} is {got['size']} bytes, {want.get('size')} when exported"
        if "sha256" in want and want["sha256"] != got["sha256"]:
            return f"{name} is not the file exported"
    return ""


def discard(entry: Path, why: str) -> None:
    """Set a damaged entry aside (one rename: other processes see it whole or not at all)
    and remove it, saying so in one line."""
    log.warning("openvino: the cached export %s is damaged (%s); exporting it again",
                entry, why)
    remove_stale(entry.parent, ".damaged-")
    aside = entry.with_name(f".damaged-{entry.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(entry, aside)
    except FileNotFoundError:
        return  # another process set it aside first
    except OSError as exc:
        raise ModelError(f"model.runtime: openvino cannot replace the damaged export "
                         f"{entry} ({exc.strerror}); remove that folder, or set "
                         f"{CACHE_ENV} to another folder") from None
    shutil.rmtree(aside, ignore_errors=True)


def intact_entry(key: dict[str, Any]) -> Path | None:
    """The cache entry for `key` when it is complete and its files are as exported; a
    damaged one is discarded (None: export again)."""
    entry = cached_entry(key)
    if entry is None:
        return None
    why = damage(entry)
    if why:
        discard(entry, why)
        return None
    return entry


# A private compile folder or a set-aside entry this old was left by a process that died
# (a compile takes seconds); younger ones may be another process's at work (any host).
STALE_S = 24 * 3600


def remove_stale(folder: Path, prefix: str) -> None:
    """Remove what dead processes left in `folder` under `prefix` (a day old or more)."""
    for left in folder.glob(prefix + "*"):
        try:
            if time.time() - left.stat().st_mtime >= STALE_S:
                shutil.rmtree(left, ignore_errors=True)
        except OSError:
            continue  # removed by another process meanwhile


@contextlib.contextmanager
def private_cache(shared: Path) -> Iterator[Path]:
    """A CACHE_DIR for one compile: a fresh folder beside `shared` holding links to the
    blobs already in it; afterwards each blob OpenVINO wrote there is renamed into `shared`.

    Why: OpenVINO writes a blob in place and then sets its permissions, and removes a blob
    it cannot read; two processes compiling one model in one CACHE_DIR (two runs on a fresh
    cache) then read each other's half-written blob and remove it under its writer, which
    fails ("cannot set permissions"). A rename within one folder is atomic, and two
    processes renaming the same blob both succeed: the second replaces the first."""
    shared.mkdir(exist_ok=True)
    remove_stale(shared.parent, ".compiling-")
    mine = Path(tempfile.mkdtemp(prefix=f".compiling-{os.getpid()}-", dir=shared.parent))
    try:
        linked = {}
        for blob in shared.iterdir():
            if blob.name.startswith(".") or not blob.is_file():
                continue
            try:
                os.link(blob, mine / blob.name)
            except FileNotFoundError:  # replaced or removed by another process meanwhile
                continue
            except OSError:  # a filesystem without hard links: OpenVINO compiles again
                continue
            linked[blob.name] = (mine / blob.name).stat().st_ino
        yield mine
        for blob in mine.iterdir():
            if blob.is_file() and linked.get(blob.name) != blob.stat().st_ino:
                os.replace(blob, shared / blob.name)  # written by this compile: publish
    finally:
        shutil.rmtree(mine, ignore_errors=True)


# ---- running --------------------------------------------------------------------------

class OpenVINOForward:
    """A compiled model and one infer request: (ids, mask) -> (states, [CLS] attention
    row), see `encode.Forward`."""

    def __init__(self, entry: Path, layers: Sequence[int], cls_attention: bool,
                 precision: str, threads: int):
        ov = import_openvino()
        self.entry = entry
        self.layers = tuple(sorted(layers))
        self.cls_attention = cls_attention
        core = ov.Core()
        # compiled blobs are cached per CPU and config by OpenVINO itself, in a private
        # folder published into the entry's compiled/ (see private_cache)
        with private_cache(entry / "compiled") as cache_dir:
            core.set_property({"CACHE_DIR": str(cache_dir)})
            self.compiled = core.compile_model(str(entry / "model.xml"), "CPU", {
                "PERFORMANCE_HINT": "LATENCY",  # one request at a time, all threads on it
                "INFERENCE_PRECISION_HINT": HINTS[precision],
                "INFERENCE_NUM_THREADS": threads,
            })
        self.request = self.compiled.create_infer_request()

    @property
    def precision(self) -> str:
        """What the CPU plugin actually runs: a bf16 hint is float32 on a CPU without bf16."""
        hint = self.compiled.get_property("INFERENCE_PRECISION_HINT")
        return PRECISIONS.get(hint.get_type_name(), str(hint))

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        # (B, T) int64 CPU tensors, read in place. share_outputs=False: OpenVINO reuses
        # its output buffers on the next infer
        inputs: dict[str, np.ndarray] = {"input_ids": ids.numpy(),
                                         "attention_mask": mask.numpy()}
        results = self.request.infer(inputs, share_inputs=True, share_outputs=False)
        outputs = [torch.from_numpy(results[i]) for i in range(len(results))]
        states = dict(zip(self.layers, outputs, strict=False))  # {layer: (B, T, H) float32}
        return states, outputs[-1] if self.cls_attention else None


def openvino_forward(spec: ModelSpec, config: Any, needs: ForwardNeeds, precision: str,
                     threads: int) -> tuple[LoadedModel, OpenVINOForward]:
    """The model's facts and the job's graph as a forward pass, exported if not cached.

    On a cache hit no torch model is built: the graph holds the weights, and the tokenizer
    and pooler come from the checkpoint's files (this skips ~2 CPU-seconds of importing
    and loading the torch model at every start)."""
    layers = tuple(sorted(needs.layers))
    fingerprint = model_fingerprint(spec.path)
    key = export_key(fingerprint["weights_sha256"], fingerprint["config"], layers,
                     needs.cls_attention)
    weights = list(fingerprint["weights_sha256"])
    entry = intact_entry(key)
    forward = None
    if entry is not None:
        forward = cached_forward(entry, layers, needs.cls_attention, precision, threads)
    if forward is not None and weights and all(w.endswith(".safetensors") for w in weights):
        return weightless_model(spec, config, needs, weights), forward
    # the export is made from the float32 weights; OpenVINO applies the precision
    model = load_model(replace(spec, dtype="float32", device="cpu"),
                       keep_layers=needs.blocks_to_run, need_pooler=needs.pooler)
    if forward is None:
        module = model.module

        def export_to(dest: Path) -> None:
            try:
                export(module, layers, needs.cls_attention, dest)
            except Exception as exc:  # noqa: BLE001 - any conversion failure: one message
                raise ModelError(f"model.runtime: openvino could not export {spec.path!r} "
                                 f"({first_line(exc)}); use model.runtime: torch") from None

        entry = cached_export(key, export_to)
        try:
            forward = OpenVINOForward(entry, layers, needs.cls_attention, precision, threads)
        except RuntimeError as exc:  # OpenVINO's own errors: one line, not a traceback
            raise ModelError(f"model.runtime: openvino could not compile the export of "
                             f"{spec.path!r} in {entry} ({first_line(exc)}); use "
                             "model.runtime: torch") from None
    model.module = WEIGHTLESS  # the graph has the weights now: free the torch copy
    return model, forward


def cached_forward(entry: Path, layers: Sequence[int], cls_attention: bool, precision: str,
                   threads: int) -> OpenVINOForward | None:
    """The cached entry compiled, or None when OpenVINO cannot read or compile it (junk
    model.xml, a weights file that does not match its graph): discarded, with a warning,
    for the caller to export again."""
    try:
        return OpenVINOForward(entry, layers, cls_attention, precision, threads)
    except RuntimeError as exc:
        discard(entry, f"OpenVINO cannot load it: {first_line(exc)}")
        return None


def first_line(exc: BaseException) -> str:
    """The first line that says something: OpenVINO's errors start with lines naming its
    source files ("Exception from src/inference/src/cpp/core.cpp:84:")."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.startswith("Exception from ")]
    return lines[0][:200] if lines else type(exc).__name__


# Stands in for the torch module once the graph holds the weights (nothing calls it).
WEIGHTLESS = torch.nn.Module()


def weightless_model(spec: ModelSpec, config: ModelConfig, needs: ForwardNeeds,
                     weight_files: Sequence[str]) -> LoadedModel:
    """What the pipeline needs besides the graph: tokenizer, sizes, the pooler's W and b."""
    tokenizer = auto_tokenizer(spec)  # chunking calls transformers' tokenizer
    n_layers, hidden_size = model_shape(config)
    pooler = read_pooler(spec.path, weight_files) if needs.pooler else None
    if needs.pooler:
        check_pooler(pooler, spec.path, str(config.model_type))
    return LoadedModel(
        tokenizer=tokenizer,
        module=WEIGHTLESS,
        model_type=config.model_type,
        n_layers=n_layers,
        blocks_run=needs.blocks_to_run,  # the graph computes exactly the blocks needed
        hidden_size=hidden_size,
        # a BERT position table reserves no rows (the module's only say in the limit)
        max_positions=max_positions(config, WEIGHTLESS, tokenizer),
        device=torch.device("cpu"),
        compute_dtype=torch.float32,
        pooler=pooler,
    )


def read_pooler(path: str, weight_files: Sequence[str]) -> torch.nn.Linear | None:
    """The pooler's dense layer straight from the safetensors files (a bare BertModel
    checkpoint names it `pooler.dense`, a task model `bert.pooler.dense`); None without."""
    from safetensors import safe_open

    root = Path(path) if Path(path).is_dir() else _snapshot(path)
    for name in weight_files:
        with safe_open(str(root / name), framework="pt") as f:
            keys = set(f.keys())
            for prefix in ("pooler.dense.", "bert.pooler.dense."):
                if {prefix + "weight", prefix + "bias"} <= keys:
                    weight, bias = f.get_tensor(prefix + "weight"), f.get_tensor(prefix + "bias")
                    dense = torch.nn.Linear(weight.shape[1], weight.shape[0])
                    with torch.no_grad():
                        dense.weight.copy_(weight.float())
                        dense.bias.copy_(bias.float())
                    return dense.eval()
    return None


def _snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, local_files_only=True))
