"""Deprecated: `python -m megalab.eval_runs` runs `python -m megalab.cli.eval_runs`, saying so.

Its names moved to `megalab.cli.eval_runs`.
"""

from typing import Any

from megalab.cli.deprecated import moved, run_moved


def __getattr__(name: str) -> Any:
    return moved("megalab.eval_runs", name, "megalab.cli.eval_runs")


if __name__ == "__main__":
    run_moved("megalab.eval_runs", "megalab.cli.eval_runs", "python -m megalab.cli.eval_runs")
