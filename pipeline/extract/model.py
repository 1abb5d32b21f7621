"""Loading an encoder: offline only, safetensors unless allowed, device and dtype chosen once.

`LoadedModel` is what a worker keeps in memory for the whole job: the tokenizer, the
torch module (cut down to the layers the views need), and the facts the rest of the
pipeline asks about (layer count, position limit, the pooler's weights). What differs
between encoder families lives in `families`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelError, first_line
from ..spec import ModelSpec
from .families import (
    check_cls_attention,
    check_pooler,
    cut_blocks,
    reserved_positions,
    take_pooler,
)
from .modelfiles import (
    ModelConfig,
    auto_tokenizer,
    capped_by_tokenizer,
    import_tqdm_quietly,
    load_config,
    model_shape,
)
from .runtime_choice import cpu_has_bf16, resolve_device


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
    tokenizer = auto_tokenizer(spec)  # chunking calls transformers' tokenizer
    module, missing = load_weights(spec)
    model_type = config.model_type
    n_layers, hidden_size = model_shape(config)
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
        hidden_size=hidden_size,
        max_positions=max_positions(config, module, tokenizer),
        device=device,
        compute_dtype=compute_dtype,
        pooler=None if pooler is None else pooler.float().eval().to(device),
    )



import_tqdm_quietly()  # transformers is imported below, on first use

# ---- files: modelfiles.py reads them without torch -----------------------------------

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


# ---- dtype, positions -------------------------------------------------------

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


def max_positions(config: ModelConfig, module: torch.nn.Module, tokenizer: Any) -> int:
    """Tokens per sequence the model can take, special tokens included: its position
    table less the rows it never uses, capped by the tokenizer's own limit."""
    limit = config.max_position_embeddings - reserved_positions(module)
    return capped_by_tokenizer(limit, tokenizer)
