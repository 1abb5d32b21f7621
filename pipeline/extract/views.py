"""Views: which hidden states, how they are combined, how tokens are pooled into one vector.

Layer indices follow `hidden_states`: 0 is the embedding output, 1..L the blocks,
negatives count from the end (-1 == L). Combining K selected layers h_1..h_K (each B,T,H):

    none        h_1
    mean        (1/K) Σ_k h_k
    sum         Σ_k h_k
    concat      [h_1; ...; h_K]                  (B, T, K·H)
    weighted    Σ_k w_k h_k                      (weights used as given)
    scalar_mix  γ · Σ_k softmax(s)_k h_k         (ELMo; s = the view's weights)

Pooling (mask excludes padding everywhere, inputs are never modified):

    cls        h[:, 0]
    pooler     tanh(h_L[:, 0] @ W.T + b) with the model's own pooler weights (last layer)
    mean       Σ_t m_t h_t / Σ_t m_t
    max        max_t over non-padding tokens, per dimension
    attention  Σ_t a_t h_t, a = last block's [CLS] attention row, averaged over heads
    last       h at the last non-padding token

Output kinds: every pooling above gives one vector per sequence, (B, width). `tokens` is
the other kind: no pooling, the combined states themselves (B, T, width); the encoder
keeps each chunk's own content tokens (no special tokens, no padding) and returns them
flat, (tokens kept, width).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import JobError
from ..spec import ViewSpec
from .viewshapes import view_shapes

Tensor = torch.Tensor


@dataclass
class PoolContext:
    """What some poolings need beyond the token states."""

    cls_attention: Tensor | None = None  # (B, T), rows sum to 1 over non-padding
    pooler: torch.nn.Linear | None = None  # the model's pooler dense layer: W (H, H), b (H,)


# ---- combine -------------------------------------------------------------------------

def _combine_none(states: Sequence[Tensor], weights: Tensor | None, gamma: float) -> Tensor:
    return states[0]


def _combine_mean(states: Sequence[Tensor], weights: Tensor | None, gamma: float) -> Tensor:
    return torch.stack(list(states)).mean(0)


def _combine_sum(states: Sequence[Tensor], weights: Tensor | None, gamma: float) -> Tensor:
    return torch.stack(list(states)).sum(0)


def _combine_concat(states: Sequence[Tensor], weights: Tensor | None, gamma: float) -> Tensor:
    return torch.cat(list(states), dim=-1)


def _combine_weighted(states: Sequence[Tensor], weights: Tensor | None, gamma: float) -> Tensor:
    assert weights is not None  # guaranteed by spec validation
    return torch.einsum("k,kbth->bth", weights.to(states[0].dtype), torch.stack(list(states)))


def _combine_scalar_mix(states: Sequence[Tensor], weights: Tensor | None, gamma: float) -> Tensor:
    assert weights is not None
    mix = torch.softmax(weights.to(states[0].dtype), dim=0)
    return gamma * torch.einsum("k,kbth->bth", mix, torch.stack(list(states)))


COMBINES: dict[str, Callable[[Sequence[Tensor], Tensor | None, float], Tensor]] = {
    "none": _combine_none,
    "mean": _combine_mean,
    "sum": _combine_sum,
    "concat": _combine_concat,
    "weighted": _combine_weighted,
    "scalar_mix": _combine_scalar_mix,
}


# ---- pooling -------------------------------------------------------------------------

def pool_cls(h: Tensor, mask: Tensor, ctx: PoolContext) -> Tensor:
    return h[:, 0]


def pool_mean(h: Tensor, mask: Tensor, ctx: PoolContext) -> Tensor:
    m = mask.unsqueeze(-1).to(h.dtype)  # (B, T, 1)
    return (h * m).sum(1) / m.sum(1).clamp(min=1.0)


def pool_max(h: Tensor, mask: Tensor, ctx: PoolContext) -> Tensor:
    filled = h.masked_fill(~mask.unsqueeze(-1), torch.finfo(h.dtype).min)
    return filled.max(dim=1).values


def pool_attention(h: Tensor, mask: Tensor, ctx: PoolContext) -> Tensor:
    if ctx.cls_attention is None:
        raise RuntimeError("attention pooling needs the [CLS] attention row")
    a = ctx.cls_attention.to(h.dtype) * mask.to(h.dtype)  # (B, T)
    return torch.einsum("bt,bth->bh", a, h)


def pool_last(h: Tensor, mask: Tensor, ctx: PoolContext) -> Tensor:
    last = mask.long().sum(1).clamp(min=1) - 1  # right padding: last real token
    return h[torch.arange(h.shape[0], device=h.device), last]


def pool_pooler(h: Tensor, mask: Tensor, ctx: PoolContext) -> Tensor:
    if ctx.pooler is None:
        raise RuntimeError("pooler pooling needs the model's pooler")
    # nn.Linear stores W transposed: dense(x) = x @ dense.weight.T + dense.bias
    return torch.tanh(ctx.pooler(h[:, 0].to(ctx.pooler.weight.dtype)))


POOLINGS: dict[str, Callable[[Tensor, Tensor, PoolContext], Tensor]] = {
    "cls": pool_cls,
    "pooler": pool_pooler,
    "mean": pool_mean,
    "max": pool_max,
    "attention": pool_attention,
    "last": pool_last,
}


def keep_tokens(h: Tensor, mask: Tensor, ctx: PoolContext) -> Tensor:
    """(B, T, H) as given: which rows are kept is the encoder's business (chunk context)."""
    return h


