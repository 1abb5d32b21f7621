"""Every pooling and combine against a NumPy float64 reference, plus the worked examples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.errors import JobError
from pipeline.extract.views import (
    COMBINES,
    POOLINGS,
    PoolContext,
    forward_needs,
    get_pooling,
    resolve_views,
)
from pipeline.extract.viewshapes import resolve_layers
from pipeline.spec import ViewSpec, job_schema
from pipeline.stores import FORMATS

RNG = np.random.default_rng(7)
B, T, H = 4, 9, 6
LENGTHS = [9, 3, 6, 1]


def _batch() -> tuple[np.ndarray, np.ndarray]:
    h = RNG.normal(size=(B, T, H))
    mask = np.arange(T)[None, :] < np.array(LENGTHS)[:, None]  # right padding
    h[~mask] = 1e6  # padding garbage that must never reach an output
    return h, mask


# ---- NumPy float64 oracles --------------------------------------------------------

def ref_mean(h: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.stack([h[b, mask[b]].mean(0) for b in range(len(h))])


def ref_max(h: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.stack([h[b, mask[b]].max(0) for b in range(len(h))])


def ref_last(h: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.stack([h[b, mask[b].sum() - 1] for b in range(len(h))])


def ref_attention(h: np.ndarray, mask: np.ndarray, a: np.ndarray) -> np.ndarray:
    return np.stack([(a[b, mask[b], None] * h[b, mask[b]]).sum(0) for b in range(len(h))])


def bert_pooler(h: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Position 0, affine (h0 · W + b, W as (in, out)), tanh."""
    return np.tanh(h[:, 0] @ w + b)


def _torch(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x)


@pytest.mark.parametrize("name,ref", [("mean", ref_mean), ("max", ref_max),
                                      ("last", ref_last)])
def test_masked_poolings_match_reference(name: str, ref) -> None:  # type: ignore[no-untyped-def]
    h, mask = _batch()
    before = h.copy()
    got = get_pooling(name)(_torch(h), _torch(mask), PoolContext()).numpy()
    np.testing.assert_allclose(got, ref(h, mask), rtol=1e-12)
    np.testing.assert_array_equal(h, before)  # pooling never modifies its input


def test_cls_is_position_zero_not_last() -> None:
    h, mask = _batch()
    got = get_pooling("cls")(_torch(h), _torch(mask), PoolContext()).numpy()
    np.testing.assert_array_equal(got, h[:, 0])


def test_attention_pooling_weights_tokens_and_excludes_padding() -> None:
    h, mask = _batch()
    a = RNG.random((B, T)) * mask
    a /= a.sum(1, keepdims=True)
    ctx = PoolContext(cls_attention=_torch(a))
    got = get_pooling("attention")(_torch(h), _torch(mask), ctx).numpy()
    np.testing.assert_allclose(got, ref_attention(h, mask, a), rtol=1e-12)


def test_pooler_worked_example_from_design_notes() -> None:
    """DESIGN's hand-worked pooler and head, computed by the project's `pooler` pooling."""
    h0 = np.array([0.8, -0.3, 1.2, -0.5])
    w = np.array([[0.5, 0.1, -0.3, 0.2], [-0.1, 0.4, 0.6, -0.2],
                  [0.3, -0.5, 0.2, 0.7], [0.2, 0.3, -0.1, 0.4]])  # used as h0 · W
    b = np.array([0.1, 0.0, -0.1, 0.05])
    dense = torch.nn.Linear(4, 4).double()  # what a checkpoint's pooler holds
    with torch.no_grad():
        dense.weight.copy_(_torch(w.T))  # nn.Linear stores the transpose
        dense.bias.copy_(_torch(b))
    # position 0 is the [CLS] token; the other tokens must not matter
    hs = _torch(np.concatenate([h0[None, None, :], RNG.normal(size=(1, 2, 4))], axis=1))
    with torch.inference_mode():
        pooled = get_pooling("pooler")(hs, torch.ones(1, 3, dtype=torch.bool),
                                       PoolContext(pooler=dense)).numpy()[0]
    np.testing.assert_allclose(pooled, [0.658, -0.658, -0.226, 0.721], atol=1e-3)
    # a 4x2 classifier head on the project's pooled output gives P(class 0) ~= 0.885
    wc = np.array([[0.6, -0.4], [-0.3, 0.5], [0.2, -0.1], [0.4, -0.6]])
    logits = pooled @ wc + np.array([0.1, -0.1])
    p = np.exp(logits) / np.exp(logits).sum()
    assert p[0] == pytest.approx(0.885, abs=1e-3)


