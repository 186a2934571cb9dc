"""Run plumbing shared by the entry points: building callbacks and loggers from config,
writing the run's `config.yaml` and `metrics.json` (checkpoints: `megalab.utils.run_folder`)."""

from __future__ import annotations

import copy
import datetime
import json
import logging
import math
import os
import signal
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import hydra
import lightning as L
import torch
from lightning import Callback
from lightning.pytorch.callbacks import Checkpoint, ProgressBar
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from megalab.utils.distributed import is_rank_zero
from megalab.utils.paths import CONFIG_DIR

log = logging.getLogger(__name__)


def instantiate_group(cfg: DictConfig | None) -> list[Any]:
    """Instantiate every entry of a dict-of-objects group (callbacks, loggers); skip nulls."""
    objects: list[Any] = []
    if not cfg:
        return objects
    if not isinstance(cfg, DictConfig):
        raise TypeError(f"expected a mapping of objects, got {type(cfg).__name__}")
    for name, node in cfg.items():
        if isinstance(node, DictConfig) and "_target_" in node:
            objects.append(hydra.utils.instantiate(node))
        elif node is not None:
            raise ValueError(f"config entry {name!r} has no `_target_`: {node}")
    return objects


def instantiate_callbacks(cfg: DictConfig | None) -> list[Callback]:
    return instantiate_group(cfg)


def instantiate_loggers(cfg: DictConfig | None) -> list[Logger]:
    return instantiate_group(cfg)


# Lightning warnings that are untrue of megalab's runs (each the start of the message, a regular
# expression), and why:
RESUMED_FOLDER_NOT_EMPTY = r"Checkpoint directory .* exists and is not empty"
"""A resumed run's checkpoint folder holds its own checkpoints: `start_run` refuses to start a
fresh run over an earlier one."""
MID_EPOCH_LOADER_NOT_RESUMABLE = r"You're resuming from a checkpoint that ended before the epoch"
"""`SequenceDataModule`'s training loaders skip the batches a resumed epoch already took
(`resumed_batches`), so a run resumed mid-epoch sees the data of the uninterrupted run."""
CALLBACKS_NOT_RESTORED = r"Be aware that when using `ckpt_path`, callbacks used to create"
"""A test restores the weights; the callbacks' states (best score, early stopping) only serve
training."""


@contextmanager
def untrue_warnings_silenced(*messages: str) -> Iterator[None]:
    """Silence the Lightning warnings `messages` (the constants above) inside the block, so that
    what a run prints is true of it; every other warning still shows."""
    with warnings.catch_warnings():
        for message in messages:
            warnings.filterwarnings("ignore", message=message)
        yield


# What Lightning prints on every run that says nothing about the run, and why it is dropped:
LIGHTNING_TIP = "💡 Tip:"
"""Lightning's suggestions to install its cloud services (litlogger, litmodels): a megalab run
logs through the loggers its config names."""
LIGHTNING_LEAFSPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
"""A deprecation newer torch raises inside Lightning 2.6's own code
(`lightning.pytorch.utilities._pytree`) on every batch transfer: nothing a user can change."""


LIGHTNING_SYNC_DIST = r"It is recommended to use `self.log\('(train|val|test)/"
"""Under DDP, Lightning suggests `sync_dist=True` for every tensor logged per epoch, once per
name (a SeqBoat run: three per layer). It is advice to the code that logs, and megalab's logging
is settled: validation and test values are already the whole run's (torchmetrics states reduced
over the processes: accuracy, loss, the language models' and translation's sums, BLEU; SacreBLEU
of the gathered translations; the aux values logged with `sync_dist`), and training values
logged step by step (a language model's loss, the aux values) are each process's own, their
epoch means rank zero's, as `docs/cluster.md` says: reducing them would cost a collective per
value and step."""


class _DropPrefix(logging.Filter):
    """Drops the log records whose message starts with `prefix`."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def quiet_lightning() -> None:
    """Drop `LIGHTNING_TIP` messages and the `LIGHTNING_LEAFSPEC` and `LIGHTNING_SYNC_DIST`
    warnings from this process's output; every other message of Lightning still shows."""
    rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropPrefix) for f in rank_zero_log.filters):
        rank_zero_log.addFilter(_DropPrefix(LIGHTNING_TIP))
    warnings.filterwarnings(
        "ignore", message=LIGHTNING_LEAFSPEC, category=FutureWarning, module="lightning"
    )
    warnings.filterwarnings("ignore", message=LIGHTNING_SYNC_DIST)


