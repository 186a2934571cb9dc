"""Callbacks that make Lightning's defaults fit every logger setting."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor as _LearningRateMonitor


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
