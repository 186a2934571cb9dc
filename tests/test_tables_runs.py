"""Which runs `megalab-tables` puts in a paper row, and how it says what they are.

Runs are grouped by their configuration (experiment and resolved config, settings such as paths
and the trainer's device aside), never by experiment name alone: every seed of every
configuration is kept, a repeated seed of one configuration counts once, a run whose overrides
make it another configuration than a paper cell's is listed apart with what differs, and step
counts, unfinished schedules and smoke runs are shown.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from conftest import ROOT
from megalab import reporting as tb

TABLES = tb.load_tables(ROOT / "tables")
TABLE2 = ["mega/table2_lra"]


def run_folder(
    root: Path,
    name: str,
    overrides: list[str],
    acc: float,
    steps: int = 2000,
    max_steps: int = 2000,
    stop_reason: str = "schedule",
    config: dict | None = None,
    mtime: float | None = None,
) -> Path:
    """A run folder as `megalab.cli.train` leaves it: metrics.json (with the schedule record), the
    resolved config.yaml and Hydra's .hydra/overrides.yaml."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    seed = int(values.get("seed", 1))
    record = {
        "experiment": values.get("experiment"),
        "seed": seed,
        "global_step": steps,
        "max_steps": max_steps,
        "max_epochs": None,
        "finished": stop_reason == "schedule",
        "stop_reason": stop_reason,
        "metrics": {"test/acc": acc},
    }
    resolved = config or {}
    resolved = {
        **resolved,
        "seed": seed,
        "paths": {"output_dir": str(run)},
        "data": {**resolved.get("data", {}), "seed": seed, "data_dir": str(root / "data")},
        "trainer": {"max_steps": max_steps, **resolved.get("trainer", {})},
    }
    (run / "metrics.json").write_text(json.dumps(record))
    (run / "config.yaml").write_text(yaml.safe_dump(resolved))
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if mtime is not None:
        os.utime(run / "metrics.json", (mtime, mtime))
    return run


def section(text: str, start: str) -> list[str]:
    return text[text.index(start) :].splitlines()


def other_runs(text: str) -> list[str]:
    lines = section(text, "### Other runs")
    return [line for line in lines if line.startswith("| ") and not line.startswith("| Exp")]


def test_the_readme_multirun_keeps_all_four_runs(tmp_path: Path) -> None:
    """`python -m megalab.cli.train -m model.d_model=32,64 seed=0,1`: two configurations of two
    seeds each (grouping by experiment name and newest per seed kept two of the four)."""
    for i, (d, seed) in enumerate(((32, 0), (32, 1), (64, 0), (64, 1))):
        overrides = [f"model.d_model={d}", f"seed={seed}"]
        run_folder(tmp_path, str(i), overrides, 0.5 + d / 1000 + seed / 100,
                   config={"model": {"d_model": d}}, mtime=1000 + i)  # fmt: skip
    # a run of an experiment: never merged with the runs without one
    run_folder(tmp_path, "exp", ["experiment=mega/lra_listops", "seed=0"], 0.6)
    runs = tb.collect_runs([tmp_path])
    assert len({r.identity for r in runs}) == 3
    text = tb.build_report(runs, TABLES, wanted=TABLE2).markdown
    rows = other_runs(text)
    d32 = next(r for r in rows if "`model.d_model=32`" in r)
    d64 = next(r for r in rows if "`model.d_model=64`" in r)
    assert d32.startswith("| (no experiment) |") and "| 53.70 ± 0.71 | 2 | 2000 |" in d32
    assert "| 56.90 ± 0.71 | 2 | 2000 |" in d64
    assert len(rows) == 2  # the experiment's run is in Table 2's Mega row
    mega = section(text, "| Mega | paper |")
    assert mega[1].startswith("| | ours | 60.00 |") and mega[3].startswith("| | steps | 2000 |")


def test_a_short_trial_never_replaces_the_full_run_in_a_paper_row(tmp_path: Path) -> None:
    """A newer 10-step run (`trainer.max_steps=10`) of the same experiment and seed is another
    configuration: the paper row keeps the 2,000-step run; the trial is listed apart."""
    full = ["experiment=mega/lra_listops", "seed=1"]
    run_folder(tmp_path, "full", full, 0.62, mtime=1000)
    run_folder(tmp_path, "trial", [*full, "trainer.max_steps=10"], 0.20, steps=10, max_steps=10,
               config={"trainer": {"max_steps": 10}}, mtime=2000)  # fmt: skip
    text = tb.build_report(tb.collect_runs([tmp_path]), TABLES, wanted=TABLE2).markdown
    mega = section(text, "| Mega | paper |")
    assert mega[1].startswith("| | ours | 62.00 |")
    assert mega[2].startswith("| | Δ (n) | -1.14 (1) |")
    assert mega[3].startswith("| | steps | 2000 |")
    (trial,) = other_runs(text)
    assert trial.startswith("| mega/lra_listops | `trainer.max_steps=10` | 20.00 | 1 | 10 |")
    assert trial.endswith(f"| {tmp_path / 'trial'} |")


