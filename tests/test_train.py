"""End-to-end: training, evaluation, resuming, multirun, DDP and loggers."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning import Callback

from conftest import FAST, ROOT, run_cli
from megalab.cli.eval import evaluate
from megalab.cli.train import train
from megalab.utils.checkpointing import RunInterrupted
from megalab.utils.paths import CONFIG_DIR


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def test_train_writes_metrics_config_and_checkpoints(compose_cfg, tmp_path: Path) -> None:
    cfg = compose_cfg()
    record = train(cfg)
    run = tmp_path / "run"
    assert (run / "config.yaml").exists() and (run / "checkpoints" / "last.ckpt").exists()
    saved = read_metrics(run)
    assert saved["global_step"] == 2 == record["global_step"]
    for key in ("train/loss", "val/loss", "val/acc", "val/acc_best", "test/acc", "test/loss"):
        assert key in saved["metrics"], key
    assert saved["monitor"] == "val/acc" and saved["params"]["total"] > 0
    assert 0.0 <= saved["metrics"]["test/acc"] <= 1.0
    assert not list(run.rglob("*.tmp")), "no partial files are left behind"


def test_a_run_prints_nothing_of_lightning_that_is_not_about_it(
    compose_cfg, caplog: pytest.LogCaptureFixture
) -> None:
    """Lightning's cloud-service tips, its `weights_only` note on every save and a deprecation
    raised inside Lightning are dropped; what Lightning says of the run still shows."""
    with caplog.at_level("INFO"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(compose_cfg())
    said = caplog.messages
    assert any(m.startswith("GPU available") for m in said), said  # Lightning is heard
    assert not [m for m in said if "Tip:" in m or "`weights_only` was not set" in m], said
    assert not [w for w in caught if "LeafSpec" in str(w.message)]


def test_the_sync_dist_hint_is_dropped_for_megalabs_own_values_only() -> None:
    """Lightning's DDP hint to log with `sync_dist=True` is advice to the code that logs: for
    megalab's values (evaluation ones already reduced, training ones each process's own by
    design) it is dropped; for a value of another name it still shows."""
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    from megalab.utils.run import quiet_lightning

    def hint(name: str) -> str:  # Lightning's text (logger_connector/result.py)
        return (
            f"It is recommended to use `self.log({name!r}, ..., sync_dist=True)` when logging "
            "on epoch level in distributed setting to accumulate the metric across devices."
        )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning()
        for name in ("val/loss", "test/ppl", "val/bleu", "train/aux/tau", "my/metric"):
            warnings.warn(hint(name), PossibleUserWarning, stacklevel=1)
    shown = [str(w.message).split("'")[1] for w in caught]
    assert shown == ["my/metric"]


def test_other_ranks_keep_only_megalabs_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """`log_from_rank_zero`: on a DDP rank other than zero, megalab's info and warnings are
    dropped (rank zero says them), its errors and other libraries' records pass."""
    from lightning.pytorch.utilities import rank_zero_only

    from megalab.utils.run import log_from_rank_zero

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{record.name}:{record.getMessage()}")

    handler = Collect(logging.DEBUG)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        log_from_rank_zero()
        log_from_rank_zero()  # twice: one filter
        assert len(handler.filters) == 1
        ours, theirs = logging.getLogger("megalab.cli.train"), logging.getLogger("lightning.x")
        for logger in (ours, theirs):
            logger.setLevel(logging.INFO)
        monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
        ours.info("info 1")
        ours.warning("warning 1")
        ours.error("error 1")
        logging.getLogger("__main__").warning("warning 1")  # python -m megalab.cli.train
        theirs.info("theirs 1")
        monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)
        ours.info("info 0")
        ours.warning("warning 0")
    finally:
        root.removeHandler(handler)
        for logger in (ours, theirs):
            logger.setLevel(logging.NOTSET)
    assert seen == [
        "megalab.cli.train:error 1",
        "lightning.x:theirs 1",
        "megalab.cli.train:info 0",
        "megalab.cli.train:warning 0",
    ]


