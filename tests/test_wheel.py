"""The built wheel works outside a checkout.

The sdist is built from the checkout, the wheel from the unpacked sdist (as `python -m build`
does, so neither a stale `build/` folder nor a file missing from the sdist goes unnoticed), and
the wheel is installed into a fresh virtual environment. Its console scripts then run from an
empty directory outside the checkout, with nothing of the checkout on the path: two training
steps of `experiment=quickstart`, `megalab-data smoke`, and a smoke reproduction (one grid point
of `sweeps/mega_lra.yaml`, rendered beside the paper's Table 2).

Trade-off, to keep this in the default suite (about 40 s on 2 cores): the fresh environment
reuses the test environment's installed dependencies through a `.pth` file and installs only
the megalab wheel (`--no-deps`, no index). So this proves what the wheel carries (every module,
config, fixture writer, paper table and sweep file) and that nothing imports from the checkout
or `tests/`; it does not prove that pip resolves megalab's declared dependencies from an index.
`.ci/run` does that: it installs everything from scratch from `constraints.txt`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "megalab"
# Variables that would let the installed package read the checkout.
CHECKOUT_VARS = (
    "PYTHONPATH",
    "MEGALAB_ROOT",
    "MEGALAB_CONFIG_DIR",
    "MEGALAB_TABLES_DIR",
    "MEGALAB_DATA_DIR",
)


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300):
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


def _build_backend(hook: str, source: Path, out: Path) -> Path:
    """Call a PEP 517 hook of setuptools in `source`; return the file it wrote in `out`."""
    code = f"from setuptools import build_meta as b; print(b.{hook}({str(out)!r}))"
    env = {k: v for k, v in os.environ.items() if k not in CHECKOUT_VARS}
    proc = _run([sys.executable, "-c", code], cwd=source, env=env)
    return out / proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The megalab wheel, built from an sdist of the checkout."""
    tmp = tmp_path_factory.mktemp("build")
    sdist = _build_backend("build_sdist", ROOT, tmp)
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    (source,) = (tmp / "unpacked").iterdir()
    (tmp / "dist").mkdir()
    return _build_backend("build_wheel", source, tmp / "dist")


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed (dependencies: see the docstring)."""
    env_dir = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=env_dir)
    python = env_dir / "bin" / "python"
    site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=env_dir
    ).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (Path(site) / "_megalab_test_dependencies.pth").write_text("\n".join(ours) + "\n")
    # --ignore-installed: never touch the megalab that the test environment itself has.
    _run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install"),
            *("--no-deps", "--no-index", "--ignore-installed", "--quiet", str(wheel)),
        ],
        cwd=env_dir,
    )
    return env_dir


@pytest.fixture
def user_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a user outside the checkout (offline, one thread)."""
    env = {k: v for k, v in os.environ.items() if k not in CHECKOUT_VARS}
    env.update(
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        MEGALAB_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    return env


def _relative_files(root: Path, pattern: str) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.glob(pattern) if p.is_file()}


def test_wheel_carries_every_module_config_fixture_writer_and_resource(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"megalab/{f}" for f in _relative_files(PACKAGE, "**/*.py")}
    expected |= {f"megalab/{f}" for f in _relative_files(PACKAGE, "configs/**/*.yaml")}
    expected |= {"megalab/py.typed"}
    for folder, pattern in [("sweeps", "*.yaml"), ("tables", "**/*.yaml"), ("tables", "*.md")]:
        files = _relative_files(ROOT / folder, pattern)
        assert files, f"no {folder}/{pattern} in the checkout"
        expected |= {f"megalab/resources/{folder}/{f}" for f in files}
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    assert any(n.startswith("megalab/testing/") for n in names)
    assert not [n for n in names if n.startswith("tests/")], "the wheel must not ship tests/"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    for script in ("train", "eval", "data", "tables", "sweep"):
        assert f"megalab-{script} = megalab." in scripts


def test_installed_package_imports_from_the_venv_and_never_from_the_checkout(
    venv: Path, tmp_path: Path, user_env: dict[str, str]
) -> None:
    code = (
        "import importlib, json, pkgutil, sys, megalab\n"
        "names = [m.name for m in pkgutil.walk_packages(megalab.__path__, 'megalab.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "print(json.dumps({'file': megalab.__file__, 'modules': sorted(sys.modules)}))\n"
    )
    proc = _run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=user_env)
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(record["file"]).is_relative_to(venv), record["file"]
    assert "megalab.testing.listops" in record["modules"]
    assert not [m for m in record["modules"] if m == "tests" or m.startswith("tests.")]


def test_quickstart_trains_two_steps_from_an_empty_directory(
    venv: Path, tmp_path: Path, user_env: dict[str, str]
) -> None:
    cmd = [str(venv / "bin" / "megalab-train"), "experiment=quickstart", "trainer.max_steps=2"]
    proc = _run(cmd, cwd=tmp_path, env=user_env)
    assert "test/acc = " in proc.stdout
    (metrics,) = tmp_path.glob("logs/train/runs/*/metrics.json")
    record = json.loads(metrics.read_text())
    assert record["global_step"] == 2 and record["experiment"] == "quickstart"
    assert (tmp_path / "data" / "lra" / "listops_quick").is_dir()


# The wheel trains the quickstart in the default suite; the smoke reproduction (22 s) is slow.
@pytest.mark.slow
def test_smoke_data_and_a_smoke_reproduction_run_from_the_wheel(
    venv: Path, tmp_path: Path, user_env: dict[str, str]
) -> None:
    bin_dir = venv / "bin"
    _run([str(bin_dir / "megalab-data"), "smoke", "--out", "smoke"], cwd=tmp_path, env=user_env)
    assert (tmp_path / "smoke" / "lra").is_dir()

    out = tmp_path / "repro"
    sweep = [
        *(str(bin_dir / "megalab-sweep"), "sweeps/mega_lra.yaml", "--smoke", "--seeds", "1"),
        *("--only", "experiment=mega/lra_listops", "--out", str(out)),
    ]
    _run(sweep, cwd=tmp_path, env=user_env, timeout=600)
    manifest = json.loads((out / "mega_lra" / "sweep.json").read_text())
    assert Path(manifest["sweep"]).is_relative_to(venv), "the sweep file comes from the wheel"
    assert len(list(out.glob("mega_lra/**/metrics.json"))) == 1

    table = [str(bin_dir / "megalab-tables"), str(out), "--table", "mega/table2_lra"]
    proc = _run(table, cwd=tmp_path, env=user_env)
    assert "Mega Table 2" in proc.stdout
    assert re.search(r"^\| \| ours \| \d+\.\d\d \| missing", proc.stdout, re.MULTILINE), (
        "our ListOps number stands in the Mega row"
    )
