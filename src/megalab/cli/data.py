"""`megalab-data`: generate and prepare datasets from the command line.

    megalab-data listops              (into <data root>/lra/listops, or --out FOLDER)
    megalab-data pathfinder --resolution 32 --num-samples 2000
    megalab-data sc10 --protocol mega
    megalab-data imagenet [--from-hub]
    megalab-data lra --task retrieval pathx
    megalab-data imdb                 (also cifar10)
    megalab-data enwik8               (also text8, wikitext103, pg19 [data.key=value ...])
    megalab-data text_corpus data.data_dir=FOLDER   (a corpus of your own: docs/datasets_lm.md)
    megalab-data wmt16                (WMT'16 En-De: fetch and prepare [data.key=value ...])
    megalab-data verify               (checksums of every prepared cache)

Every subcommand takes `--root`, the data root, which is where training looks (`paths.data_dir`)
by default: `MEGALAB_DATA_DIR`, else `data/` below the project root (`MEGALAB_ROOT`, the source
checkout, or the current folder). Each subcommand is a thin wrapper around the dataset module's
own function.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any


def _flags(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The named flags as keyword arguments: a subcommand's flags are named after the keywords of
    the function it wraps (`--num-samples` is `num_samples=`)."""
    return {name: getattr(args, name) for name in names}


def _listops(args: argparse.Namespace) -> None:
    from megalab.data.lra.listops import ListOpsSettings, generate_listops

    settings = ListOpsSettings(args.max_depth, args.max_args, args.min_length, args.max_length)
    out = generate_listops(
        args.out,
        args.num_train,
        args.num_val,
        args.num_test,
        settings=settings,
        **_flags(args, "seed", "workers"),
    )
    print(f"ListOps written to {out}")


def _pathfinder(args: argparse.Namespace) -> None:
    from megalab.data.lra.pathfinder_gen import generate_pathfinder

    out = generate_pathfinder(
        args.out,
        **_flags(
            args, "resolution", "contour_length", "num_samples", "seed", "workers", "overwrite"
        ),
    )
    print(f"Pathfinder written to {out}")


def _smoke(args: argparse.Namespace) -> None:
    from megalab.data.smoke import write_smoke_data

    out = write_smoke_data(args.out)
    print(
        f"smoke-test data for every dataset written to {out}: train on it with "
        f"paths.data_dir={out}, and data.sha256=null for enwik8 and text8 (their copies here are "
        "not the official files the checksums name)"
    )


def _lra(args: argparse.Namespace) -> None:
    from megalab.data.download import DatasetMissingError
    from megalab.data.lra.release import prepare_release

    try:
        folders = prepare_release(
            args.root,
            args.task,
            keep_archive=not args.delete_archive,
            **_flags(args, "url", "archive", "sha256"),
        )
    except DatasetMissingError:
        raise  # main() prints its message, with this command's flags
    for task, folder in folders.items():
        print(f"{task}: {folder}")


def _hub(args: argparse.Namespace) -> None:
    from megalab.data.download import DatasetMissingError
    from megalab.data.lra import image, text

    hub_dataset = {"imdb": text.hub_dataset, "cifar10": image.hub_dataset}[args.command]
    source = hub_dataset(args.out, args.hub_id)
    try:
        source.require(cache_dir=args.cache_dir)
    except DatasetMissingError:
        raise  # main() prints its message, with this command's flags
    print(f"{args.hub_id} ({', '.join(source.splits)}) in {args.out}")


def _sc10(args: argparse.Namespace) -> None:
    from pathlib import Path

    from megalab.data.speech_commands import SpeechCommandsDataModule

    dm = SpeechCommandsDataModule(Path(args.root) / "speech_commands", protocol=args.protocol)
    dm.prepare_data()
    dm.setup()
    sizes = ", ".join(f"{split} {len(ds):,}" for split, ds in dm.datasets.items())
    print(f"Speech Commands SC10 ({args.protocol} protocol) ready in {dm.data_dir}: {sizes}")


