"""Callbacks that make Lightning's defaults fit every logger setting."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor as _LearningRateMonitor
from lightning.pytorch.callbacks import RichProgressBar as _RichProgressBar

from megalab.efficiency import EfficiencyMonitor

__all__ = ["EfficiencyMonitor", "LearningRateMonitor", "RichProgressBar"]


class LearningRateMonitor(_LearningRateMonitor):
    """Lightning's LR monitor that stays silent when the run has no logger (`logger=none`)."""

    def on_train_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._enabled = bool(trainer.loggers)
        if self._enabled:
            super().on_train_start(trainer, *args, **kwargs)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if getattr(self, "_enabled", False):
            super().on_train_batch_start(trainer, *args, **kwargs)

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if getattr(self, "_enabled", False):
            super().on_train_epoch_start(trainer, *args, **kwargs)


class RichProgressBar(_RichProgressBar):
    """Lightning's rich progress bar, with step-based runs' epochs shown as `Epoch 3`.

    Without `max_epochs` (every paper configuration counts steps) Lightning sets it to -1 and
    the stock bar shows `Epoch 3/-2`.
    """

    # Lightning internal (1 of 7, hence the `lightning<2.7` bound in pyproject.toml): overrides
    # the private RichProgressBar._get_train_description. tests/test_lightning_internals.py
    # fails when Lightning renames it or stops building the bar's title with it.
    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:
            description = description.replace(
                f"Epoch {current_epoch}/{max_epochs - 1}", f"Epoch {current_epoch}"
            )
        return description
