"""Deprecated path of `megalab-export`: `python -m megalab.export` still runs it, saying so.

Its names moved to `megalab.pretrained` and `megalab.cli.export`.
"""

from typing import Any

from megalab.cli.deprecated import moved, run_moved


def __getattr__(name: str) -> Any:
    return moved("megalab.export", name, "megalab.pretrained", "megalab.cli.export")


if __name__ == "__main__":
    run_moved("megalab.export", "megalab.cli.export", "megalab-export")
