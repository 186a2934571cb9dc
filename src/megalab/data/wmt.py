"""WMT'16 English-German translation, prepared as the Mega authors did (Mega §4.3, Table 6).

Sources (the Hugging Face Hub copies of the official WMT releases):

- training: ``wmt/wmt16``, config ``de-en``, split ``train`` (Europarl v7, Common Crawl and News
  Commentary v11: 4,548,885 pairs), in ``<data_dir>/wmt16/de-en/train-*.parquet``;
- validation and test: ``wmt/wmt14``, config ``de-en``, splits ``validation`` (newstest2013, 3,000
  pairs) and ``test`` (newstest2014 "full", 3,003 pairs), in ``<data_dir>/wmt14/de-en/``.

Every file has one column ``translation``, a struct ``{"de": str, "en": str}``. Missing files
are fetched with ``datasets.load_dataset`` when online (``megalab-data wmt16 --root data``);
offline the error says what to download where.

Preparation follows the authors' ``examples/mega/prepare-wmt16en2de.sh`` and fairseq's
``preprocess.py`` (the paper cites Ma 2020, Apollo, for it):

1. training text: Moses ``remove-non-printing-char`` (every ``\\p{C}`` character becomes a
   space) and ``normalize-punctuation`` per language (sacremoses);
2. every split: the Moses tokenizer per language with ``-no-escape`` (sacremoses, no aggressive
   dash splitting);
3. one joint BPE of ``bpe_merges`` = 32,000 merge operations learned on the tokenized English and
   German training text (the script uses subword-nmt; we learn it with ``tokenizers`` — the same
   algorithm with end-of-word markers and pairs seen at least twice, whose tie-breaking between
   equally frequent pairs may differ), applied to every split;
4. training pairs cleaned as Moses ``clean-corpus-n.perl -ratio 1.5 ... 3 150``: both sides 3 to
   150 subword tokens, neither more than 1.5 times as long as the other;
5. one joint fairseq dictionary (``--joined-dictionary --nwordssrc 33000``): ``<s>``=0,
   ``<pad>``=1, ``</s>``=2, ``<unk>``=3, then the subwords of the cleaned training text by
   frequency (ties in alphabetical order, as fairseq), at most ``vocab_size`` entries; fairseq
   pads a dictionary to a multiple of 8 with ``madeupwordNNNN`` symbols, we pad it to exactly
   ``vocab_size`` (the model's table size, which the config must know before preparation);
   symbols are written in subword-nmt's notation (``@@`` ends a non-final piece);
6. every sentence becomes its ids followed by ``</s>``; the decoder reads ``[</s>, y_1..y_n]``
   and predicts ``[y_1..y_n, </s>]`` (fairseq's convention).

Batches are fairseq's: examples sorted by (source, target) length after a seeded shuffle, packed
greedily while (sentences x longest) <= ``max_tokens`` and sentences <= ``batch_size``, in
multiples of 8 when full (``--required-batch-size-multiple 8``); the set of batches is fixed,
their order reshuffled every epoch. ``max_tokens`` and ``batch_size`` are *global* per
optimizer step (the paper's 8,192 tokens x 8 GPUs = 65,536), divided over processes and
gradient-accumulation steps. Sources are left-padded like fairseq's translation task
(``left_pad_source``), targets right-padded.

The prepared files (``<data_dir>/prepared/wmt16_en_de/<hash>/``) hold the BPE model, the
dictionary, the binarized splits and the raw validation/test references (for SacreBLEU).
`TextPipeline` carries the tokenizers, BPE and dictionary (checkpoints store it, so
``megalab-translate`` needs no data).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from megalab.data.base import SequenceDataModule
from megalab.data.cache import cache_dir, check_npy, mark_prepared, prepared
from megalab.data.hub import HubDataset, HubFormatError

log = logging.getLogger(__name__)

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
BOS_ID, PAD_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
BPE_CONT = "@@"  # subword-nmt's mark of a non-final piece
_EOW = "</w>"  # the end-of-word suffix of the `tokenizers` BPE model
LANGS = ("en", "de")
_CACHE_VERSION = 1


class WMTFormatError(HubFormatError):
    """A WMT file without the `translation` column or without a language of the pair."""


def hub_sources(data_dir: str | Path, config: str = "de-en") -> tuple[HubDataset, HubDataset]:
    """(training data of wmt/wmt16, newstest2013/2014 of wmt/wmt14), `config` folders."""
    data_dir = Path(data_dir)
    command = f"megalab-data wmt16 --root {data_dir.parent}"
    train = HubDataset(
        name="WMT'16 English-German (training)",
        repo="wmt/wmt16",
        config=config,
        local_dir=data_dir / "wmt16" / config,
        columns=("translation",),
        splits=("train",),
        fetch_dir=".",
        command=command,
        load_per_split=True,
        format_error=WMTFormatError,
    )
    evaluation = HubDataset(
        name="WMT'14 English-German (newstest2013 validation, newstest2014 test)",
        repo="wmt/wmt14",
        config=config,
        local_dir=data_dir / "wmt14" / config,
        columns=("translation",),
        splits=("val", "test"),
        fetch_dir=".",
        command=command,
        load_per_split=True,
        format_error=WMTFormatError,
    )
    return train, evaluation


# ---------------------------------------------------------------------------------------------
# Moses normalisation, tokenisation and detokenisation (sacremoses)
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _moses(lang: str) -> tuple[Any, Any, Any]:
    from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer

    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang), MosesDetokenizer(lang=lang)


@lru_cache(maxsize=1)
def _non_printing() -> Any:
    import regex

    return regex.compile(r"\p{C}")


def remove_non_printing(text: str) -> str:
    """Moses `remove-non-printing-char.perl`: every control/format character becomes a space."""
    return _non_printing().sub(" ", text)


def normalize(text: str, lang: str) -> str:
    """Moses `normalize-punctuation.perl <lang>` after `remove-non-printing-char.perl`."""
    return _moses(lang)[0].normalize(remove_non_printing(text))


def tokenize(text: str, lang: str) -> str:
    """Moses `tokenizer.perl -l <lang> -no-escape`."""
    return _moses(lang)[1].tokenize(text, escape=False, return_str=True)


def detokenize(text: str, lang: str) -> str:
    """Moses `detokenizer.perl -l <lang>` (what SacreBLEU scores)."""
    return _moses(lang)[2].detokenize(text.split())


def _prepare_line(args: tuple[str, str, bool]) -> str:
    text, lang, norm = args
    return tokenize(normalize(text, lang) if norm else text, lang)


def moses_lines(texts: Sequence[str], lang: str, norm: bool, workers: int = 1) -> list[str]:
    """Tokenize (and for training text first normalise) lines, in `workers` processes."""
    jobs = [(t, lang, norm) for t in texts]
    if workers <= 1 or len(jobs) < 10_000:
        return [_prepare_line(j) for j in jobs]
    with mp.get_context("spawn").Pool(workers) as pool:
        return pool.map(_prepare_line, jobs, chunksize=2_000)


# ---------------------------------------------------------------------------------------------
# BPE and dictionary
# ---------------------------------------------------------------------------------------------
def learn_bpe(lines: Sequence[str], merges: int) -> str:
    """A joint BPE of `merges` merge operations over whitespace-tokenized lines (JSON model).

    Like subword-nmt's `learn_bpe.py -s merges`: characters with an end-of-word marker on the
    last one, pairs merged by frequency while seen at least twice.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    chars: set[str] = set()
    finals: set[str] = set()
    for line in lines:
        for w in line.split():
            chars.update(w)
            finals.add(w[-1])
    tok = Tokenizer(models.BPE(unk_token=SPECIALS[UNK_ID], end_of_word_suffix=_EOW))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(
        # The trainer counts the initial alphabet (characters, word-final characters) and the
        # special token in the vocabulary: what is left is the number of merges.
        vocab_size=len(chars) + len(finals) + 1 + merges,
        min_frequency=2,
        special_tokens=[SPECIALS[UNK_ID]],
        end_of_word_suffix=_EOW,
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer, length=len(lines))
    return tok.to_str()


