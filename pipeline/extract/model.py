"""Loading an encoder: offline only, safetensors unless allowed, device and dtype chosen once.

`LoadedModel` is what a worker keeps in memory for the whole job: the tokenizer, the
torch module (cut down to the layers the views need), and the facts the rest of the
pipeline asks about (layer count, position limit, the pooler's weights). What differs
between encoder families lives in `families`.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError, first_line
from ..fileutil import sha256_file
from ..spec import ModelSpec
from .families import (
    check_cls_attention,
    check_pooler,
    cut_blocks,
    reserved_positions,
    take_pooler,
)

# model types whose position table starts after padding_idx (RoBERTa-style embeddings): what
# `reserved_positions` finds on a loaded module, known from the config before loading
PADDING_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert", "longformer",
                                      "roberta-prelayernorm", "xlm-roberta-xl"})



@dataclass
class LoadedModel:
    tokenizer: Any
    module: torch.nn.Module
    model_type: str
    n_layers: int  # transformer blocks; hidden_states has n_layers + 1 entries
    blocks_run: int  # blocks one forward pass computes (fewer than n_layers when cut)
    hidden_size: int
    max_positions: int  # usable positions per sequence, special tokens included
    device: torch.device
    compute_dtype: torch.dtype  # the weights' dtype: float32, bfloat16 or float16
    pooler: torch.nn.Linear | None  # the pooler's dense W, b in float32; None without one


def load_model(
    spec: ModelSpec, keep_layers: int | None = None, need_pooler: bool = False,
    need_cls_attention: bool = False,
) -> LoadedModel:
    """Load tokenizer and encoder from a local directory or the offline cache.

    `keep_layers`: run only the first k transformer blocks (views need nothing above).
    `need_pooler`: refuse a checkpoint whose pooler weights are absent, because
    transformers would silently initialise a random one.
    `need_cls_attention`: refuse a family whose [CLS] attention cannot be recomputed exactly.
    """
    config = load_config(spec)
    tokenizer = load_tokenizer(spec)
    module, missing = load_weights(spec)
    model_type = str(config.model_type)
    n_layers = int(config.num_hidden_layers)
    pooler = take_pooler(module, missing)
    if need_pooler:
        check_pooler(pooler, spec.path, model_type)
    if need_cls_attention:
        check_cls_attention(model_type)
    blocks_run = cut_blocks(module, n_layers, keep_layers)
    device = resolve_device(spec.device)
    compute_dtype = resolve_dtype(spec.dtype, device)
    # Half-precision weights rather than autocast: no per-batch weight casts (measured
    # ~5% faster on a 2-core AVX512-BF16 CPU, cosine to fp32 >= 0.9998). The pooler is
    # applied to float32 states by the `pooler` pooling, so it stays float32.
    module.eval().to(device=device, dtype=compute_dtype)
    return LoadedModel(
        tokenizer=tokenizer,
        module=module,
        model_type=model_type,
        n_layers=n_layers,
        blocks_run=blocks_run,
        hidden_size=int(config.hidden_size),
        max_positions=max_positions(config, module, tokenizer),
        device=device,
        compute_dtype=compute_dtype,
        pooler=None if pooler is None else pooler.float().eval().to(device),
    )



def _import_tqdm_quietly() -> None:
    """Import tqdm.auto once, its widget warning silenced. huggingface_hub imports it under
    transformers, and in a Jupyter kernel without ipywidgets that first import warns
    'IProgress not found' into the user's notebook; bertpipe draws no widget (its own
    model loading turns the bar off), so the warning says nothing to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import tqdm.auto  # noqa: F401


_import_tqdm_quietly()

# ---- files ---------------------------------------------------------------------------

