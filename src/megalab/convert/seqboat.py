"""The authors' SeqBoat weights (renll/SeqBoat, a fairseq fork of Mega) onto megalab modules.

One function per level maps the authors' `state_dict` names and layouts onto ours and returns a
state dict for the matching megalab module (load it with `load_state_dict(..., strict=True)`):

    convert_unit       SeqBoatUnit (the code's "slag" layer)  -> models.seqboat.SeqBoatLayer
    convert_lra_model  LRAModel with SeqBoat layers (LRA)     -> ClassificationTask(encoder,
                                                                 SeqBoat, head)
    convert_lm_model   the slag LM decoder (enwik8)           -> LanguageModelingTask(encoder,
                                                                 SeqBoat, head)

Renames: the EMA `move.*` becomes `ssm.*` with Mega's renames (`delta`/`alpha` are the paper's
α/δ, `gamma` is η; see `megalab.convert.mega.convert_ema`); the unit's `gamma`/`beta` (the Q/K
scale and offset) become `kappa`/`mu`; `q_router.temp` (log τ) becomes `router.log_tau`;
`rel_pos_bias.rel_pos_bias` moves to `attention.rel_pos_bias.weight`; `mx_proj`, `hx_proj`,
`h_proj` and `norm.norm.*` keep their names. The LRA encoder's `pos_emb.scale` (`--add-apos`)
becomes the backbone's `pos_scale` (its `inv_freq` buffer is recomputed, and checked). The same
functions map gradients, which carry the same names.

From an official checkpoint (fairseq stores the weights under `model`, the arguments under
`args`):

    ckpt = load_fairseq_checkpoint("checkpoint_best.pt")
    backbone = SeqBoat(**seqboat_kwargs_from_fairseq(ckpt["args"]))
    task = ClassificationTask(encoder, backbone, head, num_classes=..., pooling="mean")
    task.load_state_dict(convert_lra_model(ckpt["model"]))

The code is time-first (L, B, D) with padding masks True at padding; use `to_batch_first` and
`mask_from_padding_mask` at that boundary.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from megalab.convert.common import (
    _sub,
    _unknown,
    load_fairseq_checkpoint,
    mask_from_padding_mask,
    to_batch_first,
)
from megalab.convert.mega import convert_ema

__all__ = [
    "convert_lm_model",
    "convert_lra_model",
    "convert_unit",
    "load_fairseq_checkpoint",
    "mask_from_padding_mask",
    "seqboat_kwargs_from_fairseq",
    "to_batch_first",
    "unit_kwargs_from_reference",
]

_KEEP = ("mx_proj.", "hx_proj.", "h_proj.", "norm.norm.")


def convert_unit(sd: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """`SeqBoatUnit` entries under `prefix` -> `SeqBoatLayer` state dict."""
    sub = _sub(sd, prefix)
    out = {"ssm." + k: v for k, v in convert_ema(sub, "move.").items()}
    for name, t in sub.items():
        if name.startswith("move."):
            continue
        if name == "gamma":
            out["kappa"] = t
        elif name == "beta":
            out["mu"] = t
        elif name == "q_router.temp":
            out["router.log_tau"] = t.reshape(1)
        elif name == "rel_pos_bias.rel_pos_bias":
            out["attention.rel_pos_bias.weight"] = t
        elif name.startswith(_KEEP):
            out[name] = t
        else:
            raise _unknown("SeqBoatUnit", name)
    return out


def _convert_layers(
    sd: Mapping[str, Tensor], root: str, unit: str, backbone_prefix: str
) -> dict[str, Tensor]:
    """Every `{root}layers.{i}.{unit}.*` (and `nffn.*`) -> `{backbone_prefix}layers.{i}.*`."""
    out: dict[str, Tensor] = {}
    ids = sorted(
        {int(m.group(1)) for k in sd if (m := re.match(re.escape(root) + r"layers\.(\d+)\.", k))}
    )
    for i in ids:
        layer = _sub(sd, f"{root}layers.{i}.")
        for name in layer:
            if not name.startswith((unit + ".", "nffn.")):
                raise _unknown("SeqBoat encoder/decoder layer", name)
        pre = f"{backbone_prefix}layers.{i}."
        out.update({pre + "layer." + k: v for k, v in convert_unit(layer, unit + ".").items()})
        out.update({pre + "ffn." + k: v for k, v in _sub(layer, "nffn.").items()})
    return out


def _check_inv_freq(t: Tensor) -> None:
    """The code's sinusoidal `inv_freq` buffer must be the one we recompute, 10000^(−2i/D)."""
    D = 2 * t.numel()
    ours = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    if not torch.allclose(t.double(), ours, rtol=1e-6, atol=0):
        raise ValueError("pos_emb.inv_freq is not 10000^(-2i/D): an unsupported position scheme")


