"""End-to-end training speed of two megalab checkouts, alternated in rounds, as a ratio.

    python benchmarks/bench_e2e.py --old /tmp/megalab-old --new . \\
        [--experiment mega_chunk/lra_listops] [--steps 8] [--warmup 2] [--rounds 3] \\
        [--json e2e.json] [-- extra Hydra overrides]

Each round runs `python -m megalab.cli.train` (older checkouts: `megalab.train`) once per
checkout (the order alternates between rounds, so drift in the machine's load hits both), each
in a fresh process with the checkout's own `src` on PYTHONPATH and the environment a user has
(no OMP_*/MKL_*/MEGALAB_* variables: each checkout applies its own start-up settings). Runs
train the experiment at its paper batch for `--steps` optimizer steps on ListOps data generated
once into `--data-dir`, with validation, testing, checkpoints and loggers off;
`steptimer.StepTimer` (this folder) records every step's wall time, data loading included.
Reported: per run the median seconds per step after `--warmup` steps, per round the speed ratio
new/old, and over rounds the median ratio with its min-max, and each run's peak RSS and the
machine's load average when it ended. The JSON is rewritten after every round (an interrupted
run keeps its finished rounds); the runs' scratch folder is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def train_module(root: Path) -> str:
    """The training entry point of the checkout at `root`: `megalab.cli.train`, or
    `megalab.train` in checkouts from before the command-line programs had their subpackage."""
    return "megalab.cli.train" if (root / "src/megalab/cli/train.py").exists() else "megalab.train"


def run_once(
    root: Path,
    label: str,
    args: argparse.Namespace,
    out: Path,
    extra_env: list[str] = (),
    extra_overrides: list[str] = (),
) -> dict:
    times = out / f"{label}.json"
    cmd = [
        sys.executable, "-m", train_module(root), f"experiment={args.experiment}",
        f"data.data_dir={args.data_dir}", f"data.num_train={args.num_train}",
        "data.num_val=64", "data.num_test=64", f"trainer.max_steps={args.steps}",
        "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0", "test=false",
        "logger=none", "callbacks=none", "+callbacks.steptimer._target_=steptimer.StepTimer",
        f"+callbacks.steptimer.path={times}", f"hydra.run.dir={out / label}", "seed=1",
        *args.overrides, *extra_overrides,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "MKL_", "MEGALAB_", "GLIBC_TUNABLES"))}  # fmt: skip
    env.update(item.split("=", 1) for item in extra_env)
    env["PYTHONPATH"] = f"{root / 'src'}:{HERE}"
    env["MEGALAB_ROOT"] = str(root)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"label": label, "returncode": proc.returncode,
                "error": proc.stderr.strip().splitlines()[-5:], "wall_s": wall}  # fmt: skip
    rec = json.loads(times.read_text())
    steps = rec["step_s"][args.warmup :] or rec["step_s"]
    return {"label": label, "step_s": rec["step_s"], "median_step_s": statistics.median(steps),
            "max_rss_mb": rec["max_rss_mb"], "wall_s": wall,
            "loadavg_1m": os.getloadavg()[0]}  # fmt: skip


def describe(root: Path) -> str:
    """A checkout by its commit (`a checkout of 1a2b3c4`, `+ changes` when it has uncommitted
    ones), so that a record names no folder of the machine it ran on."""
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if not (root / ".git").exists() or head.returncode != 0:
        return "a checkout outside git"
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return f"a checkout of {head.stdout.strip()}" + (" + changes" if dirty else "")


def summarize(args: argparse.Namespace, roots: dict[str, Path], rounds: list[dict]) -> dict:
    """The record of the finished rounds: per-round ratios and their median with min-max."""
    ratios = [r["speedup"] for r in rounds if "speedup" in r]
    return {
        "experiment": args.experiment, "steps": args.steps, "warmup": args.warmup,
        "old": describe(roots["old"]), "new": describe(roots["new"]), "old_env": args.old_env,
        "overrides": args.overrides, "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs", "rounds": rounds,
        "speedup_median": statistics.median(ratios) if ratios else None,
        "speedup_min": min(ratios, default=None), "speedup_max": max(ratios, default=None),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="checkout of the baseline commit")
    ap.add_argument("--new", type=Path, required=True, help="checkout of the new commit")
    ap.add_argument("--experiment", default="mega_chunk/lra_listops")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-train", type=int, default=1024)
    ap.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "megalab-e2e")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--old-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment of the old runs (e.g. MEGALAB_MALLOC_TUNING=0 to compare "
                    "settings of one checkout)")  # fmt: skip
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = ap.parse_args()
    roots = {"old": args.old.resolve(), "new": args.new.resolve()}
    out = Path(tempfile.mkdtemp(prefix="megalab-e2e-"))
    try:
        rounds = run_rounds(args, roots, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    summary = summarize(args, roots, rounds)
    if summary["speedup_median"] is not None:
        print(f"steps/s new/old: median {summary['speedup_median']:.2f}x "
              f"(min {summary['speedup_min']:.2f}, max {summary['speedup_max']:.2f}) "
              f"over {sum('speedup' in r for r in rounds)} rounds")  # fmt: skip


def run_rounds(args: argparse.Namespace, roots: dict[str, Path], out: Path) -> list[dict]:
    """Generate the data, then alternate old and new for `args.rounds` rounds."""
    # Generate the data once (not timed) with the new checkout: one step of a small batch (the
    # data do not depend on it), so that generating needs little memory.
    gen = run_once(roots["new"], "generate", argparse.Namespace(**{**vars(args), "steps": 1}), out,
                   extra_overrides=["data.batch_size=2"])  # fmt: skip
    if "error" in gen:
        sys.exit(f"data generation failed: {gen}")
    rounds = []
    for r in range(args.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        env = {"old": args.old_env, "new": []}
        runs = {name: run_once(roots[name], f"{name}{r}", args, out, env[name]) for name in order}
        for name in order:
            res = runs[name]
            print(f"round {r} {name}: " + (f"{res['median_step_s']:.2f} s/step, peak RSS "
                  f"{res['max_rss_mb']:,.0f} MB" if "error" not in res else f"failed {res}"),
                  flush=True)  # fmt: skip
        if all("error" not in v for v in runs.values()):
            runs["speedup"] = runs["old"]["median_step_s"] / runs["new"]["median_step_s"]
            print(f"round {r}: new/old steps per second = {runs['speedup']:.2f}x", flush=True)
        rounds.append(runs)
        if args.json:
            args.json.write_text(json.dumps(summarize(args, roots, rounds), indent=1))
    return rounds


if __name__ == "__main__":
    main()