def test_eval_and_generate_find_the_folder_train_uses(tmp_path: Path) -> None:
    """Run from any folder, `megalab-eval` and `megalab-generate` resolve `paths.root_dir` (so
    `data/` and `logs/`) as `megalab-train` does: they read a run's data where it trained
    (they looked below the current folder instead, and did not find it)."""
    script = (
        "import os\n"
        "roots = []\n"
        "for command in ('train', 'eval', 'generate'):\n"
        "    __import__('megalab.cli.' + command)\n"
        "    roots.append(os.environ.pop('MEGALAB_ROOT', None))\n"
        "print(roots)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MEGALAB_ROOT"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    train_root, eval_root, generate_root = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert train_root is not None and eval_root == train_root and generate_root == train_root


def test_fast_dev_run_then_eval_on_a_checkpoint(compose_cfg, tmp_path: Path) -> None:
    train(compose_cfg("debug=fdr", f"paths.output_dir={tmp_path / 'fdr'}"))
    cfg = compose_cfg()
    train(cfg)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    eval_cfg = compose_cfg(f"ckpt_path={ckpt}", config="eval")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = evaluate(eval_cfg)
    assert set(record["metrics"]) == {"test/acc", "test/loss"}
    # Lightning asks a test for the callbacks the checkpoint was trained with; a test needs none.
    assert not [w for w in caught if "callbacks used to create" in str(w.message)]
    assert (tmp_path / "run" / "eval_metrics.json").exists()


@pytest.mark.parametrize("debug", ["overfit", "limit"])
def test_debug_options_run_with_an_experiment_that_validates_by_steps(
    compose_cfg, tmp_path: Path, debug: str
) -> None:
    """The quickstart validates every 500 batches: `debug=overfit` (3 batches an epoch) and
    `debug=limit` (20) validate per epoch instead, not failing on an interval longer than their
    epochs or never validating; `limit` takes a few batches of a small split too."""
    cfg = compose_cfg(
        "experiment=quickstart",
        f"debug={debug}",
        "data.num_train=1000",  # the quickstart's data, smaller (generated here)
        "data.num_val=200",
        "data.num_test=200",
        "logger=none",
        "trainer.enable_progress_bar=false",
        fast=False,
    )
    cfg.paths.data_dir = str(tmp_path / "data")
    record = train(cfg)
    assert record["global_step"] == cfg.trainer.max_steps and "test/acc" in record["metrics"]
    assert record["best_checkpoint"] is not None, "it validated"


SCHEDULERS = sorted(p.stem for p in (CONFIG_DIR / "scheduler").glob("*.yaml"))
OPTIMIZERS = sorted(p.stem for p in (CONFIG_DIR / "optim").glob("*.yaml"))


@pytest.mark.parametrize(
    ("optim", "scheduler"),
    [("adamw", s) for s in SCHEDULERS] + [(o, "none") for o in OPTIMIZERS if o != "adamw"],
)
def test_every_optimizer_and_schedule_of_the_groups_trains(
    compose_cfg, tmp_path: Path, optim: str, scheduler: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each file of the optim and scheduler groups trains (scheduler=none failed with "'dict'
    object is not callable": its empty config reached the task as a mapping), with the quickstart
    experiment's warmup_steps, which scheduler=none does not use and says so."""
    cfg = compose_cfg("experiment=quickstart", f"optim={optim}", f"scheduler={scheduler}")
    with caplog.at_level(logging.INFO, logger="megalab"):
        assert train(cfg)["global_step"] == 2
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    lr = saved["optimizer_states"][0]["param_groups"][0]["lr"]
    if scheduler == "none":
        assert saved["lr_schedulers"] == [] and lr == cfg.optim.optimizer.lr
        assert "the experiment's scheduler settings (warmup_steps=200) are not used" in caplog.text
    else:
        assert len(saved["lr_schedulers"]) == 1


def test_a_run_without_the_checkpoint_callbacks_writes_none_and_says_what_it_loses(
    compose_cfg, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`callbacks=early_stopping` keeps that callback alone. Lightning then added a checkpoint of
    its own below the logger's folder and tested from it, and nothing said the run could no
    longer resume or save on a signal."""
    cfg = compose_cfg("callbacks=early_stopping", "logger=csv")
    with caplog.at_level(logging.WARNING, logger="megalab"):
        record = train(cfg)
    assert record["global_step"] == 2 and "test/loss" in record["metrics"]
    assert not list((tmp_path / "run").rglob("*.ckpt"))
    warned = [r.getMessage() for r in caplog.records if "writes no last.ckpt" in r.getMessage()]
    assert len(warned) == 1
    assert "(callbacks=early_stopping replaces the default callbacks)" in warned[0]
    assert "callbacks.<name>=null" in warned[0]


def test_process_count_warning_only_when_resuming(
    compose_cfg, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint saved by 2 DDP processes: resuming it in 1 process warns that its random
    numbers cannot continue exactly; evaluating its weights continues nothing and says
    nothing of it."""
    from megalab.utils.checkpointing.files import write_checkpoint

    train(compose_cfg("trainer.max_steps=2", "test=false"))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    ranks = checkpoint["resume_states"]["ranks"]
    checkpoint["resume_states"]["ranks"] = [ranks[0], ranks[0]]  # as 2 processes save it
    write_checkpoint(checkpoint, ckpt)
    warning = "the checkpoint comes from 2 process(es), this run has 1"
    with caplog.at_level("WARNING", logger="megalab"):
        evaluate(compose_cfg(f"ckpt_path={ckpt}", config="eval"))
        assert warning not in caplog.text
        train(compose_cfg("trainer.max_steps=3", "test=false", "ckpt_path=last"))
    assert warning in caplog.text


def test_eval_of_a_run_records_its_metrics_in_the_run(compose_cfg, tmp_path: Path) -> None:
    """An evaluation in its own output dir also leaves its metrics where megalab-tables looks."""
    from omegaconf import OmegaConf

    cfg = compose_cfg()
    train(cfg)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(exist_ok=True)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(compose_cfg()))
    ckpt = run / "checkpoints" / "last.ckpt"
    eval_cfg = compose_cfg(
        f"ckpt_path={ckpt}", f"paths.output_dir={tmp_path / 'eval'}", config="eval"
    )
    record = evaluate(eval_cfg)
    own = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())
    in_run = json.loads((run / "eval_metrics.json").read_text())
    assert own["metrics"] == in_run["metrics"] == record["metrics"]
    assert in_run["eval_dir"] == str(tmp_path / "eval")


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)


class SigtermAt(Callback):
    """Send this process SIGTERM after optimizer step `step` (an interrupted run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class SleepAt(Callback):
    """Sleep 1.1 s after the first batch with `step` optimizer steps done and index `batch` in
    its epoch (a batch that outlasts a 1 s `max_time`)."""

    def __init__(self, step: int, batch: int) -> None:
        self.step, self.batch, self.slept = step, batch, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (trainer.global_step, batch_idx) == (self.step, self.batch) and not self.slept:
            self.slept = True
            time.sleep(1.1)


# The short run the resume tests interrupt: 2 batches an epoch, 5 steps, a constant rate.
RESUME_SETTINGS = (
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "test=false",
    "scheduler=constant",
    "scheduler.warmup_steps=2",
    "trainer.max_steps=5",
)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """The folder of the uninterrupted run of `RESUME_SETTINGS` plus `overrides`, trained once
    for all the cases that compare with it (in a folder of the module's: a passing test's own
    tmp_path is removed when it ends)."""
    runs: dict[tuple[str, ...], Path] = {}

    def straight(compose_cfg: Callable[..., Any], *overrides: str) -> Path:
        if overrides not in runs:
            cfg = compose_cfg(*RESUME_SETTINGS, *overrides)
            cfg.paths.output_dir = str(tmp_path_factory.mktemp("straight"))
            train(cfg)
            runs[overrides] = Path(cfg.paths.output_dir)
        return runs[overrides]

    return straight


def assert_same_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two checkpoints' weights, bit for bit."""
    for name, value in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stop", [2, 3], ids=["epoch-boundary", "mid-epoch"])
def test_resume_continues_exactly(
    compose_cfg, tmp_path: Path, stop: int, straight_run: Callable[..., Path]
) -> None:
    """Train 5 steps straight, or get SIGTERM after `stop` steps and resume: same weights and
    optimizer. With the default callbacks: the signal saves `last.ckpt` (the fault-injection
    suite in tests/reliability covers kills without warning, DDP and the logs)."""
    common = RESUME_SETTINGS
    straight_dir = straight_run(compose_cfg)
    first = compose_cfg(
        *common, "+callbacks.stop._target_=test_train.SigtermAt", f"+callbacks.stop.step={stop}"
    )
    first.paths.output_dir = str(tmp_path / "resumed")
    with pytest.raises(RunInterrupted, match="SIGTERM received"):
        train(first)
    second = compose_cfg("ckpt_path=last", *common)
    second.paths.output_dir = str(tmp_path / "resumed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = train(second)
    assert record["global_step"] == 5
    # What Lightning says of a resumed run in general is untrue of this one: the folder holds
    # the run's own checkpoints, and the loader resumes mid-epoch (compared below).
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "is not empty" in m or "not resumable" in m], said

    a = _final_weights(straight_dir)
    b = _final_weights(tmp_path / "resumed")
    assert a["global_step"] == b["global_step"] == 5
    assert_same_weights(a, b)
    opt_a, opt_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    for idx, state in opt_a.items():
        for key, value in state.items():
            torch.testing.assert_close(opt_b[idx][key], value, rtol=0, atol=0)
    assert a["lr_schedulers"][0]["last_epoch"] == b["lr_schedulers"][0]["last_epoch"]


def test_same_seed_gives_same_metrics(compose_cfg, tmp_path: Path) -> None:
    runs = []
    for name in ("a", "b"):
        cfg = compose_cfg("seed=7")
        cfg.paths.output_dir = str(tmp_path / name)
        runs.append(train(cfg)["metrics"])
    # Measurements of the machine (time, memory) differ between runs; everything else may not.
    measured = {"train/tokens_per_sec", "train/step_s", "train/peak_mem_mb"}
    measured |= {"train/step_tokens_per_s"}

    def learned(m: dict) -> dict:
        return {k: v for k, v in m.items() if k not in measured and not k.startswith("eff/")}

    assert set(runs[0]) == set(runs[1])
    assert learned(runs[0]) == learned(runs[1])


@pytest.mark.parametrize("profiler", ["simple", "pytorch"])
def test_a_profiled_run_writes_the_report_in_its_folder(
    compose_cfg, tmp_path: Path, profiler: str
) -> None:
    """`trainer.profiler` was not a key (it needed `+`), and by name Lightning printed its
    report on the console, hundreds of lines after the run's own output."""
    assert train(compose_cfg(f"trainer.profiler={profiler}"))["global_step"] == 2
    run = tmp_path / "run"
    report = (run / "fit-profile.txt").read_text()
    assert report.startswith("FIT Profiler Report") and "run_training_batch" in report
    assert (run / "test-profile.txt").is_file()
    if profiler == "pytorch":  # and Chrome traces beside it
        assert list(run.glob("*.pt.trace.json")), sorted(p.name for p in run.iterdir())


@pytest.mark.parametrize("logger", ["csv", "wandb"])
def test_loggers_write_their_files(
    compose_cfg, tmp_path: Path, logger: str, capfd: pytest.CaptureFixture
) -> None:
    cfg = compose_cfg(f"logger={logger}")
    train(cfg)
    run = tmp_path / "run"
    if logger == "csv":
        text = (run / "csv" / "metrics.csv").read_text()
        assert "train/loss" in text and "val/acc" in text
    else:
        assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))
        # W&B's warning of the deprecated `anonymous` setting, which Lightning passed unasked
        assert "anonymous" not in capfd.readouterr().err


