"""Deprecated: `python -m megalab.curves` still runs `python -m megalab.cli.curves`, saying so.

Its names moved to `megalab.reporting.curves` and `megalab.cli.curves`.
"""

from typing import Any

from megalab.cli.deprecated import moved, run_moved


def __getattr__(name: str) -> Any:
    return moved("megalab.curves", name, "megalab.reporting.curves", "megalab.cli.curves")


if __name__ == "__main__":
    run_moved("megalab.curves", "megalab.cli.curves", "python -m megalab.cli.curves")
