"""The kill matrix's representative in the default suite: a run killed without warning
(SIGKILL after an optimizer step, in a forked child of the test process) resumes with
`ckpt_path=last` to the weights, `metrics.json` and CSV rows of the uninterrupted run, with
dropout on and the default callbacks. Every phase, signals and DDP: test_kill_matrix.py (slow)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from faults import assert_same_run

from megalab.train import train

OVERRIDES = (
    "trainer.max_steps=6",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.val_check_interval=2",
    "trainer.check_val_every_n_epoch=null",
    "model.d_model=16",
    "model.backbone.num_layers=1",
    "model.backbone.dropout=0.1",  # dropout on: the RNG states matter
    "logger=csv",
    "callbacks.last_checkpoint.every_n_train_steps=2",
)


def test_sigkill_after_a_step_resumes_exactly(compose_cfg, tmp_path: Path) -> None:
    straight = compose_cfg(*OVERRIDES)
    straight.paths.output_dir = str(tmp_path / "straight")
    train(straight)

    run = tmp_path / "run"
    fault = ("+callbacks.fault._target_=faults.Fault", "+callbacks.fault.step=3")
    killed = compose_cfg(*OVERRIDES, *fault, "+callbacks.fault.phase=step")
    killed.paths.output_dir = str(run)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child trains until it kills itself
        try:
            train(killed)
        finally:
            os._exit(0)  # not reached when the fault fires
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL

    resumed = compose_cfg(*OVERRIDES, "ckpt_path=last")
    resumed.paths.output_dir = str(run)
    assert train(resumed)["global_step"] == 6
    assert_same_run(run, tmp_path / "straight")