def test_resumed_run_logs_to_the_same_wandb_run(compose_cfg, tmp_path: Path) -> None:
    """W&B names a run's folder <mode>-<time to the second>-<id>, plus -1, -2... when a run of
    the same id starts within the same second (fast runs): the id is the `run-<id>.wandb` file
    inside, and resuming reads it from <run>/wandb/run_id, never from folder names."""
    train(compose_cfg("logger=wandb", "trainer.max_steps=2"))
    train(compose_cfg("logger=wandb", "trainer.max_steps=4", "ckpt_path=last"))
    train(compose_cfg("logger=wandb", "trainer.max_steps=6", "ckpt_path=last"))
    files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    ids = {p.stem.removeprefix("run-") for p in files}
    assert len(files) == 3 and len(ids) == 1
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert f"id: {ids.pop()}" in saved


def test_unknown_override_fails_with_hydra_message(fixture_data_dir: Path) -> None:
    proc = run_cli(
        "-m",
        "megalab.cli.train",
        "model.backbone.num_layerz=2",
        f"paths.data_dir={fixture_data_dir}",
    )
    assert proc.returncode != 0
    assert "Could not override 'model.backbone.num_layerz'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("-m", "megalab.cli.train", "model=transformerr")
    assert proc.returncode != 0
    assert "Could not find 'model/transformerr'" in proc.stderr
    assert "Available options" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_config_value_fails_early_with_a_clear_message(compose_cfg) -> None:
    cfg = compose_cfg("model.backbone.positions=rotary")
    expected = "model.backbone.positions='rotary': expected one of sinusoidal, learned, none"
    with pytest.raises(Exception, match=re.escape(expected)):
        train(cfg)


