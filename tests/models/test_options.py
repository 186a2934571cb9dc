"""Each backbone option is declared once, on its config dataclass (`megalab.utils.options`).

For every backbone the model configs build: each field of its config dataclass has a type the
schema knows, a one-line meaning and a rule in `megalab.config_schema` (so a field added without
a declaration fails here); its defaults and the shipped configs' values pass their rules; and the
same declared range gives both the dataclass's error and the schema's line for a run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from megalab.config_schema import ConfigError, backbone_rules, model_rules, problems, validate
from megalab.models.mega import MegaConfig
from megalab.models.megalodon import MegalodonConfig
from megalab.models.s4d import S4DConfig
from megalab.models.seqboat import SeqBoatConfig
from megalab.models.transformer import TransformerConfig
from megalab.models.transformer_xl import TransformerXLConfig
from megalab.utils.options import config_class_of, declared, option, option_rules
from megalab.utils.paths import CONFIG_DIR, group_config
from megalab.utils.safe_config import megalab_object

DATA_SPEC = {"vocab_size": 32, "d_input": None, "pad_id": 0, "max_len": 64, "num_classes": 4}
MODELS = sorted(
    p.relative_to(CONFIG_DIR / "model").with_suffix("").as_posix()
    for p in (CONFIG_DIR / "model").rglob("*.yaml")
    if "backbone" in OmegaConf.load(p) or p.parent.name == "megalodon"
)


def run_config(name: str, *overrides: str) -> Any:
    cfg = OmegaConf.create({"model": group_config("model", name), "data": DATA_SPEC})
    for override in overrides:
        key, value = override.split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value))
    return cfg


def config_class(name: str) -> type:
    target = group_config("model", name).backbone._target_
    found = config_class_of(megalab_object(target))
    assert found is not None, f"{target} names no config dataclass"
    return found


def test_the_model_configs_are_found() -> None:
    assert {"mega", "seqboat", "megalodon", "llama", "s4d", "transformer"} <= set(MODELS)
    assert {"transformer_xl", "lamemo", "megalodon/7b"} <= set(MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_every_field_is_declared_with_a_meaning_and_has_a_schema_rule(name: str) -> None:
    cls = config_class(name)
    undocumented = [k for k, (_, spec) in declared(cls).items() if spec is None or not spec.doc]
    assert undocumented == [], f"{cls.__name__}: declare {undocumented} with option(doc=...)"
    rules = backbone_rules(run_config(name))
    fields = {f"model.backbone.{f.name}" for f in dataclasses.fields(cls) if f.init}
    assert fields <= set(rules)


@pytest.mark.parametrize("name", MODELS)
def test_defaults_and_shipped_values_pass_their_rules(name: str) -> None:
    cls = config_class(name)
    rules = option_rules(cls)
    for field in dataclasses.fields(cls):
        value = list(field.default) if isinstance(field.default, tuple) else field.default
        assert rules[field.name].check(value), (field.name, value, rules[field.name].expects)
    assert problems(run_config(name)) == []


def test_a_field_without_a_declaration_has_no_rule_and_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Half:
        width: int = option(4, ge=1, doc="a width")
        depth: int = 2

    with pytest.raises(TypeError, match=r"Half\.depth is not declared"):
        option_rules(Half)


@pytest.mark.parametrize(
    ("name", "override", "line"),
    [
        (
            "mega",
            "model.backbone.chunk_size=0",
            "model.backbone.chunk_size=0: expected an integer >= 1, or -1 (no chunking)",
        ),
        (
            "megalodon",
            "model.backbone.chunk_size=abc",
            "model.backbone.chunk_size='abc': expected an integer >= 1, or -1 (no chunking)",
        ),
        (
            "s4d",
            "model.backbone.num_layers=0",
            "model.backbone.num_layers=0: expected an integer >= 1",
        ),
        (
            "mega",
            "model.backbone.ema_dim=-1",
            "model.backbone.ema_dim=-1: expected an integer >= 0 (0 removes the EMA: the h = 0 "
            "ablation)",
        ),
        (
            "mega",
            "model.backbone.dropout=1.0",
            "model.backbone.dropout=1.0: expected a number in [0, 1)",
        ),
        (
            "mega",
            "model.backbone.prenorm=maybe",
            "model.backbone.prenorm='maybe': expected true or false",
        ),
        (
            "mega",
            "model.backbone.positions=rotary",
            "model.backbone.positions='rotary': expected one of none, learned",
        ),
        ("seqboat", "model.backbone.gumbel_tau=[1.0, 0.5]", "expected a list of 3 numbers"),
        (
            "llama",
            "model.backbone.ffn_dim=1.5",
            "expected an integer or null (null: Meta's 8d/3 rule)",
        ),
        ("transformer", "model.backbone.activation=tanh", "expected one of gelu, relu, silu"),
        (
            "transformer_xl",
            "model.backbone.ext_len=-1",
            "model.backbone.ext_len=-1: expected an integer >= 0",
        ),
        (
            "transformer",
            "model.encoder.dropout=1.5",
            "model.encoder.dropout=1.5: expected a number in [0, 1)",
        ),
    ],
)
def test_the_schema_names_each_bad_option_with_its_declared_range(
    name: str, override: str, line: str
) -> None:
    with pytest.raises(ConfigError) as err:
        validate(run_config(name, override))
    assert line in str(err.value)


def test_a_target_without_a_config_dataclass_gets_no_backbone_rules() -> None:
    cfg = run_config("mega", "model.backbone._target_=megalab.nn.embedding.SequenceEncoder")
    assert backbone_rules(cfg) == {}
    # Dropout rates still are probabilities there.
    assert any(
        "model.backbone.dropout" in p
        for p in problems(run_config("mega", "model.backbone.dropout=2.0"))
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: MegaConfig(num_layers=0), "num_layers must be >= 1, got 0"),
        (
            lambda: MegaConfig(chunk_size=0).build(),
            r"chunk_size must be >= 1, or -1 \(no chunking\), got 0",
        ),
        (
            lambda: MegaConfig(positions="rotary").build(),
            "unknown positions 'rotary'; choose one of none, learned",
        ),
        (lambda: MegalodonConfig(ffn_dim=0), "ffn_dim must be >= 1, got 0"),
        (lambda: MegalodonConfig(norm_type="layer"), "unknown norm_type 'layer'"),
        (lambda: S4DConfig(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
        (lambda: TransformerXLConfig(ext_len=-1), "ext_len must be >= 0, got -1"),
        (lambda: TransformerXLConfig(eval_mem_len=-2), "eval_mem_len must be >= 0, got -2"),
        (lambda: TransformerConfig(init="xavier").build(), "unknown init 'xavier'"),
        # None where the type has no None (a ${data.max_len} built without a dataset): it
        # failed when the layer compared it with a number.
        (lambda: MegaConfig(max_positions=None), "max_positions must be an integer, got None"),
        (
            lambda: MegalodonConfig(chunk_size=None),
            r"chunk_size must be an integer >= 1.*, got None",
        ),
    ],
)
def test_the_dataclasses_refuse_values_out_of_the_declared_range(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        # Each failed deep inside the layers (torch.empty's "must be tuple of ints", "'float'
        # object is not iterable") or was taken silently (a string for a flag).
        (lambda: MegaConfig(d_model="32"), "d_model must be an integer >= 1, got '32'"),
        (lambda: MegaConfig(z_dim=32.0), "z_dim must be an integer >= 1, got 32.0"),
        (lambda: MegaConfig(num_layers=True), "num_layers must be an integer >= 1, got True"),
        (lambda: MegaConfig(prenorm="false"), "prenorm must be true or false, got 'false'"),
        (lambda: MegaConfig(causal=1), "causal must be true or false, got 1"),
        (lambda: MegaConfig(dropout="0.1"), r"dropout must be a number in \[0, 1\), got '0.1'"),
        (lambda: MegaConfig(norm_type=3), "norm_type must be a string, got 3"),
        (lambda: MegaConfig(truncation=8.5), "truncation must be an integer or null, got 8.5"),
        (lambda: MegalodonConfig(d_model=[64]), r"d_model must be an integer >= 1, got \[64\]"),
        (
            lambda: SeqBoatConfig(gumbel_tau=(1.0, 0.5)),
            r"gumbel_tau must be a list of 3 numbers, got \(1.0, 0.5\)",
        ),
    ],
)
def test_the_dataclasses_refuse_values_of_another_type(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_the_dataclasses_take_numpy_scalars_as_before() -> None:
    config = MegaConfig(
        num_layers=np.int64(2), dropout=np.float64(0.1), causal=np.bool_(True), z_dim=np.int32(8)
    )
    assert (config.num_layers, config.causal, config.z_dim) == (2, True, 8)
    assert MegaConfig(dropout=0).dropout == 0  # an integer is a number
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        MegaConfig(num_layers=np.int64(0))


@pytest.mark.parametrize("name", ["seq2seq/mega", "seq2seq/transformer"])
def test_translation_model_options_get_their_declared_rules(name: str) -> None:
    cfg = run_config(name)
    cls = config_class_of(megalab_object(cfg.model.encoder_decoder._target_))
    assert cls is not None
    fields = {f"model.encoder_decoder.{f.name}" for f in dataclasses.fields(cls) if f.init}
    assert fields <= set(model_rules(cfg))
    assert problems(cfg) == []
    with pytest.raises(ConfigError) as err:
        validate(run_config(name, "model.encoder_decoder.decoder_layers=0"))
    assert "model.encoder_decoder.decoder_layers=0: expected an integer >= 1" in str(err.value)