def convert_lra_model(
    sd: Mapping[str, Tensor],
    encoder_prefix: str = "encoder.",
    backbone_prefix: str = "backbone.",
    head_prefix: str = "head.",
) -> dict[str, Tensor]:
    """A SeqBoat `LRAModel` (LRA text/image/retrieval; SC-Raw has the same parts) ->
    `ClassificationTask` state dict.

    The task's encoder is a `TokenEmbedding` (text: `embedding.weight`) or a `FeatureEmbedding`
    (pixels/audio: `proj.weight` (D, 1), `proj.bias`), its backbone a `SeqBoat` and its head a
    `ClassificationHead` (`fc1`, GELU, `fc2` without bias). Each layer's unit is called
    `mega_layer` in the code.
    """
    enc = "encoder.encoder."
    out = _convert_layers(sd, enc, "mega_layer", backbone_prefix)
    for name, t in sd.items():
        if name.startswith(enc + "layers."):
            continue
        if name == enc + "embed_tokens.embed.weight":
            out[encoder_prefix + "embedding.weight"] = t
        elif name == enc + "embed_tokens.weight":
            out[encoder_prefix + "proj.weight"] = t.reshape(-1, 1)
        elif name == enc + "embed_tokens.bias":
            out[encoder_prefix + "proj.bias"] = t
        elif name == enc + "pos_emb.scale":
            out[backbone_prefix + "pos_scale"] = t.reshape(1)
        elif name == enc + "pos_emb.inv_freq":
            _check_inv_freq(t)
        elif name.startswith(enc + "final_norm.norm."):
            out[backbone_prefix + name[len(enc) :]] = t
        elif name.startswith("classifier.0.0."):
            out[head_prefix + "fc1." + name[len("classifier.0.0.") :]] = t
        elif name == "sentence_projection_layer.weight":
            out[head_prefix + "fc2.weight"] = t
        elif name.startswith("classifier."):
            raise KeyError(f"{name!r}: only the slag archs' one-layer classifier is supported")
        else:
            raise _unknown("LRAModel", name)
    return out


def convert_lm_model(
    sd: Mapping[str, Tensor],
    encoder_prefix: str = "encoder.embed.",
    backbone_prefix: str = "backbone.",
) -> dict[str, Tensor]:
    """The slag LM decoder (`slag_lm_enwik8_base_v2`) -> `LanguageModelingTask` state dict.

    Expected names: `decoder.embed_tokens.weight` (the tied input/output table),
    `decoder.layers.{i}.slag_layer.*` (the unit, as `convert_unit`), `decoder.layers.{i}.nffn.*`
    when an FFN is present, and `decoder.final_norm.norm.*` when the final norm is affine. The
    target is `LanguageModelingTask(SequenceEncoder(vocab_size=V, token_scale=True), SeqBoat(
    causal=True, ...), LinearLMHead, tie_weights=True)` (configs/experiment/seqboat/enwik8),
    whose tied head needs no entry. No reference tensors cover this mapping (the layer names
    are the unit's, which the golden tests cover); an unexpected name raises.
    """
    dec = "decoder."
    out = _convert_layers(sd, dec, "slag_layer", backbone_prefix)
    for name, t in sd.items():
        if name.startswith(dec + "layers."):
            continue
        if name == dec + "embed_tokens.weight":
            out[encoder_prefix + "embedding.weight"] = t
        elif name.startswith(dec + "final_norm.norm."):
            out[backbone_prefix + name[len(dec) :]] = t
        elif name in (dec + "output_projection.weight", dec + "version"):
            continue  # the tied projection (same tensor as the embedding), a version marker
        else:
            raise _unknown("SeqBoat LM decoder", name)
    return out


