"""Paper-vs-ours tables: `megalab-tables <run folders> [--wandb entity/project] [--out DIR]`.

Collects the `metrics.json` of every run under the given folders (with the metrics of a later
`megalab.eval` of the run, its `eval_metrics.json`, taking precedence) and, when asked, the runs
of a W&B project through its public API; matches them to the papers' published numbers in
`tables/` (one file per paper table, each cell naming the experiment that reproduces it), and
renders Markdown: the paper's number, ours as mean ± std over seeds, the difference and the
number of seeds, with cells that have no runs yet marked `missing`. Runs are grouped by
configuration (the experiment and the resolved config, settings such as paths and devices
aside), so every seed of every configuration counts and a repeated seed of one configuration
counts once (the newest run that finished its schedule). A run whose overrides make it another
configuration than a cell's (`trainer.max_steps=20`) never goes into that cell: it is listed
under "Other runs" with what differs. Each row shows our runs' step counts, and marks runs
that stopped before their configured schedule (†) and smoke runs. Sweep results (runs in a
folder written by `megalab-sweep`, whose `sweep.json` names the swept parameters) also become
PNG plots: the metric against the swept parameter, one line per experiment, with the paper's
points where it gives them.

    megalab-tables logs/reproduce/reproduce-mega-lra/2026-01-01_12-00-00
    megalab-tables logs/sweeps --table mega/fig4_chunk_size --out results/
    megalab-tables --wandb my-team/megalab --out results/
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from megalab.utils.paths import resource_dir
from megalab.utils.safe_config import load_yaml

log = logging.getLogger(__name__)

# tables/ of the project, or the copy an installed wheel carries
TABLES_DIR = Path(os.environ.get("MEGALAB_TABLES_DIR", str(resource_dir("tables"))))

MISSING = "missing"  # a reproducible cell without runs yet
BLANK = "—"  # a cell with no number (the paper's blank, or nothing of ours to compare)
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


# -- the papers' numbers ---------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """A column of a paper table; metric settings default to the table's."""

    id: str
    label: str
    metric: str | None
    scale: float
    goal: str
    digits: int
    params: Mapping[str, Any] = field(default_factory=dict)
    mean_of: tuple[str, ...] = ()
    compare: bool = True
    hidden: bool = False  # a component of a `mean_of` column: reproduced, not printed
    relative_to: str | None = None  # ours as a ratio to this row's value in the same column
    inverse: bool = False  # ratio = that row's / ours (a speed-up from step times)


@dataclass(frozen=True)
class Cell:
    """One published number with its provenance and the run that reproduces it."""

    paper: str
    table: str
    row: str  # labels, as printed
    column: str
    value: float | None  # None: no number (blank, or a mark such as ✗)
    display: str  # as printed in the paper ("63.14", "✗", "≈90")
    approx: bool = False
    experiment: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    metric: str | None = None
    scale: float = 1.0
    goal: str = "max"
    digits: int = 2
    seeds: int | None = None
    notes: str = ""
    source: str = ""
    row_id: str = ""
    column_id: str = ""
    axis: str = ""  # where the table's swept parameter is set: "column", "row" or ""


@dataclass(frozen=True)
class Row:
    id: str
    label: str
    notes: str = ""


@dataclass
class PaperTable:
    """A paper's table (or figure) as data: rows x columns of `Cell`s."""

    id: str  # path under tables/ without suffix, e.g. "mega/table2_lra"
    source: str
    paper: str
    citation: str
    table: str
    title: str
    notes: str
    seeds: int | None
    columns: list[Column]
    rows: list[Row]
    cells: dict[tuple[str, str], Cell]
    parameter: str | None = None  # swept config key (figures and ablation tables)
    xlabel: str | None = None
    ylabel: str | None = None

    def cell(self, row: str, column: str) -> Cell | None:
        return self.cells.get((row, column))

    @property
    def reproducible(self) -> list[Cell]:
        return [c for c in self.cells.values() if c.experiment]


def parse_value(raw: Any) -> tuple[float | None, str, bool]:
    """A table entry -> (number or None, text as printed, approximate?)."""
    if raw is None:
        return None, BLANK, False
    if isinstance(raw, bool):
        raise ValueError(f"not a table value: {raw!r}")
    if isinstance(raw, int | float):
        return float(raw), str(raw), False
    text = str(raw).strip()
    if text in ("", "-", BLANK):
        return None, BLANK, False
    approx = text[0] in "≈~"
    body = text[1:].strip() if approx else text
    try:
        return float(body), text, approx
    except ValueError:
        return None, text, False


def _params(raw: Any) -> dict[str, Any]:
    """`{k: v}` or the CSV form `k=v;k=v` (values parsed as YAML scalars)."""
    if not raw:
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    out = {}
    for part in str(raw).split(";"):
        if part.strip():
            key, _, value = part.partition("=")
            out[key.strip()] = yaml.safe_load(value.strip())
    return out


