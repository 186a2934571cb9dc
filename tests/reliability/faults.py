"""Fault injection for the reliability suite: a callback that kills or signals its own process
at a chosen phase and step, and checkpoint writes that die half-way.

Used through Hydra overrides (`+callbacks.fault._target_=faults.Fault +callbacks.fault.phase=...`)
with `tests/reliability` on PYTHONPATH, so the product code carries no test hooks.
"""

from __future__ import annotations

import csv
import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch

PHASES = ("step", "checkpoint", "checkpoint_partial", "validation", "epoch_end", "test")
# Measurements of time and memory (the efficiency monitor's): they differ between any two runs.
TIMING = {"train/tokens_per_sec", "train/step_s", "train/step_tokens_per_s", "train/peak_mem_mb"}


def _measured(key: str) -> bool:
    return key in TIMING or key.startswith("eff/")


def csv_rows(run: Path) -> list[dict[str, str]]:
    """The rows of a run's `csv/metrics.csv` (timing columns and empty cells aside)."""
    with open(run / "csv" / "metrics.csv", newline="") as f:
        rows = csv.DictReader(f)
        return [{k: v for k, v in r.items() if not _measured(k) and v} for r in rows]


def _assert_equal(got: Any, want: Any, where: str) -> None:
    """Nested checkpoint entries equal, tensors bit for bit."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            _assert_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_equal(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def assert_same_run(run: Path, straight: Path) -> None:
    """Same final weights, optimizer state, `metrics.json` (timing aside) and CSV rows as the
    straight run."""
    a = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"]
    for name, value in a["state_dict"].items():
        assert torch.equal(b["state_dict"][name], value), name
    _assert_equal(b["optimizer_states"], a["optimizer_states"], "optimizer_states")
    _assert_equal(b["lr_schedulers"], a["lr_schedulers"], "lr_schedulers")
    ma = json.loads((straight / "metrics.json").read_text())["metrics"]
    mb = json.loads((run / "metrics.json").read_text())["metrics"]
    assert {k: v for k, v in ma.items() if not _measured(k)} == {
        k: v for k, v in mb.items() if not _measured(k)
    }
    assert csv_rows(run) == csv_rows(straight)


class Fault(L.Callback):
    """At `phase` (once `trainer.global_step >= step`), deliver `how` to this process.

    `how`: "kill" (SIGKILL: nothing runs after it), "term" (SIGTERM), "int" (SIGINT) or "usr1"
    (SIGUSR1: the requeue signal of a SLURM job); `rank`: only that process (default: all).
    Phases: `step` (after an optimizer step), `validation` (mid-validation batch), `epoch_end`
    (in the epoch-end hooks), `test` (a test batch), `checkpoint` (after the temporary file of
    a checkpoint is complete, before its rename), `checkpoint_partial` (half-way through the
    bytes of a checkpoint).
    """

    def __init__(self, phase: str, step: int = 1, how: str = "kill", rank: int | None = None):
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
        self.phase, self.step, self.how, self.rank = phase, step, how, rank
        self.done = False

    def _fire(self) -> None:
        if self.done:
            return
        self.done = True
        sig = {
            "kill": signal.SIGKILL,
            "term": signal.SIGTERM,
            "int": signal.SIGINT,
            "usr1": signal.SIGUSR1,
        }[self.how]
        os.kill(os.getpid(), sig)

    def _due(self, trainer: L.Trainer) -> bool:
        # Every process of a distributed run dies at the same point (a node failure), except
        # in a checkpoint write, which only rank 0 does, and where `rank` names the one process.
        if self.phase.startswith("checkpoint") and not trainer.is_global_zero:
            return False
        if self.rank is not None and trainer.global_rank != self.rank:
            return False
        return trainer.global_step >= self.step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.phase.startswith("checkpoint"):
            self._patch_checkpoint_writes(trainer)

    def _patch_checkpoint_writes(self, trainer: L.Trainer) -> None:
        from megalab.utils.checkpointing import files

        fault = self
        if self.phase == "checkpoint":
            original_fsync = os.fsync

            def fsync(fd: int) -> None:
                original_fsync(fd)
                name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else ""
                if name.endswith(files.TEMP_SUFFIX) and fault._due(trainer):
                    fault._fire()

            files.os.fsync = fsync  # type: ignore[attr-defined]
        else:
            original_write = files._HashingWriter.write

            def write(self: Any, data: Any) -> int:
                n = original_write(self, data)
                if self.size > 2048 and fault._due(trainer):
                    fault._fire()
                return n

            files._HashingWriter.write = write  # type: ignore[method-assign]

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.phase == "step" and self._due(trainer):
            self._fire()

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.phase == "validation" and not trainer.sanity_checking and self._due(trainer):
            self._fire()

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.phase == "epoch_end" and self._due(trainer):
            self._fire()

    def on_test_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.phase == "test":
            self._fire()
