"""The authors' Mega weights (facebookresearch/mega, a fairseq fork) onto megalab modules.

One function per level maps the authors' `state_dict` names and layouts onto ours and returns a
state dict for the matching megalab module (load it with `load_state_dict(..., strict=True)`):

    convert_ema            MultiHeadEMA                 -> megalab.nn.ema.DampedEMA
    convert_maga           MovingAverageGatedAttention  -> models.mega.MovingAverageGatedAttention
    convert_encoder_layer  MegaSentenceEncoderLayer     -> models.mega.MegaBlock
    convert_lra_model      LRAModel (Mega LRA)          -> ClassificationTask(encoder, Mega, head)
    convert_vision_mega    VisionMEGA (mega-image repo) -> ClassificationTask(encoder, Mega, head)
    convert_gated_cross_attention  GatedCrossAttention  -> nn.cross_attention.GatedCrossAttention
    convert_decoder_layer  MegaDecoderLayer (MT)        -> models.mega_translation.MegaDecoderLayer
    convert_mega_translation  MegaModel (MT)            -> MegaEncoderDecoder (mega_translation)

Renames: EMA `delta`/`alpha` are the paper's α/δ (the code swaps the names) and become our
`alpha`/`delta`; EMA `gamma` (η) becomes `eta`; the (D', h, 1) EMA tensors lose their last axis;
MAGA `gamma`/`beta` (the Q/K scale and offset κ, μ) become `kappa`/`mu`; the rel-pos tables move
under `attention.rel_pos_bias` (`rel_pos_bias` → `weight`, rotary `alpha`/`beta` → `a`/`b`); the
rotary `_float_tensor` buffer is dropped. The same functions map gradients, which carry the same
names.

From an official checkpoint (a fairseq checkpoint stores the weights under `model` and the
training arguments under `args`):

    ckpt = load_fairseq_checkpoint("checkpoint_best.pt")
    backbone = Mega(**mega_kwargs_from_fairseq(ckpt["args"]))
    task = ClassificationTask(encoder, backbone, head, ...)
    task.load_state_dict(convert_lra_model(ckpt["model"]))

The authors' tensors are time-first (L, B, D) and their padding masks are True at padding; ours
are batch-first with masks True at real tokens: use `to_batch_first` and `mask_from_padding_mask`
at that boundary.
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
from megalab.models.mega import MegaConfig
from megalab.nn.ffn import ACTIVATIONS

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


def convert_maga(
    sd: Mapping[str, Tensor], prefix: str = "", ema_naming: str = "fairseq"
) -> dict[str, Tensor]:
    """`MovingAverageGatedAttention` entries under `prefix` -> our MAGA state dict."""
    sub = _sub(sd, prefix)
    out = {"ema." + k: v for k, v in convert_ema(sub, "move.", ema_naming).items()}
    for name, t in sub.items():
        if name.startswith("move."):
            continue
        if name == "gamma":
            out["kappa"] = t
        elif name == "beta":
            out["mu"] = t
        elif name.startswith(_LINEARS) or name.startswith("norm.norm."):
            out[name] = t
        elif name == "rel_pos_bias.rel_pos_bias":
            out["attention.rel_pos_bias.weight"] = t
        elif name == "rel_pos_bias.alpha":
            out["attention.rel_pos_bias.a"] = t.reshape(-1)
        elif name == "rel_pos_bias.beta":
            out["attention.rel_pos_bias.b"] = t.reshape(-1)
        elif name == "rel_pos_bias._float_tensor":
            continue  # a dtype/device marker with no information
        else:
            raise _unknown("MovingAverageGatedAttention", name)
    return out


def convert_ffn(sd: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """`NormalizedFeedForwardNetwork` entries under `prefix` -> `NormalizedFFN` state dict."""
    out = {}
    for name, t in _sub(sd, prefix).items():
        if not name.startswith(("fc1.", "fc2.", "norm.norm.")):
            raise _unknown("NormalizedFeedForwardNetwork", name)
        out[name] = t
    return out


def convert_encoder_layer(
    sd: Mapping[str, Tensor], prefix: str = "", ema_naming: str = "fairseq"
) -> dict[str, Tensor]:
    """`MegaSentenceEncoderLayer` (or mega-image `MegaLayer`) under `prefix` -> `MegaBlock`."""
    sub = _sub(sd, prefix)
    for name in sub:
        if not name.startswith(("mega_layer.", "nffn.")):
            raise _unknown("MegaSentenceEncoderLayer", name)
    out = {"maga." + k: v for k, v in convert_maga(sub, "mega_layer.", ema_naming).items()}
    out.update({"ffn." + k: v for k, v in convert_ffn(sub, "nffn.").items()})
    return out


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
    out: dict[str, Tensor] = {}
    enc = "encoder.encoder."
    layer_ids = sorted(
        {int(m.group(1)) for k in sd if (m := re.match(re.escape(enc) + r"layers\.(\d+)\.", k))}
    )
    for i in layer_ids:
        layer = convert_encoder_layer(sd, f"{enc}layers.{i}.")
        out.update({f"{backbone_prefix}layers.{i}.{k}": v for k, v in layer.items()})
    for name, t in sd.items():
        if name.startswith(enc + "layers."):
            continue
        if name == enc + "embed_tokens.embed.weight":
            out[encoder_prefix + "embedding.weight"] = t
        elif name == enc + "embed_tokens.weight":
            out[encoder_prefix + "proj.weight"] = t.reshape(-1, 1)
        elif name == enc + "embed_tokens.bias":
            out[encoder_prefix + "proj.bias"] = t
        elif name.startswith((enc + "final_norm.norm.", enc + "embed_norm.norm.")):
            # embed_norm: --normalize-embedding (post-norm models)
            out[backbone_prefix + name[len(enc) :]] = t
        elif name.startswith("classifier.0.0."):
            out[head_prefix + "fc1." + name[len("classifier.0.0.") :]] = t
        elif name == "sentence_projection_layer.weight":
            out[head_prefix + "fc2.weight"] = t
        elif name.startswith("classifier.") or name.startswith(enc + "embed_positions"):
            raise KeyError(
                f"{name!r}: only the Mega LRA archs (classifier_layers=1, no absolute "
                "positions) are supported; a checkpoint with more classifier layers or "
                "encoder_learned_pos has weights megalab has no place for"
            )
        else:
            raise _unknown("LRAModel", name)
    return out


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
    out: dict[str, Tensor] = {}
    layer_ids = sorted({int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
    for i in layer_ids:
        layer = convert_encoder_layer(sd, f"blocks.{i}.", ema_naming)
        out.update({f"{backbone_prefix}layers.{i}.{k}": v for k, v in layer.items()})
    for name, t in sd.items():
        if name.startswith("blocks."):
            continue
        if name == "patch_embed.pemb.proj.weight":
            out[encoder_prefix + "proj.weight"] = (
                conv_patch_weight_to_linear(t) if t.dim() == 4 else t
            )
        elif name == "patch_embed.pemb.proj.bias":
            out[encoder_prefix + "proj.bias"] = t
        elif name == "pos_embed":
            out[backbone_prefix + "pos_embed"] = t.reshape(t.shape[-2], t.shape[-1])
        elif name.startswith("final_norm.norm."):
            out[backbone_prefix + name] = t
        elif name.startswith("out_proj.fc."):
            out[backbone_prefix + "out_proj." + name[len("out_proj.fc.") :]] = t
        elif name in ("head.weight", "head.bias"):
            out[head_prefix + "fc2." + name[len("head.") :]] = t
        elif name.startswith("pre_logits."):
            raise KeyError(
                f"{name!r}: a representation layer (pre_logits, --representation-size) is not "
                "supported; only models built without it convert"
            )
        else:
            raise _unknown("VisionMEGA", name)
    return out


# The options of the authors' LRA model parser (`LRAModel.add_args`) and of its arch defaults,
# by how a Mega backbone takes them. Keys in `_FAIRSEQ_MAPPED` become `Mega` arguments.
_FAIRSEQ_MAPPED = frozenset(
    {
        "encoder_embed_dim", "encoder_layers", "z_dim", "encoder_hidden_dim",
        "encoder_ffn_embed_dim", "n_dim", "chunk_size", "truncation_length",
        "attention_activation_fn", "rel_pos_bias", "max_positions", "norm_type",
        "encoder_normalize_before", "normalize_embedding", "dropout", "attention_dropout",
        "act_dropout", "activation_fn",
    }
)  # fmt: skip
# Read by the encoder, the head or the task, not by the backbone (see `convert_lra_model`):
# `input_type` (TokenEmbedding or FeatureEmbedding), the classifier sizes and activation
# (ClassificationHead), `sentence_class_num`, `sent_loss`, and `max_source_positions` /
# `decoder_embed_dim` (copies the model fills in from the above).
_FAIRSEQ_OUTSIDE_BACKBONE = frozenset(
    {
        "input_type", "sentence_class_num", "sent_loss", "classifier_in_dim",
        "classifier_out_dim", "classifier_activation_fn", "max_source_positions",
        "decoder_embed_dim",
    }
)  # fmt: skip
# Options of the parser that the Mega LRA encoder never reads (other layer types' options, or
# ones LRAEncoder does not pass on): any value builds the same Mega model.
_FAIRSEQ_UNUSED_BY_MEGA = frozenset(
    {
        "encoder_attention_heads", "encoder_learned_pos", "no_token_positional_embeddings",
        "share_encoder_input_output_embed", "encoder_layerdrop", "no_scale_embedding",
        "quant_noise_pq", "quant_noise_pq_block_size", "quant_noise_scalar",
        "encoder_projection_length", "encoder_projected_attention_heads",
        "decoder_projected_attention_heads", "tie_layer_weights", "adaptive_input",
    }
)  # fmt: skip
# Options megalab builds only at one value (the one every Mega LRA/SC arch uses): any other
# value is refused with the reason.
_FAIRSEQ_FIXED: dict[str, tuple[Any, str]] = {
    "layer_type": ("mega", "only the Mega layer type converts onto megalab's Mega"),
    "feature_dropout": (
        False,
        "channel-wise (Dropout2d) feature dropout is not implemented; retrain with element "
        "dropout (feature_dropout=False)",
    ),
    "apply_bert_init": (
        False,
        "BERT initialisation of a Mega model is not implemented (no Mega arch uses it); "
        "the weights of a checkpoint do not depend on it, so load with apply_bert_init=False",
    ),
    "use_p": (False, "use_p reads the Luna encoder's projected sequence, which Mega lacks"),
    "sen_rep_type": (
        "mp",
        "megalab's Mega classifiers mean-pool ('mp'); the 'cls' representation needs the "
        "task's prepended <CLS> token, which megalab's LRA data does not add",
    ),
    "classifier_layers": (
        1,
        "megalab's ClassificationHead has exactly one hidden layer (every Mega LRA/SC arch)",
    ),
}
# Other keys of a fairseq namespace (the trainer's, task's, optimizer's options) do not shape
# the model; a key with a model-option prefix that is in none of the sets above is refused.
_FAIRSEQ_MODEL_PREFIXES = ("encoder_", "decoder_", "classifier_", "sen_", "sentence_", "layer_")


def check_fairseq_args(args: Mapping[str, Any]) -> None:
    """Refuse a Mega LRA/SC fairseq namespace megalab cannot build exactly, naming the option.

    Every option of the authors' LRA model parser is known here: mapped onto `Mega`, read by
    the encoder/head/task, unused by the Mega encoder, or supported at one value only. An
    option with a model prefix (`encoder_`, `decoder_`, `classifier_`, ...) that is none of
    these is refused as unknown.
    """
    for name, value in args.items():
        if name in _FAIRSEQ_FIXED:
            want, why = _FAIRSEQ_FIXED[name]
            if value != want:
                raise ValueError(f"fairseq arg {name}={value!r} is not supported: {why}")
        elif name in _FAIRSEQ_MAPPED | _FAIRSEQ_OUTSIDE_BACKBONE | _FAIRSEQ_UNUSED_BY_MEGA:
            continue
        elif name.startswith(_FAIRSEQ_MODEL_PREFIXES):
            raise ValueError(
                f"unknown fairseq model arg {name}={value!r}: not an option of the authors' Mega "
                "LRA model, so megalab cannot tell what it changes; remove it if it does not "
                "shape the model"
            )
    activation = args.get("activation_fn")
    if _fairseq_activation(activation) not in ACTIVATIONS:
        raise ValueError(
            f"fairseq arg activation_fn={activation!r} is not supported; megalab has "
            f"{', '.join(ACTIVATIONS)} (gelu_fast is gelu_accurate)"
        )
    if args.get("truncation_length") == 0:
        raise ValueError(
            "fairseq arg truncation_length=0 gives the bidirectional EMA an empty kernel, which "
            "the authors' code cannot run; no such LRA model exists (use None for no truncation)"
        )
    if args.get("normalize_embedding") and args.get("encoder_normalize_before"):
        raise ValueError(
            "fairseq args normalize_embedding and encoder_normalize_before are exclusive in the "
            "authors' code (it asserts so)"
        )


def _fairseq_activation(name: Any) -> Any:
    """fairseq's deprecated `gelu_fast` is its `gelu_accurate`."""
    return "gelu_accurate" if name == "gelu_fast" else name


