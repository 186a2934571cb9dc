"""`megalab-data`: generate and prepare datasets from the command line.

    megalab-data listops --out data/lra/listops
    megalab-data pathfinder --resolution 32 --num-samples 2000 --out data/lra/pathfinder

Each subcommand is a thin wrapper around the dataset module's own function.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def _listops(args: argparse.Namespace) -> None:
    from megalab.data.lra.listops import ListOpsSettings, generate_listops

    settings = ListOpsSettings(args.max_depth, args.max_args, args.min_length, args.max_length)
    out = generate_listops(
        args.out, args.num_train, args.num_val, args.num_test, seed=args.seed,
        workers=args.workers, settings=settings,
    )
    print(f"ListOps written to {out}")


def _pathfinder(args: argparse.Namespace) -> None:
    from megalab.data.lra.pathfinder_gen import generate_pathfinder

    out = generate_pathfinder(
        args.out, resolution=args.resolution, contour_length=args.contour_length,
        num_samples=args.num_samples, seed=args.seed, workers=args.workers,
        overwrite=args.overwrite,
    )
    print(f"Pathfinder written to {out}")


def _smoke(args: argparse.Namespace) -> None:
    from megalab.data.smoke import write_smoke_data

    out = write_smoke_data(args.out)
    print(f"smoke-test data for every dataset written to {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megalab-data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("listops", help="generate LRA ListOps with the published procedure")
    p.add_argument("--out", default="data/lra/listops", help="output folder")
    p.add_argument("--num-train", type=int, default=96_000)
    p.add_argument("--num-val", type=int, default=2_000)
    p.add_argument("--num-test", type=int, default=2_000)
    p.add_argument("--min-length", type=int, default=500)
    p.add_argument("--max-length", type=int, default=2000)
    p.add_argument("--max-depth", type=int, default=10)
    p.add_argument("--max-args", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.set_defaults(func=_listops)

    p = sub.add_parser("pathfinder", help="generate Pathfinder/Path-X images (LRA layout)")
    p.add_argument("--out", default="data/lra/pathfinder", help="root folder")
    p.add_argument("--resolution", type=int, default=32, choices=(32, 64, 128, 256))
    p.add_argument("--contour-length", type=int, default=14, choices=(6, 9, 14))
    p.add_argument("--num-samples", type=int, default=200_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="processes (default: all CPUs)")
    p.add_argument("--overwrite", action="store_true", help="replace a folder with other data")
    p.set_defaults(func=_pathfinder)

    p = sub.add_parser(
        "smoke", help="write tiny copies of every dataset in its official format (smoke runs)"
    )
    p.add_argument("--out", default="data/smoke", help="folder to use as paths.data_dir")
    p.set_defaults(func=_smoke)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
