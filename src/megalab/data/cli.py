"""Deprecated path of `megalab-data`: `python -m megalab.data.cli` still runs it, saying so.

Its names moved to `megalab.cli.data`.
"""

from typing import Any

from megalab.cli.deprecated import moved, run_moved


def __getattr__(name: str) -> Any:
    return moved("megalab.data.cli", name, "megalab.cli.data")


if __name__ == "__main__":
    run_moved("megalab.data.cli", "megalab.cli.data", "megalab-data")