def test_pooler_matches_numpy_reference() -> None:
    h, mask = _batch()
    w, b = RNG.normal(size=(H, H)), RNG.normal(size=H)
    dense = torch.nn.Linear(H, H).double()
    with torch.no_grad():
        dense.weight.copy_(_torch(w.T))
        dense.bias.copy_(_torch(b))
        got = get_pooling("pooler")(_torch(h), _torch(mask), PoolContext(pooler=dense)).numpy()
    np.testing.assert_allclose(got, bert_pooler(h, w, b), rtol=1e-12)


def _states(n_layers: int) -> dict[int, torch.Tensor]:
    return {i: _torch(RNG.normal(size=(B, T, H))) for i in range(n_layers + 1)}


def _ref_combine(name: str, hs: list[np.ndarray], w: np.ndarray | None, gamma: float
                 ) -> np.ndarray:
    if name == "none":
        return hs[0]
    if name == "mean":
        return sum(hs) / len(hs)
    if name == "sum":
        return sum(hs)
    if name == "concat":
        return np.concatenate(hs, axis=-1)
    assert w is not None
    if name == "weighted":
        return sum(wk * hk for wk, hk in zip(w, hs, strict=True))
    s = np.exp(w - w.max())
    s /= s.sum()
    return gamma * sum(sk * hk for sk, hk in zip(s, hs, strict=True))


@pytest.mark.parametrize("combine,layers,weights,gamma", [
    ("none", (-2,), None, 1.0),
    ("mean", (1, 2, 3), None, 1.0),
    ("sum", (0, -1), None, 1.0),
    ("concat", (-2, -1), None, 1.0),
    ("weighted", (1, 3), (0.25, 0.75), 1.0),
    ("scalar_mix", "all", (0.1, -0.3, 2.0, 0.5), 0.7),
])
def test_combines_match_reference(combine: str, layers, weights, gamma: float) -> None:  # type: ignore[no-untyped-def]
    n_layers = 3
    spec = ViewSpec("v", pooling="mean", layers=layers, combine=combine, weights=weights,
                    gamma=gamma)
    (view,) = resolve_views([spec], n_layers, H)
    states = _states(n_layers)
    _, mask = _batch()
    got = view.compute(states, _torch(mask), PoolContext()).numpy()
    hs = [states[i].numpy() for i in view.layers]
    w = None if weights is None else np.array(weights)
    expected = ref_mean(_ref_combine(combine, hs, w, gamma), mask)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    assert got.shape == (B, view.width)
    assert view.width == (H * len(hs) if combine == "concat" else H)


def test_normalize_gives_unit_vectors() -> None:
    (view,) = resolve_views([ViewSpec("u", pooling="max", normalize=True)], 2, H)
    states = _states(2)
    _, mask = _batch()
    got = view.compute(states, _torch(mask), PoolContext()).numpy()
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-12)
    raw = ref_max(states[2].numpy(), mask)
    np.testing.assert_allclose(got, raw / np.linalg.norm(raw, axis=1, keepdims=True),
                               rtol=1e-10)


def test_layer_indices_follow_hidden_states() -> None:
    assert resolve_layers((-1,), 6, "k") == (6,)
    assert resolve_layers((0, -7), 6, "k") == (0, 0)
    assert resolve_layers("all", 2, "k") == (0, 1, 2)
    with pytest.raises(JobError, match=r"views.x.layers: 7 is out of range.*-7..6"):
        resolve_layers((7,), 6, "views.x")


def test_unknown_pooling_lists_valid_names() -> None:
    with pytest.raises(JobError, match="unknown 'median'; valid: cls, pooler, mean, max, "
                                       "attention, last"):
        get_pooling("median")


def test_registries_are_in_the_schema() -> None:
    """A pooling, combine or store format is added in one registry; the job schema must
    name it too, or no job could ask for it."""
    view = job_schema()["$defs"]["view"]["properties"]
    assert set(POOLINGS) <= set(view["pooling"]["enum"])
    assert list(COMBINES) == view["combine"]["enum"]
    output = job_schema()["properties"]["output"]["properties"]
    assert list(FORMATS) == output["format"]["enum"]


def test_forward_needs_runs_only_needed_blocks() -> None:
    views = resolve_views([ViewSpec("a", "mean", layers=(2,)),
                           ViewSpec("b", "cls", layers=(1, 2), combine="mean")], 6, H)
    needs = forward_needs(views, 6)
    assert needs.blocks_to_run == 2 and needs.hidden_states
    last_only = forward_needs(resolve_views([ViewSpec("a", "mean")], 6, H), 6)
    assert last_only.blocks_to_run == 6 and not last_only.hidden_states
    pooler = forward_needs(resolve_views([ViewSpec("a", "mean", layers=(1,)),
                                          ViewSpec("p", "pooler")], 6, H), 6)
    assert pooler.blocks_to_run == 6 and pooler.pooler and pooler.hidden_states
