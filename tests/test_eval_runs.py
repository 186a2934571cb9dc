"""`megalab.cli.eval_runs`: every finished run tested again with other settings (Table 5's pass)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import FAST, run_cli
from megalab.cli import eval_runs


def test_commands_use_the_best_checkpoint_else_the_last(tmp_path: Path) -> None:
    for name, best in (("a", True), ("b", False), ("c", None)):
        run = tmp_path / "sweep" / name
        (run / "checkpoints").mkdir(parents=True)
        ckpt = run / "checkpoints" / ("best.ckpt" if best else "last.ckpt")
        if best is not None:
            ckpt.write_bytes(b"")
        record = {"experiment": f"mega/{name}", "best_checkpoint": str(ckpt) if best else None}
        (run / "metrics.json").write_text(json.dumps(record))
    cmds = eval_runs.commands([tmp_path], ["model.backbone.chunk_size=8"], "long")
    assert len(cmds) == 2  # run c saved no checkpoint
    first = cmds[0]
    assert first[:3] == [sys.executable, "-m", "megalab.cli.eval"]
    assert first[3] == f"ckpt_path={tmp_path / 'sweep' / 'a' / 'checkpoints' / 'best.ckpt'}"
    # The run's groups are forced: the default config composed first may lack the key.
    assert first[4:] == ["++model.backbone.chunk_size=8", f"hydra.run.dir={tmp_path}/sweep/a/long"]
    assert cmds[1][3].endswith("b/checkpoints/last.ckpt")
    only = eval_runs.commands([tmp_path], [], "long", experiment="mega/b")
    assert len(only) == 1 and "/b/" in only[0][3]


@pytest.mark.slow
def test_a_trained_run_is_evaluated_again_and_the_tables_see_it(
    fixture_data_dir: Path, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    proc = run_cli(
        "-m", "megalab.cli.train", *FAST, f"paths.data_dir={fixture_data_dir}",
        f"hydra.run.dir={runs / '0'}", "model.d_model=16", "model.backbone.num_layers=1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(
        "-m", "megalab.cli.eval_runs", str(runs), "--name", "again", "trainer=cpu",
        "model.backbone.num_layers=1",
        "trainer.limit_test_batches=1", f"paths.data_dir={fixture_data_dir}",
        "data.eval_batch_size=2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((runs / "0" / "eval_metrics.json").read_text())
    assert record["eval_dir"] == str(runs / "0" / "again") and "test/acc" in record["metrics"]
    assert (runs / "0" / "again" / "eval_metrics.json").is_file()


def test_no_finished_run_is_a_failure(tmp_path: Path) -> None:
    assert eval_runs.main([str(tmp_path)]) == 1
