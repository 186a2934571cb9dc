"""megalab's loading policy: what a file that is data may make megalab build, run or write.

Trusted: the command line and the installed package (its configs, its sweep files). Data: run
folders (`.hydra/config.yaml`), checkpoints, sweep files, table files, prepared caches; someone
may send any of them. Every entry point that reads one goes through this module:

- YAML is read with the safe loader only (`load_yaml`, `load_run_config`): a tag such as
  `!!python/object` is refused, naming the file and the line.
- A config's `_target_`s (what `hydra.utils.instantiate` would import and call) may name only
  megalab's own classes, the few megalab functions the configs use as factories
  (learning-rate schedules, the FSDP wrap policy), and the library classes the configs name
  (optimizers, Lightning's trainer pieces): `check_targets`. Anything else (`torch.load` with
  `weights_only: false`, `os.system`, `subprocess.run`) is refused with `UnsafeConfigError`
  before anything is instantiated. Interpolations are resolved first, so a target cannot hide
  behind one, and only the resolvers megalab's configs use may appear (`check_resolvers`).
- Overrides taken from a file (a sweep's `command` and parameters) may not name a `_target_`,
  add keys (`+key=...`), delete them, or set Hydra's or the paths' keys (`check_file_override`),
  unless the command line opts in (`megalab-sweep --allow-targets`).
- Evaluation and generation read the data a run used but never generate, download or write
  into its data folder unless the command line asks (`data_settings_from_command_line`).
- Checkpoints are read with `torch.load(weights_only=True)` after their checksum is verified
  (`megalab.utils.checkpointing.read_checkpoint`); carried state is rebuilt only from the
  registered state classes (`megalab.nn.state`); the authors' checkpoints only with an
  argparse `Namespace` and numpy scalars besides (`megalab.models.convert.load_checkpoint`).
"""

from __future__ import annotations

import inspect
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from megalab.utils.errors import UserError

