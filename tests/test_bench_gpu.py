"""The GPU benchmark and the GPU check run their code on the CPU (no timing is asserted).

`make gpu-check` (benchmarks/gpu_check.py) runs on a CUDA machine that is rarely at hand: these
tests keep `benchmarks/bench_gpu.py --smoke` and the check's own plumbing working here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu  # noqa: E402
import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("bench_gpu")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_gpu.py",
            "--smoke",
            "--json",
            str(out / "b.json"),
            "--md",
            str(out / "b.md"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "b.json").read_text()), (out / "b.md").read_text(), out / "b.json"


def test_the_smoke_benchmark_measures_every_case_of_every_section(smoke) -> None:
    record, markdown, _ = smoke
    assert record["failures"] == [] and record["measured"] is False
    settings = record["settings"]
    assert {"device", "driver", "cuda", "torch", "triton"} <= set(settings)
    kinds = {(r["section"], r["kind"]) for r in record["rows"]}
    assert {("blocks", k) for k in bench_gpu.BLOCKS} <= kinds
    assert {
        ("lra_text", e)
        for e in (
            "transformer/lra_text",
            "mega/lra_text",
            "mega_chunk/lra_text",
            "seqboat/lra_text",
            "megalodon_chunk/lra_text",
        )
    } <= kinds
    assert {("e2e", "llama/pg19"), ("e2e", "megalodon/pg19_100m")} <= kinds
    for r in record["rows"]:
        assert "error" not in r, r
        assert len(r["times_s"]) == record["protocol"]["rounds"]
        assert r["min"] <= r["median"] <= r["max"] and r["tokens_per_s"] > 0
        assert r["launches_per_step"] > 0 and r["launches_of"] == "aten ops"
        assert r["speed_ratio"]["min"] <= r["speed_ratio"]["median"] <= r["speed_ratio"]["max"]
    assert all(r["steps_per_s"] > 0 for r in record["rows"] if r["section"] == "e2e")
    assert "| megalodon_chunk |" in markdown and "### LRA Text" in markdown


def test_a_saved_record_renders_to_the_same_tables(smoke) -> None:
    """What the check shows of a benchmark killed at its budget: the rows it saved."""
    _, markdown, path = smoke
    assert gpu_check.rendered_bench(path).strip() == markdown.strip()


def test_the_benchmark_refuses_to_measure_without_cuda() -> None:
    if __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device is visible")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_gpu.py", "--sections", "blocks"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "--smoke runs its code on the CPU" in proc.stderr


def test_the_check_installs_what_a_bare_image_lacks_and_never_torch() -> None:
    reqs = gpu_check.requirements()
    names = {gpu_check._name(r).lower() for r in reqs}
    assert {"lightning", "hydra-core", "omegaconf", "torchmetrics", "pytest"} <= names
    assert "torch" not in names and "triton" not in names
    pins = {gpu_check._name(p).lower() for p in gpu_check.pinned()}
    assert "antlr4-python3-runtime" in pins and not pins & {"torch", "triton"}


def test_a_part_that_fails_or_runs_out_of_time_is_recorded(tmp_path: Path) -> None:
    ok = gpu_check.run_part("ok", [sys.executable, "-c", "print('fine')"], {}, 60)
    assert ok["status"] == "passed" and "fine" in ok["tail"]
    bad = gpu_check.run_part("bad", [sys.executable, "-c", "raise SystemExit(3)"], {}, 60)
    assert bad["status"] == "failed" and bad["returncode"] == 3
    slow = gpu_check.run_part("slow", [sys.executable, "-c", "import time; time.sleep(60)"], {}, 1)
    assert slow["status"] == "timed out" and slow["seconds"] < 30
    unset = gpu_check.run_part(
        "env",
        [sys.executable, "-c", "import os; print(os.environ.get('TRITON_INTERPRET'))"],
        {"TRITON_INTERPRET": ""},
        60,
    )
    assert unset["tail"].strip() == "None"


def test_pytest_counts_come_from_junit(tmp_path: Path) -> None:
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2">'
        "</testsuite></testsuites>"
    )
    assert gpu_check.junit_counts(junit) == {"passed": 2, "failed": 1, "errors": 0, "skipped": 2}
    assert gpu_check.junit_counts(tmp_path / "missing.xml") is None


def test_the_record_says_why_each_test_failed(tmp_path: Path) -> None:
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="1">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad[x]">'
        '<failure message="InstantiationException: Error in call to target&#10;more">'
        "tests/test_a.py:12: in test_bad&#10;    train(cfg)&#10;"
        "src/megalab/nn/x.py:34: in f&#10;    raise ValueError(&quot;no clipping by norm&quot;)"
        "&#10;E   ValueError: no clipping by norm</failure></testcase>"
        '<testcase classname="tests.test_b" name="test_err"><error message="">Timeout &gt;45.0s'
        "</error></testcase></testsuite></testsuites>"
    )
    trace = (
        "tests/test_a.py:12: in test_bad\n    train(cfg)\nsrc/megalab/nn/x.py:34: in f\n"
        '    raise ValueError("no clipping by norm")\nE   ValueError: no clipping by norm'
    )
    assert gpu_check.junit_failures(junit) == [
        {"test": "tests.test_a::test_bad[x]", "kind": "failure",
         "message": "InstantiationException: Error in call to target",
         "at": "src/megalab/nn/x.py:34", "trace": trace},
        {"test": "tests.test_b::test_err", "kind": "error", "message": "Timeout >45.0s",
         "at": "", "trace": "Timeout >45.0s"},
    ]  # fmt: skip
    assert gpu_check.junit_failures(tmp_path / "missing.xml") == []


def test_a_pytest_part_that_only_skipped_did_not_pass() -> None:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 49}
    part = {"status": "passed", "returncode": 0, "counts": counts}
    assert gpu_check.pytest_status(part) == "all skipped"
    assert gpu_check.pytest_status({**part, "counts": {**counts, "passed": 3}}) == "passed"
    assert gpu_check.pytest_status({"status": "failed", "returncode": 5, "counts": None}) == (
        "no tests"
    )
    assert gpu_check.pytest_status({**part, "status": "timed out", "returncode": -9}) == (
        "timed out"
    )


def test_the_gpu_parts_find_their_tests() -> None:
    files = gpu_check.gpu_test_files()
    assert "tests/test_experiments.py" in files and "tests/test_trainers.py" in files
    assert gpu_check.TRAINER_RUNS not in files
    assert not any(f.endswith("_golden.py") for f in files)
    cmds = gpu_check.commands(Path("out"))
    assert set(cmds) == set(gpu_check.PARTS)
    assert cmds["kernels"][1] == {"TRITON_INTERPRET": ""}
    assert sum(gpu_check.BUDGETS.values()) <= 8 * 60 - 15
    # compiling parts overlap their compilations in pytest-xdist processes (installed here, and
    # on the GPU image from the check's requirements); the DDP/NCCL runs stay in one process
    assert "pytest-xdist" in gpu_check.requirements()
    for part, (cmd, _env) in cmds.items():
        assert ("-n" in cmd) == (part in ("kernels", "golden_cuda")), part


def test_speed_ratios_are_of_throughput_when_micro_batches_differ() -> None:
    """A case stepping half the baseline's sequences in 0.6 of its time runs at 0.83x its
    tokens per second, not 1.67x (LRA Text: Mega's 25 sequences against the Transformer's 50)."""
    base = {"tokens_per_step": 50 * 4000, "times_s": [1.0, 1.0, 1.0]}
    half = {"tokens_per_step": 25 * 4000, "times_s": [0.6, 0.5, 0.6]}
    ratio = bench_gpu.speed_ratio(base, half)
    assert ratio["median"] == pytest.approx(1.0 / 0.6 / 2)
    assert ratio["min"] == pytest.approx(1.0 / 0.6 / 2) and ratio["max"] == pytest.approx(1.0)


def test_launches_are_counted_by_source_line_and_do_not_depend_on_the_sizes() -> None:
    """benchmarks/count_launches.py: every launch is charged to a line, the Triton kernels count
    once each, and the count is the same at two sizes (it stands in for the GPU's count)."""
    import count_launches

    # Sizes at which the interpreter is quick (Megalodon's step at d = 64 takes 15 s on a core).
    small = count_launches.main(["--d", "16", "--length", "16", "--chunk", "8", "--lines", "0"])
    large = count_launches.main(["--d", "32", "--length", "32", "--chunk", "16", "--lines", "0"])
    for kind in ("llama", "mega_chunk", "megalodon_chunk"):
        block = small["blocks"][kind]
        assert block["launches"] == large["blocks"][kind]["launches"], kind
        assert sum(block["by_line"].values()) == sum(block["by_op"].values()) == block["launches"]
        assert 8 < block["saved_bytes_per_token_feature"] < 1000, kind
        assert any(line.startswith("nn/rope.py:") for line in block["by_line"]), kind  # RoPE
        assert any(line.startswith(f"models/{kind.split('_')[0]}/") for line in block["by_line"])
    triton = {op for op in small["blocks"]["megalodon_chunk"]["by_op"] if op.startswith("triton:")}
    assert {
        "triton:fwd_kernel", "triton:_apply_kernel", "triton:_fwd_normalize",
        "triton:_log_decay_kernel", "triton:_queries_keys_kernel",
    } <= triton  # fmt: skip
    assert not any(op.startswith("triton:") for op in small["blocks"]["llama"]["by_op"])
    # the bound set for a block step's launches on a GPU: at most twice Llama's
    assert 1.5 < small["blocks"]["megalodon_chunk"]["ratio_to_first"] <= 2.0
    assert small["blocks"]["mega_chunk"]["ratio_to_first"] <= 2.0


def test_the_summary_names_where_each_failure_was_raised(tmp_path: Path) -> None:
    failure = {"test": "tests.t::test_x", "kind": "failure", "message": "Error in call",
               "at": "src/megalab/nn/x.py:34", "trace": "E   ValueError: bad"}  # fmt: skip
    part = {"status": "failed", "counts": {"failed": 1}, "seconds": 3.0, "budget_s": 10.0,
            "tail": "output", "failures": [failure]}  # fmt: skip
    text = gpu_check.render({"environment": {}, "parts": {"trainer_runs": part}, "seconds": 3.0})
    assert "- `tests.t::test_x` (failure): Error in call (at `src/megalab/nn/x.py:34`)" in text
