"""Tiny copies of every dataset in its official on-disk format, for smoke runs.

`make reproduce-* SMOKE=1` trains every configuration for a couple of steps offline; it points
`paths.data_dir` at a folder written here. The writers are the test suite's fixtures
(`tests/fixtures/`), so smoke runs and tests read exactly the same files.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def write_smoke_data(out: str | Path) -> Path:
    """Write every dataset fixture under `out` (the layout of `paths.data_dir`)."""
    tests = ROOT / "tests"
    if not (tests / "fixtures" / "__init__.py").exists():
        raise FileNotFoundError(
            f"smoke data needs the test fixtures in {tests / 'fixtures'}: run from a source "
            "checkout of megalab"
        )
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    fixtures = importlib.import_module("fixtures")
    out = Path(out).expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    fixtures.write_all_fixtures(out)
    return out
