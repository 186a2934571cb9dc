"""A run folder holds one run: start it, resume it, never mix two.

`start_run` is what `megalab.train` does before building anything: lock the folder
(`megalab.utils.locking`), resolve `ckpt_path` (`last`, `auto`, a path), refuse to start a fresh
run where an earlier run left its checkpoints or results (it would overwrite them), and point
the W&B logger of a resumed run at the run it logged to before. The W&B run id is recorded in
`<run>/wandb/run_id` when the run starts, so resuming does not depend on guessing it from the
names of W&B's folders.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, open_dict

from megalab.utils.checkpointing import CheckpointError, read_checkpoint, verify_checkpoint
from megalab.utils.checkpointing.callbacks import time_limit_reached
from megalab.utils.distributed import is_rank_zero
from megalab.utils.errors import UserError
from megalab.utils.locking import lock_run_folder

log = logging.getLogger(__name__)

WANDB_ID_FILE = Path("wandb") / "run_id"
_WANDB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_WANDB_DIR = re.compile(r"^(?:offline-)?run-\d{8}_\d{6}-([a-z0-9]+)(?:-\d+)?$")


class RunFolderError(UserError, RuntimeError):
    """The run folder cannot be used as asked (it holds another run, or nothing to resume)."""


def find_run_config(ckpt_path: Path) -> Path | None:
    """The `.hydra/config.yaml` of the run a checkpoint belongs to, if any."""
    for parent in list(ckpt_path.resolve().parents)[:3]:
        candidate = parent / ".hydra" / "config.yaml"
        if candidate.exists():
            return candidate
    return None


def find_run_dir(ckpt_path: Path) -> Path | None:
    """The folder of the run a checkpoint belongs to (the one holding its `.hydra/`), if any."""
    config = find_run_config(ckpt_path)
    return config.parent.parent if config is not None else None


def resolve_ckpt_path(ckpt_path: str | None, output_dir: str | os.PathLike[str]) -> str | None:
    """`last`: this run folder's `checkpoints/last.ckpt` (it must exist); `auto`: the newest of
    the folder's checkpoints a run resumes exactly from (`resumable_checkpoint`), else None (a
    fresh start: what a requeued cluster job wants); a path: that file."""
    if ckpt_path in (None, "", "none", "null"):
        return None
    last = Path(output_dir) / "checkpoints" / "last.ckpt"
    if ckpt_path == "auto":
        found = resumable_checkpoint(output_dir)
        return str(found) if found is not None else None
    if ckpt_path == "last":
        if not last.exists():
            found = resumable_checkpoint(output_dir)
            instead = (
                f" The run can resume exactly from {found}: pass ckpt_path=auto (or "
                f"ckpt_path={found})."
                if found is not None
                else ""
            )
            raise RunFolderError(
                f"ckpt_path=last but {last} does not exist.{instead} To resume a run, start it "
                "again in its own output directory: `hydra.run.dir=<run dir> ckpt_path=last` "
                "(ckpt_path=auto resumes from the newest resumable checkpoint, or starts afresh "
                "when there is none)"
            )
        return str(last)
    refuse_folder(Path(ckpt_path))
    if not Path(ckpt_path).exists():
        raise RunFolderError(f"checkpoint not found: {ckpt_path}")
    return str(ckpt_path)


def refuse_folder(path: Path, key: str = "ckpt_path") -> None:
    """Refuse a folder given as `ckpt_path` (or `key`: a run folder rather than one of its
    checkpoints), naming the checkpoint files below it."""
    if not path.is_dir():
        return
    found = sorted(path.rglob("*.ckpt"))
    listed = ", ".join(str(p) for p in found[:4]) + (", ..." if len(found) > 4 else "")
    raise RunFolderError(
        f"{key}={path} is a folder: give one checkpoint file"
        + (f", e.g. {listed}" if found else " (none below it ends in .ckpt)")
    )


def _peek(path: Path) -> tuple[int, bool] | None:
    """(global step, holds the loop and optimizer state?) of a checkpoint, read lazily
    (memory-mapped, nothing verified yet); None when it is not a readable checkpoint."""
    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    if not isinstance(checkpoint, dict):
        return None
    loops, optimizers = checkpoint.get("loops"), checkpoint.get("optimizer_states")
    return int(checkpoint.get("global_step", -1)), bool(loops) and bool(optimizers)


def resumable_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint of the run folder a run resumes exactly from: one that records the loops'
    progress and the optimizer (a weights-only file does not), passes its checksum, and was
    written at the latest step (`last.ckpt` on a tie). A run killed before its first `last.ckpt`
    (the time-based schedule) resumes from its best checkpoint, written after a validation."""
    folder = Path(output_dir) / "checkpoints"
    if not folder.is_dir():
        return None
    candidates = []
    for path in folder.glob("*.ckpt"):
        peeked = _peek(path)
        if peeked is not None and peeked[1]:
            candidates.append((peeked[0], path.name == "last.ckpt", path))
    for step, _, path in sorted(candidates, reverse=True):
        try:
            verify_checkpoint(path, allow_unverified=False)
        except CheckpointError as err:
            log.warning("ckpt_path=auto: %s cannot be used (%s)", path, err)
            continue
        log.info("ckpt_path=auto: resuming from %s (step %d)", path, step)
        return path
    return None


def set_aside_earlier_run(output_dir: str | os.PathLike[str]) -> Path:
    """Move what an earlier run left in `output_dir` (checkpoints, `metrics.json`, CSV log)
    into `<output_dir>/earlier/<time>/`, so a fresh run starts there without overwriting it."""
    folder = Path(output_dir)
    aside = folder / "earlier" / time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while aside.exists():
        aside = aside.with_name(f"{aside.name.split('.')[0]}.{n}")
        n += 1
    aside.mkdir(parents=True)
    for name in ("checkpoints", "metrics.json", "csv"):
        if (folder / name).exists():
            os.replace(folder / name, aside / name)
    return aside


