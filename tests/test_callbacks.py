"""megalab.callbacks: Lightning's callbacks adjusted to the framework's defaults."""

from __future__ import annotations

import lightning as L
import pytest

from megalab.callbacks import RichProgressBar


@pytest.mark.parametrize(
    ("limits", "expected"),
    [({"max_steps": 10}, "Epoch 3"), ({"max_epochs": 5}, "Epoch 3/4")],
    ids=["step-based", "epoch-based"],
)
def test_progress_bar_epoch_description(limits: dict, expected: str) -> None:
    bar = RichProgressBar()
    trainer = L.Trainer(
        callbacks=[bar], logger=False, enable_checkpointing=False, accelerator="cpu", **limits
    )
    bar.setup(trainer, L.LightningModule(), stage="fit")
    assert bar._get_train_description(3).strip() == expected