def unit_kwargs_from_reference(ctor: Mapping[str, Any]) -> dict[str, Any]:
    """`SeqBoatConfig` keyword arguments (one layer) from the code's `SeqBoatUnit` kwargs.

    `chunk_size <= 0` is the code's global mode (SeqBoat-full); `always_act` removes the
    configurator; `density_threshold` and `max_steps` have no effect in the code's local mode
    (README §6, quirk 6) and are not needed.
    """
    k = dict(ctor)
    chunk = k["chunk_size"]
    return {
        "d_model": k["embed_dim"],
        "num_layers": 1,
        "z_dim": k["zdim"],
        "v_dim": k["hdim"],
        "ema_dim": k["ndim"],
        "truncation": k.get("truncation") or None,
        "attention": "local" if chunk > 0 else "full",
        "chunk_size": chunk if chunk > 0 else 128,
        "attention_activation": k["attention_activation"],
        "rel_pos_bias": k["rel_pos_bias"],
        "local_pos": bool(k.get("local_pos", False)),
        "max_positions": k["max_positions"],
        "norm_type": k["norm_type"],
        "prenorm": k["prenorm"],
        "causal": not k["bidirectional"],
        "router": "none" if k.get("always_act") else "softmax",
        "init_temp_scale": k["init_temp_scale"],
        "always_compress": False,
        "dropout": k["dropout"],
        "attention_dropout": k["attention_dropout"],
        "hidden_dropout": k["hidden_dropout"],
    }


def seqboat_kwargs_from_fairseq(args: Mapping[str, Any] | Any) -> dict[str, Any]:
    """`SeqBoat(...)` keyword arguments from a SeqBoat LRA/SC fairseq argument namespace.

    As Mega's LRA encoder, `--act-dropout` drives the value (V) dropout and `--dropout` the
    embedding dropout (`input_dropout`); `--add-apos` adds the scaled sinusoidal positions.
    """
    a = args if isinstance(args, Mapping) else vars(args)
    chunk = a["chunk_size"]
    ffn = a.get("encoder_ffn_embed_dim", -1) or -1
    return {
        "d_model": a["encoder_embed_dim"],
        "num_layers": a["encoder_layers"],
        "z_dim": a["z_dim"],
        "v_dim": a["encoder_hidden_dim"],
        "ema_dim": a["n_dim"],
        "truncation": a.get("truncation_length") or None,
        "attention": "local" if chunk > 0 else "full",
        "chunk_size": chunk if chunk > 0 else 128,
        "attention_activation": a["attention_activation_fn"],
        "rel_pos_bias": a["rel_pos_bias"],
        "local_pos": bool(a.get("local_pos", False)),
        "max_positions": a["max_positions"],
        "positions": "sinusoidal" if a.get("add_apos") else "none",
        "norm_type": a["norm_type"],
        "prenorm": a["encoder_normalize_before"],
        "causal": False,
        "router": "none" if a.get("always_act") else "softmax",
        "init_temp_scale": a["init_temp_scale"],
        "act_bias": float(a.get("act_bias", 0.0) or 0.0),
        "always_compress": False,
        "ffn_dim": max(int(ffn), 0),
        "dropout": a["dropout"],
        "attention_dropout": a["attention_dropout"],
        "hidden_dropout": a["act_dropout"],
        "activation_dropout": a["act_dropout"],
        "input_dropout": a["dropout"],
    }
