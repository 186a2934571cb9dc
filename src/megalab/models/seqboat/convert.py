"""The authors' SeqBoat weights (renll/SeqBoat, a fairseq fork of Mega) onto megalab modules.

One function per level maps the authors' `state_dict` names and layouts onto ours and returns a
state dict for the matching megalab module (load it with `load_state_dict(..., strict=True)`):

    convert_unit       SeqBoatUnit (the code's "slag" layer)  -> models.seqboat.SeqBoatLayer
    convert_lra_model  LRAModel with SeqBoat layers (LRA)     -> ClassificationTask(encoder,
                                                                 SeqBoat, head)
    convert_lm_model   the slag LM decoder (enwik8)           -> LanguageModelingTask(encoder,
                                                                 SeqBoat, head)

The golden cases (tests/models/seqboat/test_seqboat_golden.py) check `convert_unit` and
`convert_lra_model` against the authors' tensors. No reference tensors exist for the LM decoder:
`convert_lm_model` follows the module names of the authors' decoder (`seqboat_lm.py`,
`seqboat_layer.py`) and is tested by a round trip of a state dict built in those names.

Renames: the EMA `move.*` becomes `ssm.*` with Mega's renames (`delta`/`alpha` are the paper's
α/δ, `gamma` is η; see `megalab.models.mega.convert.convert_ema`); the unit's `gamma`/`beta` (the
Q/K scale and offset) become `kappa`/`mu`; `q_router.temp` (log τ) becomes `router.log_tau`;
`rel_pos_bias.rel_pos_bias` moves to `attention.rel_pos_bias.weight`; `mx_proj`, `hx_proj`,
`h_proj` and `norm.norm.*` keep their names. The LRA encoder's `pos_emb.scale` (`--add-apos`)
becomes the backbone's `pos_scale` (its `inv_freq` buffer is recomputed, and checked). The same
functions map gradients, which carry the same names.

From an official checkpoint (fairseq stores the weights under `model`, the arguments under
`args`):

    ckpt = load_fairseq_checkpoint("checkpoint_best.pt")
    backbone = SeqBoat(SeqBoatConfig(**seqboat_kwargs_from_fairseq(ckpt["args"])))
    task = ClassificationTask(encoder, backbone, head, num_classes=..., pooling="mean")
    task.load_state_dict(convert_lra_model(ckpt["model"]))

The code is time-first (L, B, D) with padding masks True at padding; use `to_batch_first` and
`mask_from_padding_mask` at that boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor

from megalab.models.convert import (
    LRA_ENCODER,
    Target,
    checked,
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
from megalab.models.mega.convert import convert_ema, convert_ffn

__all__ = [
    "convert_lm_model",
    "convert_lra_model",
    "convert_unit",
    "load_fairseq_checkpoint",
    "mask_from_padding_mask",
    "seqboat_kwargs_from_fairseq",
    "seqboat_lm_kwargs_from_fairseq",
    "to_batch_first",
    "unit_kwargs_from_reference",
]

# The unit: the Q/K scale and offset `gamma`/`beta` are our `kappa`/`mu`, `q_router.temp` (log τ)
# is `router.log_tau`; the EMA (`move.`) converts with Mega's `convert_ema`.
_UNIT_NAMES: dict[str, Target] = {
    "gamma": "kappa",
    "beta": "mu",
    "q_router.temp": reshaped("router.log_tau", 1),
    "rel_pos_bias.rel_pos_bias": "attention.rel_pos_bias.weight",
}
_UNIT_PREFIXES = kept("mx_proj.", "hx_proj.", "h_proj.", "norm.norm.")


def convert_unit(sd: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """`SeqBoatUnit` entries under `prefix` -> `SeqBoatLayer` state dict."""
    ema = {"move.": ("ssm.", convert_ema)}
    return convert_module(sd, prefix, "SeqBoatUnit", ema, _UNIT_NAMES, _UNIT_PREFIXES)


def _convert_layer(sd: Mapping[str, Tensor], prefix: str, unit: str) -> dict[str, Tensor]:
    """An encoder/decoder layer under `prefix`, its unit `{unit}.*` and FFN `nffn.*` (Mega's
    `NormalizedFeedForwardNetwork`) -> `SeqBoatBlock` (`layer.*`, `ffn.*`)."""
    children = {unit + ".": ("layer.", convert_unit), "nffn.": ("ffn.", convert_ffn)}
    return convert_module(sd, prefix, "SeqBoat encoder/decoder layer", children)


def _check_inv_freq(t: Tensor) -> None:
    """The code's sinusoidal `inv_freq` buffer must be the one we recompute, 10000^(−2i/D)."""
    D = 2 * t.numel()
    ours = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    # compared on the host: a checkpoint may have been loaded onto a GPU
    if not torch.allclose(t.double().cpu(), ours, rtol=1e-6, atol=0):
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
    enc = LRA_ENCODER
    names: dict[str, Target] = {
        enc + "pos_emb.scale": reshaped(backbone_prefix + "pos_scale", 1),
        enc + "pos_emb.inv_freq": checked(_check_inv_freq),
    }
    prefixes = {"classifier.": refused("only the slag archs' one-layer classifier is supported")}
    layer = partial(_convert_layer, unit="mega_layer")
    return convert_lra_task(
        sd, layer, encoder_prefix, backbone_prefix, head_prefix, names, prefixes
    )


