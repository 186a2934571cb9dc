"""Tiny copies of every dataset in its official on-disk format, for smoke runs.

`make reproduce-* SMOKE=1` trains every configuration for a couple of steps offline; it points
`paths.data_dir` at a folder written here. The writers are `megalab.testing`'s fixtures, so
smoke runs and tests read exactly the same files.
"""

from __future__ import annotations

from pathlib import Path

from megalab.testing import write_all_fixtures


def write_smoke_data(out: str | Path) -> Path:
    """Write every dataset fixture under `out` (the layout of `paths.data_dir`)."""
    out = Path(out).expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    write_all_fixtures(out)
    return out