# Outputs of the per-token kind: (B, T, H) instead of (B, H); see the module docstring.
TOKEN_OUTPUTS: dict[str, Callable[[Tensor, Tensor, PoolContext], Tensor]] = {
    "tokens": keep_tokens,
}


def get_pooling(name: str) -> Callable[[Tensor, Tensor, PoolContext], Tensor]:
    found = POOLINGS.get(name) or TOKEN_OUTPUTS.get(name)
    if found is None:
        valid = ", ".join([*POOLINGS, *TOKEN_OUTPUTS])
        raise JobError(f"pooling: unknown {name!r}; valid: {valid}")
    return found


def get_combine(name: str) -> Callable[[Sequence[Tensor], Tensor | None, float], Tensor]:
    try:
        return COMBINES[name]
    except KeyError:
        raise JobError(f"combine: unknown {name!r}; valid: {', '.join(COMBINES)}") from None


# ---- resolved views ------------------------------------------------------------------

@dataclass(frozen=True)
class ResolvedView:
    """A view with absolute layer indices (0..L), its output width, and its combine and
    pooling functions looked up once (not per batch)."""

    spec: ViewSpec
    layers: tuple[int, ...]
    width: int
    combine: Callable[[Sequence[Tensor], Tensor | None, float], Tensor]
    pool: Callable[[Tensor, Tensor, PoolContext], Tensor]
    weights: Tensor | None  # float64; cast to the states' dtype and device in the combine

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def per_token(self) -> bool:
        """(B, T, width) per batch instead of (B, width): see `TOKEN_OUTPUTS`."""
        return self.spec.pooling in TOKEN_OUTPUTS

    def compute(self, states: dict[int, Tensor], mask: Tensor, ctx: PoolContext) -> Tensor:
        """(B, width) float32 vectors for one batch; (B, T, width) for a token view."""
        selected = [states[i] for i in self.layers]
        weights = None if self.weights is None else self.weights.to(selected[0].device)
        combined = self.combine(selected, weights, self.spec.gamma)
        pooled = self.pool(combined, mask, ctx)
        if self.spec.normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled


def resolve_views(specs: Sequence[ViewSpec], n_layers: int, hidden: int) -> list[ResolvedView]:
    resolved = []
    for shape in view_shapes(specs, n_layers, hidden):
        spec = shape.spec
        weights = None if spec.weights is None else torch.tensor(spec.weights,
                                                                   dtype=torch.float64)
        resolved.append(ResolvedView(spec, shape.layers, shape.width, get_combine(spec.combine),
                                     get_pooling(spec.pooling), weights))
    return resolved


@dataclass(frozen=True)
class ForwardNeeds:
    """What one forward pass must produce so that every view can be computed."""

    layers: frozenset[int]  # hidden-state indices used
    blocks_to_run: int  # transformer blocks to keep (0..L)
    hidden_states: bool  # any layer other than the last run block
    cls_attention: bool
    pooler: bool


def forward_needs(views: Sequence[ResolvedView], n_layers: int) -> ForwardNeeds:
    layers = frozenset(i for v in views for i in v.layers)
    attention = any(v.spec.pooling == "attention" for v in views)
    pooler = any(v.spec.pooling == "pooler" for v in views)
    # The pooler and the [CLS] attention are defined by the model's last block.
    blocks = n_layers if attention or pooler else max(layers)
    return ForwardNeeds(
        layers=layers,
        blocks_to_run=blocks,
        hidden_states=layers != frozenset({blocks}),
        cls_attention=attention,
        pooler=pooler,
    )
