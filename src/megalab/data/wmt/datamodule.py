"""`WMT16EnDeDataModule`: the Hub sources, the preparation (package docstring) and the loaders."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

import megalab.data.wmt.batching as batching
import megalab.data.wmt.text as text
from megalab.data.base import SequenceDataModule
from megalab.data.cache import cache_dir, check_npy, mark_prepared, prepared
from megalab.data.hub import HubDataset, HubFormatError

log = logging.getLogger(__name__)

LANGS = ("en", "de")
_CACHE_VERSION = 1


class WMTFormatError(HubFormatError):
    """A WMT file without the `translation` column or without a language of the pair."""


def hub_sources(data_dir: str | Path, config: str = "de-en") -> tuple[HubDataset, HubDataset]:
    """(training data of wmt/wmt16, newstest2013/2014 of wmt/wmt14), `config` folders."""
    data_dir = Path(data_dir)

    def source(name: str, year: str, splits: tuple[str, ...]) -> HubDataset:
        """The `config` folder of wmt/wmt<year> with `splits`, fetched by one command."""
        return HubDataset(
            name=name,
            repo=f"wmt/wmt{year}",
            config=config,
            local_dir=data_dir / f"wmt{year}" / config,
            columns=("translation",),
            splits=splits,
            fetch_dir=".",
            command=f"megalab-data wmt16 --root {data_dir.parent}",
            load_per_split=True,
            format_error=WMTFormatError,
        )

    return (
        source("WMT'16 English-German (training)", "16", ("train",)),
        source(
            "WMT'14 English-German (newstest2013 validation, newstest2014 test)",
            "14",
            ("val", "test"),
        ),
    )


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
        pad_id: int = text.PAD_ID,
        eos_id: int = text.EOS_ID,
        bos_id: int = text.BOS_ID,
        unk_id: int = text.UNK_ID,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("num_classes", None)
        kwargs.pop("d_input", None)
        super().__init__(data_dir=data_dir, max_len=max_len, batch_size=batch_size,
                         eval_batch_size=eval_batch_size, vocab_size=vocab_size, pad_id=pad_id,
                         **kwargs)  # fmt: skip
        if (pad_id, eos_id, bos_id, unk_id) != (text.PAD_ID, text.EOS_ID, text.BOS_ID, text.UNK_ID):
            raise ValueError(
                "the fairseq dictionary has <s>=0, <pad>=1, </s>=2, <unk>=3; the config says "
                f"bos_id={bos_id}, pad_id={pad_id}, eos_id={eos_id}, unk_id={unk_id}"
            )
        if {source_lang, target_lang} != set(LANGS):
            raise ValueError(
                f"WMT'16 En-De translates en->de or de->en, got {source_lang}->{target_lang}"
            )
        if vocab_size <= len(text.SPECIALS):
            raise ValueError(f"vocab_size={vocab_size} leaves no room beside the specials")
        self.source_lang, self.target_lang, self.hub_config = source_lang, target_lang, hub_config
        self.bpe_merges, self.clean = bpe_merges, (clean_min_len, clean_max_len, clean_ratio)
        self.max_tokens, self.eval_max_tokens = max_tokens, eval_max_tokens
        self.batch_multiple, self.left_pad_source = batch_multiple, left_pad_source
        self.val_bleu_subset, self.max_train_pairs = val_bleu_subset, max_train_pairs
        self.workers = workers if workers is not None else (os.cpu_count() or 1)
        self.download, self.hf_cache_dir = download, hf_cache_dir
        self.train_source, self.eval_source = hub_sources(self.data_dir, hub_config)
        self._pipeline: text.TextPipeline | None = None

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
        tok = {lang: text.moses_lines(train.pop(lang), lang, True, self.workers) for lang in LANGS}
        bpe_json = text.learn_bpe([*tok["en"], *tok["de"]], self.bpe_merges)
        bpe = text.BPE(bpe_json)
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
        symbols = text.build_dictionary(counts, int(self.spec.vocab_size or 0))
        pipeline = text.TextPipeline(self.source_lang, self.target_lang, bpe_json, symbols)
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
                lines = "".join(line.replace("\n", " ") + "\n" for line in raw[lang])
                (cache / f"{split}.raw.{lang}").write_text(lines, encoding="utf-8")
            sizes[split] = len(raw["en"])
        (cache / "bpe.json").write_text(bpe_json, encoding="utf-8")
        (cache / "dict.txt").write_text(
            "".join(f"{s} {counts.get(s, 0)}\n" for s in symbols[len(text.SPECIALS) :]),
            encoding="utf-8",
        )
        mark_prepared(cache, {"sizes": sizes, "types": len(counts)})
        log.info("WMT'16 En-De prepared: %s; %d subword types", json.dumps(sizes), len(counts))

    @staticmethod
    def _chunks(
        bpe: text.BPE, tok: dict[str, list[str]], size: int = 100_000
    ) -> Iterator[tuple[int, list[list[str]], list[list[str]]]]:
        """(first index, English subwords, German subwords) of consecutive chunks."""
        for start in range(0, len(tok["en"]), size):
            yield (
                start,
                bpe.segment(tok["en"][start : start + size]),
                bpe.segment(tok["de"][start : start + size]),
            )

    # -- loading ----------------------------------------------------------------------------
    def pipeline(self) -> text.TextPipeline:
        """The text pipeline of the prepared data (preparing it first if needed)."""
        if self._pipeline is None:
            cache = self._ready()
            symbols = [*text.SPECIALS] + [
                line.rsplit(" ", 1)[0]
                for line in (cache / "dict.txt").read_text(encoding="utf-8").splitlines()
            ]
            self._pipeline = text.TextPipeline(
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
            ds = batching.ParallelSentences(**arrays)
            longest = int(ds.lengths().max()) if len(ds) else 0
            if longest > self.max_len:
                raise ValueError(
                    f"the {split} split has a sentence of {longest} tokens, more than "
                    f"data.max_len={self.max_len} (the model's max positions): raise both"
                )
            out[split] = ds
        return out

    def collate_fn(self, split: str = "train") -> Callable:
        return batching.TranslationCollator(text.PAD_ID, self.left_pad_source)

    def _batches(self, split: str, train: bool, indices: np.ndarray | None = None) -> list:
        ds = self.datasets[split]
        assert isinstance(ds, batching.ParallelSentences)
        if indices is None:
            indices = batching.ordered_indices(ds, shuffle=train, seed=self.seed)
        if train:
            tokens = self.per_device_batch_size(self.max_tokens)
            sentences = self.per_device_batch_size(self.batch_size)
        else:
            tokens, sentences = self.eval_max_tokens, self.eval_batch_size or self.batch_size
        return batching.batch_by_size(indices, ds.lengths(), tokens, sentences, self.batch_multiple)

    def _token_loader(self, split: str, train: bool, batches: list) -> DataLoader:
        rank, world = self.rank_and_world()
        sampler = batching.TokenBatchSampler(
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
            assert isinstance(ds, batching.ParallelSentences)
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
