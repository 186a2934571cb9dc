"""WikiText-103 (Merity et al. 2017) at the word level, as Transformer-XL and Mega use it.

Source: the Hub dataset `Salesforce/wikitext`, config `wikitext-103-v1` (the tokenised
`wiki.{train,valid,test}.tokens` files, one row per line), read from local Hub-style parquet
copies (`<data_dir>/wikitext-103-v1/{train,validation,test}-*.parquet`, column `text`), fetched
there from the Hub when missing (`megalab.data.hub`). Preparation follows Transformer-XL's
`data_utils.py`:

- every line (blank ones too) is split on whitespace and gets `<eos>` appended; a split is the
  concatenation of its lines (103,227,021 / 217,646 / 245,569 tokens);
- the vocabulary is built from the training split only: `<eos>` first, then every other type by
  decreasing count (ties in order of first occurrence), no minimum count, case kept; `<unk>`
  is an ordinary word of the corpus. On the full data this gives 267,735 types (fairseq's
  dictionary of the same data has 267,744 entries: its 4 specials, `<unk>` merged with its own,
  padded to a multiple of 8); the count is checked when the full training split is used.
- a word of the validation/test splits missing from the vocabulary is an error (WikiText-103
  has none).

Each split stream starts with `<eos>` (as fairseq feeds the first block), so every token of the
split is predicted once. Tokens are words, so the perplexity is word-level; `num_words` counts
every scored token (`<eos>` included), the convention of all WikiText-103 results.
"""

from __future__ import annotations

import json
import logging
from array import array
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megalab.data.cache import cache_dir, prepared
from megalab.data.hub import HubDataset
from megalab.data.lm.codec import WordCodec
from megalab.data.lm.prepared import token_dtype, write_meta, write_split
from megalab.data.lm.stream import LMStreamDataModule, TokenStream, load_streams

log = logging.getLogger(__name__)

EOS = "<eos>"
#: Transformer-XL's counts on the full data (LaMemo paper Table 4, XL `data_utils.py`).
KNOWN_TRAIN_TOKENS = 103_227_021
KNOWN_VOCAB_SIZE = 267_735


def build_vocab(lines: Iterator[str]) -> tuple[list[str], int]:
    """Transformer-XL's vocabulary of the training lines, and the number of tokens (with eos)."""
    counter: Counter[str] = Counter()
    n_lines = 0
    for line in lines:
        counter.update(line.split())
        n_lines += 1
    if not counter:
        raise ValueError("WikiText-103: the training split has no words")
    vocab = [EOS]
    vocab += [w for w, _ in counter.most_common() if w != EOS]
    return vocab, sum(counter.values()) + n_lines


def encode_lines(
    lines: Iterator[str], index: dict[str, int], split: str, chunk_lines: int = 100_000
) -> Iterator[np.ndarray]:
    """Token ids of `<eos>` followed by every line's words and `<eos>`, in chunks."""
    eos = index[EOS]
    buf = array("l", [eos])
    missing: Counter[str] = Counter()
    for n, line in enumerate(lines, 1):
        for w in line.split():
            i = index.get(w)
            if i is None:
                missing[w] += 1
            else:
                buf.append(i)
        buf.append(eos)
        if n % chunk_lines == 0:
            yield np.array(buf, dtype=np.int64)
            buf = array("l")
    if missing:
        examples = ", ".join(repr(w) for w, _ in missing.most_common(5))
        raise ValueError(
            f"WikiText-103: {sum(missing.values())} word(s) of the {split} split are not in the "
            f"training vocabulary (e.g. {examples}); the files are not WikiText-103's (whose "
            "validation and test words all occur in training)"
        )
    if buf:
        yield np.array(buf, dtype=np.int64)