def _column(spec: Mapping[str, Any], defaults: Mapping[str, Any]) -> Column:
    return Column(
        id=str(spec["id"]),
        label=str(spec.get("label", spec["id"])),
        metric=spec.get("metric", defaults.get("metric")),
        scale=float(spec.get("scale", defaults.get("scale", 1.0))),
        goal=str(spec.get("goal", defaults.get("goal", "max"))),
        digits=int(spec.get("digits", defaults.get("digits", 2))),
        params=_params(spec.get("params")),
        mean_of=tuple(spec.get("mean_of") or ()),
        compare=bool(spec.get("compare", True)),
        hidden=bool(spec.get("hidden", False)),
        relative_to=spec.get("relative_to", defaults.get("relative_to")),
        inverse=bool(spec.get("inverse", defaults.get("inverse", False))),
    )


def _table_from_yaml(path: Path, table_id: str) -> PaperTable:
    spec = load_yaml(path)  # a table file is data: safe YAML (megalab.utils.safe_config)
    for key in ("paper", "table", "columns", "rows"):
        if key not in spec:
            raise ValueError(f"{path}: missing `{key}`")
    columns = [_column(c, spec) for c in spec["columns"]]
    col_ids = {c.id for c in columns}
    rows, cells = [], {}
    for row_spec in spec["rows"]:
        row = Row(
            str(row_spec["id"]),
            str(row_spec.get("label", row_spec["id"])),
            str(row_spec.get("notes", "") or ""),
        )
        rows.append(row)
        values = row_spec.get("values") or {}
        experiments = row_spec.get("experiments") or {}
        cell_notes = row_spec.get("cell_notes") or {}
        unknown = (set(values) | set(experiments) | set(cell_notes)) - col_ids
        if unknown:
            raise ValueError(f"{path}: row {row.id!r} names unknown columns {sorted(unknown)}")
        for col in columns:
            experiment = experiments.get(col.id, row_spec.get("experiment"))
            if col.id not in values and not experiment:
                continue
            if col.mean_of or not col.compare:
                experiment = None
            value, display, approx = parse_value(values.get(col.id))
            cells[(row.id, col.id)] = Cell(
                paper=str(spec["paper"]),
                table=str(spec["table"]),
                row=row.label,
                column=col.label,
                value=value,
                display=display,
                approx=approx,
                experiment=experiment,
                params={**col.params, **_params(row_spec.get("params"))},
                metric=col.metric,
                scale=col.scale,
                goal=col.goal,
                digits=col.digits,
                seeds=row_spec.get("seeds", spec.get("seeds")),
                notes=" ".join(str(n) for n in (row.notes, cell_notes.get(col.id, "")) if n),
                source=str(path),
                row_id=row.id,
                column_id=col.id,
                axis=(
                    "column"
                    if spec.get("parameter") in col.params
                    else "row"
                    if spec.get("parameter") in _params(row_spec.get("params"))
                    else ""
                ),
            )
    return PaperTable(
        id=table_id,
        source=str(path),
        paper=str(spec["paper"]),
        citation=" ".join(str(spec.get("citation", "")).split()),
        table=str(spec["table"]),
        title=str(spec.get("title", "")),
        notes=" ".join(str(spec.get("notes", "")).split()),
        seeds=spec.get("seeds"),
        columns=columns,
        rows=rows,
        cells=cells,
        parameter=spec.get("parameter"),
        xlabel=spec.get("xlabel"),
        ylabel=spec.get("ylabel"),
    )


CSV_FIELDS = (
    "paper",
    "table",
    "title",
    "row",
    "column",
    "value",
    "experiment",
    "params",
    "metric",
    "scale",
    "goal",
    "digits",
    "seeds",
    "notes",
)


