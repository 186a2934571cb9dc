"""Test a checkpoint: `python -m megalab.eval ckpt_path=<run>/checkpoints/last.ckpt`.

When the checkpoint lies in a megalab run directory, the run's own `data`, `model`, `task`,
`optim` and `scheduler` configs are used, so no overrides need repeating; command-line
overrides of those groups still apply on top. Writes `eval_metrics.json` into this evaluation's
output directory and, for a checkpoint of a megalab run, into that run's directory, where
`megalab-tables` takes its metrics over the ones the training run recorded.
"""

from __future__ import annotations

from megalab.utils.runtime import configure_runtime, log_settings

# Allocator and OpenMP settings must precede the first import of torch (docs/benchmarks.md).
configure_runtime()

import logging  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import hydra  # noqa: E402
import yaml  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402

from megalab.memory import lightning_trainer_config  # noqa: E402
from megalab.utils import run as run_utils  # noqa: E402
from megalab.utils.paths import CONFIG_DIR  # noqa: E402

log = logging.getLogger(__name__)

RUN_GROUPS = ("data", "model", "task", "optim", "scheduler", "monitor")


def find_run_config(ckpt_path: Path) -> Path | None:
    """The `.hydra/config.yaml` of the run a checkpoint belongs to, if any."""
    for parent in list(ckpt_path.resolve().parents)[:3]:
        candidate = parent / ".hydra" / "config.yaml"
        if candidate.exists():
            return candidate
    return None


def merge_run_config(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Replace this config's model/data/task groups with the checkpoint's run config."""
    run_cfg_path = find_run_config(Path(cfg.ckpt_path))
    if run_cfg_path is None or not cfg.get("use_run_config", True):
        return cfg
    log.info("using the run config %s", run_cfg_path)
    run_cfg = OmegaConf.load(run_cfg_path)
    with open_dict(cfg):
        for key in RUN_GROUPS:
            if key in run_cfg:
                cfg[key] = run_cfg[key]
        ours = [o for o in overrides if o.lstrip("+~").split(".")[0].split("=")[0] in RUN_GROUPS]
        for item in ours:
            key, _, value = item.lstrip("+").partition("=")
            OmegaConf.update(cfg, key, yaml.safe_load(value) if value else None, force_add=True)
    return cfg


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Run `trainer.test` on `cfg.ckpt_path`; return and save the metrics."""
    try:
        return _evaluate(cfg)
    finally:
        run_utils.finish_wandb()


def _evaluate(cfg: DictConfig) -> dict[str, Any]:
    if not Path(cfg.ckpt_path).exists():
        raise FileNotFoundError(f"checkpoint not found: {cfg.ckpt_path}")
    datamodule = hydra.utils.instantiate(cfg.data)
    task = hydra.utils.instantiate(cfg.task)
    loggers = run_utils.instantiate_loggers(cfg.get("logger"))
    trainer = hydra.utils.instantiate(
        lightning_trainer_config(cfg.trainer), logger=loggers or False, callbacks=[]
    )
    results = trainer.test(task, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    metrics = {k: run_utils.to_number(v) for k, v in (results[0] if results else {}).items()}
    record: dict[str, Any] = {"ckpt_path": str(cfg.ckpt_path), "metrics": metrics}
    out = Path(cfg.paths.output_dir) / "eval_metrics.json"
    run_utils.write_metrics(out, record)
    run_cfg_path = find_run_config(Path(cfg.ckpt_path))
    if run_cfg_path is not None:
        # The training run's copy is what `megalab-tables` reads over the run's own test
        # numbers, e.g. a language model tested with the paper's longer chunks.
        run_dir = run_cfg_path.parent.parent
        if run_dir.resolve() != out.parent.resolve():
            run_utils.write_metrics(
                run_dir / "eval_metrics.json", {**record, "eval_dir": str(out.parent)}
            )
    return record


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="eval")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    log_settings()
    overrides = list(HydraConfig.get().overrides.task)
    cfg = merge_run_config(cfg, overrides)
    record = evaluate(cfg)
    for key, val in sorted(record["metrics"].items()):
        if isinstance(val, float):
            print(f"{key} = {val:.4f}")


if __name__ == "__main__":
    main()