def convert_lm_model(
    sd: Mapping[str, Tensor],
    encoder_prefix: str = "encoder.embed.",
    backbone_prefix: str = "backbone.",
    head_prefix: str = "head.",
) -> dict[str, Tensor]:
    """The slag LM decoder (`slag_lm_enwik8_base_v2`) -> `LanguageModelingTask` state dict.

    The authors' `SeqBoatLanguageModel` (fairseq/models/seqboat_lm.py) holds
    `SeqBoatDecoderNoCrossAttn` as `decoder`: `decoder.embed_tokens.weight` (the input table),
    `decoder.layers.{i}.slag_layer.*` (each `SeqBoatDecoderLayer`'s unit, as `convert_unit`;
    no `rel_pos_bias` entry under RoPE), `decoder.layers.{i}.nffn.*` when an FFN is present
    (`--decoder-ffn-embed-dim` > 0), `decoder.final_norm.norm.*` when the final norm is affine
    (none with `--no-affine-final-norm`), `decoder.output_projection.weight` (with
    `--share-decoder-input-output-embed` the same tensor as the input table) and the buffer
    `decoder.version`. The target is `LanguageModelingTask(SequenceEncoder(vocab_size=V,
    token_scale=True), SeqBoat(SeqBoatConfig(causal=True, ...)), LinearLMHead, tie_weights=True)`
    (configs/experiment/seqboat/enwik8): the output projection becomes `head.proj.weight`, which
    `load_state_dict(strict=True)` asks for even when tied.

    No reference tensors exist for the LM (the golden cases cover the unit, whose names the
    layers reuse, and the LRA encoder): tests/models/seqboat/test_seqboat_convert.py checks the
    round trip of a state dict written in the authors' names. An unexpected name raises.
    """
    layer = partial(_convert_layer, unit="slag_layer")
    out = convert_layers(sd, "decoder.layers.", layer, backbone_prefix + "layers.")
    names: dict[str, Target] = {
        "decoder.embed_tokens.weight": encoder_prefix + "embedding.weight",
        # tied: the embedding table itself
        "decoder.output_projection.weight": head_prefix + "proj.weight",
        "decoder.version": None,  # fairseq's version marker
    }
    prefixes: dict[str, Target] = {
        "decoder.layers.": None,  # converted above
        "decoder.final_norm.norm.": backbone_prefix + "final_norm.norm.",
    }
    out.update(rename_entries(sd, "SeqBoat LM decoder", names, prefixes))
    return out


