"""The checkpoint callbacks: `LastCheckpoint` (`last.ckpt` on a schedule and on interruption,
with the epoch accumulations Lightning does not save) and `BestCheckpoint` (relocatable best
checkpoints).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint, Timer

from megalab.utils.checkpointing.files import remove_stale_temporaries
from megalab.utils.errors import Interrupted

log = logging.getLogger(__name__)


class RunInterrupted(Interrupted):
    """Training stopped on a signal after saving `last.ckpt`; `code` is the exit status."""


# -- what Lightning does not save: epoch accumulations of logged training values ----------------
_REDUCTIONS = {torch.mean: "mean", torch.max: "max", torch.min: "min", torch.sum: "sum"}


def snapshot_train_results(trainer: L.Trainer) -> list[dict[str, Any]]:
    """The training epoch's logged values being accumulated (Lightning keeps them in memory)."""
    results = trainer.fit_loop.epoch_loop._results
    out = []
    for key, metric in results.items():
        meta = metric.meta
        if not meta.on_epoch:
            continue
        entry: dict[str, Any] = {
            "key": key,
            "fx": meta.fx,
            "name": meta.name,
            "prog_bar": meta.prog_bar,
            "logger": meta.logger,
            "on_step": meta.on_step,
            "on_epoch": meta.on_epoch,
            "reduce_fx": _REDUCTIONS.get(meta.reduce_fx, "mean"),
            "enable_graph": meta.enable_graph,
            "add_dataloader_idx": meta.add_dataloader_idx,
            "metric_attribute": meta.metric_attribute,
            "sync_dist": bool(meta.sync.should),
            "rank_zero_only": bool(meta.sync.rank_zero_only),
            "is_tensor": bool(metric.is_tensor),
        }
        if metric.is_tensor:
            entry["value"] = metric.value.detach().clone().cpu()
            if meta.is_mean_reduction:
                entry["cumulated_batch_size"] = metric.cumulated_batch_size.detach().clone().cpu()
        out.append(entry)
    return out


def restore_train_results(trainer: L.Trainer, saved: list[dict[str, Any]]) -> None:
    """Re-register the saved accumulations, so the epoch-level values cover the whole epoch."""
    results = trainer.fit_loop.epoch_loop._results
    module = trainer.lightning_module
    attributes = dict(module.named_modules())
    if saved:
        # Lightning zeroes the plain-tensor accumulations of each hook at the first value that
        # hook logs in an epoch (`_first_loop_iter` True, `LightningModule.log`): a resumed epoch
        # looks like a new one, so the values restored here would be dropped (the torchmetrics
        # objects are spared, which is why classification kept its epoch metrics). Marking the
        # first batch as already under way keeps them; a new epoch resets as before.
        trainer._logger_connector._first_loop_iter = True
    for entry in saved:
        if entry["key"] in results:
            continue
        if entry["is_tensor"]:
            value: Any = entry["value"].to(module.device)
        else:
            value = attributes.get(entry["metric_attribute"] or "")
            if value is None:
                continue
        results.log(
            entry["fx"],
            entry["name"],
            value,
            prog_bar=entry["prog_bar"],
            logger=entry["logger"],
            on_step=entry["on_step"],
            on_epoch=entry["on_epoch"],
            reduce_fx=entry["reduce_fx"],
            enable_graph=entry["enable_graph"],
            sync_dist=entry["sync_dist"],
            sync_dist_fn=trainer.strategy.reduce,
            add_dataloader_idx=entry["add_dataloader_idx"],
            batch_size=1,
            metric_attribute=entry["metric_attribute"],
            rank_zero_only=entry["rank_zero_only"],
        )
        metric = results[entry["key"]]
        metric._forward_cache = None  # nothing of this was logged in the current step
        if entry["is_tensor"]:
            metric.value = entry["value"].to(metric.value.device, metric.value.dtype)
            if "cumulated_batch_size" in entry:
                metric.cumulated_batch_size = entry["cumulated_batch_size"].to(
                    metric.cumulated_batch_size.device
                )


