"""The commands' old module paths (`python -m megalab.train`, ...), kept working as shims.

Run, an old module prints one line to stderr naming the command that replaces it, then runs that
command's `main`. Imported, its names resolve to where they moved, with a `DeprecationWarning`
(`from megalab.train import train` still works).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any


def notice(old: str, command: str, module: str) -> str:
    """The line an old module path prints when run."""
    return f"`python -m {old}` is deprecated: run `{command}` (or `python -m {module}`)"


def run_moved(old: str, module: str, command: str) -> None:
    """Print the deprecation line for `old`, then run `module`'s `main` and exit with its code."""
    print(notice(old, command, module), file=sys.stderr, flush=True)
    sys.exit(importlib.import_module(module).main())


def moved(old: str, name: str, *modules: str) -> Any:
    """`old.name` looked up in the modules it moved to, first that has it, with a warning."""
    if not name.startswith("__"):
        for module in modules:
            value = getattr(importlib.import_module(module), name, _MISSING)
            if value is not _MISSING:
                warnings.warn(
                    f"{old}.{name} moved to {module}.{name}", DeprecationWarning, stacklevel=3
                )
                return value
    raise AttributeError(f"module {old!r} has no attribute {name!r}")


_MISSING = object()
