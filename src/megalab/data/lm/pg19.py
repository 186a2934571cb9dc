"""PG-19 (Rae et al. 2020): books from Project Gutenberg published before 1919, subword level.

Source: the Hub dataset `deepmind/pg19` (columns `short_book_title`, `publication_date`, `url`,
`text`; 28,602 / 50 / 100 books), from local Hub-style parquet shards below the data folder,
fetched there from the Hub when missing (`megalab.data.hub`). Each split is the concatenation
of its books (Hub order), each followed by `<eos>`, after a leading `<eos>`, so every token is
predicted once (`megalab.data.lm.subword`).

Tokenizer: a byte-level BPE (or a unigram model) trained locally on a seeded sample of the
training books, with a 32K vocabulary by default, the size of the Block-Recurrent Transformer's
SentencePiece vocabulary that Megalodon uses (that exact vocabulary is not public on the Hub);
or any `tokenizer.json`. Word-level perplexity as Megalodon Table 5 reports it
(`megalab.data.lm.subword`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megalab.data.hub import HubDataset
from megalab.data.lm.subword import (
    TOKENIZER_MODELS,
    SubwordDataModule,
    train_tokenizer,
    word_counts,
)

__all__ = ["TOKENIZER_MODELS", "PG19DataModule", "train_tokenizer", "word_counts"]


class PG19DataModule(SubwordDataModule):
    """PG-19 subword streams with word counts for word-level perplexity (see module doc)."""

    title = "PG-19"
    dataset = "pg19"

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int,
        vocab_size: int = 32_000,
        hub_name: str = "deepmind/pg19",
        hub_config: str | None = None,
        hub_revision: str | None = None,
        text_column: str = "text",
        tokenizer_sample_books: int | None = 2000,
        encode_batch_books: int = 8,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            data_dir,
            max_len,
            vocab_size=vocab_size,
            tokenizer_sample_docs=tokenizer_sample_books,
            encode_batch_docs=encode_batch_books,
            **kwargs,
        )
        self.source = HubDataset(
            name="PG-19",
            repo=hub_name,
            local_dir=self.data_dir,
            columns=(text_column,),
            config=hub_config,
            revision=hub_revision,
            command=f"megalab-data pg19 --root {self.data_dir.parent}",
            load_per_split=True,
        )