# -- a finished run trained on: its closed epoch ---------------------------------------------
def close_finished_epoch(checkpoint: dict[str, Any]) -> bool:
    """Clear the batch counts a finished run's final checkpoint keeps of its last epoch;
    return whether there were any (the loops then start the next epoch afresh:
    `start_next_epoch`).

    When `max_steps` ends training, Lightning runs the epoch's end hooks (its epoch row, the
    metric resets) and counts the epoch done; the final `last.ckpt` is written after that, with
    the batches that epoch ran. Resumed with a larger `max_steps` (to train longer), Lightning
    takes them for the progress of the next epoch, as training is step-based: the data loader
    would skip as many batches, and after an epoch's last batch the next epoch would be empty
    and log NaN.
    """
    # Lightning internal (3 of 7, hence the `lightning<2.7` bound in pyproject.toml): the loops'
    # progress counters in a checkpoint and their restart flags (tests/test_lightning_internals.py).
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    epochs = loop.get("epoch_progress", {}).get("current", {})
    batches = loop.get("epoch_loop.batch_progress", {})
    counts = batches.get("current", {})
    if not counts.get("ready") or epochs.get("completed") != epochs.get("ready"):
        return False  # inside an epoch or at its end hooks: Lightning resumes those
    for key in counts:
        counts[key] = 0
    batches["is_last_batch"] = False
    return True


def start_next_epoch(trainer: L.Trainer) -> None:
    """Run the loops of a run resumed from a closed epoch (`close_finished_epoch`) as an
    uninterrupted run enters its next epoch, not as a restart inside one (which would count a
    logging step twice)."""
    fit = trainer.fit_loop
    fit._restarting = False
    fit.epoch_loop.restarting = False  # and its validation loop
    fit.epoch_loop.reset_restart_stage()


