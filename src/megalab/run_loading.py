"""A checkpoint with its run's config, as `megalab-eval`, `megalab-generate` and the
long-context evaluation load it; and the weights a new run starts from (`init_from`).

When the checkpoint lies in a megalab run directory (`megalab.utils.run_folder.find_run_config`),
`merge_run_config` takes the run's own `data`, `model`, `task`, `optim`, `scheduler` and
`monitor` configs (checked by the loading policy, `megalab.utils.safe_config`) and the data
folder the run read; `load_task` builds the task and loads the checkpoint's weights (checksum
verified, `weights_only=True`).

`init_weights` starts a training run from another run's weights (fine-tuning): a checkpoint
(`<run>/checkpoints/*.ckpt`, read as `load_task` reads one) or an export (`megalab-export`'s
folder, or its Hub id). Only the weights are taken; the optimizer, the schedule and the step
start afresh (`ckpt_path` resumes a run instead). The weights `init_skip` names keep their fresh
initialisation (`init_skip=[head]`: a new classifier head); every other weight must fit, or the
run stops naming those that do not.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
import torch
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from megalab.data.vocabulary import check_vocabulary, run_tokenizer, run_vocabulary
from megalab.utils import errors
from megalab.utils.checkpointing import read_checkpoint
from megalab.utils.run_folder import find_run_config, find_run_dir, refuse_folder
from megalab.utils.safe_config import (
    UnsafeConfigError,
    check_targets,
    data_settings_from_command_line,
    load_run_config,
    megalab_object,
    upgrade_backbone_targets,
)

if TYPE_CHECKING:
    from megalab.tasks.language_modeling import LanguageModelingTask

log = logging.getLogger("megalab.eval")

RUN_GROUPS = ("data", "model", "task", "optim", "scheduler", "monitor")


def _given(overrides: list[str]) -> set[str]:
    """The keys the command line sets (`+a.b=1` -> `a.b`)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


def run_data_dir(run_cfg: DictConfig, source: str = "the run config") -> str | None:
    """The data folder a run read (`paths.data_dir` resolved in the run's own config)."""
    try:
        value = OmegaConf.select(run_cfg, "paths.data_dir", throw_on_resolution_failure=True)
    except Exception:
        return None
    if value is not None and "${" in str(value):  # resolves to an interpolation: refuse it
        raise UnsafeConfigError(f"{source}: paths.data_dir={value!r} is not a folder")
    return None if value is None else str(value)


def _data_dir_set_apart(run_cfg: DictConfig) -> bool:
    """Whether the run was given its data folder (`paths.data_dir=/datasets`), rather than
    the default below its root (an interpolation of `paths.root_dir`)."""
    paths = run_cfg.get("paths")
    if not isinstance(paths, DictConfig) or "data_dir" not in paths:
        return False
    return not OmegaConf.is_interpolation(paths, "data_dir")


def checkpoint_file(cfg: DictConfig) -> Path:
    """`cfg.ckpt_path`, refused when it is not given or names a folder (a run folder rather
    than one of its checkpoints), before any config is read from next to it."""
    if "ckpt_path" not in cfg or OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.ckpt_path:
        raise ValueError(
            "no checkpoint given: add ckpt_path=<run>/checkpoints/<name>.ckpt (last.ckpt, or "
            "the best-*.ckpt a run's metrics.json names as best_checkpoint)"
        )
    path = Path(str(cfg.ckpt_path)).expanduser()
    refuse_folder(path)
    return path


