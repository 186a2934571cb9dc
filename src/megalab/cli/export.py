"""`megalab-export RUN_DIR OUT`: write a trained run as a shareable model folder.

The folder's format, its loading (`megalab.from_pretrained`) and the upload to the Hub are
`megalab.pretrained`; `--format hf` writes a Llama as a Hugging Face `transformers` folder
(`megalab.models.llama.convert`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from megalab.pretrained import checkpoint_path, export_run, push_to_hub, run_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megalab-export", description="Write a trained run as a shareable model folder."
    )
    parser.add_argument("run_dir", help="the run folder megalab-train wrote")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument(
        "--checkpoint", default="best", help="best (default), last, or a checkpoint path"
    )
    parser.add_argument(
        "--format",
        default="megalab",
        choices=("megalab", "hf"),
        help="megalab (safetensors + config.json) or hf (a Llama as a transformers folder)",
    )
    parser.add_argument(
        "--without-tokenizer", action="store_true", help="export without the data's tokenizer"
    )
    parser.add_argument("--push-to-hub", metavar="USER/NAME", help="upload to this Hub repo")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from megalab.utils import errors

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.format == "hf":
            from megalab.models.llama.convert import run_to_hf

            run_dir = Path(args.run_dir)
            run_config(run_dir)  # the allow-list, before anything is built
            out = run_to_hf(checkpoint_path(run_dir, args.checkpoint), args.out)
        else:
            out = export_run(
                args.run_dir, args.out, args.checkpoint, with_tokenizer=not args.without_tokenizer
            )
        print(f"exported to {out}")
        if args.push_to_hub:
            print(f"uploaded: {push_to_hub(out, args.push_to_hub, private=args.private)}")
    except Exception as err:
        found = None if errors.full_errors() else errors.actionable(err)
        if found is None:
            raise
        errors.print_error(str(found))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
