"""Which runs reproduce a paper cell, and ours for it: mean ± std over seeds, one run per seed
of one configuration.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from megalab.reporting.paper import Cell, PaperTable
from megalab.reporting.runs import Planned, Run, same_value


def matches(cell: Cell, run: Run) -> bool:
    """A run reproduces a cell when it ran the cell's experiment with the cell's parameters and
    its sweep varied no parameter the cell leaves unspecified."""
    if not cell.experiment or run.experiment != cell.experiment:
        return False
    if any(k not in cell.params for k in run.swept):
        return False
    if run.differences(cell.params):  # e.g. `trainer.max_steps=20`: not the paper's setting
        return False
    return all(same_value(run.param(k), v) for k, v in cell.params.items())


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
            and all(same_value(p.swept[k], v) for k, v in cell.params.items() if k in p.swept)
        ]
        if points:
            reasons = [p.skipped for p in points]
            out[key] = reasons[0] if all(reasons) else ""  # type: ignore[assignment]
    return out
