"""What differs between encoder families, in one place, each fact with its reason.

Where the transformer blocks live and how a model is cut to fewer of them, which rows of
the position table a sequence can use, where the pooler's weights are, and whose [CLS]
attention row can be recomputed exactly. `tests/test_zoo.py` checks every family named
here against plain transformers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import ModelError

log = logging.getLogger(__name__)

# Model families whose checkpoints ship a pooler that was never trained (no NSP task).
UNTRAINED_POOLER_TYPES = frozenset({"roberta", "xlm-roberta", "camembert", "longformer"})

# Where each family keeps its per-layer list of transformer blocks.
BLOCK_PATHS = ("encoder.layer",  # BERT, RoBERTa, XLM-RoBERTa, ELECTRA, DeBERTa
               "transformer.layer",  # DistilBERT
               "layers",  # ModernBERT
               "encoder.layers")

# Families whose attention logits are (W_q h_0 + b_q)·(W_k h_t + b_k) / sqrt(d_head) plus
# the padding mask, nothing else: for them the [CLS] attention row is recomputed exactly
# from the last block's input (encode.ClsAttention); other families are refused.
PLAIN_ATTENTION_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "electra",
                                   "albert", "distilbert"})
# Why the others cannot have it, where we know.
NOT_PLAIN_ATTENTION = {
    "deberta": "adds disentangled relative-position terms to its attention logits",
    "deberta-v2": "adds disentangled relative-position terms to its attention logits",
    "modernbert": "rotates queries and keys by position (rotary embeddings)",
}


# ---- pooler --------------------------------------------------------------------------

def take_pooler(module: torch.nn.Module, missing: set[str]) -> torch.nn.Linear | None:
    """Detach the pooler from the forward pass and keep its dense layer (W, b).

    Nothing computes the pooler per batch unless a view asks; the `pooler` pooling applies
    tanh(h_cls @ W.T + b) itself. None when the checkpoint has no pooler weights (a
    random one is never used) or the pooler is not a dense layer followed by tanh.
    """
    pooler = getattr(module, "pooler", None)
    if pooler is None:
        return None
    module.register_module("pooler", None)  # out of the forward pass
    # BERT, RoBERTa: pooler.dense + pooler.activation; ALBERT: pooler + pooler_activation
    dense = pooler if isinstance(pooler, torch.nn.Linear) else getattr(pooler, "dense", None)
    activation = getattr(module, "pooler_activation", getattr(pooler, "activation", None))
    if missing or not isinstance(dense, torch.nn.Linear) or not isinstance(activation,
                                                                          torch.nn.Tanh):
        return None
    return dense


def check_pooler(pooler: torch.nn.Linear | None, path: str, model_type: str) -> None:
    if pooler is None:
        raise ModelError(f"pooling pooler: model {path!r} ({model_type}) has no trained "
                         "pooler weights; use cls or mean instead")
    if model_type in UNTRAINED_POOLER_TYPES:
        log.warning("pooling pooler: %s checkpoints are trained without next-sentence "
                    "prediction, so their pooler output is not a trained feature", model_type)


# ---- blocks --------------------------------------------------------------------------

def encoder_layers(module: torch.nn.Module) -> torch.nn.ModuleList:
    """The per-layer list of transformer blocks for the encoder families we support."""
    for path in BLOCK_PATHS:
        node: Any = module
        for attr in path.split("."):
            node = getattr(node, attr, None)
            if node is None:
                break
        if isinstance(node, torch.nn.ModuleList):
            return node
    raise ModelError(f"{type(module).__name__}: cannot find its transformer blocks")


def albert_groups(module: torch.nn.Module) -> torch.nn.ModuleList | None:
    """ALBERT's shared blocks: one group of layers that runs L times (no per-layer list)."""
    groups = getattr(getattr(module, "encoder", None), "albert_layer_groups", None)
    return groups if isinstance(groups, torch.nn.ModuleList) else None


def last_block(module: torch.nn.Module) -> torch.nn.Module:
    """The module that computes the last transformer block."""
    groups = albert_groups(module)
    if groups is not None:  # the last group's last layer runs last
        layers: Any = groups[-1]
        return layers.albert_layers[-1]
    return encoder_layers(module)[-1]


def cut_blocks(module: torch.nn.Module, n_layers: int, keep: int | None) -> int:
    """Drop the blocks above `keep` (views need nothing above); the blocks left to run.

    ALBERT shares its blocks' weights, so there is nothing to drop: all L run.
    ModernBERT layer-normalises the last block's output (`final_norm`), and its
    hidden_states[k] for k < L is the block's raw output: a cut model must not normalise.
    """
    if keep is None or keep >= n_layers or albert_groups(module) is not None:
        return n_layers
    del encoder_layers(module)[keep:]
    if isinstance(getattr(module, "final_norm", None), torch.nn.Module):
        module.register_module("final_norm", torch.nn.Identity())
    return keep


def check_cls_attention(model_type: str) -> None:
    if model_type not in PLAIN_ATTENTION_TYPES:
        why = NOT_PLAIN_ATTENTION.get(model_type, "is not a family whose attention bertpipe "
                                      "can recompute")
        raise ModelError(f"pooling attention: {model_type} {why}, so its [CLS] attention "
                         "row cannot be computed exactly; use mean, max or cls instead")


# ---- positions -----------------------------------------------------------------------

def reserved_positions(module: torch.nn.Module) -> int:
    """Rows of the position table that no token uses.

    RoBERTa-style embeddings (RoBERTa, XLM-RoBERTa, CamemBERT, Longformer) number the
    positions from padding_idx + 1, so rows 0..padding_idx are never used: a 514-row table
    holds 512 tokens. They are the tables built with a padding index; BERT-style tables
    start at 0 and have none.
    """
    table = getattr(getattr(module, "embeddings", None), "position_embeddings", None)
    padding_idx = getattr(table, "padding_idx", None)
    return 0 if padding_idx is None else int(padding_idx) + 1