class _RankZeroOnly(logging.Filter):
    """Passes megalab's records below ERROR only on the process of global rank zero (the entry
    point's own logger is `__main__` when it runs as `python -m megalab.cli.<command>`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name.startswith("megalab") or record.name == "__main__"
        return record.levelno >= logging.ERROR or not ours or is_rank_zero()


def log_from_rank_zero() -> None:
    """Show megalab's info and warnings once per run, from global rank zero.

    Under DDP and FSDP every process runs the same program: each line (the parameter groups,
    the efficiency summary with that process's own numbers, "metrics written", a warning about
    the settings) would print once per process, on the console and in the run's log. The other
    ranks keep their errors, and other libraries' records (Lightning's per-rank "Initializing
    distributed") pass. The rank is read when a record is logged (Lightning sets it from the
    launcher's environment and again when the processes join). Filters the handlers the root
    logger has now (Hydra's console and file); called again, it adds nothing."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _RankZeroOnly) for f in handler.filters):
            handler.addFilter(_RankZeroOnly())


@contextmanager
def launched_processes_stopped_on_user_error(trainer: L.Trainer) -> Iterator[None]:
    """Around `trainer.fit` / `trainer.test`: when this process started the run's other
    processes itself (Lightning's launcher of `trainer=ddp`, `fsdp`, `ddp_cpu`, ... on one
    machine) and stops on an error the user can act on (a dataset missing, found by rank zero
    alone as it prepares the data), stop them too, as Lightning does on Ctrl-C. Each would
    otherwise end in a traceback of its own ("Connection closed by peer") printed after the
    message, which would then be neither last nor alone. Other errors are left as they are."""
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )

    from megalab.utils.errors import actionable

    try:
        yield
    except Exception as err:
        launcher = trainer.strategy.launcher
        if isinstance(launcher, _SubprocessScriptLauncher) and actionable(err) is not None:
            launcher.kill(signal.SIGKILL)  # as Lightning's Ctrl-C path; they wait in a collective
            for process in launcher.procs:
                process.wait()
            # Lightning internal (4 of 7, hence the `lightning<2.7` bound in pyproject.toml):
            # its child-process observer polls this same list every 5 s and kills this process
            # when a child has died; emptied, it ends instead, so the message is shown.
            launcher.procs.clear()
        raise


_HYDRA_VALUE_FLAGS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir")
# What Lightning's launcher sets in the launching process's environment before it starts the
# other processes; left there, the next job of a multirun would take them as started already.
_LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def single_run_argv(argv: list[str], job_overrides: list[str]) -> list[str]:
    """The command line of one job of a Hydra multirun: `argv`'s program and Hydra flags (the
    config path, name and folder), without `-m` and the sweep's overrides, then the job's own
    overrides."""
    out = [argv[0]]
    args = iter(argv[1:])
    for arg in args:
        if arg in ("-m", "--multirun") or not arg.startswith("-"):
            continue  # the multirun flag, or an override: the job's own come last
        out.append(arg)
        if arg in _HYDRA_VALUE_FLAGS:
            value = next(args, None)
            if value is not None:
                out.append(value)
    return [*out, *job_overrides]


@contextmanager
def processes_launched_per_job() -> Iterator[None]:
    """Around one job of a Hydra multirun (`megalab-train -m seed=1,2 trainer=ddp`): the other
    processes a trainer starts (Lightning's launcher on one machine) run this job alone, and
    are gone, with the process group, when it ends.

    Lightning starts them with this process's command line, `-m` included: each ran a sweep of
    its own, in step with this one only while every job had the same processes (a job on one
    process was trained again by the others, into its folder, while this one waited for them
    at the next job's rendezvous), and left a sweep folder of its own. Here the command line
    they get is the job's (`single_run_argv`) and their run folder the job's; after the job
    the next one starts its own. Processes started by a cluster (SLURM, torchrun) are left as
    they are. Outside a multirun, this does nothing."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import read_write

    launcher = "LOCAL_RANK" not in os.environ  # no process of this run was started yet
    if not (launcher and HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
        yield
        return
    root = HydraConfig.instance().cfg
    assert isinstance(root, DictConfig)
    hydra_cfg = root.hydra
    argv, run_dir = list(sys.argv), hydra_cfg.run.dir
    environment = {key: os.environ.get(key) for key in _LAUNCH_ENV}  # a user's MASTER_PORT
    # Lightning internal (5 of 7, hence the `lightning<2.7` bound in pyproject.toml): the
    # launcher builds the other processes' command line from
    # `sys.argv` and `HydraConfig.get().run.dir` (`_hydra_subprocess_cmd`).
    sys.argv = single_run_argv(argv, list(hydra_cfg.overrides.task))
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir
    try:
        yield
    finally:
        sys.argv = argv
        with read_write(hydra_cfg), open_dict(hydra_cfg):
            hydra_cfg.run.dir = run_dir
        if "LOCAL_RANK" in os.environ:  # this job started processes: the next starts its own
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            for key, value in environment.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


# megalab's own keys of the `trainer` group, which `lightning.Trainer` does not take
# (megalab.memory reads them before the trainer is built).
MEGALAB_TRAINER_KEYS = ("max_tokens_per_step", "memory_check")


def check_accelerator(cfg: DictConfig) -> None:
    """Fail early, in one message, when the `trainer` group asks for a GPU that is not there.

    Lightning would only fail later, inside `torch.cuda`, with a bare `AssertionError: Torch not
    compiled with CUDA enabled` (or a device count of 0).
    """
    from megalab.config_schema import ConfigError, group_choice

    accelerator = str(cfg.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "torch with CUDA"
        layout = ""
        choice = group_choice("trainer")
        if choice and (CONFIG_DIR / "trainer" / f"{choice}_cpu.yaml").is_file():
            layout = f", or with trainer={choice}_cpu (trainer={choice}'s layout on CPU processes)"
        raise ConfigError(
            f"trainer.accelerator={accelerator} asks for a CUDA GPU, but no CUDA device is "
            f"visible to this process ({build} {torch.__version__}). Train on the CPU with "
            "trainer=cpu (or trainer=default, which takes a GPU only when there is one)"
            f"{layout}, or run on a machine where torch.cuda.is_available() is true"
        )


def lightning_trainer_config(cfg: DictConfig) -> DictConfig:
    """The `trainer` group without megalab's own keys, as `lightning.Trainer` takes it."""
    out = copy.deepcopy(cfg)
    with open_dict(out):
        for key in MEGALAB_TRAINER_KEYS:
            out.pop(key, None)
    return out


