"""Deprecated path of `megalab-sweep`: `python -m megalab.sweep` still runs it, saying so.

Its names moved to `megalab.cli.sweep`.
"""

from typing import Any

from megalab.cli.deprecated import moved, run_moved


def __getattr__(name: str) -> Any:
    return moved("megalab.sweep", name, "megalab.cli.sweep")


if __name__ == "__main__":
    run_moved("megalab.sweep", "megalab.cli.sweep", "megalab-sweep")
