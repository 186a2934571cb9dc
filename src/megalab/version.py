"""megalab's version (`megalab.__version__`), importable without the package's public API."""

from __future__ import annotations

__version__ = "0.1.0"