def load_config(spec: ModelSpec) -> Any:
    """The model's config, from a local directory or the offline cache (never the network)."""
    from huggingface_hub.errors import HFValidationError
    from transformers import AutoConfig

    if Path(spec.path).is_absolute() and not Path(spec.path).is_dir():
        raise ModelError(f"model.path: {spec.path} does not exist (a local model directory, "
                         "or a hub id already in the local cache)")
    try:
        return AutoConfig.from_pretrained(spec.path, local_files_only=True,
                                          trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError, HFValidationError) as exc:
        if not Path(spec.path).is_absolute() and not _in_hub_cache(spec.path):
            # a relative path that is no folder here was kept as a hub id (spec._model_path):
            # say that neither exists, not that the hub could not be reached
            raise ModelError(f"model.path: {spec.path!r} does not exist: no folder "
                             f"{Path(spec.path).absolute()}, and no hub id {spec.path!r} in "
                             "the local Hugging Face cache (models are never downloaded)"
                             ) from None
        raise ModelError(f"model.path: cannot load {spec.path!r} offline: {first_line(exc)}"
                         ) from None


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds anything of `repo_id`."""
    try:
        _cached_snapshot(repo_id)
    except Exception:  # noqa: BLE001 - not a valid id, or not cached: either way, not there
        return False
    return True


def check_weights(spec: ModelSpec) -> None:
    """The weight files the loader will take are there (safetensors, or .bin with
    `allow_pickle`), told from their names alone: a folder with a config and a tokenizer
    but no usable weights is refused before a store is made, not when a worker loads it."""
    root = Path(spec.path)
    if not root.is_dir():
        try:
            root = _cached_snapshot(spec.path)
        except Exception:  # noqa: BLE001 - not in the cache: load_config said so already
            return
    if any(root.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in root.glob("*.bin"))
    if pickled and spec.allow_pickle:
        return
    if pickled:
        raise ModelError(f"model.path: {spec.path!r} has only pickle weights "
                         f"({', '.join(pickled[:3])}); convert them to safetensors, or set "
                         "model.allow_pickle: true if you trust their source")
    raise ModelError(f"model.path: {spec.path!r} has no weights (no *.safetensors"
                     f"{' or *.bin' if spec.allow_pickle else ''} file)")


def load_tokenizer(spec: ModelSpec) -> Any:
    """The fast tokenizer: chunking needs its offsets mapping."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.path, use_fast=True,
                                                  local_files_only=True,
                                                  trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelError(f"model.path: cannot load the tokenizer of {spec.path!r} offline: "
                         f"{first_line(exc)}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ModelError(f"model.path: {spec.path!r} has no fast tokenizer (tokenizer.json)")
    return tokenizer


def model_shape(config: Any, key: str = "model.path") -> tuple[int, int]:
    """(transformer blocks, hidden size) from a config, or a ModelError naming what is
    missing (an encoder config always has both)."""
    try:
        return int(config.num_hidden_layers), int(config.hidden_size)
    except (AttributeError, TypeError, ValueError):
        raise ModelError(f"{key}: its config.json gives no num_hidden_layers/hidden_size; "
                         "not a BERT-family encoder") from None


def has_pooler_weights(path: str) -> bool | None:
    """Whether the safetensors weights hold a pooler, read from the file headers only;
    None when that cannot be told without loading (pickle weights, no local files)."""
    from safetensors import safe_open

    root = Path(path)
    if not root.is_dir():
        try:
            root = _cached_snapshot(path)
        except Exception:  # noqa: BLE001 - not in the cache: the loader reports it
            return None
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return None
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                if any(k.endswith("pooler.dense.weight") or k == "pooler.weight"
                       for k in handle.keys()):
                    return True
    except (OSError, ValueError, RuntimeError):
        return None  # an unreadable header: the loader reports it with its own message
    return False


def load_weights(spec: ModelSpec) -> tuple[torch.nn.Module, set[str]]:
    """The bare encoder in float32 and the pooler weights the checkpoint lacks.

    A fine-tuned checkpoint (e.g. `BertForSequenceClassification`) loads its encoder: its
    head's weights are unexpected keys and dropped. Any other missing or mis-shaped weight
    is refused, because transformers would initialise it at random without a word.
    """
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # why: a per-load bar in batch logs is noise
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module, info = AutoModel.from_pretrained(
                spec.path, output_loading_info=True, dtype=torch.float32,
                use_safetensors=None if spec.allow_pickle else True,
                local_files_only=True, trust_remote_code=spec.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - a damaged .bin fails inside the unpickler as
        # anything (UnpicklingError, IndexError, EOFError, ...): all mean unusable weights
        hint = "" if spec.allow_pickle else " (safetensors only unless model.allow_pickle: true)"
        raise ModelError(f"model.path: cannot load weights of {spec.path!r}{hint}: "
                         f"{first_line(exc)}") from None
    missing = set(info.get("missing_keys", ()))
    absent = sorted(k for k in missing if not k.startswith("pooler."))
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k)
                        for k in info.get("mismatched_keys", ()))
    if absent or mismatched:
        raise ModelError(f"model.path: {spec.path!r} lacks weights for "
                         f"{(absent + mismatched)[:3]}")
    return module, {k for k in missing if k.startswith("pooler.")}


def model_fingerprint(path: str) -> dict[str, Any]:
    """SHA-256 of each weight file plus the config: what the provenance records."""
    root = Path(path)
    if not root.is_dir():
        root = _cached_snapshot(path)
    weights = sorted(p for p in root.rglob("*")
                     if p.suffix in (".safetensors", ".bin") and p.is_file())
    digests = {str(p.relative_to(root)): sha256_file(p) for p in weights}
    config_path = root / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return {"path": path, "weights_sha256": digests, "config": config}


def _cached_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, local_files_only=True))


# ---- device, dtype, positions -------------------------------------------------------

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError("model.device: cuda requested but no CUDA device is available")
    return torch.device(name)


def cpu_has_bf16() -> bool:
    """True where the CPU runs bf16 matmuls natively (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if name == "float16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def max_positions(config: Any, module: torch.nn.Module, tokenizer: Any) -> int:
    """Tokens per sequence the model can take, special tokens included: its position
    table less the rows it never uses, capped by the tokenizer's own limit."""
    limit = int(getattr(config, "max_position_embeddings", 512)) - reserved_positions(module)
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < limit:
        limit = tok_limit
    return limit


def max_positions_of(config: Any, tokenizer: Any) -> int:
    """The same limit read from the config alone (validation, before any weights load):
    RoBERTa-style position tables reserve padding_idx + 1 rows, as `reserved_positions`
    finds on a loaded module."""
    limit = int(getattr(config, "max_position_embeddings", 512))
    if getattr(config, "model_type", "") in PADDING_OFFSET_POSITIONS:
        limit -= int(getattr(config, "pad_token_id", 1) or 0) + 1
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < limit:
        limit = tok_limit
    return limit

