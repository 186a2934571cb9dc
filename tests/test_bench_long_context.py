"""The long-context benchmark runs end to end on a tiny size and renders what it recorded (no
timing is asserted): both clocks, the memory columns and the conditions of every length."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_long_context.py"
TINY = ["--d-model", "32", "--chunks", "64", "128", "--decode", "2", "--rounds", "2"]
TRAIN_CASES = ["llama", "mega_c64", "mega_c128", "megalodon_c64", "megalodon_c128"]


def _run(*args: str | Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _range_ok(r: dict) -> None:
    assert set(r) == {"median", "min", "max"}
    assert 0 < r["min"] <= r["median"] <= r["max"]


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[Path]]:
    """One process per length, as the long runs are made; Llama only up to 256 tokens."""
    out = tmp_path_factory.mktemp("lc")
    paths = [out / "lc_256.json", out / "lc_512.json"]
    _run(*TINY, "--lengths", "256", "--contexts", "128", "--json", paths[0])
    _run(*TINY, "--lengths", "512", "--sections", "train", "--llama-max-len", "256",
         "--skip-cases", "megalodon_c128", "--json", paths[1])  # fmt: skip
    return [json.loads(p.read_text()) for p in paths], paths


def test_rows_have_both_clocks_ratios_and_memory(records: tuple[list[dict], list[Path]]) -> None:
    (first, second), _ = records
    s = first["settings"]
    assert s["threads"] == 1 and s["rounds"] == 2 and len(s["loadavg_at_start"]) == 3
    assert s["available_gb_at_start"] > 0 and {"malloc", "omp_wait_policy"} <= set(s["runtime"])
    train = {r["case"]: r for r in first["rows"] if r["section"] == "train"}
    assert list(train) == TRAIN_CASES
    for name, r in train.items():
        assert len(r["times_s"]) == len(r["cpu_times_s"]) == 2
        _range_ok(r["cpu"])
        _range_ok(r["speed_ratio"])
        _range_ok(r["cpu_speed_ratio"])
        assert r["saved_bytes_per_token"] > 0 and r["step_peak_rss_mb"] is not None
        assert (r["memory_ratio"] == 1.0) == (name == "llama")
    decode = [r for r in first["rows"] if r["section"] == "decode"]
    assert [r["case"] for r in decode] == ["llama", "mega_c64", "megalodon_c64"]
    assert all(r["cpu_tokens_per_s"] > 0 and r["state_mb"] > 0 for r in decode)
    assert [(c["section"], c["L"]) for c in s["conditions"]] == [("decode", 128), ("train", 256)]
    assert all(c["process_peak_rss_mb"] > 0 for c in s["conditions"])
    # Llama beyond --llama-max-len: a row that says so; the others carry no ratio against it.
    rows = {r["case"]: r for r in second["rows"]}
    assert "not_run" in rows["llama"] and "speed_ratio" not in rows["mega_c64"]
    assert "megalodon_c128" not in rows and second["settings"]["skip_cases"] == ["megalodon_c128"]


def test_render_joins_the_files_of_each_length(records: tuple[list[dict], list[Path]]) -> None:
    _, paths = records
    text = _run("--render", *paths)
    assert "| megalodon_c64 | 512 |" in text and "| llama | 512 | not run:" in text
    assert "| mega_c64 | 128 |" in text  # decode
    conditions = text.split("### Conditions per length")[1]
    assert [line.split("|")[1:3] for line in conditions.splitlines() if "| train" in line] == [
        [" train ", " 256 "],
        [" train ", " 512 "],
    ]
