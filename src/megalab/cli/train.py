"""Train a model: `megalab-train experiment=mega/lra_listops` (or `python -m megalab.cli.train`).

Instantiates data -> task (encoder, backbone, head) -> callbacks -> loggers -> trainer from the
Hydra config, fits (resuming from `ckpt_path`), tests the best checkpoint, and writes the
resolved `config.yaml` and a `metrics.json` of final numbers into the run directory. Returns
the monitored metric so Hydra sweepers can optimise it.
"""

from __future__ import annotations

from megalab.utils.runtime import configure_runtime, log_settings

# Allocator and OpenMP settings must precede the first import of torch (docs/benchmarks.md).
configure_runtime()

import logging  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import hydra  # noqa: E402
import lightning as L  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from megalab.config_schema import group_choice  # noqa: E402
from megalab.config_schema import validate as validate_config  # noqa: E402
from megalab.data.base import SequenceDataModule  # noqa: E402
from megalab.data.vocabulary import SaveVocabulary  # noqa: E402
from megalab.efficiency import efficiency_metrics  # noqa: E402
from megalab.memory import plan_run, shared_with_launched_processes  # noqa: E402
from megalab.parallel.lightning import find_unused_data_dependent_parameters  # noqa: E402
from megalab.run_loading import init_weights, weights_vocabulary  # noqa: E402
from megalab.tasks.base import TaskBase  # noqa: E402
from megalab.utils import errors  # noqa: E402
from megalab.utils import run as run_utils  # noqa: E402
from megalab.utils.checkpointing import (  # noqa: E402
    LastCheckpoint,
    RunInterrupted,
    set_verification,
)
from megalab.utils.locking import unlock_run_folder  # noqa: E402
from megalab.utils.paths import CONFIG_DIR, export_project_root  # noqa: E402
from megalab.utils.run_folder import (  # noqa: E402
    remember_wandb_run,
    resolve_ckpt_path,
    resume_command,
    schedule_record,
    start_run,
)
from megalab.utils.safe_config import upgrade_backbone_targets  # noqa: E402

log = logging.getLogger(__name__)

export_project_root()


