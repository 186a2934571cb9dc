"""W&B sweep files (`sweeps/`) and the offline sweep runner (`megalab.cli.sweep`).

Every sweep file is a valid W&B sweep config, passes its parameters to `megalab.cli.train` as Hydra
overrides, and each of its grid points composes (and, for the ablations, builds and runs a
forward pass); the offline runner plans multiruns, skips what cannot run, and runs a 2-point
grid end to end on fixture data.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from conftest import CONFIG_DIR, ROOT, run_cli
from megalab.cli import sweep as sw

SWEEPS = sorted((ROOT / "sweeps").glob("*.yaml"))
SCHEMA = json.loads((ROOT / "sweeps" / "wandb_sweep.schema.json").read_text())
ABLATIONS = [p for p in SWEEPS if p.stem.startswith(("mega_lra_text_", "mega_lra_image_"))]
# Megalodon's ablations sweep an experiment list too (LRA Text and Image).
ABLATIONS += [
    p for p in SWEEPS if p.stem.startswith("megalodon_lra_") and not p.stem.endswith("pathx")
]
# Language-model sweeps optimise the validation loss (LanguageModelingTask logs val/loss).


def _points() -> list[tuple[str, dict]]:
    """(sweep file, grid point without its seed), each distinct point once."""
    out = []
    for path in SWEEPS:
        s = sw.load_sweep(path)
        seen = set()
        for point in sw.expand(s):
            point = {k: v for k, v in point.items() if k != "seed"}
            key = json.dumps(point, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append((path.name, point))
    return out


POINTS = _points()


def test_sweeps_exist() -> None:
    names = {p.stem for p in SWEEPS}
    for task in ("text", "image"):
        for ablation in ("chunk_size", "ema_dim", "attention"):
            assert f"mega_lra_{task}_{ablation}" in names
    assert {"mega_lra", "mega_lra_pathx", "mega_sc10"} <= names


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_validates_against_the_wandb_schema(path: Path) -> None:
    jsonschema.validate(yaml.safe_load(path.read_text()), SCHEMA)


def test_schema_rejects_malformed_sweeps() -> None:
    good = yaml.safe_load(SWEEPS[0].read_text())
    for bad in (
        {**good, "method": "exhaustive"},
        {**good, "metric": {"goal": "maximize"}},
        {**good, "parameters": {"model.backbone.chunk_size": {"vals": [1]}}},
        {**good, "parameters": {"model.backbone.chunk_size": {"values": []}}},
        {**good, "command": "python -m megalab.cli.train"},
        {**good, "unknown_key": 1},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCHEMA)


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_runs_megalab_train_with_hydra_overrides(path: Path) -> None:
    cfg = yaml.safe_load(path.read_text())
    command = cfg["command"]
    assert command[:4] == ["${env}", "python", "-m", "megalab.cli.train"]
    assert command[-1] == "${args_no_hyphens}"  # key=value: Hydra overrides
    assert "logger=wandb" in command and "logger.wandb.offline=false" in command
    assert cfg["method"] == "grid"
    # What the W&B logger sees after every validation: ClassificationTask logs val/acc_best,
    # the language-model task val/loss (test/loss for test-only sweeps of a trained
    # checkpoint), the seq2seq task val/bleu.
    goals = {
        "val/acc_best": "maximize",
        "val/loss": "minimize",
        "test/loss": "minimize",
        "val/bleu": "maximize",
    }
    assert cfg["metric"]["goal"] == goals[cfg["metric"]["name"]]
    experiments = [c for c in command if c.startswith("experiment=")]
    assert experiments or "experiment" in cfg["parameters"]
    fixed = sw.load_sweep(path).fixed
    assert [c for c in fixed if c.startswith("experiment=")] == experiments
    assert not any(c.startswith("logger") for c in fixed)  # offline: the config's own logger


def test_classification_task_logs_the_sweep_metric() -> None:
    import inspect

    from megalab.tasks import classification

    assert '"val/acc_best"' in inspect.getsource(classification)


@pytest.fixture(scope="module")
def hydra_compose():
    """The Hydra compose API over configs/ (module-scoped: composing is the slow part)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):

        def _compose(overrides: list[str]):
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
            with open_dict(cfg):
                cfg.hydra.runtime.output_dir = str(ROOT / "logs")
                cfg.hydra.job.num = 0
            HydraConfig().set_config(cfg)
            return cfg

        yield _compose
    GlobalHydra.instance().clear()


