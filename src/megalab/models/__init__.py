"""megalab's models, for use in your own code: backbones, their configs and their blocks.

    from megalab.models import Megalodon, MegalodonConfig, MegalodonBlock, from_preset

    model = Megalodon(MegalodonConfig(d_model=128, num_layers=2, causal=True))
    model = from_preset("megalodon/mega200M", num_layers=2)   # a shipped preset, resized
    translator = encoder_decoder_from_preset("seq2seq/mega", data={"vocab_size": 32000})

Every model is a package `megalab/models/<model>/` whose `__init__.py` lists its public names in
a literal `__all__`: those names are this module's too, found by reading the packages' `__all__`
(nothing is listed here by hand), and load on first use (each model folder imports its layers
and `megalab.nn`): `import megalab.models` itself imports nothing heavy.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pkgutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs only; a new model needs no line here
    from megalab.models.base import Backbone as Backbone
    from megalab.models.base import BackboneConfig as BackboneConfig
    from megalab.models.base import BackboneOutput as BackboneOutput
    from megalab.models.lamemo import LaMemo as LaMemo
    from megalab.models.lamemo import LaMemoConfig as LaMemoConfig
    from megalab.models.llama import Llama as Llama
    from megalab.models.llama import LlamaBlock as LlamaBlock
    from megalab.models.llama import LlamaConfig as LlamaConfig
    from megalab.models.mega import Mega as Mega
    from megalab.models.mega import MegaBlock as MegaBlock
    from megalab.models.mega import MegaConfig as MegaConfig
    from megalab.models.megalodon import Megalodon as Megalodon
    from megalab.models.megalodon import MegalodonBlock as MegalodonBlock
    from megalab.models.megalodon import MegalodonConfig as MegalodonConfig
    from megalab.models.s4d import S4DBackbone as S4DBackbone
    from megalab.models.s4d import S4DBlock as S4DBlock
    from megalab.models.s4d import S4DConfig as S4DConfig
    from megalab.models.seq2seq import EncoderDecoder as EncoderDecoder
    from megalab.models.seq2seq import EncoderDecoderConfig as EncoderDecoderConfig
    from megalab.models.seqboat import SeqBoat as SeqBoat
    from megalab.models.seqboat import SeqBoatBlock as SeqBoatBlock
    from megalab.models.seqboat import SeqBoatConfig as SeqBoatConfig
    from megalab.models.transformer import Transformer as Transformer
    from megalab.models.transformer import TransformerConfig as TransformerConfig
    from megalab.models.transformer_xl import TransformerXL as TransformerXL
    from megalab.models.transformer_xl import TransformerXLConfig as TransformerXLConfig

# The contracts every backbone (`megalab.models.base`) and every encoder-decoder
# (`megalab.models.seq2seq`) implements: modules, not models.
_CONTRACT_NAMES = {
    "Backbone": "base",
    "BackboneConfig": "base",
    "BackboneOutput": "base",
    "EncoderDecoder": "seq2seq",
    "EncoderDecoderConfig": "seq2seq",
}
# Defined in this file.
_OWN_NAMES = ("block_classes", "encoder_decoder_from_preset", "from_preset")

# What a model config interpolates from the data (`${data.*}`) when built outside a run.
_DATA_SPEC = {
    "vocab_size": None,
    "d_input": None,
    "pad_id": 0,
    "max_len": None,
    "num_classes": None,
}


def _declared_names(init: Path) -> list[str]:
    """The literal `__all__` of a model package's `__init__.py`, read without importing it."""
    for node in ast.parse(init.read_text(encoding="utf-8"), str(init)).body:
        if isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "__all__":
            try:
                names = ast.literal_eval(value)
            except ValueError:
                break
            if isinstance(names, list | tuple) and all(isinstance(n, str) for n in names):
                return list(names)
    raise ImportError(
        f"{init}: a model package lists its public names in a literal "
        "`__all__ = [...]` of strings (megalab.models exports them)"
    )


