"""The shape of each view, from the job and the model's config alone: its hidden-state
indices and its stored width. No torch: `bertpipe validate` checks views with this, and
views.resolve_views builds the computing views on it, so the two cannot disagree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import JobError
from ..spec import ViewSpec


@dataclass(frozen=True)
class ViewShape:
    """A view with absolute layer indices (0..L) and its output width."""

    spec: ViewSpec
    layers: tuple[int, ...]
    width: int

    @property
    def name(self) -> str:
        return self.spec.name


def resolve_layers(layers: tuple[int, ...] | str, n_layers: int, key: str) -> tuple[int, ...]:
    """Map job layer indices to 0..L; `all` is every hidden state."""
    if layers == "all":
        return tuple(range(n_layers + 1))
    out = []
    for i in layers:
        assert isinstance(i, int)
        j = i + n_layers + 1 if i < 0 else i
        if not 0 <= j <= n_layers:
            raise JobError(f"{key}.layers: {i} is out of range for a model with {n_layers} "
                           f"layers (valid: {-(n_layers + 1)}..{n_layers})")
        out.append(j)
    return tuple(out)


def view_shapes(specs: Sequence[ViewSpec], n_layers: int, hidden: int) -> list[ViewShape]:
    """Each view's layers and width; a JobError for a layer out of range or a weight count
    that does not match the layers."""
    shapes = []
    for spec in specs:
        key = f"views.{spec.name}"
        layers = resolve_layers(spec.layers, n_layers, key)
        if spec.weights is not None and len(spec.weights) != len(layers):
            raise JobError(f"{key}.weights: {len(spec.weights)} weights for {len(layers)} layers")
        width = hidden * len(layers) if spec.combine == "concat" else hidden
        shapes.append(ViewShape(spec, layers, width))
    return shapes