class BPE:
    """Applies a learned BPE to whitespace-tokenized text, in subword-nmt notation."""

    def __init__(self, model_json: str) -> None:
        from tokenizers import Tokenizer

        self.model_json = model_json
        self.tokenizer = Tokenizer.from_str(model_json)

    def segment(self, lines: Sequence[str]) -> list[list[str]]:
        """Subwords of each line; non-final pieces end with `@@` (an unknown piece is `<unk>`)."""
        out = []
        for enc in self.tokenizer.encode_batch(list(lines), add_special_tokens=False):
            pieces = []
            for tok in enc.tokens:
                if tok.endswith(_EOW):
                    pieces.append(tok[: -len(_EOW)])
                elif tok == SPECIALS[UNK_ID]:
                    pieces.append(tok)
                else:
                    pieces.append(tok + BPE_CONT)
            out.append(pieces)
        return out


def remove_bpe(pieces: Iterable[str]) -> str:
    """fairseq's `--remove-bpe '@@ '`: join the pieces into the tokenized sentence."""
    return (" ".join(pieces) + " ").replace(BPE_CONT + " ", "").rstrip()


def build_dictionary(counts: Counter[str], size: int) -> list[str]:
    """fairseq's `Dictionary.finalize`: specials, then the most frequent symbols (ties
    alphabetical), padded with `madeupwordNNNN` to exactly `size` entries."""
    if size <= len(SPECIALS):
        raise ValueError(f"vocab_size={size} leaves no room beside the {len(SPECIALS)} specials")
    ranked = sorted((s for s in counts if s not in SPECIALS), key=lambda s: (-counts[s], s))
    symbols = [*SPECIALS, *ranked[: size - len(SPECIALS)]]
    symbols += [f"madeupword{i:04d}" for i in range(size - len(symbols))]
    return symbols


