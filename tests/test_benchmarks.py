"""The Mega benchmark and its report run end to end on a tiny size (no timing is asserted).

`make bench` runs `benchmarks/bench_mega.py` and renders its JSON into docs/benchmarks.md with
`benchmarks/report.py`; these tests keep both scripts and the JSON they exchange working.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

# Every section but `compile` (inductor needs a minute to compile the block: slow test below).
SECTIONS = {
    "layer": ["transformer", "mega_chunk128", "mega_full", "mega_full_keep", "mega_full_mkl"],
    "ema": ["conv_autograd", "conv_ours", "ema_authors", "ema_ours", "mega_chunk128"],
    "attention": ["sdpa_math", "fused_recompute", "fused_keep", "fused_recompute_mkl",
                  "fused_keep_mkl"],
    "precision": ["mega_chunk128", "mega_chunk128_bf16", "mega_full", "mega_full_bf16",
                  "transformer", "transformer_bf16"],
    "kernel": ["kernel_naive", "kernel_ours"],
}  # fmt: skip
TINY = ["--lengths", "64", "--tokens", "128", "--rounds", "2", "--warmup", "1"]


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{BENCH}"}
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _ratio_ok(r: dict) -> None:
    assert set(r) == {"median", "min", "max"}
    assert 0 < r["min"] <= r["median"] <= r["max"]


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    _run(BENCH / "bench_mega.py", "--sections", *SECTIONS, "scaling", *TINY,
         "--scaling-lengths", "64", "128", "--json", out)  # fmt: skip
    return json.loads(out.read_text()), out


def test_json_has_settings_protocol_and_every_row(record: tuple[dict, Path]) -> None:
    rec, _ = record
    s = rec["settings"]
    assert s["threads"] == 1 and s["device"] == "cpu" and len(s["loadavg"]) == 3
    assert {"malloc", "omp_wait_policy", "threads"} <= set(s["runtime"])
    assert rec["protocol"]["rounds"] == 2 and rec["protocol"]["lengths"] == [64]
    assert set(rec["sections"]) == {*SECTIONS, "scaling"}
    for name, kinds in SECTIONS.items():
        rows = [r for r in rec["rows"] if r["section"] == name]
        assert [r["kind"] for r in rows] == kinds, name
        for r in rows:
            assert (r["L"], r["B"]) == (64, 2)
            assert len(r["times_s"]) == len(r["cpu_times_s"]) == 2
            _ratio_ok(r["speed_ratio"])
            _ratio_ok(r["cpu_speed_ratio"])
            assert r["saved_bytes_per_token"] > 0
        base = rows[0]  # each section's first kind is its baseline: ratio 1 in every round
        assert base["speed_ratio"]["min"] == base["speed_ratio"]["max"] == 1.0
    shares = [r for r in rec["rows"] if r["section"] == "ema" and r["kind"].startswith("conv")]
    for r in shares:
        _ratio_ok(r["share_of_layer"])
    scaling = [r for r in rec["rows"] if r["section"] == "scaling"]
    assert [(r["malloc"], r["L"]) for r in scaling] == [
        ("tuned", 64), ("tuned", 128), ("default", 64), ("default", 128)
    ]  # fmt: skip
    assert scaling[0]["settings"]["runtime"]["malloc"].startswith("tuned")
    assert scaling[2]["settings"]["runtime"]["malloc"].startswith("off")
    assert scaling[0]["cpu_relative_to_first"] == scaling[2]["relative_to_first"] == 1.0


def test_mkl_cases_run_the_fused_attention_without_onednn() -> None:
    """`*_mkl` cases switch the fused attention's oneDNN GEMMs off for their pass only (in a
    child process: importing the benchmark sets the process's allocator and threads)."""
    code = (
        "import bench_mega\n"
        "from megalab.nn import fused_attention as fa\n"
        "seen = []\n"
        "bench_mega.without_onednn(lambda: seen.append(fa.ONEDNN))()\n"
        "assert seen == [False] and fa.ONEDNN, (seen, fa.ONEDNN)\n"
    )
    _run("-c", code)


def test_report_fills_the_marked_block_only(record: tuple[dict, Path], tmp_path: Path) -> None:
    _, path = record
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Title\n\nprose before\n\n<!-- bench:begin -->\nold table\n"
                   "<!-- bench:end -->\n\n## SeqBoat\n\nprose after\n")  # fmt: skip
    _run(BENCH / "report.py", path, doc)
    text = doc.read_text()
    assert text.startswith("# Title\n\nprose before\n\n<!-- bench:begin -->\n")
    assert text.endswith("<!-- bench:end -->\n\n## SeqBoat\n\nprose after\n")
    block = text.split("<!-- bench:begin -->")[1].split("<!-- bench:end -->")[0]
    assert "old table" not in block and "1 intra-op thread" in block
    for kinds in SECTIONS.values():
        for kind in kinds:
            assert f"| {kind} | 64 | 2 |" in block or kind == "mega_chunk128"
    assert block.count("| tuned | ") == 2 and block.count("| default | ") == 2
    _run(BENCH / "report.py", path, doc)  # rendering again changes nothing
    assert doc.read_text() == text


def test_update_replaces_only_the_measured_sections(record: tuple[dict, Path]) -> None:
    rec, path = record
    copy = path.with_name("update.json")
    copy.write_text(json.dumps(rec))
    _run(BENCH / "bench_mega.py", "--sections", "kernel", *TINY, "--update", "--json", copy)
    new = json.loads(copy.read_text())
    old_rows = [r for r in rec["rows"] if r["section"] != "kernel"]
    assert [r for r in new["rows"] if r["section"] != "kernel"] == old_rows
    assert [r["kind"] for r in new["rows"] if r["section"] == "kernel"] == SECTIONS["kernel"]
    assert set(new["sections"]) == set(rec["sections"])


def test_report_refuses_a_document_without_markers(
    record: tuple[dict, Path], tmp_path: Path
) -> None:
    _, path = record
    doc = tmp_path / "plain.md"
    doc.write_text("no markers\n")
    env = {**os.environ, "PYTHONPATH": str(BENCH)}
    proc = subprocess.run([sys.executable, str(BENCH / "report.py"), str(path), str(doc)],
                          env=env, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0 and "<!-- bench:begin -->" in proc.stderr
    assert doc.read_text() == "no markers\n"


@pytest.mark.slow
def test_compile_section_runs(tmp_path: Path) -> None:
    out = tmp_path / "compile.json"
    _run(BENCH / "bench_mega.py", "--sections", "compile", *TINY, "--json", out)
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == [
        "mega_chunk128", "mega_chunk128_compiled", "mega_chunk128_compiled_real"
    ]  # fmt: skip
    for r in rows:
        _ratio_ok(r["cpu_speed_ratio"])


def test_e2e_runs_each_checkout_through_its_own_training_entry_point(tmp_path: Path) -> None:
    """bench_e2e compares against older commits, whose training module is `megalab.train`, and
    records each checkout by its commit."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e", BENCH / "bench_e2e.py")
    assert spec is not None and spec.loader is not None
    bench_e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_e2e)
    assert bench_e2e.train_module(ROOT) == "megalab.cli.train"
    (tmp_path / "src/megalab").mkdir(parents=True)
    (tmp_path / "src/megalab/train.py").write_text("")
    assert bench_e2e.train_module(tmp_path) == "megalab.train"
    # The record names commits, not folders of the machine it ran on.
    assert bench_e2e.describe(ROOT).startswith("a checkout of ")
    assert bench_e2e.describe(tmp_path) == "a checkout outside git"
