"""Test a checkpoint: `megalab-eval ckpt_path=<run>/checkpoints/last.ckpt`.

`mode=long_context` scores a whole split as one long document instead, in segments with the
carried state and bounded memory, with perplexity per context-position bucket and its plot
(`megalab.long_context`; settings under `long_context.*`).

When the checkpoint lies in a megalab run directory, the run's own `data`, `model`, `task`,
`optim` and `scheduler` configs are used, so no overrides need repeating; command-line
overrides of those groups still apply on top. The data is read from the folder the run used
(its `paths.data_dir`, unless the command line gives one). A run folder is data (it may come
from anyone): its config may name only megalab's classes and the library classes megalab's
configs use (`megalab.utils.safe_config`, the loading policy), and its checkpoint is loaded with
`weights_only=True` after its checksum is verified; anything else is refused before it is
built. Evaluation never generates or downloads data unless the command line asks
(`data.generate_if_missing=true`, `data.download=true`).

Writes `eval_metrics.json` into this evaluation's output directory and, for a checkpoint of a
megalab run, into that run's directory, where `megalab-tables` takes its metrics over the ones
the training run recorded.
"""

from __future__ import annotations

from megalab.utils.runtime import configure_runtime, log_settings

# Allocator and OpenMP settings must precede the first import of torch (docs/benchmarks.md).
configure_runtime()

import logging  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from megalab.config_schema import validate as validate_config  # noqa: E402
from megalab.data.cache import caches_written_under  # noqa: E402
from megalab.run_loading import (  # noqa: E402
    RUN_GROUPS as RUN_GROUPS,
)
from megalab.run_loading import check_run_vocabulary, run_entry_point_of_a_run  # noqa: E402
from megalab.run_loading import (  # noqa: E402
    merge_run_config as merge_run_config,
)
from megalab.run_loading import (  # noqa: E402
    run_data_dir as run_data_dir,
)
from megalab.tasks.base import TaskBase  # noqa: E402
from megalab.utils import errors  # noqa: E402
from megalab.utils import run as run_utils  # noqa: E402
from megalab.utils.checkpointing import set_verification  # noqa: E402
from megalab.utils.paths import CONFIG_DIR, export_project_root  # noqa: E402
from megalab.utils.run_folder import (  # noqa: E402
    find_run_config as find_run_config,
)
from megalab.utils.safe_config import upgrade_backbone_targets  # noqa: E402

log = logging.getLogger(__name__)

# `paths.root_dir` (data, logs) is the folder `megalab-train` uses, wherever this runs from.
export_project_root()


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Run `trainer.test` on `cfg.ckpt_path`; return and save the metrics."""
    try:
        return _evaluate(cfg)
    finally:
        run_utils.finish_wandb()


def _evaluate(cfg: DictConfig) -> dict[str, Any]:
    if not Path(cfg.ckpt_path).exists():
        raise FileNotFoundError(f"checkpoint not found: {cfg.ckpt_path}")
    upgrade_backbone_targets(cfg)  # a config from before backbones took their config
    validate_config(cfg)
    # Nothing written outside the output folder: prepared data the data folder lacks goes there.
    with caches_written_under(cfg.paths.output_dir):
        return _evaluate_in(cfg)


def _evaluate_in(cfg: DictConfig) -> dict[str, Any]:
    mode = cfg.get("mode", "test")
    if mode == "long_context":
        from megalab.long_context import evaluate_long_context

        record = evaluate_long_context(cfg)
        record["metrics"] = {"long_context/loss": record["loss"], "long_context/ppl": record["ppl"]}
        return record
    if mode != "test":
        raise ValueError(f"unknown eval mode {mode!r}; choose test or long_context")
    datamodule = hydra.utils.instantiate(cfg.data)
    check_run_vocabulary(cfg, datamodule, "megalab-eval")
    task = hydra.utils.instantiate(cfg.task)
    loggers = run_utils.instantiate_loggers(cfg.get("logger"))
    trainer = run_utils.instantiate_trainer(cfg.trainer, logger=loggers or False, callbacks=[])
    set_verification(trainer, cfg.get("ckpt_verify", True))
    with (
        run_utils.untrue_warnings_silenced(run_utils.CALLBACKS_NOT_RESTORED),
        run_utils.launched_processes_stopped_on_user_error(trainer),
    ):
        results = trainer.test(task, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    metrics = {k: run_utils.to_number(v) for k, v in (results[0] if results else {}).items()}
    record = {"ckpt_path": str(cfg.ckpt_path), "metrics": metrics}
    if isinstance(task, TaskBase):  # e.g. the SacreBLEU signature (seq2seq)
        record.update(task.record_extras())
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
def hydra_main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    run_utils.log_from_rank_zero()
    log_settings()
    overrides = list(HydraConfig.get().overrides.task)
    with errors.reported(), run_utils.processes_launched_per_job():
        cfg = merge_run_config(cfg, overrides)
        record = evaluate(cfg)
    run_utils.print_numbers(record["metrics"])


def main() -> None:
    """`megalab-eval`: the Hydra entry point, with the closest keys after a misspelled one."""
    run_entry_point_of_a_run(hydra_main, "eval")


if __name__ == "__main__":
    main()
