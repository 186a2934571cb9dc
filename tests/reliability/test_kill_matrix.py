"""The kill matrix (slow): runs killed or signalled at every phase, single-process and DDP,
resume with `ckpt_path=last` to the same weights, `metrics.json` and CSV rows as an
uninterrupted run; a SLURM job's requeue signal saves, requeues and resumes the same way.
Faults come from `faults.Fault` through Hydra overrides."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faults import assert_same_run

from conftest import ROOT

pytestmark = pytest.mark.slow

BASE = [
    "trainer.max_steps=8",
    "trainer.limit_train_batches=3",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.log_every_n_steps=1",
    "trainer.enable_model_summary=false",
    "trainer.enable_progress_bar=false",
    "model.d_model=16",
    "model.backbone.num_layers=1",
    "model.backbone.dropout=0.1",  # dropout on: the RNG states matter
    "data.batch_size=4",
    "data.eval_batch_size=4",
    "data.num_workers=0",
    "logger=csv",
    "callbacks.last_checkpoint.every_n_train_steps=2",
]
STEP_VAL = ["trainer.val_check_interval=2", "trainer.check_val_every_n_epoch=null"]
VARIANTS = {
    "epoch_val": ["trainer=cpu"],
    "step_val": ["trainer=cpu", *STEP_VAL],
    "ddp": ["trainer=ddp_cpu", *STEP_VAL],
}
CASES = [
    ("epoch_val", "step", 3, "kill"),
    ("epoch_val", "checkpoint", 4, "kill"),
    ("epoch_val", "epoch_end", 6, "kill"),
    ("epoch_val", "test", 8, "kill"),
    ("epoch_val", "validation", 5, "int"),
    ("epoch_val", "step", 4, "term"),
    ("step_val", "checkpoint_partial", 3, "kill"),
    ("step_val", "validation", 4, "kill"),
    ("step_val", "epoch_end", 3, "kill"),
    ("step_val", "step", 3, "term"),  # an epoch's last batch, no validation due
    ("ddp", "step", 3, "kill"),
    ("ddp", "validation", 4, "kill"),
    ("ddp", "step", 5, "term"),
    ("ddp", "checkpoint", 4, "kill"),
    ("ddp", "epoch_end", 3, "kill"),
    ("ddp", "test", 8, "kill"),
]


def _run(
    args: list[str], out: Path, data: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(Path(__file__).parent)]),
        "OMP_NUM_THREADS": "1",
        "MEGALAB_ROOT": str(ROOT),
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "megalab.cli.train", *args, f"paths.data_dir={data}"]
    proc = subprocess.Popen(
        [*cmd, f"hydra.run.dir={out}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:  # DDP workers of a killed rank 0 would wait for it forever
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _fault(phase: str, step: int, how: str) -> list[str]:
    return [
        "+callbacks.fault._target_=faults.Fault",
        f"+callbacks.fault.phase={phase}",
        f"+callbacks.fault.step={step}",
        f"+callbacks.fault.how={how}",
    ]


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory, fixture_data_dir: Path) -> dict[str, Path]:
    out = {}
    for name, extra in VARIANTS.items():
        run = tmp_path_factory.mktemp("straight") / name
        proc = _run([*BASE, *extra], run, fixture_data_dir)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = run
    return out


@pytest.mark.parametrize(("variant", "phase", "step", "how"), CASES)
def test_interrupted_run_resumes_exactly(
    straight_runs, fixture_data_dir: Path, tmp_path: Path, variant, phase, step, how
) -> None:
    run = tmp_path / "run"
    args = [*BASE, *VARIANTS[variant]]
    killed = _run([*args, *_fault(phase, step, how)], run, fixture_data_dir)
    assert killed.returncode != 0
    if how != "kill":
        assert killed.returncode == 128 + {"term": 15, "int": 2}[how]
        assert "ckpt_path=last" in killed.stderr.splitlines()[-1]
    resumed = _run([*args, "ckpt_path=last"], run, fixture_data_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list((run / "checkpoints").glob(".*.tmp")), "temporary files are cleaned up"
    assert not list((run / "checkpoints").glob("last-v*.ckpt"))
    assert_same_run(run, straight_runs[variant])


# A language model carrying its memory across segments (Transformer-XL on enwik8), its epoch
# loss a plain-tensor accumulation: the users' schedule (`every_n_minutes`) plus a save every 4
# steps, killed at step 5, validated every 3 steps.
LM = [
    "experiment=transformer_xl/enwik8",
    *[a for a in BASE if not a.startswith(("model.", "callbacks.last_checkpoint"))],
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
    "data.sha256=null",
    "data.valid_size=3000",
    "data.test_size=3000",
    "callbacks.last_checkpoint.every_n_train_steps=4",
]


@pytest.mark.parametrize("trainer", ["cpu", "ddp_cpu"])
def test_language_model_killed_mid_epoch_resumes_exactly(
    fixture_data_dir: Path, tmp_path: Path, trainer: str
) -> None:
    args = [*LM, f"trainer={trainer}"]
    straight = tmp_path / "straight"
    proc = _run(args, straight, fixture_data_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    killed = _run([*args, *_fault("step", 5, "kill")], run, fixture_data_dir)
    assert killed.returncode != 0
    resumed = _run([*args, "ckpt_path=last"], run, fixture_data_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run, straight)


# A SLURM job as `sbatch` starts it (one task), on CPU, with Lightning's SLURM environment and
# auto-requeue (trainer=slurm); `scontrol` is a script that records its arguments.
SLURM = [
    "trainer=slurm",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.num_nodes=1",
    *STEP_VAL,
]


def _slurm_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "megalab",
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODELIST": "localhost",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }


def test_slurm_requeue_signal_saves_requeues_and_resumes(
    fixture_data_dir: Path, tmp_path: Path
) -> None:
    """SIGUSR1 (the launcher's `--signal=USR1@120`) at step 5: `last.ckpt` at step 5, the job
    requeued with `scontrol requeue <job id>`, exit 128 + 10; the requeued job (same folder,
    `ckpt_path=auto`) ends exactly like an uninterrupted one."""
    env = _slurm_env(tmp_path)
    args = [*BASE, *SLURM]
    straight = tmp_path / "straight"
    proc = _run(args, straight, fixture_data_dir, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "scontrol.log").exists()

    run = tmp_path / "run"
    killed = _run([*args, "ckpt_path=auto", *_fault("step", 5, "usr1")], run, fixture_data_dir, env)
    assert killed.returncode == 128 + signal.SIGUSR1, killed.stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert "ckpt_path=last" in killed.stderr.splitlines()[-1]
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 5

    requeued = _run([*args, "ckpt_path=auto"], run, fixture_data_dir, env)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # once
    assert_same_run(run, straight)