def mega_kwargs_from_fairseq(args: Mapping[str, Any] | Any) -> dict[str, Any]:
    """`Mega(...)` keyword arguments from a Mega LRA/SC fairseq argument namespace (or dict).

    The namespace is checked first (`check_fairseq_args`): an option megalab cannot build is
    refused by name. In LRA/SC runs `--act-dropout` drives both the value (V) and the FFN hidden
    dropout. `truncation_length` None is the whole sequence (the code's kernel length L).
    `--normalize-embedding` becomes `embed_norm=True` with `embed_dropout=dropout`: the code
    normalises the embedding before its embedding dropout, so build the encoder with
    `dropout=0` then (the backbone applies it after the norm).
    """
    a = args if isinstance(args, Mapping) else vars(args)
    check_fairseq_args(a)
    truncation = a.get("truncation_length")
    embed_norm = bool(a.get("normalize_embedding", False))
    return {
        "d_model": a["encoder_embed_dim"],
        "num_layers": a["encoder_layers"],
        "z_dim": a["z_dim"],
        "v_dim": a["encoder_hidden_dim"],
        "ffn_dim": a["encoder_ffn_embed_dim"],
        "ema_dim": a["n_dim"],
        "chunk_size": a["chunk_size"],
        "truncation": truncation,
        "attention_activation": a["attention_activation_fn"],
        "rel_pos_bias": a["rel_pos_bias"],
        "max_positions": a["max_positions"],
        "norm_type": a["norm_type"],
        "prenorm": a["encoder_normalize_before"],
        "embed_norm": embed_norm,
        "embed_dropout": a["dropout"] if embed_norm else 0.0,
        "causal": False,
        "dropout": a["dropout"],
        "attention_dropout": a["attention_dropout"],
        "hidden_dropout": a["act_dropout"],
        "activation_dropout": a["act_dropout"],
        "activation": _fairseq_activation(a["activation_fn"]),
    }


