"""megalab's models, for use in your own code: backbones, their configs and their blocks.

    from megalab.models import Megalodon, MegalodonConfig, MegalodonBlock, from_preset

    model = Megalodon(MegalodonConfig(d_model=128, num_layers=2, causal=True))
    model = from_preset("megalodon/mega200M", num_layers=2)   # a shipped preset, resized

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
    from megalab.models.seqboat import SeqBoat as SeqBoat
    from megalab.models.seqboat import SeqBoatBlock as SeqBoatBlock
    from megalab.models.seqboat import SeqBoatConfig as SeqBoatConfig
    from megalab.models.transformer import Transformer as Transformer
    from megalab.models.transformer import TransformerConfig as TransformerConfig
    from megalab.models.transformer_xl import TransformerXL as TransformerXL
    from megalab.models.transformer_xl import TransformerXLConfig as TransformerXLConfig

# The contract every backbone implements, from `megalab.models.base` (a module, not a model).
_BASE_NAMES = ("Backbone", "BackboneConfig", "BackboneOutput")
# Defined in this file.
_OWN_NAMES = ("block_classes", "from_preset")

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
    where = {name: "base" for name in _BASE_NAMES}
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


def _check_data_given(name: str, cfg: Any, options: Mapping[str, Any]) -> None:
    """Raise a ValueError naming the `data` entry to give when a backbone option the preset
    takes from the dataset (`${data.max_len}`) is left None and its field does not allow None."""
    from omegaconf import OmegaConf

    from megalab.utils.options import config_class_of, declared, rule_of
    from megalab.utils.safe_config import megalab_object

    backbone = cfg.model.backbone
    config_class = config_class_of(megalab_object(str(backbone.get("_target_", ""))))
    fields = declared(config_class) if config_class is not None else {}
    unresolved = OmegaConf.to_container(backbone, resolve=False)
    assert isinstance(unresolved, dict)
    for key, raw in unresolved.items():
        key = str(key)
        if not (isinstance(raw, str) and raw.startswith("${data.") and raw.endswith("}")):
            continue
        data_key = raw[len("${data.") : -1]
        annotation, spec = fields.get(key, (None, None))
        if key in options or backbone[key] is not None or spec is None:
            continue
        if rule_of(annotation, spec).check(None):
            continue  # None is a valid value of this option
        raise ValueError(
            f"{name}: {key} comes from the dataset ({raw}), and no dataset is given: pass "
            f"data={{{data_key!r}: ...}} or {key}=... to from_preset"
        )


def from_preset(name: str, data: Mapping[str, Any] | None = None, **options: Any) -> Backbone:
    """The backbone of the shipped model config `name` (`mega`, `megalodon/mega200M`, ...).

    `options` replace the preset's: `d_model`, or any option of its backbone (`num_layers`,
    `chunk_size`, ...); `data` fills what the config takes from a dataset (`max_len`, ...).
    """
    import hydra
    from omegaconf import OmegaConf

    from megalab.utils.paths import CONFIG_DIR, group_config

    if not (CONFIG_DIR / "model" / f"{name}.yaml").is_file():
        shipped = sorted(
            str(p.relative_to(CONFIG_DIR / "model").with_suffix(""))
            for p in (CONFIG_DIR / "model").rglob("*.yaml")
        )
        raise ValueError(f"no model preset {name!r}; the shipped ones are {shipped}")
    model = group_config("model", name)
    if "backbone" not in model:
        raise ValueError(f"model preset {name!r} has no backbone (an encoder-decoder?)")
    cfg = OmegaConf.create({"model": model, "data": {**_DATA_SPEC, **(data or {})}})
    for key, value in options.items():
        if key == "d_model":
            cfg.model.d_model = value
        elif key in cfg.model.backbone:
            cfg.model.backbone[key] = value
        else:
            options_known = sorted(k for k in cfg.model.backbone if k != "_target_")
            raise ValueError(f"{name}: no option {key!r}; its options are {options_known}")
    _check_data_given(name, cfg, options)
    from megalab.models.base import Backbone, built

    try:
        backbone = built(hydra.utils.instantiate(cfg.model.backbone))
    except hydra.errors.InstantiationException as e:
        if isinstance(e.__cause__, ValueError):  # a config check: say it without Hydra's frame
            raise ValueError(f"{name}: {e.__cause__}") from None
        raise
    assert isinstance(backbone, Backbone)
    return backbone