class TextPipeline:
    """Text <-> ids for one direction: Moses, the joint BPE and the fairseq dictionary.

    `encode(text, lang)` tokenizes raw text (as the validation/test data: no normalisation),
    applies the BPE and returns the ids with `</s>`; `decode(ids)` gives the tokenized sentence
    (BPE removed, what tokenized BLEU scores), `detokenize` the plain text (SacreBLEU).
    `state()` / `from_state()` are plain strings and lists (saved in checkpoints).
    """

    def __init__(self, source_lang: str, target_lang: str, bpe: str, symbols: Sequence[str]):
        self.source_lang, self.target_lang = source_lang, target_lang
        self.bpe = BPE(bpe)
        self.symbols = list(symbols)
        self.ids = {s: i for i, s in enumerate(self.symbols)}

    def state(self) -> dict[str, Any]:
        return {
            "source_lang": self.source_lang,
            "target_lang": self.target_lang,
            "bpe": self.bpe.model_json,
            "symbols": self.symbols,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TextPipeline:
        return cls(state["source_lang"], state["target_lang"], state["bpe"], state["symbols"])

    def index(self, pieces: Iterable[str]) -> list[int]:
        """Ids of subword pieces (`<unk>` for unknown ones) followed by `</s>`."""
        return [self.ids.get(p, UNK_ID) for p in pieces] + [EOS_ID]

    def encode_tokenized(self, lines: Sequence[str]) -> list[list[int]]:
        return [self.index(p) for p in self.bpe.segment(lines)]

    def encode(self, texts: Sequence[str], lang: str | None = None) -> list[list[int]]:
        """Raw sentences -> ids (Moses tokenizer of `lang`, default the source language)."""
        lang = lang or self.source_lang
        return self.encode_tokenized([tokenize(t, lang) for t in texts])

    def decode(self, ids: Iterable[int], unk: str = SPECIALS[UNK_ID]) -> str:
        """Ids -> tokenized sentence, stopping at `</s>`; padding and `<s>` are dropped."""
        pieces = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i in (PAD_ID, BOS_ID):
                continue
            pieces.append(unk if i == UNK_ID else self.symbols[i])
        return remove_bpe(pieces)

    def detokenize(self, text: str) -> str:
        return detokenize(text, self.target_lang)


# ---------------------------------------------------------------------------------------------
# Datasets and batching
# ---------------------------------------------------------------------------------------------
class ParallelSentences(Dataset):
    """Source and target ids stored flat (one int32 array per side plus offsets)."""

    def __init__(self, src: np.ndarray, src_offsets: np.ndarray, tgt: np.ndarray,
                 tgt_offsets: np.ndarray) -> None:  # fmt: skip
        if len(src_offsets) != len(tgt_offsets):
            raise ValueError("source and target have different numbers of sentences")
        self.src, self.src_offsets, self.tgt, self.tgt_offsets = src, src_offsets, tgt, tgt_offsets

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    def src_sizes(self) -> np.ndarray:
        return np.diff(self.src_offsets)

    def tgt_sizes(self) -> np.ndarray:
        return np.diff(self.tgt_offsets)

    def lengths(self) -> np.ndarray:
        """fairseq's `num_tokens`: the longer side."""
        return np.maximum(self.src_sizes(), self.tgt_sizes())

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = np.asarray(self.src[self.src_offsets[i] : self.src_offsets[i + 1]], dtype=np.int64)
        t = np.asarray(self.tgt[self.tgt_offsets[i] : self.tgt_offsets[i + 1]], dtype=np.int64)
        return {"source": torch.from_numpy(s), "target": torch.from_numpy(t), "index": i}


def batch_by_size(
    indices: Sequence[int] | np.ndarray,
    num_tokens: np.ndarray,
    max_tokens: int | None,
    max_sentences: int | None,
    multiple: int = 1,
) -> list[list[int]]:
    """fairseq's `data_utils.batch_by_size`: greedy batches in the order of `indices`.

    A batch is full when it holds `max_sentences` examples or one more would make
    (examples x longest) exceed `max_tokens`; a full batch is cut to a multiple of `multiple`
    and the rest starts the next one.
    """
    max_tokens = max_tokens or -1
    max_sentences = max_sentences or -1
    batches: list[list[int]] = []
    batch: list[int] = []
    lens: list[int] = []
    longest = 0
    for idx in indices:
        n = int(num_tokens[idx])
        if 0 < max_tokens < n:
            raise ValueError(
                f"example {idx} has {n} tokens, more than max_tokens={max_tokens} per batch: "
                "raise data.max_tokens or filter longer sentences"
            )
        lens.append(n)
        longest = max(longest, n)
        full = bool(batch) and (
            (max_sentences > 0 and len(batch) == max_sentences)
            or (max_tokens > 0 and (len(batch) + 1) * longest > max_tokens)
        )
        if full:
            cut = max(multiple * (len(batch) // multiple), len(batch) % multiple)
            batches.append(batch[:cut])
            batch, lens = batch[cut:], lens[cut:]
            longest = max(lens) if lens else 0
        batch.append(int(idx))
    if batch:
        batches.append(batch)
    return batches


def ordered_indices(dataset: ParallelSentences, shuffle: bool, seed: int) -> np.ndarray:
    """fairseq's `LanguagePairDataset.ordered_indices`: a seeded shuffle (training), then a
    stable sort by target length, then by source length."""
    n = len(dataset)
    indices = np.random.RandomState(seed).permutation(n) if shuffle else np.arange(n)
    indices = indices[np.argsort(dataset.tgt_sizes()[indices], kind="mergesort")]
    return indices[np.argsort(dataset.src_sizes()[indices], kind="mergesort")]


class TokenBatchSampler(Sampler[list[int]]):
    """One process's batches of a fixed set (`batch_by_size`), in a per-epoch seeded order.

    Training batches are reshuffled every epoch (`set_epoch`) and dealt round-robin to the
    processes, the list wrapped around so every process takes the same number of steps;
    evaluation batches keep their order and are dealt without repetition. `position()` (the
    batches already consumed this epoch when a run resumes) is skipped.
    """

    def __init__(
        self,
        batches: list[list[int]],
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        position: Callable[[], int] | None = None,
    ) -> None:
        self.batches, self.shuffle, self.seed = batches, shuffle, seed
        self.rank, self.world_size, self.position = rank, world_size, position
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def mine(self) -> list[list[int]]:
        order = list(range(len(self.batches)))
        if self.shuffle:
            rng = np.random.RandomState(self.seed + self.epoch)
            order = rng.permutation(len(self.batches)).tolist()
            per_rank = -(-len(order) // self.world_size)
            order += order[: per_rank * self.world_size - len(order)]
        return [self.batches[i] for i in order[self.rank :: self.world_size]]

    def __iter__(self) -> Iterator[list[int]]:
        skip = self.position() if self.position is not None else 0
        return iter(self.mine()[skip:])

    def __len__(self) -> int:
        return len(self.mine())


class TranslationCollator:
    """Pads a list of examples into a seq2seq batch.

    `inputs` (B, S) source ids (left-padded by default, as fairseq), `mask` True at real source
    ids, `targets` (B, T) target ids ending with `</s>` (right-padded), `target_mask`, and
    `index` (B,) the examples' positions in their split.
    """

    def __init__(self, pad_id: int = PAD_ID, left_pad_source: bool = True) -> None:
        self.pad_id, self.left_pad_source = pad_id, left_pad_source

    def _pad(self, seqs: list[Tensor], left: bool) -> tuple[Tensor, Tensor]:
        width = max(len(s) for s in seqs)
        out = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.bool)
        for i, s in enumerate(seqs):
            sl = slice(width - len(s), width) if left else slice(0, len(s))
            out[i, sl], mask[i, sl] = s, True
        return out, mask

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Tensor]:
        src, src_mask = self._pad([it["source"] for it in items], self.left_pad_source)
        tgt, tgt_mask = self._pad([it["target"] for it in items], False)
        index = torch.tensor([it["index"] for it in items], dtype=torch.long)
        return {"inputs": src, "mask": src_mask, "targets": tgt, "target_mask": tgt_mask,
                "index": index}  # fmt: skip


def _flat(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sequences of ids -> (one int32 array, their lengths)."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter((i for s in seqs for i in s), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


def _save_ids(cache: Path, split: str, lang: str, flat: np.ndarray, lengths: np.ndarray) -> None:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np.save(cache / f"{split}.{lang}.ids.npy", flat)
    np.save(cache / f"{split}.{lang}.offsets.npy", offsets)


# ---------------------------------------------------------------------------------------------
# DataModule
# ---------------------------------------------------------------------------------------------
class WMT16EnDeDataModule(SequenceDataModule):
    """WMT'16 En-De (newstest2013 validation, newstest2014 test) for a seq2seq task.

    Args (besides the `SequenceDataModule` ones):
        source_lang, target_lang: the direction (en, de or de, en).
        hub_config: the Hub config of both datasets ("de-en").
        bpe_merges: BPE merge operations (32,000).  vocab_size: dictionary size (33,000).
        clean_min_len, clean_max_len, clean_ratio: `clean-corpus-n` bounds (3, 150, 1.5).
        max_len: the longest sentence (tokens with `</s>`) allowed in any split (the model's
            max positions, 1024): a longer one fails early.
        max_tokens: tokens per optimizer step (source or target, whichever is longer, times
            the sentences of a batch), divided over processes and accumulation steps.
        batch_size: sentences per optimizer step at most (`--max-sentences`), likewise divided.
        eval_max_tokens, eval_batch_size: the same per evaluation batch (one process).
        batch_multiple: full batches are cut to a multiple of this (fairseq's 8).
        left_pad_source: pad sources on the left (fairseq's translation task) or the right.
        val_bleu_subset: sentences of the validation split (a seeded random subset, in the
            order of the split) that a second validation loader serves for BLEU; null: BLEU
            on the whole validation split, from the loss loader.
        max_train_pairs: use only the first N training pairs (quick experiments; null: all).
        workers: processes for the Moses tokenization (null: every CPU).
        download: fetch missing files from the Hub when online.
    """

    def __init__(
        self,
        data_dir: str | Path,
        source_lang: str = "en",
        target_lang: str = "de",
        hub_config: str = "de-en",
        bpe_merges: int = 32000,
        vocab_size: int = 33000,
        clean_min_len: int = 3,
        clean_max_len: int = 150,
        clean_ratio: float = 1.5,
        max_len: int = 1024,
        max_tokens: int = 65536,
        batch_size: int = 8192,
        eval_max_tokens: int = 8192,
        eval_batch_size: int = 1024,
        batch_multiple: int = 8,
        left_pad_source: bool = True,
        val_bleu_subset: int | None = None,
        max_train_pairs: int | None = None,
        workers: int | None = None,
        download: bool = True,
        hf_cache_dir: str | None = None,
        pad_id: int = PAD_ID,
        eos_id: int = EOS_ID,
        bos_id: int = BOS_ID,
        unk_id: int = UNK_ID,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("num_classes", None)
        kwargs.pop("d_input", None)
        super().__init__(data_dir=data_dir, max_len=max_len, batch_size=batch_size,
                         eval_batch_size=eval_batch_size, vocab_size=vocab_size, pad_id=pad_id,
                         **kwargs)  # fmt: skip
        if (pad_id, eos_id, bos_id, unk_id) != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
            raise ValueError(
                "the fairseq dictionary has <s>=0, <pad>=1, </s>=2, <unk>=3; the config says "
                f"bos_id={bos_id}, pad_id={pad_id}, eos_id={eos_id}, unk_id={unk_id}"
            )
        if {source_lang, target_lang} != set(LANGS):
            raise ValueError(
                f"WMT'16 En-De translates en->de or de->en, got {source_lang}->{target_lang}"
            )
        if vocab_size <= len(SPECIALS):
            raise ValueError(f"vocab_size={vocab_size} leaves no room beside the specials")
        self.source_lang, self.target_lang, self.hub_config = source_lang, target_lang, hub_config
        self.bpe_merges, self.clean = bpe_merges, (clean_min_len, clean_max_len, clean_ratio)
        self.max_tokens, self.eval_max_tokens = max_tokens, eval_max_tokens
        self.batch_multiple, self.left_pad_source = batch_multiple, left_pad_source
        self.val_bleu_subset, self.max_train_pairs = val_bleu_subset, max_train_pairs
        self.workers = workers if workers is not None else (os.cpu_count() or 1)
        self.download, self.hf_cache_dir = download, hf_cache_dir
        self.train_source, self.eval_source = hub_sources(self.data_dir, hub_config)
        self._pipeline: TextPipeline | None = None

    # -- preparation ------------------------------------------------------------------------
    def cache_path(self) -> Path:
        params = {
            "train": self.train_source.repo,
            "eval": self.eval_source.repo,
            "config": self.hub_config,
            "direction": [self.source_lang, self.target_lang],
            "bpe_merges": self.bpe_merges,
            "vocab_size": self.vocab_size,
            "clean": list(self.clean),
            "max_train_pairs": self.max_train_pairs,
            "sources": self.train_source.fingerprint() + self.eval_source.fingerprint(),
        }
        return cache_dir(self.cache_root, "wmt16_en_de", params, version=_CACHE_VERSION)

    def _pairs(
        self, source: HubDataset, split: str, limit: int | None = None
    ) -> dict[str, list[str]]:
        """(English, German) sentences of a split."""
        en: list[str] = []
        de: list[str] = []
        for i, row in enumerate(source.rows(split, batch_size=4096)):
            if limit is not None and i >= limit:
                break
            pair = row["translation"]
            if not isinstance(pair, dict) or any(not isinstance(pair.get(k), str) for k in LANGS):
                raise WMTFormatError(
                    f"{source.name}: row {i} of the {split} split has no English and German "
                    f"strings in its `translation` column: {pair!r}"
                )
            en.append(pair["en"])
            de.append(pair["de"])
        return {"en": en, "de": de}

    def prepare_data(self) -> None:
        for source in (self.train_source, self.eval_source):
            source.require(download=self.download, cache_dir=self.hf_cache_dir)
        cache = self.cache_path()
        if prepared(cache):
            return
        log.info("preparing WMT'16 En-De in %s (Moses, BPE, dictionary)", cache)
        train = self._pairs(self.train_source, "train", self.max_train_pairs)
        tok = {lang: moses_lines(train.pop(lang), lang, True, self.workers) for lang in LANGS}
        bpe_json = learn_bpe([*tok["en"], *tok["de"]], self.bpe_merges)
        bpe = BPE(bpe_json)
        # Two passes over chunks (the subwords of 9M sentences do not fit in memory): count the
        # subwords of the pairs that survive cleaning, then write their ids.
        lo, hi, ratio = self.clean
        keep = np.zeros(len(tok["en"]), dtype=bool)
        counts: Counter[str] = Counter()
        for start, en, de in self._chunks(bpe, tok):
            for j, (e, d) in enumerate(zip(en, de)):
                ok = lo <= len(e) <= hi and lo <= len(d) <= hi
                if ok and len(e) <= ratio * len(d) and len(d) <= ratio * len(e):
                    keep[start + j] = True
                    counts.update(e)
                    counts.update(d)
        symbols = build_dictionary(counts, int(self.spec.vocab_size or 0))
        pipeline = TextPipeline(self.source_lang, self.target_lang, bpe_json, symbols)
        parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {lang: [] for lang in LANGS}
        for start, en, de in self._chunks(bpe, tok):
            rows = [j for j in range(len(en)) if keep[start + j]]
            for lang, pieces in (("en", en), ("de", de)):
                parts[lang].append(_flat([pipeline.index(pieces[j]) for j in rows]))
        for lang in LANGS:
            flat = np.concatenate([p[0] for p in parts[lang]])
            _save_ids(cache, "train", lang, flat, np.concatenate([p[1] for p in parts[lang]]))
        sizes = {"train_raw": len(keep), "train": int(keep.sum())}
        del parts, tok
        for split in ("val", "test"):
            raw = self._pairs(self.eval_source, split)
            for lang in LANGS:
                _save_ids(cache, split, lang, *_flat(pipeline.encode(raw[lang], lang)))
                text = "".join(line.replace("\n", " ") + "\n" for line in raw[lang])
                (cache / f"{split}.raw.{lang}").write_text(text, encoding="utf-8")
            sizes[split] = len(raw["en"])
        (cache / "bpe.json").write_text(bpe_json, encoding="utf-8")
        (cache / "dict.txt").write_text(
            "".join(f"{s} {counts.get(s, 0)}\n" for s in symbols[len(SPECIALS) :]),
            encoding="utf-8",
        )
        mark_prepared(cache, {"sizes": sizes, "types": len(counts)})
        log.info("WMT'16 En-De prepared: %s; %d subword types", json.dumps(sizes), len(counts))

    @staticmethod
    def _chunks(
        bpe: BPE, tok: dict[str, list[str]], size: int = 100_000
    ) -> Iterator[tuple[int, list[list[str]], list[list[str]]]]:
        """(first index, English subwords, German subwords) of consecutive chunks."""
        for start in range(0, len(tok["en"]), size):
            yield (
                start,
                bpe.segment(tok["en"][start : start + size]),
                bpe.segment(tok["de"][start : start + size]),
            )

    # -- loading ----------------------------------------------------------------------------
    def pipeline(self) -> TextPipeline:
        """The text pipeline of the prepared data (preparing it first if needed)."""
        if self._pipeline is None:
            cache = self._ready()
            symbols = [*SPECIALS] + [
                line.rsplit(" ", 1)[0]
                for line in (cache / "dict.txt").read_text(encoding="utf-8").splitlines()
            ]
            self._pipeline = TextPipeline(
                self.source_lang,
                self.target_lang,
                (cache / "bpe.json").read_text(encoding="utf-8"),
                symbols,
            )
        return self._pipeline

    def describe(self) -> str:
        """Split sizes and the dictionary, for `megalab-data`."""
        if not self.datasets:
            self.setup()
        sizes = ", ".join(f"{s} {len(ds):,} pairs" for s, ds in self.datasets.items())  # type: ignore[arg-type]
        return f"{self.source_lang}->{self.target_lang}, {sizes}, dictionary {self.vocab_size:,}"

    def references(self, split: str) -> list[str]:
        """The raw target sentences of the validation or test split (for SacreBLEU)."""
        path = self._ready() / f"{split}.raw.{self.target_lang}"
        return path.read_text(encoding="utf-8").split("\n")[:-1]

    def tokenizer_files(self) -> dict[str, Path]:
        """The joint BPE and the dictionary of the prepared data (fairseq's dict.txt)."""
        cache = self.cache_path()
        return {"bpe.json": cache / "bpe.json", "dict.txt": cache / "dict.txt"}

    def _ready(self) -> Path:
        cache = self.cache_path()
        if not prepared(cache):
            self.prepare_data()
            cache = self.cache_path()  # fetching may have changed the sources' fingerprint
        return cache

    def build_datasets(self) -> dict[str, Dataset]:

        cache = self._ready()
        out: dict[str, Dataset] = {}
        for split in ("train", "val", "test"):
            for lang in (self.source_lang, self.target_lang):
                for name in ("ids", "offsets"):
                    check_npy(cache / f"{split}.{lang}.{name}.npy", ndim=1, cache=cache)
            arrays = {
                f"{side}{suffix}": np.load(cache / f"{split}.{lang}.{name}.npy", mmap_mode="r")
                for side, lang in (("src", self.source_lang), ("tgt", self.target_lang))
                for suffix, name in (("", "ids"), ("_offsets", "offsets"))
            }
            ds = ParallelSentences(**arrays)
            longest = int(ds.lengths().max()) if len(ds) else 0
            if longest > self.max_len:
                raise ValueError(
                    f"the {split} split has a sentence of {longest} tokens, more than "
                    f"data.max_len={self.max_len} (the model's max positions): raise both"
                )
            out[split] = ds
        return out

    def collate_fn(self, split: str = "train") -> Callable:
        return TranslationCollator(PAD_ID, self.left_pad_source)

    def _batches(self, split: str, train: bool, indices: np.ndarray | None = None) -> list:
        ds = self.datasets[split]
        assert isinstance(ds, ParallelSentences)
        if indices is None:
            indices = ordered_indices(ds, shuffle=train, seed=self.seed)
        if train:
            tokens = self.per_device_batch_size(self.max_tokens)
            sentences = self.per_device_batch_size(self.batch_size)
        else:
            tokens, sentences = self.eval_max_tokens, self.eval_batch_size or self.batch_size
        return batch_by_size(indices, ds.lengths(), tokens, sentences, self.batch_multiple)

    def _token_loader(self, split: str, train: bool, batches: list) -> DataLoader:
        rank, world = self.rank_and_world()
        sampler = TokenBatchSampler(
            batches, shuffle=train, seed=self.seed, rank=rank, world_size=world,
            position=self.resumed_batches if train else None,
        )  # fmt: skip
        return DataLoader(
            self.datasets[split],
            batch_sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            collate_fn=self.collate_fn(split),
        )

    def _eval_loader(self, split: str, indices: np.ndarray | None = None) -> DataLoader:
        if split not in self.datasets:
            self.setup()
        if indices is not None:  # a subset, still batched by length
            ds = self.datasets[split]
            assert isinstance(ds, ParallelSentences)
            indices = indices[np.argsort(ds.lengths()[indices], kind="mergesort")]
        return self._token_loader(split, False, self._batches(split, False, indices))

    def train_dataloader(self) -> DataLoader:
        if "train" not in self.datasets:
            self.setup()
        return self._token_loader("train", True, self._batches("train", True))

    def val_dataloader(self) -> Any:
        loss_loader = self._eval_loader("val")
        if self.val_bleu_subset is None:
            return loss_loader
        n = len(self.datasets["val"])  # type: ignore[arg-type]
        k = min(self.val_bleu_subset, n)
        subset = np.sort(np.random.RandomState(self.seed).permutation(n)[:k])
        return [loss_loader, self._eval_loader("val", subset)]

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
