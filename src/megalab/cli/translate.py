"""Translate a text file with a trained seq2seq checkpoint: `megalab-translate`.

    megalab-translate --checkpoint logs/train/.../checkpoints/best-....ckpt \
        --input newstest2014.en --output newstest2014.hyp.de [--beam 5 --lenpen 0.5]

The checkpoint carries everything: the model's class and options, its weights and the text
pipeline (Moses tokenizer, joint BPE, dictionary) the run was trained with. Each input line is
one raw sentence in the source language; it is tokenized and segmented like the test data,
translated with beam search (the paper's beam 5, length penalty 0.5 by default) and written
detokenized (`--tokenized` keeps the Moses tokens with BPE removed, what tokenized BLEU scores),
one line per input line, in input order; a blank line (a paragraph break) stays blank rather
than getting a made-up translation. Sentences are batched by length.

The checkpoint is data (megalab's loading policy, `megalab.utils.safe_config`): it is read with
`torch.load(weights_only=True)` after its checksum is verified, the model class it names must be
one of megalab's encoder-decoders (an allow-list), its languages must be language codes, and
nothing else in it is executed.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megalab.generation.beam import GenerationConfig, SpecialTokens, beam_search
from megalab.models.mega.translation import MegaEncoderDecoder
from megalab.models.seq2seq import EncoderDecoder
from megalab.models.transformer.translation import TransformerEncoderDecoder

log = logging.getLogger(__name__)

#: The encoder-decoders a checkpoint may name (nothing else is rebuilt from a checkpoint).
ENCODER_DECODERS: dict[str, type[EncoderDecoder]] = {
    cls.__name__: cls for cls in (MegaEncoderDecoder, TransformerEncoderDecoder)
}


_LANG = re.compile(r"^[a-z]{2,3}$")


class CheckpointError(ValueError):
    """The file is not a megalab seq2seq checkpoint, or names a model outside the allow-list."""


def load_translator(path: str | Path, device: str = "cpu") -> tuple[EncoderDecoder, Any]:
    """(model in eval mode, text pipeline) from a `Seq2SeqTask` checkpoint."""
    from megalab.data.wmt import TextPipeline
    from megalab.tasks.seq2seq import MODEL_KEY
    from megalab.utils import checkpointing

    if not Path(path).is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        ckpt = checkpointing.read_checkpoint(path)
    except checkpointing.CheckpointError as err:
        raise CheckpointError(str(err)) from None
    spec, pipeline = ckpt.get(MODEL_KEY), ckpt.get("text_pipeline")
    if not isinstance(spec, dict) or pipeline is None or "state_dict" not in ckpt:
        raise CheckpointError(
            f"{path} is not a checkpoint of a megalab seq2seq run (it lacks the model spec, the "
            "text pipeline or the weights): train with task=seq2seq (experiment=mega/wmt16_en_de)"
        )
    cls = ENCODER_DECODERS.get(str(spec.get("class")))
    if cls is None:
        raise CheckpointError(
            f"{path} names the model class {spec.get('class')!r}; megalab-translate builds only "
            f"{', '.join(sorted(ENCODER_DECODERS))}"
        )
    langs = [pipeline.get(k) if isinstance(pipeline, dict) else None
             for k in ("source_lang", "target_lang")]  # fmt: skip
    if not all(isinstance(lang, str) and _LANG.match(lang) for lang in langs):
        raise CheckpointError(
            f"{path}: text_pipeline.source_lang/target_lang are {langs}, not language codes"
        )
    options = spec.get("config")
    if not isinstance(options, dict):
        raise CheckpointError(f"{path}: {MODEL_KEY}.config is not a mapping of options")
    try:
        model = cls.from_options(options)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: its {cls.__name__} options do not build ({err})") from None
    state = {}
    for name, tensor in ckpt["state_dict"].items():
        if name.startswith("model."):
            state[name[len("model.") :].removeprefix("_orig_mod.")] = tensor
    model.load_state_dict(state, strict=True)
    return model.to(device).eval(), TextPipeline.from_state(pipeline)


def batches(lengths: Sequence[int], max_tokens: int, max_sentences: int) -> list[list[int]]:
    """Indices grouped by length (longest first) into batches of bounded size."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        current = out[-1] if out else None
        # Longest first: the batch's first sentence sets its width.
        if (
            current
            and len(current) < max_sentences
            and ((len(current) + 1) * lengths[current[0]] <= max_tokens)
        ):
            current.append(i)
        else:
            out.append([i])
    return out


