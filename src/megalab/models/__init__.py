"""megalab's models, for use in your own code: backbones, their configs and their blocks.

    from megalab.models import Megalodon, MegalodonConfig, MegalodonBlock, from_preset

    model = Megalodon.from_config(MegalodonConfig(d_model=128, num_layers=2, causal=True))
    model = from_preset("megalodon/mega200M", num_layers=2)   # a shipped preset, resized

The names load on first use (each model folder imports its layers and `megalab.nn`):
`import megalab.models` itself imports nothing heavy.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megalab.models.base import Backbone, BackboneOutput
    from megalab.models.lamemo.model import LaMemo
    from megalab.models.llama.model import Llama, LlamaBlock, LlamaConfig
    from megalab.models.mega.model import Mega, MegaBlock, MegaConfig
    from megalab.models.megalodon.model import Megalodon, MegalodonBlock, MegalodonConfig
    from megalab.models.s4d import S4DBackbone, S4DBlock, S4DConfig
    from megalab.models.seqboat.model import SeqBoat, SeqBoatBlock, SeqBoatConfig
    from megalab.models.transformer.model import Transformer
    from megalab.models.transformer_xl.model import TransformerXL

_WHERE = {
    "Backbone": "base",
    "BackboneOutput": "base",
    "LaMemo": "lamemo",
    "Llama": "llama",
    "LlamaBlock": "llama",
    "LlamaConfig": "llama",
    "Mega": "mega",
    "MegaBlock": "mega",
    "MegaConfig": "mega",
    "Megalodon": "megalodon",
    "MegalodonBlock": "megalodon",
    "MegalodonConfig": "megalodon",
    "S4DBackbone": "s4d",
    "S4DBlock": "s4d",
    "S4DConfig": "s4d",
    "SeqBoat": "seqboat",
    "SeqBoatBlock": "seqboat",
    "SeqBoatConfig": "seqboat",
    "Transformer": "transformer",
    "TransformerXL": "transformer_xl",
}

__all__ = [
    "Backbone",
    "BackboneOutput",
    "LaMemo",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "Mega",
    "MegaBlock",
    "MegaConfig",
    "Megalodon",
    "MegalodonBlock",
    "MegalodonConfig",
    "S4DBackbone",
    "S4DBlock",
    "S4DConfig",
    "SeqBoat",
    "SeqBoatBlock",
    "SeqBoatConfig",
    "Transformer",
    "TransformerXL",
    "block_classes",
    "from_preset",
]

# What a model config interpolates from the data (`${data.*}`) when built outside a run.
_DATA_SPEC = {
    "vocab_size": None,
    "d_input": None,
    "pad_id": 0,
    "max_len": None,
    "num_classes": None,
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"megalab.models.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'megalab.models' has no attribute {name!r}")


def block_classes() -> set[type]:
    """The block class of every megalab backbone (each declares its `block_class`): each block
    becomes its own FSDP unit and activation-checkpointing region (Lightning's
    `auto_wrap_policy` / `activation_checkpointing_policy` take a set of classes)."""
    from megalab.models.base import Backbone

    exported = [__getattr__(name) for name in _WHERE]
    backbones = [c for c in exported if isinstance(c, type) and issubclass(c, Backbone)]
    return {c.block_class for c in backbones if c.block_class is not None}


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
    backbone: Backbone = hydra.utils.instantiate(cfg.model.backbone)
    return backbone