def build(cfg: DictConfig, resume: bool = False) -> dict[str, Any]:
    """Instantiate everything a run needs; nothing is trained. The memory plan may raise
    `trainer.accumulate_grad_batches` (a resumed run keeps its own), or fail early; a run that
    only tests (`train=false`) has no training step to plan."""
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    task = hydra.utils.instantiate(cfg.task)
    memory_plan = None
    if cfg.get("train", True):
        memory_plan = plan_run(cfg, task, cfg.paths.output_dir, resume=resume)
    callbacks = run_utils.instantiate_callbacks(cfg.get("callbacks"))
    if cfg.get("train", True):  # whatever the callbacks group holds: the run's token ids
        source = None if resume else cfg.get("init_from")
        vocabulary = weights_vocabulary(str(source)) if source else {}
        callbacks.append(SaveVocabulary(cfg.paths.output_dir, source, vocabulary))
    loggers = run_utils.instantiate_loggers(cfg.get("logger"))
    trainer = run_utils.instantiate_trainer(
        cfg.trainer, callbacks=callbacks, logger=loggers or False
    )
    check = getattr(trainer.strategy, "check", None)  # chunk parallelism: before processes start
    if callable(check):
        check(task, datamodule)
    find_unused_data_dependent_parameters(trainer.strategy, task)
    return {
        "datamodule": datamodule,
        "task": task,
        "trainer": trainer,
        "loggers": loggers,
        "memory_plan": memory_plan,
    }


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit and test; return the final metrics record written to `metrics.json`.

    A W&B run opened here is always closed, so the next run in the same process (a multirun
    job, a test) starts its own.
    """
    try:
        return _train(cfg)
    except RunInterrupted as err:
        err.message += f"\nResume it with:\n  {resume_command(cfg)}"
        raise
    finally:
        run_utils.finish_wandb()
        unlock_run_folder(cfg.paths.output_dir)


def _note_settings_of_no_schedule(cfg: DictConfig) -> None:
    """Say that `scheduler=none` leaves unused what the experiment set for its schedule."""
    scheduler = cfg.get("scheduler")
    if isinstance(scheduler, DictConfig) and "_target_" not in scheduler and len(scheduler):
        log.info(
            "scheduler=none: the learning rate stays the optimizer's; the experiment's "
            "scheduler settings (%s) are not used",
            ", ".join(f"{k!s}={v}" for k, v in scheduler.items()),
        )


def _warn_without_last_checkpoint(trainer: L.Trainer) -> None:
    """Warn before training a run that keeps no `last.ckpt`: choosing one file of the
    `callbacks` group (`callbacks=early_stopping`) replaces the whole default list."""
    if any(isinstance(c, LastCheckpoint) for c in trainer.callbacks):  # type: ignore[attr-defined]
        return
    choice = group_choice("callbacks")
    log.warning(
        "this run writes no last.ckpt%s: it cannot be resumed, and a signal or a time limit "
        "ends it without saving. Keep the default callbacks and change one with its keys "
        "(callbacks.early_stopping.patience=10), or drop one with callbacks.<name>=null",
        f" (callbacks={choice} replaces the default callbacks)" if choice else "",
    )


def _start_from_weights(cfg: DictConfig, task: L.LightningModule, resumed: str | None) -> None:
    """Load `init_from`'s weights into a run that starts afresh. A resumed run (a requeued
    fine-tuning job, `ckpt_path=auto`) takes its weights from its own checkpoint instead."""
    source = cfg.get("init_from")
    if not source:
        return
    if resumed or (not cfg.get("train", True) and cfg.get("ckpt_path")):
        log.info("init_from is not used: the weights come from %s", resumed or cfg.ckpt_path)
        return
    skip = list(cfg.get("init_skip") or [])
    log.info(init_weights(task, str(source), skip, verify=cfg.get("ckpt_verify", True)))


def _train(cfg: DictConfig) -> dict[str, Any]:
    output_dir = Path(cfg.paths.output_dir)
    upgrade_backbone_targets(cfg)  # a config from before backbones took their config
    validate_config(cfg)
    _note_settings_of_no_schedule(cfg)
    ckpt_path = start_run(cfg, output_dir)  # lock the folder, what to resume, the W&B run
    run_utils.save_config(cfg, output_dir / "config.yaml")
    objs = build(cfg, resume=ckpt_path is not None)
    datamodule, task, trainer = objs["datamodule"], objs["task"], objs["trainer"]
    set_verification(trainer, cfg.get("ckpt_verify", True))
    if cfg.get("train", True):
        _warn_without_last_checkpoint(trainer)
    _start_from_weights(cfg, task, ckpt_path)
    run_utils.log_hyperparameters(cfg, objs["loggers"], task)
    remember_wandb_run(objs["loggers"], output_dir)
    params = run_utils.count_parameters(task)
    log.info(
        "model: %s parameters (%s trainable)", f"{params['total']:,}", f"{params['trainable']:,}"
    )

    start = time.time()
    fit_metrics: dict[str, Any] = {}
    if cfg.get("train", True):
        untrue: tuple[str, ...] = ()
        if ckpt_path:
            log.info("resuming from %s", ckpt_path)
            untrue = (run_utils.RESUMED_FOLDER_NOT_EMPTY,)
            if isinstance(datamodule, SequenceDataModule):
                untrue += (run_utils.MID_EPOCH_LOADER_NOT_RESUMABLE,)
        with (
            shared_with_launched_processes(objs["memory_plan"]),  # DDP ranks: the same plan
            run_utils.untrue_warnings_silenced(*untrue),
            run_utils.launched_processes_stopped_on_user_error(trainer),
        ):
            trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path)
        fit_metrics = {k: run_utils.to_number(v) for k, v in trainer.callback_metrics.items()}

    test_metrics: dict[str, Any] = {}
    # Recorded with or without a test: `megalab.cli.eval_runs` tests a run's best checkpoint.
    best_path = getattr(trainer.checkpoint_callback, "best_model_path", "") or None
    if cfg.get("test", True):
        if best_path is None and not cfg.get("train", True) and cfg.get("ckpt_path"):
            # Test only: the given checkpoint, with this config's overrides (e.g. a longer
            # evaluation memory, LaMemo's Fig. 5).
            best_path = resolve_ckpt_path(cfg.get("ckpt_path"), output_dir)
        if best_path is None:
            log.warning(
                "no best checkpoint (%s): testing the final weights", _why_no_best(cfg, trainer)
            )
        with (
            run_utils.untrue_warnings_silenced(run_utils.CALLBACKS_NOT_RESTORED),
            run_utils.launched_processes_stopped_on_user_error(trainer),
        ):
            results = trainer.test(task, datamodule=datamodule, ckpt_path=best_path)
        test_metrics = {
            k: run_utils.to_number(v) for k, v in (results[0] if results else {}).items()
        }

    monitor = cfg.get("monitor")
    record = {
        "experiment": cfg.get("experiment_name"),
        "task_name": cfg.get("task_name"),
        "tags": list(cfg.get("tags") or []),
        "seed": cfg.get("seed"),
        "monitor": monitor,
        "monitor_value": fit_metrics.get(monitor) if monitor else None,
        "best_checkpoint": best_path,
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        **schedule_record(trainer),
        "params": params,
        "wall_time_s": round(time.time() - start, 3),
        "metrics": {**fit_metrics, **test_metrics},
        "memory_plan": objs["memory_plan"],
        "output_dir": str(output_dir),
    }
    if not cfg.get("train", True) and isinstance(task, TaskBase):
        # A test of a checkpoint: the steps of the weights it tested; whether their training
        # finished its schedule is the record of the run that wrote them.
        steps = task.checkpoint_step
        record.update(stop_reason="test_only", finished=None)
        record["global_step"] = steps if steps is not None else trainer.global_step
    record["metrics"].update(efficiency_metrics(trainer))
    best = getattr(trainer.checkpoint_callback, "best_model_score", None)
    if best is not None and monitor:
        record["monitor_value"] = run_utils.to_number(best)
    if isinstance(task, TaskBase):  # e.g. the SacreBLEU signature (seq2seq)
        record.update(task.record_extras())
    run_utils.write_metrics(output_dir / "metrics.json", record)
    return record


def _why_no_best(cfg: DictConfig, trainer: L.Trainer) -> str:
    """Why a run that ends has no best checkpoint to test, in the user's settings."""
    if not cfg.get("train", True):
        return "train=false and no ckpt_path"
    if trainer.checkpoint_callback is None:
        return "the run has no checkpoint callback"
    monitor = cfg.get("monitor")
    if monitor and monitor in trainer.callback_metrics:
        return f"validation ran, but no checkpoint was kept for {monitor} (was it NaN?)"
    settings = cfg.trainer
    if settings.get("limit_val_batches") == 0:
        return "validation is off: trainer.limit_val_batches=0"
    interval = settings.get("val_check_interval")
    if isinstance(interval, int):
        every = f"every {interval} training batches (trainer.val_check_interval)"
    elif isinstance(interval, float):
        every = f"every {interval:g} of an epoch (trainer.val_check_interval)"
    else:
        n = settings.get("check_val_every_n_epoch") or 1
        every = f"after every {n} epoch(s) (trainer.check_val_every_n_epoch)"
    return f"no validation in the run's {trainer.global_step} steps: it runs {every}"


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def hydra_main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the monitored metric for sweepers."""
    run_utils.log_from_rank_zero()
    log_settings()
    with errors.reported(), run_utils.processes_launched_per_job():
        record = train(cfg)
    value = record.get("monitor_value")
    log.info("metrics written to %s", Path(cfg.paths.output_dir) / "metrics.json")
    for report in sorted(Path(cfg.paths.output_dir).glob(f"*-{run_utils.PROFILE}*.txt")):
        log.info("profiler report written to %s", report)
    run_utils.print_numbers(record["metrics"], "test/")
    return float(value) if value is not None else None


def main() -> None:
    """`megalab-train`: the Hydra entry point, with the closest keys after a misspelled one."""
    errors.run_entry_point(hydra_main, "train")


if __name__ == "__main__":
    main()