def _imagenet(args: argparse.Namespace) -> None:
    from pathlib import Path

    from megalab.data.imagenet import ImageNetDataModule

    dm = ImageNetDataModule(
        Path(args.root) / "imagenet",
        source="hub" if args.from_hub else "folder",
        augment="none",
        mixup=0.0,
        cutmix=0.0,
        repeated_aug=1,
        num_classes=args.num_classes,
    )
    dm.prepare_data()
    dm.setup()
    print(
        f"ImageNet ({dm.source}) ready in {dm.data_dir}: {len(dm.classes)} classes, "
        f"train {len(dm.datasets['train']):,}, val {len(dm.datasets['val']):,} images"
    )


def _lm(args: argparse.Namespace) -> None:
    """Download (or read) and prepare a language-model dataset with its data config."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from megalab.data.download import DatasetMissingError
    from megalab.utils.paths import CONFIG_DIR

    root = Path(args.root).expanduser().absolute()
    overrides = [f"data={args.command}", f"paths.data_dir={root}", *args.overrides]
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    dm = instantiate(cfg.data)
    try:
        dm.prepare_data()
        dm.setup()
    except DatasetMissingError:
        raise  # main() prints its message, with this command's flags
    print(f"{args.command} ready in {dm.data_dir}: {dm.describe()}")


def _wmt16(args: argparse.Namespace) -> None:
    """Fetch WMT'16 En-De (and newstest2013/2014) and prepare it with its data config."""
    args.command = "wmt16_en_de"
    _lm(args)


def _verify(args: argparse.Namespace) -> None:
    """Verify every prepared cache below --root in full (checksums of caches and sources)."""
    from pathlib import Path

    from megalab.data.cache import verify_all

    if not Path(args.root).is_dir():
        raise SystemExit(f"megalab-data verify: no folder {args.root} (give the data root: --root)")
    checked, problems = verify_all(args.root)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    print(f"{len(checked)} prepared cache(s) below {args.root}: {len(problems)} problem(s)")
    if problems:
        raise SystemExit(1)


# Hints written for `megalab-train` name Hydra keys; here the same setting is a flag: `--root`
# (the data root), or `--out` (the dataset's own folder) where the command was given one.
_FLAG_FOR = {
    "root": (
        ("`paths.data_dir=/your/data/root`", "`--root /your/data/root`"),
        ("the `paths.data_dir` setting", "the --root flag"),
        ("paths.data_dir", "--root"),
        ("data.num_classes=", "--num-classes "),
    ),
    "out": (
        (
            "The data root is the `paths.data_dir` setting; to keep data elsewhere, run with "
            "`paths.data_dir=/your/data/root` and put the files at the same relative paths there.",
            "The files go to the --out folder; to keep them elsewhere, run with "
            "`--out /your/folder` and put them there.",
        ),
    ),
}


def _for_this_command(message: str, args: argparse.Namespace) -> str:
    """`message` with the Hydra keys it names replaced by this command's own flags."""
    by_root = hasattr(args, "root") and not getattr(args, "out_given", False)
    for key, flag in _FLAG_FOR["root" if by_root else "out"]:
        message = message.replace(key, flag)
    return message


def _root_flag(p: argparse.ArgumentParser, out: str | None = None) -> None:
    """`--root`, the data root (default: where training looks), and for a command that writes
    one dataset's folder, `--out` (default: its folder `out` below the root, as the data config
    expects it)."""
    p.add_argument(
        "--root",
        default=None,
        help="data root, paths.data_dir (default: MEGALAB_DATA_DIR, else data/ below the project "
        "root)",
    )
    if out is not None:
        p.add_argument("--out", default=None, help=f"output folder (default: <root>/{out})")
        p.set_defaults(out_below_root=out)