@functools.cache
def _model_packages() -> dict[str, str]:
    """Public name -> the model package (`megalab.models.<package>`) that exports it.

    The packages are the sub-packages of `megalab.models` on its `__path__`: only megalab's own
    folders, never names from configs or data."""
    where = dict(_CONTRACT_NAMES)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.ispkg or not info.name.isidentifier():
            continue
        init = Path(getattr(info.module_finder, "path", "")) / info.name / "__init__.py"
        for name in _declared_names(init):
            if name in where or name in _OWN_NAMES:
                owner = f"megalab.models.{where[name]}" if name in where else "megalab.models"
                raise ImportError(
                    f"megalab.models.{info.name} and {owner} both export {name!r}: rename one "
                    "(megalab.models holds every model's names)"
                )
            where[name] = info.name
    return where


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return sorted([*_model_packages(), *_OWN_NAMES])
    package = _model_packages().get(name)
    if package is None:
        raise AttributeError(f"module 'megalab.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megalab.models.{package}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_model_packages(), "__all__"})


def block_classes() -> set[type]:
    """The block class of every megalab backbone (each declares its `block_class`): each block
    becomes its own FSDP unit and activation-checkpointing region (Lightning's
    `auto_wrap_policy` / `activation_checkpointing_policy` take a set of classes)."""
    from megalab.models.base import Backbone

    exported = [__getattr__(name) for name in _model_packages()]
    backbones = [c for c in exported if isinstance(c, type) and issubclass(c, Backbone)]
    return {c.block_class for c in backbones if c.block_class is not None}


def _check_data_given(name: str, node: Any, options: Mapping[str, Any]) -> None:
    """Raise a ValueError naming the `data` entry to give when an option of the preset's `node`
    (its backbone or encoder-decoder) that it takes from the dataset (`${data.max_len}`) is left
    None and its field does not allow None."""
    from omegaconf import OmegaConf

    from megalab.utils.options import config_class_of, declared, rule_of
    from megalab.utils.safe_config import megalab_object

    config_class = config_class_of(megalab_object(str(node.get("_target_", ""))))
    fields = declared(config_class) if config_class is not None else {}
    unresolved = OmegaConf.to_container(node, resolve=False)
    assert isinstance(unresolved, dict)
    for key, raw in unresolved.items():
        key = str(key)
        if not (isinstance(raw, str) and raw.startswith("${data.") and raw.endswith("}")):
            continue
        data_key = raw[len("${data.") : -1]
        annotation, spec = fields.get(key, (None, None))
        if key in options or node[key] is not None or spec is None:
            continue
        if rule_of(annotation, spec).check(None):
            continue  # None is a valid value of this option
        raise ValueError(
            f"{name}: {key} comes from the dataset ({raw}), and no dataset is given: pass "
            f"data={{{data_key!r}: ...}} or {key}=... to the preset"
        )


def _shipped_presets(kind: str) -> list[str]:
    from megalab.utils.paths import CONFIG_DIR, group_config

    root = CONFIG_DIR / "model"
    names = sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))
    return [n for n in names if kind in group_config("model", n)]


# A model config's node -> what it builds, and the function that builds it from a preset.
_PRESET_KINDS = {
    "backbone": ("a backbone", "from_preset"),
    "encoder_decoder": ("an encoder-decoder", "encoder_decoder_from_preset"),
}


def _built_preset(
    name: str, kind: str, data: Mapping[str, Any] | None, options: Mapping[str, Any]
) -> Any:
    """The model the shipped model config `name` builds from its `kind` node (`backbone` or
    `encoder_decoder`), with `options` replacing the preset's and `data` filling `${data.*}`."""
    import hydra
    from omegaconf import OmegaConf

    from megalab.models.base import built
    from megalab.utils.paths import CONFIG_DIR, group_config

    if not (CONFIG_DIR / "model" / f"{name}.yaml").is_file():
        raise ValueError(f"no model preset {name!r}; the shipped ones are {_shipped_presets(kind)}")
    model = group_config("model", name)
    if kind not in model:
        other = "encoder_decoder" if "encoder_decoder" in model else "backbone"
        (said, builder), (wanted, _) = _PRESET_KINDS[other], _PRESET_KINDS[kind]
        raise ValueError(
            f"model preset {name!r} is {said}, not {wanted}: build it with {builder}({name!r}, ...)"
        )
    cfg = OmegaConf.create({"model": model, "data": {**_DATA_SPEC, **(data or {})}})
    node = cfg.model[kind]
    for key, value in options.items():
        if key == "d_model":
            cfg.model.d_model = value
        elif key in node:
            node[key] = value
        else:
            options_known = sorted(k for k in node if k != "_target_")
            raise ValueError(f"{name}: no option {key!r}; its options are {options_known}")
    _check_data_given(name, node, options)
    try:
        made = hydra.utils.instantiate(node)
    except hydra.errors.InstantiationException as e:
        if isinstance(e.__cause__, ValueError):  # a config check: say it without Hydra's frame
            raise ValueError(f"{name}: {e.__cause__}") from None
        raise
    return made.build() if kind == "encoder_decoder" else built(made)


def from_preset(name: str, data: Mapping[str, Any] | None = None, **options: Any) -> Backbone:
    """The backbone of the shipped model config `name` (`mega`, `megalodon/mega200M`, ...).

    `options` replace the preset's: `d_model`, or any option of its backbone (`num_layers`,
    `chunk_size`, ...); `data` fills what the config takes from a dataset (`max_len`, ...).
    """
    from megalab.models.base import Backbone

    backbone = _built_preset(name, "backbone", data, options)
    assert isinstance(backbone, Backbone)
    return backbone


def encoder_decoder_from_preset(
    name: str, data: Mapping[str, Any] | None = None, **options: Any
) -> EncoderDecoder:
    """The encoder-decoder of the shipped model config `name` (`seq2seq/mega`,
    `seq2seq/transformer`), as `from_preset` builds a backbone.

    `data` gives the dictionary's `vocab_size` (and `pad_id`, 0 unless given) that the preset
    takes from the translation data; `options` replace any option of its `encoder_decoder`.
    """
    from megalab.models.seq2seq import EncoderDecoder

    model = _built_preset(name, "encoder_decoder", data, options)
    assert isinstance(model, EncoderDecoder)
    return model
