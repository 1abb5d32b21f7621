"""The encoding loop: token ids in, one float32 matrix per view out.

One forward pass per batch serves every view. Hidden states are requested only when a
view needs a layer other than the last one run; the [CLS] attention row for attention
pooling is recomputed from the last block's input for query position 0 only, so the
model keeps its fast (SDPA) attention kernel. A token view (`pooling: tokens`) is the
other output kind: instead of one vector per sequence it returns the rows of the
positions each sequence keeps (its own content tokens), flat in input order.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ModelError
from ..spec import BatchingSpec
from .batching import plan_batches
from .families import last_block
from .model import LoadedModel
from .views import ForwardNeeds, PoolContext, ResolvedView


class Encoder:
    # on_batch(batches done, batches planned) after each forward pass: progress only
    on_batch: Callable[[int, int], None] | None = None

    def __init__(self, model: LoadedModel, views: Sequence[ResolvedView], needs: ForwardNeeds):
        self.model = model
        self.views = list(views)
        self.needs = needs
        self.pad_id = int(model.tokenizer.pad_token_id or 0)
        # a model that could not be cut runs more blocks than the views need: read the
        # needed layer from hidden_states, not from its last output
        self.hidden_states = needs.hidden_states or model.blocks_run != needs.blocks_to_run
        self._cls_attention: _ClsAttention | None = None
        if needs.cls_attention:
            self._cls_attention = _ClsAttention(model)

    def encode(self, sequences: Sequence[Sequence[int]], batching: BatchingSpec,
               keep: Sequence[tuple[int, int]] | None = None) -> dict[str, np.ndarray]:
        """Vectors for every sequence (ids incl. special tokens), in input order.

        A pooled view gives (M, width). A token view gives (K, width): the rows at
        positions keep[i] = [lo, hi) of each sequence i, concatenated in input order
        (every position when `keep` is None).
        """
        n = len(sequences)
        out = {v.name: np.empty((n, v.width), np.float32)
               for v in self.views if not v.per_token}
        token_views = [v for v in self.views if v.per_token]
        spans = list(keep) if keep is not None else [(0, len(s)) for s in sequences]
        sizes = np.fromiter((hi - lo for lo, hi in spans), np.int64, n)
        starts = np.concatenate([[0], np.cumsum(sizes)])  # (M + 1,) row of each sequence
        out.update({v.name: np.empty((int(starts[-1]), v.width), np.float32)
                    for v in token_views})
        lengths = [len(s) for s in sequences]
        batches = plan_batches(lengths, batching.max_tokens_per_batch, batching.max_batch_size)
        for done, idx in enumerate(batches, 1):
            vectors = self.encode_batch([sequences[i] for i in idx],
                                        [spans[i] for i in idx] if token_views else None)
            for v in token_views:  # the batch's rows, sequence after sequence
                rows = vectors.pop(v.name)
                at = 0
                for i in idx:
                    out[v.name][starts[i] : starts[i + 1]] = rows[at : at + sizes[i]]
                    at += int(sizes[i])
            for name, arr in vectors.items():
                out[name][idx] = arr
            if self.on_batch:
                self.on_batch(done, len(batches))
        return out

    def encode_batch(self, sequences: Sequence[Sequence[int]],
                     keep: Sequence[tuple[int, int]] | None = None) -> dict[str, np.ndarray]:
        """One padded batch: (B, width) per pooled view; per token view the rows
        keep[b] = [lo, hi) of each sequence, concatenated (every position when None)."""
        ids, mask = self._pad(sequences)  # (B, T)
        with torch.inference_mode():
            with self._capture_attention() as capture:
                outputs = self.model.module(
                    input_ids=ids, attention_mask=mask,
                    output_hidden_states=self.hidden_states, return_dict=True,
                )
            states = self._states(outputs)  # {layer: (B, T, H) float32}
            bool_mask = mask.bool()
            ctx = PoolContext(
                cls_attention=capture(bool_mask) if capture else None,
                pooler=self.model.pooler if self.needs.pooler else None,
            )
            out = {}
            rows: tuple[torch.Tensor, torch.Tensor] | None = None
            for v in self.views:
                computed = v.compute(states, bool_mask, ctx)
                if v.per_token:  # (B, T, width) -> (K, width), kept rows only
                    rows = rows or _kept_rows(keep, [len(s) for s in sequences], ids.device)
                    computed = computed[rows]
                out[v.name] = computed.float().cpu().numpy()
            return out

    def _pad(self, sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        return ids.to(self.model.device), mask.to(self.model.device)

    def _states(self, outputs: Any) -> dict[int, torch.Tensor]:
        # Pool in float32 whatever the compute dtype: sums over hundreds of tokens in
        # bf16 would lose more precision than the matmuls did.
        if self.hidden_states:
            hs = outputs.hidden_states
            return {i: hs[i].float() for i in self.needs.layers}
        return {self.needs.blocks_to_run: outputs.last_hidden_state.float()}

    @contextlib.contextmanager
    def _capture_attention(self) -> Iterator[Any]:
        if self._cls_attention is None:
            yield None
            return
        with self._cls_attention.hooked() as capture:
            yield capture


class _ClsAttention:
    """Recomputes the last block's [CLS] attention row, averaged over heads.

    softmax(q_0 · K^T / sqrt(d_head) + padding mask) for query position 0 only: O(T·H)
    extra work instead of switching the model to eager attention for (B, heads, T, T).
    Exact for the families in `model.PLAIN_ATTENTION_TYPES` (the loader refuses others).
    """

    def __init__(self, model: LoadedModel):
        layer = last_block(model.module)
        self.attn, self.q, self.k = _find_query_key(layer)
        config: Any = model.module.config
        self.n_heads = int(config.num_attention_heads)
        self._hidden: torch.Tensor | None = None

    @contextlib.contextmanager
    def hooked(self) -> Iterator[Any]:
        def grab(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._hidden = args[0] if args else next(iter(kwargs.values()))

        handle = self.attn.register_forward_pre_hook(grab, with_kwargs=True)
        self._hidden = None
        try:
            yield self._weights
        finally:
            handle.remove()

    def _weights(self, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) attention of position 0 over the non-padding tokens (mask: B, T bool)."""
        h = self._hidden
        if h is None:
            raise RuntimeError("the last attention block did not run")
        h = h.float()
        b, t, hidden = h.shape
        d_head = hidden // self.n_heads
        q0 = torch.nn.functional.linear(h[:, 0], self.q.weight.float(), _f(self.q.bias))
        q0 = q0.view(b, self.n_heads, d_head)  # (B, nh, dh)
        # q0·(W_k h_t + b_k) = (W_kᵀ q0)·h_t + q0·b_k: fold the key projection into the
        # query (H·nh work per token instead of H·H); the bias term is constant over t and
        # cancels in the softmax.
        w_k = self.k.weight.float().view(self.n_heads, d_head, hidden)  # (nh, dh, H)
        u = torch.einsum("bnd,ndh->bnh", q0, w_k)  # (B, nh, H)
        scores = torch.einsum("bnh,bth->bnt", u, h) / math.sqrt(d_head)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1).mean(1)  # (B, T)


def _kept_rows(keep: Sequence[tuple[int, int]] | None, lengths: Sequence[int],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch index, position) of every kept token, sequence after sequence."""
    spans = keep if keep is not None else [(0, n) for n in lengths]
    batch = [torch.full((hi - lo,), b, dtype=torch.long) for b, (lo, hi) in enumerate(spans)]
    pos = [torch.arange(lo, hi, dtype=torch.long) for lo, hi in spans]
    return torch.cat(batch).to(device), torch.cat(pos).to(device)


def _f(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _find_query_key(layer: torch.nn.Module) -> tuple[torch.nn.Module, Any, Any]:
    for module in layer.modules():
        for q, k in (("query", "key"), ("q_lin", "k_lin"), ("q_proj", "k_proj")):
            if isinstance(getattr(module, q, None), torch.nn.Linear) and isinstance(
                    getattr(module, k, None), torch.nn.Linear):
                return module, getattr(module, q), getattr(module, k)
    raise ModelError(f"pooling attention: cannot find query/key projections in "
                     f"{type(layer).__name__}")
