"""Transformer-XL weights (the authors' PyTorch `MemTransformerLM`, attn_type 0) onto megalab.

The original XL code (kimiyoung/transformer-xl), NVIDIA's fork and LaMemo's code base
(thu-coai/LaMemo) share the parameter names, so one mapping serves them all. The reference
model is one module (embedding, layers, softmax); ours is a `LanguageModelingTask` of three:

    word_emb.emb_layers.{i}.weight, word_emb.emb_projs.{i}   -> encoder.* (AdaptiveEmbedding)
    r_w_bias, r_r_bias                                       -> backbone.u, backbone.v
    layers.{l}.dec_attn.qkv_net.weight                       -> backbone.layers.{l}.attn.qkv.weight
    layers.{l}.dec_attn.{r_net,o_net,layer_norm}             -> ....attn.{r_proj,o_proj,norm}
    layers.{l}.pos_ff.CoreNet.{0,3}, pos_ff.layer_norm       -> ....ffn.{fc1,fc2}, ffn.norm.norm
    crit.out_layers.{i}, crit.out_projs.{i}, crit.cluster_*  -> head.* (ProjectedAdaptiveLogSoftmax)

`pos_emb.inv_freq` (a buffer we compute the same way, in float32) is checked and dropped.
Gradients carry the same names and convert with the same functions.

Checkpoints. LaMemo's and NVIDIA's trainers save {'model_config', 'model_state', 'args',
'vocab', ...}: `load_reference_checkpoint` reads them with `weights_only=True`, allow-listing the
argparse Namespace and reading the pickled vocabulary into the inert `ReferenceVocab` (its
symbols only; no code of the authors runs). The original XL trainer pickles the whole module
(`model.pt`), which no safe loader can read: save its `state_dict()` once with the authors' code
(`torch.save(torch.load('model.pt').state_dict(), 'state.pt')`) and convert that file.

    ckpt = load_reference_checkpoint("checkpoint_best.pt")
    kw = task_kwargs_from_reference(ckpt["model_config"])
    encoder = AdaptiveEmbedding(**kw["encoder"]); head = ProjectedAdaptiveLogSoftmax(**kw["head"])
    backbone = TransformerXL(TransformerXLConfig(**kw["backbone"]))
    task = LanguageModelingTask(encoder, backbone, head, tie_weights=True)
    task.load_state_dict(convert_lm(ckpt["model_state"]), strict=False)   # optimizer state aside

Token ids: XL numbers its vocabulary by frequency. WikiText-103 is built the same way here;
for enwik8/text8 (ids = bytes / space + a-z here) `vocabulary_permutation` gives the rows to
reorder the embedding and output layer with (`permute_vocabulary`).
"""

from __future__ import annotations

import argparse
import collections
import pickle
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megalab.models.convert import _checkpoint_safe_globals, _unknown
from megalab.nn.relative_attention import SinusoidPositions

__all__ = [
    "ReferenceVocab",
    "backbone_kwargs_from_reference",
    "check_reference_config",
    "convert_backbone",
    "convert_lm",
    "load_reference_checkpoint",
    "permute_vocabulary",
    "task_kwargs_from_reference",
    "vocabulary_permutation",
]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_FFN = {
    "pos_ff.CoreNet.0.weight": "ffn.fc1.weight",
    "pos_ff.CoreNet.0.bias": "ffn.fc1.bias",
    "pos_ff.CoreNet.3.weight": "ffn.fc2.weight",
    "pos_ff.CoreNet.3.bias": "ffn.fc2.bias",
    "pos_ff.layer_norm.weight": "ffn.norm.norm.weight",
    "pos_ff.layer_norm.bias": "ffn.norm.norm.bias",
}
_ATTN = {
    "dec_attn.qkv_net.weight": "attn.qkv.weight",
    "dec_attn.r_net.weight": "attn.r_proj.weight",
    "dec_attn.o_net.weight": "attn.o_proj.weight",
    "dec_attn.layer_norm.weight": "attn.norm.weight",
    "dec_attn.layer_norm.bias": "attn.norm.bias",
}
_GLOBAL = {"r_w_bias": "u", "r_r_bias": "v", "r_r_bias_future": "v_future"}
# LaMemo's attention holds two constant buffers its forward never reads.
_UNUSED = ("dec_attn.train_logits_constant", "dec_attn.eval_logits_constant")


class ReferenceVocab:
    """What a pickled `Vocab` of the authors' code (utils/vocabulary.py) is read into: its
    attributes (`idx2sym`, `sym2idx`, `counter`, ...), and no behaviour."""

    idx2sym: list[str]


def check_inv_freq(inv_freq: Tensor) -> None:
    """The reference's sinusoid frequencies must be the ones we compute (in float32)."""
    ours = SinusoidPositions(inv_freq.numel() * 2).inv_freq
    if not torch.equal(inv_freq.to(ours.dtype), ours):
        raise ValueError(
            "pos_emb.inv_freq differs from 1/10000^(2k/d) computed in float32: not a "
            "Transformer-XL/LaMemo sinusoid table"
        )


