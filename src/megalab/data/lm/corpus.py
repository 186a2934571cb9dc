"""A text corpus of one's own: local files of each split, in subword streams like PG-19.

The folder `data_dir` holds the corpus as

- `.txt` files, one document each (a book, an article; UTF-8);
- `.jsonl` files, one document per line, the text in the field `text_column`;
- `.parquet` files, one document per row, the text in the column `text_column`;

each of a split by its name, as on the Hugging Face Hub: a folder named after the split on its
path (`train/`, `validation/` or `valid/`, `test/`) or a `-`/`_`/`.`-separated part of its file
name (`train.txt`, `valid-00001.jsonl`, `test.parquet`). Files are read in the order of their
paths; hidden files and the `prepared/` cache are not part of the corpus.

Each split is then what PG-19's is (`megalab.data.lm.subword`): its documents, each followed by
`<eos>`, tokenized by a BPE or unigram tokenizer trained on the training split (or a given
`tokenizer.json`), with word counts for word-level perplexity. The prepared tokens are keyed
on the files' names, sizes and modification times, so an edited corpus is prepared again.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalab.data.download import DatasetMissingError
from megalab.data.hub import HUB_SPLIT_NAMES, belongs_to_split, file_fingerprint, is_source_file
from megalab.data.lm.subword import SubwordDataModule
from megalab.utils.errors import UserError

__all__ = ["FORMATS", "CorpusFormatError", "TextCorpusDataModule", "TextFiles"]

#: The file endings a corpus is read from: what one document is in each.
FORMATS = {
    ".txt": "a document per file",
    ".jsonl": "a document per line",
    ".parquet": "a document per row",
}
SPLITS = ("train", "val", "test")


class CorpusFormatError(UserError, ValueError):
    """A corpus file that cannot be read as text; the message names the file (and line)."""


@dataclass(frozen=True)
class TextFiles:
    """The documents of a corpus folder, split by file and folder names (see module doc)."""

    local_dir: Path
    text_column: str = "text"
    name: str = "text corpus"

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_dir", Path(self.local_dir).expanduser().absolute())

    def _by_split(self) -> dict[str, list[Path]]:
        """The files of each split, sorted by path (the folder walked once)."""
        if not self.local_dir.is_dir():
            return {split: [] for split in SPLITS}
        rels = sorted(
            f.relative_to(self.local_dir)
            for f in self.local_dir.rglob("*")
            if f.suffix in FORMATS and f.is_file()
        )
        rels = [r for r in rels if is_source_file(r)]
        return {
            split: [self.local_dir / r for r in rels if belongs_to_split(r, HUB_SPLIT_NAMES[split])]
            for split in SPLITS
        }

    def files(self, split: str) -> list[Path]:
        """The files of `split`, sorted by path."""
        return self._by_split()[split]

    def require(self) -> None:
        """Raise `DatasetMissingError` when a split has no file, and `CorpusFormatError` when a
        file is of two splits (`train/test_notes.txt`) or its format is not the one its ending
        says (a .jsonl line without the text field, a parquet file without the text column)."""
        found = self._by_split()
        for i, split in enumerate(SPLITS):
            for other in SPLITS[i + 1 :]:
                both = sorted(set(found[split]) & set(found[other]))
                if both:
                    raise CorpusFormatError(
                        f"{self.name}: {both[0]} is of both the {_split_word(split)} and the "
                        f"{_split_word(other)} split (by its folder or file name): rename it "
                        "so that only one split's name is part of its path"
                    )
        absent = [s for s in SPLITS if not found[s]]
        if not absent:
            # Each file's format before hours of tokenization, not when its split's turn comes:
            # a parquet file's columns, a .jsonl file's first document.
            for path in (f for split in SPLITS for f in found[split]):
                if path.suffix == ".jsonl":
                    with contextlib.closing(self._read_jsonl(path)) as documents:
                        next(documents, None)
                elif path.suffix == ".parquet":
                    self._text_column(path)
            return
        if self.local_dir.is_dir():
            counts = ", ".join(f"{_split_word(s)}: {len(found[s])}" for s in SPLITS)
            where = f"below {self.local_dir} (files found per split: {counts})"
        else:
            where = f"at {self.local_dir}: there is no such folder"
        kinds = "; ".join(f"{ending} ({what})" for ending, what in FORMATS.items())
        words = [_split_word(s) for s in absent]
        names = " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)
        raise DatasetMissingError(
            f"{self.name}: no file of the {names} split{'s' if len(absent) > 1 else ''} "
            f"{where}.\nPut each split's documents there as {kinds}; the text of "
            f".jsonl and .parquet documents is in the field {self.text_column!r} "
            "(data.text_column). A file is of a split when the split's name is a folder on its "
            "path or a part of its file name: train/, validation/ or valid/, test/; "
            "train.txt, valid.jsonl, test-00001.parquet. Or point data.data_dir at the folder "
            "that holds them."
        )

    def source_files(self) -> list[Path]:
        found = self._by_split()
        return [f for split in SPLITS for f in found[split]]

    def fingerprint(self) -> list[list[Any]]:
        """`[path, size, mtime_ns]` of every file (paths relative to the folder)."""
        return file_fingerprint(self.source_files(), self.local_dir)

    def num_rows(self, split: str) -> int:
        """The number of documents of `split` (without reading their text)."""
        import pyarrow.parquet as pq

        count = 0
        for path in self.files(split):
            if path.suffix == ".txt":
                count += 1
            elif path.suffix == ".jsonl":
                with path.open("rb") as f:
                    count += sum(1 for line in f if line.strip())
            else:
                count += pq.ParquetFile(path).metadata.num_rows
        return count

    def texts(self, split: str, batch_size: int = 64) -> Iterator[str]:
        """The documents of `split`, file after file (`batch_size`: rows read at a time from a
        parquet file)."""
        for path in self.files(split):
            if path.suffix == ".txt":
                yield self._read_txt(path)
            elif path.suffix == ".jsonl":
                yield from self._read_jsonl(path)
            else:
                yield from self._read_parquet(path, batch_size)

    def _read_txt(self, path: Path) -> str:
        data = path.read_bytes()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorpusFormatError(
                f"{self.name}: {path} is not UTF-8 text (byte {e.start} is "
                f"{data[e.start : e.start + 1]!r}): convert it to UTF-8"
            ) from None

    def _read_jsonl(self, path: Path) -> Generator[str, None, None]:
        with path.open("rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"{self.name}: {path}, line {number}"
                try:
                    record = json.loads(raw)
                except ValueError as e:
                    raise CorpusFormatError(f"{where}: not a JSON object ({e})") from None
                if not isinstance(record, dict) or self.text_column not in record:
                    fields = list(record) if isinstance(record, dict) else type(record).__name__
                    raise CorpusFormatError(
                        f"{where}: no field {self.text_column!r} (it has {fields}); set "
                        "data.text_column to the field that holds the text"
                    )
                text = record[self.text_column]
                if not isinstance(text, str):
                    raise CorpusFormatError(
                        f"{where}: the field {self.text_column!r} holds "
                        f"{type(text).__name__}, not text"
                    )
                yield text

    def _text_column(self, path: Path) -> None:
        """Check that a parquet file has the text column, of strings."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path)
        except Exception as e:
            raise CorpusFormatError(f"{self.name}: cannot read {path} as parquet ({e})") from None
        if self.text_column not in schema.names:
            raise CorpusFormatError(
                f"{self.name}: {path} has no column {self.text_column!r} (it has "
                f"{schema.names}); set data.text_column to the column that holds the text"
            )
        kind = schema.field(self.text_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise CorpusFormatError(
                f"{self.name}: {path}: the column {self.text_column!r} holds {kind}, not text"
            )

    def _read_parquet(self, path: Path, batch_size: int) -> Iterator[str]:
        import pyarrow.parquet as pq

        self._text_column(path)
        for batch in pq.ParquetFile(path).iter_batches(batch_size, columns=[self.text_column]):
            for text in batch.column(0).to_pylist():
                yield "" if text is None else text


def _split_word(split: str) -> str:
    return HUB_SPLIT_NAMES[split][0]


class TextCorpusDataModule(SubwordDataModule):
    """Subword streams of one's own text corpus with word counts (see module doc).

    Args:
        data_dir: the corpus folder (its `prepared/` holds the caches, unless `cache_root`).
        text_column: the field (.jsonl) or column (.parquet) holding each document's text.
        name: what messages and logs call the corpus.
        kwargs: the tokenizer and stream settings of `SubwordDataModule` and
            `LMStreamDataModule` (`vocab_size`, `tokenizer`, `tokenizer_model`, `max_len`, ...).
    """

    dataset = "text_corpus"

    def __init__(
        self,
        data_dir: str | Path,
        max_len: int,
        text_column: str = "text",
        name: str = "text corpus",
        **kwargs: Any,
    ) -> None:
        super().__init__(data_dir, max_len, **kwargs)
        self.title = name
        self.source = TextFiles(self.data_dir, text_column, name)