@pytest.mark.parametrize(
    ("name", "point"), POINTS, ids=[f"{n}-{sw._describe(p)}" for n, p in POINTS]
)
def test_every_grid_point_composes(hydra_compose, name: str, point: dict) -> None:
    s = sw.load_sweep(ROOT / "sweeps" / name)
    overrides = s.fixed + [f"{k}={sw.format_value(v)}" for k, v in point.items()]
    cfg = hydra_compose(overrides)
    for key, value in point.items():
        got = cfg.experiment_name if key == "experiment" else OmegaConf.select(cfg, key)
        assert got == value, key
    backbone = cfg.model.get("backbone") or {}
    if backbone.get("chunk_size", 0) == -1 and "max_positions" in backbone:
        # full attention: the bias table spans the input
        assert backbone.max_positions >= cfg.data.max_len
    seq2seq = cfg.model.get("encoder_decoder")  # translation: sentences up to data.max_len
    if seq2seq is not None:
        assert min(seq2seq.max_source_positions, seq2seq.max_target_positions) >= cfg.data.max_len


@pytest.mark.parametrize("path", ABLATIONS, ids=lambda p: p.name)
def test_ablation_points_build_and_run(hydra_compose, path: Path) -> None:
    """Each ablation's models build and run forward (h = 0, c > L, relu2 included)."""
    import hydra

    s = sw.load_sweep(path)
    for point in sw.expand(s):
        overrides = s.fixed + [f"{k}={sw.format_value(v)}" for k, v in point.items()]
        cfg = hydra_compose(overrides)
        backbone = hydra.utils.instantiate(cfg.model.backbone).build()
        backbone.eval()
        x = torch.randn(2, 40, cfg.model.d_model)
        mask = torch.ones(2, 40, dtype=torch.bool)
        mask[1, 30:] = False
        with torch.no_grad():
            y = backbone(x, mask=mask).y
        assert y.shape == x.shape and torch.isfinite(y).all(), sw._describe(point)


