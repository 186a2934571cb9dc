"""LaMemo weights (thu-coai/LaMemo `MemTransformerLM`, attn_type 3 or 31) onto megalab.

LaMemo's code base is NVIDIA's Transformer-XL fork, so the names are XL's
(`megalab.models.transformer_xl.convert`) with three differences handled there:

    layers.{l}.dec_attn.q_net.weight ; kv_net.weight  -> backbone.layers.{l}.attn.qkv.weight
                                                         (stacked: rows [W_q; W_k; W_v])
    r_r_bias_future                                    -> backbone.v_future (v₋)
    layers.{l}.dec_attn.{train,eval}_logits_constant   -> dropped (never read by the code)

attn_type 3 is LaMemo (`rpe="disentangled"`), 31 its Table 3 ablation with XL's encoding
(`rpe="xl"`, no v₋). The carried memory converts too: the code's list of 2·L + 1 time-first
tensors (`mems`) becomes a `LaMemoState` with `state_from_reference`.

    ckpt = load_reference_checkpoint("checkpoint_best.pt")
    kw = task_kwargs_from_reference(ckpt["model_config"])
    backbone = LaMemo(LaMemoConfig(**kw["backbone"]))
    task = LanguageModelingTask(AdaptiveEmbedding(**kw["encoder"]), backbone,
                                ProjectedAdaptiveLogSoftmax(**kw["head"]), tie_weights=True)
    task.load_state_dict(convert_lm(ckpt["model_state"]))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from megalab.models.convert import to_batch_first
from megalab.models.lamemo.model import LaMemoState
from megalab.models.transformer_xl.convert import (
    ReferenceVocab,
    backbone_kwargs_from_reference,
    convert_backbone,
    convert_lm,
    load_reference_checkpoint,
    permute_vocabulary,
    task_kwargs_from_reference,
    vocabulary_permutation,
)
from megalab.models.transformer_xl.model import XLMemory

__all__ = [
    "ReferenceVocab",
    "backbone_kwargs_from_reference",
    "convert_backbone",
    "convert_lm",
    "lamemo_kwargs_from_reference",
    "load_reference_checkpoint",
    "permute_vocabulary",
    "state_from_reference",
    "task_kwargs_from_reference",
    "vocabulary_permutation",
    "xl_memory_from_reference",
]


def lamemo_kwargs_from_reference(config: Mapping[str, Any]) -> dict[str, Any]:
    """`LaMemoConfig` keyword arguments from a reference `model_config` (attn_type 3 or 31)."""
    if config.get("attn_type") not in (3, 31):
        raise ValueError(
            f"attn_type {config.get('attn_type')} is not LaMemo (3) or its XL-encoding "
            "ablation (31); Transformer-XL (0) converts with megalab.models.transformer_xl.convert"
        )
    return backbone_kwargs_from_reference(config)


def state_from_reference(mems: Sequence[Tensor]) -> LaMemoState:
    """The code's LaMemo memory [embeddings, recur_0, denom_0, recur_1, denom_1, ...]
    (time-first) -> a batch-first `LaMemoState`."""
    if len(mems) % 2 != 1:
        raise ValueError(f"a LaMemo memory has 2 x layers + 1 tensors, got {len(mems)}")
    emb = to_batch_first(mems[0])
    return LaMemoState(
        emb,
        [to_batch_first(t) for t in mems[1::2]],
        [to_batch_first(t) for t in mems[2::2]],
        torch.zeros(emb.shape[0], dtype=torch.bool, device=emb.device),
    )


def xl_memory_from_reference(mems: Sequence[Tensor]) -> XLMemory:
    """The code's Transformer-XL memory (layers + 1 time-first tensors) -> `XLMemory`."""
    hidden = [to_batch_first(t) for t in mems]
    return XLMemory(hidden, torch.zeros(hidden[0].shape[0], dtype=torch.bool))