_REFERENCE_LAYER_KWARGS = frozenset(
    {
        "embed_dim", "embedding_dim", "zdim", "z_dim", "hdim", "hidden_dim", "ndim", "n_dim",
        "chunk_size", "truncation", "attention_activation", "rel_pos_bias", "max_positions",
        "norm_type", "prenorm", "norm_affine", "bidirectional", "dropout", "attention_dropout",
        "hidden_dropout", "activation", "ffn_hidden_dim", "feature_dropout", "export",
    }
)  # fmt: skip


def maga_config_from_reference(kwargs: Mapping[str, Any]) -> MegaConfig:
    """The `MegaConfig` of our MAGA / MegaBlock from the authors' MAGA or encoder-layer kwargs.

    `truncation` is taken as is: None is the whole sequence, 0 the code's empty kernel (causal
    only; see `megalab.nn.ema.DampedEMA`). `norm_affine=False` gives non-affine block norms.
    An unknown argument, or `feature_dropout=True`, is refused by name; `export` (apex's
    fused-norm switch) does not change the result.
    """
    k = dict(kwargs)
    for name in k:
        if name not in _REFERENCE_LAYER_KWARGS:
            raise ValueError(f"unknown Mega layer argument {name!r}: megalab cannot build it")
    if k.get("feature_dropout"):
        raise ValueError(
            "feature_dropout=True (channel-wise Dropout2d) is not implemented; use element "
            "dropout (feature_dropout=False)"
        )
    d = k.get("embed_dim", k.get("embedding_dim"))
    out = {
        "d_model": d,
        "z_dim": k.get("zdim", k.get("z_dim")),
        "v_dim": k.get("hdim", k.get("hidden_dim")),
        "ema_dim": k.get("ndim", k.get("n_dim")),
        "chunk_size": k["chunk_size"],
        "truncation": k.get("truncation"),
        "attention_activation": k["attention_activation"],
        "rel_pos_bias": k["rel_pos_bias"],
        "max_positions": k["max_positions"],
        "norm_type": k["norm_type"],
        "prenorm": k["prenorm"],
        "norm_affine": k.get("norm_affine", True),
        "causal": not k.get("bidirectional", True),  # the encoder layer is always bidirectional
        "dropout": k["dropout"],
        "attention_dropout": k["attention_dropout"],
        "hidden_dropout": k["hidden_dropout"],
        "activation": _fairseq_activation(k["activation"]),
    }
    if "ffn_hidden_dim" in k:
        out["ffn_dim"] = k["ffn_hidden_dim"]
        out["activation_dropout"] = k["hidden_dropout"]
    return MegaConfig(**out)


