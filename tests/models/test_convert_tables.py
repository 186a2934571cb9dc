"""The converters' shared parts (`megalab.models.convert`): renaming by table, layer stacks and
the frame of the authors' fairseq `LRAModel`, which Mega's and SeqBoat's converters fill in."""

from __future__ import annotations

import pytest
import torch

from megalab.models.convert import (
    checked,
    convert_layers,
    convert_lra_task,
    convert_module,
    kept,
    layer_ids,
    lra_io_entry,
    refused,
    rename_entries,
    reshaped,
)
from megalab.models.mega.convert import convert_ffn, convert_gated_cross_attention, convert_maga
from megalab.models.mega.convert import convert_lra_model as mega_lra
from megalab.models.mega.convert_args import (
    check_fairseq_args,
    check_fairseq_translation_args,
)
from megalab.models.megalodon.convert import convert_block
from megalab.models.seqboat.convert import convert_lra_model as seqboat_lra
from megalab.models.seqboat.convert import convert_unit


def t(*shape: int) -> torch.Tensor:
    return torch.arange(float(torch.tensor(shape).prod())).reshape(shape)


# ---------------------------------------------------------------------------- rename by table
def test_rename_entries_exact_names_before_prefixes_and_the_longest_prefix_wins() -> None:
    sd = {"a.b.c": t(2), "a.x": t(3), "a.b": t(1), "drop.me": t(1)}
    names = {"a.b": "exact"}
    prefixes = {"a.": "short.", "a.b.": "long.", "drop.": None}
    out = rename_entries(sd, "Module", names, prefixes)
    assert list(out) == ["long.c", "short.x", "exact"]  # in the order of `sd`
    assert out["long.c"] is sd["a.b.c"]  # renamed, not copied


def test_rename_entries_rules_reshape_check_and_refuse() -> None:
    seen: list[torch.Tensor] = []
    names = {"w": reshaped("ours.w", -1, 1), "buf": checked(seen.append)}
    out = rename_entries({"w": t(3), "buf": t(2)}, "Module", names)
    assert list(out) == ["ours.w"] and out["ours.w"].shape == (3, 1)
    assert len(seen) == 1 and torch.equal(seen[0], t(2))
    with pytest.raises(KeyError, match=r"'extra.w': no place for it"):
        rename_entries({"extra.w": t(1)}, "Module", {}, {"extra.": refused("no place for it")})


def test_rename_entries_refuses_an_unknown_name_with_the_module_kind() -> None:
    with pytest.raises(KeyError, match="unexpected SomeModule entry 'other'"):
        rename_entries({"fc1.weight": t(1), "other": t(1)}, "SomeModule", {}, kept("fc1."))


