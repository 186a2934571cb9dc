"""The one-command check of megalab on a CUDA machine (`make gpu-check`), each part time-boxed.

    python benchmarks/gpu_check.py [--out benchmarks/results] [--parts gpu_tests ...]
        [--budget bench=120 ...]
    python benchmarks/gpu_check.py --requirements     # what a bare CUDA + PyTorch image lacks
    python benchmarks/gpu_check.py --download-wheels DIR [--python-version 3.12]

Parts, in order (docs/gpu.md), each a process of its own killed at its budget in seconds:

1. gpu_tests: the tests marked `gpu` (every test file that marks one, but the two below).
2. golden_cuda: the golden tests' CUDA variants (tests/models/test_*_golden.py -m gpu):
   float32 at the golden READMEs' float32 tolerances, and a bf16-autocast bound.
3. kernels: the Triton kernels' tests (tests/kernels) compiled (TRITON_INTERPRET unset).
4. trainer_runs: two training steps of one experiment of every model with trainer=gpu, ddp and
   fsdp on one GPU (tests/test_gpu_trainers.py).
5. bench: benchmarks/bench_gpu.py (its JSON and tables go beside this check's).

A part that fails or runs out of time is recorded and the next one runs. The record goes to
`<out>/gpu_check.json` (per part: status, pytest counts, seconds, the output's tail) and a summary
to `<out>/gpu_check.md`, after every part. The exit status is 0 only when every part passed.
Only the standard library is imported here: the check starts on a bare image, before anything
else is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Seconds per part: 465 in all, so that the whole check stays under 8 minutes on one H100. Measured
# there (docs/gpu.md): the GPU-marked tests 61 s once Triton's cache is warm, the compiled kernel
# tests 7-14 s, the trainer runs about 6 s each (24 of them), the benchmark 118 s.
BUDGETS = {"gpu_tests": 90, "golden_cuda": 70, "kernels": 30, "trainer_runs": 170, "bench": 105}
# A test still running after this many seconds fails alone (pytest-timeout, where installed), so
# that a hanging test leaves its part's summary and the failures' reasons in the record.
TEST_TIMEOUT = {"gpu_tests": 60, "golden_cuda": 30, "kernels": 30, "trainer_runs": 45}
PARTS = list(BUDGETS)
# Files that hold the tests of parts 2 and 4 (part 1 takes every other file marking `gpu`).
TRAINER_RUNS = "tests/test_gpu_trainers.py"
GOLDEN = "tests/models/test_*_golden.py"
# Beside megalab's dependencies (pyproject.toml, torch excepted), what its tests need.
TEST_REQUIREMENTS = ["pytest", "jsonschema", "pytest-xdist"]
# Parts whose time goes mostly to compiling (Triton's kernels, each test's first CUDA kernels)
# run in this many pytest-xdist processes, where it is installed: the compilations overlap.
WORKERS = {"golden_cuda": 4, "kernels": 4}
# Packages of the image itself, never downloaded or installed by the check.
IMAGE_PACKAGES = re.compile(r"^(torch|triton|pytorch-triton|nvidia-[\w-]+|cuda-[\w-]+)$", re.I)


# -- what to install -----------------------------------------------------------------------------
def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0]


def requirements() -> list[str]:
    """megalab's dependencies without torch, and the test tools: what a bare image lacks."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    if block is None:
        raise SystemExit("pyproject.toml has no [project] dependencies list")
    deps = re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)
    return [d for d in deps if not IMAGE_PACKAGES.match(_name(d))] + TEST_REQUIREMENTS


def pinned() -> list[str]:
    """The pins of constraints.txt without the image's packages (torch, Triton, NVIDIA)."""
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = [ln.strip() for ln in lines if "==" in ln and not ln.lstrip().startswith("#")]
    return [p for p in pins if not IMAGE_PACKAGES.match(_name(p))]


def download_wheels(folder: Path, python_version: str) -> int:
    """Every pin of constraints.txt (the image's packages excepted) as a wheel for CPython
    `python_version` on manylinux x86-64, into `folder`; a package published only as a source
    archive is built into a wheel here (pure Python ones: antlr4-python3-runtime). Also pip's
    build tools, for `pip install --no-index -e .`. Returns the number of pins that failed."""
    folder.mkdir(parents=True, exist_ok=True)
    tag = python_version.replace(".", "")
    platform_args = [
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "--abi",
        f"cp{tag}",
        "--abi",
        "abi3",
        "--abi",
        "none",
        *[
            a
            for p in (
                "manylinux2014_x86_64",
                "manylinux_2_17_x86_64",
                "manylinux_2_28_x86_64",
                "manylinux_2_34_x86_64",
                "any",
            )
            for a in ("--platform", p)
        ],
    ]
    failed = 0
    for pin in [*pinned(), "wheel"]:
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
        got = subprocess.run(
            [*pip, "download", "--no-deps", "-d", str(folder), *platform_args, pin],
            capture_output=True,
            text=True,
        )
        if got.returncode != 0:  # no wheel for the platform: build one (pure Python)
            got = subprocess.run(
                [*pip, "wheel", "--no-deps", "-w", str(folder), pin], capture_output=True, text=True
            )
        if got.returncode != 0:
            failed += 1
            print(f"no wheel for {pin}: {got.stderr.strip()[-300:]}", file=sys.stderr)
    (folder / "requirements.txt").write_text("\n".join(requirements()) + "\n")
    (folder / "constraints.txt").write_text("\n".join(pinned()) + "\n")
    print(f"{len(list(folder.glob('*.whl')))} wheels in {folder} ({failed} pins failed)")
    return failed