def _table_from_csv(path: Path, table_id: str) -> PaperTable:
    """Long format: one line per cell with the columns in `CSV_FIELDS` (most optional)."""
    with path.open(newline="", encoding="utf-8") as f:
        lines = [r for r in csv.DictReader(f) if any((v or "").strip() for v in r.values())]
    if not lines:
        raise ValueError(f"{path}: no cells")
    missing = {"paper", "table", "row", "column", "value"} - set(lines[0])
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)}")
    columns: dict[str, Column] = {}
    rows: dict[str, Row] = {}
    cells = {}
    for line in lines:
        get = lambda k, d=None, line=line: (line.get(k) or "").strip() or d  # noqa: E731
        col_label, row_label = get("column"), get("row")
        col = columns.setdefault(
            col_label,
            Column(
                id=col_label,
                label=col_label,
                metric=get("metric", "test/acc"),
                scale=float(get("scale", 1.0)),
                goal=get("goal", "max"),
                digits=int(get("digits", 2)),
            ),
        )
        rows.setdefault(row_label, Row(row_label, row_label))
        value, display, approx = parse_value(yaml.safe_load(get("value", "") or "null"))
        cells[(row_label, col_label)] = Cell(
            paper=get("paper"),
            table=get("table"),
            row=row_label,
            column=col_label,
            value=value,
            display=display,
            approx=approx,
            experiment=get("experiment"),
            params=_params(get("params")),
            metric=get("metric", col.metric),
            scale=float(get("scale", col.scale)),
            goal=get("goal", col.goal),
            digits=int(get("digits", col.digits)),
            seeds=int(get("seeds")) if get("seeds") else None,
            notes=get("notes", ""),
            source=str(path),
            row_id=row_label,
            column_id=col_label,
        )
    first = lines[0]
    return PaperTable(
        id=table_id,
        source=str(path),
        paper=first["paper"],
        citation="",
        table=first["table"],
        title=(first.get("title") or "").strip(),
        notes="",
        seeds=None,
        columns=list(columns.values()),
        rows=list(rows.values()),
        cells=cells,
    )


def load_table(path: str | Path, root: str | Path | None = None) -> PaperTable:
    """Read one paper table (`.yaml`/`.yml` row-wise, or `.csv` one line per cell)."""
    path = Path(path)
    try:
        table_id = path.relative_to(root).with_suffix("").as_posix() if root else path.stem
    except ValueError:
        table_id = path.stem
    if path.suffix == ".csv":
        return _table_from_csv(path, table_id)
    return _table_from_yaml(path, table_id)


def load_tables(root: str | Path = TABLES_DIR) -> list[PaperTable]:
    """Every paper table under `root` (sorted by id)."""
    root = Path(root)
    paths = [p for p in root.rglob("*") if p.suffix in (".yaml", ".yml", ".csv")]
    return sorted((load_table(p, root) for p in paths), key=lambda t: t.id)


# -- our runs --------------------------------------------------------------------------------
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
            flat = {k: v for k, v in _flatten(self.config).items() if not is_setting(k)}
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
            if not is_setting(k) and k not in self.allowed and k not in (params or {})
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
        return _select(self.config, key)


def _select(config: Any, key: str) -> Any:
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