def _resolve_folders(args: argparse.Namespace) -> None:
    """Fill `--root` and `--out` left at their defaults."""
    from pathlib import Path

    from megalab.utils.paths import data_root

    if getattr(args, "root", "") is None:
        args.root = str(data_root())
    below = getattr(args, "out_below_root", None)
    args.out_given = getattr(args, "out", None) is not None
    if below is not None and args.out is None:
        args.out = str(Path(args.root) / below)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megalab-data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("listops", help="generate LRA ListOps with the published procedure")
    _root_flag(p, out="lra/listops")
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
    _root_flag(p, out="lra/pathfinder")
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

    from megalab.data.lra.release import RELEASE_TASKS, RELEASE_URL

    p = sub.add_parser("lra", help="download the LRA release and extract tasks into --root/lra")
    p.add_argument(
        "--task",
        nargs="+",
        default=["all"],
        choices=(*RELEASE_TASKS, "all"),
        help="listops, retrieval (AAN), pathfinder (32x32), pathx (128x128) or all",
    )
    _root_flag(p)
    p.add_argument("--url", default=RELEASE_URL, help="where to download lra_release.gz from")
    p.add_argument("--archive", default=None, help="use this lra_release.gz, do not download")
    p.add_argument("--sha256", default=None, help="verify the archive against this digest")
    p.add_argument(
        "--delete-archive", action="store_true", help="delete the download after extraction"
    )
    p.set_defaults(func=_lra)

    for name, hub_id, help_text in (
        ("imdb", "stanfordnlp/imdb", "fetch IMDB (LRA Text) from the Hub as parquet"),
        ("cifar10", "uoft-cs/cifar10", "fetch CIFAR-10 (LRA Image) from the Hub as parquet"),
    ):
        p = sub.add_parser(name, help=help_text)
        _root_flag(p, out=f"lra/{name}")
        p.add_argument("--hub-id", default=hub_id, help="Hub dataset to fetch")
        p.add_argument("--cache-dir", default=None, help="cache folder for `datasets`")
        p.set_defaults(func=_hub)

    p = sub.add_parser("verify", help="verify the checksums of every prepared cache below --root")
    _root_flag(p)
    p.set_defaults(func=_verify)

    p = sub.add_parser("sc10", help="download and prepare Speech Commands SC10 (raw audio)")
    _root_flag(p)
    p.add_argument("--protocol", default="mega", choices=("mega", "official"))
    p.set_defaults(func=_sc10)

    p = sub.add_parser("imagenet", help="check the ImageNet folders, or fetch the Hub copy")
    _root_flag(p)
    p.add_argument("--from-hub", action="store_true", help="download ILSVRC/imagenet-1k (gated)")
    p.add_argument("--num-classes", type=int, default=1000, help="classes expected (subsets)")
    p.set_defaults(func=_imagenet)

    for name, help_text in (
        ("enwik8", "download and prepare enwik8 (bytes, 90M/5M/5M)"),
        ("text8", "download and prepare text8 (27 characters, 90M/5M/5M)"),
        ("wikitext103", "prepare WikiText-103 (words) from local parquet (fetched if missing)"),
        ("pg19", "prepare PG-19 from local parquet (fetched if missing); train its tokenizer"),
        ("text_corpus", "prepare a corpus of your own (data.data_dir=FOLDER); train its tokenizer"),
    ):
        p = sub.add_parser(name, help=help_text)
        _root_flag(p)
        p.add_argument(
            "overrides", nargs="*", help="data config overrides, e.g. data.vocab_size=16000"
        )
        p.set_defaults(func=_lm)

    p = sub.add_parser(
        "wmt16", help="fetch WMT'16 En-De from the Hub and prepare it (Moses, BPE, dictionary)"
    )
    _root_flag(p)
    p.add_argument("overrides", nargs="*", help="data config overrides, e.g. data.workers=16")
    p.set_defaults(func=_wmt16)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from megalab.utils.errors import actionable, full_errors, print_error

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    _resolve_folders(args)
    try:
        args.func(args)
    except Exception as err:
        found = None if full_errors() else actionable(err)
        if found is None:
            raise
        print_error(_for_this_command(str(found), args))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
