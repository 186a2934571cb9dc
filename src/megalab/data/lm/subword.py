"""Subword streams of documents: a tokenizer trained locally (or given) and word counts.

The common part of PG-19 (`megalab.data.lm.pg19`) and a corpus of one's own
(`megalab.data.lm.corpus`): each split is the concatenation of its documents (a book, an
article, a file), each followed by `<eos>`, after a leading `<eos>`, so every token is predicted
once. Where the documents come from is the subclass's `source` (`TextSource`).

Tokenizer: by default a byte-level BPE (or a unigram model) trained locally with Hugging Face
`tokenizers` on the training split, or a seeded sample of its documents, with a configurable
vocabulary; or any `tokenizer.json` (a path, or a Hub name when online). The trained tokenizer
is cached, keyed by the data and settings.

Word-level perplexity (Megalodon Table 5; Rae et al.): exp(total NLL of a split / number of
words), words counted as whitespace-separated strings of the document text
(`len(text.split())`; the papers do not spell their count out, see docs/datasets_lm.md). The
words are attributed to tokens (a word to the token holding its first character), so the
batches' `num_words` add up to the split's word count exactly when every token is scored once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from megalab.data.cache import cache_dir, mark_prepared, may_write, prepared
from megalab.data.download import DatasetMissingError, is_offline
from megalab.data.lm.codec import TokenizerCodec
from megalab.data.lm.prepared import token_dtype, write_meta, write_split, write_tokens
from megalab.data.lm.stream import LMStreamDataModule, TokenStream, load_streams

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

TOKENIZER_MODELS = ("bpe", "unigram")
_WORD = re.compile(r"\S+")


def train_tokenizer(
    texts: Iterator[str], model: str, vocab_size: int, eos_token: str, length: int | None = None
) -> Tokenizer:
    """Train a byte-level BPE or a unigram (Metaspace) tokenizer with `eos_token` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if model == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer: trainers.Trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[eos_token],
            min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    elif model == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size,
            special_tokens=[eos_token, "<unk>"],
            unk_token="<unk>",
            show_progress=False,
        )
    else:
        raise ValueError(f"unknown tokenizer_model {model!r}; choose one of {TOKENIZER_MODELS}")
    tok.train_from_iterator(texts, trainer, length=length)
    return tok


def word_counts(text: str, ends: np.ndarray) -> np.ndarray:
    """Words starting in each token: a word goes to the first token ending after its start."""
    starts = np.fromiter((m.start() for m in _WORD.finditer(text)), dtype=np.int64)
    if not len(ends):
        if len(starts):
            raise ValueError("a non-empty text was encoded to no tokens")
        return np.zeros(0, dtype=np.int64)
    owner = np.minimum(np.searchsorted(ends, starts, side="right"), len(ends) - 1)
    return np.bincount(owner, minlength=len(ends))


class TextSource(Protocol):
    """Where the documents of each split come from: a Hub dataset's local copy
    (`megalab.data.hub.HubDataset`) or a folder of one's own files
    (`megalab.data.lm.corpus.TextFiles`)."""

    def require(self) -> None:
        """Make sure every split is there (fetched when allowed), or raise
        `DatasetMissingError` saying what to put where."""
        ...

    def fingerprint(self) -> list[list[Any]]:
        """`[path, size, mtime_ns]` of every source file (keys the prepared caches)."""
        ...

    def source_files(self) -> list[Path]:
        """Every source file, recorded with the prepared cache."""
        ...

    def num_rows(self, split: str) -> int:
        """The number of documents of `split`."""
        ...

    def texts(self, split: str, batch_size: int = 64) -> Iterator[str]:
        """The documents of `split`, in order."""
        ...