def _has_key(cfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(node, DictConfig) and leaf in node


def run_config_in_argv(argv: list[str]) -> DictConfig | None:
    """The saved config of the run whose checkpoint the command line names (`ckpt_path=`), or
    None: no such run, `use_run_config=false`, or a config that cannot be read
    (`merge_run_config` then says why)."""
    settings = dict(a.partition("=")[::2] for a in argv if "=" in a and not a.startswith("-"))
    ckpt = settings.get("ckpt_path")
    if not ckpt or str(settings.get("use_run_config", "true")).lower() in ("false", "0"):
        return None
    try:
        run_cfg_path = find_run_config(Path(ckpt).expanduser())
        return load_run_config(run_cfg_path) if run_cfg_path is not None else None
    except Exception:
        return None


def run_overrides_composable(argv: list[str], run_cfg: DictConfig | None) -> list[str]:
    """`argv` with the overrides of keys of the run's config (`data.eval_max_len=...`) marked
    `++`, so that Hydra composes them: it checks overrides against the entry point's default
    groups (ListOps, a Transformer) before `merge_run_config` swaps in the run's. Keys the run
    lacks stay as typed, for Hydra to refuse; `+`/`~` overrides and group choices are left
    alone."""
    if run_cfg is None:
        return argv
    out = []
    for arg in argv:
        key, eq, _ = arg.partition("=")
        ours = eq and "." in key and key.split(".")[0] in RUN_GROUPS and key[0].isalpha()
        out.append("++" + arg if ours and _has_key(run_cfg, key) else arg)
    return out


def run_entry_point_of_a_run(hydra_main: Callable[[], Any], config_name: str) -> None:
    """Call the `@hydra.main` of a command that loads a run's checkpoint (`megalab-eval`,
    `megalab-generate`): overrides of the run's own keys compose (`run_overrides_composable`),
    and a misspelled key is answered with the run's closest keys."""
    run_cfg = run_config_in_argv(sys.argv[1:])
    sys.argv[1:] = run_overrides_composable(sys.argv[1:], run_cfg)
    errors.run_entry_point(hydra_main, config_name, keys_from=run_cfg)


def merge_run_config(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Replace this config's model/data/task groups with the checkpoint's run config (and its
    data folder), checked by the loading policy; turn off data generation and downloads that
    the command line does not ask for."""
    run_cfg_path = find_run_config(checkpoint_file(cfg))
    if run_cfg_path is None or not cfg.get("use_run_config", True):
        upgrade_backbone_targets(cfg)  # composed here: an old model target reads as its config
        data_settings_from_command_line(cfg, overrides)
        return cfg
    log.info("using the run config %s", run_cfg_path)
    run_cfg = load_run_config(run_cfg_path)  # safe YAML, safe resolvers (safe_config)
    given = _given(overrides)
    with open_dict(cfg):
        for key in RUN_GROUPS:
            if key in run_cfg:
                cfg[key] = run_cfg[key]
        data_dir = run_data_dir(run_cfg, str(run_cfg_path))
        # The run's data, not this command's default folder. A root given here moves the data
        # of a run that kept it below its root (a project moved); one set apart stays.
        moved = "paths.root_dir" in given and not _data_dir_set_apart(run_cfg)
        if data_dir is not None and "paths.data_dir" not in given and not moved:
            cfg.paths.data_dir = data_dir
        # The run's own token ids: data that trains its tokenizer reads the run's copy instead
        # (megalab.data.vocabulary), also when its files have changed since.
        tokenizer = run_tokenizer(run_cfg_path.parent.parent)
        data = cfg.get("data")
        has_option = isinstance(data, DictConfig) and "tokenizer" in data
        if tokenizer is not None and has_option and "data.tokenizer" not in given:
            cfg.data.tokenizer = str(tokenizer)
        ours = [o for o in overrides if o.lstrip("+~").split(".")[0].split("=")[0] in RUN_GROUPS]
        for item in ours:
            key, _, value = item.lstrip("+").partition("=")
            OmegaConf.update(cfg, key, yaml.safe_load(value) if value else None, force_add=True)
    # The run folder is data: build nothing from it but megalab's classes (safe_config).
    for key in RUN_GROUPS:
        node = cfg.get(key)
        if isinstance(node, DictConfig):
            check_targets(node, f"{run_cfg_path} ({key})")
    off = data_settings_from_command_line(cfg, overrides)
    if off:
        log.info("data is not generated or downloaded (%s=false): ask on the command line "
                 "to change it", ", ".join(off))  # fmt: skip
    return cfg


def check_run_vocabulary(cfg: DictConfig, datamodule: Any, command: str) -> None:
    """Refuse data whose vocabulary is not the one the checkpoint's run trained with (a run
    folder without a copy, or `use_run_config=false`: nothing to check)."""
    run_dir = find_run_dir(checkpoint_file(cfg))
    if run_dir is not None and cfg.get("use_run_config", True):
        check_vocabulary(datamodule, run_dir, command)


def require_language_model(cfg: DictConfig, command: str) -> None:
    """Fail before the data or the weights are read when the run's task is not language
    modelling (`command` names what needs one in the message)."""
    from megalab.tasks.language_modeling import LanguageModelingTask

    target = OmegaConf.select(cfg, "task._target_")
    task_class = megalab_object(target) if isinstance(target, str) else None
    if isinstance(task_class, type) and issubclass(task_class, LanguageModelingTask):
        return
    name = task_class.__name__ if isinstance(task_class, type) else f"task {target!r}"
    raise ValueError(
        f"{name} is not a language model: {command} needs a run trained with task=language_modeling"
    )


def load_task(
    cfg: DictConfig, device: torch.device, dtype: torch.dtype, command: str = "megalab-generate"
) -> LanguageModelingTask:
    """The run's task with the checkpoint's weights (checksum verified, `weights_only=True`)."""
    require_language_model(cfg, command)
    ckpt_path = Path(cfg.ckpt_path)
    if not ckpt_path.is_file():
        raise FileNotFoundError(
            f"checkpoint not found: {ckpt_path} (pass ckpt_path=<run>/checkpoints/last.ckpt)"
        )
    # Verified before torch.load reads it: a damaged file fails naming it (ckpt_verify=false: a
    # file without a readable checksum is read unverified; a mismatch is refused all the same).
    checkpoint = read_checkpoint(ckpt_path, verify=cfg.get("ckpt_verify", True))
    task = hydra.utils.instantiate(cfg.task)
    if "state_dict" not in checkpoint:
        raise ValueError(f"{ckpt_path}: no state_dict (not a megalab/Lightning checkpoint)")
    task.load_state_dict(checkpoint["state_dict"], strict=True)
    return task.to(device=device, dtype=dtype).eval()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _weights_of(source: str, verify: bool) -> dict[str, torch.Tensor]:
    """The task weights in `source`: a megalab run's checkpoint, or an export folder / Hub id."""
    from megalab.pretrained import export_weights
    from megalab.utils.checkpointing import check_lightning_checkpoint

    path = Path(source).expanduser()
    hub_id = not path.exists() and source.count("/") == 1 and path.suffix != ".ckpt"
    if (path / "config.json").is_file() or hub_id:
        return export_weights(source)  # an export folder, or a Hub id
    refuse_folder(path, "init_from")  # a run folder: name its checkpoints
    if not path.is_file():
        raise FileNotFoundError(
            f"init_from={source}: no such checkpoint file or export folder (give "
            "<run>/checkpoints/last.ckpt or best-*.ckpt, or a folder megalab-export wrote)"
        )
    checkpoint = read_checkpoint(path, verify=verify)
    check_lightning_checkpoint(checkpoint, path)
    return checkpoint["state_dict"]


def weights_vocabulary(source: str) -> dict[str, Path]:
    """The vocabulary the weights of `init_from=source` were trained with: the run folder's
    copy for a checkpoint, the export's tokenizer files for an export folder (none known for a
    Hub id before it is fetched, or for a run without a copy)."""
    from megalab.pretrained import TOKENIZER_DIR

    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        folder = path / TOKENIZER_DIR
        return {p.name: p for p in sorted(folder.glob("*")) if p.is_file()}
    run_dir = find_run_dir(path) if path.is_file() else None
    return run_vocabulary(run_dir) if run_dir is not None else {}


def init_weights(
    task: torch.nn.Module, source: str, skip: list[str] | None = None, verify: bool = True
) -> str:
    """Load the weights of `source` into `task`, except those `skip` names (they keep their
    initialisation): a module (`head`: its weights), a weight, or a pattern with `*`
    (`backbone.layers.*.ffn`). Return what was done, in a line.

    Raise `CheckpointMismatchError` naming the weights that are missing, extra or of another
    shape, and how to keep them fresh instead.
    """
    from fnmatch import fnmatchcase

    from megalab.tasks.base import CheckpointMismatchError, plain_name, weights_mismatch

    def names(name: str, entry: str) -> bool:
        return fnmatchcase(name, entry) or fnmatchcase(name, f"{entry}.*")

    def skipped(name: str) -> bool:
        return any(names(name, entry) for entry in skip or [])

    # Checkpoints of a compiled run written before they were saved by plain names.
    saved = {plain_name(k): v for k, v in _weights_of(source, verify).items()}
    own = task.state_dict()
    unknown = [e for e in skip or [] if not any(names(k, e) for k in [*own, *saved])]
    if unknown:
        modules = sorted({k.split(".")[0] for k in own})
        raise ValueError(
            f"init_skip: {', '.join(map(repr, unknown))} names no weight of this model or of "
            f"init_from (its modules: {', '.join(modules)}; deeper names as in "
            "task.state_dict(), with * for any part)"
        )
    taken = {k: v for k, v in saved.items() if not skipped(k)}
    wanted = {k: v for k, v in own.items() if not skipped(k)}
    differ = weights_mismatch(wanted, taken)
    if differ:
        raise CheckpointMismatchError(
            f"init_from={source}: its weights do not fit the model this config builds "
            f"({differ}). Give the model options of the run that wrote them, or keep the weights "
            "that differ fresh with init_skip (their modules or names, such as init_skip=[head] "
            "for a new classifier head)"
        )
    task.load_state_dict(taken, strict=False)
    fresh = len(own) - len(wanted)
    kept = f"; {fresh} kept fresh by init_skip" if fresh else ""
    return f"init_from: {len(taken)} weights from {source}{kept}"
