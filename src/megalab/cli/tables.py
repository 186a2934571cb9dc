"""The `megalab-tables` command: read run folders (and a W&B project), print the report and
write it with the plots.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from megalab.reporting.paper import load_tables
from megalab.reporting.report import build_report
from megalab.reporting.runs import collect_planned, collect_runs, collect_wandb_runs


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
    parser.add_argument(
        "--tables-dir", type=Path, default=None, help="paper tables (default: the project's)"
    )
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
        tables = load_tables(ns.tables_dir)  # a malformed table or `reproduces:` entry, likewise
    except ValueError as err:
        parser.error(str(err))
    if ns.wandb:
        try:
            runs += collect_wandb_runs(ns.wandb)
        except Exception as err:  # not logged in, no such project, no network: W&B's message
            if not type(err).__module__.startswith("wandb"):
                raise
            parser.error(f"--wandb {ns.wandb}: {err}")
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
