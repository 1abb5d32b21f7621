"""The encoding loop: token ids in, one float32 matrix per view out, whatever the runtime.

`Encoder` owns everything but the forward pass: batching, padding, the views, and where
each batch's rows go. The forward pass is a `Forward`: (ids, mask) -> (the hidden states
the views need, the [CLS] attention row or None). The torch runtime (`runtime.
TorchForward`) and the OpenVINO runtime (`runtime_openvino.OpenVINOForward`) implement
only that, so every view kind, token views included, runs the same code on both.

One forward pass per batch serves every view. The [CLS] attention row for attention
pooling is `ClsAttention`, one formula for both runtimes: recomputed from the last block's
input for query position 0 only, so the model keeps its fast (SDPA or fused) attention
kernel. A token view (`pooling: tokens`) is the other output kind: instead of one vector
per sequence it returns the rows of the positions each sequence keeps (its own content
tokens), flat in input order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import ModelError
from ..spec import BatchingSpec
from .batching import plan_batches
from .model import LoadedModel
from .views import ForwardNeeds, PoolContext, ResolvedView

Tensor = torch.Tensor


class Forward(Protocol):
    """One forward pass of a runtime.

    (ids (B, T) int64, mask (B, T) int64, 1 = token, on the model's device) ->
    ({layer: (B, T, H) float32} for every layer in `needs.layers`,
     the last block's [CLS] attention row (B, T) float32 when `needs.cls_attention`, else
     None).
    """

    def __call__(self, ids: Tensor, mask: Tensor) -> tuple[dict[int, Tensor], Tensor | None]:
        ...


# A marker of the work a device has queued so far: calling it waits until that work is done.
Waiter = Callable[[], None]


def queue_marker(forward: Forward) -> Callable[[], Waiter] | None:
    """`forward.record` when its runtime queues work on a device and returns before it is
    done (a CUDA stream): `record()` marks the work queued so far and returns its `Waiter`.
    None for a runtime whose forward pass has finished when it returns (the CPU runtimes)."""
    return getattr(forward, "record", None)


@dataclass
class _Launched:
    """A batch handed to the model: its views' outputs, on the host once `wait` returns."""

    k: int  # the batch's place in its plan
    idx: np.ndarray  # the batch's sequence indices
    outputs: dict[str, Tensor]
    wait: Waiter | None


@dataclass
class EncodePlan:
    """A partition's sequences ready for the model: where each sequence's rows go and the
    batches, planned (and, when asked, padded) before any forward pass. Making it is CPU
    work only, so it can be done on another thread while the model runs (see `pad`)."""

    sequences: Sequence[Sequence[int]]
    spans: list[tuple[int, int]]  # each sequence's kept positions [lo, hi) (token views)
    starts: np.ndarray  # (M + 1,) first row of each sequence in a token view's output
    batches: list[np.ndarray]  # sequence indices, one array per forward pass
    # the batches' padded (ids, mask) on the host, filled by `Encoder.pad`; empty: padded
    # one at a time as the model reaches them
    padded: list[tuple[Tensor, Tensor]] = field(default_factory=list)


class Encoder:
    # on_batch(batches done, batches planned) after each forward pass: progress only
    on_batch: Callable[[int, int], None] | None = None

    def __init__(self, model: LoadedModel, views: Sequence[ResolvedView], needs: ForwardNeeds,
                 forward: Forward):
        self.model = model
        self.views = list(views)
        self.needs = needs
        self.forward = forward
        self.token_views = any(v.per_token for v in self.views)
        self.pad_id = int(model.tokenizer.pad_token_id or 0)
        # why only for CUDA: page-locked host memory lets the copy to the device run
        # asynchronously (non_blocking); on the CPU it would be a copy for nothing
        self.to_cuda = model.device.type == "cuda"

    def encode(self, sequences: Sequence[Sequence[int]], batching: BatchingSpec,
               keep: Sequence[tuple[int, int]] | None = None) -> dict[str, np.ndarray]:
        """Vectors for every sequence (ids incl. special tokens), in input order.

        A pooled view gives (M, width). A token view gives (K, width): the rows at
        positions keep[i] = [lo, hi) of each sequence i, concatenated in input order
        (every position when `keep` is None).
        """
        return self.run(self.plan(sequences, batching, keep))

    def plan(self, sequences: Sequence[Sequence[int]], batching: BatchingSpec,
             keep: Sequence[tuple[int, int]] | None = None) -> EncodePlan:
        """The batches of `encode(sequences, batching, keep)`, nothing run yet."""
        n = len(sequences)
        spans = list(keep) if keep is not None else [(0, len(s)) for s in sequences]
        sizes = np.fromiter((hi - lo for lo, hi in spans), np.int64, n)
        starts = np.concatenate([[0], np.cumsum(sizes)])  # (M + 1,) row of each sequence
        lengths = [len(s) for s in sequences]
        batches = plan_batches(lengths, batching.max_tokens_per_batch, batching.max_batch_size)
        return EncodePlan(sequences, spans, starts, batches)

    def pad(self, plan: EncodePlan) -> EncodePlan:
        """Pad every batch of `plan` now, on the host (memory: the plan's padded tokens,
        twice 8 bytes each), so that `run` only copies them to the device."""
        plan.padded = [self._pad_host([plan.sequences[i] for i in idx]) for idx in plan.batches]
        return plan

    def run(self, plan: EncodePlan) -> dict[str, np.ndarray]:
        """Every batch of `plan` through the model and the views (see `encode`).

        On a runtime that queues its work on a device (`queue_marker`), batch k + 1 is
        queued before the host waits for batch k and places its rows: the device always has
        the next batch while the host copies results out, and never waits for that turn."""
        n = len(plan.sequences)
        out = {v.name: np.empty((n, v.width), np.float32)
               for v in self.views if not v.per_token}
        out.update({v.name: np.empty((int(plan.starts[-1]), v.width), np.float32)
                    for v in self.views if v.per_token})
        record = queue_marker(self.forward)
        ahead = 1 if record is not None else 0  # batches queued beyond the one placed next
        launched: deque[_Launched] = deque()
        for k, idx in enumerate(plan.batches):
            launched.append(self._launch(plan, k, idx, record))
            if len(launched) > ahead:
                self._place(out, plan, launched.popleft())
        while launched:
            self._place(out, plan, launched.popleft())
        return out

    def _launch(self, plan: EncodePlan, k: int, idx: np.ndarray,
                record: Callable[[], Waiter] | None) -> _Launched:
        """Batch k of `plan` padded, on the device, through the forward pass and the views;
        on a queuing runtime the work is queued and `wait` marks its end."""
        sequences = [plan.sequences[i] for i in idx]
        host = plan.padded[k] if plan.padded else self._pad_host(sequences)
        ids, mask = self._to_device(*host)
        outputs = self._views(ids, mask, [len(s) for s in sequences],
                              [plan.spans[i] for i in idx] if self.token_views else None)
        return _Launched(k, idx, outputs, record() if record is not None else None)

    def _place(self, out: dict[str, np.ndarray], plan: EncodePlan, batch: _Launched) -> None:
        """A launched batch's rows into `out`, once the device has finished it."""
        if batch.wait is not None:
            batch.wait()
        starts = plan.starts
        for v in self.views:
            rows = batch.outputs[v.name].numpy()
            if not v.per_token:
                out[v.name][batch.idx] = rows
                continue
            at = 0  # the batch's token rows, sequence after sequence
            for i in batch.idx:
                size = int(starts[i + 1] - starts[i])
                out[v.name][starts[i] : starts[i + 1]] = rows[at : at + size]
                at += size
        if self.on_batch:
            self.on_batch(batch.k + 1, len(plan.batches))

    def encode_batch(self, sequences: Sequence[Sequence[int]],
                     keep: Sequence[tuple[int, int]] | None = None) -> dict[str, np.ndarray]:
        """One padded batch: (B, width) per pooled view; per token view the rows
        keep[b] = [lo, hi) of each sequence, concatenated (every position when None)."""
        ids, mask = self._to_device(*self._pad_host(sequences))  # (B, T)
        outputs = self._views(ids, mask, [len(s) for s in sequences], keep)
        record = queue_marker(self.forward)
        if record is not None:
            record()()
        return {name: t.numpy() for name, t in outputs.items()}

    def _views(self, ids: Tensor, mask: Tensor, lengths: Sequence[int],
               keep: Sequence[tuple[int, int]] | None) -> dict[str, Tensor]:
        """The forward pass and every view on the model's device; only the views' outputs
        (pooled vectors, kept token rows) are copied to the host: asynchronously from a
        CUDA device (into page-locked memory), so they are there once its queue is done."""
        with torch.inference_mode():
            states, cls_attention = self.forward(ids, mask)  # {layer: (B, T, H)}, (B, T)
            bool_mask = mask.bool()
            ctx = PoolContext(cls_attention=cls_attention,
                              pooler=self.model.pooler if self.needs.pooler else None)
            out = {}
            rows: tuple[Tensor, Tensor] | None = None
            for v in self.views:
                computed = v.compute(states, bool_mask, ctx)
                if v.per_token:  # (B, T, width) -> (K, width), kept rows only
                    rows = rows or _kept_rows(keep, lengths, ids.device)
                    computed = computed[rows]
                out[v.name] = computed.float().to("cpu", non_blocking=self.to_cuda)
            return out

    def _pad_host(self, sequences: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """(ids, mask) (B, T) int64 on the host, right-padded to the longest sequence;
        page-locked when the model is on a CUDA device. Built in NumPy: no torch kernel,
        so no OpenMP team in a thread that only prepares batches."""
        lengths = np.fromiter(map(len, sequences), np.int64, len(sequences))
        mask = np.arange(int(lengths.max())) < lengths[:, None]  # (B, T) bool
        ids = np.full(mask.shape, self.pad_id, np.int64)
        # a boolean index fills row after row, each in position order: the sequences as given
        ids[mask] = np.fromiter(chain.from_iterable(sequences), np.int64, int(lengths.sum()))
        host = torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))
        if self.to_cuda:
            return host[0].pin_memory(), host[1].pin_memory()
        return host

    def _to_device(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        # non_blocking from page-locked memory: the copy is queued on the device's stream
        # ahead of the forward pass that reads it, and the host goes on at once
        return (ids.to(self.model.device, non_blocking=self.to_cuda),
                mask.to(self.model.device, non_blocking=self.to_cuda))


def _kept_rows(keep: Sequence[tuple[int, int]] | None, lengths: Sequence[int],
               device: torch.device) -> tuple[Tensor, Tensor]:
    """(batch index, position) of every kept token, sequence after sequence."""
    spans = keep if keep is not None else [(0, n) for n in lengths]
    batch = [torch.full((hi - lo,), b, dtype=torch.long) for b, (lo, hi) in enumerate(spans)]
    pos = [torch.arange(lo, hi, dtype=torch.long) for lo, hi in spans]
    return torch.cat(batch).to(device), torch.cat(pos).to(device)


# ---- the [CLS] attention row -----------------------------------------------------------

class ClsAttention(torch.nn.Module):
    """The last block's [CLS] attention row, averaged over heads, from that block's input.

    softmax(q_0 · K^T / sqrt(d_head) + padding mask) for query position 0 only: O(T·H)
    extra work instead of switching the model to eager attention for (B, heads, T, T).
    Exact for the families in `families.PLAIN_ATTENTION_TYPES` (the loader refuses others).
    The one formula of both runtimes: the torch runtime calls it on the input it hooks
    from the last block, the OpenVINO export traces it into its graph.
    """

    def __init__(self, query: torch.nn.Linear, key: torch.nn.Linear, n_heads: int):
        super().__init__()
        self.q, self.k = query, key
        self.n_heads = n_heads
        self.hidden = int(self.k.weight.shape[1])
        self.d_head = self.hidden // n_heads

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        """(B, T) attention of position 0 over the non-padding tokens; h (B, T, H) the last
        block's input, mask (B, T) bool. Rows sum to 1."""
        h = h.float()  # a bf16 model's row in float32: it weights sums over every token
        q0 = torch.nn.functional.linear(h[:, 0], self.q.weight.float(), _f(self.q.bias))
        q0 = q0.view(-1, self.n_heads, self.d_head)  # (B, nh, dh)
        # q0·(W_k h_t + b_k) = (W_kᵀ q0)·h_t + q0·b_k: fold the key projection into the
        # query (H·nh work per token instead of H·H); the bias term is constant over t and
        # cancels in the softmax.
        w_k = self.k.weight.float().view(self.n_heads, self.d_head, self.hidden)  # (nh,dh,H)
        u = torch.einsum("bnd,ndh->bnh", q0, w_k)  # (B, nh, H)
        scores = torch.einsum("bnh,bth->bnt", u, h) * self.d_head ** -0.5  # (B, nh, T)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1).mean(1)  # (B, T)


def _f(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.float()


def find_query_key(block: torch.nn.Module) -> tuple[torch.nn.Module, Any, Any]:
    """The module of a transformer block that projects queries and keys (its input is the
    row's `h`), and those two projections (nn.Linear)."""
    for module in block.modules():
        for q, k in (("query", "key"), ("q_lin", "k_lin"), ("q_proj", "k_proj")):
            if isinstance(getattr(module, q, None), torch.nn.Linear) and isinstance(
                    getattr(module, k, None), torch.nn.Linear):
                return module, getattr(module, q), getattr(module, k)
    raise ModelError(f"pooling attention: cannot find query/key projections in "
                     f"{type(block).__name__}")
