"""The efficiency numbers under a paper table: our runs' `eff/*` averages (written by
`megalab.efficiency.EfficiencyMonitor`), and the papers' relative Speed / Mem. columns (Mega
Table 2, SeqBoat Table 6) as ratios between our runs where the table file declares them (its
`efficiency:` list, see tables/README.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from megalab.reporting.paper import BLANK, PaperTable
from megalab.reporting.runs import Run
from megalab.reporting.stats import aggregate, matches

RAW_COLUMNS = (
    ("s / step", "eff/train_step_s", "{:.3g}"),
    ("train tokens/s", "eff/train_tokens_per_s", "{:,.0f}"),
    ("peak MB", "eff/peak_mem_mb", "{:,.0f}"),
    ("eval tokens/s", "eff/eval_tokens_per_s", "{:,.0f}"),
)
_RATIO_METRICS = {"speed": "eff/train_tokens_per_s", "memory": "eff/peak_mem_mb"}


def _efficiency_specs(table: PaperTable) -> list[dict[str, Any]]:
    """The table file's `efficiency:` list (column, quantity, task column, baseline row)."""
    try:
        spec = yaml.safe_load(Path(table.source).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return []
    items = (spec or {}).get("efficiency") or []
    out = []
    for item in items:
        if item.get("quantity") not in _RATIO_METRICS:
            raise ValueError(
                f"{table.source}: efficiency column {item.get('column')!r} needs quantity: "
                f"{' or '.join(_RATIO_METRICS)}"
            )
        out.append(item)
    return out


def render_efficiency(table: PaperTable, runs: Sequence[Run]) -> str:
    """Markdown under a paper table: our `eff/*` numbers for every cell with runs, and the
    paper's relative Speed / Mem. columns as ratios between our runs where the file declares
    them. Empty when no run has efficiency numbers."""
    rows = []
    # Cells of one row that the same runs reproduce (several metrics of one experiment, as
    # dev and test) are listed once, with their columns joined.
    seen: dict[tuple[str, str, str], list[str]] = {}
    for cell in table.cells.values():
        if not cell.experiment:
            continue
        key = (cell.row, cell.experiment, repr(sorted(cell.params.items())))
        if key in seen:
            seen[key].append(cell.column)
            continue
        matched = [r for r in runs if matches(cell, r)]
        stats = [aggregate(matched, metric) for _, metric, _ in RAW_COLUMNS]
        if any(s is not None for s in stats):
            seen[key] = [cell.column]
            rows.append((cell, seen[key], stats))
    if not rows:
        return ""
    # The paper's rows (models, or the swept value of an ablation) and columns (tasks, metrics,
    # or the swept value of a figure) each line reproduces.
    row_title, column_title = "Model", "Column"
    if table.xlabel:
        swept = table.xlabel[:1].upper() + table.xlabel[1:]
        if any(cell.axis == "column" for cell, _, _ in rows):
            column_title = swept
        elif any(cell.axis == "row" for cell, _, _ in rows):
            row_title = swept
    lines = [
        "",
        f"#### Efficiency ({table.paper} {table.table}): training and evaluation, per run",
        "",
        "Means over seeds of the run averages in `metrics.json` (`megalab.efficiency`: wall "
        "time per optimizer step, tokens/s, per-step peak memory).",
        "",
        f"| {row_title} | {column_title} | Experiment | "
        + " | ".join(c for c, _, _ in RAW_COLUMNS)
        + " | n |",
        "|---|---|---|" + "---:|" * (len(RAW_COLUMNS) + 1),
    ]
    for cell, columns, stats in rows:
        values = [
            BLANK if s is None else fmt.format(s.mean) for s, (_, _, fmt) in zip(stats, RAW_COLUMNS)
        ]
        n = max((s.n for s in stats if s is not None), default=0)
        lines.append(
            f"| {cell.row} | {', '.join(columns)} | {cell.experiment} | "
            + " | ".join(values)
            + f" | {n} |"
        )
    ratios = _render_ratios(table, runs)
    return "\n".join(lines) + "\n" + ratios


def _render_ratios(table: PaperTable, runs: Sequence[Run]) -> str:
    specs = _efficiency_specs(table)
    if not specs:
        return ""

    def mean(row_id: str, task: str, metric: str) -> float | None:
        cell = table.cell(row_id, task)
        if cell is None or not cell.experiment:
            return None
        stat = aggregate([r for r in runs if matches(cell, r)], metric)
        return None if stat is None else stat.mean

    labels = {c.id: c.label for c in table.columns}
    lines = [
        "",
        "Relative to the paper's baseline row, as the paper reports them (ours: ratios of the "
        "means above; speed = training tokens/s, memory = per-step peak memory):",
        "",
        "| Model | | " + " | ".join(labels.get(s["column"], s["column"]) for s in specs) + " |",
        "|---|---|" + "---:|" * len(specs),
    ]
    for row in table.rows:
        paper, ours, seen = [], [], False
        for s in specs:
            cell = table.cell(row.id, s["column"])
            paper.append(cell.display if cell is not None else "")
            metric = _RATIO_METRICS[s["quantity"]]
            a, b = mean(row.id, s["task"], metric), mean(s["baseline"], s["task"], metric)
            seen = seen or a is not None
            ours.append(f"{a / b:.2f}×" if a is not None and b else BLANK)
        if not seen:
            continue
        lines.append(f"| {row.label} | paper | " + " | ".join(paper) + " |")
        lines.append("| | ours | " + " | ".join(ours) + " |")
    notes = "; ".join(
        f"{labels.get(s['column'], s['column'])}: {s['quantity']} on "
        f"{labels.get(s['task'], s['task'])} vs {s['baseline']}"
        for s in specs
    )
    lines += ["", f"Ours from: {notes}.", ""]
    return "\n".join(lines)
