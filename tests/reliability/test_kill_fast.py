"""The kill matrix's representative in the default suite: a run killed without warning
(SIGKILL after an optimizer step, in a forked child of the test process) resumes with
`ckpt_path=last` to the weights, `metrics.json` and CSV rows of the uninterrupted run, with
dropout on and the default callbacks; the same for a language model carrying its memory across
segments, whose epoch loss is a plain-tensor accumulation. Every phase, signals and DDP:
test_kill_matrix.py (slow)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from faults import assert_same_run, csv_rows

from conftest import FAST
from megalab.cli.train import train
from megalab.utils.run_folder import RunFolderError, resolve_ckpt_path

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


# Transformer-XL on enwik8 (its memory carried across segments), validated every 3 steps; the
# users' checkpoint schedule (`every_n_minutes`) plus a save every 4 steps, killed at step 5.
LM_OVERRIDES = (
    "experiment=transformer_xl/enwik8",
    *FAST,
    "trainer.max_steps=6",
    "trainer.limit_train_batches=null",
    "trainer.val_check_interval=3",
    "trainer.check_val_every_n_epoch=null",
    "model.d_model=16",
    "model.backbone.num_layers=1",
    "model.backbone.num_heads=2",
    "model.backbone.head_dim=8",
    "model.backbone.ffn_dim=32",
    "model.backbone.mem_len=16",
    "data.max_len=16",
    "data.eval_max_len=16",
    "data.batch_size=4",
    "data.eval_batch_size=4",
    "data.sha256=null",
    "data.valid_size=3000",
    "data.test_size=3000",
    "logger=csv",
    "callbacks.last_checkpoint.every_n_train_steps=4",
)


def _kill_and_resume(compose_cfg, overrides: tuple[str, ...], step: int, tmp_path: Path) -> Path:
    """Train `overrides` uninterrupted, then again SIGKILLed after `step` and resumed with
    `ckpt_path=last`; return the resumed run's folder."""
    straight = compose_cfg(*overrides)
    straight.paths.output_dir = str(tmp_path / "straight")
    train(straight)

    run = tmp_path / "run"
    fault = ("+callbacks.fault._target_=faults.Fault", f"+callbacks.fault.step={step}")
    killed = compose_cfg(*overrides, *fault, "+callbacks.fault.phase=step")
    killed.paths.output_dir = str(run)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child trains until it kills itself
        try:
            train(killed)
        finally:
            os._exit(0)  # not reached when the fault fires
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL

    resumed = compose_cfg(*overrides, "ckpt_path=last")
    resumed.paths.output_dir = str(run)
    assert train(resumed)["global_step"] == 6
    return run


def test_sigkill_after_a_step_resumes_exactly(compose_cfg, tmp_path: Path) -> None:
    run = _kill_and_resume(compose_cfg, OVERRIDES, 3, tmp_path)
    assert_same_run(run, tmp_path / "straight")


def test_language_model_resumes_its_epoch_loss_exactly(compose_cfg, tmp_path: Path) -> None:
    """The epoch's loss accumulated before the kill (steps 1-4) counts in `train/loss_epoch`."""
    run = _kill_and_resume(compose_cfg, LM_OVERRIDES, 5, tmp_path)
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 6
    epoch_rows = [r for r in csv_rows(run) if "train/loss_epoch" in r]
    assert len(epoch_rows) == 1
    assert_same_run(run, tmp_path / "straight")


def test_a_finished_run_trains_on_with_a_larger_max_steps_exactly(
    compose_cfg, tmp_path: Path
) -> None:
    """A finished run (4 steps: two epochs of 2 batches) resumed with `ckpt_path=last` and 6
    steps in all trains the next epoch in full (Lightning alone would run an empty epoch that
    logs NaN) and ends as the 6-step run does (at a constant lr: the decay of the default
    schedule spans `max_steps`, which the longer run changes)."""
    overrides = (*OVERRIDES, "scheduler=constant")
    straight = compose_cfg(*overrides)
    straight.paths.output_dir = str(tmp_path / "straight")
    train(straight)

    run = tmp_path / "run"
    first = compose_cfg(*overrides, "trainer.max_steps=4")
    first.paths.output_dir = str(run)
    assert train(first)["global_step"] == 4
    longer = compose_cfg(*overrides, "ckpt_path=last")
    longer.paths.output_dir = str(run)
    assert train(longer)["global_step"] == 6
    assert_same_run(run, tmp_path / "straight")


