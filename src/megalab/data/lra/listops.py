"""LRA ListOps (Nangia & Bowman 2018; Tay et al. 2021): generator, reader and DataModule.

Files are the LRA release's `basic_{train,val,test}.tsv` with a `Source`/`Target` header. When
they are missing, `prepare_data` generates them with the published LRA procedure (operators
MIN, MAX, MED, SM; depth <= 10; <= 10 arguments; 500-2000 tokens; value probability 0.25;
96K/2K/2K samples). A user with the official release points `data_dir` at it instead.

Each sequence ends with EOS, as fairseq-preprocess appends it. `prepend_cls=True` starts it with
`<CLS>` (id 19), as the authors' `lra-text` task does for the fairseq Transformer baseline, whose
sentence representation is that token (`sen_rep_type='cls'`); its `max_positions` 2002 is
<CLS> + 2000 tokens + EOS.
"""

from __future__ import annotations

import csv
import functools
import logging
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from megalab.data.base import (
    SequenceDataModule,
    TokenSequences,
    cached_sequences,
    check_truncation,
    file_key,
)
from megalab.data.dictionary import EOS_ID, PAD_ID, SPECIALS
from megalab.utils.errors import UserError

log = logging.getLogger(__name__)

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
VALUES = tuple(str(v) for v in range(10))
NUM_CLASSES = 10
SPLITS = ("train", "val", "test")

# The Mega code's fairseq dictionary: <s>=0, <pad>=1, </s>=2, <unk>=3, then the symbols, and
# the task appends <CLS>. Parentheses are not tokens (LRA's tokenizer drops them). The order
# of the symbols in the authors' dict.txt is not public; this fixed order is ours.
SYMBOLS = (*VALUES, END, *OPERATORS)
VOCAB = (*SPECIALS, *SYMBOLS, "<CLS>")
CLS_ID = len(VOCAB) - 1
TOKEN_TO_ID = {tok: i for i, tok in enumerate(VOCAB)}


# ---------------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ListOpsSettings:
    """Knobs of the LRA ListOps generator (defaults are the published ones)."""

    max_depth: int = 10
    max_args: int = 10
    min_length: int = 500
    max_length: int = 2000
    value_p: float = 0.25


def _random_tree(rng: random.Random, depth: int, s: ListOpsSettings) -> tuple[object, int]:
    """A random expression tree and its length in tokens (values, operators and `]`)."""
    if depth >= s.max_depth or rng.random() > s.value_p:
        return rng.randrange(10), 1
    args, length = [], 2
    for _ in range(rng.randint(2, s.max_args)):
        sub, n = _random_tree(rng, depth + 1, s)
        args.append(sub)
        length += n
    return (rng.choice(OPERATORS), args), length


def _value(tree: Any) -> int:
    if isinstance(tree, int):
        return tree
    op, args = tree
    vals = [_value(a) for a in args]
    if op == "[MIN":
        return min(vals)
    if op == "[MAX":
        return max(vals)
    if op == "[MED":
        return int(np.median(vals))  # as LRA: the median, truncated to an integer
    return sum(vals) % 10


def _to_string(tree: Any) -> str:
    """LRA's bracketing: ((op a1) a2) ... ]) with every pair wrapped in parentheses."""
    if isinstance(tree, int):
        return str(tree)
    op, args = tree
    s = f"( {op} {_to_string(args[0])} )"
    for a in args[1:]:
        s = f"( {s} {_to_string(a)} )"
    return f"( {s} {END} )"


def _generate_block(args: tuple[int, int, int, ListOpsSettings]) -> list[tuple[str, int]]:
    seed, block, size, settings = args
    rng = random.Random(seed * 1_000_003 + block)
    out: list[tuple[str, int]] = []
    while len(out) < size:
        tree, length = _random_tree(rng, 1, settings)
        if settings.min_length <= length <= settings.max_length:
            out.append((_to_string(tree), _value(tree)))
    return out


