"""Our runs: the `metrics.json` of run folders (with a later evaluation's metrics), their
resolved configs and sweep manifests, or a W&B project's runs, as `Run`s; and which config keys
say where a run ran rather than what it computes (`SETTING_KEYS`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megalab.utils.safe_config import load_yaml

log = logging.getLogger(__name__)

# Keys a run's identity never depends on when it is matched to a paper cell.
_NOT_PARAMS = ("experiment", "seed")
# Config keys (and their sub-keys) that say where and how a run ran, not what it computes: they
# never make two runs' configurations differ, and overriding them keeps a run in its paper row.
# `trainer` is the trainer group's choice (TRAINER=gpu|ddp|cpu); its step schedule and batch
# keys (trainer.max_steps, ...) are not in this list and do count.
SETTING_KEYS = frozenset(
    {
        "experiment",
        "experiment_name",
        "seed",
        "task_name",
        "tags",
        "ckpt_path",
        "ckpt_verify",
        "train",
        "test",
        "hydra",
        "paths",
        "logger",
        "trainer._target_",
        "trainer.accelerator",
        "trainer.devices",
        "trainer.num_nodes",
        "trainer.strategy",
        "trainer.plugins",
        "trainer.sync_batchnorm",
        "trainer.enable_progress_bar",
        "trainer.enable_model_summary",
        "trainer.enable_checkpointing",
        "trainer.log_every_n_steps",
        "trainer.num_sanity_val_steps",
        "trainer.default_root_dir",
        "trainer.benchmark",
        "trainer.profiler",
        "data.download",
        "callbacks.rich_progress_bar",
        "callbacks.model_checkpoint",
        "callbacks.last_checkpoint",
        "callbacks.lr_monitor",
        "callbacks.efficiency_monitor",
    }
)
# Last components of keys that hold a place or a per-run value (`data.seed: ${seed}`).
_SETTING_NAMES = frozenset(
    {
        "seed",
        "num_workers",
        "data_dir",
        "cache_root",
        "hf_cache_dir",
        "dirpath",
        "save_dir",
        "output_dir",
        "root_dir",
        "log_dir",
        "default_root_dir",
    }
)


@dataclass
class Run:
    """One finished run: its record (`metrics.json`), config and swept parameter values."""

    experiment: str | None
    seed: int | None
    record: dict[str, Any]
    config: Any = None  # the resolved config (DictConfig, or a W&B config dict)
    swept: dict[str, Any] = field(default_factory=dict)  # parameters its sweep varied
    source: str = ""
    time: float = 0.0
    smoke: bool = False
    # The Hydra overrides it was started with (`.hydra/overrides.yaml`, key -> value as typed);
    # None where unknown (W&B runs, folders without `.hydra/`): then only `params` are checked.
    overrides: dict[str, str] | None = None
    allowed: frozenset[str] = frozenset()  # override keys its sweep set for every point
    _identity: str | None = field(default=None, repr=False, compare=False)

    @property
    def identity(self) -> str:
        """Its resolved configuration without settings (`SETTING_KEYS`), as one string: runs
        with equal identities are seeds of one configuration."""
        if self._identity is None:
            flat = {k: v for k, v in flatten_config(self.config).items() if not is_setting(k)}
            self._identity = json.dumps(
                [self.experiment, flat], sort_keys=True, default=str, separators=(",", ":")
            )
        return self._identity

    @property
    def steps(self) -> int | None:
        value = self.record.get("global_step")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def unfinished(self) -> str | None:
        """Why it stopped before its configured schedule (None: it finished, or unknown)."""
        if self.record.get("finished") is not False:
            return None
        max_steps = self.record.get("max_steps")
        of = f" of {max_steps}" if isinstance(max_steps, int) and max_steps >= 0 else ""
        reason = str(self.record.get("stop_reason") or "stopped").replace("_", " ")
        return f"{reason} at step {self.steps}{of}"

    def differences(self, params: Mapping[str, Any] | None = None) -> dict[str, str]:
        """Its overrides that a configuration with `params` does not have: what makes it
        another configuration than its experiment's (smoke runs: none, they are marked)."""
        if self.overrides is None or self.smoke:
            return {}
        return {
            k: v
            for k, v in self.overrides.items()
            if not is_setting(k.lstrip("~")) and k not in self.allowed and k not in (params or {})
        }

    def metric(self, name: str | None) -> float | None:
        """A metric (`test/acc`) or a record field (`params.total`), as a float."""
        if not name:
            return None
        metrics = self.record.get("metrics") or {}
        value: Any = metrics.get(name)
        if value is None:
            value = self.record
            for part in name.split("."):
                value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return float(value) if math.isfinite(value) else None

    def param(self, key: str) -> Any:
        """A config value by dotted key (`experiment`/`seed` from the record)."""
        if key == "experiment":
            return self.experiment
        if key == "seed":
            return self.seed
        if key in self.swept:
            return self.swept[key]
        return config_value(self.config, key)


def config_value(config: Any, key: str) -> Any:
    if config is None:
        return None
    if isinstance(config, Mapping) and key in config:  # W&B sweep params arrive flat
        value = config[key]
        return value.get("value", value) if isinstance(value, Mapping) else value
    node = config
    for part in key.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif hasattr(node, "get") and not isinstance(node, Mapping | str):
            node = node.get(part)
        else:
            return None
    return node


def is_setting(key: str) -> bool:
    """Whether a config key says where or how a run ran (`SETTING_KEYS`), not what it is."""
    parts = key.split(".")
    if key == "trainer" or parts[-1] in _SETTING_NAMES:  # the trainer group's choice
        return True
    return any(".".join(parts[:i]) in SETTING_KEYS for i in range(1, len(parts) + 1))


