"""Deprecated path of `megalab-train`: `python -m megalab.train` still runs it, saying so.

Its names moved to `megalab.cli.train`.
"""

from typing import Any

from megalab.cli.deprecated import moved, run_moved


def __getattr__(name: str) -> Any:
    return moved("megalab.train", name, "megalab.cli.train")


if __name__ == "__main__":
    run_moved("megalab.train", "megalab.cli.train", "megalab-train")