class SubwordDataModule(LMStreamDataModule):
    """Streams of subword tokens of a `source`'s documents, with word counts (see module doc).

    Subclasses set `source` in their `__init__`, and `title` (the name messages use) and
    `dataset` (the name the prepared cache records).
    """

    word_level = True
    title = "text"
    dataset = "text"
    source: TextSource

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int,
        *,
        tokenizer: str | None = None,
        tokenizer_model: str = "bpe",
        tokenizer_sample_docs: int | None = 2000,
        tokenizer_seed: int = 0,
        eos_token: str = "<eos>",
        encode_batch_docs: int = 8,
        **kwargs: Any,
    ) -> None:
        super().__init__(data_dir, max_len, **kwargs)  # vocab_size among them: the spec's
        if tokenizer is None and tokenizer_model not in TOKENIZER_MODELS:
            raise ValueError(
                f"unknown tokenizer_model {tokenizer_model!r}; choose one of {TOKENIZER_MODELS}"
            )
        self.tokenizer_name = tokenizer
        self.tokenizer_model = tokenizer_model
        self.tokenizer_sample_docs = tokenizer_sample_docs
        self.tokenizer_seed = tokenizer_seed
        self.eos_token = eos_token
        self.encode_batch_docs = encode_batch_docs
        self._tokenizer: Tokenizer | None = None

    # -- tokenizer ------------------------------------------------------------------------------
    def tokenizer_path(self) -> Path:
        """Where the trained tokenizer is cached (keyed by the training data and settings)."""
        params = {
            "source": self.source.fingerprint(),
            "model": self.tokenizer_model,
            "vocab_size": self.spec.vocab_size,
            "sample_books": self.tokenizer_sample_docs,  # the key of the caches made before
            "seed": self.tokenizer_seed,
            "eos": self.eos_token,
        }
        return cache_dir(self.cache_root, "tokenizer", params) / "tokenizer.json"

    def tokenizer_files(self) -> dict[str, Path]:
        """The given tokenizer.json, the one trained for this data (its cached file), or a Hub
        tokenizer's copy in the prepared tokens (written when they are prepared)."""
        name = self.tokenizer_name
        if name is not None and Path(name).expanduser().is_file():
            return {"tokenizer.json": Path(name).expanduser()}
        if name is not None:
            return {"tokenizer.json": self.cache() / "tokenizer.json"}
        return {"tokenizer.json": self.tokenizer_path()}

    def _sample_texts(self) -> tuple[Iterator[str], int]:
        n = self.source.num_rows("train")
        k = self.tokenizer_sample_docs
        if k is None or k >= n:
            return self.source.texts("train", 16), n
        rng = np.random.default_rng(self.tokenizer_seed)
        chosen = set(rng.choice(n, size=k, replace=False).tolist())
        texts = (t for i, t in enumerate(self.source.texts("train", 16)) if i in chosen)
        return texts, k

    def tokenizer(self) -> Tokenizer:
        """The tokenizer: a named/loaded one, or the cached locally trained one (trained now)."""
        if self._tokenizer is not None:
            return self._tokenizer
        vocab_size = self.spec.vocab_size
        assert vocab_size is not None  # a required data setting
        from tokenizers import Tokenizer

        name = self.tokenizer_name
        if name is not None:
            if Path(name).expanduser().is_file():
                tok = Tokenizer.from_file(str(Path(name).expanduser()))
            else:
                if is_offline():
                    raise DatasetMissingError(
                        f"{self.title}: the tokenizer {name!r} is neither a tokenizer.json file "
                        "nor reachable (offline mode is on): give the path of a tokenizer.json, or "
                        "set data.tokenizer=null to train one locally"
                    )
                tok = Tokenizer.from_pretrained(name)
        else:
            self.source.require()  # fetches missing splits first: the path is keyed on the files
            path = self.tokenizer_path()
            done = prepared(path.parent)
            if not done and path.exists() and may_write(path):
                # saved whole (atomically) by a version that did not mark the cache finished;
                # unmarked, evaluation (which reads only finished caches) trained it again
                mark_prepared(path.parent)
                done = True
            if done:
                tok = Tokenizer.from_file(str(path))
            else:
                texts, n = self._sample_texts()
                log.info(
                    "%s: training a %s tokenizer (vocabulary %d) on %d documents",
                    self.title,
                    self.tokenizer_model,
                    vocab_size,
                    n,
                )
                tok = train_tokenizer(
                    texts, self.tokenizer_model, vocab_size, self.eos_token, length=n
                )
                tmp = path.with_name(".tokenizer.json.tmp")
                tok.save(str(tmp))
                tmp.replace(path)
                mark_prepared(path.parent)
                # As every later run reads it: a trained unigram model serialises otherwise
                # than its saved file reads back, and the prepared tokens are keyed on that.
                tok = Tokenizer.from_file(str(path))
        size = tok.get_vocab_size()
        if size > vocab_size:
            raise ValueError(
                f"{self.title}: the tokenizer has {size:,} tokens but data.vocab_size="
                f"{vocab_size:,}; set data.vocab_size={size}"
            )
        if tok.token_to_id(self.eos_token) is None:
            raise ValueError(
                f"{self.title}: the tokenizer has no {self.eos_token!r} token: set "
                "data.eos_token to its end-of-text token"
            )
        self._tokenizer = tok
        return tok

    # -- streams --------------------------------------------------------------------------------
    def cache(self) -> Path:
        tok = self.tokenizer()
        digest = hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]
        params = {"source": self.source.fingerprint(), "tokenizer": digest, "eos": self.eos_token}
        return cache_dir(self.cache_root, "tokens", params)

    def _encode(
        self, split: str, counts: list[int], with_words: bool
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Chunks of (token ids, words per token) for `split`; counts[0] += total words."""
        tok = self.tokenizer()
        eos = tok.token_to_id(self.eos_token)
        assert eos is not None  # checked by tokenizer()
        texts = self.source.texts(split, self.encode_batch_docs)
        yield np.array([eos]), np.zeros(1, dtype=np.int64)
        while True:
            batch = [t for _, t in zip(range(self.encode_batch_docs), texts)]
            if not batch:
                return
            for text, enc in zip(batch, tok.encode_batch(batch, add_special_tokens=False)):
                ids = np.append(np.asarray(enc.ids, dtype=np.int64), eos)
                if with_words:
                    ends = np.asarray([e for _, e in enc.offsets], dtype=np.int64)
                    words = np.append(word_counts(text, ends), 0)
                    counts[0] += len(text.split())
                else:
                    words = np.zeros(0, dtype=np.int64)
                yield ids, words

    def prepare_data(self) -> None:
        self.source.require()
        cache = self.cache()
        if prepared(cache):
            return
        tok = self.tokenizer()
        assert self.spec.vocab_size is not None  # a required data setting
        dtype = token_dtype(self.spec.vocab_size)
        meta: dict = {"dataset": self.dataset, "vocab_size": tok.get_vocab_size(), "splits": {}}
        for split in ("train", "val", "test"):
            with_words = split != "train"
            total = [0]
            word_chunks: list[np.ndarray] = []

            def ids(
                split: str = split,
                total: list[int] = total,
                with_words: bool = with_words,
                word_chunks: list[np.ndarray] = word_chunks,
            ) -> Iterator[np.ndarray]:
                for chunk, words in self._encode(split, total, with_words):
                    if with_words:
                        word_chunks.append(words)
                    yield chunk

            entry = write_split(cache, split, ids(), dtype)
            if with_words:
                words = np.concatenate(word_chunks)
                if words.max(initial=0) > 255 or int(words.sum()) != total[0]:
                    raise ValueError(f"{self.title}: word attribution failed on the {split} split")
                write_tokens(cache / f"{split}.words.bin", [words], "uint8")
                entry.update(words_file=f"{split}.words.bin", words=total[0])
            meta["splits"][split] = entry
            log.info(
                "%s %s: %s tokens%s",
                self.title,
                split,
                f"{entry['tokens']:,}",
                f", {total[0]:,} words" if with_words else "",
            )
        (cache / "tokenizer.json").write_text(tok.to_str())
        write_meta(cache, meta, self.source.source_files())

    def load_streams(self) -> dict[str, TokenStream]:
        if not prepared(self.cache()):
            self.prepare_data()
        return load_streams(self.cache(), self.spec.vocab_size)

    def text_spec(self) -> dict[str, Any]:
        return {"kind": "tokenizer", "file": "tokenizer.json", "eos_token": self.eos_token}

    def text_codec(self) -> TokenizerCodec:
        """Prompts through the data's tokenizer; `<eos>` ends a document."""
        return TokenizerCodec(self.tokenizer(), self.eos_token)

    def num_words(self, split: str) -> int:
        """Whitespace-separated words of a prepared evaluation split."""
        meta = json.loads((self.cache() / "meta.json").read_text())
        return int(meta["splits"][split]["words"])
