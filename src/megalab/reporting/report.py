"""The whole `megalab-tables` report: the asked (or reproduced) paper tables with their
efficiency numbers, the runs no table covers, and the sweep plots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megalab.reporting.efficiency import render_efficiency
from megalab.reporting.markdown import render_other_runs, render_table
from megalab.reporting.paper import PaperTable
from megalab.reporting.plots import plot_sweep, sweep_series
from megalab.reporting.runs import Planned, Run
from megalab.reporting.stats import cell_runs, plan_status, summarize


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