# ------------------------------------------------------------------------- options -> kwargs
def _refuse(option: str, value: Any, instead: str) -> ValueError:
    """The error for an option of the authors' code that megalab does not support."""
    return ValueError(f"the authors' option {option}={value!r} is not supported: {instead}")


def _check(
    a: Mapping[str, Any], option: str, ok: Callable[[Any], bool], default: Any, instead: str
) -> None:
    """Refuse `option` unless it is absent (None) or `ok(value)`."""
    value = a.get(option, default)
    if value is not None and not ok(value):
        raise _refuse(option, value, instead)


def _check_common(a: Mapping[str, Any]) -> None:
    """Options shared by the unit, the LRA/SC encoder and the LM decoder."""
    _check(
        a,
        "activation_fn",
        lambda v: v == "silu",
        "silu",
        "megalab's SeqBoat uses SiLU, as every released config; use 'silu'",
    )
    _check(
        a,
        "feature_dropout",
        lambda v: not v,
        False,
        "channel (feature) dropout is not implemented; use feature_dropout=False",
    )
    _check(
        a,
        "normalize_embedding",
        lambda v: not v,
        False,
        "there is no embedding norm in megalab's SeqBoat; use normalize_embedding=False",
    )
    _check(
        a,
        "rel_pos_bias",
        lambda v: v in ("simple", "rotary"),
        "simple",
        "the code's 't5' buckets are not implemented; use 'simple' or 'rotary'",
    )


def _attention(chunk: int, rel_pos_bias: str, local_pos: Any) -> dict[str, Any]:
    """`chunk_size > 0` is the code's local mode (window W), otherwise global (SeqBoat-full);
    the code uses `local_pos` only in local mode with the 'simple' bias."""
    local = chunk > 0
    return {
        "attention": "local" if local else "full",
        "chunk_size": chunk if local else 128,
        "rel_pos_bias": rel_pos_bias,
        "local_pos": bool(local_pos) and local and rel_pos_bias == "simple",
    }


# Constructor keywords of the authors' `SeqBoatUnit` (seqboat_unit.py).
UNIT_OPTIONS = (
    "embed_dim", "zdim", "hdim", "ndim", "dropout", "attention_dropout", "hidden_dropout",
    "activation", "attention_activation", "bidirectional", "chunk_size", "truncation",
    "norm_type", "prenorm", "norm_affine", "feature_dropout", "rel_pos_bias", "max_positions",
    "export", "density_threshold", "max_steps", "init_temp_scale", "local_pos", "always_act",
)  # fmt: skip