def test_a_20_step_trial_alone_is_not_ours_in_table_2(tmp_path: Path) -> None:
    run_folder(tmp_path, "t", ["experiment=mega/lra_text", "seed=1", "trainer.max_steps=20"],
               0.55, steps=20, max_steps=20)  # fmt: skip
    text = tb.build_report(tb.collect_runs([tmp_path]), TABLES, wanted=TABLE2).markdown
    mega = section(text, "| Mega | paper |")
    assert mega[1].startswith("| | ours | missing | missing |")  # only the planned-row view
    assert other_runs(text)[0].startswith("| mega/lra_text | `trainer.max_steps=20` | 55.00 |")


def test_settings_do_not_make_another_configuration(tmp_path: Path) -> None:
    """Where and how a run ran (trainer choice, devices, paths, workers, logger) is no
    difference: seeds run on other hardware still average together in the paper row."""
    base = ["experiment=mega/lra_listops"]
    run_folder(tmp_path, "a", [*base, "seed=1", "trainer=gpu", "data.num_workers=8"], 0.62)
    elsewhere = ["trainer=ddp", "trainer.devices=8", "logger=wandb", "hydra.run.dir=/x"]
    run_folder(tmp_path, "b", [*base, "seed=2", *elsewhere, "ckpt_path=last"], 0.64)
    text = tb.build_report(tb.collect_runs([tmp_path]), TABLES, wanted=TABLE2).markdown
    mega = section(text, "| Mega | paper |")
    assert mega[1].startswith("| | ours | 63.00 ± 1.41 |") and "### Other runs" not in text


def test_repeated_seed_counts_once_preferring_a_finished_run(tmp_path: Path) -> None:
    exp = ["experiment=mega/lra_listops", "seed=1"]
    run_folder(tmp_path, "old", exp, 0.60, mtime=1000)
    run_folder(tmp_path, "newer", exp, 0.64, mtime=2000)  # same configuration: the newest
    run_folder(tmp_path, "newest-stopped", exp, 0.10, steps=30, stop_reason="other", mtime=3000)
    stat = tb.summarize(next(t for t in TABLES if t.id == "mega/table2_lra"),
                        tb.collect_runs([tmp_path]))[("mega", "listops")]  # fmt: skip
    assert stat is not None and stat.n == 1 and stat.mean == 64.0 and stat.unfinished == ()


def test_runs_short_of_their_schedule_are_marked(tmp_path: Path) -> None:
    exp = ["experiment=mega/lra_listops"]
    run_folder(tmp_path, "s1", [*exp, "seed=1"], 0.60)
    run_folder(tmp_path, "s2", [*exp, "seed=2"], 0.50, steps=700, stop_reason="early_stopping")
    text = tb.build_report(tb.collect_runs([tmp_path]), TABLES, wanted=TABLE2).markdown
    mega = section(text, "| Mega | paper |")
    assert mega[1].startswith(f"| | ours | 55.00 ± 7.07 {tb.UNFINISHED} |")
    assert mega[3].startswith("| | steps | 700–2000 |")
    assert f"{tb.UNFINISHED} Stopped before the configured schedule (not a result):" in text
    assert f"- Mega / ListOps: {tmp_path / 's2'}: early stopping at step 700 of 2000" in text


