"""Multi-node launch: the SLURM launcher and trainer configs, and a 2-step job through
submitit's local executor (`hydra/launcher=submitit_local`)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import hydra
import pytest

from conftest import FAST, run_cli

submitit = pytest.importorskip(
    "submitit", reason="cluster launch needs hydra-submitit-launcher: pip install megalab[cluster]"
)


def test_slurm_launcher_asks_one_task_per_gpu_and_lightnings_requeue_signal(compose_cfg) -> None:
    from submitit.slurm.slurm import _make_sbatch_string

    cfg = compose_cfg(
        "hydra/launcher=slurm", "trainer=slurm", "trainer.num_nodes=2", "trainer.devices=4",
        "hydra.launcher.partition=gpu", fast=False,
    )  # fmt: skip
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)
    # The parameters as hydra-submitit-launcher hands them to submitit's sbatch writer.
    script = _make_sbatch_string(
        command="python -m megalab.cli.train",
        folder="/tmp/submitit",
        nodes=launcher.nodes,
        ntasks_per_node=launcher.tasks_per_node,
        gpus_per_node=launcher.gpus_per_node,
        cpus_per_task=launcher.cpus_per_task,
        time=launcher.timeout_min,
        partition=launcher.partition,
        signal_delay_s=launcher.signal_delay_s,
        additional_parameters=dict(launcher.additional_parameters),
    )
    for line in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--partition=gpu",
                 "--signal=USR1@120", "--requeue"):  # fmt: skip
        assert f"#SBATCH {line}" in script, line
    assert "USR2" not in script  # submitit's own signal is replaced: only Lightning requeues
    env = hydra.utils.instantiate(cfg.trainer.plugins[0])
    assert env.auto_requeue and env.requeue_signal == signal.SIGUSR1


@pytest.mark.slow
def test_a_two_step_job_runs_through_submitit_local(fixture_data_dir: Path, tmp_path: Path):
    proc = run_cli(
        "-m", "megalab.cli.train", "-m", "hydra/launcher=submitit_local",
        *FAST, "trainer.max_steps=2", "data.batch_size=4",
        f"paths.data_dir={fixture_data_dir}", f"hydra.sweep.dir={tmp_path}",
        "hydra.launcher.timeout_min=10",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "0" / "metrics.json").read_text())
    assert record["global_step"] == 2
    assert list((tmp_path / ".submitit").iterdir()), "submitit kept no job folder"
