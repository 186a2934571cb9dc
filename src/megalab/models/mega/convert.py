"""The authors' Mega weights (facebookresearch/mega, a fairseq fork) onto megalab modules.

One function per level maps the authors' `state_dict` names and layouts onto ours and returns a
state dict for the matching megalab module (load it with `load_state_dict(..., strict=True)`):

    convert_ema            MultiHeadEMA                 -> megalab.nn.ema.DampedEMA
    convert_maga           MovingAverageGatedAttention  -> models.mega.MovingAverageGatedAttention
    convert_ffn            NormalizedFeedForwardNetwork -> megalab.nn.ffn.NormalizedFFN
    convert_encoder_layer  MegaSentenceEncoderLayer     -> models.mega.MegaBlock
    convert_lra_model      LRAModel (Mega LRA)          -> ClassificationTask(encoder, Mega, head)
    convert_vision_mega    VisionMEGA (mega-image repo) -> ClassificationTask(encoder, Mega, head)
    convert_gated_cross_attention  GatedCrossAttention  -> models.mega.cross_attention (same name)
    convert_decoder_layer  MegaDecoderLayer (MT)        -> models.mega.translation.MegaDecoderLayer
    convert_mega_translation  MegaModel (MT)       -> models.mega.translation.MegaEncoderDecoder

Renames: EMA `delta`/`alpha` are the paper's α/δ (the code swaps the names) and become our
`alpha`/`delta`; EMA `gamma` (η) becomes `eta`; the (D', h, 1) EMA tensors lose their last axis;
MAGA `gamma`/`beta` (the Q/K scale and offset κ, μ) become `kappa`/`mu`; the rel-pos tables move
under `attention.rel_pos_bias` (`rel_pos_bias` → `weight`, rotary `alpha`/`beta` → `a`/`b`); the
rotary `_float_tensor` buffer is dropped. The same functions map gradients, which carry the same
names.

From an official checkpoint (a fairseq checkpoint stores the weights under `model` and the
training arguments under `args`):

    ckpt = load_fairseq_checkpoint("checkpoint_best.pt")
    backbone = Mega(MegaConfig(**mega_kwargs_from_fairseq(ckpt["args"])))
    task = ClassificationTask(encoder, backbone, head, ...)
    task.load_state_dict(convert_lra_model(ckpt["model"]))

The authors' tensors are time-first (L, B, D) and their padding masks are True at padding; ours
are batch-first with masks True at real tokens: use `to_batch_first` and `mask_from_padding_mask`
at that boundary.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial

import torch
from torch import Tensor

from megalab.models.convert import (
    LRA_ENCODER,
    Target,
    _sub,
    _unknown,
    convert_layers,
    convert_lra_task,
    convert_module,
    kept,
    load_fairseq_checkpoint,
    mask_from_padding_mask,
    refused,
    rename_entries,
    reshaped,
    to_batch_first,
)
from megalab.models.mega.convert_args import (
    check_fairseq_args,
    check_fairseq_translation_args,
    maga_config_from_reference,
    mega_kwargs_from_fairseq,
    mega_translation_kwargs_from_fairseq,
)

__all__ = [
    "check_fairseq_args",
    "check_fairseq_translation_args",
    "convert_ema",
    "convert_encoder_layer",
    "convert_ffn",
    "convert_gated_cross_attention",
    "convert_lra_model",
    "convert_maga",
    "convert_mega_translation",
    "convert_vision_mega",
    "load_fairseq_checkpoint",
    "maga_config_from_reference",
    "mask_from_padding_mask",
    "mega_kwargs_from_fairseq",
    "mega_translation_kwargs_from_fairseq",
    "to_batch_first",
]

_EMA_NAMES = {"delta": "alpha", "alpha": "delta", "beta": "beta", "gamma": "eta", "omega": "omega"}
# The mega-image repo's EMA computes p = σ(alpha)·beta, q = 1 − σ(alpha)·σ(delta): its `alpha` is
# already the paper's input weight α, so only `gamma` (η) is renamed.
_EMA_NAMES_IMAGE = {
    "alpha": "alpha",
    "delta": "delta",
    "beta": "beta",
    "gamma": "eta",
    "omega": "omega",
}
EMA_NAMINGS = {"fairseq": _EMA_NAMES, "mega-image": _EMA_NAMES_IMAGE}
_LINEARS = ("v_proj.", "mx_proj.", "h_proj.")


def _ema_names(naming: str) -> dict[str, str]:
    if naming not in EMA_NAMINGS:
        raise ValueError(f"unknown EMA naming {naming!r}; choose one of {sorted(EMA_NAMINGS)}")
    return EMA_NAMINGS[naming]


def convert_ema(
    sd: Mapping[str, Tensor], prefix: str = "", naming: str = "fairseq"
) -> dict[str, Tensor]:
    """`MultiHeadEMA` entries under `prefix` -> `DampedEMA` state dict.

    `naming`: "fairseq" (`delta` is the input weight α; the default) or "mega-image" (`alpha`
    is α).
    """
    names = _ema_names(naming)
    out: dict[str, Tensor] = {}
    for name, t in _sub(sd, prefix).items():
        if name not in names:
            raise _unknown("MultiHeadEMA", name)
        if name in ("delta", "alpha", "beta"):
            t = t.reshape(t.shape[0], -1)  # (D', h, 1) -> (D', h)
        out[names[name]] = t
    return out


def _rel_pos_bias_names(under: str) -> dict[str, Target]:
    """The relative position bias, in MAGA and the cross-attention alike, as ours under `under`:
    'simple' (a (2M-1,) table) or 'rotary' (alpha, beta of shape (1, z) -> our (z,) a, b); the
    rotary `_float_tensor` buffer is a dtype/device marker with no information."""
    return {
        "rel_pos_bias.rel_pos_bias": reshaped(under + "rel_pos_bias.weight", -1),
        "rel_pos_bias.alpha": reshaped(under + "rel_pos_bias.a", -1),
        "rel_pos_bias.beta": reshaped(under + "rel_pos_bias.b", -1),
        "rel_pos_bias._float_tensor": None,
    }


# MAGA: the Q/K scale and offset `gamma`/`beta` are our `kappa`/`mu`; the EMA (`move.`) converts
# with `convert_ema`.
_MAGA_NAMES = {"gamma": "kappa", "beta": "mu", **_rel_pos_bias_names("attention.")}
_MAGA_PREFIXES = kept(*_LINEARS, "norm.norm.")


def convert_maga(
    sd: Mapping[str, Tensor], prefix: str = "", ema_naming: str = "fairseq"
) -> dict[str, Tensor]:
    """`MovingAverageGatedAttention` entries under `prefix` -> our MAGA state dict."""
    ema = ("ema.", partial(convert_ema, naming=ema_naming))
    return convert_module(
        sd, prefix, "MovingAverageGatedAttention", {"move.": ema}, _MAGA_NAMES, _MAGA_PREFIXES
    )


def convert_ffn(sd: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """`NormalizedFeedForwardNetwork` entries under `prefix` -> `NormalizedFFN` state dict."""
    prefixes = kept("fc1.", "fc2.", "norm.norm.")
    return convert_module(sd, prefix, "NormalizedFeedForwardNetwork", prefixes=prefixes)


def convert_encoder_layer(
    sd: Mapping[str, Tensor], prefix: str = "", ema_naming: str = "fairseq"
) -> dict[str, Tensor]:
    """`MegaSentenceEncoderLayer` (or mega-image `MegaLayer`) under `prefix` -> `MegaBlock`."""
    maga = partial(convert_maga, ema_naming=ema_naming)
    return convert_module(
        sd,
        prefix,
        "MegaSentenceEncoderLayer",
        {"mega_layer.": ("maga.", maga), "nffn.": ("ffn.", convert_ffn)},
    )


def convert_lra_model(
    sd: Mapping[str, Tensor],
    encoder_prefix: str = "encoder.",
    backbone_prefix: str = "backbone.",
    head_prefix: str = "head.",
) -> dict[str, Tensor]:
    """A Mega `LRAModel` (LRA text/image/retrieval) -> `ClassificationTask` state dict.

    SC-Raw's `SCRawModel` is built from the same parts; its checkpoint names are expected to
    follow the same scheme but no reference tensors cover them (an unknown name raises).

    The task's encoder is a `TokenEmbedding` (text: `embedding.weight`) or a
    `FeatureEmbedding` (pixels/audio: `proj.weight` (D, 1) and `proj.bias`, the authors'
    x·w + b), its backbone a `Mega` and its head a `ClassificationHead` with `fc1` (hidden,
    GELU) and `fc2` (no bias). The retrieval (two-document) model has the same names.
    """
    enc = LRA_ENCODER
    unsupported = refused(
        "only the Mega LRA archs (classifier_layers=1, no absolute positions) are supported; a "
        "checkpoint with more classifier layers or encoder_learned_pos has weights megalab has "
        "no place for"
    )
    prefixes: dict[str, Target] = {
        # --normalize-embedding (post-norm models)
        enc + "embed_norm.norm.": backbone_prefix + "embed_norm.norm.",
        enc + "embed_positions": unsupported,
        "classifier.": unsupported,
    }
    return convert_lra_task(
        sd, convert_encoder_layer, encoder_prefix, backbone_prefix, head_prefix, {}, prefixes
    )


def conv_patch_weight_to_linear(weight: Tensor) -> Tensor:
    """A stride-p patch convolution's (D, C, p, p) weight -> the (D, C·p·p) `FeatureEmbedding`.

    `megalab.data.imagenet.patchify` flattens each patch channel-major, (C, p, p), exactly the
    layout of a conv weight's input axes, and orders patches row-major like the conv's
    flattened (H/p, W/p) output; so the mapping is a reshape, no permutation:
    Linear(patchify(x)) = Conv2d(x, stride=p).flatten(2).transpose(1, 2).
    """
    if weight.dim() != 4:
        raise ValueError(f"expected a (D, C, p, p) conv weight, got shape {tuple(weight.shape)}")
    return weight.reshape(weight.shape[0], -1)


def linear_to_conv_patch_weight(weight: Tensor, channels: int = 3) -> Tensor:
    """The inverse of `conv_patch_weight_to_linear`: (D, C·p·p) -> (D, C, p, p)."""
    D, F = weight.shape
    p = round((F / channels) ** 0.5)
    if channels * p * p != F:
        raise ValueError(f"{F} features are not {channels} channels of a square patch")
    return weight.reshape(D, channels, p, p)


def convert_vision_mega(
    sd: Mapping[str, Tensor],
    encoder_prefix: str = "encoder.embed.",
    backbone_prefix: str = "backbone.",
    head_prefix: str = "head.",
    ema_naming: str = "mega-image",
) -> dict[str, Tensor]:
    """The mega-image repo's `VisionMEGA` (e.g. `mega_base_patch16_224`) -> task state dict.

    The target is `ClassificationTask(SequenceEncoder(d_input=3·p², ...), Mega(...,
    ema_shift=True, positions="learned", max_len=(img/p)², output_proj=True),
    ClassificationHead(D, 0, classes))` (configs/experiment/mega/imagenet.yaml), fed with
    `megalab.data.imagenet.patchify` patches; the default prefixes are that config's names
    (`encoder.embed.proj` is the `FeatureEmbedding` inside `SequenceEncoder`). Mapping:

        patch_embed.pemb.proj.{weight,bias}  -> encoder proj (conv (D, C, p, p) reshaped, or the
                                                 `patch_impl=linear` (D, C·p·p) as is)
        pos_embed (1, N, D)                   -> backbone.pos_embed (N, D)
        blocks.i.{mega_layer,nffn}.*          -> backbone.layers.i.{maga,ffn}.* (as LRA)
        final_norm.norm.*                     -> backbone.final_norm.norm.*
        out_proj.fc.*                         -> backbone.out_proj.*
        head.{weight,bias}                    -> head.fc2.{weight,bias}

    `ema_naming="mega-image"`: that repo's EMA names its input weight `alpha` (no swap, unlike
    fairseq); pass "fairseq" for a checkpoint whose EMA uses the fairseq names. DropPath has no
    weights. A `pre_logits` layer (`--representation-size`) is not supported.
    """
    layer = partial(convert_encoder_layer, ema_naming=ema_naming)
    out = convert_layers(sd, "blocks.", layer, backbone_prefix + "layers.")
    names: dict[str, Target] = {
        "patch_embed.pemb.proj.weight": lambda _, t: {
            encoder_prefix + "proj.weight": conv_patch_weight_to_linear(t) if t.dim() == 4 else t
        },
        "patch_embed.pemb.proj.bias": encoder_prefix + "proj.bias",
        "pos_embed": lambda _, t: {
            backbone_prefix + "pos_embed": t.reshape(t.shape[-2], t.shape[-1])
        },
        "head.weight": head_prefix + "fc2.weight",
        "head.bias": head_prefix + "fc2.bias",
    }
    prefixes: dict[str, Target] = {
        "blocks.": None,  # converted above
        "final_norm.norm.": backbone_prefix + "final_norm.norm.",
        "out_proj.fc.": backbone_prefix + "out_proj.",
        "pre_logits.": refused(
            "a representation layer (pre_logits, --representation-size) is not supported; only "
            "models built without it convert"
        ),
    }
    out.update(rename_entries(sd, "VisionMEGA", names, prefixes))
    return out


# -- machine translation (MegaModel, archs mega_wmt_en_de / mega_wmt_en_de_big) ---------------
_CROSS_LINEARS = ("k_proj.", "v_proj.", "q_proj.", "h_proj.")
_CROSS_NAMES = _rel_pos_bias_names("")


def convert_gated_cross_attention(sd: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """`GatedCrossAttention` entries under `prefix` -> our `GatedCrossAttention` state dict.

    The four linears and the norm keep their names; the relative position bias becomes
    `rel_pos_bias.weight` ('simple') or `rel_pos_bias.a` / `.b` ('rotary'), as in MAGA.
    """
    return convert_module(
        sd, prefix, "GatedCrossAttention", None, _CROSS_NAMES, kept(*_CROSS_LINEARS, "norm.norm.")
    )


def convert_decoder_layer(sd: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """`MegaDecoderLayer` under `prefix` -> our `MegaDecoderLayer` (maga, cross_attn, ffn)."""
    children = {
        "mega_layer.": ("maga.", convert_maga),
        "cross_attn.": ("cross_attn.", convert_gated_cross_attention),
        "nffn.": ("ffn.", convert_ffn),
    }
    return convert_module(sd, prefix, "MegaDecoderLayer", children)


def convert_mega_translation(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The authors' `MegaModel` state dict -> `MegaEncoderDecoder` state dict.

    Mapping (i: layer index):

        encoder.embed_tokens.weight           -> embed_src.embedding.weight
        decoder.embed_tokens.weight           -> embed_tgt.embedding.weight
        decoder.output_projection.weight      -> output_proj.weight (dropped when it is the
                                                 shared embedding: our output is then tied)
        encoder.layers.i.{mega_layer,nffn}.*  -> encoder.layers.i.{maga,ffn}.*
        decoder.layers.i.{mega_layer,cross_attn,nffn}.* -> decoder_layers.i.{maga,cross_attn,ffn}.*
        encoder.final_norm.norm.*             -> encoder.final_norm.norm.*  (pre-norm only)
        decoder.final_norm.norm.*             -> decoder_final_norm.norm.*  (pre-norm only)

    The `version` buffers carry no weights. With `--share-all-embeddings` the three tables are
    one tensor; load the result into a model built with `share_all_embeddings=True`.
    """
    out = convert_layers(sd, "encoder.layers.", convert_encoder_layer, "encoder.layers.")
    out.update(convert_layers(sd, "decoder.layers.", convert_decoder_layer, "decoder_layers."))
    tgt_embed = sd.get("decoder.embed_tokens.weight")
    for name, t in sd.items():
        if re.match(r"(encoder|decoder)\.layers\.\d+\.", name):
            continue
        if name == "encoder.embed_tokens.weight":
            out["embed_src.embedding.weight"] = t
        elif name == "decoder.embed_tokens.weight":
            out["embed_tgt.embedding.weight"] = t
        elif name == "decoder.output_projection.weight":
            tied = tgt_embed is not None and (t is tgt_embed or torch.equal(t, tgt_embed))
            if not tied:
                out["output_proj.weight"] = t
        elif name.startswith("encoder.final_norm.norm."):
            out[name] = t
        elif name.startswith("decoder.final_norm.norm."):
            out["decoder_final_norm." + name[len("decoder.final_norm.") :]] = t
        elif name in ("encoder.version", "decoder.version"):
            continue
        elif name.startswith(("encoder.embed_norm.", "decoder.embed_norm.", "decoder.project_in")):
            raise KeyError(
                f"{name!r}: the translation model's --normalize-embedding and project_in_dim "
                "(decoder_input_dim != decoder_embed_dim) are not supported; only models "
                "without them convert (the LRA encoder's normalize_embedding is: embed_norm)"
            )
        else:
            raise _unknown("MegaModel", name)
    return out