def test_smoke_runs_are_marked_in_the_row(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run_folder(sweep, "0", ["experiment=mega/lra_listops", "seed=1", "trainer.max_steps=2",
                            "data.batch_size=4"], 0.3, steps=2, max_steps=2)  # fmt: skip
    manifest = {"parameters": ["experiment", "seed"], "smoke": True, "fixed": [], "points": []}
    (sweep / "sweep.json").write_text(json.dumps(manifest))
    text = tb.build_report(tb.collect_runs([tmp_path]), TABLES, wanted=TABLE2).markdown
    mega = section(text, "| Mega | paper |")
    assert mega[1].startswith("| | ours | 30.00 |")
    assert mega[3].startswith("| | steps | 2 (smoke) |")
    assert "**Smoke runs**" in text and "### Other runs" not in text


def test_a_sweep_files_own_command_overrides_are_its_configuration(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run_folder(sweep, "0", ["experiment=mega/lra_listops", "seed=1", "data.max_len=2000"], 0.61)
    manifest = {"parameters": ["experiment", "seed"], "smoke": False,
                "fixed": ["data.max_len=2000"], "extra": [], "points": []}  # fmt: skip
    (sweep / "sweep.json").write_text(json.dumps(manifest))
    text = tb.build_report(tb.collect_runs([tmp_path]), TABLES, wanted=TABLE2).markdown
    assert section(text, "| Mega | paper |")[1].startswith("| | ours | 61.00 |")


def test_an_edited_experiment_file_splits_the_runs(tmp_path: Path) -> None:
    """Same overrides, different resolved configs (the experiment file changed between runs):
    the paper row takes one configuration (most seeds), the other is listed with the keys whose
    values differ."""
    exp = "experiment=mega/lra_listops"
    for seed in (1, 2):
        run_folder(tmp_path, f"new{seed}", [exp, f"seed={seed}"], 0.6 + seed / 100,
                   config={"optim": {"lr": 0.001}})  # fmt: skip
    run_folder(tmp_path, "old", [exp, "seed=1"], 0.40, config={"optim": {"lr": 0.01}}, mtime=5)
    text = tb.build_report(tb.collect_runs([tmp_path]), TABLES, wanted=TABLE2).markdown
    assert section(text, "| Mega | paper |")[1].startswith("| | ours | 61.50 ± 0.71 |")
    (old,) = other_runs(text)
    assert old.startswith("| mega/lra_listops | `optim.lr=0.01` | 40.00 | 1 | 2000 |")


def test_rows_that_overrides_alone_would_not_tell_apart_show_the_keys_that_do(
    tmp_path: Path,
) -> None:
    """`trainer=ddp_cpu` is a setting, yet it sets `trainer.deterministic=false`: two rows both
    labelled `trainer.max_steps=10` would look alike. A deleted key is shown as typed."""
    base = ["experiment=quickstart", "seed=1", "trainer.max_steps=10"]
    run_folder(tmp_path, "cpu", base, 0.2, steps=10, max_steps=10,
               config={"trainer": {"deterministic": True}})  # fmt: skip
    run_folder(tmp_path, "ddp", [*base, "trainer=ddp_cpu"], 0.3, steps=10, max_steps=10,
               config={"trainer": {"deterministic": False}})  # fmt: skip
    run_folder(tmp_path, "mega", [*base, "model=mega", "~model.backbone.num_heads"], 0.4,
               steps=10, max_steps=10, config={"model": {"name": "mega"}})  # fmt: skip
    text = tb.build_report(tb.collect_runs([tmp_path]), TABLES, wanted=TABLE2).markdown
    labels = sorted(row.split(" | ")[1] for row in other_runs(text))
    assert labels == [
        "`trainer.max_steps=10` `model=mega` `~model.backbone.num_heads`",
        "`trainer.max_steps=10` `trainer.deterministic=false`",
        "`trainer.max_steps=10` `trainer.deterministic=true`",
    ]


def test_runs_without_the_metric_say_which_they_record(tmp_path: Path) -> None:
    run_folder(tmp_path, "cls", ["experiment=quickstart", "seed=1"], 0.5)
    lm = run_folder(tmp_path, "lm", ["model=llama", "task=language_modeling", "seed=1"], 0.0,
                    config={"task": {"name": "lm"}})  # fmt: skip
    record = json.loads((lm / "metrics.json").read_text())
    record["metrics"] = {"test/ppl": 20.5, "test/loss": 3.02}
    (lm / "metrics.json").write_text(json.dumps(record))
    text = tb.build_report(tb.collect_runs([tmp_path]), TABLES, wanted=TABLE2).markdown
    assert (
        "Runs shown without `test/acc` record `test/ppl`, `test/loss`: `--metric test/ppl "
        "--scale 1` lists them by it." in text
    )
    by_ppl = tb.build_report(tb.collect_runs([tmp_path]), TABLES, wanted=TABLE2,
                             metric="test/ppl", scale=1.0).markdown  # fmt: skip
    assert "| `model=llama` `task=language_modeling` | 20.50 | 1 |" in by_ppl
