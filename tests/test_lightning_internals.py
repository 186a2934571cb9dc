"""The Lightning internals megalab relies on, checked against the installed Lightning.

`pyproject.toml` bounds Lightning below the next minor version; before raising the bound, these
tests must pass with the new version:

1. `RichProgressBar._get_train_description` (overridden in `megalab.callbacks`) still titles
   the training bar, so step-based runs read `Epoch 3`, not `Epoch 3/-2`.
2. `trainer.fit_loop.epoch_loop.restarting` and `.batch_progress.current.processed` (read by
   `SequenceDataModule.resumed_batches`) still say, on a mid-epoch resume, that the loop is
   restarting and how many batches of the epoch were done.
3. A checkpoint saved after `max_steps` ended training holds the closed epoch's batch counts
   under `loops.fit_loop` (cleared by `close_finished_epoch`), and the fit loop's `_restarting`,
   the epoch loop's `restarting` and `reset_restart_stage` still let a resumed run enter its
   next epoch afresh (`start_next_epoch`).
4. `_SubprocessScriptLauncher.procs` (emptied by `launched_processes_stopped_on_user_error`
   after it kills the processes on bad input) is the list Lightning's child-process observer
   watches, so the observer ends instead of killing the launching process before it prints.
5. The launcher starts the other processes with `sys.argv` and `HydraConfig.get().run.dir`
   (`_hydra_subprocess_cmd`), which `processes_launched_per_job` sets to one multirun job's,
   and leaves `LOCAL_RANK` and the rest in the launching process's environment, which it
   clears after the job: checked end to end by
   `tests/test_train.py::test_multirun_with_a_trainer_that_starts_processes_runs_each_job_once`.
6. Lightning's message for a `val_check_interval` longer than an epoch, which
   `megalab.utils.errors` recognises and turns into one message naming the settings.
7. `WandbLogger._wandb_init`, the keyword arguments Lightning gives `wandb.init`, from which
   `megalab.loggers.WandbLogger` drops the `anonymous=None` W&B warns of.
"""

from __future__ import annotations

import re
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version
from torch.utils.data import DataLoader, TensorDataset

from megalab.callbacks import RichProgressBar
from megalab.utils.checkpointing.callbacks import close_finished_epoch, start_next_epoch

ROOT = Path(__file__).resolve().parents[1]