def convert_layer(name: str, value: Tensor, sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """One reference parameter of `layers.{l}.*` -> ours (LaMemo's q_net/kv_net are stacked
    into `qkv` when `q_net` is met; `kv_net` is then skipped)."""
    match = _LAYER.match(name)
    assert match is not None
    index, rest = match.groups()
    prefix = f"layers.{index}."
    if rest in _FFN:
        return {prefix + _FFN[rest]: value}
    if rest in _ATTN:
        return {prefix + _ATTN[rest]: value}
    if rest == "dec_attn.q_net.weight":
        kv = sd.get(f"layers.{index}.dec_attn.kv_net.weight")
        if kv is None:
            raise KeyError(f"{name} has no matching layers.{index}.dec_attn.kv_net.weight")
        return {prefix + "attn.qkv.weight": torch.cat([value, kv], dim=0)}
    if rest == "dec_attn.kv_net.weight" or rest in _UNUSED:
        return {}
    raise _unknown("MemTransformerLM layer", name)


def convert_backbone(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The layer and bias entries of a reference state dict -> a `TransformerXL`/`LaMemo`
    state dict (embedding and softmax entries are ignored; see `convert_lm`)."""
    out: dict[str, Tensor] = {}
    for name, value in sd.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = value
        elif name.startswith("layers."):
            out.update(convert_layer(name, value, sd))
        elif name == "pos_emb.inv_freq":
            check_inv_freq(value)
        elif not name.startswith(("word_emb.", "crit.")):
            raise _unknown("MemTransformerLM", name)
    return out


def convert_lm(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A whole reference state dict -> a `LanguageModelingTask` state dict
    (`encoder.*` AdaptiveEmbedding, `backbone.*`, `head.*` ProjectedAdaptiveLogSoftmax)."""
    out = {f"backbone.{k}": v for k, v in convert_backbone(sd).items()}
    for name, value in sd.items():
        if name.startswith("word_emb."):
            out["encoder." + name[len("word_emb.") :]] = value
        elif name.startswith("crit."):
            out["head." + name[len("crit.") :]] = value
    return out


def backbone_kwargs_from_reference(config: Mapping[str, Any]) -> dict[str, Any]:
    """`TransformerXLConfig`/`LaMemoConfig` keyword arguments from the reference's `model_config`
    (checked by `check_reference_config`)."""
    check_reference_config(config)
    kw: dict[str, Any] = {
        "d_model": config["d_model"],
        "num_layers": config["n_layer"],
        "num_heads": config["n_head"],
        "head_dim": config["d_head"],
        "ffn_dim": config["d_inner"],
        "dropout": config["dropout"],
        "attention_dropout": config["dropatt"],
        "pre_lnorm": bool(config.get("pre_lnorm", False)),
        "mem_len": config["mem_len"],
        "same_length": bool(config.get("same_length", False)),
        "clamp_len": config.get("clamp_len", -1),
    }
    attn_type = config.get("attn_type", 0)
    if attn_type == 0:
        kw["ext_len"] = config.get("ext_len", 0) or 0
    elif attn_type in (3, 31):
        kw["rpe"] = "disentangled" if attn_type == 3 else "xl"
    else:
        raise ValueError(
            f"attn_type {attn_type} is not a model of the XL or LaMemo papers (0: XL, 3: LaMemo, "
            "31: LaMemo with XL's encoding); megalab does not build it"
        )
    return kw


# Every argument of the reference `MemTransformerLM` (LaMemo's, a superset of XL's), by what
# megalab does with it. Mapped onto the encoder, backbone and head:
_MAPPED = frozenset(
    {
        "n_token", "n_layer", "n_head", "d_model", "d_head", "d_inner", "dropout", "dropatt",
        "tie_weight", "d_embed", "div_val", "tie_projs", "pre_lnorm", "mem_len", "ext_len",
        "cutoffs", "same_length", "attn_type", "clamp_len", "sample_softmax",
    }
)  # fmt: skip
# No effect on the model's outputs: `tgt_len` is the trainer's segment length (a data setting
# here); `adapt_inp` and `attn_norm_type` are stored but never read by the code; `save_analysis`
# only returns attention maps beside the outputs.
_NO_EFFECT = frozenset({"tgt_len", "adapt_inp", "attn_norm_type", "save_analysis"})
# Supported only at the default: the reason and what to use instead.
_DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "half_loss": (
        False,
        "the training loss on the second half of each segment only (doubled) is not "
        "implemented; the weights load into a model trained on the whole segment "
        "(half_loss=False), which evaluates the same",
    ),
    "enhance_recurrence": (
        False,
        "XL memory that caches layer outputs instead of layer inputs is not implemented; "
        "no LaMemo or XL setting uses it (enhance_recurrence=False)",
    ),
}


def check_reference_config(config: Mapping[str, Any]) -> None:
    """Refuse a reference `model_config` megalab cannot build exactly, naming the option.

    Every `MemTransformerLM` argument is known (mapped, without effect on the outputs, or
    supported at its default only); anything else is refused as unknown.
    """
    for name, value in config.items():
        if name in _DEFAULT_ONLY:
            default, why = _DEFAULT_ONLY[name]
            if bool(value) != default:
                raise ValueError(f"model_config {name}={value!r} is not supported: {why}")
        elif name not in _MAPPED and name not in _NO_EFFECT:
            raise ValueError(
                f"unknown model_config option {name}={value!r}: not an argument of the "
                "authors' MemTransformerLM, so megalab cannot tell what it changes"
            )
    if config.get("sample_softmax", -1) > 0:
        raise ValueError(
            f"model_config sample_softmax={config['sample_softmax']} (sampled softmax, "
            "training-only and unused by every XL/LaMemo setting) is not supported: its "
            "output layer is a plain Linear that megalab does not convert; use -1"
        )


def task_kwargs_from_reference(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Keyword arguments of the encoder, backbone and head of a reference `model_config`.

    The config is checked first (`check_reference_config`). Untied models (`tie_weight=False`)
    give a head with its own output tables (`tie_weight=False`): build the task with
    `tie_weights=True` all the same, which then shares only the projections of `tie_projs`, as
    the code does.
    """
    check_reference_config(config)
    d_embed = config.get("d_embed") or config["d_model"]
    common = {
        "d_model": config["d_model"],
        "d_embed": d_embed,
        "cutoffs": list(config.get("cutoffs") or []),
        "div_val": config.get("div_val", 1),
    }
    return {
        "encoder": {"vocab_size": config["n_token"], "dropout": config["dropout"], **common},
        "backbone": backbone_kwargs_from_reference(config),
        "head": {
            "vocab_size": config["n_token"],
            "tie_projs": list(config.get("tie_projs") or [False]),
            "tie_weight": bool(config.get("tie_weight", True)),
            **common,
        },
    }


def load_reference_checkpoint(path: str | Path) -> dict[str, Any]:
    """An XL/LaMemo trainer checkpoint read with `weights_only=True`: tensors, containers, the
    argparse Namespace, numpy scalars, and its vocabulary as an inert `ReferenceVocab`."""
    allowed: list[Any] = [
        *_checkpoint_safe_globals(),
        collections.Counter,
        (ReferenceVocab, "utils.vocabulary.Vocab"),
        (ReferenceVocab, "vocabulary.Vocab"),
    ]
    with torch.serialization.safe_globals(allowed):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"{path}: not a state dict or trainer checkpoint that loads without running "
                "code (the original XL `model.pt` pickles its module: save its state_dict() "
                f"with the authors' code and convert that) ({err})"
            ) from None
    if isinstance(ckpt, dict) and "model_state" in ckpt:
        if isinstance(ckpt.get("args"), argparse.Namespace):
            ckpt["args"] = vars(ckpt["args"])
        return ckpt
    if isinstance(ckpt, dict) and all(isinstance(v, Tensor) for v in ckpt.values()):
        return {"model_state": ckpt}
    raise ValueError(f"{path}: neither a state dict nor a trainer checkpoint with model_state")


def vocabulary_permutation(ref_symbols: Sequence[str], ours: Sequence[str]) -> list[int]:
    """For each of our token ids, the reference id of the same symbol (-1 when the reference
    vocabulary lacks it); `ours` is our vocabulary in id order."""
    index = {s: i for i, s in enumerate(ref_symbols)}
    return [index.get(s, -1) for s in ours]


def permute_vocabulary(
    sd: Mapping[str, Tensor], order: Sequence[int], absent_bias: float = -1.0e4
) -> dict[str, Tensor]:
    """A converted task state dict with embedding and output rows in our id order.

    Row t takes reference row `order[t]`; ids the reference lacks get a zero embedding and an
    output bias of `absent_bias` (probability e^-10^4 = 0: the reference's distribution).
    Only for a full softmax (one band): bands of an adaptive softmax follow the frequency order.
    """
    out = dict(sd)
    if any(k.startswith("head.cluster_") for k in sd):
        raise ValueError("reordering the vocabulary of an adaptive softmax would break its bands")
    index = torch.tensor(order)
    present = index >= 0
    for key in (
        "encoder.emb_layers.0.weight",
        "head.out_layers.0.weight",
        "head.out_layers.0.bias",
    ):
        if key not in sd:
            continue
        ref = sd[key]
        fill = absent_bias if key.endswith("bias") else 0.0
        rows = ref.new_full((len(order), *ref.shape[1:]), fill)
        rows[present] = ref[index[present]]
        out[key] = rows
    return out
