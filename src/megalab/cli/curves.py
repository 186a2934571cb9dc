"""Training loss curves and tokens/s side by side: `python -m megalab.cli.curves <run folders>`.

Writes `curves.png` and `curves.md` for a set of language-model runs (Megalodon's Fig. 1 and
Fig. 4 in miniature; `megalab.reporting.curves` says what they show).

    python -m megalab.cli.curves logs/reproduce/reproduce-megalodon-vs-llama/<time>
    python -m megalab.cli.curves runs/a runs/b --baseline llama --out results/
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from megalab.reporting.curves import lines, load_curves, plot_curves, render_markdown


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megalab.cli.curves",
        description="Training loss against tokens and training tokens/s of language-model runs.",
    )
    p.add_argument("paths", nargs="+", help="run folders, or folders holding runs (sweeps)")
    p.add_argument(
        "--out", type=Path, default=None, help="write curves.png and curves.md here (default: "
        "the first folder)"
    )  # fmt: skip
    p.add_argument(
        "--baseline", default="llama", help="model (backbone class, any case) the tokens/s "
        "ratios are against"
    )  # fmt: skip
    p.add_argument("--title", default="Megalodon vs Llama: training loss and throughput")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[curves] %(message)s")
    args = build_parser().parse_args(argv)
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        print(f"[curves] no such folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    series = lines(load_curves(args.paths))
    if not series:
        print(
            f"[curves] no run with a training-loss history under {', '.join(args.paths)} "
            "(runs need metrics.json and csv/metrics.csv: logger=csv, the default)",
            file=sys.stderr,
        )
        return 1
    out = args.out or Path(args.paths[0])
    table = render_markdown(series, args.baseline)
    out.mkdir(parents=True, exist_ok=True)
    (out / "curves.md").write_text(f"# {args.title}\n\n{table}")
    png = plot_curves(out / "curves.png", series, args.baseline, args.title)
    print(table)
    print(f"[curves] wrote {out / 'curves.md'} and {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
