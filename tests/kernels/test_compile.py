"""Every kernel launch of the interpreted kernel tests compiles for an H100 and an A100.

The interpreter runs the kernels as Python and accepts what the compiler may refuse; this test
records each distinct launch of `tests/kernels` under the interpreter (`launches.py`) and
compiles it with Triton's compiler and ptxas for CUDA capabilities 9.0 and 8.0, no GPU needed.
It also checks that every launch pins `megalab.kernels.LAUNCH_OPTIONS`, and that no kernel of
`megalab.kernels` goes unlaunched (a kernel the tests never launch is never compiled here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalab import kernels

from .launches import ENV

TESTS = Path(__file__).resolve().parents[1]
SHARED_MEMORY = {90: 227 * 1024, 80: 163 * 1024}  # bytes per block, H100 and A100

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernels.triton_available(), reason="needs Triton (the gpu extra)"),
    # What it stands in for: on a CUDA machine the kernel tests themselves compile every launch
    # for the device, and `make gpu-check` gives them 30 s, not this test's two minutes.
    pytest.mark.skipif(torch.cuda.is_available(), reason="the other kernel tests compile on CUDA"),
]


def _launched_kernels() -> set[str]:
    """The @triton.jit functions of megalab's kernel modules (every module of the folder) that
    the host code launches."""
    folder = Path(kernels.__file__ or "").parent
    modules = {p.stem: p.read_text() for p in folder.glob("*.py") if p.name != "__init__.py"}
    host = "".join(modules.values())
    names = set()
    for module, source in modules.items():
        for line in source.splitlines():
            if line.startswith("def ") and "@triton.jit\n" + line in source:
                name = line[4:].split("(")[0]
                if f"{name}[" in host:
                    names.add(f"megalab.kernels.{module}.{name}")
    return names


def test_every_launch_compiles_for_sm90_and_sm80(tmp_path: Path) -> None:
    record = tmp_path / "launches.json"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        ENV: str(record),
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", str(TESTS / "kernels"), "-q", "-m", "not slow",
         "-p", "kernels.launches", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--basetemp", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=1200, check=False, cwd=TESTS.parent,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    launches = json.loads(record.read_text())
    assert {f"{e['module']}.{e['name']}" for e in launches} == _launched_kernels()
    for launch in launches:
        for option, value in kernels.LAUNCH_OPTIONS.items():
            assert launch["options"].get(option) == value, (launch["name"], launch["options"])

    compile_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for capability, limit in SHARED_MEMORY.items():
        done = subprocess.run(
            [sys.executable, str(TESTS / "kernels" / "launches.py"), str(record), str(capability)],
            env=compile_env, capture_output=True, text=True, timeout=1800, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads(done.stdout.strip().splitlines()[-1])
        assert len(results) == len(launches)
        errors = [(r["kernel"], r["error"][:500]) for r in results if "error" in r]
        assert not errors, f"sm_{capability}: {errors}"
        too_big = [(r["kernel"], r["shared"]) for r in results if r["shared"] > limit]
        assert not too_big, f"sm_{capability}: over {limit} bytes of shared memory: {too_big}"
