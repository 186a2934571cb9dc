"""Reporting: paper-vs-ours tables, sweep plots, loss curves and efficiency columns of runs.

`megalab-tables <run folders> [--wandb entity/project] [--out DIR]` (`megalab.cli.tables`)

Collects the `metrics.json` of every run under the given folders (with the metrics of a later
`megalab-eval` of the run, its `eval_metrics.json`, taking precedence) and, when asked, the runs
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

The modules, bottom up: `paper` (the papers' numbers), `runs` (our runs and their settings),
`stats` (which runs make a cell, mean ± std), `markdown` and `efficiency` (the tables' text;
the numbers come from `megalab.efficiency`, measured while training), `plots`, `report` (all of
it for a set of runs) and `curves` (loss against tokens and tokens/s, for
`python -m megalab.cli.curves`). Reporting reads run folders: training never imports it.
"""

from typing import Any

from megalab.reporting.efficiency import render_efficiency
from megalab.reporting.markdown import UNFINISHED, render_other_runs, render_table
from megalab.reporting.paper import (
    BLANK,
    MISSING,
    Cell,
    Column,
    PaperTable,
    Row,
    load_table,
    load_tables,
    parse_value,
    tables_dir,
)
from megalab.reporting.plots import Series, plot_sweep, sweep_series
from megalab.reporting.report import Report, build_report
from megalab.reporting.runs import (
    SETTING_KEYS,
    Planned,
    Run,
    collect_planned,
    collect_runs,
    collect_wandb_runs,
    config_value,
    is_setting,
    run_from_wandb,
)
from megalab.reporting.stats import (
    Stat,
    aggregate,
    cell_runs,
    configurations,
    matches,
    one_per_seed,
    plan_status,
    summarize,
)

__all__ = [
    "BLANK",
    "MISSING",
    "SETTING_KEYS",
    "TABLES_DIR",
    "UNFINISHED",
    "Cell",
    "Column",
    "PaperTable",
    "Planned",
    "Report",
    "Row",
    "Run",
    "Series",
    "Stat",
    "aggregate",
    "build_report",
    "cell_runs",
    "collect_planned",
    "collect_runs",
    "collect_wandb_runs",
    "config_value",
    "configurations",
    "is_setting",
    "load_table",
    "load_tables",
    "matches",
    "one_per_seed",
    "parse_value",
    "plan_status",
    "plot_sweep",
    "render_efficiency",
    "render_other_runs",
    "render_table",
    "run_from_wandb",
    "summarize",
    "sweep_series",
    "tables_dir",
]


def __getattr__(name: str) -> Any:
    """`TABLES_DIR`, the name of earlier versions: `tables_dir()` when read."""
    if name == "TABLES_DIR":
        return tables_dir()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