def test_a_config_naming_the_backbone_class_still_trains_with_a_warning(
    compose_cfg, tmp_path: Path
) -> None:
    """A user config written before backbones took their config object names the backbone
    class with its options beside it: it is read as the config class, and the run says so."""
    cfg = compose_cfg("model.backbone._target_=megalab.models.transformer.Transformer")
    with pytest.warns(FutureWarning, match="name its config class instead.*TransformerConfig"):
        record = train(cfg)
    assert record["global_step"] == 2
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "_target_: megalab.models.transformer.TransformerConfig" in saved


def test_multirun_gives_each_job_its_own_dir(fixture_data_dir: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "megalab.cli.train",
        "-m",
        "model.d_model=16,32",
        *FAST,
        f"paths.data_dir={fixture_data_dir}",
        f"hydra.sweep.dir={sweep}",
        "test=false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [read_metrics(sweep / str(i)) for i in range(2)]
    assert records[0]["params"]["total"] < records[1]["params"]["total"]


def test_a_multirun_jobs_command_line_keeps_the_flags_and_takes_the_jobs_overrides() -> None:
    from megalab.utils.run import single_run_argv

    argv = ["megalab-train", "-m", "-cn", "train", "seed=1,2", "--config-dir=/c", "x.y=3"]
    assert single_run_argv(argv, ["seed=2", "x.y=3"]) == [
        "megalab-train", "-cn", "train", "--config-dir=/c", "seed=2", "x.y=3"
    ]  # fmt: skip


def test_multirun_with_a_trainer_that_starts_processes_runs_each_job_once(
    fixture_data_dir: Path, tmp_path: Path
) -> None:
    """`-m trainer=ddp_cpu,cpu,ddp_cpu`: each two-process job starts its other process for
    that job alone, and the next starts its own. Lightning relaunches the command line, `-m`
    included: the other process ran a sweep of its own, in step only while every job had the
    same processes (with `trainer=cpu,ddp_cpu` it trained job 0 again, into job 0's folder,
    and the run was killed)."""
    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "megalab.cli.train",
        "-m",
        *FAST,
        "trainer=ddp_cpu,cpu,ddp_cpu",  # after FAST's trainer=cpu
        "trainer.max_steps=2",
        "data.batch_size=4",
        f"paths.data_dir={fixture_data_dir}",
        f"paths.log_dir={tmp_path / 'logs'}",
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert said.count("Launching 3 jobs locally") == 1, said[-3000:]
    assert said.count("GLOBAL_RANK: 1") == 2, said[-3000:]
    for job in ("0", "1", "2"):
        assert read_metrics(sweep / job)["global_step"] == 2
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "2", "multirun.yaml"]
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_quickstart_beats_majority_class(tmp_path: Path) -> None:
    proc = run_cli(
        "-m",
        "megalab.cli.train",
        "experiment=quickstart",
        f"hydra.run.dir={tmp_path}",
        f"paths.data_dir={tmp_path / 'data'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_metrics(tmp_path)["metrics"]["test/acc"] > 0.3


def train_ddp_cpu(*overrides: str, env: dict[str, str] | None = None):
    """`megalab-train` with the test settings on two CPU processes (2 steps, batches of 4;
    `overrides` come last)."""
    return run_cli(
        "-m", "megalab.cli.train", *FAST, "trainer=ddp_cpu", "trainer.max_steps=2",
        "data.batch_size=4", *overrides, env=env,
    )  # fmt: skip


def test_ddp_cpu_runs_two_processes(fixture_data_dir: Path, tmp_path: Path) -> None:
    proc = train_ddp_cpu(f"paths.data_dir={fixture_data_dir}", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = read_metrics(tmp_path)
    assert record["global_step"] == 2
    said = proc.stderr + proc.stdout
    assert "GLOBAL_RANK: 1" in said or "world_size=2" in proc.stderr
    # Both processes run the whole program; what megalab says, it says once, from rank zero.
    log_file = (tmp_path / "train.log").read_text()
    for line in ("metrics written to", "efficiency: train_step_s", "param group default"):
        assert said.count(line) == 1, (line, said[-3000:])
        assert log_file.count(line) == 1, (line, log_file)
    assert proc.stdout.count("test/acc = ") == 1, proc.stdout


def test_ddp_cpu_missing_data_is_one_message_last(tmp_path: Path) -> None:
    """Rank zero alone prepares the data and finds it missing; the other process, waiting for
    it, is stopped rather than ending in a traceback of its own after the message."""
    proc = train_ddp_cpu(
        "data.generate_if_missing=false",
        f"paths.data_dir={tmp_path / 'no_data'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "GLOBAL_RANK: 1" in said, said[-3000:]
    assert "Traceback" not in said and "Connection closed" not in said, said[-3000:]
    assert said.count("Error:") == 1, said[-3000:]
    last = proc.stderr.strip().splitlines()[-2]
    assert last.startswith("Error: LRA ListOps files missing"), proc.stderr[-3000:]


def test_ddp_cpu_signal_to_one_process_stops_all_with_one_message(
    fixture_data_dir: Path, tmp_path: Path
) -> None:
    """SIGINT reaches rank 1 alone (`kill -INT <pid>`): both processes save and stop at the
    same step, and the message, once and from rank zero, names the signal that arrived (rank
    zero said SIGTERM of a signal it had not received) with the exit status of SIGINT."""
    proc = train_ddp_cpu(
        "trainer.max_steps=50",
        "+callbacks.fault._target_=faults.Fault",
        "+callbacks.fault.phase=step",
        "+callbacks.fault.step=2",
        "+callbacks.fault.how=int",
        "+callbacks.fault.rank=1",
        f"paths.data_dir={fixture_data_dir}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests/reliability")])},
    )
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert said.count("Error:") == 1, said[-3000:]
    assert "Error: SIGINT received: training stopped at step" in said, said[-3000:]
    assert "ckpt_path=last" in proc.stderr.splitlines()[-1]
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def test_eval_uses_the_run_config_with_overrides(compose_cfg, tmp_path: Path) -> None:
    from megalab.cli.eval import merge_run_config

    # rotary bias: its parameters do not depend on the chunk size, so the test chunk can differ
    mega = ("model=mega", "model.backbone.chunk_size=16", "model.backbone.rel_pos_bias=rotary")
    train(compose_cfg(*mega))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    (tmp_path / "run" / ".hydra").mkdir(exist_ok=True)
    # What Hydra saves for a run: the composed, unresolved config.
    from omegaconf import OmegaConf

    run_cfg = compose_cfg(*mega)
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(run_cfg))
    eval_cfg = compose_cfg(f"ckpt_path={ckpt}", config="eval")
    assert eval_cfg.model.backbone._target_.endswith("TransformerConfig")
    merged = merge_run_config(eval_cfg, ["model.backbone.chunk_size=8", f"ckpt_path={ckpt}"])
    assert merged.task.backbone._target_ == "megalab.models.mega.MegaConfig"
    assert merged.task.backbone.chunk_size == 8  # the override reaches the interpolated task
    record = evaluate(merged)
    assert set(record["metrics"]) == {"test/acc", "test/loss"}