class TinyRegression(L.LightningModule):
    """One linear layer on a fixed dataset of 10 batches."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(20, 2, generator=gen), torch.randn(20, 1)), 2)


class ProbedLoader(DataLoader):
    """Records, when an epoch's iteration starts (where megalab's ResumableDataLoader asks),
    what the fit loop reports: (restarting, batches of the epoch processed)."""

    def __init__(self) -> None:
        base = _loader()
        super().__init__(base.dataset, batch_size=base.batch_size)
        self.trainer: L.Trainer | None = None
        self.seen: list[tuple[bool, int]] = []

    def __iter__(self):
        assert self.trainer is not None
        loop = self.trainer.fit_loop.epoch_loop
        self.seen.append((bool(loop.restarting), int(loop.batch_progress.current.processed)))
        return super().__iter__()


def _quiet_trainer(tmp_path: Path, **settings: Any) -> L.Trainer:
    """A CPU trainer with no logger, progress bar or model summary, and `settings`."""
    return L.Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
        **settings,
    )


def _probed_fit(
    tmp_path: Path, max_steps: int, callbacks: list[Any], ckpt_path: Path | None = None
) -> tuple[L.Trainer, ProbedLoader]:
    """A quiet CPU fit of `TinyRegression` on a `ProbedLoader` (checkpointing only by a
    `ModelCheckpoint` among `callbacks`)."""
    loader = ProbedLoader()
    checkpointing = any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks)
    trainer = _quiet_trainer(
        tmp_path, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=checkpointing
    )
    loader.trainer = trainer
    trainer.fit(TinyRegression(), loader, ckpt_path=ckpt_path)
    return trainer, loader


def _fit(tmp_path: Path, max_steps: int, ckpt_path: Path | None = None) -> list[tuple[bool, int]]:
    callbacks = [
        L.pytorch.callbacks.ModelCheckpoint(
            dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, save_last=False
        )
    ]
    _, loader = _probed_fit(tmp_path, max_steps, [] if ckpt_path else callbacks, ckpt_path)
    return loader.seen


def test_installed_lightning_is_within_the_bound_these_tests_checked() -> None:
    (line,) = re.findall(
        r'^\s*"(lightning[<>=!~,. 0-9]*)",', (ROOT / "pyproject.toml").read_text(), re.M
    )
    spec = Requirement(line)
    assert any(s.operator == "<" for s in spec.specifier), "Lightning needs an upper bound"
    assert Version(metadata.version("lightning")) in spec.specifier


def test_rich_progress_bar_title_is_built_by_the_overridden_method(tmp_path: Path) -> None:
    bar = RichProgressBar()
    titles: list[str] = []

    class Probe(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            assert bar.progress is not None, "Lightning's RichProgressBar has no `progress`"
            task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
            titles.append(str(task.description).strip())

    assert "_get_train_description" in vars(L.pytorch.callbacks.RichProgressBar), (
        "Lightning renamed RichProgressBar._get_train_description: update megalab.callbacks"
    )
    trainer = L.Trainer(
        max_steps=3,
        callbacks=[bar, Probe()],
        logger=False,
        enable_checkpointing=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    trainer.fit(TinyRegression(), _loader())
    assert titles and set(titles) == {"Epoch 0"}, titles


# This plain loader and checkpoint callback are not what megalab resumes with: Lightning says so.
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
def test_fit_loop_reports_a_mid_epoch_resume(tmp_path: Path) -> None:
    assert _fit(tmp_path, max_steps=3) == [(False, 0)], "a fresh fit is not restarting"
    (path,) = tmp_path.glob("*step=3.ckpt")
    assert _fit(tmp_path / "resumed", max_steps=5, ckpt_path=path) == [(True, 3)], (
        "on a mid-epoch resume Lightning must report restarting=True and the 3 batches done: "
        "SequenceDataModule.resumed_batches reads these"
    )


class NextEpochAfresh(L.Callback):
    """What `LastCheckpoint` does for a checkpoint of a finished run."""

    def __init__(self) -> None:
        self.closed = False

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: Any) -> None:
        self.closed = close_finished_epoch(checkpoint)

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.closed:
            start_next_epoch(trainer)


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_finished_run_resumed_for_longer_runs_its_next_epoch_in_full(tmp_path: Path) -> None:
    def fit(max_steps: int, ckpt_path: Path | None = None) -> tuple[L.Trainer, ProbedLoader]:
        return _probed_fit(tmp_path, max_steps, [NextEpochAfresh()], ckpt_path)

    first, _ = fit(3)  # 3 of the epoch's 10 batches, then the epoch is closed
    path = tmp_path / "last.ckpt"
    first.save_checkpoint(path)  # where LastCheckpoint saves at the end of training
    loop = torch.load(path, weights_only=False)["loops"]["fit_loop"]
    epochs = loop["epoch_progress"]["current"]
    assert epochs["completed"] == epochs["ready"] == 1, "max_steps no longer closes the epoch"
    assert loop["epoch_loop.batch_progress"]["current"]["ready"] == 3, (
        "the closed epoch's batch counts moved: update close_finished_epoch"
    )
    longer, loader = fit(13, ckpt_path=path)
    # The iterator is made before on_train_start, while the loop still says it restarts.
    assert [done for _, done in loader.seen] == [0], "the next epoch must skip no batch"
    assert longer.current_epoch == 2 and longer.global_step == 13
    assert longer.fit_loop.epoch_loop.batch_progress.current.processed == 10


def test_launched_processes_stopped_on_user_error_leave_the_launcher_alive() -> None:
    """On bad input the processes Lightning launched are killed, and Lightning's observer of
    them (which kills the launching process when a child dies) lets the launcher live to
    print its message. Here the observer watches a stand-in for the launching process."""
    import subprocess as sp
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )

    from megalab.utils.errors import UserError
    from megalab.utils.run import launched_processes_stopped_on_user_error

    launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    child = sp.Popen(["sleep", "60"])
    launching = sp.Popen(["sleep", "60"])  # what the observer kills when a child dies
    launcher.procs.append(child)
    _ChildProcessObserver(launching.pid, launcher.procs, sleep_period=0.05).start()
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=launcher))
    try:
        with pytest.raises(UserError), launched_processes_stopped_on_user_error(trainer):
            raise UserError("dataset missing")
        assert child.poll() is not None  # killed
        time.sleep(0.5)  # ten rounds of the observer
        assert launching.poll() is None, "the observer killed the launching process"
    finally:
        for process in (child, launching):
            process.kill()
            process.wait()


def test_a_validation_interval_longer_than_an_epoch_becomes_one_message(tmp_path: Path) -> None:
    from megalab.utils.errors import ValidationIntervalError, actionable

    trainer = _quiet_trainer(
        tmp_path, max_steps=30, val_check_interval=15, enable_checkpointing=False
    )
    with pytest.raises(ValueError) as raised:
        trainer.fit(TinyRegression(), _loader())  # 10 batches an epoch
    found = actionable(raised.value)
    assert isinstance(found, ValidationIntervalError), raised.value
    assert str(found).startswith(
        "trainer.val_check_interval=15 is more than the 10 training batches of an epoch"
    )
    assert "trainer.check_val_every_n_epoch=null" in str(found)


def test_the_wandb_logger_hands_wandb_init_no_anonymous_setting(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger

    from megalab.loggers import WandbLogger

    theirs = LightningWandbLogger(save_dir=str(tmp_path), offline=True)
    assert "anonymous" in theirs._wandb_init and theirs._wandb_init["anonymous"] is None
    ours = WandbLogger(save_dir=str(tmp_path), offline=True, project="p")
    assert "anonymous" not in ours._wandb_init
    assert ours._wandb_init["project"] == "p" and ours._wandb_init["dir"] == str(tmp_path)
    assert "anonymous" in WandbLogger(save_dir=str(tmp_path), anonymous=True)._wandb_init
