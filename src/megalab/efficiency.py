"""Training efficiency as the papers measure it: the `eff/*` numbers of every run.

`EfficiencyMonitor` (on by default, `callbacks/efficiency_monitor.yaml`) follows SeqBoat App.
A.6: the training time is the average wall time of an optimizer step over the run, the speed its
inverse, and the memory the average of each step's peak. Per step it measures

- the wall time of the step's forward, backward and optimizer work over all its micro-batches
  (from the start of the first micro-batch to the end of the last: data loading between steps,
  validation and checkpointing are not counted), synchronised on CUDA;
- the peak memory: on CUDA `torch.cuda.max_memory_allocated`, reset at the start of the step; on
  CPU the resident set's high-water mark (`VmHWM`), reset at the start of the step through
  `/proc/self/clear_refs` (Linux; elsewhere the process's high-water mark so far);
- the real tokens (`mask` sums; all positions without a mask) of every micro-batch;

and over evaluation batches (validation during training, test; not the sanity check) the tokens
per second of inference. The first `warmup_steps` steps (allocator growth, compilation) are left
out of the averages. At the end of training the averages go into `metrics.json["metrics"]`:

    eff/train_step_s        mean seconds per optimizer step
    eff/train_tokens_per_s  tokens of the measured steps / their time (all processes)
    eff/peak_mem_mb         mean per-step peak memory, MB (per process)
    eff/peak_mem_max_mb     largest per-step peak memory, MB
    eff/eval_tokens_per_s   tokens of the evaluation batches / their time (all processes)
    eff/mfu                 model FLOPs utilisation, where the device's peak is known (Lightning's
                            `get_available_flops`: CUDA GPUs), with the FLOPs per token counted
                            on the first step (`torch.utils.flop_counter`; FFTs count zero)

`megalab-tables` shows these numbers under every table it renders, with the papers' relative
Speed / Mem. columns as ratios between runs (`megalab.reporting.efficiency`).
"""

from __future__ import annotations

import logging
import math
import resource
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT

log = logging.getLogger(__name__)

KEYS = (
    "eff/train_step_s",
    "eff/train_tokens_per_s",
    "eff/peak_mem_mb",
    "eff/eval_tokens_per_s",
)
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def count_tokens(batch: Any) -> int | None:
    """Real tokens of a batch: the sums of `mask`/`mask2`, else all positions of the inputs."""
    if not isinstance(batch, Mapping) or "inputs" not in batch:
        return None
    total = 0
    for inputs, mask in (("inputs", "mask"), ("inputs2", "mask2")):
        if inputs not in batch:
            continue
        m = batch.get(mask)
        x = batch[inputs]
        total += int(m.sum()) if isinstance(m, torch.Tensor) else int(x.shape[0] * x.shape[1])
    return total