def test_a_run_too_short_to_validate_says_why_it_tests_its_final_weights(
    compose_cfg, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = compose_cfg("trainer.val_check_interval=100", "trainer.check_val_every_n_epoch=null")
    with caplog.at_level("WARNING", logger="megalab.cli.train"):
        record = train(cfg)
    assert record["best_checkpoint"] is None and "test/acc" in record["metrics"]
    assert (
        "no best checkpoint (no validation in the run's 2 steps: it runs every 100 training "
        "batches (trainer.val_check_interval)): testing the final weights"
    ) in caplog.text


def test_testing_another_runs_checkpoint_says_nothing_of_its_best_checkpoint_record(
    compose_cfg, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`train=false ckpt_path=<a run's best>` (LaMemo's Fig. 5 tests) reads the weights only:
    no "run folder moved" note, no warning of files "forgotten", no best score or training
    speed borrowed from the run that wrote it."""
    record = train(compose_cfg())
    cfg = compose_cfg("train=false", f"ckpt_path={record['best_checkpoint']}")
    cfg.paths.output_dir = str(tmp_path / "test_only")
    with caplog.at_level("INFO"):
        tested = train(cfg)
    assert "test/acc" in tested["metrics"] and tested["monitor_value"] is None
    # the steps are those of the weights tested; no table marks it as a run stopped early
    assert tested["global_step"] == record["global_step"] == 2 and tested["finished"] is None
    # the efficiency numbers are this run's: it trained no step
    assert "eff/train_step_s" not in tested["metrics"], tested["metrics"]
    assert tested["metrics"]["eff/eval_tokens_per_s"] > 0
    said = caplog.text
    assert "run folder moved" not in said and "forgotten" not in said, said


def _best_files(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("best-*.ckpt"))


def test_a_moved_run_resumes_with_its_best_record_and_another_run_continues_in_its_own(
    compose_cfg, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run folder moved elsewhere resumes with its best-checkpoint record rebased: the top-k
    bookkeeping goes on managing the moved best file (one best file, not a second beside it).
    Training continued from that run's checkpoint into a new folder says so once, leaves the
    first run's files as they are and keeps its own best."""
    import shutil

    train(compose_cfg("trainer.max_steps=2", "test=false"))
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "run", moved)
    assert len(_best_files(moved)) == 1
    resumed = compose_cfg("trainer.max_steps=4", "test=false", "ckpt_path=last")
    resumed.paths.output_dir = str(moved)
    with caplog.at_level("INFO", logger="megalab"):
        record = train(resumed)
    assert "run folder moved" in caplog.text and "outside" not in caplog.text, caplog.text
    assert len(_best_files(moved)) == 1, _best_files(moved)
    assert Path(record["best_checkpoint"]).parent == moved / "checkpoints"

    caplog.clear()
    before = sorted(p.name for p in (moved / "checkpoints").iterdir())
    other = compose_cfg(
        "trainer.max_steps=6", "test=false", f"ckpt_path={moved}/checkpoints/last.ckpt"
    )
    other.paths.output_dir = str(tmp_path / "new")
    with caplog.at_level("INFO", logger="megalab"):
        record = train(other)
    said = caplog.text
    assert "run folder moved" not in said and "outside" not in said, said
    assert said.count(f"continuing from a checkpoint of {moved}:") == 1, said
    assert sorted(p.name for p in (moved / "checkpoints").iterdir()) == before
    assert len(_best_files(tmp_path / "new")) == 1
    assert Path(record["best_checkpoint"]).parent == tmp_path / "new" / "checkpoints"


def _assert_equal_but(a: dict[str, Any], b: dict[str, Any], but: str = "-") -> None:
    """Two checkpoints hold the same weights, bit for bit, but those named `but...`."""
    a, b = ({"state_dict": {k: v for k, v in c["state_dict"].items() if not k.startswith(but)}}
            for c in (a, b))  # fmt: skip
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert_same_weights(a, b)


def test_a_run_starts_from_another_runs_weights_with_its_own_optimizer_and_step(
    compose_cfg, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """init_from (fine-tuning) takes the weights of a checkpoint or of an export and nothing
    else: the step, the optimizer and the schedule start afresh. Weights of another shape are
    named, init_skip keeps them fresh, and a resumed run takes its weights from its own
    checkpoint."""
    from megalab.pretrained import export_run
    from megalab.tasks.base import CheckpointMismatchError

    train(compose_cfg("test=false"))
    source = tmp_path / "run" / "checkpoints" / "last.ckpt"
    given = _final_weights(tmp_path / "run")
    export = export_run(tmp_path / "run", tmp_path / "export", checkpoint="last")

    def start(name: str, *overrides: str) -> dict:
        # A learning rate far too small to move a float32 weight: the weights stay as given.
        cfg = compose_cfg("optim.optimizer.lr=1e-30", "test=false", *overrides)
        cfg.paths.output_dir = str(tmp_path / name)
        return train(cfg)

    for name, init in (("from_ckpt", source), ("from_export", export)):
        with caplog.at_level(logging.INFO, logger="megalab"):
            assert start(name, f"init_from={init}")["global_step"] == 2  # not 4: a fresh step
        assert f"init_from: {len(given['state_dict'])} weights from {init}" in caplog.text
        started = _final_weights(tmp_path / name)
        _assert_equal_but(started, given)
        assert started["lr_schedulers"][0]["last_epoch"] == 2

    with pytest.raises(CheckpointMismatchError, match=r"other shapes: head\.fc1\.weight .*"
                       r"init_skip=\[head\]"):  # fmt: skip
        start("other_head", f"init_from={source}", "model.head_hidden=32")
    start("new_head", f"init_from={source}", "model.head_hidden=32", "init_skip=[head]")
    new_head = _final_weights(tmp_path / "new_head")
    _assert_equal_but(new_head, given, "head.")
    assert new_head["state_dict"]["head.fc1.weight"].shape[0] == 32
    with pytest.raises(ValueError, match="init_skip: 'haed' names no weight"):
        start("typo", f"init_from={source}", "init_skip=[haed]")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megalab"):
        cfg = compose_cfg("test=false", "trainer.max_steps=4", "ckpt_path=last",
                          f"init_from={source}")  # fmt: skip
        cfg.paths.output_dir = str(tmp_path / "from_ckpt")
        assert train(cfg)["global_step"] == 4
    assert "init_from is not used: the weights come from" in caplog.text


def test_a_checkpoint_of_other_model_options_fails_with_the_names_that_differ(
    compose_cfg, tmp_path: Path
) -> None:
    """Testing (or resuming) a checkpoint with other model options: one message naming the
    weights that differ and how to give the right options, not Lightning's traceback."""
    from megalab.tasks.base import CheckpointMismatchError

    record = train(compose_cfg())
    cfg = compose_cfg("train=false", f"ckpt_path={record['best_checkpoint']}", "model.d_model=24")
    cfg.paths.output_dir = str(tmp_path / "other")
    with pytest.raises(CheckpointMismatchError, match=r"other shapes: .* here .*megalab-eval"):
        train(cfg)


def test_eval_without_a_checkpoint_file_says_what_to_give(compose_cfg, tmp_path: Path) -> None:
    """No `ckpt_path`, or a run folder instead of one of its checkpoints: one message, before
    a config is read (megalab-eval and megalab-generate load through `merge_run_config`)."""
    from megalab.cli.eval import merge_run_config
    from megalab.utils.run_folder import RunFolderError

    with pytest.raises(ValueError, match=r"no checkpoint given: add ckpt_path=<run>/checkpoints/"):
        merge_run_config(compose_cfg(config="eval"), [])
    run = tmp_path / "a_run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    cfg = compose_cfg(f"ckpt_path={run}", config="eval")
    folder = r"is a folder: give one checkpoint file, e\.g\. .*last\.ckpt"
    with pytest.raises(RunFolderError, match=folder):
        merge_run_config(cfg, [f"ckpt_path={run}"])
    # and training (resume, or train=false) as well
    with pytest.raises(RunFolderError, match=folder):
        train(compose_cfg(f"ckpt_path={run}"))


@pytest.mark.parametrize("accumulate", [1, 2], ids=["step", "mid-accumulation"])
def test_a_run_out_of_time_saves_says_so_and_resumes_exactly(
    compose_cfg, tmp_path: Path, straight_run: Callable[..., Path], accumulate: int
) -> None:
    """`trainer.max_time` (Lightning's Timer; here 1 s, spent by one batch): the run saves
    `last.ckpt`, records `stop_reason: time_limit` (not early stopping, which the tables would
    footnote), and `ckpt_path=last` with more time continues exactly. Under gradient
    accumulation the time runs out inside one (the first micro-batch of an epoch) and the run
    stops after its optimizer step."""
    accumulation = f"trainer.accumulate_grad_batches={accumulate}"
    common = (*RESUME_SETTINGS, accumulation)
    straight_dir = straight_run(compose_cfg, accumulation)
    first = compose_cfg(
        *common,
        "trainer.max_time=00:00:00:01",
        "+callbacks.slow._target_=test_train.SleepAt",
        "+callbacks.slow.step=1",
        "+callbacks.slow.batch=0",  # mid-epoch after step 1; or mid-accumulation of step 2
    )
    first.paths.output_dir = str(tmp_path / "timed")
    record = train(first)
    assert record["stop_reason"] == "time_limit" and record["finished"] is False, record
    assert 0 < record["global_step"] < 5
    second = compose_cfg(*common, "ckpt_path=last", "trainer.max_time={days: 1}")
    second.paths.output_dir = str(tmp_path / "timed")
    record = train(second)
    assert record["stop_reason"] == "schedule" and record["global_step"] == 5
    assert_same_weights(_final_weights(straight_dir), _final_weights(tmp_path / "timed"))
