"""Test finished runs again with other settings: `python -m megalab.cli.eval_runs <folders> ...`.

    python -m megalab.cli.eval_runs logs/reproduce/reproduce-mega-lm/<time>/wikitext103 \
        --name test_chunk2048 model.backbone.chunk_size=2048 data.eval_max_len=4096

Every run below the folders (a `metrics.json`, optionally only those of `--experiment`) is
tested with `megalab-eval` on its best checkpoint (else `checkpoints/last.ckpt`) and the given
Hydra overrides on top of the run's own config. The evaluation's folder is `<run>/<name>/`; its
metrics also go to `<run>/eval_metrics.json`, which `megalab-tables` prefers to the numbers the
training run recorded. This is how Mega Table 5 is reproduced: the language models are trained
with one attention chunk and tested with a longer one (`make reproduce-mega-lm`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from megalab.utils.paths import project_root

log = logging.getLogger(__name__)


def finished_runs(folders: Sequence[Path], experiment: str | None = None) -> Iterator[Path]:
    """Run folders (holding `metrics.json`) below `folders`, optionally of one experiment."""
    for folder in folders:
        for record_path in sorted(folder.rglob("metrics.json")):
            record = json.loads(record_path.read_text())
            if experiment is None or record.get("experiment") == experiment:
                yield record_path.parent


def checkpoint(run: Path) -> Path | None:
    """The run's best checkpoint, else its last one (None if it saved none)."""
    record = json.loads((run / "metrics.json").read_text())
    best = record.get("best_checkpoint")
    if best and Path(best).is_file():
        return Path(best)
    last = run / "checkpoints" / "last.ckpt"
    return last if last.is_file() else None


def forced(overrides: Sequence[str]) -> list[str]:
    """Overrides of the run's own groups (model, data, ...) as `++key=value`.

    `megalab-eval` composes its default config first, which may lack the key (the run's model
    replaces it afterwards and the override is applied again on top), so these are added.
    """
    from megalab.run_loading import RUN_GROUPS

    out = []
    for o in overrides:
        group = o.split("=", 1)[0].split(".")[0]
        out.append(f"++{o}" if group in RUN_GROUPS and not o.startswith(("+", "~")) else o)
    return out


def commands(
    folders: Sequence[Path], overrides: Sequence[str], name: str, experiment: str | None = None
) -> list[list[str]]:
    """One `megalab-eval` command per finished run with a checkpoint."""
    overrides = forced(overrides)
    out = []
    for run in finished_runs(folders, experiment):
        ckpt = checkpoint(run)
        if ckpt is None:
            log.warning("%s: no checkpoint to evaluate", run)
            continue
        target = f"hydra.run.dir={run / name}"
        out.append(
            [sys.executable, "-m", "megalab.cli.eval", f"ckpt_path={ckpt}", *overrides, target]
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the number of failed evaluations (0: all passed)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m megalab.cli.eval_runs", description=__doc__)
    parser.add_argument("args", nargs="+", help="run folders, then key=value overrides")
    parser.add_argument("--name", default="eval", help="evaluation folder inside each run")
    parser.add_argument("--experiment", default=None, help="only the runs of this experiment")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    ns = parser.parse_intermixed_args(argv)
    folders = [Path(a) for a in ns.args if "=" not in a]
    overrides = [a for a in ns.args if "=" in a]
    missing = [str(f) for f in folders if not f.is_dir()]
    if missing or not folders:
        parser.error(f"run folder(s) not found: {', '.join(missing) or '(none given)'}")
    cmds = commands(folders, overrides, ns.name, ns.experiment)
    if not cmds:
        print(f"[eval_runs] no finished run with a checkpoint under {', '.join(map(str, folders))}")
        return 1
    failures = 0
    env = {**os.environ, "MEGALAB_ROOT": os.environ.get("MEGALAB_ROOT", str(project_root()))}
    for cmd in cmds:
        print(f"[eval_runs] $ {' '.join(cmd)}", flush=True)
        if not ns.dry_run and subprocess.run(cmd, env=env, check=False).returncode != 0:
            failures += 1
    return failures


if __name__ == "__main__":
    sys.exit(min(main(), 1))
