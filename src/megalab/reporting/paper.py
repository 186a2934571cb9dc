"""The papers' published numbers as data: `tables/<paper>/<table>.yaml` (or `.csv`) read into
`PaperTable`s, each cell naming the experiment that reproduces it (tables/README.md).

A cell's experiment is named by its row in the table file, or by the experiment itself: an
experiment config's `reproduces:` list names rows of any paper's tables (a baseline filling the
rows of another paper's tables, S4D in Mega's), so adding it needs no edit to the table.
"""

from __future__ import annotations

import csv
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megalab.utils.paths import CONFIG_DIR, resource_dir
from megalab.utils.safe_config import load_yaml


def tables_dir() -> Path:
    """The paper tables: `MEGALAB_TABLES_DIR`, else `tables/` of the project (or the copy an
    installed wheel carries). Read when asked, not at import: a process that moves
    `MEGALAB_ROOT` (a notebook, a test) reads the tables of the project it is in."""
    return Path(os.environ.get("MEGALAB_TABLES_DIR") or resource_dir("tables"))


def __getattr__(name: str) -> Path:
    """`TABLES_DIR`, the name of earlier versions: `tables_dir()` when read."""
    if name == "TABLES_DIR":
        return tables_dir()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MISSING = "missing"  # a reproducible cell without runs yet
BLANK = "—"  # a cell with no number (the paper's blank, or nothing of ours to compare)


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


@dataclass(frozen=True)
class Reproduction:
    """An experiment config's `reproduces:` entry: the row (and column, or every column) of a
    paper table its runs fill, with a note for the row."""

    experiment: str
    table: str
    row: str
    column: str | None = None
    notes: str = ""


@functools.cache
def declared_reproductions(
    experiment_dir: Path = CONFIG_DIR / "experiment",
) -> tuple[Reproduction, ...]:
    """Every `reproduces:` entry of the experiment configs under `experiment_dir` (the
    installed package's; read as data, safe YAML), in the order of their files."""
    out = []
    for path in sorted(experiment_dir.rglob("*.yaml")):
        spec = load_yaml(path) or {}
        name = path.relative_to(experiment_dir).with_suffix("").as_posix()
        entries = spec.get("reproduces") if isinstance(spec, Mapping) else None
        for entry in entries or ():
            if not isinstance(entry, Mapping) or not {"table", "row"} <= set(entry):
                raise ValueError(
                    f"{path}: each `reproduces:` entry is {{table: <paper>/<table>, row: <row id>"
                    f"[, column: <column id>][, notes: ...]}}, got {entry!r}"
                )
            column = entry.get("column")
            out.append(
                Reproduction(
                    name,
                    str(entry["table"]),
                    str(entry["row"]),
                    None if column is None else str(column),
                    " ".join(str(entry.get("notes", "")).split()),
                )
            )
    return tuple(out)


def check_reproductions(tables: list[PaperTable], every_table: bool = True) -> None:
    """Raise where an experiment's `reproduces:` names a table, row or column that is not
    there (a renamed row would otherwise silently lose its runs). `every_table=False`: `tables`
    is a selection (another tables folder), and only the entries of its tables are checked."""
    by_id = {t.id: t for t in tables}
    for r in declared_reproductions():
        table = by_id.get(r.table)
        if table is None and not every_table:
            continue
        if table is None or table.source.endswith(".csv"):
            raise ValueError(
                f"experiment {r.experiment} reproduces {r.table!r}, which is no YAML table "
                "under tables/ (a CSV table names its experiments itself)"
            )
        if r.row not in {row.id for row in table.rows}:
            raise ValueError(f"experiment {r.experiment}: {r.table} has no row {r.row!r}")
        if r.column is not None and r.column not in {c.id for c in table.columns}:
            raise ValueError(f"experiment {r.experiment}: {r.table} has no column {r.column!r}")


def _table_from_yaml(path: Path, table_id: str) -> PaperTable:
    spec = load_yaml(path)  # a table file is data: safe YAML (megalab.utils.safe_config)
    for key in ("paper", "table", "columns", "rows"):
        if key not in spec:
            raise ValueError(f"{path}: missing `{key}`")
    columns = [_column(c, spec) for c in spec["columns"]]
    col_ids = {c.id for c in columns}
    rows, cells = [], {}
    for row_spec in spec["rows"]:
        row_id = str(row_spec["id"])
        declared = [r for r in declared_reproductions() if (r.table, r.row) == (table_id, row_id)]
        notes = dict.fromkeys([str(row_spec.get("notes", "") or ""), *(r.notes for r in declared)])
        row = Row(row_id, str(row_spec.get("label", row_id)), " ".join(n for n in notes if n))
        rows.append(row)
        values = row_spec.get("values") or {}
        experiments = {
            **{c: r.experiment for r in declared for c in ([r.column] if r.column else col_ids)},
            **(row_spec.get("experiments") or {}),
        }
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


def load_tables(root: str | Path | None = None) -> list[PaperTable]:
    """Every paper table under `root` (default: `tables_dir()`), sorted by id."""
    root = Path(root) if root is not None else tables_dir()
    paths = [p for p in root.rglob("*") if p.suffix in (".yaml", ".yml", ".csv")]
    tables = sorted((load_table(p, root) for p in paths), key=lambda t: t.id)
    check_reproductions(tables, every_table=root.resolve() == tables_dir().resolve())
    return tables
