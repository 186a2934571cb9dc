"""Deprecated path of `megalab-tables`: `python -m megalab.tables` still runs it, saying so.

Its names moved to `megalab.reporting` and `megalab.cli.tables`.
"""

from typing import Any

from megalab.cli.deprecated import moved


def __getattr__(name: str) -> Any:
    return moved("megalab.tables", name, "megalab.reporting", "megalab.cli.tables")