def _flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (W&B's flat sweep keys are kept as they are)."""
    out: dict[str, Any] = {}
    if not isinstance(config, Mapping):
        return out
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _override_items(overrides: Iterable[str]) -> dict[str, str]:
    """Hydra override strings (`+a.b=1`, `~c`, `d=x`) -> {key: value as typed}."""
    out = {}
    for text in overrides:
        key, _, value = str(text).partition("=")
        out[key.strip().lstrip("+~")] = value.strip()
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


def _same(a: Any, b: Any) -> bool:
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
    """The run's record with the metrics of a later `megalab.eval` of it taking precedence."""
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
            run.swept = {k: _select(config, k) for k in keys}
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
        "experiment": _select(config, "experiment_name") or _select(config, "experiment"),
        "seed": _select(config, "seed"),
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
    out.swept = {k: _select(config, k) for k in keys}
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


# -- matching and statistics -----------------------------------------------------------------
def matches(cell: Cell, run: Run) -> bool:
    """A run reproduces a cell when it ran the cell's experiment with the cell's parameters and
    its sweep varied no parameter the cell leaves unspecified."""
    if not cell.experiment or run.experiment != cell.experiment:
        return False
    if any(k not in cell.params for k in run.swept):
        return False
    if run.differences(cell.params):  # e.g. `trainer.max_steps=20`: not the paper's setting
        return False
    return all(_same(run.param(k), v) for k, v in cell.params.items())


@dataclass(frozen=True)
class Stat:
    """Ours for one cell: mean and sample std over seeds (std None for one seed)."""

    mean: float
    std: float | None
    n: int
    seeds: tuple[Any, ...]
    smoke: bool = False
    steps: tuple[int | None, ...] = ()  # each run's optimizer steps
    unfinished: tuple[str, ...] = ()  # "<run folder>: <why>" for runs short of their schedule


def one_per_seed(runs: Iterable[Run]) -> list[Run]:
    """Every seed of every configuration once: of the runs of one configuration and seed, the
    newest that finished its schedule (else the newest). Runs of other configurations are all
    kept (a multirun over `model.d_model=32,64 seed=0,1` is four runs)."""
    chosen: dict[tuple[str, Any], Run] = {}
    unseeded = []
    for run in sorted(runs, key=lambda r: (r.unfinished is None, r.time)):
        if run.seed is None:
            unseeded.append(run)
        else:
            chosen[(run.identity, run.seed)] = run
    return list(chosen.values()) + unseeded


def aggregate(runs: Sequence[Run], metric: str | None, scale: float = 1.0) -> Stat | None:
    """Mean ± std of `metric` x `scale` over seeds (a seed repeated with the same configuration
    counts once: `one_per_seed`)."""
    chosen = one_per_seed(r for r in runs if r.metric(metric) is not None)
    values = [run.metric(metric) * scale for run in chosen]  # type: ignore[operator]
    if not values:
        return None
    std = statistics.stdev(values) if len(values) > 1 else None
    seeds: tuple[Any, ...] = tuple(sorted((r.seed for r in chosen if r.seed is not None), key=str))
    seeds += (None,) * sum(r.seed is None for r in chosen)
    return Stat(
        statistics.fmean(values),
        std,
        len(values),
        seeds,
        any(r.smoke for r in chosen),
        tuple(r.steps for r in chosen),
        tuple(f"{r.source or r.experiment}: {r.unfinished}" for r in chosen if r.unfinished),
    )


def configurations(runs: Iterable[Run]) -> list[list[Run]]:
    """Runs grouped by configuration (experiment and resolved config, settings aside)."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.identity, []).append(run)
    return list(groups.values())


def cell_runs(cell: Cell, runs: Sequence[Run]) -> list[Run]:
    """The runs behind a cell: those that match it, of one configuration (the one with the
    most seeds, then the newest; others that match, e.g. of an experiment file edited between
    runs, are listed among the other runs with what differs)."""
    groups = configurations(r for r in runs if matches(cell, r))
    if not groups:
        return []
    return max(groups, key=lambda g: (len({r.seed for r in g}), max(r.time for r in g)))


def summarize(table: PaperTable, runs: Sequence[Run]) -> dict[tuple[str, str], Stat | None]:
    """Ours for every reproducible cell of a table (None where no run matches)."""
    out: dict[tuple[str, str], Stat | None] = {}
    for key, cell in table.cells.items():
        if cell.experiment:
            out[key] = aggregate(cell_runs(cell, runs), cell.metric, cell.scale)
    return _relative(table, out)


def _relative(
    table: PaperTable, stats: dict[tuple[str, str], Stat | None]
) -> dict[tuple[str, str], Stat | None]:
    """Columns with `relative_to`: ours as the ratio of our means to that row's in the same
    column (`inverse`: the row's over ours), like the papers' "relative to MEGA" columns."""
    out = dict(stats)
    for col in table.columns:
        if not col.relative_to:
            continue
        base = stats.get((col.relative_to, col.id))
        for row in table.rows:
            stat = stats.get((row.id, col.id))
            if stat is None:
                continue
            if base is None or base.mean == 0 or stat.mean == 0:
                out[(row.id, col.id)] = None
                continue
            ratio = base.mean / stat.mean if col.inverse else stat.mean / base.mean
            out[(row.id, col.id)] = Stat(
                ratio,
                None,
                min(stat.n, base.n),
                stat.seeds,
                stat.smoke or base.smoke,
                stat.steps,
                stat.unfinished + base.unfinished,
            )
    return out


def plan_status(table: PaperTable, planned: Sequence[Planned]) -> dict[tuple[str, str], str]:
    """For reproducible cells that an offline sweep planned: "" (it runs), or why every
    matching point was skipped."""
    out: dict[tuple[str, str], str] = {}
    for key, cell in table.cells.items():
        if not cell.experiment:
            continue
        points = [
            p
            for p in planned
            if p.experiment == cell.experiment
            and all(k in cell.params for k in p.swept)
            and all(_same(p.swept[k], v) for k, v in cell.params.items() if k in p.swept)
        ]
        if points:
            reasons = [p.skipped for p in points]
            out[key] = reasons[0] if all(reasons) else ""  # type: ignore[assignment]
    return out


# -- Markdown --------------------------------------------------------------------------------
def _num(x: float, digits: int) -> str:
    return f"{x:.{digits}f}"


def _signed(x: float, digits: int) -> str:
    text = _num(abs(x), digits)
    if float(text) == 0:
        return text
    return f"+{text}" if x > 0 else f"-{text}"


def _paper_text(cell: Cell | None, digits: int) -> str:
    if cell is None:
        return ""
    if cell.value is None or cell.approx:
        return cell.display
    return _num(cell.value, digits)


UNFINISHED = "†"  # marks ours where a run stopped before its configured schedule


def _ours_text(stat: Stat | None, digits: int) -> str:
    if stat is None:
        return MISSING
    mark = f" {UNFINISHED}" if stat.unfinished else ""
    if stat.std is None:
        return _num(stat.mean, digits) + mark
    return f"{_num(stat.mean, digits)} ± {_num(stat.std, digits)}{mark}"


def _steps_text(stat: Stat | None) -> str:
    """The runs' optimizer steps (a range over seeds), "(smoke)" for smoke runs."""
    if stat is None:
        return ""
    steps = [s for s in stat.steps if s is not None]
    text = "?" if not steps else str(min(steps))
    if steps and min(steps) != max(steps):
        text += f"–{max(steps)}"
    return text + (" (smoke)" if stat.smoke else "")


def _delta_text(cell: Cell, stat: Stat | None, digits: int) -> str:
    if stat is None:
        return ""
    if cell.value is None:
        return f"({stat.n})"
    return f"{'≈' if cell.approx else ''}{_signed(stat.mean - cell.value, digits)} ({stat.n})"


def _row_mean(
    table: PaperTable, row: Row, col: Column, stats: Mapping[tuple[str, str], Stat | None]
) -> str:
    """Ours for an average column: the mean of the row's per-column means, when all exist."""
    parts = [table.cell(row.id, c) for c in col.mean_of]
    wanted = [c for c in parts if c is not None and c.experiment]
    if not wanted:
        return ""
    have = [stats.get((row.id, cid)) for cid in col.mean_of if (row.id, cid) in stats]
    means = [s.mean for s in have if s is not None]
    if len(means) < len(wanted):
        return f"{MISSING} ({len(means)}/{len(wanted)})"
    return _num(statistics.fmean(means), col.digits)


def _metric_text(columns: Sequence[Column]) -> str:
    """How ours is computed, e.g. "`test/acc` × 100" (per column when they differ)."""

    def one(col: Column) -> str:
        return f"`{col.metric}`" + (f" × {col.scale:g}" if col.scale != 1 else "")

    metered = [c for c in columns if c.metric and not c.mean_of]
    kinds = {one(c) for c in metered}
    if len(kinds) == 1:
        return kinds.pop()
    return ", ".join(f"{c.label}: {one(c)}" for c in metered)


def render_table(
    table: PaperTable,
    stats: Mapping[tuple[str, str], Stat | None],
    status: Mapping[tuple[str, str], str] | None = None,
) -> str:
    """One paper table as Markdown: per row we ran (or planned) a paper line, an ours line and
    a Δ (n) line; other rows show the paper's numbers only. Without runs or plans at all, every
    reproducible row shows its ours line (all `missing`)."""
    status = status or {}
    active = {k for k, v in stats.items() if v is not None} | set(status)
    skipped: dict[str, list[str]] = {}
    unfinished: list[str] = []
    shown = [c for c in table.columns if c.compare and not c.hidden]
    hidden = [c.label for c in table.columns if not c.compare]
    lines = [f"### {table.paper} {table.table}: {table.title}".rstrip(": "), ""]
    lines.append(
        "Ours: mean ± std over seeds of " + _metric_text(shown) + "; Δ = ours − paper, "
        "(n) = seeds; steps = optimizer steps of our runs; `missing` = not run yet; "
        f"{UNFINISHED} = a run stopped before its configured schedule."
    )
    if any(s is not None and s.smoke for s in stats.values()):
        lines.append(
            "**Smoke runs** (2 training steps on fixture data): ours only checks the pipeline."
        )
    relative = [c for c in shown if c.relative_to]
    if relative:
        inverse = [c.label for c in relative if c.inverse]
        lines.append(
            f"Ratios ({', '.join(c.label for c in relative)}): ours is the ratio of our mean to "
            "the reference row's in the same column"
            + (f" ({', '.join(inverse)}: a speed-up, its step time over ours)." if inverse else ".")
        )
    lines.append("")
    lines.append("| Model | | " + " | ".join(c.label for c in shown) + " |")
    lines.append("|---|---|" + "---:|" * len(shown))
    for row in table.rows:
        cells = [table.cell(row.id, c.id) for c in shown]
        reproducible = any(c is not None and c.experiment for c in cells)
        if active:  # hidden columns count: their runs make the row's averages
            reproducible = any((row.id, c.id) in active for c in table.columns)
        paper = [_paper_text(c, col.digits) for c, col in zip(cells, shown)]
        lines.append(f"| {row.label} | paper | " + " | ".join(paper) + " |")
        if not reproducible:
            continue
        ours, delta, steps = [], [], []
        for cell, col in zip(cells, shown):
            if col.mean_of:
                ours.append(_row_mean(table, row, col, stats))
                delta.append("")
                steps.append("")
            elif cell is None or not cell.experiment:
                ours.append(BLANK)
                delta.append("")
                steps.append("")
            else:
                stat = stats.get((row.id, col.id))
                reason = status.get((row.id, col.id))
                if stat is None and reason:
                    mark = skipped.setdefault(reason, [])
                    mark.append(f"{row.label} / {col.label}")
                    ours.append(f"skipped[^{list(skipped).index(reason) + 1}]")
                else:
                    ours.append(_ours_text(stat, col.digits))
                delta.append(_delta_text(cell, stat, col.digits))
                steps.append(_steps_text(stat))
                if stat is not None:
                    place = f"{row.label} / {col.label}"
                    unfinished += [f"{place}: {u}" for u in stat.unfinished]
        lines.append("| | ours | " + " | ".join(ours) + " |")
        lines.append("| | Δ (n) | " + " | ".join(delta) + " |")
        lines.append("| | steps | " + " | ".join(steps) + " |")
    lines.append("")
    source = f"Source: {table.citation or table.paper}, {table.table}"
    if table.seeds:
        source += f"; paper: mean of {table.seeds} seeds"
    lines.append(source + f". Data: `tables/{table.id}`.")
    if table.notes:
        lines.append(f"Notes: {table.notes}")
    if hidden:
        lines.append(f"Not compared: {', '.join(hidden)} (in the data file).")
    lines.append("")
    for i, (reason, where) in enumerate(skipped.items(), start=1):
        lines.append(f"[^{i}]: Skipped ({', '.join(where)}): {reason}")
    if skipped:
        lines.append("")
    if unfinished:
        lines.append(f"{UNFINISHED} Stopped before the configured schedule (not a result):")
        lines += [f"- {u}" for u in unfinished]
        lines.append("")
    return "\n".join(lines)


def _differing(group: Sequence[Run], siblings: Sequence[Sequence[Run]]) -> str:
    """What makes a group of runs another configuration: its overrides beyond its experiment's
    settings, else the resolved config keys whose values differ from the sibling groups' (runs
    of the same experiment) or the swept parameters."""
    run = group[0]
    diff = run.differences()
    if not diff and run.swept:
        diff = {k: str(v) for k, v in run.swept.items()}
    if not diff:
        mine = {k: v for k, v in _flatten(run.config).items() if not is_setting(k)}
        for other in siblings:
            theirs = {k: v for k, v in _flatten(other[0].config).items() if not is_setting(k)}
            for key in sorted(set(mine) | set(theirs)):
                if mine.get(key) != theirs.get(key) and key not in diff:
                    diff[key] = json.dumps(mine.get(key), default=str)
    return " ".join(f"`{k}={v}`" for k, v in diff.items()) or BLANK


def render_other_runs(runs: Sequence[Run], matched: set[int], metric: str, scale: float) -> str:
    """Runs in no rendered paper row, one line per configuration (runs of one configuration
    and several seeds share a line), with what differs from the experiment's configuration:
    a run whose config is not a paper cell's never counts as that cell's."""
    groups = configurations(r for r in runs if id(r) not in matched)
    if not groups:
        return ""
    lines = [
        "### Other runs (not in a paper row)",
        "",
        "Configurations that differ from every paper cell's (what differs is shown), runs "
        "without a paper number, and runs of a configuration other than the one in a paper row.",
        "",
        f"| Experiment | Differs | `{metric}` × {scale:g} | n | steps | runs |",
        "|---|---|---:|---:|---:|---|",
    ]
    by_experiment: dict[str | None, list[list[Run]]] = {}
    for group in configurations(runs):
        by_experiment.setdefault(group[0].experiment, []).append(group)
    for group in sorted(groups, key=lambda g: (g[0].experiment or "", g[0].identity)):
        siblings = [
            g for g in by_experiment[group[0].experiment] if g[0].identity != group[0].identity
        ]
        stat = aggregate(group, metric, scale)
        where = ", ".join(sorted({r.source for r in group if r.source})) or BLANK
        lines.append(
            f"| {group[0].experiment or '(no experiment)'} | {_differing(group, siblings)} | "
            f"{_ours_text(stat, 2) if stat else BLANK} | {stat.n if stat else 0} | "
            f"{_steps_text(stat) if stat else BLANK} | {where} |"
        )
    notes = [
        f"- {u}" for g in groups for s in [aggregate(g, metric, scale)] if s for u in s.unfinished
    ]
    if notes:
        lines += ["", f"{UNFINISHED} Stopped before the configured schedule:", *notes]
    return "\n".join(lines) + "\n"


# -- plots -----------------------------------------------------------------------------------
@dataclass
class Series:
    """One line of a sweep plot: an experiment's metric against the swept parameter."""

    label: str
    x: list[Any]
    ours: list[Stat | None]
    paper: list[Cell | None]


def _tick(key: str, value: Any) -> str:
    return "full" if key.endswith("chunk_size") and _same(value, -1) else str(value)


def sweep_series(
    key: str, runs: Sequence[Run], table: PaperTable | None, metric: str, scale: float
) -> tuple[list[str], list[Series]]:
    """Lines for a plot of `metric` against `key`: one per experiment, the paper table's first,
    x values in the table's order, then values only our runs have."""
    xs: list[Any] = []
    ticks: list[str] = []
    lines: list[tuple[str, str]] = []  # (experiment, label)
    cells = [c for c in (table.cells.values() if table else []) if c.experiment and c.axis]
    for cell in cells:
        value = cell.params[key]
        if not any(_same(value, x) for x in xs):
            xs.append(value)
            ticks.append(cell.column if cell.axis == "column" else cell.row)
        label = cell.row if cell.axis == "column" else cell.column
        if cell.experiment not in {e for e, _ in lines}:
            lines.append((cell.experiment, label))  # type: ignore[arg-type]
    swept = [r for r in runs if list(r.swept) == [key]]
    extra = [r.swept[key] for r in swept if not any(_same(r.swept[key], x) for x in xs)]
    for value in sorted(
        {str(v): v for v in extra}.values(),
        key=lambda v: (isinstance(v, int | float) and v < 0, str(type(v)), v),
    ):
        xs.append(value)
        ticks.append(_tick(key, value))
    for run in swept:
        if run.experiment and run.experiment not in {e for e, _ in lines}:
            lines.append((run.experiment, run.experiment))
    series = []
    for experiment, label in lines:
        ours, paper = [], []
        for x in xs:
            group = [r for r in swept if r.experiment == experiment and _same(r.swept[key], x)]
            ours.append(aggregate(group, metric, scale))
            paper.append(
                next(
                    (c for c in cells if c.experiment == experiment and _same(c.params[key], x)),
                    None,
                )
            )
        if any(o is not None for o in ours):
            series.append(Series(label, xs, ours, paper))
    return ticks, series


def plot_sweep(
    path: str | Path,
    key: str,
    labels: Sequence[str],
    series: Sequence[Series],
    title: str,
    xlabel: str,
    ylabel: str,
    smoke: bool = False,
) -> Path:
    """Write a PNG: ours (mean ± std, filled markers and lines) and the paper's points
    (hollow markers, ≈ for values the paper only describes) for every series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 5.0), dpi=150)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # Ordered numeric values (chunk size, EMA dimension) are joined by lines; categories
    # (attention functions) are not, and each series is shifted a little so they do not overlap.
    categorical = any(not isinstance(x, int | float) for s in series for x in s.x)
    handles: list[Any] = []  # matplotlib artists: error bar containers and lines
    notes: list[tuple[float, float, str, str]] = []  # paper labels: (x, y, text, color)
    for i, s in enumerate(series):
        color = colors[i % len(colors)]
        shift = (i - (len(series) - 1) / 2) * 0.15 if categorical else 0.0
        positions = [p + shift for p in range(len(labels))]
        have = [o for o in s.ours if o is not None]
        if have:
            # NaN at missing points breaks the line there instead of bridging the gap.
            n = max(o.n for o in have)
            handles.append(
                ax.errorbar(
                    positions,
                    [o.mean if o is not None else math.nan for o in s.ours],
                    yerr=[(o.std or 0.0) if o is not None else math.nan for o in s.ours],
                    color=color,
                    marker="o",
                    markersize=6,
                    linewidth=0 if categorical else 2,
                    elinewidth=2,
                    capsize=4,
                    label=f"{s.label}, ours"
                    + (f" (mean ± std, n = {n})" if n > 1 else " (1 seed)"),
                )
            )
        paper = [
            (p, c) for p, c in zip(positions, s.paper) if c is not None and c.value is not None
        ]
        if paper:
            (line,) = ax.plot(
                [p for p, _ in paper],
                [cast(float, c.value) for _, c in paper],
                linestyle="none",
                marker="D",
                markersize=9,
                markerfacecolor="white",
                markeredgecolor=color,
                markeredgewidth=2,
                label=f"{s.label}, paper",
                zorder=3,
            )
            handles.append(line)
            for p, c in paper:
                notes.append(
                    (
                        p,
                        float(cast(float, c.value)),
                        c.display if c.approx else _num(cast(float, c.value), 2),
                        color,
                    )
                )
    # Paper values above their markers, stacked where points of several series coincide.
    ax.margins(y=0.14)
    low, high = ax.get_ylim()
    placed: list[tuple[float, float]] = []
    for x, y, text, color in sorted(notes, key=lambda n: (n[0], n[1])):
        level = sum(
            1 for px, py in placed if abs(px - x) < 0.1 and abs(py - y) < 0.04 * (high - low)
        )
        placed.append((x, y))
        ax.annotate(
            text,
            (x, y),
            textcoords="offset points",
            xytext=(0, 9 + 10 * level),
            ha="center",
            fontsize=8,
            color=color,
            bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8},
        )
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(
        handles=handles,
        fontsize=8,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=2,
        frameon=False,
    )
    if smoke:
        fig.text(
            0.5,
            0.01,
            "smoke runs: 2 training steps on fixture data, not results",
            ha="center",
            fontsize=8,
            color="firebrick",
        )
    fig.tight_layout(rect=(0, 0.03 if smoke else 0, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# -- report ----------------------------------------------------------------------------------
@dataclass
class Report:
    markdown: str
    plots: list[Path]
    tables: list[str]


def build_report(
    runs: Sequence[Run],
    tables: Sequence[PaperTable],
    planned: Sequence[Planned] = (),
    wanted: Sequence[str] = (),
    everything: bool = False,
    out: Path | None = None,
    metric: str = "test/acc",
    scale: float = 100.0,
) -> Report:
    """Render the `wanted` tables (default: every table some run reproduces; `everything`:
    all), the runs no table covers, and, when `out` is given, the sweep plots."""
    from megalab.efficiency import render_efficiency

    by_id = {t.id: t for t in tables}
    unknown = [w for w in wanted if w not in by_id]
    if unknown:
        raise ValueError(f"unknown table(s) {unknown}; known: {sorted(by_id)}")
    parts = []
    matched: set[int] = set()
    rendered = []
    for table in tables:
        hits = [id(r) for c in table.reproducible for r in cell_runs(c, runs)]
        matched.update(hits)
        if everything or table.id in wanted or (hits and not wanted):
            rendered.append(table.id)
            stats = summarize(table, runs)
            parts.append(render_table(table, stats, plan_status(table, planned)))
            parts.append(render_efficiency(table, runs))  # eff/* and Speed/Mem columns
    other = render_other_runs(runs, matched, metric, scale)
    if other:
        parts.append(other)
    plots: list[Path] = []
    if out is not None:
        keys = sorted({next(iter(r.swept)) for r in runs if len(r.swept) == 1})
        for key in keys:
            swept_table = next((t for t in tables if t.parameter == key), None)
            m, s = metric, scale
            if swept_table is not None and swept_table.reproducible:
                m, s = (
                    swept_table.reproducible[0].metric or metric,
                    swept_table.reproducible[0].scale,
                )
            labels, series = sweep_series(key, runs, swept_table, m, s)
            if not series:
                continue
            short = key.rsplit(".", 1)[-1]
            title = (
                f"{swept_table.paper} {swept_table.table}: {swept_table.title}"
                if swept_table
                else f"{m} vs {short}"
            )
            smoke = any(r.smoke for r in runs if r.swept and key in r.swept)
            plots.append(
                plot_sweep(
                    out / f"{short}.png",
                    key,
                    labels,
                    series,
                    title=title,
                    xlabel=(swept_table.xlabel if swept_table and swept_table.xlabel else key),
                    ylabel=(
                        swept_table.ylabel if swept_table and swept_table.ylabel else f"{m} × {s:g}"
                    ),
                    smoke=smoke,
                )
            )
    if not parts:
        parts.append("No runs found and no table asked for.\n")
    return Report("\n".join(parts), plots, rendered)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megalab-tables",
        description="Render paper-vs-ours tables (Markdown) and sweep plots (PNG).",
    )
    parser.add_argument("paths", nargs="*", type=Path, help="folders holding runs (metrics.json)")
    parser.add_argument(
        "--wandb", metavar="ENTITY/PROJECT", default=None, help="also read a W&B project's runs"
    )
    parser.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="ID",
        help="render this paper table (e.g. mega/table2_lra; repeatable); default: every "
        "table that some run reproduces",
    )
    parser.add_argument("--all", action="store_true", help="render every paper table")
    parser.add_argument("--tables-dir", type=Path, default=TABLES_DIR, help="paper tables")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write table.md and the plots here (default: the first folder given)",
    )
    parser.add_argument("--metric", default="test/acc", help="metric for runs without a table")
    parser.add_argument("--scale", type=float, default=100.0, help="its scale")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `megalab-tables`; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not ns.paths and not ns.wandb and not (ns.table or ns.all):
        parser.error("give run folders, --wandb ENTITY/PROJECT, or --table/--all")
    missing = [str(p) for p in ns.paths if not p.exists()]
    if missing:
        parser.error(f"not found: {', '.join(missing)}")
    try:  # run folders are data: a refused file (megalab.utils.safe_config) stops with its name
        runs = collect_runs(ns.paths)
        planned = collect_planned(ns.paths)
    except ValueError as err:
        parser.error(str(err))
    if ns.wandb:
        runs += collect_wandb_runs(ns.wandb)
    tables = load_tables(ns.tables_dir)
    out = ns.out or (ns.paths[0] if ns.paths and ns.paths[0].is_dir() else None)
    try:
        report = build_report(runs, tables, planned, ns.table, ns.all, out, ns.metric, ns.scale)
    except ValueError as err:
        parser.error(str(err))
    print(report.markdown)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(report.markdown, encoding="utf-8")
        print(f"[tables] {len(runs)} run(s); wrote {out / 'table.md'}", file=sys.stderr)
        for plot in report.plots:
            print(f"[tables] wrote {plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