#: Library classes the configs instantiate (the groups `megalab.eval` takes from a run).
LIBRARY_TARGETS = frozenset(
    {
        "torch.optim.Adam",
        "torch.optim.AdamW",
        "torch.optim.SGD",
        "torch.optim.RAdam",
        "torch.optim.NAdam",
        "torch.optim.Adamax",
        "torch.optim.Adagrad",
        "torch.optim.RMSprop",
        "lightning.pytorch.callbacks.EarlyStopping",
        "lightning.pytorch.callbacks.ModelCheckpoint",
        "lightning.pytorch.loggers.csv_logs.CSVLogger",
        "lightning.pytorch.loggers.wandb.WandbLogger",
        "lightning.pytorch.strategies.DDPStrategy",
        "lightning.pytorch.strategies.FSDPStrategy",
        "lightning.pytorch.trainer.Trainer",
    }
)
#: megalab modules whose functions are factories a config may call (schedules, wrap policies).
FUNCTION_MODULES = ("megalab.optim", "megalab.utils.distributed")
#: Other megalab functions a config may call (the FSDP wrap policy's block classes).
FUNCTIONS = frozenset({"megalab.models.block_classes"})
#: The resolvers megalab's configs use; none of them runs code (`${oc.env:...}` reads the
#: environment, `${oc.decode:...}` parses a value whose targets are checked like any other).
SAFE_RESOLVERS = frozenset({"hydra", "now", "oc.env", "oc.select", "oc.decode"})
_NAME = re.compile(r"^megalab(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_RESOLVER = re.compile(r"\$\{\s*([A-Za-z_][A-Za-z0-9_.\-]*)\s*:")


class UnsafeConfigError(UserError, ValueError):
    """A file that is data names something megalab does not build, run or write from data."""


def _allowed(target: str) -> bool:
    if target in LIBRARY_TARGETS:
        return True
    obj = megalab_object(target)
    if obj is None:
        return False
    if inspect.isclass(obj):
        return obj.__module__.startswith("megalab.") or obj.__module__ == "megalab"
    if inspect.isfunction(obj):
        where = obj.__module__
        return where in FUNCTION_MODULES or f"{where}.{obj.__qualname__}" in FUNCTIONS
    return False


def megalab_object(target: str) -> Any:
    """The megalab class or function a `_target_` names, or None for any other name (nothing
    outside megalab is imported)."""
    if not _NAME.match(target):
        return None
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception:
        return None


def _targets(node: Any, path: str = "") -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    if isinstance(node, Mapping):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                found.append((where, value))
            else:
                found.extend(_targets(value, where))
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            found.extend(_targets(value, f"{path}[{i}]"))
    return found


def _strings(node: Any, path: str = "") -> Iterable[tuple[str, str]]:
    """Every (key path, string) below `node`, keys included (an interpolation may be a key)."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            yield where, str(key)
            yield from _strings(value, where)
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def check_resolvers(cfg: DictConfig | ListConfig | Mapping[str, Any], source: str) -> None:
    """Raise `UnsafeConfigError` if an interpolation calls a resolver outside `SAFE_RESOLVERS`
    (a resolver registered by some library could run code when the config is resolved)."""
    plain = (
        OmegaConf.to_container(cfg, resolve=False)
        if isinstance(cfg, DictConfig | ListConfig)
        else cfg
    )
    bad = [
        f"{where}={text!r}"
        for where, text in _strings(plain)
        for name in _RESOLVER.findall(text)
        if name not in SAFE_RESOLVERS
    ]
    if bad:
        raise UnsafeConfigError(
            f"{source} calls resolvers megalab does not run from data: {', '.join(bad)}. "
            f"Only {', '.join(sorted(SAFE_RESOLVERS))} may appear in an interpolation "
            "(docs/reliability.md, loading policy)"
        )


EVAL_HINT = (
    "If you trust this run, pass use_run_config=false and give the model/data/task groups on "
    "the command line instead"
)


def check_targets(
    cfg: DictConfig | ListConfig | Mapping[str, Any], source: str, hint: str = EVAL_HINT
) -> None:
    """Raise `UnsafeConfigError` unless every `_target_` in `cfg` is allowed and every resolver
    is one of `SAFE_RESOLVERS` (see module doc); `hint` says how to proceed with a trusted file."""
    check_resolvers(cfg, source)
    if isinstance(cfg, DictConfig | ListConfig):
        try:
            plain = OmegaConf.to_container(cfg, resolve=True)
        except Exception as err:
            raise UnsafeConfigError(f"{source}: cannot resolve the config ({err})") from None
    else:
        plain = cfg
    # Name keys from the config's root (`task.evil._target_`), also when given one group.
    prefix = cfg._get_full_key(None) if isinstance(cfg, DictConfig | ListConfig) else ""
    found = _targets(plain, str(prefix or ""))
    bad = [(where, t) for where, t in found if not isinstance(t, str) or not _allowed(t)]
    if bad:
        listed = ", ".join(f"{where}={target!r}" for where, target in bad)
        raise UnsafeConfigError(
            f"{source} names objects megalab does not build from a run's saved config: {listed}. "
            "megalab instantiates from data only its own classes and the library classes its "
            f"configs use (docs/reliability.md). {hint}"
        )


# -- files ------------------------------------------------------------------------------------
def load_yaml(path: str | os.PathLike[str]) -> Any:
    """A YAML file that is data, read with the safe loader: plain mappings, lists and scalars
    (a `!!python/...` tag is refused naming the file, the line and its key)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        return yaml.safe_load(text)
    except yaml.constructor.ConstructorError as err:
        raise UnsafeConfigError(_tag_message(path, text, err)) from None


def _tag_message(path: Path, text: str, err: yaml.MarkedYAMLError) -> str:
    mark = err.problem_mark
    where = ""
    if mark is not None:
        lines = text.splitlines()
        line = lines[mark.line].strip() if mark.line < len(lines) else ""
        where = f" line {mark.line + 1} ({line[:80]!r})"
    return (
        f"{path}{where}: {err.problem}. megalab reads YAML files as plain data (mappings, lists, "
        "numbers, strings) and never builds Python objects from their tags"
    )


def load_run_config(path: str | os.PathLike[str]) -> DictConfig:
    """A run folder's saved config (`.hydra/config.yaml`): safe YAML, a mapping, and no
    resolver outside `SAFE_RESOLVERS`. Its targets are checked by the caller, on the groups it
    builds (`check_targets`); a model class named with its options beside it, as runs from
    before the models took their config object do, is read as its config class (with a
    warning)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        cfg = OmegaConf.create(text)  # OmegaConf's loader: PyYAML's SafeLoader with float fixes
    except yaml.constructor.ConstructorError as err:
        raise UnsafeConfigError(_tag_message(path, text, err)) from None
    except Exception as err:  # not YAML, or YAML that is not a mapping
        raise UnsafeConfigError(f"{path}: not a readable run config ({err})") from None
    if not isinstance(cfg, DictConfig):
        raise UnsafeConfigError(f"{path}: not a run config (expected a mapping of groups)")
    check_resolvers(cfg, str(path))
    upgrade_backbone_targets(cfg, str(path))
    return cfg


def upgrade_backbone_targets(cfg: Any, source: str = "the config") -> None:
    """Rewrite, in place, each `_target_` that names a model class with its options beside it
    (`_target_: megalab.models.mega.Mega`, `chunk_size: 128`) to name the model's config class
    (`megalab.models.mega.MegaConfig`), which the task builds the model from. The same holds for
    the encoder-decoders (`megalab.models.mega.translation.MegaEncoderDecoder` ->
    `MegaEncoderDecoderConfig`): every class under `megalab.models` whose constructor takes a
    config dataclass.

    Backbones take their config object since megalab's model folders, the encoder-decoders
    since after; configs, saved runs and exports written before keep working, with a
    FutureWarning that names the new target. The options keep their names
    (`model.backbone.chunk_size`, `model.encoder_decoder.dropout`). Interpolated targets are
    left to their source; only megalab's own classes are looked up (`megalab_object`).
    """
    from megalab.utils.options import config_class_of

    container = OmegaConf.to_container(cfg, resolve=False)  # interpolations stay strings
    for where, target in _targets(container):
        obj = megalab_object(target) if isinstance(target, str) else None
        if not (isinstance(obj, type) and obj.__module__.startswith("megalab.models.")):
            continue
        config_class = config_class_of(obj)
        if config_class is None or config_class is obj:
            continue
        parent = where.rpartition(".")[0]
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if isinstance(node, DictConfig) and "config" in node:
            continue  # the model class given its config object: today's spelling
        module, _, _ = target.rpartition(".")
        new = f"{module}.{config_class.__name__}"
        if megalab_object(new) is not config_class:
            new = f"{config_class.__module__}.{config_class.__qualname__}"
        warnings.warn(
            f"{source}: `_target_: {target}` with the model's options beside it is "
            f"deprecated; name its config class instead, `_target_: {new}` (the options keep "
            "their names). It was read as that.",
            FutureWarning,
            stacklevel=2,
        )
        with open_dict(cfg):
            OmegaConf.update(cfg, where, new)


# -- overrides from files ---------------------------------------------------------------------
#: Top-level keys a file's override may not set: Hydra's own (its callbacks and launchers are
#: `_target_`s, its run and sweep folders say where to write) and the paths (where data and
#: outputs go). The command line sets them.
FILE_OVERRIDE_FORBIDDEN = ("hydra", "paths")
_PATH_ESCAPE = re.compile(r"(^|[=,\[\s'\"])(/|~|\.\./)|/\.\./|/\.\.$")


def config_groups() -> frozenset[str]:
    """The config groups of the installed package (`experiment`, `model`, `data`, ...)."""
    from megalab.utils.paths import CONFIG_DIR

    return frozenset(p.name for p in Path(CONFIG_DIR).iterdir() if p.is_dir())


def check_file_override(override: str, source: str, allow_targets: bool = False) -> None:
    """Refuse a Hydra override read from a file (not the command line) that names a `_target_`,
    calls a resolver outside `SAFE_RESOLVERS`, adds or deletes a key (`+a.b=...`, `~a`) other
    than selecting an option of one of megalab's config groups (`+experiment=...`), sets
    `hydra.*` or `paths.*`, or gives a path outside the run (`/...`, `../`).
    `allow_targets` (a command-line flag) lifts all but the resolver rule."""
    text = str(override)
    key, _, value = text.partition("=")
    bare = key.lstrip("+~")
    top = bare.split(".", 1)[0].split("/", 1)[0]
    for name in _RESOLVER.findall(text):
        if name not in SAFE_RESOLVERS:
            raise UnsafeConfigError(
                f"{source}: the override {text!r} calls the resolver {name!r}; only "
                f"{', '.join(sorted(SAFE_RESOLVERS))} may appear in a file's overrides"
            )
    if allow_targets:
        return
    problem = None
    if "_target_" in text:
        problem = "names a `_target_` (an object to import and call)"
    elif key.startswith(("+", "~")) and not ("." not in bare and bare in config_groups()):
        problem = "adds or deletes a key outside megalab's config groups"
    elif top in FILE_OVERRIDE_FORBIDDEN:
        problem = f"sets `{top}.*`, which only the command line may set"
    elif _PATH_ESCAPE.search(value):
        problem = "gives a path outside the run's folders (absolute, `~` or `../`)"
    if problem is not None:
        raise UnsafeConfigError(
            f"{source}: the override {text!r} {problem}. Overrides from a file are data; if you "
            "trust this file, pass --allow-targets on the command line (docs/reliability.md)"
        )


# -- evaluation's data ------------------------------------------------------------------------
#: Data settings that make a DataModule generate, download or write data when it is missing.
DATA_WRITE_KEYS = ("generate_if_missing", "download")


def data_settings_from_command_line(cfg: DictConfig, overrides: Iterable[str]) -> list[str]:
    """Turn off `DATA_WRITE_KEYS` in `cfg.data` unless the command line sets them (evaluation
    and generation read the data a run used and never make or fetch it unasked); returns the
    keys turned off."""
    from omegaconf import open_dict

    data = cfg.get("data")
    if not isinstance(data, DictConfig):
        return []
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    off = []
    with open_dict(cfg):
        for key in DATA_WRITE_KEYS:
            if key in data and f"data.{key}" not in given and data.get(key) is not False:
                data[key] = False
                off.append(f"data.{key}")
    return off
