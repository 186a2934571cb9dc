"""The authors' Megalodon weights (XuezheMax/megalodon) onto megalab modules.

One function per level maps the authors' `state_dict` names and layouts onto ours and returns a
state dict for the matching megalab module (load it with `load_state_dict(..., strict=True)`):

    convert_cema           MultiHeadComplexEMA  -> megalodon.cema.ComplexEMA
    convert_timestep_norm  TimestepNorm         -> megalodon.timestep_norm.TimestepNorm
    convert_block          MegaBlock            -> megalodon.MegalodonBlock
    convert_lm             Mega (the LM)        -> LanguageModelingTask(encoder, Megalodon, head)

(`megalodon.` is `megalab.models.megalodon.`.)

Names and layouts. The authors' CEMA tensors are channel-first with trailing unit axes
(`alpha`, `delta` (D, N, 1), `theta` (D, 1, 1), `omega` (D, 1)): ours drop them. Their complex
η is stored as a real view `gamma` (D, N, 2), as is our `eta`. `mega.rmsnorm` (the RMSNorm on the
CEMA output) is our `attn.cema_norm`; `mega.gamma`/`mega.beta` (the Q/K scale and offset) are
our `attn.attention.kappa`/`mu`; `mega.timenorm` is `attn.norm`; the linears keep their names
(`wz`, `wv`, `wr`, `wh1`, `wh2`) under `attn`, and `nffn` becomes `ffn`. Model level: `embed` is
the encoder's token table, `output.final_norm` the backbone's `final_norm`, `output.output` the
head's `proj` (dropped when the embedding is shared, `share_emb`). The buffers `rope.freqs`
(recomputed from `rope_base`) is checked and dropped; the timestep norms' `prior_*` entries are
dropped at `prior_count` 0 and kept above it (the learned prior, `norm_prior_count`). The same
functions map gradients, which carry the same names. Carried states convert with
`convert_cema_state` (real view -> complex) and are otherwise (count, mean, var) as ours.

From a checkpoint of the authors' code (none was released; their training writes a consolidated
state dict per tensor-parallel rank: merge ranks first, the 7B ran with tensor parallel 1):

    sd = load_checkpoint("consolidated.pt")            # weights_only, allow-listed
    kw = megalodon_kwargs_from_reference(model_conf)   # the ModelConf fields as a dict
    backbone = Megalodon(MegalodonConfig(**kw))
    task = LanguageModelingTask(SequenceEncoder(kw["d_model"], vocab_size=V, token_scale=...),
                                backbone, LinearLMHead(kw["d_model"], V), tie_weights=...)
    task.load_state_dict(convert_lm(sd), strict=True)

Their model never passes a padding mask and is time-first only inside; its inputs and outputs
are batch-first (B, L) tokens and (B, L, V) logits, like ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from megalab.models.convert import (
    Target,
    _sub,
    _unknown,
    convert_module,
    load_checkpoint,
)
from megalab.nn.rope import rope_inv_freq

__all__ = [
    "convert_block",
    "convert_cema",
    "convert_cema_state",
    "convert_lm",
    "convert_timestep_norm",
    "load_checkpoint",
    "megalodon_kwargs_from_reference",
]

_ATTN_LINEARS = ("wz.", "wv.", "wr.", "wh1.", "wh2.")
_FFN = ("norm.weight", "norm.bias", "fc1.weight", "fc2.weight", "fc3.weight")
# `MegaBlock` -> `MegalodonBlock`; the timestep norm and the CEMA convert with their functions.
_BLOCK_NAMES: dict[str, Target] = {
    "mega.rmsnorm.weight": "attn.cema_norm.weight",
    "mega.gamma": "attn.attention.kappa",
    "mega.beta": "attn.attention.mu",
    **{"nffn." + name: "ffn." + name for name in _FFN},
}
_BLOCK_PREFIXES: dict[str, Target] = {"mega." + p: "attn." + p for p in _ATTN_LINEARS}


def convert_cema(sd: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """`MultiHeadComplexEMA` entries under `prefix` -> `ComplexEMA`: drop the unit axes,
    `gamma` -> `eta`."""
    out = {}
    for name, t in _sub(sd, prefix).items():
        if name in ("alpha", "delta"):  # (D, N, 1) -> (D, N)
            out[name] = t.reshape(t.shape[0], t.shape[1])
        elif name in ("theta", "omega"):  # (D, 1, 1), (D, 1) -> (D,)
            out[name] = t.reshape(-1)
        elif name == "gamma":  # complex η as a real view (D, N, 2), unchanged
            out["eta"] = t
        else:
            raise _unknown("MultiHeadComplexEMA", name)
    return out


def convert_cema_state(hx: Tensor) -> Tensor:
    """The code's CEMA state as a real view (B, D, N, 2) -> our complex (B, D, N)."""
    return torch.view_as_complex(hx.contiguous())