# `ckpt_path=auto` with the users' schedule (last.ckpt every 5 minutes: none in a short run),
# validation every 2 steps: a kill before the first last.ckpt leaves only the best checkpoint.
AUTO_OVERRIDES = (
    *OVERRIDES[:-1],
    "trainer.max_steps=8",
    "ckpt_path=auto",
)


def _killed_at(compose_cfg, step: int, run: Path) -> None:
    fault = ("+callbacks.fault._target_=faults.Fault", f"+callbacks.fault.step={step}")
    killed = compose_cfg(*AUTO_OVERRIDES, *fault, "+callbacks.fault.phase=step")
    killed.paths.output_dir = str(run)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child trains until it kills itself
        try:
            train(killed)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL


@pytest.mark.parametrize("step", [1, 5])
def test_auto_resumes_from_the_newest_resumable_checkpoint(
    compose_cfg, tmp_path: Path, step: int
) -> None:
    """Killed before any last.ckpt, the run is requeued with the same `ckpt_path=auto`: it
    resumes from the best checkpoint (after step 5: written at a validation) or starts afresh
    (after step 1: nothing saved), and ends exactly like the uninterrupted run."""
    straight = compose_cfg(*AUTO_OVERRIDES)
    straight.paths.output_dir = str(tmp_path / "straight")
    train(straight)
    run = tmp_path / "run"
    _killed_at(compose_cfg, step, run)
    checkpoints = run / "checkpoints"
    found = sorted(checkpoints.glob("*.ckpt")) if checkpoints.is_dir() else []
    assert [p.name.startswith("best-") for p in found] == ([True] if step == 5 else [])
    if found:
        assert resolve_ckpt_path("auto", run) == str(found[0])
        with pytest.raises(RunFolderError, match=f"ckpt_path=auto \\(or ckpt_path={found[0]}"):
            resolve_ckpt_path("last", run)  # says what resumes instead

    requeued = compose_cfg(*AUTO_OVERRIDES)
    requeued.paths.output_dir = str(run)
    assert train(requeued)["global_step"] == 8
    assert_same_run(run, tmp_path / "straight")
    assert not (run / "earlier").exists()


def test_auto_starts_over_keeping_the_earlier_files_when_nothing_resumes(
    compose_cfg, tmp_path: Path
) -> None:
    """The only checkpoint damaged: `ckpt_path=auto` moves the earlier run's files aside and
    starts over (a requeued job never loops on a refusal); the result is the uninterrupted
    run's."""
    straight = compose_cfg(*AUTO_OVERRIDES)
    straight.paths.output_dir = str(tmp_path / "straight")
    train(straight)
    run = tmp_path / "run"
    _killed_at(compose_cfg, 5, run)
    (best,) = (run / "checkpoints").glob("*.ckpt")
    data = bytearray(best.read_bytes())
    data[len(data) // 2] ^= 0x01
    best.write_bytes(bytes(data))

    requeued = compose_cfg(*AUTO_OVERRIDES)
    requeued.paths.output_dir = str(run)
    assert train(requeued)["global_step"] == 8
    assert_same_run(run, tmp_path / "straight")
    (aside,) = (run / "earlier").iterdir()
    assert (aside / "checkpoints" / best.name).read_bytes() == bytes(data)
    assert (aside / "csv" / "metrics.csv").is_file()


def test_a_finished_run_leaves_the_signal_handlers_as_it_found_them(compose_cfg) -> None:
    """No handler of a finished run stays installed: Lightning's holds its trainer, model and
    data, which then stayed alive for the rest of the process."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    train(compose_cfg("logger=csv"))
    assert {s: signal.getsignal(s) for s in before} == before
