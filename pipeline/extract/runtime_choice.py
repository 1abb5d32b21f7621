"""Which runtime runs the encoder (`model.runtime`), decided without torch where it can be:
`bertpipe validate` checks the choice, and asks torch about the GPU only where the answer
can refuse the job. runtime.py loads what is chosen."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelError
from ..spec import ModelSpec

if TYPE_CHECKING:  # torch is imported where a device is resolved
    import torch

CACHE_ENV = "BERTPIPE_CACHE_DIR"

log = logging.getLogger(__name__)


def openvino_installed() -> bool:
    return importlib.util.find_spec("openvino") is not None


def openvino_supports(config: Any) -> bool:
    """BERT encoders: the export wraps BertModel's own embeddings and blocks with a padding
    mask (a BERT configured as a causal decoder would need another)."""
    return str(config.model_type) == "bert" and not getattr(config, "is_decoder", False)


# The device nodes through which a GPU reaches a process on Linux: NVIDIA's driver, WSL 2's
# paravirtual GPU and ROCm's kernel driver (torch's ROCm build answers torch.cuda too).
GPU_DEVICE_NODES = ("nvidiactl", "dxg", "kfd")


def gpu_device_nodes(dev: Path = Path("/dev")) -> list[str]:
    """The GPU device nodes this process can see."""
    return [name for name in GPU_DEVICE_NODES if (dev / name).exists()]


def device_type(name: str) -> str:
    """`cpu` or `cuda` for `model.device`; a ModelError for cuda where there is none. On
    Linux with no GPU device node torch can find no CUDA device either, so `auto` is the
    CPU without importing torch (seconds, in a process that may encode nothing itself)."""
    if name == "cpu" or (name == "auto" and sys.platform == "linux" and not gpu_device_nodes()):
        return "cpu"
    return resolve_device(name).type


def resolve_device(name: str) -> torch.device:
    """The torch device `model.device` names: `auto` is CUDA where torch finds it; a
    ModelError for cuda where there is none."""
    import torch  # why here: it takes seconds to import, and `device_type` rarely asks

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError("model.device: cuda requested but no CUDA device is available")
    return torch.device(name)


def choose_runtime(spec: ModelSpec, config: Any) -> str:
    """`torch` or `openvino` for this job on this machine; an error where the job asks
    for OpenVINO and it cannot run, never a silent switch."""
    if spec.runtime == "torch":
        return "torch"
    on_cuda = device_type(spec.device) == "cuda"
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


def check_runtime(spec: ModelSpec, config: Any, here: bool) -> None:
    """Refuse, before any weights load, what `load_encoder` would refuse. `here`: the model
    runs on this machine (its device and installed runtimes decide); else the workers'
    machines decide those, and only what holds everywhere is checked."""
    if spec.runtime == "openvino":  # the job's own mistakes first: they hold everywhere
        check_openvino_job(spec, config)
    if here and could_refuse_here(spec):
        device_type(spec.device)  # what the model's loading asks first, whatever the runtime
        choose_runtime(spec, config)


def could_refuse_here(spec: ModelSpec) -> bool:
    """Whether loading `spec` can be refused on some machine: an openvino job (a GPU here,
    openvino missing), or device cuda whatever the runtime (no GPU here). Device auto or cpu
    runs everywhere, so the device is not asked (torch would be imported for nothing)."""
    return spec.runtime == "openvino" or spec.device == "cuda"


def cache_base() -> Path:
    """bertpipe's cache folder: `$BERTPIPE_CACHE_DIR`, default `~/.cache/bertpipe` (exported
    models here, runtime calibrations in calibrate.py)."""
    base = os.environ.get(CACHE_ENV)
    return Path(base).expanduser() if base else Path.home() / ".cache" / "bertpipe"


def cpu_has_bf16() -> bool:
    """True where the CPU runs bf16 matmuls natively (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


def installed_versions(names: Sequence[str]) -> dict[str, str]:
    """Each package's installed version, from its metadata ("" when it is not installed):
    no import, so asking costs nothing (importing torch to read `__version__` would cost a
    process that encodes nothing seconds)."""
    import importlib.metadata as md

    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = ""
    return out