def unit_kwargs_from_reference(ctor: Mapping[str, Any]) -> dict[str, Any]:
    """`SeqBoatConfig` keyword arguments (one layer) from the code's `SeqBoatUnit` kwargs.

    Every constructor keyword is mapped or checked: `chunk_size <= 0` is the code's global mode
    (SeqBoat-full); `always_act` removes the configurator; `norm_affine` is the layer norm's;
    `density_threshold` is forced to 1 in local mode by the code, and in global mode megalab
    packs below the code's default 0.9 (a threshold above 1, always packing, is
    `always_compress=True`); `max_steps` drives only the code's unreachable annealing and
    `export` only picks apex's LayerNorm: both are ignored. Any other keyword, or a value
    megalab does not implement (activation other than SiLU, feature dropout, the 't5' bias),
    raises a ValueError naming it.
    """
    k = dict(ctor)
    unknown = sorted(set(k) - set(UNIT_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown SeqBoatUnit option(s) {', '.join(unknown)}: the authors' unit takes "
            f"{', '.join(UNIT_OPTIONS)}"
        )
    _check(
        k,
        "activation",
        lambda v: v == "silu",
        "silu",
        "megalab's SeqBoat uses SiLU, as every released config; use 'silu'",
    )
    _check_common(k)
    chunk = k.get("chunk_size", -1)
    always_compress = False
    threshold = k.get("density_threshold", 0.9)
    if chunk <= 0 and threshold != 0.9:
        if threshold <= 1:
            raise _refuse(
                "density_threshold",
                threshold,
                "global mode packs while L'/L < 0.9 (the code's default); use 0.9, or a value "
                "above 1 to always pack (always_compress=True)",
            )
        always_compress = True
    rel_pos_bias = k.get("rel_pos_bias", "simple")
    return {
        "d_model": k["embed_dim"],
        "num_layers": 1,
        "z_dim": k["zdim"],
        "v_dim": k["hdim"],
        "ema_dim": k["ndim"],
        "truncation": k.get("truncation") or None,
        **_attention(chunk, rel_pos_bias, k.get("local_pos", False)),
        "attention_activation": k.get("attention_activation", "relu2"),
        "max_positions": k.get("max_positions", 1024),
        "norm_type": k.get("norm_type", "layernorm"),
        "norm_affine": bool(k.get("norm_affine", True)),
        "prenorm": k.get("prenorm", True),
        "causal": not k.get("bidirectional", False),
        "router": "none" if k.get("always_act") else "softmax",
        "init_temp_scale": k.get("init_temp_scale", 0.3),
        "always_compress": always_compress,
        "dropout": k.get("dropout", 0.0),
        "attention_dropout": k.get("attention_dropout", 0.0),
        "hidden_dropout": k.get("hidden_dropout", 0.0),
    }


def seqboat_kwargs_from_fairseq(args: Mapping[str, Any] | Any) -> dict[str, Any]:
    """`SeqBoatConfig(...)` keyword arguments from a SeqBoat LRA/SC fairseq argument namespace.

    As Mega's LRA encoder, `--act-dropout` drives the value (V) dropout and `--dropout` the
    embedding dropout (`input_dropout`); `--add-apos` adds the scaled sinusoidal positions.
    The namespace also holds every task and optimizer option; of the model's options
    (`LRAModel.add_args`), those megalab does not implement are refused with their name: a
    `--layer-type` other than slag, `--activation-fn` other than silu, `--feature-dropout`,
    `--normalize-embedding`, `--rel-pos-bias t5`, `--encoder-layerdrop`, quantization noise,
    `--use-p`, `--sen-rep-type cls`, a classifier of other than one GELU layer and
    `--apply-bert-init`. Options the slag encoder never reads (attention heads, learned or
    token positions, Luna's projections, `--share-encoder-input-output-embed`,
    `--no-scale-embedding`) are ignored; `--use-nli`, `--sentence-class-num` and
    `--classifier-out-dim` belong to the task's head.
    """
    a = args if isinstance(args, Mapping) else vars(args)
    _check_common(a)
    _check(
        a,
        "layer_type",
        lambda v: v == "slag",
        "slag",
        "only the SeqBoat ('slag') encoder maps onto megalab's SeqBoat",
    )
    for option in ("encoder_layerdrop", "quant_noise_pq", "quant_noise_scalar"):
        _check(a, option, lambda v: not v, 0, "not implemented; use 0")
    _check(a, "use_p", lambda v: not v, False, "use the pooled features (use_p=False)")
    _check(
        a,
        "sen_rep_type",
        lambda v: v == "mp",
        "mp",
        "the slag archs pool by mean ('mp'); a CLS token is not implemented",
    )
    _check(
        a,
        "classifier_layers",
        lambda v: v == 1,
        1,
        "ClassificationHead is the slag archs' one hidden layer; use 1",
    )
    _check(
        a,
        "classifier_activation_fn",
        lambda v: v == "gelu",
        "gelu",
        "ClassificationHead uses GELU, as the slag archs; use 'gelu'",
    )
    _check(
        a,
        "apply_bert_init",
        lambda v: not v,
        False,
        "the slag archs use the code's own init (apply_bert_init=False)",
    )
    chunk = a["chunk_size"]
    ffn = a.get("encoder_ffn_embed_dim", -1) or -1
    return {
        "d_model": a["encoder_embed_dim"],
        "num_layers": a["encoder_layers"],
        "z_dim": a["z_dim"],
        "v_dim": a["encoder_hidden_dim"],
        "ema_dim": a["n_dim"],
        "truncation": a.get("truncation_length") or None,
        **_attention(chunk, a.get("rel_pos_bias", "simple"), a.get("local_pos", False)),
        "attention_activation": a["attention_activation_fn"],
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


def seqboat_lm_kwargs_from_fairseq(args: Mapping[str, Any] | Any) -> dict[str, Any]:
    """`SeqBoatConfig(causal=True, ...)` keyword arguments from the slag LM's fairseq namespace
    (`SeqBoatLanguageModel.add_args`, e.g. `slag_lm_enwik8_base_v2`).

    `--decoder-chunk-size` is the window W (global mode when <= 0); `--max-target-positions`
    is P of the 'simple' bias; `--no-affine-final-norm` gives `final_norm_affine=False`;
    `--dropout` is also the embedding dropout. The embedding scale (√D unless
    `--no-scale-embedding`) and `--share-decoder-input-output-embed` belong to the task's
    `SequenceEncoder(token_scale=...)` and `tie_weights`. Refused with their name: adaptive
    input/softmax, `--decoder-input-dim` other than `--decoder-embed-dim` (a projection),
    `--decoder-embed-path`, and the options every SeqBoat refuses (activation other than silu,
    feature dropout, embedding norm, the 't5' bias); `--report-ema-alpha` and
    `--write-out-alpha` only log and are ignored.
    """
    a = args if isinstance(args, Mapping) else vars(args)
    _check_common(a)
    for option in ("adaptive_input", "tie_adaptive_weights", "tie_adaptive_proj"):
        _check(
            a,
            option,
            lambda v: not v,
            False,
            "adaptive input/softmax of the slag LM are not mapped; use a plain embedding "
            "tied to the output (share_decoder_input_output_embed)",
        )
    _check(
        a,
        "adaptive_softmax_cutoff",
        lambda v: not v,
        None,
        "adaptive input/softmax of the slag LM are not mapped; use a plain embedding tied "
        "to the output (share_decoder_input_output_embed)",
    )
    _check(
        a,
        "decoder_input_dim",
        lambda v: v == a["decoder_embed_dim"],
        None,
        "no input projection (project_in_dim); use decoder_input_dim = decoder_embed_dim",
    )
    _check(
        a,
        "decoder_embed_path",
        lambda v: not v,
        None,
        "load pretrained embeddings into the task's encoder instead",
    )
    ffn = a.get("decoder_ffn_embed_dim", -1) or -1
    return {
        "d_model": a["decoder_embed_dim"],
        "num_layers": a["decoder_layers"],
        "z_dim": a["decoder_z_dim"],
        "v_dim": a["decoder_hidden_dim"],
        "ema_dim": a["decoder_n_dim"],
        "truncation": a.get("truncation_length") or None,
        **_attention(
            a["decoder_chunk_size"], a.get("rel_pos_bias", "simple"), a.get("local_pos", False)
        ),
        "attention_activation": a["attention_activation_fn"],
        "max_positions": a["max_target_positions"],
        "norm_type": a["normalization_type"],
        "prenorm": bool(a.get("normalize_before", False)),
        "final_norm_affine": not a.get("no_affine_final_norm", False),
        "causal": True,
        "router": "softmax",
        "init_temp_scale": a["init_temp_scale"],
        "ffn_dim": max(int(ffn), 0),
        "dropout": a["dropout"],
        "attention_dropout": a["attention_dropout"],
        "hidden_dropout": a["hidden_dropout"],
        "activation_dropout": a.get("activation_dropout", 0.0) or 0.0,
        "input_dropout": a["dropout"],
    }
