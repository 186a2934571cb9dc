"""The kill matrix (slow): runs killed or signalled at every phase, single-process and DDP,
resume with `ckpt_path=last` to the same weights, `metrics.json` and CSV rows as an
uninterrupted run. Faults come from `faults.Fault` through Hydra overrides."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    "callbacks.rich_progress_bar=null",
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
    ("ddp", "step", 3, "kill"),
    ("ddp", "validation", 4, "kill"),
    ("ddp", "step", 5, "term"),
]
TIMING = {"train/tokens_per_sec"}


def _run(args: list[str], out: Path, data: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(Path(__file__).parent)]),
        "OMP_NUM_THREADS": "1",
        "MEGALAB_ROOT": str(ROOT),
    }
    cmd = [sys.executable, "-m", "megalab.train", *args, f"paths.data_dir={data}"]
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


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING and v} for r in csv.DictReader(f)]


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
    fault = [
        "+callbacks.fault._target_=faults.Fault",
        f"+callbacks.fault.phase={phase}",
        f"+callbacks.fault.step={step}",
        f"+callbacks.fault.how={how}",
    ]
    args = [*BASE, *VARIANTS[variant]]
    killed = _run([*args, *fault], run, fixture_data_dir)
    assert killed.returncode != 0
    if how != "kill":
        assert killed.returncode == 128 + {"term": 15, "int": 2}[how]
        assert "ckpt_path=last" in killed.stderr.splitlines()[-1]
    resumed = _run([*args, "ckpt_path=last"], run, fixture_data_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list((run / "checkpoints").glob(".*.tmp")), "temporary files are cleaned up"
    assert not list((run / "checkpoints").glob("last-v*.ckpt"))

    straight = straight_runs[variant]
    a = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    for name, value in a["state_dict"].items():
        assert torch.equal(b["state_dict"][name], value), name
    ma = json.loads((straight / "metrics.json").read_text())["metrics"]
    mb = json.loads((run / "metrics.json").read_text())["metrics"]
    assert {k: v for k, v in ma.items() if k not in TIMING} == {
        k: v for k, v in mb.items() if k not in TIMING
    }
    assert _rows(run) == _rows(straight)
