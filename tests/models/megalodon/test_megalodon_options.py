"""The authors' Megalodon `ModelConf`: every field is mapped, known to leave the model
unchanged, or refused by name with what to use instead."""

from __future__ import annotations

import pytest

from megalab.models.megalodon.convert import megalodon_kwargs_from_reference
from megalab.models.megalodon.model import MegalodonConfig

CONF = {
    "num_layers": 2, "model_dim": 16, "z_dim": 8, "value_dim": 32, "num_heads": 2,
    "ffn_hidden_dim": 24, "cema_ndim": 4, "chunk_size": 8, "efficient_attn": None,
    "init_mode": "he", "vocab_size": 50, "output_size": -1, "norm_num_groups": 4,
    "norm_affine": True, "norm_eps": 1e-5, "rope_base": None, "dropout": 0.0,
    "hidden_dropout": 0.0, "attention_dropout": 0.0, "swiglu": False, "rescale_nffn": False,
    "scale_emb": False, "share_emb": False, "layerwise_ckpt": True,
}  # fmt: skip


def test_every_model_conf_field_is_known() -> None:
    MegalodonConfig(**megalodon_kwargs_from_reference(CONF)).build()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rescale_nffn": True}, "rescale_nffn=True .* use rescale_nffn=False"),
        ({"norm_affine": False}, "norm_affine=False .* use norm_affine=True"),
        ({"init_mode": "gaussian"}, "init_mode='gaussian' is not supported"),
        ({"efficient_attn": "flash"}, "efficient_attn='flash': choose"),
        ({"num_experts": 4}, "unknown ModelConf field num_experts=4"),
    ],
)
def test_unsupported_fields_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        megalodon_kwargs_from_reference(CONF | change)
