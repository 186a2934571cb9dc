"""Loss curves and tokens/s side by side (`megalab.cli.curves`), and the
`make reproduce-megalodon-vs-llama` target that draws them (Megalodon Fig. 1 and Fig. 4 in
miniature)."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from megalab import reporting as tb
from megalab.cli import curves as curves_cli
from megalab.reporting import curves

HEADER = [
    "epoch",
    "lr/default",
    "step",
    "train/loss_step",
    "train/peak_mem_mb",
    "train/step_s",
    "train/step_tokens_per_s",
    "val/loss",
]


def write_run(
    root: Path,
    experiment: str,
    target: str,
    context: int,
    batch: int,
    losses: list[float],
    speed: float,
    seed: int = 1,
    val: dict[int, float] | None = None,
    step_log: bool = True,
) -> Path:
    """A run folder as megalab.cli.train writes it with the CSV logger: metrics.json, config.yaml
    and csv/metrics.csv in Lightning's layout (one row per logging call)."""
    run = root / f"{experiment.replace('/', '_')}_{seed}"
    (run / "csv").mkdir(parents=True)
    record = {
        "experiment": experiment,
        "seed": seed,
        "metrics": {"eff/train_tokens_per_s": speed, "train/loss_step": losses[-1]},
        "params": {"total": 1_000_000},
    }
    (run / "metrics.json").write_text(json.dumps(record))
    config = {
        "seed": seed,
        "data": {"max_len": context, "batch_size": batch},
        "model": {"backbone": {"_target_": target}},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    with (run / "csv" / "metrics.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, HEADER)
        w.writeheader()
        for step, loss in enumerate(losses):
            w.writerow({"step": step, "lr/default": 1e-3})  # the LR monitor's row
            row = {"epoch": 0, "step": step, "train/loss_step": loss}
            if step_log:  # the efficiency monitor's per-step numbers: batch x context tokens
                row |= {"train/step_s": 2.0, "train/step_tokens_per_s": batch * context / 2.0}
            w.writerow(row)
        for step, loss in (val or {}).items():
            w.writerow({"epoch": 0, "step": step - 1, "val/loss": loss})
    return run


def write_comparison(root: Path, smoke: bool = False) -> None:
    """Megalodon and Llama at two contexts, Megalodon with two seeds at 4K."""
    mega, llama = "megalab.models.megalodon.Megalodon", "megalab.models.llama.Llama"
    write_run(root, "megalodon/a", mega, 64, 4, [5.0, 4.0, 3.0], 90.0, val={3: 3.5})
    write_run(root, "megalodon/a", mega, 64, 4, [6.0, 5.0, 4.0, 2.0], 110.0, seed=2)
    write_run(root, "llama/a", llama, 64, 4, [5.5, 4.5, 3.5], 100.0)
    write_run(root, "megalodon/b", mega, 512, 1, [5.0, 4.0], 130.0, step_log=False)
    write_run(root, "llama/b", llama, 512, 1, [5.0, 4.5], 100.0)
    (root / "sweep.json").write_text(json.dumps({"parameters": ["experiment"], "smoke": smoke}))


def test_curves_on_a_token_axis_with_seed_means_and_speed_ratios(tmp_path: Path) -> None:
    write_comparison(tmp_path)
    series = curves.lines(curves.load_curves([tmp_path]))
    by = {ln.label: ln for ln in series}
    assert [ln.label for ln in series] == ["llama/a", "megalodon/a", "llama/b", "megalodon/b"]
    mega = by["megalodon/a"]
    # steps both seeds logged (1..3), x 256 tokens per step (the monitor's tokens)
    assert mega.tokens == [256.0, 512.0, 768.0]
    assert mega.loss == pytest.approx([5.5, 4.5, 3.5])
    assert mega.val_tokens == [768.0] and mega.val_loss == [3.5]
    assert (mega.seeds, mega.speed, mega.model, mega.context) == (2, 100.0, "Megalodon", 64)
    # without the per-step log, tokens per step come from data.batch_size x data.max_len
    assert by["megalodon/b"].tokens == [512.0, 1024.0]
    ratios = curves.speed_ratios(series, "llama")
    assert ratios == pytest.approx(
        {"llama/a": 1.0, "megalodon/a": 1.0, "llama/b": 1.0, "megalodon/b": 1.3}
    )


def test_markdown_and_png(tmp_path: Path, capsys) -> None:
    write_comparison(tmp_path / "runs", smoke=True)
    out = tmp_path / "out"
    assert curves_cli.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    text = (out / "curves.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| megalodon/b |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    # experiment, model, params, context, seeds, tokens, final loss, val, tokens/s, ratio
    assert cells == ["megalodon/b", "Megalodon", "1.0M", "512", "1", "1,024", "4.0000", "—",
                     "130.0", "1.30"]  # fmt: skip
    row = next(line for line in text.splitlines() if line.startswith("| megalodon/a |"))
    assert row.split("|")[8].strip() == "3.5000" and row.split("|")[4].strip() == "64"
    assert "**Smoke runs" in text
    png = out / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "| llama/b | Llama |" in capsys.readouterr().out


def test_no_history_fails_with_a_message(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"experiment": "x", "metrics": {}}))
    assert curves_cli.main([str(tmp_path)]) == 1
    assert "logger=csv" in capsys.readouterr().err
    assert curves_cli.main([str(tmp_path / "nowhere")]) == 2


def test_history_reader_skips_non_finite_and_empty_cells(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,step,train/loss_step,val/loss\n0,0,nan,\n0,1,2.5,\n,1,,\n0,1,,3.0\n,x,1.0,\n"
    )
    loss, val, tokens = curves.read_history(path)
    assert loss == {2: 2.5} and val == {2: 3.0} and tokens == []
    assert not math.isnan(loss[2])


def test_fig4_table_pairs_the_comparison_experiments() -> None:
    (table,) = [t for t in tb.load_tables(ROOT / "tables") if t.id == "megalodon/fig4_throughput"]
    cells = {(c.row_id, c.column_id): c for c in table.cells.values()}
    assert cells[("megalodon", "ctx32k")].experiment == "megalodon/pg19_100m_32k"
    assert cells[("llama", "ctx4k")].experiment == "llama/pg19"
    assert cells[("megalodon", "ctx4k")].display == "≈0.94"
    assert all(c.relative_to == "llama" for c in table.columns)


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _make_dry_run(*args: str) -> list[str]:
    """The sweep commands `make -n reproduce-megalodon-vs-llama` would run, one per line."""
    cmd = ["make", "--no-print-directory", "-n", "-C", str(ROOT), "reproduce-megalodon-vs-llama",
           "REPRO_INSTALL=", f"BIN={Path(sys.executable).parent}", *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [c for c in proc.stdout.split(";") if "megalab.cli.sweep" in c]


@needs_make
def test_vs_llama_smoke_shrinks_both_models_and_the_full_target_keeps_the_configs() -> None:
    """SMOKE=1 runs each experiment as its own sweep with its model's tiny sizes (both models
    2 layers of width 64, Megalodon's chunk a window of the 4K pair); without SMOKE the four
    experiments run exactly as configured."""
    smoke = _make_dry_run("SMOKE=1")
    full = _make_dry_run()
    experiments = ["megalodon/pg19_100m", "llama/pg19", "megalodon/pg19_100m_32k", "llama/pg19_32k"]
    for commands in (smoke, full):
        assert [c.split("--only experiment=")[1].split()[0] for c in commands] == experiments
    for command in full:
        assert "++" not in command and "--smoke" not in command
    for command, window in zip(smoke, (64, 64, 512, 512), strict=True):
        assert "--smoke" in command and f"++data.max_len={window} " in command
        assert "++model.d_model=64" in command and "++model.backbone.num_layers=2" in command
        megalodon = "experiment=megalodon/" in command
        assert ("++model.backbone.chunk_size=64" in command) == megalodon
        assert ("++model.backbone.num_heads=4" in command) == (not megalodon)


@needs_make
@pytest.mark.slow
def test_make_reproduce_megalodon_vs_llama_smoke(tmp_path: Path) -> None:
    """The whole target on fixtures: four runs of 2 CPU steps of the shrunk models (about
    2 minutes), the Fig. 4 table and the curves of both models side by side."""
    env = {**os.environ, "MEGALAB_ROOT": str(ROOT), "WANDB_MODE": "offline",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    cmd = ["make", "--no-print-directory", "-C", str(ROOT), "reproduce-megalodon-vs-llama",
           "SMOKE=1", "REPRO_INSTALL=", f"REPRO_ROOT={tmp_path}",
           f"BIN={Path(sys.executable).parent}"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (folder,) = (tmp_path / "reproduce-megalodon-vs-llama").iterdir()
    records = [json.loads(p.read_text()) for p in folder.rglob("metrics.json")]
    assert sorted(r["experiment"] for r in records) == [
        "llama/pg19", "llama/pg19_32k", "megalodon/pg19_100m", "megalodon/pg19_100m_32k"
    ]  # fmt: skip
    for record in records:  # the shrunk models, trained 2 steps to a finite loss
        assert record["params"]["total"] < 200_000, record["experiment"]
        assert record["global_step"] == 2 and math.isfinite(record["metrics"]["train/loss_step"])
    table = (folder / "table.md").read_text()
    ours = table[table.index("| Megalodon | paper | ≈0.94 | ≈1.32 |") :].splitlines()[1]
    assert all(c.strip()[0].isdigit() for c in ours.split("|")[3:-1]), ours
    text = (folder / "curves.md").read_text()
    contexts = {"megalodon/pg19_100m": "64", "llama/pg19": "64",
                "megalodon/pg19_100m_32k": "512", "llama/pg19_32k": "512"}  # fmt: skip
    for experiment, context in contexts.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| {experiment} |"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[3] == context and float(cells[8].replace(",", "")) > 0, row
    assert "**Smoke runs" in text
    assert (folder / "curves.png").stat().st_size > 20_000


def test_a_model_keeps_one_label_before_and_after_it_took_its_config() -> None:
    from megalab.reporting.curves import _model_name
    from megalab.reporting.runs import Run

    def label(target: str) -> str:
        return _model_name(Run(None, 0, {}, {"model": {"backbone": {"_target_": target}}}))

    assert label("megalab.models.s4d.S4DBackbone") == label("megalab.models.s4d.S4DConfig") == "S4D"
    assert label("megalab.models.llama.Llama") == label("megalab.models.llama.LlamaConfig")