# -- the offline runner ----------------------------------------------------------------------
def _sweep_file(tmp_path: Path, values: list, experiment: str = "mega/lra_listops") -> Path:
    path = tmp_path / "tiny_chunk_size.yaml"
    command = ["${env}", "python", "-m", "megalab.cli.train", f"experiment={experiment}"]
    command += ["logger=wandb", "logger.wandb.offline=false", "${args_no_hyphens}"]
    spec = {
        "name": "tiny",
        "method": "grid",
        "metric": {"name": "val/acc_best", "goal": "maximize"},
        "parameters": {"model.backbone.chunk_size": {"values": values}},
        "command": command,
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def test_seeds_only_and_values() -> None:
    assert sw.parse_seeds("3") == [1, 2, 3]
    assert sw.parse_seeds("1,4,7") == [1, 4, 7] == sw.parse_seeds("1 4 7")
    assert sw.parse_seeds("") is None and sw.parse_seeds(None) is None
    with pytest.raises(sw.SweepError, match=r"--seeds takes N .* got 'x'"):
        sw.parse_seeds("x")
    assert sw.parse_only(["experiment=a/b,c/d"]) == {"experiment": ["a/b", "c/d"]}
    assert sw.format_value(-1) == "-1" and sw.format_value(True) == "true"
    assert sw.format_value(None) == "null" and sw.format_value("mega/lra_text") == "mega/lra_text"
    assert sw.format_value("a b") == "'a b'" and sw.format_value([1, 2]) == "[1,2]"
    assert sw.merge_overrides(["trainer=cpu", "a=1"], ["trainer=gpu"]) == ["a=1", "trainer=gpu"]


def test_expand_grid_seeds_only_random_and_bayes() -> None:
    s = sw.load_sweep(ROOT / "sweeps" / "mega_lra.yaml")
    points = sw.expand(s, seeds=[1, 2], only={"experiment": ["mega/lra_listops", "mega/lra_text"]})
    assert points == [
        {"experiment": "mega/lra_listops", "seed": 1},
        {"experiment": "mega/lra_listops", "seed": 2},
        {"experiment": "mega/lra_text", "seed": 1},
        {"experiment": "mega/lra_text", "seed": 2},
    ]
    assert sw.expand(s, only={"experiment": ["nope"]}) == []
    s.method = "random"
    s.parameters["model.backbone.dropout"] = {"distribution": "uniform", "min": 0.0, "max": 0.3}
    drawn = sw.expand(s, count=4)
    assert len(drawn) == 4 * 5 and all(0 <= p["model.backbone.dropout"] <= 0.3 for p in drawn)
    s.method = "bayes"
    with pytest.raises(sw.SweepError, match="W&B server"):
        sw.expand(s)


def test_plan_uses_one_multirun_and_own_processes_for_ddp(tmp_path: Path) -> None:
    s = sw.load_sweep(ROOT / "sweeps" / "mega_lra.yaml")
    s.parameters["experiment"] = {
        "values": ["mega/lra_listops", "mega_chunk/lra_listops", "mega/lra_pathx"]
    }
    plan = sw.plan_sweep(s, tmp_path / "out", seeds=[1, 2])
    assert not plan.skipped, [p.skip for p in plan.skipped]
    multirun, *singles = plan.commands
    assert "-m" in multirun[3:]
    assert "experiment=mega/lra_listops,mega_chunk/lra_listops" in multirun
    assert "seed=1,2" in multirun and any(a.startswith("hydra.sweep.dir=") for a in multirun)
    # Path-X trains with DDP (a DDP job re-launches its own command line): one process each.
    assert len(singles) == 2
    for i, cmd in enumerate(singles):
        assert "experiment=mega/lra_pathx" in cmd and "-m" not in cmd[3:]
        assert cmd[-1] == f"hydra.run.dir={tmp_path / 'out' / str(4 + i)}"


def test_plan_skips_missing_experiments_and_cpu_heavy_smoke(tmp_path: Path) -> None:
    s = sw.load_sweep(_sweep_file(tmp_path, [16, -1], experiment="mega/no_such_task"))
    plan = sw.plan_sweep(s, tmp_path / "out")
    assert not plan.commands and len(plan.skipped) == 2
    assert "mega/no_such_task" in plan.skipped[0].skip
    s = sw.load_sweep(ROOT / "sweeps" / "mega_lra_pathx.yaml")
    plan = sw.plan_sweep(
        s,
        tmp_path / "out",
        seeds=[1],
        smoke_overrides=sw.SMOKE_OVERRIDES,
        smoke=True,
    )
    assert plan.skipped and not plan.commands
    assert "on a CPU" in plan.skipped[0].skip or "Could not find" in plan.skipped[0].skip


def test_extra_overrides_must_not_set_swept_keys(tmp_path: Path) -> None:
    s = sw.load_sweep(_sweep_file(tmp_path, [16, -1]))
    with pytest.raises(sw.SweepError, match="--only"):
        sw.plan_sweep(s, tmp_path / "out", extra=["model.backbone.chunk_size=8"], check=False)


def test_a_misspelt_only_value_is_refused_with_the_values_there_are(capsys) -> None:
    """`--only experiment=mega/lra_listop` would drop its points silently; it names the values."""
    mega, megalodon = (str(ROOT / "sweeps" / f"{n}_lra.yaml") for n in ("mega", "megalodon"))
    typo = "experiment=mega/lra_text,mega/lra_listop"
    with pytest.raises(SystemExit):
        sw.main([mega, megalodon, "--dry-run", "--only", typo])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--only experiment=mega/lra_listop: not among the values" in err
    assert "mega/lra_listops" in err and "megalodon/lra_listops" in err
    # a value one of several sweeps gives is enough (make's ONLY= over a target's sweeps)
    only = "experiment=megalodon/lra_listops"
    assert sw.main([mega, megalodon, "--dry-run", "--smoke", "--only", only]) == 0
    with pytest.raises(SystemExit):
        sw.main([mega, "--dry-run", "--seeds", "two"])
    assert "--seeds takes N" in capsys.readouterr().err


def test_dry_run_prints_and_writes_nothing(tmp_path: Path, capsys) -> None:
    path = _sweep_file(tmp_path, [16, 32, -1])
    out = tmp_path / "out"
    extra = "model.backbone.dropout=0.2"
    assert sw.main([str(path), "--dry-run", "--seeds", "2", "--out", str(out), extra]) == 0
    printed = capsys.readouterr().out
    assert "model.backbone.chunk_size=16,32,-1" in printed and "seed=1,2" in printed
    assert extra in printed and "logger" not in printed
    assert not out.exists()
    with pytest.raises(SystemExit):  # an override that does not compose fails before running
        sw.main([str(path), "--dry-run", "--out", str(out), "model.no_such_key=1"])
    assert "no_such_key" in capsys.readouterr().err


# make reproduce-mega-lra SMOKE=1 runs a sweep in the default suite; this grid (13 s) is slow.
@pytest.mark.slow
def test_offline_sweep_runs_a_two_point_smoke_grid_and_plots(tmp_path: Path) -> None:
    path = _sweep_file(tmp_path, [16, -1])
    out = tmp_path / "out"
    proc = run_cli(
        *("-m", "megalab.cli.sweep", str(path), "--smoke", "--seeds", "1", "--out", str(out)),
        "model.backbone.num_layers=1",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    folder = out / path.stem
    manifest = json.loads((folder / "sweep.json").read_text())
    assert manifest["parameters"] == ["model.backbone.chunk_size", "seed"] and manifest["smoke"]
    records = [json.loads((folder / str(i) / "metrics.json").read_text()) for i in range(2)]
    assert [r["global_step"] for r in records] == [2, 2]
    assert {r["experiment"] for r in records} == {"mega/lra_listops"}

    from megalab.cli import tables

    assert tables.main([str(out)]) == 0
    plot = out / "chunk_size.png"
    assert plot.is_file() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "table.md").read_text()
    # Not the paper's configuration (one layer, chunk sizes of the grid): both runs are listed
    # apart from the paper rows, each with what differs and its step count.
    for chunk in (16, -1):
        assert f"| mega/lra_listops | `model.backbone.chunk_size={chunk}` |" in text
    assert text.count("| 2 (smoke) |") == 2


def test_cpu_smoke_skips_seqboat_full_on_pathx_but_runs_seqboat(tmp_path: Path) -> None:
    """SeqBoat-full attends over every activated pixel of Path-X whatever its chunk_size (the
    window of SeqBoat): quadratic in 16K on a CPU, so the smoke skips it; SeqBoat's window of
    256 runs."""
    s = sw.load_sweep(ROOT / "sweeps" / "seqboat_lra_pathx.yaml")
    plan = sw.plan_sweep(
        s, tmp_path / "out", seeds=[1], smoke_overrides=sw.SMOKE_OVERRIDES, smoke=True
    )
    skipped = {p.params["experiment"]: p.skip for p in plan.skipped}
    assert "on a CPU" in skipped["seqboat_full/lra_pathx"]
    assert "seqboat/lra_pathx" not in skipped
