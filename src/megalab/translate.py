"""Deprecated path of `megalab-translate`: `python -m megalab.translate` still runs it, saying so.

Its names moved to `megalab.cli.translate`.
"""

from typing import Any

from megalab.cli.deprecated import moved, run_moved


def __getattr__(name: str) -> Any:
    return moved("megalab.translate", name, "megalab.cli.translate")


if __name__ == "__main__":
    run_moved("megalab.translate", "megalab.cli.translate", "megalab-translate")
