"""Which runtime runs the encoder, chosen once per worker from `model.runtime`.

    torch     PyTorch: the float32 reference, every model family, every GPU run
    openvino  OpenVINO on the CPU (fused attention, LayerNorm and GELU kernels), with the
              job's graph exported once per weights and outputs and cached
              (runtime_openvino.py); refused where it cannot run
    auto      openvino on the CPU when it is installed and the model is a BERT, else torch

Both runtimes feed the same views (views.py) with float32 hidden states, so a view's
vectors agree within float32 rounding whichever runtime made them.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelError
from ..spec import ModelSpec
from .encode import Encoder
from .model import LoadedModel, load_model, resolve_device, resolve_dtype
from .views import ForwardNeeds, ResolvedView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """What the partition markers and the provenance record."""

    name: str  # torch | openvino
    dtype: str  # what the encoder computes in: float32, bfloat16 or float16


def openvino_installed() -> bool:
    return importlib.util.find_spec("openvino") is not None


def openvino_supports(config: Any) -> bool:
    """BERT encoders: the export wraps BertModel's own embeddings and blocks with a padding
    mask (a BERT configured as a causal decoder would need another)."""
    return str(config.model_type) == "bert" and not getattr(config, "is_decoder", False)


def choose_runtime(spec: ModelSpec, config: Any) -> str:
    """`torch` or `openvino` for this job on this machine; an error where the job asks
    for OpenVINO and it cannot run, never a silent switch."""
    if spec.runtime == "torch":
        return "torch"
    on_cuda = resolve_device(spec.device).type == "cuda"
    if spec.runtime == "openvino":
        check_openvino_job(spec, config)
        if on_cuda:
            raise ModelError(_OPENVINO_ON_GPU)
        if not openvino_installed():
            raise ModelError("model.runtime: openvino is not installed "
                             "(pip install 'bertpipe[openvino]'), or use model.runtime: torch")
        return "openvino"
    if on_cuda or not openvino_installed():
        return "torch"
    if not openvino_supports(config):
        log.info("model.runtime auto: %s runs on torch (the openvino runtime supports BERT "
                 "encoders)", _kind(config))
        return "torch"
    return "openvino"


_OPENVINO_ON_GPU = ("model.runtime: openvino runs on the CPU; set model.device: cpu, or "
                    "model.runtime: torch for the GPU")


def _kind(config: Any) -> str:
    return str(config.model_type) + (" (decoder)" if getattr(config, "is_decoder", False)
                                     else "")


def check_openvino_job(spec: ModelSpec, config: Any) -> None:
    """What `model.runtime: openvino` refuses whatever the machine: a device other than
    the CPU, a model family it cannot run."""
    if spec.device == "cuda":
        raise ModelError(_OPENVINO_ON_GPU)
    if not openvino_supports(config):
        raise ModelError(f"model.runtime: openvino supports BERT encoders, not "
                         f"{_kind(config)}; use model.runtime: torch")


def token_views_refusal(token_views: Sequence[str]) -> ModelError:
    return ModelError(f"model.runtime: openvino gives pooled views only; token views "
                      f"({', '.join(token_views)}) need model.runtime: torch")


def check_runtime(spec: ModelSpec, config: Any, token_views: Sequence[str],
                  here: bool) -> None:
    """Refuse, before any weights load, what `load_encoder` would refuse. `here`: the model
    runs on this machine (its device and installed runtimes decide); else the workers'
    machines decide those, and only what holds everywhere is checked."""
    if spec.runtime == "openvino":  # the job's own mistakes first: they hold everywhere
        check_openvino_job(spec, config)
        if token_views:
            raise token_views_refusal(token_views)
    if here:
        choose_runtime(spec, config)


def load_encoder(spec: ModelSpec, config: Any, views: Sequence[ResolvedView],
                 needs: ForwardNeeds) -> tuple[LoadedModel, Encoder, Runtime]:
    """The loaded model, the encoder that runs it, and the runtime actually used."""
    name = choose_runtime(spec, config)
    token_views = [v.name for v in views if v.per_token]
    if name == "openvino" and token_views:
        if spec.runtime == "openvino":
            raise token_views_refusal(token_views)
        name = "torch"  # auto: token views are computed by the torch encoder
    if name == "torch":
        model = load_model(spec, keep_layers=needs.blocks_to_run, need_pooler=needs.pooler,
                           need_cls_attention=needs.cls_attention)
        runtime = Runtime("torch", dtype_name(model.compute_dtype))
        return model, Encoder(model, views, needs), runtime

    from .runtime_openvino import openvino_encoder  # why here: openvino is optional

    wanted = dtype_name(resolve_dtype(spec.dtype, torch.device("cpu")))
    model, encoder = openvino_encoder(spec, config, views, needs, wanted)
    actual = encoder.forward.precision
    if actual != wanted:
        log.info("model.dtype: openvino runs %s on this CPU (asked for %s)", actual, wanted)
    return model, encoder, Runtime("openvino", actual)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