# -- signals -----------------------------------------------------------------------------------
def _requeue_slurm_job() -> None:
    """Requeue this SLURM job (as Lightning's auto-requeue does)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job_id = os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job_id):
        raise ValueError(f"unexpected SLURM job id {job_id!r}")
    result = subprocess.call(["scontrol", "requeue", job_id])
    if result == 0:
        log.info("requeued SLURM job %s", job_id)
    else:
        log.warning("requeueing SLURM job %s failed (scontrol exit status %d)", job_id, result)


def _max_over_ranks(trainer: L.Trainer, values: list[int]) -> list[int]:
    """Element-wise maximum of `values` over all processes (one small all-reduce when
    distributed): of flags, whether any process has it; of signal numbers, one that arrived."""
    if trainer.world_size <= 1 or not torch.distributed.is_initialized():
        return values
    device = trainer.strategy.root_device
    if torch.distributed.get_backend() == "gloo":
        device = torch.device("cpu")
    t = torch.tensor(values, dtype=torch.int32, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def time_limit_reached(trainer: L.Trainer) -> bool:
    """Whether `trainer.max_time` is spent (Lightning's Timer, present only when it is set)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by the connector
        if isinstance(callback, Timer):
            remaining = callback.time_remaining()
            if remaining is not None and remaining <= 0:
                return True
    return False


# -- last.ckpt ------------------------------------------------------------------------------------
class LastCheckpoint(Checkpoint):
    """Write `<dirpath>/last.ckpt` on a schedule, at the end of training and on interruption.

    `every_n_train_steps` and `every_n_minutes` (either may be null) set the schedule; the clock
    is rank 0's. A save is written at the end of the training batch, or, when that step's
    validation is due, at the end of the validation: the points Lightning's loops resume
    exactly from (a checkpoint written before a due validation would skip it on resume).

    On SIGINT or SIGTERM (all processes stop at the same step) it saves at the next such point,
    prints how to resume and raises `RunInterrupted` (exit status 128 + signal). A second signal
    stops at once without saving. In a SLURM job with Lightning's auto-requeue, the requeue
    signal (SIGUSR1 unless configured) saves the same way and requeues the job.

    When `trainer.max_time` is spent, it saves at the step the Timer stopped (after the optimizer
    step of a gradient accumulation the time ran out in; the training then ends, and tests, as
    Lightning's Timer has it) and not again at the end of training: the fit loop marks a stopped
    epoch finished, and a resume from there would skip the epoch's rest.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        filename: str = "last.ckpt",
        every_n_train_steps: int | None = None,
        every_n_minutes: float | None = 5.0,
        save_on_signal: bool = True,
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1 or null, got {every_n_train_steps}")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"every_n_minutes must be > 0 or null, got {every_n_minutes}")
        self.dirpath = Path(dirpath)
        self.filename = filename
        self.every_n_train_steps = every_n_train_steps
        self.every_n_minutes = every_n_minutes
        self.save_on_signal = save_on_signal
        self._last_save_time = time.monotonic()
        self._last_saved_step = -1
        self._pending = False
        self._signal: int | None = None
        self._signal_elsewhere: int | None = None  # received by another process of the run
        self._previous_handlers: dict[int, Any] = {}
        self._resume_state: dict[str, Any] | None = None
        self._saved_results: list[dict[str, Any]] = []
        self._where: str | None = None
        self._closed_epoch = False
        self._out_of_time = False

    @property
    def path(self) -> Path:
        return self.dirpath / self.filename

    @property
    def state_key(self) -> str:
        return "LastCheckpoint"

    # -- state ---------------------------------------------------------------------------------
    # Besides the epoch accumulations, a checkpoint records where the loggers stand: the rows
    # of each file logger, the latest metrics (what `metrics.json` reports when the resumed
    # run has nothing left to train), and the step metrics of the saved batch, which Lightning
    # logs only after the batch-end hooks (they are logged when the run resumes).
    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "_trainer", None)
        if trainer is None or trainer.state.fn != "fit":
            return {}
        loop = trainer.fit_loop.epoch_loop
        where = self._where
        if where is None:  # another callback's checkpoint (the best one, after validation)
            progress = loop.batch_progress.total
            where = (
                "batch_end" if progress.completed == progress.processed - 1 else "validation_end"
            )
        step = loop._batches_that_stepped
        pending: dict[str, float] | None = None
        if where == "batch_end":
            connector = trainer._logger_connector
            if connector.should_update_logs and trainer.loggers:
                pending = {
                    k: float(v) for k, v in connector.metrics["log"].items() if v.numel() == 1
                }
        rows = {}
        for i, logger in enumerate(trainer.loggers):
            if callable(getattr(logger, "row_count", None)):
                rows[str(i)] = logger.row_count()
        return {
            "train_results": snapshot_train_results(trainer),
            "saved_step": trainer.global_step,
            "callback_metrics": {
                k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1
            },
            "pending_log": pending,
            "pending_log_step": step,
            "pending_log_epoch": trainer.current_epoch,
            "logger_rows": rows,
        }

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Before Lightning restores its loops from the checkpoint and makes the data iterator.
        self._closed_epoch = close_finished_epoch(checkpoint)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_state = dict(state_dict)
        self._last_saved_step = int(state_dict.get("saved_step", -1))

    def _continue_logs(self, trainer: L.Trainer) -> None:
        """Put the loggers and Lightning's logging step where the checkpoint left them."""
        state, self._resume_state = self._resume_state, None
        if state is None:
            if trainer.ckpt_path is None:  # a fresh run: its files start empty
                for logger in trainer.loggers:
                    if callable(getattr(logger, "truncate", None)):
                        cast(Any, logger).truncate(0)  # duck-typed, checked above
            return
        self._saved_results = state.get("train_results") or []
        metrics = state.get("callback_metrics") or {}
        connector = trainer._logger_connector
        for key, value in metrics.items():  # what metrics.json reports if no step follows
            connector._callback_metrics.setdefault(key, torch.tensor(value))
        rows = state.get("logger_rows") or {}
        for i, logger in enumerate(trainer.loggers):
            if str(i) in rows and callable(getattr(logger, "truncate", None)):
                cast(Any, logger).truncate(int(rows[str(i)]))  # duck-typed, checked above
        pending = state.get("pending_log")
        if pending:
            metrics = {**pending, "epoch": state.get("pending_log_epoch", trainer.current_epoch)}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=int(state["pending_log_step"]))
                logger.save()

    # -- set-up --------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage == "fit" and trainer.is_global_zero:
            remove_stale_temporaries(self.dirpath)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install_handlers(trainer)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After the checkpoint was restored, before anything is logged (even when the resumed
        # run has nothing left to train and goes straight to its test).
        self._continue_logs(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install_handlers(trainer)
        self._last_save_time = time.monotonic()
        if self._closed_epoch:
            start_next_epoch(trainer)
        self._closed_epoch = False
        if self._saved_results:
            restore_train_results(trainer, self._saved_results)
        self._saved_results = []

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handlers()

    # -- signals -----------------------------------------------------------------------------------
    def _signals(self, trainer: L.Trainer) -> list[int]:
        signals: list[int] = [signal.SIGINT, signal.SIGTERM]
        env = trainer._accelerator_connector.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal:
            signals.append(int(env.requeue_signal))
        return signals

    def _install_handlers(self, trainer: L.Trainer) -> None:
        import threading

        if not self.save_on_signal or self._previous_handlers:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        # Lightning's own SIGTERM handler (installed before this hook) makes the loops exit
        # with status 0 at the next batch, before anything is saved: it is replaced here and
        # put back at teardown.
        for signum in self._signals(trainer):
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            # Only where ours is still installed: Lightning's teardown, which runs before this
            # callback's, has put its own original back already, and restoring the handler it
            # had replaced (Lightning's, holding its trainer, model and data) would keep every
            # finished run of the process alive, each one's handler holding the one before.
            if signal.getsignal(signum) != self._on_signal:
                continue
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal is not None:
            # A second signal: stop now, without waiting for the next safe point.
            self._restore_handlers()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signal = signum
        name = signal.Signals(signum).name
        log.warning(
            "%s received: saving %s after the current step, then stopping (send it again to "
            "stop at once without saving)",
            name,
            self.path,
        )

    # -- schedule ------------------------------------------------------------------------------
    def _decide(self, trainer: L.Trainer) -> tuple[bool, bool]:
        """(save now?, stop after saving?) for the step that just finished, on every rank."""
        step = trainer.global_step
        by_steps = self.every_n_train_steps is not None and step % self.every_n_train_steps == 0
        clock_due = (
            self.every_n_minutes is not None
            and trainer.is_global_zero
            and time.monotonic() - self._last_save_time >= 60.0 * self.every_n_minutes
        )
        # Lightning's Timer (before this callback: checkpoints run last) has set should_stop.
        time_up = trainer.should_stop and time_limit_reached(trainer)
        signum, by_time, out_of_time = _max_over_ranks(
            trainer, [self._signal or 0, int(clock_due), int(time_up)]
        )
        signalled = self._signalled_anywhere(signum)
        ran_out = bool(out_of_time) and not self._out_of_time  # once (min_steps may go on)
        self._out_of_time = self._out_of_time or bool(out_of_time)
        return by_steps or bool(by_time) or signalled or self._pending or ran_out, signalled

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        # Trainer sets fast_dev_run in its debugging-flag setup; its class does not declare it.
        if trainer.fast_dev_run:  # type: ignore[attr-defined]  # a debugging run: no checkpoints
            return
        if trainer.fit_loop.epoch_loop._should_accumulate():
            if trainer.should_stop:
                self._finish_accumulation(trainer)
            return  # mid-accumulation: the optimizer has not stepped
        due, stop = self._decide(trainer)
        if not due:
            return
        if self._validation_due(trainer):
            self._pending = True  # saved at the end of this step's validation
            return
        if trainer.fit_loop.epoch_loop._num_ready_batches_reached():
            # The epoch's last batch, before its epoch-end hooks and metrics: a resume from
            # here would start the next epoch without them (other data order, no epoch row).
            # Saved after the next step instead (or at the end of training).
            self._pending = True
            return
        self._save(trainer, stop, "batch_end")

    @staticmethod
    def _finish_accumulation(trainer: L.Trainer) -> None:
        """Lightning's Timer stops the loop after any batch, inside a gradient accumulation too,
        where no save resumes exactly (the micro-batches taken would be skipped). Let the
        accumulation finish: the Timer stops the loop again after the optimizer step, which is
        saved."""
        (spent,) = _max_over_ranks(trainer, [int(time_limit_reached(trainer))])
        if spent:
            trainer.should_stop = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking or trainer.fast_dev_run:  # type: ignore[attr-defined]
            return
        # A signal during validation is acted on once the validation is complete.
        (signum,) = _max_over_ranks(trainer, [self._signal or 0])
        signalled = self._signalled_anywhere(signum)
        if self._pending or signalled:
            self._save(trainer, signalled, "validation_end")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The final state, after the last epoch-end hooks: evaluating last.ckpt evaluates the
        # trained model, and resuming a finished run goes straight to its test.
        if trainer.fast_dev_run:  # type: ignore[attr-defined]
            return
        spent = trainer.should_stop and time_limit_reached(trainer)  # the Timer stopped it
        (out_of_time,) = _max_over_ranks(trainer, [int(spent)])  # every process alike
        if out_of_time and self._last_saved_step == trainer.global_step:
            return  # saved where the time ran out (or a resume found it spent): exact from there
        self._save(trainer, False, "train_end")

    @staticmethod
    def _validation_due(trainer: L.Trainer) -> bool:
        loop = trainer.fit_loop.epoch_loop
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is None or not trainer.enable_validation:
            return False
        return bool(loop._should_check_val_fx(fetcher))

    # -- saving --------------------------------------------------------------------------------
    def _save(self, trainer: L.Trainer, stop: bool, where: str) -> None:
        self._pending = False
        for logger in trainer.loggers:  # rows up to this step are on disk with the checkpoint
            logger.save()
        self._where = where
        try:
            trainer.save_checkpoint(self.path, weights_only=False)  # the resumable kind
        finally:
            self._where = None
        self._last_saved_step = trainer.global_step
        self._last_save_time = time.monotonic()
        if trainer.is_global_zero:
            log.info("saved %s at step %d", self.path, trainer.global_step)
        if stop:
            self._stop(trainer)

    def _signalled_anywhere(self, signum: int) -> bool:
        """Whether a process of the run got a signal (`signum`, the largest number of those
        that arrived); this one takes it as its own, so every process stops on the signal a
        process received (a kill of rank zero alone: SIGINT everywhere, not SIGTERM)."""
        if signum and self._signal is None:
            self._signal_elsewhere = signum
        return bool(signum)

    def _stop(self, trainer: L.Trainer) -> None:
        signum = self._signal or self._signal_elsewhere or signal.SIGTERM
        name = signal.Signals(signum).name
        # The requeue signal (handled beside SIGINT and SIGTERM only where SLURM requeues),
        # whichever process it reached.
        if signum not in (signal.SIGINT, signal.SIGTERM) and trainer.is_global_zero:
            _requeue_slurm_job()
        message = (
            f"{name} received: training stopped at step {trainer.global_step}; {self.path} holds it"
        )
        self._restore_handlers()
        raise RunInterrupted(message, 128 + int(signum))


class BestCheckpoint(ModelCheckpoint):
    """Lightning's `ModelCheckpoint` for the best checkpoint(s) of a run, made relocatable.

    A run folder copied or moved elsewhere resumes with its best-so-far record: the paths the
    checkpoint recorded are rebased onto the new folder (Lightning would drop the record, and
    then write a second best file beside the first). `enable_version_counter` is off, so no
    `-v1` copies appear next to a file of the same name.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(*args, **kwargs)
        self._fitting = True

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._fitting = stage == "fit"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._fitting:
            # A test (`train=false ckpt_path=<another run's checkpoint>`) reads the weights; the
            # best-so-far record serves training only, and this run's folder never held it.
            return
        old = state_dict.get("dirpath")
        other_run = None
        if old and self.dirpath and old != self.dirpath:
            state_dict, moved = _rebase_paths(state_dict, str(old), str(self.dirpath))
            if moved:
                log.info(
                    "the run folder moved from %s to %s: best-checkpoint paths rebased",
                    old,
                    self.dirpath,
                )
            else:
                other_run = str(old)
        super().load_state_dict(state_dict)
        self._confine_paths(other_run)

    def _confine_paths(self, other_run: str | None = None) -> None:
        """Forget recorded paths outside this run's checkpoint folder: a checkpoint is data, and
        the top-k bookkeeping deletes the files it records (megalab.utils.safe_config).

        `other_run`: the checkpoint folder of another run the checkpoint comes from (training
        continued in a new folder); its best checkpoints stay there, and this run's best is
        chosen among its own validations from here on.
        """
        if not self.dirpath:
            return
        root = Path(self.dirpath).resolve()

        def inside(path: Any, folder: Path = root) -> bool:
            return isinstance(path, str) and folder in Path(path).resolve().parents

        outside = [p for p in self.best_k_models if not inside(p)]
        for path in outside:
            del self.best_k_models[path]
        named = [getattr(self, a) for a in ("best_model_path", "kth_best_model_path")]
        forgotten = list(dict.fromkeys(str(p) for p in [*outside, *named] if p and not inside(p)))
        if not forgotten:
            return
        if other_run is not None and all(inside(p, Path(other_run).resolve()) for p in forgotten):
            log.info(
                "continuing from a checkpoint of %s: its best checkpoints stay there, untouched; "
                "this run's best checkpoint is chosen among its own validations",
                Path(other_run).parent,
            )
        else:
            log.warning(
                "the checkpoint records files outside %s (%s): forgotten, never deleted",
                root,
                ", ".join(forgotten),
            )
        if self.last_model_path and not inside(self.last_model_path):
            self.last_model_path = ""
        best, kth = (min, max) if self.mode == "min" else (max, min)
        if self.best_k_models:
            scores = self.best_k_models
            self.best_model_path = best(scores, key=lambda path: float(scores[path]))
            self.kth_best_model_path = kth(scores, key=lambda path: float(scores[path]))
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        else:
            self.best_model_path = self.kth_best_model_path = ""


def _rebase_paths(state: dict[str, Any], old: str, new: str) -> tuple[dict[str, Any], bool]:
    """The recorded checkpoint paths under `old` moved to `new` (files that exist there), and
    whether any did (a moved run folder; else the checkpoint comes from another run's)."""
    rebased = False

    def move(path: Any) -> Any:
        nonlocal rebased
        if not isinstance(path, str) or not path.startswith(old.rstrip("/") + "/"):
            return path
        moved = str(Path(new) / Path(path).relative_to(old))
        if not Path(moved).exists():
            return path
        rebased = True
        return moved

    out = dict(state)
    for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
        if key in out:
            out[key] = move(out[key])
    if isinstance(out.get("best_k_models"), dict):
        out["best_k_models"] = {move(k): v for k, v in out["best_k_models"].items()}
    out["dirpath"] = new
    return out, rebased
