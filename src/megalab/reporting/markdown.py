"""Markdown of a paper table against ours (paper, ours, Δ and steps lines per row), and of the
runs that are in no paper row.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence

from megalab.reporting.paper import BLANK, MISSING, Cell, Column, PaperTable, Row
from megalab.reporting.runs import Run, flatten_config, is_setting
from megalab.reporting.stats import Stat, aggregate, configurations


def number_text(x: float, digits: int) -> str:
    return f"{x:.{digits}f}"


def _signed(x: float, digits: int) -> str:
    text = number_text(abs(x), digits)
    if float(text) == 0:
        return text
    return f"+{text}" if x > 0 else f"-{text}"


def _paper_text(cell: Cell | None, digits: int) -> str:
    if cell is None:
        return ""
    if cell.value is None or cell.approx:
        return cell.display
    return number_text(cell.value, digits)


UNFINISHED = "†"  # marks ours where a run stopped before its configured schedule


def _ours_text(stat: Stat | None, digits: int) -> str:
    if stat is None:
        return MISSING
    mark = f" {UNFINISHED}" if stat.unfinished else ""
    if stat.std is None:
        return number_text(stat.mean, digits) + mark
    return f"{number_text(stat.mean, digits)} ± {number_text(stat.std, digits)}{mark}"


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
    return number_text(statistics.fmean(means), col.digits)


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
    # Without overrides of its own, a group is told by the config keys where it differs from
    # its siblings; with them, from the siblings its overrides alone would not tell it from
    # (a trainer choice changes `trainer.deterministic`, say, but is itself a setting).
    alike = siblings if not diff else [o for o in siblings if o[0].differences() == diff]
    mine = {k: v for k, v in flatten_config(run.config).items() if not is_setting(k)}
    for other in alike:
        theirs = {k: v for k, v in flatten_config(other[0].config).items() if not is_setting(k)}
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key) and key not in diff:
                diff[key] = json.dumps(mine.get(key), default=str)
    # A deleted key (`~key` on the command line) is shown as it was typed.
    return (
        " ".join(f"`{k}`" if k.startswith("~") else f"`{k}={v}`" for k, v in diff.items()) or BLANK
    )


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
    # Runs that record another metric (a language model's test/ppl beside classifiers' test/acc)
    # say which, and how to list them by it.
    theirs = sorted(  # a loss last: the papers report ppl, bpc, accuracy or BLEU
        {
            name
            for g in groups
            if aggregate(g, metric, scale) is None
            for r in g
            for name in (r.record.get("metrics") or {})
            if str(name).startswith("test/") and r.metric(name) is not None
        },
        key=lambda name: (name.endswith("loss"), name),
    )
    if theirs:
        lines += [
            "",
            f"Runs shown without `{metric}` record {', '.join(f'`{m}`' for m in theirs)}: "
            f"`--metric {theirs[0]} --scale 1` lists them by it.",
        ]
    return "\n".join(lines) + "\n"
