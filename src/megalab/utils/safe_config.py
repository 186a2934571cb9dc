"""What a run folder's saved config may make `megalab.eval` build.

A run folder is data: someone may send one, and its `.hydra/config.yaml` names the `_target_`s
that `hydra.utils.instantiate` would import and call. `check_targets` accepts only megalab's own
classes, the few megalab functions the configs use as factories (learning-rate schedules, the
FSDP wrap policy), and the library classes the configs name (optimizers); anything else (say
`torch.load` with `weights_only: false`, `os.system`, `subprocess.run`) is refused with
`UnsafeConfigError` before anything is instantiated. Interpolations are resolved first, so a
target cannot hide behind one.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

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
_NAME = re.compile(r"^megalab(\.[A-Za-z_][A-Za-z0-9_]*)+$")


class UnsafeConfigError(ValueError):
    """A saved config names something megalab does not build from data."""


def _allowed(target: str) -> bool:
    if target in LIBRARY_TARGETS:
        return True
    if not _NAME.match(target):
        return False
    from hydra.utils import get_object

    try:
        obj = get_object(target)  # imports megalab modules only (checked above)
    except Exception:
        return False
    if inspect.isclass(obj):
        return obj.__module__.startswith("megalab.") or obj.__module__ == "megalab"
    if inspect.isfunction(obj):
        return obj.__module__ in FUNCTION_MODULES
    return False


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


def check_targets(cfg: DictConfig | ListConfig | Mapping[str, Any], source: str) -> None:
    """Raise `UnsafeConfigError` unless every `_target_` in `cfg` is allowed (see module doc)."""
    if isinstance(cfg, DictConfig | ListConfig):
        try:
            plain = OmegaConf.to_container(cfg, resolve=True)
        except Exception as err:
            raise UnsafeConfigError(f"{source}: cannot resolve the config ({err})") from None
    else:
        plain = cfg
    bad = [(where, t) for where, t in _targets(plain) if not isinstance(t, str) or not _allowed(t)]
    if bad:
        listed = ", ".join(f"{where}={target!r}" for where, target in bad)
        raise UnsafeConfigError(
            f"{source} names objects megalab does not build from a run's saved config: {listed}. "
            "Evaluation instantiates only megalab's classes and the library classes its configs "
            "use (docs/reliability.md). If you trust this run, pass use_run_config=false and "
            "give the model/data/task groups on the command line instead"
        )
