"""Deprecated path of `megalab-eval`: `python -m megalab.eval` still runs it, saying so.

Its names moved to `megalab.cli.eval`.
"""

from typing import Any

from megalab.cli.deprecated import moved, run_moved


def __getattr__(name: str) -> Any:
    return moved("megalab.eval", name, "megalab.cli.eval")


if __name__ == "__main__":
    run_moved("megalab.eval", "megalab.cli.eval", "megalab-eval")
