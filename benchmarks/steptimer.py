"""A Lightning callback that records the wall time of every optimizer step into a JSON file.

Stand-alone (no megalab import), so `bench_e2e.py` can time any commit of megalab the same way:
`+callbacks.steptimer._target_=steptimer.StepTimer +callbacks.steptimer.path=<file>` with this
folder on PYTHONPATH. A step is timed from the end of the previous optimizer step to the end of
this one (data loading included, the first batch's start for the first step), as a user sees
steps per second; validation is turned off in the benchmark runs.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class StepTimer(Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.times: list[float] = []
        self._last: float | None = None
        self._step = -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._step:  # an optimizer step ended with this batch
            now = time.perf_counter()
            self.times.append(now - self._last)
            self._last, self._step = now, trainer.global_step
            self.path.write_text(
                json.dumps(
                    {
                        "step_s": self.times,
                        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    }
                )
            )