# -- the parts -----------------------------------------------------------------------------------
def gpu_test_files() -> list[str]:
    """Test files that mark a test `gpu` (or list GPU-only experiments), but parts 2 and 4's."""
    skip = {TRAINER_RUNS, *(str(p.relative_to(ROOT)) for p in ROOT.glob(GOLDEN))}
    files = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = str(path.relative_to(ROOT))
        if rel not in skip and re.search(r"mark\.gpu|GPU_ONLY", path.read_text()):
            files.append(rel)
    return files


def pytest_command(
    files: list[str],
    junit: Path,
    marks: str | None,
    timeout: int | None = None,
    workers: int = 0,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rfEs",
        "--tb=short",
        "--durations=10",
        f"--junitxml={junit}",
        *files,
    ]
    if timeout and importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append(f"--timeout={timeout}")
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(min(workers, os.cpu_count() or 1))]
    return cmd + (["-m", marks] if marks else [])


def commands(out: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each part's command and its extra environment."""
    golden = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(GOLDEN))
    box = max(20, BUDGETS["bench"] - 25)  # the benchmark's own: its start and last case fit
    t = TEST_TIMEOUT
    return {
        "gpu_tests": (
            pytest_command(gpu_test_files(), out / "gpu_tests.xml", "gpu", t["gpu_tests"]),
            {},
        ),
        "golden_cuda": (
            pytest_command(
                golden, out / "golden_cuda.xml", "gpu", t["golden_cuda"], WORKERS["golden_cuda"]
            ),
            {},
        ),
        "kernels": (
            pytest_command(
                ["tests/kernels"], out / "kernels.xml", None, t["kernels"], WORKERS["kernels"]
            ),
            {"TRITON_INTERPRET": ""},
        ),
        "trainer_runs": (
            pytest_command([TRAINER_RUNS], out / "trainer_runs.xml", "gpu", t["trainer_runs"]),
            {},
        ),
        "bench": (
            [
                sys.executable,
                "benchmarks/bench_gpu.py",
                "--time-box",
                str(box),
                "--json",
                str(out / "bench_gpu.json"),
                "--md",
                str(out / "bench_gpu.md"),
            ],
            {},
        ),
    }


def junit_counts(path: Path) -> dict[str, int] | None:
    """passed/failed/errors/skipped of a pytest JUnit XML (None when pytest wrote none)."""
    if not path.is_file():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {
        "passed": passed,
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
    }


# A frame of pytest's short traceback ("src/megalab/x.py:12: in f"), and how many of a failure's
# last traceback lines the record keeps.
_FRAME = re.compile(r"^(\S+\.py:\d+): ")
TRACE_LINES = 12


def junit_failures(path: Path) -> list[dict[str, str]]:
    """Each failed or erroring test of a pytest JUnit XML: its id, the first line of why, the
    innermost `file:line` of its traceback (`at`: where a wrapped error, such as Hydra's
    instantiation error, was raised) and the traceback's last lines (`trace`)."""
    if not path.is_file():
        return []
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return []
    found = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is None:
                continue
            why = (node.get("message") or node.text or "").strip().splitlines()
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            text = [line for line in (node.text or "").splitlines() if line.strip()]
            frames = [m.group(1) for m in map(_FRAME.match, text) if m]
            found.append(
                {
                    "test": name,
                    "kind": kind,
                    "message": (why[0] if why else "")[:400],
                    "at": frames[-1] if frames else "",
                    "trace": "\n".join(text[-TRACE_LINES:])[-1500:],
                }
            )
    return found


def pytest_status(part: dict[str, Any]) -> str:
    """A pytest part's status: `no tests` when pytest found none, `all skipped` when none ran
    (no CUDA device: nothing was checked), else the process's."""
    counts = part.get("counts") or {}
    if part["status"] == "failed" and part["returncode"] == 5:
        return "no tests"
    if part["status"] == "passed" and not counts.get("passed"):
        return "all skipped"
    return str(part["status"])


def run_part(name: str, cmd: list[str], env: dict[str, str], budget: float) -> dict[str, Any]:
    """Run one part in its own process group, killed at `budget` seconds; what happened."""
    full_env = {**os.environ, **env}
    for key, value in env.items():
        if value == "":  # unset (TRITON_INTERPRET: the kernels compile)
            full_env.pop(key, None)
    src = str(ROOT / "src")
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, full_env.get("PYTHONPATH")]))
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=budget)
        status = "passed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = "timed out"
    seconds = time.monotonic() - start
    print(f"[gpu-check] {name}: {status} in {seconds:.0f} s", file=sys.stderr, flush=True)
    return {
        "status": status,
        "returncode": proc.returncode,
        "seconds": round(seconds, 1),
        "budget_s": budget,
        "command": " ".join(cmd),
        "tail": output[-6000:],
    }


