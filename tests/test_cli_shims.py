"""The commands' old module paths still run: `python -m megalab.train` (and the rest) prints one
deprecation line naming the command that replaces it, then runs that command; names imported from
an old module resolve to where they moved, with a DeprecationWarning."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

import pytest

from conftest import ROOT
from megalab.cli.deprecated import notice

# Old module path -> (the command that replaces it, its module).
MOVED = {
    "megalab.train": ("megalab-train", "megalab.cli.train"),
    "megalab.eval": ("megalab-eval", "megalab.cli.eval"),
    "megalab.generate": ("megalab-generate", "megalab.cli.generate"),
    "megalab.translate": ("megalab-translate", "megalab.cli.translate"),
    "megalab.sweep": ("megalab-sweep", "megalab.cli.sweep"),
    "megalab.export": ("megalab-export", "megalab.cli.export"),
    "megalab.tables": ("megalab-tables", "megalab.cli.tables"),
    "megalab.data.cli": ("megalab-data", "megalab.cli.data"),
    "megalab.curves": ("python -m megalab.cli.curves", "megalab.cli.curves"),
    "megalab.eval_runs": ("python -m megalab.cli.eval_runs", "megalab.cli.eval_runs"),
}


@pytest.mark.parametrize("old", MOVED)
def test_old_module_path_runs_the_new_command(
    old: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m <old> --help`, run as Python runs it: the deprecation line on stderr first,
    then the new command's help (argparse exits 0; Hydra prints its help and returns)."""
    command, module = MOVED[old]
    monkeypatch.setattr(sys, "argv", [old, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(old, run_name="__main__", alter_sys=True)
    out, err = capsys.readouterr()
    assert done.value.code in (0, None)
    assert err.splitlines()[0] == notice(old, command, module)
    # argparse's usage, or Hydra's help listing the config groups it found in the package
    assert "usage:" in out or "== Configuration groups ==" in out, out


def test_python_m_megalab_train_still_composes_the_packaged_configs() -> None:
    """In a process of its own: the shim runs Hydra, which finds src/megalab/configs (the train
    config with an experiment), and the first stderr line names the new command."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "megalab.train", "experiment=mega/lra_listops", "--cfg", "job"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == notice("megalab.train", *MOVED["megalab.train"])
    # The job keeps its name (`train`, as the run folders record it) and the experiment composed.
    assert "task_name: train\n" in proc.stdout and "- listops\n" in proc.stdout


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("megalab.train", "train", "megalab.cli.train"),
        ("megalab.generate", "sample_tokens", "megalab.generation.sampling"),
        ("megalab.export", "from_pretrained", "megalab.pretrained"),
        ("megalab.tables", "collect_runs", "megalab.reporting"),
        ("megalab.curves", "load_curves", "megalab.reporting.curves"),
        ("megalab.data.cli", "main", "megalab.cli.data"),
    ],
)
def test_old_module_names_resolve_where_they_moved(old: str, name: str, new: str) -> None:
    old_module, new_module = __import__(old, fromlist=["_"]), __import__(new, fromlist=["_"])
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} moved to {new}.{name}"):
        value = getattr(old_module, name)
    assert value is getattr(new_module, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        old_module.no_such_name  # noqa: B018
