"""Make targets read as they run: `make -n` prints a target's commands and runs none of them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_dry_run_of_reproduce_mega_runs_nothing(tmp_path: Path) -> None:
    """`make -n reproduce-mega SMOKE=1` prints the sub-targets' sweeps and Table 1's command
    without running either (its $(MAKE) line holds nothing else), and writes nothing."""
    cmd = ["make", "--no-print-directory", "-n", "-C", str(ROOT), "reproduce-mega", "SMOKE=1",
           "REPRO_INSTALL=", f"REPRO_ROOT={tmp_path / 'repro'}",
           f"BIN={Path(sys.executable).parent}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("-m megalab.cli.sweep") >= 6
    assert "--table mega/table1_summary" in proc.stdout
    assert not (tmp_path / "repro").exists()