def rendered_bench(path: Path) -> str:
    """The tables of a benchmark JSON (`bench_gpu.py --render`), or why there are none."""
    cmd = [sys.executable, "benchmarks/bench_gpu.py", "--render", str(path)]
    got = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return got.stdout if got.returncode == 0 else f"(no tables: {got.stderr.strip()[-500:]})"


def environment() -> dict[str, Any]:
    """Versions of what the check runs on (torch is asked in a child: it may be missing)."""
    probe = (
        "import json, torch; c = torch.cuda.is_available(); print(json.dumps({"
        "'torch': torch.__version__, 'cuda': torch.version.cuda, 'cuda_available': c, "
        "'device': torch.cuda.get_device_name(0) if c else None}))"
    )
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    info: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    if got.returncode == 0:
        info.update(json.loads(got.stdout.strip().splitlines()[-1]))
    else:
        info["torch_error"] = got.stderr.strip()[-500:]
    return info


def render(record: dict[str, Any]) -> str:
    env = record["environment"]
    lines = [
        "# GPU check",
        "",
        f"{env.get('device') or 'no CUDA device'}; torch {env.get('torch')}, CUDA "
        f"{env.get('cuda')}, Python {env.get('python')}; {record['seconds']:.0f} s in all.",
        "",
        *(
            []
            if env.get("cuda_available")
            else [
                "**No CUDA device was visible: the GPU tests skip and the benchmark refuses to "
                "run, so nothing on a GPU was checked.**",
                "",
            ]
        ),
        "| part | status | passed | failed | errors | skipped | seconds (budget) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, part in record["parts"].items():
        c = part.get("counts") or {}
        lines.append(
            f"| {name} | {part['status']} | {c.get('passed', '')} | {c.get('failed', '')} "
            f"| {c.get('errors', '')} | {c.get('skipped', '')} "
            f"| {part['seconds']:.0f} ({part['budget_s']:.0f}) |"
        )
    bench = record.get("bench_markdown")
    if bench:
        lines += ["", "## Benchmarks (benchmarks/bench_gpu.py)", "", bench]
    failing = [n for n, p in record["parts"].items() if p["status"] != "passed"]
    for name in failing:
        part = record["parts"][name]
        lines += ["", f"## {name}: {part['status']}", ""]
        for failure in part.get("failures") or []:
            at = f" (at `{failure['at']}`)" if failure.get("at") else ""
            lines.append(f"- `{failure['test']}` ({failure['kind']}): {failure['message']}{at}")
        lines += ["", "```", part["tail"][-2500:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    ap.add_argument("--budget", nargs="*", default=[], metavar="PART=SECONDS")
    ap.add_argument(
        "--requirements",
        action="store_true",
        help="print what a bare CUDA + PyTorch image lacks, one per line",
    )
    ap.add_argument("--download-wheels", type=Path, metavar="DIR")
    ap.add_argument("--python-version", default="3.12")
    args = ap.parse_args(argv)
    if args.requirements:
        print("\n".join(requirements()))
        return 0
    if args.download_wheels:
        return 1 if download_wheels(args.download_wheels, args.python_version) else 0
    for item in args.budget:
        part, _, seconds = item.partition("=")
        if part not in BUDGETS or not seconds:
            raise SystemExit(f"--budget takes PART=SECONDS with PART one of {PARTS}, got {item!r}")
        BUDGETS[part] = int(seconds)

    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    record: dict[str, Any] = {"environment": environment(), "parts": {}, "seconds": 0.0}
    print(f"[gpu-check] {json.dumps(record['environment'])}", file=sys.stderr, flush=True)
    cmds = commands(args.out)
    for name in args.parts:
        cmd, env = cmds[name]
        part = run_part(name, cmd, env, BUDGETS[name])
        if cmd[1:3] == ["-m", "pytest"]:
            junit = Path(next(a for a in cmd if a.startswith("--junitxml=")).split("=", 1)[1])
            part["counts"] = junit_counts(junit)
            part["failures"] = junit_failures(junit)
            part["status"] = pytest_status(part)
        if name == "bench":
            bench = args.out / "bench_gpu.json"
            if bench.is_file():
                record["bench"] = json.loads(bench.read_text())
            md = args.out / "bench_gpu.md"
            if not md.is_file() and bench.is_file():  # killed at its budget: its saved rows
                md.write_text(rendered_bench(bench))
            record["bench_markdown"] = md.read_text() if md.is_file() else None
        record["parts"][name] = part
        record["seconds"] = round(time.monotonic() - start, 1)
        (args.out / "gpu_check.json").write_text(json.dumps(record, indent=1) + "\n")
        (args.out / "gpu_check.md").write_text(render(record))
    print(render(record))
    return 0 if all(p["status"] == "passed" for p in record["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
