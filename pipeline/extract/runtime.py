"""Which runtime runs the encoder, chosen once per worker from `model.runtime`.

    torch     PyTorch: the float32 reference, every model family, every GPU run
    openvino  OpenVINO on the CPU (fused attention, LayerNorm and GELU kernels), with the
              job's graph exported once per weights and outputs and cached
              (runtime_openvino.py); refused where it cannot run
    auto      a run on the CPU measures torch against openvino (calibrate.py, decided once
              on the client and handed to the workers as an explicit runtime); where no
              decision is given (an Extractor used on its own), openvino on the CPU when
              it is installed and the model is a BERT, else torch

Each runtime is only a forward pass (`encode.Forward`): `TorchForward` here,
`OpenVINOForward` in runtime_openvino.py. The one `encode.Encoder` batches, pads and
computes every view (views.py, token views included) from the float32 hidden states
either gives, so a view's vectors agree within float32 rounding whichever runtime made
them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..spec import ModelSpec
from .encode import ClsAttention, Encoder, Forward, Waiter, find_query_key
from .families import last_block
from .model import LoadedModel, load_model, resolve_dtype
from .runtime_choice import choose_runtime
from .threads import allot, use_torch_threads
from .views import ForwardNeeds, ResolvedView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """What the partition markers and the provenance record."""

    name: str  # torch | openvino
    dtype: str  # what the encoder computes in: float32, bfloat16 or float16


def load_encoder(spec: ModelSpec, config: Any, views: Sequence[ResolvedView],
                 needs: ForwardNeeds, threads: int | None = None
                 ) -> tuple[LoadedModel, Encoder, Runtime]:
    """The loaded model, the encoder that runs it, and the runtime actually used, with as
    many threads as this process was given (`threads`: a Dask worker's own count; see
    threads.py). Call it in the thread that will run the forward passes: torch's OpenMP
    thread count is per calling thread."""
    forward: Forward
    allotment = allot(threads)
    log.info("encoder threads: %d (%s)", allotment.threads, allotment.describe())
    if choose_runtime(spec, config) == "torch":
        use_torch_threads(allotment.threads)
        model = load_model(spec, keep_layers=needs.blocks_to_run, need_pooler=needs.pooler,
                           need_cls_attention=needs.cls_attention)
        forward = TorchForward(model, needs)
        runtime = Runtime("torch", dtype_name(model.compute_dtype))
    else:
        from .runtime_openvino import openvino_forward  # why here: openvino is optional

        wanted = dtype_name(resolve_dtype(spec.dtype, torch.device("cpu")))
        model, forward = openvino_forward(spec, config, needs, wanted, allotment.threads)
        if forward.precision != wanted:
            log.info("model.dtype: openvino runs %s on this CPU (asked for %s)",
                     forward.precision, wanted)
        runtime = Runtime("openvino", forward.precision)
    return model, Encoder(model, views, needs, forward), runtime


class TorchForward:
    """The torch module's own forward pass (SDPA attention kept): (ids, mask) ->
    (states, [CLS] attention row), see `encode.Forward`."""

    def __init__(self, model: LoadedModel, needs: ForwardNeeds):
        self.module = model.module
        self.layers = sorted(needs.layers)
        self.last = needs.blocks_to_run
        # a model that could not be cut runs more blocks than the views need: read the
        # needed layer from hidden_states, not from its last output
        self.hidden_states = needs.hidden_states or model.blocks_run != needs.blocks_to_run
        # a CUDA device runs the work queued on its stream after the calls return: the
        # encoder marks each batch's end and queues the next before waiting (encode.run)
        self.record = cuda_marker if model.device.type == "cuda" else None
        self.attention: torch.nn.Module | None = None  # whose input the [CLS] row needs
        self.cls_attention: ClsAttention | None = None
        if needs.cls_attention:
            config: Any = model.module.config
            self.attention, query, key = find_query_key(last_block(model.module))
            self.cls_attention = ClsAttention(query, key, int(config.num_attention_heads))

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        grabbed: list[torch.Tensor] = []  # the last block's attention input (B, T, H)

        def grab(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> None:
            # the last call's: ALBERT runs its one shared block L times
            grabbed[:] = [args[0] if args else next(iter(kwargs.values()))]

        hook = (self.attention.register_forward_pre_hook(grab, with_kwargs=True)
                if self.attention is not None else None)
        try:
            outputs = self.module(input_ids=ids, attention_mask=mask,
                                  output_hidden_states=self.hidden_states, return_dict=True)
        finally:
            if hook is not None:
                hook.remove()
        # Pool in float32 whatever the compute dtype: sums over hundreds of tokens in
        # bf16 would lose more precision than the matmuls did.
        if self.hidden_states:
            states = {i: outputs.hidden_states[i].float() for i in self.layers}
        else:
            states = {self.last: outputs.last_hidden_state.float()}
        if self.cls_attention is None:
            return states, None
        if not grabbed:
            raise RuntimeError("the last attention block did not run")
        return states, self.cls_attention(grabbed[-1], mask.bool())


def cuda_marker() -> Waiter:
    """The end of the work queued so far on the current CUDA stream: wait on it to read
    what that work wrote (see `encode.queue_marker`)."""
    event = torch.cuda.Event()
    event.record()
    return event.synchronize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