def convert_timestep_norm(sd: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """`TimestepNorm` entries under `prefix` -> ours: weight and bias, and the learned prior
    when it has one.

    With `prior_count` 0 the code's `prior_mean`/`prior_logv` are unused buffers: they are
    dropped (ours has no prior then). With `prior_count > 0` they are parameters and keep their
    names, with the count (load into a `TimestepNorm(..., prior_count=c)`, Megalodon's
    `norm_prior_count`). A gradient dict (no `prior_count`) keeps whatever prior entries it has.
    """
    sd = _sub(sd, prefix)
    count = int(sd["prior_count"]) if "prior_count" in sd else None
    out = {}
    for name, t in sd.items():
        if name in ("weight", "bias"):
            out[name] = t
        elif name in ("prior_count", "prior_mean", "prior_logv"):
            if count != 0:
                out[name] = t
        else:
            raise _unknown("TimestepNorm", name)
    return out


def convert_block(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`MegaBlock` (`mega.*`, `nffn.*`) -> `MegalodonBlock` (`attn.*`, `ffn.*`)."""
    children = {
        "mega.timenorm.": ("attn.norm.", convert_timestep_norm),
        "mega.cema.": ("attn.cema.", convert_cema),
    }
    return convert_module(sd, "", "MegaBlock", children, _BLOCK_NAMES, _BLOCK_PREFIXES)


def _check_rope(freqs: Tensor, rope_base: float | None) -> None:
    """The code's `rope.freqs` buffer must be base^(−2j/d) for the base we rebuild it from."""
    base = 10000.0 if rope_base is None else float(rope_base)
    dim = 2 * freqs.numel()
    expected = rope_inv_freq(dim, base, torch.float64)
    # compared on the host: a checkpoint may have been loaded onto a GPU
    if not torch.allclose(freqs.double().cpu(), expected, rtol=1e-5, atol=0.0):
        raise ValueError(
            f"rope.freqs does not match RoPE base {base:g} for head width {dim}: pass the "
            "checkpoint's rope_base"
        )


def convert_lm(sd: Mapping[str, Tensor], rope_base: float | None = None) -> dict[str, Tensor]:
    """The authors' `Mega` LM -> `LanguageModelingTask(encoder, Megalodon, LinearLMHead)`.

    `rope_base`: the model's base (None: the code's default 10⁴), checked against `rope.freqs`.
    """
    out: dict[str, Tensor] = {}
    layers: dict[int, dict[str, Tensor]] = {}
    for name, t in sd.items():
        if name == "embed.weight":
            out["encoder.embed.embedding.weight"] = t
        elif name == "rope.freqs":
            _check_rope(t, rope_base)
        elif name.startswith("layers."):
            index, _, rest = name[len("layers.") :].partition(".")
            layers.setdefault(int(index), {})[rest] = t
        elif name.startswith("output.final_norm."):
            continue
        elif name == "output.output.weight":
            out["head.proj.weight"] = t
        else:
            raise _unknown("Mega", name)
    for i in sorted(layers):
        for key, value in convert_block(layers[i]).items():
            out[f"backbone.layers.{i}.{key}"] = value
    for key, value in convert_timestep_norm(sd, "output.final_norm.").items():
        out[f"backbone.final_norm.{key}"] = value
    return out


# The code's `ModelConf` fields. `vocab_size`/`output_size` (the head's rows), `scale_emb`
# (token_scale) and `share_emb` (tie_weights) belong to the task's encoder and head;
# `layerwise_ckpt` (activation checkpointing, megalab's `checkpoint_activations`) does not change
# the results; the others are read or checked below.
_MODEL_CONF_FIELDS = frozenset(
    {
        "num_layers", "model_dim", "z_dim", "value_dim", "num_heads", "ffn_hidden_dim",
        "cema_ndim", "chunk_size", "efficient_attn", "init_mode", "vocab_size", "output_size",
        "norm_num_groups", "norm_affine", "norm_eps", "rope_base", "dropout", "hidden_dropout",
        "attention_dropout", "swiglu", "rescale_nffn", "scale_emb", "share_emb",
        "layerwise_ckpt",
    }
)  # fmt: skip


def megalodon_kwargs_from_reference(conf: Mapping[str, Any]) -> dict[str, Any]:
    """`MegalodonConfig` keyword arguments from the code's `ModelConf` fields (a dict).

    The embedding options (`scale_emb`: token_scale, `share_emb`: tie_weights) and the
    vocabulary belong to the task's encoder and head. A field that is not one of `ModelConf`'s,
    or an unsupported value, is refused by name. Attention dropout is DropKey, the code's
    fused kernel (`efficient_attn`); its plain path drops softmax outputs instead (the two agree
    at the presets' 0).
    """
    for name in conf:
        if name not in _MODEL_CONF_FIELDS:
            raise ValueError(
                f"unknown ModelConf field {name}={conf[name]!r}: not an option of the authors' "
                "Megalodon, so megalab cannot tell what it changes"
            )
    if conf.get("rescale_nffn", False):
        raise ValueError(
            "ModelConf.rescale_nffn=True (a learned FFN layer scale, used by no preset) is not "
            "supported: use rescale_nffn=False"
        )
    if not conf.get("norm_affine", True):
        raise ValueError(
            "ModelConf.norm_affine=False (norms without learned scale and bias, used by no "
            "preset) is not supported: use norm_affine=True"
        )
    if conf.get("efficient_attn") not in (None, "swift", "fused"):
        raise ValueError(
            f"unknown ModelConf.efficient_attn={conf['efficient_attn']!r}: choose None, 'swift' "
            "or 'fused'"
        )
    if conf.get("init_mode", "he") != "he":
        raise ValueError(
            f"ModelConf.init_mode={conf['init_mode']!r} is not supported: only the 'he' "
            "initialisation is reproduced (use init_mode='he'; converted weights do not depend "
            "on it)"
        )
    rope_base = conf.get("rope_base")
    return {
        "d_model": int(conf["model_dim"]),
        "num_layers": int(conf["num_layers"]),
        "z_dim": int(conf["z_dim"]),
        "v_dim": int(conf["value_dim"]),
        "num_heads": int(conf["num_heads"]),
        "ffn_dim": int(conf["ffn_hidden_dim"]),
        "swiglu": bool(conf["swiglu"]),
        "cema_dim": int(conf["cema_ndim"]),
        "chunk_size": int(conf["chunk_size"]),
        "norm_groups": int(conf["norm_num_groups"]),
        "norm_eps": float(conf["norm_eps"]),
        "rope_base": 10000.0 if rope_base is None else float(rope_base),
        "causal": True,
        "dropout": float(conf.get("dropout", 0.0)),
        "attention_dropout": float(conf.get("attention_dropout", 0.0)),
        "hidden_dropout": float(conf.get("hidden_dropout", 0.0)),
    }