def earlier_run_outputs(output_dir: str | os.PathLike[str]) -> list[Path]:
    """What a previous run left in `output_dir` that a fresh run would overwrite."""
    folder = Path(output_dir)
    found = (
        sorted((folder / "checkpoints").glob("*.ckpt")) if (folder / "checkpoints").is_dir() else []
    )
    if (folder / "metrics.json").is_file():
        found.append(folder / "metrics.json")
    return found


def checkpoint_step(path: str | os.PathLike[str]) -> int | None:
    """The global step a checkpoint was written at (None when it cannot be read)."""
    try:
        return int(read_checkpoint(path, offer_alternatives=False).get("global_step", -1))
    except Exception:
        return None


def start_run(cfg: DictConfig, output_dir: str | os.PathLike[str]) -> str | None:
    """Lock the run folder, resolve the checkpoint to resume from (returned), refuse to start a
    fresh run over an earlier one, and reuse a resumed run's W&B id."""
    output_dir = Path(output_dir)
    lock_run_folder(output_dir)
    if not cfg.get("train", True):
        return None
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), output_dir)
    if ckpt_path is None:
        earlier = earlier_run_outputs(output_dir)
        if earlier and cfg.get("ckpt_path") == "auto":
            # Nothing there resumes exactly (no checkpoint with the loop state passes its
            # checksum): start over, keeping the earlier files, so a requeued job never loops.
            if is_rank_zero():
                aside = set_aside_earlier_run(output_dir)
                log.warning(
                    "ckpt_path=auto: no checkpoint in %s resumes exactly; the earlier run's "
                    "files were moved to %s and the run starts over",
                    output_dir,
                    aside,
                )
        elif earlier:
            listed = ", ".join(p.name for p in earlier[:4]) + (" ..." if len(earlier) > 4 else "")
            raise RunFolderError(
                f"the run folder {output_dir} holds an earlier run ({listed}); a new run there "
                "would overwrite it. Resume that run with ckpt_path=last (its last.ckpt) or "
                "ckpt_path=auto (the newest checkpoint it resumes exactly from, else a fresh "
                "start with the earlier files kept aside), or start this one in another folder "
                "(a new hydra.run.dir)"
            )
    else:
        reuse_wandb_run(cfg, output_dir)
    return ckpt_path


def reuse_wandb_run(cfg: DictConfig, output_dir: Path) -> None:
    """Log a resumed run to the W&B run it used before (its id from `<run>/wandb/run_id`)."""
    wandb_cfg = (cfg.get("logger") or {}).get("wandb")
    if not wandb_cfg or wandb_cfg.get("id"):
        return
    run_id = None
    id_file = output_dir / WANDB_ID_FILE
    if id_file.is_file():
        run_id = id_file.read_text().strip() or None
    else:  # a run of an earlier megalab version: its newest W&B folder (names start with the time)
        # W&B names them <mode>-<YYYYmmdd_HHMMSS>-<id>[-<n>]: a second run with the same id
        # started within the same second gets the suffix -1, -2, ...
        names = sorted(p.name for p in (output_dir / "wandb").glob("*run-*") if p.is_dir())
        found = [m.group(1) for n in names if (m := _WANDB_DIR.match(n))]
        run_id = found[-1] if found else None
    if run_id and not _WANDB_ID.match(run_id):  # the folder is data: an id, not a config value
        raise RunFolderError(f"{id_file}: {run_id[:40]!r} is not a W&B run id (letters, digits)")
    if run_id:
        with open_dict(cfg):
            cfg.logger.wandb.id = run_id
        log.info("resuming W&B run %s", run_id)


@rank_zero_only
def remember_wandb_run(loggers: list[Any], output_dir: str | os.PathLike[str]) -> None:
    """Record the W&B run id of this run in `<run>/wandb/run_id` (rank 0, once it exists)."""
    from lightning.pytorch.loggers import WandbLogger

    from megalab.utils.run import atomic_write_text

    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            run_id = logger.version
            if run_id:
                atomic_write_text(Path(output_dir) / WANDB_ID_FILE, f"{run_id}\n")


def schedule_record(trainer: Any) -> dict[str, Any]:
    """Whether a run finished its configured schedule (for `metrics.json` and the tables)."""
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    steps_done = max_steps is not None and max_steps >= 0 and trainer.global_step >= max_steps
    epochs_done = max_epochs not in (None, -1) and trainer.current_epoch >= max_epochs
    finished = bool(steps_done or epochs_done)
    if finished:
        reason = "schedule"
    elif time_limit_reached(trainer):
        reason = "time_limit"  # trainer.max_time: Lightning's Timer stopped it
    else:
        reason = "early_stopping" if trainer.should_stop else "other"
    return {
        "max_steps": max_steps,
        "max_epochs": max_epochs,
        "finished": finished,
        "stop_reason": reason,
    }


def resume_command(cfg: DictConfig) -> str:
    """The command that resumes this run: its overrides, its folder, `ckpt_path=last`."""
    overrides: list[str] = []
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except Exception:
        pass
    keep = [
        o
        for o in overrides
        if o.split("=", 1)[0].lstrip("+~") not in ("ckpt_path", "hydra.run.dir")
    ]
    args = [*keep, f"hydra.run.dir={cfg.paths.output_dir}", "ckpt_path=last"]
    return "python -m megalab.cli.train " + " ".join(_quote(a) for a in args)


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