def test_convert_module_converts_children_then_own_entries_and_refuses_the_rest() -> None:
    def child(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        return {"weight": sd[prefix + "w"]}

    children = {"sub.": ("child.", child)}
    sd = {"m.own": t(1), "m.sub.w": t(2), "m.fc.bias": t(3), "other": t(4)}
    out = convert_module(sd, "m.", "Parent", children, {"own": "mine"}, kept("fc."))
    assert list(out) == ["child.weight", "mine", "fc.bias"]  # the children first
    assert out["child.weight"] is sd["m.sub.w"]
    with pytest.raises(KeyError, match=r"unexpected Parent entry 'fc\.bias'"):
        convert_module(sd, "m.", "Parent", children, {"own": "mine"})  # fc. in no table


def test_layer_ids_and_convert_layers_keep_layer_order_and_prefixes() -> None:
    sd = {"layers.10.w": t(1), "layers.2.w": t(2), "layers.x.w": t(3), "top": t(4)}
    assert layer_ids(sd, "layers.") == [2, 10]

    def convert(sub: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        return {"v": sub[prefix + "w"]}

    out = convert_layers(sd, "layers.", convert, "backbone.layers.")
    assert list(out) == ["backbone.layers.2.v", "backbone.layers.10.v"]
    assert out["backbone.layers.10.v"] is sd["layers.10.w"]


# --------------------------------------------------------------------------- LRAModel frame
ENC = "encoder.encoder."


def test_lra_io_entry_maps_the_embedding_and_the_one_layer_classifier() -> None:
    def entry(name: str, x: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        return lra_io_entry(name, x, ENC, "encoder.", "head.")

    w = t(4)
    assert entry(ENC + "embed_tokens.embed.weight", w) == ("encoder.embedding.weight", w)
    name, proj = entry(ENC + "embed_tokens.weight", w)  # type: ignore[misc]
    assert name == "encoder.proj.weight" and proj.shape == (4, 1)
    assert entry(ENC + "embed_tokens.bias", w) == ("encoder.proj.bias", w)
    assert entry("classifier.0.0.weight", w) == ("head.fc1.weight", w)
    assert entry("sentence_projection_layer.weight", w) == ("head.fc2.weight", w)
    assert entry("classifier.1.weight", w) is None
    assert entry(ENC + "final_norm.norm.weight", w) is None


def lra_io(d: int = 4) -> dict[str, torch.Tensor]:
    """The entries an LRAModel holds besides its layers (token input, one classifier layer)."""
    return {
        ENC + "embed_tokens.embed.weight": t(5, d),
        ENC + "final_norm.norm.weight": t(d),
        "classifier.0.0.weight": t(d, d),
        "classifier.0.0.bias": t(d),
        "sentence_projection_layer.weight": t(2, d),
    }


def test_convert_lra_task_maps_the_shared_entries_and_the_model_tables() -> None:
    def layer(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        return {"w": sd[prefix + "w"]}

    sd = {ENC + "layers.0.w": t(1), **lra_io(), ENC + "extra": t(3)}
    out = convert_lra_task(sd, layer, "enc.", "bb.", "hd.", {ENC + "extra": "bb.extra"}, {})
    assert sorted(out) == [
        "bb.extra",
        "bb.final_norm.norm.weight",
        "bb.layers.0.w",
        "enc.embedding.weight",
        "hd.fc1.bias",
        "hd.fc1.weight",
        "hd.fc2.weight",
    ]
    with pytest.raises(KeyError, match="unexpected LRAModel entry 'other'"):
        convert_lra_task(
            {**sd, "other": t(1)}, layer, "enc.", "bb.", "hd.", {ENC + "extra": None}, {}
        )


@pytest.mark.parametrize(
    "name", ["classifier.1.weight", ENC + "embed_positions.weight", ENC + "unknown"]
)
def test_mega_lra_model_refuses_weights_it_has_no_place_for(name: str) -> None:
    sd = lra_io()
    assert set(mega_lra({**sd, ENC + "embed_norm.norm.weight": t(4)})) >= {
        "backbone.embed_norm.norm.weight",
        "backbone.final_norm.norm.weight",
    }
    match = "LRAModel" if name.endswith("unknown") else "only the Mega LRA archs"
    with pytest.raises(KeyError, match=match):
        mega_lra({**sd, name: t(1)})


def test_seqboat_lra_model_maps_positions_and_refuses_more_classifier_layers() -> None:
    d = 4
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    sd = {**lra_io(d), ENC + "pos_emb.scale": torch.tensor(0.5), ENC + "pos_emb.inv_freq": inv_freq}
    out = seqboat_lra(sd)
    assert out["backbone.pos_scale"].shape == (1,)
    assert not any("inv_freq" in k for k in out)
    with pytest.raises(ValueError, match="inv_freq"):
        seqboat_lra({**sd, ENC + "pos_emb.inv_freq": inv_freq + 1})
    with pytest.raises(KeyError, match="one-layer classifier"):
        seqboat_lra({**sd, "classifier.1.weight": t(1)})
    with pytest.raises(KeyError, match="embed_norm"):
        seqboat_lra({**sd, ENC + "embed_norm.norm.weight": t(d)})  # Mega's only


# ------------------------------------------------------------------- block-level rename tables
def test_layer_tables_rename_reshape_drop_and_refuse() -> None:
    maga = convert_maga(
        {
            "gamma": t(2, 3),
            "beta": t(2, 3),
            "v_proj.weight": t(1),
            "rel_pos_bias.alpha": t(1, 3),
            "rel_pos_bias._float_tensor": t(1),
        }
    )
    assert sorted(maga) == ["attention.rel_pos_bias.a", "kappa", "mu", "v_proj.weight"]
    assert maga["attention.rel_pos_bias.a"].shape == (3,)
    cross = convert_gated_cross_attention({"q_proj.weight": t(1), "rel_pos_bias.beta": t(1, 3)})
    assert sorted(cross) == ["q_proj.weight", "rel_pos_bias.b"]
    unit = convert_unit({"q_router.temp": torch.tensor(0.1), "hx_proj.bias": t(2)})
    assert unit["router.log_tau"].shape == (1,) and "hx_proj.bias" in unit
    block = convert_block({"mega.wz.weight": t(1), "nffn.fc3.weight": t(1), "mega.gamma": t(1)})
    assert sorted(block) == ["attn.attention.kappa", "attn.wz.weight", "ffn.fc3.weight"]
    for convert, bad, kind in (
        (convert_maga, "v_proj2.weight", "MovingAverageGatedAttention"),
        (convert_ffn, "fc3.weight", "NormalizedFeedForwardNetwork"),
        (convert_gated_cross_attention, "o_proj.weight", "GatedCrossAttention"),
        (convert_unit, "v_proj.weight", "SeqBoatUnit"),
        (convert_block, "nffn.fc4.weight", "MegaBlock"),
    ):
        with pytest.raises(KeyError, match=f"unexpected {kind} entry"):
            convert({bad: t(1)})


def test_lra_and_translation_namespaces_refuse_an_activation_alike() -> None:
    messages = []
    for check in (check_fairseq_args, check_fairseq_translation_args):
        with pytest.raises(ValueError, match="activation_fn='tanh' is not supported") as err:
            check({"activation_fn": "tanh"})
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert "gelu_fast is gelu_accurate" in messages[0]