@torch.no_grad()
def translate(
    model: EncoderDecoder,
    pipeline: Any,
    sentences: Sequence[str],
    cfg: GenerationConfig,
    max_tokens: int = 8192,
    max_sentences: int = 128,
    tokenized: bool = False,
    left_pad_source: bool = True,
) -> list[str]:
    """Translations of raw source sentences, in input order; blank ones stay blank."""
    from megalab.data.wmt import EOS_ID, PAD_ID, UNK_ID

    special = SpecialTokens(eos=EOS_ID, pad=PAD_ID, unk=UNK_ID)
    out: list[str] = [""] * len(sentences)
    todo = [i for i, sentence in enumerate(sentences) if sentence.strip()]
    ids = pipeline.encode([sentences[i] for i in todo])
    device = next(model.parameters()).device
    for batch in batches([len(s) for s in ids], max_tokens, max_sentences):
        width = max(len(ids[j]) for j in batch)
        src = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        for row, j in enumerate(batch):
            n = len(ids[j])
            cols = slice(width - n, width) if left_pad_source else slice(0, n)
            src[row, cols], mask[row, cols] = torch.tensor(ids[j]), True
        nbest = beam_search(model, src.to(device), mask.to(device), cfg, special)
        for j, hyps in zip(batch, nbest):
            text = pipeline.decode(hyps[0].tokens.tolist())
            out[todo[j]] = text if tokenized else pipeline.detokenize(text)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megalab-translate",
        description="Translate a file (one sentence per line) with a megalab seq2seq checkpoint.",
    )
    p.add_argument("--checkpoint", required=True, help="a .ckpt of a task=seq2seq run")
    p.add_argument("--input", required=True, help="source sentences, one per line ('-': stdin)")
    p.add_argument("--output", default="-", help="where to write translations ('-': stdout)")
    p.add_argument("--beam", type=int, default=5, help="beam size (paper: 5)")
    p.add_argument("--lenpen", type=float, default=0.5, help="length penalty (paper: 0.5)")
    p.add_argument("--max-len-a", type=float, default=0.0, help="max length a * source + b")
    p.add_argument("--max-len-b", type=int, default=200)
    p.add_argument("--min-len", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=8192, help="source tokens per batch")
    p.add_argument("--batch-size", type=int, default=128, help="sentences per batch")
    p.add_argument("--tokenized", action="store_true", help="write Moses-tokenized output")
    p.add_argument("--right-pad-source", action="store_true",
                   help="pad sources on the right (training padded them on the left)")  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GenerationConfig:
    """Refuse bad arguments before the checkpoint is loaded and anything is translated (argparse's
    usage and message, exit status 2); the decoding settings they give."""
    if args.input != "-" and not Path(args.input).is_file():
        parser.error(f"--input {args.input}: no such file")
    if args.output != "-" and not Path(args.output).resolve().parent.is_dir():
        parser.error(f"--output {args.output}: its folder does not exist (create it first)")
    for flag, value in (("--max-tokens", args.max_tokens), ("--batch-size", args.batch_size)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.max_len_a < 0 or args.max_len_b < 0:
        parser.error(f"--max-len-a/--max-len-b must be >= 0, got {args.max_len_a}/{args.max_len_b}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device}: not a device name (cpu, cuda, cuda:1, ...)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here; use --device cpu")
    try:
        return GenerationConfig(
            beam=args.beam, len_penalty=args.lenpen, max_len_a=args.max_len_a,
            max_len_b=args.max_len_b, min_len=args.min_len,
        )  # fmt: skip
    except ValueError as err:  # beam < 1, min_len < 0
        parser.error(str(err).replace("beam", "--beam").replace("min_len", "--min-len"))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `megalab-translate`; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = _checked(parser, args)
    try:
        model, pipeline = load_translator(args.checkpoint, args.device)
    except (FileNotFoundError, CheckpointError) as err:
        print(f"megalab-translate: {err}", file=sys.stderr)
        return 2
    if args.input == "-":
        lines = sys.stdin.read().split("\n")
    else:
        lines = Path(args.input).read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    blank = sum(not line.strip() for line in lines)
    log.info(
        "translating %d sentence%s %s->%s with %s (beam %d, length penalty %g)%s",
        len(lines) - blank, "" if len(lines) - blank == 1 else "s", pipeline.source_lang,
        pipeline.target_lang, type(model).__name__, cfg.beam, cfg.len_penalty,
        f"; {blank} blank line{'' if blank == 1 else 's'} kept blank" if blank else "",
    )  # fmt: skip
    out = translate(
        model, pipeline, lines, cfg, args.max_tokens, args.batch_size, args.tokenized,
        left_pad_source=not args.right_pad_source,
    )  # fmt: skip
    text = "".join(t + "\n" for t in out)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
        log.info("translations written to %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