PROFILE = "profile"
"""The name a profiler's report takes in the run folder: `<stage>-profile[-<rank>].txt`."""


def profiler_in_run_folder(name: str, run_dir: str) -> Any:
    """Lightning's `name` profiler writing its report to `<run_dir>/<stage>-profile.txt` (and
    the PyTorch profiler its Chrome traces beside it): given by name, Lightning prints the
    report on the console, hundreds of lines after the run's own output."""
    from lightning.pytorch import profilers

    classes = {
        "simple": profilers.SimpleProfiler,
        "advanced": profilers.AdvancedProfiler,
        "pytorch": profilers.PyTorchProfiler,
    }
    return classes[name](dirpath=run_dir, filename=PROFILE)


def instantiate_trainer(cfg: DictConfig, **kwargs: Any) -> Any:
    """Build the Lightning Trainer of a `trainer` config group; every entry point builds its
    trainer here, so megalab's own keys never reach Lightning. `enable_progress_bar: false`
    drops the progress bar of the `callbacks` group (Lightning refuses the two together).
    Callbacks that keep no checkpoint (`callbacks=none`) make a run that writes none: Lightning
    would add a ModelCheckpoint of its own, below the logger's folder, and test from it."""
    check_accelerator(cfg)
    quiet_lightning()
    if cfg.get("enable_progress_bar") is False and kwargs.get("callbacks"):
        kwargs["callbacks"] = [c for c in kwargs["callbacks"] if not isinstance(c, ProgressBar)]
    callbacks = kwargs.get("callbacks")
    keeps_none = callbacks is not None and not any(isinstance(c, Checkpoint) for c in callbacks)
    if keeps_none and "enable_checkpointing" not in cfg:
        kwargs["enable_checkpointing"] = False
    from megalab.config_schema import PROFILERS

    profiler = cfg.get("profiler")
    if isinstance(profiler, str) and profiler in PROFILERS:
        kwargs["profiler"] = profiler_in_run_folder(profiler, str(cfg.default_root_dir))
    max_time = cfg.get("max_time")
    if isinstance(max_time, DictConfig):  # {hours: 20}: Lightning takes a dict, not a DictConfig
        kwargs["max_time"] = datetime.timedelta(**cast(dict, OmegaConf.to_container(max_time)))
    return hydra.utils.instantiate(lightning_trainer_config(cfg), **kwargs)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a text file so that readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def to_number(value: Any) -> Any:
    """Tensors and numpy scalars -> Python floats (NaN/inf become None for JSON)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@rank_zero_only
def write_metrics(path: str | Path, record: Mapping[str, Any]) -> None:
    """Write `metrics.json` (sorted keys, floats as numbers)."""
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True, default=to_number) + "\n")


@rank_zero_only
def save_config(cfg: DictConfig, path: str | Path) -> None:
    """Save the fully resolved config of a run."""
    atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))


def print_numbers(metrics: Mapping[str, Any], prefix: str = "") -> None:
    """`name = value` of each number in `metrics` whose name starts with `prefix`, what an
    entry point prints last; from global rank zero only, as every DDP/FSDP process ends there."""
    if not is_rank_zero():
        return
    for key, val in sorted(metrics.items()):
        if key.startswith(prefix) and isinstance(val, float):
            print(f"{key} = {val:.4f}")


def count_parameters(module: torch.nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "frozen": total - trainable}


@rank_zero_only
def log_hyperparameters(cfg: DictConfig, loggers: list[Logger], model: torch.nn.Module) -> None:
    """Send the resolved config and parameter counts to every logger."""
    if not loggers:
        return
    params = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    assert isinstance(params, dict)
    params.pop("hydra", None)
    params["params"] = count_parameters(model)
    for logger in loggers:
        logger.log_hyperparams(params)


def finish_wandb() -> None:
    """Close an open W&B run so the next job of a multirun starts clean."""
    try:
        import wandb
    except ImportError:  # pragma: no cover - wandb is a dependency
        return
    if wandb.run is not None:
        wandb.finish()