def _rss_peak_bytes() -> int:
    """The process's resident-set high-water mark (VmHWM) in bytes."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0); False where that is not possible."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class EfficiencyMonitor(Callback):
    """Per-step wall time, peak memory and tokens/s, averaged over the run (SeqBoat App. A.6).

    Args:
        warmup_steps: optimizer steps left out of the averages (allocator growth, compilation).
            When a run has no more steps than this, all its steps are averaged.
        log_every_step: also log each step's `train/step_s`, `train/peak_mem_mb` and
            `train/step_tokens_per_s` to the loggers.
        count_flops: count the FLOPs of the first step for `eff/mfu` (on devices whose peak
            FLOP/s Lightning knows; the counting slows that one step down).
    """

    def __init__(
        self, warmup_steps: int = 1, log_every_step: bool = True, count_flops: bool = True
    ) -> None:
        super().__init__()
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.log_every_step = log_every_step
        self.count_flops = count_flops
        self.steps: list[dict[str, float]] = []  # every finished optimizer step, warm-up too
        self.eval_time = 0.0
        self.eval_tokens = 0
        self.flops_per_token: float | None = None
        self.peak_flops: float | None = None
        self._open: dict[str, float] | None = None  # the optimizer step in progress
        self._t0 = 0.0
        self._eval_t0: float | None = None
        self._counter: Any = None
        self._device = torch.device("cpu")
        self._world = 1
        self._fitting = True  # `setup`'s stage: state is restored only when fitting

    # -- timing helpers ----------------------------------------------------------------------
    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def _reset_peak(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        else:
            _reset_rss_peak()

    def _peak_mb(self) -> float:
        if self._device.type == "cuda":
            return torch.cuda.max_memory_allocated(self._device) / 2**20
        return _rss_peak_bytes() / 2**20

    # -- training ----------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before a resumed run restores this callback's state (`load_state_dict`).
        self._fitting = stage == "fit"
        if stage == "fit":
            self.steps, self._open = [], None
            self.eval_time, self.eval_tokens = 0.0, 0
            self.flops_per_token = None

    def _attach(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The device whose memory is measured and the number of processes (token rates)."""
        self._device = pl_module.device
        self._world = trainer.world_size

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._attach(trainer, pl_module)
        if self.count_flops and self._device.type == "cuda":
            from lightning.fabric.utilities.throughput import get_available_flops

            dtype = next(pl_module.parameters()).dtype
            if "bf16" in str(trainer.precision):
                dtype = torch.bfloat16
            elif "16" in str(trainer.precision):
                dtype = torch.float16
            self.peak_flops = get_available_flops(self._device, dtype)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._open is None:
            self._open = {"time": 0.0, "tokens": 0.0, "global_step": trainer.global_step}
            self._reset_peak()
            if self.peak_flops and self.flops_per_token is None and not self.steps:
                from torch.utils.flop_counter import FlopCounterMode

                self._counter = FlopCounterMode(display=False)
                self._counter.__enter__()
        self._t0 = self._now()

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._open is None:
            return
        step = self._open
        step["time"] += self._now() - self._t0
        step["tokens"] += count_tokens(batch) or 0
        if trainer.global_step == step["global_step"]:
            return  # accumulating: the optimizer step is not done yet
        step["peak_mb"] = self._peak_mb()
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            flops = self._counter.get_total_flops()
            self._counter = None
            if step["tokens"] > 0 and flops > 0:
                self.flops_per_token = flops / step["tokens"]
        self.steps.append(step)
        self._open = None
        if self.log_every_step and step["time"] > 0:
            values = {"train/step_s": step["time"], "train/peak_mem_mb": step["peak_mb"]}
            if step["tokens"]:
                values["train/step_tokens_per_s"] = step["tokens"] * self._world / step["time"]
            pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)

    # -- evaluation --------------------------------------------------------------------------
    def on_validation_batch_start(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Start timing an evaluation batch (validation or test; not the sanity check)."""
        self._eval_t0 = None if trainer.sanity_checking else self._now()

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Add the batch's time and tokens to the evaluation totals."""
        if self._eval_t0 is None:
            return
        self.eval_time += self._now() - self._eval_t0
        self.eval_tokens += count_tokens(batch) or 0
        self._eval_t0 = None

    # Test batches are timed as validation batches are.
    on_test_batch_start = on_validation_batch_start
    on_test_batch_end = on_validation_batch_end

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._attach(trainer, pl_module)

    # -- summary -----------------------------------------------------------------------------
    def summary(self) -> dict[str, float]:
        """The run's averages under the `eff/*` keys (empty before any step)."""
        out: dict[str, float] = {}
        measured = self.steps[self.warmup_steps :] or self.steps
        if measured:
            time_s = sum(s["time"] for s in measured)
            tokens = sum(s["tokens"] for s in measured)
            out["eff/train_step_s"] = time_s / len(measured)
            out["eff/peak_mem_mb"] = statistics.fmean(s["peak_mb"] for s in measured)
            out["eff/peak_mem_max_mb"] = max(s["peak_mb"] for s in measured)
            if tokens and time_s > 0:
                out["eff/train_tokens_per_s"] = tokens * self._world / time_s
                if self.flops_per_token and self.peak_flops:
                    out["eff/mfu"] = tokens / time_s * self.flops_per_token / self.peak_flops
        if self.eval_tokens and self.eval_time > 0:
            out["eff/eval_tokens_per_s"] = self.eval_tokens * self._world / self.eval_time
        return {k: float(v) for k, v in out.items() if math.isfinite(v)}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "eval_time": self.eval_time,
                "eval_tokens": self.eval_tokens}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A resumed run averages over all its steps, before and after the interruption. A test
        # from a checkpoint (the run's best, or another run's) keeps this run's own numbers:
        # the file holds the steps up to when it was saved.
        if not self._fitting:
            return
        self.steps = list(state_dict.get("steps", []))
        self.eval_time = float(state_dict.get("eval_time", 0.0))
        self.eval_tokens = int(state_dict.get("eval_tokens", 0))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        summary = self.summary()
        if summary:
            log.info(
                "efficiency: %s",
                ", ".join(f"{k.removeprefix('eff/')} {v:,.4g}" for k, v in summary.items()),
            )


def efficiency_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The `eff/*` averages of the trainer's `EfficiencyMonitor`, if it has one."""
    # `Trainer.callbacks` is a property set up by its callback connector (not in the stubs).
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, EfficiencyMonitor):
            return callback.summary()
    return {}