def generate_listops(
    out_dir: str | Path,
    num_train: int = 96_000,
    num_val: int = 2_000,
    num_test: int = 2_000,
    seed: int = 0,
    workers: int = 1,
    settings: ListOpsSettings | None = None,
    progress: bool = True,
) -> Path:
    """Write `basic_{train,val,test}.tsv` with the LRA procedure; deterministic for a seed.

    Samples are drawn in fixed-size blocks, each from its own seeded RNG, and de-duplicated in
    block order, so the files do not depend on `workers`.
    """
    settings = settings or ListOpsSettings()
    if settings.min_length > settings.max_length:
        raise ValueError(f"min_length {settings.min_length} > max_length {settings.max_length}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    total = num_train + num_val + num_test
    block_size = 250
    seen: set[str] = set()
    samples: list[tuple[str, int]] = []
    bar = tqdm(total=total, desc="ListOps", unit="sample", disable=not progress)
    next_block = 0
    pool = ProcessPoolExecutor(workers) if workers > 1 else None
    try:
        while len(samples) < total:
            n_blocks = max(1, workers) * 2
            jobs = [(seed, next_block + b, block_size, settings) for b in range(n_blocks)]
            next_block += n_blocks
            results = pool.map(_generate_block, jobs) if pool else map(_generate_block, jobs)
            for block in results:
                for src, label in block:
                    if src not in seen and len(samples) < total:
                        seen.add(src)
                        samples.append((src, label))
                        bar.update(1)
    finally:
        bar.close()
        if pool:
            pool.shutdown()
    random.Random(seed).shuffle(samples)
    bounds = {
        "train": (0, num_train),
        "val": (num_train, num_train + num_val),
        "test": (num_train + num_val, total),
    }
    for split, (a, b) in bounds.items():
        path = out_dir / f"basic_{split}.tsv"
        tmp = path.with_suffix(".tsv.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.writer(f, delimiter="\t", lineterminator="\n")
            writer.writerow(["Source", "Target"])
            writer.writerows(samples[a:b])
        tmp.replace(path)
    log.info("wrote ListOps (%d/%d/%d) to %s", num_train, num_val, num_test, out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------
class ListOpsFormatError(UserError, ValueError):
    """A ListOps TSV that does not follow the LRA format."""


# Every symbol is mapped to one byte so a whole line is tokenised with one table lookup.
_CODES = {"[MIN": "a", "[MAX": "b", "[MED": "c", "[SM": "d"}
_LUT = np.full(256, -1, dtype=np.int64)
for _tok in SYMBOLS:
    _LUT[ord(_CODES.get(_tok, _tok))] = TOKEN_TO_ID[_tok]


def tokenize(source: str) -> np.ndarray | None:
    """Token ids of one expression (parentheses dropped, no EOS); None if a token is unknown."""
    s = source
    for op, code in _CODES.items():
        s = s.replace(op, code)
    pieces = s.replace("(", " ").replace(")", " ").split()
    packed = "".join(pieces)
    if len(packed) != len(pieces) or not packed.isascii():
        return None
    ids = _LUT[np.frombuffer(packed.encode("ascii"), dtype=np.uint8)]
    return None if (ids < 0).any() else ids


def encode_tokens(
    ids: np.ndarray, max_len: int, append_eos: bool = True, prepend_cls: bool = False
) -> np.ndarray:
    """[<CLS>] + the first tokens + [</s>], at most `max_len` in all.

    fairseq prepends <CLS> and then keeps the first `max_positions` tokens, which would drop
    the EOS of an over-long sequence; like the Text and Retrieval modules, this truncates the
    expression instead and keeps EOS. Both agree whenever the sequence fits (the published
    data: at most 2000 tokens + EOS + <CLS> = 2002).
    """
    room = max_len - int(append_eos) - int(prepend_cls)
    if room < 1:
        raise ValueError(
            f"max_len={max_len} leaves no room for tokens "
            f"(append_eos={append_eos}, prepend_cls={prepend_cls})"
        )
    head = [CLS_ID] if prepend_cls else []
    tail = [EOS_ID] if append_eos else []
    return np.concatenate(
        [np.asarray(head, np.int64), np.asarray(ids[:room], np.int64), np.asarray(tail, np.int64)]
    )


def read_listops(
    path: str | Path, max_len: int = 2001, append_eos: bool = True, prepend_cls: bool = False
) -> TokenSequences:
    """Read one LRA ListOps TSV into token sequences; errors name the file, line and problem.

    Expressions longer than `max_len` are cut (see `encode_tokens`); the result's `truncated`
    counts them, for the DataModule's `truncate` policy.
    """
    path = Path(path)
    encode_tokens(np.zeros(0, np.int64), max_len, append_eos, prepend_cls)  # fail early
    room = max_len - int(append_eos) - int(prepend_cls)
    truncated = 0
    all_ids, offsets, labels = [], [0], []
    with path.open(newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:2]] != ["Source", "Target"]:
            raise ListOpsFormatError(
                f"{path}:1: expected the header 'Source<TAB>Target', got {header!r}"
            )
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) < 2:
                raise ListOpsFormatError(
                    f"{path}:{lineno}: expected 2 tab-separated columns (Source, Target), "
                    f"got {len(row)}"
                )
            source, target = row[0], row[1].strip()
            try:
                label = int(target)
            except ValueError:
                raise ListOpsFormatError(
                    f"{path}:{lineno}: Target {target!r} is not an integer"
                ) from None
            if not 0 <= label < NUM_CLASSES:
                raise ListOpsFormatError(
                    f"{path}:{lineno}: label {label} out of range 0..{NUM_CLASSES - 1}"
                )
            ids = tokenize(source)
            if ids is None:
                bad = next(
                    t
                    for t in source.replace("(", " ").replace(")", " ").split()
                    if t not in SYMBOLS
                )
                raise ListOpsFormatError(
                    f"{path}:{lineno}: unknown token {bad!r}; ListOps uses {' '.join(SYMBOLS)}"
                )
            truncated += int(len(ids) > room)
            ids = encode_tokens(ids, max_len, append_eos, prepend_cls)
            all_ids.append(ids)
            offsets.append(offsets[-1] + len(ids))
            labels.append(label)
    tokens = np.concatenate(all_ids).astype(np.int16) if all_ids else np.zeros(0, np.int16)
    ds = TokenSequences(tokens, np.asarray(offsets, dtype=np.int64), np.asarray(labels))
    ds.truncated = truncated
    return ds


class ListOpsDataModule(SequenceDataModule):
    """LRA ListOps: 10-way classification of nested list-operation expressions.

    `max_len` counts every token, EOS and (with `prepend_cls`) <CLS> included: 2001 for Mega,
    2002 for the fairseq Transformer baseline, which pools the prepended <CLS>. Longer
    expressions fail the run unless `truncate=True` cuts them (with a warning and their count):
    a cut expression has another value than its label.
    """

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int = 2001,
        generate_if_missing: bool = True,
        num_train: int = 96_000,
        num_val: int = 2_000,
        num_test: int = 2_000,
        min_length: int = 500,
        max_length: int = 2000,
        max_depth: int = 10,
        max_args: int = 10,
        generator_seed: int = 0,
        generator_workers: int = 2,
        prepend_cls: bool = False,
        truncate: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("vocab_size", len(VOCAB))
        kwargs.setdefault("num_classes", NUM_CLASSES)
        kwargs.setdefault("pad_id", PAD_ID)
        super().__init__(data_dir=data_dir, max_len=max_len, **kwargs)
        if self.spec.vocab_size != len(VOCAB):
            raise ValueError(f"ListOps has vocab_size {len(VOCAB)}, config says {self.vocab_size}")
        if self.spec.num_classes != NUM_CLASSES:
            raise ValueError(f"ListOps has {NUM_CLASSES} classes, config says {self.num_classes}")
        self.prepend_cls = prepend_cls
        self.truncate = truncate
        encode_tokens(np.zeros(0, np.int64), self.max_len, True, prepend_cls)  # fail early
        self.generate_if_missing = generate_if_missing
        self.sizes = (num_train, num_val, num_test)
        self.settings = ListOpsSettings(max_depth, max_args, min_length, max_length)
        self.generator_seed = generator_seed
        self.generator_workers = generator_workers

    def files(self) -> dict[str, Path]:
        return {split: self.data_dir / f"basic_{split}.tsv" for split in SPLITS}

    def prepare_data(self) -> None:
        missing = [p for p in self.files().values() if not p.exists()]
        if not missing:
            return
        if not self.generate_if_missing:
            raise FileNotFoundError(
                "LRA ListOps files missing: " + ", ".join(str(p) for p in missing) + ". "
                "Generate them with `megalab-data listops --out " + str(self.data_dir) + "`, "
                "or download the LRA release (lra_release.gz from "
                "https://github.com/google-research/long-range-arena), and point "
                "`data.data_dir` at its `listops-1000` folder"
            )
        log.info("ListOps files missing in %s: generating them", self.data_dir)
        generate_listops(
            self.data_dir,
            *self.sizes,
            seed=self.generator_seed,
            workers=self.generator_workers,
            settings=self.settings,
        )

    def build_datasets(self) -> dict[str, TokenSequences]:
        for p in self.files().values():
            if not p.exists():
                raise FileNotFoundError(
                    f"{p} not found; run `megalab-data listops --out {self.data_dir}` or set "
                    "`data.data_dir` to the LRA release's listops-1000 folder"
                )
        datasets = {
            split: cached_sequences(
                self.cache_root,
                f"listops_{split}",
                {
                    **file_key(path),
                    "max_len": self.max_len,
                    "append_eos": True,
                    "prepend_cls": self.prepend_cls,
                    "vocab": VOCAB,
                },
                functools.partial(read_listops, path, self.max_len, prepend_cls=self.prepend_cls),
                sources=[path],
                vocab_size=len(VOCAB),
                num_classes=NUM_CLASSES,
            )
            for split, path in self.files().items()
        }
        check_truncation(
            f"LRA ListOps ({self.data_dir})",
            {split: ds.truncated for split, ds in datasets.items()},
            {split: len(ds) for split, ds in datasets.items()},
            self.max_len,
            self.truncate,
        )
        return datasets
