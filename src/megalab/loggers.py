"""Loggers whose files survive a resume.

Lightning's `CSVLogger` deletes `metrics.csv` when it finds one (the rows before a resume were
lost). Here the file is kept and appended to; `megalab.utils.checkpointing.LastCheckpoint`
records how many rows the file had at each checkpoint and truncates it back to that count when
the run resumes, so rows the interrupted run wrote after its last checkpoint (which the resumed
run writes again) appear once.

`WandbLogger` is Lightning's, without the `anonymous` setting it always hands `wandb.init`.
"""

from __future__ import annotations

import csv
import os
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger as _CSVLogger
from lightning.pytorch.loggers import WandbLogger as _WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only


class AppendingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer that keeps an existing `metrics.csv` (and its columns)."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                header = next(csv.reader(f), [])
            self.metrics_keys = sorted(set(header))

    def _check_log_dir_exists(self) -> None:
        """Keep what is there (Lightning's writer deletes the previous metrics file)."""

    def row_count(self) -> int:
        """Rows on disk after writing the buffered ones."""
        self.save()
        if not os.path.isfile(self.metrics_file_path):
            return 0
        with open(self.metrics_file_path, newline="") as f:
            return max(0, sum(1 for _ in csv.reader(f)) - 1)

    def truncate(self, rows: int) -> None:
        """Keep the first `rows` rows (drop what was written after a checkpoint)."""
        self.metrics = []
        if not os.path.isfile(self.metrics_file_path):
            return
        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            fields = list(reader.fieldnames or [])
            kept = [r for _, r in zip(range(rows), reader)]
        if rows == 0:
            os.remove(self.metrics_file_path)
            self.metrics_keys = []
            return
        tmp = f"{self.metrics_file_path}.tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.metrics_file_path)
        self.metrics_keys = sorted(set(fields))


class CSVLogger(_CSVLogger):
    """`<save_dir>/<name>/<version>/metrics.csv`, continued (not replaced) when a run resumes."""

    @property
    @rank_zero_experiment
    def experiment(self) -> AppendingExperimentWriter:  # type: ignore[override]
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment  # type: ignore[return-value]

    @rank_zero_only
    def row_count(self) -> int:
        """Rows in `metrics.csv` (recorded with each checkpoint)."""
        return self.experiment.row_count()

    @rank_zero_only
    def truncate(self, rows: int) -> None:
        """Keep the first `rows` rows (a resumed run continues after its checkpoint's rows)."""
        self.experiment.truncate(rows)


class WandbLogger(_WandbLogger):
    """Lightning's W&B logger (same arguments), minus the `anonymous=None` it passes to
    `wandb.init` unasked: W&B deprecated the setting and warned of it on every run, and it will
    refuse the argument once it is removed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Lightning internal (7 of 7, hence the `lightning<2.7` bound in pyproject.toml): the
        # keyword arguments it gives `wandb.init` (tests/test_lightning_internals.py).
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