# -- machine translation (MegaModel, archs mega_wmt_en_de / mega_wmt_en_de_big) ---------------
_CROSS_LINEARS = ("k_proj.", "v_proj.", "q_proj.", "h_proj.")


def convert_gated_cross_attention(sd: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """`GatedCrossAttention` entries under `prefix` -> our `GatedCrossAttention` state dict.

    The four linears and the norm keep their names; the relative position bias becomes
    `rel_pos_bias.weight` ('simple') or `rel_pos_bias.a` / `.b` ('rotary'), as in MAGA.
    """
    out: dict[str, Tensor] = {}
    for name, t in _sub(sd, prefix).items():
        if name.startswith(_CROSS_LINEARS) or name.startswith("norm.norm."):
            out[name] = t
        elif name == "rel_pos_bias.rel_pos_bias":
            out["rel_pos_bias.weight"] = t
        elif name == "rel_pos_bias.alpha":
            out["rel_pos_bias.a"] = t.reshape(-1)
        elif name == "rel_pos_bias.beta":
            out["rel_pos_bias.b"] = t.reshape(-1)
        elif name == "rel_pos_bias._float_tensor":
            continue
        else:
            raise _unknown("GatedCrossAttention", name)
    return out


def convert_decoder_layer(sd: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """`MegaDecoderLayer` under `prefix` -> our `MegaDecoderLayer` (maga, cross_attn, ffn)."""
    sub = _sub(sd, prefix)
    for name in sub:
        if not name.startswith(("mega_layer.", "cross_attn.", "nffn.")):
            raise _unknown("MegaDecoderLayer", name)
    out = {"maga." + k: v for k, v in convert_maga(sub, "mega_layer.").items()}
    out.update(
        {"cross_attn." + k: v for k, v in convert_gated_cross_attention(sub, "cross_attn.").items()}
    )
    out.update({"ffn." + k: v for k, v in convert_ffn(sub, "nffn.").items()})
    return out


def _layer_ids(sd: Mapping[str, Tensor], prefix: str) -> list[int]:
    pattern = re.escape(prefix) + r"(\d+)\."
    return sorted({int(m.group(1)) for k in sd if (m := re.match(pattern, k))})


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
    out: dict[str, Tensor] = {}
    for i in _layer_ids(sd, "encoder.layers."):
        layer = convert_encoder_layer(sd, f"encoder.layers.{i}.")
        out.update({f"encoder.layers.{i}.{k}": v for k, v in layer.items()})
    for i in _layer_ids(sd, "decoder.layers."):
        layer = convert_decoder_layer(sd, f"decoder.layers.{i}.")
        out.update({f"decoder_layers.{i}.{k}": v for k, v in layer.items()})
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


# The translation model's parser (`MegaModel.add_args`) and arch defaults, by how
# `MegaEncoderDecoder` takes them (see `check_fairseq_translation_args`).
_MT_MAPPED = frozenset(
    {
        "activation_fn", "attention_activation_fn", "dropout", "attention_dropout",
        "hidden_dropout", "activation_dropout", "encoder_embed_dim", "encoder_hidden_dim",
        "encoder_z_dim", "encoder_n_dim", "encoder_ffn_embed_dim", "encoder_chunk_size",
        "encoder_layers", "decoder_layers", "decoder_chunk_size",
        "share_decoder_input_output_embed", "share_all_embeddings", "normalization_type",
        "normalize_before", "rel_pos_bias", "truncation_length", "max_source_positions",
        "max_target_positions",
    }
)  # fmt: skip
# One width for both stacks in MegaEncoderDecoder: the decoder's must equal the encoder's.
_MT_SAME_AS_ENCODER = {
    "decoder_embed_dim": "encoder_embed_dim",
    "decoder_input_dim": "encoder_embed_dim",
    "decoder_hidden_dim": "encoder_hidden_dim",
    "decoder_ffn_embed_dim": "encoder_ffn_embed_dim",
    "decoder_z_dim": "encoder_z_dim",
    "decoder_n_dim": "encoder_n_dim",
}
# Initialisation-only paths, and adaptive-softmax settings that act only with a cutoff.
_MT_NO_EFFECT = frozenset(
    {
        "encoder_embed_path", "decoder_embed_path", "adaptive_softmax_dropout",
        "adaptive_input", "tie_adaptive_weights",
    }
)  # fmt: skip
_MT_DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "feature_dropout": (False, "channel-wise dropout is not implemented; use False"),
    "normalize_embedding": (False, "the translation embedding norm is not implemented; use False"),
    "no_scale_embedding": (
        False,
        "MegaEncoderDecoder always scales embeddings by sqrt(d); use False",
    ),
    "adaptive_softmax_cutoff": (None, "no adaptive softmax in MegaEncoderDecoder; use None"),
}
_MT_MODEL_PREFIXES = ("encoder_", "decoder_", "adaptive_", "share_", "normaliz")


def check_fairseq_translation_args(args: Mapping[str, Any]) -> None:
    """Refuse a Mega translation namespace `MegaEncoderDecoder` cannot build, naming the option.

    Every option of the authors' `MegaModel` parser and arch defaults is known; a key with a
    model prefix (`encoder_`, `decoder_`, ...) that is not one of them is refused as unknown.
    """
    for name, value in args.items():
        if name in _MT_DEFAULT_ONLY:
            default, why = _MT_DEFAULT_ONLY[name]
            if value != default and not (default is False and not value):
                raise ValueError(f"fairseq arg {name}={value!r} is not supported: {why}")
        elif name in _MT_SAME_AS_ENCODER:
            other = _MT_SAME_AS_ENCODER[name]
            if value is not None and value != args.get(other, value):
                raise ValueError(
                    f"fairseq arg {name}={value!r} differs from {other}={args[other]!r}: "
                    "MegaEncoderDecoder uses one width for both stacks"
                )
        elif name in _MT_MAPPED or name in _MT_NO_EFFECT:
            continue
        elif name.startswith(_MT_MODEL_PREFIXES):
            raise ValueError(
                f"unknown fairseq model arg {name}={value!r}: not an option of the authors' Mega "
                "translation model, so megalab cannot tell what it changes"
            )
    activation = args.get("activation_fn")
    if _fairseq_activation(activation) not in ACTIVATIONS:
        raise ValueError(
            f"fairseq arg activation_fn={activation!r} is not supported; megalab has "
            f"{', '.join(ACTIVATIONS)}"
        )


def mega_translation_kwargs_from_fairseq(args: Mapping[str, Any] | Any) -> dict[str, Any]:
    """`MegaEncoderDecoder(...)` keyword arguments (without vocab_size/pad_id) from the
    arguments of a fairseq `mega` translation checkpoint (after its arch defaults).

    The namespace is checked first (`check_fairseq_translation_args`): an option megalab cannot
    build is refused by name. A `truncation_length` of 0 (the WMT README) is read as no
    truncation (see
    `megalab.models.mega_translation`). The code defaults `max_source_positions` and
    `max_target_positions` to 1024 when they are unset.
    """
    a = args if isinstance(args, Mapping) else vars(args)
    check_fairseq_translation_args(a)
    return {
        "d_model": a["encoder_embed_dim"],
        "encoder_layers": a["encoder_layers"],
        "decoder_layers": a["decoder_layers"],
        "z_dim": a["encoder_z_dim"],
        "v_dim": a["encoder_hidden_dim"],
        "ffn_dim": a["encoder_ffn_embed_dim"],
        "ema_dim": a["encoder_n_dim"],
        "encoder_chunk_size": a["encoder_chunk_size"],
        "decoder_chunk_size": a.get("decoder_chunk_size", a["encoder_chunk_size"]),
        "truncation": a.get("truncation_length") or None,
        "attention_activation": a["attention_activation_fn"],
        "rel_pos_bias": a.get("rel_pos_bias", "simple"),
        "max_source_positions": a.get("max_source_positions") or 1024,
        "max_target_positions": a.get("max_target_positions") or 1024,
        "norm_type": a["normalization_type"],
        "prenorm": bool(a.get("normalize_before", False)),
        "dropout": a["dropout"],
        "attention_dropout": a["attention_dropout"],
        "hidden_dropout": a["hidden_dropout"],
        "activation_dropout": a["activation_dropout"],
        "activation": _fairseq_activation(a["activation_fn"]),
        "share_all_embeddings": bool(a.get("share_all_embeddings", False)),
        "share_decoder_input_output_embed": bool(
            a.get("share_decoder_input_output_embed", False) or a.get("share_all_embeddings")
        ),
    }
