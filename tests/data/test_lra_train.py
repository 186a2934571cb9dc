"""`python -m megalab.cli.train model=transformer data=lra_<task>` trains on every LRA fixture, and
the documented offline Pathfinder recipe works on a fresh data folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli
from megalab.cli.train import train

SMALL = ["data.batch_size=4", "data.eval_batch_size=4"]
TASKS = {
    "lra_listops": [],
    "lra_text": ["data.max_len=512"],  # the fixture's long review, kept cheap for attention
    "lra_retrieval": ["task=retrieval", "data.max_len=512"],
    "lra_image": [],
    "lra_pathfinder": [],
    # 16,384 pixels: the default 4-layer model's full attention is minutes on 2 CPU cores.
    "lra_pathx": [
        "model.backbone.num_layers=1",
        "model.d_model=32",
        "model.head_hidden=32",
        "data.batch_size=1",
        "data.eval_batch_size=1",
    ],
}


@pytest.mark.parametrize(
    "data",
    # Path-X: even one small layer of full attention over 16,384 pixels takes ~45 s here.
    [pytest.param(d, marks=pytest.mark.slow) if d == "lra_pathx" else d for d in sorted(TASKS)],
)
def test_transformer_trains_on_each_lra_task(compose_cfg, data: str) -> None:
    cfg = compose_cfg("model=transformer", f"data={data}", *SMALL, *TASKS[data])
    record = train(cfg)
    assert record["global_step"] == 2
    assert {"test/acc", "test/loss"} <= set(record["metrics"])


def test_offline_pathfinder_recipe_generates_data(compose_cfg, tmp_path: Path) -> None:
    cfg = compose_cfg(
        "experiment=transformer/lra_pathfinder",
        f"paths.data_dir={tmp_path / 'data'}",
        "data.generate_if_missing=true",
        "data.generator_samples=20",
        "data.generator_workers=1",
        *SMALL,
    )
    record = train(cfg)
    assert record["global_step"] == 2
    folder = tmp_path / "data" / "lra" / "pathfinder" / "pathfinder32" / "curv_contour_length_14"
    assert len((folder / "metadata" / "0.npy").read_text().splitlines()) == 20


@pytest.mark.slow
def test_documented_offline_pathfinder_command(tmp_path: Path) -> None:
    """The exact command of docs/datasets_lra.md (2,000 generated images, then a few steps)."""
    proc = run_cli(
        "-m",
        "megalab.cli.train",
        "experiment=transformer/lra_pathfinder",
        "data.generate_if_missing=true",
        "data.generator_samples=2000",
        "data.batch_size=16",
        "trainer.max_steps=20",
        "trainer.val_check_interval=10",
        f"paths.data_dir={tmp_path / 'data'}",
        f"paths.log_dir={tmp_path / 'logs'}",
        env={"HF_HUB_OFFLINE": "1", "MEGALAB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test/acc" in proc.stdout