def flatten_config(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (W&B's flat sweep keys are kept as they are)."""
    out: dict[str, Any] = {}
    if not isinstance(config, Mapping):
        return out
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = value
    return out


def _override_items(overrides: Iterable[str]) -> dict[str, str]:
    """Hydra override strings (`+a.b=1`, `~c`, `d=x`) -> {key: value as typed}; a deletion keeps
    its `~` (`~c`), which no setting's key has."""
    out = {}
    for text in overrides:
        key, _, value = str(text).partition("=")
        out[key.strip().lstrip("+")] = value.strip()
    return out


def _load_overrides(run_dir: Path) -> dict[str, str] | None:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    try:
        items = load_yaml(path)  # a run folder is data: a Python tag is refused, naming it
    except yaml.YAMLError:
        return None
    return _override_items(items) if isinstance(items, list) else None


def same_value(a: Any, b: Any) -> bool:
    """Config values compared as an override would (`-1` == -1, `16` == 16.0)."""
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a).lower() == str(b).lower()


def _find_manifest(run_dir: Path, stop: Path) -> dict[str, Any] | None:
    for parent in [run_dir, *run_dir.parents]:
        manifest = parent / "sweep.json"
        if manifest.is_file():
            return json.loads(manifest.read_text())
        if parent == stop or parent == parent.parent:
            return None
    return None


def _load_config(run_dir: Path) -> Any:
    for name in ("config.yaml", ".hydra/config.yaml"):
        path = run_dir / name
        if path.is_file():
            try:
                return load_yaml(path)
            except yaml.YAMLError:
                return None
    return None


def _with_evaluation(record: dict[str, Any], eval_path: Path) -> dict[str, Any]:
    """The run's record with the metrics of a later `megalab-eval` of it taking precedence."""
    if not eval_path.is_file():
        return record
    try:
        evaluation = json.loads(eval_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        log.warning("ignoring %s: %s", eval_path, err)
        return record
    metrics = {**(record.get("metrics") or {}), **(evaluation.get("metrics") or {})}
    return {**record, "metrics": metrics, "evaluation": evaluation}


def collect_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Every run (a folder with `metrics.json`) under `paths`."""
    runs = []
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(root.rglob("metrics.json"))
        for path in files:
            try:
                record = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                log.warning("skipping %s: %s", path, err)
                continue
            run_dir = path.parent
            record = _with_evaluation(record, run_dir / "eval_metrics.json")
            config = _load_config(run_dir)
            manifest = _find_manifest(run_dir, root if root.is_dir() else run_dir) or {}
            keys = [k for k in manifest.get("parameters", []) if k not in _NOT_PARAMS]
            run = Run(
                experiment=record.get("experiment"),
                seed=record.get("seed"),
                record=record,
                config=config,
                source=str(run_dir),
                time=path.stat().st_mtime,
                smoke=bool(manifest.get("smoke")),
                overrides=_load_overrides(run_dir),
                # the sweep file's own command and its swept keys (checked against the cell)
                allowed=frozenset(
                    [*_override_items(manifest.get("fixed") or []), *manifest.get("parameters", [])]
                ),
            )
            run.swept = {k: config_value(config, k) for k in keys}
            runs.append(run)
    return runs


@dataclass(frozen=True)
class Planned:
    """A point of an offline sweep (from its `sweep.json`), run or skipped."""

    experiment: str | None
    swept: Mapping[str, Any]
    skipped: str | None = None


def collect_planned(paths: Iterable[str | Path]) -> list[Planned]:
    """The points of every offline sweep under `paths` (`sweep.json` manifests)."""
    planned = []
    for root in paths:
        root = Path(root)
        for manifest in sorted(root.rglob("sweep.json")) if root.is_dir() else []:
            try:
                record = json.loads(manifest.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            for point in record.get("points", []):
                swept = {k: v for k, v in point.get("params", {}).items() if k not in _NOT_PARAMS}
                experiment = point.get("experiment") or point.get("params", {}).get("experiment")
                planned.append(Planned(experiment, swept, point.get("skipped")))
    return planned


def run_from_wandb(run: Any) -> Run:
    """A W&B public-API run (`wandb.Api().runs(...)` item) as a `Run`."""
    config = dict(run.config or {})
    summary = dict(getattr(run.summary, "_json_dict", None) or dict(run.summary or {}))
    metrics = {k: v for k, v in summary.items() if isinstance(v, int | float) and "/" in k}
    params = config.get("params") if isinstance(config.get("params"), Mapping) else {}
    record = {
        "experiment": config_value(config, "experiment_name") or config_value(config, "experiment"),
        "seed": config_value(config, "seed"),
        "metrics": metrics,
        "params": params,
        "global_step": summary.get("trainer/global_step"),
    }
    sweep = getattr(run, "sweep", None)
    keys: list[str] = []
    if sweep is not None:
        keys = [k for k in (sweep.config or {}).get("parameters", {}) if k not in _NOT_PARAMS]
    created = getattr(run, "created_at", "") or ""
    out = Run(
        experiment=record["experiment"],
        seed=record["seed"],
        record=record,
        config=config,
        source=f"wandb:{'/'.join(getattr(run, 'path', []) or [])}",
        time=_timestamp(created),
    )
    out.swept = {k: config_value(config, k) for k in keys}
    return out


def _timestamp(text: str) -> float:
    import datetime as dt

    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def collect_wandb_runs(path: str, api: Any = None, state: str = "finished") -> list[Run]:
    """Finished runs of a W&B project `entity/project` (needs `wandb login`)."""
    if api is None:
        import wandb

        api = wandb.Api()
    filters = {"state": state} if state else None
    return [run_from_wandb(r) for r in api.runs(path, filters=filters)]