class WikiText103DataModule(LMStreamDataModule):
    """WikiText-103 word-level streams (see the module doc for the protocol)."""

    word_level = True

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int,
        vocab_size: int = KNOWN_VOCAB_SIZE,
        hub_name: str = "Salesforce/wikitext",
        hub_config: str = "wikitext-103-v1",
        hub_revision: str | None = None,
        text_column: str = "text",
        known_vocab_size: int | None = KNOWN_VOCAB_SIZE,
        known_train_tokens: int | None = KNOWN_TRAIN_TOKENS,
        **kwargs: Any,
    ) -> None:
        super().__init__(data_dir, max_len, vocab_size=vocab_size, **kwargs)
        self.source = HubDataset(
            name="WikiText-103",
            repo=hub_name,
            local_dir=self.data_dir / hub_config,
            columns=(text_column,),
            config=hub_config,
            revision=hub_revision,
            fetch_dir=".",
            command=f"megalab-data wikitext103 --root {self.data_dir.parent}",
            load_per_split=True,
        )
        self.known_vocab_size, self.known_train_tokens = known_vocab_size, known_train_tokens

    def cache(self) -> Path:
        return cache_dir(self.cache_root, "tokens", {"source": self.source.fingerprint()})

    def tokenizer_files(self) -> dict[str, Path]:
        """The prepared vocabulary, one word per line (id = line number)."""
        return {"vocab.txt": self.cache() / "vocab.txt"}

    def vocabulary(self) -> list[str]:
        """The prepared vocabulary (id = position)."""
        return (self.cache() / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]

    def text_spec(self) -> dict[str, Any]:
        return {"kind": "words", "file": "vocab.txt", "eos": EOS, "unk": "<unk>"}

    def text_codec(self) -> WordCodec:
        """Prompts as words of the training vocabulary, `<eos>` per line break."""
        if not prepared(self.cache()):
            self.prepare_data()
        return WordCodec(self.vocabulary(), eos=EOS)

    def prepare_data(self) -> None:
        self.source.require()  # fetches missing splits first: the cache is keyed on the files
        cache = self.cache()
        if prepared(cache):
            return
        log.info("WikiText-103: building the vocabulary from the training split")
        vocab, train_tokens = build_vocab(self.source.texts("train", 4096))
        if (
            self.known_train_tokens is not None
            and self.known_vocab_size is not None
            and train_tokens == self.known_train_tokens
            and len(vocab) != self.known_vocab_size
        ):
            raise ValueError(
                f"WikiText-103: the full training split gives {len(vocab):,} types, not the "
                f"known {self.known_vocab_size:,} (Transformer-XL): the files differ from the "
                "official ones"
            )
        (cache / "vocab.txt").write_text("".join(w + "\n" for w in vocab), encoding="utf-8")
        index = {w: i for i, w in enumerate(vocab)}
        dtype = token_dtype(len(vocab))
        meta: dict = {
            "dataset": "wikitext103",
            "vocab_size": len(vocab),
            "splits": {},
            "train_tokens_with_eos": train_tokens,
        }
        for split in ("train", "val", "test"):
            chunks = encode_lines(self.source.texts(split, 4096), index, split)
            entry = write_split(cache, split, chunks, dtype, words_per_token=True)
            meta["splits"][split] = entry
            log.info(
                "WikiText-103 %s: %s tokens (with the leading <eos>)", split, f"{entry['tokens']:,}"
            )
        write_meta(cache, meta, self.source.source_files())

    def load_streams(self) -> dict[str, TokenStream]:
        if not prepared(self.cache()):
            self.prepare_data()
        cache = self.cache()
        meta = json.loads((cache / "meta.json").read_text())
        if meta["vocab_size"] != self.spec.vocab_size:
            raise ValueError(
                f"WikiText-103: the prepared vocabulary has {meta['vocab_size']:,} types but "
                f"data.vocab_size={self.spec.vocab_size:,}; set data.vocab_size="
                f"{meta['vocab_size']} (the model's embedding and softmax are sized by it)"
            )
        return load_streams(cache, self.spec.vocab_size)
