"""Deprecated path of `megalab-generate`: `python -m megalab.generate` still runs it, saying so.

Its names moved to `megalab.generation.sampling` and `megalab.cli.generate`.
"""

from typing import Any

from megalab.cli.deprecated import moved, run_moved


def __getattr__(name: str) -> Any:
    return moved("megalab.generate", name, "megalab.generation.sampling", "megalab.cli.generate")


if __name__ == "__main__":
    run_moved("megalab.generate", "megalab.cli.generate", "megalab-generate")
