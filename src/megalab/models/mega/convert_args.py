"""The training arguments of the authors' Mega checkpoints (a fairseq `args` namespace) as
megalab's: each option is mapped, known to have no effect, or refused with the reason.

    mega_kwargs_from_fairseq              LRAModel's args        -> `MegaConfig(**kwargs)`
    maga_config_from_reference            a reference layer's kwargs -> `MegaConfig`
    mega_translation_kwargs_from_fairseq  MegaModel's (MT) args  -> `MegaEncoderDecoderConfig(...)`

(`megalab.models.mega.convert` converts the weights and re-exports these.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megalab.models.mega.model import MegaConfig
from megalab.nn.ffn import ACTIVATIONS

__all__ = [
    "check_fairseq_args",
    "check_fairseq_translation_args",
    "maga_config_from_reference",
    "mega_kwargs_from_fairseq",
    "mega_translation_kwargs_from_fairseq",
]


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
    _check_fairseq_activation(args)
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


def _check_fairseq_activation(args: Mapping[str, Any]) -> None:
    """Refuse an `activation_fn` megalab does not have (LRA and translation namespaces alike)."""
    activation = args.get("activation_fn")
    if _fairseq_activation(activation) not in ACTIVATIONS:
        raise ValueError(
            f"fairseq arg activation_fn={activation!r} is not supported; megalab has "
            f"{', '.join(ACTIVATIONS)} (gelu_fast is gelu_accurate)"
        )


def mega_kwargs_from_fairseq(args: Mapping[str, Any] | Any) -> dict[str, Any]:
    """`MegaConfig(...)` keyword arguments from a Mega LRA/SC fairseq argument namespace (or dict).

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
    _check_fairseq_activation(args)


def mega_translation_kwargs_from_fairseq(args: Mapping[str, Any] | Any) -> dict[str, Any]:
    """`MegaEncoderDecoderConfig(...)` keyword arguments (without vocab_size/pad_id) from the
    arguments of a fairseq `mega` translation checkpoint (after its arch defaults).

    The namespace is checked first (`check_fairseq_translation_args`): an option megalab cannot
    build is refused by name. A `truncation_length` of 0 (the WMT README) is read as no
    truncation (see
    `megalab.models.mega.translation`). The code defaults `max_source_positions` and
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
