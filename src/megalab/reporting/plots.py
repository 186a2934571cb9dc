"""Sweep plots (PNG): a metric against the swept parameter, one line per experiment, with the
paper's points where it gives them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from megalab.reporting.markdown import number_text
from megalab.reporting.paper import Cell, PaperTable
from megalab.reporting.runs import Run, same_value
from megalab.reporting.stats import Stat, aggregate


@dataclass
class Series:
    """One line of a sweep plot: an experiment's metric against the swept parameter."""

    label: str
    x: list[Any]
    ours: list[Stat | None]
    paper: list[Cell | None]


def _tick(key: str, value: Any) -> str:
    return "full" if key.endswith("chunk_size") and same_value(value, -1) else str(value)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, smoke: bool) -> Path:
    """Lay `fig` out, with a note at the bottom when it shows smoke runs, write it to `path`
    (creating the folder) and close it."""
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
    pyplot().close(fig)
    return path


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
        if not any(same_value(value, x) for x in xs):
            xs.append(value)
            ticks.append(cell.column if cell.axis == "column" else cell.row)
        label = cell.row if cell.axis == "column" else cell.column
        if cell.experiment not in {e for e, _ in lines}:
            lines.append((cell.experiment, label))  # type: ignore[arg-type]
    swept = [r for r in runs if list(r.swept) == [key]]
    extra = [r.swept[key] for r in swept if not any(same_value(r.swept[key], x) for x in xs)]
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
            group = [r for r in swept if r.experiment == experiment and same_value(r.swept[key], x)]
            ours.append(aggregate(group, metric, scale))
            paper.append(
                next(
                    (
                        c
                        for c in cells
                        if c.experiment == experiment and same_value(c.params[key], x)
                    ),
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
    plt = pyplot()
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
                        c.display if c.approx else number_text(cast(float, c.value), 2),
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
    return save_figure(fig, path, smoke)
