"""Shared test fixtures: Hydra config composition and tiny datasets in the official formats."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# One OpenMP thread for the test process and every process it starts (runs, spawned ranks): the
# suite is many small ops, and `make test` runs it in two worker processes (pytest-xdist), where a
# second thread per process only oversubscribes the cores. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

# Without CUDA, Triton's interpreter runs the fused kernels on CPU tensors (megalab.kernels): it
# must be set before any kernel module is imported, since Triton reads it when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from megalab.cli.sweep import SMOKE_TRAINER
from megalab.testing import write_all_fixtures
from megalab.utils.paths import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("MEGALAB_ROOT", str(ROOT))
# The entry points' malloc tuning (megalab.utils.runtime: no mmap, no trimming) applies to the
# whole process once `megalab.cli.train` is imported, and then every freed block stays resident: a
# test session builds hundreds of models of different sizes one after another, and its resident
# set only grew (docs/reliability.md, "Test-suite memory"). Off for the test process and the runs
# it starts; tests/test_runtime.py checks the tuning in processes of its own.
os.environ.setdefault("MEGALAB_MALLOC_TUNING", "0")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One intra-op thread even where OMP_NUM_THREADS was set otherwise (see above).
torch.set_num_threads(1)

# Overrides that make any configuration run in seconds on a CPU (the smoke runs' trainer).
FAST = [*SMOKE_TRAINER, "logger=none", "data.num_workers=0"]


@pytest.fixture(autouse=True)
def _root_log_handlers_of_the_test_removed() -> Iterator[None]:
    """The command-line `main()`s a test calls set up logging (`logging.basicConfig`) on the
    stream the test's output capture holds; left on the root logger, that handler writes to a
    closed stream in every later test of the process ("--- Logging error ---" on stderr)."""
    import logging

    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)


@pytest.fixture(scope="module", autouse=True)
def _return_freed_memory() -> Iterator[None]:
    """After each test file, give the heap's free pages back to the system (glibc keeps them
    while a live block sits above them: 2.0 GB resident after three experiment tests, 0.7 GB
    once trimmed)."""
    yield
    import ctypes
    import gc
    import platform

    gc.collect()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="session")
def fixture_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory holding every dataset as a tiny fixture in its official layout."""
    root = tmp_path_factory.mktemp("data")
    write_all_fixtures(root)
    return root


@pytest.fixture
def compose_cfg(tmp_path: Path, fixture_data_dir: Path) -> Iterator[Callable[..., DictConfig]]:
    """Compose a config (train.yaml by default) with FAST overrides, outputs under tmp_path."""

    def _compose(*overrides: str, config: str = "train", fast: bool = True) -> DictConfig:
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(
                config,
                overrides=[
                    *(FAST if fast else []),
                    f"paths.data_dir={fixture_data_dir}",
                    f"paths.log_dir={tmp_path / 'logs'}",
                    f"hydra.run.dir={tmp_path / 'run'}",
                    *overrides,
                ],
                return_hydra_config=True,
            )
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(tmp_path / "run")
            cfg.hydra.job.num = 0
        HydraConfig().set_config(cfg)
        return cfg

    yield _compose
    GlobalHydra.instance().clear()


def run_cli(
    *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run a command with the test interpreter; return the completed process (no check)."""
    full_env = {**os.environ, "MEGALAB_ROOT": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- peak memory per test (`make test-memory`, docs/reliability.md) -------------------------------
# With MEGALAB_TEST_MEMORY=<file.json>, each test's peak resident set is measured (VmHWM, reset to
# the current RSS before the test through /proc/self/clear_refs) together with the largest child
# process waited for so far (runs started with run_cli, spawned ranks), and written to that file,
# largest first. MEGALAB_TEST_MEMORY_LIMIT_GB (default 6) fails the session past it. Under
# pytest-xdist (`-n`) each worker measures its own tests in its own process and hands them to the
# controller when it finishes, which writes the one report.
_MEMORY_REPORT = os.environ.get("MEGALAB_TEST_MEMORY")
_memory: dict[str, dict[str, float]] = {}


def _vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _MEMORY_REPORT:
        yield
        return
    import resource

    Path("/proc/self/clear_refs").write_text("5")
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    yield
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    _memory[item.nodeid] = {
        "peak_gb": _vm_hwm_bytes() / 2**30,
        "child_peak_gb": (children / 2**30) if children > children_before else 0.0,
    }


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist controller: collect a finished worker's peaks."""
    _memory.update(getattr(node, "workeroutput", {}).get("megalab_memory", {}))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _MEMORY_REPORT:
        return
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller writes the report
        workeroutput["megalab_memory"] = _memory
        return
    if not _memory:
        return
    import json

    limit = float(os.environ.get("MEGALAB_TEST_MEMORY_LIMIT_GB", "6"))
    ranked = sorted(_memory.items(), key=lambda kv: -max(kv[1].values()))
    worst = max(max(v.values()) for v in _memory.values())
    Path(_MEMORY_REPORT).write_text(
        json.dumps(
            {"tests": len(_memory), "max_gb": worst, "limit_gb": limit, "peaks": dict(ranked)},
            indent=1,
        )
        + "\n"
    )
    over = [n for n, v in ranked if max(v.values()) > limit]
    if over:
        print(f"\n{len(over)} test(s) over {limit} GB resident: {over[:10]}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA; without it they are skipped, saying why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
